"""_runtime/liveness.py: when a worker is ended, from the evidence each rule sees (no process,
no cluster: what the watchdog, the reset and hvd-adapt-discover would observe)."""
import os
import signal
import subprocess
import sys
import threading
import time

from hvd_adapt._runtime import liveness


def polls(judge, start, end, **seen):
    """The reasons the judge gives at each second from ``start`` to ``end`` (exclusive)."""
    return [judge.observe(t, **seen) for t in range(start, end)]


def test_a_computing_worker_is_never_ended_however_long_its_peers_wait():
    # Rank 0 evaluating alone while its peers reset: its heartbeat beats throughout.
    judge = liveness.Judge()
    assert all(judge.observe(t, marker=True, beats=4 * t, cpu=float(t)) is None
               for t in range(3600))


def test_a_worker_computing_while_it_holds_the_gil_is_not_wedged():
    # A long C call that holds the GIL silences the heartbeat thread, but the process uses
    # the CPU: it computes.
    judge = liveness.Judge()
    assert judge.observe(0, marker=True, beats=1, cpu=0.0) is None
    assert all(reason is None for reason in
               (judge.observe(t, marker=True, beats=1, cpu=0.9 * t) for t in range(1, 600)))


def test_a_wedged_worker_is_ended_once_its_peers_reset():
    judge = liveness.Judge(silent_seconds=5)
    assert judge.observe(0, beats=7, cpu=3.0) is None
    # Silent and idle, but its peers train on: nothing shows it holds anyone up.
    assert polls(judge, 1, 20, beats=7, cpu=3.0) == [None] * 19
    reason = judge.observe(20, marker=True, beats=7, cpu=3.05)
    assert "heartbeat has been silent for 20 s" in reason and "while its peers reset" in reason


def test_a_wedged_worker_whose_threads_wait_for_the_gil_is_ended_however_long_its_silence():
    # The process's other threads wake for the GIL every 5 ms (16 of them: 0.07 s of CPU
    # in 5 s, measured here): a little CPU that adds up over a long silence, and no
    # computing.
    judge = liveness.Judge(silent_seconds=5)
    assert judge.observe(0, beats=7, cpu=3.0) is None
    assert polls(judge, 1, 600, beats=7, cpu=3.0) == [None] * 599
    assert "heartbeat has been silent for 600 s" in judge.observe(
        600, marker=True, beats=7, cpu=3.0 + 0.014 * 600)


def test_a_heartbeat_that_beats_again_restarts_the_count():
    judge = liveness.Judge(silent_seconds=5)
    assert polls(judge, 0, 4, marker=True, beats=1) == [None] * 4
    assert polls(judge, 4, 8, marker=True, beats=2) == [None] * 4
    assert judge.observe(9, marker=True, beats=2) is not None


def test_a_stopped_worker_is_ended_only_once_its_peers_reset():
    judge = liveness.Judge()
    assert polls(judge, 0, 30, state="T", beats=1) == [None] * 30
    # Stopped for as long before its peers reset: ended at their first sign, and named so.
    assert "stopped (/proc state T) while its peers reset (seen stopped at 30 polls in a row" \
        in judge.observe(30, marker=True, state="T", beats=1)
    judge = liveness.Judge()
    assert polls(judge, 0, 2, marker=True, state="t", beats=1) == [None] * 2
    assert "state t" in judge.observe(2, marker=True, state="t", beats=1)


def test_a_worker_paused_for_moments_on_a_loaded_machine_is_not_stopped():
    # SIGSTOP and SIGCONT in turn on busy cores: a poll may find it stopped without a beat
    # since the poll before, but the next finds it running, or beating.
    judge = liveness.Judge()
    beats, seen = 0, [judge.observe(0, marker=True, state="S", beats=0)]
    for t in range(1, 3600):
        beats += t % 2 == 0      # a beat between every other pair of polls, none between the rest
        seen.append(judge.observe(t, marker=True, state="T", beats=beats))
    assert seen == [None] * len(seen)


def test_a_worker_seen_stopped_whose_heartbeat_beats_is_not_stopped():
    # A profiler's samples pause it for moments (state t), and it beats between them.
    judge = liveness.Judge()
    assert judge.observe(0, marker=True, state="t", beats=0) is None
    assert all(judge.observe(t, marker=True, state="T", beats=t) is None
               for t in range(1, 3600))


def test_a_launcher_that_does_not_answer_ends_nothing_however_long():
    # An outage of the launcher's link: the server says nothing, and nothing is known of
    # the peers; even a stopped, silent worker is left alone (its peers' reset, if any,
    # waits for the launcher as well).
    judge = liveness.Judge()
    assert polls(judge, 0, 3600, reached="silent", state="T") == [None] * 3600


def test_a_launcher_that_refuses_twice_in_a_row_is_gone():
    judge = liveness.Judge("the rendezvous server 10.0.0.1:1234")
    assert judge.observe(0, reached="refused") is None
    assert judge.observe(1, reached="answered") is None       # one refusal: a hiccup
    assert judge.observe(2, reached="refused") is None
    assert judge.observe(3, reached="silent") is None
    assert judge.observe(4, reached="refused") is None
    assert judge.observe(5, reached="refused") == (
        "the rendezvous server 10.0.0.1:1234 refused 2 connections in a row: horovodrun is "
        "gone")


def test_a_worker_whose_launcher_session_is_gone_is_ended_at_once():
    reason = liveness.Judge().observe(0, closed_streams=["standard output"], reached="silent")
    assert reason.startswith("the launcher's session to it is gone (its standard output "
                             "has no reader")


def test_a_worker_is_left_behind_only_when_its_world_is_gone():
    assert liveness.left_behind(b"h3:0:42", b"h3:0:42") is None
    assert "the driver formed the next world without it" in liveness.left_behind(
        b"h3:0:42", None)
    assert "found b'h1:0:7'" in liveness.left_behind(b"h3:0:42", b"h1:0:7")


def test_a_silent_host_is_lost_only_when_its_peers_reset_without_it():
    args = dict(lost_after=2, min_probes=2, port=22)
    assert liveness.host_lost("h3", 1.0, 2, peers_reset=True, others_answer=True, **args) == (False, None)
    assert liveness.host_lost("h3", 5.0, 1, peers_reset=True, others_answer=True, **args) == (False, None)
    lost, reason = liveness.host_lost("h3", 5.0, 3, peers_reset=False, others_answer=True,
                                      **args)
    assert not lost and "no worker of the job has reset: keeping its sessions" in reason
    # Every host silent: the launcher's own link, even while a reset is under way.
    lost, reason = liveness.host_lost("h3", 5.0, 3, peers_reset=True, others_answer=False,
                                      **args)
    assert not lost and "nor does any other host of the job" in reason
    lost, reason = liveness.host_lost("h3", 5.0, 3, peers_reset=True, others_answer=True,
                                      **args)
    assert lost and "while the job's workers reset without it" in reason


def test_process_state_counts_the_cpu_of_every_thread():
    state, cpu = liveness.process_state(os.getpid())
    assert state == "R"
    sum(range(3 * 10 ** 7))     # computes in C, holding the GIL
    assert liveness.process_state(os.getpid())[1] > cpu
    # Another thread holds the GIL and computes while the main thread waits for it: the
    # judge must not count the process idle.
    cpu, started = liveness.process_state(os.getpid())[1], time.monotonic()
    computing = threading.Thread(target=lambda: sum(range(10 ** 8)))
    computing.start()
    computing.join()
    used = liveness.process_state(os.getpid())[1] - cpu
    assert used >= liveness.IDLE_CPU_SHARE * (time.monotonic() - started)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(200):
            if liveness.process_state(child.pid)[0] == "T":
                break
            time.sleep(0.01)
        assert liveness.process_state(child.pid)[0] == "T"
    finally:
        child.kill()
        child.wait()
    assert liveness.process_state(child.pid) == (None, None)
