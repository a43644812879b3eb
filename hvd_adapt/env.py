"""Where this process runs: rank, world size, nodes, and how it was launched.

Thin wrappers over Horovod's own queries, so that the rest of hvd_adapt (and
user code) can ask one place. They work the same when the script is started
with plain ``python`` (a world of one), ``horovodrun -np N`` (Gloo, elastic or
not) and ``mpirun -np N`` (MPI).
"""
import os

import horovod.torch as hvd


def init():
    """Initialise Horovod once; later calls do nothing.

    >>> import hvd_adapt
    >>> hvd_adapt.init()
    >>> hvd_adapt.env.size()
    1
    """
    if not hvd.is_initialized():
        hvd.init()


def _require_init():
    if not hvd.is_initialized():
        raise RuntimeError("Horovod is not initialised: call hvd_adapt.init() first")


def rank():
    """This replica's global rank, 0 <= rank < size()."""
    _require_init()
    return hvd.rank()


def size():
    """Number of replicas in the current world."""
    _require_init()
    return hvd.size()


def local_rank():
    """This replica's rank among the replicas on its node."""
    _require_init()
    return hvd.local_rank()


def local_size():
    """Number of replicas on this replica's node."""
    _require_init()
    return hvd.local_size()


def num_nodes():
    """Number of nodes (hosts) the world spans, Horovod's cross size."""
    _require_init()
    return hvd.cross_size()


def launcher():
    """How this process was started: ``"horovodrun"``, ``"mpirun"`` or ``"python"``.

    Decided from the environment the launchers set, so it can be asked before
    :func:`init`.
    """
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ or "HOROVOD_RANK" in os.environ:
        return "horovodrun"
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
        return "mpirun"
    return "python"


def is_elastic():
    """True when started by ``horovodrun`` in elastic mode (host discovery or --min-np)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"
