"""Handwritten digits with adaptive batch sizes: the main hvd_adapt example.

A small MLP on scikit-learn's bundled 8x8 digits (no download). The loader
starts at a global batch of 32 and lets hvd_adapt grow it for goodput up to
512; validation metrics are summed over replicas with an Accumulator; a
checkpoint is written between epochs (and on SIGTERM), so a job killed
outright resumes where it stopped.

    python examples/digits/train.py                        # one process
    horovodrun -np 2 -H localhost:2 python examples/digits/train.py
    horovodrun -np 2 --min-np 1 --max-np 3 --network-interface lo \\
        --host-discovery-script examples/elastic/discover.sh \\
        python examples/digits/train.py                    # elastic
"""
import argparse
import logging
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

import hvd_adapt


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="initial global batch size")
    parser.add_argument("--max-batch-size", type=int, default=512)
    parser.add_argument("--max-local-bsz", type=int, default=128,
                        help="largest batch one replica may load at once (memory bound)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--no-autoscale", action="store_true", help="keep the batch size fixed")
    parser.add_argument("--epochs-by-progress", action="store_true",
                        help="an epoch lasts one pass's worth of progress at the initial batch "
                             "size (AdaScale gain counted), not one pass")
    parser.add_argument("--batches-per-commit", type=int, default=10,
                        help="batches between commits of the elastic state (hosts are checked "
                             "after every batch)")
    parser.add_argument("--checkpoint", default=None, help="checkpoint file (resumed if present)")
    parser.add_argument("--tensorboard", default=None, help="TensorBoard log directory")
    parser.add_argument("--target-accuracy", type=float, default=None,
                        help="stop once validation accuracy reaches this")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--amp", action="store_true",
                        help="mixed precision: autocast (bf16 on CPU, fp16 on CUDA) with a GradScaler")
    parser.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                        help="clip the averaged gradients' norm to MAX_NORM")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: this replica's GPU where CUDA is available, else the CPU")
    args = parser.parse_args(argv)
    if args.batches_per_commit < 1:
        parser.error(f"--batches-per-commit must be >= 1, got {args.batches_per_commit}")
    if args.clip is not None and not args.clip > 0:
        parser.error(f"--clip must be > 0, got {args.clip}")
    return args


def digits_datasets(seed=0):
    """80/20 split of the 1797 digits, standardised with training statistics."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order].astype(np.float32), y[order]
    split = int(0.8 * len(x))
    mean, std = x[:split].mean(0), x[:split].std(0) + 1e-6
    x = (x - mean) / std
    to_set = lambda a, b: TensorDataset(torch.from_numpy(a), torch.from_numpy(b).long())  # noqa: E731
    return to_set(x[:split], y[:split]), to_set(x[split:], y[split:])


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def main(argv=None):
    args = parse_args(argv)
    # hvd_adapt logs its batch-size decisions at INFO on rank 0.
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("hvd_adapt").setLevel(logging.INFO)
    hvd_adapt.init()
    rank = hvd_adapt.env.rank()
    torch.manual_seed(0)
    train_set, val_set = digits_datasets()

    device = hvd_adapt.env.device(args.device)
    model = make_model().to(device)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type) if args.amp else None
    opt = hvd_adapt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), grad_scaler=scaler)
    train_loader = hvd_adapt.AdaptiveDataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    if not args.no_autoscale:
        train_loader.autoscale_batch_size(args.max_batch_size,
                                          local_bsz_bounds=(8, args.max_local_bsz),
                                          gradient_accumulation=True,
                                          epochs_by_progress=args.epochs_by_progress)
    val_loader = hvd_adapt.AdaptiveDataLoader(val_set, batch_size=256)
    stats = hvd_adapt.Accumulator()
    state = hvd_adapt.State(model=model, optimizer=opt, loader=train_loader,
                            val_loader=val_loader, stats=stats, best_accuracy=0.0)
    if args.checkpoint:
        hvd_adapt.install_sigterm_drain(state, checkpoint_path=args.checkpoint)
        # Collective: every rank starts from the newest checkpoint any of them sees.
        if state.load_checkpoint(args.checkpoint) and rank == 0:
            print(f"resumed from {args.checkpoint} at epoch {state.epoch}", flush=True)

    writer = None
    if args.tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(args.tensorboard)

    @hvd_adapt.run
    def train(state):
        for epoch in hvd_adapt.remaining_epochs_until(args.epochs, checkpoint=args.checkpoint):
            model.train()
            started = time.time()
            batches = train_loader
            if rank == 0 and not args.quiet:
                from tqdm import tqdm
                batches = tqdm(train_loader, desc=f"epoch {epoch}", leave=False)
            for step, (x, y) in enumerate(batches, 1):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                opt.zero_grad()
                with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
                    loss = F.cross_entropy(model(x), y)
                if scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
                # Gradients are averaged over replicas when backward returns, so
                # unscaling, clipping and the scaler's skip decision agree on every
                # rank; as with any accumulation, only at the end of a cycle.
                if train_loader.is_optim_step():
                    if scaler is not None:
                        opt.synchronize()
                        scaler.unscale_(opt)
                    if args.clip is not None:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                    if scaler is not None:
                        with opt.skip_synchronize():
                            scaler.step(opt)
                        scaler.update()
                    else:
                        opt.step()
                real = len(y) - train_loader.num_padded
                stats["train_loss"] += loss.item() * real
                stats["train_n"] += real
                if step % args.batches_per_commit == 0:
                    state.commit()
                else:
                    state.check_host_updates()

            model.eval()
            with torch.no_grad():
                for x, y in val_loader:
                    x, y = x.to(device), y.to(device)
                    real = len(y) - val_loader.num_padded
                    logits = model(x)[:real].float()
                    stats["val_loss"] += F.cross_entropy(logits, y[:real], reduction="sum").item()
                    stats["val_correct"] += int((logits.argmax(1) == y[:real]).sum())
                    stats["val_n"] += real
            with stats.synchronized():
                accuracy = stats["val_correct"] / stats["val_n"]
                state.best_accuracy = max(state.best_accuracy, accuracy)
                if rank == 0:
                    print(f"epoch {epoch:3d}  samples {stats['train_n']}"
                          f"  train_loss {stats['train_loss'] / stats['train_n']:.4f}"
                          f"  val_loss {stats['val_loss'] / stats['val_n']:.4f}"
                          f"  val_acc {accuracy:.4f}  {train_loader.progress_line()}"
                          f"  {time.time() - started:.1f}s", flush=True)
                if writer is not None:
                    writer.add_scalar("val/accuracy", accuracy, epoch)
                    writer.add_scalar("val/loss", stats["val_loss"] / stats["val_n"], epoch)
                    train_loader.to_tensorboard(writer, epoch)
                stats.clear()
            if args.target_accuracy is not None and accuracy >= args.target_accuracy:
                return epoch + 1
        return args.epochs

    epochs_run = train(state)
    if rank == 0:
        print(f"final validation accuracy {state.best_accuracy:.4f} (best over {epochs_run} epochs, "
              f"{hvd_adapt.env.size()} replica{'s' if hvd_adapt.env.size() > 1 else ''})",
              flush=True)
    if writer is not None:
        writer.close()
    return state.best_accuracy, epochs_run


if __name__ == "__main__":
    main()
