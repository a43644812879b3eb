"""The discovery rule against hand-computed curves."""
import pytest

from hvd_adapt.scheduling.rule import DiscoveryRule, assign


def curve(speedups, single=100.0):
    return [{"replicas": r, "speedup": s, "goodput": single * s}
            for r, s in enumerate(speedups, 1)]


def test_adds_workers_while_each_adds_half_a_worker():
    rule = DiscoveryRule()
    # Marginal speed-ups 0.9, 0.8, 0.49: the fourth worker adds less than half of one.
    assert rule.target(curve([1.0, 1.9, 2.7, 3.19]), minimum=1, limit=8, slots_per_node=1) == 3
    # Exactly 0.5 pays.
    assert rule.target(curve([1.0, 1.5, 2.0]), minimum=1, limit=8, slots_per_node=1) == 3
    assert DiscoveryRule(efficiency=0.8).target(curve([1.0, 1.9, 2.7, 3.19]), 1, 8, 1) == 3
    assert DiscoveryRule(efficiency=0.85).target(curve([1.0, 1.9, 2.7, 3.19]), 1, 8, 1) == 2


def test_communication_bound_curve_stays_at_its_minimum():
    rule = DiscoveryRule()
    assert rule.target(curve([1.0, 0.8, 0.9, 1.0]), minimum=1, limit=4, slots_per_node=1) == 1
    assert rule.target(curve([1.0, 0.8, 0.9, 1.0]), minimum=2, limit=4, slots_per_node=1) == 2


def test_a_new_node_counts_its_workers_together():
    # Two slots a node: the third worker opens a node (+0.2 alone), the third and
    # fourth together add 1.6, 0.8 a worker.
    speedups = [1.0, 1.9, 2.1, 3.5, 3.6, 3.7]
    assert DiscoveryRule().target(curve(speedups), 1, 6, slots_per_node=2) == 4
    assert DiscoveryRule().target(curve(speedups), 1, 6, slots_per_node=1) == 2


def test_limit_and_curve_length_bound_the_target():
    linear = curve([1.0, 2.0, 3.0, 4.0])
    assert DiscoveryRule().target(linear, 1, limit=3, slots_per_node=1) == 3
    assert DiscoveryRule().target(linear, 1, limit=10, slots_per_node=1) == 4


def test_growth_cap_is_twice_the_largest_count_timed_and_never_below_current():
    rule = DiscoveryRule()
    assert rule.growth_cap([1], current=1) == 2
    assert rule.growth_cap([1, 3], current=3) == 6
    assert rule.growth_cap([1], current=4) == 4
    assert DiscoveryRule(growth_limit=1.5).growth_cap([2], current=2) == 3


def test_hysteresis_needs_fifteen_percent_of_the_replicas_and_five_percent_gain():
    rule = DiscoveryRule()
    # 10 -> 11 replicas is 10% of 10: not worth it, even for a large gain.
    big = curve([1.0] * 9 + [8.0, 9.5])
    assert not rule.worth_changing(big, current=10, target=11)
    # 4 -> 5 (25%): needs >= 5% more goodput.
    assert not rule.worth_changing(curve([1, 2, 3, 4.0, 4.19]), current=4, target=5)
    assert rule.worth_changing(curve([1, 2, 3, 4.0, 4.2]), current=4, target=5)
    # Shrinking 4 -> 2 needs >= 5% more goodput per worker: 0.95 a worker against 0.75.
    assert rule.worth_changing(curve([1, 1.9, 2.5, 3.0]), current=4, target=2)
    # 0.75 against 0.74: not worth it.
    assert not rule.worth_changing(curve([1, 1.5, 2.4, 2.96]), current=4, target=2)
    assert not rule.worth_changing(curve([1, 2]), current=2, target=2)


@pytest.mark.parametrize("name, value", [("efficiency", 1.5), ("efficiency", -0.1),
                                         ("min_gain", -1), ("growth_limit", 0.5),
                                         ("min_change", "x")])
def test_bad_settings_name_the_value_and_range(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be a number in \[.*\], got"):
        DiscoveryRule(**{name: value})


def test_assign_fills_in_order_the_last_in_part():
    assert assign([("a", 2), ("b", 2), ("c", 2)], 3) == [("a", 2), ("b", 1)]
    assert assign([("a", 2), ("b", 0), ("c", 2)], 4) == [("a", 2), ("c", 2)]
    assert assign([("a", 1)], 5) == [("a", 1)]
    assert assign([("a", 1)], 0) == []
