"""The optimizer state on disk in one process: a step whose closing agreement between ranks
fails after every chunk stepped, and a read of the state between steps (a logger)."""
import pytest
import torch

import hvd_adapt
from hvd_adapt.swap import DiskState
from support.swap_pairs import assert_same, deep, pair, step_both


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def test_reading_the_optimizer_state_to_log_it_does_not_break_the_next_step(tmp_path):
    # Monitoring code reads Adam's state between steps (the step count, a moment's norm):
    # `opt.state[p]` on torch's defaultdict inserts an empty dict. In memory that is
    # harmless; with swap_dir the next step must not refuse to run over it (today:
    # "RuntimeError: the wrapped optimizer holds state in memory between steps", on every
    # later step, for a read).
    pairs = pair(deep, str(tmp_path), buffer_mb=24 / 1024)
    step_both(pairs, 2)
    for model, opt in pairs:
        first = next(model.parameters())
        logged = opt.state[first].get("step")
        assert logged is None or torch.is_tensor(logged)
    step_both(pairs, 2)
    assert_same(pairs)


def stepped_twice(tmp_path):
    """``(model, swapped)``: a DiskState stepped twice, and a backward for a third step."""
    torch.manual_seed(0)
    model, inner = deep()
    swapped = DiskState(inner, str(tmp_path), buffer_mb=24 / 1024)
    for i in range(3):
        inner.zero_grad()
        model(torch.randn(8, 32, generator=torch.Generator().manual_seed(1))) \
            .pow(2).mean().backward()
        if i < 2:
            swapped.step()
    return model, swapped


@pytest.mark.parametrize("interrupt", [RuntimeError, KeyboardInterrupt],
                         ids=["peer-lost", "ctrl-c"])
def test_an_agreement_that_fails_after_every_chunk_stepped_is_not_silent(interrupt, tmp_path):
    # The second agreement ("stepped"), a collective, can raise after every chunk stepped
    # (a peer lost: HorovodInternalError; a Ctrl-C while waiting in it): the new file is
    # discarded, so the parameters moved and their state did not. That must never pass
    # silently: the state is broken until a restore (here: the state loaded again), the
    # parameters' values as the user restores them.
    model, swapped = stepped_twice(tmp_path)
    try:
        before = [p.detach().clone() for p in model.parameters()]
        kept = swapped.tensors()
        kept = {p: {k: v.clone() for k, v in values.items()} for p, values in kept.items()}

        def agree(outcome, what):
            if what == "stepped":
                raise interrupt("a peer was lost in the agreement")
            return [outcome]
        with pytest.raises(interrupt, match="peer was lost"):
            swapped.step(agree=agree)
        assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
        for action in (swapped.step, swapped.tensors, swapped.commit):
            with pytest.raises(OSError, match="failed after parameters moved.*restore a commit"):
                action()
        with torch.no_grad():
            for p, q in zip(model.parameters(), before):
                p.copy_(q)
        params = [p for group in swapped.optimizer.param_groups for p in group["params"]]
        swapped.load({"param_groups": swapped.optimizer.state_dict()["param_groups"],
                      "state": {i: kept[p] for i, p in enumerate(params)}})
        swapped.step()
    finally:
        swapped.release()
