"""probe_max_local_bsz: the largest batch that fits, found by doubling and bisection."""
import pytest

from hvd_adapt import probe_max_local_bsz


def fake_step(limit, calls):
    def step(b):
        calls.append(b)
        if b > limit:
            raise RuntimeError(f"CUDA out of memory. Tried to allocate {b} MiB")
    return step


@pytest.mark.parametrize("limit", [1, 37, 64, 1000])
def test_finds_the_edge(limit):
    calls = []
    assert probe_max_local_bsz(fake_step(limit, calls), limit=4096, safety=1.0) == limit
    assert len(calls) <= 2 * 13


def test_safety_margin_and_limit():
    assert probe_max_local_bsz(fake_step(100, []), safety=0.9) == 90
    assert probe_max_local_bsz(fake_step(10 ** 6, []), limit=300, safety=1.0) == 300


def test_other_errors_propagate_and_bad_arguments():
    def broken(b):
        raise RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        probe_max_local_bsz(broken)
    with pytest.raises(RuntimeError, match="even batch size 4"):
        probe_max_local_bsz(fake_step(2, []), start=4)
    with pytest.raises(ValueError, match="start=0"):
        probe_max_local_bsz(fake_step(2, []), start=0)
    with pytest.raises(ValueError, match="safety must be in"):
        probe_max_local_bsz(fake_step(2, []), safety=0)
