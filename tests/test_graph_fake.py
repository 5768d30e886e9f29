"""csrc/graph.c against the recording driver stand-in: loader nodes found by function
handle among a capture's nodes, and switched in place (on, empty, off, other tables);
the graph without them, a GraphExec (csrc/graphexec.c) bound to the driver that made it."""

import gc
import pickle
import shutil
import sys

import pytest

import l2prefetch
from l2prefetch import _C
from _fakecuda import FakeCuda
from conftest import FakeArray, device_ptr

PWR = l2prefetch.PreparedWeightRanges
PC = l2prefetch.PrefetchController
STREAM = 0x5000
GRAPH, EXEC = 0x7000, 0x7100


def arr(i=0, n=1024, device=0):
    return FakeArray(device_ptr(device, i * 65536), (n,))


def kv(line):
    return dict(tok.split("=", 1) for tok in line.split()[1:] if "=" in tok)


@pytest.fixture
def captured(fake):
    """Two leaf forks captured after a memcpy-like node; returns the controller and tables."""
    tables = [PWR([arr(0), arr(1)]), PWR([arr(2)])]
    c = PC(device=0, graph_fork="leaf")
    for layer, t in enumerate(tables):
        c.add("p", layer, 1, t)
    fake.set_capture(7)
    fake.add_capture_node(1)
    for layer in range(2):
        assert c.fork("p", layer, 1, stream=STREAM)
    fake.add_capture_node(1)
    fake.clear_log()
    return c, tables


def test_loader_nodes_are_the_forks_kernels_with_their_ranges(fake, captured):
    _, tables = captured
    found = _C._graph_loader_nodes(GRAPH)
    assert [ranges for _, ranges in found] == [tables[0].ranges, tables[1].ranges]
    # the two other nodes are not kernels; every node's type was asked once
    assert len(fake.log("cuGraphNodeGetType")) == 4


def test_states_switch_every_node(fake, captured):
    _, tables = captured
    nodes = tuple(node for node, _ in _C._graph_loader_nodes(GRAPH))
    fake.clear_log()
    _C._graph_set_loaders(EXEC, nodes, "off")
    assert [kv(l)["enabled"] for l in fake.log("cuGraphNodeSetEnabled")] == ["0", "0"]
    fake.clear_log()
    _C._graph_set_loaders(EXEC, nodes, "empty")
    assert [kv(l)["count"] for l in fake.log("cuGraphExecKernelNodeSetParams")] == ["0", "0"]
    assert [kv(l)["enabled"] for l in fake.log("cuGraphNodeSetEnabled")] == ["1", "1"]
    fake.clear_log()
    _C._graph_set_loaders(EXEC, nodes, "on")
    assert [kv(l)["count"] for l in fake.log("cuGraphExecKernelNodeSetParams")] == ["2", "1"]
    fake.clear_log()
    other = PWR([arr(3)], grid=8)
    _C._graph_set_loaders(EXEC, nodes, (other, tables[0]))
    lines = fake.log("cuGraphExecKernelNodeSetParams")
    assert [(kv(l)["grid"], kv(l)["count"]) for l in lines] == [("8", "1"), ("32", "2")]


@pytest.mark.parametrize("state, error, message", [
    ("fast", ValueError, "state must be 'on', 'empty', 'off' or a tuple"),
    ((), ValueError, "0 tables for 2 nodes"),
    ((1, 2), TypeError, r"state\[0\] must be a PreparedWeightRanges, not int"),
])
def test_bad_states(fake, captured, state, error, message):
    nodes = tuple(node for node, _ in _C._graph_loader_nodes(GRAPH))
    with pytest.raises(error, match=message):
        _C._graph_set_loaders(EXEC, nodes, state)


def test_bad_handles(fake, captured):
    with pytest.raises(ValueError, match="graph must be a non-null handle"):
        _C._graph_loader_nodes(0)
    with pytest.raises(TypeError, match="graph must be an int handle, not str"):
        _C._graph_loader_nodes("g")
    with pytest.raises(TypeError, match="nodes must be the tuple"):
        _C._graph_set_loaders(EXEC, [1], "on")
    nodes = tuple(node for node, _ in _C._graph_loader_nodes(GRAPH))
    fake.add_capture_node(0)   # node 5: a kernel node launching no function of ours
    foreign = nodes[1] + 2 * 16   # the fake's handles count nodes in steps of 16
    assert len(_C._graph_loader_nodes(GRAPH)) == 2
    with pytest.raises(ValueError, match="node 2 is not a loader node"):
        _C._graph_set_loaders(EXEC, nodes + (foreign,), "on")


def test_edges_are_the_capture_dependencies(fake, captured):
    """_graph_edges: each node's edges from the set it was captured on (leaf forks: each
    loader from the node before it and from the previous loader; the node after them
    from the first node, not from a loader)."""
    nodes = [node for node, _ in _C._graph_loader_nodes(GRAPH)]
    edges = _C._graph_edges(GRAPH)
    index = {h: i + 1 for i, h in enumerate(sorted({n for e in edges for n in e}))}
    first, last = min(index, key=index.get), max(index, key=index.get)
    assert (first, nodes[0]) in edges and (nodes[0], nodes[1]) in edges
    assert (first, nodes[1]) in edges and (first, last) in edges
    assert not any(u in nodes for u, v in edges if v == last)


def test_a_graph_without_the_loader_nodes(fake, captured):
    """_graph_instantiate_without: the template cloned, each node found in the clone and
    destroyed there, the clone instantiated and destroyed; the exec comes back as a
    GraphExec, launched on a stream and destroyed by its close()."""
    nodes = tuple(node for node, _ in _C._graph_loader_nodes(GRAPH))
    fake.clear_log()
    ex = _C._graph_instantiate_without(GRAPH, nodes)
    calls = [line.split()[0] for line in fake.log()]
    assert calls == ["cuGraphClone"] + ["cuGraphNodeFindInClone", "cuGraphDestroyNode"] * 2 + \
        ["cuGraphInstantiateWithFlags", "cuGraphDestroy"]
    assert fake.live("graph") == 0 and fake.live("exec") == 1
    assert type(ex) is _C.GraphExec and not ex.closed
    made = kv(fake.log("cuGraphInstantiateWithFlags")[-1])["exec"]
    assert repr(ex) == f"<GraphExec {made}>"
    ex.launch(STREAM)
    assert kv(fake.log("cuGraphLaunch")[-1]) == {"exec": made, "stream": hex(STREAM)}
    ex.close()
    assert fake.live("exec") == 0 and fake.bad_destroys() == 0
    assert ex.closed and repr(ex) == "<GraphExec closed>"
    with pytest.raises(l2prefetch.Error, match="this GraphExec is closed"):
        ex.launch(STREAM)
    assert len(fake.log("cuGraphLaunch")) == 1   # refused before the driver


def test_an_exec_goes_to_the_driver_that_made_it(fake, tmp_path):
    """The module's driver swapped after instantiating (to a second copy of the stand-in,
    a library with its own counters, then to none at all): each GraphExec is launched and
    destroyed, once, through the driver instance that made it, by close() or by dealloc."""
    other_path = str(tmp_path / "libfakecuda_other.so")
    shutil.copyfile(fake.path, other_path)
    other = FakeCuda(other_path)
    other.reset()
    first = _C._graph_instantiate_without(GRAPH, ())
    _C._use_driver(other_path)
    assert _C.driver_info()["path"] == other_path
    second = _C._graph_instantiate_without(GRAPH, ())
    assert (fake.live("exec"), other.live("exec")) == (1, 1)
    _C._use_driver(None)
    fake.clear_log()
    other.clear_log()
    first.launch(STREAM)
    second.launch(STREAM)
    first.close()
    first.close()          # again: nothing
    del second             # dealloc: its own driver, not the module's (none now)
    gc.collect()
    for drv in (fake, other):
        assert [line.split()[0] for line in drv.log()] == ["cuGraphLaunch", "cuGraphExecDestroy"]
        assert drv.live("exec") == 0 and drv.bad_destroys() == 0


def test_an_exec_holds_its_driver_instance(fake):
    """What the driver instance holds (here: cuda:0's primary context, retained for a
    table) is released only when the last GraphExec made with it goes, after the module
    dropped it: the exec holds it, and does not leak it."""
    table = PWR([arr(0)])
    ex = _C._graph_instantiate_without(GRAPH, ())
    del table
    _C._use_driver(None)
    gc.collect()
    assert fake.live("context") == 1 and fake.live("exec") == 1
    del ex
    assert fake.live("context") == 0 and fake.live("exec") == 0 and fake.bad_destroys() == 0


def test_a_failed_close_raises_once_and_is_not_tried_again(fake):
    ex = _C._graph_instantiate_without(GRAPH, ())
    fake.fail("cuGraphExecDestroy", code="CUDA_ERROR_INVALID_HANDLE")
    with pytest.raises(l2prefetch.CudaError) as info:
        ex.close()
    assert info.value.operation == "cuGraphExecDestroy"
    assert info.value.name == "CUDA_ERROR_INVALID_HANDLE"
    assert ex.closed
    ex.close()
    del ex
    gc.collect()
    assert fake.calls("cuGraphExecDestroy") == 1


def test_dealloc_keeps_a_pending_exception(fake, monkeypatch):
    """A GraphExec freed while an exception propagates (the list that list() was filling
    when the generator raised) destroys its exec and leaves the exception as it was; a
    failed destroy is reported as unraisable, CUDA_ERROR_DEINITIALIZED (interpreter exit)
    not at all.  Had dealloc cleared the exception, list() would raise SystemError; had it
    raised, its own exception would replace KeyError."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook",
                        lambda u: seen.append((u.exc_type, str(u.exc_value), u.object)))

    def execs(fail=None):
        yield _C._graph_instantiate_without(GRAPH, ())
        if fail:
            fake.fail("cuGraphExecDestroy", code=fail)
        raise KeyError("kept")

    with pytest.raises(KeyError, match="kept"):
        list(execs())
    assert fake.live("exec") == 0 and seen == []
    with pytest.raises(KeyError, match="kept"):
        list(execs("CUDA_ERROR_DEINITIALIZED"))
    assert seen == []
    with pytest.raises(KeyError, match="kept"):
        list(execs("CUDA_ERROR_INVALID_HANDLE"))
    assert len(seen) == 1, seen
    exc_type, message, obj = seen[0]
    assert exc_type is RuntimeWarning and obj is _C.GraphExec
    assert "cuGraphExecDestroy" in message and "CUDA_ERROR_INVALID_HANDLE" in message
    assert fake.calls("cuGraphExecDestroy") == 3 and fake.bad_destroys() == 0


def test_a_graph_exec_is_made_only_by_instantiating(fake):
    with pytest.raises(TypeError, match="cannot create 'l2prefetch._C.GraphExec' instances"):
        _C.GraphExec()
    ex = _C._graph_instantiate_without(GRAPH, ())
    with pytest.raises(TypeError):
        ex.launch()
    with pytest.raises(TypeError):
        ex.launch(STREAM, STREAM)
    with pytest.raises(TypeError, match="cannot pickle"):
        pickle.dumps(ex)
    ex.close()


@pytest.mark.parametrize("fails", ["cuGraphClone", "cuGraphNodeFindInClone",
                                   "cuGraphDestroyNode", "cuGraphInstantiateWithFlags"])
def test_a_failed_step_leaves_no_clone_and_no_exec(fake, captured, fails):
    nodes = tuple(node for node, _ in _C._graph_loader_nodes(GRAPH))
    fake.fail(fails, code="CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(l2prefetch.CudaError, match=f"{fails}.*CUDA_ERROR_OUT_OF_MEMORY"):
        _C._graph_instantiate_without(GRAPH, nodes)
    assert fake.live("graph") == 0 and fake.live("exec") == 0 and fake.bad_destroys() == 0


def test_a_failed_clone_destroy_destroys_the_exec(fake, captured):
    nodes = tuple(node for node, _ in _C._graph_loader_nodes(GRAPH))
    fake.fail("cuGraphDestroy", code="CUDA_ERROR_UNKNOWN")
    with pytest.raises(l2prefetch.CudaError, match="cuGraphDestroy"):
        _C._graph_instantiate_without(GRAPH, nodes)
    assert fake.live("exec") == 0 and fake.bad_destroys() == 0


def test_bad_arguments_of_the_graph_without_loaders(fake, captured):
    with pytest.raises(TypeError, match="nodes must be a tuple of node handles, not list"):
        _C._graph_instantiate_without(GRAPH, [1])
    with pytest.raises(ValueError, match="each node must be a non-null handle"):
        _C._graph_instantiate_without(GRAPH, (0,))
    with pytest.raises(TypeError, match=r"exactly 2 positional arguments \(1 given\)"):
        _C._graph_instantiate_without(GRAPH)
    nodes = tuple(node for node, _ in _C._graph_loader_nodes(GRAPH))
    with pytest.raises(ValueError, match=r"nodes\[2\] repeats nodes\[0\]"):
        _C._graph_instantiate_without(GRAPH, nodes + nodes[:1])
    ex = _C._graph_instantiate_without(GRAPH, nodes)
    with pytest.raises(TypeError, match="stream must be an int handle, not str"):
        ex.launch("s")
    with pytest.raises(OverflowError):
        ex.launch(-1)
    ex.close()
    with pytest.raises(ValueError, match="exec must be a non-null handle"):
        _C._graph_set_loaders(0, nodes, "on")
    with pytest.raises(ValueError, match="graph must be a non-null handle"):
        _C._graph_edges(0)
    assert fake.live("graph") == 0 and fake.live("exec") == 0


def test_no_forks_refuses_a_graph_whose_loaders_order_other_nodes(fake, monkeypatch):
    """rig.NoForks checks the edges first: a loader node that is the only path between
    two other nodes (not a graph the controller captures) is refused, nothing made."""
    from l2prefetch.tuning.rig import NoForks

    c = PC(device=0, graph_fork="leaf")
    c.add("p", 0, 1, PWR([arr(0)]))
    fake.set_capture(7)
    fake.add_capture_node(1)
    assert c.fork("p", 0, 1, stream=STREAM)
    loader = _C._graph_loader_nodes(GRAPH)[0][0]

    class Graph:
        def raw_cuda_graph(self):
            return GRAPH

    after = fake.add_capture_node(1)   # the node after the fork: an edge from the first
    real = _C._graph_edges
    edges = real(GRAPH)
    first = next(u for u, v in edges if v == loader)
    assert (first, loader + 16) in edges and after == 3
    # planted: the node after depends on the loader alone, not on the first node
    planted = tuple(e for e in edges if e != (first, loader + 16)) + ((loader, loader + 16),)
    monkeypatch.setattr(_C, "_graph_edges", lambda g: planted)
    with pytest.raises(RuntimeError, match="would unorder 1 pairs of other nodes"):
        NoForks(Graph())
    assert fake.live("graph") == 0 and fake.live("exec") == 0
    monkeypatch.setattr(_C, "_graph_edges", real)
    without = NoForks(Graph())
    assert fake.live("exec") == 1
    without.close()
    assert fake.live("exec") == 0


def test_many_loader_nodes_keep_their_ranges(fake):
    """Issue 38.1: the stand-in's node table grows (realloc) as a capture adds nodes; the
    parameters it handed out at capture stay valid (the real driver's copy does), so
    every node of a long capture reads back its own ranges (ASan: no use after free)."""
    layers = 300   # several reallocs of the node table, past the size malloc maps apart
    tables = [PWR([arr(i % 50), arr(i % 50 + 1, n=256 + i)]) for i in range(layers)]
    c = PC(device=0, graph_fork="leaf")
    for layer, t in enumerate(tables):
        c.add("p", layer, 1, t)
    fake.set_capture(7)
    fake.add_capture_node(1)
    for layer in range(layers):
        assert c.fork("p", layer, 1, stream=STREAM)
        fake.add_capture_node(1)   # the layer's own work between forks
    found = _C._graph_loader_nodes(GRAPH)
    assert [ranges for _, ranges in found] == [t.ranges for t in tables]
    c.close()


@pytest.mark.parametrize("n", [9, 32, 33, 128])
def test_a_node_of_more_than_8_ranges_reads_back_whole(fake, n):
    """Issue 38.1: a table of n ranges (the loader of capacity 32 or 128) reads back all n
    ranges from its node, not 8 and then whatever followed the stand-in's copy."""
    table = PWR([arr(2 * i) for i in range(n)])
    assert len(table.ranges) == n
    c = PC(device=0, graph_fork="leaf")
    c.add("p", 0, 1, table)
    fake.set_capture(7)
    fake.add_capture_node(1)
    assert c.fork("p", 0, 1, stream=STREAM)
    (_, ranges), = _C._graph_loader_nodes(GRAPH)
    assert ranges == table.ranges
    c.close()


# -- warm_activation: a node captured with its fork's activation appended ---------------------

def test_a_warm_node_switched_keeps_its_activation(fake):
    """tuning.rig.LoaderSwitch: a node captured by a warm fork has its table's ranges and
    the activation; a warm table switched in gets that activation again, another not;
    bad extras are refused before any driver call."""
    from l2prefetch.tuning.rig import LoaderSwitch

    warm = PWR([arr(0)], warm_activation=True)
    c = PC(device=0, graph_fork="leaf")
    c.add("p", 0, 1, warm)
    fake.set_capture(7)
    act = arr(9, 64)
    assert c.fork("p", 0, 1, stream=STREAM, activation=act)
    (node, ranges), = _C._graph_loader_nodes(GRAPH)
    assert ranges == (*warm.ranges, (act.ptr, 128))

    class Graph:   # what LoaderSwitch reads of a torch CUDAGraph
        def raw_cuda_graph(self):
            return GRAPH

        def raw_cuda_graph_exec(self):
            return EXEC

    switch = LoaderSwitch(Graph())
    other_warm, plain = PWR([arr(3)], grid=8, warm_activation=True), PWR([arr(4)])
    fake.clear_log()
    switch.set({warm.ranges: other_warm})
    line, = fake.log("cuGraphExecKernelNodeSetParams")
    assert (kv(line)["grid"], kv(line)["count"], kv(line)["last"]) == \
        ("8", "2", f"{act.ptr:#x}+128")
    fake.clear_log()
    switch.set({warm.ranges: plain})
    line, = fake.log("cuGraphExecKernelNodeSetParams")
    assert (kv(line)["count"], kv(line)["last"]) == ("1", f"{arr(4).ptr:#x}+2048")
    with pytest.raises(ValueError, match="no table given for the loader node captured"):
        switch.set({plain.ranges: warm})
    fake.clear_log()
    for extras, error, message in [
            ([None], TypeError, "extras must be None or a tuple of 1 items"),
            ((None, None), TypeError, "extras must be None or a tuple of 1 items"),
            (((act.ptr + 4, 128),), ValueError, r"extras\[0\] must be None or \(ptr, nbytes\)"),
            (((act.ptr, 8),), ValueError, r"extras\[0\] must be None or \(ptr, nbytes\)"),
            (((act.ptr, -1),), ValueError, r"extras\[0\] must be None or \(ptr, nbytes\)"),
            (((act.ptr, 128.0),), ValueError, r"extras\[0\] must be None or \(ptr, nbytes\)")]:
        with pytest.raises(error, match=message):
            _C._graph_set_loaders(EXEC, (node,), (other_warm,), extras)
    assert fake.log("cuGraphExecKernelNodeSetParams") == []
