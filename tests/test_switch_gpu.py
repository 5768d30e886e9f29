"""Loader nodes switched in place (csrc/graph.c, tuning.rig.LoaderSwitch), the graph
without them (tuning.rig.NoForks), and the leaf fork.

Functional checks on a small captured graph: the switch finds exactly the
loader nodes, each state ('on', 'empty', 'off', another table) replays with
bitwise the same output, and a leaf fork leaves the step's output unchanged.
Timing equivalence (a switched 'empty' against a captured empty fork) is a
benchmark, not a test: benchmarks/RESULTS.md, run 12.
"""

import pytest

torch = pytest.importorskip("torch")

from l2prefetch import PrefetchController, PreparedWeightRanges, _C  # noqa: E402
from l2prefetch.mechanisms import GRAPH_FORK_MODES  # noqa: E402
from l2prefetch.tuning.rig import LoaderSwitch, NoForks, Rig, orderings_lost  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def setup():
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    w1 = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    w2 = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16)
    return dev, w1, w2, x


def _switched_bitwise(rig, step, captured, states):
    """step() captured with its LoaderSwitch, whose nodes hold ``captured`` (or what that
    function returns after the capture); each of ``states`` replays bitwise like step()."""
    ref = step().clone()
    graph, out = rig.capture(step, keep_graph=True)
    sw = LoaderSwitch(graph)
    assert sw.captured == (captured() if callable(captured) else captured)
    for state in states:
        sw.set(state)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
    return graph, sw


@pytest.mark.parametrize("mode", [name for name, m in GRAPH_FORK_MODES.items() if m.switchable])
def test_switched_states_replay_bitwise(setup, mode):
    dev, w1, w2, x = setup
    rig = Rig(dev)
    loads = PreparedWeightRanges([w2], grid=32, device=0)
    half = PreparedWeightRanges([w2], byte_cap=4 << 20, grid=16, device=0)
    c = PrefetchController(0, graph_fork=mode)
    c.add("p", 0, [1], loads)
    c.add("p", 1, [1], loads)

    def step():
        h = x @ w1.t()
        c.fork("p", 0, 1)
        h = torch.relu(h) @ w1.t()
        c.fork("p", 1, 1)
        y = h @ w2.t()
        c.join()
        return y

    graph, sw = _switched_bitwise(rig, step, (loads.ranges, loads.ranges),
                                  ("empty", "off", {loads.ranges: half}, "on", "off", "on"))
    with pytest.raises(ValueError, match="no table given"):
        sw.set({half.ranges: loads})
    with pytest.raises(ValueError, match="'on', 'empty', 'off'"):
        _C._graph_set_loaders(graph.raw_cuda_graph_exec(), sw.nodes, "fast")


@pytest.mark.parametrize("mode", [name for name, m in GRAPH_FORK_MODES.items() if m.switchable])
def test_warm_nodes_switch_with_their_activation(setup, mode):
    """A warm fork's node holds its table's ranges and the activation; a warm table
    switched in keeps that activation, an empty or plain one does not; every state
    replays bitwise (under compute-sanitizer: no read outside the tensors)."""
    dev, w1, w2, x = setup
    rig = Rig(dev)
    loads = PreparedWeightRanges([w2], grid=32, device=0, warm_activation=True)
    half = PreparedWeightRanges([w2], byte_cap=4 << 20, grid=16, device=0,
                                warm_activation=True)
    plain = PreparedWeightRanges([w2], byte_cap=1 << 20, device=0)
    c = PrefetchController(0, graph_fork=mode)
    c.add("p", 0, [1], loads)
    seen = {}

    def step():
        h = torch.relu(x @ w1.t())
        seen["h"] = h
        c.fork("p", 0, 1, activation=h)
        y = h @ w2.t()
        c.join()
        return y

    _switched_bitwise(rig, step, lambda: ((*loads.ranges, (seen["h"].data_ptr(), 2048)),),
                      ({loads.ranges: half}, "empty", {loads.ranges: plain}, "off", "on"))


def test_a_graph_without_forks_has_no_loader_nodes(setup):
    dev, w1, _, x = setup
    graph, _ = Rig(dev).capture(lambda: x @ w1.t(), keep_graph=True)
    assert LoaderSwitch(graph).nodes == ()


@pytest.mark.parametrize("mode", [name for name, m in GRAPH_FORK_MODES.items() if m.switchable])
def test_the_graph_without_its_loader_nodes_is_the_step_without_forks(setup, mode):
    """NoForks: the captured graph cloned without its loader nodes replays the step's
    output bitwise, and its edges are those of a capture without forks (removing the
    nodes unorders nothing: no edge of the fork's graph is lost or added); closing it
    twice is fine, replaying it closed is an error."""
    dev, w1, w2, x = setup
    rig = Rig(dev)
    c = PrefetchController(0, graph_fork=mode)
    loads = PreparedWeightRanges([w2], grid=32, device=0)
    c.add("p", 0, [1], loads)
    c.add("p", 1, [1], loads)

    def step(fork):
        h = x @ w1.t()
        if fork:
            c.fork("p", 0, 1)
        h = torch.relu(h) @ w1.t()
        if fork:
            c.fork("p", 1, 1)
        y = h @ w2.t()
        if fork:
            c.join()
        return y

    ref = step(False).clone()
    plain, _ = rig.capture(lambda: step(False), keep_graph=True)
    graph, out = rig.capture(lambda: step(True), keep_graph=True)
    nodes = LoaderSwitch(graph).nodes
    edges = _C._graph_edges(graph.raw_cuda_graph())
    assert len(nodes) == 2 and orderings_lost(edges, nodes) == []
    kept = [e for e in edges if not set(e) & set(nodes)]
    assert len(kept) == len(_C._graph_edges(plain.raw_cuda_graph()))
    without = NoForks(graph)
    assert without.nodes == nodes
    out.zero_()
    without.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    without.close()
    without.close()
    with pytest.raises(RuntimeError, match="closed"):
        without.replay()
