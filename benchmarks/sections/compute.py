"""compute: the effect with a compute-bound window, n GEMMs on small L2-resident matrices.

The gate's rule (a window is memory-idle time) says a compute-bound kernel
should leave room for the loader as the spin does; this measures it, with
the glue section's loaders (:func:`benchmarks.sections.glue.window_effect`).
"""

from __future__ import annotations

import torch

from .glue import window_effect

#: The window: n products of two L2-resident [COMPUTE_N x COMPUTE_N] bf16 matrices
#: (6 MiB in all; 2 * COMPUTE_N**3 flop each), as for an attention core that is
#: compute-bound.
COMPUTE_N = 1024


def run(rig, quick):
    g = torch.Generator(device=rig.device).manual_seed(1)
    a, b = (torch.randn(COMPUTE_N, COMPUTE_N, device=rig.device, generator=g).to(torch.bfloat16)
            for _ in range(2))

    def window(h, n):
        for _ in range(n):
            torch.mm(a, b)
    return window_effect(
        rig, quick, window, lambda n: n,
        "compute: the effect with a compute-bound window",
        f"n GEMMs of two L2-resident [{COMPUTE_N} x {COMPUTE_N}] bf16 matrices "
        f"({2 * COMPUTE_N ** 3 / 1e9:.1f} GFLOP each, 6 MiB in all)")
