"""The split of a pool among jobs: Pollux's objective, minimums, hysteresis, hosts kept."""
import itertools
import math
import random

import pytest

from hvd_adapt.scheduling.allocation import JobView, SplitSettings, split

POOL = [(f"h{i}", 1) for i in range(1, 5)]
NOW = 10_000.0


def linear(n=8, per_worker=1.0):
    return {r: 100.0 * (1 + per_worker * (r - 1)) for r in range(1, n + 1)}


FLAT = {1: 100.0, 2: 103.0, 3: 105.0, 4: 106.0}     # bound by communication


def counts(result):
    return {name: len(hosts) for name, hosts in result.hosts.items()}


def test_the_job_that_scales_gets_the_hosts_the_other_cannot_use():
    a = JobView("a", 0, curve=linear(), timed=2, hosts=("h1", "h2"))
    b = JobView("b", 1, curve=FLAT, timed=2, hosts=("h3", "h4"))
    result = split([a, b], POOL, SplitSettings(), NOW, last_change=0.0)
    assert result.hosts == {"a": ["h1", "h2", "h4"], "b": ["h3"]}   # b gives its newest
    assert result.by_choice and result.why == {"a": "2 -> 3 host(s) (by choice)",
                                               "b": "2 -> 1 host(s) (by choice)"}


def test_fairness_shares_equal_jobs_equally_and_p_one_maximises_the_sum():
    a = JobView("a", 0, curve=linear(), timed=4, hosts=("h1", "h2", "h3"))
    b = JobView("b", 1, curve=linear(), timed=1, hosts=("h4",))
    assert counts(split([a, b], POOL, SplitSettings(), NOW, 0.0)) == {"a": 2, "b": 2}
    # The sum of the speed-ups is the same either way: nothing gained, nothing moved.
    assert counts(split([a, b], POOL, SplitSettings(fairness=1.0), NOW, 0.0)) == \
        {"a": 3, "b": 1}
    # A job that scales half as well gets less under the sum, more under fairness.
    half = JobView("b", 1, curve=linear(per_worker=0.5), timed=4, hosts=("h4",))
    assert counts(split([a, half], POOL, SplitSettings(fairness=1.0), NOW, 0.0)) == \
        {"a": 3, "b": 1}
    assert counts(split([a, half], POOL, SplitSettings(fairness=-1.0), NOW, 0.0))["b"] >= 2


def test_a_small_gain_or_a_recent_change_moves_nothing_but_what_is_needed_still_happens():
    a = JobView("a", 0, curve=linear(per_worker=1.0), timed=4, hosts=("h1", "h2"))
    b = JobView("b", 1, curve=linear(per_worker=0.98), timed=4, hosts=("h3", "h4"))
    # Moving a host from b to a would gain about 1%.
    assert counts(split([a, b], POOL, SplitSettings(fairness=1.0), NOW, 0.0)) == \
        {"a": 2, "b": 2}
    # Within the interval a clear gain waits ...
    b_flat = JobView("b", 1, curve=FLAT, timed=2, hosts=("h3", "h4"))
    settings = SplitSettings(interval=60.0)
    assert counts(split([a, b_flat], POOL, settings, NOW, last_change=NOW - 30)) == \
        {"a": 2, "b": 2}
    # ... but a new job's minimum does not, and is taken where it costs least (from b).
    c = JobView("c", 2, curve=None, hosts=())
    result = split([a, b_flat, c], POOL, settings, NOW, last_change=NOW - 30)
    assert counts(result) == {"a": 2, "b": 1, "c": 1} and not result.by_choice
    assert result.hosts["c"] == ["h4"] and result.why["c"] == "0 -> 1 host(s) (needed)"


def test_minimums_in_arrival_order_with_backfill_and_never_below_a_running_jobs_minimum():
    a = JobView("a", 0, min_np=2, curve=linear(), timed=4, hosts=("h1", "h2", "h3", "h4"))
    big = JobView("big", 1, min_np=3, curve=None)
    small = JobView("small", 2, min_np=1, curve=None)
    result = split([a, big, small], POOL, SplitSettings(), NOW, NOW)
    # big's 3 do not fit beside a's 2; small's 1 does, and a keeps its minimum.
    assert counts(result) == {"a": 3, "big": 0, "small": 1}
    result = split([a, big], POOL, SplitSettings(), NOW, NOW)
    assert counts(result) == {"a": 4, "big": 0}


def test_a_failed_host_leaves_every_grant_and_is_replaced_from_the_free_ones():
    a = JobView("a", 0, curve=linear(), timed=2, hosts=("h1", "h2"))
    pool = [("h1", 1), ("h3", 1), ("h4", 1)]            # h2 stopped answering
    result = split([a], pool, SplitSettings(), NOW, NOW)   # no change by choice allowed
    assert result.hosts == {"a": ["h1"]}
    a2 = JobView("a", 0, min_np=2, curve=linear(), timed=2, hosts=("h1", "h2"))
    assert split([a2], pool, SplitSettings(), NOW, NOW).hosts == {"a": ["h1", "h3"]}


def test_a_job_not_yet_timed_in_its_world_keeps_its_hosts_unless_a_minimum_needs_them():
    a = JobView("a", 0, curve=FLAT, timed=4, movable=False, hosts=("h1", "h2", "h3"))
    b = JobView("b", 1, curve=linear(), timed=4, hosts=("h4",))
    assert counts(split([a, b], POOL, SplitSettings(), NOW, 0.0)) == {"a": 3, "b": 1}
    c = JobView("c", 2, min_np=2, curve=None)
    assert counts(split([a, b, c], POOL, SplitSettings(), NOW, 0.0)) == \
        {"a": 1, "b": 1, "c": 2}


def test_a_job_without_a_curve_gets_its_initial_workers_and_keeps_them():
    a = JobView("a", 0, initial_np=2, curve=None)
    assert counts(split([a], POOL, SplitSettings(), NOW, 0.0)) == {"a": 2}
    a = JobView("a", 0, initial_np=2, curve=None, hosts=("h1", "h2", "h3"))
    assert counts(split([a], POOL, SplitSettings(), NOW, 0.0)) == {"a": 3}


def test_growth_stays_within_twice_what_was_timed_and_max_np():
    a = JobView("a", 0, curve=linear(), timed=1, hosts=("h1",))
    assert counts(split([a], POOL, SplitSettings(), NOW, 0.0)) == {"a": 2}
    a = JobView("a", 0, max_np=3, curve=linear(), timed=4, hosts=("h1",))
    assert counts(split([a], POOL, SplitSettings(), NOW, 0.0)) == {"a": 3}


def test_hosts_another_job_still_holds_are_taken_last():
    a = JobView("a", 0, curve=linear(), timed=4, hosts=("h1",))
    result = split([a], POOL, SplitSettings(), NOW, 0.0, held={"h2": {"gone"}, "h3": {"a"}})
    assert result.hosts == {"a": ["h1", "h3", "h4", "h2"]}


def test_running_jobs_keep_a_host_each_when_the_pool_shrinks_below_their_minimums():
    a = JobView("a", 0, min_np=2, curve=linear(), timed=2, hosts=("h1", "h2"))
    b = JobView("b", 1, min_np=2, curve=linear(), timed=2, hosts=("h3", "h4"))
    pool = [("h1", 1), ("h2", 1), ("h3", 1)]
    assert counts(split([a, b], pool, SplitSettings(), NOW, NOW)) == {"a": 2, "b": 1}


def test_hosts_with_several_slots_count_in_workers():
    a = JobView("a", 0, max_np=3, curve=linear(), timed=4, hosts=("h1",))
    b = JobView("b", 1, curve=FLAT, timed=2, hosts=("h2",))
    pool = [("h1", 2), ("h2", 2), ("h3", 2)]
    assert counts(split([a, b], pool, SplitSettings(), NOW, 0.0)) == {"a": 2, "b": 1}


def power_mean(speedups, fairness):
    if fairness == 0:
        return math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    return (sum(s ** fairness for s in speedups) / len(speedups)) ** (1 / fairness)


def brute_force(jobs, total, settings):
    """The best power mean over every split that keeps each job within its range."""
    best = None
    for choice in itertools.product(*[range(1, total + 1) for _ in jobs]):
        if sum(choice) > total:
            continue
        value = power_mean([job.curve[min(n, max(job.curve))] /
                             job.curve[min(max(1, total // len(jobs)), max(job.curve))]
                             for job, n in zip(jobs, choice)], settings.fairness)
        best = value if best is None else max(best, value)
    return best


@pytest.mark.parametrize("fairness", [-2.0, -1.0, 0.0, 0.5, 1.0])
def test_the_split_is_the_optimum_of_the_power_mean(fairness):
    rng = random.Random(fairness)
    settings = SplitSettings(fairness=fairness, min_gain=0.0, interval=0.0, efficiency=0.0,
                             growth_limit=1000.0)
    for _ in range(40):
        total = rng.randrange(2, 8)
        pool = [(f"h{i}", 1) for i in range(total)]
        jobs = []
        for index in range(rng.randrange(1, min(total, 4) + 1)):
            goodput, curve = 100.0, {}
            for r in range(1, total + 1):       # concave or not: any non-decreasing curve
                goodput += rng.uniform(0, 100)
                curve[r] = goodput
            jobs.append(JobView(f"j{index}", index, curve=curve, timed=total,
                                hosts=(pool[index][0],)))
        result = split(jobs, pool, settings, NOW, 0.0)
        fair = max(1, total // len(jobs))
        got = power_mean([job.curve[len(result.hosts[job.name])] / job.curve[fair]
                           for job in jobs], fairness)
        assert got == pytest.approx(brute_force(jobs, total, settings)), (jobs, result)


@pytest.mark.parametrize("kwargs, message", [
    ({"fairness": 2.0}, r"fairness must be a number in \[-10.0, 1.0\], got 2.0"),
    ({"min_gain": -0.1}, "min_gain must be"), ({"interval": float("nan")}, "interval must be"),
    ({"efficiency": 1.5}, r"efficiency must be a number in \[0.0, 1.0\]"),
    ({"growth_limit": 0.5}, "growth_limit must be")])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SplitSettings(**kwargs)
