"""Optimizer state on disk (``swap_dir``) against the state in memory, in one invocation.

Three measurements, ratios side by side:

- **disk**: the swapper's write (``load``) and read (``read_back``, the way a
  step reads) of the state's bytes, against a plain sequential ``pwrite``/
  ``pread`` of the same bytes in 8 MiB pieces on the same file system
  (``O_DIRECT`` where it takes it, so the page cache does not answer);
- **memory**: peak RSS (``VmHWM``) of an AdamW job whose optimizer state
  is ``--state-gb`` (an MLP of 4096-wide layers), swapped against in memory,
  each in a process of its own;
- **step time**: the median optimizer step of that job, swapped over in
  memory, at 1 and 2 processes, with 1 and 4 micro-steps of accumulation,
  and the fraction of the swap's I/O time hidden behind the optimizer's
  own work (1 - waited / (read + write)).

DeepSpeed's swapper, at its published 3.7 GB/s read and 3.2 GB/s write on one
PCIe Gen4 drive, is printed beside: the seconds the same bytes would take.

    python benchmarks/optimizer_swap.py --swap-dir /path/on/a/local/disk [--state-gb 2]
                                        [--procs 1,2] [--steps 3] [--json out.json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
WIDTH = 4096
PIECE = 8 << 20
DEEPSPEED_READ_GBPS, DEEPSPEED_WRITE_GBPS = 3.7, 3.2


def layers_for(state_gb):
    """Linear(4096, 4096) layers whose AdamW state (two fp32 moments) is ``state_gb``."""
    per_layer = 2 * 4 * (WIDTH * WIDTH + WIDTH)
    return max(1, round(state_gb * 1e9 / per_layer))


def raw_disk(folder, nbytes):
    """Seconds to write then read ``nbytes`` sequentially in one file of ``folder``."""
    from hvd_adapt.optim.swap import AlignedBuffer
    buffer = AlignedBuffer(PIECE, pin=False)
    buffer.bytes.random_(0, 255)
    view = memoryview(buffer.bytes.numpy())
    path = os.path.join(folder, "raw.bin")
    flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
        direct = True
    except OSError:
        fd, direct = os.open(path, flags, 0o600), False
    started = time.perf_counter()
    for offset in range(0, nbytes, PIECE):
        os.pwritev(fd, [view], offset)
    os.fsync(fd)
    write = time.perf_counter() - started
    os.close(fd)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    started = time.perf_counter()
    for offset in range(0, nbytes, PIECE):
        os.preadv(fd, [view], offset)
    read = time.perf_counter() - started
    os.close(fd)
    os.remove(path)
    return write, read, direct


def swapper_disk(folder, layers):
    """Seconds the swapper takes to write (load) and read back the state of ``layers``."""
    import torch
    from hvd_adapt.optim.swap import SwappedState
    params = [torch.nn.Parameter(torch.empty(WIDTH, WIDTH)) for _ in range(layers)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    swapped = SwappedState(opt, folder)
    states = {p: {"step": torch.tensor(1.0), "exp_avg": torch.randn(WIDTH, WIDTH),
                  "exp_avg_sq": torch.rand(WIDTH, WIDTH)} for p in params}
    started = time.perf_counter()
    swapped.load(states)
    write = time.perf_counter() - started
    del states
    started = time.perf_counter()
    nbytes = swapped.read_back()
    read = time.perf_counter() - started
    swapped.close()
    return write, read, nbytes


def worker(args):
    """One job: ``--mode memory|swap``, ``--micro`` micro-steps per optimizer step."""
    import statistics
    import horovod.torch as hvd
    import torch
    import hvd_adapt
    hvd_adapt.init()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(args.layers)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())])
    opt = hvd_adapt.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01),
        swap_dir=args.swap_dir if args.mode == "swap" else None, measure_noise=False)
    micro = int(args.micro)
    batch = args.batch * hvd.size() * micro
    data = torch.utils.data.TensorDataset(torch.randn(batch * (args.steps + 2), WIDTH))
    loader = hvd_adapt.AdaptiveDataLoader(data, batch_size=batch)
    if micro > 1:
        loader.autoscale_batch_size(batch, local_bsz_bounds=(args.batch, args.batch),
                                    gradient_accumulation=True, decide_every=10 ** 6)
    hvd_adapt.State(model=model, optimizer=opt, loader=loader).sync()
    times, last = [], None
    for (x,) in loader:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if not loader.is_optim_step():
            continue
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
        if len(times) == args.steps:
            break
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"step_s": statistics.median(times), "peak_bytes": peak,
                       "swap": opt.swap_metrics()}, f)


def launch(procs, mode, micro, args):
    out = tempfile.mktemp(suffix=".json")
    script = [sys.executable, HERE, "--worker", "--mode", mode, "--micro", str(micro), "--out",
              out, "--layers", str(args.layers), "--steps", str(args.steps), "--batch",
              str(args.batch), "--swap-dir", args.swap_dir]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if procs > 1:
        script = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", str(procs),
                  "-H", f"localhost:{procs}", "--gloo", "--network-interface", "lo"] + script
    subprocess.run(script, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swap-dir", default=None, help="default: a folder under /tmp")
    parser.add_argument("--state-gb", type=float, default=2.0)
    parser.add_argument("--procs", default="1,2")
    parser.add_argument("--micro", default="1,4", help="micro-steps per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    parser.add_argument("--batch", type=int, default=8, help="samples per micro-step per replica")
    parser.add_argument("--json", default=None,
                        help="also write the results here (relative: under benchmarks/results/)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    args.swap_dir = args.swap_dir or tempfile.mkdtemp(prefix="hvd_adapt_swap_bench_")
    os.makedirs(args.swap_dir, exist_ok=True)
    args.layers = layers_for(args.state_gb)
    results = {"state_gb": args.state_gb, "layers": args.layers, "swap_dir": args.swap_dir}

    swap_write, swap_read, nbytes = swapper_disk(args.swap_dir, args.layers)
    raw_write, raw_read, direct = raw_disk(args.swap_dir, nbytes)
    gb = nbytes / 1e9
    disk = {"bytes": nbytes, "o_direct": direct,
            "raw_write_gbps": gb / raw_write, "raw_read_gbps": gb / raw_read,
            "swap_write_gbps": gb / swap_write, "swap_read_gbps": gb / swap_read,
            "deepspeed_seconds": gb / DEEPSPEED_READ_GBPS + gb / DEEPSPEED_WRITE_GBPS}
    results["disk"] = disk
    print(f"state {gb:.2f} GB ({args.layers} x Linear({WIDTH}, {WIDTH}), AdamW), "
          f"O_DIRECT {'yes' if direct else 'no'}")
    print(f"{'':>8} {'raw GB/s':>9} {'swap GB/s':>10} {'swap/raw':>9}")
    for kind in ("write", "read"):
        raw, swap = disk[f"raw_{kind}_gbps"], disk[f"swap_{kind}_gbps"]
        print(f"{kind:>8} {raw:>9.2f} {swap:>10.2f} {swap / raw:>9.2f}")
    print(f"DeepSpeed's swapper at 3.7/3.2 GB/s: {disk['deepspeed_seconds']:.2f} s for the same "
          f"bytes read and written")

    runs = []
    print(f"{'procs':>5} {'micro':>5} {'memory_s':>9} {'swap_s':>8} {'ratio':>6} {'hidden':>7} "
          f"{'memory_GB':>10} {'swap_GB':>8} {'saved/state':>11}")
    for procs in [int(p) for p in args.procs.split(",")]:
        for micro in [int(m) for m in args.micro.split(",")]:
            memory = launch(procs, "memory", micro, args)
            swap = launch(procs, "swap", micro, args)
            stats = swap["swap"]
            io = stats["swap_read_s"] + stats["swap_write_s"]
            hidden = 1 - stats["swap_wait_s"] / io if io else 0.0
            row = {"procs": procs, "micro": micro, "memory_step_s": memory["step_s"],
                   "swap_step_s": swap["step_s"], "ratio": swap["step_s"] / memory["step_s"],
                   "hidden": hidden, "memory_peak_bytes": memory["peak_bytes"],
                   "swap_peak_bytes": swap["peak_bytes"],
                   "saved_over_state": (memory["peak_bytes"] - swap["peak_bytes"]) / nbytes}
            runs.append(row)
            print(f"{procs:>5} {micro:>5} {row['memory_step_s']:>9.2f} {row['swap_step_s']:>8.2f} "
                  f"{row['ratio']:>6.2f} {hidden:>7.2f} {memory['peak_bytes'] / 1e9:>10.2f} "
                  f"{swap['peak_bytes'] / 1e9:>8.2f} {row['saved_over_state']:>11.2f}", flush=True)
    results["runs"] = runs
    if args.json:
        import record
        record.write(args.json, results)
    return results


if __name__ == "__main__":
    main()
