"""Running the captures for :mod:`l2prefetch.tuning.trace` (see its docstring): what
to fork (:class:`Forks`, from a role or a profile) and :func:`trace`, which captures
the step five times, replays each graph under ``torch.profiler`` and analyses the
timelines.  Needs torch with CUDA; the files it reads back and writes go through
``_files``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional

from .._files import check_output, read_bytes, write_atomic
from ..mechanisms import DEFAULT_GRAPH_FORK
from .trace_analysis import Layout, analyze, layout_of
from .trace_dot import dot_neighbours
from .trace_events import Kernel, TraceError, timeline
from .trace_render import TraceResult

__all__ = ["Forks", "MAX_FILE_BYTES", "WARM_REPLAYS", "capture_graph", "forks_of_profile",
           "forks_of_role", "profile_replays", "trace"]

logger = logging.getLogger(__name__)

#: The most the files this module reads back may be (the profiler's chrome trace, the
#: graph's cuGraphDebugDotPrint): both are written by torch or the driver into a
#: private temporary directory.
MAX_FILE_BYTES = 1 << 30
#: Eager replays before the profiled ones (lazy instantiation, clocks).
WARM_REPLAYS = 3


@dataclasses.dataclass
class Forks:
    """What a trace forks: ``build(empty)`` makes its controller (``empty``: the control,
    same forks with empty tables), ``points`` are the hook points for
    :func:`l2prefetch.hooks.attach`, ``consumers[(point, layer)]`` the path of the module
    that reads each fork's first loaded weight."""

    build: Callable[[bool], Any]
    points: dict[str, list[tuple[Any, int]]]
    consumers: dict[tuple[str, int], str]


def forks_of_role(model: Any, role: Any, batch: int, *, byte_cap: int, grid: int = 32,
                  kernel: Optional[str] = None, mode: str = DEFAULT_GRAPH_FORK,
                  device: Any = None, warm_activation: bool = False) -> Forks:
    """The forks of a :class:`~l2prefetch.tuning.Role` at ``batch``, every one in ``mode``
    (one of :data:`l2prefetch.mechanisms.GRAPH_FORKS`: the controller's, so any mode its C
    build takes), their loads ending with their site's activation where
    ``warm_activation`` (as tune() measures an eager step's)."""
    from .. import PrefetchController
    from .rig import empty_controller

    entries = role.entries((batch,), byte_cap=byte_cap, grid=grid, kernel=kernel,
                           warm_activation=warm_activation)

    def build(empty: bool) -> Any:
        if empty:
            return empty_controller(entries, device, graph_fork=mode, eager=False)
        return PrefetchController.from_plan(entries, device, graph_fork=mode, eager=False)
    return Forks(build, {role.name: role.hook_sites(model)},
                 {(role.name, s.layer): s.reads[0] for s in role.sites if s.reads})


def forks_of_profile(model: Any, profile: Any, device: Any = None) -> Forks:
    """The forks of a loaded :class:`~l2prefetch.tuning.Profile` (each entry in its own
    mode, as :func:`~l2prefetch.tuning.rig.build_controller` deploys it)."""
    from .rig import build_controller

    consumers = {}
    for entry, paths in zip(profile.plan, profile.weight_paths):
        if paths:
            consumers.setdefault((entry.point, entry.layer), paths[0].rpartition(".")[0])
    return Forks(lambda empty: build_controller(profile.plan, device, empty=empty, eager=False),
                 profile.hook_points(model), consumers)


# ------------------------------------------------------------------ on the GPU

class _Markers:
    """The layout graph's stand-in controller: where ``control`` would fork, it launches
    an empty loader kernel on the captured stream and notes the key."""

    def __init__(self, torch: Any, control: Any, marker: Any, marks: list) -> None:
        self.torch, self.control, self.marker, self.marks = torch, control, marker, marks
        self.modes: dict[tuple, Optional[str]] = {}

    def fork(self, point: str, layer: int, batch: int) -> bool:
        if not self.torch.cuda.is_current_stream_capturing() or \
                self.control.get(point, layer, batch) is None:
            return False
        self.marker.launch()
        self.marks.append(("fork", (point, layer, batch)))
        self.modes[(point, layer, batch)] = self.control.get_mode(point, layer, batch)
        return True

    def join(self) -> None:
        pass

    def mark(self, kind: str, path: str) -> None:
        if self.torch.cuda.is_current_stream_capturing():
            self.marker.launch()
            self.marks.append((kind, path))


def capture_graph(torch: Any, fn: Callable[[], Any], stream: Any,
                  keep_graph: bool = False) -> Any:
    """``fn()`` captured into a graph with its own memory pool (as the tuning rig does,
    whose docstring says why) after one eager call on the capture stream."""
    graph = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
    if keep_graph:
        graph.enable_debug_mode()   # torch before 2.9 dumps only in debug mode
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph


def _dump(graph: Any, path: str) -> list[str]:
    """Write ``graph`` (captured with ``keep_graph``) to ``path`` with cuGraphDebugDotPrint;
    return its loader nodes' neighbours (:func:`dot_neighbours`).

    The driver writes the file where it is told, following links, so it writes into a
    private directory; the file is read back through ``_files`` and written to ``path``
    atomically, as every output (a link at ``path`` is replaced, never written through)."""
    graph.instantiate()   # first: an older torch frees the graph once it has dumped it
    with tempfile.TemporaryDirectory(prefix="l2prefetch-dot-") as tmp:
        dumped = os.path.join(tmp, "graph.dot")
        with warnings.catch_warnings():  # torch warns "DEBUG: calling debug_dump()"
            warnings.simplefilter("ignore")
            graph.debug_dump(dumped)
        try:
            data = read_bytes(dumped, "cuGraphDebugDotPrint's graph", limit=MAX_FILE_BYTES)
        except (OSError, ValueError) as exc:
            raise OSError(f"cuGraphDebugDotPrint wrote no graph for {path}: {exc}") from exc
    write_atomic(path, data, "dot")
    return dot_neighbours(data.decode("utf-8", errors="replace"))


def profile_replays(torch: Any, graph: Any, replays: int) -> Any:
    """The chrome trace (parsed) of ``replays`` replays of ``graph``, CUDA activity only."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(WARM_REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # torch 2.11: "Profiler clears events at the end of ..."
        warnings.simplefilter("ignore", UserWarning)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
                torch.cuda.synchronize()
    with tempfile.TemporaryDirectory(prefix="l2prefetch-trace-") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return json.loads(read_bytes(path, "the profiler's chrome trace", limit=MAX_FILE_BYTES))


def _span(kernels: Sequence[Kernel]) -> Optional[float]:
    return max(k.end for k in kernels) - min(k.start for k in kernels) if kernels else None


def trace(model: Any, step: Callable[[int], Any], batch: int, forks: Forks, *,
          replays: int = 5, dot: Optional[str] = None, title: str = "") -> TraceResult:
    """Trace ``step(batch)`` with ``forks`` (see the module's docstring).

    ``step(batch)`` runs one capturable decode step of ``model`` (as for
    :func:`~l2prefetch.tuning.tune`); ``dot`` a path for the loads graph's
    ``cuGraphDebugDotPrint``.  Raises :class:`~l2prefetch.tuning.StepError` when
    the step fails or cannot be captured, :class:`TraceError` for a trace that
    cannot be read.
    """
    from .. import PreparedWeightRanges, _torch, hooks
    from .errors import StepError

    torch = _torch.require("l2prefetch.tuning.trace")

    if isinstance(replays, bool) or not isinstance(replays, int) or replays < 1:
        raise ValueError(f"replays must be an int >= 1, got {replays!r}")
    if dot:
        dot = check_output(dot, "dot")   # before anything is captured
    if hooks.disabled():
        raise ValueError("L2PREFETCH_DISABLE is set, so nothing forks: unset it to trace")
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"trace needs the model on a CUDA device, it is on {device}")

    def fn() -> Any:
        with torch.no_grad():
            return step(batch)

    controllers: list[Any] = []
    handles: list[Any] = []
    graphs: dict[str, Any] = {}
    marks: list[tuple[str, Any]] = []
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        try:
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as exc:
                raise StepError(f"step({batch}) failed: {type(exc).__name__}: {exc}") from exc
            controllers.append(forks.build(False))
            controllers.append(forks.build(True))
            loads, control = controllers
            markers = _Markers(torch, control, PreparedWeightRanges([], grid=1,
                                                                    device=device.index), marks)
            what = "with the forks"     # which capture failed, for the error
            try:
                for name, controller in (("loads", loads), ("control", control)):
                    with hooks.attach(model, controller, forks.points):
                        graphs[name] = capture_graph(torch, fn, stream,
                                                     keep_graph=bool(dot) and name == "loads")
                # no forks, twice: the empty forks' delays, and that measure's noise
                what = "without forks"
                graphs["none"] = capture_graph(torch, fn, stream)
                graphs["none again"] = capture_graph(torch, fn, stream)
                # The layout graph: markers where the forks are and around each consumer.
                what = "with the layout's markers"
                for path in sorted(set(forks.consumers.values())):
                    module = model.get_submodule(path)
                    handles.append(module.register_forward_pre_hook(
                        lambda m, a, path=path: markers.mark("begin", path)))
                    handles.append(module.register_forward_hook(
                        lambda m, a, o, path=path: markers.mark("end", path)))
                with hooks.attach(model, markers, forks.points):
                    graphs["layout"] = capture_graph(torch, fn, stream)
            except Exception as exc:
                raise StepError(f"step({batch}) cannot be captured {what}: "
                                f"{type(exc).__name__}: {exc}") from exc
            neighbours = _dump(graphs["loads"], dot) if dot else []
            timelines = {name: timeline(profile_replays(torch, graph, replays), replays)
                         for name, graph in graphs.items()}
        finally:
            for handle in handles:
                handle.remove()
            graphs.clear()      # the graphs launch the controllers' tables: gone first
            for controller in controllers:
                controller.close()
    try:
        layout: Optional[Layout] = layout_of(timelines["layout"], marks)
    except TraceError as exc:
        logger.warning("the layout graph cannot place forks and consumers (%s): consumers "
                       "found by name", exc)
        layout = None
    consumers = {(p, l, b): forks.consumers.get((p, l)) for (p, l, b) in markers.modes}
    result = TraceResult(
        title=title or type(model).__name__, replays=replays,
        forks=analyze(timelines["loads"], timelines["control"], layout, consumers,
                      markers.modes, timelines["none"], timelines["none again"]),
        step_us=_span(timelines["loads"]), control_step_us=_span(timelines["control"]),
        none_step_us=_span(timelines["none"]),
        graph=neighbours, kernels=timelines["loads"])
    if dot:
        result.notes.append(f"The loads graph's nodes and edges: `{dot}` (cuGraphDebugDotPrint).")
    return result
