"""What an inline fork's launch-order edges become when another stream joins.

An inline fork (csrc/capture.c, NOTE [inline graph fork]) leaves the captured
stream depending on its last node X (X's own edge) and on the prefetch kernel
K (a programmatic launch-order edge).  torch's NCCL work, and any other
cross-stream code, records an event on that stream and makes its own stream
wait on it.  This probe captures

    main:  X = a.add_(1);  fork (K);  event record;  Y = c.add_(1);  wait side;  Z = d.add_(1)
    side:  wait event;  N = b.mul_(2)

and prints every edge of the graph with its type and ports: does N keep K's
launch-order edge, or wait for K to finish?  Run on a GPU, needs cuda.bindings:

    python benchmarks/probe_edges.py
"""

from __future__ import annotations

import sys

import torch

from l2prefetch import PrefetchController, PreparedWeightRanges

NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
              6: "wait_event", 7: "event_record"}


def check(result, what):
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return values[0] if len(values) == 1 else values


def describe(cu, node, names):
    kind = int(check(cu.cuGraphNodeGetType(node), "cuGraphNodeGetType"))
    label = NODE_TYPES.get(kind, str(kind))
    if kind == 0:
        params = check(cu.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
        try:
            name = check(cu.cuFuncGetName(params.func), "cuFuncGetName")
            label += " " + (name.decode() if isinstance(name, bytes) else str(name))[:60]
        except Exception:                                              # noqa: BLE001
            pass
    return names.setdefault(int(node), f"n{len(names)} {label}")


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_edges.py needs a CUDA GPU")
        return 0
    from cuda.bindings import driver as cu

    a, b, c, d = (torch.ones(1024, device="cuda") for _ in range(4))
    w = torch.randn(4 << 20, device="cuda")
    ctrl = PrefetchController(0)
    ctrl.add("p", 0, [1], PreparedWeightRanges([w]))
    side = torch.cuda.Stream()
    for label, wait_side in (("side stream joins back before Z", True),):
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g):
            a.add_(1)                                   # X
            ctrl.fork("p", 0, 1)                        # K
            ev = torch.cuda.Event()
            ev.record()
            with torch.cuda.stream(side):
                side.wait_event(ev)
                b.mul_(2)                               # N (the NCCL kernel's place)
            c.add_(1)                                   # Y
            if wait_side:
                torch.cuda.current_stream().wait_stream(side)
            d.add_(1)                                   # Z
            ctrl.join()
        graph = cu.CUgraph(int(g.raw_cuda_graph()))
        # cuda.bindings 12.x names the edge-data form cuGraphGetEdges_v2; 13.x, cuGraphGetEdges.
        get_edges = getattr(cu, "cuGraphGetEdges_v2", cu.cuGraphGetEdges)
        n = check(get_edges(graph, 0), "cuGraphGetEdges")[-1]
        frm, to, data, n = check(get_edges(graph, n), "cuGraphGetEdges")
        names: dict[int, str] = {}
        print(f"{label}: {n} edges")
        for f, t, e in zip(frm, to, data):
            print(f"  {describe(cu, f, names):40s} -> {describe(cu, t, names):40s} "
                  f"type {int(e.type)} from_port {int(e.from_port)} to_port {int(e.to_port)}")
        g.instantiate()
        g.replay()
        torch.cuda.synchronize()
        del g
    ctrl.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
