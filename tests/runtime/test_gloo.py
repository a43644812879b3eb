"""_runtime/gloo.py in one process: the meeting on a key-value store like horovodrun's, the
next world asked for, the proxy that answers rank_and_size, the start timeout's checks."""
import os
import threading

import pytest

from hvd_adapt._runtime import gloo
from hvd_adapt._runtime.rendezvous import RESET_KEY, RESET_SCOPE, LauncherGone, RendezvousServer
from support.gloo_store import Store


def meeting(store, rank, size, results, **kwargs):
    thread = threading.Thread(target=lambda: results.append(
        (rank, gloo.meet(store, rank, size, f"h{rank}".encode(), **kwargs))))
    thread.start()
    return thread


def test_ranks_meet_once_all_have_started(store):
    met = []
    first = meeting(store, 0, 3, met, wait=30)
    late = meeting(store, 2, 3, met)
    assert first.is_alive() and late.is_alive()          # rank 1 has not started
    assert gloo.meet(store, 1, 3, b"h1") == gloo.GO
    first.join(30)
    late.join(30)
    assert sorted(met) == [(0, gloo.GO), (2, gloo.GO)]
    assert store.get(gloo.START_SCOPE, "1") == b"h1"     # the mark a reset checks


def test_rank_0_sends_a_world_short_of_a_rank_to_the_driver(store):
    # Rank 2's launch failed (or it starts slowly): after `wait`, rank 0 says "again", and
    # every rank there asks the driver for the next world.
    met = []
    follower = meeting(store, 1, 3, met)
    assert gloo.meet(store, 0, 3, b"h0", wait=0.3) == gloo.AGAIN
    follower.join(30)
    assert met == [(1, gloo.AGAIN)]
    # Rank 2, arriving late, follows the verdict too.
    assert gloo.meet(store, 2, 3, b"h2") == gloo.AGAIN


def test_a_rank_already_in_gloos_rendezvous_has_started(store):
    # The survivors of a reset of Horovod's own hvd.elastic.run enter Gloo's rendezvous
    # without meeting (no verdict comes): a joiner's meeting finds them there.
    store.put(gloo.GLOO_GLOBAL_SCOPE, "0", b"address")
    assert gloo.meet(store, 1, 2, b"h1") == gloo.GO
    # Nor does a new rank 0 send such survivors away (rank 3 here): it waits for the rest,
    # then goes.
    store.put(gloo.GLOO_GLOBAL_SCOPE, "3", b"address")
    assert gloo.meet(store, 0, 4, b"h0", wait=0.1, timeout=0.5) == gloo.GO


def test_a_worker_whose_world_moved_on_during_its_meeting_trusts_no_verdict(store):
    # Cut off in its meeting, the driver formed the next world without it; healed, it reads
    # that world's verdict, but its own mark is gone with the world it was in.
    outcome = []

    def follow():
        try:
            outcome.append(gloo.meet(store, 1, 3, b"h1"))
        except LauncherGone as e:
            outcome.append(str(e))

    follower = threading.Thread(target=follow)
    follower.start()
    while store.get(gloo.START_SCOPE, "1") is None:
        pass
    Store.data.clear()                                  # the driver's next world
    store.put(gloo.START_SCOPE, gloo.VERDICT_KEY, gloo.GO)
    follower.join(30)
    assert len(outcome) == 1 and "formed the next world without it" in outcome[0], outcome


def test_a_launch_that_is_not_elastic_never_asks_a_driver(store):
    assert gloo.meet(store, 1, 2, b"h1", wait=None, timeout=0.3) == gloo.GO
    assert store.get(gloo.START_SCOPE, "1") == b"h1"
    assert gloo.meet(store, 0, 3, b"h0", wait=None, timeout=0.3) == gloo.GO


def test_ranks_whose_rank_0_never_comes_leave_and_a_late_rank_0_follows(store):
    assert gloo.meet(store, 1, 2, b"h1", timeout=0.3) == gloo.AGAIN
    assert store.get(gloo.START_SCOPE, "1") == gloo.LEFT
    assert gloo.meet(store, 0, 2, b"h0", wait=30) == gloo.AGAIN


def test_the_next_world_is_asked_for_after_the_marker_and_only_by_a_worker_of_the_last(
        store, monkeypatch):
    monkeypatch.setenv("HOROVOD_HOSTNAME", "h2")
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "0")
    store.put("rank_and_size", "h2:0", b"1,2,0,1,1,2")
    store.put(gloo.START_SCOPE, "2", b"h2:0:42")
    assert gloo.ask_for_next_world(store, b"h2:0:42", 2) == b"1,2,0,1,1,2"
    assert store.get(RESET_SCOPE, RESET_KEY) == b"1"
    # The driver formed a world without this worker while it could not reach the launcher
    # (its mark there is another's): it must not answer for its old slot.
    store.put(gloo.START_SCOPE, "2", b"h1:0:7")
    with pytest.raises(LauncherGone, match="formed the next world without it"):
        gloo.ask_for_next_world(store, b"h2:0:42", 2)


def test_a_new_worker_sent_to_the_driver_takes_its_next_slot(store, monkeypatch):
    # Rank 0 said "again" before this (slow) new worker arrived: it asks the driver for the
    # next world itself, and its first hvd.init() reads that slot from the environment.
    address = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": store.address,
               "HOROVOD_GLOO_RENDEZVOUS_PORT": str(store.port), "HOROVOD_HOSTNAME": "h2",
               "HOROVOD_LOCAL_RANK": "0", "HOROVOD_RANK": "2", "HOROVOD_SIZE": "3",
               "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": "2", "HOROVOD_CROSS_SIZE": "1"}
    for name, value in address.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HOROVOD_GLOO_IFACE", raising=False)
    store.put(gloo.START_SCOPE, gloo.VERDICT_KEY, gloo.AGAIN)
    store.put("rank_and_size", "h2:0", b"0,1,0,1,0,1")
    seen = []
    gloo.init_world(lambda: seen.append({name: os.environ[name] for name in
                                         gloo.SLOT_VARIABLES}))
    assert seen == [{"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1", "HOROVOD_LOCAL_RANK": "0",
                     "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": "0",
                     "HOROVOD_CROSS_SIZE": "1"}]


def test_the_proxy_answers_rank_and_size_and_passes_the_rest_on(store):
    with gloo._RankAndSizeProxy(store, b"1,3,0,1,1,3") as proxy:
        via = RendezvousServer(*proxy.server_address)
        assert via.get("rank_and_size", "h2:0") == b"1,3,0,1,1,3"
        assert store.get("rank_and_size", "h2:0") is None    # the driver was not asked again
        via.put("global", "1", b"address")
        assert store.get("global", "1") == b"address"
        assert via.get("global", "2") is None


@pytest.mark.parametrize("value", ["0", "-3", "soon", "inf"])
def test_a_bad_start_timeout_is_named(monkeypatch, value):
    monkeypatch.setenv(gloo.START_TIMEOUT_VARIABLE, value)
    with pytest.raises(ValueError, match=f"HVD_ADAPT_START_TIMEOUT_SECONDS must be a number of "
                                         f"seconds > 0, got '{value}'"):
        gloo.start_timeout()


def test_a_bad_gloo_timeout_is_named_before_the_watchdog_uses_it(monkeypatch):
    monkeypatch.setenv(gloo.TIMEOUT_VARIABLE, "5s")
    with pytest.raises(ValueError, match="HOROVOD_GLOO_TIMEOUT_SECONDS must be a number of "
                                         "seconds > 0, got '5s'"):
        gloo.collective_timeout()
    monkeypatch.delenv(gloo.TIMEOUT_VARIABLE)
    assert gloo.collective_timeout() == gloo.COLLECTIVE_TIMEOUT_SECONDS
