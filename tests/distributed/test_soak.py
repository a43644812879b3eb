"""The seeded soaks (soak.py) in short: a few events of every kind."""
import os

import pytest

from support.soak import KINDS, make_schedule, soak

pytestmark = [pytest.mark.distributed, pytest.mark.elastic]


def test_schedule_is_drawn_from_the_seed():
    assert make_schedule(6, seed=3) == make_schedule(6, seed=3)
    assert make_schedule(6, seed=3) != make_schedule(6, seed=4)
    hosts, resizes, kills = make_schedule(40, seed=5)
    assert len(resizes) + len(kills) == 40
    assert any(k["mid_cycle"] for k in kills) and any(not k["mid_cycle"] for k in kills)
    assert any(k["rank"] == 0 for k in kills)
    assert all(len(hosts) == 2 for _, hosts in resizes)


def test_six_random_events():
    # HVD_ADAPT_SOAK_SEED replays a seed printed by a failing soak.
    seed = int(os.environ.get("HVD_ADAPT_SOAK_SEED", "8"))
    summary = soak(6, seed)
    print(summary)
    assert summary["kills_fired"] >= 1 and len(set(summary["sizes"])) >= 2, summary


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "mixed"])
def test_two_events_of_each_kind(kind):
    summary = soak(2, seed=11, kind=kind)
    print(summary)
    if kind in ("kill_after_sync", "kill_in_checkpoint"):
        assert summary["kills_fired"] == 2, summary
    if kind == "kill_after_sync":
        assert summary["restore_points_checked"] >= 2, summary
    if kind == "kill_in_checkpoint":
        assert summary["checkpoint_ages_checked"] >= 2, summary
    if kind == "drain":
        assert len(summary["signal_to_exit"]) == 2, summary
