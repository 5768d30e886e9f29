"""The measuring rig: capture a step into CUDA graphs, replay them interleaved, time them.

The tuner and the benchmarks measure the same way, with this one
implementation:

* every variant of a step is captured into several graph instances (two
  instantiations of one capture can replay a few microseconds apart, more
  than the effects measured, so the instance is the unit of measurement);
* all instances of all variants are replayed round after round, one replay
  of each graph per round, with the variants' order rotated each round, so
  that drift (clocks, temperature) falls on all of them alike;
* each replay is timed with CUDA events around ``graph.replay()``; replays
  go back to back with no flush in between unless a ``before`` callable asks
  for one (a real decode step streams its own weights through L2; the
  benchmarks' cold measurements use :meth:`Rig.flush`);
* a variant's time per instance is the median of that instance's replays,
  and :mod:`l2prefetch.tuning.stats` compares variants by those medians.

The empty-fork control (:func:`empty_controller`) is the same forks with
empty tables: same points, layers, batches, grids and launch settings, so the
graph has the same prefetch nodes and loads nothing.

Needs torch with CUDA; importing this module does not.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

# The runtime builds a plan's controller and its empty-fork control; the rig re-exports them.
from ..controller import build_controller, empty_controller

__all__ = ["LoaderSwitch", "Measurement", "NoForks", "Rig", "build_controller",
           "empty_controller", "orderings_lost", "spin_cycles_per_us"]


def spin_cycles_per_us(device: Any = None) -> float:
    """``torch.cuda._sleep`` cycles per microsecond on ``device``: the scale of a spin
    (one CTA that waits: a window in which the GPU is nearly idle)."""
    import torch

    with torch.cuda.device(device):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        cycles = 2_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        return cycles / (start.elapsed_time(end) * 1e3)


@dataclasses.dataclass
class Measurement:
    """What one interleaved run of several variants gave.

    ``medians[name]`` holds one number per instance (the median us of its
    replays); ``replays[name][i]`` every replay of instance i; ``outputs[name][i]``
    the output tensor of instance i after its last replay (for bitwise checks);
    ``capture_s`` and ``replay_s`` the host time spent on each.
    """

    medians: dict[str, list[float]]
    replays: dict[str, list[list[float]]]
    outputs: dict[str, list[Any]]
    capture_s: float
    replay_s: float

    def mean(self, name: str) -> float:
        return statistics.fmean(self.medians[name])

    def pooled_median(self, name: str) -> float:
        """The median of every replay of every instance of ``name``."""
        return statistics.median(x for per in self.replays[name] for x in per)

    def spread(self, name: str) -> float:
        """Highest minus lowest per-instance median of ``name`` (how far instances differ)."""
        return max(self.medians[name]) - min(self.medians[name])


class Rig:
    """Graph capture and interleaved, event-timed replays on one device.

    Every graph gets its own memory pool unless :meth:`capture` is given one
    (GraphBackend's shared placement, whose outputs are read right after their
    own replays).  Graphs that share one, replayed
    interleaved, overwrite each other's outputs: at each capture torch frees
    the cuBLAS workspace the previous graph's kernels still use into that
    pool, where the next capture can place its output (seen on the H200 with
    torch 2.11: logits off by ~7 in 3 of 5 instances).  A decode step's
    activations are small, so private pools cost little.
    """

    def __init__(self, device: Any = None) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"the rig measures on a CUDA device, got {self.device}")
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream()
        self._cycles_per_us: Optional[float] = None
        self._flush_buf: Any = None
        self._flush_out: Any = None

    # ------------------------------------------------------------ windows
    @property
    def cycles_per_us(self) -> float:
        if self._cycles_per_us is None:
            self._cycles_per_us = spin_cycles_per_us(self.device)
        return self._cycles_per_us

    def spin(self, us: float) -> None:
        """Enqueue one CTA that waits about ``us`` microseconds (a nearly idle GPU)."""
        if us > 0:
            self.torch.cuda._sleep(int(us * self.cycles_per_us))

    # ------------------------------------------------------------ cold L2
    @property
    def l2_bytes(self) -> int:
        """The device's L2 size in bytes."""
        return int(self.torch.cuda.get_device_properties(self.device).L2_cache_size)

    def flush(self) -> None:
        """Enqueue a read of a buffer 8x the L2 size, so that what follows starts on a
        cold L2 (the buffer is allocated on first use and kept)."""
        torch = self.torch
        if self._flush_buf is None:
            self._flush_buf = torch.randn(8 * self.l2_bytes // 4, device=self.device)
            self._flush_out = torch.empty((), device=self.device)
        torch.sum(self._flush_buf, dim=0, out=self._flush_out)

    # ------------------------------------------------------------ capture
    def capture(self, fn: Callable[[], Any], *, warmup: int = 1,
                pool: Any = None, keep_graph: bool = False) -> tuple[Any, Any]:
        """Capture ``fn()`` into a CUDA graph after ``warmup`` eager calls on the
        capture stream (cuBLAS handles, workspaces, lazy init), in memory pool
        ``pool`` (None: a private one).  Returns ``(graph, output)``; the output
        tensor is refreshed by each replay.  ``keep_graph`` keeps the template
        graph (instantiated here), which :class:`LoaderSwitch` needs."""
        torch = self.torch
        graph = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for _ in range(warmup):
                    fn()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                    output = fn()
            torch.cuda.current_stream().wait_stream(self.stream)
            if keep_graph:
                graph.instantiate()
            torch.cuda.synchronize()
        return graph, output

    def paired(self, switches: Sequence["LoaderSwitch"], states: Mapping[str, Any], rounds: int
               ) -> dict[str, list[float]]:
        """Per state, the median us of each switch's graph in that state, in switch order.

        Every round replays every graph once in every state (``states[name]``: what
        :meth:`LoaderSwitch.set` takes), the states' order rotated each round, so a
        state's comparison with another is paired within each graph instance.
        """
        torch = self.torch
        names = list(states)
        pairs: dict[tuple[str, int], list] = {(n, i): [] for n in names
                                              for i in range(len(switches))}
        with torch.cuda.device(self.device):
            for r in range(rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for i, sw in enumerate(switches):
                    for name in order:
                        sw.set(states[name])
                        start = torch.cuda.Event(enable_timing=True)
                        end = torch.cuda.Event(enable_timing=True)
                        start.record()
                        sw.graph.replay()
                        end.record()
                        pairs[(name, i)].append((start, end))
            torch.cuda.synchronize()
        return {n: [statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs[(n, i)])
                    for i in range(len(switches))] for n in names}

    # ------------------------------------------------------------ replays
    def replays(self, graphs: Mapping[Any, Any], rounds: int,
                before: Optional[Callable[[Any], None]] = None) -> dict[Any, list[float]]:
        """Every replay's microseconds per graph: ``rounds`` rounds, each replaying
        every graph once, the order rotated by one each round; ``before(key)``
        (e.g. a flush) runs before each replay when given."""
        torch = self.torch
        keys = list(graphs)
        pairs: dict[Any, list] = {key: [] for key in keys}
        with torch.cuda.device(self.device):
            for r in range(rounds):
                k = r % len(keys) if keys else 0
                for key in keys[k:] + keys[:k]:
                    if before is not None:
                        before(key)
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    graphs[key].replay()
                    end.record()
                    pairs[key].append((start, end))
            torch.cuda.synchronize()
        return {key: [s.elapsed_time(e) * 1e3 for s, e in p] for key, p in pairs.items()}

    def time_graphs(self, graphs: Mapping[Any, Any], rounds: int,
                    before: Optional[Callable[[Any], None]] = None) -> dict[Any, float]:
        """The median us of each graph's replays (:meth:`replays`: interleaved,
        ``before(key)`` before each replay when given)."""
        return medians(self.replays(graphs, rounds, before))

    def time_graph(self, graph: Any, rounds: int,
                   before: Optional[Callable[[], None]] = None) -> float:
        """The median us of ``rounds`` replays of one graph, ``before()`` (a flush,
        say) before each when given."""
        return self.time_graphs({0: graph}, rounds,
                                None if before is None else (lambda _key: before()))[0]

    def instance_medians(self, graphs: Mapping[tuple[Any, int], Any], rounds: int,
                         before: Optional[Callable[[tuple[Any, int]], None]] = None
                         ) -> dict[Any, list[float]]:
        """Per variant, the median us of each instance's replays, in instance order.

        ``graphs`` maps ``(variant, instance)`` to a captured graph; all of them
        are replayed interleaved (:meth:`replays`).  Two keys may hold the same
        graph, to replay one capture under two conditions (``before`` tells
        them apart: after a flush, after a warm-up read).
        """
        us = self.replays(graphs, rounds, before)
        out: dict[Any, list[tuple[int, float]]] = {}
        for (name, index), values in us.items():
            out.setdefault(name, []).append((index, statistics.median(values)))
        return {name: [m for _, m in sorted(per)] for name, per in out.items()}

    def measure(self, variants: Mapping[str, Callable[[], Any]], instances: int, rounds: int, *,
                setup: Optional[Mapping[str, Callable[[], Any]]] = None,
                before: Optional[Callable[[str], None]] = None) -> Measurement:
        """Capture each variant ``instances`` times and time all of them interleaved.

        ``variants[name]`` is the function to capture.  ``setup[name]()``, when
        given, is a context manager entered around that variant's captures
        (attaching hooks, say).  Graphs of one instance index are captured
        variant after variant, so capture order does not favour a variant.
        """
        if instances < 1 or rounds < 1:
            raise ValueError(f"instances and rounds must be >= 1, got {instances}, {rounds}")
        import contextlib

        t0 = time.perf_counter()
        graphs: dict[tuple[str, int], Any] = {}
        outputs: dict[str, list[Any]] = {name: [] for name in variants}
        for i in range(instances):
            for name, fn in variants.items():
                ctx = setup[name]() if setup and name in setup else contextlib.nullcontext()
                with ctx:
                    graph, out = self.capture(fn, warmup=1 if i == 0 else 0)
                graphs[(name, i)] = graph
                outputs[name].append(out)
        t1 = time.perf_counter()
        us = self.replays(graphs, rounds,
                          None if before is None else (lambda key: before(key[0])))
        t2 = time.perf_counter()
        replays = {name: [us[(name, i)] for i in range(instances)] for name in variants}
        medians = {name: [statistics.median(x) for x in per] for name, per in replays.items()}
        del graphs
        return Measurement(medians, replays, outputs, t1 - t0, t2 - t1)


class LoaderSwitch:
    """The loader nodes of one captured graph (``Rig.capture(..., keep_graph=True)``),
    switched in place between replays: the tuner's paired comparisons.

    :meth:`set` takes ``"on"`` (the captured loads), ``"empty"`` (the same kernels
    with no ranges: the empty-fork control), ``"off"`` (the nodes disabled) or a
    mapping from a captured table's ranges to the table each such node should
    launch instead (another cap, grid or kernel; priority and carveout stay as
    captured).  A node an eager fork captured with its activation appended
    (``warm_activation``) has one range more than its table: it matches that table's
    ranges, and a warm table put in its place gets the same activation range.  Updates
    apply to later replays only, so switching needs no sync.
    """

    def __init__(self, graph: Any) -> None:
        from .. import _C

        self._C = _C
        self.graph = graph
        found = _C._graph_loader_nodes(graph.raw_cuda_graph())
        self.nodes = tuple(node for node, _ in found)
        #: The ranges each node was captured with, in node order.
        self.captured = tuple(ranges for _, ranges in found)
        self._exec = graph.raw_cuda_graph_exec()
        self._state: Any = "on"

    def set(self, state: Any) -> None:
        if state is self._state or (isinstance(state, str) and state == self._state):
            return
        if isinstance(state, Mapping):
            tables, extras = [], []
            for ranges in self.captured:
                table, extra = state.get(ranges), None
                if table is None and ranges and ranges[:-1] in state:   # captured warm
                    table = state[ranges[:-1]]
                    extra = ranges[-1] if table.warm_activation else None
                if table is None:
                    raise ValueError(f"no table given for the loader node captured with "
                                     f"ranges {ranges!r}")
                tables.append(table)
                extras.append(extra)
            self._C._graph_set_loaders(self._exec, self.nodes, tuple(tables), tuple(extras))
        else:
            self._C._graph_set_loaders(self._exec, self.nodes, state)
        self._state = state


def orderings_lost(edges: Sequence[tuple[int, int]], removed: Sequence[int]
                   ) -> list[tuple[int, int]]:
    """What removing nodes from a graph would unorder: the pairs (p, s) of other nodes
    with a path p -> removed nodes only -> s but no path from p to s through the
    other nodes.  ``edges``: (from, to) node pairs (``_C._graph_edges``).

    A fork's loader node in any mode (inline, branch, leaf) is such that nothing is
    lost: the node after an inline fork keeps its own edge from the node before, a
    branch's join follows the fork's node along the captured stream, and nothing
    waits for a leaf.  So an empty list is the expected answer, and anything else
    means the graph is not what the controller captures.  Every edge counts as an
    ordering, whatever its type: a programmatic edge standing in for a lost full one
    is not caught (the controller makes no such graph).
    """
    gone = set(removed)
    after: dict[int, list[int]] = {}
    for u, v in edges:
        after.setdefault(u, []).append(v)
    lost = []
    for p in sorted({u for u, v in edges if v in gone and u not in gone}):
        # the other nodes p reaches through removed nodes alone
        targets, seen, todo = set(), set(), [v for v in after.get(p, ()) if v in gone]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for v in after.get(n, ()):
                if v in gone:
                    todo.append(v)
                else:
                    targets.add(v)
        # which of them p reaches without them; most are a node or two down
        reached, todo = set(), [v for v in after.get(p, ()) if v not in gone]
        while todo and not targets <= reached:
            n = todo.pop()
            if n in reached:
                continue
            reached.add(n)
            todo.extend(v for v in after.get(n, ()) if v not in gone)
        lost.extend((p, s) for s in sorted(targets - reached))
    return lost


class NoForks:
    """A captured graph's step without its forks, at the same addresses: the template
    graph (``Rig.capture(..., keep_graph=True)``) cloned without its loader nodes and
    instantiated on its own, replayed on the current stream.

    Two captures of a step replay apart by where their buffers land (RESULTS run 18),
    so the tuner's (a) for an arm is this graph of the arm's own capture.  It raises
    RuntimeError if removing the loader nodes would unorder other nodes
    (:func:`orderings_lost`).  Holds ``graph`` (whose pool its nodes read and write)
    and the executable graph (a ``_C.GraphExec``, which holds the driver that made it);
    :meth:`close` (or garbage collection) destroys the executable graph.
    """

    def __init__(self, graph: Any, nodes: Optional[Sequence[int]] = None, *,
                 device: Any = None) -> None:
        import torch

        from .. import _C

        self.graph = graph
        #: Where it replays (that device's current stream); None: the current device.
        self.device = None if device is None else torch.device(device)
        raw = graph.raw_cuda_graph()
        if nodes is None:
            nodes = [node for node, _ in _C._graph_loader_nodes(raw)]
        self.nodes = tuple(nodes)
        lost = orderings_lost(_C._graph_edges(raw), self.nodes)
        if lost:
            raise RuntimeError(f"removing the {len(self.nodes)} loader nodes would unorder "
                               f"{len(lost)} pairs of other nodes (first: {lost[0]}); the "
                               f"graph is not one the controller captured")
        self._exec = _C._graph_instantiate_without(raw, self.nodes)

    def replay(self) -> None:
        import torch

        if self._exec.closed:
            raise RuntimeError("this NoForks graph is closed")
        stream = torch.cuda.current_stream(self.device)
        with torch.cuda.device(stream.device):
            self._exec.launch(stream.cuda_stream)

    def close(self) -> None:
        """Destroy the executable graph (again: nothing)."""
        self._exec.close()


def medians(values: Mapping[Any, Sequence[float]]) -> dict[Any, float]:
    """The median of each list."""
    return {key: statistics.median(v) for key, v in values.items()}
