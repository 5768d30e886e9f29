"""Probe 2 (issue 24): where an empty side-stream fork's 2-4 us go in an HF model's graph.

Per-kernel timelines (CUPTI, medians over replays) of no forks, empty forks and 48 MiB
loads, in modes branch and leaf; aligned kernel by kernel (loader kernels left out), the
differences of durations and of the gaps before each kernel.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

import torch

from benchmarks.sections.planted import _model, _planted
from l2prefetch import PrefetchController, PreparedWeightRanges
from l2prefetch.tuning.rig import Rig

dev = torch.device("cuda", 0)
rig = Rig(dev)
MODES = [m for m in sys.argv[1:] if not m.startswith("-")] or ["leaf", "branch"]


def timelines(graph, n=5):
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
    out = []
    for run in runs:
        t0 = run[0]["ts"]
        out.append([(e["name"], e.get("args", {}).get("stream"), e["ts"] - t0, e["dur"]) for e in run])
    return out


def summary(runs):
    """main kernels (no l2p): median start, dur; gap before each; span."""
    main = [[r for r in run if "l2p_prefetch" not in r[0]] for run in runs]
    k = len(main[0])
    med = []
    for i in range(k):
        st = statistics.median(run[i][2] for run in main)
        du = statistics.median(run[i][3] for run in main)
        gap = statistics.median(run[i][2] - (run[i - 1][2] + run[i - 1][3]) if i else 0.0 for run in main)
        med.append((main[0][i][0], main[0][i][1], st, du, gap))
    span = statistics.median(run[-1][2] + run[-1][3] for run in main)
    return med, span


def main():
    from l2prefetch.tuning.hf import DecodeStep

    model = _model("llama")   # benchmarks/sections/planted.py's Llama shape, random bf16
    step = DecodeStep(model)
    layers = model.model.layers
    _planted(rig, model, "mlp", 40)
    empty = PreparedWeightRanges([], grid=32, device=0)
    full = [PreparedWeightRanges([l.mlp.gate_proj.weight], grid=32, device=0) for l in layers]

    def cap(k, mode):
        hooks = []
        c = None
        if k != "none":
            c = PrefetchController(0, graph_fork=mode)
            for i, l in enumerate(layers):
                c.add("p", i, [1], empty if k == "d" else full[i])
                hooks.append(l.self_attn.o_proj.register_forward_hook(
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

    with torch.no_grad():
        base, bspan = summary(timelines(cap("none", "leaf")))
        print(f"none: {len(base)} kernels, span {bspan:.1f} us, sum dur {sum(r[3] for r in base):.1f}, "
              f"sum gaps {sum(r[4] for r in base):.1f}", flush=True)
        for mode in MODES:
            for k in ("d", "f"):
                s, span = summary(timelines(cap(k, mode)))
                if len(s) != len(base):
                    print(f"{mode} {k}: kernel count {len(s)} != {len(base)}")
                    continue
                dd = [(s[i][3] - base[i][3], i) for i in range(len(s))]
                dg = [(s[i][4] - base[i][4], i) for i in range(len(s))]
                streams = sorted({r[1] for r in s})
                print(f"{mode} {k}: span {span:.1f} (+{span - bspan:.1f}), sum dur "
                      f"{sum(r[3] for r in s):.1f} ({sum(d for d, _ in dd):+.1f}), sum gaps "
                      f"{sum(r[4] for r in s):.1f} ({sum(d for d, _ in dg):+.1f}); streams {streams}",
                      flush=True)
                for label, lst in (("dur", dd), ("gap", dg)):
                    top = sorted(lst, reverse=True)[:8]
                    bot = sorted(lst)[:4]
                    print(f"   {label} most +: " + "; ".join(
                        f"#{i} {s[i][0][:38]} ({base[i][1]}->{s[i][1]}) {d:+.2f}" for d, i in top))
                    print(f"   {label} most -: " + "; ".join(
                        f"#{i} {s[i][0][:38]} {d:+.2f}" for d, i in bot))
                # the first layer's window, in full
                if k == "f":
                    for i in range(len(s)):
                        pass


if __name__ == "__main__":
    main()
