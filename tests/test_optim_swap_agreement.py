"""The optimizer state on disk in one process: a step whose closing agreement between ranks
fails after every chunk stepped, and a read of the state between steps (a logger)."""
import pytest
import torch

import hvd_adapt
from hvd_adapt.optim.swap import SwappedState
from test_optim_swap import assert_same, deep, pair, step_both


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def test_reading_the_optimizer_state_to_log_it_does_not_break_the_next_step(tmp_path):
    # Monitoring code reads Adam's state between steps (the step count, a moment's norm):
    # `opt.state[p]` on torch's defaultdict inserts an empty dict. In memory that is
    # harmless; with swap_dir the next step must not refuse to run over it (today:
    # "RuntimeError: the wrapped optimizer holds state in memory between steps", on every
    # later step, for a read).
    pairs = pair(deep, str(tmp_path), buffer_mb=36 / 1024)
    step_both(pairs, 2)
    for model, opt in pairs:
        first = next(model.parameters())
        logged = opt.state[first].get("step")
        assert logged is None or torch.is_tensor(logged)
    step_both(pairs, 2)
    assert_same(pairs)


def test_an_agreement_that_fails_after_every_chunk_stepped_puts_the_parameters_back(tmp_path):
    # SwappedState.step's all-or-none: "either every parameter's step is applied and its
    # state is in a new live generation, or none is". The second agreement ("stepped"), a
    # collective, can raise (a peer lost: HorovodInternalError; a Ctrl-C while waiting in
    # it): the new generation is discarded, but the parameters, all stepped, are not put
    # back: parameters after the step, state before it.
    torch.manual_seed(0)
    model, inner = deep()
    swapped = SwappedState(inner, str(tmp_path), buffer_mb=36 / 1024)
    try:
        def micro_step():
            inner.zero_grad()
            model(torch.randn(8, 32, generator=torch.Generator().manual_seed(1))) \
                .pow(2).mean().backward()
        for _ in range(2):
            micro_step()
            swapped.step()
        micro_step()
        before = [p.detach().clone() for p in model.parameters()]

        def agree(message, what):
            if what == "stepped":
                raise RuntimeError("a peer was lost in the agreement")
            return [message] if message else []
        with pytest.raises(RuntimeError, match="peer was lost"):
            swapped.step(agree=agree)
        moved = [i for i, (p, q) in enumerate(zip(model.parameters(), before))
                 if not torch.equal(p, q)]
        assert not moved, f"parameters {moved} stepped, their state not"
    finally:
        swapped.close()
