"""The arbiter: one process that splits a pool of hosts among elastic jobs, every few seconds.

It owns the hosts a base discovery lists (a host file, or a command such as
the MPI Operator's ``discover_hosts.sh``), keeps those whose sshd answers,
and gives each job that registered the hosts that pay most
(:func:`~.allocation.split`, from the curves the jobs publish). Jobs find it
through its folder: each job's ``hvd-adapt-discover --arbiter DIR`` writes
a report there at every run and offers exactly the hosts granted to it
(:mod:`.arbiter_files` says what they exchange). Standard library only.

What it promises, and the evidence each promise rests on:

- **No host runs workers of two jobs at once.** A host taken from job A goes
  to job B only once A has given it back: two reports of A's discovery in a
  row, both of runs that read a grant without the host, say that A's driver
  runs no command there and starts none (:func:`.sessions.commands`: the
  ssh session or local command of the worker on that host has exited, and no
  launch is under way). Horovod's driver launches only on hosts its
  discovery offered, and a discovery that read the grant no longer offers
  the host. A job whose discovery cannot see its driver (run by hand) never
  gives a host back while it runs.
- **Losing the arbiter changes nothing.** Its state (the grants, what is
  being given back, the jobs in arrival order, when the split last changed)
  is on disk, rewritten atomically whenever it changes; a job that cannot
  read it keeps the hosts it has. A restarted arbiter reads it and goes on;
  the hysteresis and the time since the last change are part of it, and
  a restarted arbiter makes no change by choice for ``--change-interval``
  (it has not yet seen how the jobs do), so a restart resizes nothing by
  itself.
- **A job that ends or dies frees its hosts**: once its discovery has not
  reported for ``--gone-after`` seconds (30; and for at least as many of the
  arbiter's own cycles, so a jump of the clock is not silence), and, where
  the arbiter can see the job's driver (same machine), once that has
  exited. Horovod runs the discovery every second while the job lives, and
  a job whose driver died loses its workers within 10 s (each worker's
  watchdog ends it when the rendezvous server stops answering,
  ``HVD_ADAPT_UNREACHABLE_SECONDS``).
- **A failed host leaves every grant**: one the base discovery stops
  listing, or whose sshd does not answer (a second, longer probe for a host
  that missed the first). It is given to another job only once
  the job it left has no command there (its session to it ends with the
  worker, or ``hvd-adapt-discover --lost-after`` ends it).
- **Nothing another user writes changes a grant**: the folder is this user's,
  0700, and every file read is this user's own regular file (see
  :mod:`.arbiter_files`); a second arbiter on the same folder refuses to
  start (a lock on the folder).
"""
import argparse
import fcntl
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from .._runtime.private_files import check_owned
from .allocation import JobView, SplitSettings, split
from .arbiter_files import (ArbiterFileError, FORMAT_VERSION, arbiter_folder,
                            process_namespace, read_json, read_report, report_keys, report_path,
                            state_path, valid_name, write_json)
from .base import BaseDiscoveryError, MAX_SLOTS, base_hosts, valid_host

log = logging.getLogger("hvd_adapt")

# A host that misses the quick probe is probed again for this long (as the discovery does
# a host of its world: past Linux's first SYN retransmission) before it is withdrawn: one
# slow answer of a loaded host does not take it from its job.
SECOND_PROBE_SECONDS = 1.5
# Reports in a row that must show a host given back (see the module's docstring).
RELEASE_REPORTS = 2


@dataclass
class JobRecord:
    """What the arbiter keeps of a job."""
    name: str
    order: int
    assigned: list = field(default_factory=list)     # its hosts in the split, oldest first
    releasing: dict = field(default_factory=dict)    # {host: generation it left the grant}
    confirmed: dict = field(default_factory=dict)    # {host: first run that showed it free}


@dataclass
class ArbiterState:
    generation: int = 0
    grants: dict = field(default_factory=dict)       # {key: [(host, slots)]}
    jobs: dict = field(default_factory=dict)         # {key: JobRecord}
    next_order: int = 0
    last_change: float = 0.0                         # when the split last changed by choice

    def to_json(self):
        return {"version": FORMAT_VERSION, "generation": self.generation,
                "grants": {k: [list(e) for e in g] for k, g in self.grants.items()},
                "jobs": {k: {"name": j.name, "order": j.order, "assigned": j.assigned,
                             "releasing": j.releasing, "confirmed": j.confirmed}
                         for k, j in self.jobs.items()},
                "next_order": self.next_order, "last_change": self.last_change,
                "written_at": time.time(), "pid": os.getpid()}


def state_from_json(path, data):
    """The :class:`ArbiterState` in a parsed state file; :class:`ArbiterFileError` naming
    what is wrong."""
    def count(v):
        return type(v) is int and 0 <= v < 1 << 62

    def fail(what):
        raise ArbiterFileError(f"{path}: {what}")
    if not count(data.get("generation")) or not count(data.get("next_order")):
        fail("generation and next_order must be integers >= 0")
    last = data.get("last_change")
    if type(last) not in (int, float) or not math.isfinite(last):
        fail("last_change must be a finite number")
    grants, jobs = data.get("grants"), data.get("jobs")
    if not isinstance(grants, dict) or not isinstance(jobs, dict):
        fail("grants and jobs must be objects")
    state = ArbiterState(data["generation"], {}, {}, data["next_order"], float(last))
    for key, grant in grants.items():
        if not (valid_name(key) and isinstance(grant, list) and all(
                isinstance(e, list) and len(e) == 2 and valid_host(e[0]) and type(e[1]) is int
                and 0 < e[1] <= MAX_SLOTS for e in grant)):
            fail(f"the grant of {key!r} is not a list of [host, slots]")
        state.grants[key] = [tuple(e) for e in grant]
    for key, job in jobs.items():
        if not (valid_name(key) and isinstance(job, dict) and valid_name(job.get("name"))
                and count(job.get("order")) and isinstance(job.get("assigned"), list)
                and all(valid_host(h) for h in job["assigned"])
                and isinstance(job.get("releasing"), dict)
                and all(valid_host(h) and count(g) for h, g in job["releasing"].items())
                and isinstance(job.get("confirmed"), dict)
                and all(valid_host(h) and count(r) for h, r in job["confirmed"].items())):
            fail(f"the record of job {key!r} is not what it must be")
        state.jobs[key] = JobRecord(job["name"], job["order"], list(job["assigned"]),
                                    dict(job["releasing"]), dict(job["confirmed"]))
    return state


def lock_folder(folder):
    """Hold an exclusive lock on the folder for this process's life (a descriptor left
    open); a second arbiter on it raises RuntimeError naming it."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        check_owned(os.fstat(fd), folder)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"another hvd-adapt-arbiter runs on {folder}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def driver_visible(driver):
    """Whether this process can see the job's driver (same boot, same PID namespace)."""
    here = process_namespace()
    return (driver is not None and here is not None and driver["boot"] == here["boot"]
            and driver["pidns"] == here["pidns"])


class Arbiter:
    """The arbiter on ``args.folder``: :meth:`cycle` once, or :meth:`serve` forever."""

    def __init__(self, args):
        self.args = args
        self.folder = arbiter_folder(args.folder)
        self.lock = lock_folder(self.folder)
        self.settings = SplitSettings(args.fairness, args.min_gain, args.change_interval,
                                      args.efficiency, args.growth_limit)
        try:
            self.state = state_from_json(state_path(self.folder),
                                         read_json(state_path(self.folder)))
            self.resumed = True
            log.info("resuming from %s: generation %d, %d job(s)", state_path(self.folder),
                     self.state.generation, len(self.state.jobs))
        except FileNotFoundError:
            self.state = ArbiterState()
            self.resumed = False
        self.reports = {}      # {key: the last good report}
        self.seen = {}         # {key: (run, seen at, cycle)}: heartbeats as seen here
        self.cycles = 0
        self.pool = None       # the last pool known: [(host, slots)] that answer
        self.dirty = False     # the state on disk is behind the one here
        self.said = set()      # the problems the last cycle said (each said once)
        self.warned = set()    # the jobs warned about once for good
        self.started = None    # the first cycle's time: silence of jobs not heard from since
        self.stopping = False

    # -- one cycle ----------------------------------------------------------------------
    def cycle(self, now=None):
        """Read the pool and the reports, forget jobs gone, confirm hosts given back, split
        the pool and write the grants where anything changed."""
        now = time.time() if now is None else now
        if self.started is None:
            self.started = now
            if self.resumed:
                # A restarted arbiter has not yet seen how the jobs do since it stopped:
                # changes by choice wait a whole interval (needed ones do not).
                self.state.last_change = now
        self.cycles += 1
        problems = []
        pool = self.read_pool(problems)
        self.read_reports(problems, now)
        changed = self.forget_gone(now, problems)
        changed |= self.register()
        changed |= self.confirm_releases()
        if pool is not None:
            changed |= self.regrant(pool, now)
        self.dirty |= changed
        if self.dirty:
            self.save(problems)
        self.say(problems)

    def read_pool(self, problems):
        """The base hosts whose sshd answers; the last pool where the base gives no answer
        (None where there never was one)."""
        try:
            base, left_out = base_hosts(self.args)
        except BaseDiscoveryError as e:
            problems.append(f"{e}; keeping the pool as it was")
            return self.pool
        problems += [f"left out: {p}" for p in left_out]
        if self.args.ssh_port:
            from .probe import answers
            hosts = [h for h, _ in base]
            said = answers(hosts, self.args.ssh_port, self.args.probe_timeout)
            missed = [h for h in hosts if not said.get(h)]
            if missed:
                said.update(answers(missed, self.args.ssh_port,
                                    max(self.args.probe_timeout, SECOND_PROBE_SECONDS)))
            down = [h for h in hosts if not said.get(h)]
            if down:
                problems.append(f"not answering on port {self.args.ssh_port}, withdrawn from "
                                f"every grant: {', '.join(down)}")
            base = [(h, s) for h, s in base if said.get(h)]
        self.pool = base
        return base

    def read_reports(self, problems, now):
        """The last good report of every job in the folder; a report that does not pass
        its checks keeps the one before (the reason said once)."""
        keys = report_keys(self.folder)
        for key in keys:
            try:
                report = read_report(self.folder, key)
            except FileNotFoundError:
                continue
            except (OSError, ArbiterFileError) as e:     # UnsafePathError among OSError
                problems.append(f"ignoring a report: {e}")
                continue
            self.reports[key] = report
            if self.seen.get(key, (None,))[0] != report["run"]:
                self.seen[key] = (report["run"], now, self.cycles)
        for key in list(self.reports):
            if key not in keys:
                del self.reports[key]

    def forget_gone(self, now, problems):
        """Jobs whose discovery has been silent for ``--gone-after`` (and as many cycles),
        whose driver, where visible, has exited: their hosts are free."""
        needed = math.ceil(self.args.gone_after / max(self.args.interval, 1e-3))
        changed = False
        for key in list(self.state.jobs):
            _, seen_at, cycle = self.seen.get(key, (None, self.started, 1))
            silent = now - seen_at
            if silent < self.args.gone_after or self.cycles - cycle < needed:
                continue
            report = self.reports.get(key)
            driver = report and report["driver"]
            if driver and driver_visible(driver):
                from .sessions import running
                if running(driver["key"]):
                    problems.append(f"{self.state.jobs[key].name}'s discovery has not "
                                    f"reported for {self.args.gone_after:g} s, but its driver "
                                    f"(pid {driver['key'].split('.')[0]}) runs: it keeps its "
                                    "hosts")
                    continue
            job = self.state.jobs.pop(key)
            self.state.grants.pop(key, None)
            self.seen.pop(key, None)
            self.reports.pop(key, None)
            try:
                os.unlink(report_path(self.folder, key))
            except FileNotFoundError:
                pass
            why = "its driver exited" if driver and driver_visible(driver) else \
                "its driver is not visible from here"
            log.info("%s (%s) is gone: no report for %.0f s, %s; its hosts are free",
                     job.name, key, silent, why)
            changed = True
        return changed

    def register(self):
        changed = False
        for key, report in sorted(self.reports.items(), key=lambda item: self.seen[item[0]][1:]):
            if key not in self.state.jobs:
                self.state.jobs[key] = JobRecord(report["job"], self.state.next_order)
                self.state.next_order += 1
                log.info("%s (%s) registered: min-np %d, max-np %s", report["job"], key,
                         report["min_np"], report["max_np"] or "none")
                changed = True
        return changed

    def confirm_releases(self):
        """A host leaves a job's ``releasing`` after RELEASE_REPORTS reports in a row, of
        runs that read a grant without it, say its driver runs nothing there."""
        changed = False
        for key, job in self.state.jobs.items():
            report = self.reports.get(key)
            for host, generation in list(job.releasing.items()):
                free = (report is not None and report["holding"] is not None
                        and report["generation"] is not None
                        and report["generation"] >= generation
                        and host not in report["holding"] and not report["launching"])
                if not free:
                    changed |= job.confirmed.pop(host, None) is not None
                elif host not in job.confirmed:
                    job.confirmed[host] = report["run"]
                    changed = True
                elif report["run"] >= job.confirmed[host] + RELEASE_REPORTS - 1:
                    del job.releasing[host], job.confirmed[host]
                    log.info("%s gave %s back", job.name, host)
                    changed = True
        return changed

    def holders(self):
        """``{host: {keys}}`` of the jobs that may have workers there: granted, being given
        back, or (their discovery says) run by their driver."""
        held = {}
        for key, job in self.state.jobs.items():
            report = self.reports.get(key)
            hosts = set(job.releasing) | {h for h, _ in self.state.grants.get(key, [])}
            hosts |= set(report["holding"] or []) if report else set()
            for host in hosts:
                held.setdefault(host, set()).add(key)
        return held

    def regrant(self, pool, now):
        """Split the pool among the jobs that reported; grant each the hosts of its share
        that no other job holds. True where the state changed."""
        state = self.state
        silent = [k for k in state.jobs if k not in self.reports]     # not heard from yet
        reserved = {h for k in silent for h in state.jobs[k].assigned}
        views = []
        for key, job in state.jobs.items():
            if key in silent:
                continue
            report = self.reports[key]
            if report["holding"] is None and key not in self.warned:
                self.warned.add(key)
                log.warning("%s's discovery finds no elastic driver (run by hand?): hosts "
                            "taken from it go to no other job while it runs", job.name)
            views.append(JobView(key, job.order, report["min_np"], report["max_np"],
                                 report["initial_np"], report["curve"], report["timed"],
                                 report["settled"], tuple(job.assigned)))
        result = split(views, [(h, s) for h, s in pool if h not in reserved], self.settings,
                       now, state.last_change, self.holders())
        before = {k: (list(j.assigned), dict(j.releasing)) for k, j in state.jobs.items()}
        for key, hosts in result.hosts.items():
            job = state.jobs[key]
            job.assigned = list(hosts)
            for host, _ in state.grants.get(key, []):
                if host not in hosts:
                    job.releasing.setdefault(host, state.generation + 1)
        held = self.holders()      # with the grants still as they were: all may hold
        slots = dict(pool)
        grants = {key: state.grants.get(key, []) if key in silent else
                  [(h, slots[h]) for h in job.assigned if held.get(h, set()) <= {key}]
                  for key, job in state.jobs.items()}
        changed = result.by_choice or before != {
            k: (j.assigned, j.releasing) for k, j in state.jobs.items()}
        if result.by_choice:
            state.last_change = now
        old = state.grants
        if grants != old:
            state.grants = grants
            state.generation += 1
            changed = True
        for key in sorted(grants, key=lambda k: state.jobs[k].order):
            if grants[key] != old.get(key, []) or state.jobs[key].assigned != before[key][0]:
                self.log_grant(key, result.why.get(key), held)
        return changed

    def log_grant(self, key, why, held):
        job = self.state.jobs[key]
        grant = self.state.grants[key]
        waiting = [h for h in job.assigned if h not in dict(grant)]
        line = ", ".join(f"{h}:{s}" for h, s in grant) or "no host"
        if waiting:
            line += "; waiting for " + ", ".join(
                f"{h} (held by {', '.join(sorted(self.state.jobs[k].name for k in held[h] - {key}))})"
                for h in waiting)
        log.info("generation %d: %s gets %s%s", self.state.generation, job.name, line,
                 f" [{why}]" if why else "")

    def say(self, problems):
        for problem in problems:
            if problem not in self.said:
                log.warning("%s", problem)
        self.said = set(problems)

    def save(self, problems):
        """Write the state; where that fails (a full disk), say so and try again next cycle.
        Meanwhile the jobs read the grants last written, and a host taken from a job in the
        state not written is not given back on reports of older grants: nothing moves, as
        with an arbiter that stopped."""
        try:
            write_json(state_path(self.folder), self.state.to_json())
            self.dirty = False
        except OSError as e:
            problems.append(f"cannot write {state_path(self.folder)}: {e}")

    # -- the loop -----------------------------------------------------------------------
    def serve(self):
        """A cycle every ``--interval`` seconds until SIGTERM or SIGINT."""
        def stop(signum, frame):
            self.stopping = True
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        log.info("splitting the pool among the jobs of %s every %g s", self.folder,
                 self.args.interval)
        while not self.stopping:
            started = time.monotonic()
            self.cycle()
            left = self.args.interval - (time.monotonic() - started)
            while left > 0 and not self.stopping:
                time.sleep(min(left, 0.2))
                left = self.args.interval - (time.monotonic() - started)


def parser():
    p = argparse.ArgumentParser(
        prog="hvd-adapt-arbiter",
        description="Split a pool of hosts among elastic jobs by their published speed-up "
                    "curves (see hvd_adapt.scheduling.arbiter); each job's discovery is "
                    "hvd-adapt-discover --arbiter FOLDER.")
    p.add_argument("--folder", required=True,
                   help="the arbiter's folder (this user's, created 0700): the jobs' reports "
                        "and the grants")
    base = p.add_mutually_exclusive_group(required=True)
    base.add_argument("--hostfile", help="the pool: a file of 'host[:slots]' lines")
    base.add_argument("--command", help="the pool: a command printing 'host[:slots]' lines")
    p.add_argument("--command-timeout", type=float, default=10.0)
    p.add_argument("--slots", type=int, default=1,
                   help="slots of a host listed without any (default 1)")
    p.add_argument("--ssh-port", type=int, default=22,
                   help="a host counts only while this port answers (default 22; 0: no check)")
    p.add_argument("--probe-timeout", type=float, default=0.03)
    p.add_argument("--interval", type=float, default=2.0,
                   help="seconds between cycles (default 2)")
    p.add_argument("--gone-after", type=float, default=30.0,
                   help="a job whose discovery has not reported for this long (and whose "
                        "driver, where visible, exited) is gone (default 30)")
    p.add_argument("--fairness", type=float, default=-1.0,
                   help="Pollux's p: 1 maximises the sum of the speed-ups, lower is fairer "
                        "(default -1)")
    p.add_argument("--min-gain", type=float, default=0.05,
                   help="a job's speed-up on another size counts this much less: a resize "
                        "by choice must gain it (default 0.05)")
    p.add_argument("--change-interval", type=float, default=60.0,
                   help="least seconds between changes by choice (default 60)")
    p.add_argument("--efficiency", type=float, default=0.0,
                   help="least speed-up a host must add to a job, in workers (default 0: "
                        "a host goes wherever it pays most, however little)")
    p.add_argument("--growth-limit", type=float, default=2.0,
                   help="most workers, as a multiple of the most a job has timed (default 2)")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.slots < 1:
        p.error(f"--slots must be >= 1, got {args.slots}")
    if not 0 <= args.ssh_port <= 65535:
        p.error(f"--ssh-port must be in [0, 65535], got {args.ssh_port}")
    for name in ("interval", "gone_after", "probe_timeout", "command_timeout"):
        if not 0 < getattr(args, name) < math.inf:
            p.error(f"--{name.replace('_', '-')} must be a finite number > 0, "
                    f"got {getattr(args, name)}")
    try:
        SplitSettings(args.fairness, args.min_gain, args.change_interval, args.efficiency,
                      args.growth_limit)
    except ValueError as e:
        p.error(f"--{str(e).replace('interval', 'change-interval').replace('_', '-')}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s hvd-adapt-arbiter: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        arbiter = Arbiter(args)
    except (OSError, RuntimeError, ArbiterFileError) as e:
        hint = (" (move it away to start afresh: the jobs keep their hosts meanwhile)"
                if isinstance(e, ArbiterFileError) else "")
        log.error("%s%s", e, hint)
        return 1
    arbiter.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
