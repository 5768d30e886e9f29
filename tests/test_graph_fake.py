"""csrc/graph.c against the recording driver stand-in: loader nodes found by function
handle among a capture's nodes, and switched in place (on, empty, off, other tables)."""

import pytest

import l2prefetch
from l2prefetch import _C
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
