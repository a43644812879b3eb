"""scipy's own BLAS at one thread, so that its threads never spin beside training.

OpenBLAS threads busy-wait for about 0.1 s when they start. Only rank 0 uses
scipy (to fit the throughput model, 7 parameters: threads gain nothing), but
a pool that starts mid-training takes a core from the steps around it and
spoils their timing, which the next fit reads: on digits, 40 ms steps among
1 ms ones, and an adaptive run twice as long. A pool starts when scipy's
BLAS is loaded, when its thread count is changed after a fork (MPI_Init of a
single process forks once), and at the first BLAS call after that fork.
Loaded with OPENBLAS_NUM_THREADS=1 it starts none; loaded already, it is
capped while its pool still runs (no spin), before Horovod's fork. numpy's
and torch's pools are left alone.
"""
import functools
import os
import sys


def _scipy_blas():
    import scipy
    from threadpoolctl import ThreadpoolController
    home = os.path.dirname(scipy.__file__)
    return [lib for lib in ThreadpoolController().lib_controllers
            if lib.user_api == "blas" and lib.filepath.startswith((home + os.sep, home + ".libs"))]


def cap_loaded_scipy_blas():
    """Cap scipy's BLAS at one thread if something (scikit-learn, say) loaded it already."""
    if "scipy" not in sys.modules:
        return
    for lib in _scipy_blas():
        if lib.num_threads > 1:
            lib.set_num_threads(1)


@functools.cache
def import_scipy_optimize():
    """``scipy.optimize``, its BLAS loaded with one thread (or capped, if loaded before).

    The autoscaling rank calls it before training starts, so that loading
    scipy happens outside the steps the profile times. Other ranks never
    import scipy, so a worker joining a running job does not spend the job's
    pause on it.
    """
    saved = os.environ.get("OPENBLAS_NUM_THREADS")
    # Read by OpenBLAS once, when loaded; numpy's copy is loaded already.
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import scipy.optimize
    finally:
        if saved is None:
            del os.environ["OPENBLAS_NUM_THREADS"]
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = saved
    cap_loaded_scipy_blas()
    return scipy.optimize
