"""hvd_adapt.State: one Horovod elastic state for everything a resize must carry.

It is a ``horovod.torch.elastic.TorchState`` (plain attributes work as in
Horovod) whose values are carried by the handlers of ``handlers.py``: models
and torch optimizers, GradScalers, learning-rate schedulers, and hvd_adapt's
own objects, which say themselves how they sync and what a reset means to
them. The State adds what Horovod's lacks:

- a sync is a commit: afterwards every rank's restore point is the state it
  synced to, so a failure right after a worker joined (or after a restart
  from a checkpoint) never sends anyone back to a freshly built model;
- one vote per commit (drain requests, a failed checkpoint write, host
  changes), so every rank acts on it at that same commit;
- accumulator totals summed at every commit and before any resize;
- commits that wait for the end of an accumulation cycle;
- host updates that are never dropped (two within a second, or one during a
  reset);
- whole-job checkpoints of the last commit, numbered by generation, that a
  restart resumes from the newest any rank can read.
"""
import gc
import logging
import pickle
import time
import weakref

import torch
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.torch.elastic.state import TorchState

from .._checks import check_bool
from .._runtime import collective, env
from .._runtime import horovod_internals as internals
from .._runtime.context import CONTEXT
from .._runtime.threads import share_cpu_threads
from . import agreement
from .commit_copies import FORWARD, STEP, CommitCopies
from .drain import Drain
from .epoch import EpochCounter, check_epoch
from .handlers import ModelHandler, handler_for, snapshot
from .participant import Participant
from .snapshot_budget import DEFAULT_SHARE, SnapshotBudget
from .state_checkpoints import StateCheckpoints

log = logging.getLogger(__name__)


class State(TorchState):
    """Everything training must carry across resizes, failures and restarts.

    Pass the model, the optimizer, loaders, accumulators, GradScalers,
    schedulers and any plain values by name; read them back as attributes.
    ``snapshot_to_host`` (default: True where CUDA is available) keeps each
    commit's copy of GPU tensors in page-locked host memory instead of a
    second copy on the GPU. ``broadcast_buffers`` (default True, as in DDP):
    every commit gives each model's buffers (BatchNorm's running statistics)
    rank 0's values, so replicas evaluate and checkpoint alike; use
    ``hvd.SyncBatchNorm`` where statistics over the whole batch matter, and
    False to keep each replica's own. ``snapshot_budget`` (default 0.03): the
    share of training time that commits' snapshots may take; None snapshots at
    every commit (see :meth:`commit`).
    Everything whose state must be the same on every replica belongs here:
    a worker that joins a job receives only what the State carries, and
    hvd_adapt refuses to run (on every rank, with an error naming it) when a
    :class:`hvd_adapt.DistributedOptimizer` or an autoscaling loader is
    missing from it.

    >>> import hvd_adapt, torch
    >>> hvd_adapt.init()
    >>> model = torch.nn.Linear(2, 1)
    >>> state = hvd_adapt.State(model=model, best_accuracy=0.0)
    >>> state.best_accuracy = 0.5
    >>> state.commit()                 # where resizes take effect
    >>> state.best_accuracy = 0.9
    >>> state.restore()
    >>> state.best_accuracy
    0.5

    ``commit()`` is a no-op in the middle of a gradient-accumulation cycle:
    accumulated gradients are not part of the state, so commits take effect
    at optimizer steps. A :class:`hvd_adapt.DistributedOptimizer` trains on
    the loader it accumulates for: the autoscaled loader if there is one,
    else the first loader given.
    """

    def __init__(self, model=None, optimizer=None, snapshot_to_host=None, broadcast_buffers=True,
                 snapshot_budget=DEFAULT_SHARE, **kwargs):
        counter = EpochCounter()
        if "epoch" in kwargs:
            # Horovod's examples keep the epoch as a plain value (State(..., epoch=0)); here
            # it is the epoch counter's, which epoch loops and checkpoints share.
            counter.epoch = check_epoch(kwargs.pop("epoch"))
        for name in kwargs:
            _check_name(name)
        kwargs.update(model=model, optimizer=optimizer)
        kwargs["epochs"] = counter
        ours = {}
        for name in list(kwargs):
            handler = _handler(name, kwargs[name])
            if handler is not None:
                ours[name] = handler
                del kwargs[name]
        if snapshot_to_host is None:
            snapshot_to_host = torch.cuda.is_available()
        check_bool("broadcast_buffers", broadcast_buffers)
        self._budget = SnapshotBudget(snapshot_budget)
        self._steps = _StepMark()          # whether an optimizer stepped since the last commit
        self._realign = False              # a snapshot outside a commit: the next one snapshots
        self._copies = CommitCopies()
        self._copies.begin(defer=False)
        for name, handler in ours.items():
            # Commits of GPU tensors to page-locked host memory, not a second GPU copy.
            handler.to_host = bool(snapshot_to_host)
            handler.name = name
            handler.copies = self._copies
            if broadcast_buffers and isinstance(handler, ModelHandler):
                handler.buffers_name = f"hvd_adapt.buffers.{name}"
            handler.save()
            _wait_for_copies_before_writes(handler.value, self._copies)
            if isinstance(handler.value, torch.optim.Optimizer):
                handler.value.register_step_pre_hook(self._steps.hook())
        self._copies.launch()
        model, optimizer = kwargs.pop("model", None), kwargs.pop("optimizer", None)
        super().__init__(model=model, optimizer=optimizer, **kwargs)
        internals.check_state(self)
        saved = {name: snapshot(value) for name, value in internals.saved_values(self).items()}
        # Horovod's own object broadcast costs a background-thread round trip
        # even in a world of one; ours returns at once there.
        internals.use_object_broadcast(self, collective.broadcast_object)
        for name, handler in ours.items():
            # TorchState always files model/optimizer; ours supersede them.
            saved.pop(name, None)
            setattr(self, name, handler.value)
        internals.set_saved_values(self, saved)
        internals.handlers(self).update(ours)
        values = [h.value for h in ours.values()]
        # Checked at every commit; participants are never replaced (they load in place).
        self._participants = [v for v in values if isinstance(v, Participant)]
        for value in self._participants:
            value.join(values)
        # Participants settled together at a commit, one group per settle method: one
        # collective for all the accumulators, say, in the order the State was given them.
        self._settle_groups = {}
        for value in self._participants:
            self._settle_groups.setdefault(type(value).settle.__func__, []).append(value)
        self._resync_pending = False
        self._holds_job = False        # passed a sync: carries the running job's state
        self._skip_next_sync = False   # load_checkpoint synced the world already
        self._drain = None
        self._checkpoints = StateCheckpoints(self, self._participants)
        self.register_reset_callbacks([self._after_reset])
        CONTEXT.state = self
        if env.initialized():
            # For scripts that called hvd.init() rather than hvd_adapt.init().
            share_cpu_threads(env.local_size(), env.local_rank())

    @property
    def epoch(self):
        """The current epoch: that of ``remaining_epochs_until``, or the one a Horovod-style
        loop assigns (``for state.epoch in range(state.epoch, epochs)``). Committed, restored,
        synced and checkpointed with the State."""
        return self.epochs.epoch

    @epoch.setter
    def epoch(self, value):
        self.epochs.epoch = check_epoch(value)

    @property
    def generation(self):
        """Commits the job has made since it started (restarts from a checkpoint included):
        the number a checkpoint of the last commit records."""
        return self.epochs.commits

    @property
    def snapshot_generation(self):
        """The :attr:`generation` that a failure (a restore) returns to: that of the last
        commit that snapshotted."""
        return internals.handlers(self)["epochs"].saved_state()["commits"]

    def at_optim_boundary(self):
        """False while any loader is between the steps of an accumulation cycle."""
        return all(value.at_commit_point() for value in self._participants)

    def set_drain(self, drain):
        """Check ``drain`` (a :class:`hvd_adapt.Drain`) at every commit."""
        self._drain = drain

    # -- commits -------------------------------------------------------------------------
    def commit(self):
        """Collective: save the state, then act on what the replicas voted at this commit.

        Pending accumulator updates are summed over replicas first (one
        collective). The vote (one more) is on: a SIGTERM drain requested on
        any replica (every replica stops here, rank 0 writes the checkpoint,
        all exit 143); a background checkpoint write that failed on rank 0
        (every rank raises :class:`hvd_adapt.CheckpointError` with its cause,
        so an elastic job ends instead of blacklisting a healthy host); a
        host change reported by the driver (``HostsUpdatedInterrupt``, where
        the resize takes effect).

        Then it snapshots (every value copied, the restore point of a failure)
        as often as the ``snapshot_budget`` given to the State allows: so a
        script may commit after every batch. A commit that skips its snapshot
        still votes and settles; a failure then returns every rank to the
        last snapshot, one step's consistent state (parameters, optimizer,
        loader positions, accumulators, counters) at most about
        ``cost / budget`` seconds of training old (about a second for a
        snapshot of 30 ms and the default 3%). Every rank snapshots at the
        same commits, and always at the end of an epoch, before a drain or
        a resize, and for a checkpoint (:meth:`save_checkpoint` snapshots
        where the last commit did not). :attr:`snapshot_generation` says
        which commit a failure returns to.
        """
        self._commit(raise_host_updates=True)

    def end_epoch(self):
        """Collective: move the epoch counter on and commit (the epoch loop's commit between
        two epochs)."""
        self.epochs.epoch += 1
        self._commit(raise_host_updates=True, epoch_end=True)

    def _commit(self, raise_host_updates, epoch_end=False, needs_snapshot=False):
        if not self.at_optim_boundary():
            return
        self._settle()
        # Every model's buffers (a model's and its EMA's BatchNorm statistics) in one call:
        # small ones travel packed, one broadcast per dtype.
        collective.broadcast_tensors(
            [pair for handler in internals.handlers(self).values()
             if isinstance(handler, ModelHandler) for pair in handler.buffers_to_align()],
            root_rank=0)
        self.epochs.commits += 1
        if epoch_end:
            self.epochs.epoch_end_commits = self.epochs.commits
        failure = self._checkpoints.failure()
        self._budget.charge(self._copies.take_seconds())
        votes = agreement.vote(self._drain is not None and self._drain.requested, failure,
                               self._host_updates(), self._budget.wants_snapshot(),
                               needs_snapshot or epoch_end or self._realign)
        self._steps.stepped = self._realign = False
        if not votes.snapshot and log.isEnabledFor(logging.DEBUG) \
                and self.snapshot_generation == self.generation - 1:
            log.debug("commit %d keeps the snapshot of commit %d: snapshots stay within %s "
                      "of the training time (State(snapshot_budget=...))", self.generation,
                      self.snapshot_generation, self._budget.share)
        if votes.snapshot:
            start = time.perf_counter()
            self._save(defer=True)
            self._budget.charge(time.perf_counter() - start)
        if votes.checkpoint_failed:
            self._checkpoints.fail_together("hvd_adapt.commit.checkpoint_failed")
        if votes.drain:
            (self._drain or Drain()).stop(self)
        if votes.hosts_updated and raise_host_updates:
            raise HostsUpdatedInterrupt(votes.removed_only)

    def _settle(self):
        for settle, participants in self._settle_groups.items():
            settle(type(participants[0]), participants)

    def _host_updates(self):
        return internals.take_host_updates(self) if env.is_elastic() else None

    def check_host_updates(self):
        """Collective: raise ``HostsUpdatedInterrupt`` if the driver reported a host change.

        Outside elastic mode no driver sends updates and it returns at once,
        so a script can call it after every batch and commit less often (as
        Horovod's examples do). Before it raises, pending accumulator
        updates are summed over replicas, so a replica about to be removed
        leaves its counts behind. Like a commit, it does nothing between
        the steps of an accumulation cycle: a resize takes effect at an
        optimizer step.
        """
        if not env.is_elastic() or not self.at_optim_boundary():
            return
        votes = agreement.vote(False, None, self._host_updates())
        if votes.hosts_updated:
            self._settle()
            raise HostsUpdatedInterrupt(votes.removed_only)

    def save(self):
        """Snapshot every value now: handlers' into their buffers, plain values as copies
        (Horovod keeps plain values by reference, so an in-place change survived a
        restore)."""
        self._save(defer=False)

    def _save(self, defer):
        # defer (a commit): the parameters' and optimizer state's copies are made while the
        # next forward runs (see commit_copies.py): the end of a forward of each model, each
        # optimizer's step, each load_state_dict of them, and anything here that reads the
        # snapshot or writes the live state wait for them and check that no source was
        # written before its copy was made (CommitCopyError otherwise). Other saves (at a
        # sync, a loaded checkpoint) are followed by writes to the live state: made at once.
        self._copies.begin(step_written=self._step_written(), defer=defer)
        try:
            super().save()
        finally:
            self._copies.launch()
        internals.set_saved_values(self, {name: snapshot(value) for name, value
                                          in internals.saved_values(self).items()})

    def _step_written(self):
        """Storage addresses that only an optimizer step writes: the parameters and state of
        every optimizer the State carries."""
        written = set()
        for handler in internals.handlers(self).values():
            if isinstance(handler.value, torch.optim.Optimizer):
                written.update(p.data_ptr() for group in handler.value.param_groups
                               for p in group["params"])
                written.update(handler.deferred())
        return written

    def wait_for_commit(self):
        """Block until the last commit's copies are made (they run during the next forward),
        and check them: call it before changing a parameter or an optimizer's state by hand
        between a commit and the next forward's end (an optimizer step, ``load_state_dict``
        and the next commit wait by themselves)."""
        self._copies.wait()

    def restore(self):
        """Return every value to the last commit; plain values get copies of the snapshot."""
        self._copies.wait()
        super().restore()
        self._detach_plain_values()

    def _detach_plain_values(self):
        for name, value in internals.saved_values(self).items():
            setattr(self, name, snapshot(value))

    # -- syncs and resets ------------------------------------------------------------------
    def sync(self):
        """Collective: every value becomes rank 0's (parameters bitwise, optimizer state without
        a step), then is committed on every rank: a failure right after a sync restores to
        what was synced. Every loader decides its batch size again."""
        if env.is_elastic() and not CONTEXT.in_run:
            raise RuntimeError(
                "in an elastic job an hvd_adapt.State is synced by @hvd_adapt.run, not by "
                "@hvd.elastic.run or by hand: after a resize that Horovod lets survivors skip "
                "their sync, a joining worker and the survivors would wait in different "
                "collectives. Decorate the training function with @hvd_adapt.run")
        if self._skip_next_sync:
            self._skip_next_sync = False
            return
        self._sync_world(full=True)

    def _sync_world(self, full, wanted_checkpoint=None, failed=None):
        # Every rank of a new world passes here once: through sync() where
        # Horovod syncs (a start, a joining worker, after a failure), through
        # resync_after_reset() where Horovod let a survivor skip its sync
        # (hosts only removed), through load_checkpoint() before training. A
        # removal and an addition close together give several at once:
        # survivors that saw only the removal and a new worker that must be
        # synced in full. They first agree, in one collective, on what the
        # world does (agreement.at_sync), so all run the same collectives
        # after it, and a new worker's checkpoint never wins over the state
        # the survivors hold. A new worker arrives only after its whole
        # start-up; the others wait for it without spinning.
        self._copies.wait()
        self._check_carried()
        generation, unreadable = agreement.NO_FILE, None
        if failed is not None:
            generation, unreadable = agreement.UNREADABLE, str(failed)
        elif wanted_checkpoint is not None:
            generation, unreadable = self._checkpoints.newest_generation(wanted_checkpoint[0])
        plan = agreement.at_sync(full, self._holds_job and wanted_checkpoint is None,
                                 generation, unreadable)
        if plan.source_rank is not None:
            self._checkpoints.load_from(plan.source_rank, *wanted_checkpoint)
        if plan.full:
            super().sync()
            self._detach_plain_values()
        else:
            for handler in internals.handlers(self).values():
                if getattr(handler, "light", False):
                    handler.sync()
        self.save()
        self._holds_job = True
        self._resync_pending = False

    def _check_carried(self):
        # A worker joining a job receives only what the State carries; a
        # distributed optimizer or an autoscaling loader outside it would
        # make collectives the joining worker alone runs (a hang). Every rank
        # builds the same objects, so every rank raises here alike.
        if env.size() == 1 and not env.is_elastic():
            return
        carried = {id(value) for value in self._participants}

        def outside():
            return [obj for obj in CONTEXT.collective_objects if id(obj) not in carried]

        if outside():
            gc.collect()    # objects a script dropped may only await collection
        left = outside()
        if left:
            kinds = ", ".join(sorted({type(obj).__name__ for obj in left}))
            raise RuntimeError(
                f"the hvd_adapt.State does not carry every {kinds} this script made: pass each "
                "to hvd_adapt.State(...) by name. A worker that joins the job is synced only "
                "with what the State carries, and would then run collectives the others do "
                "not (a hang)")

    def _after_reset(self):
        # After a HostsUpdatedInterrupt with skip_sync, Horovod does not sync;
        # resync_after_reset() still re-syncs the light values (cheap) so that
        # positions, totals and batch-size choices come from one rank.
        # Collectives are not allowed here: a new worker does not pass
        # through this callback.
        self._resync_pending = True
        self._skip_next_sync = False
        share_cpu_threads(env.local_size(), env.local_rank())
        for value in self._participants:
            value.on_reset()

    def on_reset(self):
        """Horovod's reset, keeping host updates the driver sent during it (Horovod drops them,
        and an added host then idled until the next change)."""
        internals.reset_keeping_host_updates(self)

    def resync_after_reset(self):
        """Collective, called by ``run`` at each attempt: after a reset that Horovod did not
        sync, make the light values (positions, totals, choices) rank 0's, or all values
        where a worker that joined the new world needs a full sync."""
        if self._resync_pending:
            self._sync_world(full=False)

    def finish_training_function(self):
        """Called by ``run`` when the training function returned: an epoch loop it left with
        ``break`` or ``return`` counts its epoch as finished, and that is committed, and
        checkpointed where the loop had a checkpoint path. (Host changes reported now are
        left to the next job: this one is ending.)"""
        path = self.epochs.finish_left_epoch()
        if path is False:
            return
        self._commit(raise_host_updates=False, needs_snapshot=True)
        if path is not None:
            self.save_checkpoint(path, background=True)
            self.settle_checkpoint()

    # -- whole-job checkpoints (state_checkpoints.py) -----------------------------------
    def save_checkpoint(self, path, background=False):
        """Write the state of the last commit to ``path`` on rank 0 (others do nothing).

        Call it after ``commit()``. The file is written beside ``path`` (a
        private temporary file) and renamed over it, so a job killed while
        writing leaves the old checkpoint intact; it records the job's
        :attr:`generation`, and a file that holds a later generation (written
        by a newer rank 0) is never replaced. With ``background=True`` it
        returns once the state is serialised to memory (one copy of it) and
        the file is written and fsynced on a thread while training goes on;
        the next save, :meth:`wait_for_checkpoint` and the interpreter's exit
        wait for it. A failed write raises :class:`hvd_adapt.CheckpointError`
        there, and at the next commit on every rank.

        Where the last commit skipped its snapshot (see :meth:`commit`), each
        rank that calls it snapshots first, so the file holds the last commit
        all the same: call it on every rank, as the examples do. (Where rank 0
        alone calls it, its restore point is ahead of the others' until the
        next commit, which then snapshots on every rank; a failure's restore
        is followed by a sync to rank 0's, so only a ``restore()`` by hand in
        between would see them differ.) Called after an optimizer step that
        no commit followed, it writes the last snapshot, and says so.
        """
        if self.snapshot_generation != self.generation:
            if self._steps.stepped:
                log.warning("save_checkpoint(%r) after an optimizer step that no commit "
                            "followed writes the last snapshot (generation %d): call it "
                            "right after state.commit()", path, self.snapshot_generation)
            else:
                self.save()
                self._realign = True
        self._checkpoints.save(path, background)

    def refresh_checkpoint(self, path):
        """Rank 0, where an epoch loop with a checkpoint starts (also after every reset): if
        ``path`` holds an older generation than the last epoch's end that was committed (the
        worker writing it died, or rank 0 moved to a host whose folder holds an older one),
        write the last commit there now, in the background."""
        self._checkpoints.refresh(path)

    def wait_for_checkpoint(self):
        """Block until a background checkpoint write is on disk (rank 0; a no-op elsewhere)."""
        self._checkpoints.wait()

    def settle_checkpoint(self):
        """Collective: wait for rank 0's background checkpoint write; if it failed, raise
        :class:`hvd_adapt.CheckpointError` with its cause on every rank."""
        self._checkpoints.fail_together("hvd_adapt.checkpoint_written")

    def load_checkpoint(self, path, trusted=False):
        """Collective: resume from the newest checkpoint at ``path`` any rank can read, or sync
        as at a start where there is none; returns whether the job runs from a checkpoint,
        the same answer on every rank.

        Call it on every rank at the same point, before training (``run``
        then skips its first sync, which this was). The ranks compare the
        generations of the files they see at ``path`` (a shared directory,
        or one per host): the newest is read by the rank that holds it (and
        sent to rank 0 where that is another rank), and every rank starts
        from it, committed. A worker that joins a running job (its script
        calls this too) meets the survivors' sync here: the state they hold
        wins over any file, and it returns what the job answered at its start.

        The file is read with ``torch.load(weights_only=True)``: tensors,
        numpy arrays and plain values (what the State itself writes) load;
        a file holding other pickled objects is refused, since unpickling
        them runs code. ``trusted=True`` loads any file: only for files you
        wrote (a State carrying values of your own classes needs it). Raises
        :class:`hvd_adapt.CheckpointError` on every rank, naming the file,
        if it is corrupt or was written for a State with other contents.
        """
        # No collective before the sync's own: a worker joining a running job
        # meets the survivors' sync here. A write of this process's that
        # failed is reported through the sync's agreement instead.
        self._sync_world(full=True, wanted_checkpoint=(path, trusted),
                         failed=self._checkpoints.own_write_error())
        self._skip_next_sync = True
        return self.epochs.resumed


def _check_name(name):
    """A State value's name must not hide the State's own attributes (Horovod's ObjectState
    would silently replace a method by the value)."""
    if name == "epochs":
        raise ValueError("State reserves the name 'epochs' for its epoch counter (state.epoch "
                         "is the epoch); call that value something else")
    if name.startswith("_") or hasattr(State, name):
        raise ValueError(f"State value {name!r} would hide State.{name}; call that value "
                         "something else")


def _handler(name, value):
    """The handler carrying ``value`` (None: a plain value), or an error naming ``name`` and
    the fix where it can be neither saved through ``state_dict()`` nor pickled."""
    try:
        handler = handler_for(value)
    except Exception as e:
        raise TypeError(f"State value {name!r} ({type(value).__name__}) cannot be saved: "
                        f"{type(e).__name__}: {e}") from e
    if handler is not None or isinstance(value, (int, float, bool, str, type(None))):
        return handler
    try:
        # Plain values are copied at every commit, sent to joining workers and written to
        # checkpoints: all three pickle them.
        pickle.dumps(value)
    except Exception as e:
        kind = type(value).__name__
        raise TypeError(
            f"State value {name!r} ({kind}) can be neither pickled ({type(e).__name__}: {e}) "
            f"nor saved through state_dict()/load_state_dict(): give {kind} those two methods, "
            f"or register a handler for it (hvd_adapt.register_handler({kind}, ...)), or keep "
            "it out of the State and rebuild it from values the State carries") from e
    return None


class _StepMark:
    """Whether an optimizer a State carries stepped since its last commit."""

    def __init__(self):
        self.stepped = False

    def hook(self):
        """An optimizer step pre-hook that sets :attr:`stepped` (holding this mark weakly)."""
        ref = weakref.ref(self)

        def hook(*_):
            found = ref()
            if found is not None:
                found.stepped = True
        return hook


def _wait_for_copies_before_writes(value, copies):
    """Hooks that wait for the commit's copies where ``value``'s copied tensors may be written
    next: an optimizer's step, a module's forward end (an EMA's update or a step comes after
    it), either's load_state_dict. The hooks hold the copies weakly (a State that is gone
    leaves hooks that do nothing)."""
    ref = weakref.ref(copies)

    def wait_on_device(until):
        def hook(*_):
            found = ref()
            if found is not None and found.pending:
                found.wait(until=until, host=False)
        return hook

    def wait(*_):
        found = ref()
        if found is not None and found.pending:
            found.wait()

    if isinstance(value, torch.optim.Optimizer):
        value.register_step_pre_hook(wait_on_device(STEP))
        value.register_load_state_dict_pre_hook(wait)
    elif isinstance(value, torch.nn.Module):
        value.register_forward_hook(wait_on_device(FORWARD))
        value.register_load_state_dict_pre_hook(wait)
