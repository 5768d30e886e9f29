"""glue: the effect with a window of small kernels that touch memory instead of the spin.

A real layer's bandwidth-idle windows (norms, RoPE and cache updates, the
router, an all-reduce) are chains of small latency-bound kernels that do
touch memory; the spin touches none.  Here the window is n rounds of an
RMSNorm, a scale and an add on a [B, 7168] bf16 activation (3n kernels),
measured with each loader of :data:`GLUE_LOADERS`.  :func:`window_effect` is
shared with the compute section.
"""

from __future__ import annotations

import torch

from l2prefetch import PreparedWeightRanges
from l2prefetch.tuning.report import table

from ..common import K, MIB, glue_chain, pct, run_sequence, weight

#: The loaders compared, (kernel variant, grid): the default, half its grid, and the
#: two variants that hold no shared memory and slowed a concurrent memory-bound kernel
#: least in the kernels section.  Grid 8 does not finish in the window (RESULTS.md,
#: "Older runs", run 8: -10..-16 us at 32 MiB).
GLUE_LOADERS = (("ring", 32), ("ring", 16), ("bulk_prefetch", 32), ("line_prefetch", 32))
#: Graph instances per variant.
GLUE_INSTANCES = 5


def window_effect(rig, quick, window, kernels, title, what):
    """The effect's four variants and each loader of GLUE_LOADERS, with window(h, n)
    (n rounds, kernels(n) kernels) in the spin's place."""
    sizes = [16, 32]
    batches = [1, 8]
    rounds = [2, 5] if quick else [2, 5, 10]
    reps = 40 if quick else 100
    instances = 3 if quick else GLUE_INSTANCES
    empty = PreparedWeightRanges([], device=rig.device.index, carveout=100)
    names = [f"{k} g{g}" for k, g in GLUE_LOADERS]
    rows, raw = [], []
    for mib in sizes:
        w = weight(rig, mib)
        pfs = {name: PreparedWeightRanges([w], carveout=100, grid=g, kernel=k)
               for name, (k, g) in zip(names, GLUE_LOADERS)}
        for b in batches:
            h = torch.randn(b, K, device=rig.device, dtype=torch.bfloat16)
            for n in rounds:
                def fn(n=n, h=h):
                    window(h, n)
                # the window alone, hot: its length in us
                alone = rig.time_graph(rig.capture(fn)[0], reps)
                variants = {"empty": empty}
                variants.update(pfs)
                r = run_sequence(rig, w, b, 0, variants, reps, window_fn=fn,
                                 instances=instances)
                gap = r["cold"] - r["hot"]
                row = [f"{w.nbytes / MIB:.1f}", b, kernels(n), f"{alone:.1f}",
                       f"{r['cold']:.2f}", f"{r['empty']:.2f}", f"{r['hot']:.2f}", f"{gap:.2f}"]
                for name in names:
                    net = r["empty"] - r[name]
                    row += [f"{r[name]:.2f}", "-" if gap <= 0.3 else pct(net / gap),
                            f"{r['cold'] - r[name]:+.2f}"]
                row.append(f"{max(r['spread'].values()):.2f}")
                raw.append((mib, b, n, alone, r))
                rows.append(row)
        del w, pfs
    head = ["W MiB", "batch", "window kernels", "window us", "cold", "empty fork", "hot", "gap"]
    for name in names:
        head += [f"{name}: prefetched", f"{name}: recovered", f"{name}: vs cold"]
    head.append("spread")
    text = (f"### {title} (step time, us)\n\n"
            f"As the effect section (inline fork, carveout 100), but the window is {what} "
            "instead of a spin that touches no memory.  Loaders (kernel variant, grid): "
            + ", ".join(names) + ".  window us = the window alone, replayed (hot); "
            "recovered = (empty fork - prefetched) / gap; vs cold = cold - prefetched.  The "
            f"empty fork is the default kernel's.  Each variant captured {instances} times, "
            f"every instance replayed {reps} times (interleaved): the median of the "
            "instances' medians; spread = the largest max - min of the instances' medians "
            "over the row's variants.  In some processes the no-fork graph of a chain of "
            "small kernels replays 2-11 us slower than the same graph with an empty fork "
            "(RESULTS.md, \"Older runs\", run 9), which inflates cold and the gap; compare "
            "against the empty fork.\n\n" + table(head, rows))
    return text, raw


def run(rig, quick):
    def window(h, n):
        glue_chain(h, 3 * n)
    return window_effect(
        rig, quick, window, lambda n: 3 * n,
        "glue: the effect with a window of small kernels",
        "a chain of small kernels that touch memory (n x RMSNorm, scale, add on x [B, 7168] "
        "bf16: the shape of a layer's norms and glue)")
