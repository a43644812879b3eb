"""Two ranks with the optimizer state on disk; rank 1's swap folder is removed (rm -rf by a
/tmp cleaner) between two steps. The folder is the job's own (issue 43): every rank must fail
the next step alike, with the same errno (no rank hangs, nothing moved), rank 1's state dict
must say its folder was removed, and after a restore the next step must fail alike again:
the job goes on from a checkpoint, with a swap_dir that is there. Reports what each rank saw."""
import hashlib
import os
import shutil
import sys

import torch

import hvd_adapt
from _report import report
from _swap_model import build

hvd_adapt.init()
rank = hvd_adapt.env.rank()
swap_dir = os.path.join(sys.argv[1], f"rank{rank}")
model, opt = build(swap_dir)
reference, ref_opt = build(None)
# One State carries both (the State checks it carries every DistributedOptimizer made).
state = hvd_adapt.State(model=model, optimizer=opt, reference=reference, ref_opt=ref_opt)
state.sync()


def digest(m, o):
    h = hashlib.sha256()
    saved = o.state_dict()["state"]
    for t in list(m.parameters()) + [v for i in sorted(saved)
                                     for _, v in sorted(saved[i].items())]:
        h.update(torch.as_tensor(t).detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def params_digest(m):
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.parameters())) \
        .hexdigest()


def step(m, o, seed):
    o.zero_grad()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * rank + seed))
    m(x).pow(2).mean().backward()
    o.step()


def attempt(what, action):
    try:
        action()
        return None
    except Exception as e:      # noqa: BLE001 (reported)
        return f"{what}: {type(e).__name__}: {e}"


seen = {}
for seed in range(2):
    step(model, opt, seed)
    step(reference, ref_opt, seed)
state.commit()
step(model, opt, 2)
step(reference, ref_opt, 2)
before = digest(model, opt)
before_params = params_digest(model)
seen["before_as_reference"] = before == digest(reference, ref_opt)
if rank == 1:
    shutil.rmtree(swap_dir)
if sys.argv[2:] == ["sync"]:
    # A sync (as at an elastic reset, a host added): a collective that writes a new
    # file on every rank but the root. Each rank says what it saw, then both meet once more.
    seen["sync_error"] = attempt("sync", state.sync)
    # Then what a loop does next: a step (its agreement is a collective on both ranks).
    seen["step_after_sync_error"] = attempt("step", lambda: step(model, opt, 3))
    report(seen, rank)
    sys.exit(0)
seen["step_error"] = attempt("step", lambda: step(model, opt, 3))
seen["state_dict_error"] = attempt("state_dict", lambda: opt.state_dict())
seen["unchanged"] = params_digest(model) == before_params and (
    rank == 1 or digest(model, opt) == before)
# Elastic: a reset restores the last commit on every rank.
seen["restore_error"] = attempt("restore", state.restore)
seen["step_after_restore_error"] = attempt("step", lambda: step(model, opt, 3))
report(seen, rank)
