"""Buffers at every commit (``State(broadcast_buffers=True)``, the default, as DDP does): every
rank holds rank 0's BatchNorm statistics, equal to a plain-torch model's on rank 0's shards;
``broadcast_buffers=False`` keeps each rank's own."""
import numpy as np
import pytest

from support.launch import run_ranks

pytestmark = pytest.mark.distributed


def test_every_commit_gives_each_rank_rank_zeros_buffers():
    job = run_ranks("buffers.py", np=2, timeout=180)
    job.check()
    zero, one = job.reports[0]["steps"], job.reports[1]["steps"]
    for step, (a, b) in enumerate(zip(zero, one)):
        for key in ("mean", "var", "tracked"):
            assert a[key] == b[key], (step, key)
        np.testing.assert_allclose(a["mean"], a["reference_mean"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(a["var"], a["reference_var"], rtol=1e-6, atol=1e-7)


def test_broadcast_buffers_false_keeps_each_ranks_own():
    job = run_ranks("buffers.py", np=2, args=["--keep-local"], timeout=180)
    job.check()
    assert job.reports[0]["steps"][-1]["mean"] != job.reports[1]["steps"][-1]["mean"]
