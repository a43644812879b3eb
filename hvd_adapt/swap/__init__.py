"""The optimizer's state on disk, as DeepSpeed's optimizer swapper, under torch optimizers:
:class:`DiskState`, the on-disk implementation of
:class:`~hvd_adapt.optim.optimizer_state.OptimizerState` (``swap_dir`` of
:class:`hvd_adapt.DistributedOptimizer`).

- ``layout.py``: what the optimizer keeps per parameter (a probe), where it lies in a
  file, and the pieces and chunks a step walks;
- ``io.py``: aligned buffers in a pool, checked reads and writes, the whole-file pipeline;
- ``files.py``: the optimizer's own folder and the life of each state file in it;
- ``step.py``: one step's pipeline (read ahead, step, write behind) and its counters;
- ``disk_state.py``: the interface's methods, and the ranks' agreements on each step
  and sync.
"""
from .disk_state import DiskState, Outcome
from .io import SwapError

__all__ = ["DiskState", "Outcome", "SwapError"]
