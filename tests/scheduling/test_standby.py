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
from support.launch import alive, torch_as_is
from support.second_user import OTHER_UID, as_other_user, other_user_running

WORKER = [sys.executable, "-m", "hvd_adapt.scheduling.standby"]

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from hvd_adapt._runtime.handover import wait_for_handover
    started = time.time()
    pid_file = sys.argv[1]
    wait_for_handover()
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    mode = os.environ.get("MODE", "print")
    if mode == "print":
        print("FOO=" + os.environ.get("FOO", "") + " cwd=" + os.getcwd() + " "
              + " ".join(f"{name}={os.environ.get(name)}" for name in ("SECRET", "HOROVOD_RANK")),
              flush=True)
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
                                env=torch_as_is(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        supervisors.append(proc)
        deadline = time.time() + 60
        while not ready.ready_files(str(tmp_path / "ready"), host):
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "the standby never became ready"
            time.sleep(0.05)
        return proc

    def launch(env=None, host="h1", **kwargs):
        return subprocess.Popen(WORKER + ["--standby-dir", str(tmp_path / "ready"),
                                          "--pass-env", "FOO", "--pass-env", "MODE", "--"]
                                + command, env=torch_as_is(dict(os.environ, HOROVOD_HOSTNAME=host,
                                                                **(env or {}))),
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
    # The launcher's secrets stay with the stub; Horovod's slot variables and the names
    # given with --pass-env go.
    stub = launch({"FOO": "bar", "SECRET": "hunter2", "HOROVOD_RANK": "5"}, cwd=str(work))
    out, err = stub.communicate(timeout=60)
    assert stub.returncode == 3, err
    assert out == f"FOO=bar cwd={work} SECRET=None HOROVOD_RANK=5\n"
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
    assert len(ready.ready_files(str(tmp_path / "ready"), "other")) == 1


def test_a_standby_of_another_command_is_not_taken(setup):
    tmp_path, start_standby, launch = setup
    start_standby(cmd=[sys.executable, str(tmp_path / "script.py"), str(tmp_path / "pid2")])
    stub = launch()
    _, err = stub.communicate(timeout=60)
    assert "starting cold" in err
    assert len(ready.ready_files(str(tmp_path / "ready"), "h1")) == 1


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
    stub = subprocess.Popen(WORKER + ["--standby-dir", str(tmp_path / "ready"), "--pass-env",
                                      "FOO", "--"] + command,
                            env=dict(os.environ, HOROVOD_HOSTNAME="h1", FOO="handed"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = stub.communicate(timeout=120)
    assert stub.returncode == 0, err
    assert out == "1 handed\n"


def test_a_heartbeat_is_judged_by_changes_the_reader_saw_not_by_clocks(tmp_path):
    folder = tmp_path / "h"
    folder.mkdir(mode=0o700)
    live, dead = folder / "1.json", folder / "2.json"
    live.write_text("{}")
    # A dead standby's file stamped an hour ahead of this machine's clock (another
    # machine's, an NFS server's): it never changes, so it never counts.
    dead.write_text("{}")
    os.utime(dead, (time.time() + 3600,) * 2)
    (folder / "3.claimed").write_text("{}")
    count, seen = ready.ready_count(str(tmp_path), "h", {}, now=100.0)
    assert count == 0                               # first sight: nothing seen beating yet
    # The live one beats with a clock six seconds behind the reader's.
    os.utime(live, (time.time() - 6,) * 2)
    count, seen = ready.ready_count(str(tmp_path), "h", seen, now=101.0)
    assert count == 1 and sorted(seen) == [str(live), str(dead)]
    count, seen = ready.ready_count(str(tmp_path), "h", seen, now=101.0 + ready.FRESH_SECONDS)
    assert count == 1
    count, seen = ready.ready_count(str(tmp_path), "h", seen, now=102.0 + ready.FRESH_SECONDS)
    assert count == 0                               # it stopped beating
    live.unlink()
    assert ready.ready_count(str(tmp_path), "h", seen, now=103.0) == \
        (0, {str(dead): seen[str(dead)]})
    assert ready.ready_count(str(tmp_path), "absent", {}, now=0.0) == (0, {})


def test_missing_command_is_an_error(capsys):
    with pytest.raises(SystemExit):
        standby.main(["--standby-dir", "x"])
    assert "the training command is missing" in capsys.readouterr().err


def test_a_killed_supervisor_takes_the_script_with_it(setup):
    tmp_path, start_standby, launch = setup
    supervisor = start_standby()
    stub = launch({"MODE": "ignore-term"})
    assert stub.stdout.readline() == "waiting\n"
    pid = int((tmp_path / "pid").read_text())
    supervisor.kill()
    _, err = stub.communicate(timeout=60)
    assert stub.returncode == 1 and "went away without an exit status" in err
    deadline = time.time() + 30
    while alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(pid), "the script outlived its supervisor"


def test_a_supervisor_refuses_folders_others_may_write(tmp_path, shared_tmp):
    def supervise(env):
        return subprocess.run(WORKER + ["--standby", "--standby-dir", str(tmp_path), "--host",
                                        "h", "--", sys.executable, "-c", "print('ran')"],
                              capture_output=True, text=True, timeout=60, env=env)

    (tmp_path / "h").mkdir()
    os.chmod(tmp_path / "h", 0o777)
    out = supervise(os.environ)
    assert out.returncode == 2 and "ran" not in out.stdout
    assert "writable by other users" in out.stderr and str(tmp_path / "h") in out.stderr
    # The runtime folder of its socket, made first by another user in a shared temp folder.
    os.chmod(tmp_path / "h", 0o700)
    runtime = os.path.join(shared_tmp, f"hvd_adapt-{os.geteuid()}")
    as_other_user(lambda: os.mkdir(runtime))
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    out = supervise(dict(env, TMPDIR=shared_tmp))
    assert out.returncode == 2 and "ran" not in out.stdout
    assert f"{runtime} belongs to uid {OTHER_UID}" in out.stderr, out.stderr


def test_a_socket_address_too_long_is_a_clear_error_before_the_boot(tmp_path):
    # A deep TMPDIR (no XDG_RUNTIME_DIR) makes the socket's path longer than AF_UNIX takes.
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    out = subprocess.run(WORKER + ["--standby", "--standby-dir", str(tmp_path), "--host", "h",
                                   "--", sys.executable, "-c", "print('ran')"],
                         capture_output=True, text=True, timeout=60, env=dict(env, TMPDIR=deep))
    assert out.returncode == 2 and "ran" not in out.stdout, out.stderr
    assert "cannot bind its socket" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_stub_that_dies_before_its_hand_over_ends_the_standby_cleanly(tmp_path):
    # A stand-in script that reports ready as wait_for_handover does, without importing torch.
    script = tmp_path / "ready.py"
    script.write_text(textwrap.dedent("""
        import json, os, socket, struct, time
        sock = socket.socket(fileno=int(os.environ["HVD_ADAPT_STANDBY_FD"]))
        data = json.dumps({"ready": True}).encode()
        sock.sendall(struct.pack("!Q", len(data)) + data)
        print(os.getpid(), flush=True)
        time.sleep(600)
    """))
    supervisor = subprocess.Popen(WORKER + ["--standby", "--standby-dir", str(tmp_path / "r"),
                                            "--host", "h", "--", sys.executable, str(script)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        script_pid = int(supervisor.stdout.readline())
        while not glob.glob(str(tmp_path / "r" / "h" / "*.json")):
            assert supervisor.poll() is None, supervisor.stderr.read()
            time.sleep(0.05)
        ready_file, = glob.glob(str(tmp_path / "r" / "h" / "*.json"))
        with open(ready_file) as f:
            address = json.load(f)["socket"]
        import socket
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stub:     # connects, dies
            stub.connect(address)
        err = supervisor.communicate(timeout=60)[1]
    finally:
        supervisor.kill()
    assert supervisor.returncode == 1 and "Traceback" not in err, err
    assert "the launch stub went away before it handed over its slot" in err, err
    assert not alive(script_pid)


def fake_standby(folder, command, pid):
    """A fake standby in ``folder``: a ready file for ``command`` naming ``pid``, and the
    listening socket it names (returned with its address)."""
    import socket
    address = os.path.join(folder, f"{pid}.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    os.chmod(address, 0o777)
    server.listen(4)
    with open(os.path.join(folder, f"{pid}.json"), "w") as f:
        json.dump({"socket": address, "pid": pid, "command": command, "ready_at": 0}, f)
    os.chmod(os.path.join(folder, f"{pid}.json"), 0o666)
    return server, address


@pytest.mark.parametrize("folder_owner", ["other", "us"])
def test_another_user_cannot_take_a_slot(setup, shared_tmp, folder_owner):
    # The standby folder on a shared path: another local user plants a ready file for our
    # command, naming a socket of its own. The stub must not connect: it starts cold.
    tmp_path, _, _ = setup
    command = [sys.executable, str(tmp_path / "script.py"), str(tmp_path / "pid")]
    host = os.path.join(shared_tmp, "h1")
    hijacked = os.path.join(shared_tmp, "hijacked")
    if folder_owner == "us":
        os.mkdir(host)
        os.chmod(host, 0o777)             # ours, but others may write it

    def hijack():
        if folder_owner == "other":
            os.mkdir(host)
            os.chmod(host, 0o777)
        server, _ = fake_standby(host, command, os.getpid())
        open(os.path.join(shared_tmp, "planted"), "w").close()
        connection, _ = server.accept()
        open(hijacked, "w").write(repr(connection.recv(1 << 16)))

    with other_user_running(hijack):
        deadline = time.time() + 30
        while not os.path.exists(os.path.join(shared_tmp, "planted")):
            assert time.time() < deadline, "the second user never planted its file"
            time.sleep(0.05)
        stub = subprocess.Popen(WORKER + ["--standby-dir", shared_tmp, "--"] + command,
                                env=dict(os.environ, HOROVOD_HOSTNAME="h1", FOO="mine",
                                         SECRET="hunter2"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = stub.communicate(timeout=60)
        time.sleep(0.5)                   # a connection the stub made would be recorded now
        assert not os.path.exists(hijacked), open(hijacked).read()
    assert stub.returncode == 3 and out.startswith("FOO=mine"), err
    assert "not using the standby folder" in err and "starting cold" in err


def test_a_claim_that_fails_in_any_way_starts_cold(setup):
    # Ready files of this user that are not a live standby's: garbage, and one whose socket
    # is served by another process than the pid it names. Neither gets the slot.
    import socket
    tmp_path, _, launch = setup
    command = [sys.executable, str(tmp_path / "script.py"), str(tmp_path / "pid")]
    folder = tmp_path / "ready" / "h1"
    folder.mkdir(parents=True, mode=0o700)
    (folder / "1.json").write_text("[")
    (folder / "2.json").write_text(json.dumps({"socket": 5, "pid": "x", "command": command}))
    server, address = fake_standby(str(folder), command, 5)
    os.chmod(address, 0o600)
    os.chmod(folder / "5.json", 0o600)
    # Two killed standbys' files: one whose socket is gone, one whose socket nobody serves.
    (folder / "3.json").write_text(json.dumps({"socket": str(tmp_path / "gone.sock"), "pid": 3,
                                               "command": command}))
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(tmp_path / "dead.sock"))
    dead.close()
    (folder / "4.json").write_text(json.dumps({"socket": str(tmp_path / "dead.sock"), "pid": 4,
                                               "command": command}))
    with server:
        stub = launch({"FOO": "cold"})
        server.settimeout(30)
        try:
            connection, _ = server.accept()     # the stub connects, then refuses ...
            connection.close()
        except socket.timeout:
            pass
        out, err = stub.communicate(timeout=60)
    assert stub.returncode == 3 and out.startswith("FOO=cold"), err
    assert "is served by pid" in err and "not a ready file" in err and "starting cold" in err
    assert "1.json: Expecting value" in err
    # The killed standbys' files are cleared away; the others are left for their owners.
    assert sorted(os.listdir(folder)) == ["1.json", "2.json", "5.claimed", "5.sock"]


def test_a_ready_file_that_cannot_be_written_ends_the_standby_and_its_script(tmp_path):
    # A full disk for the supervisor once its script runs, as RLIMIT_FSIZE gives it: every
    # write past 0 bytes fails (EFBIG; Python ignores SIGXFSZ).
    import resource
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    supervisor = subprocess.Popen(
        WORKER + ["--standby", "--standby-dir", str(tmp_path / "ready"), "--host", "h", "--",
                  sys.executable, str(script), str(tmp_path / "pid")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children = f"/proc/{supervisor.pid}/task/{supervisor.pid}/children"
    deadline = time.time() + 60
    while not open(children).read().split():
        assert time.time() < deadline and supervisor.poll() is None, "no script started"
        time.sleep(0.01)
    script_pid = int(open(children).read().split()[0])
    resource.prlimit(supervisor.pid, resource.RLIMIT_FSIZE, (0, 0))
    _, err = supervisor.communicate(timeout=120)
    assert supervisor.returncode == 1 and "cannot publish" in err, err
    assert os.listdir(tmp_path / "ready" / "h") == []
    assert not alive(script_pid)
