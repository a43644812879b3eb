"""The swap tests' fixture: file systems the test mounts."""
import pytest


@pytest.fixture
def mount(tmp_path):
    """``mount(kind, size)``: a fresh file system of ``kind`` (tmpfs, ramfs) mounted by the
    test; skipped where this user may not mount one."""
    import subprocess
    points = []

    def make(kind, size=None):
        point = tmp_path / f"{kind}{len(points)}"
        point.mkdir()
        options = ["-o", f"size={size}"] if size else []
        done = subprocess.run(["mount", "-t", kind] + options + [kind, str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"mounting a {kind} needs root and mount rights: {done.stderr.strip()}")
        points.append(point)
        return point

    yield make
    for point in points:
        subprocess.run(["umount", "-l", str(point)], check=False)
