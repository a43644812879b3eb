"""Two replicas training a linear model with an unused parameter, with or without
gradient accumulation (``--micro N``: N micro-batches per optimizer step at the same
global batch). Reports the final weights: accumulation must change nothing."""
import argparse
import functools

import torch

import hvd_adapt
from _report import run_cases


class WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.unused = torch.nn.Parameter(torch.ones(3))  # never gets a gradient

    def forward(self, x):
        return self.linear(x)


parser = argparse.ArgumentParser()
parser.add_argument("--cases", nargs="+", default=["1"],
                    help="MICRO or MICRO+noise: micro-batches per optimizer step, and whether "
                         "the noise scale is measured; one job trains each afresh")
args = parser.parse_args()


def train_case(micro, measure_noise):
    torch.manual_seed(0)
    model = WithUnused()
    opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         measure_noise=measure_noise)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 4, generator=gen)
    data = torch.utils.data.TensorDataset(x, x @ torch.arange(1.0, 5.0).unsqueeze(1))
    loader = hvd_adapt.AdaptiveDataLoader(data, batch_size=32, shuffle=True)
    if micro > 1:
        local = 32 // 2 // micro
        loader.autoscale_batch_size(32, local_bsz_bounds=(local, local),
                                    gradient_accumulation=True, decide_every=10 ** 6)
    state = hvd_adapt.State(model=model, optimizer=opt, loader=loader)

    @hvd_adapt.run
    def train(state):
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            state.commit()

    train(state)
    return {"weights": model.linear.weight.detach().flatten().tolist(),
            "bias": model.linear.bias.item(), "unused": model.unused.detach().tolist(),
            "accum": loader.accumulation_steps}


# One job for every case (a job's start-up costs more than its training).
hvd_adapt.init()
run_cases({case: functools.partial(train_case, int(case.split("+")[0]), case.endswith("+noise"))
           for case in args.cases}, hvd_adapt.env.rank())
