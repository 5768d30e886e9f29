"""Probe 5 (issue 24): what an empty fork's ~2 us at batch 8 are made of.

HF Llama-shaped, 6 layers, 40 us spin before each post_attention_layernorm, forks after
o_proj with EMPTY tables only, 8 instances per variant: per fork or per graph (1 vs 6
forks), the loader's resources (ring grid 32 with 64 KiB smem, grid 1, line_prefetch
without smem), streams (leaf, leaf chained into one side chain, branch, inline).
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

from benchmarks.sections.planted import _model, _planted
from l2prefetch import PrefetchController, PreparedWeightRanges
from l2prefetch.tuning.rig import Rig

dev = torch.device("cuda", 0)
rig = Rig(dev)
N = 8


def welch(a, b):
    m = statistics.mean(a) - statistics.mean(b)
    se = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    return m, 2.15 * se


def main(batch):
    from l2prefetch.tuning.hf import DecodeStep

    model = _model("llama")   # benchmarks/sections/planted.py's Llama shape, random bf16
    step = DecodeStep(model)
    layers = model.model.layers
    _planted(rig, model, "mlp", 40)
    tables = {"ring32": PreparedWeightRanges([], grid=32, device=0),
              "ring1": PreparedWeightRanges([], grid=1, device=0),
              "line32": PreparedWeightRanges([], grid=32, kernel="line_prefetch", device=0)}

    def cap(mode, table, which):
        hooks = []
        c = None
        if mode != "none":
            os.environ["L2PREFETCH_LEAF_CHAIN"] = "1" if mode == "chain" else "0"
            c = PrefetchController(0, graph_fork="leaf" if mode == "chain" else mode)
            for i in which:
                c.add("p", i, [batch], tables[table])
                hooks.append(layers[i].self_attn.o_proj.register_forward_hook(
                    lambda m, a, o, i=i: c.fork("p", i, batch) and None))
        try:
            def fn():
                out = step(batch)
                if c is not None:
                    c.join()
                return out
            return rig.capture(fn, warmup=1)[0]
        finally:
            for h in hooks:
                h.remove()

    six = range(6)
    variants = {"none": ("none", "ring32", ()),
                "leaf ring32 x6": ("leaf", "ring32", six), "leaf ring32 x1": ("leaf", "ring32", (3,)),
                "leaf ring1 x6": ("leaf", "ring1", six), "leaf line32 x6": ("leaf", "line32", six),
                "chain ring32 x6": ("chain", "ring32", six),
                "branch ring32 x6": ("branch", "ring32", six),
                "branch ring32 x1": ("branch", "ring32", (3,)),
                "inline ring32 x6": ("inline", "ring32", six),
                "inline ring1 x6": ("inline", "ring1", six)}
    with torch.no_grad():
        graphs = {}
        for i in range(N):
            for name, v in variants.items():
                graphs[(name, i)] = cap(*v)
        med = rig.instance_medians(graphs, 30)
    base = med["none"]
    print(f"== batch {batch}: none {statistics.mean(base):.1f} us "
          f"(instances {min(base):.1f}-{max(base):.1f}); empty forks' cost against none:")
    for name, v in med.items():
        if name == "none":
            continue
        d, w = welch(v, base)
        print(f"   {name:18} {d:+6.2f} +-{w:.2f} us", flush=True)


if __name__ == "__main__":
    for b in (sys.argv[1:] or ["8"]):
        main(int(b))
