"""Whole-job checkpoint files: written atomically, read back with every failure named.

The payload is built and applied by :class:`hvd_adapt.State`; this module
only knows the file: a format tag, written to a temporary file beside the
target, fsynced and renamed over it (on a thread if asked), so a job killed
while writing leaves the previous checkpoint intact.
"""
import io
import logging
import os
import pickle
import threading

import numpy as np
import torch

FORMAT = "hvd_adapt-checkpoint-v2"

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be read or does not fit this job's State."""


def _write_atomically(path, write):
    # write(f) fills the temporary file; fsync and rename make it the checkpoint.
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class CheckpointWriter:
    """Writes checkpoint files atomically (temporary file, fsync, rename), optionally in
    the background, one at a time.

    The payload is serialised to memory before ``write`` returns, so the
    tensors it holds may change right after (a commit reuses its buffers);
    only the file write and fsync, the slow part on a shared file system,
    run on a thread. That thread is not a daemon: the interpreter waits for
    it at exit, so a finished job never leaves a half-written file behind.
    """

    def __init__(self):
        self._thread = None
        self._error = None
        self._path = None

    def write(self, payload, path, background=False):
        """Write ``payload`` (with the format tag added) to ``path``; wait for the previous
        write first (raising :class:`CheckpointError` if it failed)."""
        self.wait()
        payload = dict(payload, format=FORMAT)
        if not background:
            # Straight into the file: no second copy of the state in memory.
            _write_atomically(path, lambda f: torch.save(payload, f))
            return
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        self._path = path
        self._thread = threading.Thread(target=self._write_in_background, args=(buffer, path),
                                        name="hvd_adapt-checkpoint")
        self._thread.start()

    def _write_in_background(self, buffer, path):
        try:
            _write_atomically(path, lambda f: f.write(buffer.getbuffer()))
        except Exception as e:  # reported by wait(), the next write, and the log now
            log.error("writing checkpoint %s failed: %s: %s", path, type(e).__name__, e)
            self._error = e

    def wait(self):
        """Block until a background write is on disk; CheckpointError if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"writing checkpoint {self._path} failed: "
                                  f"{type(error).__name__}: {error}") from error


def _numpy_globals():
    # What hvd_adapt's own state pickles besides tensors: numpy arrays (noise
    # statistics, the step-time profile) and their dtypes.
    core = getattr(np, "_core", None) or np.core
    dtypes = [type(np.dtype(t)) for t in (np.float64, np.float32, np.int64, np.int32, np.bool_)]
    return [np.ndarray, np.dtype, core.multiarray._reconstruct] + dtypes


def read(path, expected_names, trusted=False):
    """The payload in ``path``; raises :class:`CheckpointError` naming the file and the cause.

    ``expected_names`` are the names the State carries: a checkpoint of a
    State with other contents is refused rather than half loaded. Unless
    ``trusted``, the file is unpickled with ``weights_only=True`` (tensors,
    numpy arrays and plain Python values only), so a planted file cannot run
    code on load.
    """
    try:
        if trusted:
            payload = torch.load(path, map_location="cpu", weights_only=False)
        else:
            with torch.serialization.safe_globals(_numpy_globals()):
                payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if trusted or "weights_only" not in str(e).lower():
            raise CheckpointError(f"checkpoint {path} is unreadable (UnpicklingError: {e}); "
                                  "delete it to start afresh") from e
        raise CheckpointError(
            f"checkpoint {path} holds Python objects other than tensors, numpy arrays and plain "
            f"values, which loading would execute; if you wrote this file yourself, load it "
            f"with load_checkpoint(path, trusted=True). ({str(e).splitlines()[-1]})") from e
    except (EOFError, RuntimeError, OSError, ValueError,
            AttributeError, ImportError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); "
                              "delete it to start afresh") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an hvd_adapt checkpoint ({FORMAT})")
    expected = set(expected_names)
    found = set(payload["handlers"]) | set(payload["objects"])
    if expected != found:
        raise CheckpointError(
            f"checkpoint {path} does not fit this State: missing {sorted(expected - found)}, "
            f"unexpected {sorted(found - expected)}")
    return payload
