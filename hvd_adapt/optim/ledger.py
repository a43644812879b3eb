"""Which gradient tensor each parameter's average is: what ``step()`` checks.

The hooks (``exchange.py``) are the fast path, but ``.grad`` is the user's:
they assign it (PCGrad, gradient surgery, meta-learning), run a second
backward into it, or clear it with ``model.zero_grad()`` between the
micro-steps of a cycle. The ledger keeps, per position of the layout:

- the gradient tensor an allreduce averaged this cycle (a weak reference: its
  identity). At ``step()`` a ``.grad`` that is not that tensor was never
  averaged, so the exchange averages it then. An averaged tensor changed in
  place afterwards (clipping, ``GradScaler.unscale_``) is the user's own
  same-on-every-rank work and is left alone; a backward into it is seen by the
  hooks and averaged again by that pass.
- between the micro-steps of an accumulation cycle, the tensor holding the
  local sum so far and its ``._version``. At the next pass that tensor must
  still be ``.grad``: where ``.grad`` was set to None (``model.zero_grad()``)
  the sum is put back, since the loader's cycle, not the user's loop, decides
  what a step's gradient is; where it was changed in place
  (``zero_grad(set_to_none=False)``) the earlier micro-steps are lost, and the
  position is reported as tampered.
"""
import weakref

import torch


class Ledger:
    """Per-position records of averaged and of locally accumulated gradients."""

    def __init__(self):
        self._averaged = {}     # position -> weak reference to the averaged .grad
        self._local = {}        # position -> (tensor, version) between micro-steps

    def forget(self):
        """A new cycle (after a step, ``zero_grad()`` or a reset)."""
        self._averaged.clear()
        self._local.clear()

    def record_averaged(self, pos, grad):
        self._averaged[pos] = weakref.ref(grad)

    def unaveraged(self, params):
        """Positions whose ``.grad`` is set and is not a tensor an allreduce averaged."""
        averaged = self._averaged
        out = []
        for pos, p in enumerate(params):
            grad = p.grad
            if grad is not None:
                ref = averaged.get(pos)
                if ref is None or ref() is not grad:
                    out.append(pos)
        return out

    def keep_local(self, params):
        """The end of a micro-step that averages nothing: remember each local sum."""
        self._local = {pos: (p.grad, p.grad._version) for pos, p in enumerate(params)
                       if p.grad is not None}

    def put_back(self, params, accumulated_pos=None):
        """At the first hook of the next pass: give back sums that ``.grad`` lost; returns the
        positions whose sum was changed in place. ``accumulated_pos`` already had this
        pass's gradient added (one version more)."""
        tampered = []
        # model.zero_grad() clears every gradient: one that the others show cleared
        # was cleared too, not summed out of place by a create_graph pass.
        cleared = any(params[pos].grad is None for pos in self._local if pos != accumulated_pos)
        for pos, (kept, version) in self._local.items():
            p = params[pos]
            grad = p.grad
            added = 1 if pos == accumulated_pos else 0
            if grad is kept:
                if kept._version != version + added:
                    tampered.append(pos)
            elif kept._version != version:
                tampered.append(pos)
            elif grad is None:
                p.grad = kept
            elif pos == accumulated_pos and (cleared or not torch.is_grad_enabled()):
                # .grad was None when this pass's gradient came (outside grad mode
                # autograd adds in place): a fresh tensor.
                p.grad = kept + grad if grad.requires_grad else kept.add_(grad)
            # Otherwise the user assigned a tensor, or a create_graph pass summed
            # out of place: it is the sum from now on, as in one process.
        self._local = {}
        return tampered
