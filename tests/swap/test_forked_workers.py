"""The descriptors held on generations in use (hvd_adapt/optim/swap.py, _hold):
they are O_CLOEXEC but not closed at a fork, so DataLoader workers forked after training
started (every epoch without persistent_workers; once, after a resume, with them) keep the
generations live at the fork allocated on disk after the parent removed them, for as long
as the workers live: the disk the state needs grows by up to two generations."""
import gc
import os

import pytest
import torch

import hvd_adapt
from hvd_adapt import State
from support.swap_pairs import deep, pair, step


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def used(point):
    s = os.statvfs(point)
    return (s.f_blocks - s.f_bfree) * s.f_frsize


def test_forked_dataloader_workers_do_not_keep_removed_generations_on_disk(mount):
    point = str(mount("tmpfs", "64m"))
    (model, opt), _ = pair(deep, point, buffer_mb=24 / 1024)
    state = State(model=model, optimizer=opt)
    for seed in range(3):
        step(model, opt, seed)
    state.commit()
    step(model, opt, 3)
    # An epoch's workers, forked now (as at each epoch's first batch).
    loader = torch.utils.data.DataLoader(list(range(64)), batch_size=8, num_workers=2,
                                         multiprocessing_context="fork")
    batches = iter(loader)
    next(batches)
    for seed in range(4, 12):
        step(model, opt, seed)
        state.commit()
    while_workers_live = used(point)
    del batches, loader
    gc.collect()
    # The workers have exited (the iterator's shutdown joins them).
    without_workers = used(point)
    assert while_workers_live == without_workers, (
        f"{while_workers_live - without_workers} bytes of removed generations stay allocated "
        "while the DataLoader workers forked after training started live")
