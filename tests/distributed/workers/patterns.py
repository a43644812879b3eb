"""The training code users write, under several replicas, against a plain-torch reference.

``--pattern P`` picks one: each trains a few optimizer steps with
hvd_adapt.DistributedOptimizer on this rank's shard of every batch and, beside
it in the same process, the same model with the plain torch optimizer on the
whole batch (every rank's shard, gathered in rank order: the mean of equal
shards' gradients is the whole batch's gradient). After every optimizer step
the rank reports the largest difference between the two models' parameters,
and a hash of its own. ``--micro N`` accumulates N micro-batches per step.
``--pattern`` takes several cases, ``name[:micro]`` each, comma-separated: one
job runs them one after the other (each from seed 0, on its own models,
optimizers and loader) and reports ``{case: result}``, so a test pays for the
launch and the imports once, not once a case.

Patterns: ``exception`` (a backward raises on every rank at one micro-step,
caught: that cycle is skipped; ``--only-rank 1``: on rank 1 alone, which every
rank must refuse), ``unfreeze`` (a frozen backbone trained from step 3, a
parameter no rank ever uses), ``checkpoint`` (reentrant activation
checkpointing, no trainable parameter outside the checkpointed blocks),
``penalty`` (a gradient-norm penalty through ``torch.autograd.grad``),
``logging`` (rank 0 alone calls ``torch.autograd.grad`` for a log line),
``reload`` (rank 0 alone reloads its optimizer's state mid-training), ``gan``
(two optimizers; the generator's backward reaches the discriminator),
``replace`` (a second optimizer over the same parameters after the first is
deleted), ``channels_last`` (a CNN in channels_last, a bucket per tensor),
``sparse`` (an ``nn.Embedding(sparse=True)``; ``--sparse-as-dense``).
"""
import argparse
import copy
import gc
import hashlib

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import hvd_adapt
from _report import report


def digest(module):
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def max_difference(model, reference):
    return max(float((p - q).abs().max()) for p, q in zip(model.parameters(),
                                                          reference.parameters()))


def gathered(tensor):
    """Every rank's shard, in rank order: the whole micro-batch."""
    return hvd.allgather(tensor, name="patterns.gather")


class Boom(torch.autograd.Function):
    """Identity whose backward raises while ``armed``."""
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if Boom.armed:
            raise RuntimeError("boom in backward")
        return grad


class Net(torch.nn.Module):
    def __init__(self, boom=False):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 3)
        self.unused = torch.nn.Parameter(torch.ones(4))   # no loss ever uses it
        self.boom = boom

    def forward(self, x):
        h = self.backbone(x)
        if self.boom:
            h = Boom.apply(h)
        return self.head(h)


class Blocks(torch.nn.Module):
    """Checkpointed blocks (trainable) under a frozen input layer and a frozen head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.head = torch.nn.Linear(16, 3)
        for p in list(self.embed.parameters()) + list(self.head.parameters()):
            p.requires_grad_(False)

    def forward(self, x):
        # As Hugging Face's enable_input_require_grads(): reentrant checkpoints
        # compute gradients only for blocks whose input requires them.
        h = self.embed(x).requires_grad_(True)
        for block in self.blocks:
            h = checkpoint(lambda a, block=block: torch.tanh(block(a)), h, use_reentrant=True)
        return self.head(h)


def classification_data(n=256, features=8, classes=3):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, features, generator=gen)
    y = torch.randint(classes, (n,), generator=gen)
    return torch.utils.data.TensorDataset(x, y)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


class Trainer:
    """One model trained the hvd_adapt way, its reference the plain way, step by step."""

    def __init__(self, args, model, make_optimizer=adamw, loss_fn=None, **optimizer_kwargs):
        self.args = args
        self.model = model
        self.reference = copy.deepcopy(model)
        self.opt = hvd_adapt.DistributedOptimizer(make_optimizer(self.model.parameters()),
                                                  **optimizer_kwargs)
        self.ref_opt = make_optimizer(self.reference.parameters())
        self.loss_fn = loss_fn or (lambda model, x, y: F.cross_entropy(model(x), y))
        batch = 32
        self.loader = hvd_adapt.AdaptiveDataLoader(classification_data(), batch_size=batch,
                                                   shuffle=True, drop_last=True)
        if args.micro > 1:
            local = batch // hvd.size() // args.micro
            self.loader.autoscale_batch_size(batch, local_bsz_bounds=(local, local),
                                             gradient_accumulation=True, decide_every=10 ** 6)
        self.state = hvd_adapt.State(model=self.model, optimizer=self.opt, loader=self.loader)
        self.steps = []
        self.micro = 0

    def reference_micro_step(self, x, y, raised=False):
        # The mean of every shard's loss: for a loss that averages its samples this is
        # the whole batch's; a gradient penalty is each shard's own, as each rank's is.
        xs, ys = gathered(x).chunk(hvd.size()), gathered(y).chunk(hvd.size())
        if not raised:
            loss = sum(self.loss_fn(self.reference, xi, yi) for xi, yi in zip(xs, ys))
            (loss / hvd.size()).backward()
        self.micro += 1

    def reference_step(self, skip=False):
        if not skip:
            for p in self.reference.parameters():
                if p.grad is not None:
                    p.grad /= self.micro
            self.ref_opt.step()
        self.ref_opt.zero_grad()
        self.micro = 0
        self.steps.append({"params": digest(self.model),
                           "difference": max_difference(self.model, self.reference)})

    def result(self):
        return {"steps": self.steps, "progress": self.opt.gns.progress}


def plain_loop(trainer, before_backward=None, after_backward=None):
    """zero_grad, backward, step every batch; ``before_backward(step, micro)`` may change the
    models; ``after_backward(step)`` runs after each backward."""

    @hvd_adapt.run
    def train(state):
        step = 0
        for x, y in trainer.loader:
            if step == trainer.args.steps:
                break
            if before_backward is not None:
                before_backward(step, trainer.micro)
            trainer.opt.zero_grad()
            trainer.loss_fn(trainer.model, x, y).backward()
            if after_backward is not None:
                after_backward(step)
            trainer.opt.step()
            trainer.reference_micro_step(x, y)
            if trainer.loader.is_optim_step():
                trainer.reference_step()
                step += 1

    train(trainer.state)
    return trainer.result()


def exception(args):
    trainer = Trainer(args, Net(boom=True))
    rank = hvd.rank()

    @hvd_adapt.run
    def train(state):
        step, skipped = 0, False
        for x, y in trainer.loader:
            if step == args.steps:
                break
            trainer.opt.zero_grad()
            Boom.armed = step == 2 and trainer.micro == 0 and args.only_rank in (-1, rank)
            raised = False
            try:
                trainer.loss_fn(trainer.model, x, y).backward()
            except RuntimeError as e:
                if "boom" not in str(e):
                    raise
                raised = True
            Boom.armed = False
            trainer.opt.step()
            skipped = skipped or raised
            trainer.reference_micro_step(x, y, raised)
            if trainer.loader.is_optim_step():
                # A cycle in which a backward raised is skipped as a whole.
                trainer.reference_step(skip=skipped)
                step += 1
                skipped = False

    train(trainer.state)
    return trainer.result()


def unfreeze(args):
    model = Net()
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    trainer = Trainer(args, model)

    def before(step, micro):
        if step == 3 and micro == 0:
            for module in (trainer.model, trainer.reference):
                for p in module.backbone.parameters():
                    p.requires_grad_(True)

    out = plain_loop(trainer, before)
    out["unused_untouched"] = bool(torch.equal(trainer.model.unused, torch.ones(4)))
    out["unused_has_state"] = trainer.model.unused in trainer.opt.state
    return out


def checkpointed(args):
    return plain_loop(Trainer(args, Blocks()))


def penalty(args):
    def loss_fn(model, x, y):
        loss = F.cross_entropy(model(x), y)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, create_graph=True)
        return loss + 0.1 * sum(g.pow(2).sum() for g in grads)
    model = Net()
    model.unused.requires_grad_(False)
    return plain_loop(Trainer(args, model, loss_fn=loss_fn))


def logging_rank0(args):
    trainer = Trainer(args, Net())

    def after(step):
        if hvd.rank() == 0:
            x = torch.ones(2, 8)
            grads = torch.autograd.grad(trainer.model(x).sum(), list(trainer.model.head.parameters()))
            trainer.logged = sum(float(g.norm()) for g in grads)

    return plain_loop(trainer, after_backward=after)


def reload_rank0(args):
    trainer = Trainer(args, Net())

    def before(step, micro):
        if step == 3 and micro == 0 and hvd.rank() == 0:
            trainer.opt.load_state_dict(trainer.opt.state_dict())

    return plain_loop(trainer, before)


def gan(args):
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    discriminator = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 1))
    models = {"g": generator, "d": discriminator}
    refs = {name: copy.deepcopy(m) for name, m in models.items()}
    opts = {name: hvd_adapt.DistributedOptimizer(adamw(m.parameters()))
            for name, m in models.items()}
    ref_opts = {name: adamw(m.parameters()) for name, m in refs.items()}
    hvd_adapt.State(generator=generator, discriminator=discriminator, g_opt=opts["g"],
                    d_opt=opts["d"]).sync()
    real_data = classification_data()
    steps = []
    rank, size = hvd.rank(), hvd.size()
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(100 + step)
        real_all = real_data.tensors[0][step * 16:(step + 1) * 16]
        z_all = torch.randn(16, 4, generator=gen)
        shard = slice(rank * 16 // size, (rank + 1) * 16 // size)
        for g, d, opt_g, opt_d, real, z in (
                (generator, discriminator, opts["g"], opts["d"], real_all[shard], z_all[shard]),
                (refs["g"], refs["d"], ref_opts["g"], ref_opts["d"], real_all, z_all)):
            opt_d.zero_grad()
            d_loss = F.softplus(-d(real)).mean() + F.softplus(d(g(z).detach())).mean()
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            F.softplus(-d(g(z))).mean().backward()    # reaches the discriminator too
            opt_g.step()
        difference = max(max_difference(models[n], refs[n]) for n in models)
        steps.append({"params": digest(generator) + digest(discriminator),
                      "difference": difference})
    return {"steps": steps, "progress": opts["g"].gns.progress}


def replace(args):
    # Staged fine-tuning without a State: an optimizer for the first steps, then
    # a new one over the same parameters once the first is deleted.
    torch.manual_seed(0)
    model = Net()
    model.unused.requires_grad_(False)
    reference = copy.deepcopy(model)
    loader = hvd_adapt.AdaptiveDataLoader(classification_data(), batch_size=32, shuffle=True,
                                          drop_last=True)
    opt = hvd_adapt.DistributedOptimizer(adamw(model.parameters()))
    ref_opt = adamw(reference.parameters())
    steps = []
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        if step == 2:
            del opt
            gc.collect()
            opt = hvd_adapt.DistributedOptimizer(adamw(model.parameters()))
            ref_opt = adamw(reference.parameters())
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(reference(gathered(x)), gathered(y)).backward()
        ref_opt.step()
        steps.append({"params": digest(model), "difference": max_difference(model, reference)})
    return {"steps": steps, "progress": opt.gns.progress}


def channels_last(args):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(8, 3))
    model = model.to(memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(3)
    images = torch.randn(256, 3, 8, 8, generator=gen).to(memory_format=torch.channels_last)
    labels = torch.randint(3, (256,), generator=gen)
    trainer = Trainer(args, model, bucket_cap_mb=1e-9)
    trainer.loader = hvd_adapt.AdaptiveDataLoader(
        torch.utils.data.TensorDataset(images, labels), batch_size=32, shuffle=True,
        drop_last=True)
    trainer.state = hvd_adapt.State(model=trainer.model, optimizer=trainer.opt,
                                    loader=trainer.loader)
    assert not trainer.model[0].weight.is_contiguous()
    return plain_loop(trainer)


def sparse(args):
    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(50, 8, sparse=True)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.embedding((x.abs() * 7).long() % 50).mean(1))

    torch.manual_seed(0)
    model = Bag()
    trainer = Trainer(args, model, make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                      sparse_as_dense=args.sparse_as_dense,
                      named_parameters=model.named_parameters())
    return plain_loop(trainer)


PATTERNS = {"exception": exception, "unfreeze": unfreeze, "checkpoint": checkpointed,
            "penalty": penalty, "logging": logging_rank0, "reload": reload_rank0, "gan": gan,
            "replace": replace, "channels_last": channels_last, "sparse": sparse}

parser = argparse.ArgumentParser()
parser.add_argument("--pattern", required=True,
                    help=f"name[:micro],... from {', '.join(sorted(PATTERNS))}")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--micro", type=int, default=1, help="for cases that name none")
parser.add_argument("--only-rank", type=int, default=-1)
parser.add_argument("--sparse-as-dense", action="store_true")
args = parser.parse_args()
cases = [case.partition(":") for case in args.pattern.split(",")]
for name, _, _ in cases:
    if name not in PATTERNS:
        parser.error(f"--pattern {name!r} is not one of {', '.join(sorted(PATTERNS))}")
hvd_adapt.init()
results = {}
for name, _, micro in cases:
    case_args = argparse.Namespace(**dict(vars(args), micro=int(micro or args.micro)))
    torch.manual_seed(0)
    results[f"{name}:{case_args.micro}"] = PATTERNS[name](case_args)
    report(results, hvd.rank())
