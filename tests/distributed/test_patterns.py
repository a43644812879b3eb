"""The training patterns users write, under horovodrun -np 2, against a plain-torch reference
on the whole batch (workers/patterns.py): every rank's parameters must match the reference's
after every optimizer step, and each other's bit for bit; patterns that cannot be averaged
stop every rank with an error that names the cause."""
import pytest

from support.launch import run_ranks

pytestmark = pytest.mark.distributed


def check_against_reference(reports, steps, tolerance=2e-5):
    first, second = reports[0]["steps"], reports[1]["steps"]
    assert len(first) == len(second) == steps, (len(first), len(second))
    assert [s["params"] for s in first] == [s["params"] for s in second]
    worst = max(s["difference"] for s in first + second)
    assert worst < tolerance, [round(s["difference"], 8) for s in first]


CASES = [("exception", 2), ("exception", 1), ("unfreeze", 2), ("checkpoint", 2), ("penalty", 2),
         ("logging", 1), ("reload", 2), ("gan", 1), ("replace", 1), ("channels_last", 1)]


@pytest.fixture(scope="module")
def patterns_job():
    """One job runs every case in turn (the launch and imports once, not ten times); each
    case still has its own models, optimizers and loader, from seed 0."""
    return run_ranks("patterns.py", np=2, args=[
        "--pattern", ",".join(f"{pattern}:{micro}" for pattern, micro in CASES)],
        timeout=300).check()


@pytest.mark.parametrize("pattern,micro", CASES)
def test_every_rank_trains_as_the_reference(patterns_job, pattern, micro):
    reports = {rank: patterns_job.reports[rank][f"{pattern}:{micro}"] for rank in (0, 1)}
    check_against_reference(reports, 6)
    if pattern == "unfreeze":
        # Used by no rank: left as a single process leaves it (no AdamW state,
        # no weight decay), not zero-filled and decayed.
        assert all(r["unused_untouched"] and not r["unused_has_state"]
                   for r in reports.values())
    if pattern == "exception":
        # The cycle with the failed backward was skipped on both ranks.
        assert reports[0]["progress"] == reports[1]["progress"] == 5


def test_a_sparse_embedding_averages_as_dense_when_asked():
    job = run_ranks("patterns.py", np=2, args=["--pattern", "sparse", "--sparse-as-dense"],
                    timeout=120).check()
    check_against_reference({rank: job.reports[rank]["sparse:1"] for rank in (0, 1)}, 6)


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
