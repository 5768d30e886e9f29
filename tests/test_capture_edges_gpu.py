"""The edges an inline fork leaves in a captured graph, when another stream joins after it.

csrc/capture.c (NOTE [inline graph fork]) relies on this: the prefetch kernel
K goes on the captured stream after the last node X with a programmatic edge from
X's launch-order port (it launches once X's blocks have begun and waits for X's
end), and the nodes after it get X's own edge plus a programmatic launch-order edge
from K, so nothing in the graph waits for K to finish.  torch's NCCL work,
and any cross-stream code, records an event on the captured stream and makes
its own stream wait on it; the kernel N it launches there must inherit the
same two edges (wait for X, and for K's launch only), or an inline fork
before a collective would serialise the collective behind the loader.

    main:  X = a.add_(1);  fork (K);  event record;  Y = c.add_(1);  wait side;  Z = d.add_(1)
    side:  wait event;  N = b.mul_(2)

Was benchmarks/probe_edges.py; the edges it printed on the H200 are in
benchmarks/RESULTS.md ("Older runs", probe_edges).
"""

import pytest

torch = pytest.importorskip("torch")

from l2prefetch import PrefetchController, PreparedWeightRanges, _C  # noqa: E402

pytestmark = pytest.mark.gpu

# cuda.h's values: CU_GRAPH_NODE_TYPE_KERNEL, CU_GRAPH_DEPENDENCY_TYPE_DEFAULT and
# _PROGRAMMATIC, CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER (a #define).
KERNEL_NODE = 0
FULL, PROGRAMMATIC = 0, 1
LAUNCH_ORDER = 2


def _check(result, what):
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return values[0] if len(values) == 1 else values


def _kernel_name(cu, node):
    params = _check(cu.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
    name = _check(cu.cuFuncGetName(params.func), "cuFuncGetName")
    return name.decode() if isinstance(name, bytes) else str(name)


def _driver_and_graph():
    cu = pytest.importorskip("cuda.bindings.driver")
    if not hasattr(cu, "cuFuncGetName"):
        pytest.skip("this cuda.bindings has no cuFuncGetName (needed to find the loader node)")
    if _C.driver_info()["version"] < 12030:
        pytest.skip("inline graph forks need driver 12.3 or newer (edge data)")
    try:
        return cu, torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        pytest.skip(f"torch {torch.__version__} has no CUDAGraph(keep_graph=True)")


def _edges_and_loader(cu, g):
    """The captured graph's edges (from, to, type, from_port) and its one loader node."""
    graph = cu.CUgraph(int(g.raw_cuda_graph()))
    # cuda.bindings 12.x names the edge-data form cuGraphGetEdges_v2; 13.x, cuGraphGetEdges.
    get_edges = getattr(cu, "cuGraphGetEdges_v2", cu.cuGraphGetEdges)
    n = _check(get_edges(graph, 0), "cuGraphGetEdges")[-1]
    frm, to, data, n = _check(get_edges(graph, n), "cuGraphGetEdges")
    edges = [(int(f), int(t), int(e.type), int(e.from_port)) for f, t, e in zip(frm, to, data)]
    nodes = {int(f): f for f in frm} | {int(t): t for t in to}
    loaders = [k for k, node in nodes.items()
               if int(_check(cu.cuGraphNodeGetType(node), "cuGraphNodeGetType")) == KERNEL_NODE
               and "l2p_prefetch" in _kernel_name(cu, node)]
    assert len(loaders) == 1, edges
    return edges, loaders[0]


def test_a_joining_stream_waits_for_the_inline_loaders_launch_only():
    cu, g = _driver_and_graph()

    a, b, c, d = (torch.ones(1024, device="cuda") for _ in range(4))
    w = torch.randn(4 << 20, device="cuda")
    ctrl = PrefetchController(0)                        # graph_fork="inline", as shipped
    ctrl.add("p", 0, [1], PreparedWeightRanges([w]))
    side = torch.cuda.Stream()
    with torch.cuda.graph(g):
        a.add_(1)                                       # X
        assert ctrl.fork("p", 0, 1)                     # K
        ev = torch.cuda.Event()
        ev.record()
        with torch.cuda.stream(side):
            side.wait_event(ev)
            b.mul_(2)                                   # N (where torch puts an NCCL kernel)
        c.add_(1)                                       # Y
        torch.cuda.current_stream().wait_stream(side)
        d.add_(1)                                       # Z
        ctrl.join()

    edges, k = _edges_and_loader(cu, g)

    # K loads when X is done: one programmatic edge in, from X's launch-order port
    # (K launches once X's blocks have begun and waits for X's end in
    # griddepcontrol.wait).
    into_k = [e for e in edges if e[1] == k]
    assert len(into_k) == 1 and into_k[0][2:] == (PROGRAMMATIC, LAUNCH_ORDER), edges
    x = into_k[0][0]
    # Out of K only launch-order edges, to Y on the captured stream and to N on the
    # stream that joined after the fork: nothing waits for K to finish.
    out_of_k = [e for e in edges if e[0] == k]
    assert len(out_of_k) == 2, edges
    assert all(e[2] == PROGRAMMATIC and e[3] == LAUNCH_ORDER for e in out_of_k), edges
    # Y and N still wait for X itself.
    for _, target, _, _ in out_of_k:
        assert (x, target, FULL, 0) in edges, edges

    g.instantiate()
    g.replay()
    torch.cuda.synchronize()
    assert [float(t[0]) for t in (a, b, c, d)] == [2.0, 2.0, 2.0, 2.0]   # one replay
    del g
    ctrl.close()


def test_an_inline_loader_after_a_copy_keeps_an_ordinary_edge():
    """Programmatic edges join kernel nodes only: after a memcpy node, K waits for it
    by its own edge; the kernel after the fork still sees the copy's data."""
    cu, g = _driver_and_graph()
    src = torch.arange(1024, device="cuda", dtype=torch.float32)
    a, c = torch.zeros_like(src), torch.zeros_like(src)
    w = torch.randn(4 << 20, device="cuda")
    ctrl = PrefetchController(0)
    ctrl.add("p", 0, [1], PreparedWeightRanges([w]))
    with torch.cuda.graph(g):
        a.copy_(src)                                    # X: a device-to-device memcpy node
        assert ctrl.fork("p", 0, 1)                     # K
        c.copy_(a * 2)                                  # Y reads what X wrote
        ctrl.join()
    edges, k = _edges_and_loader(cu, g)
    into_k = [e for e in edges if e[1] == k]
    assert len(into_k) == 1 and into_k[0][2:] == (FULL, 0), edges
    g.instantiate()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(c, src * 2)
    del g
    ctrl.close()
