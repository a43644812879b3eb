"""Training workloads shared by the benchmarks: data made offline, a model, a recipe, a metric.

Each module defines one :class:`~.base.Workload` named ``WORKLOAD``;
``get(name)`` returns it. Nothing is downloaded: the digits come with
scikit-learn, the images and the text are generated from a seed.
"""
import importlib

NAMES = ("digits", "shapes", "markov_text")


def get(name):
    """The workload called ``name``; ValueError naming the known ones otherwise."""
    if name not in NAMES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{name}").WORKLOAD
