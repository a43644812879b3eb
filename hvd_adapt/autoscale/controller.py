"""The batch-size controller: the one object a loader and an optimizer share.

The loader reports each step it hands out and asks which local batch and
accumulation steps to plan with; the optimizer asks whether a batch ends an
accumulation cycle and which batch sizes to scale the learning rate for, and
reports the time spent averaging gradients. Neither reaches into the other.

When to decide (before the first batch, after a resize or restore, every
``decide_every`` optimizer steps) and how every replica adopts the same
choice (rank 0 decides, the others wait sleeping, then one broadcast) live
here; what to choose is the :class:`~hvd_adapt.autoscale.policy.AutoscalePolicy`'s.

>>> import hvd_adapt
>>> hvd_adapt.init()
>>> controller = Controller(init_batch_size=128)
>>> controller.local_bsz, controller.accumulation_steps   # one replica, no autoscaling
(128, 0)
"""
import logging
import math
import time

from .._runtime import collective, env
from .profile import StepProfile

log = logging.getLogger(__name__)

# The noise is measured on one optimizer step in this many, each measurement
# standing for the steps until the next: the smoothed estimate spans hundreds
# of steps, so sampling it loses little, and measuring every step cost a
# small transformer a tenth of its step at two replicas. With one replica and
# no accumulation there is no second gradient of the same weights to measure
# with, so the measured step is loaded as two half batches, an accumulation
# cycle of two. (Consecutive steps' gradients also differ by the weights'
# drift between them, which inflated tr(Sigma) by about 1 + lr*curvature.) A
# half batch costs little more than half a step.
#
# Several replicas split steps the same way while their world has timed one
# local batch size only, so that its first decision knows what a step's
# time owes to the batch: from one size the throughput model guesses, and
# the guess (larger batches nearly free) sent a compute-bound CNN at two
# replicas to twice its batch for a decision interval it then lost at its
# early target (benchmarks/RESULTS.md). Splitting costs no statistical
# efficiency, as the halves add up to the step's batch.
MEASURE_EVERY = 4
# Each half holds at least 2 samples: BatchNorm refuses a batch of one.
MIN_SPLIT_BSZ = 4


class Controller:
    """Current batch-size plan, step-time profile and decision protocol of one training loader.

    ``init_batch_size`` is B0, the global batch the learning rate was tuned
    for. Until :meth:`configure` gives it a policy, every world splits B0
    over its replicas and nothing is decided.
    """

    def __init__(self, init_batch_size):
        self.init_batch_size = init_batch_size
        self.policy = None
        self.epochs_by_progress = False
        self.profile = StepProfile()
        self._noise = None
        self._measuring = None
        self._choice = None
        self._micro = 0
        self._position = 0           # the batch just handed out: its place in its cycle
        self._split_first = None     # samples of a split step's first half, while it is open
        self._split_micro_bsz = None  # set on the second half, until the next batch
        self._times_halves = False   # rank 0's word: this world splits steps to time a half
        self._needs_decision = True
        self._steps_since_decision = 0   # the same on every rank: the splits' phase
        self._optim_steps = 0            # the same on every rank: which steps are measured
        self._epoch_progress_start = 0.0
        self._epoch_verdict = None   # handle of rank 0's last epoch-end verdict in flight
        self._abandon_listeners = []
        self._hints = None           # (path, max replicas) of the published speed-up curve
        self._hints_error = None     # the last error publishing them, logged once

    def configure(self, policy, epochs_by_progress=False, hints_path=None, hints_max_replicas=64):
        """Autoscale with ``policy``; decide again before the next batch. With ``hints_path``,
        rank 0 publishes the speed-up curve for 1..``hints_max_replicas`` replicas there
        after every decision (:mod:`hvd_adapt.scheduling.hints`)."""
        self.policy = policy
        self.epochs_by_progress = epochs_by_progress
        self._hints = None if hints_path is None else (hints_path, hints_max_replicas)
        self._needs_decision = True

    @property
    def autoscaling(self):
        """True once a policy chooses the batch size."""
        return self.policy is not None

    def attach_noise_scale(self, noise_scale, measuring=None):
        """Read gradient statistics and training progress from ``noise_scale`` (the
        optimizer's :class:`~hvd_adapt.optim.noise.GradientNoiseScale`); ``measuring()``
        says whether the optimizer measures it now (then one replica splits steps)."""
        self._noise = noise_scale
        self._measuring = measuring

    @property
    def has_noise_scale(self):
        """True once an optimizer attached its noise scale."""
        return self._noise is not None

    # -- the current plan --------------------------------------------------------------
    def _default(self, num_replicas):
        if self.policy is None:
            return math.ceil(self.init_batch_size / num_replicas), 0
        return self.policy.default(num_replicas)

    def _current(self):
        size = env.size()
        if self._choice is None or self._choice[2] != size:
            return self._default(size)
        return self._choice[:2]

    @property
    def local_bsz(self):
        """Samples each replica loads per step (the atomic batch size)."""
        return self._current()[0]

    @property
    def accumulation_steps(self):
        """Steps that only accumulate gradients before each optimizer step."""
        return self._current()[1]

    @property
    def batch_size(self):
        """Global samples per optimizer step: size * local bsz * (accumulation steps + 1)."""
        local, accum = self._current()
        return env.size() * local * (accum + 1)

    @property
    def choice(self):
        """``(local_bsz, accumulation_steps, num_replicas)`` last decided, or None before any
        decision; ``num_replicas`` is the world size it was made for."""
        return self._choice

    # -- accumulation cycles -----------------------------------------------------------
    def start_cycles(self):
        """A new pass over the data starts: its first batch opens a cycle."""
        self._micro = self._position = 0
        self._split_first = self._split_micro_bsz = None

    def on_cycle_abandoned(self, callback):
        """Call ``callback()`` whenever a cycle is abandoned (the optimizer drops the
        micro-steps it accumulated)."""
        self._abandon_listeners.append(callback)

    def abandon_cycle(self):
        """The pass was left in the middle of an accumulation cycle: close it, and tell the
        listeners to drop what it accumulated."""
        self.start_cycles()
        for callback in self._abandon_listeners:
            callback()

    def next_micro_step(self, last_of_plan, split_half=None):
        """Account one batch handed out; ``last_of_plan`` closes the cycle early.
        ``split_half``: the batch's samples when it is half of a split step."""
        self._split_micro_bsz = None
        self._position = self._micro if split_half is None or self._split_first is not None \
            else 0
        if split_half is not None:
            if self._split_first is None:
                self._split_first, self._micro = split_half, 1
                return
            # Unequal halves weigh alike in the accumulated mean: the estimator's
            # micro-batch size is then their harmonic mean.
            first, self._split_first = self._split_first, None
            self._split_micro_bsz = 2.0 / (1.0 / first + 1.0 / split_half)
            self._micro = 0
            return
        accum = self.accumulation_steps
        self._micro = 0 if (self._micro == accum or last_of_plan) else self._micro + 1

    @property
    def split_micro_bsz(self):
        """After the second half of a split step (until the next batch): the micro-batch
        size its noise measurement stands for; None otherwise."""
        return self._split_micro_bsz

    def splits_steps(self):
        """True when steps are split for the noise measurement: one replica, no
        accumulation, a local batch of at least 4, and an optimizer measuring."""
        local, accum = self._current()
        return (env.size() == 1 and accum == 0 and local >= MIN_SPLIT_BSZ
                and self._measuring is not None and self._measuring())

    def times_halves(self):
        """True when several replicas split steps to time a half batch: rank 0 found
        one local batch size timed in this world at the last decision, and there is
        no accumulation (whose steps would time their own size)."""
        local, accum = self._current()
        return (self._times_halves and self.policy is not None and env.size() > 1
                and accum == 0 and local >= MIN_SPLIT_BSZ)

    def steps_to_split(self, num_steps):
        """Which of the next ``num_steps`` optimizer steps to load as two halves (offsets
        from the next one): one in ``MEASURE_EVERY``, counted from the last decision
        (which every rank made at the same step), while :meth:`splits_steps`, or
        until the next decision while :meth:`times_halves` (that one has timed both)."""
        if self.splits_steps():
            stop = num_steps
        elif self.times_halves():
            stop = min(num_steps, self.policy.decide_every - self._steps_since_decision)
        else:
            return range(0)
        return range((-self._steps_since_decision) % MEASURE_EVERY, stop, MEASURE_EVERY)

    def is_optim_step(self):
        """True when the batch just handed out ends an accumulation cycle."""
        return self._micro == 0

    def cycle_position(self):
        """How many batches of its accumulation cycle came before the one just handed out."""
        return self._position

    # -- deciding ----------------------------------------------------------------------
    def request_decision(self):
        """Decide again before the next batch (after a resize or restore)."""
        self._needs_decision = True

    @property
    def decision_due(self):
        """True when the next batch must wait for a decision."""
        return self._needs_decision

    def measure_due(self):
        """True when the optimizer step under way is one whose noise is measured: one in
        ``MEASURE_EVERY`` of the steps this loader handed out, a count in its state (synced,
        restored and checkpointed with it), so every rank agrees without a word."""
        return self._optim_steps % MEASURE_EVERY == 0

    def optim_step_done(self):
        """Count one optimizer step towards ``decide_every``."""
        self._steps_since_decision += 1
        self._optim_steps += 1
        if self.policy is not None and self._steps_since_decision >= self.policy.decide_every:
            self._needs_decision = True

    def decide(self):
        """Collective: every rank adopts rank 0's choice of (local bsz, accumulation steps)."""
        self._needs_decision = False
        self._steps_since_decision = 0
        if self.policy is None:
            return
        size = env.size()
        decision = None
        if env.rank() == 0:
            before = self._current()
            forced = self._choice is None or self._choice[2] != size
            conflict = self.policy.conflict(size) if forced else None
            if conflict is not None:
                # autoscale_batch_size refused these bounds in its own world; a
                # resize made them impossible, and training goes on as it says.
                log.warning("%s", conflict)
            choice, prediction = self.policy.decide(self.profile, self.grad_params(),
                                                    env.num_nodes(), size, before, forced)
            self._log_decision(before, choice, prediction, size)
            times_halves = size > 1 and len(self.profile.sizes(env.num_nodes(), size)) < 2
            decision = (choice, times_halves)
            if self._hints is not None:
                self._publish_hints(size)
        if size > 1:
            # Rank 0 may have spent a while fitting the throughput model: the others wait
            # for it sleeping (collective.wait).
            decision = collective.broadcast_object(decision, name="hvd_adapt.decision")
        choice, self._times_halves = decision
        self._choice = (int(choice[0]), int(choice[1]), size)

    def _publish_hints(self, size):
        # A scheduler's hint is never worth the training: a write that fails is
        # logged (once per distinct error) and training goes on.
        from ..scheduling.hints import make_hints, write_hints
        path, max_replicas = self._hints
        started = time.perf_counter()
        try:
            curve = self.policy.speedup_curve(self.profile, self.grad_params(),
                                              max(max_replicas, size), env.local_size())
            counts = {int(r) for r in self.profile.arrays()["num_replicas"]}
            write_hints(path, make_hints(size, env.local_size(), counts, self.init_batch_size,
                                         time.time() if curve else None, curve))
            self._hints_error = None
        except (OSError, ValueError, ArithmeticError) as e:
            if repr(e) != self._hints_error:
                log.warning("cannot publish the speed-up curve to %s: %s", path, e)
            self._hints_error = repr(e)
            return
        log.debug("published the speed-up curve to %s in %.1f ms", path,
                  1e3 * (time.perf_counter() - started))

    def _log_decision(self, before, choice, prediction, size):
        old = size * before[0] * (before[1] + 1)
        new = size * choice[0] * (choice[1] + 1)
        why = "" if prediction is None else \
            f", predicted goodput x{prediction[0]:.2f}, gain {prediction[1]:.2f}"
        # Unchanged choices are logged at debug level: they show that a
        # decision came when due even though nothing changed.
        level = logging.INFO if tuple(choice) != tuple(before) else logging.DEBUG
        log.log(level, "batch size %d -> %d: local %d x %d accumulation step(s) x %d "
                "replica(s)%s", old, new, choice[0], choice[1], size, why)

    def grad_params(self):
        """The noise scale's :class:`~hvd_adapt.goodput.GradParams`, or None before any estimate."""
        if self._noise is None or not self._noise.has_estimate():
            return None
        return self._noise.grad_params(self.init_batch_size)

    # -- timing ------------------------------------------------------------------------
    def record_step(self, seconds, local_bsz, optim):
        """Add one step's wall time at ``local_bsz`` in the current world to the profile."""
        self.profile.record(env.num_nodes(), env.size(), local_bsz, seconds, optim=optim)

    def record_sync(self, seconds):
        """Add the gradient-averaging part of one optimizer step to the profile."""
        self.profile.record_sync(env.num_nodes(), env.size(), self.local_bsz, seconds)

    def throughput(self):
        """Measured samples/s of the current plan, or None before it was timed."""
        local, accum = self._current()
        return self.profile.throughput(env.num_nodes(), env.size(), local, accum)

    # -- progress ----------------------------------------------------------------------
    @property
    def progress(self):
        """Training progress in B0-steps (a step at a larger batch counts its gain)."""
        return self._noise.progress if self._noise is not None else 0.0

    def gain(self):
        """The AdaScale gain of the current batch size over B0 (1 before any estimate)."""
        if self._noise is None:
            return 1.0
        return float(self._noise.gain(self.batch_size, self.init_batch_size))

    def start_epoch(self):
        """Progress of a new epoch counts from here (for epochs by progress)."""
        self._settle_epoch_verdict()
        self._epoch_progress_start = self.progress

    def epoch_progress_made(self, num_samples):
        """True once this epoch has made one B0-pass over ``num_samples`` of progress
        (this rank's own reckoning; :meth:`epoch_ends` is what every rank acts on)."""
        needed = num_samples / self.init_batch_size
        return self.progress - self._epoch_progress_start >= needed - 1e-9

    def epoch_ends(self, num_samples, pass_ended):
        """Collective: whether an epoch by progress ends after this optimizer step, as rank 0
        reckons it, so every rank ends it at the same step.

        Each rank's progress comes from the same allreduced statistics, but
        a last-bit difference (another CPU's libm in one replica) would end
        the pass on one rank only and hang the job. Rank 0's verdict of each
        step travels in the background and is acted on at the next step (an
        epoch by progress lasts one step longer); at the end of a pass, where
        the loader must know at once whether to start another, it is waited
        for.
        """
        verdict = self._settle_epoch_verdict()
        if verdict:
            return True
        ours = self.epoch_progress_made(num_samples)
        handle = collective.start_broadcast_flag(ours, name="hvd_adapt.epoch_end")
        if pass_ended or handle is None:
            return collective.flag_of(handle, ours)
        self._epoch_verdict = handle
        return False

    def _settle_epoch_verdict(self):
        handle, self._epoch_verdict = self._epoch_verdict, None
        return handle is not None and collective.flag_of(handle)

    def forget_epoch_verdict(self):
        """Drop a verdict in flight (its world is gone after a reset or restore)."""
        self._epoch_verdict = None

    # -- reporting and state -----------------------------------------------------------
    def metrics(self):
        """Scalars worth plotting: batch sizes, accumulation, replicas, and where known the
        gain, noise scale, progress and measured samples/s."""
        local, accum = self._current()
        out = {"batch_size": self.batch_size, "local_bsz": local, "accumulation_steps": accum,
               "replicas": env.size()}
        rate = self.throughput()
        if rate:
            out["samples_per_second"] = rate
        if self._noise is not None and self._noise.has_estimate():
            out.update(gain=self.gain(), noise_scale=self._noise.noise_scale(),
                       progress=self.progress)
        return out

    def progress_line(self):
        """One line of text: global batch, local batch, accumulation, gain, samples/s."""
        values = self.metrics()
        gain = f" gain={values['gain']:.2f}" if "gain" in values else ""
        rate = f" samples/s={values['samples_per_second']:.1f}" \
            if "samples_per_second" in values else ""
        return (f"bsz={values['batch_size']} local_bsz={values['local_bsz']} "
                f"accum={values['accumulation_steps']}{gain}{rate} replicas={values['replicas']}")

    def state_dict(self):
        return {"profile": self.profile.state_dict(), "choice": self._choice,
                "epoch_progress_start": self._epoch_progress_start,
                "optim_steps": self._optim_steps}

    def load_state_dict(self, state):
        self.profile.load_state_dict(state["profile"])
        self._choice = None if state["choice"] is None else tuple(state["choice"])
        self._epoch_progress_start = state["epoch_progress_start"]
        self._optim_steps = state.get("optim_steps", 0)
        self._epoch_verdict = None
        self.start_cycles()
        self._needs_decision = True

    def timed_decision(self):
        """:meth:`decide`, returning the seconds it took (left out of the step being timed)."""
        started = time.perf_counter()
        self.decide()
        return time.perf_counter() - started
