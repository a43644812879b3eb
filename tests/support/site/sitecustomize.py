"""Test processes only: torch's eager optimizers without importing ``torch._dynamo``.

Python imports this file at start-up in every process whose PYTHONPATH names this
folder; tests/conftest.py puts it there for the processes the suite starts
(``HVD_ADAPT_TEST_TORCH_AS_IS=1`` leaves it out, to run the suite exactly as a
user's processes run). Nothing in hvd_adapt uses it.

Why: torch 2.x imports ``torch._dynamo`` (and sympy) in every process at its first
optimizer step and at the first call of the methods it marks ``_disable_dynamo``
(``Optimizer.add_param_group``, ``zero_grad``, ``load_state_dict``, ...), only to
call ``graph_break()`` or to wrap the method so that a compiled caller does not
trace it. Neither does anything in a process where nothing was compiled, which
is most of the suite's workers; the import alone took 1.6 of a worker's 4.7
CPU-seconds before its first step here, about a third of the suite's CPU time.

So until ``torch._dynamo`` is imported (``torch.compile`` imports it), the two
wrappers call the function as in eager mode; from then on they are torch's own,
unchanged. If a torch version names these functions differently nothing is
patched and tests/test_suite_harness.py says so.
"""
import sys

# Every Python process the suite starts imports this file, torch or not (Horovod's discovery
# polls each start one): nothing is imported here that a bare interpreter has not loaded.
# functools is imported by the patches alone, in processes that import torch.


def _dynamo_loaded():
    return "torch._dynamo" in sys.modules


def _patch_disable_dynamo(module):
    import functools
    original = getattr(module, "_disable_dynamo", None)
    if original is None:
        return

    # Whatever else torch's takes is passed through to it.
    def _disable_dynamo(fn=None, *args, **kwargs):
        if fn is None:
            return functools.partial(_disable_dynamo, *args, **kwargs)
        disabled = original(fn, *args, **kwargs)

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if _dynamo_loaded():
                return disabled(*args, **kwargs)
            return fn(*args, **kwargs)
        return inner
    module._disable_dynamo = _disable_dynamo


def _patch_use_grad(module):
    import functools
    original = getattr(module, "_use_grad_for_differentiable", None)
    if original is None:
        return
    torch = sys.modules["torch"]

    def _use_grad_for_differentiable(func):
        with_dynamo = original(func)

        # torch's wrapper without its graph breaks, which only a compiled caller sees.
        def _use_grad(*args, **kwargs):
            if _dynamo_loaded():
                return with_dynamo(*args, **kwargs)
            prev_grad = torch.is_grad_enabled()
            try:
                torch.set_grad_enabled(args[0].defaults["differentiable"])
                return func(*args, **kwargs)
            finally:
                torch.set_grad_enabled(prev_grad)
        functools.update_wrapper(_use_grad, func)
        return _use_grad
    module._use_grad_for_differentiable = _use_grad_for_differentiable


# Patched right after the module runs, before the modules that decorate with them import them.
_PATCHES = {"torch._compile": _patch_disable_dynamo, "torch.optim.optimizer": _patch_use_grad}


class _PatchAfterImport:
    """A meta path finder (an object with ``find_spec``) for the two modules above only."""

    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            patch(module)
        spec.loader.exec_module = exec_then_patch
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
