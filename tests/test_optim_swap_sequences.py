"""Random sequences of what loops do with the optimizer state on disk
(steps, steps failed part-way and retried, commits, restores, state dicts handed out,
load_state_dict round trips, parameters changed between backward and step through
torch.no_grad() and through p.data), with waits that let the undo copies be written ahead
or not, each against the same sequence with the state in memory, compared after every
operation. 150 seeds held at the time of writing; the test runs a few."""
import random
import tempfile
import time

import pytest
import torch

import hvd_adapt
from hvd_adapt import DistributedOptimizer, State
from test_optim_swap import deep


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()

OPERATIONS = ["step", "step", "step", "fail", "commit", "restore", "state_dict", "load",
              "no_grad_edit", "data_edit"]


def raiser():
    raise RuntimeError("injected")


def build(where):
    torch.manual_seed(0)
    model, inner = deep()
    inner.after = {}
    opt = DistributedOptimizer(inner, swap_dir=where,
                               swap_buffer_mb=36 / 1024 if where else None)
    return model, opt, State(model=model, optimizer=opt)


def difference(a, b):
    (model_a, opt_a, _), (model_b, opt_b, _) = a, b
    if not all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters())):
        return "parameters"
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    if sorted(sa) != sorted(sb):
        return "state keys"
    for i in sb:
        for key in sb[i]:
            if not torch.equal(torch.as_tensor(sa[i][key]), torch.as_tensor(sb[i][key])):
                return f"state {i}.{key}"
    return None


def run(seed, swap_root, n=40):
    """None, or (seed, the operations so far, what differs)."""
    rng = random.Random(seed)
    swapped, memory = build(tempfile.mkdtemp(dir=swap_root)), build(None)
    both = (swapped, memory)
    ops = []
    for t in range(n):
        op = rng.choice(OPERATIONS)
        ops.append(op)
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed * 1000 + t))
        if op in ("step", "fail", "no_grad_edit", "data_edit"):
            for model, opt, _ in both:
                opt.zero_grad()
                model(x).pow(2).mean().backward()
            if rng.random() < 0.5:
                time.sleep(0.02)        # the undo copies written ahead, or some of them
            for model, _, _ in both:
                if op == "no_grad_edit":
                    with torch.no_grad():
                        next(model.parameters()).mul_(0.5)
                elif op == "data_edit":
                    list(model.parameters())[3].data.add_(0.25)
            if op == "fail":
                before = [p.detach().clone() for p in swapped[0].parameters()]
                swapped[1].optimizer.calls = 0
                swapped[1].optimizer.after = {rng.randrange(4): raiser}
                with pytest.raises(RuntimeError, match="injected"):
                    swapped[1].step()
                swapped[1].optimizer.after = {}
                if not all(torch.equal(p, q) for p, q in zip(swapped[0].parameters(), before)):
                    return seed, ops, "a failed step was not undone"
                if rng.random() < 0.5:
                    ops.append("retry")
                    for _, opt, _ in both:
                        opt.step()
            else:
                for _, opt, _ in both:
                    opt.step()
        elif op == "commit":
            for _, _, state in both:
                state.commit()
        elif op == "restore":
            for _, _, state in both:
                state.restore()
        elif op == "state_dict":
            swapped[1].state_dict()     # handed out: its file is never the spare
        elif op == "load":
            for _, opt, _ in both:
                opt.load_state_dict(opt.state_dict())
        found = difference(swapped, memory)
        if found:
            return seed, ops, found
    return None


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_stay_as_in_memory(seed, tmp_path):
    assert run(seed, str(tmp_path)) is None
