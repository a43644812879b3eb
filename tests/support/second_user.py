"""Acting as a second local user in a test: ``nobody`` (uid 65534), by forking and dropping
privileges, so no interpreter needs to be executable by that user. Root only: skipped elsewhere."""
import contextlib
import os
import signal
import traceback

import pytest

OTHER_UID = 65534  # nobody


def as_other_user(action):
    """Run ``action()`` in a forked child that dropped to ``OTHER_UID``; raise
    ``AssertionError`` with its traceback if it raised."""
    if os.geteuid() != 0:
        pytest.skip("acting as a second local user needs root (setuid)")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 0
        try:
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            action()
        except BaseException:
            os.write(write, traceback.format_exc().encode())
            code = 1
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        message = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the second user's action failed:\n{message}"


@contextlib.contextmanager
def other_user_running(action):
    """Run ``action()`` as ``OTHER_UID`` in a forked child while the ``with`` block runs (a
    hostile process that keeps listening, say); the child is killed when the block ends."""
    if os.geteuid() != 0:
        pytest.skip("acting as a second local user needs root (setuid)")
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            action()
        finally:
            os._exit(0)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
