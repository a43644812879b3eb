"""The optimizer's state on disk (``swap_dir``; docs/optimizer-state-on-disk.md), as DeepSpeed's
swapper: :mod:`.disk_state` (:class:`DiskState`, the on-disk ``OptimizerState``), :mod:`.files`
(each file's life), :mod:`.step` (a step's pipeline), :mod:`.layout`, :mod:`.io` (checked I/O)."""
from .disk_state import DiskState, Outcome
from .io import SwapError

__all__ = ["DiskState", "Outcome", "SwapError"]
