"""BERT-style masked-LM pretraining on generated tokens, the shape of a large-scale script.

A small transformer encoder (torch.nn) learns to fill in masked tokens of
sequences drawn from a fixed random Markov chain, so there is something to
learn and nothing to download. Like a real pretraining job it has a linear
warm-up and decay of the learning rate, gradient accumulation (when the
global batch exceeds --max-local-bsz per replica), a samples/s line every
--log-every optimizer steps, checkpoints every --save-every steps named
``epoch{E}_step{S}``, resumption from one of them (epoch, global step, data
position, LR schedule), --max-steps, and validation loss after each epoch.

    python examples/bert_pretrain/train.py --epochs 2
    python examples/bert_pretrain/train.py --swap-dir /scratch/swap  # AdamW state on disk
    python examples/bert_pretrain/train.py --load-checkpoint ckpt --checkpoint-id epoch0_step40
    horovodrun -np 2 -H localhost:2 python examples/bert_pretrain/train.py
    horovodrun -np 2 --min-np 1 --max-np 3 --network-interface lo \\
        --host-discovery-script examples/elastic/discover.sh python examples/bert_pretrain/train.py
"""
import argparse
import logging
import math
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import hvd_adapt

PAD, MASK, FIRST_WORD = 0, 1, 2


class MarkovTokens(Dataset):
    """Sequences from a fixed sparse random Markov chain over the vocabulary."""

    def __init__(self, num_sequences, seq_len, vocab, seed):
        gen = torch.Generator().manual_seed(1234)
        words = vocab - FIRST_WORD
        # Each token has 4 likely successors: predictable from context.
        successors = torch.randint(0, words, (words, 4), generator=gen)
        gen.manual_seed(seed)
        seqs = torch.empty(num_sequences, seq_len, dtype=torch.long)
        seqs[:, 0] = torch.randint(0, words, (num_sequences,), generator=gen)
        for t in range(1, seq_len):
            choice = torch.randint(0, 4, (num_sequences,), generator=gen)
            seqs[:, t] = successors[seqs[:, t - 1], choice]
        self.tokens = seqs + FIRST_WORD

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i], i


class MaskingCollate:
    """Masks 15% of tokens, deterministically per sample index (so replays mask alike)."""

    def __init__(self, seed):
        self.seed = seed

    def __call__(self, batch):
        tokens = torch.stack([t for t, _ in batch])
        gen = torch.Generator().manual_seed(self.seed + sum(int(i) for _, i in batch))
        masked = torch.rand(tokens.shape, generator=gen) < 0.15
        masked[:, 0] |= ~masked.any(1)
        inputs = tokens.masked_fill(masked, MASK)
        labels = tokens.masked_fill(~masked, -100)
        return inputs, labels


class TinyBert(torch.nn.Module):
    def __init__(self, vocab, seq_len, dim=64, layers=2, heads=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=PAD)
        self.position = torch.nn.Parameter(torch.zeros(seq_len, dim))
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.position))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--max-local-bsz", type=int, default=32,
                        help="per-replica batch that fits in memory; above it, accumulate")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=40)
    parser.add_argument("--checkpoint-dir", default="checkpoints/bert")
    parser.add_argument("--load-checkpoint", default=None, help="directory to resume from")
    parser.add_argument("--checkpoint-id", default=None, help="e.g. epoch0_step40 (default: latest)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: this replica's GPU where CUDA is available, else the CPU")
    parser.add_argument("--swap-dir", default=None,
                        help="keep AdamW's state in files under this folder (a local disk), "
                             "with only a few buffers of it in memory")
    parser.add_argument("--swap-buffer-mb", type=float, default=None,
                        help="size of each swap buffer (default: the largest parameter's state)")
    return parser.parse_args(argv)


def latest_checkpoint(directory):
    ids = [f[:-3] for f in os.listdir(directory) if f.startswith("epoch") and f.endswith(".pt")]
    if not ids:
        raise FileNotFoundError(f"no epoch*_step*.pt checkpoint in {directory}")
    return max(ids, key=lambda i: int(i.split("_step")[1]))


def main(argv=None):
    args = parse_args(argv)
    # hvd_adapt logs its batch-size decisions at INFO on rank 0.
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("hvd_adapt").setLevel(logging.INFO)
    hvd_adapt.init()
    rank = hvd_adapt.env.rank()
    torch.manual_seed(0)
    train_set = MarkovTokens(args.sequences, args.seq_len, args.vocab, seed=1)
    val_set = MarkovTokens(max(256, args.sequences // 16), args.seq_len, args.vocab, seed=2)

    device = hvd_adapt.env.device(args.device)
    model = TinyBert(args.vocab, args.seq_len).to(device)
    opt = hvd_adapt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr,
                                                           weight_decay=0.01),
                                         swap_dir=args.swap_dir,
                                         swap_buffer_mb=args.swap_buffer_mb)
    loader = hvd_adapt.AdaptiveDataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                                          collate_fn=MaskingCollate(seed=10))
    # max_batch_size = batch_size: a fixed global batch, split into
    # accumulation steps where it does not fit one replica's memory.
    loader.autoscale_batch_size(args.batch_size, local_bsz_bounds=(1, args.max_local_bsz),
                                gradient_accumulation=True)
    val_loader = hvd_adapt.AdaptiveDataLoader(val_set, batch_size=128,
                                              collate_fn=MaskingCollate(seed=20))
    steps_per_epoch = math.ceil(len(train_set) / args.batch_size)
    total_steps = args.max_steps or args.epochs * steps_per_epoch

    def warmup_then_decay(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - args.warmup_steps))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_decay)
    stats = hvd_adapt.Accumulator()
    state = hvd_adapt.State(model=model, optimizer=opt, loader=loader, val_loader=val_loader,
                            schedule=schedule, stats=stats, global_step=0)
    if args.load_checkpoint:
        checkpoint_id = args.checkpoint_id or latest_checkpoint(args.load_checkpoint)
        path = os.path.join(args.load_checkpoint, checkpoint_id + ".pt")
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        state.load_checkpoint(path)
        if rank == 0:
            print(f"resumed {path}: epoch {state.epoch}, step {state.global_step}, "
                  f"{loader.sampler.position} samples into the epoch", flush=True)

    @hvd_adapt.run
    def train(state):
        window_start, window_samples = time.perf_counter(), 0
        for epoch in hvd_adapt.remaining_epochs_until(args.epochs):
            model.train()
            for inputs, labels in loader:
                inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                logits = model(inputs)
                loss = F.cross_entropy(logits.reshape(-1, args.vocab), labels.reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                window_samples += (len(inputs) - loader.num_padded) * hvd_adapt.env.size()
                if not loader.is_optim_step():
                    continue
                schedule.step()
                state.global_step += 1
                state.commit()
                step = state.global_step
                if rank == 0 and step % args.log_every == 0:
                    now = time.perf_counter()
                    print(f"step {step:5d}  loss {loss.item():.4f}  lr {schedule.get_last_lr()[0]:.2e}"
                          f"  samples/s {window_samples / (now - window_start):.1f}"
                          f"  {loader.progress_line()}", flush=True)
                    window_start, window_samples = now, 0
                if step % args.save_every == 0:
                    state.save_checkpoint(os.path.join(args.checkpoint_dir,
                                                       f"epoch{epoch}_step{step}.pt"))
                if args.max_steps is not None and step >= args.max_steps:
                    return step
            model.eval()
            with torch.no_grad():
                for inputs, labels in val_loader:
                    inputs, labels = inputs.to(device), labels.to(device)
                    real = len(inputs) - val_loader.num_padded
                    logits = model(inputs[:real])
                    stats["val_loss"] += F.cross_entropy(logits.reshape(-1, args.vocab),
                                                         labels[:real].reshape(-1),
                                                         reduction="sum").item()
                    stats["val_tokens"] += int((labels[:real] != -100).sum())
            with stats.synchronized():
                if rank == 0:
                    print(f"epoch {epoch}  validation loss "
                          f"{stats['val_loss'] / stats['val_tokens']:.4f}", flush=True)
                stats.clear()
        return state.global_step

    steps = train(state)
    if rank == 0:
        print(f"done after {steps} steps", flush=True)
    return steps


if __name__ == "__main__":
    main()
