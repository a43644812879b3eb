"""Real recipes under horovodrun -np 2: AdamW + weight decay, bf16 autocast + GradScaler,
clipping, and a rank that skips a step. Every rank's gradients and parameters are compared.
"""
import pytest

from support.launch import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("buckets", [[], ["--bucket-cap-mb", 0.002],
                                     ["--bucket-cap-mb", 0.002, "--amp"]],
                         ids=["one-bucket", "buckets", "buckets+amp"])
def test_clipping_sees_the_averaged_gradients(buckets):
    # This small model fits in one bucket by default; tiny buckets (one per
    # parameter here) take the path larger models take, allreduces started
    # mid-backward, also under bf16 autocast with a GradScaler.
    job = run_ranks("recipes_train.py", np=2, args=["--steps", 4] + buckets).check()
    first, second = job.reports[0]["steps"], job.reports[1]["steps"]
    assert [s["grads"] for s in first] == [s["grads"] for s in second]
    assert [s["params"] for s in first] == [s["params"] for s in second]
    assert all(s["stepped"] for s in first + second)


def test_fp16_compression_passes_through_and_keeps_replicas_alike():
    job = run_ranks("recipes_train.py", np=2, args=["--steps", 4, "--fp16-compression"]).check()
    first, second = job.reports[0]["steps"], job.reports[1]["steps"]
    assert [s["grads"] for s in first] == [s["grads"] for s in second]
    assert [s["params"] for s in first] == [s["params"] for s in second]
    assert all(s["grad_dtypes"] == ["torch.float32"] for s in first)
    # The gradients went through fp16: they differ from an uncompressed run's.
    plain = run_ranks("recipes_train.py", np=2, args=["--steps", 1]).check()
    assert plain.reports[0]["steps"][0]["grads"] != first[0]["grads"]


def test_gradscaler_skips_an_overflow_on_one_rank_on_every_rank():
    job = run_ranks("recipes_train.py", np=2, args=["--amp", "--steps", 8, "--inf-at", 3],
                    timeout=120).check()
    first, second = job.reports[0]["steps"], job.reports[1]["steps"]
    assert [s["stepped"] for s in first] == [s["stepped"] for s in second]
    assert [s["stepped"] for s in first] == [True] * 3 + [False] + [True] * 4
    # The scale halved after the overflow, on both ranks.
    assert first[3]["scale"] == second[3]["scale"] == first[2]["scale"] / 2
    assert [s["params"] for s in first] == [s["params"] for s in second]
    # A skipped step is no progress.
    assert job.reports[0]["progress"] == job.reports[1]["progress"] == 7


def test_a_rank_skipping_step_leaves_no_one_waiting():
    job = run_ranks("recipes_train.py", np=2, args=["--steps", 6, "--skip-at", 2],
                    timeout=90).check()
    first, second = job.reports[0]["steps"], job.reports[1]["steps"]
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


@pytest.mark.parametrize("measure", [[], ["--measure-noise"]], ids=["plain", "measuring"])
def test_accumulation_at_two_replicas_equals_one_large_batch(measure):
    # Averaged over micro-steps and replicas alike whether a bucket starts in a
    # hook or at the end of backward (an unused parameter holds it back).
    big = run_ranks("accumulate.py", np=2, args=measure).check().reports
    small = run_ranks("accumulate.py", np=2, args=["--micro", 4] + measure).check().reports
    assert small[0]["accum"] == 3 and big[0]["accum"] == 0
    for rank in (0, 1):
        assert small[rank]["weights"] == pytest.approx(big[rank]["weights"], abs=1e-5)
        assert small[rank]["bias"] == pytest.approx(big[rank]["bias"], abs=1e-5)
        assert small[rank]["unused"] == big[rank]["unused"] == [1.0, 1.0, 1.0]
