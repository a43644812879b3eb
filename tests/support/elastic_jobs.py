"""Elastic jobs under horovodrun whose host discovery follows the job's own progress.

The discovery script reads the steps rank 0 has committed (the progress
file workers/elastic_train.py writes), so resizes land at chosen steps
whatever the speed of the machine.
"""
import os
import stat
import sys
import tempfile

from support.launch import WORKERS, run_job
from support.training_logs import SAMPLES, read_logs

FAST_HOROVODRUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hvdrun_fast_discovery.py")


def discovery_script(out_dir, schedule):
    """``schedule``: [(first_step, [host lines])...], from step 0 on. An entry
    ``(first_step, hosts, seconds)`` holds from ``seconds`` after the script first saw
    ``first_step`` reached: two changes closer together than the driver's polls. An entry
    ``(first_step, hosts, "name")`` holds once the job has also written the file ``name``
    into its output folder: a change at a moment the job chooses."""
    lines = ["#!/bin/bash", f'step=$(cat "{out_dir}/progress" 2>/dev/null || echo 0)',
             "now=$(date +%s.%N)",
             # Seconds since this script first saw step >= $1.
             f'since() {{ f="{out_dir}/seen.$1"; [ -f "$f" ] || echo "$now" > "$f"; '
             'awk -v a="$(cat "$f")" -v b="$now" \'BEGIN {print b - a}\'; }']
    for i, (first, hosts, *delay) in enumerate(reversed(schedule)):
        keyword = "if" if i == 0 else "elif"
        condition = f'[ "$step" -ge {first} ]'
        if delay and isinstance(delay[0], str):
            condition += f' && [ -f "{out_dir}/{delay[0]}" ]'
        elif delay:
            condition += f' && awk -v s="$(since {first})" \'BEGIN {{exit !(s >= {delay[0]})}}\''
        lines.append(f'{keyword} {condition}; then')
        lines += [f'  echo "{h}"' for h in hosts]
    lines.append("fi")
    path = os.path.join(out_dir, "discover.sh")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


def worker_command(worker_args):
    """The training command every worker of :func:`run_elastic` runs."""
    return [sys.executable, os.path.join(WORKERS, "elastic_train.py"),
            "--samples", str(SAMPLES)] + [str(a) for a in worker_args]


def run_elastic(schedule, np, min_np, max_np, worker_args, timeout=180, env=None,
                launcher_args=(), out_dir=None, discovery=None, launch_prefix=(),
                launcher=FAST_HOROVODRUN):
    """Run workers/elastic_train.py under elastic horovodrun with hosts from ``schedule``;
    returns the job, every rank's commits and rank 0's epoch totals. ``discovery(script)``
    turns the schedule's discovery script into the one horovodrun runs (a wrapper);
    ``launch_prefix`` goes before the training command (a launch stub); ``launcher``:
    horovodrun polling discovery every 0.5 s (default) or the real one."""
    out_dir = out_dir or tempfile.mkdtemp(prefix="hvd_adapt_elastic_")
    script = discovery_script(out_dir, schedule)
    command = [sys.executable, launcher, "-np", str(np), "--min-np", str(min_np),
               "--max-np", str(max_np), "--network-interface", "lo",
               "--host-discovery-script", discovery(script) if discovery else script,
               *[str(a) for a in launcher_args], *launch_prefix, *worker_command(worker_args)]
    job = run_job(command, out_dir=out_dir, timeout=timeout, env=env)
    return (job,) + read_logs(out_dir)


def sizes_in_order(commits):
    by_step = {}
    for entry in commits:
        by_step.setdefault(entry["step"], set()).add(entry["size"])
    order = []
    for step in sorted(by_step):
        for size in sorted(by_step[step]):
            if not order or order[-1] != size:
                order.append(size)
    return order
