"""Optimizer state on disk (``swap_dir``) against raw disk I/O and against the state in
memory, in one invocation.

- **disk**: the swapper's writes and reads of a ``--state-gb`` state through its own I/O
  (``hvd_adapt/swap/io.py``'s ``windows``: the file a buffer at a time, every buffer of
  the pool in flight, its requests on the I/O threads, as a step moves its chunks; a
  write into a file reserved with ``posix_fallocate``), against raw ``pwrite``/``pread``
  at the **same concurrency and request size** (``--workers`` threads, 8 MiB requests):
  both read the swapper's live file, both write a file reserved the same way.
  ``O_DIRECT`` on both sides (no page cache), interleaved, ``--rounds`` rounds; medians
  and ranges.
- **memory and step time**: an AdamW job whose largest parameter is an embedding
  (>= 25% of the parameters), its state ``--jobs-gb`` GB each, swapped against in
  memory, each in a process of its own, ``--job-rounds`` rounds of the two in
  alternating order: peak RSS (``VmHWM``) saved over the state's bytes, and the
  median optimizer step with ``--micro`` micro-steps against the physical bound
  max(in-memory step, state / raw read + state / raw write), a ratio per round
  (median and range), beside this design's floor (the in-memory micro-steps, then the
  state's I/O or the in-memory optimizer step, whichever is longer) over the same
  bound, and the swapped step over that floor, with where each job's step goes
  (micro-steps and optimizer; for the swapped one its reads and writes, waits,
  compute, copies and agreements, and the bytes it moved, per step).
- **memory at default settings**: where users start, an AdamW state of about 200 MB
  (24 x Linear(1024, 1024)) swapped with no ``swap_buffer_mb``: peak RSS saved over
  the state's bytes (goal >= 0.7), against the same job in memory.

    python benchmarks/optimizer_swap.py --swap-dir /path/on/a/local/disk [--state-gb 2]
                                        [--jobs-gb 0.5,2] [--rounds 6] [--job-rounds 3]
                                        [--json out.json]
"""
import argparse
import concurrent.futures
import json
import os
import shutil
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
    import types
    from hvd_adapt.swap.files import StateFiles
    from hvd_adapt.swap.io import IO_BYTES, AlignedBuffer, BufferPool, windows
    from hvd_adapt.swap.step import BUFFERS
    buffer_bytes = 16 << 20         # the pool's buffers at their default's largest
    nbytes = max(1, round(state_gb * 1e9 / buffer_bytes)) * buffer_bytes
    files, layout = StateFiles(folder), types.SimpleNamespace(nbytes=nbytes)
    pool = BufferPool(BUFFERS, buffer_bytes, pin=False)
    io = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
    buffers = [AlignedBuffer(IO_BYTES, pin=False) for _ in range(workers)]
    for buffer in buffers:
        buffer.bytes.random_(0, 255)

    def swap_write():
        with files.new(layout) as (_, writer):
            windows(io, pool, writer, nbytes, True)

    def swap_read():
        reader = files.open(files.live)
        try:
            windows(io, pool, reader, nbytes, False)
        finally:
            reader.close()

    def raw(path, write):
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
        list(io.map(request, range(0, nbytes, IO_BYTES)))
        os.close(fd)

    swap_write()        # the live file both sides read
    live = os.path.join(files.root, files.live.name)
    results = {key: [] for key in ("swap_write", "raw_write", "swap_read", "raw_read")}
    for r in range(rounds):
        # The two sides back to back in each direction, the first alternating: a read that
        # follows writes may share the disk with their write-back (a VM's disk is a file
        # on its host), and each side is that read as often.
        for direction in ("read", "write"):
            for kind in ("swap", "raw") if r % 2 == 0 else ("raw", "swap"):
                started = time.perf_counter()
                if kind == "swap":
                    (swap_write if direction == "write" else swap_read)()
                elif direction == "write":
                    # Removed inside the timing, as the swapper's file it replaces goes.
                    path = os.path.join(folder, f"raw{r}.bin")
                    raw(path, True)
                    os.remove(path)
                else:
                    raw(live, False)
                results[f"{kind}_{direction}"].append(time.perf_counter() - started)
    io.shutdown()
    pool.release()
    shutil.rmtree(files.root, ignore_errors=True)
    os.close(files.fd)
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
    """One job: ``--mode memory|swap``, ``--micro`` micro-steps per optimizer step; the model
    ``--gb`` (an embedding and layers, see :func:`model_for`) or, with ``--gb 0``,
    ``--default-layers`` x Linear(1024, 1024)."""
    import torch
    import hvd_adapt
    hvd_adapt.init()
    torch.manual_seed(0)
    tokens = torch.Generator().manual_seed(1)
    if args.gb:
        vocab, layers = model_for(args.gb)
        model = torch.nn.Sequential(
            torch.nn.EmbeddingBag(vocab, WIDTH),
            *[m for _ in range(layers) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())])

        def batch():
            return torch.randint(vocab, (args.batch, 16), generator=tokens)
    else:
        vocab, model = 0, torch.nn.Sequential(*[torch.nn.Linear(1024, 1024)
                                                for _ in range(args.default_layers)])

        def batch():
            return torch.randn(args.batch, 1024, generator=tokens)
    opt = hvd_adapt.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01),
        swap_dir=args.swap_dir if args.mode == "swap" else None, measure_noise=False,
        swap_buffer_mb=args.buffer_mb)
    state_bytes = sum(2 * p.numel() * p.element_size() for p in model.parameters())
    times, micro, stepping = [], [], []
    for step in range(args.steps + 1):
        started = time.perf_counter()
        opt.zero_grad()
        for _ in range(args.micro):
            model(batch()).pow(2).mean().backward()
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


def launch(mode, gb, args, micro=None):
    out = tempfile.mktemp(suffix=".json")
    command = [sys.executable, HERE, "--worker", "--mode", mode, "--gb", str(gb), "--out", out,
               "--micro", str(micro or args.micro), "--steps", str(args.steps), "--batch",
               str(args.batch), "--swap-dir", args.swap_dir,
               "--default-layers", str(args.default_layers)] + (
        ["--buffer-mb", str(args.buffer_mb)] if args.buffer_mb else [])
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    return result


def default_memory(args):
    """Peak RSS of ``--default-layers`` x Linear(1024, 1024) with AdamW, in memory and
    swapped with the library's default buffers, ``--job-rounds`` rounds alternating: saved
    over the state."""
    if args.buffer_mb:
        return None         # only where users start: no swap_buffer_mb
    rounds = []
    for r in range(args.job_rounds):
        order = ("memory", "swap") if r % 2 == 0 else ("swap", "memory")
        rounds.append({mode: launch(mode, 0, args, micro=1) for mode in order})
    state = rounds[0]["swap"]["state_bytes"]
    saved = [(r["memory"]["peak_bytes"] - r["swap"]["peak_bytes"]) / state for r in rounds]
    print(f"memory at default settings: {args.default_layers} x Linear(1024, 1024), AdamW state "
          f"{state / 1e6:.0f} MB: peak RSS in memory "
          f"{statistics.median(r['memory']['peak_bytes'] for r in rounds) / 1e6:.0f} MB, "
          f"swapped {statistics.median(r['swap']['peak_bytes'] for r in rounds) / 1e6:.0f} MB, "
          f"saved/state {spread(saved)} (goal >= 0.7)", flush=True)
    return {"layers": args.default_layers, "state_bytes": state, "saved_over_state_rounds": saved,
            "memory_peak_bytes": [r["memory"]["peak_bytes"] for r in rounds],
            "swap_peak_bytes": [r["swap"]["peak_bytes"] for r in rounds]}


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
    parser.add_argument("--buffer-mb", type=float, default=None,
                        help="each swap buffer (default: the library's, as users start)")
    parser.add_argument("--default-layers", type=int, default=24,
                        help="Linear(1024, 1024) layers of the job at default settings")
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
          f"{'swap/bound':>10} {'floor/bound':>11} {'swap/floor':>10} {'memory GB':>10} "
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
        # moves the state in and out once (its compute overlapping that I/O). Nothing goes
        # to disk during the micro-steps; hiding state I/O there would take buffers as large
        # as the I/O hidden (docs/optimizer-state-on-disk.md, "The floor").
        floor_s = [r["memory"]["micro_s"] + max(r["memory"]["optimizer_s"], io_bound)
                   for r in rounds]
        floors = [floor / bound for floor, bound in zip(floor_s, bounds)]
        over_floor = [r["swap"]["step_s"] / floor for r, floor in zip(rounds, floor_s)]

        def median(mode, key):
            return statistics.median(r[mode][key] for r in rounds)
        row = {"state_gb": state / 1e9, "embedding_share": rounds[0]["swap"]["embedding_share"],
               "memory_step_s": median("memory", "step_s"), "swap_step_s": median("swap", "step_s"),
               "bound_s": statistics.median(bounds), "swap_over_bound": statistics.median(ratios),
               "swap_over_bound_rounds": ratios, "floor_over_bound_rounds": floors,
               "swap_over_floor_rounds": over_floor,
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
              f"{spread(ratios):>10} {spread(floors):>11} {spread(over_floor):>10} "
              f"{row['memory_peak_bytes'] / 1e9:>10.2f} {row['swap_peak_bytes'] / 1e9:>8.2f} "
              f"{row['saved_over_state']:>11.2f}", flush=True)
        phases = row["phases"]
        print("    per step, s: " + ", ".join(
            f"{key} {value:.3f}" for key, value in phases.items() if key.endswith("_s")),
            flush=True)
        print(f"    per step, MB: read {phases['swap_read_bytes'] / 1e6:.0f}, written "
              f"{phases['swap_written_bytes'] / 1e6:.0f}", flush=True)
    results["default_memory"] = default_memory(args)
    results["runs"] = runs
    if args.json:
        import record
        record.write(args.json, results)
    return results


if __name__ == "__main__":
    main()
