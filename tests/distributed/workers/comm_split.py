"""``mpirun -np 4``: two independent 2-rank hvd_adapt jobs on halves of COMM_WORLD.

Each half trains one epoch of its own dataset; what every rank trained on is
gathered through mpi4py's COMM_WORLD, not through Horovod, as the oracle.
"""
import torch
from mpi4py import MPI
from torch.utils.data import Dataset

import hvd_adapt
from hvd_adapt._runtime import collective
from _report import report


class Indices(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


world = MPI.COMM_WORLD
half = world.rank // 2
hvd_adapt.init(comm=world.Split(color=half, key=world.rank))
samples = 30 + 10 * half  # the halves train on datasets of different sizes
loader = hvd_adapt.AdaptiveDataLoader(Indices(samples), batch_size=4, shuffle=True, seed=half)
model = torch.nn.Linear(1, 1)
opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
state = hvd_adapt.State(model=model, optimizer=opt, loader=loader)
trained = []


@hvd_adapt.run
def train(state):
    for batch in loader:
        real = batch[:len(batch) - loader.num_padded]
        trained.extend(real.tolist())
        opt.zero_grad()
        model(batch.float().unsqueeze(1)).sum().backward()
        opt.step()
        state.commit()


train(state)
everyone = world.allgather({"half": half, "trained": trained, "samples": samples,
                            "hvd_rank": hvd_adapt.env.rank(), "hvd_size": hvd_adapt.env.size(),
                            "sum_of_world_ranks": collective.allreduce(world.rank),
                            "weight": model.weight.item()})
report({"world_rank": world.rank, "everyone": everyone}, world.rank)
