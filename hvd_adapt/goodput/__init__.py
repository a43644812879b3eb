"""Goodput :mod:`.model` and :mod:`.fit`, numpy and scipy only (no torch, no Horovod).

A scheduler can import this package alone to ask what a profiled job would
gain from more replicas; ``import hvd_adapt.goodput`` loads neither torch nor
Horovod.
"""
from .fit import fit_loss, fit_perf_params
from .model import GoodputFunction, GradParams, PerfParams

__all__ = ["GoodputFunction", "GradParams", "PerfParams", "fit_perf_params", "fit_loss"]
