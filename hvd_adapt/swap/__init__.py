"""The optimizer's state on disk, as DeepSpeed's optimizer swapper, under torch optimizers:
:class:`DiskState`, the on-disk :class:`~hvd_adapt.optim.optimizer_state.OptimizerState`
(``swap_dir`` of :class:`hvd_adapt.DistributedOptimizer`; docs/optimizer-state-on-disk.md)."""
from .disk_state import DiskState, Outcome
from .io import SwapError

__all__ = ["DiskState", "Outcome", "SwapError"]
