"""Probe (run 26's question): one decode step's kernels in launch order, eager and
compiled.  In the step the window role's loads recover 45-75% of what
``benchmarks.probe_l2`` measures for the same load with nothing between it and the
consumer, and no loaded line fades (RESULTS run 26): does the compiled step run another
large GEMV (up_proj's, beside gate_proj's) between the window and its consumer?

The model is :func:`benchmarks.compiled.build`'s (``--window`` us planted before every
MLP), its step run once under ``torch.profiler`` after two warm-up steps, not in a graph
(the same kernels, launched one by one).  Printed: the kernels from the first spin
(the planted window; from the first kernel when nothing is planted), ``--kernels`` of
them, each with its name cut to 100 characters and its time.

    python -m benchmarks.probe_order [--model llama] [--window 40] [--batch 1]
                                     [--ways eager,compiled] [--kernels 40]
"""
import argparse

import torch

from benchmarks.common import no_gpu
from benchmarks.compiled import build
from l2prefetch.tuning.cli import compile_forward
from l2prefetch.tuning.compiled import recompile


def kernels(step, batch):
    """[(name, us)] of one ``step(batch)``'s device activity, in start order."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(2):
            step(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(batch)
            torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in events]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probe_order")
    parser.add_argument("--model", default="llama")
    parser.add_argument("--window", type=float, default=40.0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ways", default="eager,compiled")
    parser.add_argument("--mode", default="default")
    parser.add_argument("--kernels", type=int, default=40)
    args = parser.parse_args(argv)
    if args.batch < 1 or args.kernels < 1 or args.window < 0:
        parser.error("--batch and --kernels are at least 1, --window at least 0")
    ways = args.ways.split(",")
    for way in ways:
        if way not in ("eager", "compiled"):
            parser.error(f"--ways: {way!r} is neither eager nor compiled")
    if no_gpu("benchmarks.probe_order"):
        return
    for way in ways:
        model, step, planted = build(args.model, args.window)
        step.state(args.batch)
        if way == "compiled":
            compile_forward(model, args.mode)
        recompile()
        found = kernels(step, args.batch)
        first = next((i for i, (name, _) in enumerate(found)
                      if "sleep" in name.lower() or "spin" in name.lower()), 0)
        print(f"probe_order {args.model} {way} B{args.batch} window {args.window:g} us: "
              f"{len(found)} kernels a step, from #{first}:", flush=True)
        for i, (name, us) in enumerate(found[first:first + args.kernels], first):
            print(f"  {i:4d} {us:8.2f} us  {name[:100]}", flush=True)
        for handle in planted:
            handle.remove()
        del model, step
        recompile()


if __name__ == "__main__":
    main()
