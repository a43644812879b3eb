"""_runtime/watchdog.py without a cluster: the watchdog's decision at each poll (Judge), and
its process beside a real stand-in worker over a key-value store like horovodrun's."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hvd_adapt._runtime import watchdog
from processes import alive
from test_runtime_gloo import Store, store  # noqa: F401  (the store fixture)


def observe(judge, t, answered=True, marker=False, step=0.0, resets=0, in_reset=0,
            stopped=False):
    return judge.observe(t, answered, marker, step, resets, in_reset, stopped)


def test_a_stopped_worker_behind_its_peers_is_killed_at_once():
    judge = watchdog.Judge(collective_timeout=5)
    assert observe(judge, 0.0) is None                      # training: no marker
    assert observe(judge, 1.0, stopped=True) is None        # stopped, peers not resetting
    assert "stopped" in observe(judge, 2.0, marker=True, stopped=True)


def test_a_running_worker_behind_its_peers_gets_the_grace():
    judge = watchdog.Judge(collective_timeout=5, grace_floor=5)
    assert judge.grace(0.5) == 10 and judge.grace(8) == 21
    for t in range(10, 30):                                  # steps of 8 s: 21 s of grace
        assert observe(judge, t, marker=True, step=8.0) is None
    assert "did not follow within 21 s" in observe(judge, 31, marker=True, step=8.0)


def test_a_worker_that_follows_its_peers_is_never_killed():
    judge = watchdog.Judge(collective_timeout=5, grace_floor=5)
    for t in range(0, 8):
        assert observe(judge, t, marker=True) is None
    # It reached its reset, and stopped there (waiting for the driver): never behind.
    for t in range(8, 100):
        assert observe(judge, t, marker=True, resets=1, in_reset=1, stopped=t > 50) is None
    # Its reset done, a marker of the last world may still be read once (the poll raced
    # the driver's clearing of the store); the grace restarts from there.
    for t in range(100, 109):
        assert observe(judge, t, marker=True, resets=1) is None
    assert observe(judge, 109, marker=False, resets=1) is None
    assert observe(judge, 110, marker=True, resets=1) is None


def test_an_unreachable_server_ends_the_worker_after_the_bound():
    judge = watchdog.Judge(collective_timeout=5, unreachable=10)
    for t in range(0, 10):
        assert observe(judge, t, answered=False) is None
    assert observe(judge, 10.5, answered=True) is None       # back: the count restarts
    for t in range(11, 21):
        assert observe(judge, t, answered=False, marker=True, stopped=True) is None
    assert "not answered for 10 s" in observe(judge, 21, answered=False)


def test_the_step_time_is_a_slowly_decaying_maximum():
    beacon = watchdog.Beacon(server=None)
    beacon.last_step = time.monotonic() - 4
    beacon.step_done()
    step, resets, in_reset = watchdog.read_page(beacon.page)
    assert step >= 4 and (resets, in_reset) == (0, 0)
    beacon.step_done()                                       # one quick step
    assert watchdog.read_page(beacon.page)[0] >= 0.9 * 4


def test_a_worker_restoring_before_its_reset_is_not_behind():
    beacon = watchdog.Beacon(server=None)
    beacon.leaving_training()    # no marker of its own yet: that comes with the reset
    assert watchdog.read_page(beacon.page)[2] == 1


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan"])
def test_a_bad_setting_is_named_in_the_worker(monkeypatch, value):
    monkeypatch.setenv(watchdog.GRACE_VARIABLE, value)
    with pytest.raises(ValueError, match=f"HVD_ADAPT_HANG_GRACE_SECONDS must be a number of "
                                         f"seconds > 0, got '{value}'"):
        watchdog.start(None, 5)


WORKER = textwrap.dedent("""
    import sys, time
    from hvd_adapt._runtime import gloo, watchdog
    beacon = watchdog.start(gloo.RendezvousServer(sys.argv[1], sys.argv[2]), 1)
    if sys.argv[3] == "in_reset":
        beacon.entering_reset()
    print(beacon.process.pid, flush=True)
    time.sleep(600)
""")


def stand_in_worker(store, mode="training", **env):
    """A process that starts its watchdog (Gloo timeout 1 s here) and sleeps; its pid and
    its watchdog's."""
    proc = subprocess.Popen([sys.executable, "-c", WORKER, store.address, str(store.port), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **env))
    return proc, int(proc.stdout.readline())


def wait_for_end(proc, timeout=60):
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the worker was not killed within {timeout} s: {proc.stderr.read()}")
    return proc.returncode, proc.stderr.read()


def test_the_watchdog_kills_a_stopped_worker_once_its_peers_reset(store):
    proc, guard = stand_in_worker(store)
    os.kill(proc.pid, signal.SIGSTOP)
    store.put(watchdog.RESET_SCOPE, watchdog.RESET_KEY, b"1")
    code, err = wait_for_end(proc)
    assert code == -signal.SIGKILL and "stopped while its peers reset" in err


def test_the_watchdog_kills_a_running_worker_after_the_grace(store):
    proc, guard = stand_in_worker(store, **{watchdog.GRACE_VARIABLE: "1"})
    store.put(watchdog.RESET_SCOPE, watchdog.RESET_KEY, b"1")
    code, err = wait_for_end(proc)
    assert code == -signal.SIGKILL and "did not follow within 2 s" in err


def test_the_watchdog_kills_its_worker_when_the_server_is_gone():
    # A port nobody listens on: every request is refused, as from a cut-off host.
    server = watchdog.RendezvousServer("127.0.0.1", 9)
    proc, guard = stand_in_worker(server, **{watchdog.UNREACHABLE_VARIABLE: "2"})
    code, err = wait_for_end(proc)
    assert code == -signal.SIGKILL and "has not answered" in err


def test_the_watchdog_dies_with_its_worker_and_spares_one_in_a_reset(store):
    proc, guard = stand_in_worker(store, "in_reset", **{watchdog.GRACE_VARIABLE: "1"})
    store.put(watchdog.RESET_SCOPE, watchdog.RESET_KEY, b"1")
    os.kill(proc.pid, signal.SIGSTOP)    # waiting in its reset, stopped: not behind
    time.sleep(4 * watchdog.POLL_SECONDS)
    assert alive(proc.pid) and alive(guard)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while alive(guard) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(guard)
