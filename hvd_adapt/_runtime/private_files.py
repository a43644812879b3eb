"""Files and folders in places another local user could write (/tmp, shared volumes).

Every file hvd_adapt creates in such a place goes through this module, so one
set of checks holds everywhere: a folder we use is a real folder (no symlink
followed), owned by us and writable by no one else; a file is created
exclusively (``O_EXCL|O_NOFOLLOW``, an unpredictable name where it is
temporary) with a mode we choose; a file we read back is ours and not a
planted link. Standard library only: the discovery script imports it.

>>> import tempfile, os
>>> top = tempfile.mkdtemp()
>>> folder = private_folder(os.path.join(top, "state"))
>>> oct(os.stat(folder).st_mode & 0o777)
'0o700'
>>> write_file_atomically(os.path.join(folder, "a.json"), b"{}")
>>> read_own_file(os.path.join(folder, "a.json"))
b'{}'
"""
import errno
import fcntl
import os
import shutil
import stat


class UnsafePathError(PermissionError):
    """A path in a shared place fails an ownership or mode check; the message says which."""


def _describe(st):
    return f"owner uid {st.st_uid}, mode {oct(stat.S_IMODE(st.st_mode))}"


def check_owned(st, path, others_may_write=False):
    """Raise :class:`UnsafePathError` unless ``st`` (an ``os.stat_result`` of ``path``)
    belongs to this process's user and, unless ``others_may_write``, no group or other
    user may write it."""
    if st.st_uid != os.geteuid():
        raise UnsafePathError(f"{path} belongs to uid {st.st_uid}, not to this user "
                              f"(uid {os.geteuid()}): refusing to use it ({_describe(st)})")
    if not others_may_write and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePathError(f"{path} is writable by other users ({_describe(st)}): another "
                              f"local user could plant files there; chmod go-w it")


def private_folder(path, mode=0o700):
    """Create ``path`` (parents included, each a real folder) with ``mode`` if it is missing;
    check that it is a real folder (not a symlink), ours and writable by no one else.
    Returns the absolute path."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, mode=mode)
    except FileExistsError:
        pass
    return check_private_folder(path)


def check_private_folder(path):
    """Check, without creating it, that ``path`` is a real folder (not a symlink), ours and
    writable by no one else (``FileNotFoundError`` where it is missing). Returns ``path``."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path} is not a folder (a symlink or a file): refusing to use it")
    check_owned(st, path)
    return path


def user_runtime_folder(name):
    """A private folder ``name`` for this user's small state files: under
    ``$XDG_RUNTIME_DIR`` when that is set, ours and private; otherwise
    ``<tmp>/hvd_adapt-<uid>/<name>``, created 0700 with the same checks (a folder
    another user made there first is refused, not used)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        try:
            st = os.lstat(runtime)
            if stat.S_ISDIR(st.st_mode):
                check_owned(st, runtime)
                return private_folder(os.path.join(runtime, "hvd_adapt", name))
        except (OSError, UnsafePathError):
            pass
    import tempfile     # only here: hvd-adapt-discover runs every second, tempfile loads random
    top = private_folder(os.path.join(tempfile.gettempdir(), f"hvd_adapt-{os.geteuid()}"))
    return private_folder(os.path.join(top, name))


def create_exclusive(path, mode=0o600, flags=0, dir_fd=None):
    """Open a new file at ``path`` for writing: created here (``O_EXCL``), never through a
    symlink (``O_NOFOLLOW``), with ``mode``; ``flags`` adds to ``os.open``'s (``O_RDWR``);
    ``dir_fd``: ``path`` is relative to that folder (one :func:`new_locked_folder` gave).
    Returns the file descriptor."""
    access = os.O_RDWR if flags & os.O_RDWR else os.O_WRONLY
    return os.open(path, access | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                   | (flags & ~os.O_RDWR), mode, dir_fd=dir_fd)


def create_temporary_beside(path, mode=0o600):
    """A new file beside ``path`` (same folder, so a rename onto ``path`` is atomic) under
    an unpredictable name, created with :func:`create_exclusive`. Returns ``(fd, name)``."""
    folder, name = os.path.split(os.path.abspath(path))
    for _ in range(100):
        tmp = os.path.join(folder, f".{name}.{os.urandom(6).hex()}.tmp")
        try:
            return create_exclusive(tmp, mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", path)


def write_file_atomically(path, data, mode=0o600, durable=False):
    """Replace ``path`` with ``data`` (bytes) atomically: a temporary file from
    :func:`create_temporary_beside`, filled, then renamed over ``path``. ``durable``:
    fsync the file before the rename. A failure removes the temporary file and leaves
    ``path`` as it was."""
    fd, tmp = create_temporary_beside(path, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def open_regular_file(path, follow_symlinks=True):
    """Open ``path`` for reading and check with ``fstat`` (on the very file opened) that it
    is a regular file, whoever owns it (a checkpoint other hosts of the job wrote). Returns
    a binary file object; :class:`UnsafePathError` for anything else (a FIFO, a device)."""
    # O_NONBLOCK: opening a FIFO planted at path (anyone may mkfifo in a shared folder)
    # would otherwise wait for a writer forever, before the check could refuse it.
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(f"{path} is not a regular file: refusing to read it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_own_file(path, others_may_write=False):
    """Open ``path`` for reading without following a symlink, and check with ``fstat`` (on
    the very file opened) that it is a regular file of ours. Returns a binary file object."""
    f = open_regular_file(path, follow_symlinks=False)
    try:
        check_owned(os.fstat(f.fileno()), path, others_may_write=others_may_write)
        return f
    except BaseException:
        f.close()
        raise


def read_own_file(path, limit=16 << 20, others_may_write=False):
    """The bytes of ``path`` (a regular file of ours, no symlink followed), at most
    ``limit`` of them: a larger file raises ``ValueError`` naming its size."""
    with open_own_file(path, others_may_write=others_may_write) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes: refusing to read it")
    return data


def remove_if_present(path):
    """Remove file ``path``; one already gone is fine (another process was first)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def hold_lock(path):
    """Take the lock file ``path`` (in a place others may write): created with
    :func:`create_exclusive` where missing, else opened without following a symlink and
    checked to be a regular file of ours that no one else may write; then an exclusive
    ``flock`` is taken without waiting. Returns the descriptor, which holds the lock for as
    long as it (or a copy a child inherited) is open: a holder that dies, even by SIGKILL,
    leaves it free, and the file is never removed (a removal would let a second holder lock
    a new file while the first holds the old). ``BlockingIOError`` where another holds it."""
    try:
        fd = create_exclusive(path, flags=os.O_RDWR)
    except FileExistsError:
        try:
            # O_NONBLOCK: a FIFO planted at path would hang the open before the check.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise UnsafePathError(f"{path} is a symlink: refusing to use it as a lock") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path} is not a regular file: refusing to use it as a lock")
        check_owned(st, path)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BaseException:
        os.close(fd)
        raise


def new_locked_folder(parent, prefix):
    """Create a new folder ``<parent>/<prefix><random>`` (``parent`` may be shared, like
    /tmp: the name is unpredictable and ``mkdir`` never follows a link), mode 0700, and hold
    an exclusive ``flock`` on it while the returned descriptor is open: the folder is in use
    for as long as its owner lives, whatever host name or PID namespace it runs in.
    Returns ``(path, fd)``; open files inside it relative to ``fd`` (``dir_fd=fd``), so a
    folder renamed under us is never followed to another place."""
    parent = os.path.abspath(parent)
    for _ in range(100):
        path = os.path.join(parent, prefix + os.urandom(6).hex())
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        # Until it is locked the new folder looks stale: another process of ours sweeping
        # parent (a rank starting or ending beside us) may lock and remove it first. Then
        # the lock fails, or is taken on a removed folder: try another name.
        try:
            fd = _lock_folder(path)
        except (BlockingIOError, FileNotFoundError):
            continue
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        try:
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                return path, fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise FileExistsError(errno.EEXIST, "no free folder name", parent)


def _lock_folder(path):
    """A descriptor of folder ``path`` (ours, no link followed) with an exclusive ``flock``
    held on it; ``BlockingIOError`` when another descriptor holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        check_owned(os.fstat(fd), path)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BaseException:
        os.close(fd)
        raise


def remove_unlocked_folders(parent, prefix):
    """Remove the folders ``<parent>/<prefix>*`` of ours whose lock is free (their owner
    ended without removing them: a crash, SIGKILL); a folder in use, another user's, or a
    link is left alone. Returns the paths removed."""
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        path = os.path.join(parent, name)
        try:
            fd = _lock_folder(path)
        except (OSError, UnsafePathError):
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed
