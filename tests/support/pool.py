"""Elastic jobs sharing a pool of namespace hosts, each offered hosts by one of three policies.

Each job is tests/distributed/workers/elastic_train.py under elastic
``horovodrun`` on h5 (over real ssh to the pool's hosts h1-h4,
``--network-interface eth0``), every worker wrapped in lifetime.py so that when each ran on which
host is logged. The hosts share this machine's cores, so each host's
accelerator is a per-sample sleep that holds a lock of that host's own
(``--device-lock`` on its local tmpfs): two jobs' workers on one host take
turns, as on one GPU. Two kinds of job, as in the scheduling tests:

- ``scales``: a small deep model whose samples each take 0.1 s of
  "accelerator": a second worker nearly doubles its goodput;
- ``comm``: an 8.4M-parameter model with 0.01 s of "accelerator" per sample:
  its allreduce (real, over the bridge, on the shared cores) outweighs what a
  second worker adds.

Policies (the job's ``--host-discovery-script``):

- ``static``: a fixed list of hosts (an equal split, decided by hand);
- ``greedy``: every host of the pool (``hvd-adapt-discover`` without hints:
  every host that answers), so jobs overlap on hosts;
- ``arbiter``: ``hvd-adapt-discover --arbiter``, with ``hvd-adapt-arbiter``
  running on h5.
"""
import collections
import json
import os
import signal
import subprocess
import sys
import time

from support.launch import BIN, WORKERS, launch_env
from support.training_logs import read_logs

LIFETIME = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lifetime.py")
# The discovery's probe of a new host: 30 ms (its default) is often missed on a machine
# whose two cores run every host at once, and a new host gets no second chance.
PROBE_TIMEOUT = 0.5
# The launchers and the arbiter run on a host of their own, outside the pool, as a
# Kubernetes launcher pod does (Horovod 0.28 cannot start a job whose first hosts are all
# local with --network-interface eth0: it looks for 127.0.0.1 on eth0).
LAUNCHER = "h5"
POOL = ["h1", "h2", "h3", "h4"]
KINDS = {
    "scales": ["--model", "deep", "--tokens", "32", "--sample-seconds", "0.1"],
    "comm": ["--model", "wide", "--sample-seconds", "0.01"],
}


class PoolJob:
    """One job: its folder (logs, hints, discovery state), kind, size and launcher."""

    def __init__(self, name, kind, out_dir, samples, epochs, max_np=4, min_np=1):
        """``epochs``: how many it trains, or None: until :meth:`finish` is called (it ends
        at the end of the epoch under way then)."""
        self.name, self.kind, self.out_dir = name, kind, out_dir
        self.samples, self.epochs, self.max_np, self.min_np = samples, epochs, max_np, min_np
        os.makedirs(out_dir, exist_ok=True)
        self.proc = self.started = self.ended = None
        self.returncode = None

    @property
    def hints(self):
        return os.path.join(self.out_dir, "hints.json")

    def start(self, bed, discovery, np=1, extra_env=None, worker_args=()):
        """Launch on LAUNCHER with ``discovery`` (a script's path) and ``-np np``;
        ``worker_args`` go to every worker."""
        until = (["--epochs", str(self.epochs)] if self.epochs else
                 ["--epochs", "100000", "--stop-file", os.path.join(self.out_dir, "finish")])
        worker = [sys.executable, os.path.join(WORKERS, "elastic_train.py"),
                  "--samples", str(self.samples), *until, "--adamw",
                  "--autoscale", "--batch-size", "8", "--max-local-bsz", "16",
                  "--decide-every", "4", "--device-lock", os.path.join(bed.local, "device"),
                  *KINDS[self.kind], *worker_args]
        command = [os.path.join(BIN, "horovodrun"), "-np", str(np), "--min-np",
                   str(self.min_np), "--max-np", str(self.max_np), "--network-interface",
                   "eth0", "--host-discovery-script", discovery, "--elastic-timeout", "900",
                   "--blacklist-cooldown-range", "1", "3", sys.executable, LIFETIME,
                   os.path.join(self.out_dir, "lifetimes.jsonl"), "--", *worker]
        env = launch_env(self.out_dir, dict({"HVD_ADAPT_HINTS": self.hints}, **(extra_env or {})))
        self.log = open(os.path.join(self.out_dir, "output.log"), "w")
        self.started = time.time()
        self.proc = bed.popen(LAUNCHER, command, cwd=self.out_dir, env=env, stdout=self.log,
                              stderr=subprocess.STDOUT, start_new_session=True)

    def finish(self):
        open(os.path.join(self.out_dir, "finish"), "w").close()

    def epochs_trained(self):
        """The epochs rank 0 logged the totals of (each once, in order from 0)."""
        _, epochs = self.logs()
        return len({e["epoch"] for e in epochs})

    def poll(self):
        if self.proc is not None and self.returncode is None:
            code = self.proc.poll()
            if code is not None:
                self.returncode, self.ended = code, time.time()
                self.log.close()
        return self.returncode

    def stop(self):
        """Kill the launcher and what it left (its process group)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.poll()

    def output(self):
        with open(os.path.join(self.out_dir, "output.log")) as f:
            return f.read()

    def logs(self):
        """(commits, epochs) as tests/support/training_logs.py reads them."""
        return read_logs(self.out_dir)

    def lifetimes(self):
        """``[(host, start, end)]`` of every worker process (end None: no end logged)."""
        starts, ends = {}, {}
        path = os.path.join(self.out_dir, "lifetimes.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            for line in f:
                entry = json.loads(line)
                (ends if "end" in entry else starts)[entry["pid"]] = entry
        return [(s["host"], s["start"], ends[pid]["end"] if pid in ends else None)
                for pid, s in starts.items()]


def discovery_script(job, body):
    path = os.path.join(job.out_dir, "discover.sh")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\n{body}\n")
    os.chmod(path, 0o755)
    return path


def static_discovery(job, hosts):
    return discovery_script(job, "".join(f"echo {h}:1\n" for h in hosts).rstrip())


def greedy_discovery(job, hostfile, initial_np=None):
    return discovery_script(job, (
        f"exec {sys.executable} -m hvd_adapt.scheduling.discover --hostfile {hostfile} "
        f"--min-np {job.min_np} --max-np {job.max_np} --initial-np {initial_np or job.min_np} "
        f"--probe-timeout {PROBE_TIMEOUT} --state {job.out_dir}/discover-state.json"))


def arbiter_discovery(job, folder, hold=8, initial_np=None):
    return discovery_script(job, (
        f"exec {sys.executable} -m hvd_adapt.scheduling.discover --arbiter {folder} "
        f"--job {job.name} --hints {job.hints} --min-np {job.min_np} --max-np {job.max_np} "
        f"--initial-np {initial_np or job.min_np} --hold {hold} "
        f"--probe-timeout {PROBE_TIMEOUT} --state {job.out_dir}/discover-state.json"))


def start_arbiter(bed, folder, hostfile, *extra):
    """``hvd-adapt-arbiter`` on LAUNCHER (it probes the hosts' sshd from there), logging
    beside its folder; returns the Popen."""
    log = open(folder + ".log", "a")
    command = [os.path.join(BIN, "hvd-adapt-arbiter"), "--folder", folder, "--hostfile",
               hostfile, "--interval", "1", *extra]
    proc = bed.popen(LAUNCHER, command, stdout=log, stderr=subprocess.STDOUT,
                     start_new_session=True)
    log.close()
    return proc


def write_hostfile(path, hosts):
    with open(path, "w") as f:
        f.write("".join(f"{h}:1\n" for h in hosts))
    return path


def shared_hosts(jobs):
    """Every time two jobs' workers ran on one host at once: ``[(host, job, job, from,
    to)]``, from their lifetime logs (a worker whose end is not logged lives on)."""
    by_host = collections.defaultdict(list)
    for job in jobs:
        for host, start, end in job.lifetimes():
            by_host[host].append((start, end if end is not None else float("inf"), job.name))
    overlaps = []
    for host, lives in by_host.items():
        for i, (s1, e1, a) in enumerate(lives):
            for s2, e2, b in lives[i + 1:]:
                if a != b and s1 < e2 and s2 < e1:
                    overlaps.append((host, a, b, max(s1, s2), min(e1, e2)))
    return overlaps


def rank0_commits(job):
    """Rank 0's committed batches, in time order."""
    commits, _ = job.logs()
    return sorted((c for c in commits if c["rank"] == 0), key=lambda c: c["time"])


def world_starts(job):
    """When each worker process began an attempt of the training function (after a resize,
    a failure's restore or at its start), from its attempts log."""
    from support.training_logs import read_attempts
    return sorted(a["time"] for entries in read_attempts(job.out_dir).values() for a in entries)


def quiet_generation(folder, jobs):
    """The arbiter's generation while nothing moves (None otherwise): no host being given
    back, every job's discovery offering exactly its grant, its world that size, and the
    grants and every job's world at least 3 s old (a world that formed just now is the last
    move's, and would fall in the window that starts 2 s before the kill: a clean run saw one)."""
    try:
        with open(os.path.join(folder, "arbiter.json")) as f:
            state = json.load(f)
        reports = {}
        for key in state["grants"]:
            with open(os.path.join(folder, "jobs", f"{key}.json")) as f:
                reports[key] = json.load(f)
    except (OSError, ValueError):
        return None
    if time.time() - state["written_at"] < 3 or any(j["releasing"]
                                                    for j in state["jobs"].values()):
        return None
    by_name = {job.name: job for job in jobs}
    for key, grant in state["grants"].items():
        report = reports[key]
        commits = rank0_commits(by_name[report["job"]])
        if (sorted(map(tuple, report["offered"])) != sorted(map(tuple, grant))
                or report["generation"] != state["generation"] or not commits
                or commits[-1]["size"] != sum(slots for _, slots in grant)):
            return None
    if any(time.time() - max(world_starts(job), default=0.0) < 3 for job in jobs):
        return None
    return state["generation"]


def wait_until(condition, timeout, jobs=()):
    """Wait until ``condition()`` (True) or ``timeout`` s or a job of ``jobs`` ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if any(job.poll() is not None for job in jobs):
            return False
        time.sleep(0.5)
    return False


def wait_all(jobs, timeout, during=None):
    """Wait until every job's launcher exited (``during()`` called every second) or the
    timeout passed (then every job is stopped); True if all ended by themselves."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # Every job polled each time (a list, not all() over a generator, which stops at the
        # first job still running): a job's end time is when its poll first sees it ended.
        if all([job.poll() is not None for job in jobs]):
            return True
        if during is not None:
            during()
        time.sleep(1)
    for job in jobs:
        job.stop()
    return False


def stop_all(bed, jobs, arbiter=None):
    for job in jobs:
        job.stop()
    if arbiter is not None and arbiter.poll() is None:
        os.killpg(arbiter.pid, signal.SIGKILL)
        arbiter.wait()
    for name in bed.hosts:
        for pid in bed.find(name, "elastic_train.py") + bed.find(name, "lifetime.py"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
