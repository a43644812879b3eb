"""Torch's CPU threads, shared among the replicas of one node.

torch starts as many intra-op threads as the machine has cores in every
process, so N replicas on a node start N times too many. On CPU the extra
threads fight each other and Horovod's background threads: the digits
example on 2 processes and 2 cores ran 1.5k samples/s at batch 32, and 10k
with one thread each. (torchrun sets OMP_NUM_THREADS=1 for the same reason.)
Each replica gets its share of the CPUs it may run on, at least one, and
never more than torch would have used; OMP_NUM_THREADS, or a count the
script set itself after ours, is left alone.
"""
import os
import sys

import torch

_ours = None  # the count set here last: a different one now was the script's choice
_ceiling = None  # torch's count before the first share


def _usable_cpus():
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def share_cpu_threads(local_size, local_rank):
    """Give torch this replica's share of the node's CPUs; call after (re)initialising Horovod."""
    global _ours, _ceiling
    if "OMP_NUM_THREADS" in os.environ:
        return
    current = torch.get_num_threads()
    if _ours is None:
        _ceiling = current
    elif current != _ours:
        return
    share = min(_ceiling, max(1, _usable_cpus() // local_size))
    if share != current:
        torch.set_num_threads(share)
        if share < current and local_rank == 0:
            print(f"hvd_adapt: {local_size} replica(s) on this node, {_usable_cpus()} usable "
                  f"CPUs: torch uses {share} thread(s) in each (OMP_NUM_THREADS overrides)",
                  file=sys.stderr, flush=True)
    _ours = share
