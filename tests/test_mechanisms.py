"""The graph fork modes are named once (l2prefetch.mechanisms), and that registry is what
the C controller implements: it accepts exactly those names, its errors list them, and each
mode's ``needs_join`` and ``switchable`` are what the controller and csrc/graph.c do
(against the recording driver stand-in, tests/fakecuda)."""

import re
import typing

import pytest

import l2prefetch
from l2prefetch import _C, mechanisms, plan
from l2prefetch.mechanisms import DEFAULT_GRAPH_FORK, GRAPH_FORK_MODES, GRAPH_FORKS
from conftest import FakeArray, device_ptr

PC = l2prefetch.PrefetchController
PWR = l2prefetch.PreparedWeightRanges
STREAM = 0x5000
GRAPH, EXEC = 0x7000, 0x7100


def table(i=0):
    return PWR([FakeArray(device_ptr(0, i * 65536), (1024,))])


def listed(message):
    """The quoted names a "graph_fork must be ..." message lists, before ", not"."""
    allowed = message.split("graph_fork must be ", 1)[1].rsplit(", not ", 1)[0]
    return re.findall(r"'([^']*)'", allowed)


def test_the_registry_is_the_one_list():
    assert GRAPH_FORKS == tuple(GRAPH_FORK_MODES) == typing.get_args(mechanisms.GraphFork)
    assert plan.GRAPH_FORKS is GRAPH_FORKS and plan.GraphFork is mechanisms.GraphFork
    for name, mode in GRAPH_FORK_MODES.items():
        assert mode.name == name and mode.description
        assert isinstance(mode.needs_join, bool) and isinstance(mode.switchable, bool)
    assert DEFAULT_GRAPH_FORK in GRAPH_FORK_MODES
    assert mechanisms.graph_fork_choices() == "'inline', 'branch' or 'leaf'"


def test_the_site_hooks_are_one_list():
    assert tuple(mechanisms.SITE_HOOKS) == typing.get_args(mechanisms.SiteHook)
    assert mechanisms.DEFAULT_SITE_HOOK == "after" and all(mechanisms.SITE_HOOKS.values())
    assert mechanisms.site_hook_choices() == "'after' or 'before'"
    assert mechanisms.site_entry("m.n", 3, "after") == ("m.n", 3)
    assert mechanisms.site_entry("m.n", 3, "before") == ("m.n", 3, "before")


def test_the_controller_takes_every_registered_mode(fake):
    assert PC(device=0).graph_fork == DEFAULT_GRAPH_FORK
    for name in GRAPH_FORKS:
        with PC(device=0, graph_fork=name) as ctl:
            assert ctl.graph_fork == name
            ctl.add("p", 0, 1, table(), graph_fork=name)
            assert ctl.get_mode("p", 0, 1) == name


def test_an_unknown_mode_lists_exactly_the_registry(fake):
    with pytest.raises(ValueError) as info:
        PC(device=0, graph_fork="sideways")
    assert listed(str(info.value)) == list(GRAPH_FORKS)
    with pytest.raises(TypeError) as info:
        PC(device=0, graph_fork=3)
    assert listed(str(info.value)) == list(GRAPH_FORKS)
    with PC(device=0) as ctl, pytest.raises(ValueError) as info:
        ctl.add("p", 0, 1, table(), graph_fork="sideways")
    assert listed(str(info.value)) == list(GRAPH_FORKS)
    assert "or None" in str(info.value)
    # a plan entry's check says the same
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError) as info:
        plan.PlanEntry("p", 0, [1], (torch.zeros(4),), graph_fork="sideways")
    assert re.findall(r"'([^']*)'", str(info.value))[:-1] == list(GRAPH_FORKS)


@pytest.mark.parametrize("name", GRAPH_FORKS)
def test_needs_join_is_what_the_controller_does(fake, name):
    """A captured fork leaves the side stream pending exactly where the mode needs a
    captured join(); a capture that ended without it is refused at the next fork."""
    mode = GRAPH_FORK_MODES[name]
    with PC(device=0, graph_fork=name) as ctl:
        ctl.add("p", 0, 1, table())
        fake.set_capture(7)
        fake.add_capture_node(0)
        assert ctl.fork("p", 0, 1, stream=STREAM)
        assert ctl.pending is mode.needs_join
        fake.set_capture(8)                              # a new capture, no join() captured
        if mode.needs_join:
            with pytest.raises(l2prefetch.Error, match=r"join\(\)"):
                ctl.fork("p", 0, 1, stream=STREAM)
        else:
            assert ctl.fork("p", 0, 1, stream=STREAM)
        ctl.join(stream=STREAM)
        assert not ctl.pending


@pytest.mark.parametrize("name", [n for n, m in GRAPH_FORK_MODES.items() if m.switchable])
def test_a_switchable_mode_leaves_loader_nodes_graph_c_switches(fake, name):
    """The tuner pairs a switchable mode's loads with its empty forks in one graph: its
    captured forks are loader nodes that csrc/graph.c finds and switches in place."""
    t0, t1 = table(0), table(1)
    with PC(device=0, graph_fork=name) as ctl:
        ctl.add("p", 0, 1, t0)
        ctl.add("p", 1, 1, t1)
        fake.set_capture(7)
        fake.add_capture_node(1)
        assert ctl.fork("p", 0, 1, stream=STREAM) and ctl.fork("p", 1, 1, stream=STREAM)
        ctl.join(stream=STREAM)
        fake.set_capture(0)
        found = _C._graph_loader_nodes(GRAPH)
        assert [ranges for _, ranges in found] == [t0.ranges, t1.ranges]
        fake.clear_log()
        _C._graph_set_loaders(EXEC, tuple(node for node, _ in found), "empty")
        assert len(fake.log("cuGraphExecKernelNodeSetParams")) == 2
