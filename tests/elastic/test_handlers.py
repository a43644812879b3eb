"""Any object with state_dict()/load_state_dict() rides in a State (committed, restored,
checkpointed) without a handler; a value that can be neither pickled nor saved that way is
refused when the State is made, naming the value and the fix."""
import threading

import pytest
import torch

import hvd_adapt
from hvd_adapt import DistributedOptimizer, State


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


class TimmLikeScheduler:
    """As timm's schedulers: not a torch LRScheduler, holds its optimizer (which cannot be
    pickled or deep-copied when it is hvd_adapt's), state_dict() is its own __dict__ less
    the optimizer."""

    def __init__(self, optimizer, t_initial):
        self.optimizer, self.t_initial, self.last = optimizer, t_initial, 0

    def step(self, epoch):
        self.last = epoch
        for group in self.optimizer.param_groups:
            group["lr"] = 0.1 * (1 - epoch / self.t_initial)

    def state_dict(self):
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state):
        self.__dict__.update(state)


def job():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return model, opt


def test_an_object_with_state_dict_is_committed_restored_and_checkpointed(tmp_path):
    model, opt = job()
    sched = TimmLikeScheduler(opt, t_initial=10)
    averaged = torch.optim.swa_utils.AveragedModel(model)
    state = State(model=model, optimizer=opt, sched=sched, averaged=averaged)
    sched.step(3)
    averaged.update_parameters(model)
    state.commit()
    state.save_checkpoint(str(tmp_path / "c.pt"))
    sched.step(7)
    state.restore()
    assert sched.last == 3 and sched.optimizer is opt
    # A fresh job reads the scheduler back from the checkpoint (weights_only: plain values).
    model2, opt2 = job()
    sched2 = TimmLikeScheduler(opt2, t_initial=10)
    state2 = State(model=model2, optimizer=opt2, sched=sched2,
                   averaged=torch.optim.swa_utils.AveragedModel(model2))
    assert state2.load_checkpoint(str(tmp_path / "c.pt"))
    assert sched2.last == 3


def test_transformers_schedules_ride_in_the_state():
    transformers = pytest.importorskip("transformers")
    model, opt = job()
    sched = transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=2,
                                                         num_training_steps=10)
    state = State(model=model, optimizer=opt, sched=sched)
    for _ in range(3):
        opt.step()
        sched.step()
    state.commit()
    lr = opt.param_groups[0]["lr"]
    opt.step()
    sched.step()
    state.restore()
    assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == lr


def test_horovods_elastic_sampler_is_carried_by_horovods_handler():
    from horovod.torch.elastic import ElasticSampler
    sampler = ElasticSampler(list(range(8)), shuffle=False)
    state = State(sampler=sampler)
    sampler.record_batch(0, 2)
    state.commit()
    sampler.record_batch(1, 2)
    state.restore()
    assert sampler.state_dict()["processed_num"] == 2


class Unpicklable:
    def __init__(self):
        self.lock = threading.Lock()


def test_a_value_that_can_be_neither_pickled_nor_saved_is_refused_naming_it_and_the_fix():
    with pytest.raises(TypeError, match=r"State value 'helper' \(Unpicklable\) can be neither "
                                        r"pickled .* nor saved through state_dict\(\)/load_state"
                                        r"_dict\(\): give Unpicklable those two methods, or "
                                        r"register a handler for it \(hvd_adapt.register_handler"):
        State(helper=Unpicklable())


def test_an_object_whose_state_dict_cannot_be_copied_is_refused_naming_it():
    class Holds:
        def state_dict(self):
            return {"lock": threading.Lock()}

        def load_state_dict(self, state):
            pass

    with pytest.raises(TypeError, match=r"State value 'holder' \(Holds\) cannot be saved"):
        State(holder=Holds())
