"""hvd-adapt-discover: base hosts, existing hosts first, the rule, readiness, state."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import zlib

import pytest

from hvd_adapt.scheduling import discover as discover_module
from hvd_adapt.scheduling.base import parse_hosts
from hvd_adapt.scheduling.hints import HintsError, make_hints, read_hints, write_hints
from support.discovery import Discovery
from support.launch import alive
from support.second_user import OTHER_UID, as_other_user


def linear_curve(n, per_worker=1.0):
    return [{"replicas": r, "nodes": r, "goodput": 100.0 * (1 + per_worker * (r - 1)),
             "speedup": 1 + per_worker * (r - 1), "local_bsz": 8, "accumulation_steps": 0,
             "batch_size": 8 * r} for r in range(1, n + 1)]


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


def test_standby_dir_limits_new_slots_to_ready_standbys(tmp_path, capsys):
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
    assert "counting no standby on c: " in capsys.readouterr().err


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
    (["--hostfile", "x", "--stale-after", "nan"], "--stale-after must be >= 0, got nan"),
    (["--command", "x", "--command-timeout", "nan"],
     "--command-timeout must be a finite number > 0, got nan"),
    (["--command", "x", "--command-timeout", "0"],
     "--command-timeout must be a finite number > 0, got 0.0"),
    (["--hostfile", "x", "--probe-timeout", "inf"],
     "--probe-timeout must be a finite number > 0, got inf"),
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
    # A failure, an empty answer, an answer of garbage only: the hosts stay, with a reason,
    # said once while it lasts (Horovod runs the discovery every second).
    for command, reason in [("exit 3", "failed with exit code 3"), ("true", ""),
                            ("echo '-oProxyCommand=x'", "is not a host name")]:
        assert run(command) == [("a", 1), ("b", 1), ("c", 1)], command
        err = capsys.readouterr().err
        assert reason in err and "keeping the current 3 worker(s) on a:1, b:1, c:1" in err
        assert run(command) == [("a", 1), ("b", 1), ("c", 1)], command
        assert capsys.readouterr().err == ""
        run("printf 'a\\nb\\nc\\n'")
    assert run("echo a; echo b") == [("a", 1), ("b", 1)]     # an answer: it counts


HOSTILE_HINTS = [
    # (what the file holds, what the reason names)
    ("{", "not JSON"),
    ("[" * 100000 + "]" * 100000, "not JSON"),                      # nested past the limit
    (b"\xff\xfe{}", "not JSON"),
    (json.dumps(dict(make_hints(1, 1, [1], 8, None, []), curve=[1, 2])), "curve must be"),
    (json.dumps(dict(make_hints(1, 1, [1], 8, None, linear_curve(3)), written_at="now")),
     "written_at must be"),
    (json.dumps(dict(make_hints(1, 1, [1], 8, None, linear_curve(3)), replicas=1e308)),
     "replicas must be"),
    (json.dumps(dict(make_hints(1, 1, [1], 8, None, [dict(e, speedup="fast")
                                                     for e in linear_curve(3)]))), "speedup"),
    (json.dumps(dict(make_hints(1, 1, [1], 8, None, [dict(e, replicas=10 ** 30)
                                                     for e in linear_curve(3)]))), "replicas"),
    (json.dumps(dict(make_hints(1, 1, [1], 8, None, [dict(e, goodput=float("nan"))
                                                     for e in linear_curve(3)]))), "goodput"),
    (json.dumps(dict(make_hints(1, 1, [1], 8, None, linear_curve(3)),
                     replica_counts_timed=[True])),
     "replica_counts_timed must be"),
    (json.dumps(dict(make_hints(1, 1, [1], 8, None, linear_curve(3)), slots_per_node=0)),
     "slots_per_node must be"),
    ("1" * 5000, "not JSON"),                                       # past int's digit limit
]


def test_every_malformed_hints_field_keeps_the_hosts_with_the_reason(tmp_path, capsys):
    run = Discovery(tmp_path, ["a", "b", "c", "d"], "--initial-np", "2", hints=True)
    assert run() == [("a", 1), ("b", 1)]
    for text, reason in HOSTILE_HINTS:
        with open(run.hints, "wb") as f:
            f.write(text if isinstance(text, bytes) else text.encode())
        capsys.readouterr()
        assert run("--min-np", "1") == [("a", 1), ("b", 1)], text[:100]
        err = capsys.readouterr().err
        assert "unreadable hints" in err and "keeping the current hosts" in err, err
        with pytest.raises(HintsError, match=reason):
            read_hints(run.hints)


def test_hints_of_another_user_do_not_steer_the_job(tmp_path, shared_tmp):
    hints = os.path.join(shared_tmp, "hints.json")
    as_other_user(lambda: write_hints(hints, make_hints(1, 1, [1], 8, None, linear_curve(3))))
    with pytest.raises(HintsError, match=f"belongs to uid {OTHER_UID}"):
        read_hints(hints)


def test_a_fifo_in_place_of_the_hints_keeps_the_hosts_instead_of_hanging(tmp_path):
    # Anyone may mkfifo in a shared folder, before the job first writes its hints there;
    # opening a FIFO waits for a writer, so discovery (every second) hung on its open.
    run = Discovery(tmp_path, ["a", "b"], "--initial-np", "1", hints=True)
    assert run() == [("a", 1)]
    os.mkfifo(run.hints)
    command = [sys.executable, "-m", "hvd_adapt.scheduling.discover", "--hostfile",
               str(run.hostfile), "--ssh-port", "0", "--hold", "0", "--state",
               str(tmp_path / "state.json"), "--hints", run.hints]
    # The timeout only bounds a hang: the answer comes in milliseconds.
    out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "a:1\n", out.stderr
    assert "not a regular file" in out.stderr and "keeping the current hosts" in out.stderr
    # In this process only once the bounded run above showed it does not hang.
    with pytest.raises(HintsError, match="is not a regular file"):
        read_hints(run.hints)


def test_host_names_that_are_not_names_never_reach_horovod(tmp_path):
    # Horovod 0.28.1 puts host names unquoted into its ssh command line.
    (tmp_path / "hosts").write_text("-oProxyCommand=touch${IFS}/tmp/owned\nhost;id\n$(id)\n"
                                    "good:2\n")
    command = [sys.executable, "-m", "hvd_adapt.scheduling.discover", "--command",
               f"cat {tmp_path / 'hosts'}", "--ssh-port", "0", "--state",
               str(tmp_path / "state.json"), "--initial-np", "2"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "good:2\n", out.stderr
    for name in ("-oProxyCommand=touch${IFS}/tmp/owned", "host;id", "$(id)"):
        assert f"{name!r} is not a host name" in out.stderr


def test_the_default_state_is_private_to_the_user(tmp_path, shared_tmp, monkeypatch):
    # The temp folder is shared: another user plants the old predictable state file and
    # links for its temporary names. The discovery keeps its state in a folder of its own.
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", shared_tmp)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a\nb\n")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.chmod(tmp_path, 0o755)
    old = os.path.join(shared_tmp, f"hvd-adapt-discover-{os.getuid()}-"
                                   f"{zlib.crc32(repr((str(hostfile), None)).encode()):08x}.json")
    me = os.getpid()

    def plant():
        with open(old, "w") as f:
            f.write("{}")
        for pid in range(me - 10, me + 10):
            os.symlink(victim, f"{old}.{pid}.tmp")

    as_other_user(plant)
    argv = ["--hostfile", str(hostfile), "--ssh-port", "0"]
    assert discover_module.main(argv) == 0
    assert discover_module.main(argv) == 0
    assert victim.read_text() == "precious"
    state = os.path.join(shared_tmp, f"hvd_adapt-{os.geteuid()}", "discover")
    assert [json.load(open(os.path.join(state, f)))["hosts"] for f in os.listdir(state)] == \
        [[["a", 1], ["b", 1]]]


def test_a_runtime_folder_another_user_made_first_is_a_clear_error(shared_tmp, monkeypatch,
                                                                    tmp_path, capsys):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", shared_tmp)
    ours = os.path.join(shared_tmp, f"hvd_adapt-{os.geteuid()}")
    as_other_user(lambda: os.mkdir(ours))
    (tmp_path / "hosts").write_text("a\n")
    assert discover_module.main(["--hostfile", str(tmp_path / "hosts"), "--ssh-port", "0"]) == 1
    assert f"belongs to uid {OTHER_UID}" in capsys.readouterr().err


# -- fuzz: hostile hints files and base answers ------------------------------------------
OPTION_LIKE = ["-oProxyCommand=id", "--help", "-p", "host;id", "$(id)", "`id`", "a b",
               "h\x00st", "hôst", "ホスト", "a:b:c", "a:-1", "a:99999999999", "a slots=",
               "a slots=0", ":", "#", "\ufeffa", "a" * 300, "x\ty"]


def random_json(rng, depth=0):
    kind = rng.randrange(10 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2, 7, 10 ** 6, 2 ** 63, -(10 ** 30), 10 ** 300])
    if kind == 3:
        return rng.choice([0.0, -0.5, 1e308, -1e308, 5e-324, float("nan"), float("inf"),
                           float("-inf"), 1.5])
    if kind in (4, 5):
        return rng.choice(OPTION_LIKE + ["", "fast", "1", "null", "\u202e", "\ud800"[:0]])
    if kind in (6, 7):
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {rng.choice(["replicas", "speedup", "goodput", "nodes", "x", "version", ""]):
            random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def fuzzed_hints(rng, now):
    """Text of a hints file: valid hints with one field (or entry field) replaced by random
    JSON, random JSON, deep nesting, or bytes that are not UTF-8."""
    kind = rng.randrange(6)
    if kind == 0:
        return json.dumps(random_json(rng), allow_nan=True).encode()
    if kind == 1:
        depth = rng.choice([10, 999, 5000, 200000])
        return (rng.choice(["[", '{"a":']) * depth).encode()
    if kind == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    hints = make_hints(2, 1, [1, 2], 8, now, linear_curve(4))
    hints["written_at"] = now
    if kind == 3:
        hints[rng.choice(list(hints))] = random_json(rng)
    else:
        entry = rng.choice(hints["curve"])
        entry[rng.choice(list(entry) + ["extra"])] = random_json(rng)
    text = json.dumps(hints, allow_nan=True)
    if kind == 5:                     # sizes: padding, or cut short
        text = rng.choice([text + " " * rng.randrange(1 << 20), text[:rng.randrange(len(text))]])
    return text.encode()


def fuzzed_base(rng, current):
    """A base answer (the host file's lines) that lists every current host among random
    lines, or lists nothing usable at all."""
    lines = [rng.choice(OPTION_LIKE + [json.dumps(random_json(rng))])
             for _ in range(rng.randrange(6))]
    if rng.random() < 0.2:            # nothing usable: random names that happen to be valid out
        return "\n".join(line for line in lines if not parse_hosts(line, 1, "")[0])
    for host, slots in current:
        lines.insert(rng.randrange(len(lines) + 1),
                     rng.choice([f"{host}:{slots}", f"{host} slots={slots}"]))
    return "\n".join(lines)


def test_fuzzed_hints_and_base_answers_never_crash_or_shrink_the_job(tmp_path, capsys):
    import random
    rng = random.Random(34)
    now = time.time()
    pool = [f"h{i}" for i in range(6)]
    checked = 0
    for case in range(200):
        folder = tmp_path / str(case)
        folder.mkdir()
        current = [(host, rng.randrange(1, 3)) for host in rng.sample(pool, rng.randrange(1, 5))]
        state, hints, hostfile = folder / "state.json", folder / "hints.json", folder / "hosts"
        state.write_text(json.dumps({"hosts": current, "changed_at": now - 1000}))
        hints.write_bytes(fuzzed_hints(rng, now))
        hostfile.write_bytes(fuzzed_base(rng, current).encode(errors="surrogateescape"))
        try:
            read_hints(str(hints))
            bad_hints = False
        except HintsError:
            bad_hints = True
        argv = ["--hostfile", str(hostfile), "--hints", str(hints), "--state", str(state),
                "--ssh-port", "0", "--hold", "0", "--min-np", "1", "--max-np", "64"]
        if rng.random() < 0.3:        # the same answer from a command that may fail
            argv[:2] = ["--command", f"cat {hostfile}; exit {rng.choice([0, 0, 1, 3])}"]
        capsys.readouterr()
        assert discover_module.main(argv) == 0, capsys.readouterr().err
        offered = dict(parse_lines(capsys.readouterr().out))
        if bad_hints:
            checked += 1
            assert all(offered.get(host, 0) >= slots for host, slots in current), \
                (case, current, offered)
    assert checked >= 150, checked


def parse_lines(out):
    return [(line.split(":")[0], int(line.split(":")[1])) for line in out.splitlines()]


def test_a_base_command_past_its_timeout_is_killed_whole_and_an_answer_is_an_answer(
        tmp_path, capsys):
    pids = tmp_path / "pids"

    def run(command):
        args = discover_module.parser().parse_args(
            ["--command", command, "--command-timeout", "2", "--ssh-port", "0",
             "--state", str(tmp_path / "state.json"), "--initial-np", "2"])
        return discover_module.discover(args)

    # It answers at once, but leaves a child that holds its output: not a timeout.
    assert run(f"echo a; echo b; sleep 300 & echo $! >> {pids}") == [("a", 1), ("b", 1)]
    # It never answers: its shell and every child are killed, the hosts stay.
    assert run(f"sh -c 'echo $$ >> {pids}; exec sleep 300' & echo $! >> {pids}; wait") == \
        [("a", 1), ("b", 1)]
    assert "did not answer within 2 s" in capsys.readouterr().err
    started = [int(p) for p in pids.read_text().split()]
    os.kill(started[0], 9)                        # the first run's child: ours to clean up
    for _ in range(200):
        if not any(alive(pid) for pid in started):
            break
        time.sleep(0.05)
    assert not any(alive(pid) for pid in started), started


def test_a_state_file_that_cannot_be_written_costs_the_memory_not_the_answer(tmp_path,
                                                                           capsys):
    (tmp_path / "hosts").write_text("a\n")
    argv = ["--hostfile", str(tmp_path / "hosts"), "--ssh-port", "0",
            "--state", str(tmp_path / "missing" / "state.json")]
    assert discover_module.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == "a:1\n" and "cannot save the state file" in err
