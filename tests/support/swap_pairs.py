"""Swap tests' helpers: a model and optimizer with the state on disk beside the same pair
with it in memory (``pair``, ``started``), stepped alike and compared bitwise, and a look
at the swap's folders and files on disk."""
import os
import subprocess

import pytest
import torch

from hvd_adapt import DistributedOptimizer
from support.hooked_optimizer import HookedAdamW


def state_tensors(opt):
    state = opt.state_dict()["state"]
    return [(i, key, value.clone()) for i in sorted(state) for key, value in sorted(state[i].items())
            if torch.is_tensor(value)]


def swap_folders(directory):
    return sorted(name for name in os.listdir(directory) if name.startswith("hvd_adapt-swap-"))


def pair(build, swap_dir, buffer_mb=0.05):
    """The same model and optimizer twice, seeded alike: state on disk, state in memory."""
    out = []
    for where in (swap_dir, None):
        torch.manual_seed(0)
        model, inner = build()
        out.append((model, DistributedOptimizer(inner, swap_dir=where,
                                                 swap_buffer_mb=buffer_mb if where else None)))
    return out


def step_both(pairs, steps=1, batch=None):
    for _ in range(steps):
        x = torch.randn(8, 16, generator=batch) if batch is not None else None
        for model, opt in pairs:
            # Not state_dict(): handing out the state's tensors keeps its file from being
            # the next generation's spare.
            gen = torch.Generator().manual_seed(len(opt.param_groups) + 7)
            inp = x if x is not None else torch.randn(8, model[0].in_features, generator=gen)
            opt.zero_grad()
            model(inp).pow(2).mean().backward()
            opt.step()


def assert_same(pairs):
    (a, opt_a), (b, opt_b) = pairs
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    for i in sa:
        assert sorted(sa[i]) == sorted(sb[i]), i
        for key in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][key]), torch.as_tensor(sb[i][key])), (i, key)


def deep():
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    return model, HookedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def fill(folder):
    """Fill ``folder``'s file system; returns the filler's path."""
    path = os.path.join(folder, "filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == 28
    return path


def by_age(folder):
    """The files in ``folder``, oldest write first: during a step, the newest is the one
    being written and the one before it the live one."""
    return sorted(folder.iterdir(), key=lambda path: path.stat().st_mtime_ns)


def step(model, opt, seed):
    opt.zero_grad()
    model(torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))).pow(2).mean() \
        .backward()
    opt.step()


def started(swap_dir):
    """The swapped and the in-memory model and optimizer (``pair``), three steps taken alike."""
    pairs = pair(deep, str(swap_dir), buffer_mb=24 / 1024)
    for seed in range(3):
        for model, opt in pairs:
            step(model, opt, seed)
    return pairs


def spare_of(folder):
    """The spare in an optimizer's ``folder`` (of two files, the one written first): the
    file the next step writes over."""
    files = sorted(folder.iterdir(), key=lambda path: path.stat().st_mtime_ns)
    assert len(files) == 2, files
    return files[0]


def only_folder(swap_dir):
    """The one optimizer folder under ``swap_dir`` (a path)."""
    [folder] = swap_folders(str(swap_dir))
    return swap_dir / folder


def chattr(flag, path):
    """Make ``path`` immutable (``+i``) or not again: entries of an immutable folder, or an
    immutable file, can be neither renamed nor removed, by root too (root ignores modes; as
    another user ``chmod 0500`` of the folder fails the same renames with EACCES)."""
    if subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr is not available on this file system")
