"""What a State must carry: a distributed optimizer or an autoscaling loader left out of it,
or a State under Horovod's own ``hvd.elastic.run``, stop every rank of an elastic job at its
start with an error that says what to change (a worker joining later would hang instead)."""
import os
import stat
import sys

import pytest

from support.launch import BIN, WORKERS, run_job

pytestmark = [pytest.mark.distributed, pytest.mark.elastic]


@pytest.mark.parametrize("args,message", [
    (["--leave-out", "optimizer"], "does not carry every DistributedOptimizer"),
    (["--leave-out", "loader"], "does not carry every AdaptiveDataLoader"),
    (["--horovod-run"], "synced by @hvd_adapt.run, not by @hvd.elastic.run"),
], ids=["optimizer", "loader", "hvd.elastic.run"])
def test_every_rank_refuses_to_train(args, message, tmp_path):
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/bash\necho localhost:2\n")
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    command = [os.path.join(BIN, "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
               "--network-interface", "lo", "--host-discovery-script", str(discover),
               sys.executable, os.path.join(WORKERS, "left_out.py")] + args
    job = run_job(command, timeout=120)
    assert job.returncode not in (0, "timeout"), job.output[-3000:]
    for rank in (0, 1):
        assert any(line.startswith(f"[{rank}]<stderr>") and message in line
                   for line in job.output.splitlines()), job.output[-3000:]
