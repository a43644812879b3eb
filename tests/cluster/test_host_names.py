"""Hosts whose own name resolves to loopback (Debian's ``127.0.1.1 h1``), on the namespace
cluster: hvd_adapt refuses them at start, naming the host, where it resolves and the fix,
instead of the job dying in Gloo (``connect [127.0.1.1]:5045: Connection refused``)."""
import os
import re
import sys

import pytest

from support import bed as cluster
from support.readme import readme_minimal_loop

BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def loopback_bed(tmp_path_factory):
    reason = cluster.missing()
    if reason:
        pytest.skip(reason)
    with cluster.Bed(3, ssh_options=cluster.KEEPALIVE, loopback_name=["h1", "h2", "h3"],
                     root=str(tmp_path_factory.mktemp("bed"))) as made:
        yield made


def test_a_host_named_after_loopback_is_refused_with_the_fix(loopback_bed, job_dir):
    with open(os.path.join(job_dir, "train.py"), "w") as f:
        f.write(readme_minimal_loop())
    command = [os.path.join(BIN, "horovodrun"), "-np", "3", "-H", "h1:1,h2:1,h3:1", "--gloo",
               "--network-interface", "eth0", sys.executable, "train.py"]
    result = loopback_bed.run("h1", command, timeout=240, check=False, cwd=job_dir,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    refused = re.findall(r"host 'h(\d)' resolves to 127.0.1.1 \(loopback\) on this host, but the "
                         r"job spans 3 hosts over interface 'eth0'", output)
    assert refused, output[-6000:]
    host = loopback_bed.hosts[f"h{refused[0]}"]
    assert f"'{host.address} {host.name}' instead of '127.0.1.1 {host.name}'" in output, output[-3000:]
