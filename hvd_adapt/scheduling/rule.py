"""Which hosts pay: from a job's published speed-up curve to the hosts to offer it.

The rule is AdaptDL's for a job alone on its hosts: add workers while each
adds at least ``efficiency`` (default 0.5) of one worker's goodput, i.e.
while the marginal speed-up per added worker stays >= efficiency. Around it:

- growth at most ``growth_limit`` (2) x the largest replica count the job
  has timed: beyond it the curve is the throughput model's extrapolation,
  whose communication terms are unmeasured (Pollux bounds it alike);
- hysteresis: change only for >= ``min_gain`` (5%) predicted gain (goodput
  when growing, goodput per worker when shrinking) and by >= ``min_change``
  (15%) of the current replicas (at least one), so a noisy fit does not
  resize the job back and forth (each resize stops it for a while);
- hosts already in the job first, new ones after, in the base discovery's
  order: Horovod's driver fails with "No hosts from previous set remaining"
  when none of the previous hosts is left, and a shrink removes the newest.

Standard library only.

>>> curve = [{"replicas": r, "speedup": s, "goodput": 100.0 * s}
...          for r, s in [(1, 1.0), (2, 1.9), (3, 2.2), (4, 2.4)]]
>>> rule = DiscoveryRule()
>>> rule.target(curve, minimum=1, limit=4, slots_per_node=1)   # the third adds 0.3 < 0.5
2
>>> assign([("a", 1), ("b", 1), ("c", 1)], 2)
[('a', 1), ('b', 1)]
"""
import math


class DiscoveryRule:
    """The rule's settings; each is checked, naming the bad value and its allowed range."""

    def __init__(self, efficiency=0.5, min_gain=0.05, min_change=0.15, growth_limit=2.0):
        for name, value, low, high in (("efficiency", efficiency, 0.0, 1.0),
                                       ("min_gain", min_gain, 0.0, 10.0),
                                       ("min_change", min_change, 0.0, 10.0),
                                       ("growth_limit", growth_limit, 1.0, 1000.0)):
            if not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
        self.efficiency = float(efficiency)
        self.min_gain = float(min_gain)
        self.min_change = float(min_change)
        self.growth_limit = float(growth_limit)

    def growth_cap(self, replica_counts_timed, current):
        """The most replicas to offer: growth_limit x the largest count timed (never below
        ``current``: the rule does not shrink a job for having grown)."""
        timed = max(replica_counts_timed, default=current)
        return max(current, math.floor(self.growth_limit * max(timed, 1)))

    def target(self, curve, minimum, limit, slots_per_node):
        """Replicas that pay: from ``minimum`` up, add workers while the speed-up per added
        worker stays >= efficiency, up to ``limit``. A worker that opens a new node may
        not pay alone where the node's first ``slots_per_node`` workers together do, so
        steps of up to a node's worth count as one."""
        speedup = {int(e["replicas"]): float(e["speedup"]) for e in curve}
        limit = min(limit, max(speedup, default=minimum))
        replicas = minimum
        while replicas < limit:
            for step in range(1, max(1, slots_per_node) + 1):
                bigger = replicas + step
                if bigger > limit or bigger not in speedup or replicas not in speedup:
                    return replicas
                if (speedup[bigger] - speedup[replicas]) / step >= self.efficiency:
                    replicas = bigger
                    break
            else:
                return replicas
        return replicas

    def worth_changing(self, curve, current, target):
        """Hysteresis: True when moving from ``current`` to ``target`` replicas changes them
        by >= min_change of current (at least one) and gains >= min_gain: in goodput when
        growing, in goodput per worker when shrinking."""
        if target == current:
            return False
        if abs(target - current) < max(1, math.ceil(self.min_change * current - 1e-9)):
            return False
        goodput = {int(e["replicas"]): float(e["goodput"]) for e in curve}
        if current not in goodput or target not in goodput:
            return False
        if target > current:
            return goodput[target] >= (1 + self.min_gain) * goodput[current]
        return goodput[target] / target >= (1 + self.min_gain) * goodput[current] / current


def assign(candidates, replicas):
    """``(host, slots)`` for ``replicas`` workers from ``candidates`` ``[(host, capacity)]``,
    taken in order (the last one possibly in part)."""
    hosts, left = [], replicas
    for host, capacity in candidates:
        if left <= 0:
            break
        take = min(capacity, left)
        if take > 0:
            hosts.append((host, take))
            left -= take
    return hosts
