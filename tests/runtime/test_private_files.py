"""The one helper for files in shared places: owner and mode checked, no link followed,
files created exclusively; a second local user (``nobody``) plants what it can."""
import os
import tempfile

import pytest

from hvd_adapt._runtime import private_files as pf
from support.second_user import OTHER_UID, as_other_user


def test_a_private_folder_is_0700_and_ours(tmp_path):
    folder = pf.private_folder(tmp_path / "a" / "b")
    assert os.stat(folder).st_mode & 0o777 == 0o700


def test_a_folder_others_may_write_is_refused(tmp_path):
    os.mkdir(tmp_path / "open")
    os.chmod(tmp_path / "open", 0o777)
    with pytest.raises(pf.UnsafePathError, match="writable by other users"):
        pf.private_folder(tmp_path / "open")


def test_a_symlink_in_place_of_the_folder_is_refused(tmp_path):
    os.mkdir(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    with pytest.raises(pf.UnsafePathError, match="not a folder"):
        pf.private_folder(tmp_path / "link")


def test_a_folder_another_user_made_first_is_refused(shared_tmp):
    state = os.path.join(shared_tmp, "state")
    as_other_user(lambda: os.mkdir(state, 0o700))
    with pytest.raises(pf.UnsafePathError, match=f"belongs to uid {OTHER_UID}"):
        pf.private_folder(state)


def test_the_runtime_folder_is_per_user_and_checked(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = pf.user_runtime_folder("discover")
    assert folder == str(tmp_path / f"hvd_adapt-{os.geteuid()}" / "discover")
    os.chmod(tmp_path / f"hvd_adapt-{os.geteuid()}", 0o777)
    with pytest.raises(pf.UnsafePathError):
        pf.user_runtime_folder("discover")


def test_creating_never_follows_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "new")
    with pytest.raises(FileExistsError):
        pf.create_exclusive(tmp_path / "new")
    assert victim.read_text() == "precious"


def test_atomic_writes_replace_whole_and_leave_no_temporary_on_failure(tmp_path):
    path = tmp_path / "f"
    pf.write_file_atomically(path, b"one")
    pf.write_file_atomically(path, b"two", durable=True)
    assert path.read_bytes() == b"two" and os.stat(path).st_mode & 0o777 == 0o600
    with pytest.raises(TypeError):
        pf.write_file_atomically(path, "not bytes")
    assert sorted(os.listdir(tmp_path)) == ["f"] and path.read_bytes() == b"two"


def test_reading_refuses_links_and_other_users_files(tmp_path, shared_tmp):
    (tmp_path / "real").write_bytes(b"x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(OSError):
        pf.read_own_file(tmp_path / "link")
    theirs = os.path.join(shared_tmp, "theirs")
    as_other_user(lambda: open(theirs, "w").write("{}"))
    with pytest.raises(pf.UnsafePathError, match="belongs to uid"):
        pf.read_own_file(theirs)
    with pytest.raises(ValueError, match="larger than 0 bytes"):
        pf.read_own_file(tmp_path / "real", limit=0)


@pytest.mark.parametrize("when", ["after-mkdir", "before-flock"])
def test_a_new_locked_folder_survives_a_sweep_before_its_lock(when, tmp_path, monkeypatch):
    # Another process of ours (a rank starting or ending on the same host) sweeps the shared
    # folder between our mkdir and our flock: it takes the new, still unlocked folder for a
    # dead one's and removes it. The new folder must be another, existing and locked.
    sweeps = []

    def sweep():
        if not sweeps:
            sweeps.append(None)     # once: the sweep's own flock comes back here
            sweeps[0] = pf.remove_unlocked_folders(str(tmp_path), "p-")

    real_mkdir, real_flock = os.mkdir, pf.fcntl.flock

    def mkdir(path, mode=0o777, **kwargs):
        real_mkdir(path, mode, **kwargs)
        if when == "after-mkdir":
            sweep()

    def flock(fd, operation):
        if when == "before-flock":
            sweep()
        return real_flock(fd, operation)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(pf.fcntl, "flock", flock)
    path, fd = pf.new_locked_folder(str(tmp_path), "p-")
    try:
        assert len(sweeps[0]) == 1 and sweeps[0][0] != path, "the sweep removed the first try"
        assert os.path.samestat(os.fstat(fd), os.lstat(path))
        assert pf.remove_unlocked_folders(str(tmp_path), "p-") == [], "ours is locked"
    finally:
        os.close(fd)


def test_a_lock_is_held_by_one_and_freed_when_its_holder_dies(tmp_path):
    path = str(tmp_path / "job.lock")
    fd = pf.hold_lock(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    with pytest.raises(BlockingIOError):
        pf.hold_lock(path)
    # A holder killed without a chance to clean up (SIGKILL) frees it; the file stays.
    pid = os.fork()
    if pid == 0:
        os.close(fd)
        try:
            pf.hold_lock(path)
        except BlockingIOError:
            os._exit(0)
        os._exit(1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    os.close(fd)
    child = os.fork()
    if child == 0:
        pf.hold_lock(path)
        os.kill(os.getpid(), 9)
    os.waitpid(child, 0)
    os.close(pf.hold_lock(path))


def test_a_lock_planted_by_a_link_or_another_user_is_refused(tmp_path, shared_tmp):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "link.lock")
    with pytest.raises(pf.UnsafePathError, match="is a symlink"):
        pf.hold_lock(str(tmp_path / "link.lock"))
    os.mkfifo(tmp_path / "fifo.lock", 0o600)
    with pytest.raises(pf.UnsafePathError, match="not a regular file"):
        pf.hold_lock(str(tmp_path / "fifo.lock"))
    theirs = os.path.join(shared_tmp, "job.lock")
    as_other_user(lambda: os.close(os.open(theirs, os.O_CREAT | os.O_WRONLY, 0o666)))
    with pytest.raises(pf.UnsafePathError, match="belongs to uid"):
        pf.hold_lock(theirs)
    assert victim.read_text() == "precious"
