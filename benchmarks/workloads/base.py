"""What a benchmark needs to know about a workload, and the evaluation every workload shares."""
import dataclasses
from typing import Callable, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Workload:
    """One task. ``make_data(seed, size)`` returns (train_set, val_set), where
    ``size`` scales the training set (1.0: the benchmark's, smaller for smoke
    tests); ``make_model()`` a fresh module; ``make_optimizer(params, lr)`` the
    task's usual optimizer; ``loss(model, batch)`` the training loss of a batch.

    ``metric`` is what the targets are read on (``higher_is_better`` says
    which way), ``targets`` the early, middle and final target;
    ``base_batch``/``base_lr`` the recipe the learning rate was tuned at and
    ``lr_scaling`` how fixed batches scale it ("linear" or "sqrt");
    ``batches`` the fixed global batches of the sweep, whose smallest is
    where the adaptive run starts and whose largest bounds it.
    """
    name: str
    make_data: Callable
    make_model: Callable
    make_optimizer: Callable
    loss: Callable
    metric: str
    higher_is_better: bool
    targets: Sequence[float]
    base_batch: int
    base_lr: float
    lr_scaling: str
    batches: Sequence[int]
    max_local_bsz: int
    read_every: int

    def lr_for(self, batch_size):
        """The fixed run's learning rate at ``batch_size``: the base scaled by its rule."""
        ratio = batch_size / self.base_batch
        return self.base_lr * (ratio if self.lr_scaling == "linear" else ratio ** 0.5)

    def reached(self, value, target):
        """Whether a metric ``value`` meets ``target``."""
        return value >= target if self.higher_is_better else value <= target

    def evaluate(self, model, val_set, batch_size=512):
        """The metric over ``val_set``: accuracy for classifiers, mean loss per token for
        language models (both computed by ``loss``'s sibling ``score``)."""
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(val_set), batch_size):
                batch = val_set[start:start + batch_size]
                value, n = score(self.metric, model, batch)
                total, count = total + value, count + n
        model.train()
        return total / count


def score(metric, model, batch):
    """(sum of the metric over the batch, how many items it covers)."""
    x, y = batch
    logits = model(x)
    if metric == "accuracy":
        return float((logits.argmax(-1) == y).sum()), len(y)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                             reduction="sum")
    return float(loss), y.numel()


def classification_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
