"""Whole-job checkpoint files: written atomically, read back with every failure named.

The payload is built and applied by :class:`hvd_adapt.State`; this module
only knows the file: a format tag, written to a temporary file beside the
target, fsynced and renamed over it, so a job killed while writing leaves
the previous checkpoint intact.
"""
import os
import pickle

import torch

FORMAT = "hvd_adapt-checkpoint-v2"


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be read or does not fit this job's State."""


def write_atomically(payload, path):
    """Write ``payload`` (with the format tag added) to ``path``: temporary file, fsync, rename."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(dict(payload, format=FORMAT), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read(path, expected_names):
    """The payload in ``path``; raises :class:`CheckpointError` naming the file and the cause.

    ``expected_names`` are the names the State carries: a checkpoint of a
    State with other contents is refused rather than half loaded.
    """
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except (pickle.UnpicklingError, EOFError, RuntimeError, OSError, ValueError,
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
