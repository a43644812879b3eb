"""hvd-adapt-discover: base hosts, existing hosts first, the rule, readiness, state."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from hvd_adapt.scheduling import discover as discover_module
from hvd_adapt.scheduling.discover import parse_hosts
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
    assert run() == []                              # nothing ready anywhere
    (ready / "a").mkdir(parents=True)
    (ready / "a" / "100.json").write_text("{}")
    assert run() == [("a", 1)]
    (ready / "a" / "100.json").unlink()             # claimed by the launch
    (ready / "b").mkdir()
    for pid in (200, 201, 202):
        (ready / "b" / f"{pid}.json").write_text("{}")
    assert run() == [("a", 1), ("b", 2)]
    stale = ready / "a" / "101.json"
    stale.write_text("{}")
    os.utime(stale, (time.time() - 60, time.time() - 60))
    assert run() == [("a", 1), ("b", 2)]            # a dead standby's file


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


def test_a_host_whose_sshd_stops_answering_is_dropped_and_one_of_the_world_stays(tmp_path):
    servers = []
    for address in ("127.0.0.1", "127.0.0.2", "127.0.0.3"):
        server = socket.socket()
        server.bind((address, servers[0].getsockname()[1] if servers else 0))
        server.listen(8)
        servers.append(server)
    port = str(servers[0].getsockname()[1])
    try:
        run = Discovery(tmp_path, ["127.0.0.1", "127.0.0.2", "127.0.0.3"], "--initial-np", "3",
                        "--probe-timeout", "2")
        assert run("--ssh-port", port) == [("127.0.0.1", 1), ("127.0.0.2", 1), ("127.0.0.3", 1)]
        servers.pop().close()                  # 127.0.0.3 goes down, still listed
        assert run("--ssh-port", port) == [("127.0.0.1", 1), ("127.0.0.2", 1)]
        # The base drops every host of the world for a new one while 127.0.0.2 answers:
        # a set sharing no host with the world would end the job.
        run.set_hosts(["127.0.0.4"])
        servers.pop(0).close()
        assert run("--ssh-port", port) == [("127.0.0.2", 1)]
    finally:
        for server in servers:
            server.close()


def test_parse_hosts_formats_and_errors():
    assert parse_hosts("a\nb:3\n# c\n\nd slots=2  # four cores\n", 1, "f") == \
        [("a", 1), ("b", 3), ("d", 2)]
    assert parse_hosts("a\n", 4, "f") == [("a", 4)]
    with pytest.raises(ValueError, match=r"f, line 2: expected .* got 'b c'"):
        parse_hosts("a\nb c\n", 1, "f")
    with pytest.raises(ValueError, match="slots must be >= 1"):
        parse_hosts("a:0\n", 1, "f")


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


def test_failing_base_command_names_it(tmp_path):
    args = discover_module.parser().parse_args(
        ["--command", "echo boom >&2; exit 3", "--state", str(tmp_path / "s")])
    with pytest.raises(RuntimeError, match="'echo boom >&2; exit 3' failed with exit code 3: boom"):
        discover_module.discover(args)
