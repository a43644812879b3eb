"""hvd-adapt-discover: base hosts, existing hosts first, the rule, readiness, state."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from hvd_adapt.scheduling import discover as discover_module
from hvd_adapt.scheduling.hints import make_hints, write_hints


def linear_curve(n, per_worker=1.0):
    return [{"replicas": r, "nodes": r, "goodput": 100.0 * (1 + per_worker * (r - 1)),
             "speedup": 1 + per_worker * (r - 1), "local_bsz": 8, "accumulation_steps": 0,
             "batch_size": 8 * r} for r in range(1, n + 1)]


class Discovery:
    """Runs the discovery in this process on a host file, as Horovod would every second."""

    def __init__(self, tmp_path, hosts, *extra, hints=False):
        self.hostfile = tmp_path / "hosts.txt"
        self.hints = str(tmp_path / "hints.json")
        self.tmp_path = tmp_path
        self.set_hosts(hosts)
        # No hold after a resize unless a test asks for one.
        self.extra = ["--hold", "0"] + list(extra) + (["--hints", self.hints] if hints else [])

    def set_hosts(self, hosts):
        self.hostfile.write_text("".join(f"{h}\n" for h in hosts))

    def publish(self, replicas, curve, timed, written_at=None):
        hints = make_hints(replicas, 1, timed, 8, time.time(), curve)
        if written_at is not None:
            hints["written_at"] = written_at
        write_hints(self.hints, hints)

    def __call__(self, *more, now=None):
        argv = ["--hostfile", str(self.hostfile), "--ssh-port", "0",
                "--state", str(self.tmp_path / "state.json")] + self.extra + list(more)
        args = discover_module.parser().parse_args(argv)
        return discover_module.discover(args, now=now)


def test_without_hints_offers_every_host_existing_first(tmp_path):
    run = Discovery(tmp_path, ["a:2", "b", "c slots=3"])
    assert run() == [("a", 1)]                       # first offer: --min-np workers
    assert run() == [("a", 2), ("b", 1), ("c", 3)]
    # a leaves the base list; a new host d comes before b in it: b and c stay first.
    run.set_hosts(["d", "b", "c:3"])
    assert run() == [("b", 1), ("c", 3), ("d", 1)]
    assert run("--max-np", "3") == [("b", 1), ("c", 2)]


def test_initial_offer_is_initial_np(tmp_path):
    run = Discovery(tmp_path, ["a", "b", "c"], "--initial-np", "2", "--max-np", "3")
    assert run() == [("a", 1), ("b", 1)]


def test_grows_only_to_twice_the_largest_count_timed(tmp_path):
    run = Discovery(tmp_path, [f"h{i}" for i in range(8)], hints=True)
    assert run() == [("h0", 1)]
    assert run() == [("h0", 1)]                      # no hints yet: stays
    run.publish(1, linear_curve(8), timed=[1])
    assert [h for h, _ in run()] == ["h0", "h1"]     # linear curve, but timed at 1 only
    # Hints from the old world: the resize is in flight, nothing changes.
    assert [h for h, _ in run()] == ["h0", "h1"]
    run.publish(2, linear_curve(8), timed=[1, 2])
    assert [h for h, _ in run()] == ["h0", "h1", "h2", "h3"]


def test_communication_bound_job_shrinks_newest_hosts_first(tmp_path):
    run = Discovery(tmp_path, ["a", "b", "c"], hints=True)
    assert run() == [("a", 1)]
    assert run() == [("a", 1)]                       # no curve yet: stays
    run.publish(1, linear_curve(3), timed=[1])
    assert [h for h, _ in run()] == ["a", "b"]
    run.publish(2, linear_curve(3), timed=[1, 2])
    assert [h for h, _ in run()] == ["a", "b", "c"]
    bad = [{**e, "speedup": s, "goodput": 100.0 * s}
           for e, s in zip(linear_curve(3), [1.0, 1.1, 1.15])]
    run.publish(3, bad, timed=[1, 2, 3])
    assert run() == [("a", 1)]


def test_hysteresis_keeps_a_small_change(tmp_path):
    hosts = [f"h{i}" for i in range(12)]
    run = Discovery(tmp_path, hosts, "--initial-np", "10", hints=True)
    assert len(run()) == 10
    # 11 would pay (+0.9 a worker), but 1 of 10 is under 15%.
    run.publish(10, linear_curve(11, per_worker=0.9), timed=[5, 10])
    assert len(run()) == 10


def test_stale_or_unreadable_hints_keep_the_hosts(tmp_path, capsys):
    run = Discovery(tmp_path, ["a", "b", "c"], "--stale-after", "60", hints=True)
    run()
    run.publish(1, linear_curve(3), timed=[1], written_at=time.time() - 120)
    assert run() == [("a", 1)]
    with open(run.hints, "w") as f:
        f.write("{")
    assert run() == [("a", 1)]
    run.publish(1, linear_curve(3), timed=[1])
    assert [h for h, _ in run()] == ["a", "b"]
    assert "predicted speed-up 2.00 at 2 against 1.00 at 1" in capsys.readouterr().err


def test_in_flight_resize_times_out_after_settle(tmp_path):
    run = Discovery(tmp_path, ["a", "b", "c"], "--settle", "30", hints=True)
    now = time.time()
    run(now=now)
    run.publish(1, linear_curve(3), timed=[1])
    assert len(run(now=now + 1)) == 2               # grows to 2 at now + 1
    # The job still trains at 1 (it may be waiting for the new worker): hints from
    # its old world, which now say a second worker does not pay, change nothing ...
    run.publish(1, [{**e, "speedup": s, "goodput": 100.0 * s}
                    for e, s in zip(linear_curve(3), [1.0, 1.1, 1.2])], timed=[1])
    assert len(run(now=now + 2)) == 2
    # ... until the resize has had --settle seconds.
    assert len(run(now=now + 40)) == 1


def test_no_resize_within_hold_seconds_of_the_last(tmp_path):
    run = Discovery(tmp_path, ["a", "b", "c"], "--hold", "30", hints=True)
    now = time.time()
    run(now=now)
    run.publish(1, linear_curve(3), timed=[1])
    assert len(run(now=now + 10)) == 1              # 10 s after the first offer
    assert len(run(now=now + 31)) == 2
    run.publish(2, linear_curve(3), timed=[1, 2], written_at=now + 35)
    assert len(run(now=now + 40)) == 2              # 9 s after the grow
    assert len(run(now=now + 62)) == 3


def test_standby_dir_limits_new_slots_to_ready_standbys(tmp_path):
    ready = tmp_path / "standby"
    run = Discovery(tmp_path, ["a:2", "b:2"], "--standby-dir", str(ready), "--initial-np", "1")

    def beat(path):
        # A heartbeat the discovery sees change (an mtime it has not seen before).
        path.touch()
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10 ** 9 * beat.count))
        beat.count += 1
    beat.count = 1

    assert run() == []                              # nothing ready anywhere
    (ready / "a").mkdir(parents=True, mode=0o700)
    beat(ready / "a" / "100.json")
    assert run() == []                              # seen once: not yet seen beating
    beat(ready / "a" / "100.json")
    assert run() == [("a", 1)]
    (ready / "a" / "100.json").unlink()             # claimed by the launch
    (ready / "b").mkdir(mode=0o700)
    for pid in (200, 201, 202):
        beat(ready / "b" / f"{pid}.json")
    run()
    for pid in (200, 201, 202):
        beat(ready / "b" / f"{pid}.json")
    assert run() == [("a", 1), ("b", 2)]
    # A dead standby's file, however new its time: it does not beat.
    stale = ready / "a" / "101.json"
    stale.write_text("{}")
    os.utime(stale, (time.time() + 3600,) * 2)
    run()
    assert run() == [("a", 1), ("b", 2)]
    # A folder another user may write counts no standby.
    run.set_hosts(["a:2", "b:2", "c"])
    (ready / "c").mkdir(mode=0o700)
    os.chmod(ready / "c", 0o777)
    for _ in range(2):
        beat(ready / "c" / "300.json")
        assert run() == [("a", 1), ("b", 2)]


def test_new_hosts_must_answer_on_the_ssh_port(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    try:
        run = Discovery(tmp_path, ["127.0.0.1", "127.0.0.2", "no-such-host.invalid"])
        args = ["--ssh-port", str(port)]
        assert run(*args) == [("127.0.0.1", 1)]
        assert run(*args) == [("127.0.0.1", 1)]     # 127.0.0.2 does not answer on the port
    finally:
        server.close()


def test_console_script_prints_host_lines_and_loads_no_torch(tmp_path):
    (tmp_path / "hosts").write_text("a:2\nb\n")
    state = str(tmp_path / "state.json")
    command = [sys.executable, "-c",
               "import sys; from hvd_adapt.scheduling.discover import main; main(sys.argv[1:]); "
               "assert not {'torch', 'numpy', 'horovod'} & set(sys.modules), sys.modules.keys()",
               "--command", f"cat {tmp_path / 'hosts'}", "--ssh-port", "0", "--state", state,
               "--initial-np", "2"]
    out = subprocess.run(command, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "a:2\n"
    assert json.load(open(state))["hosts"] == [["a", 2]]
    out = subprocess.run(command, capture_output=True, text=True)
    assert out.stdout == "a:2\nb:1\n"


@pytest.mark.parametrize("argv, message", [
    (["--hostfile", "x", "--min-np", "0"], "--min-np must be >= 1, got 0"),
    (["--hostfile", "x", "--min-np", "3", "--max-np", "2"], "--max-np must be >= --min-np"),
    (["--hostfile", "x", "--efficiency", "2"], r"efficiency must be a number in \[0.0, 1.0\]"),
    (["--hostfile", "x", "--ssh-port", "70000"], r"--ssh-port must be in \[0, 65535\]"),
    (["--hostfile", "x", "--command", "y"], "not allowed with argument"),
    (["--hostfile", "x", "--hold", "-1"], "--hold must be >= 0, got -1.0"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        discover_module.main(argv)
    assert __import__("re").search(message, capsys.readouterr().err)


def test_a_failing_base_command_is_named_and_keeps_the_hosts(tmp_path, capsys):
    state = str(tmp_path / "s")

    def run(command):
        args = discover_module.parser().parse_args(
            ["--command", command, "--state", state, "--ssh-port", "0", "--initial-np", "3"])
        return discover_module.discover(args)

    # Nothing known yet: an error that names the command.
    with pytest.raises(RuntimeError, match="'echo boom >&2; exit 3' failed with exit code 3: "
                                           "boom"):
        run("echo boom >&2; exit 3")
    assert run("printf 'a\\nb\\nc\\n'") == [("a", 1), ("b", 1), ("c", 1)]
    capsys.readouterr()
    # A failure, an empty answer, an answer of garbage only: the hosts stay, with a reason.
    for command, reason in [("exit 3", "failed with exit code 3"), ("true", ""),
                            ("echo '-oProxyCommand=x'", "is not a host name")]:
        assert run(command) == [("a", 1), ("b", 1), ("c", 1)], command
        err = capsys.readouterr().err
        assert reason in err and "keeping the current 3 worker(s) on a:1, b:1, c:1" in err
    assert run("echo a; echo b") == [("a", 1), ("b", 1)]     # an answer: it counts
