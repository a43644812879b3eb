"""The training patterns users write, under horovodrun -np 2, against a plain-torch reference
on the whole batch (workers/patterns.py): every rank's parameters must match the reference's
after every optimizer step, and each other's bit for bit; patterns that cannot be averaged
stop every rank with an error that names the cause."""
import pytest

from support.launch import run_ranks

pytestmark = pytest.mark.distributed


def check_against_reference(job, steps, tolerance=2e-5):
    first, second = job.reports[0]["steps"], job.reports[1]["steps"]
    assert len(first) == len(second) == steps, (len(first), len(second))
    assert [s["params"] for s in first] == [s["params"] for s in second]
    worst = max(s["difference"] for s in first + second)
    assert worst < tolerance, [round(s["difference"], 8) for s in first]


@pytest.mark.parametrize("pattern,micro", [
    ("exception", 2), ("exception", 1), ("unfreeze", 2), ("checkpoint", 2), ("penalty", 2),
    ("logging", 1), ("reload", 2), ("gan", 1), ("replace", 1), ("channels_last", 1),
])
def test_every_rank_trains_as_the_reference(pattern, micro):
    job = run_ranks("patterns.py", np=2, args=["--pattern", pattern, "--micro", micro],
                    timeout=120).check()
    check_against_reference(job, 6)
    if pattern == "unfreeze":
        # Used by no rank: left as a single process leaves it (no AdamW state,
        # no weight decay), not zero-filled and decayed.
        assert all(r["unused_untouched"] and not r["unused_has_state"]
                   for r in job.reports.values())
    if pattern == "exception":
        # The cycle with the failed backward was skipped on both ranks.
        assert job.reports[0]["progress"] == job.reports[1]["progress"] == 5


def test_a_sparse_embedding_averages_as_dense_when_asked():
    job = run_ranks("patterns.py", np=2, args=["--pattern", "sparse", "--sparse-as-dense"],
                    timeout=120).check()
    check_against_reference(job, 6)


def stderr_of(job, rank):
    return "\n".join(line for line in job.output.splitlines()
                     if line.startswith(f"[{rank}]<stderr>"))


@pytest.mark.parametrize("args,message", [
    (["--pattern", "sparse"], "parameter embedding.weight has a sparse gradient"),
    (["--pattern", "exception", "--only-rank", "1"], "raised on some ranks"),
    (["--pattern", "exception", "--only-rank", "1", "--micro", "2"], "raised on some ranks"),
], ids=["sparse", "exception-on-one-rank", "exception-on-one-rank-accumulating"])
def test_what_cannot_be_averaged_stops_every_rank_with_its_cause(args, message):
    job = run_ranks("patterns.py", np=2, args=args, timeout=120)
    assert job.returncode not in (0, "timeout"), job.output[-3000:]
    for rank in (0, 1):
        assert message in stderr_of(job, rank), job.output[-3000:]
