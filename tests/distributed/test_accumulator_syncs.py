"""Accumulator syncs at two real ranks: matched syncs sum exactly; syncs that do not match
raise on every rank naming what each synced, lose nothing, and never hang.

Before, every sync went out under one collective name with keys (position,
key): rank 0 syncing ``a`` while rank 1 synced ``b`` mixed their keys and sums
silently.
"""
import pytest

from support.launch import run_ranks

pytestmark = pytest.mark.distributed


def sums(rounds, scale):
    # The plain reference: what ranks 0 and 1 added over ``rounds`` rounds (the worker's added()).
    return {"n": 3 * rounds, "x": scale * (0.5 + 1.5) * rounds, "only_on_1": 7 * rounds}


def test_matched_syncs_sum_and_mismatched_ones_raise_everywhere_without_loss():
    job = run_ranks("accumulator_syncs.py", np=2, timeout=150).check()
    r0, r1 = job.reports[0], job.reports[1]
    for seen in (r0, r1):
        assert seen["matched_a"] == [sums(1, 1.0)] and seen["matched_b"] == [sums(1, 10.0)]
        # Crossed syncs raise on both ranks, naming both accumulators and their keys.
        (crossed,) = seen["crossed"]
        assert crossed.startswith("AccumulatorMismatchError: ")
        assert "rank 0: 'accumulator_syncs.py:" in crossed and "rank 1: 'evaluation'" in crossed
        assert "keys ['n', 'only_on_1', 'x']" in crossed
        # Nothing was added by the failed sync, nothing lost: the next syncs count it once.
        assert seen["after_crossed_a"] == [sums(2, 1.0)]
        assert seen["after_crossed_b"] == [sums(2, 10.0)]
        # Rank 0 alone syncing pairs with rank 1's next sync: both raise, then go on.
        assert seen["alone"][0].startswith("AccumulatorMismatchError: ")
        assert "different accumulators" in seen["alone"][0] and seen["alone"][1] == sums(2, 10.0)
        assert seen["after_alone_a"] == [sums(3, 1.0)]
        # ... and with rank 1's commit of a State holding both accumulators.
        (at_commit,) = seen["alone_at_commit"]
        assert at_commit.startswith("AccumulatorMismatchError: ")
        assert "rank 1: 'accumulator_syncs.py:" in at_commit and "'evaluation' (keys [])" \
            in at_commit
        assert seen["after_commit_a"] == [sums(4, 1.0)]
    # Rank 0 alone syncing while rank 1 ends: an error naming the sync, not a hang.
    (at_end,) = r0["alone_at_end"]
    assert at_end.startswith("HorovodInternalError") and "in the sync of accumulators" in at_end
