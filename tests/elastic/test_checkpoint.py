"""Checkpoint files (hvd_adapt/elastic/checkpoint.py): private temporary files, fsyncs, and
generations that an older write can never replace."""
import datetime
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hvd_adapt.elastic import checkpoint


def write(path, generation, value):
    return checkpoint.write_atomically(
        path, lambda f: torch.save({"format": checkpoint.FORMAT, "generation": generation,
                                    "value": value, "handlers": {}, "objects": {}}, f),
        generation)


def test_a_file_is_private_and_no_temporary_file_is_left(tmp_path):
    path = str(tmp_path / "job.pt")
    assert write(path, 1, "a")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == [checkpoint.LOCK_NAME, "job.pt"]
    assert checkpoint.generation_of(path) == 1


def test_an_older_generation_never_replaces_a_newer_one(tmp_path):
    # A worker that stopped being rank 0 may finish its background write after
    # the new rank 0 wrote a later commit: the checkpoint must not go back in time.
    path = str(tmp_path / "job.pt")
    assert write(path, 7, "newer")
    assert not write(path, 5, "older")
    assert torch.load(path)["value"] == "newer" and checkpoint.generation_of(path) == 7
    assert write(path, 7, "same commit again") and write(path, 8, "next")
    assert checkpoint.generation_of(path) == 8
    assert sorted(os.listdir(tmp_path)) == [checkpoint.LOCK_NAME, "job.pt", "job.pt.previous"]
    assert checkpoint.generation_of(checkpoint.previous_path(path)) == 7


def test_the_temporary_name_is_not_predictable_nor_followed_through_a_link(tmp_path):
    # A predictable name (job.pt.tmp.<pid>) opened without O_EXCL let anyone who
    # can write the directory plant a link there and have the write clobber its target.
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    path = str(tmp_path / "job.pt")
    os.symlink(victim, f"{path}.tmp.{os.getpid()}")
    assert write(path, 1, "a")
    assert victim.read_text() == "keep me"


def test_the_file_and_its_directory_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", recording_fsync)
    write(str(tmp_path / "job.pt"), 1, "a")
    assert synced == [False, True], "the file, then the directory holding the rename"


def test_generation_of_a_missing_or_foreign_file(tmp_path):
    assert checkpoint.generation_of(str(tmp_path / "none.pt")) is None
    other = tmp_path / "other.pt"
    torch.save({"something": 1}, str(other))
    with pytest.raises(checkpoint.CheckpointError, match="not an hvd_adapt checkpoint"):
        checkpoint.generation_of(str(other))


def test_a_background_failure_is_reported_without_waiting_and_raised_once(tmp_path):
    (tmp_path / "file").write_text("a file where a directory should be")
    writer = checkpoint.CheckpointWriter()
    writer.write({"handlers": {}, "objects": {}}, str(tmp_path / "file" / "job.pt"), 3,
                 background=True)
    with pytest.raises(checkpoint.CheckpointError, match="job.pt failed"):
        writer.wait()
    assert writer.failure() is None
    writer.write({"handlers": {}, "objects": {}}, str(tmp_path / "file" / "job.pt"), 4,
                 background=True)
    deadline = time.time() + 30
    while writer.failure() is None and time.time() < deadline:
        time.sleep(0.02)
    assert "job.pt failed" in writer.failure()


def test_the_last_two_generations_are_kept_and_a_damaged_newest_falls_back(tmp_path, caplog):
    path = str(tmp_path / "job.pt")
    previous = checkpoint.previous_path(path)
    for generation in (1, 2, 3):
        assert write(path, generation, f"gen {generation}")
    assert checkpoint.generation_of(path) == 3 and checkpoint.generation_of(previous) == 2
    assert checkpoint.newest_good(path) == (path, 3)
    good = open(path, "rb").read()
    damages = {"truncated": good[:len(good) // 2], "not a checkpoint": b"garbage" * 100}
    # A bit flipped in the payload's bytes (the pickle): found only when it is read in full.
    flipped = bytearray(good)
    at = good.index(b"gen 3")
    flipped[at:at + 5] = b"gen 9"
    damages["bit-flipped"] = bytes(flipped)
    for how, data in damages.items():
        with open(path, "wb") as f:
            f.write(data)
        caplog.clear()
        assert checkpoint.read_newest(path, [])["value"] == "gen 2", how
        assert f"checkpoint {path}" in caplog.text and "falling back to the previous " \
            f"generation {previous}" in caplog.text, how
    # A write over a damaged newest file keeps the good previous generation.
    assert write(path, 4, "gen 4")
    assert checkpoint.generation_of(path) == 4 and checkpoint.generation_of(previous) == 2
    # Both damaged: the newest one's error, naming it.
    for name in (path, previous):
        with open(name, "wb") as f:
            f.write(b"x")
    with pytest.raises(checkpoint.CheckpointError, match="job.pt is unreadable"):
        checkpoint.newest_good(path)
    # The newest missing (a crash between the two renames): the previous one.
    os.remove(path)
    write(previous, 2, "gen 2")
    assert checkpoint.newest_good(path) == (previous, 2)


def test_a_fifo_planted_at_either_name_is_a_damaged_file_not_a_hang(tmp_path):
    # Anyone may mkfifo in a shared folder; opening one waits for a writer, so a load or a
    # save (both read the generation at path) hung on every rank, as did a load falling back
    # to a FIFO at path.previous. Checked in a child first, so that a hang fails the test
    # instead of stopping the run.
    fifo_newest, fifo_previous = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    assert write(fifo_newest, 1, "gen 1") and write(fifo_newest, 2, "gen 2")
    os.remove(fifo_newest)
    os.mkfifo(fifo_newest)
    # b.pt's newest refused only on the full load (a planted pickle naming a class), its
    # previous a FIFO.
    assert write(fifo_previous, 1, "gen 1") and write(fifo_previous, 2, datetime.date.today())
    os.remove(checkpoint.previous_path(fifo_previous))
    os.mkfifo(checkpoint.previous_path(fifo_previous))
    probe = textwrap.dedent("""
        import sys
        from hvd_adapt.elastic import checkpoint
        print(checkpoint.read_newest(sys.argv[1], [])["value"])
        try:
            checkpoint.read_newest(sys.argv[2], [])
        except checkpoint.CheckpointError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", probe, fifo_newest, fifo_previous],
                         capture_output=True, text=True, timeout=120)   # bounds a hang only
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "gen 1", out.stdout
    assert "b.pt.previous is not a regular file" in out.stdout, out.stdout
    with pytest.raises(checkpoint.CheckpointError, match="is not a regular file"):
        checkpoint.generation_of(fifo_newest)
    # The next save replaces the FIFO; the good previous generation stays.
    assert write(fifo_newest, 3, "gen 3")
    assert checkpoint.generation_of(fifo_newest) == 3
    assert checkpoint.generation_of(checkpoint.previous_path(fifo_newest)) == 1


def test_a_link_planted_at_the_previous_name_is_replaced_not_followed(tmp_path):
    # In a shared folder another user may plant path.previous as a link to a victim's file:
    # the rotation renames over the link itself, and a read of it is a checked load.
    path = str(tmp_path / "job.pt")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, checkpoint.previous_path(path))
    assert write(path, 1, "gen 1") and write(path, 2, "gen 2")
    assert victim.read_text() == "precious"
    assert not os.path.islink(checkpoint.previous_path(path))
    assert checkpoint.generation_of(checkpoint.previous_path(path)) == 1
