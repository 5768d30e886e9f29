"""Probe: what does a fork cost inside the HF DeepSeek-V3 decode graph, and why?

    python benchmarks/probe_forks.py [--batches 1,8] [--reps 200]

Captures the benchmark model's decode step (benchmarks/deepseek.py) with the
deepseek_v3 hook points and different ways of putting the loader on a side
branch, then replays them interleaved (CUDA events, medians):

  none               no hooks
  branch(_empty)     PrefetchController(graph_fork="branch"): a side-stream fork per point,
                     the join at the end (the session-1 path), with the plan's / empty tables
  one_branch_empty   one such fork only
  one_edge_only      the side stream waits on the main stream and launches nothing (one
                     bare cross-stream edge, joined at the end); edge_only: at every point
  root_empty         the empty launches on one side chain hanging off the graph's root
  prog_empty         side forks whose edge from the main stream is programmatic (launch order)
  inline_empty       empty launches on the captured stream, ordinary edges (serial)
  inline_keep(_empty) on the captured stream with launch-order edges, the next node keeping
                     its edge from the node before: what graph_fork="inline" does
  inline_leaf(_empty) the same but the launch left as a leaf (no edge to the next node)
  shipped(_empty)    PrefetchController.from_plan (graph_fork="inline", the default)

``--synthetic`` times the same kinds of fork on chains of small kernels instead.
Prints one Markdown table per batch.  Exploratory: its findings go to RESULTS.md.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepseek as ds                               # noqa: E402
import l2prefetch                                   # noqa: E402
from l2prefetch import deepseek_v3                  # noqa: E402


class EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte),
                ("type", ctypes.c_ubyte), ("reserved", ctypes.c_ubyte * 5)]


class Driver:
    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        get = lib.cuGetProcAddress_v2
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                        ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]

        def proc(name, restype, *argtypes):
            fn = ctypes.c_void_p()
            status = ctypes.c_int()
            rc = get(name.encode(), ctypes.byref(fn), 12030, 0, ctypes.byref(status))
            if rc != 0 or not fn.value:
                raise RuntimeError(f"cuGetProcAddress({name}) = {rc}")
            return ctypes.CFUNCTYPE(restype, *argtypes)(fn.value)

        vp = ctypes.c_void_p
        self.info = proc("cuStreamGetCaptureInfo", ctypes.c_int, vp, ctypes.POINTER(ctypes.c_int),
                         ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(vp),
                         ctypes.POINTER(ctypes.POINTER(vp)),
                         ctypes.POINTER(ctypes.POINTER(EdgeData)),
                         ctypes.POINTER(ctypes.c_size_t))
        self.update = proc("cuStreamUpdateCaptureDependencies", ctypes.c_int, vp,
                           ctypes.POINTER(vp), ctypes.POINTER(EdgeData), ctypes.c_size_t,
                           ctypes.c_uint)
        self.node_type = proc("cuGraphNodeGetType", ctypes.c_int, vp, ctypes.POINTER(ctypes.c_int))
        self.get_edges = proc("cuGraphGetEdges", ctypes.c_int, vp, ctypes.POINTER(vp),
                              ctypes.POINTER(vp), ctypes.POINTER(EdgeData),
                              ctypes.POINTER(ctypes.c_size_t))
        self.get_nodes = proc("cuGraphGetNodes", ctypes.c_int, vp, ctypes.POINTER(vp),
                              ctypes.POINTER(ctypes.c_size_t))

    def edge_histogram(self, graph):
        n = ctypes.c_size_t(0)
        vp = ctypes.c_void_p
        rc = self.get_edges(graph, None, None, None, ctypes.byref(n))
        frm, to = (vp * n.value)(), (vp * n.value)()
        data = (EdgeData * n.value)()
        rc = self.get_edges(graph, frm, to, data, ctypes.byref(n))
        if rc:
            return f"cuGraphGetEdges = {rc}"
        out = {}
        for e in data[: n.value]:
            key = f"type{e.type}/port{e.from_port}"
            out[key] = out.get(key, 0) + 1
        return out

    def histogram(self, graph):
        n = ctypes.c_size_t(0)
        self.get_nodes(graph, None, ctypes.byref(n))
        nodes = (ctypes.c_void_p * n.value)()
        self.get_nodes(graph, nodes, ctypes.byref(n))
        names = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
                 6: "wait_event", 7: "event_record", 8: "ext_sem_signal", 9: "ext_sem_wait",
                 10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}
        out = {}
        for node in nodes:
            t = ctypes.c_int()
            self.node_type(node, ctypes.byref(t))
            out[names.get(t.value, t.value)] = out.get(names.get(t.value, t.value), 0) + 1
        return out

    def deps(self, stream):
        status = ctypes.c_int()
        cid = ctypes.c_uint64()
        graph = ctypes.c_void_p()
        deps = ctypes.POINTER(ctypes.c_void_p)()
        edges = ctypes.POINTER(EdgeData)()
        n = ctypes.c_size_t()
        rc = self.info(stream, ctypes.byref(status), ctypes.byref(cid), ctypes.byref(graph),
                       ctypes.byref(deps), ctypes.byref(edges), ctypes.byref(n))
        if rc != 0:
            raise RuntimeError(f"cuStreamGetCaptureInfo = {rc}")
        if status.value != 1:
            return None
        out = []
        for i in range(n.value):
            e = edges[i] if edges else EdgeData()
            out.append((deps[i], (e.from_port, e.to_port, e.type)))
        return out

    def set_deps(self, stream, items):
        n = len(items)
        nodes = (ctypes.c_void_p * max(n, 1))(*[node for node, _ in items])
        data = (EdgeData * max(n, 1))()
        for i, (_, (fp, tp, ty)) in enumerate(items):
            data[i].from_port, data[i].to_port, data[i].type = fp, tp, ty
        rc = self.update(stream, nodes, data, n, 1)          # SET
        if rc != 0:
            raise RuntimeError(f"cuStreamUpdateCaptureDependencies = {rc}")

    def is_kernel(self, node):
        t = ctypes.c_int()
        rc = self.node_type(node, ctypes.byref(t))
        return rc == 0 and t.value == 0


class Probe:
    """fork/join for hooks.attach: tables by key, a side stream, a way to fork."""

    def __init__(self, tables, mode, drv, port=2, edge_type=1):
        self.tables, self.mode, self.drv = tables, mode, drv
        self.port, self.edge_type = port, edge_type
        self.side = torch.cuda.Stream()
        self.forks = 0

    def reset_stats(self):
        self.forks = 0

    def stats(self):
        return {"all": {"forks": self.forks, "bytes": 0}}

    def fork(self, point, layer, batch):
        table = self.tables.get((point, layer, batch))
        if table is None:
            return False
        main = torch.cuda.current_stream()
        capturing = torch.cuda.is_current_stream_capturing()
        self.side.wait_stream(main)
        if capturing and self.mode in ("root", "prog"):
            s = self.side.cuda_stream
            side_deps = self.drv.deps(s)
            main_deps = {node for node, _ in self.drv.deps(main.cuda_stream)}
            new = []
            for node, edge in side_deps:
                if node in main_deps:
                    if self.mode == "root":
                        continue
                    if self.drv.is_kernel(node):
                        edge = (self.port, 0, self.edge_type)
                new.append((node, edge))
            self.drv.set_deps(s, new)
        if self.mode == "inline_leaf" and capturing:
            m = main.cuda_stream
            before = self.drv.deps(m)
            self.drv.set_deps(m, [(node, (2, 0, 1) if self.drv.is_kernel(node) else edge)
                                  for node, edge in before])
            table.launch(m)
            self.drv.set_deps(m, before)
            self.forks += 1
            return True
        if self.mode == "inline_keep" and capturing:
            m = main.cuda_stream
            before = self.drv.deps(m)
            self.drv.set_deps(m, [(node, (2, 0, 1) if self.drv.is_kernel(node) else edge)
                                  for node, edge in before])
            table.launch(m)
            after = self.drv.deps(m)
            self.drv.set_deps(m, before + [(node, (2, 0, 1)) for node, _ in after])
            self.forks += 1
            return True
        if self.mode.startswith("inline"):
            table.launch(main.cuda_stream)
            if capturing and self.mode != "inline":
                deps = self.drv.deps(main.cuda_stream)
                self.drv.set_deps(main.cuda_stream,
                                  [(node, (self.port, 0, self.edge_type)) for node, _ in deps])
            self.forks += 1
            return True
        if self.mode != "edge":
            table.launch(self.side.cuda_stream)
        if self.mode == "join_now":
            main.wait_stream(self.side)
        self.forks += 1
        return True

    def join(self):
        if not self.mode.startswith("inline"):
            torch.cuda.current_stream().wait_stream(self.side)


def synthetic(reps):
    """A chain of 2000 small kernels, with 0, 1 or 10 empty forks spread over it."""
    x = torch.zeros(4096, device="cuda")
    table = l2prefetch.PreparedWeightRanges([], grid=32, device=0)
    ctrl = l2prefetch.PrefetchController(0, graph_fork="branch")   # side-stream forks
    ctrl.add("p", 0, [1], table)
    y = torch.ones(4096, device="cuda")
    graphs = {}
    for forks, copies in ((0, 0), (1, 0), (10, 0), (0, 1), (1, 1)):
        at = {int(i * 2000 / max(forks, 1)) + 100 for i in range(forks)}
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            x.add_(1)
            with torch.cuda.graph(g, stream=s):
                for i in range(2000):
                    x.add_(1)
                    if copies and i % 50 == 7:
                        y.copy_(x)                      # a D2D memcpy node
                    if i in at:
                        ctrl.fork("p", 0, 1)
                if forks:
                    ctrl.join()
        torch.cuda.current_stream().wait_stream(s)
        graphs[(forks, copies)] = g
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    for forks in (0, 1):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            torch.nn.functional.linear(h, w)
            with torch.cuda.graph(g, stream=s):
                v = h
                for i in range(300):
                    v = torch.nn.functional.linear(v, w) * 0.01
                    if forks and i == 100:
                        ctrl.fork("p", 0, 1)
                if forks:
                    ctrl.join()
        torch.cuda.current_stream().wait_stream(s)
        graphs[(forks, "linear")] = g
    drv = Driver()
    probes = {m: Probe({("p", 0, 1): table}, m, drv) for m in ("inline_keep", "inline_leaf")}
    for mode, probe in probes.items():
        for forks in (1, 10):
            at = {int(i * 300 / forks) + 20 for i in range(forks)}
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(s):
                with torch.cuda.graph(g, stream=s):
                    v = h
                    for i in range(300):
                        v = torch.nn.functional.linear(v, w) * 0.01
                        if i in at:
                            probe.fork("p", 0, 1)
                    probe.join()
            torch.cuda.current_stream().wait_stream(s)
            graphs[(forks, "linear " + mode)] = g
    times = ds.time_interleaved({k: (None, g.replay) for k, g in graphs.items()}, reps)
    print("\n### synthetic: 2000 x add_ on 4096 floats (+ 40 D2D copies), graph replay us\n")
    for k in graphs:
        base = ds.median(times[(0, "linear" if isinstance(k[1], str) else k[1])])
        print(f"| {k[0]} forks, {k[1]!s} | {ds.median(times[k]):.1f} | "
              f"{ds.median(times[k]) - base:+.1f} |")
    # A memcpy node right after an inline fork: does capture, instantiation, replay work?
    for mode, probe in probes.items():
        try:
            a = torch.zeros(1024, device="cuda")
            b = torch.zeros(1024, device="cuda")
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(s):
                with torch.cuda.graph(g, stream=s):
                    a.add_(1)
                    probe.fork("p", 0, 1)
                    b.copy_(a)
                    a.add_(1)
            torch.cuda.current_stream().wait_stream(s)
            g.replay()
            g.replay()
            torch.cuda.synchronize()
            print(f"memcpy after {mode} fork: replays, b = {b[0].item()} (want 3), "
                  f"a = {a[0].item()} (want 4)", flush=True)
        except Exception as exc:                                       # noqa: BLE001
            print(f"memcpy after {mode} fork: {type(exc).__name__}: {exc}", flush=True)
            torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--synthetic", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.synthetic:
        synthetic(args.reps)
        return
    model = ds.build_model(ds.TINY_CONFIG if args.tiny else ds.BENCH_CONFIG, "cuda")
    plan = deepseek_v3.plan(model, points=("next_attention",))   # the default plan is empty
    shipped = l2prefetch.PrefetchController.from_plan(plan, 0)          # graph_fork="inline"
    empty = ds.empty_controller(plan, 0)
    branch = l2prefetch.PrefetchController.from_plan(plan, 0, graph_fork="branch")
    branch_empty = ds.empty_controller(plan, 0, graph_fork="branch")
    drv = Driver()
    full_tables = {k: shipped.get(*k) for k in shipped.keys()}
    empty_tables = {k: empty.get(*k) for k in empty.keys()}
    first = sorted(empty.keys(), key=lambda k: (k[1], k[0]))[0]
    one = {k: v for k, v in empty_tables.items() if k[:2] == first[:2]}
    one_branch = ds.empty_controller([e for e in plan if (e.point, e.layer) == first[:2]], 0,
                                     graph_fork="branch")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for batch in batches:
        dec = ds.Decoder(model, batch)
        variants = {
            "none": None,
            "branch_empty": branch_empty, "branch": branch, "one_branch_empty": one_branch,
            "one_edge_only": Probe(one, "edge", drv),
            "edge_only": Probe(empty_tables, "edge", drv),
            "root_empty": Probe(empty_tables, "root", drv),
            "prog_empty": Probe(empty_tables, "prog", drv),
            "inline_empty": Probe(empty_tables, "inline", drv),
            "inline_keep_empty": Probe(empty_tables, "inline_keep", drv),
            "inline_keep": Probe(full_tables, "inline_keep", drv),
            "inline_leaf_empty": Probe(empty_tables, "inline_leaf", drv),
            "inline_leaf": Probe(full_tables, "inline_leaf", drv),
            "shipped_empty": empty, "shipped": shipped,
        }
        graphs, outs, notes = {}, {}, {}
        try:
            keep = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(keep):
                dec.step()
            raw = ctypes.c_void_p(keep.raw_cuda_graph())
            print("nodes of the decode graph:", drv.histogram(raw), "edges:",
                  drv.edge_histogram(raw), flush=True)
            del keep
        except Exception as exc:                                       # noqa: BLE001
            print("node histogram failed:", type(exc).__name__, exc, flush=True)
        for name, ctl in variants.items():
            try:
                graph, logits, stats = ds.capture(dec, ctl)
            except Exception as exc:                                   # noqa: BLE001
                notes[name] = f"capture failed: {type(exc).__name__}: {str(exc)[:200]}"
                print(name, notes[name], flush=True)
                torch.cuda.synchronize()
                continue
            graphs[name] = graph
            dec.reset()
            graph.replay()
            outs[name] = logits.clone()
        ref = outs["none"]
        runs = {name: (dec.reset, g.replay) for name, g in graphs.items()}
        times = ds.time_interleaved(runs, args.reps)
        base = ds.median(times["none"])
        print(f"\n### batch {batch}: graph replay, median us over {args.reps} (interleaved)\n")
        print("| variant | us | vs none | bitwise == none | note |\n|---|---|---|---|---|")
        for name in variants:
            if name not in times:
                print(f"| {name} | - | - | - | {notes.get(name, '')} |")
                continue
            m = ds.median(times[name])
            print(f"| {name} | {m:.1f} +-{ds.spread(times[name]):.1f} | {m - base:+.1f} | "
                  f"{ds.bitwise_equal(ref, outs[name])} | {notes.get(name, '')} |", flush=True)
        del graphs, outs
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
