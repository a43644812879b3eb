"""docs/porting-from-horovod.md, step by step, on the shapes of Horovod's own elastic scripts
(its integration test's training script, its MNIST and synthetic-benchmark examples): the
script with its imports changed trains as Horovod's does and keeps its State values; the
integration script survives 2 -> 3 -> 2 workers."""
import json
import os
import sys
import tempfile

import numpy as np
import pytest

from support.elastic_jobs import FAST_HOROVODRUN, discovery_script
from support.launch import WORKERS, run_job, run_ranks

pytestmark = pytest.mark.distributed

# What each shape's State holds at the end (Horovod's loops leave these values).
FINAL = {"integration": {"epoch": 3, "batch": 0, "commits": 15, "rendezvous": 1},
         "mnist": {"epoch": 3, "batch": 0},
         "synthetic": {"batch": 0, "img_secs": [0.0, 1.0, 2.0], "iter": 2, "warm": True}}


@pytest.mark.parametrize("shape", sorted(FINAL))
def test_a_horovod_elastic_script_with_its_imports_changed_trains_as_horovods(shape):
    args = ["--shape", shape]
    horovod = run_ranks("horovod_ported.py", np=2, args=args + ["--library", "horovod"]).check()
    ported = run_ranks("horovod_ported.py", np=2, args=args + ["--library", "hvd_adapt"]).check()
    for rank in (0, 1):
        theirs, ours = horovod.reports[rank], ported.reports[rank]
        assert ours["values"] == theirs["values"] == FINAL[shape], rank
        for a, b in zip(ours["params"], theirs["params"]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert ported.reports[0]["params"] == ported.reports[1]["params"]


@pytest.mark.parametrize("loop,resumed", [("for", [2, 3]), ("remaining", [3])])
def test_a_ported_scripts_epoch_is_checkpointed_and_resumed(tmp_path, loop, resumed):
    # The MNIST shape's epoch (assigned by its for loop) is the State's epoch counter: a
    # checkpoint resumes in the epoch of its last commit, as Horovod's State does after a
    # failure (the last epoch is trained again); remaining_epochs_until commits the next
    # epoch between two, so a restart goes on after the last finished one.
    path = str(tmp_path / "job.pt")
    args = ["--shape", "mnist", "--library", "hvd_adapt", "--checkpoint", path,
            "--epoch-loop", loop]
    first = run_ranks("horovod_ported.py", np=2, args=args + ["--epochs", "2"]).check()
    assert first.reports[0]["trained"] == [1, 2]
    again = run_ranks("horovod_ported.py", np=2, args=args + ["--epochs", "3"]).check()
    assert again.reports[0]["trained"] == again.reports[1]["trained"] == resumed
    assert again.reports[0]["values"]["epoch"] == (3 if loop == "for" else 4)


def test_the_ported_integration_script_survives_a_grow_and_a_shrink():
    out_dir = tempfile.mkdtemp(prefix="hvd_adapt_ported_")
    logfile = os.path.join(out_dir, "epochs.jsonl")
    # Commits: 5 an epoch; a third worker from the 6th, gone again from the 19th; each
    # epoch's end takes 4 s (Horovod's script's --epoch-wait), so the new worker starts
    # while the job still trains.
    script = discovery_script(out_dir, [(0, ["localhost:2"]), (6, ["localhost:3"]),
                                        (19, ["localhost:2"])])
    command = [sys.executable, FAST_HOROVODRUN, "-np", "2", "--min-np", "2", "--max-np", "3",
               "--network-interface", "lo", "--host-discovery-script", script,
               sys.executable, os.path.join(WORKERS, "horovod_ported.py"), "--library",
               "hvd_adapt", "--shape", "integration", "--epochs", "6", "--epoch-wait", "4",
               "--logfile", logfile]
    job = run_job(command, out_dir=out_dir, timeout=300)
    job.check()
    with open(logfile) as f:
        lines = [json.loads(line) for line in f]
    # One line per epoch, each after its last batch, the commits counted as Horovod's test
    # counts them; the world grew to 3 and shrank to 2, with a rendezvous for each.
    assert [e["epoch"] for e in lines] == [0, 1, 2, 3, 4, 5], lines
    assert [e["commits"] for e in lines] == [4, 9, 14, 19, 24, 29], lines
    assert 3 in [e["size"] for e in lines] and lines[-1]["size"] == 2, lines
    assert lines[-1]["rendezvous"] >= 3, lines
    final = job.reports[0]
    assert final["values"]["epoch"] == 6 and final["values"]["commits"] == 30
    assert final["size"] == 2
