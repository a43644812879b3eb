"""Per-step cost of the hvd_adapt loop against a plain Horovod loop, 1 and 2 processes.

Both loops train the same model on the same in-memory data at the same fixed
batch size, for each model asked for (``--model``): ``mlp-small``
(256-512-512-10, 0.4M parameters, batch 64), ``mlp-8m`` (8 x Linear(1024,
1024), batch 64), ``mlp-25m`` (6 x Linear(2048, 2048), batch 32) and
``transformer-24`` (24 pre-norm blocks of width 128 with separate q/k/v/o
projections and a gated feed-forward: 434 parameter tensors, 4.0M
parameters, batch 32 of 16 tokens); and the models users bring
(``user_models.py``): ``resnet18-ema`` (timm's resnet18 with ModelEmaV3 updated
after every step, or torch-only stand-ins where timm does not install; SGD
with momentum, batch 32 of 3x64x64) and ``gpt2`` (Hugging Face's GPT-2 from a
4-layer config, tied embeddings, AdamW, a warm-up schedule, clipping; batch
16 of 64 tokens). Small models hide communication costs;
the large ones show whether gradients are averaged while backward still
runs, as ``hvd.DistributedOptimizer`` does; the transformer shows the Python
work done per parameter tensor (hooks, buckets, norms). The
plain loop uses torch's DataLoader with a DistributedSampler
and ``hvd.DistributedOptimizer``, the other AdaptiveDataLoader,
hvd_adapt.DistributedOptimizer, an Accumulator and ``state.commit()`` every
``--commit-every`` steps (default 1: every step, as the README's loop; the EMA and the
schedule ride in the State), whose snapshots take at most ``--snapshot-budget`` of the
training time (default the State's, 0.03; ``none``: every commit snapshots, as before
the budget); both do the same EMA update, clipping and schedule. Each
process builds both loops once and runs them in alternating blocks of steps
(a round: one block of each, the order flipped every round), and reports
median step times after warm-up, the median over rounds of the ratio of the
two loops' median step times in the round (the ratio the goal is set on)
with a bootstrap 90% interval over rounds, and the ratio of mean step times
(which includes the commits' snapshots). ``ledger_ms`` is the median time of the optimizer's check
at the step (``synchronize()`` after backward: the ledger's identity checks
and the bitmask every rank agrees on), ``ledger_share`` its share of the
hvd_adapt loop's median step.

    python benchmarks/overhead.py [--model mlp-small,mlp-8m,mlp-25m] [--commit-every 1]
                                  [--snapshot-budget 0.03|none]
                                  [--measure-noise] [--device auto|cpu|cuda]

It also reports each loop's peak memory above the model's own (RSS on the
CPU, ``torch.cuda.max_memory_allocated`` on CUDA), each loop measured in a
process of its own since peaks only grow.

With ``--measure-noise`` the hvd_adapt loop also measures the gradient noise
scale, as it does whenever the loader autoscales its batch size.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)


def worker(args):
    import horovod.torch as hvd
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import hvd_adapt

    torch.set_num_threads(1)
    hvd_adapt.init()
    device = hvd_adapt.env.device(args.device)
    size = hvd.size()
    local_bsz = args.batch_size // size
    gen = torch.Generator().manual_seed(0)
    user = args.model in USER_MODELS
    if user:
        sys.path.insert(0, os.path.dirname(HERE))
        import user_models
        # Eight batches a pass, passes repeated: images are too large to hold every step's.
        build = getattr(user_models, USER_MODELS[args.model])
        x, y = build()[2](local_bsz * size * 8, gen)
        data = TensorDataset(x, y)
    else:
        width, depth = MODELS[args.model][:2]
        # One pass over the data serves a loop's every step (warm-up and 2 a block
        # more, with room for the loader's last short batch).
        samples = local_bsz * size * (args.steps + 2 * args.rounds + args.warmup + 5)
        shape = (samples, TOKENS, width) if args.model.startswith("transformer") \
            else (samples, width)
        data = TensorDataset(torch.randn(*shape, generator=gen),
                             torch.randint(0, 10, (samples,), generator=gen))

    def training():
        """(model, optimizer, extras, loss, after_step): the same recipe for both loops;
        ``extras`` are the values a State carries besides model and optimizer."""
        torch.manual_seed(0)
        if user:
            model, ema, _, loss = build()
            model = model.to(device)
            if ema is not None:
                ema = ema.to(device)
                opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                                      weight_decay=5e-5)
                extras = {"ema": ema}
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
                extras = {}

            def after_step():
                if ema is not None:
                    ema.update(model)
                else:
                    # The warm-up schedule, on the optimizer the loop steps.
                    for group in opt.param_groups:
                        group["lr"] = 3e-4 * min(1.0, (after_step.steps + 1) / 100)
                    after_step.steps += 1
            after_step.steps = 0
            return model, opt, extras, loss, after_step
        if args.model.startswith("transformer"):
            model = Transformer(width, depth).to(device)
        elif args.model == "mlp-small":
            model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                        torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                        torch.nn.Linear(512, 10)).to(device)
        else:
            layers = [m for _ in range(depth)
                      for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
            layers.append(torch.nn.Linear(width, 10))
            model = torch.nn.Sequential(*layers).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return model, opt, {}, lambda m, x, y: F.cross_entropy(m(x), y), lambda: None

    def passes(loader):
        while True:
            yield from loader

    def step_ends(batches, step, ends_step=lambda: True):
        """The time at the end of each optimizer step, one per ``next()``: ``step(i, x, y)``
        runs each batch, ``ends_step()`` says whether it ended one (a step measuring the
        noise alone comes as two half batches)."""
        i = 0
        for x, y in batches:
            step(i, x.to(device), y.to(device))
            if not ends_step():
                continue
            i += 1
            if device.type == "cuda":
                # Step times mean the same as on the CPU: the device's work included.
                torch.cuda.synchronize(device)
            yield time.perf_counter()

    def plain():
        model, sgd, _, loss_of, after_step = training()
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        loader = DataLoader(data, batch_size=local_bsz,
                            sampler=DistributedSampler(data, size, hvd.rank(), shuffle=True))
        total = [0.0]

        def step(i, x, y):
            opt.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            if user:
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            after_step()
            total[0] += loss.item()
        return step_ends(passes(loader), step)

    def adaptive():
        model, sgd, extras, loss_of, after_step = training()
        opt = hvd_adapt.DistributedOptimizer(sgd, measure_noise=args.measure_noise,
                                             named_parameters=model.named_parameters())
        loader = hvd_adapt.AdaptiveDataLoader(data, batch_size=args.batch_size, shuffle=True)
        stats = hvd_adapt.Accumulator()
        if args.snapshot_budget != "default":
            extras["snapshot_budget"] = args.snapshot_budget
        state = hvd_adapt.State(model=model, optimizer=opt, loader=loader, stats=stats, **extras)
        state.sync()

        def step(i, x, y):
            opt.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            # The ledger's check at the step (identities, the agreed bitmask), timed
            # alone: synchronize() does what step() would, skip_synchronize() the rest.
            started = time.perf_counter()
            opt.synchronize()
            ledger.append(time.perf_counter() - started)
            if user:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                opt.step()
            after_step()
            stats["loss"] += loss.item()
            if i % args.commit_every == 0 and loader.is_optim_step():
                state.commit()
        return step_ends(passes(loader), step, loader.is_optim_step)

    loops = {"plain": plain, "hvd_adapt": adaptive}
    ledger = []
    if args.memory_of:
        baseline = peak_memory(device)
        ends = loops[args.memory_of]()
        for _ in range(args.warmup):
            next(ends)
        if hvd.rank() == 0:
            with open(args.out, "w") as f:
                json.dump({"peak_bytes": peak_memory(device) - baseline}, f)
        return
    # Both loops are built once and run in alternating blocks of steps, the
    # order flipped every round (plain first, then hvd_adapt first): drift on a
    # shared machine and the cost of switching between two models' memory
    # fall on both alike.
    ends = {name: loop() for name, loop in loops.items()}
    for name in ends:
        for _ in range(args.warmup):
            next(ends[name])
    ledger.clear()
    results = {"plain": [], "hvd_adapt": []}
    round_ratios = []
    per_round = args.steps // args.rounds
    for r in range(args.rounds):
        medians = {}
        for name in (list(ends) if r % 2 == 0 else list(ends)[::-1]):
            # A block's first two steps are left out: the first has no start stamp (it
            # follows the other loop's), the second pays for switching models in cache.
            stamps = [next(ends[name]) for _ in range(per_round + 2)][1:]
            times = np.diff(stamps).tolist()
            results[name] += times
            medians[name] = np.median(times)
        round_ratios.append(medians["hvd_adapt"] / medians["plain"])
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            # The two loops of a round run back to back, so the median of the
            # per-round ratios discounts load that comes and goes on a shared machine.
            json.dump({k: float(np.median(v)) for k, v in results.items()} |
                      {k + "_mean": float(np.mean(v)) for k, v in results.items()} |
                      {"ledger": float(np.median(ledger)),
                       "ledger_share": float(np.median(ledger) / np.median(results["hvd_adapt"])),
                       "ratio": float(np.median(round_ratios)),
                       "ratio_interval": median_interval(round_ratios),
                       "round_ratios": [float(x) for x in round_ratios],
                       "steps": len(results["plain"])}, f)


def median_interval(values, level=0.9, resamples=2000):
    """A bootstrap ``level`` interval of the median of ``values`` (rounds): whether a
    ratio's distance from a goal is more than this machine's round-to-round spread."""
    import numpy as np
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(values, size=(resamples, len(values))), axis=1)
    tail = (1 - level) / 2
    return [float(np.quantile(medians, tail)), float(np.quantile(medians, 1 - tail))]


# name: (width, depth, global batch, timed steps, rounds)
MODELS = {"mlp-small": (256, 2, 64, 1200, 12), "mlp-8m": (1024, 8, 64, 320, 32),
          "mlp-25m": (2048, 6, 32, 160, 16), "transformer-24": (128, 24, 32, 240, 24),
          "resnet18-ema": (None, None, 32, 160, 16), "gpt2": (None, None, 16, 160, 16)}
# The models users bring: the builder in user_models.py of each.
USER_MODELS = {"resnet18-ema": "resnet18_ema", "gpt2": "gpt2"}
TOKENS = 16


def Transformer(width, depth):
    """A stack of pre-norm blocks with 18 parameter tensors each (q, k, v, o, a gated
    feed-forward's three projections, two LayerNorms), mean-pooled into 10 classes."""
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
            self.q, self.k, self.v, self.o = (torch.nn.Linear(width, width) for _ in range(4))
            self.gate = torch.nn.Linear(width, 2 * width)
            self.up = torch.nn.Linear(width, 2 * width)
            self.down = torch.nn.Linear(2 * width, width)

        def forward(self, x):
            h = self.norm1(x)
            attention = F.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h))
            x = x + self.o(attention)
            h = self.norm2(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.Sequential(*(Block() for _ in range(depth)))
            self.head = torch.nn.Linear(width, 10)

        def forward(self, x):
            return self.head(self.blocks(x).mean(1))

    return Model()


def peak_memory(device):
    """Peak bytes this process has held: on CUDA allocated by torch, else resident."""
    import resource
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def launch(np_, args, memory_of=None):
    out = tempfile.mktemp(suffix=".json")
    script = [HERE, "--worker", "--out", out, "--steps", str(args.steps), "--warmup",
              str(args.warmup), "--rounds", str(args.rounds), "--batch-size", str(args.batch_size),
              "--commit-every", str(args.commit_every), "--device", args.device,
              "--snapshot-budget", str(args.snapshot_budget).lower(),
              "--model", args.model]
    if args.measure_noise:
        script.append("--measure-noise")
    if memory_of:
        script += ["--memory-of", memory_of]
    # Both loops live in one process: together they name more collectives
    # (434 per step on the transformer, plus each loop's broadcasts) than
    # Horovod's response cache holds by default (1024), and evictions would
    # slow whichever loop ran second; either loop alone fits.
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1", HOROVOD_CACHE_CAPACITY="8192")
    if np_ == 1:
        command = [sys.executable] + script
    else:
        command = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", str(np_),
                   "-H", f"localhost:{np_}", "--gloo", "--network-interface", "lo",
                   sys.executable] + script
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def budget(text):
    """``--snapshot-budget``: a share of training time, ``none`` or ``default``."""
    if text.lower() in ("none", "default"):
        return None if text.lower() == "none" else "default"
    return float(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp-small,mlp-8m,mlp-25m",
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per loop (default: the model's)")
    parser.add_argument("--warmup", type=int, default=None, help="default: a tenth of --steps")
    parser.add_argument("--rounds", type=int, default=None,
                        help="alternations of the two loops (evens out drift on a shared machine)")
    parser.add_argument("--batch-size", type=int, default=None, help="global batch size")
    parser.add_argument("--memory-of", choices=["plain", "hvd_adapt"], help=argparse.SUPPRESS)
    parser.add_argument("--commit-every", type=int, default=1,
                        help="the hvd_adapt loop commits every N steps (default 1: every step)")
    parser.add_argument("--snapshot-budget", type=budget, default="default",
                        help="the share of training time commits' snapshots may take "
                             "(default: the State's, 0.03); none: every commit snapshots")
    parser.add_argument("--procs", default="1,2")
    parser.add_argument("--measure-noise", action="store_true",
                        help="the hvd_adapt loop measures the gradient noise scale too")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--json", default=None,
                        help="also write the rows, command, machine and commit here "
                             "(relative: under benchmarks/results/)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    models = args.model.split(",")
    for name in models:
        if name not in MODELS:
            parser.error(f"--model {name!r} is not one of {', '.join(MODELS)}")
    print({"default": "snapshot budget: the State's default",
           None: "snapshot budget: none (every commit snapshots)"}.get(
        args.snapshot_budget, f"snapshot budget: {args.snapshot_budget} of the training time"))
    print(f"{'model':>14} {'procs':>5} {'commit_every':>12} {'plain_ms':>9} {'hvd_adapt_ms':>13} {'ratio':>6} "
          f"{'90% interval':>13} {'mean_ratio':>10} {'steps':>6} {'plain_MiB':>9} "
          f"{'hvd_adapt_MiB':>13} {'ledger_ms':>9} {'ledger_share':>12}")
    worst = 0.0
    rows = []
    for name in models:
        _, _, batch, steps, rounds = MODELS[name]
        run = argparse.Namespace(**vars(args))
        run.model = name
        run.batch_size = args.batch_size or batch
        run.steps = args.steps or steps
        run.warmup = args.warmup if args.warmup is not None else max(run.steps // 10, 4)
        run.rounds = args.rounds or rounds
        if run.steps < 2 * run.rounds:
            # A round's ratio needs at least two timed steps of each loop.
            parser.error(f"--steps {run.steps} must be at least 2 x --rounds ({run.rounds}) "
                         f"for {name}")
        for np_ in [int(p) for p in args.procs.split(",")]:
            r = launch(np_, run)
            mem = {loop: launch(np_, run, memory_of=loop)["peak_bytes"] / 2 ** 20
                   for loop in ("plain", "hvd_adapt")}
            ratio = r["ratio"]
            worst = max(worst, ratio)
            mean_ratio = r["hvd_adapt_mean"] / r["plain_mean"]
            low, high = r["ratio_interval"]
            interval = f"{low:.3f}-{high:.3f}"
            print(f"{name:>14} {np_:>5} {args.commit_every:>12} {r['plain'] * 1e3:>9.3f} {r['hvd_adapt'] * 1e3:>13.3f} "
                  f"{ratio:>6.3f} {interval:>13} {mean_ratio:>10.3f} {r['steps']:>6} "
                  f"{mem['plain']:>9.1f} {mem['hvd_adapt']:>13.1f} {r['ledger'] * 1e3:>9.3f} "
                  f"{r['ledger_share']:>12.4f}", flush=True)
            rows.append({"model": name, "procs": np_, "commit_every": args.commit_every,
                         "snapshot_budget": args.snapshot_budget,
                         "plain_ms": r["plain"] * 1e3,
                         "hvd_adapt_ms": r["hvd_adapt"] * 1e3, "ratio": ratio,
                         "interval": [low, high], "mean_ratio": mean_ratio, "steps": r["steps"],
                         "plain_mib": mem["plain"], "hvd_adapt_mib": mem["hvd_adapt"],
                         "ledger_ms": r["ledger"] * 1e3, "ledger_share": r["ledger_share"]})
    print(f"overhead_ratio={worst:.3f} (goal <= {1.05 if args.measure_noise else 1.03})")
    if args.json:
        import record
        record.write(args.json, {"measure_noise": args.measure_noise, "device": args.device,
                                 "commit_every": args.commit_every,
                                 "snapshot_budget": args.snapshot_budget, "rows": rows})
    return worst


if __name__ == "__main__":
    main()
