"""hvd-adapt-discover ends the sessions of a host the job lost (silent while its peers reset),
under Horovod's real safe_shell_exec (hvd_adapt/scheduling/sessions.py): a small "driver"
runs one command per host as Horovod does (a middleman in a session of its own; the
command's program named ``ssh``, the host an argument, the job's rendezvous server named as
horovodrun names it) and then runs the discovery through the same helper."""
import json
import os
import socket
import subprocess
import sys

import pytest

from hvd_adapt._runtime.rendezvous import RESET_KEY, RESET_SCOPE
from hvd_adapt.scheduling import sessions
from support.silent_host import silent_listener

# The driver: a session per host (argv "<program> -c <sleep> <host>", a sleeping Python),
# then the discovery four times, as Horovod's driver polls; it prints each session's exit code (None: still
# running) and exits (safe_shell_exec's middlemen end what is left when it is gone).
DRIVER = r"""
import json, os, sys, threading, time
from horovod.runner.common.util import safe_shell_exec
codes = {}
def session(host, program):
    codes[host] = safe_shell_exec.execute(
        f"bash -c 'exec -a {program} {sys.executable} -c \"import time; time.sleep(60)\" {host} "
        f"{sys.argv[3]}'")
hosts = json.loads(sys.argv[2])
for host, program in hosts.items():
    threading.Thread(target=session, args=(host, program), daemon=True).start()
time.sleep(1)
for _ in range(4):
    safe_shell_exec.execute(sys.argv[1])
    time.sleep(0.3)
time.sleep(1)
print(json.dumps({host: codes.get(host) for host in hosts}), flush=True)
os._exit(0)    # not multiprocessing's join of the middlemen: they end their commands
"""


def discover_under_a_driver(tmp_path, host_lines, port, hosts, named):
    """Run hvd-adapt-discover (base: ``host_lines``, probing ``port``) as the stand-in driver's
    discovery script, beside commands ``hosts`` (``{arguments: program}``) whose lines carry
    ``named``; ``(the completed process, {arguments: exit code or None})``."""
    (tmp_path / "hosts").write_text(host_lines)
    discovery = (f"{sys.executable} -m hvd_adapt.scheduling.discover --command "
                 f"'cat {tmp_path}/hosts' --ssh-port {port} --lost-after 0.001 "
                 f"--state {tmp_path}/state.json --min-np 1")
    out = subprocess.run([sys.executable, "-c", DRIVER, discovery, json.dumps(hosts), named],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    return out, json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("peers_reset", [True, False], ids=["peers_reset", "launcher_cut_off"])
def test_only_the_sessions_of_a_host_the_job_lost_are_ended(tmp_path, store, peers_reset):
    # 127.0.0.2 accepts on the port. 127.0.0.5 says nothing (a full accept queue), as a
    # host cut off: it is lost. 127.0.0.4 accepts but the base no longer lists it (a
    # scheduler's graceful removal): its session stays. 127.0.0.3 refuses (up, its sshd
    # restarting): its session stays. 127.0.0.6 is silent too but its command is no ssh.
    # 127.0.0.7 accepts and is new: it is not offered while 127.0.0.5 is judged and for a
    # while after its sessions were ended (the offer stays as it is until the next world
    # has formed: Horovod's driver would notify rank 0, perhaps on the lost host). Without
    # the peers' reset marker on the rendezvous server, 127.0.0.5's silence is the launcher's
    # own link down: its session stays.
    if peers_reset:
        store.put(RESET_SCOPE, RESET_KEY, b"1")
    named = (f"HOROVOD_GLOO_RENDEZVOUS_ADDR={store.address} "
             f"HOROVOD_GLOO_RENDEZVOUS_PORT={store.port} HOROVOD_CONTROLLER=gloo")
    with socket.socket() as listener, socket.socket() as other, socket.socket() as new:
        listener.bind(("127.0.0.2", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        other.bind(("127.0.0.4", port))
        other.listen(16)
        new.bind(("127.0.0.7", port))
        new.listen(16)
        silent = silent_listener("127.0.0.5", port) + silent_listener("127.0.0.6", port)
        try:
            hosts = {"127.0.0.2": "ssh", "127.0.0.5": "ssh", "127.0.0.4": "ssh",
                     "127.0.0.3": "ssh", "127.0.0.6": "worker"}
            out, codes = discover_under_a_driver(
                tmp_path, "127.0.0.2\n127.0.0.5\n127.0.0.3\n127.0.0.6\n127.0.0.7\n", port,
                hosts, named)
        finally:
            for sock in silent:
                sock.close()
    assert codes["127.0.0.2"] is None and codes["127.0.0.4"] is None, out
    assert codes["127.0.0.3"] is None and codes["127.0.0.6"] is None, out
    assert "127.0.0.5 said nothing: keeping the current offer" in out.stderr, out.stderr
    if peers_reset:
        assert codes["127.0.0.5"] not in (None, 0), out     # ended: the driver sees a failure
        assert out.stderr.count("ending the job's 1 session(s)") == 1, out.stderr
        assert "while the job's workers reset without it" in out.stderr, out.stderr
    else:
        assert codes["127.0.0.5"] is None, out
        assert "ending the job's" not in out.stderr, out.stderr
        assert out.stderr.count("127.0.0.5 says nothing on port") == 1, out.stderr
    assert "127.0.0.7" not in out.stderr, out.stderr          # never offered meanwhile


def test_a_lost_host_is_found_lost_beside_a_worker_on_the_launchers_own_host(tmp_path, store):
    # horovodrun -H h1:1,h2:1 run on h1: h1's worker is a local command (no ssh), h2's an ssh
    # session. h2 falls silent while the workers reset: the launcher reaches its own host,
    # so its link is not the one down, and h2 is lost.
    store.put(RESET_SCOPE, RESET_KEY, b"1")
    named = (f"HOROVOD_GLOO_RENDEZVOUS_ADDR={store.address} "
             f"HOROVOD_GLOO_RENDEZVOUS_PORT={store.port} HOROVOD_CONTROLLER=gloo")
    with socket.socket() as probe:
        probe.bind(("127.0.0.5", 0))
        port = probe.getsockname()[1]
    silent = silent_listener("127.0.0.5", port)
    try:
        # Each command's arguments name its host as horovodrun's do (HOROVOD_HOSTNAME=...;
        # ssh's also as its target).
        hosts = {"127.0.0.5 HOROVOD_HOSTNAME=127.0.0.5": "ssh",
                 "HOROVOD_HOSTNAME=localhost": "python"}
        out, codes = discover_under_a_driver(tmp_path, "127.0.0.5\n", port, hosts, named)
    finally:
        for sock in silent:
            sock.close()
    assert codes["HOROVOD_HOSTNAME=localhost"] is None, out
    assert codes["127.0.0.5 HOROVOD_HOSTNAME=127.0.0.5"] not in (None, 0), out.stderr
    assert "while the job's workers reset without it" in out.stderr, out.stderr


def test_run_by_hand_it_finds_no_driver_and_ends_nothing():
    assert sessions.find_driver() is None
    assert sessions.sessions(None, ["127.0.0.3"]) == {}


def test_lost_after_is_checked(capsys):
    from hvd_adapt.scheduling import discover
    for bad in ("-1", "nan", "inf"):
        try:
            discover.main(["--hostfile", "x", "--lost-after", bad])
        except SystemExit as e:
            assert e.code == 2
        assert f"--lost-after must be a finite number >= 0 (0: never), got {float(bad)}" in \
            capsys.readouterr().err


def test_without_the_probe_and_without_keepalive_one_line_names_the_fix(tmp_path, capsys):
    if not sessions.keepalive_off("h1"):
        pytest.skip("this user's ssh has a keepalive (or no ssh): nothing to warn about")
    from support.discovery import Discovery      # runs with --ssh-port 0
    run = Discovery(tmp_path, ["h1", "h2"])
    run()
    run()
    err = capsys.readouterr().err
    assert err.count("ssh to h1 has no keepalive") == 1, err
    assert "'ServerAliveInterval 2' and 'ServerAliveCountMax 3' in ~/.ssh/config" in err


# Two polls of the discovery by one "driver" (through Horovod's safe_shell_exec, as
# the elastic driver runs it), each answer printed on a line of its own.
POLLS = r"""
import io, sys
from horovod.runner.common.util import safe_shell_exec
for _ in range(2):
    out = io.StringIO()
    safe_shell_exec.execute(sys.argv[1], stdout=out)
    print(" ".join(out.getvalue().split()), flush=True)
"""


def test_a_later_job_with_the_same_arguments_starts_at_its_first_offer(tmp_path):
    # Without --state the state file is this job's: a second job with the same hosts and
    # arguments first offers --initial-np again, not the hosts the first job ended with.
    (tmp_path / "hosts").write_text("h1:1\nh2:1\nh3:1\n")
    discovery = (f"{sys.executable} -m hvd_adapt.scheduling.discover --hostfile "
                 f"{tmp_path}/hosts --ssh-port 0 --min-np 1 --initial-np 1")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
               XDG_RUNTIME_DIR=str(tmp_path))
    os.chmod(tmp_path, 0o700)
    jobs = [subprocess.run([sys.executable, "-c", POLLS, discovery], capture_output=True,
                           text=True, timeout=120, env=env).stdout.splitlines()
            for _ in range(2)]
    assert jobs == [["h1:1", "h1:1 h2:1 h3:1"]] * 2, jobs
    assert len(os.listdir(tmp_path / "hvd_adapt" / "discover")) == 2


def test_a_driver_that_is_pid_1_keeps_its_jobs_apart(tmp_path):
    # A launcher container whose command is horovodrun (exec form: it is PID 1 there) and
    # that is restarted (docker's restart policy keeps the container's /tmp): the middleman
    # that runs the discovery is the driver's child with parent pid 1. Without the fix
    # find_driver() took it for an orphan: every such job shared one state file, and no
    # lost host's sessions were ended (found by an attacker). The driver runs as PID 1 of
    # a PID namespace here.
    namespace = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    if subprocess.run(namespace + ["true"], capture_output=True).returncode != 0:
        pytest.skip("no PID namespaces here (needs root)")
    (tmp_path / "hosts").write_text("h1:1\nh2:1\nh3:1\n")
    discovery = (f"{sys.executable} -m hvd_adapt.scheduling.discover --hostfile "
                 f"{tmp_path}/hosts --ssh-port 0 --min-np 1 --initial-np 1")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), XDG_RUNTIME_DIR=str(tmp_path))
    os.chmod(tmp_path, 0o700)
    jobs = [subprocess.run(namespace + [sys.executable, "-c", POLLS, discovery],
                           capture_output=True, text=True, timeout=120, env=env)
            for _ in range(2)]
    assert all(job.returncode == 0 for job in jobs), [job.stderr[-2000:] for job in jobs]
    answers = [job.stdout.splitlines() for job in jobs]
    assert answers == [["h1:1", "h1:1 h2:1 h3:1"]] * 2, answers


# A "driver" with three worker commands through Horovod's safe_shell_exec: one as a local
# slot runs (the slot's variables before the command, which the shell execs), one as a
# remote slot runs (ssh's last argument holds them), one that exits at once; and a
# middleman that has not started its command yet (a spawn child still in the driver's
# session). Then it asks commands() from a discovery run through safe_shell_exec too.
COMMANDS = r"""
import json, multiprocessing, os, sys, threading, time
from horovod.runner.common.util import safe_shell_exec
sleep = f"{sys.executable} -c 'import time; time.sleep(60)'"
for command in (f"HOROVOD_HOSTNAME=h1 HOROVOD_RANK=0 exec {sleep}",
                f"bash -c 'exec -a ssh {sys.executable} -c \"import time; time.sleep(60)\" "
                f"h2 \"cd /x > /dev/null 2>&1 ; HOROVOD_HOSTNAME=h2 HOROVOD_RANK=1 python t.py\"'",
                "HOROVOD_HOSTNAME=h3 true"):
    threading.Thread(target=safe_shell_exec.execute, args=(command,), daemon=True).start()
time.sleep(2)
ask = (f"{sys.executable} -c 'import json; from hvd_adapt.scheduling import sessions; "
       f"found, launching = sessions.commands(sessions.find_driver()); "
       f"print(json.dumps([sorted(found), launching]))'")
for pending in (False, True):
    if pending:
        starting = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
        starting.start()
        time.sleep(2)
    safe_shell_exec.execute(ask)
starting.kill()
os._exit(0)
"""


def test_the_drivers_commands_are_found_by_their_host_and_a_launch_under_way_is_seen():
    out = subprocess.run([sys.executable, "-c", COMMANDS], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    answers = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
    assert answers == [[["h1", "h2"], False], [["h1", "h2"], True]], (out.stdout, out.stderr)
    assert sessions.commands(None) == ({}, False)
