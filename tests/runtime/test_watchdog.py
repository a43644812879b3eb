"""_runtime/watchdog.py without a cluster: the watchdog process beside a real stand-in worker,
over a key-value store like horovodrun's, ending it on each kind of evidence
(_runtime/liveness.py) and on none other."""
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time

import pytest

from hvd_adapt._runtime import liveness
from hvd_adapt._runtime.rendezvous import RESET_KEY, RESET_SCOPE
from support.launch import alive
from support.silent_host import silent_listener

WORKER = textwrap.dedent("""
    import sys, time
    from hvd_adapt._runtime import watchdog
    from hvd_adapt._runtime.rendezvous import RendezvousServer
    beacon = watchdog.start()
    if sys.argv[3] == "no_stdout":
        print(beacon.process.pid, flush=True)
        import os
        os.close(1)
    if sys.argv[3] == "not_elastic":
        beacon.close()
        print(beacon.process.pid, flush=True)
        beacon.process.wait()
        print("watchdog ended", beacon.process.returncode, flush=True)
        time.sleep(600)
    beacon.watch(RendezvousServer(sys.argv[1], sys.argv[2]))
    if sys.argv[3] != "no_stdout":
        print(beacon.process.pid, flush=True)
    if sys.argv[3] == "wedged":
        import ctypes
        ctypes.PyDLL(None).sleep(600)   # holds the GIL, uses no CPU: a wedged interpreter
    if sys.argv[3] == "thread_computes":
        # Another thread computes in C, holding the GIL (a sort, a json.loads of a large
        # index in a prefetch thread); the main thread only waits for it.
        import threading
        computing = threading.Thread(target=lambda: sum(range(10 ** 13)))
        computing.start()
        computing.join()
    time.sleep(600)
""")


def stand_in_worker(address, port, mode="training"):
    """A process that starts its watchdog and sleeps (its heartbeat beats) or wedges, its
    standard output and error pipes to this test; it and its watchdog's pid."""
    proc = subprocess.Popen([sys.executable, "-c", WORKER, address, str(port), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def ended(proc, timeout=60):
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the worker was not ended within {timeout} s: {proc.stderr.read()}")
    assert proc.returncode == -signal.SIGKILL
    return proc.stderr.read()


def still_running(proc, polls=8):
    """Whether ``proc`` is alive after ``polls`` of its watchdog."""
    time.sleep(polls * liveness.POLL_SECONDS)
    running = proc.poll() is None
    proc.kill()
    proc.wait()
    return running


def test_a_stopped_worker_is_ended_once_its_peers_reset(store):
    proc, _ = stand_in_worker(store.address, store.port)
    os.kill(proc.pid, signal.SIGSTOP)
    store.put(RESET_SCOPE, RESET_KEY, b"1")
    assert "stopped (/proc state T) while its peers reset" in ended(proc)


def test_a_worker_paused_for_moments_is_not_stopped(store):
    # A sampling profiler (py-spy pauses the process at each sample) or cpulimit (SIGSTOP and
    # SIGCONT in turn) leaves it in state T or t for moments: a poll may see it stopped,
    # yet it goes on, its heartbeat beating between the pauses.
    store.put(RESET_SCOPE, RESET_KEY, b"1")
    proc, _ = stand_in_worker(store.address, store.port)
    deadline = time.monotonic() + 8 * liveness.POLL_SECONDS
    while time.monotonic() < deadline and proc.poll() is None:
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.05)
    assert still_running(proc, polls=1), proc.stderr.read()


def test_a_wedged_worker_is_ended_once_its_peers_reset(store):
    proc, _ = stand_in_worker(store.address, store.port, "wedged")
    store.put(RESET_SCOPE, RESET_KEY, b"1")
    assert "its heartbeat has been silent for" in ended(proc)


def test_a_worker_that_beats_is_never_ended_while_its_peers_reset(store):
    store.put(RESET_SCOPE, RESET_KEY, b"1")
    proc, _ = stand_in_worker(store.address, store.port)
    assert still_running(proc, polls=2 * liveness.SILENT_SECONDS)


def test_a_worker_whose_other_thread_computes_holding_the_gil_is_not_wedged(store):
    # Its heartbeat is silent and its main thread idle, but the process uses the CPU: it
    # computes, and is never ended however long its peers reset.
    store.put(RESET_SCOPE, RESET_KEY, b"1")
    proc, _ = stand_in_worker(store.address, store.port, "thread_computes")
    assert still_running(proc, polls=2 * liveness.SILENT_SECONDS)


def test_a_worker_whose_launcher_does_not_answer_trains_on():
    # A listener whose accept queue is full: connections hear nothing, as from a launcher
    # whose link is down.
    with socket.socket() as probe:
        probe.bind(("127.0.0.9", 0))
        port = probe.getsockname()[1]
    sockets = silent_listener("127.0.0.9", port)
    try:
        proc, _ = stand_in_worker("127.0.0.9", port)
        assert still_running(proc, polls=12)
    finally:
        for sock in sockets:
            sock.close()


def test_a_worker_whose_launcher_refuses_is_ended():
    # A port nobody listens on: every connection is refused, as where horovodrun is gone.
    proc, _ = stand_in_worker("127.0.0.1", 9)
    assert "refused 2 connections in a row: horovodrun is gone" in ended(proc)


def test_a_worker_whose_launcher_session_is_gone_is_ended(store):
    proc, _ = stand_in_worker(store.address, store.port)
    proc.stdout.close()     # as sshd's end of the pipe when horovodrun's ssh ends
    assert "the launcher's session to it is gone (its standard output has no reader" in \
        ended(proc)


def test_a_worker_without_a_standard_output_is_watched_on_the_rest(store):
    proc, _ = stand_in_worker(store.address, store.port, "no_stdout")
    proc.stderr.close()     # its one stream with a reader loses it
    try:
        proc.wait(60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL


def test_a_worker_that_finds_hvd_adapt_on_its_own_path_gets_its_watchdog(store, tmp_path):
    # hvd_adapt not installed: the script puts the project's checkout on its sys.path (as
    # research code does), so the watchdog must import it from there as well. The base
    # interpreter, with the packages of this one but not their .pth files (hvd_adapt's
    # editable install), is such an environment.
    root = os.path.dirname(os.path.dirname(os.path.abspath(liveness.__file__)))
    env = dict(os.environ, PYTHONPATH=sysconfig.get_paths()["purelib"])
    python = os.path.realpath(sys.executable)
    probe = subprocess.run([python, "-c", "import hvd_adapt"], cwd=tmp_path, env=env,
                           capture_output=True)
    if probe.returncode == 0:
        pytest.skip("hvd_adapt is importable here without the script's path")
    code = f"import sys; sys.path.insert(0, {os.path.dirname(root)!r})\n" + WORKER
    proc = subprocess.Popen([python, "-c", code, store.address, str(store.port), "training"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.strip().isdigit(), proc.stderr.read() if proc.wait(60) is not None else line
    proc.stdout.close()     # the launcher goes: its watchdog, running, ends it
    assert "the launcher's session to it is gone" in ended(proc)


def test_a_watchdog_told_nothing_to_watch_ends(store):
    # A standby starts its watchdog before its hand-over; handed a launch that is not
    # elastic, it closes the watchdog's socket.
    proc, _ = stand_in_worker(store.address, store.port, "not_elastic")
    assert proc.stdout.readline() == "watchdog ended 0\n"
    proc.kill()
    proc.wait()


def test_the_watchdog_dies_with_its_worker(store):
    proc, guard = stand_in_worker(store.address, store.port)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while alive(guard) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(guard)
