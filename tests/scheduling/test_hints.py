"""The hints file: atomic, versioned, readable without torch."""
import json
import os
import subprocess
import sys

import pytest

from hvd_adapt.scheduling.hints import HintsError, make_hints, read_hints, write_hints

ENTRY = {"replicas": 1, "nodes": 1, "goodput": 10.0, "speedup": 1.0, "local_bsz": 8,
         "accumulation_steps": 0, "batch_size": 8}


def test_round_trip_and_fields(tmp_path):
    path = str(tmp_path / "sub" / "hints.json")
    hints = make_hints(2, 1, [2, 1, 2], 8, 123.0, [ENTRY])
    write_hints(path, hints)
    read = read_hints(path)
    assert read == hints
    assert read["replica_counts_timed"] == [1, 2] and read["timed_two_counts"]
    assert read["version"] == 1 and read["fitted_at"] == 123.0
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    assert [p for p in os.listdir(tmp_path / "sub")] == ["hints.json"]   # no temp file left


def test_missing_file_is_none_and_bad_files_are_errors(tmp_path):
    path = str(tmp_path / "hints.json")
    assert read_hints(path) is None
    for text, message in [("{", "not JSON"), (json.dumps({"version": 2}), "version 2"),
                          (json.dumps([1]), "version None"),
                          (json.dumps({"version": 1, "curve": []}), "missing replicas"),
                          (json.dumps(dict(make_hints(1, 1, [1], 8, None, []),
                                           curve=[{"replicas": 1}])), "lacks nodes")]:
        with open(path, "w") as f:
            f.write(text)
        with pytest.raises(HintsError, match=message):
            read_hints(path)


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = str(tmp_path / "hints.json")
    write_hints(path, make_hints(1, 1, [1], 8, None, []))
    with pytest.raises(TypeError):
        write_hints(path, {"version": 1, "bad": object()})
    assert read_hints(path)["replicas"] == 1
    assert os.listdir(tmp_path) == ["hints.json"]


def test_reading_loads_neither_torch_nor_numpy(tmp_path):
    path = str(tmp_path / "hints.json")
    write_hints(path, make_hints(1, 1, [1], 8, None, [ENTRY]))
    code = ("import sys; from hvd_adapt.scheduling.hints import read_hints; "
            f"read_hints({path!r}); "
            "print(sorted(m for m in ('torch', 'numpy', 'horovod') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
