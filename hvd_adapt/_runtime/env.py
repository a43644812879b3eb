"""Where this process runs: rank, world size, nodes, and how it was launched.

Thin wrappers over Horovod's own queries, so that the rest of hvd_adapt (and
user code) can ask one place. They work the same when the script is started
with plain ``python`` (a world of one), ``horovodrun -np N`` (Gloo, elastic or
not) and ``mpirun -np N`` (MPI). Before :func:`init` they raise Horovod's
ValueError ("Horovod has not been initialized; use hvd.init()"); they are
called on every step, so they add no checks of their own.
"""
import os

import horovod.torch as hvd
import torch

from .handover import ENV_FD as STANDBY_FD, wait_for_handover
from .blas import cap_loaded_scipy_blas
from . import watchdog
from .context import CONTEXT
from .gloo import init_world
from .rendezvous import RendezvousServer
from .threads import share_cpu_threads


def init(comm=None):
    """Initialise Horovod once (later calls do nothing) and set this replica up.

    ``comm`` is passed to ``hvd.init``: an mpi4py communicator (or a list of
    ranks) to run this job on a subset of an ``mpirun`` world. In an elastic
    job, the workers of a world first meet (a world short of a worker asks
    Horovod's driver for the next), then Gloo waits 5 s for a peer's message
    (``COLLECTIVE_TIMEOUT_SECONDS``, unless ``HOROVOD_GLOO_TIMEOUT_SECONDS`` or
    ``horovodrun --gloo-timeout-seconds`` says otherwise): a dead or stopped
    peer costs seconds, a worker slow to start costs nothing (see
    ``_runtime/gloo.py``). There, a watchdog process beside the worker ends it
    on evidence that it cannot go on: stopped or wedged while its peers reset,
    or its launcher gone (see ``_runtime/liveness.py``). Afterwards
    torch's CPU threads are shared among the node's replicas (see
    ``_runtime/threads.py``) and, where CUDA is available, the replica's
    device is ``cuda:local_rank``, as Horovod's examples set it. In a standby
    worker (``hvd-adapt-worker --standby``, see
    :mod:`hvd_adapt.scheduling.standby`) it first waits for a slot
    (``_runtime/handover.py``).

    >>> import hvd_adapt
    >>> hvd_adapt.init()
    >>> hvd_adapt.env.size()
    1
    """
    if initialized():
        return
    # A standby starts its watchdog before its hand-over, so that a warm join waits for no
    # process to start (watchdog.py).
    beacon = watchdog.start() if STANDBY_FD in os.environ or is_elastic() else None
    # A standby worker (hvd-adapt-worker --standby) waits here, booted, for the
    # slot and environment of the launch that takes it over.
    wait_for_handover()
    if launcher() == "python":
        # MPI_Init forks here; see blas.py for what that does to BLAS threads.
        cap_loaded_scipy_blas()
    elastic = is_elastic()
    server = RendezvousServer.from_environment() if elastic else None
    if beacon is not None and server is None:
        beacon.close()
    elif beacon is not None:
        # Before the meeting, which a worker that hangs in it would never leave.
        beacon.watch(server)
        CONTEXT.watchdog = beacon
    # Refuses a host whose name resolves to loopback, and meets the world; Gloo's
    # timeout is short in an elastic world, since the meeting lets no worker into its
    # rendezvous before all have started (gloo.py).
    init_world(lambda: hvd.init(comm=comm), elastic=elastic)
    share_cpu_threads(hvd.local_size(), hvd.local_rank())
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())


def initialized():
    """True once Horovod is initialised (by :func:`init` or directly)."""
    return hvd.is_initialized()


def rank():
    """This replica's global rank, 0 <= rank < size()."""
    return hvd.rank()


def size():
    """Number of replicas in the current world."""
    return hvd.size()


def local_rank():
    """This replica's rank among the replicas on its node."""
    return hvd.local_rank()


def local_size():
    """Number of replicas on this replica's node."""
    return hvd.local_size()


def num_nodes():
    """Number of nodes (hosts) the world spans, Horovod's cross size."""
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


def device(name="auto"):
    """The torch device this replica trains on: ``"auto"`` (its GPU where CUDA is available,
    else the CPU), ``"cpu"`` or ``"cuda"`` (``cuda:local_rank``; an error without CUDA).

    >>> device("cpu")
    device(type='cpu')
    """
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    index = hvd.local_rank() % torch.cuda.device_count() if initialized() else 0
    return torch.device("cuda", index)
