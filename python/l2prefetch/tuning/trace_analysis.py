"""The analysis for :mod:`l2prefetch.tuning.trace`: per fork, its loader against its
window and its consumer, placed by the layout graph, and the empty fork's delays
against the graph without forks (see that module's docstring).  Pure Python.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from .trace_events import Kernel, TraceError

__all__ = ["BEFORE", "ForkTrace", "GEMM_NAME", "HELD_US", "Layout", "Row", "analyze",
           "layout_of"]

logger = logging.getLogger(__name__)

#: The fallback consumer: the first kernel after the fork whose name says it multiplies.
GEMM_NAME = re.compile(r"gemm|gemv|matmul|splitk|cutlass|xmma|nvjet", re.IGNORECASE)
#: Kernels shown before each fork.
BEFORE = 3
#: A kernel on the loader's own stream that ran while it did is *held* by it when it
#: took this much longer than with empty tables (us); otherwise it ran beside it (an
#: inline loader and the node after it, such as a window's spin: RESULTS run 20).
HELD_US = 1.0


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
