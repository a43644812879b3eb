"""Accumulator modes, in one process."""
import numpy as np
import pytest
import torch

import hvd_adapt
from hvd_adapt import Accumulator


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def test_updates_then_synchronized_totals():
    acc = Accumulator()
    acc["loss"] += 1.5
    acc["loss"] += 0.5
    acc["n"] += 3
    assert acc["loss"] == 2.0 and dict(acc) == {"loss": 2.0, "n": 3}
    with acc.synchronized():
        assert dict(acc) == {"loss": 2.0, "n": 3}
    acc["n"] += 1
    assert dict(acc) == {"n": 1}, "outside synchronized() the view is the pending updates"
    with acc.synchronized():
        assert acc["n"] == 4 and isinstance(acc["n"], int)
        acc.clear()
    with acc.synchronized():
        assert len(acc) == 0


def test_initial_values_and_update_adds_outside_sync():
    acc = Accumulator(a=1)
    acc.update({"a": 2, "b": 1})
    acc.update(b=1)
    with acc.synchronized():
        assert dict(acc) == {"a": 3, "b": 2}
        acc.update({"a": 10})
        assert acc["a"] == 10


def test_tensor_and_numpy_scalars_become_numbers():
    acc = Accumulator()
    acc["t"] += torch.tensor(2.0)
    acc["np"] += np.float32(1.5)
    with acc.synchronized():
        assert acc["t"] == 2.0 and type(acc["t"]) is float and acc["np"] == 1.5


@pytest.mark.parametrize("bad", ["text", [1.0], torch.ones(2), None])
def test_non_numbers_are_rejected_with_the_key(bad):
    acc = Accumulator()
    with pytest.raises(TypeError, match="key 'x'"):
        acc["x"] = bad


def test_missing_key_inside_synchronized_raises():
    acc = Accumulator()
    with acc.synchronized():
        with pytest.raises(KeyError):
            acc["nope"]


def test_state_dict_round_trip():
    acc = Accumulator(a=1)
    acc["b"] += 2
    copy = Accumulator(name=acc.name)
    copy.load_state_dict(acc.state_dict())
    assert repr(copy) == repr(acc)
    copy["b"] += 1
    assert acc["b"] == 2, "state dicts must not alias"


def test_membership_get_len_and_iteration_agree_inside_and_outside_synchronized():
    acc = Accumulator()
    acc["seen"] += 2
    assert "seen" in acc and "other" not in acc
    assert acc.get("seen") == 2 and acc.get("other", -1) == -1
    assert len(acc) == 1 and list(acc) == ["seen"]
    with acc.synchronized():
        assert "seen" in acc and "other" not in acc and len(acc) == 1
        assert acc.get("other") is None and dict(acc) == {"seen": 2}


def test_name_defaults_to_where_it_was_made_and_is_checked():
    made_here = Accumulator()
    assert made_here.name.startswith("test_accumulator.py:")
    named = Accumulator(name="eval")
    assert named.name == "eval" and "name='eval'" in repr(named)
    assert Accumulator({"name": 2}).state_dict()["totals"] == {"name": 2}
    with pytest.raises(TypeError, match="name must be a str or None, got 3"):
        Accumulator(name=3)
