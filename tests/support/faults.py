"""Elastic jobs on the namespace cluster with one host's failure injected mid-training.

:func:`run_fault` starts tests/distributed/workers/elastic_train.py (AdamW
with weight decay, bf16 autocast with a GradScaler, autoscaling with
gradient accumulation) under elastic ``horovodrun`` on the bed's launcher host
(h0 where it has one, else h1), over real ssh to h1, h2 and h3
(``--network-interface eth0``), with a discovery script that
prints the lines of the job folder's ``hosts`` file. Once rank 0 has
committed ``at_step`` steps, ``inject(bed, job)`` injects the fault; the job
then has ``after_fault`` seconds to finish its epochs (about 15 s of
training are left: the bound is what turns a stall of a minute or a hang
into a failure). What every rank logged is
read back for the soak's checks (tests/support/training_logs.py), and
the seconds between the fault and the survivors' next commit are measured
(for benchmarks/fault_recovery.py; the tests assert no time).
"""
import json
import os
import subprocess
import sys
import time

from support.elastic_jobs import FAST_HOROVODRUN
from support.launch import WORKERS, alive, launch_env
from support.training_logs import read_attempts, read_logs

SAMPLES = 96
ALL = ["h1:1", "h2:1", "h3:1"]
WORKER_HOSTS = ("h1", "h2", "h3")


class FaultJob:
    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.process = None            # horovodrun's Popen
        self.returncode = None
        self.output = ""
        self.fault_time = None
        self.commits, self.epochs = [], []

    def set_hosts(self, hosts):
        path = os.path.join(self.out_dir, "hosts")
        with open(path + ".tmp", "w") as f:
            f.write("".join(h + "\n" for h in hosts))
        os.replace(path + ".tmp", path)

    def progress(self):
        try:
            with open(os.path.join(self.out_dir, "progress")) as f:
                return int(f.read() or 0)
        except (OSError, ValueError):
            return 0

    def stall(self):
        """Seconds from the fault to the first commit after it of a rank in a world that
        trained on: the survivors' pause (None before a commit after the fault)."""
        after = sorted(entry["time"] for entry in self.commits
                       if entry["time"] > self.fault_time)
        return after[0] - self.fault_time if after else None

    def longest_pause(self):
        """The longest time without a commit from the fault to the job's end: the
        survivors' pause after a failure, the grow's after a joiner came (None before a
        commit after the fault)."""
        times = sorted({entry["time"] for entry in self.commits if entry["time"] > self.fault_time})
        if not times:
            return None
        return max(b - a for a, b in zip([self.fault_time] + times, times))

    def describe(self):
        return f"exit {self.returncode}, output:\n{self.output[-5000:]}"


def discovery(out_dir, wrapped=False):
    """The job's discovery script: the lines of the job folder's ``hosts`` file, or with
    ``wrapped``, ``hvd-adapt-discover`` wrapping them as a user would (its sshd probe of
    every host, its ending of a lost host's sessions; no hints: every answering host)."""
    path = os.path.join(out_dir, "discover.sh")
    base = f'cat "{out_dir}/hosts"'
    if wrapped:
        base = (f"exec {sys.executable} -m hvd_adapt.scheduling.discover --command '{base}' "
                f"--min-np 2 --max-np 3 --initial-np 3 --hold 0 "
                f'--state "{out_dir}/discover-state.json"')
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\n{base}\n")
    os.chmod(path, 0o755)
    return path


def run_fault(bed, out_dir, inject, at_step=6, after_fault=45, epochs=3, hosts=ALL,
              worker_args=(), launcher_args=(), env=None, np=3, min_np=2, start_timeout=150,
              wrapped_discovery=False, prefix=()):
    """Run the job (``wrapped_discovery``: see :func:`discovery`; ``prefix``: a command
    horovodrun's runs under, such as hvd-adapt-run), call ``inject(bed, job)`` once rank 0 committed ``at_step`` steps
    (within ``start_timeout`` s), wait up to ``after_fault`` seconds more for the job's
    end; return the :class:`FaultJob` (``returncode`` "timeout" where it had to be
    killed)."""
    job = FaultJob(out_dir)
    job.set_hosts(hosts)
    command = [*prefix, sys.executable, FAST_HOROVODRUN, "-np", str(np), "--min-np", str(min_np),
               "--max-np", "3", "--network-interface", "eth0",
               "--host-discovery-script", discovery(out_dir, wrapped_discovery),
               "--blacklist-cooldown-range", "1", "3", *launcher_args,
               sys.executable, os.path.join(WORKERS, "elastic_train.py"),
               "--samples", str(SAMPLES), "--epochs", str(epochs), "--adamw", "--amp",
               "--inf-steps", "[1, 2]", "--autoscale", "--batch-size", "8",
               "--max-local-bsz", "8", "--batch-seconds", "0.1", *worker_args]
    log_path = os.path.join(out_dir, "output.log")
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = job.process = bed.popen(bed.launcher, command, cwd=out_dir,
                                       env=launch_env(out_dir, env), stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while job.progress() < at_step and proc.poll() is None \
                    and time.monotonic() - started < start_timeout:
                time.sleep(0.05)
            if proc.poll() is None and job.progress() >= at_step:
                job.fault_time = time.time()
                inject(bed, job)
                job.returncode = proc.wait(timeout=after_fault)
            else:
                job.returncode = proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            job.returncode = "timeout"
        finally:
            stop_job(bed, proc)
    with open(log_path) as f:
        job.output = f.read()
    job.commits, job.epochs = read_logs(out_dir)
    return job


def crash_dropped(bed, job):
    job.set_hosts(["h1:1", "h2:1"])    # the cluster's scheduler notices the host is gone
    bed.crash("h3")


def crash_listed(bed, job):
    bed.crash("h3")


def partition_dropped(bed, job):
    job.set_hosts(["h1:1", "h2:1"])
    bed.cut("h3")


def partition_listed(bed, job):
    bed.cut("h3")


def wait_for_commit(job, size, since, timeout):
    """Wait until a world of ``size`` committed after ``since`` (time.time()); True if it
    did within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        commits, _ = read_logs(job.out_dir)
        if any(entry["time"] > since and entry["size"] == size for entry in commits):
            return True
        time.sleep(0.2)
    return False


def partition_then_heal(bed, job, trained_on=45, ends_itself=40):
    """Cut h3; once the survivors have committed at 2 (within ``trained_on`` s), heal the
    link: h3's old worker, which waited for the launcher in its reset, ends itself on what
    it finds then (the world it trained in is gone from the rendezvous server, or its ssh
    session is: hvd_adapt/_runtime/liveness.py), and h3 rejoins with a fresh worker. A
    worker left alive would answer for h3's slot in the next world. ``job.heal_time`` is
    when the link came back (None where the survivors never trained on);
    ``job.ended_itself`` whether the old worker was gone within ``ends_itself`` s of the
    heal (it is killed then, so the job goes on, and the test fails on it)."""
    job.heal_time, job.ended_itself = None, None
    old = worker_pid(bed, "h3")
    bed.cut("h3")
    if wait_for_commit(job, 2, job.fault_time, trained_on):
        job.heal_time = time.time()
        bed.heal("h3")
        deadline = time.monotonic() + ends_itself
        while alive(old) and time.monotonic() < deadline:
            time.sleep(0.2)
        job.ended_itself = not alive(old)
        if not job.ended_itself:
            try:
                os.kill(old, 9)
            except ProcessLookupError:
                pass


def launcher_cut_off(bed, job, outages=(12, 30), trained_on=60):
    """Cut the launcher's host off (its link down, no reset: the workers still reach each
    other) for each of ``outages`` seconds in turn, healing it after each and waiting (up
    to ``trained_on`` s) for a commit after the heal. ``job.outages``: ``[(cut, healed)]``
    times."""
    job.outages = []
    for seconds in outages:
        cut = time.time()
        bed.cut(bed.launcher)
        time.sleep(seconds)
        bed.heal(bed.launcher)
        job.outages.append((cut, time.time()))
        wait_for_commit(job, 3, job.outages[-1][1], trained_on)


def kill_launcher(bed, job, ends=60):
    """SIGKILL horovodrun, and wait up to ``ends`` s for every worker on h1..h3 to end.
    ``job.killed_at``: when; ``job.left``: the workers still there after that (killed
    then); ``job.ended_after``: seconds until the last one ended (None where some were
    left)."""
    job.killed_at = time.time()
    job.process.kill()
    deadline = time.monotonic() + ends
    while time.monotonic() < deadline and any(_python_workers(bed, h) for h in WORKER_HOSTS):
        time.sleep(0.1)
    job.left = [pid for host in WORKER_HOSTS for pid in _python_workers(bed, host)]
    job.ended_after = None if job.left else time.time() - job.killed_at


def solo_work_then_crash(bed, job, into=5, started=60):
    """Once rank 0 has started working alone (``--solo-work``, within ``started`` s), crash
    the host of the world's last rank ``into`` seconds later (Horovod's driver orders new
    hosts as a set does: rank 0 need not be on h1); discovery still lists it.
    ``job.crash_time``: when (None where the solo work never started); ``job.crashed``: the
    host."""
    job.crash_time, job.crashed = None, None
    deadline = time.monotonic() + started
    while not os.path.exists(os.path.join(job.out_dir, "solo_started")):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    time.sleep(into)
    attempts = [entry for entries in read_attempts(job.out_dir).values() for entry in entries]
    job.crashed = max((entry for entry in attempts if entry["rank"] == entry["size"] - 1),
                      key=lambda entry: entry["time"])["host"]
    job.crash_time = time.time()
    bed.crash(job.crashed)


def _python_workers(bed, host):
    return [pid for pid in bed.find(host, "elastic_train.py") if _exe(pid).startswith("python")]


def stop_job(bed, proc):
    """End the launcher and every worker it left on any host."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for name in bed.hosts:
        for pid in bed.find(name, "elastic_train.py") + bed.find(name, "hvdrun_fast_discovery"):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def worker_pid(bed, host):
    """The training process of the worker on ``host`` (not its ssh or shell)."""
    pids = _python_workers(bed, host)
    assert pids, f"no worker on {host}"
    return max(pids)


def _exe(pid):
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return ""


def summary(job):
    return json.dumps({"returncode": job.returncode, "stall": job.stall(),
                       "epochs": len(job.epochs)})


def replace_all_hosts(bed, job, lost=("h2", "h3"), new="h4", slots=2):
    """Every host of the job lost at once (all their processes killed, sshd included) in the
    middle of an epoch after the first checkpoint, and the cluster's scheduler offering a new
    host in their place (``new``, down until then, with ``slots``; a bed of 4 hosts), or with
    ``new=None`` the lost hosts themselves coming back under their names (a StatefulSet's
    pods) once the discovery has offered none. ``job.answered`` is when the first host
    answers again (None where the job never got there)."""
    checkpoint = os.path.join(job.out_dir, "job.pt")
    job.answered = None
    deadline = time.monotonic() + 150
    while not os.path.exists(checkpoint):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    step = job.progress()
    while job.progress() < step + 2:
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    job.fault_time = time.time()
    for host in lost:
        bed.crash(host)
    if new is not None:
        job.set_hosts([f"{new}:{slots}"])
        bed.heal(new)
        job.answered = time.time()
        return
    log = os.path.join(job.out_dir, "output.log")
    while time.monotonic() < deadline:
        with open(log) as f:
            if "0 worker(s) on no host" in f.read():
                break
        time.sleep(0.1)
    for host in lost:
        bed.heal(host)
        job.answered = job.answered or time.time()
