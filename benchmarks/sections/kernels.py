"""kernels: the prefetch kernel variants and grids on the effect's step.

Per variant: the step time with it (all loaders of one W in one interleaved
run), its own duration alone on a cold L2, and how much it slows a
concurrent memory-bound copy on the main stream.
"""

from __future__ import annotations

import torch

import l2prefetch
from l2prefetch import PrefetchController, PreparedWeightRanges, _C
from l2prefetch.tuning.report import table

from ..common import MIB, pct, run_sequence, weight

#: H200 HBM3e peak (TB/s): a loader "faster" than this skipped loads.
HBM_PEAK_TBS = 4.8


def run(rig, quick):
    dev = rig.device.index
    variants = [v for v, info in l2prefetch.kernel_variants().items()
                if _C.device_info(dev)["sm"] >= info["min_sm"]]
    grids = [8, 32, 132] if quick else [8, 16, 32, 64, 132]
    reps = 40 if quick else 100
    window = 10
    rows = []
    src = torch.randn(64 * MIB, device=rig.device)   # 256 MiB copy: a memory-bound neighbour
    dst = torch.empty_like(src)
    empty = PreparedWeightRanges([], device=dev, carveout=100)
    for mib in (16, 32):
        w = weight(rig, mib)
        loaders = {(v, grid): PreparedWeightRanges([w], kernel=v, grid=grid, carveout=100)
                   for v in variants for grid in grids if v.startswith("ring") or grid == 32}
        # Every loader of this W in one interleaved run, against one cold / empty / hot:
        # the recovered shares compare like with like.
        r = run_sequence(rig, w, 1, window,
                         {"empty": empty, **{f"{v} g{grid}": p for (v, grid), p in loaders.items()}},
                         reps)
        gap = r["cold"] - r["hot"]
        for (v, grid), p in loaders.items():
            pf = r[f"{v} g{grid}"]
            rec = (r["empty"] - pf) / gap if gap > 0.3 else float("nan")
            # The loader's own duration, alone on a cold L2.
            own = rig.time_graph(rig.capture(lambda p=p: p.launch())[0], reps, rig.flush)
            # Slowdown of a concurrent 256 MiB copy on the main stream.
            ctrl = PrefetchController(dev)
            ctrl.add("p", 0, [1], p)

            def copy_with(fork, ctrl=ctrl):
                def fn():
                    if fork:
                        ctrl.fork("p", 0, 1)
                    dst.copy_(src)
                    if fork:
                        ctrl.join()
                return fn

            c0 = rig.time_graph(rig.capture(copy_with(False))[0], reps, rig.flush)
            c1 = rig.time_graph(rig.capture(copy_with(True))[0], reps, rig.flush)
            ctrl.close()
            rate = mib * MIB / own / 1e6
            # Faster than the HBM can deliver: the kernel cannot have loaded every byte.
            flag = " (above HBM peak: not loading)" if rate > HBM_PEAK_TBS else ""
            rows.append((mib, v, grid, p.block, f"{pf:.2f}", "-" if rec != rec else pct(rec),
                         f"{own:.2f}", f"{rate:.2f}{flag}", f"{c1 - c0:+.2f}"))
        rows.append((mib, "(cold / empty / hot)", "", "", f"{r['cold']:.2f} / {r['empty']:.2f} / "
                     f"{r['hot']:.2f}", "", "", "", ""))
        del loaders
    return ("### kernels: kernel variants (W 16 and 32 MiB, batch 1, T = 10 us)\n\n"
            "prefetched = step time with that loader (all loaders of one W interleaved in one "
            "run, against one cold / empty / hot); recovered net of the empty fork; own = the "
            "loader alone on a cold L2 (us) and its rate (TB/s); copy slowdown = extra time of a "
            "concurrent 256 MiB device copy on the main stream when the loader runs beside it.\n\n"
            + table(["W MiB", "variant", "grid", "block", "prefetched us", "recovered", "own us",
                     "TB/s", "copy slowdown us"], rows))
