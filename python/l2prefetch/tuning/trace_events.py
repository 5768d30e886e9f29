"""Profiler-event parsing for :mod:`l2prefetch.tuning.trace`: a chrome trace's kernels,
split into replays of one graph, and their median timeline.

Pure Python (tested on synthetic traces).  Every malformed trace is a
:class:`TraceError`, in time linear in its size.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

__all__ = ["Kernel", "LOADER_PREFIX", "MAX_US", "TraceError", "kernel_events",
           "median_timeline", "split_replays", "timeline"]

#: The loader kernels' names: ``l2p_prefetch_<CAP>`` (CAP: the most ranges it takes).
LOADER_PREFIX = "l2p_prefetch_"


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
