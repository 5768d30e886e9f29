"""Time PrefetchController.from_plan for the 61-layer Kimi-sized TP8 plan in this process.

The plan is the reference design's (``points=kimi_k3.POINTS``, next_attention
capped at 24 MiB at every batch): the shipped defaults fork nowhere, and an
empty plan would time nothing.

    L2PREFETCH_CACHE_DIR=/some/dir python benchmarks/construct.py

Prints one line: "<ms> <entries> <tables>".  The report's host section
(benchmarks/sections/host.py) runs it in fresh processes, first with an empty
kernel cache (cold: NVRTC compiles), then again (warm: the CUBIN comes from
the disk cache).  Model building and CUDA context
creation are outside the timed region.
"""

import time

import torch

from l2prefetch import PrefetchController, kimi_k3
from l2prefetch.cli import build_synthetic_kimi


def main():
    _, layers, packed = build_synthetic_kimi(tp=8, device="cuda:0")
    plan = kimi_k3.plan(layers, packed, tp=8, next_attention={8: {b: 24 for b in range(1, 9)}},
                        points=kimi_k3.POINTS)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    controller = PrefetchController.from_plan(plan, 0)
    ms = (time.perf_counter() - t0) * 1e3
    tables = len({id(controller.get(*k)) for k in controller.keys()})
    print(f"{ms:.1f} {len(plan)} {tables}")


if __name__ == "__main__":
    main()
