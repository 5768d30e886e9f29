"""persist: the alternative, CUDA's L2 persistence, on the effect's step.

A set-aside (``cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE)``) and a
persisting access-policy window over W, through cuda-python, flushed and
steady, against cold, l2prefetch and hot.  Skipped without cuda-python or
where the device reports no persistence.
"""

from __future__ import annotations

import traceback

import torch

from l2prefetch import PreparedWeightRanges
from l2prefetch.tuning.report import table

from ..common import K, MIB, run_sequence, weight


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


def _capture_persisting(cu, stream, fn):
    """fn captured on ``stream``, whose access-policy window the kernel nodes take at
    capture (so not on the rig's own capture stream), after one eager warm-up, in a
    private memory pool; returns (graph, note on how many kernel nodes carry the window)."""
    try:
        g, kept = torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:  # torch without keep_graph: no node check
        g, kept = torch.cuda.CUDAGraph(), False
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=stream):
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


def run(rig, quick):
    title = "### persist: the alternative, CUDA L2 persistence (step time, us)\n\n"
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
    pstream = torch.cuda.Stream(rig.device)
    try:
        dev = _cu_call(cu, "cuDeviceGet", cu.cuDeviceGet(rig.device.index))
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
            w = weight(rig, mib)
            pf = PreparedWeightRanges([w], carveout=100)
            x = {b: torch.randn(b, K, device=rig.device, dtype=torch.bfloat16) for b in batches}
            before = torch.zeros(256, device=rig.device)
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

                        g, check = _capture_persisting(cu, pstream, fn)
                        checks.add(check)
                        p = rig.time_graphs({"persist, flushed": g, "persist, steady": g}, reps,
                                            lambda key: rig.flush() if key == "persist, flushed"
                                            else None)
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
    text += ("\n" + verdict + "\n\nWhy it is not a drop-in alternative for decode: (1) the "
             f"set-aside (up to {max_persist / MIB:.1f} MiB here) is a context-wide limit, taken "
             "from the L2 every other kernel of the process uses, for as long as it is set; "
             "(2) the window is a per-stream (captured: per kernel node) attribute, one window "
             f"of at most {max_window / MIB:.0f} MiB per launch, while a decode step reads a "
             "different weight in every GEMV; (3) a decode step streams each weight once (61 "
             "layers, far more than L2), so persisting one weight only helps if that weight is "
             "reused across steps and fits the set-aside.  l2prefetch needs no reservation: it "
             "loads the next weights into the ordinary L2 during idle bandwidth.")
    return text, raw
