"""The files of the optimizer state on disk, in a folder of its own (``<swap_dir>/hvd_adapt-
swap-<random>``, 0700, ``flock``-ed while it lives: one whose lock is free is a dead
process's, removed by the next to start there). Each use opens its file by name, never
through a link, and checks it is the file written (device and inode): a file removed or
replaced behind the job's back fails that use loudly. No descriptor stays open."""
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
    """A file's ``name``, ``identity`` (device, inode), ``layout``, ``serial`` (of its content:
    a commit's mark), whether it was ``lent``."""

    def __init__(self, name, identity):
        self.name, self.identity, self.layout, self.serial, self.lent = \
            name, identity, None, None, False


class StateFiles:
    """The optimizer's folder under ``directory`` and each file's life: new (being written,
    in :meth:`new`), :attr:`live` and/or :attr:`committed`, lent (mapped tensors handed
    out), then the spare (the next new file, written over: no blocks freed and allocated at
    each step) or removed. ``o_direct`` where the file system takes it."""

    def __init__(self, directory, o_direct=True):
        self.root, self.fd = new_locked_folder(directory, PREFIX)
        self.live = self.committed = self._spare = None
        self._names, self._serials, self.direct = itertools.count(), itertools.count(1), o_direct
        self._leftover = set()      # files no longer used that could not be removed yet

    @contextlib.contextmanager
    def new(self, layout):
        """``(file, writer)`` for ``layout``'s state, its space reserved (a full disk fails
        here): the spare, else a new file; live on leaving, or, where the block raised, the
        spare again (a file made here: removed)."""
        file, self._spare = self._spare, None
        writer, created = None, file is None
        try:
            if created:
                file, writer = self._create()
            else:
                try:
                    writer = self.open(file, os.O_RDWR)
                except SwapError:   # said once (this use fails), then a new file is made
                    self._leftover.add(file)
                    file = None
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
        """``file`` (None: no state) is the live one."""
        previous, self.live = self.live, file
        self._release(previous)

    def commit(self):
        """Keep the live file as the commit's; returns its mark, its serial (0: no state)."""
        previous, self.committed = self.committed, self.live
        self._release(previous)
        return 0 if self.live is None else self.live.serial

    def kept(self, mark):
        """The file a commit's ``mark`` names (None: the commit had no state)."""
        if mark and (self.committed is None or self.committed.serial != mark):
            raise SwapError(errno.ENOENT, "that commit's optimizer state is no longer on disk "
                            "(a later commit replaced it)")
        return self.committed if mark else None

    def _create(self):
        name = f"state{next(self._names)}.bin"
        path = os.path.join(self.root, name)
        try:
            fd = create_exclusive(name, flags=os.O_RDWR, dir_fd=self.fd)
        except OSError as e:
            raise failure(e.errno, f"cannot create {path}{self._gone()}") from e
        st = os.fstat(fd)
        return StateFile(name, (st.st_dev, st.st_ino)), CheckedFile(fd, path, self.direct)

    def _gone(self):
        return " (the folder was removed behind this job's back)" \
            if os.fstat(self.fd).st_nlink == 0 else ""

    def open(self, file, flags=os.O_RDONLY):
        """``file`` opened by name; ``SwapError`` where it is gone or replaced."""
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
        unlinked file stays readable while mapped); ``lend``: never written over again."""
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
        """``file`` is no longer used: the spare, unless there is one, it was lent (writing
        over it would change the tensors handed out) or ``remove``; else removed."""
        if self._spare is None and not file.lent and not remove:
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
            self._leftover.add(file)
            return
        self._leftover.discard(file)
