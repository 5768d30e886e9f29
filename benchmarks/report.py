"""The benchmark report: every single-GPU measurement in one process, one device call.

    python benchmarks/report.py [--quick] [--out benchmarks/RESULTS.md] [--sections a,b,...]

Prints compact Markdown tables and writes them to RESULTS.md (and PNG plots
next to it where matplotlib is installed: effect_<mib>mib.png,
layer_speedup.png) with the device, driver, torch version and the exact
command.  GPU time comes from CUDA events around CUDA-graph replays, so
host launch costs do not blur kernel times; medians over many repetitions; L2
is flushed before every cold measurement by reading a buffer 8x the L2 size;
weights are random, never zeros.  A section that fails is reported as
failed (traceback on stderr) and the others still run; the exit status is 1.

Sections:
  effect   a bf16 GEMV y = x @ W^T (K = 7168) after a bandwidth-idle window of T
           us on the main stream (one CTA spinning), in four variants: cold,
           empty fork (the control), prefetched (fork at the window's start,
           join at the end), hot (W read just before: the physical limit).
  glue     the effect with a window of small kernels that touch memory
           (RMSNorm, scale, add) instead of the spin, for the loaders of
           GLUE_LOADERS (kernel variant, grid), over GLUE_INSTANCES captures.
  compute  the same with a compute-bound window: GEMMs on L2-resident matrices.
  persist  the alternative: CUDA L2 persistence (a set-aside and a persisting
           access-policy window over W, through cuda-python) on the effect's
           sequence, flushed and steady, against cold, l2prefetch and hot.
  layer    a decode step of two Kimi-shaped MoE layers at TP8 shard sizes in
           one graph, with kimi_k3.plan's forks at LAYER_POINTS (the candidate;
           the shipped default forks nowhere): no prefetch, l2prefetch, empty
           forks, the limit, and the loaders of LAYER_ALT_KERNELS, at batches 1-8.
  layer_glue  the same step with chains of small kernels in place of the
           attention-core and all-reduce spins.
  caps     the layer step per TP (1, 2, 4, 8), batch and next_attention cap, and
           the other points left out: what kimi_k3.NEXT_ATTENTION and
           kimi_k3.DEFAULT_POINTS were chosen from (with spin stand-ins).
  kernels  the prefetch kernel variants and grids on the same sequence, their
           own duration, and how much they slow a concurrent memory-bound copy.
  host     host cost of fork+join: the controller, a Python reference built
           the seed's way, and the C floor; controller construction time.
  graph    the cost of an empty fork inside a replayed graph, mid-graph and
           at the graph's root, against no fork and against a plain kernel node.
  table    the range table as kernel parameters (shipped) against a table in
           device memory (the seed's way).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch

import l2prefetch
from l2prefetch import PrefetchController, PreparedWeightRanges, _C

MIB = 2**20
K = 7168
DEV = "cuda:0"


# ---------------------------------------------------------------- helpers

#: Graph instances per variant in the layer and caps sections (Rig.time_instances).
INSTANCES = 3
#: Graph instances per variant in the graph section (an empty fork costs about as much as
#: two instances of one capture differ).
GRAPH_INSTANCES = 9


def spin_cycles_per_us():
    """torch.cuda._sleep cycles per microsecond on the current device (the spin's scale)."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    cycles = 2_000_000
    s.record()
    torch.cuda._sleep(cycles)
    e.record()
    torch.cuda.synchronize()
    return cycles / (s.elapsed_time(e) * 1e3)


def empty_controller(plan, device=0, kernel=None, graph_fork="inline"):
    """The control: plan's points, layers and batches with empty tables (same launch settings)."""
    controller = PrefetchController(device, graph_fork=graph_fork)
    tables = {}
    for entry in plan:
        key = (entry.grid, entry.carveout, entry.priority)
        if key not in tables:
            tables[key] = PreparedWeightRanges(
                [], grid=entry.grid, carveout=entry.carveout, priority=entry.priority,
                device=device, kernel=kernel)
        controller.add(entry.point, entry.layer, entry.batches, tables[key])
    return controller


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
        self.cycles_per_us = spin_cycles_per_us()
        # True: wait for the GPU after each round of replays (every graph once), so
        # that the host never runs more than a round ahead.  benchmarks/probe_queue.py
        # found the same glue tables either way (RESULTS.md, run 9): off.
        self.sync_rounds = False

    def flush(self):
        torch.sum(self.flush_buf, dim=0, out=self.scratch)

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

    def replays(self, graphs, befores, reps):
        """Every replay's us per graph, the graphs interleaved rep by rep so that
        drift (clocks, temperature) affects all of them alike; befores[key]()
        runs before each replay."""
        pairs = {key: [] for key in graphs}
        for _ in range(reps):
            for key, g in graphs.items():
                befores[key]()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                g.replay()
                e.record()
                pairs[key].append((s, e))
            if self.sync_rounds:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return {key: [s.elapsed_time(e) * 1e3 for s, e in p] for key, p in pairs.items()}

    def time_graphs(self, graphs, befores, reps):
        """Medians (us) of each graph's replay (see replays)."""
        return {name: statistics.median(us)
                for name, us in self.replays(graphs, befores, reps).items()}

    def instance_medians(self, fns, befores, reps, instances=INSTANCES):
        """Each variant of ``fns`` captured ``instances`` times, every graph replayed
        ``reps`` times (interleaved, see replays): {name: [median us of each instance]}.
        Two instantiations of one capture can differ by several us (a two-layer step
        here, up to 48 us in a real model's), more than the effects measured."""
        graphs = {(name, i): self.capture(fn) for i in range(instances)
                  for name, fn in fns.items()}
        us = self.replays(graphs, {key: befores[key[0]] for key in graphs}, reps)
        del graphs
        return {name: [statistics.median(us[name, i]) for i in range(instances)]
                for name in fns}, us

    def time_instances(self, fns, befores, reps, instances=INSTANCES):
        """Like time_graphs, over ``instances`` captures of each variant (see
        instance_medians).  Returns ({name: median of all instances' replays},
        {name: max - min of the per-instance medians})."""
        per, us = self.instance_medians(fns, befores, reps, instances)
        medians = {name: statistics.median(x for i in range(instances) for x in us[name, i])
                   for name in fns}
        return medians, {name: max(m) - min(m) for name, m in per.items()}

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

def run_sequence(rig, w, batch, window, prepared_by_name, reps, window_fn=None, instances=1):
    """cold / empty / prefetched / hot medians (us) of [fork?] spin(window) gemv [join?];
    window_fn() enqueues the window instead of the spin when given.  With instances > 1
    every variant is captured that many times and the median of the instances' medians
    is returned (hot replays cold's instances); out["spread"] = {variant: max - min of
    the instances' medians}."""
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
            if window_fn is None:
                rig.spin(window)
            else:
                window_fn()
            torch.nn.functional.linear(x, w)
            if ctrl:
                ctrl.join()
        return fn

    graphs = {}
    for i in range(instances):
        graphs["cold", i] = graphs["hot", i] = rig.capture(step())
        for name in prepared_by_name:
            graphs[name, i] = rig.capture(step(name))

    def warm():
        rig.flush()
        torch.nn.functional.linear(x, w)

    befores = {key: (warm if key[0] == "hot" else rig.flush) for key in graphs}
    us = rig.replays(graphs, befores, reps)
    del graphs
    per = {name: [statistics.median(us[name, i]) for i in range(instances)]
           for name in ("cold", "hot", *prepared_by_name)}
    out = {name: statistics.median(m) for name, m in per.items()}
    if instances > 1:
        out["spread"] = {name: max(m) - min(m) for name, m in per.items()}
    for ctrl in ctrls.values():
        ctrl.close()
    return out


#: Graph instances per variant in the effect section: at 16 MiB the cold-to-hot gap
#: is 0.8-1.6 us, and one capture can sit 0.3 us off the next (run 9).
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


def section_effect(rig, quick):
    sizes = [16, 32] if quick else [2, 4, 8, 16, 24, 32, 48]
    batches = [1, 8] if quick else [1, 2, 4, 8]
    windows = [0, 10, 20] if quick else [0, 5, 10, 20, 40]
    reps = 60 if quick else 100
    instances = 1 if quick else EFFECT_INSTANCES
    empty = PreparedWeightRanges([], device=0, carveout=100)
    rows, raw = [], []
    for mib in sizes:
        w = weight(mib)
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
    text = ("### The effect: GEMV after a bandwidth-idle window (step time, us)\n\n"
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
            + "\n\n" + break_even_table(raw))
    return text, raw


# ---------------------------------------------------------------- glue

_GAMMAS = {}


def glue_chain(h, kernels):
    """Enqueue ``kernels`` small kernels that touch memory: RMSNorm, scale and add on
    h [B, 7168] in turn (the glue section's window and the layer_glue stand-ins)."""
    key = (h.device, h.dtype, h.shape[-1])
    gamma = _GAMMAS.get(key)
    if gamma is None:
        gamma = _GAMMAS[key] = torch.ones(h.shape[-1], device=h.device, dtype=h.dtype)
    v = h
    for k in range(kernels):
        if k % 3 == 0:
            v = torch.nn.functional.rms_norm(v, (h.shape[-1],), gamma)
        elif k % 3 == 1:
            v = v * 0.5
        else:
            v = v + h
    return v


#: The loaders the glue section compares, (kernel variant, grid): the default,
#: half its grid, and the two variants that hold no shared memory and slowed a
#: concurrent memory-bound kernel least in the kernels section.  Grid 8 was
#: measured in run 8 (it does not finish: -10..-16 us at 32 MiB).
GLUE_LOADERS = (("ring", 32), ("ring", 16), ("bulk_prefetch", 32), ("line_prefetch", 32))
#: Graph instances per variant in the glue section.
GLUE_INSTANCES = 5


#: The compute section's window: n products of two L2-resident [COMPUTE_N x COMPUTE_N]
#: bf16 matrices (6 MiB in all; COMPUTE_N**3 * 2 flop each), as for an attention core
#: that is compute-bound.
COMPUTE_N = 1024


def section_glue(rig, quick):
    """The effect with a window of small kernels instead of the spin.

    A real layer's bandwidth-idle windows (norms, RoPE and cache updates, the
    router, an all-reduce) are chains of small latency-bound kernels that do
    touch memory; the spin touches none.  Here the window is n rounds of an
    RMSNorm, a scale and an add on a [B, 7168] bf16 activation (3n kernels),
    with each loader of GLUE_LOADERS."""
    def window(h, n):
        glue_chain(h, 3 * n)
    return _window_effect(
        rig, quick, window, lambda n: 3 * n,
        "The effect with a window of small kernels",
        "a chain of small kernels that touch memory (n x RMSNorm, scale, add on x [B, 7168] "
        "bf16: the shape of a layer's norms and glue)")


def section_compute(rig, quick):
    """The effect with a compute-bound window: n GEMMs on small L2-resident matrices.

    The gate's rule (a window is memory-idle time) says a compute-bound kernel
    should leave room for the loader as the spin does; this measures it."""
    g = torch.Generator(device=DEV).manual_seed(1)
    a, b = (torch.randn(COMPUTE_N, COMPUTE_N, device=DEV, generator=g).to(torch.bfloat16)
            for _ in range(2))

    def window(h, n):
        for _ in range(n):
            torch.mm(a, b)
    return _window_effect(
        rig, quick, window, lambda n: n,
        "The effect with a compute-bound window",
        f"n GEMMs of two L2-resident [{COMPUTE_N} x {COMPUTE_N}] bf16 matrices "
        f"({2 * COMPUTE_N ** 3 / 1e9:.1f} GFLOP each, 6 MiB in all)")


def _window_effect(rig, quick, window, kernels, title, what):
    """The effect's four variants and each loader of GLUE_LOADERS, with window(h, n)
    (n rounds, kernels(n) kernels) in the spin's place."""
    sizes = [16, 32]
    batches = [1, 8]
    rounds = [2, 5] if quick else [2, 5, 10]
    reps = 40 if quick else 100
    instances = 3 if quick else GLUE_INSTANCES
    empty = PreparedWeightRanges([], device=0, carveout=100)
    names = [f"{k} g{g}" for k, g in GLUE_LOADERS]
    rows, raw = [], []
    for mib in sizes:
        w = weight(mib)
        pfs = {name: PreparedWeightRanges([w], carveout=100, grid=g, kernel=k)
               for name, (k, g) in zip(names, GLUE_LOADERS)}
        for b in batches:
            h = torch.randn(b, K, device=DEV, dtype=torch.bfloat16)
            for n in rounds:
                def fn(n=n, h=h):
                    window(h, n)
                # the window alone, hot: its length in us
                alone = rig.time_graphs({"g": rig.capture(fn)}, {"g": lambda: None}, reps)["g"]
                variants = {"empty": empty}
                variants.update(pfs)
                r = run_sequence(rig, w, b, 0, variants, reps, window_fn=fn,
                                 instances=instances)
                gap = r["cold"] - r["hot"]
                row = [f"{w.nbytes / MIB:.1f}", b, kernels(n), f"{alone:.1f}",
                       f"{r['cold']:.2f}", f"{r['empty']:.2f}", f"{r['hot']:.2f}", f"{gap:.2f}"]
                for name in names:
                    net = r["empty"] - r[name]
                    row += [f"{r[name]:.2f}", "-" if gap <= 0.3 else pct(net / gap),
                            f"{r['cold'] - r[name]:+.2f}"]
                row.append(f"{max(r['spread'].values()):.2f}")
                raw.append((mib, b, n, alone, r))
                rows.append(row)
        del w, pfs
    head = ["W MiB", "batch", "window kernels", "window us", "cold", "empty fork", "hot", "gap"]
    for name in names:
        head += [f"{name}: prefetched", f"{name}: recovered", f"{name}: vs cold"]
    head.append("spread")
    text = (f"### {title} (step time, us)\n\n"
            f"As the effect section (inline fork, carveout 100), but the window is {what} "
            "instead of a spin that touches no memory.  Loaders (kernel variant, grid): "
            + ", ".join(names) + ".  window us = the window alone, replayed (hot); "
            "recovered = (empty fork - prefetched) / gap; vs cold = cold - prefetched.  The "
            f"empty fork is the default kernel's.  Each variant captured {instances} times, "
            f"every instance replayed {reps} times (interleaved): the median of the "
            "instances' medians; spread = the largest max - min of the instances' medians "
            "over the row's variants.  In some processes the no-fork graph of a chain of "
            "small kernels replays 2-11 us slower than the same graph with an empty fork "
            "(RESULTS.md, run 9), which inflates cold and the gap; compare against the empty "
            "fork.\n\n" + table(head, rows))
    return text, raw


# ---------------------------------------------------------------- persist

def _cu_call(cu, name, result):
    """Check a cuda.bindings driver call's (CUresult, *values); raise naming the call."""
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{name} failed: {getattr(err, 'name', err)}")
    return result[1] if len(result) == 2 else result[1:]


def _set_window(cu, stream, ptr, nbytes, ratio):
    """The stream's access-policy window: [ptr, ptr + nbytes) persisting with hitRatio ratio,
    misses streaming; nbytes == 0 clears it (all properties normal)."""
    value = getattr(cu, "CUstreamAttrValue", None) or cu.CUlaunchAttributeValue
    value = value()
    win = value.accessPolicyWindow
    win.base_ptr = ptr
    win.num_bytes = nbytes
    win.hitRatio = ratio
    prop = cu.CUaccessProperty
    win.hitProp = prop.CU_ACCESS_PROPERTY_PERSISTING if nbytes else prop.CU_ACCESS_PROPERTY_NORMAL
    win.missProp = prop.CU_ACCESS_PROPERTY_STREAMING if nbytes else prop.CU_ACCESS_PROPERTY_NORMAL
    _cu_call(cu, "cuStreamSetAttribute(CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW)",
             cu.cuStreamSetAttribute(cu.CUstream(stream.cuda_stream),
                                     getattr(cu, "CUstreamAttrID", cu.CUlaunchAttributeID)
                                     .CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW,
                                     value))


def _persist_reset(cu, stream):
    """Undo the section's persistence state; returns the failures (never raises)."""
    failures = []
    steps = (("torch.cuda.synchronize", lambda: torch.cuda.synchronize()),
             ("clear the stream window", lambda: _set_window(cu, stream, 0, 0, 0.0)),
             ("cuCtxResetPersistingL2Cache",
              lambda: _cu_call(cu, "cuCtxResetPersistingL2Cache",
                               cu.cuCtxResetPersistingL2Cache())),
             ("cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 0)",
              lambda: _cu_call(cu, "cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 0)",
                               cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 0))),
             ("torch.cuda.synchronize", lambda: torch.cuda.synchronize()))
    for name, step in steps:
        try:
            step()
        except Exception as exc:  # keep undoing the rest
            failures.append(f"{name}: {exc}")
    return failures


def _window_nodes(cu, g):
    """(kernel nodes carrying a persisting window, kernel nodes) of g's captured graph."""
    graph = cu.CUgraph(int(g.raw_cuda_graph()))
    _, n = _cu_call(cu, "cuGraphGetNodes", cu.cuGraphGetNodes(graph, 0))
    nodes, _ = _cu_call(cu, "cuGraphGetNodes", cu.cuGraphGetNodes(graph, n))
    carrying = kernels = 0
    for node in nodes:
        kind = _cu_call(cu, "cuGraphNodeGetType", cu.cuGraphNodeGetType(node))
        if kind != cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        kernels += 1
        value = _cu_call(cu, "cuGraphKernelNodeGetAttribute(ACCESS_POLICY_WINDOW)",
                         cu.cuGraphKernelNodeGetAttribute(
                             node, cu.CUkernelNodeAttrID.CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW))
        win = value.accessPolicyWindow
        if win.num_bytes and win.hitProp == cu.CUaccessProperty.CU_ACCESS_PROPERTY_PERSISTING:
            carrying += 1
    return carrying, kernels


def _capture_persisting(rig, cu, stream, fn):
    """fn captured on stream (whose window the kernel nodes take at capture), same pool as
    Rig.capture; returns (graph, note on how many kernel nodes carry the window)."""
    try:
        g, kept = torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:  # torch without keep_graph: no node check
        g, kept = torch.cuda.CUDAGraph(), False
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, pool=rig.pool, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    note = "node check unavailable (torch has no CUDAGraph(keep_graph=True))"
    if kept:
        try:
            carrying, kernels = _window_nodes(cu, g)
            note = f"{carrying} of {kernels} kernel nodes carry the window"
        except Exception as exc:
            note = f"node check unavailable ({type(exc).__name__}: {exc})"
        g.instantiate()   # keep_graph defers it; do it before timing
    torch.cuda.synchronize()
    return g, note


def section_persist(rig, quick):
    """CUDA's L2 persistence (access-policy window + set-aside) against l2prefetch."""
    title = "### The alternative: CUDA L2 persistence (step time, us)\n\n"
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return title + ("Skipped: cuda-python (`cuda.bindings.driver`) is not installed, and "
                        "torch has no API for access-policy windows."), []
    sizes, batches = [16, 32], [1, 8]
    windows = [0, 10] if quick else [0, 10, 20]
    reps = 60 if quick else 150
    rows, raw, notes, cleanup = [], [], [], []
    failure = None
    pstream = torch.cuda.Stream()
    try:
        dev = _cu_call(cu, "cuDeviceGet", cu.cuDeviceGet(torch.cuda.current_device()))
        attr = cu.CUdevice_attribute
        max_persist = _cu_call(cu, "cuDeviceGetAttribute(MAX_PERSISTING_L2_CACHE_SIZE)",
                               cu.cuDeviceGetAttribute(
                                   attr.CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE, dev))
        max_window = _cu_call(cu, "cuDeviceGetAttribute(MAX_ACCESS_POLICY_WINDOW_SIZE)",
                              cu.cuDeviceGetAttribute(
                                  attr.CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE, dev))
        if max_persist <= 0 or max_window <= 0:
            return title + (f"Skipped: the device reports max persisting L2 {max_persist} B and "
                            f"max window {max_window} B (persistence unsupported here)."), []
        for mib in sizes:
            w = weight(mib)
            pf = PreparedWeightRanges([w], carveout=100)
            x = {b: torch.randn(b, K, device=DEV, dtype=torch.bfloat16) for b in batches}
            before = torch.zeros(256, device=DEV)
            # Phase 1, no set-aside: cold / l2prefetch (inline fork) / hot, as in the effect.
            base = {(b, t): run_sequence(rig, w, b, t, {"prefetched": pf}, reps)
                    for b in batches for t in windows}
            # Phase 2: set-aside and a persisting window over W on a stream of its own.
            setaside = min(w.nbytes, max_persist)
            span = min(w.nbytes, max_window)
            label = f"{w.nbytes / MIB:.2f}"
            try:
                torch.cuda.synchronize()
                _cu_call(cu, "cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE)",
                         cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE, setaside))
                got = _cu_call(cu, "cuCtxGetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE)",
                               cu.cuCtxGetLimit(cu.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE))
                # hitRatio 1 while the set-aside holds the window (it does at 16 and 32 MiB);
                # lower, the fraction that fits, so that the lines do not evict each other.
                ratio = min(1.0, (got or setaside) / span)
                _set_window(cu, pstream, w.data_ptr(), span, ratio)
                checks = set()
                for b in batches:
                    for t in windows:
                        def fn(xb=x[b], t=t, w=w):
                            before.add_(1.0)
                            rig.spin(t)
                            torch.nn.functional.linear(xb, w)

                        g, check = _capture_persisting(rig, cu, pstream, fn)
                        checks.add(check)
                        p = rig.time_graphs({"persist, flushed": g, "persist, steady": g},
                                            {"persist, flushed": rig.flush,
                                             "persist, steady": lambda: None}, reps)
                        r = dict(base[b, t], **p)
                        raw.append((label, b, t, r))
                        rows.append((label, b, t, f"{r['cold']:.2f}", f"{r['prefetched']:.2f}",
                                     f"{r['persist, flushed']:.2f}", f"{r['persist, steady']:.2f}",
                                     f"{r['hot']:.2f}"))
                        del g
                notes.append(f"W {mib} MiB: window {span / MIB:.2f} MiB, hitRatio {ratio:.2f}, "
                             f"set-aside asked {setaside / MIB:.2f} MiB, got {got / MIB:.2f} MiB; "
                             + "; ".join(sorted(checks)))
            finally:
                cleanup += _persist_reset(cu, pstream)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        failure = f"{type(exc).__name__}: {exc}"
    finally:
        cleanup += _persist_reset(cu, pstream)
    text = title
    if failure:
        text += f"**Failed**: {failure} (rows measured before the failure follow).\n\n"
    if cleanup:
        text += "**Cleanup failures** (later sections may see persisting lines): " + "; ".join(
            dict.fromkeys(cleanup)) + "\n\n"
    if not rows:
        return text.rstrip(), raw
    text += ("Same step as the effect: small op, spin(T), GEMV y = x @ W^T.  cold = flushed L2; "
             "prefetched = l2prefetch (fork at the window's start, inline, join at the end; grid "
             "32, carveout 100); persistence = a set-aside of min(W, device max) bytes "
             "(`cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE)`) and an access-policy window "
             "over W (hitProp persisting, missProp streaming) set on a capture stream of its own "
             "before capture, so the graph's kernel nodes carry it; 'persist, flushed' flushes "
             "before each replay like cold, 'persist, steady' replays without a flush; hot = W "
             "read just before.  cold / prefetched / hot are measured first with no set-aside, "
             "then persistence (persisting lines would survive the flush of the other variants "
             f"too).  Device: max persisting L2 {max_persist / MIB:.2f} MiB, max window "
             f"{max_window / MIB:.2f} MiB.  " + "  ".join(n + "." for n in notes) + "\n\n"
             + table(["W MiB", "batch", "T us", "cold", "prefetched (l2prefetch)",
                      "persist, flushed", "persist, steady", "hot"], rows))
    wins = [(m, b, t, r["prefetched"] - r["persist, flushed"]) for m, b, t, r in raw
            if r["persist, flushed"] < r["prefetched"] - 0.3]
    gaps = [(r["cold"] - r["hot"], r["cold"] - r["persist, flushed"]) for _, _, _, r in raw]
    survived = sum(1 for gap, got in gaps if gap > 0.3 and got >= 0.8 * gap)
    evicted = sum(1 for gap, got in gaps if gap > 0.3 and got < 0.2 * gap)
    steady = max(abs(r["persist, steady"] - r["hot"]) for _, _, _, r in raw)
    if wins:
        where = ", ".join(f"W {m} B{b} T{t} ({d:.2f} us)" for m, b, t, d in wins)
        verdict = (f"Persistence (flushed) beats l2prefetch in {len(wins)} of {len(raw)} rows "
                   f"({where}): its lines are already resident when the step starts, so it "
                   "needs no bandwidth-idle window (a prefetch at T = 0 has nothing to hide "
                   "its load behind).")
    else:
        verdict = (f"Persistence (flushed) beats l2prefetch by more than 0.3 us in none of the "
                   f"{len(raw)} rows.")
    if survived:
        verdict += (f"  In {survived} of {len(raw)} rows the flushed persistence time is within "
                    "20% of the cold-hot gap from hot: the set-aside survived the 8x-L2 flush "
                    "(normal traffic does not evict persisting lines), which is the whole point "
                    "and also the cost.")
    if evicted:
        verdict += (f"  In {evicted} rows it stays near cold: the persisting lines did not "
                    "survive the flush (or the nodes did not carry the window, see above).")
    verdict += (f"  Without a flush, persistence and hot differ by at most {steady:.2f} us: W "
                "fits in L2 either way.")
    text += ("\n\n" + verdict + "\n\nWhy it is not a drop-in alternative for decode: (1) the "
             f"set-aside (up to {max_persist / MIB:.1f} MiB here) is a context-wide limit, taken "
             "from the L2 every other kernel of the process uses, for as long as it is set; "
             "(2) the window is a per-stream (captured: per kernel node) attribute, one window "
             f"of at most {max_window / MIB:.0f} MiB per launch, while a decode step reads a "
             "different weight in every GEMV; (3) a decode step streams each weight once (61 "
             "layers, far more than L2), so persisting one weight only helps if that weight is "
             "reused across steps and fits the set-aside.  l2prefetch needs no reservation: it "
             "loads the next weights into the ordinary L2 during idle bandwidth.")
    return text, raw


# ---------------------------------------------------------------- layer

#: The layer section's stand-ins for a Kimi MoE decode layer at TP8 (per rank, bf16):
#: weight shapes [out, in] of each GEMV, in the order a layer runs them.
LAYER_WEIGHTS = (
    ("attn_in", (1152, K)),        # attention input projection (KDA in_proj_qkvgfab stand-in)
    ("o_proj", (K, 1024)),         # 64 heads x 128 / 8 ranks -> hidden
    ("front", (512, K)),           # packed [router 384 rows; latent-down shard 128 rows]
    ("shared_gate_up", (384, K)),  # shared expert gate_up shard
    ("shared_down", (K, 384)),     # shared expert down shard (reads gate_up's output)
    ("experts", (2176, K)),        # routed experts: one GEMV over ~30 MiB
)
#: Attention core stand-in: one CTA spinning (reads no weights, leaves HBM idle).
LAYER_CORE_US = 20
#: TP8 all-reduce stand-in (after o_proj and after the MoE): one CTA spinning.
LAYER_ALLREDUCE_US = 8
#: layer_glue section: about how long one small kernel of the glue chain runs in a graph
#: at batch 1-8 (glue section, run 8: 6 kernels took 19-24 us, 30 took 88-99 us).
GLUE_KERNEL_US = 3.2


def _glue(h, us):
    """Enqueue about us microseconds of the glue chain on h, at least one kernel."""
    glue_chain(h, max(1, round(us / GLUE_KERNEL_US)))


def _layer_weight(shape):
    return torch.randn(*shape, device=DEV, dtype=torch.float32).to(torch.bfloat16)


def _covered(intervals, start, nbytes):
    """Bytes of [start, start + nbytes) inside the union of intervals [(lo, hi)]."""
    merged = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    end = start + nbytes
    return sum(max(0, min(hi, end) - max(lo, start)) for lo, hi in merged)


def _kimi_layers(tp, count=2):
    """count Kimi-shaped MoE layers with LAYER_WEIGHTS scaled from TP8 to tp (the sharded
    dimension grows by 8 / tp; the router's 384 rows of front are not sharded), as objects
    kimi_k3.plan reads; returns (layers, packed)."""
    from types import SimpleNamespace as NS

    scale = 8 // tp
    layers = []
    for index in range(count):
        ws = {}
        for name, (rows, cols) in LAYER_WEIGHTS:
            if name == "front":
                rows = 384 + (rows - 384) * scale
            elif name in ("o_proj", "shared_down"):
                cols *= scale
            else:
                rows *= scale
            ws[name] = _layer_weight((rows, cols))
        attention = NS(in_proj_qkvgfab=NS(weight=ws["attn_in"]), o_proj=NS(weight=ws["o_proj"]))
        shared = NS(gate_up_proj=NS(weight=ws["shared_gate_up"]),
                    down_proj=NS(weight=ws["shared_down"]))
        layers.append(NS(is_moe_layer=True, layer_idx=index, self_attn=attention,
                         mlp=NS(shared_experts=shared), ws=ws))
    return layers, {layer.layer_idx: layer.ws["front"] for layer in layers}


def _layer_step(rig, layers, ctrl, batch, h, a, s, allreduce, glue=False):
    """The step of the layer sections: the layers' GEMVs, the stand-ins, the seed's forks
    (when ctrl is not None) and one join at the end.  h [B, 7168], a and s: the inputs of
    o_proj and shared_down.  allreduce: the all-reduce's stand-in in us (a spin), or a
    callable that runs a real one (benchmarks/allreduce.py --layer).  glue: the stand-ins
    are chains of small kernels that touch memory (_glue) instead of spins."""
    lin = torch.nn.functional.linear

    def wait(us):
        if glue:
            _glue(h, us)
        else:
            rig.spin(us)

    if not callable(allreduce):
        allreduce_us = allreduce

        def allreduce():
            wait(allreduce_us)

    def fork(point, index):
        if ctrl is not None:
            ctrl.fork(point, index, batch)

    def fn():
        for layer in layers:
            ws, i = layer.ws, layer.layer_idx
            lin(h, ws["attn_in"])
            fork("attention_moe", i)       # after the KDA input projection
            wait(LAYER_CORE_US)            # attention core
            lin(a, ws["o_proj"])
            fork("oproj_down", i)          # after the o-projection
            allreduce()                    # all-reduce
            lin(h, ws["front"])            # router + latent-down
            lin(h, ws["shared_gate_up"])
            lin(s, ws["shared_down"])
            lin(h, ws["experts"])
            fork("next_attention", i)      # once the routed experts are launched
            allreduce()                    # all-reduce
        if ctrl is not None:
            ctrl.join()                    # one join, at the end of the step
    return fn


#: The layer sections' fork points (kimi_k3.plan's points=): the candidate, which
#: is what kimi_k3 shipped at TP 8 until run 9 (attention_moe at B5-8; the
#: next_attention caps are 0).  None: kimi_k3.DEFAULT_POINTS, as shipped.
LAYER_POINTS = ("attention_moe", "next_attention")
#: Loader kernel variants the layer sections also try in (b)'s place.
LAYER_ALT_KERNELS = ("line_prefetch", "bulk_prefetch")


def section_layer(rig, quick, glue=False):
    """Two Kimi-shaped MoE decode layers (TP8 shard sizes) in one graph, with the seed's forks;
    with glue, the attention-core and all-reduce stand-ins are small kernels, not spins."""
    from l2prefetch import kimi_k3

    batches = [1, 8] if quick else [1, 2, 4, 8]
    reps = 60 if quick else 150
    lin = torch.nn.functional.linear
    shapes = dict(LAYER_WEIGHTS)
    layers, packed = _kimi_layers(8)
    entries = kimi_k3.plan(layers, packed, 8, points=LAYER_POINTS)
    ctrl_b = PrefetchController.from_plan(entries, 0)   # graph_fork='inline', as shipped
    ctrl_d = empty_controller(entries, 0)
    ctrl_alt = {k: PrefetchController.from_plan(entries, 0, kernel=k) for k in LAYER_ALT_KERNELS}
    rows, raw = [], []
    for batch in batches:
        h = torch.randn(batch, K, device=DEV, dtype=torch.bfloat16)
        a = torch.randn(batch, shapes["o_proj"][1], device=DEV, dtype=torch.bfloat16)
        s = torch.randn(batch, shapes["shared_down"][1], device=DEV, dtype=torch.bfloat16)
        inputs = {"o_proj": a, "shared_down": s}

        def step(ctrl, batch=batch, h=h, a=a, s=s):
            return _layer_step(rig, layers, ctrl, batch, h, a, s, LAYER_ALLREDUCE_US, glue)

        fns = {"a": step(None), "b": step(ctrl_b), "d": step(ctrl_d)}
        fns.update({k: step(c) for k, c in ctrl_alt.items()})
        befores = {name: rig.flush for name in fns}
        # What the forks load at this batch, and which GEMVs read it.
        active = [(p, l) for p, l, bb in ctrl_b.keys() if bb == batch]
        intervals, loaded = [], 0
        for p, l in active:
            prepared = ctrl_b.get(p, l, batch)
            loaded += prepared.nbytes
            intervals += [(ptr, ptr + n) for ptr, n in prepared.ranges]
        consumers = {}
        for layer in layers:
            for name, wt in layer.ws.items():
                frac = _covered(intervals, wt.data_ptr(), wt.nbytes) / wt.nbytes
                if frac > 0:
                    consumers[f"L{layer.layer_idx} {name}"] = (wt, inputs.get(name, h), frac)
        for key, (wt, xin, _) in consumers.items():
            def gemv(wt=wt, xin=xin):
                lin(xin, wt)

            def warm(wt=wt, xin=xin):
                rig.flush()
                lin(xin, wt)

            fns["cold " + key], befores["cold " + key] = gemv, rig.flush
            fns["hot " + key], befores["hot " + key] = gemv, warm
        t, spread = rig.time_instances(fns, befores, reps)
        saving = sum(frac * max(0.0, t["cold " + key] - t["hot " + key])
                     for key, (_, _, frac) in consumers.items())
        ta, tb, td = t["a"], t["b"], t["d"]
        tc = ta - saving
        share = (ta - tb) / (ta - tc) if ta - tc > 0.5 else float("nan")
        points = sorted({p for p, _ in active})
        raw.append({"batch": batch, "a": ta, "b": tb, "d": td, "c": tc, "share": share,
                    "points": points, "loaded": loaded, "consumers": list(consumers),
                    "alt": {k: t[k] for k in LAYER_ALT_KERNELS}})
        rows.append((batch, ", ".join(points) or "-", f"{loaded / MIB:.1f}", f"{ta:.2f}",
                     f"{tb:.2f}", f"{td:.2f}", f"{tc:.2f}", f"{ta / tb:.3f}x", f"{ta - tb:+.2f}",
                     f"{td - tb:+.2f}", f"{ta - tc:.2f}", "-" if share != share else pct(share),
                     f"{spread['a']:.2f} / {spread['b']:.2f}",
                     *(f"{t[k]:.2f} ({ta / t[k]:.3f}x)" for k in LAYER_ALT_KERNELS)))
    for ctrl in (ctrl_b, ctrl_d, *ctrl_alt.values()):
        ctrl.close()
    per_layer = sum(wt.nbytes for wt in layers[0].ws.values())
    sizes = ", ".join(f"{name} [{r} x {c}] {r * c * 2 / MIB:.2f} MiB"
                      for name, (r, c) in LAYER_WEIGHTS)
    goal = []
    for row in raw:
        ok_speed = row["a"] / row["b"] >= 0.99
        limited = row["a"] - row["c"] > 0.5
        ok_share = (not limited) or row["share"] >= 0.85
        goal.append(ok_speed and ok_share)
        row["goal"] = goal[-1]
    misses = [f"B{row['batch']}" for row in raw if not row["goal"]]
    if glue:
        x1 = torch.randn(1, K, device=DEV, dtype=torch.bfloat16)
        lengths = rig.time_graphs({us: rig.capture(lambda us=us: _glue(x1, us))
                                   for us in (LAYER_CORE_US, LAYER_ALLREDUCE_US)},
                                  {us: (lambda: None) for us in (LAYER_CORE_US, LAYER_ALLREDUCE_US)},
                                  reps)
        title = "A decode step with real glue: the same two layers, small kernels for the spins"
        core = (f"{round(LAYER_CORE_US / GLUE_KERNEL_US)} small kernels (RMSNorm, scale, add "
                f"on x [B, 7168]; {lengths[LAYER_CORE_US]:.1f} us alone at B1)")
        ar = (f"{round(LAYER_ALLREDUCE_US / GLUE_KERNEL_US)} such kernels "
              f"({lengths[LAYER_ALLREDUCE_US]:.1f} us at B1)")
    else:
        title = "A decode step: two Kimi-shaped MoE layers at TP8"
        core = f"spin({LAYER_CORE_US} us) (one CTA, reads no weights)"
        ar = f"spin({LAYER_ALLREDUCE_US} us)"
    text = (f"### {title} (step time, us)\n\n"
            f"One CUDA graph of two layers back to back, per layer: GEMV attn_in; "
            f"[attention_moe]; attention core stand-in = {core}; GEMV o_proj; [oproj_down]; "
            f"all-reduce stand-in = {ar}; GEMVs front, shared gate_up, shared down, routed "
            f"experts; [next_attention]; all-reduce stand-in = {ar}; "
            "one join at the end of the step.  Weights (bf16, hidden 7168, per TP8 rank, "
            f"{per_layer / MIB:.1f} MiB per layer): {sizes}; norms, activations and routing "
            "are left out, every GEMV reads fixed random inputs.  Forks, weights, batches, "
            "grids, carveouts and priorities come from `l2prefetch.kimi_k3.plan(layers, "
            f"packed, tp=8, points={LAYER_POINTS!r})` (shipped points: "
            f"{', '.join(kimi_k3.DEFAULT_POINTS[8]) or 'none'}; KDA attention: attention_moe at B5-8 "
            "with front + shared expert, grid 32, carveout 100, priority; next_attention: "
            "layer 1's attn_in + o_proj capped at NEXT_ATTENTION[8] "
            f"= {kimi_k3.NEXT_ATTENTION[8]}, grid 32), graph_fork='inline'.  "
            f"Each variant captured {INSTANCES} times (graph instances of one capture differ), "
            "all replays interleaved, each after a flush (a real step's weights are cold): (a) no "
            "prefetch, (b) l2prefetch, (d) the same forks with empty tables (control), and (b) "
            "with the loader kernel " + " or ".join(LAYER_ALT_KERNELS) + " (last columns; "
            "a/that in brackets).  (c) "
            "the limit: (a) minus, for every GEMV whose weight the forks load at that batch, "
            "its cold - hot time measured alone (hot = weight read just before; scaled by the "
            "share of the weight loaded), interleaved with the rest.  It is computed rather "
            "than replayed because the step streams "
            f"{2 * per_layer / MIB:.0f} MiB, more than L2: weights read before the step would "
            "be evicted before their GEMV runs.  share = (a-b)/(a-c), shown where a-c > 0.5 "
            "us.  points = forks that launch at that batch; MiB = bytes they load; spread = "
            "max - min of the per-instance medians of a and of b.\n\n"
            + table(["batch", "points", "MiB", "a: none", "b: l2prefetch", "d: empty forks",
                     "c: limit", "a/b", "a-b", "d-b", "a-c", "share of limit",
                     "spread a / b", *(f"b: {k}" for k in LAYER_ALT_KERNELS)], rows)
            + "\n\nGoal: at least 85% of the limit where the limit exceeds 0.5 us, and never "
            "slower than 0.99x (a/b >= 0.99): "
            + ("met at every batch." if not misses else f"missed at {', '.join(misses)}."))
    return text, raw


# ---------------------------------------------------------------- caps

#: next_attention caps (MiB) the caps section tries (quick / full).
CAPS_MIB_QUICK = (0, 8, 16, 32)
CAPS_MIB = (0, 4, 8, 16, 24, 32)
#: All-reduce stand-in per TP (us): none at TP1; the facts' 7-13 us TP2 window elsewhere.
CAPS_ALLREDUCE_US = {1: 0, 2: 8, 4: 8, 8: 8}
#: Step-time differences below this are noise (us): the choice is the smallest cap within it.
CAPS_NOISE_US = 0.3


def _ablations(entries, tp):
    """The shipped plan's variants the caps section times next to it: the MoE front
    (oproj_down) at grid 32 instead of the seed's 8, without oproj_down, and (TP8)
    without attention_moe."""
    out = {"front g32": [dataclasses.replace(e, grid=32) if e.point == "oproj_down" else e
                         for e in entries],
           "no front": [e for e in entries if e.point != "oproj_down"]}
    if tp == 8:
        out["no attn_moe"] = [e for e in entries if e.point != "attention_moe"]
    return out


def section_caps(rig, quick):
    """kimi_k3.NEXT_ATTENTION by measurement: the two-layer step per TP, batch and cap."""
    from l2prefetch import kimi_k3

    batches = [1, 4, 8] if quick else list(range(1, 9))
    caps = CAPS_MIB_QUICK if quick else CAPS_MIB
    reps = 40 if quick else 100
    rows, raw, summary, ablation_rows = [], [], [], []
    for tp in (1, 2, 4, 8):
        layers, packed = _kimi_layers(tp)
        shapes = {name: tuple(w.shape) for name, w in layers[0].ws.items()}
        # The seed's points at every TP (kimi_k3.plan may leave some out by measurement).
        seed_like = {cap: kimi_k3.plan(layers, packed, tp, {tp: {b: cap for b in range(1, 9)}},
                                       points=kimi_k3.POINTS) for cap in caps}
        ctrls = {cap: PrefetchController.from_plan(entries, 0)
                 for cap, entries in seed_like.items()}
        shipped = kimi_k3.plan(layers, packed, tp)
        ctrls["shipped"] = PrefetchController.from_plan(shipped, 0)
        shipped_seed = kimi_k3.plan(layers, packed, tp, points=kimi_k3.POINTS)
        ablations = _ablations(shipped_seed, tp)
        for name, entries in ablations.items():
            ctrls[name] = PrefetchController.from_plan(entries, 0)
        allreduce = CAPS_ALLREDUCE_US[tp]
        for batch in batches:
            def rand(n, batch=batch):
                return torch.randn(batch, n, device=DEV, dtype=torch.bfloat16)

            h, a, sd = rand(K), rand(shapes["o_proj"][1]), rand(shapes["shared_down"][1])
            fns = {"none": _layer_step(rig, layers, None, batch, h, a, sd, allreduce)}
            for key, ctrl in ctrls.items():
                fns[key] = _layer_step(rig, layers, ctrl, batch, h, a, sd, allreduce)
            t, _ = rig.time_instances(fns, {k: rig.flush for k in fns}, reps)
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
    text = ("### Choosing kimi_k3.NEXT_ATTENTION: next_attention cap per TP and batch "
            "(step time, us)\n\n"
            "The layer section's two Kimi-shaped MoE layers, their weights scaled from TP8 to "
            "each TP (the sharded dimension x 8 / TP), the all-reduce stand-in "
            f"{CAPS_ALLREDUCE_US} us by TP, forks from `kimi_k3.plan(layers, packed, tp, "
            "{tp: {batch: cap}}, points=kimi_k3.POINTS)` (the seed's points at every TP) with the same cap "
            "at every batch (0 = no next_attention), graph_fork='inline'; each variant "
            f"captured {INSTANCES} times, all replays interleaved, each after a flush.  none = no forks at all.  best = the cap with the lowest "
            f"step; choice = the smallest cap within {CAPS_NOISE_US} us of the best; speed-up "
            "= none / choice; shipped cap = what NEXT_ATTENTION holds; shipped = the step with "
            "`kimi_k3.plan(layers, packed, tp)` as shipped.\n\n"
            + table(["TP", "batch", "none"] + [f"cap {c} MiB" for c in caps]
                    + ["best", "choice", "speed-up", "shipped cap", "shipped", "none / shipped"],
                    rows)
            + "\n\nMean speed-up (none / step) over the batches, per TP and cap; the top cap "
            "is what `kimi_k3.NEXT_ATTENTION[tp]` should hold at every batch (0: none):\n\n"
            + table(["TP"] + [f"cap {c}" for c in caps] + ["top"], summary)
            + "\n\nThe other points, at the shipped caps (step us): shipped plan; the seed's "
            "points with oproj_down at grid 32 instead of the seed's 8 (front g32); without "
            "oproj_down (no front); without attention_moe (no attn_moe, TP8).\n\n"
            + table(["TP", "batch", "none", "shipped", "front g32", "no front", "no attn_moe"],
                    ablation_rows))
    return text, raw


# ---------------------------------------------------------------- kernels

#: H200 HBM3e peak (TB/s): a loader "faster" than this skipped loads.
HBM_PEAK_TBS = 4.8


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
        loaders = {(v, grid): PreparedWeightRanges([w], kernel=v, grid=grid, carveout=100)
                   for v in variants for grid in grids if v.startswith("ring") or grid == 32}
        # Every loader of this W in one interleaved sequence run, against one cold /
        # empty / hot: the recovered shares compare like with like.
        r = run_sequence(rig, w, 1, window,
                         {"empty": empty, **{f"{v} g{grid}": p for (v, grid), p in loaders.items()}},
                         reps)
        gap = r["cold"] - r["hot"]
        for (v, grid), p in loaders.items():
            pf = r[f"{v} g{grid}"]
            rec = (r["empty"] - pf) / gap if gap > 0.3 else float("nan")
            # The loader's own duration, alone on a cold L2.
            alone = rig.capture(lambda p=p: p.launch())
            own = rig.time_graph(alone, reps, rig.flush)
            # Slowdown of a concurrent 256 MiB copy on the main stream.
            ctrl = PrefetchController(0)
            ctrl.add("p", 0, [1], p)

            def copy_with(fork, ctrl=ctrl):
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
            rate = mib * MIB / own / 1e6
            # Faster than the HBM can deliver: the kernel cannot have loaded every byte.
            flag = " (above HBM peak: not loading)" if rate > HBM_PEAK_TBS else ""
            rows.append((mib, v, grid, p.block, f"{pf:.2f}", "-" if rec != rec else pct(rec),
                         f"{own:.2f}", f"{rate:.2f}{flag}", f"{c1 - c0:+.2f}"))
        rows.append((mib, "(cold / empty / hot)", "", "", f"{r['cold']:.2f} / {r['empty']:.2f} / "
                     f"{r['hot']:.2f}", "", "", "", ""))
        del loaders
    text = ("### Kernel variants (W 16 and 32 MiB, batch 1, T = 10 us)\n\n"
            "prefetched = step time with that loader (all loaders of one W interleaved in one "
            "run, against one cold / empty / hot); recovered net of the empty fork; own = the "
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
            "Building a controller for the 61-layer Kimi-sized TP8 plan with the seed's points "
            f"and next_attention at 24 MiB ({plan_note}), in a "
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
        # mode "plain": no fork, one plain kernel node (a zero-length spin) in its place:
        # the floor of what any node added to the graph costs.
        ctrl = ctrls.get(mode)

        def fn():
            if where == "root":
                ctrl.fork("e", 0, 1)
            rig.spin(5)
            if where == "mid":
                if ctrl is None:
                    torch.cuda._sleep(0)
                else:
                    ctrl.fork("e", 0, 1)
            torch.nn.functional.linear(x, w)
            rig.spin(5)
            torch.nn.functional.linear(x, w)
            if where and ctrl is not None:
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

    # Instances of one capture differ (placement), by about as much as a fork costs, so
    # each variant is captured GRAPH_INSTANCES times and compared by the median of its
    # instances' medians.
    short = {(None, None): seq(None, "inline")}
    for mode in ("inline", "branch"):
        for where in ("mid", "root"):
            short[(where, mode)] = seq(where, mode)
    short[("mid", "plain")] = seq("mid", "plain")
    chains = {mode: chain(mode) for mode in (None, "inline", "branch")}
    noop = lambda: None  # noqa: E731
    per_short, _ = rig.instance_medians(short, dict.fromkeys(short, noop), reps,
                                        GRAPH_INSTANCES)
    per_chain, _ = rig.instance_medians(chains, dict.fromkeys(chains, noop), reps // 10,
                                        GRAPH_INSTANCES)
    label = {"short": "spin 5 us, GEMV 8 MiB, spin 5 us, GEMV",
             "chain": "300 x (GEMV 2048 x 2048, scale)"}
    rows = []
    for shape, per in (("short", per_short),
                       ("chain", {("mid", m): v for m, v in per_chain.items()})):
        base = statistics.median(per[next(iter(per))])
        for (where, mode), meds in per.items():
            m = statistics.median(meds)
            if mode is None:
                what = "no fork"
            elif mode == "plain":
                what = "no fork; a plain kernel node mid-graph (a zero-length spin): the floor"
            else:
                what = f"empty fork {'mid-graph' if where == 'mid' else 'at the root'}, {mode}"
            rows.append((label[shape], what, f"{m:.2f}", f"{min(meds):.2f}-{max(meds):.2f}",
                         "" if mode is None else f"{m - base:+.2f}"))
    for ctrl in ctrls.values():
        ctrl.close()
    return ("### Cost of a fork inside a replayed graph (us)\n\n"
            "One empty fork and the join at the end, as shipped (graph_fork='inline') and as a "
            f"side branch ('branch'), against the same graph without it.  Each variant captured "
            f"{GRAPH_INSTANCES} times, all replays interleaved; replay us = the median of the "
            f"instances' medians, range = the lowest and highest instance median.\n\n"
            + table(["graph", "fork", "replay us", "instances' range", "vs no fork"], rows))


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


# ---------------------------------------------------------------- plots

def plot(raws, outdir):
    """PNG plots of the effect and layer sections; returns (paths written, note).

    effect_<mib>mib.png: per batch 1 and 8, each variant's step time above hot
    (the physical limit) against the window T, so that the sub-us differences
    the table holds are visible.  layer_speedup.png: a / b per batch for the
    layer sections present (spin stand-ins, small kernels), against 1.0 and
    the 0.99x bound."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "No PNG plots: matplotlib is not installed."
    paths = []

    def save(fig, name):
        path = os.path.join(outdir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)

    effect = raws.get("effect") or []
    colors = {"cold": "tab:blue", "empty": "tab:gray", "prefetched": "tab:green"}
    for mib in sorted({row[0] for row in effect}):
        batches = [b for b in (1, 8) if any(m == mib and bb == b for m, bb, *_ in effect)]
        fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.6),
                                 sharey=True, squeeze=False)
        for ax, batch in zip(axes[0], batches):
            pts = sorted((t, r) for m, b, t, r, _ in effect if m == mib and b == batch)
            for name, color in colors.items():
                ax.plot([t for t, _ in pts], [r[name] - r["hot"] for _, r in pts], color=color,
                        marker="o", label=name)
            ax.axhline(0.0, color="tab:red", linewidth=1.0, label="hot (the limit)")
            ax.set_xlabel("bandwidth-idle window T (us)")
            ax.set_title(f"batch {batch}")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("step time above hot (us)")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"GEMV over W = {mib} MiB after a spin of T us")
        save(fig, f"effect_{mib}mib.png")
    layers = [(label, raws[key]) for key, label in (("layer", "spin stand-ins"),
                                                    ("layer_glue", "small kernels"))
              if raws.get(key)]
    if layers:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        batches = sorted({row["batch"] for _, rows in layers for row in rows})
        width = 0.8 / len(layers)
        ratios = []
        for k, ((label, rows), color) in enumerate(zip(layers, ("tab:green", "tab:orange"))):
            by = {row["batch"]: row["a"] / row["b"] for row in rows}
            xs = [n + (k - (len(layers) - 1) / 2) * width for n in range(len(batches))]
            # bars from 1.0: up is faster with the prefetch, down is slower
            ax.bar(xs, [by.get(b, float("nan")) - 1.0 for b in batches], width, bottom=1.0,
                   color=color, label=label)
            ratios += list(by.values())
        ax.set_xticks(range(len(batches)))
        ax.set_xticklabels([str(b) for b in batches])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(0.99, color="tab:red", linewidth=0.8, linestyle="--", label="0.99x")
        ax.set_xlabel("batch")
        ax.set_ylabel("a / b (no prefetch / l2prefetch)")
        ax.set_title("Two Kimi-shaped MoE layers (TP8), candidate forks")
        ax.set_ylim(min(0.98, *ratios) - 0.005, max(1.02, *ratios) + 0.005)
        ax.legend(fontsize=7)
        save(fig, "layer_speedup.png")
    return paths, ""


# ---------------------------------------------------------------- main

SECTIONS = {"effect": section_effect, "glue": section_glue, "compute": section_compute,
            "persist": section_persist,
            "layer": section_layer,
            "layer_glue": lambda rig, quick: section_layer(rig, quick, glue=True),
            "caps": section_caps, "kernels": section_kernels, "host": section_host, "graph": section_graph,
            "table": section_table}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "RESULTS.md"))
    args = ap.parse_args(argv)
    names = [n for n in args.sections.split(",") if n]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; sections: {', '.join(SECTIONS)}")
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
    parts, raws = [header], {}
    failed = []
    for name in names:
        t0 = time.perf_counter()
        try:
            result = SECTIONS[name](rig, args.quick)
        except Exception as exc:  # a failing section must not cost the others their results
            traceback.print_exc()
            failed.append(name)
            result = (f"### Section {name}: failed\n\n`{type(exc).__name__}: {exc}` "
                      "(traceback on stderr)")
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        text = result[0] if isinstance(result, tuple) else result
        if isinstance(result, tuple):
            raws[name] = result[1]
        print("\n" + text + f"\n\n({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
        parts.append(text)
    try:
        pngs, note = plot(raws, os.path.dirname(os.path.abspath(args.out)))
    except Exception as exc:  # a plot must never cost the report
        print(f"warning: plotting failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        pngs, note = [], f"No PNG plots: plotting failed ({type(exc).__name__}: {exc})."
    if pngs:
        note = "Plots (next to this file): " + ", ".join(
            f"[{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs) + "."
    if note:
        print("\n" + note + ("\n" + "\n".join(pngs) if pngs else ""), flush=True)
        parts.append(note)
    with open(args.out, "w") as f:
        f.write("# l2prefetch benchmark results\n\n" + "\n\n".join(parts) + "\n")
    print(f"\nwrote {args.out}")
    if failed:
        print(f"failed sections: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
