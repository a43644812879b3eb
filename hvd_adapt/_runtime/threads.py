"""Torch's CPU threads, shared among the replicas of one node.

torch starts as many intra-op threads as the machine has cores in every
process, so N replicas on a node start N times too many, which fight each
other and Horovod's background threads (``benchmarks/RESULTS.md`` has the
measured cost; torchrun sets OMP_NUM_THREADS=1 for the same reason). Each
replica gets its share of the CPUs it may run on, at least one, and never
more than torch would have used; OMP_NUM_THREADS, or a count the script set
itself after ours, is left alone.
"""
import logging
import os

import torch

from .context import CONTEXT

log = logging.getLogger(__name__)


def usable_cpus():
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def share_cpu_threads(local_size, local_rank):
    """Give torch this replica's share of the node's CPUs; call after (re)initialising Horovod."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    current = torch.get_num_threads()
    if CONTEXT.threads_set is None:
        CONTEXT.thread_ceiling = current
    elif current != CONTEXT.threads_set:
        return
    cpus = usable_cpus()
    share = min(CONTEXT.thread_ceiling, max(1, cpus // local_size))
    if share != current:
        torch.set_num_threads(share)
        if share < current and local_rank == 0:
            log.info("%d replica(s) on this node, %d usable CPUs: torch uses %d thread(s) in "
                     "each (OMP_NUM_THREADS overrides)", local_size, cpus, share)
    CONTEXT.threads_set = share
