"""hvd-adapt-run's own mechanics with plain commands in place of horovodrun (the Horovod
jobs are in tests/distributed/test_job_supervisor.py): what a run leaves behind is ended
before the next, a supervisor that dies stops its command and keeps the job locked until
that ends, signals are passed on and stop the restarts, and the decisions it takes on a
run's end."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hvd_adapt.scheduling import job_supervisor
from hvd_adapt.scheduling.job_supervisor import JobSupervisor
from hvd_adapt.scheduling.launcher_output import LineSplitter, RunOutput
from hvd_adapt._runtime.script_end import format_record
from support.launch import alive
from support.second_user import OTHER_UID, as_other_user

SUPERVISOR = [sys.executable, "-m", "hvd_adapt.scheduling.job_supervisor"]


def supervise(tmp_path, script, *options, **kwargs):
    return subprocess.run(SUPERVISOR + ["--lock", str(tmp_path / "job.lock"), *options, "--",
                                        "sh", "-c", script],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, **kwargs)


def wait_for(path, timeout=60):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.05)


def test_what_a_run_leaves_behind_is_ended_before_the_next_launch(tmp_path):
    # Each launch starts a process that outlives it (a worker orphaned when horovodrun is
    # SIGKILLed) and is then killed; the next launch looks for the last one's.
    script = ('[ -f left.0 ] && kill -0 "$(cat left.0)" 2>/dev/null && touch overlapped\n'
              'sleep 300 & echo $! > "left.$HVD_ADAPT_RESTARTS"\nkill -9 $$\n')
    result = supervise(tmp_path, script, "--max-restarts", "1")
    assert result.returncode == 137, result.stderr
    assert not (tmp_path / "overlapped").exists()
    for launch in (0, 1):
        assert not alive(int((tmp_path / f"left.{launch}").read_text())), launch
    assert result.stderr.count("left 1 process(es) of its run on this machine") == 2
    assert "restart 1 of 1" in result.stderr and "horovodrun was killed by SIGKILL" in result.stderr
    assert "restart budget is spent (--max-restarts 1): exiting with 137" in result.stderr


def test_a_supervisor_that_dies_stops_its_command_which_keeps_the_job_locked(tmp_path):
    # The command drains for as long as the test says (file "go"): meanwhile no second copy.
    script = ('trap \'while [ ! -f go ]; do sleep 0.05; done; touch stopped; exit 0\' TERM\n'
              'touch started\nwhile :; do sleep 0.05; done\n')
    first = subprocess.Popen(SUPERVISOR + ["--lock", str(tmp_path / "job.lock"), "--",
                                           "sh", "-c", script],
                             cwd=tmp_path, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(tmp_path / "started")
        first.kill()
        first.wait()
        second = supervise(tmp_path, "true")
        assert second.returncode == 1 and "this job is already running" in second.stderr, \
            second.stderr
        (tmp_path / "go").touch()
        wait_for(tmp_path / "stopped")
        # Its command gone, the lock is free.
        deadline = time.monotonic() + 60
        while supervise(tmp_path, "true").returncode != 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        (tmp_path / "go").touch()
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigterm_is_passed_on_and_nothing_is_launched_again(tmp_path):
    script = 'trap "exit 7" TERM\ntouch "started.$HVD_ADAPT_RESTARTS"\nwhile :; do sleep 0.05; done\n'
    proc = subprocess.Popen(SUPERVISOR + ["--lock", str(tmp_path / "job.lock"), "--",
                                          "sh", "-c", script],
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    wait_for(tmp_path / "started.0")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 7, stderr
    assert "stopped by SIGTERM (passed on to horovodrun); exiting with 7" in stderr
    assert sorted(os.listdir(tmp_path)) == ["job.lock", "started.0"]


@pytest.mark.parametrize("argv,message", [
    (["--max-restarts", value, "--", "true"],
     f"argument --max-restarts: must be a whole number >= 0, got '{value}'")
    for value in ("-1", "1.5", "three")] + [
    (["--lock", "", "--", "true"], "--lock must name a file, got ''"),
    ([], "the horovodrun command is missing (give it after --)"),
    (["--"], "the horovodrun command is missing (give it after --)"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        job_supervisor.main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("where", ["a folder", "in a missing folder"])
def test_a_lock_that_cannot_be_taken_is_named(tmp_path, where):
    lock = tmp_path if where == "a folder" else tmp_path / "missing" / "job.lock"
    result = subprocess.run(SUPERVISOR + ["--lock", str(lock), "--", "touch", "ran"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"cannot take the job's lock {lock}:" in result.stderr, result.stderr
    assert not (tmp_path / "ran").exists()


def test_a_runtime_folder_another_user_made_first_is_a_clear_error(tmp_path, shared_tmp):
    # The default lock's folder, <tmp>/hvd_adapt-<uid>, planted by another local user.
    ours = os.path.join(shared_tmp, f"hvd_adapt-{os.geteuid()}")
    as_other_user(lambda: os.mkdir(ours))
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    result = subprocess.run(SUPERVISOR + ["--", "touch", "ran"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60,
                            env=dict(env, TMPDIR=shared_tmp))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"belongs to uid {OTHER_UID}" in result.stderr and not (tmp_path / "ran").exists()


def test_a_supervisor_started_with_its_output_closed_keeps_the_lock_apart(tmp_path):
    # Started with standard output closed (a daemon's, a cron line's >&-): the lock file must
    # not take descriptor 1, where the job's output would overwrite the holder's record and
    # horovodrun's own standard output would replace the lock it should inherit.
    lock = tmp_path / "job.lock"
    holds = (f'echo job output; for f in /proc/$$/fd/*; do [ "$(readlink "$f")" = "{lock}" ] '
             '&& exit 0; done; exit 3')
    command = " ".join(f"'{a}'" for a in SUPERVISOR + ["--lock", str(lock), "--", "sh", "-c",
                                                       holds])
    result = subprocess.run(["sh", "-c", f"exec {command} 1>&-"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(lock.read_text())["pid"] > 0


def test_a_command_that_cannot_run_says_so(tmp_path):
    result = subprocess.run(SUPERVISOR + ["--lock", str(tmp_path / "job.lock"), "--",
                                          str(tmp_path / "no-such-horovodrun")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 127 and "cannot run" in result.stderr, result.stderr


def output(*lines):
    out = RunOutput("tok")
    splitter = LineSplitter(out.read_line)
    splitter.feed("".join(line + "\n" for line in lines).encode())
    splitter.close()
    return out


def test_what_each_end_of_a_run_means(tmp_path):
    supervisor = JobSupervisor(["horovodrun"], lock_path=str(tmp_path / "job.lock"))
    gave_up = "ERROR:root:failure count == 2 -> stop running"
    both = [format_record("tok", rank, 2, 9, ValueError("bug")).strip() for rank in (0, 1)]
    assert supervisor.judge(0, output(gave_up)) == (False, 0, "the script finished")
    restart, code, why = supervisor.judge(1, output(gave_up))
    assert restart and code == 1 and why.startswith("every worker of the world failed")
    restart, code, why = supervisor.judge(1, output(gave_up, *both))
    assert not restart and code == 1 and "rank 0: ValueError: bug" in why
    restart, code, why = supervisor.judge(1, output(gave_up, both[1]))
    assert restart and "the script ended on some ranks only (rank 1 of 2: ValueError: bug)" in why
    assert supervisor.judge(-9, output()) == (True, 137, "horovodrun was killed by SIGKILL")
    restart, code, why = supervisor.judge(2, output("horovodrun: error: bad arguments"))
    assert not restart and code == 2 and "no sign that a running job was given up" in why
    supervisor.stop_signal = signal.SIGTERM
    assert supervisor.judge(1, output(gave_up))[:2] == (False, 1)


def test_a_script_that_exits_0_on_some_ranks_and_raises_on_others_is_no_success(tmp_path):
    # Rank 0 leaves with sys.exit(0), rank 1 raises: horovodrun fails, and so must the job.
    supervisor = JobSupervisor(["horovodrun"], lock_path=str(tmp_path / "job.lock"))
    records = [format_record("tok", 0, 2, 9, SystemExit(0)).strip(),
               "[1]<stderr>:" + format_record("tok", 1, 2, 9, ValueError("bug")).strip()]
    restart, code, why = supervisor.judge(1, output(*records))
    assert not restart and code == 1 and "rank 1: ValueError: bug" in why
    # Every rank said 0 but horovodrun failed after: its code, never 0.
    zeros = [format_record("tok", rank, 2, 9, SystemExit(0)).strip() for rank in (0, 1)]
    assert supervisor.judge(3, output(*zeros))[:2] == (False, 3)
    assert supervisor.judge(0, output(*zeros)) == (False, 0, "the script finished")


def test_a_job_every_rank_drained_exits_143_though_horovodrun_said_0(tmp_path):
    # Seen once on a loaded machine: SIGTERM passed on, both ranks drained (SystemExit 143),
    # and elastic horovodrun exited 0; the job looked finished to whatever ran it.
    supervisor = JobSupervisor(["horovodrun"], lock_path=str(tmp_path / "job.lock"))
    supervisor.stop_signal = signal.SIGTERM
    drained = [format_record("tok", rank, 2, 2, SystemExit(143)).strip() for rank in (0, 1)]
    restart, code, why = supervisor.judge(0, output(*drained))
    assert not restart and code == 143 and "SystemExit: 143" in why


def test_the_supervisor_loads_no_training_stack():
    code = ("import sys, hvd_adapt.scheduling.job_supervisor\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'horovod', 'numpy'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# A supervisor whose evidence waits are 1 s (DRIVER_EXIT_SECONDS), around a stand-in for
# horovodrun: a Python script that starts worker sessions as horovodrun does.
LOWERED = ("import sys\nfrom hvd_adapt.scheduling import job_supervisor\n"
           "job_supervisor.DRIVER_EXIT_SECONDS = 1.0\n"
           "sys.exit(job_supervisor.main(sys.argv[1:]))")


def supervise_stand_in(tmp_path, stand_in, *args):
    return subprocess.run([sys.executable, "-c", LOWERED, "--lock", str(tmp_path / "job.lock"),
                           "--max-restarts", "0", "--", sys.executable, "-c", stand_in,
                           *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_a_horovodrun_that_hangs_after_its_driver_stopped_the_job_is_killed(tmp_path):
    # Horovod 0.28 at times never exits after "-> stop running" (a registry thread left in
    # its barrier: tests/cluster/test_host_replacement.py meets it). Here a stand-in whose
    # worker session ends, that says the driver's words and then ignores SIGTERM, with the
    # wait lowered to 1 s.
    result = supervise_stand_in(tmp_path, HANGS_AFTER_THE_STOP)
    assert result.returncode == 137, result.stderr
    assert "its workers are gone and horovodrun has not exited (it hangs at times after a " \
        "stop): killing it" in result.stderr
    assert "restart budget is spent (--max-restarts 0): exiting with 137" in result.stderr


HANGS_AFTER_THE_STOP = r'''
import signal, subprocess, sys, time
subprocess.run(["sh", "-c", "env HOROVOD_HOSTNAME=localhost HOROVOD_RANK=0 sleep 3"])
print("ERROR:root:failure count == 1 -> stop running", file=sys.stderr, flush=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
while True:
    time.sleep(0.05)
'''


def test_a_lock_planted_where_the_job_would_put_it_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "job.lock")
    result = supervise(tmp_path, "touch ran")
    assert result.returncode == 1 and "is a symlink: refusing to use it as a lock" in result.stderr
    assert victim.read_text() == "precious" and not (tmp_path / "ran").exists()


# A worker on this host, started as horovodrun starts one: a shell whose command line
# exports the slot's variables; it says the driver's words (as a script that logs what it
# caught might), trains on for 6 s and finishes.
SAYS_THE_DRIVERS_WORDS = r'''
import subprocess, sys
said = sys.argv[1] + "ERROR:root:failure count == 2 -> stop running"
worker = subprocess.Popen(["sh", "-c", "env HOROVOD_HOSTNAME=localhost HOROVOD_RANK=0 "
                           f"sh -c 'echo \"{said}\"; sleep 6; touch finished'"])
sys.exit(worker.wait())
'''


@pytest.mark.parametrize("prefix", ["", "[1,0]<stdout>:"], ids=["mpirun", "horovodrun-mpi"])
def test_a_script_printing_the_drivers_words_does_not_end_its_job(tmp_path, prefix):
    # Plain mpirun passes a worker's lines on as they are, horovodrun's MPI mode tags them
    # as Open MPI does ("[1,0]<stdout>:"), not as its Gloo mode ("[0]<stdout>:"). A line of
    # output alone is no evidence that a horovodrun hangs: its workers still run.
    result = supervise_stand_in(tmp_path, SAYS_THE_DRIVERS_WORDS, prefix)
    assert result.returncode == 0, result.stderr
    assert "killing it" not in result.stderr and (tmp_path / "finished").exists()


# A remote worker's session (ssh's command line carries the slot's variables) fails; the
# worker on this host trains on for 6 s. Horovod runs that one as
# `sh -c 'env HOROVOD_...=... python train.py'`, which bash, /bin/sh on RHEL, Fedora and
# Arch, execs: its command line says nothing of Horovod, its environment does.
LOCAL_WORKER_OUTLIVES_A_REMOTE_ONE = r'''
import os, subprocess, sys
remote = subprocess.Popen([os.path.abspath("ssh"), "h2", "cd /job > /dev/null 2>&1 ; env "
                           "HOROVOD_HOSTNAME=h2 HOROVOD_RANK=1 python train.py"])
local = subprocess.Popen(["sh", "-c", "exec env HOROVOD_HOSTNAME=localhost HOROVOD_RANK=0 "
                          "sh -c 'sleep 6; touch finished'"])
if remote.wait():
    print(f"Process 1 exit with status code {remote.returncode}.", flush=True)
sys.exit(local.wait())
'''


def test_a_worker_whose_shell_execd_it_counts_as_a_worker(tmp_path):
    ssh = tmp_path / "ssh"
    ssh.write_text("#!/bin/sh\nsleep 3\nexit 255\n")
    ssh.chmod(0o755)
    result = supervise_stand_in(tmp_path, LOCAL_WORKER_OUTLIVES_A_REMOTE_ONE)
    assert result.returncode == 0, result.stderr
    assert "has had no worker" not in result.stderr and (tmp_path / "finished").exists()
