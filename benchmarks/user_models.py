"""The models users bring, built as their libraries build them, for the commit-every-step rows.

- ``resnet18_ema()``: timm's ``resnet18`` with ``timm.utils.ModelEmaV3`` where timm
  imports; otherwise a torch-only stand-in of the same shape (ResNet-18's
  BasicBlocks and BatchNorms, 11.7M parameters, and an EMA that keeps a copy of
  the model and lerps its parameters towards the model's after every step, as
  ``ModelEmaV3`` does). timm needs torchvision, whose wheels pin the torch they
  were built for, so it is not installed beside the torch Horovod was built
  against here.
- ``gpt2()``: Hugging Face ``GPT2LMHeadModel`` from a small ``GPT2Config``
  (random weights, tied embeddings; nothing downloaded).

Each returns ``(model, ema_or_None, batch_fn, loss_fn)``: ``batch_fn(n, generator)`` makes
``n`` random inputs and targets, ``loss_fn(model, x, y)`` the training loss.
"""
import copy

import torch
import torch.nn.functional as F

IMAGE = 64          # resnet18 inputs: 3 x 64 x 64, 100 classes
CLASSES = 100
SEQUENCE = 64       # gpt2 inputs: 64 tokens of a 4096-word vocabulary
VOCABULARY = 4096


class ModelEma(torch.nn.Module):
    """A stand-in for ``timm.utils.ModelEmaV3``: ``module`` is a frozen copy of the model
    whose parameters follow the model's (``lerp`` by ``1 - decay``) and whose buffers are
    copied, at ``update(model)`` after every optimizer step."""

    def __init__(self, model, decay=0.9998):
        super().__init__()
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model, step=None):
        ema_params = list(self.module.parameters())
        torch._foreach_lerp_(ema_params, list(model.parameters()), 1.0 - self.decay)
        for ema_b, b in zip(self.module.buffers(), model.buffers()):
            ema_b.copy_(b)


class _Block(torch.nn.Module):
    def __init__(self, inp, out, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(out)
        self.conv2 = torch.nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inp != out:
            self.downsample = torch.nn.Sequential(torch.nn.Conv2d(inp, out, 1, stride, bias=False),
                                                  torch.nn.BatchNorm2d(out))

    def forward(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        x = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(x)) + shortcut)


class ResNet18(torch.nn.Module):
    """ResNet-18 (torchvision's and timm's layout: 4 stages of 2 BasicBlocks)."""

    def __init__(self, classes=CLASSES):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(64)
        widths = [64, 128, 256, 512]
        stages, inp = [], 64
        for i, width in enumerate(widths):
            stages.append(torch.nn.Sequential(_Block(inp, width, 1 if i == 0 else 2),
                                              _Block(width, width, 1)))
            inp = width
        self.layers = torch.nn.Sequential(*stages)
        self.fc = torch.nn.Linear(512, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        return self.fc(self.layers(x).mean((2, 3)))


def resnet18_ema(channels_last=False):
    """(model, ema, batch_fn, loss_fn): timm's resnet18 and ModelEmaV3, or the stand-ins."""
    try:
        import timm
        from timm.utils import ModelEmaV3
        model = timm.create_model("resnet18", num_classes=CLASSES)
        ema_cls = ModelEmaV3
    except ImportError:
        model, ema_cls = ResNet18(), ModelEma
    if channels_last:
        model = model.to(memory_format=torch.channels_last)

    def batch(n, generator):
        return (torch.randn(n, 3, IMAGE, IMAGE, generator=generator),
                torch.randint(0, CLASSES, (n,), generator=generator))

    def loss(model, x, y):
        return F.cross_entropy(model(x), y)
    return model, ema_cls(model, decay=0.9998), batch, loss


def gpt2(layers=4, width=256, heads=4):
    """(model, None, batch_fn, loss_fn): a small GPT-2 with tied input and output embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=VOCABULARY,
                        n_positions=SEQUENCE, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)

    def batch(n, generator):
        tokens = torch.randint(0, VOCABULARY, (n, SEQUENCE + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    def loss(model, x, y):
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    return model, None, batch, loss
