"""``python -m l2prefetch``: the main job, and ``python -m l2prefetch plan``.

With no subcommand, it shows what l2prefetch does on this machine.  On a GPU:
it prepares the ranges of a realistic weight set (a Kimi-sized next-layer
attention shard, ~32 MiB of bf16), launches the prefetch and reports the
device, architecture, kernel variant, bytes, the host time of one launch, and
the time of a GEMV over those weights when L2 is cold, after the prefetch, and
hot.  Without a GPU it says so and still compiles the kernel for sm_90 with
NVRTC, printing its instruction mix and resource use, and the range table of a
synthetic weight set.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections import Counter

from . import _C, __version__


def _synthetic_weights(device):
    """Kimi-like attention shard, 32 MiB-ish of bf16 (rows multiples of 32)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(2336, 7168), (64, 7168), (1024, 1536), (7168, 160)]
    return [torch.randn(s, generator=gen, dtype=torch.float32).to(torch.bfloat16).to(device)
            for s in shapes]


def _instruction_mix(ptx: str) -> Counter:
    ops = Counter()
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)", line)
        if m and not line.lstrip().startswith((".", "//", "{", "}", "$")):
            op = m.group(1)
            ops[op.split(".")[0] if not op.startswith(("cp.", "mbarrier", "prefetch", "ld.")) else
                ".".join(op.split(".")[:3])] += 1
    return ops


def _no_gpu(reason: str) -> int:
    print(f"l2prefetch {__version__}: no usable GPU here ({reason.splitlines()[0]})")
    print("Showing what can be shown without one.\n")
    variant = "ring"
    try:
        info = _C.nvrtc_info()
        built = _C.compile(variant, 90)
        ptx = _C.compile(variant, 90, ptx=True)
    except Exception as exc:  # NVRTC missing: say so, don't crash
        print(f"NVRTC unavailable: {exc}")
        return 0
    print(f"NVRTC {info['version'][0]}.{info['version'][1]} at {info['path']}")
    print(f"kernel '{variant}' for sm_90: {len(built['image'])} bytes of CUBIN; options "
          f"{' '.join(built['options'])}")
    usage = [l.strip() for l in built["log"].splitlines() if "Used" in l or "entry function" in l]
    print("resource use (ptxas):")
    for line in usage:
        print("  " + line.replace("ptxas info    : ", ""))
    mix = _instruction_mix(ptx["image"].decode(errors="replace"))
    print("PTX instruction mix (all three table capacities):")
    for op, n in mix.most_common(12):
        print(f"  {op:40s} {n}")
    try:
        import torch
    except ImportError:
        print("\n(torch not installed: no range table to show)")
        return 0
    weights = _synthetic_weights("cpu")
    ranges = _C.compute_ranges(weights, 24 * 2**20)
    print("\nrange table of a synthetic weight set (CPU tensors), capped at 24 MiB:")
    for i, (w, (ptr, n)) in enumerate(zip(weights, ranges)):
        print(f"  {i}: shape {tuple(w.shape)} -> 0x{ptr:x} + {n} bytes ({n / 2**20:.2f} MiB)")
    print(f"  total {sum(n for _, n in ranges) / 2**20:.2f} MiB")
    return 0


def _median_ms(fn, reps=50):
    import torch

    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn(start, end)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _gpu() -> int:
    import torch

    from . import PreparedWeightRanges

    dev = torch.cuda.current_device()
    info = _C.device_info(dev)
    props = torch.cuda.get_device_properties(dev)
    weights = _synthetic_weights(f"cuda:{dev}")
    w = weights[0]
    prepared = PreparedWeightRanges((w,), grid=32, carveout=100, priority=True)
    print(f"l2prefetch {__version__} on {props.name} (cuda:{dev}, sm_{info['sm']}, "
          f"{info['sm_count']} SMs, L2 {info['l2_bytes'] / 2**20:.0f} MiB, driver "
          f"{info['driver_version']}, torch {torch.__version__})")
    print(f"kernel '{prepared.kernel}', grid {prepared.grid} x {prepared.block} threads, "
          f"{prepared.smem} B shared memory, {prepared.nbytes / 2**20:.2f} MiB in "
          f"{len(prepared.ranges)} range(s)")
    side = torch.cuda.Stream()
    prepared.launch(side)
    torch.cuda.synchronize()
    host = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        prepared.launch(side)
        host.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    print(f"host time of one launch: median {statistics.median(host) / 1e3:.2f} us")

    flush = torch.empty(512 * 2**20 // 4, dtype=torch.float32, device=w.device).normal_()
    x = torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device)
    cur = torch.cuda.current_stream()

    def cold(s, e):
        flush.add_(1.0)
        s.record()
        torch.nn.functional.linear(x, w)
        e.record()

    def prefetched(s, e):
        flush.add_(1.0)
        side.wait_stream(cur)
        prepared.launch(side)
        cur.wait_stream(side)
        s.record()
        torch.nn.functional.linear(x, w)
        e.record()

    def hot(s, e):
        flush.add_(1.0)
        torch.nn.functional.linear(x, w)
        s.record()
        torch.nn.functional.linear(x, w)
        e.record()

    results = {name: _median_ms(fn) * 1e3 for name, fn in
               (("cold", cold), ("prefetched", prefetched), ("hot", hot))}
    print(f"GEMV y = x @ W^T, W {tuple(w.shape)} bf16, batch 1 (median of 50, us): "
          + ", ".join(f"{k} {v:.2f}" for k, v in results.items()))
    gap = results["cold"] - results["hot"]
    if gap > 0:
        share = (results["cold"] - results["prefetched"]) / gap
        print(f"the prefetch recovered {100 * share:.0f}% of the cold->hot gap of {gap:.2f} us "
              "(the prefetch ran to completion first; benchmarks/ measures real overlap)")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "plan":
        from .cli import plan_main

        return plan_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m l2prefetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=__version__)
    parser.parse_args(argv)
    try:
        count = _C.driver_info()["device_count"]
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device (a CPU-only torch build?)")
        if count == 0:
            raise RuntimeError("the driver sees no CUDA device")
    except (ImportError, RuntimeError) as exc:
        return _no_gpu(str(exc))
    return _gpu()


if __name__ == "__main__":
    sys.exit(main())
