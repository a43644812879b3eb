"""An AdamW that runs a test's hook after its n-th step: faults injected part-way through a
swapped step (tests/swap/test_disk_state.py, tests/distributed/workers/swap_faults.py)."""
import torch


class HookedAdamW(torch.optim.AdamW):
    """AdamW that calls ``after[n]()`` after its n-th step from now (with swap_dir, a step
    per chunk), once the parameters of that call have moved."""
    after = {}
    calls = 0

    def step(self, closure=None):
        result = super().step(closure)
        hook = self.after.pop(self.calls, None)
        self.calls += 1
        if hook is not None:
            hook()
        return result
