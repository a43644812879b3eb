"""hvd_adapt: adaptive, elastic PyTorch training on Horovod.

Elastic sampling, accumulators, goodput-optimal batch sizes and learning-rate
scaling, all carried by one Horovod elastic State. See README.md.

Public names load lazily (PEP 562): ``import hvd_adapt`` loads neither torch
nor Horovod, and ``import hvd_adapt.goodput`` stays numpy/scipy only, so a
scheduler can use the goodput model without a training stack.
"""
import importlib

__version__ = "0.2.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "Accumulator": "hvd_adapt.accumulator",
    "AccumulatorMismatchError": "hvd_adapt.accumulator",
    "AdaptiveDataLoader": "hvd_adapt.data.loader",
    "ElasticSampler": "hvd_adapt.data.sampler",
    "Controller": "hvd_adapt.autoscale.controller",
    "AutoscalePolicy": "hvd_adapt.autoscale.policy",
    "StepProfile": "hvd_adapt.autoscale.profile",
    "DistributedOptimizer": "hvd_adapt.optim.distributed",
    "AbandonedBackwardError": "hvd_adapt.optim.exchange",
    "GradientNoiseScale": "hvd_adapt.optim.noise",
    "ScalingRule": "hvd_adapt.optim.scaling_rules",
    "AdaScale": "hvd_adapt.optim.scaling_rules",
    "AdamScale": "hvd_adapt.optim.scaling_rules",
    "LinearScale": "hvd_adapt.optim.scaling_rules",
    "SqrtScale": "hvd_adapt.optim.scaling_rules",
    "LEGWScale": "hvd_adapt.optim.scaling_rules",
    "GoodputFunction": "hvd_adapt.goodput",
    "GradParams": "hvd_adapt.goodput",
    "PerfParams": "hvd_adapt.goodput",
    "fit_perf_params": "hvd_adapt.goodput",
    "State": "hvd_adapt.elastic.state",
    "CheckpointError": "hvd_adapt.elastic.checkpoint",
    "CommitCopyError": "hvd_adapt.elastic.commit_copies",
    "register_handler": "hvd_adapt.elastic.handlers",
    "run": "hvd_adapt.elastic.run",
    "Drain": "hvd_adapt.elastic.drain",
    "install_sigterm_drain": "hvd_adapt.elastic.drain",
    "remaining_epochs_until": "hvd_adapt.elastic.epoch",
    "current_epoch": "hvd_adapt.elastic.epoch",
    "init": "hvd_adapt._runtime.env",
    "probe_max_local_bsz": "hvd_adapt.autoscale.memory",
}
# Public modules under a short name: hvd_adapt.env.rank(), hvd_adapt.env.size(), ...
_MODULES = {"env": "hvd_adapt._runtime.env"}

__all__ = sorted(_EXPORTS) + sorted(_MODULES)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    else:
        raise AttributeError(f"module 'hvd_adapt' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
