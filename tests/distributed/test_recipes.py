"""Real recipes under horovodrun -np 2: AdamW + weight decay, bf16 autocast + GradScaler,
clipping, and a rank that skips a step. Every rank's gradients and parameters are compared.
The cases that end well share one job per worker script (a job's start-up costs more than
their few steps); the one that must fail has a job of its own.
"""
import json

import pytest

from support.launch import run_ranks

pytestmark = pytest.mark.distributed


CASES = {
    "one-bucket": ["--steps", 4],
    "buckets": ["--steps", 4, "--bucket-cap-mb", 0.002],
    "buckets+amp": ["--steps", 4, "--bucket-cap-mb", 0.002, "--amp"],
    "fp16-compression": ["--steps", 4, "--fp16-compression"],
    "uncompressed": ["--steps", 1],
    "inf-on-one-rank": ["--amp", "--steps", 8, "--inf-at", 3],
    "step-skipped-on-one-rank": ["--steps", 6, "--skip-at", 2],
}


@pytest.fixture(scope="module")
def recipes_job():
    """One job trains every case of CASES (recipes_train.py); ``recipes(name)`` is the
    case's (rank 0, rank 1) reports."""
    return run_ranks("recipes_train.py", np=2, args=["--cases", json.dumps(CASES)],
                     timeout=240)


@pytest.fixture
def recipes(recipes_job):
    def case(name):
        runs = recipes_job.case(name)
        return runs[0], runs[1]
    return case


@pytest.mark.parametrize("case", ["one-bucket", "buckets", "buckets+amp"])
def test_clipping_sees_the_averaged_gradients(case, recipes):
    # This small model fits in one bucket by default; tiny buckets (one per
    # parameter here) take the path larger models take, allreduces started
    # mid-backward, also under bf16 autocast with a GradScaler.
    first, second = (rep["steps"] for rep in recipes(case))
    assert [s["grads"] for s in first] == [s["grads"] for s in second]
    assert [s["params"] for s in first] == [s["params"] for s in second]
    assert all(s["stepped"] for s in first + second)


def test_fp16_compression_passes_through_and_keeps_replicas_alike(recipes):
    first, second = (rep["steps"] for rep in recipes("fp16-compression"))
    assert [s["grads"] for s in first] == [s["grads"] for s in second]
    assert [s["params"] for s in first] == [s["params"] for s in second]
    assert all(s["grad_dtypes"] == ["torch.float32"] for s in first)
    # The gradients went through fp16: they differ from an uncompressed run's.
    assert recipes("uncompressed")[0]["steps"][0]["grads"] != first[0]["grads"]


def test_gradscaler_skips_an_overflow_on_one_rank_on_every_rank(recipes):
    first_report, second_report = recipes("inf-on-one-rank")
    first, second = first_report["steps"], second_report["steps"]
    assert [s["stepped"] for s in first] == [s["stepped"] for s in second]
    assert [s["stepped"] for s in first] == [True] * 3 + [False] + [True] * 4
    # The scale halved after the overflow, on both ranks.
    assert first[3]["scale"] == second[3]["scale"] == first[2]["scale"] / 2
    assert [s["params"] for s in first] == [s["params"] for s in second]
    # A skipped step is no progress.
    assert first_report["progress"] == second_report["progress"] == 7


def test_a_rank_skipping_step_leaves_no_one_waiting(recipes):
    first, second = (rep["steps"] for rep in recipes("step-skipped-on-one-rank"))
    assert len(first) == len(second) == 6
    assert [s["stepped"] for s in second] == [True, True, False, True, True, True]
    # Gradients are averaged in backward: every later step still averages alike.
    assert [s["grads"] for s in first] == [s["grads"] for s in second]


def test_a_rank_skipping_backward_fails_fast_with_an_error_naming_the_cause():
    # Ranks that disagree on the number of backward passes leave one rank's
    # gradient allreduces unmatched: an error, not a hang.
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "6"}
    job = run_ranks("recipes_train.py", np=2, args=["--steps", 4, "--skip-backward-at", 1],
                    timeout=120, env=env)
    assert job.returncode not in (0, "timeout"), job.output[-3000:]
    assert "while averaging gradients hvd_adapt.grad." in job.output, job.output[-3000:]
    assert "different numbers of backward passes" in job.output


@pytest.fixture(scope="module")
def accumulated():
    """One job trains accumulate.py's four cases."""
    return run_ranks("accumulate.py", np=2, args=["--cases", "1", "4", "1+noise", "4+noise"])


@pytest.mark.parametrize("noise", ["", "+noise"], ids=["plain", "measuring"])
def test_accumulation_at_two_replicas_equals_one_large_batch(noise, accumulated):
    # Averaged over micro-steps and replicas alike whether a bucket starts in a
    # hook or at the end of backward (an unused parameter holds it back).
    bigs, smalls = accumulated.case("1" + noise), accumulated.case("4" + noise)
    for rank in (0, 1):
        big, small = bigs[rank], smalls[rank]
        assert small["accum"] == 3 and big["accum"] == 0
        assert small["weights"] == pytest.approx(big["weights"], abs=1e-5)
        assert small["bias"] == pytest.approx(big["bias"], abs=1e-5)
        assert small["unused"] == big["unused"] == [1.0, 1.0, 1.0]
