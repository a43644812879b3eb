"""hvd-adapt-arbiter: cycles on real files, as jobs' discoveries report and read grants."""
import json
import os
import subprocess

import pytest

from hvd_adapt.scheduling import arbiter as arbiter_module
from hvd_adapt.scheduling import discover as discover_module
from hvd_adapt.scheduling.arbiter_files import (FORMAT_VERSION, read_grant, report_path,
                                                state_path, write_json)
from support.second_user import as_other_user

LINEAR = [[r, 100.0 * r] for r in range(1, 9)]
FLAT = [[1, 100.0], [2, 103.0], [3, 105.0], [4, 106.0]]


class Pool:
    """An arbiter on a host file of ``hosts``, its cycles run here with times we give."""

    def __init__(self, tmp_path, hosts, *extra):
        self.folder = str(tmp_path / "arbiter")
        self.hostfile = tmp_path / "pool"
        self.hostfile.write_text("".join(f"{h}\n" for h in hosts))
        self.argv = ["--folder", self.folder, "--hostfile", str(self.hostfile),
                     "--ssh-port", "0", "--interval", "1", "--gone-after", "10",
                     "--change-interval", "0", *extra]
        self.arbiter = self.start()
        self.now = 1000.0
        self.runs = {}

    def start(self):
        return arbiter_module.Arbiter(arbiter_module.parser().parse_args(self.argv))

    def cycle(self, seconds=1.0):
        self.now += seconds
        self.arbiter.cycle(self.now)

    def grant(self, key):
        return [h for h, _ in read_grant(self.folder, key)[1]]

    def generation(self):
        return read_grant(self.folder, "x")[0]

    def report(self, key, holding="offered", generation="current", offered=None, curve=LINEAR,
               launching=False, settled=True, min_np=1, max_np=None, driver=None, run=None):
        """Write job ``key``'s report as its discovery would: by default it offers its grant
        and its driver runs commands on exactly those hosts."""
        self.runs[key] = self.runs.get(key, 0) + 1 if run is None else run
        try:
            gen, grant = read_grant(self.folder, key)
        except FileNotFoundError:
            gen, grant = None, []
        offered = [[h, s] for h, s in grant] if offered is None else [[h, 1] for h in offered]
        holding = [h for h, _ in offered] if holding == "offered" else holding
        write_json(report_path(self.folder, key), {
            "version": FORMAT_VERSION, "job": key.split(".")[0], "run": self.runs[key],
            "generation": gen if generation == "current" else generation, "min_np": min_np,
            "max_np": max_np, "initial_np": min_np, "curve": curve,
            "timed": 8 if curve else 1, "settled": settled, "offered": offered,
            "holding": holding, "launching": launching, "driver": driver})


def test_jobs_register_in_order_and_the_pool_is_split_by_their_curves(tmp_path):
    pool = Pool(tmp_path, ["h1", "h2", "h3", "h4"])
    pool.report("a", curve=None)
    pool.cycle()
    assert pool.grant("a") == ["h1"]                   # no curve: its initial workers
    pool.report("a")
    pool.report("b", curve=FLAT)
    pool.cycle()
    # b's second worker would bring 0.03 of one: a gets the rest.
    assert pool.grant("a") == ["h1", "h2", "h3"] and pool.grant("b") == ["h4"]
    state = json.load(open(state_path(pool.folder)))
    assert state["jobs"]["a"]["order"] == 0 and state["jobs"]["b"]["order"] == 1


def a_on_both_hosts(pool):
    """Job a registers and, its curve linear, gets both hosts of the pool."""
    pool.report("a", curve=LINEAR)
    pool.cycle()
    pool.report("a")
    pool.cycle()
    assert pool.grant("a") == ["h1", "h2"]


def listeners(addresses, port=0):
    """A listening socket on each of ``addresses``, all on one port (``port``, or one the
    first is given): hosts whose sshd answers; close one and the host refuses."""
    import socket
    servers = []
    for address in addresses:
        server = socket.socket()
        server.bind((address, servers[0].getsockname()[1] if servers else port))
        server.listen(8)
        servers.append(server)
    return servers


@pytest.mark.parametrize("evidence", [
    {"generation": "before"},                        # its discovery read the old grant
    {"holding": ["h1", "h2"]},                       # its driver still runs a worker there
    {"launching": True},                             # a launch under way names no host yet
    {"holding": None}],                              # its discovery found no driver
    ids=["old-grant", "still-there", "launching", "no-driver"])
def test_a_host_goes_to_another_job_only_once_the_first_has_given_it_back(tmp_path, evidence):
    pool = Pool(tmp_path, ["h1", "h2"])
    a_on_both_hosts(pool)
    before = pool.generation()
    pool.report("b", curve=None)                 # a new job: its minimum is needed
    pool.cycle()
    assert pool.grant("a") == ["h1"] and pool.grant("b") == []    # h2 still a's
    if evidence.get("generation") == "before":
        evidence = {"generation": before, "offered": ["h1"], "holding": ["h1"]}
    else:
        evidence = dict({"holding": ["h1"]}, **evidence)
    for _ in range(3):                           # reports that do not show h2 given back
        pool.report("a", **evidence)
        pool.cycle()
        assert pool.grant("b") == [], evidence
    pool.report("a")                             # one that does, seen by two cycles ...
    pool.cycle()
    pool.cycle()
    assert pool.grant("b") == []
    pool.report("a")                             # ... and a second in a row: given back
    pool.cycle()
    assert pool.grant("b") == ["h2"] and pool.grant("a") == ["h1"]


def test_a_restarted_arbiter_goes_on_where_it_stopped_and_moves_nothing(tmp_path):
    pool = Pool(tmp_path, ["h1", "h2", "h3", "h4"], "--change-interval", "60")
    pool.report("a")
    pool.report("b", curve=FLAT)
    pool.cycle()
    grants = {k: pool.grant(k) for k in "ab"}
    generation = pool.generation()
    with pytest.raises(RuntimeError, match="another hvd-adapt-arbiter runs on"):
        pool.start()
    # b now says it scales as well as a: an even split would pay, but the last change
    # was less than 60 s ago, and that too survives the restart; a restarted arbiter
    # waits a whole interval besides before a change by choice.
    pool.report("a")
    pool.report("b", curve=LINEAR)
    pool.cycle()
    os.close(pool.arbiter.lock)                       # as if killed
    pool.arbiter = pool.start()
    for _ in range(5):
        pool.report("a")
        pool.report("b", curve=LINEAR)
        pool.cycle(seconds=10)
    assert {k: pool.grant(k) for k in "ab"} == grants and pool.generation() == generation
    pool.cycle(seconds=10)                            # 60 s after the first change
    assert pool.generation() == generation
    pool.cycle(seconds=10)                            # and 60 s after the restart
    assert pool.grant("a") == ["h1", "h2"] and pool.arbiter.state.jobs["b"].assigned == \
        ["h4", "h3"]                                  # h3 goes to b once a gave it back


def test_a_job_gone_silent_frees_its_hosts_unless_its_driver_is_seen_running(tmp_path):
    from hvd_adapt.scheduling.arbiter_client import driver_identity
    pool = Pool(tmp_path, ["h1", "h2"])
    with open(f"/proc/{os.getpid()}/stat") as f:
        start = f.read().rsplit(")", 1)[1].split()[19]
    alive = driver_identity(f"{os.getpid()}.{start}")
    exited = subprocess.Popen(["true"])
    exited.wait()
    dead = driver_identity(f"{exited.pid}.{start}")
    pool.report("a", driver=alive)
    pool.report("b", driver=dead)
    pool.cycle()
    pool.report("a", driver=alive)
    pool.report("b", driver=dead)
    pool.cycle()
    assert pool.grant("a") == ["h1"] and pool.grant("b") == ["h2"]
    for _ in range(9):
        pool.cycle()
    assert pool.grant("b") == ["h2"]                  # 9 s silent: not yet
    pool.cycle(seconds=2)
    assert pool.grant("a") == ["h1", "h2"]            # b is gone; a's driver runs
    assert not os.path.exists(report_path(pool.folder, "b"))


def test_a_failed_host_leaves_every_grant_and_comes_back_when_it_answers(tmp_path):
    servers = listeners(["127.0.0.1", "127.0.0.2"])
    port = str(servers[0].getsockname()[1])
    try:
        pool = Pool(tmp_path, ["127.0.0.1", "127.0.0.2"], "--ssh-port", port)
        pool.report("a", min_np=2)
        pool.cycle()
        assert pool.grant("a") == ["127.0.0.1", "127.0.0.2"]
        pool.report("a", min_np=2)
        servers.pop().close()                         # 127.0.0.2 goes down
        pool.cycle()
        assert pool.grant("a") == ["127.0.0.1"]
        servers += listeners(["127.0.0.2"], int(port))
        pool.report("a", holding=["127.0.0.1"])       # its session there has ended
        pool.cycle()
        pool.report("a", holding=["127.0.0.1"])
        pool.cycle()
        pool.report("a", holding=["127.0.0.1"])
        pool.cycle()
        assert pool.grant("a") == ["127.0.0.1", "127.0.0.2"]
    finally:
        for server in servers:
            server.close()


def test_a_bad_report_keeps_the_last_good_one_and_is_said_once(tmp_path, caplog):
    pool = Pool(tmp_path, ["h1", "h2", "h3"])
    pool.report("a")
    pool.cycle()
    pool.report("a")
    pool.cycle()
    grant = pool.grant("a")
    for bad in ('{"version": 1, "job": "a"}', "{", json.dumps({"version": 1, "job": "a;id"})):
        with open(report_path(pool.folder, "a"), "w") as f:
            f.write(bad)
        caplog.clear()
        pool.cycle()
        pool.cycle()
        assert pool.grant("a") == grant
        assert sum("ignoring a report" in r.getMessage() for r in caplog.records) == 1


def test_nothing_another_user_writes_counts(tmp_path, shared_tmp):
    # Their folder: refused, not used.
    theirs = os.path.join(shared_tmp, "arbiter")
    as_other_user(lambda: os.makedirs(os.path.join(theirs, "jobs"), mode=0o777))
    with pytest.raises(PermissionError, match="belongs to uid"):
        arbiter_module.Arbiter(arbiter_module.parser().parse_args(
            ["--folder", theirs, "--hostfile", "/dev/null"]))
    # A report of theirs in our folder (planted before it was made private): ignored.
    pool = Pool(tmp_path, ["h1", "h2"])
    pool.report("a")
    os.chown(report_path(pool.folder, "a"), 65534, 65534)
    pool.cycle()
    assert pool.arbiter.state.jobs == {} and not os.path.exists(state_path(pool.folder))


def test_a_full_disk_moves_nothing_until_the_state_is_written(full_disk, caplog):
    # A host taken from a job in a state that could not be written is given to no one on
    # reports of the grant still on disk; the write is tried again each cycle.
    from support.full_disk import fill
    pool = Pool(full_disk, ["h1", "h2"])
    a_on_both_hosts(pool)
    generation = pool.generation()
    # b arrives, and a's last report before the disk fills claims h2 free, of the grant
    # on disk.
    pool.report("b", curve=None)
    pool.report("a", holding=["h1"], offered=["h1"])
    fill(full_disk)
    caplog.clear()
    for _ in range(4):
        pool.cycle()
    assert pool.generation() == generation and pool.grant("a") == ["h1", "h2"]
    assert pool.arbiter.state.jobs["a"].releasing == {"h2": generation + 1}
    assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1
    os.unlink(os.path.join(full_disk, "filler"))
    pool.cycle()
    assert pool.grant("a") == ["h1"] and pool.grant("b") == []    # h2 not yet given back
    for _ in range(2):
        pool.report("a")
        pool.cycle()
    assert pool.grant("b") == ["h2"]


def test_a_state_file_that_is_not_one_stops_the_arbiter_naming_it(tmp_path, capsys):
    folder = tmp_path / "arbiter"
    pool = Pool(tmp_path, ["h1"])
    os.close(pool.arbiter.lock)
    with open(state_path(str(folder)), "w") as f:
        f.write(json.dumps({"version": 1, "generation": -1}))
    assert arbiter_module.main(pool.argv) == 1
    err = capsys.readouterr().err
    assert "arbiter.json: generation and next_order must be integers" in err
    assert "move it away to start afresh" in err


# -- the discovery's side -----------------------------------------------------------------
def discovery(pool, tmp_path, *extra):
    argv = ["--arbiter", pool.folder, "--job", "a", "--ssh-port", "0", "--hold", "0",
            "--state", str(tmp_path / "discover.json"), *extra]
    args = discover_module.parser().parse_args(argv)
    return lambda: discover_module.discover(args)


def test_the_discovery_offers_its_grant_reports_and_keeps_the_grant_it_cannot_read(
        tmp_path, capsys):
    pool = Pool(tmp_path, ["h1", "h2", "h3"])
    run = discovery(pool, tmp_path, "--max-np", "2")
    assert run() == []                                # no arbiter state yet
    assert "no arbiter has written" in capsys.readouterr().err
    pool.cycle()
    assert run() == [("h1", 1)]                       # registered: its first worker
    report = json.load(open(report_path(pool.folder, "a")))
    assert report["run"] == 2 and report["offered"] == [["h1", 1]]
    assert report["holding"] is None                  # run by hand: no driver seen
    pool.cycle()
    assert run() == [("h1", 1)]                       # no curve: it keeps its first grant
    os.rename(state_path(pool.folder), state_path(pool.folder) + ".away")
    assert run() == [("h1", 1)]
    assert "keeping the grant of generation" in capsys.readouterr().err
    # A grant in a file another user could write is not read.
    os.rename(state_path(pool.folder) + ".away", state_path(pool.folder))
    os.chmod(state_path(pool.folder), 0o666)
    assert run() == [("h1", 1)]
    assert "writable by other users" in capsys.readouterr().err


def test_the_discovery_never_offers_a_host_outside_its_grant(tmp_path, capsys):
    # Without an arbiter the discovery keeps one host of the world that answers where the
    # base drops them all, and keeps its hosts on an empty base answer (Horovod stops a job
    # offered none of its world). Under an arbiter a host outside the grant may be another
    # job's: the grant is the offer, even an empty one.
    servers = listeners(["127.0.0.1", "127.0.0.2", "127.0.0.3"])
    port = str(servers[0].getsockname()[1])
    folder = str(tmp_path / "arbiter")
    os.makedirs(os.path.join(folder, "jobs"), mode=0o700)
    os.chmod(folder, 0o700)

    def grant(hosts, generation):
        write_json(state_path(folder), {"version": 1, "generation": generation,
                                        "grants": {"a": [[h, 1] for h in hosts]}})
    args = discover_module.parser().parse_args(
        ["--arbiter", folder, "--job", "a", "--ssh-port", port, "--hold", "0",
         "--probe-timeout", "1", "--initial-np", "2", "--state", str(tmp_path / "d.json")])
    try:
        grant(["127.0.0.1", "127.0.0.2"], 1)
        assert discover_module.discover(args) == [("127.0.0.1", 1), ("127.0.0.2", 1)]
        grant(["127.0.0.3"], 2)
        assert discover_module.discover(args) == [("127.0.0.3", 1)]
        grant([], 3)
        assert discover_module.discover(args) == []
        assert "the arbiter granted a no host" in capsys.readouterr().err
    finally:
        for server in servers:
            server.close()
