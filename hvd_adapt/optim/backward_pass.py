"""Which autograd graph task is a backward pass, so that the exchange opens and closes its
work once per ``.backward()``, however the pass is built.

A backward pass is the graph task that ``loss.backward()`` starts. Three
things made "the first hook to fire" a poor stand-in for it:

- reentrant activation checkpointing (``checkpoint(..., use_reentrant=True)``)
  runs a nested ``torch.autograd.backward`` inside the outer pass for every
  checkpointed block, each its own graph task, and its hooks may be the
  first (even the only) ones to fire;
- ``torch.autograd.grad`` with respect to parameters fires tensor hooks but
  accumulates nothing;
- a pass that raises never runs its end-of-pass callbacks.

Here a pass opens at a parameter's post-accumulate-grad hook (they fire for
``.backward()`` only, never for ``autograd.grad``). A task is nested when it
runs inside the backward of a custom autograd Function (the frame of
``BackwardCFunction.apply`` is on the thread's stack: the engine runs a
reentrant backward on the thread that asked for it); then a one-shot hook on
that Function's node fires when the node is done, inside the enclosing task,
and so on outwards until the outermost task, whose end-of-pass callback
closes the pass. A pass still open when the next outermost task starts, or
when the optimizer's ``zero_grad()`` or ``step()`` runs, raised.
"""
import inspect

import torch
from torch.autograd import Variable
from torch.autograd import function as autograd_function

_FUNCTION_FILE = autograd_function.__file__


def current_task():
    """The id of the graph task running on this thread, or -1 outside a backward."""
    return torch._C._current_graph_task_id()


def _enclosing_function_node():
    # The backward node of the custom Function whose backward runs the task
    # this thread is in, or None when the task is an outermost one.
    frame = inspect.currentframe().f_back
    while frame is not None:
        code = frame.f_code
        if code.co_name == "apply" and code.co_filename == _FUNCTION_FILE:
            node = frame.f_locals.get("self")
            if isinstance(node, autograd_function.BackwardCFunction):
                return node
        frame = frame.f_back
    return None


class BackwardPass:
    """One ``.backward()``: its outermost graph task (None until known) and the nested tasks
    seen in it; ``plan`` and the rest are the exchange's to fill."""

    def __init__(self, root):
        self.root = root
        self.nested = set()
        self.plan = None
        self.ended = False


class PassTracker:
    """Tells, at each post-accumulate hook, which :class:`BackwardPass` it belongs to, and
    calls ``on_end(pass)`` once that pass's outermost task has finished."""

    def __init__(self, on_end):
        self._on_end = on_end
        self.current = None        # the pass open now (or one that raised), or None

    def enter(self):
        """Called in a post-accumulate hook: ``(pass, stale)``. ``pass.plan`` is None when
        this hook opened it; ``stale`` is a pass left open by a backward that raised, which
        an outermost task starting now proves dead."""
        task = current_task()
        open_pass = self.current
        if open_pass is not None and (task == open_pass.root or task in open_pass.nested):
            return open_pass, None
        node = _enclosing_function_node()
        if node is None:
            new = BackwardPass(task)
            self.current = new
            Variable._execution_engine.queue_callback(lambda: self._ended(new))
            return new, open_pass
        if open_pass is None:
            open_pass = self.current = BackwardPass(None)
        open_pass.nested.add(task)
        if open_pass.root is None:
            self._watch(node, open_pass)
        return open_pass, None

    def _watch(self, node, open_pass):
        # Fires when the Function's backward (the nested task's caller) is
        # done, inside the task that ran that Function's node.
        handles = []

        def node_done(grad_inputs, grad_outputs):
            for handle in handles:
                handle.remove()
            if open_pass is not self.current or open_pass.root is not None:
                return
            enclosing = _enclosing_function_node()
            if enclosing is None:
                open_pass.root = current_task()
                Variable._execution_engine.queue_callback(lambda: self._ended(open_pass))
            else:
                open_pass.nested.add(current_task())
                self._watch(enclosing, open_pass)

        handles.append(node.register_hook(node_done))

    def _ended(self, ended_pass):
        if ended_pass is self.current:
            self.current = None
            ended_pass.ended = True
            self._on_end(ended_pass)

    def take_stale(self):
        """The pass left open by a backward that raised, or None; it is forgotten. Call it
        outside any backward (from ``zero_grad()`` or ``step()``)."""
        stale, self.current = self.current, None
        return stale
