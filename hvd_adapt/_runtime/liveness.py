"""Liveness by evidence: the one place that says when an elastic worker is ended, and why.

A timer cannot tell a dead worker from a busy or an unreachable one: a rank
evaluating alone for minutes, a slow save, a long first step and a host whose
launcher link is down all look like silence. So a worker is ended only on
evidence that it cannot go on, and each decision returns the sentence that
names its evidence (the caller logs it). Three places act on these rules:

- **its watchdog** (``_runtime/watchdog.py``), a process beside the worker,
  at each poll (:class:`Judge`): the launcher's session to the worker is gone
  (its standard output or error has no reader any more: horovodrun, or the ssh
  that carried the command, ended); the rendezvous server refuses connections
  (horovodrun's process is gone); or its peers reset (their marker on the
  server) while the worker is stopped (``/proc`` state T at two polls in a row,
  its heartbeat silent since the poll before them: not a profiler's pause of a
  moment, nor such pauses on a loaded machine) or its own heartbeat
  (a thread of the training process) is silent while the process uses no
  CPU. A worker that computes beats and is never ended, however long it
  computes alone: it joins its peers' reset when its next collective fails, as
  in plain Horovod. A server that says nothing (an outage of the launcher's
  link) ends nothing, however long: the worker trains on with its peers and
  waits for the launcher at its next reset;
- **the worker's own reset** (``_runtime/gloo.py``): the server refuses
  connections (:class:`~.rendezvous.LauncherGone`), or the world the worker
  trained in is gone from the server (:func:`left_behind`): the driver formed
  the next world without it while it could not reach the launcher, and it
  would otherwise answer for a slot given to another worker;
- **hvd-adapt-discover** on the launcher's host, which ends the driver's ssh
  sessions to a host (:func:`host_lost`) only when that host has said nothing
  to its probes and the job's workers reset without it: a host silent while
  nobody resets is the launcher's own link down, not the host lost.

Standard library only.
"""
import os

# The watchdog's poll, and the heartbeat's period: a beat every quarter of a poll.
POLL_SECONDS = 1.0
BEAT_SECONDS = 0.25
# A heartbeat is silent once it has not beaten for this long (20 beats): a thread starved by
# a loaded machine for a moment is not a wedged interpreter.
SILENT_SECONDS = 5.0
# The share of a core the process may use, on average over that silence, and still count as
# idle: a thread blocked on a lock uses none, one computing in C while it holds the GIL uses
# all of a core. The whole process, not its main thread: the thread that holds the GIL may
# be any (a prefetch thread sorting or parsing an index while the main thread waits for
# it). A share, not an amount: a wedged interpreter's other threads still wake for the GIL
# every 5 ms (16 of them use 1.4% of a core), which adds up over a long silence.
IDLE_CPU_SHARE = 0.1
# Refusals in a row that end the worker: one refusal may be a port's hiccup, two a second
# apart are a launcher that is gone.
REFUSALS = 2
# Polls in a row that must see the worker stopped, its heartbeat silent all the while: a
# worker paused for moments (SIGSTOP and SIGCONT in turn, 50 ms each) on a machine whose cores
# were all busy was seen stopped, not having beaten since the poll before, at one poll.
STOPPED_POLLS = 2

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_state(pid):
    """``(state letter of its main thread, CPU seconds of all its threads, ended ones
    included)`` of process ``pid`` from ``/proc``, or ``(None, None)`` where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None, None
    # The command name in parentheses may itself hold spaces or ')'.
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], (int(fields[11]) + int(fields[12])) / _TICKS


class Judge:
    """The watchdog's decision at each poll, from what it saw then (:meth:`observe`)."""

    def __init__(self, server="the rendezvous server", silent_seconds=SILENT_SECONDS):
        self.server = server
        self.silent_seconds = silent_seconds
        self.refusals = 0
        self.stopped = 0             # polls in a row that saw it stopped, and no beat
        self.beats = None            # the heartbeat's last value seen,
        self.beat_at = None          # when it changed,
        self.cpu_at_beat = None      # and the process's CPU seconds then

    def observe(self, now, closed_streams=(), reached="answered", marker=False, beats=0,
                state="S", cpu=0.0):
        """The reason to end the worker now, or None.

        ``closed_streams``: the worker's standard streams whose reader is gone;
        ``reached``: the poll of the server ``"answered"``, was ``"refused"`` or met
        ``"silent"``; ``marker``: the peers' reset marker was on it; ``beats``: the
        worker's heartbeat counter; ``state``, ``cpu``: its ``/proc`` state letter and
        its CPU seconds (all its threads)."""
        if beats != self.beats:
            self.beats, self.beat_at, self.cpu_at_beat = beats, now, cpu
        # Stopped at polls in a row with no beat since the poll before them (counted whether
        # or not the peers reset, so that one stopped long before they did is named so): a
        # profiler's samples (py-spy pauses the process for each) and cpulimit's
        # SIGSTOP/SIGCONT leave it stopped for moments, and it goes on between them.
        stopped = state in ("T", "t") and now > self.beat_at
        self.stopped = self.stopped + 1 if stopped else 0
        if closed_streams:
            return (f"the launcher's session to it is gone (its {' and '.join(closed_streams)} "
                    "has no reader: horovodrun, or the ssh that carried its command, ended)")
        self.refusals = self.refusals + 1 if reached == "refused" else 0
        if self.refusals >= REFUSALS:
            return (f"{self.server} refused {self.refusals} connections in a row: horovodrun "
                    "is gone")
        if not (reached == "answered" and marker):
            # Peers training, or the launcher out of reach (nothing said about the peers):
            # however long, nothing shows that this worker holds anyone up.
            return None
        silent = now - self.beat_at
        if self.stopped >= STOPPED_POLLS:
            return (f"it is stopped (/proc state {state}) while its peers reset (seen stopped at "
                    f"{self.stopped} polls in a row, its heartbeat silent for {silent:.0f} s)")
        used = cpu - self.cpu_at_beat
        if silent >= self.silent_seconds and used < IDLE_CPU_SHARE * silent:
            return (f"its heartbeat has been silent for {silent:.0f} s and the process "
                    f"used {used:.2f} s of CPU meanwhile (under {IDLE_CPU_SHARE:.0%} of a "
                    "core: a wedged interpreter), while its peers reset")
        return None


def left_behind(own_mark, found):
    """The reason a worker in its reset must end, or None: its start mark ``own_mark`` in the
    world it trained in is no longer on the rendezvous server (``found`` is there instead),
    so the driver formed a world without it (it recorded its ssh session's end) while the
    worker could not reach the launcher."""
    if found == own_mark:
        return None
    return (f"its start mark in the world it trained in is gone from the rendezvous server "
            f"(found {found!r}): the driver formed the next world without it while it could "
            "not reach the launcher, so its slot is no longer its own")


def host_lost(host, silent_for, probes, lost_after, min_probes, peers_reset, others_answer,
              port=22):
    """``(lost, reason)`` for a host of the job that said nothing (no connection, no refusal)
    to ``probes`` probes of its port over ``silent_for`` seconds: lost only after
    ``lost_after`` s and ``min_probes`` probes, and only where ``peers_reset`` (the job's
    workers reset while it said nothing) and ``others_answer`` (another host of the job
    answered these probes, or the launcher runs a worker on its own host): a host that is
    silent while nobody resets, or while every host is, is the launcher's link down, and its
    workers train on with their peers."""
    if probes < min_probes or silent_for < lost_after:
        return False, None
    if not others_answer:
        return False, (f"{host} says nothing on port {port}, nor does any other host of the "
                       "job: keeping its sessions (the launcher's own link is down; its "
                       "workers still train with their peers)")
    if not peers_reset:
        return False, (f"{host} says nothing on port {port}, but no worker of the job has "
                       "reset: keeping its sessions (the launcher's own link may be down, "
                       "and its workers still train with their peers)")
    return True, (f"{host} has said nothing on port {port} for {silent_for:.1f} s ({probes} "
                  "probes) while the job's workers reset without it (their marker on the "
                  "rendezvous server)")
