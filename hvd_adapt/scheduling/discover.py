"""``hvd-adapt-discover``: a host-discovery script that offers a job only the hosts that pay.

Give it to ``horovodrun --host-discovery-script`` in place of the base
discovery it wraps (a static host file, or any command that prints
``host[:slots]`` lines, such as the MPI Operator's
``/etc/mpi/discover_hosts.sh``)::

    horovodrun -np 2 --min-np 1 --max-np 16 --host-discovery-script \\
        "hvd-adapt-discover --command /etc/mpi/discover_hosts.sh --hints /shared/hints.json \\
         --min-np 1 --max-np 16 --slots 4" python train.py

Horovod runs it every second and reads ``host:slots`` lines. Each run:

1. reads the base hosts, in the base's order;
2. puts the hosts it offered last time first (their slots as before), then
   spare slots on them, then new hosts; a host counts only while its sshd
   port answers (``--ssh-port``, every host probed at once: a pod that runs
   is not yet one that accepts ssh, and a host that went down or was cut
   off is dropped before Horovod's driver launches on it again; where the
   base drops every host of the last offer, one that answers stays, since
   Horovod stops a job offered none of its world) and, with
   ``--standby-dir``, only with as many slots as it has standby workers
   ready (:mod:`hvd_adapt.scheduling.standby`);
3. with ``--hints`` (the file the job publishes, see
   :mod:`hvd_adapt.scheduling.hints`), offers as many workers as pay
   (:class:`~hvd_adapt.scheduling.rule.DiscoveryRule`); without it, all
   that are ready. The hosts last offered stay as they are while the job
   has not yet published hints from the world they make (a resize in
   flight), for ``--hold`` seconds after a resize (the new world's first
   steps are slow), and while the hints are older than ``--stale-after``
   seconds;
4. under Horovod's driver, ends the job's ssh sessions to a host the job
   lost: it has said nothing (no connection, no refusal) to every probe for
   ``--lost-after`` seconds (2 probes at least, each missed one probed
   again for 1.5 s) while the job's workers reset without it (their marker
   on the rendezvous server) and another of its hosts answers (the launcher's
   own host among them, where it runs a worker): Horovod's
   driver waits for a lost worker's session to end before it forms the next
   world, and a host cut off silently never ends it (:mod:`.sessions`).
   Meanwhile, and for 6 s after, the offer stays as it is
   (``FREEZE_AFTER_END``). A host that is silent while nobody resets, or
   while every host is, keeps its sessions (the launcher's own link is down,
   and its workers still train together), as does one that answers, or
   refuses (it is up: its sshd restarting), listed or not: a host the base
   drops while it answers leaves gracefully, as below;
5. clamps to ``--min-np``/``--max-np`` and remembers what it offered in a
   small state file (``--state``; by default in this user's private runtime
   folder), for the next run.

Bad input keeps what it knows: an empty, failed or timed-out base answer
(:mod:`.base`) and hints that fail their schema check keep the hosts last
offered, with the reason on standard error; a host name that is not one is
reported and dropped.

A host it stops offering leaves the job as any removed host does: Horovod
interrupts the workers at their next commit (``HostsUpdatedInterrupt``) and
stops the removed host's workers; it is not blacklisted. Changes are logged
to standard error, which horovodrun shows. Standard library only: a run
takes milliseconds (``benchmarks/RESULTS.md``), the base command's time aside.
"""
import argparse
import dataclasses
import math
import os
import sys
import time
import zlib

from .._runtime.private_files import user_runtime_folder
from .base import BaseDiscoveryError, base_hosts
from .discovery_state import load_state, save_state
from .hints import HintsError, read_hints
from .rule import DiscoveryRule, assign
from .ready import ready_count

# A host's sessions are ended only after this many silent probes in a row (and
# --lost-after seconds from the first), each of them given SECOND_PROBE_SECONDS: one
# slow answer of a loaded host is not a partition. Two, not three: under load a run of
# this script takes about 2 s, and a third probe pushed the end of a lost host's
# sessions past Gloo's 5 s, into the survivors' pause.
LOST_PROBES = 2
# How long the offer stays unchanged after a lost host's sessions were ended: the
# survivors notice within Gloo's timeout (5 s, hvd_adapt/_runtime/gloo.py), after which
# the driver forms the next world without the host (blacklisted for its cooldown; a
# cooldown shorter than this would let the driver launch on the lost host again).
FREEZE_AFTER_END = 6.0
# The second, longer probe of a host offered last or with sessions that missed the first:
# past Linux's first SYN retransmission (1 s), so one lost packet is not a silent probe.
SECOND_PROBE_SECONDS = 1.5


def standbys_ready(args, base, seen, now, problems):
    """``{host: standbys whose heartbeat beats}`` for the base hosts (None without
    ``--standby-dir``), and the heartbeats seen, to remember for the next run; a host
    folder it cannot trust adds to ``problems``."""
    if not args.standby_dir:
        return None, {}
    ready, kept = {}, {}
    for host, _ in base:
        try:
            ready[host], host_seen = ready_count(args.standby_dir, host, seen, now)
        except OSError as e:    # UnsafePathError among them: another user could plant files
            problems.append(f"counting no standby on {host}: {e}")
            ready[host], host_seen = 0, {}
        kept.update(host_seen)
    return ready, kept


def candidates(base, previous, answering=None, ready=None, keep_one=True):
    """Hosts in the order to fill them, with their capacity: last offered (as offered),
    their spare slots, then new hosts that answer and have standbys ready (``answering``:
    the hosts whose sshd answered, None without the check; ``ready``: standbys per host,
    None when every slot counts). ``keep_one``: where the base keeps no host of the last
    offer, one that answers stays (not under an arbiter: only its grant is offered)."""
    capacity = dict(base)
    if ready is not None:
        capacity = {host: min(slots, previous.get(host, 0) + ready[host])
                    for host, slots in base}
    kept = [(host, min(slots, capacity[host])) for host, slots in previous.items()
            if host in capacity]
    new = [host for host, _ in base if host not in previous and capacity[host] > 0]
    if answering is not None:
        # A host offered last whose sshd stopped answering (down, cut off) is not offered
        # again, so Horovod's driver does not launch on it after its blacklist cooldown.
        new = [host for host in new if host in answering]
        kept = [(host, slots) for host, slots in kept if host in answering]
        if previous and not kept and keep_one:
            # Horovod's driver stops a job offered no host of its world ("No hosts from
            # previous set remaining"): one of them stays while it answers.
            kept = [(host, slots) for host, slots in previous.items() if host in answering][:1]
    spare = [(host, capacity[host] - slots) for host, slots in kept
             if capacity.get(host, 0) > slots]
    return kept, spare + [(host, capacity[host]) for host in new]


def probe_hosts(args, hosts, second_chance):
    """``(answering, silent)``: the ``hosts`` whose sshd accepted a connection, all probed
    at once within ``--probe-timeout``, and those that said nothing at all (no refusal:
    down, or cut off). Those of ``second_chance`` that did not accept are probed once
    more, for ``SECOND_PROBE_SECONDS``: a loaded host is not dropped, nor its sessions
    ended, for one slow answer. ``(None, set())`` without the check (``--ssh-port 0``)."""
    if not args.ssh_port:
        return None, set()
    from .probe import answers      # sockets only when there is a host to probe
    said = answers(hosts, args.ssh_port, args.probe_timeout) if hosts else {}
    missed = [host for host in second_chance if said.get(host) is not True]
    if missed:
        said.update(answers(missed, args.ssh_port,
                            max(args.probe_timeout, SECOND_PROBE_SECONDS)))
    return ({host for host, value in said.items() if value},
            {host for host, value in said.items() if value is None})


def end_lost_sessions(args, driver, live, silent, unanswered, ended_at, now, problems):
    """End the driver's sessions (``live``: ``{host: pids}``) to each host the job lost:
    it has said nothing (``silent``: no connection, no refusal) to every probe for
    ``--lost-after`` seconds and at least ``LOST_PROBES`` probes, and the job's workers
    reset without it (``_runtime/liveness.py``'s ``host_lost``; :mod:`.sessions` says
    why), noting when in ``ended_at``; the ``{host: [first missed at, probes missed]}`` to
    remember for the hosts still being judged. Another host of the job answers where one
    with sessions does, or where the ``driver`` runs a worker on its own host (it reaches
    that one: ``horovodrun -H h1:1,h2:1`` run on h1). A host that is silent while nobody
    resets keeps its sessions (the launcher's own link is down; a line in ``problems`` says so),
    and so does a host that refuses (it is up, its sshd restarting, say: its sessions may
    be fine, and a crashed host's own kernel ends them)."""
    from .._runtime.liveness import host_lost
    from .sessions import end, peers_reset, runs_a_worker_here
    judged, reset, local = {}, None, None
    for host, pids in live.items():
        if host not in silent:
            continue
        first, missed = unanswered.get(host, [now, 0])
        missed += 1
        if reset is None and missed >= LOST_PROBES and now - first >= args.lost_after:
            reset = peers_reset([pid for each in live.values() for pid in each])
            local = runs_a_worker_here(driver, live)
        others_answer = local or any(other not in silent for other in live)
        lost, reason = host_lost(host, now - first, missed, args.lost_after, LOST_PROBES,
                                 reset, others_answer, args.ssh_port)
        if lost:
            ended = end(pids)
            ended_at[host] = now
            sys.stderr.write(f"hvd-adapt-discover: {reason}: ending the job's {len(ended)} "
                             "session(s) to it, so that Horovod's driver counts its workers "
                             "as failed\n")
            continue
        if reason:
            problems.append(reason)
        judged[host] = [first, missed]
    return judged


def warn_without_keepalive(args, base, state):
    """Once per state file, where neither this script (``--ssh-port 0`` or
    ``--lost-after 0``) nor ssh (``ServerAliveInterval 0``) would notice a host cut off
    silently: one line naming the fix."""
    if state.keepalive_checked or not base or (args.ssh_port and args.lost_after):
        return
    from .sessions import keepalive_off
    host = base[0][0]
    if keepalive_off(host):
        sys.stderr.write(
            f"hvd-adapt-discover: ssh to {host} has no keepalive and --ssh-port/--lost-after "
            "is off: a host cut off silently stalls the job until its link heals; set "
            "'ServerAliveInterval 2' and 'ServerAliveCountMax 3' in ~/.ssh/config "
            "(docs/elastic.md)\n")


def merge(hosts):
    """``[(host, slots)]`` with each host once, at its first place, slots summed."""
    merged = {}
    for host, slots in hosts:
        merged[host] = merged.get(host, 0) + slots
    return list(merged.items())


def target_replicas(args, rule, kept, total, state, now):
    """How many workers to offer, and why."""
    current = sum(slots for _, slots in kept)
    if not state.hosts:
        return args.initial_np or args.min_np, "first offer"
    if not args.hints:
        return total, "all that are ready"
    try:
        hints = read_hints(args.hints)
    except HintsError as e:
        return current, f"unreadable hints ({e})"
    unsettled = why_unsettled(args, hints, current, state.changed_at, now)
    if unsettled:
        return current, unsettled
    limit = min(total, rule.growth_cap(hints["replica_counts_timed"], current))
    best = rule.target(hints["curve"], max(1, args.min_np), limit,
                       hints.get("slots_per_node", 1))
    if not rule.worth_changing(hints["curve"], current, best):
        return current, f"{best} replica(s) would not pay for a resize"
    speedup = {e["replicas"]: e["speedup"] for e in hints["curve"]}
    return best, (f"predicted speed-up {speedup.get(best, 0):.2f} at {best} against "
                  f"{speedup.get(current, 0):.2f} at {current}")


def why_unsettled(args, hints, current, changed_at, now):
    """Why the ``hints`` do not yet tell how ``current`` workers do (None where they do):
    no curve yet, stale, from the world before the last change, or a hold after it."""
    if hints is None or not hints["curve"]:
        return "no speed-up curve published yet"
    if now - hints["written_at"] > args.stale_after:
        return f"hints older than {args.stale_after:g} s"
    in_flight = hints["written_at"] < changed_at or hints["replicas"] != current
    if in_flight and now - changed_at < args.settle:
        return "resize in flight"
    if now - changed_at < args.hold:
        # A new world's first steps (warm-up, a joiner's first allocations)
        # are slow: the curve they give would undo the resize at once.
        return f"held for {args.hold:g} s after the last resize"
    return None


def default_state_path(args):
    """The state file of this base discovery and hints, and under Horovod's driver of this
    job (a later job with the same arguments starts afresh, at its first offer; two at once
    keep apart): in this user's private runtime folder (``$XDG_RUNTIME_DIR``, else a
    checked 0700 folder in the temp folder)."""
    from .sessions import driver_key
    key = repr((args.hostfile, args.command, args.hints, driver_key()) +
               ((args.arbiter, args.job) if args.arbiter else ()))
    key = f"{zlib.crc32(key.encode()):08x}"
    return os.path.join(user_runtime_folder("discover"), f"{key}.json")


def discover(args, now=None):
    """One run: the ``[(host, slots)]`` to print (and the state file updated). An empty
    or failed base answer keeps the hosts offered last, as do unreadable hints; each
    problem is said on stderr once, while it lasts (Horovod runs this every second).
    Under Horovod's driver, the job's sessions to a host that stopped answering are
    ended (:func:`end_lost_sessions`). With ``--arbiter`` the base is the job's grant,
    every granted host that is ready is offered, and each run reports to the arbiter
    (:mod:`.arbiter_client`)."""
    now = time.time() if now is None else now
    rule = DiscoveryRule(args.efficiency, args.min_gain, args.min_change, args.growth_limit)
    state_path = args.state or default_state_path(args)
    state = load_state(state_path)
    previous = list(state.hosts.items())
    problems = []
    if args.arbiter:
        base, state = granted_hosts(args, state, problems)
    else:
        try:
            base, left_out = base_hosts(args)
        except BaseDiscoveryError as e:
            if not previous:
                raise
            base, left_out = [], [str(e)]
        problems += [f"left out: {problem}" for problem in left_out]
    warn_without_keepalive(args, base, state)
    from .sessions import find_driver
    driver = find_driver()
    live = {}
    if args.ssh_port and args.lost_after:
        from .sessions import sessions
        live = sessions(driver, set(state.watch) | set(state.hosts) | {host for host, _ in base})
    new = [host for host, _ in base if host not in state.hosts]
    answering, silent = probe_hosts(args, new + list(state.hosts) + list(live),
                                    list(state.hosts) + list(live))
    ended_at = {host: at for host, at in state.ended.items()
                if 0 <= now - at < FREEZE_AFTER_END}
    unanswered = end_lost_sessions(args, driver, live, silent, state.unanswered, ended_at,
                                   now, problems)
    # What every run remembers, whatever it answers.
    state = dataclasses.replace(state, watch=sorted(live), unanswered=unanswered,
                                ended=ended_at, keepalive_checked=True)
    frozen = sorted(set(unanswered) | set(ended_at))
    if previous and (frozen or not (base or args.arbiter)):
        # Any change of the offer makes Horovod's driver notify the world's rank 0 from
        # its discovery thread, over a socket with no timeout (elastic/driver.py,
        # _notify_workers_host_changes), while it holds the lock that forming the next
        # world needs: with rank 0 on a host cut off, the whole driver waits minutes.
        # So the offer stays as it is while a host of the world is being judged, and for
        # FREEZE_AFTER_END after its sessions were ended, until the next world is formed.
        if frozen:
            problems.append(f"{', '.join(frozen)} said nothing: keeping the current offer "
                            "until the next world is formed without it")
        else:
            problems.append(f"the base discovery listed no usable host; keeping the current "
                            f"{sum(s for _, s in previous)} worker(s) on "
                            f"{', '.join(f'{h}:{s}' for h, s in previous)}")
        hosts, changed_at, standbys = previous, state.changed_at, state.standbys
    else:
        ready, standbys = standbys_ready(args, base, state.standbys, now, problems)
        kept, more = candidates(base, state.hosts, answering, ready,
                                keep_one=not args.arbiter)
        total = sum(slots for _, slots in kept + more)
        if args.max_np:
            total = min(total, args.max_np)
        if args.arbiter:
            replicas, why = total, "granted by the arbiter"
        else:
            replicas, why = target_replicas(args, rule, kept, total, state, now)
        if why.startswith("unreadable hints"):
            problems.append(f"{why}; keeping the current hosts")
        replicas = max(args.min_np, min(replicas, total))
        hosts = merge(assign(kept + more, replicas))
        changed_at = now if hosts != previous else state.changed_at
        if hosts != previous:
            sys.stderr.write(f"hvd-adapt-discover: {sum(s for _, s in hosts)} worker(s) on "
                             f"{', '.join(f'{h}:{s}' for h, s in hosts) or 'no host'} "
                             f"({why})\n")
    state = dataclasses.replace(state, hosts=dict(hosts), changed_at=changed_at,
                                standbys=standbys)
    if args.arbiter:
        state = report_to_arbiter(args, state, hosts, driver, now, problems)
    say_new(problems, state)
    save_state(state_path, dataclasses.replace(state, said=problems))
    return hosts


def job_name(args):
    """``--job``, or the hints file's name without its extension, or "job"."""
    if args.job is not None:
        return args.job
    return os.path.splitext(os.path.basename(args.hints))[0] if args.hints else "job"


def job_key(args):
    from .arbiter_client import job_key as key
    from .sessions import driver_key
    return key(job_name(args), driver_key())


def granted_hosts(args, state, problems):
    """The job's grant (the base under an arbiter), and the state remembering it."""
    from .arbiter_client import grant
    generation, hosts, problem = grant(args.arbiter, job_key(args),
                                       (state.generation, state.grant))
    if problem:
        problems.append(problem)
    if hosts is None:
        return [], state
    if hosts == [] and state.hosts:
        problems.append(f"the arbiter granted {job_name(args)} no host: it offers none")
    return hosts, dataclasses.replace(state, grant=hosts, generation=generation)


def report_to_arbiter(args, state, hosts, driver, now, problems):
    """Write this run's report (a failed write is said; the answer stands). Returns the
    state counting it."""
    from .arbiter_client import report, write_report
    from .sessions import commands
    curve, timed, settled = None, 1, False
    if args.hints:
        try:
            hints = read_hints(args.hints)
        except HintsError as e:
            problems.append(f"unreadable hints ({e}): reporting no curve")
            hints = None
        if hints is not None and hints["curve"]:
            curve = [[e["replicas"], e["goodput"]] for e in hints["curve"]]
            timed = max(hints["replica_counts_timed"], default=hints["replicas"])
            current = sum(slots for _, slots in hosts)
            settled = why_unsettled(args, hints, current, state.changed_at, now) is None
    run = state.reports + 1
    data = report(args, job_name(args), run, state.generation, curve, timed, settled, hosts,
                  None if driver is None else commands(driver))
    try:
        write_report(args.arbiter, job_key(args), data)
    except OSError as e:
        problems.append(f"cannot write the report to the arbiter: {e}")
    return dataclasses.replace(state, reports=run)


def say_new(problems, state):
    """Write the ``problems`` the last run did not already say to stderr."""
    for problem in problems:
        if problem not in state.said:
            sys.stderr.write(f"hvd-adapt-discover: {problem}\n")


def parser():
    p = argparse.ArgumentParser(
        prog="hvd-adapt-discover",
        description="Host discovery for horovodrun --elastic that offers only the hosts that "
                    "pay (see hvd_adapt.scheduling.discover).")
    base = p.add_mutually_exclusive_group(required=True)
    base.add_argument("--hostfile", help="base hosts: a file of 'host[:slots]' lines")
    base.add_argument("--command", help="base hosts: a command printing 'host[:slots]' lines")
    base.add_argument("--arbiter", metavar="FOLDER",
                      help="offer the hosts hvd-adapt-arbiter grants this job (its folder), "
                           "and report to it at every run")
    p.add_argument("--job", default=None,
                   help="the job's name in the arbiter's logs (default: the hints file's name "
                        "without its extension, else 'job')")
    p.add_argument("--command-timeout", type=float, default=10.0,
                   help="seconds the base command may take (default 10)")
    p.add_argument("--slots", type=int, default=1,
                   help="slots of a host listed without any (default 1)")
    p.add_argument("--hints", default=None,
                   help="the job's published speed-up curve (HVD_ADAPT_HINTS); without it, "
                        "every ready host is offered")
    p.add_argument("--min-np", type=int, default=1)
    p.add_argument("--max-np", type=int, default=None)
    p.add_argument("--initial-np", type=int, default=None,
                   help="workers of the first offer (horovodrun's -np; default --min-np)")
    p.add_argument("--efficiency", type=float, default=0.5,
                   help="least speed-up an added worker must bring, in workers (default 0.5)")
    p.add_argument("--min-gain", type=float, default=0.05,
                   help="least predicted gain worth a resize (default 0.05)")
    p.add_argument("--min-change", type=float, default=0.15,
                   help="least resize, as a share of the current workers (default 0.15)")
    p.add_argument("--growth-limit", type=float, default=2.0,
                   help="most workers, as a multiple of the most the job has timed (default 2)")
    p.add_argument("--ssh-port", type=int, default=22,
                   help="port a new host must answer on (default 22; 0: no check)")
    p.add_argument("--probe-timeout", type=float, default=0.03,
                   help="seconds to wait for the hosts' ports, all at once (default 0.03); "
                        "a host offered last or with sessions that missed it gets a second "
                        "probe of 1.5 s")
    p.add_argument("--lost-after", type=float, default=2.0,
                   help="end the job's ssh sessions to a host that has said nothing (no "
                        "connection, no refusal) to every probe (2 at least) for this many "
                        "seconds, so that Horovod's driver "
                        "counts its workers as failed instead of waiting for the link to "
                        "heal (default 2; 0: never)")
    p.add_argument("--standby-dir", default=None,
                   help="offer new slots only where a standby worker is ready "
                        "(hvd-adapt-worker --standby)")
    p.add_argument("--state", default=None,
                   help="where to remember the hosts offered (default: this user's private "
                        "runtime folder, $XDG_RUNTIME_DIR/hvd_adapt/discover or "
                        "<tmp>/hvd_adapt-<uid>/discover)")
    p.add_argument("--stale-after", type=float, default=600.0,
                   help="ignore hints older than this many seconds (default 600)")
    p.add_argument("--hold", type=float, default=30.0,
                   help="seconds after a resize before the next, while the new world's "
                        "steps are timed (default 30)")
    p.add_argument("--settle", type=float, default=120.0,
                   help="seconds a resize may take before hints from the old world count "
                        "again (default 120)")
    return p


def check(args, p):
    from .arbiter_files import valid_name
    if not valid_name(job_name(args)):
        p.error(f"--job must be letters, digits and _.- (at most 128, not starting with a "
                f"dot), got {job_name(args)!r}")
    if args.min_np < 1:
        p.error(f"--min-np must be >= 1, got {args.min_np}")
    if args.max_np is not None and args.max_np < args.min_np:
        p.error(f"--max-np must be >= --min-np ({args.min_np}), got {args.max_np}")
    if args.initial_np is not None and not args.min_np <= args.initial_np <= (
            args.max_np or args.initial_np):
        p.error(f"--initial-np must be within [--min-np, --max-np], got {args.initial_np}")
    if args.slots < 1:
        p.error(f"--slots must be >= 1, got {args.slots}")
    if not 0 <= args.ssh_port <= 65535:
        p.error(f"--ssh-port must be in [0, 65535], got {args.ssh_port}")
    # "not x >= 0" rather than "x < 0": argparse's float() takes "nan", which no
    # comparison holds for and which ended in a traceback (--command-timeout) or in
    # holds and staleness that never apply.
    if not 0 <= args.lost_after < math.inf:
        p.error(f"--lost-after must be a finite number >= 0 (0: never), got {args.lost_after}")
    for name in ("hold", "settle", "stale_after"):
        if not getattr(args, name) >= 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("probe_timeout", "command_timeout"):
        if not 0 < getattr(args, name) < math.inf:
            p.error(f"--{name.replace('_', '-')} must be a finite number > 0, "
                    f"got {getattr(args, name)}")
    try:
        DiscoveryRule(args.efficiency, args.min_gain, args.min_change, args.growth_limit)
    except ValueError as e:
        p.error(str(e))


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    check(args, p)
    try:
        hosts = discover(args)
    except (BaseDiscoveryError, OSError) as e:    # OSError: the state file (UnsafePathError)
        sys.stderr.write(f"hvd-adapt-discover: {e}\n")
        return 1
    sys.stdout.write("".join(f"{host}:{slots}\n" for host, slots in hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
