"""Probe 4 (issues 23, 24): loader nodes switched in place inside one graph instance.

HF Llama-shaped, 6 layers, 40 us spin before each post_attention_layernorm; forks after
o_proj loading that layer's gate_proj (48 MiB captured; other caps switched in).  Per mode:
(1) does a switched graph replay like the graph it stands for ('off' vs a capture without
forks, 'empty' vs a capture with empty tables), across 6 instances each; (2) paired
differences within instances against their unpaired twins (95% interval half-widths).
"""
from __future__ import annotations

import statistics
import sys

import torch

from benchmarks.sections.planted import _model, _planted
from l2prefetch import PrefetchController, PreparedWeightRanges
from l2prefetch.tuning.rig import LoaderSwitch, Rig

dev = torch.device("cuda", 0)
rig = Rig(dev)
N = 6
T = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 10: 2.26, 12: 2.20}
MIB = 1 << 20


def ci(xs):
    m = statistics.mean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, T.get(len(xs) - 1, 2.0) * statistics.stdev(xs) / len(xs) ** 0.5


def welch(a, b):
    m = statistics.mean(a) - statistics.mean(b)
    se = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    return m, 2.3 * se


def main(batch, spin, modes):
    from l2prefetch.tuning.hf import DecodeStep

    model = _model("llama")   # benchmarks/sections/planted.py's Llama shape, random bf16
    step = DecodeStep(model)
    layers = model.model.layers
    _planted(rig, model, "mlp", spin)
    empty = PreparedWeightRanges([], grid=32, device=0)
    full = [PreparedWeightRanges([l.mlp.gate_proj.weight], grid=32, device=0) for l in layers]
    caps = {c: {full[i].ranges: PreparedWeightRanges([l.mlp.gate_proj.weight], byte_cap=c * MIB,
                                                     grid=32, device=0)
                for i, l in enumerate(layers)} for c in (8, 16, 24, 32)}
    g132 = {full[i].ranges: PreparedWeightRanges([l.mlp.gate_proj.weight], byte_cap=24 * MIB,
                                                 grid=132, device=0) for i, l in enumerate(layers)}

    def cap(mode, table, keep=False):
        hooks = []
        c = None
        if table != "none":
            c = PrefetchController(0, graph_fork=mode)
            for i, l in enumerate(layers):
                c.add("p", i, [batch], empty if table == "empty" else full[i])
                hooks.append(l.self_attn.o_proj.register_forward_hook(
                    lambda m, a, o, i=i: c.fork("p", i, batch) and None))
        try:
            def fn():
                out = step(batch)
                if c is not None:
                    c.join()
                return out
            return rig.capture(fn, warmup=1, keep_graph=keep)
        finally:
            for h in hooks:
                h.remove()

    print(f"== batch {batch}, spin {spin} us", flush=True)
    with torch.no_grad():
        for mode in modes:
            graphs, switches, outs = {}, [], []
            for i in range(N):
                graphs[("none", i)] = cap(mode, "none")[0]
                graphs[("empty", i)] = cap(mode, "empty")[0]
                g, o = cap(mode, "loads", keep=True)
                switches.append(LoaderSwitch(g))
                outs.append(o)
            states = {"on48": "on", "c8": caps[8], "c16": caps[16], "c24": caps[24],
                      "c32": caps[32], "c24g132": g132, "empty": "empty", "off": "off"}
            sep = rig.instance_medians(graphs, 30)
            par = rig.paired(switches, states, 30)
            n_nodes = len(switches[0].nodes)
            m_none, w_none = ci(sep["none"])
            print(f"{mode}: {n_nodes} loader nodes per graph; none {m_none:.1f} us "
                  f"(instances {min(sep['none']):.1f}-{max(sep['none']):.1f})")
            d, w = welch(par["off"], sep["none"])
            print(f"   switched off - captured none     {d:+6.2f} +-{w:.2f} us (across instances)")
            d, w = welch(par["empty"], sep["empty"])
            print(f"   switched empty - captured empty  {d:+6.2f} +-{w:.2f} us (across instances)")
            d, w = welch(sep["empty"], sep["none"])
            print(f"   captured empty - captured none   {d:+6.2f} +-{w:.2f} us (across instances)")
            d, w = ci([a - b for a, b in zip(par["empty"], par["off"])])
            print(f"   empty - off (paired)             {d:+6.2f} +-{w:.2f} us")
            for s in ("c8", "c16", "c24", "c32", "on48", "c24g132"):
                d, w = ci([e - x for e, x in zip(par["empty"], par[s])])
                d2, w2 = ci([e - x for e, x in zip(par["off"], par[s])])
                du, wu = welch(sep["empty"], par[s])
                print(f"   {s:8} gain vs empty {d:+6.2f} +-{w:.2f} (unpaired +-{wu:.2f}); "
                      f"vs off {d2:+6.2f} +-{w2:.2f} us", flush=True)
            print(f"   logits bitwise equal across instances: "
                  f"{all(torch.equal(outs[0], o) for o in outs)}")
            del graphs, switches
            torch.cuda.empty_cache()


if __name__ == "__main__":
    args = sys.argv[1:]
    batch = int(args[0]) if args else 1
    spin = float(args[1]) if len(args) > 1 else 40.0
    modes = args[2:] or ["leaf", "branch", "inline"]
    main(batch, spin, modes)
