"""Every private piece of Horovod hvd_adapt relies on, in one place.

hvd_adapt supports Horovod 0.28.x (``horovod>=0.28.1,<0.29``); each name
below says which Horovod 0.28.1 source it depends on, so that a new Horovod
release is checked here and nowhere else. Two parts:

- **the launcher**, as its processes and its key-value store show it: the
  mark of ``safe_shell_exec``'s middleman, the programs that carry a worker's
  command to its host, the scope the elastic rendezvous answers
  ``rank_and_size`` from. Standard library only: ``hvd-adapt-discover``
  (``scheduling/sessions.py``) and the worker's reset (``_runtime/gloo.py``)
  use them. (The driver's sentences, read for their meaning, are listed with
  it in ``scheduling/launcher_output.py``'s ``GIVING_UP``.)
- **the elastic State**: ``horovod.torch.elastic.TorchState``'s underscore
  attributes. Horovod is imported when they are first used; a State checks,
  when it is built (:func:`check_state`), the Horovod version and every name
  it needs, so that a missing one is an error naming it instead of an
  AttributeError deep inside a reset.
"""
# -- the launcher (standard library only) ------------------------------------------------
#: common/util/safe_shell_exec.py: the middleman between the driver and a command (a worker's
#: session, the discovery script) is a multiprocessing spawn child, started with this argument.
SPAWN_MARK = "--multiprocessing-fork"
#: runner/util/remote.py: the programs that carry a worker's command to its host (ssh), or
#: kubectl under the MPI Operator's kubexec.sh.
REMOTE_PROGRAMS = ("ssh", "kubectl")
#: runner/elastic/rendezvous.py: the key-value scope the elastic driver answers a worker's
#: ``rank_and_size`` from at each reset.
RANK_AND_SIZE_SCOPE = "rank_and_size"

# -- the elastic State (imports Horovod when used) ----------------------------------------
SUPPORTED = ((0, 28, 1), (0, 29, 0))

# Instance attributes made by Horovod's constructors:
#   horovod/common/elastic.py  State.__init__:       _bcast_object, _host_messages,
#                                                     _reset_callbacks
#   horovod/common/elastic.py  ObjectState.__init__: _saved_state
#   horovod/torch/elastic/state.py  TorchState.__init__: _handlers
_INSTANCE_ATTRIBUTES = ("_bcast_object", "_host_messages", "_reset_callbacks", "_saved_state",
                        "_handlers")
# Methods hvd_adapt overrides or calls, horovod/common/elastic.py.
_STATE_METHODS = ("on_reset", "reset", "on_hosts_updated", "check_host_updates",
                  "register_reset_callbacks")
# horovod/runner/elastic/worker.py: HostUpdateResult(IntFlag).
_HOST_UPDATE_FLAGS = ("no_update", "removed", "added")


def _version_tuple(text):
    return tuple(int("".join(ch for ch in part if ch.isdigit()) or 0)
                 for part in text.split(".")[:3])


def _check_import():
    import horovod
    import horovod.common.elastic as _common_elastic
    from horovod.runner.elastic.worker import HostUpdateResult
    version = _version_tuple(horovod.__version__)
    low, high = SUPPORTED
    if not low <= version < high:
        raise ImportError(f"hvd_adapt supports Horovod >=0.28.1,<0.29 (it uses Horovod's elastic "
                          f"internals, see {__name__}); found horovod {horovod.__version__}")
    missing = [name for name in _STATE_METHODS if not hasattr(_common_elastic.State, name)]
    missing += [f"HostUpdateResult.{flag}" for flag in _HOST_UPDATE_FLAGS
                if not hasattr(HostUpdateResult, flag)]
    if missing:
        raise ImportError(f"horovod {horovod.__version__} lacks {missing}, which hvd_adapt's "
                          f"elastic State needs (see {__name__})")


def check_state(state):
    """Raise ImportError unless this Horovod's version and classes are the ones hvd_adapt
    supports, and RuntimeError unless ``state`` (after ``TorchState.__init__``) has every
    Horovod attribute the accessors below use."""
    import horovod
    _check_import()
    missing = [name for name in _INSTANCE_ATTRIBUTES if not hasattr(state, name)]
    if missing:
        raise RuntimeError(f"horovod {horovod.__version__}'s elastic State lacks {missing}, "
                           f"which hvd_adapt needs (see {__name__})")


def saved_values(state):
    """The plain values of the last save, by name (``ObjectState._saved_state``)."""
    return state._saved_state


def set_saved_values(state, values):
    state._saved_state = values


def handlers(state):
    """The name -> StateHandler dict (``TorchState._handlers``)."""
    return state._handlers


def use_object_broadcast(state, broadcast):
    """Make ``ObjectState.sync`` broadcast plain values with ``broadcast(obj)``
    (``ObjectState._bcast_object``)."""
    state._bcast_object = broadcast


def take_host_updates(state):
    """``(removed, added)``, two bools, for every host update the driver sent since the last
    call (``State._host_messages``, filled by ``on_hosts_updated`` on the notification
    thread, of ``(timestamp, HostUpdateResult)`` pairs), or None when there was none.

    Every message counts, whatever its timestamp: the driver sends one only
    when the host assignment changed (``ElasticDriver._notify_workers_host_changes``),
    and stamps it in whole seconds, so Horovod's own ``timestamp > last``
    test dropped the second of two changes within one second.
    """
    from horovod.runner.elastic.worker import HostUpdateResult
    messages = state._host_messages
    received, update = False, HostUpdateResult.no_update
    while not messages.empty():
        _, result = messages.get()
        received, update = True, update | result
    if not received:
        return None
    return bool(update & HostUpdateResult.removed), bool(update & HostUpdateResult.added)


def reset_keeping_host_updates(state):
    """What ``State.on_reset`` does, except that it keeps the host-update queue.

    Horovod's ``on_reset`` replaces ``_host_messages`` with a new queue, so an
    update the driver sent while the workers were resetting (a host added
    during a resize) was dropped, and the new host idled until the next
    discovery change. The queue is a ``queue.Queue``, safe to keep while the
    notification thread adds to it.
    """
    state.reset()
    for callback in state._reset_callbacks:
        callback()
