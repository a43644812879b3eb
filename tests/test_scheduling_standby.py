"""Warm standby workers: handover of environment, streams and exit status; signals; cold
starts; a stub killed with its slot takes the script with it."""
import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hvd_adapt.scheduling import ready, standby

WORKER = [sys.executable, "-m", "hvd_adapt.scheduling.standby"]

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from hvd_adapt.scheduling.standby import wait_for_handover
    started = time.time()
    pid_file = sys.argv[1]
    wait_for_handover()
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    mode = os.environ.get("MODE", "print")
    if mode == "print":
        print("FOO=" + os.environ.get("FOO", "") + " cwd=" + os.getcwd(), flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        sys.exit(3)
    if mode == "modules":
        print(" ".join(f"{name}={name in sys.modules}"
                       for name in ("torch._dynamo", "hvd_adapt.optim.distributed")), flush=True)
    if mode == "term":
        def on_term(signum, frame):
            print("drained", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, on_term)
        print("waiting", flush=True)
        time.sleep(60)
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("waiting", flush=True)
        time.sleep(60)
""")


@pytest.fixture
def setup(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    command = [sys.executable, str(script), str(tmp_path / "pid")]
    supervisors = []

    def start_standby(host="h1", cmd=None):
        proc = subprocess.Popen(WORKER + ["--standby", "--standby-dir", str(tmp_path / "ready"),
                                          "--host", host, "--"] + (cmd or command),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        supervisors.append(proc)
        deadline = time.time() + 60
        while ready.ready_count(str(tmp_path / "ready"), host) == 0:
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "the standby never became ready"
            time.sleep(0.05)
        return proc

    def launch(env=None, host="h1", **kwargs):
        return subprocess.Popen(WORKER + ["--standby-dir", str(tmp_path / "ready"), "--"]
                                + command, env=dict(os.environ, HOROVOD_HOSTNAME=host,
                                                    **(env or {})),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                **kwargs)

    yield tmp_path, start_standby, launch
    for proc in supervisors:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_handover_passes_environment_cwd_streams_and_exit_code(setup):
    tmp_path, start_standby, launch = setup
    supervisor = start_standby()
    work = tmp_path / "work"
    work.mkdir()
    stub = launch({"FOO": "bar"}, cwd=str(work))
    out, err = stub.communicate(timeout=60)
    assert stub.returncode == 3, err
    assert out == f"FOO=bar cwd={work}\n"
    assert "to stderr" in err and "starting cold" not in err
    # The script that ran is the standby's child, not a process of the stub.
    assert int((tmp_path / "pid").read_text()) != stub.pid
    assert supervisor.wait(timeout=30) == 3
    assert glob.glob(str(tmp_path / "ready" / "h1" / "*")) == []


def test_the_standby_has_imported_what_a_script_needs_after_init(setup):
    # The survivors wait while a joiner imports these: a standby does it before its slot.
    tmp_path, start_standby, launch = setup
    start_standby()
    out, _ = launch(env={"MODE": "modules"}).communicate(timeout=60)
    assert out.split() == ["torch._dynamo=True", "hvd_adapt.optim.distributed=True"], out


def test_without_a_ready_standby_the_stub_starts_cold(setup):
    tmp_path, start_standby, launch = setup
    start_standby(host="other")
    stub = launch({"FOO": "cold"})
    out, err = stub.communicate(timeout=60)
    assert stub.returncode == 3
    assert out.startswith("FOO=cold") and "no standby ready on h1; starting cold" in err
    assert ready.ready_count(str(tmp_path / "ready"), "other") == 1


def test_a_standby_of_another_command_is_not_taken(setup):
    tmp_path, start_standby, launch = setup
    start_standby(cmd=[sys.executable, str(tmp_path / "script.py"), str(tmp_path / "pid2")])
    stub = launch()
    _, err = stub.communicate(timeout=60)
    assert "starting cold" in err
    assert ready.ready_count(str(tmp_path / "ready"), "h1") == 1


def test_sigterm_to_the_stub_reaches_the_script(setup):
    tmp_path, start_standby, launch = setup
    start_standby()
    stub = launch({"MODE": "term"})
    assert stub.stdout.readline() == "waiting\n"
    stub.send_signal(signal.SIGTERM)
    out, _ = stub.communicate(timeout=30)
    assert stub.returncode == 7 and out == "drained\n"


def test_a_killed_stub_takes_the_script_with_it(setup):
    tmp_path, start_standby, launch = setup
    supervisor = start_standby()
    stub = launch({"MODE": "ignore-term"})
    assert stub.stdout.readline() == "waiting\n"
    pid = int((tmp_path / "pid").read_text())
    # horovodrun's way: SIGTERM, then SIGKILL; the script ignores the SIGTERM.
    stub.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    stub.kill()
    stub.communicate()
    assert supervisor.wait(timeout=30) == 128 + signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_script_that_ends_before_init_is_reported(tmp_path):
    out = subprocess.run(WORKER + ["--standby", "--standby-dir", str(tmp_path), "--host", "h",
                                   "--", sys.executable, "-c", "print('no init')"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "before it reached hvd_adapt.init()" in out.stderr
    assert glob.glob(str(tmp_path / "h" / "*")) == []


def test_hvd_adapt_init_waits_in_a_standby(setup):
    tmp_path, start_standby, launch = setup
    script = tmp_path / "init.py"
    script.write_text("import os, hvd_adapt\nhvd_adapt.init()\n"
                      "print(hvd_adapt.env.size(), os.environ['FOO'], flush=True)\n")
    command = [sys.executable, str(script)]
    start_standby(cmd=command)
    stub = subprocess.Popen(WORKER + ["--standby-dir", str(tmp_path / "ready"), "--"] + command,
                            env=dict(os.environ, HOROVOD_HOSTNAME="h1", FOO="handed"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = stub.communicate(timeout=120)
    assert stub.returncode == 0, err
    assert out == "1 handed\n"


def test_ready_files_expire_without_heartbeat(tmp_path):
    folder = tmp_path / "h"
    folder.mkdir()
    (folder / "1.json").write_text(json.dumps({}))
    (folder / "2.claimed").write_text(json.dumps({}))
    old = tmp_path / "h" / "3.json"
    old.write_text("{}")
    os.utime(old, (time.time() - 2 * ready.FRESH_SECONDS,) * 2)
    assert ready.ready_count(str(tmp_path), "h") == 1
    assert ready.ready_count(str(tmp_path), "absent") == 0


def test_missing_command_is_an_error(capsys):
    with pytest.raises(SystemExit):
        standby.main(["--standby-dir", "x"])
    assert "the training command is missing" in capsys.readouterr().err
