"""hvd_adapt installs into a user's own torch + Horovod environment without replacing either."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dry_run_report(tmp_path):
    report = tmp_path / "report.json"
    # --no-index: whatever pip would have to fetch makes the resolution fail.
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                    "--no-build-isolation", "--quiet", "--report", str(report), ROOT],
                   check=True, capture_output=True, text=True)
    return json.loads(report.read_text())


def test_install_into_an_environment_with_torch_and_horovod_installs_neither(tmp_path):
    report = dry_run_report(tmp_path)
    names = [item["metadata"]["name"].lower().replace("_", "-") for item in report["install"]]
    assert names == ["hvd-adapt"], names
    ours = report["install"][0]["metadata"]
    requires = [r for r in ours.get("requires_dist", []) if "extra ==" not in r]
    # Ranges, not pins, and nothing the library does not import.
    for name in ("torch", "horovod"):
        spec = next(r for r in requires if r.lower().startswith(name))
        assert "==" not in spec and ">=" in spec, spec
    assert not [r for r in requires if r.lower().startswith(("pytest", "mpi4py"))], requires
    assert ours["requires_python"] == ">=3.10"
    extras = set(ours.get("provides_extra", []))
    assert {"test", "examples", "tensorboard"} <= extras
