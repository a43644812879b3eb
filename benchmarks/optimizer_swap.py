"""Optimizer state on disk (``swap_dir``) against raw disk I/O and against the state in
memory, in one invocation.

- **disk**: the swapper's writes and reads of a ``--state-gb`` state, as it moves a
  whole generation (``move_bytes``: its one pipeline, the pool's buffers cut into
  request-sized slots in flight on its I/O threads, checked transfers; a write
  reserves a new file with ``posix_fallocate``), against raw
  ``pwrite``/``pread`` at the **same concurrency and request size** (``--workers``
  threads, 8 MiB requests): both read the swapper's live generation file, both
  write a fresh file reserved the same way. ``O_DIRECT`` on both sides (no page
  cache), interleaved, ``--rounds`` rounds; medians and ranges.
- **memory and step time**: an AdamW job whose largest parameter is an embedding
  (>= 25% of the parameters), its state ``--jobs-gb`` GB each, swapped against in
  memory, each in a process of its own, ``--job-rounds`` rounds of the two in
  alternating order: peak RSS (``VmHWM``) saved over the state's bytes, and the
  median optimizer step with ``--micro`` micro-steps against the physical bound
  max(in-memory step, state / raw read + state / raw write), a ratio per round
  (median and range), beside this design's floor (the in-memory micro-steps, then the
  state's I/O or the in-memory optimizer step, whichever is longer) over the same
  bound, with where each job's step goes (micro-steps and
  optimizer; for the swapped one its reads and writes, waits, compute, copies
  and agreements, and the bytes it wrote and found written ahead, per step).

    python benchmarks/optimizer_swap.py --swap-dir /path/on/a/local/disk [--state-gb 2]
                                        [--jobs-gb 0.5,2] [--rounds 6] [--job-rounds 3]
                                        [--json out.json]
"""
import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.abspath(__file__)
WIDTH = 2048
SIDE = 4096                 # the disk test's parameters: SIDE x SIDE fp32


def disk(folder, state_gb, rounds, workers):
    """Rounds of swapper and raw writes and reads of the same bytes, interleaved."""
    import torch
    from hvd_adapt.optim.swap import IO_BYTES, SwappedState
    from hvd_adapt.optim.swap_io import AlignedBuffer
    count = max(1, round(state_gb * 1e9 / (2 * 4 * SIDE * SIDE)))
    params = [torch.nn.Parameter(torch.empty(SIDE, SIDE)) for _ in range(count)]
    swapped = SwappedState(torch.optim.AdamW(params), folder, workers=workers, o_direct=True)
    value = torch.randn(SIDE, SIDE)     # every entry's bytes: the state costs no memory
    states = {p: {"step": torch.tensor(1.0), "exp_avg": value, "exp_avg_sq": value}
              for p in params}
    buffers = [AlignedBuffer(IO_BYTES, pin=False) for _ in range(workers)]
    for buffer in buffers:
        buffer.bytes.random_(0, 255)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)

    def raw(path, nbytes, write):
        """``workers`` threads moving 8 MiB requests, each its own buffer, O_DIRECT; a short
        transfer is an error (the swapper checks every one too)."""
        flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL) if write else os.O_RDONLY
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
        if write:
            os.posix_fallocate(fd, 0, nbytes)
        local = threading.local()

        def request(offset):
            # One request per task from a shared queue, as the swapper dispatches them.
            if not hasattr(local, "view"):
                local.view = memoryview(buffers[next(lanes)].bytes.numpy())
            size = min(IO_BYTES, nbytes - offset)
            call = os.pwritev if write else os.preadv
            if call(fd, [local.view[:size]], offset) != size:
                raise OSError(f"short raw transfer at {offset}")

        lanes = iter(range(workers))
        list(pool.map(request, range(0, nbytes, IO_BYTES)))
        os.close(fd)

    swapped.load(states)
    nbytes = swapped.layout().nbytes
    live = os.path.join(swapped.root, f"gen{swapped.live}.bin")
    results = {key: [] for key in ("swap_write", "raw_write", "swap_read", "raw_read")}
    for r in range(rounds):
        # The two sides back to back in each direction, the first alternating: a read that
        # follows writes may share the disk with their write-back (a VM's disk is a file
        # on its host), and each side is that read as often.
        for direction in ("read", "write"):
            for kind in ("swap", "raw") if r % 2 == 0 else ("raw", "swap"):
                started = time.perf_counter()
                if kind == "swap":
                    swapped.move_bytes(write=direction == "write")
                elif direction == "write":
                    # Removed inside the timing, as the swapper removes its scratch file.
                    path = os.path.join(folder, f"raw{r}.bin")
                    raw(path, nbytes, True)
                    os.remove(path)
                else:
                    raw(live, nbytes, False)
                results[f"{kind}_{direction}"].append(time.perf_counter() - started)
    swapped.close()
    pool.shutdown()
    gbps = {key: [nbytes / 1e9 / s for s in values] for key, values in results.items()}
    return nbytes, gbps


def model_for(state_gb):
    """An embedding (40% of the parameters) and Linear(WIDTH, WIDTH) layers whose AdamW
    state (two fp32 moments) is ``state_gb``."""
    params = state_gb * 1e9 / 8
    vocab = int(0.4 * params / WIDTH)
    layers = max(1, round(0.6 * params / (WIDTH * WIDTH + WIDTH)))
    return vocab, layers


def worker(args):
    """One job: ``--mode memory|swap``, ``--micro`` micro-steps per optimizer step."""
    import torch
    import hvd_adapt
    hvd_adapt.init()
    torch.manual_seed(0)
    vocab, layers = model_for(args.gb)
    model = torch.nn.Sequential(
        torch.nn.EmbeddingBag(vocab, WIDTH),
        *[m for _ in range(layers) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())])
    opt = hvd_adapt.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01),
        swap_dir=args.swap_dir if args.mode == "swap" else None, measure_noise=False,
        swap_buffer_mb=args.buffer_mb)
    state_bytes = sum(2 * p.numel() * p.element_size() for p in model.parameters())
    tokens = torch.Generator().manual_seed(1)
    times, micro, stepping = [], [], []
    for step in range(args.steps + 1):
        started = time.perf_counter()
        opt.zero_grad()
        for _ in range(args.micro):
            x = torch.randint(vocab, (args.batch, 16), generator=tokens)
            model(x).pow(2).mean().backward()
        stepped = time.perf_counter()
        opt.step()
        if step:                        # the first step creates the state
            times.append(time.perf_counter() - started)
            micro.append(stepped - started)
            stepping.append(time.perf_counter() - stepped)
        if step == 0:
            first = opt.swap_metrics()
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    with open(args.out, "w") as f:
        swap = opt.swap_metrics()
        # The timed steps' own (the first creates the state), per step.
        timed = {key: (value - first[key]) / args.steps for key, value in swap.items()} \
            if swap else {}
        json.dump({"step_s": statistics.median(times), "peak_bytes": peak,
                   "micro_s": statistics.median(micro),
                   "optimizer_s": statistics.median(stepping), "swap_per_step": timed,
                   "state_bytes": state_bytes,
                   "embedding_share": vocab * WIDTH / sum(p.numel() for p in model.parameters()),
                   "swap": opt.swap_metrics()}, f)


def launch(mode, gb, args):
    out = tempfile.mktemp(suffix=".json")
    command = [sys.executable, HERE, "--worker", "--mode", mode, "--gb", str(gb), "--out", out,
               "--micro", str(args.micro), "--steps", str(args.steps), "--batch",
               str(args.batch), "--swap-dir", args.swap_dir, "--buffer-mb", str(args.buffer_mb)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    return result


def spread(values):
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swap-dir", default=None, help="default: a folder under /tmp")
    parser.add_argument("--state-gb", type=float, default=2.0, help="the disk test's state")
    parser.add_argument("--rounds", type=int, default=6,
                        help="the disk test's rounds (even: each side goes first as often)")
    parser.add_argument("--workers", type=int, default=4, help="I/O threads, both sides")
    parser.add_argument("--jobs-gb", default="0.5,2", help="the jobs' AdamW states, GB")
    parser.add_argument("--micro", type=int, default=4, help="micro-steps per optimizer step")
    parser.add_argument("--job-rounds", type=int, default=3,
                        help="rounds of the in-memory and swapped jobs, alternating")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    parser.add_argument("--batch", type=int, default=8, help="samples per micro-step")
    parser.add_argument("--buffer-mb", type=float, default=16, help="each swap buffer")
    parser.add_argument("--json", default=None,
                        help="also write the results here (relative: under benchmarks/results/)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--gb", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    args.swap_dir = args.swap_dir or tempfile.mkdtemp(prefix="hvd_adapt_swap_bench_")
    os.makedirs(args.swap_dir, exist_ok=True)
    nbytes, gbps = disk(args.swap_dir, args.state_gb, args.rounds, args.workers)
    results = {"disk_bytes": nbytes, "workers": args.workers, "rounds": args.rounds,
               "job_rounds": args.job_rounds,
               "disk_gbps": gbps}
    print(f"disk: {nbytes / 1e9:.2f} GB, {args.workers} threads, 8 MiB requests, O_DIRECT, "
          f"{args.rounds} rounds interleaved; GB/s median [range]")
    for kind in ("write", "read"):
        ratios = [s / r for s, r in zip(gbps[f"swap_{kind}"], gbps[f"raw_{kind}"])]
        print(f"  {kind:>5}: raw {spread(gbps[f'raw_{kind}'])}  swapper "
              f"{spread(gbps[f'swap_{kind}'])}  swapper/raw {spread(ratios)}")
    raw_read = statistics.median(gbps["raw_read"])
    raw_write = statistics.median(gbps["raw_write"])
    runs = []
    print(f"{'state GB':>8} {'emb':>5} {'memory s':>9} {'swap s':>7} {'bound s':>8} "
          f"{'swap/bound':>10} {'floor/bound':>11} {'hidden':>7} {'memory GB':>10} "
          f"{'swap GB':>8} {'saved/state':>11}")
    for gb in [float(g) for g in args.jobs_gb.split(",") if g]:
        rounds = []
        for r in range(args.job_rounds):
            order = ("memory", "swap") if r % 2 == 0 else ("swap", "memory")
            rounds.append({mode: launch(mode, gb, args) for mode in order})
        state = rounds[0]["swap"]["state_bytes"]
        io_bound = state / 1e9 / raw_read + state / 1e9 / raw_write
        bounds = [max(r["memory"]["step_s"], io_bound) for r in rounds]
        ratios = [r["swap"]["step_s"] / bound for r, bound in zip(rounds, bounds)]
        # The least this design can take: the micro-steps as in memory, then a step that
        # moves the state in and out once (its compute overlapping that I/O). Only the undo
        # copies go to disk during the micro-steps; hiding state I/O there would take
        # buffers as large as the I/O hidden (docs/optimizer-state-on-disk.md, "The floor").
        floors = [(r["memory"]["micro_s"] + max(r["memory"]["optimizer_s"], io_bound)) / bound
                  for r, bound in zip(rounds, bounds)]

        def median(mode, key):
            return statistics.median(r[mode][key] for r in rounds)
        stats = [r["swap"]["swap"] for r in rounds]
        row = {"state_gb": state / 1e9, "embedding_share": rounds[0]["swap"]["embedding_share"],
               "memory_step_s": median("memory", "step_s"), "swap_step_s": median("swap", "step_s"),
               "bound_s": statistics.median(bounds), "swap_over_bound": statistics.median(ratios),
               "swap_over_bound_rounds": ratios, "floor_over_bound_rounds": floors,
               "hidden": statistics.median(s["swap_hidden_s"] / s["swap_io_s"] if s["swap_io_s"]
                                           else 0 for s in stats),
               "memory_peak_bytes": median("memory", "peak_bytes"),
               "swap_peak_bytes": median("swap", "peak_bytes")}
        row["saved_over_state"] = (row["memory_peak_bytes"] - row["swap_peak_bytes"]) / state
        row["phases"] = {"memory_micro_s": median("memory", "micro_s"),
                         "memory_optimizer_s": median("memory", "optimizer_s"),
                         "swap_micro_s": median("swap", "micro_s"),
                         "swap_optimizer_s": median("swap", "optimizer_s"),
                         **{key: statistics.median(r["swap"]["swap_per_step"][key] for r in rounds)
                            for key in rounds[0]["swap"]["swap_per_step"]}}
        runs.append(row)
        print(f"{row['state_gb']:>8.2f} {row['embedding_share']:>5.2f} "
              f"{row['memory_step_s']:>9.2f} {row['swap_step_s']:>7.2f} {row['bound_s']:>8.2f} "
              f"{spread(ratios):>10} {spread(floors):>11} {row['hidden']:>7.2f} "
              f"{row['memory_peak_bytes'] / 1e9:>10.2f} {row['swap_peak_bytes'] / 1e9:>8.2f} "
              f"{row['saved_over_state']:>11.2f}", flush=True)
        phases = row["phases"]
        print("    per step, s: " + ", ".join(
            f"{key} {value:.3f}" for key, value in phases.items() if key.endswith("_s")),
            flush=True)
        print(f"    per step, MB: read {phases['swap_read_bytes'] / 1e6:.0f}, written "
              f"{phases['swap_written_bytes'] / 1e6:.0f}, undo copies found written ahead "
              f"{phases['swap_undo_ahead_used_bytes'] / 1e6:.0f}", flush=True)
    results["runs"] = runs
    if args.json:
        import record
        record.write(args.json, results)
    return results


if __name__ == "__main__":
    main()
