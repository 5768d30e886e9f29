"""effect: a bf16 GEMV y = x @ W^T (K = 7168) after a bandwidth-idle window.

The window is T us of one CTA spinning on the main stream (the GPU nearly
idle).  Four variants: cold (L2 flushed), empty fork (the control), prefetched
(fork at the window's start, join at the end; inline and as a side branch),
hot (W read just before: the physical limit).  Then the break-even table:
from which window on a fork stops losing, and whether ``plan.gate`` agrees.
"""

from __future__ import annotations

from l2prefetch import PreparedWeightRanges
from l2prefetch.tuning.report import table

from ..common import MIB, pct, run_sequence, weight

#: Graph instances per variant: at 16 MiB the cold-to-hot gap is 0.8-1.6 us, and one
#: capture can sit 0.3 us off the next (RESULTS.md, "Older runs", run 9).
EFFECT_INSTANCES = 3

#: A loss smaller than this (us) is noise in the effect's short graphs.
EFFECT_NOISE_US = 0.3


def break_even(raw, noise=EFFECT_NOISE_US, bytes_per_us=None):
    """Where a fork stops losing, from the effect section's raw rows (mib, batch, T, {cold,
    prefetched, ...}, recovered).  Per (W MiB, batch), sorted: (mib, batch, T*, gate_us,
    gate_ok) with T* the shortest measured window from which on the fork loses at most
    ``noise`` us against not forking (cold - prefetched >= -noise there and at every longer
    window; None if it never gets there), gate_us the window plan.gate asks for (W /
    bytes_per_us, default plan.GATE_BYTES_PER_US), and gate_ok whether every measured
    window the gate lets fork (T >= gate_us) lost at most ``noise``."""
    if bytes_per_us is None:
        from l2prefetch.plan import GATE_BYTES_PER_US as bytes_per_us
    by = {}
    for mib, batch, t, r, _rec in raw:
        by.setdefault((mib, batch), []).append((t, r["cold"] - r["prefetched"]))
    out = []
    for (mib, batch), points in sorted(by.items()):
        points.sort()
        first = next((t for i, (t, _) in enumerate(points)
                      if all(v >= -noise for _, v in points[i:])), None)
        gate_us = mib * MIB / bytes_per_us
        ok = all(v >= -noise for t, v in points if t >= gate_us)
        out.append((mib, batch, first, gate_us, ok))
    return out


def break_even_table(raw):
    rows = [(mib, batch, "-" if first is None else first, f"{gate_us:.1f}", "yes" if ok else "no")
            for mib, batch, first, gate_us, ok in break_even(raw)]
    return ("Break-even, from the table above: the shortest measured window T from which on the "
            f"inline fork loses at most {EFFECT_NOISE_US} us against not forking (vs cold), and "
            "the window `plan.gate` asks for at its default rate (W / "
            "plan.GATE_BYTES_PER_US); gate avoids losses = every measured window the gate lets "
            "fork lost at most that much.\n\n"
            + table(["W MiB", "batch", "break-even T us", "gate's window us",
                     "gate avoids losses"], rows))


def run(rig, quick):
    sizes = [16, 32] if quick else [2, 4, 8, 16, 24, 32, 48]
    batches = [1, 8] if quick else [1, 2, 4, 8]
    windows = [0, 10, 20] if quick else [0, 5, 10, 20, 40]
    reps = 60 if quick else 100
    instances = 1 if quick else EFFECT_INSTANCES
    empty = PreparedWeightRanges([], device=rig.device.index, carveout=100)
    rows, raw = [], []
    for mib in sizes:
        w = weight(rig, mib)
        pf = PreparedWeightRanges([w], carveout=100)
        for b in batches:
            for t in windows:
                r = run_sequence(rig, w, b, t, {"empty": empty, "prefetched": pf,
                                                "empty (branch)": empty,
                                                "prefetched (branch)": pf}, reps,
                                 instances=instances)
                gap = r["cold"] - r["hot"]
                net = r["empty"] - r["prefetched"]
                rec = net / gap if gap > 0.3 else float("nan")
                net_b = r["empty (branch)"] - r["prefetched (branch)"]
                raw.append((mib, b, t, r, rec))
                rows.append((f"{pf.nbytes / MIB:.1f}", b, t, f"{r['cold']:.2f}", f"{r['empty']:.2f}",
                             f"{r['prefetched']:.2f}", f"{r['hot']:.2f}", f"{gap:.2f}",
                             f"{net:+.2f}", "-" if rec != rec else pct(rec),
                             f"{r['cold'] - r['prefetched']:+.2f}",
                             f"{r['empty (branch)']:.2f}", f"{r['prefetched (branch)']:.2f}",
                             "-" if gap <= 0.3 else pct(net_b / gap),
                             f"{r['cold'] - r['prefetched (branch)']:+.2f}"))
        del w, pf
    text = ("### effect: the effect, a GEMV after a bandwidth-idle window (step time, us)\n\n"
            "Step = small op, [fork] spin(T) GEMV [join], replayed as a CUDA graph, the variants "
            f"interleaved, each captured {instances} time(s) (the median of the instances' "
            "medians); default kernel, grid 32, carveout 100.  Forks as shipped "
            "(graph_fork='inline': the loader on the captured stream with launch-order edges) "
            "and as a side branch (graph_fork='branch').  gap = cold - hot (the prize); net = "
            "empty fork - prefetched (the gain against the control); recovered = net / gap "
            "(shown where the gap exceeds 0.3 us); vs cold = cold - prefetched (what a user "
            "sees against not forking).\n\n"
            + table(["W MiB", "batch", "T us", "cold", "empty fork", "prefetched", "hot", "gap",
                     "net", "recovered", "vs cold", "branch: empty", "branch: prefetched",
                     "branch: recovered", "branch: vs cold"], rows)
            + "\n" + break_even_table(raw))
    return text, raw
