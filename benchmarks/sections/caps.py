"""caps: the layer step per TP (1, 2, 4, 8), batch and next_attention cap.

What ``kimi_k3.NEXT_ATTENTION`` and ``kimi_k3.DEFAULT_POINTS`` were chosen
from: the two Kimi-shaped layers of :mod:`benchmarks.sections.layer`, their
weights scaled to each TP, spins standing in for the all-reduces, the
reference design's points with the same cap at every batch, and the shipped
plan and its ablations beside them.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from l2prefetch import PrefetchController
from l2prefetch.tuning.report import table

from ..common import K
from .layer import INSTANCES, kimi_layers, layer_step

#: next_attention caps (MiB) tried (quick / full).
CAPS_MIB_QUICK = (0, 8, 16, 32)
CAPS_MIB = (0, 4, 8, 16, 24, 32)
#: All-reduce stand-in per TP (us): none at TP1; the facts' 7-13 us TP2 window elsewhere.
CAPS_ALLREDUCE_US = {1: 0, 2: 8, 4: 8, 8: 8}
#: Step-time differences below this are noise (us): the choice is the smallest cap within it.
CAPS_NOISE_US = 0.3


def _ablations(entries, tp):
    """The shipped plan's variants timed next to it: the MoE front (oproj_down) at grid
    32 instead of the reference design's 8, without oproj_down, and (TP8) without
    attention_moe."""
    out = {"front g32": [dataclasses.replace(e, grid=32) if e.point == "oproj_down" else e
                         for e in entries],
           "no front": [e for e in entries if e.point != "oproj_down"]}
    if tp == 8:
        out["no attn_moe"] = [e for e in entries if e.point != "attention_moe"]
    return out


def run(rig, quick):
    """kimi_k3.NEXT_ATTENTION by measurement: the two-layer step per TP, batch and cap."""
    from l2prefetch import kimi_k3

    dev = rig.device.index
    batches = [1, 4, 8] if quick else list(range(1, 9))
    caps = CAPS_MIB_QUICK if quick else CAPS_MIB
    reps = 40 if quick else 100
    rows, raw, summary, ablation_rows = [], [], [], []
    for tp in (1, 2, 4, 8):
        layers, packed = kimi_layers(tp, rig.device)
        shapes = {name: tuple(w.shape) for name, w in layers[0].ws.items()}
        # The reference design's points at every TP (kimi_k3.plan may leave some out).
        reference = {cap: kimi_k3.plan(layers, packed, tp, {tp: {b: cap for b in range(1, 9)}},
                                       points=kimi_k3.POINTS) for cap in caps}
        ctrls = {cap: PrefetchController.from_plan(entries, dev)
                 for cap, entries in reference.items()}
        shipped = kimi_k3.plan(layers, packed, tp)
        ctrls["shipped"] = PrefetchController.from_plan(shipped, dev)
        shipped_reference = kimi_k3.plan(layers, packed, tp, points=kimi_k3.POINTS)
        for name, entries in _ablations(shipped_reference, tp).items():
            ctrls[name] = PrefetchController.from_plan(entries, dev)
        allreduce = CAPS_ALLREDUCE_US[tp]
        for batch in batches:
            def rand(n, batch=batch):
                return torch.randn(batch, n, device=rig.device, dtype=torch.bfloat16)

            h, a, sd = rand(K), rand(shapes["o_proj"][1]), rand(shapes["shared_down"][1])
            fns = {"none": layer_step(rig, layers, None, batch, h, a, sd, allreduce)}
            for key, ctrl in ctrls.items():
                fns[key] = layer_step(rig, layers, ctrl, batch, h, a, sd, allreduce)
            m = rig.measure(fns, INSTANCES, reps, before=lambda _name: rig.flush())
            t = {name: m.pooled_median(name) for name in fns}
            best = min(caps, key=lambda c: t[c])
            choice = min(c for c in caps if t[c] <= t[best] + CAPS_NOISE_US)
            current = kimi_k3.NEXT_ATTENTION[tp].get(batch, 0)
            current = current[0] if isinstance(current, tuple) else current
            raw.append({"tp": tp, "batch": batch, "times": t, "best": best, "choice": choice})
            rows.append((tp, batch, f"{t['none']:.2f}", *(f"{t[c]:.2f}" for c in caps),
                         f"{best}", f"{choice}", f"{t['none'] / t[choice]:.3f}x", f"{current}",
                         f"{t['shipped']:.2f}", f"{t['none'] / t['shipped']:.3f}x"))
            ablation_rows.append((tp, batch, f"{t['none']:.2f}", f"{t['shipped']:.2f}",
                                  *(f"{t[n]:.2f}" if n in t else "-"
                                    for n in ("front g32", "no front", "no attn_moe"))))
        # One cap per TP: the per-batch choices move between neighbours within noise.
        mean = {cap: statistics.fmean(r["times"]["none"] / r["times"][cap]
                                      for r in raw if r["tp"] == tp) for cap in caps}
        top = max(caps, key=lambda c: mean[c])
        summary.append((tp, *(f"{mean[c]:.4f}" for c in caps), f"{top}"))
        for ctrl in ctrls.values():
            ctrl.close()
        del layers, packed, ctrls
    text = ("### caps: choosing kimi_k3.NEXT_ATTENTION, the next_attention cap per TP and batch "
            "(step time, us)\n\n"
            "The layer section's two Kimi-shaped MoE layers, their weights scaled from TP8 to "
            "each TP (the sharded dimension x 8 / TP), the all-reduce stand-in "
            f"{CAPS_ALLREDUCE_US} us by TP, forks from `kimi_k3.plan(layers, packed, tp, "
            "{tp: {batch: cap}}, points=kimi_k3.POINTS)` (the reference design's points at "
            "every TP) with the same cap at every batch (0 = no next_attention), "
            f"graph_fork='inline'; each variant captured {INSTANCES} times, all replays "
            "interleaved, each after a flush.  none = no forks at all.  best = the cap with "
            f"the lowest step; choice = the smallest cap within {CAPS_NOISE_US} us of the best; "
            "speed-up = none / choice; shipped cap = what NEXT_ATTENTION holds; shipped = the "
            "step with `kimi_k3.plan(layers, packed, tp)` as shipped.\n\n"
            + table(["TP", "batch", "none"] + [f"cap {c} MiB" for c in caps]
                    + ["best", "choice", "speed-up", "shipped cap", "shipped", "none / shipped"],
                    rows)
            + "\nMean speed-up (none / step) over the batches, per TP and cap; the top cap "
            "is what `kimi_k3.NEXT_ATTENTION[tp]` should hold at every batch (0: none):\n\n"
            + table(["TP"] + [f"cap {c}" for c in caps] + ["top"], summary)
            + "\nThe other points, at the shipped caps (step us): shipped plan; the reference "
            "design's points with oproj_down at grid 32 instead of its 8 (front g32); without "
            "oproj_down (no front); without attention_moe (no attn_moe, TP8).\n\n"
            + table(["TP", "batch", "none", "shipped", "front g32", "no front", "no attn_moe"],
                    ablation_rows))
    return text, raw
