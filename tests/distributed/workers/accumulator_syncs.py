"""Accumulator syncs that match and that do not, at two ranks, in one job.

Each scenario reports what every rank saw; the test compares totals with the
sums of what each rank added (computed in the test, in one process).
"""
import hvd_adapt
from _report import report

hvd_adapt.init()
rank = hvd_adapt.env.rank()
seen = {}


def added(acc, scale):
    # What this rank adds: the test recomputes the sums from the same formula.
    acc["n"] += rank + 1
    acc["x"] += scale * (rank + 0.5)
    if rank == 1:
        acc["only_on_1"] += 7


def attempt(what, acc):
    try:
        with acc.synchronized():
            seen.setdefault(what, []).append(dict(acc))
    except RuntimeError as e:
        seen.setdefault(what, []).append(f"{type(e).__name__}: {e}")


a = hvd_adapt.Accumulator()
b = hvd_adapt.Accumulator(name="evaluation")

# 1. Matched syncs, both ranks alike.
added(a, 1.0)
added(b, 10.0)
attempt("matched_a", a)
attempt("matched_b", b)

# 2. Crossed: rank 0 syncs a while rank 1 syncs b; then both sync both, nothing lost.
added(a, 1.0)
added(b, 10.0)
attempt("crossed", a if rank == 0 else b)
attempt("after_crossed_a", a)
attempt("after_crossed_b", b)

# 3. Rank 0 alone syncs a, then both sync b: rank 0's a pairs with rank 1's b.
added(a, 1.0)
if rank == 0:
    attempt("alone", a)
attempt("alone", b)
if rank == 1:
    attempt("alone", b)   # pairs with rank 0's second sync of b
attempt("after_alone_a", a)

# 4. Rank 0 alone syncs a while rank 1 commits a State holding both.
state = hvd_adapt.State(stats=a, evaluation=b)
added(a, 1.0)
if rank == 0:
    attempt("alone_at_commit", a)
else:
    try:
        state.commit()
    except RuntimeError as e:
        seen["alone_at_commit"] = [f"{type(e).__name__}: {e}"]
state.commit()
with a.synchronized():
    seen["after_commit_a"] = [dict(a)]

# 5. Rank 0 alone syncs while rank 1 ends its script: rank 0 gets an error, not a hang.
added(a, 1.0)
report(seen, rank)
if rank == 0:
    try:
        with a.synchronized():
            seen["alone_at_end"] = ["returned"]
    except Exception as e:
        seen["alone_at_end"] = [f"{type(e).__name__}: {e}"]
    report(seen, rank)
