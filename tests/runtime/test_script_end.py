"""The line a worker leaves for hvd-adapt-run when its script ends on its own."""
import io
import sys

import pytest

from hvd_adapt._runtime import script_end


@pytest.mark.parametrize("error,code", [(ValueError("x"), 1), (SystemExit(143), 143),
                                        (SystemExit(None), 0), (SystemExit("bye"), 1),
                                        (KeyboardInterrupt(), 130)])
def test_the_record_carries_the_exit_code_the_error_gives(error, code):
    line = script_end.format_record("tok", rank=0, size=1, generation=3, error=error)
    assert script_end.read_record(line, "tok")["code"] == code


def test_only_a_job_under_the_supervisor_gets_a_record(monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.delenv(script_end.TOKEN_ENV, raising=False)
    script_end.tell(0, 2, 5, ValueError("bad"))
    assert stderr.getvalue() == ""
    monkeypatch.setenv(script_end.TOKEN_ENV, "abc")
    script_end.tell(1, 2, 5, ValueError("bad\nsecond line"))
    lines = stderr.getvalue().splitlines()
    assert len(lines) == 1
    assert script_end.read_record(lines[0], "abc") == {
        "rank": 1, "size": 2, "generation": 5, "code": 1, "error": "ValueError: bad\nsecond line"}


def test_a_closed_stderr_never_hides_the_scripts_error(monkeypatch):
    stderr = io.StringIO()
    stderr.close()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setenv(script_end.TOKEN_ENV, "abc")
    script_end.tell(0, 1, 0, ValueError("bad"))


def test_lines_that_only_look_like_records_are_not_read():
    line = script_end.format_record("tok", rank=0, size=1, generation=3, error=ValueError("x"))
    assert script_end.read_record(line, "other") is None
    assert script_end.read_record(line.replace('"rank": 0', '"rank": true'), "tok") is None
    assert script_end.read_record(line[:-10], "tok") is None
    assert script_end.read_record("print(" + line + ")", "tok") is None
    long = script_end.format_record("tok", 0, 1, 3, ValueError("y" * 10000))
    assert len(long) < 700
