"""The benchmark report: every single-GPU measurement in one process, one device call.

    python benchmarks/report.py [--quick] [--out benchmarks/RESULTS.md] [--sections a,b,...]

Prints compact Markdown tables and writes them to RESULTS.md (and PNG plots
where matplotlib is installed) with the device, driver, torch version and the
exact command.  GPU time comes from CUDA events around CUDA-graph replays, so
host launch costs do not blur kernel times; medians over many repetitions; L2
is flushed before every cold measurement by reading a buffer 8x the L2 size;
weights are random, never zeros.

Sections:
  effect   a bf16 GEMV y = x @ W^T (K = 7168) after a bandwidth-idle window of T
           us on the main stream (one CTA spinning), in four variants: cold,
           empty fork (the control), prefetched (fork at the window's start,
           join at the end), hot (W read just before: the physical limit).
  kernels  the prefetch kernel variants and grids on the same sequence, their
           own duration, and how much they slow a concurrent memory-bound copy.
  host     host cost of fork+join: the controller, a Python reference built
           the seed's way, and the C floor; controller construction time.
  graph    the cost of an empty fork inside a replayed graph, mid-graph and
           at the graph's root, against no fork.
  table    the range table as kernel parameters (shipped) against a table in
           device memory (the seed's way).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

import l2prefetch
from l2prefetch import PrefetchController, PreparedWeightRanges, _C

MIB = 2**20
K = 7168
DEV = "cuda:0"


# ---------------------------------------------------------------- helpers

class Rig:
    """Flush buffer, spin calibration, graph pool, event timing."""

    def __init__(self):
        props = torch.cuda.get_device_properties(0)
        self.l2 = _C.device_info(0)["l2_bytes"]
        self.flush_buf = torch.randn(8 * self.l2 // 4, device=DEV)
        self.scratch = torch.empty((), device=DEV)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()
        self.name = props.name
        self.cycles_per_us = self._calibrate()

    def flush(self):
        torch.sum(self.flush_buf, dim=0, out=self.scratch)

    def _calibrate(self):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        cycles = 2_000_000
        s.record()
        torch.cuda._sleep(cycles)
        e.record()
        torch.cuda.synchronize()
        return cycles / (s.elapsed_time(e) * 1e3)

    def spin(self, us):
        if us > 0:
            torch.cuda._sleep(int(us * self.cycles_per_us))

    def capture(self, fn):
        g = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()   # warm-up outside capture (cuBLAS handles, workspaces)
            torch.cuda.synchronize()
            with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
                fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize()
        return g

    def time_graphs(self, graphs, befores, reps):
        """Medians (us) of each graph's replay, the variants interleaved rep by rep
        so that drift (clocks, temperature) affects all of them alike."""
        pairs = {name: [] for name in graphs}
        for _ in range(reps):
            for name, g in graphs.items():
                befores[name]()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                g.replay()
                e.record()
                pairs[name].append((s, e))
        torch.cuda.synchronize()
        return {name: statistics.median(s.elapsed_time(e) * 1e3 for s, e in p)
                for name, p in pairs.items()}

    def time_graph(self, g, reps, before=None):
        """Median us of g.replay(), with before() (e.g. a flush) run first each time."""
        pairs = []
        for _ in range(reps):
            if before:
                before()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            pairs.append((s, e))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs)


def weight(mib):
    rows = max(32, int(mib * MIB / (K * 2)) // 32 * 32)
    return torch.randn(rows, K, device=DEV, dtype=torch.float32).to(torch.bfloat16)


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def pct(x):
    return f"{100 * x:.0f}%"


# ---------------------------------------------------------------- effect

def run_sequence(rig, w, batch, window, prepared_by_name, reps):
    """cold / empty / prefetched / hot medians (us) of [fork?] spin(window) gemv [join?]."""
    x = torch.randn(batch, K, device=DEV, dtype=torch.bfloat16)
    # Names ending in " (branch)" fork to the side stream inside the graph (graph_fork="branch").
    ctrls = {mode: PrefetchController(0, graph_fork=mode) for mode in ("inline", "branch")}
    for name, p in prepared_by_name.items():
        base = name[: -len(" (branch)")] if name.endswith(" (branch)") else name
        ctrls["branch" if base != name else "inline"].add(base, 0, [batch], p)

    before = torch.zeros(256, device=DEV)

    def step(name=None):
        ctrl, point = None, name
        if name:
            mode = "branch" if name.endswith(" (branch)") else "inline"
            ctrl, point = ctrls[mode], name[: -len(" (branch)")] if mode == "branch" else name

        def fn():
            before.add_(1.0)   # the work the fork follows: the fork is mid-graph, as in a layer
            if ctrl:
                ctrl.fork(point, 0, batch)
            rig.spin(window)
            torch.nn.functional.linear(x, w)
            if ctrl:
                ctrl.join()
        return fn

    graphs = {"cold": rig.capture(step()), "hot": None}
    graphs["hot"] = graphs["cold"]
    for name in prepared_by_name:
        graphs[name] = rig.capture(step(name))

    def warm():
        rig.flush()
        torch.nn.functional.linear(x, w)

    befores = {name: (warm if name == "hot" else rig.flush) for name in graphs}
    out = rig.time_graphs(graphs, befores, reps)
    for ctrl in ctrls.values():
        ctrl.close()
    return out


def section_effect(rig, quick):
    sizes = [16, 32] if quick else [2, 4, 8, 16, 24, 32, 48]
    batches = [1, 8] if quick else [1, 2, 4, 8]
    windows = [0, 10, 20] if quick else [0, 5, 10, 20, 40]
    reps = 60 if quick else 150
    empty = PreparedWeightRanges([], device=0, carveout=100)
    rows, raw = [], []
    for mib in sizes:
        w = weight(mib)
        pf = PreparedWeightRanges([w], carveout=100)
        for b in batches:
            for t in windows:
                r = run_sequence(rig, w, b, t, {"empty": empty, "prefetched": pf,
                                                "empty (branch)": empty,
                                                "prefetched (branch)": pf}, reps)
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
    text = ("### The effect: GEMV after a bandwidth-idle window (step time, us)\n\n"
            "Step = small op, [fork] spin(T) GEMV [join], replayed as a CUDA graph, the variants "
            "interleaved; default kernel, grid 32, carveout 100.  Forks as shipped "
            "(graph_fork='inline': the loader on the captured stream with launch-order edges) "
            "and as a side branch (graph_fork='branch').  gap = cold - hot (the prize); net = "
            "empty fork - prefetched (the gain against the control); recovered = net / gap "
            "(shown where the gap exceeds 0.3 us); vs cold = cold - prefetched (what a user "
            "sees against not forking).\n\n"
            + table(["W MiB", "batch", "T us", "cold", "empty fork", "prefetched", "hot", "gap",
                     "net", "recovered", "vs cold", "branch: empty", "branch: prefetched",
                     "branch: recovered", "branch: vs cold"], rows))
    return text, raw


# ---------------------------------------------------------------- kernels

def section_kernels(rig, quick):
    variants = [v for v, info in l2prefetch.kernel_variants().items()
                if _C.device_info(0)["sm"] >= info["min_sm"]]
    grids = [8, 32, 132] if quick else [8, 16, 32, 64, 132]
    reps = 40 if quick else 100
    window = 10
    rows = []
    src = torch.randn(64 * MIB, device=DEV)   # 256 MiB copy: a memory-bound neighbour
    dst = torch.empty_like(src)
    empty = PreparedWeightRanges([], device=0, carveout=100)
    for mib in (16, 32):
        w = weight(mib)
        base = run_sequence(rig, w, 1, window, {"empty": empty}, reps)
        for v in variants:
            for grid in grids:
                if not v.startswith("ring") and grid != 32:
                    continue
                p = PreparedWeightRanges([w], kernel=v, grid=grid, carveout=100)
                r = run_sequence(rig, w, 1, window, {"empty": empty, "pf": p}, reps)
                gap = r["cold"] - r["hot"]
                rec = (r["empty"] - r["pf"]) / gap if gap > 0.3 else float("nan")
                # The loader's own duration, alone on a cold L2.
                alone = rig.capture(lambda: p.launch())
                own = rig.time_graph(alone, reps, rig.flush)
                # Slowdown of a concurrent 256 MiB copy on the main stream.
                ctrl = PrefetchController(0)
                ctrl.add("p", 0, [1], p)

                def copy_with(fork):
                    def fn():
                        if fork:
                            ctrl.fork("p", 0, 1)
                        dst.copy_(src)
                        if fork:
                            ctrl.join()
                    return fn

                c0 = rig.time_graph(rig.capture(copy_with(False)), reps, rig.flush)
                c1 = rig.time_graph(rig.capture(copy_with(True)), reps, rig.flush)
                ctrl.close()
                rows.append((mib, v, grid, p.block, f"{r['pf']:.2f}", "-" if rec != rec else pct(rec),
                             f"{own:.2f}", f"{mib / own * MIB / 1e6:.2f}", f"{c1 - c0:+.2f}"))
        rows.append((mib, "(cold / empty / hot)", "", "", f"{base['cold']:.2f} / {base['empty']:.2f} / "
                     f"{base['hot']:.2f}", "", "", "", ""))
    text = ("### Kernel variants (W 16 and 32 MiB, batch 1, T = 10 us)\n\n"
            "prefetched = step time with that loader; recovered net of the empty fork; own = the "
            "loader alone on a cold L2 (us) and its rate (TB/s); copy slowdown = extra time of a "
            "concurrent 256 MiB device copy on the main stream when the loader runs beside it.\n\n"
            + table(["W MiB", "variant", "grid", "block", "prefetched us", "recovered", "own us",
                     "TB/s", "copy slowdown us"], rows))
    return text


# ---------------------------------------------------------------- host

def _python_reference(p, n):
    """The seed's way: torch events/streams, cuda-bindings cuLaunchKernelEx, same kernel."""
    from cuda.bindings import driver as cu

    image, _ = _C._kernel_image(p.kernel, _C.device_info(0)["sm"])
    err, mod = cu.cuModuleLoadData(image)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    err, fn = cu.cuModuleGetFunction(mod, b"l2p_prefetch_8")
    cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, p.smem)
    words = [len(p.ranges), sum(n // 16 for _, n in p.ranges)]
    for ptr, nb in p.ranges:
        words += [ptr, nb]
    words += [0] * (2 + 2 * 8 - len(words))
    block = (ctypes.c_uint64 * len(words))(*words)
    args = (ctypes.c_void_p * 1)(ctypes.addressof(block))
    attrs = []
    top = cu.CUlaunchAttribute()
    top.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PRIORITY
    top.value.priority = _C.device_info(0)["greatest_priority"]
    attrs.append(top)
    smem = cu.CUlaunchAttribute()
    smem.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    smem.value.sharedMemCarveout = 100
    attrs.append(smem)
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = p.grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = p.block, 1, 1
    config.sharedMemBytes, config.attrs, config.numAttrs = p.smem, attrs, len(attrs)
    side = torch.cuda.Stream()
    event = torch.cuda.Event()
    handle = cu.CUstream(side.cuda_stream)
    address = ctypes.addressof(args)

    def fork_join():
        event.record(torch.cuda.current_stream(0))
        side.wait_event(event)
        config.hStream = handle
        err, = cu.cuLaunchKernelEx(config, fn, address, 0)
        torch.cuda.current_stream(0).wait_stream(side)

    fork_join()
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fork_join()
    t1 = time.perf_counter_ns()
    torch.cuda.synchronize()
    cu.cuModuleUnload(mod)
    return (t1 - t0) / n / 1e3


def section_host(rig, quick):
    n = 5000 if quick else 20000
    # An empty table: the kernel returns at once, so the GPU never falls behind
    # and back-pressure cannot throttle the host loop being measured.
    p = PreparedWeightRanges([], device=0, grid=32, carveout=100, priority=True)
    ctrl = PrefetchController(0)
    ctrl.add("p", 0, [1], p)
    fork, join = ctrl.fork, ctrl.join

    def controller_us():
        for _ in range(200):
            fork("p", 0, 1)
            join()
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fork("p", 0, 1)
            join()
        t1 = time.perf_counter_ns()
        torch.cuda.synchronize()
        return (t1 - t0) / n / 1e3

    def floor_us():
        _C._floor_fork_join(p, 200, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        return _C._floor_fork_join(p, n, torch.cuda.current_stream().cuda_stream) / n / 1e3

    def op_us():
        from l2prefetch import ops

        handle = ops.register(ctrl)
        op_fork, op_join = torch.ops.l2prefetch.fork, torch.ops.l2prefetch.join
        try:
            for _ in range(200):
                op_fork(handle, "p", 0, 1)
                op_join(handle)
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(n):
                op_fork(handle, "p", 0, 1)
                op_join(handle)
            t1 = time.perf_counter_ns()
            torch.cuda.synchronize()
        finally:
            ops.unregister(handle)
        return (t1 - t0) / n / 1e3

    a = statistics.median(controller_us() for _ in range(5))
    c = statistics.median(floor_us() for _ in range(5))
    d = statistics.median(op_us() for _ in range(5))
    try:
        b = statistics.median(_python_reference(p, n // 4) for _ in range(3))
    except ImportError:
        b = float("nan")
    unknown = time.perf_counter_ns()
    for _ in range(n):
        fork("nothing", 0, 1)
    unknown = (time.perf_counter_ns() - unknown) / n / 1e3
    ctrl.close()

    # Construction of the Kimi-sized 61-layer TP8 plan, each in a fresh process.
    import subprocess

    times, plan_note = {}, "plan size unknown"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "construct.py")
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, L2PREFETCH_CACHE_DIR=tmp)
        for label in ("cold NVRTC cache", "warm disk cache"):
            out = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True)
            if out.returncode:
                times[label] = "failed: " + out.stderr.strip().splitlines()[-1]
                continue
            ms, entries, tables = out.stdout.split()
            times[label] = f"{float(ms):.1f} ms"
            plan_note = f"{entries} entries, {tables} prepared tables"
    rows = [("(a) PrefetchController.fork + join, from Python", f"{a:.2f}", f"{a / c:.2f}x"),
            ("(b) Python reference (seed's way: torch events, cuda-bindings launch)", f"{b:.2f}",
             f"{b / c:.2f}x"),
            ("(c) floor: the same driver calls from C", f"{c:.2f}", "1.00x"),
            ("(d) torch.ops.l2prefetch.fork + join (the custom ops, eager)", f"{d:.2f}",
             f"{d / c:.2f}x"),
            ("fork of an unregistered key (returns False)", f"{unknown:.3f}", "")]
    text = ("### Host cost of one fork + join (eager, us per pair, median of 5 runs of "
            f"{n})\n\n" + table(["path", "us", "vs floor"], rows)
            + f"\n\n(a) is {b / a:.1f}x cheaper than (b).  Current stream found through: "
            f"`{_C.stream_source()}`.\n\n"
            f"Building a controller for the 61-layer Kimi-sized TP8 plan ({plan_note}), in a "
            "fresh process (benchmarks/construct.py): "
            + ", ".join(f"{k} {v}" for k, v in times.items()) + ".")
    return text


# ---------------------------------------------------------------- graph

def section_graph(rig, quick):
    reps = 200 if quick else 500
    w = weight(8)
    x = torch.randn(1, K, device=DEV, dtype=torch.bfloat16)
    empty = PreparedWeightRanges([], device=0)
    ctrls = {mode: PrefetchController(0, graph_fork=mode) for mode in ("inline", "branch")}
    for ctrl in ctrls.values():
        ctrl.add("e", 0, [1], empty)

    def seq(where, mode):
        ctrl = ctrls[mode]

        def fn():
            if where == "root":
                ctrl.fork("e", 0, 1)
            rig.spin(5)
            if where == "mid":
                ctrl.fork("e", 0, 1)
            torch.nn.functional.linear(x, w)
            rig.spin(5)
            torch.nn.functional.linear(x, w)
            if where:
                ctrl.join()
        return fn

    # A chain of 300 cuBLAS GEMVs (2048 x 2048 bf16, batch 1), each followed by a scale:
    # the shape of a decode step's graph, where a side branch costs tens of us.
    wc = torch.randn(2048, 2048, device=DEV, dtype=torch.bfloat16)
    hc = torch.randn(1, 2048, device=DEV, dtype=torch.bfloat16)

    def chain(mode):
        def fn():
            v = hc
            for i in range(300):
                v = torch.nn.functional.linear(v, wc) * 0.01
                if mode and i == 150:
                    ctrls[mode].fork("e", 0, 1)
            if mode:
                ctrls[mode].join()
        return fn

    graphs = {("short", None, None): rig.capture(seq(None, "inline"))}
    for mode in ("inline", "branch"):
        for where in ("mid", "root"):
            graphs[("short", where, mode)] = rig.capture(seq(where, mode))
    for mode in (None, "inline", "branch"):
        graphs[("chain", "mid", mode)] = rig.capture(chain(mode))
    # Interleave the variants so drift hits all of them alike.
    res = {k: [] for k in graphs}
    for _ in range(5):
        for k, g in graphs.items():
            res[k].append(rig.time_graph(g, reps // 5))
    med = {k: statistics.median(v) for k, v in res.items()}
    base = {"short": med[("short", None, None)], "chain": med[("chain", "mid", None)]}
    label = {"short": "spin 5 us, GEMV 8 MiB, spin 5 us, GEMV",
             "chain": "300 x (GEMV 2048 x 2048, scale)"}
    rows = []
    for (shape, where, mode), m in med.items():
        what = "no fork" if mode is None else (
            f"empty fork {'mid-graph' if where == 'mid' else 'at the root'}, {mode}")
        rows.append((label[shape], what, f"{m:.2f}",
                     "" if mode is None else f"{m - base[shape]:+.2f}"))
    for ctrl in ctrls.values():
        ctrl.close()
    return ("### Cost of a fork inside a replayed graph (us)\n\n"
            "One empty fork and the join at the end, as shipped (graph_fork='inline') and as a "
            "side branch ('branch'), against the same graph without it.\n\n"
            + table(["graph", "fork", "replay us", "vs no fork"], rows))


# ---------------------------------------------------------------- table

def section_table(rig, quick):
    """Range table as the parameter block (ours) vs in device memory (the seed's).

    The device-memory form is the same source built with -DL2P_TABLE_GLOBAL=1
    and launched through cuda-bindings with a pointer to a CUDA tensor holding
    the same bytes.  Compared: the loader alone on a cold L2 (the table itself
    flushed too), for few and many ranges."""
    from cuda.bindings import driver as cu

    reps = 60 if quick else 200
    sm = _C.device_info(0)["sm"]
    info = l2prefetch.kernel_variants()["ring"]
    src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels",
                            "prefetch.cu")).read()
    image = _C._compile_source(src, [f"--gpu-architecture=sm_{sm}", "-std=c++17",
                                     "-DL2P_TABLE_GLOBAL=1", *info["defines"].split()])
    err, mod = cu.cuModuleLoadData(image)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    rows = []
    for mib, pieces in ((16, 1), (16, 24), (32, 1), (32, 100)):
        w = weight(mib)
        ws = list(torch.chunk(w, pieces, dim=0)) if pieces > 1 else [w]
        ws = [t for t in ws if t.data_ptr() % 16 == 0]
        p = PreparedWeightRanges(ws, carveout=100)
        cap = next(c for c in (8, 32, 128) if c >= len(p.ranges))
        words = [len(p.ranges), sum(n // 16 for _, n in p.ranges)]
        for ptr, nb in p.ranges:
            words += [ptr, nb]
        words += [0] * (2 + 2 * cap - len(words))
        dev_table = torch.tensor(words, dtype=torch.int64, device=DEV)
        err, fn = cu.cuModuleGetFunction(mod, f"l2p_prefetch_{cap}".encode())
        cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                              info["smem"])
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        attr.value.sharedMemCarveout = 100
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = p.grid, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = p.block, 1, 1
        config.sharedMemBytes, config.attrs, config.numAttrs = p.smem, [attr], 1
        pointer = ctypes.c_void_p(dev_table.data_ptr())
        args = (ctypes.c_void_p * 1)(ctypes.addressof(pointer))

        def launch_global():
            config.hStream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
            err, = cu.cuLaunchKernelEx(config, fn, ctypes.addressof(args), 0)
            assert err == cu.CUresult.CUDA_SUCCESS, err

        graphs = {"param": rig.capture(lambda: p.launch()), "global": rig.capture(launch_global)}
        t = rig.time_graphs(graphs, {k: rig.flush for k in graphs}, reps)
        rows.append((mib, len(p.ranges), f"{t['param']:.2f}", f"{t['global']:.2f}",
                     f"{t['global'] - t['param']:+.2f}"))
    cu.cuModuleUnload(mod)
    return ("### Where the range table lives (loader alone on a cold L2, default ring, grid 32; us)\n\n"
            + table(["W MiB", "ranges", "parameter block (shipped)", "device memory (seed)",
                     "difference"], rows))


# ---------------------------------------------------------------- main

SECTIONS = {"effect": section_effect, "kernels": section_kernels, "host": section_host,
            "graph": section_graph, "table": section_table}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "RESULTS.md"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/report.py needs a CUDA GPU; none is visible here.")
        return 0
    rig = Rig()
    info = _C.device_info(0)
    drv = _C.driver_info()
    header = (f"Device: {rig.name} (sm_{info['sm']}, {info['sm_count']} SMs, L2 "
              f"{info['l2_bytes'] / MIB:.0f} MiB), driver {drv['version'] // 1000}."
              f"{drv['version'] % 1000 // 10}, torch {torch.__version__}, l2prefetch "
              f"{l2prefetch.__version__}, NVRTC {'.'.join(map(str, _C.nvrtc_info()['version']))}, "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.\n"
              f"Command: `python benchmarks/report.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
              f" (spin calibrated at {rig.cycles_per_us:.0f} cycles/us).")
    print(header, flush=True)
    parts = [header]
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        result = SECTIONS[name](rig, args.quick)
        text = result[0] if isinstance(result, tuple) else result
        print("\n" + text + f"\n\n({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
        parts.append(text)
    with open(args.out, "w") as f:
        f.write("# l2prefetch benchmark results\n\n" + "\n\n".join(parts) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
