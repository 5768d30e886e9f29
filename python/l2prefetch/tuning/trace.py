"""Where the prefetch loads ran in a captured CUDA graph, per fork (``l2prefetch trace``).

A loader is a kernel node of the captured decode step; whether its loads pay
depends on what the GPU runs meanwhile (issue 24: an inline loader held the
node after it; a leaf or branch loader ran beside the window).  :func:`trace`
captures the step five times:

* *loads*: the forks with their tables (the role or profile traced);
* *control*: the same forks with empty tables
  (:func:`~l2prefetch.tuning.rig.empty_controller`), each kernel's baseline;
* *none*: no forks, against which *control* shows where each empty fork's cost
  arises (``ForkTrace.delay_us``: how much later the kernel after it started,
  relative to the end of the kernel before it; ``delay_to_next_us``: how much
  later the step reached the next fork), captured twice: the second shows the
  same measure's noise between captures (``delay_floor_us``);
* *layout*: no forks; an empty loader kernel on the captured stream marks
  each fork and the start and end of each consumer module (the module that
  reads the first loaded weight), which places them among the step's kernels
  by order.  The step's own kernels are the same in all five graphs; where
  they are not, a fork's consumer is the first GEMM/GEMV-named kernel after it.

Each graph is replayed a few times under ``torch.profiler`` (CUPTI records
every kernel of a graph replay, on the hardware stream the graph executor
chose); per kernel, the medians over the replays of its start and end,
relative to the replay's first kernel, make one timeline.  An inline loader
launches early, as a programmatic dependent of the kernel before it (once
that kernel's blocks have begun), and waits at its first instruction
(``griddepcontrol.wait``) until that kernel is done: its CUPTI start is that
early launch, so where it began before that kernel's end the trace shows it
from that end, when its loads can start.  Per fork it gives the loader's
start, end and stream, the window (the kernels that ran on other
streams while it ran), the overlap (the share of the loader's time during
which another kernel ran: on another stream, or on its own beside an inline
loader without being held, :data:`HELD_US`) and the consumer's time with loads and
with empty tables.  With ``dot=`` the loads graph is also written with
``cuGraphDebugDotPrint`` and each loader node's neighbours are listed.

The parsing and the analysis are pure Python (tested on synthetic traces);
capturing needs torch with CUDA.  Nothing of this is imported by the runtime
(controller, hooks, ops): only the trace command imports it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import re
import statistics
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from .._files import check_output, read_bytes, write_atomic
from ..mechanisms import DEFAULT_GRAPH_FORK

__all__ = ["Forks", "ForkTrace", "Kernel", "Layout", "TraceError", "TraceResult", "analyze",
           "forks_of_profile", "forks_of_role", "kernel_events", "layout_of", "median_timeline",
           "split_replays", "timeline", "trace"]

logger = logging.getLogger(__name__)

#: The loader kernels' names: ``l2p_prefetch_<CAP>`` (CAP: the most ranges it takes).
LOADER_PREFIX = "l2p_prefetch_"
#: The fallback consumer: the first kernel after the fork whose name says it multiplies.
GEMM_NAME = re.compile(r"gemm|gemv|matmul|splitk|cutlass|xmma|nvjet", re.IGNORECASE)
#: Kernels shown before each fork, and the most rows of one fork's table.
BEFORE = 3
#: A kernel on the loader's own stream that ran while it did is *held* by it when it
#: took this much longer than with empty tables (us); otherwise it ran beside it (an
#: inline loader and the node after it, such as a window's spin: RESULTS run 20).
HELD_US = 1.0
MAX_ROWS = 40
#: The most the files this module reads back may be (the profiler's chrome trace, the
#: graph's cuGraphDebugDotPrint): both are written by torch or the driver into a
#: private temporary directory.
MAX_FILE_BYTES = 1 << 30
#: Eager replays before the profiled ones (lazy instantiation, clocks).
WARM_REPLAYS = 3


class TraceError(ValueError):
    """A kernel trace that cannot be read: malformed, empty, or replays that differ."""


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel's run: ``start`` and ``end`` in us, ``stream`` as CUPTI names it."""

    name: str
    stream: Any
    start: float
    end: float

    @property
    def dur(self) -> float:
        return self.end - self.start

    @property
    def loader(self) -> bool:
        return self.name.startswith(LOADER_PREFIX)


#: The most a kernel event's ``ts`` or its end may be from zero, in us (31,000 years):
#: every difference of two times stays finite.
MAX_US = 1e18


def _within(value: Any, low: float) -> bool:
    """Whether ``value`` is a number (not a bool) in ``low..MAX_US``; an int too large
    for a float is not (math.isfinite would raise OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return low <= value <= MAX_US      # False for NaN; compares a huge int exactly


def _stream(value: Any) -> bool:
    """A stream as CUPTI names it: an int of 64 bits or a short str (it is counted, keyed
    and written in the Markdown)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return -2**63 <= value < 2**64
    return isinstance(value, str) and len(value) <= 200


def _brief(value: Any, depth: int = 0) -> str:
    """A short, always printable account of a JSON value for a message (``repr`` of an
    int of more than 4300 digits raises; a field may hold megabytes)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"<a {value.bit_length()}-bit int>"
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, (dict, list)):
        if depth >= 2:
            return "{...}" if isinstance(value, dict) else "[...]"
        items = list(value.items() if isinstance(value, dict) else enumerate(value))
        shown = [f"{_brief(k, 2)}: {_brief(v, depth + 1)}" if isinstance(value, dict)
                 else _brief(v, depth + 1) for k, v in items[:8]]
        more = ", ..." if len(items) > 8 else ""
        return ("{%s%s}" if isinstance(value, dict) else "[%s%s]") % (", ".join(shown), more)
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return f"<{type(value).__name__}>"


def kernel_events(data: Any) -> list[Kernel]:
    """The kernels of a chrome trace (``export_chrome_trace``'s JSON, parsed), by start.

    Kernel events are ``"ph": "X"``, ``"cat": "kernel"`` with ``ts`` and ``dur``
    in us; the stream is ``args.stream`` (else ``tid``).  Other events are
    skipped; a kernel event without a name (a str), a ``ts`` and a ``dur >= 0``
    whose sum lie within :data:`MAX_US` of zero, or a stream (an int of 64 bits or
    a str) raises :class:`TraceError`, as does anything but such a list; the time
    taken is linear in the number of events.
    """
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceError("a chrome trace is a JSON object with a 'traceEvents' list (or that "
                         f"list), got {type(data).__name__}")
    out = []
    for i, event in enumerate(events):
        if not isinstance(event, dict) or event.get("ph") != "X" or event.get("cat") != "kernel":
            continue
        name, ts, dur = event.get("name"), event.get("ts"), event.get("dur")
        if not isinstance(name, str) or not _within(ts, -MAX_US) or not _within(dur, 0) \
                or not _within(ts + dur, -MAX_US):
            raise TraceError(f"traceEvents[{i}] is a kernel event without a name, a finite "
                             f"'ts' and a finite 'dur' >= 0 (their sum within {MAX_US:g} us "
                             f"of zero): {_brief(event)}")
        args = event.get("args")
        stream = args.get("stream", event.get("tid")) if isinstance(args, dict) else \
            event.get("tid")
        if not _stream(stream):
            raise TraceError(f"traceEvents[{i}] is a kernel event whose stream ('args.stream', "
                             f"else 'tid') is not an int of 64 bits or a short str: "
                             f"{_brief(stream)}")
        out.append(Kernel(name, stream, float(ts), float(ts) + float(dur)))
    out.sort(key=lambda k: (k.start, k.end))
    return out


def split_replays(kernels: Sequence[Kernel], replays: int) -> list[list[Kernel]]:
    """``kernels`` (by start) of ``replays`` back-to-back replays of one graph, one list per
    replay, each relative to its first kernel.  Every replay must run the same kernels."""
    if isinstance(replays, bool) or not isinstance(replays, int) or replays < 1:
        raise ValueError(f"replays must be an int >= 1, got {replays!r}")
    if not kernels:
        raise TraceError("the trace holds no kernel events: was the profiler recording CUDA "
                         "activity (ProfilerActivity.CUDA) while the graph replayed?")
    if len(kernels) % replays:
        raise TraceError(f"{len(kernels)} kernels do not split into {replays} replays of one "
                         "graph (each replay runs the same kernels)")
    per = len(kernels) // replays
    runs = [list(kernels[i * per:(i + 1) * per]) for i in range(replays)]
    first = Counter(k.name for k in runs[0])
    for r, run in enumerate(runs[1:], 1):
        if Counter(k.name for k in run) != first:
            raise TraceError(f"replay {r} ran other kernels than replay 0: the trace is not of "
                             f"{replays} replays of one graph")
    return [[Kernel(k.name, k.stream, k.start - run[0].start, k.end - run[0].start)
             for k in run] for run in runs]


def _keyed(run: Sequence[Kernel]) -> dict[tuple[str, int], Kernel]:
    """A replay's kernels keyed by (name, n): the n-th kernel of that name by start, which
    is the same kernel in every replay (same-named kernels do not run side by side)."""
    seen: Counter = Counter()
    out = {}
    for k in sorted(run, key=lambda k: (k.start, k.end)):
        out[(k.name, seen[k.name])] = k
        seen[k.name] += 1
    return out


def median_timeline(runs: Sequence[Sequence[Kernel]]) -> list[Kernel]:
    """One timeline of several replays (:func:`split_replays`): per kernel the median start
    and end and the stream it ran on most often, by median start."""
    if not runs:
        raise TraceError("no replays to take medians over")
    keyed = [_keyed(run) for run in runs]
    if any(run.keys() != keyed[0].keys() for run in keyed):
        raise TraceError("the replays ran different kernels: they are not replays of one graph")
    out = []
    for key in keyed[0]:
        ks = [run[key] for run in keyed]
        stream = Counter(k.stream for k in ks).most_common(1)[0][0]
        out.append(Kernel(key[0], stream, statistics.median(k.start for k in ks),
                          statistics.median(k.end for k in ks)))
    out.sort(key=lambda k: (k.start, k.end))
    return out


def timeline(data: Any, replays: int) -> list[Kernel]:
    """The median timeline of a chrome trace of ``replays`` replays of one graph."""
    return median_timeline(split_replays(kernel_events(data), replays))


# ------------------------------------------------------------------ analysis

@dataclasses.dataclass(frozen=True)
class Layout:
    """Where forks and consumers fall among the step's own kernels (the non-loader
    kernels by start): ``names`` those kernels' names; ``forks`` per fork in order its
    key and the index of the first kernel after it; ``consumers[path]`` a module's
    kernels as ``(first, last + 1)``."""

    names: tuple[str, ...]
    forks: tuple[tuple[Any, int], ...]
    consumers: Mapping[str, tuple[int, int]]


def layout_of(kernels: Sequence[Kernel], marks: Sequence[tuple[str, Any]]) -> Layout:
    """The layout of a marker graph's timeline: its loader kernels are markers, in the
    order of ``marks`` (``("fork", key)``, ``("begin", path)``, ``("end", path)``)."""
    markers = sum(1 for k in kernels if k.loader)
    if markers != len(marks):
        raise TraceError(f"the layout graph ran {markers} marker kernels for {len(marks)} marks")
    names: list[str] = []
    forks, begins, consumers = [], {}, {}
    pending = iter(marks)
    for k in kernels:
        if not k.loader:
            names.append(k.name)
            continue
        kind, what = next(pending)
        if kind == "fork":
            forks.append((what, len(names)))
        elif kind == "begin":
            begins.setdefault(what, len(names))
        elif kind == "end" and what in begins:
            consumers.setdefault(what, (begins[what], len(names)))
        else:
            raise TraceError(f"a layout mark must be ('fork', key), ('begin', path) or "
                             f"('end', path) after its begin, got {(kind, what)!r}")
    return Layout(tuple(names), tuple(forks), consumers)


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a fork's table: ``index`` among the step's kernels (None for a loader),
    the kernel with loads, its run with empty tables (``control``), and what it is."""

    index: Optional[int]
    kernel: Kernel
    control: Optional[Kernel]
    role: str


@dataclasses.dataclass
class ForkTrace:
    """One fork: its loader against its window and its consumer (see the module's docstring).

    ``key`` is ``(point, layer, batch)`` and ``consumer_path`` the consumer module
    where known; ``before`` the kernel the fork follows; ``found_by`` says how the
    consumer was found (``"module"``, ``"name"`` or ``"none"``).
    """

    number: int
    key: Optional[tuple]
    mode: Optional[str]
    consumer_path: Optional[str]
    loader: Kernel
    loader_control: Optional[Kernel]
    before: Optional[Kernel]
    window: list[Kernel]
    overlap: float
    consumer: list[Kernel]
    consumer_control: list[Kernel]
    found_by: str
    rows: list[Row]
    #: The number of the step's kernels before the fork (``rows``' index of the next one).
    after: Optional[int] = None
    #: With empty tables against no forks (``analyze``'s ``none``): how much later the
    #: kernel after the fork started, relative to the end of the kernel before it, and
    #: how much later the step reached the next fork (or its end), relative to the same;
    #: ``delay_floor_us``: the first between two captures without forks (the noise).
    delay_us: Optional[float] = None
    delay_to_next_us: Optional[float] = None
    delay_floor_us: Optional[float] = None
    #: Per kernel from the one after the fork (``rows``' index ``after``) to the one before
    #: the next fork: how much later it started with empty tables than without forks,
    #: relative to the end of the kernel before the fork (the first is ``delay_us``), and
    #: the same between the two captures without forks.
    lags_us: tuple[float, ...] = ()
    lags_floor_us: tuple[float, ...] = ()

    @property
    def label(self) -> str:
        if self.key is None:
            return f"fork {self.number}"
        point, layer, batch = self.key
        return f"`{point}`, layer {layer}, batch {batch}"

    @staticmethod
    def _span(kernels: Sequence[Kernel]) -> Optional[float]:
        return kernels[-1].end - kernels[0].start if kernels else None

    @property
    def consumer_us(self) -> Optional[float]:
        return self._span(self.consumer)

    @property
    def consumer_control_us(self) -> Optional[float]:
        return self._span(self.consumer_control)

    @property
    def fork_us(self) -> Optional[float]:
        """When the fork's predecessor ended: the earliest the loader can start."""
        return None if self.before is None else self.before.end

    @property
    def start_after_fork_us(self) -> Optional[float]:
        return None if self.fork_us is None else self.loader.start - self.fork_us

    def summary(self) -> str:
        ld = self.loader
        parts = [f"loads ran {ld.start:.1f}-{ld.end:.1f} us ({ld.dur:.1f} us"
                 + (f", starting {self.start_after_fork_us:+.1f} us after the fork)"
                    if self.fork_us is not None else ")")]
        if self.window:
            parts.append(f"window (kernels on other streams meanwhile) "
                         f"{min(k.start for k in self.window):.1f}-"
                         f"{max(k.end for k in self.window):.1f} us")
        else:
            parts.append("window (kernels on other streams meanwhile): none")
        parts.append(f"overlap {100 * self.overlap:.0f}%")
        if self.consumer:
            control = self.consumer_control_us
            parts.append(f"consumer {self.consumer_us:.1f} us with loads vs "
                         + (f"{control:.1f} us with empty tables" if control is not None
                            else "(no control)"))
        else:
            parts.append("consumer not found")
        return "; ".join(parts)


def _covered(loader: Kernel, others: Sequence[Kernel]) -> float:
    """How many us of ``loader``'s run at least one of ``others`` ran."""
    spans = sorted((max(k.start, loader.start), min(k.end, loader.end)) for k in others)
    total, reach = 0.0, loader.start
    for start, end in spans:
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


def _consumer(step: Sequence[Kernel], after: int, layout: Optional[Layout],
              path: Optional[str]) -> tuple[int, int, str]:
    span = layout.consumers.get(path) if layout is not None and path is not None else None
    if span is not None and span[1] > span[0]:
        return span[0], span[1], "module"
    for j in range(after, len(step)):
        if GEMM_NAME.search(step[j].name):
            return j, j + 1, "name"
    return after, after, "none"


def _loads_from(before: Kernel, loader: Kernel) -> Kernel:
    """``loader`` as its loads ran: an inline loader launches once the kernel before its
    fork has begun (on that kernel's stream) and waits for its end in
    griddepcontrol.wait, so its loads start no earlier than that end."""
    if before.stream == loader.stream and before.start <= loader.start < before.end < loader.end:
        return dataclasses.replace(loader, start=before.end)
    return loader


def _delays(base: Sequence[Kernel], bare: Sequence[Kernel], afters: Sequence[int]
            ) -> list[tuple[Optional[float], Optional[float], tuple[float, ...]]]:
    """Per fork (``afters``: the step's kernels before each), how much later the step with
    empty tables (``base``) ran than ``bare`` (the same kernels, no forks): the kernel after
    the fork's start, relative to the end of the one before it; the end of the kernel
    before the next fork (or the step's end), relative to the same; and the start of each
    kernel from the one after the fork to the one before the next fork, relative to the
    same (its first is the first delay: where along the way the delay grew or shrank).
    Forks back to back (one place): the first carries the place's delay, the others None.
    A fork at the step's start or end: None (the replay's zero, its first kernel, may be
    a loader)."""
    def lag(j: int, edge: str) -> float:   # how much later kernel j's start or end ran
        return getattr(base[j], edge) - getattr(bare[j], edge)

    n, out = len(base), []
    for i, after in enumerate(afters):
        if not 0 < after < n or after in afters[:i]:
            out.append((None, None, ()))
            continue
        at = lag(after - 1, "end")
        nxt = min((a for a in afters if a > after), default=None)
        reach = lag(nxt - 1, "end") if nxt is not None else \
            max(k.end for k in base) - max(k.end for k in bare)
        lags = tuple(lag(j, "start") - at for j in range(after, n if nxt is None else nxt))
        out.append((lags[0], reach - at, lags))
    return out


def analyze(loads: Sequence[Kernel], control: Optional[Sequence[Kernel]] = None,
            layout: Optional[Layout] = None,
            consumers: Optional[Mapping[tuple, str]] = None,
            modes: Optional[Mapping[tuple, str]] = None,
            none: Optional[Sequence[Kernel]] = None,
            floor: Optional[Sequence[Kernel]] = None) -> list[ForkTrace]:
    """Per loader kernel of the ``loads`` timeline, its :class:`ForkTrace`.

    ``control`` is the timeline with empty tables; ``layout`` places forks and
    consumers (:func:`layout_of`; ignored, with a warning, when its kernels are
    not the step's); ``consumers[key]`` is each fork's consumer module path and
    ``modes[key]`` its graph fork mode, by ``(point, layer, batch)``; ``none`` the
    timeline without forks, against which ``control`` gives each empty fork's delay, and
    ``floor`` another capture without forks, against which ``none`` gives that delay's
    noise between captures.
    """
    step = [k for k in loads if not k.loader]
    loaders = [k for k in loads if k.loader]
    base = [k for k in control if not k.loader] if control is not None else None
    base_loaders = [k for k in control if k.loader] if control is not None else []
    if base is not None and [k.name for k in base] != [k.name for k in step]:
        logger.warning("the control graph ran other kernels than the loads graph: no "
                       "durations with empty tables")
        base, base_loaders = None, []
    if len(base_loaders) != len(loaders):
        base_loaders = []
    if layout is not None and (list(layout.names) != [k.name for k in step]
                               or len(layout.forks) != len(loaders)):
        logger.warning("the layout graph's kernels are not the loads graph's (%d kernels and "
                       "%d forks against %d and %d): forks placed by time, consumers by name",
                       len(layout.names), len(layout.forks), len(step), len(loaders))
        layout = None
    # Where each fork is: (key, the number of the step's kernels before it).  Without a
    # layout: after the last kernel that ended before the loader began, or that was
    # running then on its own stream (an inline loader's early launch).
    places = layout.forks if layout is not None else [
        (None, 1 + max((j for j, k in enumerate(step) if k.end <= loader.start or (
            k.stream == loader.stream and k.start <= loader.start)), default=-1))
        for loader in loaders]
    for i, (_, after) in enumerate(places):
        if after > 0:
            loaders[i] = _loads_from(step[after - 1], loaders[i])
            if base_loaders:
                base_loaders[i] = _loads_from(base[after - 1], base_loaders[i])
    out = []
    for i, loader in enumerate(loaders):
        key, after = places[i]
        path = (consumers or {}).get(key) if key is not None else None
        c0, c1, found_by = _consumer(step, after, layout, path)
        # The window: the step's kernels on other streams that ran while the loader ran.
        in_window = {j for j, k in enumerate(step) if k.stream != loader.stream
                     and k.start < loader.end and k.end > loader.start}
        window = [step[j] for j in sorted(in_window)]
        # On the loader's own stream a kernel runs meanwhile only beside an inline loader
        # (the node after it); it overlaps the loads unless the loader held it (it took
        # HELD_US longer than with empty tables; without the control, held is assumed).
        beside = {j for j, k in enumerate(step) if k.stream == loader.stream
                  and k.start < loader.end and k.end > loader.start}
        held = {j for j in beside if base is None or step[j].dur > base[j].dur + HELD_US}
        alongside = window + [step[j] for j in sorted(beside - held)]
        overlap = _covered(loader, alongside) / loader.dur if loader.dur > 0 else 0.0
        last = max([c1, *(j + 1 for j in in_window)])
        first = max(0, after - BEFORE)
        rows = []
        for j in range(first, last):
            role = ", ".join(r for r, on in (("window", j in in_window),
                                             ("meanwhile, its stream", j in beside),
                                             ("held", j in held),
                                             ("consumer", c0 <= j < c1)) if on)
            rows.append(Row(j, step[j], base[j] if base is not None else None, role))
        lo = step[first].start if first < len(step) else loader.start
        hi = step[last - 1].end if last > first else loader.end
        for n, other in enumerate(loaders):
            if n == i or lo <= other.start <= hi:
                rows.append(Row(None, loader if n == i else other,
                                base_loaders[n] if base_loaders else None,
                                "**loader**" if n == i else "another fork's loader"))
        rows.sort(key=lambda r: (r.kernel.start, r.index is not None))
        out.append(ForkTrace(
            number=i + 1, key=key, mode=(modes or {}).get(key), consumer_path=path,
            loader=loader, loader_control=base_loaders[i] if base_loaders else None,
            before=step[after - 1] if after > 0 else None, window=window, overlap=overlap,
            consumer=step[c0:c1], consumer_control=base[c0:c1] if base is not None else [],
            found_by=found_by, rows=rows, after=after))
    if none is not None and base is not None:
        bare = [k for k in none if not k.loader]
        if [k.name for k in bare] == [k.name for k in base]:
            afters = [after for _, after in places]
            for fork, (delay, reach, lags) in zip(out, _delays(base, bare, afters)):
                fork.delay_us, fork.delay_to_next_us, fork.lags_us = delay, reach, lags
            if floor is not None:
                again = [k for k in floor if not k.loader]
                if [k.name for k in again] == [k.name for k in bare]:
                    for fork, (delay, _, lags) in zip(out, _delays(again, bare, afters)):
                        fork.delay_floor_us, fork.lags_floor_us = delay, lags
        else:
            logger.warning("the graph without forks ran other kernels than the one with "
                           "empty tables: no delays per fork")
    return out


# ------------------------------------------------------------------ output

def _name(name: str, width: int = 72) -> str:
    text = name if len(name) <= width else name[:width - 3] + "..."
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`"


def _us(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.1f}"


@dataclasses.dataclass
class TraceResult:
    """What :func:`trace` found: per fork a :class:`ForkTrace`, plus the whole step's span
    with loads and with empty tables, and the loader nodes' neighbours in the graph."""

    title: str
    replays: int
    forks: list[ForkTrace]
    step_us: Optional[float] = None
    control_step_us: Optional[float] = None
    none_step_us: Optional[float] = None
    notes: list[str] = dataclasses.field(default_factory=list)
    graph: list[str] = dataclasses.field(default_factory=list)
    kernels: list[Kernel] = dataclasses.field(default_factory=list, repr=False)

    def markdown(self) -> str:
        lines = [f"# l2prefetch trace: {self.title}", ""]
        lines.append(f"Medians over {self.replays} replay{'s' if self.replays != 1 else ''} "
                     "of each captured graph (CUPTI, "
                     "torch.profiler); times in us from the replay's first kernel.  Loaders "
                     f"are `{LOADER_PREFIX}*`; the control is the same graph with empty tables.")
        if self.step_us is not None:
            lines.append(f"The step's kernels span {self.step_us:.1f} us with loads"
                         + (f", {self.control_step_us:.1f} us with empty tables"
                            if self.control_step_us is not None else "")
                         + (f", {self.none_step_us:.1f} us without forks"
                            if self.none_step_us is not None else "") + ".")
        if self.notes:
            lines += [""] + [f"- {note}" for note in self.notes]
        if not self.forks:
            lines += ["", "No loader kernel ran: nothing forked in this step (is the batch one "
                          "the plan covers?)."]
        for fork in self.forks:
            lines += ["", f"## Fork {fork.number}: {fork.label}"
                      + (f" ({fork.mode})" if fork.mode else ""), ""]
            lines.append(fork.summary() + ".")
            for row in fork.rows:
                if "meanwhile, its stream" in row.role:
                    k, c = row.kernel, row.control
                    lines += ["", f"Meanwhile on the loader's stream: {_name(k.name, 60)} ran "
                              f"{k.start:.1f}-{k.end:.1f} us ({k.dur:.1f} us"
                              + (f"; {c.dur:.1f} us with empty tables" if c else "")
                              + ("): the loader held it." if "held" in row.role
                                 else "): it ran beside the loads.")]
            how = {"module": f"the kernels of `{fork.consumer_path}`, placed by the layout graph",
                   "name": "the first GEMM/GEMV-named kernel after the fork",
                   "none": "none found"}[fork.found_by]
            lines.append("")
            before = fork.before
            lines.append("The fork follows " + (
                f"{_name(before.name, 60)} (stream {before.stream}, ends {before.end:.1f} us)"
                if before is not None else "the step's start")
                + f"; the loader ran on stream {fork.loader.stream}; consumer: {how}.")
            if fork.delay_us is not None:
                lines.append(f"With empty tables against no forks: the kernel after the fork "
                             f"started {fork.delay_us:+.2f} us later, relative to the end of "
                             f"the one before it"
                             + (f" (two captures without forks: {fork.delay_floor_us:+.2f} us)"
                                if fork.delay_floor_us is not None else "")
                             + f"; the step reached the next fork (or its end) "
                             f"{fork.delay_to_next_us:+.2f} us later.")
            if fork.number - 1 < len(self.graph):
                lines.append(f"Graph: {self.graph[fork.number - 1]}")
            lines += ["", "| # | kernel | stream | start | end | dur | dur, empty tables | |",
                      "|---|---|---|---|---|---|---|---|"]
            rows = fork.rows
            if len(rows) > MAX_ROWS:
                keep = MAX_ROWS // 2
                rows = rows[:keep] + [None] + rows[-keep:]
            for row in rows:
                if row is None:
                    lines.append(f"| ... | {len(fork.rows) - 2 * (MAX_ROWS // 2)} rows left out "
                                 "| | | | | | |")
                    continue
                k, c = row.kernel, row.control
                lines.append(f"| {'-' if row.index is None else row.index} | {_name(k.name)} | "
                             f"{k.stream} | {k.start:.1f} | {k.end:.1f} | {k.dur:.1f} | "
                             f"{_us(c.dur if c else None)} | {row.role} |")
        return "\n".join(lines) + "\n"

    def plot(self, path: str) -> None:
        """A PNG of each fork's rows as a Gantt chart, one row per stream, the loaders
        highlighted.  Raises ImportError where matplotlib is not installed."""
        try:
            from matplotlib.figure import Figure
        except ImportError:
            raise ImportError("--plot needs matplotlib: pip install matplotlib") from None
        forks = self.forks[:8] or [None]
        fig = Figure(figsize=(11, 2.2 * len(forks) + 0.6))
        for n, fork in enumerate(forks):
            ax = fig.add_subplot(len(forks), 1, n + 1)
            if fork is None:
                ax.set_title("no loader kernel ran")
                continue
            lo = min(r.kernel.start for r in fork.rows)
            hi = max(r.kernel.end for r in fork.rows)
            shown = [k for k in self.kernels if k.end >= lo and k.start <= hi] or \
                [r.kernel for r in fork.rows]
            streams = list(dict.fromkeys(str(k.stream) for k in shown))  # first seen on top
            window, consumer = {id(k) for k in fork.window}, {id(k) for k in fork.consumer}
            for k in shown:
                if k.loader and (k.stream, k.end) == (fork.loader.stream, fork.loader.end):
                    k = fork.loader                   # drawn from when its loads started
                color = ("tab:red" if k is fork.loader else "tab:orange" if k.loader else
                         "tab:blue" if id(k) in consumer else
                         "tab:green" if id(k) in window else "0.65")
                ax.broken_barh([(k.start, max(k.dur, 0.05))],
                               (streams.index(str(k.stream)) - 0.4, 0.8), color=color)
            if fork.fork_us is not None:
                ax.axvline(fork.fork_us, color="k", linestyle="--", linewidth=0.8)
            ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
            ax.invert_yaxis()
            ax.set_title(f"fork {fork.number}: {fork.label.replace('`', '')}"
                         f"{' (' + fork.mode + ')' if fork.mode else ''}: overlap "
                         f"{100 * fork.overlap:.0f}% (red: its loader, green: window, blue: "
                         "consumer, orange: other loaders)", fontsize=8)
        fig.axes[-1].set_xlabel("us from the replay's first kernel")
        fig.tight_layout()
        image = io.BytesIO()   # written by l2prefetch, not matplotlib: atomically (_files)
        fig.savefig(image, format="png", dpi=110)
        write_atomic(path, image.getvalue(), "plot")


# ------------------------------------------------------------------ the graph's nodes

# Every pattern here is linear in the text: a node starts at a line's start, an edge at a
# name's start, and nothing spans a line but a node's label, which is searched for once.
_DOT_NODE = re.compile(r'^[ \t]*"?([\w.]+)"?[ \t]*\[', re.M)
_DOT_NODE_END = re.compile(r'\];?[ \t\r\f\v]*$', re.M)
_DOT_EDGE = re.compile(r'(?<![\w."])"?([\w.]+)"?[ \t]*->[ \t]*"?([\w.]+)"?')
# A kernel node's record label: {KERNEL | {ID | 53 (topoId: 4) | NAME\<\<\<grid...
_DOT_KERNEL = re.compile(r"\{ID\s*\|[^|]*\|\s*([^|{}<>\\\s]+)")
_DIGITS = re.compile(r"\d+")


def _demangle(name: str) -> str:
    """The qualified name of an Itanium-mangled function (``_ZN2at6native6kernelI...`` ->
    ``at::native::kernel``), enough to tell kernels apart; other names as they are.
    Linear in the name: a length is read only where it can fit in what follows."""
    if not re.match(r"_ZN?\d", name):
        return name
    parts, pos = [], 2 + (name[2:3] == "N")
    room = len(str(len(name)))   # a length of more digits than this cannot fit
    while (num := _DIGITS.match(name, pos)) and len(num.group()) <= room:
        size, pos = int(num.group()), num.end()
        if size == 0 or size > len(name) - pos:
            break
        parts.append(name[pos:pos + size])
        pos += size
    return "::".join(parts) or name


def _dot_nodes(text: str) -> dict[str, str]:
    """``name -> label`` of a dot text's node statements (``NAME [ ... ];``), the first
    statement of each name; a statement that is never closed ends the search."""
    nodes: dict[str, str] = {}
    pos = 0
    while (m := _DOT_NODE.search(text, pos)) is not None:
        end = _DOT_NODE_END.search(text, m.end())
        if end is None:        # unclosed: no later statement can close either
            break
        if "->" not in text[m.start():m.end()]:
            nodes.setdefault(m.group(1), text[m.end():end.start()])
        pos = end.end()
    return nodes


def _node_order(node: str) -> tuple:
    """Nodes by the numbers in their names (``graph_1_node_10`` after ``..._node_9``),
    compared as digit strings: a 5000-digit number is never converted to an int."""
    return tuple((len(d.lstrip("0")), d.lstrip("0")) for d in _DIGITS.findall(node)), node


def dot_neighbours(text: str) -> list[str]:
    """Per loader node of a ``cuGraphDebugDotPrint`` graph, in node order, a line naming
    the nodes it depends on and those that depend on it.

    Text that is not such a graph gives the lines of what it holds (none for most), never
    an error, in time linear in its length (and in the lines written)."""
    nodes = _dot_nodes(text)
    preds: dict[str, list[str]] = {}
    succs: dict[str, list[str]] = {}
    for a, b in _DOT_EDGE.findall(text):
        if a in nodes and b in nodes:
            succs.setdefault(a, []).append(b)
            preds.setdefault(b, []).append(a)
    shorts: dict[str, str] = {}

    def short(node: str) -> str:
        if node not in shorts:
            label = nodes[node]
            at = label.find("{ID")    # the record's first ID field only (one search)
            found = _DOT_KERNEL.match(label, at) if at >= 0 else None
            name = node if len(node) <= 80 else node[:77] + "..."
            shorts[node] = f"{name} ({_demangle(found.group(1))[:60]})" if found else name
        return shorts[node]

    out = []
    for node in sorted((n for n, label in nodes.items() if LOADER_PREFIX in label),
                       key=_node_order):
        before = [short(a) for a in preds.get(node, [])]
        after = [short(b) for b in succs.get(node, [])]
        out.append(f"node {short(node)} depends on {', '.join(before) or 'nothing'}; "
                   f"{', '.join(after) or 'nothing (a sink of the graph)'} depend"
                   f"{'s' if len(after) <= 1 else ''} on it.")
    return out


# ------------------------------------------------------------------ what to fork

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
                  device: Any = None) -> Forks:
    """The forks of a :class:`~l2prefetch.tuning.Role` at ``batch``, every one in ``mode``
    (one of :data:`l2prefetch.mechanisms.GRAPH_FORKS`: the controller's, so any mode its C
    build takes)."""
    from .. import PrefetchController
    from .rig import empty_controller

    entries = role.entries((batch,), byte_cap=byte_cap, grid=grid, kernel=kernel)

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
    for entry, raw in zip(profile.plan, profile.data["plan"]):
        if raw["weights"]:
            consumers.setdefault((entry.point, entry.layer), raw["weights"][0].rpartition(".")[0])
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


def _capture(torch: Any, fn: Callable[[], Any], stream: Any, keep_graph: bool = False) -> Any:
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


def _profile(torch: Any, graph: Any, replays: int) -> Any:
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
    import torch

    from .. import PreparedWeightRanges, hooks
    from .arms import StepError

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
                        graphs[name] = _capture(torch, fn, stream,
                                                keep_graph=bool(dot) and name == "loads")
                # no forks, twice: the empty forks' delays, and that measure's noise
                what = "without forks"
                graphs["none"] = _capture(torch, fn, stream)
                graphs["none again"] = _capture(torch, fn, stream)
                # The layout graph: markers where the forks are and around each consumer.
                what = "with the layout's markers"
                for path in sorted(set(forks.consumers.values())):
                    module = model.get_submodule(path)
                    handles.append(module.register_forward_pre_hook(
                        lambda m, a, path=path: markers.mark("begin", path)))
                    handles.append(module.register_forward_hook(
                        lambda m, a, o, path=path: markers.mark("end", path)))
                with hooks.attach(model, markers, forks.points):
                    graphs["layout"] = _capture(torch, fn, stream)
            except Exception as exc:
                raise StepError(f"step({batch}) cannot be captured {what}: "
                                f"{type(exc).__name__}: {exc}") from exc
            neighbours = _dump(graphs["loads"], dot) if dot else []
            timelines = {name: timeline(_profile(torch, graph, replays), replays)
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
