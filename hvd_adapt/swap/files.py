"""The files of the optimizer state on disk: the folder they live in, and each file's life.

Each optimizer has a folder of its own, ``<swap_dir>/hvd_adapt-swap-<random>`` (0700,
an unpredictable name, so ``swap_dir`` may be shared like /tmp), ``flock``-ed while the
optimizer lives: a folder whose lock is free is a dead process's and is removed by the
next optimizer that starts there; another user's, or one in use, is left alone.

A :class:`StateFile` holds one version of the state with the layout it was written
with. :class:`StateFiles` takes each through one life: **new** (being written, in
:meth:`StateFiles.new`: discarded if anything fails there), **live** and/or
**committed**, **lent** (tensors mapped from it were handed out: never written over
again), then the **spare** (no longer used: the next new file is written over it, so
no blocks are freed and allocated again at each step) or **removed**.

The folder is the job's own. No descriptor stays open on a file between uses: each use
opens it by name, never through a link, and checks that it is the file written (device
and inode), so a file removed or replaced behind the job's back fails that use loudly,
naming it, and forked children (DataLoader workers) keep no file allocated.
"""
import contextlib
import errno
import itertools
import logging
import mmap
import os

import torch

from .._runtime.private_files import create_exclusive, new_locked_folder
from .io import CheckedFile, SwapError, failure

log = logging.getLogger(__name__)

PREFIX = "hvd_adapt-swap-"


class StateFile:
    """One file of the state: its ``name`` in the folder, ``identity`` (device and inode of
    the file created), the :class:`~hvd_adapt.swap.layout.Layout` it holds, the ``serial``
    of that content (what a commit is restored by) and whether it was ``lent``."""

    def __init__(self, name, identity):
        self.name, self.identity = name, identity
        self.layout = self.serial = None
        self.lent = False


class StateFiles:
    """The optimizer's own folder under ``directory``, its :attr:`live` file and its
    :attr:`committed` one (None: no state). ``o_direct``: read and write around the page
    cache where the file system takes it (each file falls back to plain I/O where not)."""

    def __init__(self, directory, o_direct=True):
        self.root, self.fd = new_locked_folder(directory, PREFIX)
        self.live = self.committed = self._spare = None
        self._names, self._serials = itertools.count(), itertools.count(1)
        self._leftover = []         # files no longer used that could not be removed yet
        self.direct = o_direct

    @contextlib.contextmanager
    def new(self, layout):
        """A file to write ``layout``'s state into, its space reserved (a full disk fails
        here): the spare where there is one, else a new file. Yields ``(file, writer)``
        (a :class:`~hvd_adapt.swap.io.CheckedFile`); on leaving, the writer is closed and
        the file is live, or, where the block raised, the spare is the spare again (a file
        created here is removed) and the exception goes on."""
        file, self._spare = self._spare, None
        writer, created = None, file is None
        try:
            if created:
                file, writer = self._create()
            else:
                try:
                    writer = self.open(file, os.O_RDWR)
                except SwapError as e:
                    if e.errno != errno.ESTALE:     # another file took its name: left alone
                        self._unlink(file)
                    file = None     # said once (this use fails), then a new file is made
                    raise
            writer.reserve(layout.nbytes)
            yield file, writer
            file.layout, file.serial = layout, next(self._serials)
        except BaseException:
            if file is not None:
                self._retire(file, remove=created)
            raise
        finally:
            if writer is not None:
                writer.close()
        self.make_live(file)
        for left in list(self._leftover):
            self._unlink(left)

    def make_live(self, file):
        """``file`` (None: no state) is the live one; the one before goes where unused."""
        previous, self.live = self.live, file
        self._release(previous)

    def commit(self):
        """Keep the live file as the commit's (the one before is released); returns its
        mark: its serial (0: no state)."""
        previous, self.committed = self.committed, self.live
        self._release(previous)
        return 0 if self.live is None else self.live.serial

    def kept(self, mark):
        """The file a commit's ``mark`` names (None: the commit had no state)."""
        if mark == 0:
            return None
        if self.committed is None or self.committed.serial != mark:
            raise SwapError(errno.ENOENT, "that commit's optimizer state is no longer on disk "
                            "(a later commit replaced it)")
        return self.committed

    def _create(self):
        name = f"state{next(self._names)}.bin"
        try:
            fd = create_exclusive(name, flags=os.O_RDWR, dir_fd=self.fd)
        except OSError as e:
            raise failure(e.errno, f"cannot create {os.path.join(self.root, name)}"
                          + self._gone()) from e
        st = os.fstat(fd)
        return StateFile(name, (st.st_dev, st.st_ino)), \
            CheckedFile(fd, os.path.join(self.root, name), self.direct)

    def _gone(self):
        return " (the folder was removed behind this job's back)" \
            if os.fstat(self.fd).st_nlink == 0 else ""

    def open(self, file, flags=os.O_RDONLY):
        """A :class:`~hvd_adapt.swap.io.CheckedFile` of ``file``, opened by name; raises
        ``SwapError`` where it is gone or another file took its name."""
        path = os.path.join(self.root, file.name)
        try:
            fd = os.open(file.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as e:
            raise failure(e.errno, f"cannot open {path}{self._gone()}") from e
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != file.identity:
            os.close(fd)
            raise failure(errno.ESTALE, f"{path} was replaced behind this job's back")
        return CheckedFile(fd, path, self.direct)

    def map(self, file, lend=True):
        """``file``'s state as a uint8 tensor mapped from it (read lazily, copy-on-write; an
        unlinked file stays readable while mapped). ``lend``: tensors made of it are handed
        out, so the file is never written over again."""
        nbytes = file.layout.nbytes
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        reader = self.open(file)
        try:
            mapped = mmap.mmap(reader.fd, nbytes, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise failure(e.errno, f"cannot map {reader.name}") from e
        except ValueError as e:     # shorter than its layout: cut behind the job's back
            raise SwapError(errno.EIO, f"cannot map {nbytes} bytes of {reader.name}: {e}") from e
        finally:
            reader.close()
        file.lent = file.lent or lend
        return torch.frombuffer(mapped, dtype=torch.uint8)

    def _release(self, file):
        if file is not None and file is not self.live and file is not self.committed:
            self._retire(file)

    def _retire(self, file, remove=False):
        """``file`` is no longer used: the spare, unless there is one, tensors mapped from it
        were handed out (writing over it would change them) or ``remove``; else removed."""
        if self._spare is None and not file.lent and not remove:
            file.layout = file.serial = None
            self._spare = file
        else:
            self._unlink(file)

    def _unlink(self, file):
        try:
            os.unlink(file.name, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            # Only disk space is at stake (the folder or the file system made read-only or
            # immutable behind the job's back): tried again as each new file goes live.
            if file not in self._leftover:
                log.warning("hvd_adapt swap: cannot remove %s, no longer used: %s; it goes "
                            "once the folder takes it", os.path.join(self.root, file.name),
                            os.strerror(e.errno))
                self._leftover.append(file)
            return
        if file in self._leftover:
            self._leftover.remove(file)
