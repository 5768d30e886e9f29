"""Probe 3 (issue 24): is a side-stream fork's cost per fork or per graph, and where is it?

HF Llama-shaped, 6 layers, 40 us spin before each post_attention_layernorm, batch 1.
Variants x 6 instances, interleaved event-timed replays; then CUPTI timelines of
back-to-back replays: the period between replays' first kernels against the kernels' span.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile

import torch

from benchmarks.sections.planted import _model, _planted
from l2prefetch import PrefetchController, PreparedWeightRanges
from l2prefetch.tuning.rig import Rig

dev = torch.device("cuda", 0)
rig = Rig(dev)


def periods(graph, n=6):
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(path)
    data = json.load(open(path))
    os.unlink(path)
    ev = sorted((e for e in data["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"),
                key=lambda e: e["ts"])
    per = len(ev) // n
    runs = [ev[i * per:(i + 1) * per] for i in range(n)]
    starts = [r[0]["ts"] for r in runs]
    spans = [max(e["ts"] + e["dur"] for e in r) - r[0]["ts"] for r in runs]
    per_ = [b - a for a, b in zip(starts, starts[1:])]
    return statistics.median(per_), statistics.median(spans)


def main():
    from l2prefetch.tuning.hf import DecodeStep

    model = _model("llama")   # benchmarks/sections/planted.py's Llama shape, random bf16
    step = DecodeStep(model)
    layers = model.model.layers
    _planted(rig, model, "mlp", 40)
    empty = PreparedWeightRanges([], grid=32, device=0)
    loads = [PreparedWeightRanges([l.mlp.gate_proj.weight], byte_cap=24 << 20, grid=32, device=0)
             for l in layers]

    def cap(mode, table, which):
        hooks = []
        c = None
        if mode != "none":
            os.environ["L2PREFETCH_LEAF_CHAIN"] = "1" if mode == "chain" else "0"
            c = PrefetchController(0, graph_fork="leaf" if mode == "chain" else mode)
            for i in which:
                c.add("p", i, [1], empty if table == "d" else loads[i])
                hooks.append(layers[i].self_attn.o_proj.register_forward_hook(
                    lambda m, a, o, i=i: c.fork("p", i, 1) and None))
        try:
            def fn():
                out = step(1)
                if c is not None:
                    c.join()
                return out
            return rig.capture(fn, warmup=1)[0]
        finally:
            for h in hooks:
                h.remove()

    all6 = range(6)
    variants = {"none": ("none", "d", ()),
                "leaf d1": ("leaf", "d", (3,)), "leaf d6": ("leaf", "d", all6),
                "branch d1": ("branch", "d", (3,)), "branch d6": ("branch", "d", all6),
                "chain d6": ("chain", "d", all6), "inline d6": ("inline", "d", all6),
                "leaf b6": ("leaf", "b", all6), "branch b6": ("branch", "b", all6),
                "chain b6": ("chain", "b", all6)}
    with torch.no_grad():
        graphs = {}
        for i in range(6):
            for name, v in variants.items():
                graphs[(name, i)] = cap(*v)
        med = rig.instance_medians(graphs, 30)
        base = med["none"]
        print(f"none: {statistics.mean(base):.1f} us (instances {min(base):.1f}-{max(base):.1f})")
        for name, v in med.items():
            d = [x - statistics.mean(base) for x in v]
            se = statistics.stdev(v) / len(v) ** 0.5
            print(f"{name:10}: {statistics.mean(v):8.1f} us, vs none {statistics.mean(d):+6.1f} "
                  f"(+-{2 * (se ** 2 + (statistics.stdev(base) / 6 ** 0.5) ** 2) ** 0.5:.1f}), "
                  f"instances {min(v):.1f}-{max(v):.1f}", flush=True)
        for name in ("none", "leaf d6", "branch d6", "chain d6", "inline d6", "leaf d1"):
            p, s = periods(graphs[(name, 0)])
            print(f"timeline {name:10}: period {p:8.1f}, kernel span {s:8.1f}, outside {p - s:6.1f} us",
                  flush=True)


if __name__ == "__main__":
    main()
