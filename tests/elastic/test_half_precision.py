"""bfloat16 through the optimizer state on disk, through the public API only: a bf16 model
with AdamW kept on disk trains bit for bit as with the state in memory, across commits, a
restore and a checkpoint read back (one process)."""
import pytest
import torch
import torch.nn.functional as F

import hvd_adapt
from hvd_adapt import DistributedOptimizer, State


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def job(swap_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).to(torch.bfloat16)
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                               swap_dir=swap_dir)
    return model, opt, State(model=model, optimizer=opt)


def train(model, opt, state, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen).to(torch.bfloat16)
        y = torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x).float(), y).backward()
        opt.step()
        state.commit()


def bits(model, opt):
    state = opt.state_dict()["state"]
    return ([p.view(torch.int16).tolist() for p in model.parameters()],
            {i: {k: v.view(torch.int16).tolist() if v.dtype == torch.bfloat16 else v.tolist()
                 for k, v in per.items()} for i, per in state.items()})


def test_bfloat16_state_on_disk_trains_restores_and_checkpoints_bit_for_bit(tmp_path):
    on_disk, in_memory = job(str(tmp_path / "swap")), job(None)
    for model, opt, state in (on_disk, in_memory):
        train(model, opt, state, 3, seed=1)
    assert bits(*on_disk[:2]) == bits(*in_memory[:2])
    assert {v.dtype for per in on_disk[1].state_dict()["state"].values()
            for v in per.values()} >= {torch.bfloat16}
    committed = bits(*on_disk[:2])
    on_disk[2].save_checkpoint(str(tmp_path / "c.pt"))
    on_disk[2].wait_for_checkpoint()
    # A step not committed, then a restore: the commit again.
    model, opt, state = on_disk
    F.cross_entropy(model(torch.ones(2, 16, dtype=torch.bfloat16)).float(),
                    torch.tensor([0, 1])).backward()
    opt.step()
    state.restore()
    assert bits(model, opt) == committed
    # A fresh job with its state on disk reads the checkpoint back.
    fresh = job(str(tmp_path / "swap2"))
    assert fresh[2].load_checkpoint(str(tmp_path / "c.pt"))
    assert bits(*fresh[:2]) == committed
