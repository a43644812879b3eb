"""The one piece of process-wide state hvd_adapt keeps: :data:`CONTEXT`.

Everything a process must remember between calls that are not made on one
object lives on this one explicit object, instead of counters and registries
spread over modules: the State that epoch loops consult, the CPU thread
share, the state handlers a script registered, and the objects whose use
makes collectives (which a State must carry).
"""
import weakref


class RuntimeContext:
    """What this process remembers across calls; see the attributes."""

    def __init__(self):
        #: The most recent :class:`hvd_adapt.State` (set by ``State()`` and ``run``).
        self.state = None
        #: torch's thread count before hvd_adapt first changed it, or None.
        self.thread_ceiling = None
        #: The thread count hvd_adapt set last: a different one now is the script's choice.
        self.threads_set = None
        #: ``(value_type, handler_cls)`` pairs from ``register_handler``, newest first.
        self.handlers = []
        #: Objects whose use makes collectives (distributed optimizers, autoscaling
        #: loaders): a worker joining a job syncs them only if the State carries them.
        self.collective_objects = weakref.WeakSet()
        #: The :class:`~hvd_adapt._runtime.watchdog.Beacon` this worker writes for its
        #: watchdog (an elastic Gloo worker), or None: held here for the worker's life (its
        #: heartbeat thread beats while the Beacon lives).
        self.watchdog = None
        #: True while ``hvd_adapt.run`` runs the training function.
        self.in_run = False
        self._hooked_params = None

    @property
    def hooked_params(self):
        """Parameter -> weak reference to the distributed optimizer averaging it: two live
        optimizers over one parameter would average its gradient twice."""
        if self._hooked_params is None:
            # Keys by identity (a tensor's == compares elements); torch is
            # loaded only once this is needed.
            from torch.utils.weak import WeakIdKeyDictionary
            self._hooked_params = WeakIdKeyDictionary()
        return self._hooked_params


CONTEXT = RuntimeContext()
