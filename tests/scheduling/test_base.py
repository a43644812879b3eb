"""The base discovery's answer: host lines parsed and checked, the command's process group
killed at its deadline, a background child holding its output no timeout."""
import os
import signal
import time

import pytest

from hvd_adapt.scheduling.base import BaseDiscoveryError, parse_hosts, run_command, valid_host
from support.launch import alive


def test_parse_hosts_formats_and_bad_lines():
    assert parse_hosts("a\nb:3\n# c\n\nd slots=2  # four cores\n", 1, "f") == \
        ([("a", 1), ("b", 3), ("d", 2)], [])
    assert parse_hosts("a\n", 4, "f") == ([("a", 4)], [])
    hosts, problems = parse_hosts("a\nb c\nx:0\ny:5000\nz\n", 1, "f")
    assert hosts == [("a", 1), ("z", 1)]
    assert problems[0] == "f, line 2: expected 'host', 'host:slots' or 'host slots=N', got 'b c'"
    assert problems[1:] == ["f, line 3: slots must be in [1, 4096], got 'x:0'",
                            "f, line 4: slots must be in [1, 4096], got 'y:5000'"]


@pytest.mark.parametrize("name", [
    "-oProxyCommand=touch /tmp/x", "host;cmd", "$(cmd)", "`cmd`", "a|b", "a&b", "-p22",
    "a..b", "a-", "-a", "a_b", "ünïcode", "a" * 64, ".".join(["a" * 60] * 5), "a/b", "a'b",
    "a\"b", "a\\b", "a*b", "[::1]"])
def test_names_that_are_not_host_names_are_dropped_and_named(name):
    assert not valid_host(name)
    hosts, problems = parse_hosts(f"good\n{name}:2\n", 1, "f")
    assert hosts == [("good", 1)] and len(problems) == 1 and "line 2" in problems[0]


def test_a_name_with_a_trailing_newline_is_not_a_host_name():
    # valid_host also checks the hosts of a state file, which no line split has cut.
    assert not valid_host("a\n") and not valid_host("node-1.svc\n")


@pytest.mark.parametrize("name", ["a", "node-1", "pod-0.svc.cluster.local", "10.0.0.1",
                                  "127.0.0.1", "A1", "1a", "x" * 63, "fqdn.example."])
def test_host_names_and_addresses_pass(name):
    assert valid_host(name) and parse_hosts(f"{name}:2\n", 1, "f") == ([(name, 2)], [])


def test_a_timed_out_command_is_killed_with_all_its_processes(tmp_path):
    pids = tmp_path / "pids"
    with pytest.raises(BaseDiscoveryError, match=r"did not answer within 1 s \(its processes"):
        run_command(f"sleep 300 & echo $! >> {pids}; sh -c 'echo $$ >> {pids}; sleep 300'; "
                    f"echo late", timeout=1)
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2
    for _ in range(100):                # killed with SIGKILL: gone once reaped by init
        if not any(alive(pid) for pid in started):
            break
        time.sleep(0.05)
    assert not any(alive(pid) for pid in started), started


def test_an_answer_with_a_background_child_holding_the_output_is_no_timeout(tmp_path):
    pid_file = tmp_path / "pid"
    try:
        out = run_command(f"echo a:2; sleep 300 & echo $! > {pid_file}; echo b", timeout=5)
        assert parse_hosts(out, 1, "c") == ([("a", 2), ("b", 1)], [])
    finally:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
