"""Gradient noise scale measured by two real Horovod replicas."""
import pytest

from launch import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("accumulate", [False, True], ids=["replicas", "replicas+accumulation"])
def test_two_replicas_estimate_known_statistics(accumulate):
    job = run_ranks("gns_train.py", np=2, launcher="gloo",
                    args=["--accumulate"] if accumulate else []).check()
    assert sorted(job.reports) == [0, 1]
    first, second = job.reports[0], job.reports[1]
    # Every replica computes the same estimate from the same allreduced norms.
    assert first["sqr"] == second["sqr"] and first["trace"] == second["trace"]
    assert first["sqr"] == pytest.approx(first["true_sqr"], rel=0.10)
    assert first["trace"] == pytest.approx(first["true_trace"], rel=0.10)
