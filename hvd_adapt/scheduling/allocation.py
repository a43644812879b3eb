"""How a pool of hosts is split among jobs: Pollux's objective on the curves the jobs publish.

A pure function (:func:`split`), standard library only, so that the arbiter
(:mod:`.arbiter`), a simulator (``benchmarks/cluster_sim.py``) and the tests
call the same code. Each job brings its speed-up curve (goodput at each
replica count, :mod:`.hints`), its ``min_np``/``max_np`` and the hosts it has;
hosts are granted whole (no host runs workers of two jobs).

The objective is Pollux's (Qiao et al., OSDI 2021): each job's speed-up
``s_j`` is its goodput on ``n_j`` hosts over its goodput on a fair share of
the pool (``hosts // jobs``), and the split maximises the power mean
``(mean_j s_j ** p) ** (1 / p)``. ``p = 1`` is the sum of the speed-ups (the
most work done); lower ``p`` is fairer (``p = -1``, Pollux's default, gives
a host to the job it speeds up most *relative to what it has*, and never
leaves a job at nothing while another has spare hosts). The sum over jobs
is separable, so a dynamic program over (jobs, hosts) finds the exact
optimum.

Around it, what keeps a cluster calm:

- **minimums first**: jobs that run keep at least one host, then get their
  ``min_np``; waiting jobs are admitted in arrival order while their
  ``min_np`` fits (a smaller one behind a large one may go first);
- **a job is moved only on its own curve from its own world**: a job whose
  curve is not yet from the world it has (a resize in flight, its hold after
  a resize, no curve yet) keeps its hosts (``movable`` False), though it may
  still be shrunk to its ``min_np`` to admit another job;
- **growth within what was measured**: at most ``growth_limit`` x the most
  replicas the job has timed (beyond, the curve is the model's guess), and
  only while each added host brings at least ``efficiency`` of a worker's
  goodput (:class:`~.rule.DiscoveryRule`'s rule; 0 by default: in a shared
  pool a host left idle helps no job, and the objective already gives each
  host where it pays most);
- **hysteresis**: in the search, a job's speed-up on any count but the one
  it has counts ``1 + min_gain`` (5%) less, so a job is resized by choice only
  where that pays for itself (in a pool of many jobs too, where a global
  threshold would see no single move); changes by choice come at most once
  per ``interval`` seconds; changes that *must* happen (a new job's minimum,
  a failed host, a job gone) are made at once, each taking the host whose
  loss costs least;
- hosts a job keeps are the ones it has (a shrink gives back its newest);
  new ones go first to hosts no other job still holds.

>>> a = JobView("a", order=0, curve={r: 100.0 * r for r in range(1, 5)}, timed=2,
...             hosts=("h1", "h2"))
>>> b = JobView("b", order=1, curve={1: 100.0, 2: 105.0, 3: 108.0, 4: 110.0}, timed=2,
...             hosts=("h3", "h4"))
>>> result = split([a, b], [("h1", 1), ("h2", 1), ("h3", 1), ("h4", 1)], SplitSettings(),
...                now=1000.0, last_change=0.0)
>>> result.hosts["a"], result.hosts["b"]     # b's second host brings 0.05 of a worker
(['h1', 'h2', 'h4'], ['h3'])
"""
import math
from dataclasses import dataclass, field

from .rule import DiscoveryRule


@dataclass(frozen=True)
class JobView:
    """What the split knows of a job."""
    name: str
    order: int = 0                 # arrival rank: minimums are met in this order
    min_np: int = 1
    max_np: int = None             # None: no limit
    initial_np: int = None         # workers of its first grant (default min_np)
    curve: dict = None             # {replicas: goodput}; None: not published yet
    timed: int = 1                 # the most replicas its step times cover
    movable: bool = True           # its curve is from the world it has, its hold is over
    hosts: tuple = ()              # the hosts it has, oldest first


@dataclass(frozen=True)
class SplitSettings:
    fairness: float = -1.0         # Pollux's p
    min_gain: float = 0.05         # least gain a resize by choice must bring the job
    interval: float = 60.0         # least seconds between changes by choice
    efficiency: float = 0.0        # least speed-up a host must add, in workers
    growth_limit: float = 2.0      # most replicas, as a multiple of the most timed

    def __post_init__(self):
        for name, value, low, high in (("fairness", self.fairness, -10.0, 1.0),
                                       ("min_gain", self.min_gain, 0.0, 10.0),
                                       ("interval", self.interval, 0.0, 1e7)):
            if not (type(value) in (int, float) and low <= value <= high):
                raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
        DiscoveryRule(self.efficiency, 0.0, 0.0, self.growth_limit)   # checks those two


@dataclass
class Split:
    """The hosts of every job (jobs left waiting get none), whether the split changed by
    choice (it restarts ``interval``), and a line per job whose host count changed."""
    hosts: dict
    by_choice: bool = False
    why: dict = field(default_factory=dict)


def split(jobs, pool, settings, now, last_change, held=None):
    """The hosts each of ``jobs`` (:class:`JobView`) gets from ``pool`` (``[(host, slots)]``
    that answer, in order). ``last_change``: when the split last changed by choice;
    ``held``: ``{host: {job names}}`` that may still have workers there (a host another
    job holds is taken last). Hosts of a job that are not in ``pool`` (failed, withdrawn)
    are gone from its grant."""
    held = held or {}
    slots = dict(pool)
    unit = min(slots.values(), default=1)      # hosts count as of the pool's smallest
    total = len(slots)
    jobs = sorted(jobs, key=lambda j: j.order)
    current = {j.name: [h for h in j.hosts if h in slots] for j in jobs}
    bounds = {j.name: _host_bounds(j, unit, total) for j in jobs}
    lows = _minimums(jobs, current, bounds, total)
    admitted = [j for j in jobs if j.name in lows]
    fair = max(1, total // max(1, len(admitted)))
    speedup = {j.name: _speedup(j, unit, fair, bounds[j.name]) for j in admitted}
    fixed, ranges = {}, {}
    for job in admitted:
        low, most = lows[job.name], bounds[job.name][1]
        have = len(current[job.name])
        if job.curve is None or not job.movable:
            start = have if have else max(low, math.ceil((job.initial_np or job.min_np) / unit))
            fixed[job.name] = max(low, min(start, most))
        else:
            ranges[job.name] = (low, max(low, min(most, max(
                have, _worth_growing_to(job, unit, low, most, settings)))))
    repaired = _repair(admitted, current, fixed, ranges, lows, speedup, settings.fairness,
                       total)
    counts, by_choice = repaired, False
    if ranges and now - last_change >= settings.interval:
        budget = total - sum(repaired[name] for name in fixed)
        best = _best(ranges, speedup, repaired, settings.min_gain, budget, settings.fairness)
        if best is not None and any(best[n] != repaired[n] for n in best):
            counts, by_choice = dict(repaired, **best), True
    hosts = _hosts(admitted, current, counts, [h for h, _ in pool], held)
    why = {}
    for job in jobs:
        before, after = len(job.hosts), len(hosts.get(job.name, []))
        if before != after:
            reason = "by choice" if by_choice and job.name in ranges else "needed"
            why[job.name] = f"{before} -> {after} host(s) ({reason})"
    return Split({j.name: hosts.get(j.name, []) for j in jobs}, by_choice, why)


def _host_bounds(job, unit, total):
    """(hosts for min_np, most hosts that could be used)."""
    least = max(1, math.ceil(job.min_np / unit))
    most = total if job.max_np is None else math.ceil(job.max_np / unit)
    return least, max(least, min(most, total))


def _minimums(jobs, current, bounds, total):
    """``{job: least hosts}`` for the jobs admitted: running jobs keep one host, then get
    their minimum, in arrival order; then waiting jobs whose minimum fits, in order."""
    lows, left = {}, total
    running = [j for j in jobs if current[j.name]]
    for job in running:
        if left > 0:
            lows[job.name], left = 1, left - 1
    for job in running:
        if job.name in lows:
            more = min(left, bounds[job.name][0] - 1)
            lows[job.name], left = lows[job.name] + more, left - more
    for job in jobs:
        if not current[job.name] and bounds[job.name][0] <= left:
            lows[job.name], left = bounds[job.name][0], left - bounds[job.name][0]
    return lows


def _goodputs(curve, top):
    """The curve's goodput at 0..``top`` replicas as a list (flat beyond its ends)."""
    known = sorted(curve)
    table, last = [], curve[known[0]]
    for replicas in range(top + 1):
        last = curve.get(replicas, last)
        table.append(last)
    return table


def _speedup(job, unit, fair, bounds):
    """The job's speed-up on a number of hosts (a list by host count, up to its most): its
    goodput there over its goodput on its fair share (1 where it published no curve)."""
    if not job.curve:
        return [1.0] * (bounds[1] + 1)
    goodput = _goodputs(job.curve, bounds[1] * unit)
    replicas = [h * unit if job.max_np is None else min(job.max_np, h * unit)
                for h in range(bounds[1] + 1)]
    reference = goodput[replicas[min(max(fair, bounds[0]), bounds[1])]]
    reference = reference if reference > 0 else 1.0
    return [max(1e-9, goodput[r] / reference) for r in replicas]


def _worth_growing_to(job, unit, low, most, settings):
    """Most hosts the job grows to: within growth_limit x its most timed, each added host
    bringing >= efficiency of a worker (the single-job rule, over hosts)."""
    rule = DiscoveryRule(settings.efficiency, 0.0, 0.0, settings.growth_limit)
    cap = rule.growth_cap([job.timed], 1)
    limit = min(most * unit, cap) if job.max_np is None else min(job.max_np, most * unit, cap)
    if limit < low * unit:
        return low
    goodput = _goodputs(job.curve, limit)
    base = max(goodput[1], 1e-9)
    entries = [{"replicas": r, "speedup": goodput[r] / base} for r in range(1, limit + 1)]
    replicas = rule.target(entries, min(low * unit, limit), limit, unit)
    return max(low, math.ceil(replicas / unit))


def _term(speedup, fairness):
    """Each job's share of the objective: maximising the sum of these maximises the mean."""
    return math.log(speedup) if fairness == 0 else speedup ** fairness / fairness


def _best(ranges, speedup, current, min_gain, budget, fairness):
    """``{job: hosts}`` within each job's range and ``budget`` hosts in all that maximises the
    sum of the terms, where a job's speed-up on any count but its ``current`` one counts
    ``1 + min_gain`` times less (a resize costs: a job is moved only where it, or the job it
    makes room for, gains that much; Pollux discounts a re-allocation alike). None where
    the minimums do not fit."""
    best = {0: 0.0}                       # hosts used -> value, after each job in turn
    choices = []                          # per job: {hosts used after it: (its hosts, before)}
    for name, (low, high) in ranges.items():
        terms = [_term(speedup[name][h] / (1.0 if h == current[name] else 1.0 + min_gain),
                       fairness) for h in range(high + 1)]
        step, choice = {}, {}
        for used, value in best.items():
            for hosts in range(low, min(high, budget - used) + 1):
                candidate = value + terms[hosts]
                if used + hosts not in step or candidate > step[used + hosts] + 1e-12:
                    step[used + hosts] = candidate
                    choice[used + hosts] = (hosts, used)
        if not step:
            return None
        best = step
        choices.append((name, choice))
    used = max(best, key=best.get)
    counts = {}
    for name, choice in reversed(choices):
        counts[name], used = choice[used]
    return counts


def _repair(admitted, current, fixed, ranges, lows, speedup, fairness, total):
    """The counts closest to what each job has that the pool allows: jobs keep their hosts
    (within their range), new jobs get their minimum, and where that is too many, a host is
    taken in turn from the job that loses least by it (fixed jobs last, largest first)."""
    counts = {}
    for job in admitted:
        name = job.name
        if name in fixed:
            counts[name] = fixed[name]
        else:
            have = len(current[name])
            counts[name] = max(ranges[name][0], min(have, ranges[name][1])) if have \
                else ranges[name][0]

    def loss(name):
        return (_term(speedup[name][counts[name]], fairness)
                - _term(speedup[name][counts[name] - 1], fairness))
    while sum(counts.values()) > total:
        above = [n for n in ranges if counts[n] > lows[n]]
        if above:
            name = min(above, key=loss)
        else:
            name = max((n for n in fixed if counts[n] > lows[n]), key=lambda n: counts[n])
        counts[name] -= 1
    return counts


def _hosts(admitted, current, counts, pool_order, held):
    """From counts to hosts: each job keeps its oldest hosts, then takes free ones, those no
    other job holds first."""
    hosts, taken = {}, set()
    for job in admitted:
        keep = current[job.name][:counts[job.name]]
        hosts[job.name] = list(keep)
        taken.update(keep)
    for job in admitted:
        want = counts[job.name] - len(hosts[job.name])
        if want <= 0:
            continue
        free = [h for h in pool_order if h not in taken]
        free.sort(key=lambda h: bool(held.get(h, set()) - {job.name}))   # stable: pool order
        hosts[job.name] += free[:want]
        taken.update(free[:want])
    return hosts
