"""``run``: Horovod's elastic loop with hvd_adapt's resets.

Under ``horovodrun`` in elastic mode, ``run`` is ``hvd.elastic.run`` (with
the reset of ``_runtime/gloo.py``, where a new world's workers meet first): a
failed collective restores the last commit, a host change raises at
``commit()``, and either way Horovod re-forms the world and calls the
training function again. hvd_adapt adds that after every reset the rest of
the epoch is re-partitioned over the new world and the batch size is
decided again, whether or not Horovod skipped its sync, and that when the
function returns, an epoch loop it left early is committed as finished (and
checkpointed). Anywhere else (plain ``python``, ``mpirun``, non-elastic
``horovodrun``) it syncs once from rank 0 and calls the function. Under
``hvd-adapt-run``, an error or exit of the script's own that leaves the
function is said in one line for the supervisor (``_runtime/script_end.py``).
"""
import functools

import horovod.torch as hvd
from horovod.common.elastic import run_fn
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

from .._runtime import env, script_end
from .._runtime.context import CONTEXT
from .._runtime.gloo import init_world


def _reset():
    """Horovod's reset (``horovod.torch.elastic._reset``: shutdown, init), except that
    the new world's workers meet before Gloo's rendezvous, and that the peers' watchdogs
    learn of it (see ``_runtime/gloo.py``)."""
    last_rank = hvd.rank()
    hvd.shutdown()
    init_world(hvd.init, reset=True, last_rank=last_rank)


def run(func):
    """Decorate ``train(state, ...)`` so it survives resizes and failures.

    >>> import hvd_adapt
    >>> hvd_adapt.init()
    >>> state = hvd_adapt.State()
    >>> @hvd_adapt.run
    ... def train(state):
    ...     for epoch in hvd_adapt.remaining_epochs_until(2):
    ...         state.commit()
    ...     return state.epoch
    >>> train(state)
    2
    """
    @functools.wraps(func)
    def attempt(state, *args, **kwargs):
        CONTEXT.state = state
        try:
            state.resync_after_reset()
            result = func(state, *args, **kwargs)
        except (HorovodInternalError, HostsUpdatedInterrupt):
            raise       # a reset: Horovod's run_fn restores and meets again
        except BaseException as error:
            # The script's own end (its error, sys.exit, a drain's 143): said for
            # hvd-adapt-run, which must not relaunch it (_runtime/script_end.py).
            script_end.tell(env.rank(), env.size(), state.generation, error)
            raise
        state.finish_training_function()
        return result

    elastic = run_fn(attempt, _reset)

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        env.init()
        outer, CONTEXT.in_run = CONTEXT.in_run, True
        try:
            if env.is_elastic():
                return elastic(state, *args, **kwargs)
            state.sync()
            return attempt(state, *args, **kwargs)
        finally:
            CONTEXT.in_run = outer

    return wrapper
