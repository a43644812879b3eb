"""Markov text: a small transformer language model on text from a random second-order Markov source.

The source has 48 symbols; after each pair of symbols a few next symbols are
likely (Dirichlet weights over a random handful), so the text has structure a
model must learn from two symbols of context, and a known entropy rate below
which no model's validation loss can go. The metric is validation loss in
nats per token (perplexity is its exp).
"""
import numpy as np
import torch
from torch.utils.data import TensorDataset

from .base import Workload

VOCAB = 48
LENGTH = 32
CHOICES = 4


def source(seed):
    """Transition table (VOCAB, VOCAB, VOCAB): next-symbol probabilities after each pair."""
    rng = np.random.default_rng(seed)
    table = np.full((VOCAB, VOCAB, VOCAB), 1e-3)
    for a in range(VOCAB):
        for b in range(VOCAB):
            likely = rng.choice(VOCAB, CHOICES, replace=False)
            table[a, b, likely] += rng.dirichlet(np.full(CHOICES, 0.7))
    return table / table.sum(-1, keepdims=True)


def sample(table, count, rng):
    """``count`` sequences of LENGTH + 1 symbols drawn from the source."""
    out = np.empty((count, LENGTH + 1), dtype=np.int64)
    out[:, :2] = rng.integers(0, VOCAB, (count, 2))
    cumulative = table.cumsum(-1)
    for t in range(2, LENGTH + 1):
        rows = cumulative[out[:, t - 2], out[:, t - 1]]
        out[:, t] = np.minimum((rows < rng.uniform(size=(count, 1))).sum(-1), VOCAB - 1)
    return out


def make_data(seed=0, size=1.0):
    # The source is the task and stays the same for every seed; the seed
    # draws the text.
    table = source(1234)
    rng = np.random.default_rng(seed)
    sets = []
    for count in (max(1, int(30000 * size)), 1000):
        text = torch.from_numpy(sample(table, count, rng))
        sets.append(TensorDataset(text[:, :-1].contiguous(), text[:, 1:].contiguous()))
    return tuple(sets)


class LanguageModel(torch.nn.Module):
    """A causal transformer: token and position embeddings, 2 pre-norm layers, a tied head."""

    def __init__(self, width=64, heads=4, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position = torch.nn.Parameter(torch.zeros(LENGTH, width))
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.layers = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(LENGTH),
                             persistent=False)

    def forward(self, tokens):
        n = tokens.shape[1]
        h = self.embed(tokens) + self.position[:n]
        h = self.layers(h, mask=self.causal[:n, :n], is_causal=True)
        return self.norm(h) @ self.embed.weight.T


def make_model():
    return LanguageModel()


def make_optimizer(params, lr):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def lm_loss(model, batch):
    x, y = batch
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def entropy_rate(seed=1234):
    """The source's entropy in nats per symbol (pairs weighted uniformly, close to stationary)."""
    table = source(seed)
    return float(-(table * np.log(table)).sum(-1).mean())


WORKLOAD = Workload(
    name="markov_text", make_data=make_data, make_model=make_model, make_optimizer=make_optimizer,
    loss=lm_loss, metric="val_loss", higher_is_better=False,
    targets=(3.0, 2.0, 1.75), base_batch=16, base_lr=5e-3, lr_scaling="sqrt",
    batches=(16, 32, 64, 256), max_local_bsz=256, read_every=1024)
