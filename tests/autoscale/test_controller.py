"""The controller a loader and an optimizer share: the plan, cycles, decisions and their log."""
import logging

import pytest
from torch.utils.data import Dataset

import hvd_adapt
from hvd_adapt import AdaptiveDataLoader
from hvd_adapt.autoscale.controller import Controller
from hvd_adapt.autoscale.policy import AutoscalePolicy


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


class Indices(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return i


class GrowingPolicy(AutoscalePolicy):
    """Keeps the default split before the first batch, then doubles the local batch."""

    def decide(self, profile, grad_params, num_nodes, num_replicas, current, forced):
        if forced:
            return self.default(num_replicas), None
        return (2 * current[0], current[1]), (1.5, 1.8)


def test_each_change_of_batch_size_is_logged_once_at_info(caplog):
    loader = AdaptiveDataLoader(Indices(), batch_size=2)
    loader.controller.configure(GrowingPolicy(2, 64, (1, 64), False, decide_every=4))
    with caplog.at_level(logging.INFO, logger="hvd_adapt"):
        sizes = [len(batch) for batch in loader]
    assert sizes == [2] * 4 + [4] * 4 + [8] * 2
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("hvd_adapt")]
    assert messages == [
        "batch size 2 -> 4: local 4 x 0 accumulation step(s) x 1 replica(s), "
        "predicted goodput x1.50, gain 1.80",
        "batch size 4 -> 8: local 8 x 0 accumulation step(s) x 1 replica(s), "
        "predicted goodput x1.50, gain 1.80"]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_without_a_policy_the_plan_splits_the_initial_batch():
    controller = Controller(init_batch_size=10)
    assert (controller.local_bsz, controller.accumulation_steps, controller.batch_size) == (10, 0, 10)
    controller.decide()
    assert controller.choice is None and not controller.decision_due


def test_cycles_close_every_accumulation_steps_and_at_the_end_of_a_plan():
    controller = Controller(init_batch_size=8)
    controller.configure(AutoscalePolicy.create(8, 64, (1, 2), gradient_accumulation=True))
    assert (controller.local_bsz, controller.accumulation_steps) == (2, 3)
    flags = []
    for i in range(6):
        controller.next_micro_step(last_of_plan=i == 5)
        flags.append(controller.is_optim_step())
    assert flags == [False, False, False, True, False, True]


def test_a_world_the_bounds_cannot_hold_in_is_refused_or_logged_with_the_numbers(caplog,
                                                                                  monkeypatch):
    loader = AdaptiveDataLoader(Indices(), batch_size=256)
    # Made here (one replica), the impossible setting is refused, naming the numbers ...
    with pytest.raises(ValueError, match=r"16 x 1 replica\(s\) = 16; the batch stays at 16"):
        loader.autoscale_batch_size(1024, local_bsz_bounds=(4, 16), gradient_accumulation=False)
    # ... in an elastic job (whose size the launcher sets: a worker joining a grown world
    # runs this line too) and after a resize, the decision logs what gives way.
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    loader.autoscale_batch_size(1024, local_bsz_bounds=(4, 16), gradient_accumulation=False)
    with caplog.at_level(logging.WARNING, logger="hvd_adapt"):
        assert [len(batch) for batch in loader] == [16] * 2 + [8]
    assert loader.current_local_bsz == 16
    assert "at 1 replica(s) the batch cannot reach batch_size 256 (less rounding) without " \
        "gradient accumulation: local_bsz_bounds upper bound 16 x 1 replica(s) = 16" \
        in caplog.text


def test_a_hints_file_that_cannot_be_written_is_logged_once_and_training_goes_on(tmp_path,
                                                                                 caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("a file where the hints folder should be")
    loader = AdaptiveDataLoader(Indices(), batch_size=2)
    loader.autoscale_batch_size(8, decide_every=2, hints_path=str(blocker / "job.json"))
    with caplog.at_level(logging.WARNING, logger="hvd_adapt"):
        assert sum(len(batch) for batch in loader) == 40
    failures = [r for r in caplog.records if "cannot publish the speed-up curve" in r.message]
    assert len(failures) == 1, caplog.text
