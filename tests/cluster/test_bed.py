"""The bed itself: what a test run killed at its timeout leaves is swept by the next bed."""
import os
import subprocess
import sys

import pytest

from support import bed as cluster

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_bed_whose_maker_died_is_swept_by_the_next(tmp_path):
    reason = cluster.missing()
    if reason:
        pytest.skip(reason)
    code = (f"import sys, time; sys.path.insert(0, {TESTS!r}); from support import bed\n"
            f"made = bed.Bed(1, root={str(tmp_path)!r}); made.build()\n"
            "print(made.tag, flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    tag = child.stdout.readline().strip()
    child.kill()
    child.wait()
    assert f"hvdbed{tag}h1" in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                text=True).stdout
    with cluster.Bed(1, root=str(tmp_path)):
        pass
    assert f"hvdbed{tag}" not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                text=True).stdout
    assert subprocess.run(["ip", "link", "show", f"hb{tag}br"], capture_output=True).returncode != 0
    assert not os.path.exists(f"/etc/netns/hvdbed{tag}h1")
    assert not any(f"hvdbed{tag}" in line for line in subprocess.run(
        ["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines())
