"""Probe: why an inline loader does not overlap a window in a captured graph (issue 24).

One GPU run, three parts, printed as they finish:

A. the minimal graph of ../shared/repro/inline_overlap.py (GEMV, fork, glue, 40 us spin,
   GEMV on 48 MiB, 24 MiB loaded), fork modes inline / branch / leaf;
B. a kernel timeline (CUPTI through torch.profiler) of one replay per mode, to see which
   hardware stream each node ran on and when the loader ran against its neighbours;
C. an HF Llama-shaped model (hidden 3072, intermediate 8192, 6 layers, GQA 24/8) with a
   40 us spin before every post_attention_layernorm, forks after o_proj loading 24 MiB of
   that layer's gate_proj, modes inline / branch / leaf; and the in-place switch of the
   loader nodes (cuGraphNodeSetEnabled) on one instance against separate captures.

    PYTHONPATH=python python3 -m benchmarks.probe_graph
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import traceback

import torch

from l2prefetch import PrefetchController, PreparedWeightRanges
from l2prefetch.mechanisms import GRAPH_FORKS
from l2prefetch.tuning.rig import Rig

MIB = 1 << 20
dev = torch.device("cuda", 0)
rig = Rig(dev)
MODES = GRAPH_FORKS


def ms(vals):
    return statistics.median(vals)


# ---------------------------------------------------------------- A: minimal graph
def part_a():
    torch.manual_seed(0)
    H = 3072
    W1 = torch.randn(3072, H, device=dev, dtype=torch.bfloat16)
    W2 = torch.randn(8192, H, device=dev, dtype=torch.bfloat16)
    FL = torch.empty(256 << 20, device=dev, dtype=torch.uint8)
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    res = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    nw = torch.randn(H, device=dev, dtype=torch.bfloat16)
    empty = PreparedWeightRanges([], grid=32, device=0)
    loads = PreparedWeightRanges([W2], byte_cap=24 << 20, grid=32, device=0)

    def glue(kind, a):
        if kind == "none":
            return a
        h = res + a
        if kind == "add":
            return h
        v = h.float().pow(2).mean(-1, keepdim=True)
        return (h.float() * torch.rsqrt(v + 1e-6)).to(torch.bfloat16) * nw

    def make(ctrl, kind, hot=False):
        def step():
            FL.add_(1)
            if hot:
                torch.sum(W2, dim=0)
            a = x @ W1.t()
            if ctrl is not None:
                ctrl.fork("p", 0, 1)
            h = glue(kind, a)
            rig.spin(40)
            y = h @ W2.t()
            if ctrl is not None:
                ctrl.join()
            return y
        return step

    def ctrl_for(k, mode):
        if k in ("none", "hot"):
            return None
        c = PrefetchController(0, graph_fork=mode)
        c.add("p", 0, [1], loads if k == "b" else empty)
        return c

    timelines = {}
    for kind in ("none", "add", "add_norm"):
        for mode in MODES:
            graphs = {}
            for i in range(3):
                for k in ("none", "d", "b"):
                    graphs[(k, i)] = rig.capture(make(ctrl_for(k, mode), kind))[0]
            med = rig.instance_medians(graphs, 60)
            m = {k: statistics.mean(v) for k, v in med.items()}
            sp = {k: max(v) - min(v) for k, v in med.items()}
            print(f"A glue {kind:8} {mode:6}: loads vs empty {m['d'] - m['b']:+6.1f} us, "
                  f"empty vs none {m['none'] - m['d']:+5.1f} (none {m['none']:.1f}; "
                  f"instance spread none/d/b {sp['none']:.1f}/{sp['d']:.1f}/{sp['b']:.1f})",
                  flush=True)
            if kind == "add_norm":
                timelines[mode] = graphs[("b", 0)]
    return timelines


# ---------------------------------------------------------------- B: timeline
def kernel_timeline(graph, warm=3):
    """[(name, stream, start_us, dur_us)] of one replay of graph, by CUPTI."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warm):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(path)
    with open(path) as f:
        data = json.load(f)
    os.unlink(path)
    ev = [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if not ev:
        return []
    t0 = min(e["ts"] for e in ev)
    return sorted(((e["name"][:60], e.get("args", {}).get("stream", e.get("tid")),
                    e["ts"] - t0, e["dur"]) for e in ev), key=lambda r: r[2])


def print_timeline(title, rows, around="l2p_prefetch", span=6):
    print(f"B {title}: {len(rows)} kernels")
    idx = [i for i, r in enumerate(rows) if around in r[0]]
    shown = set()
    for i in idx[:3]:
        for j in range(max(0, i - 2), min(len(rows), i + span)):
            if j in shown:
                continue
            shown.add(j)
            n, s, t, d = rows[j]
            print(f"   {t:9.2f} +{d:7.2f} -> {t + d:9.2f}  stream {s}  {n}")
        print("   ...")
    sys.stdout.flush()


# ---------------------------------------------------------------- C: HF model
def part_c():
    import transformers as tf

    from l2prefetch.tuning.hf import DecodeStep

    cfg = tf.LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=6,
                         num_attention_heads=24, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=256)
    torch.manual_seed(0)
    with torch.device(dev):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    step = DecodeStep(model)
    layers = model.model.layers
    spin_us = {"v": 40.0}
    for layer in layers:
        layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a: rig.spin(spin_us["v"]))
    empty = PreparedWeightRanges([], grid=32, device=0)
    loads = [PreparedWeightRanges([l.mlp.gate_proj.weight], byte_cap=24 << 20, grid=32, device=0)
             for l in layers]
    full = [PreparedWeightRanges([l.mlp.gate_proj.weight], grid=32, device=0) for l in layers]
    hooks = []

    def attach(ctrl):
        for i, l in enumerate(layers):
            hooks.append(l.self_attn.o_proj.register_forward_hook(
                lambda m, a, o, i=i: ctrl.fork("p", i, 1) and None))

    def detach():
        while hooks:
            hooks.pop().remove()

    def ctrl_for(k, mode):
        if k == "none":
            return None
        c = PrefetchController(0, graph_fork=mode)
        for i in range(len(layers)):
            c.add("p", i, [1], {"d": empty, "b": loads[i], "f": full[i]}[k])
        return c

    def cap(k, mode):
        c = ctrl_for(k, mode)
        if c is not None:
            attach(c)
        try:
            def fn():
                out = step(1)
                if c is not None:
                    c.join()
                return out
            g, out = rig.capture(fn, warmup=1)
        finally:
            detach()
        return g, out

    with torch.no_grad():
        for spin in (40.0, 0.0):
            spin_us["v"] = spin
            for mode in MODES:
                graphs, outs = {}, {}
                for i in range(3):
                    for k in ("none", "d", "b", "f"):
                        graphs[(k, i)], outs[(k, i)] = cap(k, mode)
                med = rig.instance_medians(graphs, 40)
                m = {k: statistics.mean(v) for k, v in med.items()}
                sp = {k: max(v) - min(v) for k, v in med.items()}
                same = all(torch.equal(outs[("none", 0)], o) for o in outs.values())
                print(f"C spin {spin:4.0f} {mode:6}: 24MiB vs empty {m['d'] - m['b']:+6.1f}, "
                      f"48MiB vs empty {m['d'] - m['f']:+6.1f}, empty vs none "
                      f"{m['none'] - m['d']:+5.1f} us/step (none {m['none']:.1f}; spread "
                      f"{sp['none']:.1f}/{sp['d']:.1f}/{sp['b']:.1f}/{sp['f']:.1f}; bitwise {same})",
                      flush=True)
                if spin == 40.0 and mode in ("inline", "leaf"):
                    rows = kernel_timeline(graphs[("f", 0)])
                    print_timeline(f"HF {mode} 48MiB layer timeline", rows, span=10)
                    if mode == "leaf":
                        rows0 = kernel_timeline(graphs[("none", 0)])
                        print("B kernel durations none vs 48MiB leaf (the 10 longest GEMV/GEMM "
                              "differences):")
                        a = [r for r in rows0 if "l2p" not in r[0]]
                        b = [r for r in rows if "l2p" not in r[0]]
                        if len(a) == len(b):
                            diffs = sorted(((ra[3] - rb[3], ra[0], ra[3], rb[3])
                                            for ra, rb in zip(a, b)), reverse=True)[:10]
                            for d, n, x, y in diffs:
                                print(f"   {n:60} none {x:7.2f} leaf {y:7.2f} ({d:+.2f})")
                        else:
                            print(f"   kernel counts differ: {len(a)} vs {len(b)}")
                del graphs, outs
                torch.cuda.empty_cache()
        spin_us["v"] = 40.0
        switch_probe(cap)


def switch_probe(cap):
    """One captured graph with loader nodes, switched in place, against separate captures."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        print("C switch: no cuda.bindings")
        return
    orig = torch.cuda.CUDAGraph
    for mode in MODES:
        g_none, _ = cap("none", mode)
        g_d, _ = cap("d", mode)
        g_b, _ = cap("b", mode)
        torch.cuda.CUDAGraph = lambda: orig(keep_graph=True)
        try:
            g_sw, _ = cap("b", mode)
        finally:
            torch.cuda.CUDAGraph = orig
        g_sw.instantiate()
        graph = cu.CUgraph(g_sw.raw_cuda_graph())
        exe = cu.CUgraphExec(g_sw.raw_cuda_graph_exec())
        _, nodes, n = cu.cuGraphGetNodes(graph, 0)
        _, nodes, n = cu.cuGraphGetNodes(graph, n)
        ours = []
        for node in nodes:
            _, t = cu.cuGraphNodeGetType(node)
            if t != cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
                continue
            _, p = cu.cuGraphKernelNodeGetParams(node)
            _, name = cu.cuFuncGetName(p.func)
            if b"l2p_prefetch" in name:
                ours.append(node)

        def enable(on):
            for node in ours:
                err, = cu.cuGraphNodeSetEnabled(exe, node, 1 if on else 0)
                if int(err) != 0:
                    raise RuntimeError(f"cuGraphNodeSetEnabled: {err}")

        times = {"none": [], "d": [], "b": [], "on": [], "off": []}
        for r in range(10):
            for key in ("none", "d", "b", "on", "off"):
                if key in ("on", "off"):
                    torch.cuda.synchronize()
                    enable(key == "on")
                g = {"none": g_none, "d": g_d, "b": g_b}.get(key, g_sw)
                ev = []
                for _ in range(20):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record(); g.replay(); e.record()
                    ev.append((s, e))
                torch.cuda.synchronize()
                times[key] += [a.elapsed_time(b) * 1e3 for a, b in ev]
        m = {k: ms(v) for k, v in times.items()}
        print(f"C switch {mode:6}: {len(ours)} loader nodes; separate captures none {m['none']:.1f} "
              f"empty {m['d']:.1f} loads {m['b']:.1f}; one capture switched on {m['on']:.1f} "
              f"off {m['off']:.1f} us (on - off {m['on'] - m['off']:+.1f})", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(0), torch.__version__, flush=True)
    tl = {}
    for name, part in (("A", part_a), ("C", part_c)):
        try:
            r = part()
            if name == "A":
                tl = r or {}
                for mode, g in tl.items():
                    print_timeline(f"minimal add_norm {mode}", kernel_timeline(g))
        except Exception:  # noqa: BLE001 - a probe: report and go on
            traceback.print_exc()
            sys.stdout.flush()
