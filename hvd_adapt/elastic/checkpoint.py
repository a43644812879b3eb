"""Whole-job checkpoint files: written atomically, never replaced by an older one, read back
with every failure named.

The payload is built and applied by :class:`hvd_adapt.State`; this module
only knows the file: a format tag and the job's generation (its number of
commits), written to a private temporary file beside the target (mode
0600), fsynced, and renamed over the target under a lock (the file
``.hvd_adapt-checkpoint.lock`` in that directory), unless the file there
holds a newer generation, then the directory is fsynced. So a job
killed while writing leaves the previous checkpoint intact, and a worker
that stopped being rank 0 (its background write still under way) cannot
take the checkpoint back in time after the new rank 0 wrote a newer one.

The last two good generations are kept: before the rename, a readable file at
the target moves to ``<path>.previous``. Where the newest file is damaged
(truncated, bit-flipped, not a checkpoint), readers fall back to the previous
one with a warning naming the damaged file (:func:`newest_good`,
:func:`read_newest`).
"""
import collections
import contextlib
import fcntl
import io
import logging
import os
import pickle
import threading
import zipfile

import numpy as np
import torch

from .._runtime import private_files

FORMAT = "hvd_adapt-checkpoint-v3"
# Files of the format before generations were recorded still load (generation 0).
_OLDER_FORMATS = ("hvd_adapt-checkpoint-v2",)

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be read or written, or does not fit this job's State."""


#: The file beside the checkpoints that their writers lock while they replace one.
LOCK_NAME = ".hvd_adapt-checkpoint.lock"


@contextlib.contextmanager
def _locked(directory):
    # Writers take turns: the generation read before the rename must still
    # be the file's when the rename lands. lockf is honoured on NFS too,
    # where flock may be local only.
    fd = os.open(os.path.join(directory, LOCK_NAME),
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _fsync_directory(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def previous_path(path):
    """Where the generation before the one at ``path`` is kept."""
    return path + ".previous"


def write_atomically(path, write, generation):
    """Fill a new private file beside ``path`` with ``write(f)``, fsync it, and rename it over
    ``path`` unless ``path`` already holds a later generation; returns whether it did. A
    readable older generation at ``path`` moves to :func:`previous_path` first; a damaged
    one is replaced (the previous generation stays)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # A name no one can predict, created exclusively (no symlink followed) with mode
    # 0600, in the target's own file system: a checkpoint folder may be shared.
    fd, tmp = private_files.create_temporary_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        with _locked(directory):
            try:
                existing = generation_of(path)
            except CheckpointError as e:
                log.warning("%s; replacing it (the previous generation stays)", e)
                existing = None
            if existing is not None and existing > generation:
                log.warning("checkpoint %s holds generation %d, newer than this write's %d: "
                            "kept it", path, existing, generation)
                return False
            if existing is not None and existing < generation:
                # A moment without a file at path is a moment a reader falls back.
                os.replace(path, previous_path(path))
            os.replace(tmp, path)
            _fsync_directory(directory)
        return True
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class CheckpointWriter:
    """Writes checkpoint files atomically, optionally in the background, one at a time.

    The payload is serialised to memory before ``write`` returns, so the
    tensors it holds may change right after (a commit reuses its buffers);
    only the file write and fsync, the slow part on a shared file system,
    run on a thread. That thread is not a daemon: the interpreter waits for
    it at exit, so a finished job never leaves a half-written file behind.
    A failed background write is kept, and no other background write starts
    until :meth:`wait` raised it: :meth:`failure` reports it without
    waiting, so that a commit can tell every rank.
    """

    def __init__(self):
        self._thread = None
        self._error = None
        self._path = None

    def write(self, payload, path, generation, background=False, stream=False):
        """Write ``payload`` (with the format tag and ``generation``) to ``path``, after the
        previous write. Where that one failed, a background write is skipped (the failure
        waits for :meth:`failure`'s reader) and a foreground one raises it. ``stream``:
        the payload stays as it is while the thread works (its tensors mapped from files
        or copies), so the thread serialises it straight into the file."""
        self._join()
        if self._error is not None:
            if background:
                return
            self.wait()
        payload = dict(_one_dtype_per_storage(payload), format=FORMAT, generation=generation)
        self._path = path
        if not background:
            # Straight into the file: no second copy of the state in memory.
            try:
                write_atomically(path, lambda f: torch.save(payload, f), generation)
            except Exception as e:
                # Not only OSError: on a full disk torch.save raises RuntimeError
                # ("[enforce fail at inline_container.cc] ... unexpected pos").
                raise self._error_for(e) from e
            return
        if stream:
            write = lambda f: torch.save(payload, f)   # noqa: E731
        else:
            buffer = io.BytesIO()
            try:
                torch.save(payload, buffer)
            except Exception as e:
                raise self._error_for(e) from e
            write = lambda f: f.write(buffer.getbuffer())   # noqa: E731
        self._thread = threading.Thread(target=self._write_in_background,
                                        args=(write, path, generation),
                                        name="hvd_adapt-checkpoint")
        self._thread.start()

    def _write_in_background(self, write, path, generation):
        try:
            write_atomically(path, write, generation)
        except Exception as e:  # reported by failure(), wait(), and the log now
            log.error("writing checkpoint %s failed: %s: %s", path, type(e).__name__, e)
            self._error = e

    def _error_for(self, error):
        return CheckpointError(f"writing checkpoint {self._path} failed: "
                               f"{type(error).__name__}: {error}")

    def _join(self):
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def failure(self):
        """The message of a background write that failed (without waiting for one under way),
        or None."""
        error = self._error
        return None if error is None else str(self._error_for(error))

    def wait(self):
        """Block until a background write is on disk; CheckpointError if it failed (raised
        once)."""
        self._join()
        error, self._error = self._error, None
        if error is not None:
            raise self._error_for(error) from error


def _one_dtype_per_storage(payload):
    """``payload`` where no storage is viewed by tensors of two dtypes: torch.save refuses that
    ("Cannot save multiple tensors or storages that view the same data as different
    types"), and optimizer state mapped from one file holds bfloat16 moments beside
    float32 step counts. In each such storage the dtype holding most bytes stays a view
    (a large state on disk is not read into memory); the others are copied."""
    tensors = []
    _collect_tensors(payload, tensors)
    by_storage = {}
    for t in tensors:
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    copied = {}
    for group in by_storage.values():
        sizes = {}
        for t in group:
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel() * t.element_size()
        if len(sizes) > 1:
            kept = max(sizes, key=sizes.get)
            copied.update((id(t), t.clone()) for t in group if t.dtype != kept)
    return _replace_tensors(payload, copied) if copied else payload


def _collect_tensors(value, out):
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_tensors(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_tensors(v, out)


def _replace_tensors(value, copies):
    if isinstance(value, torch.Tensor):
        return copies.get(id(value), value)
    if isinstance(value, dict):
        out = type(value)((k, _replace_tensors(v, copies)) for k, v in value.items()) \
            if type(value) in (dict, collections.OrderedDict) \
            else {k: _replace_tensors(v, copies) for k, v in value.items()}
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_replace_tensors(v, copies) for v in value)
    return value


def _numpy_globals():
    # What hvd_adapt's own state pickles besides tensors: numpy arrays (noise
    # statistics, the step-time profile) and their dtypes.
    core = getattr(np, "_core", None) or np.core
    dtypes = [type(np.dtype(t)) for t in (np.float64, np.float32, np.int64, np.int32, np.bool_)]
    return [np.ndarray, np.dtype, core.multiarray._reconstruct] + dtypes


def _load(source, name, trusted):
    try:
        # A path is opened here, not by torch.load: a FIFO planted at it would hang that open.
        with (private_files.open_regular_file(source) if isinstance(source, (str, os.PathLike))
              else contextlib.nullcontext(source)) as f:
            if trusted:
                return torch.load(f, map_location="cpu", weights_only=False)
            with torch.serialization.safe_globals(_numpy_globals()):
                return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if trusted or "weights_only" not in str(e).lower():
            raise CheckpointError(f"checkpoint {name} is unreadable (UnpicklingError: {e}); "
                                  "delete it to start afresh") from e
        raise CheckpointError(
            f"checkpoint {name} holds Python objects other than tensors, numpy arrays and plain "
            f"values, which loading would execute; if you wrote this file yourself, load it "
            f"with load_checkpoint(path, trusted=True). ({str(e).splitlines()[-1]})") from e
    except (EOFError, RuntimeError, OSError, ValueError,
            AttributeError, ImportError, KeyError) as e:
        raise CheckpointError(f"checkpoint {name} is unreadable ({type(e).__name__}: {e}); "
                              "delete it to start afresh") from e


def _check_format(payload, name):
    if not isinstance(payload, dict) or payload.get("format") not in (FORMAT,) + _OLDER_FORMATS:
        raise CheckpointError(f"{name} is not an hvd_adapt checkpoint ({FORMAT})")
    return payload.get("generation", 0)


class _Inert:
    """Stands for every class and function a pickle names: nothing is imported or called."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    # What the pickle may do to an instance of a dict or list subclass.
    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass


class _SkeletonUnpickler(pickle.Unpickler):
    # Tensors come back as _Inert objects and their storages as None: only the
    # plain structure around them (the format tag, the generation) is read.
    def find_class(self, module, name):
        return _Inert

    def persistent_load(self, pid):
        return None


def generation_of(path):
    """The generation recorded in the checkpoint at ``path``, None when there is no file;
    :class:`CheckpointError` when the file is not a readable checkpoint. Only the pickled
    structure is read (no tensor data), and no class it names is imported, so this is cheap
    and safe for any file, also one holding the user's own objects."""
    if not os.path.exists(path):
        return None
    try:
        # A FIFO planted at path would hang a plain open (and every rank with it).
        with private_files.open_regular_file(path) as file, zipfile.ZipFile(file) as archive:
            record = next(name for name in archive.namelist() if name.endswith("/data.pkl"))
            with archive.open(record) as f:
                payload = _SkeletonUnpickler(f).load()
    except (zipfile.BadZipFile, StopIteration, pickle.UnpicklingError, EOFError, OSError,
            ValueError, AttributeError, IndexError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); "
                              "delete it to start afresh") from e
    return _check_format(payload, path)


def read(source, expected_names, trusted=False, name=None):
    """The payload in ``source`` (a path, or a file-like object holding a file's bytes, then
    ``name`` says which file); raises :class:`CheckpointError` naming the file and the cause.

    ``expected_names`` are the names the State carries: a checkpoint of a
    State with other contents is refused rather than half loaded. Unless
    ``trusted``, the file is unpickled with ``weights_only=True`` (tensors,
    numpy arrays and plain Python values only), so a planted file cannot run
    code on load.
    """
    name = name or source
    return _fitting(_load(source, name, trusted), expected_names, name)


def _fitting(payload, expected_names, name):
    _check_format(payload, name)
    expected = set(expected_names)
    found = set(payload["handlers"]) | set(payload["objects"])
    if expected != found:
        raise CheckpointError(
            f"checkpoint {name} does not fit this State: missing {sorted(expected - found)}, "
            f"unexpected {sorted(found - expected)}")
    return payload


def newest_good(path):
    """``(file, generation)`` of the newest readable generation at ``path``: ``path`` itself,
    or, where it is missing or damaged, :func:`previous_path` (with a warning naming the
    damaged file); None where neither exists. :class:`CheckpointError` where the files that
    exist are all damaged (the newest one's error)."""
    try:
        generation = generation_of(path)
    except CheckpointError as damaged:
        older = _previous_generation(path)
        if older is None:
            raise
        log.warning("%s; falling back to the previous generation %s", damaged, older[0])
        return older
    if generation is None:
        return _previous_generation(path)
    return path, generation


def _previous_generation(path):
    older = previous_path(path)
    try:
        generation = generation_of(older)
    except CheckpointError as e:
        log.warning("%s", e)
        return None
    return None if generation is None else (older, generation)


def read_newest(path, expected_names, trusted=False):
    """:func:`read` of the newest good generation at ``path``: where the newest file is
    damaged beyond its structure (a tensor's bytes), the previous one, with a warning naming
    the damaged file; :class:`CheckpointError` when neither can be read."""
    found = newest_good(path)
    if found is None:
        raise CheckpointError(f"checkpoint {path} could not be read: there is no such file")
    source = found[0]
    try:
        payload = _load(source, source, trusted)
    except CheckpointError as damaged:
        source = previous_path(path)
        if found[0] == source or not os.path.exists(source):
            raise
        log.warning("%s; falling back to the previous generation %s", damaged, source)
        payload = _load(source, source, trusted)
    # A file that does not fit this State is refused, not passed over: the
    # previous generation was written by the same job.
    return _fitting(payload, expected_names, source)
