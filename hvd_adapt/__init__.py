"""hvd_adapt: adaptive, elastic PyTorch training on Horovod.

Elastic sampling, accumulators, goodput-optimal batch sizes and learning-rate
scaling, all carried by one Horovod elastic State. See README.md.
"""
from .accumulator import Accumulator
from .data import AdaptiveDataLoader, ElasticSampler
from .elastic import Drain, install_sigterm_drain, run
from .env import init
from .epoch import current_epoch, remaining_epochs_until
from .goodput import GoodputFunction, GradParams, PerfParams, fit_perf_params
from .gns import GradientNoiseScale
from .memory import probe_max_local_bsz
from .optimizer import DistributedOptimizer
from .scaling_rules import AdamScale, AdaScale, LEGWScale, LinearScale, ScalingRule, SqrtScale
from .state import CheckpointError, State, register_handler

__version__ = "0.1.0"

__all__ = [
    "Accumulator", "AdaptiveDataLoader", "ElasticSampler", "Drain", "install_sigterm_drain",
    "run", "init", "current_epoch", "remaining_epochs_until", "GoodputFunction", "GradParams",
    "PerfParams", "fit_perf_params", "GradientNoiseScale", "probe_max_local_bsz",
    "DistributedOptimizer", "AdamScale", "AdaScale", "LEGWScale", "LinearScale", "ScalingRule",
    "SqrtScale", "CheckpointError", "State", "register_handler",
]
