"""The distributed optimizer: :mod:`.distributed` (``DistributedOptimizer``),
:mod:`.backward_pass`, :mod:`.buckets`, :mod:`.exchange`, :mod:`.ledger` and
:mod:`.matching` (gradients averaged during backward), :mod:`.optimizer_state` (the one
interface to the wrapped optimizer's state, in memory; on disk in :mod:`hvd_adapt.swap`),
:mod:`.noise` (the gradient noise scale) and :mod:`.scaling_rules` (learning-rate rules)."""
