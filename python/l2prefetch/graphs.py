"""Keep the fastest of several CUDA-graph captures of one step.

Identical captures of one decode step do not replay equally fast, and the
difference is stable: on the H200 the spread between instances is 0.2-4.9% of
the step (benchmarks/RESULTS.md, runs 11-12), more than most prefetches gain.
:func:`capture_fastest` captures a step ``k`` times, each into its own memory
pool, times every instance in interleaved rounds, keeps the fastest, frees the
others, and then times the kept one against the first capture once more: the
result is never a capture that measured slower than the first one.

    from l2prefetch import graphs
    graph, out, report = graphs.capture_fastest(lambda: step(batch), k=8)
    logger.info("%s", report)        # what the choice gained, in us and %

Needs torch with CUDA; importing this module does not.  It is the runtime's
(hooks and layer code that capture their own graphs use it): it imports no tuner code.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
from collections.abc import Callable
from typing import Any, Optional

__all__ = ["CaptureReport", "capture_fastest"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CaptureReport:
    """What :func:`capture_fastest` measured (us: medians of event-timed replays)."""

    k: int
    chosen: int               # index of the kept capture (0: the first)
    first_us: float           # the first capture, in the final comparison
    chosen_us: float          # the kept one, in the final comparison
    instance_us: tuple        # every capture's median in the first rounds

    @property
    def gain_us(self) -> float:
        return self.first_us - self.chosen_us

    @property
    def spread_pct(self) -> float:
        """(slowest - fastest) / fastest of the k captures, in percent."""
        lo, hi = min(self.instance_us), max(self.instance_us)
        return 100.0 * (hi - lo) / lo if lo > 0 else 0.0

    def __str__(self) -> str:
        return (f"kept capture {self.chosen} of {self.k}: {self.chosen_us:.1f} us against the "
                f"first's {self.first_us:.1f} us ({self.gain_us:+.1f} us, "
                f"{100 * self.gain_us / self.first_us:+.2f}%); spread of the {self.k} "
                f"captures {self.spread_pct:.2f}%")


def _check(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def capture_fastest(fn: Callable[[], Any], k: int = 8, *, replays: int = 20, warmup: int = 1,
                    stream: Any = None, before: Optional[Callable[[], None]] = None
                    ) -> tuple[Any, Any, CaptureReport]:
    """Capture ``fn()`` ``k`` times and keep the fastest; returns ``(graph, output, report)``.

    ``warmup`` eager calls of ``fn`` run on the capture stream first (cuBLAS
    handles, lazy initialisation).  Each capture gets its own memory pool
    (captures sharing one would overwrite each other's buffers).  Every capture
    is replayed ``replays`` times, one replay of each per round, in rotated
    order; ``before()`` (e.g. an L2 flush) runs before each timed replay when
    given.  The fastest by median is then replayed against the first capture in
    the same way and kept only if it is still faster; the rest are freed.
    ``output`` is the kept capture's output, refreshed by each replay.
    """
    import torch

    _check("k", k, 1)
    _check("replays", replays, 1)
    _check("warmup", warmup, 0)
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not torch.cuda.is_available():
        raise RuntimeError("capture_fastest needs a CUDA GPU (torch.cuda.is_available() is False)")
    stream = torch.cuda.Stream() if stream is None else stream
    captures: list[tuple[Any, Any]] = []
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    for _ in range(k):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = fn()
        captures.append((graph, out))
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    def timed(indices: list[int]) -> list[float]:
        events: dict[int, list] = {i: [] for i in indices}
        for r in range(replays):
            order = indices[r % len(indices):] + indices[:r % len(indices)]
            for i in order:
                if before is not None:
                    before()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                captures[i][0].replay()
                end.record()
                events[i].append((start, end))
        torch.cuda.synchronize()
        return [statistics.median(s.elapsed_time(e) * 1e3 for s, e in events[i]) for i in indices]

    medians = timed(list(range(k)))
    best = min(range(k), key=lambda i: medians[i])
    first_us = chosen_us = medians[0]
    if best != 0:
        first_us, chosen_us = timed([0, best])
        if chosen_us >= first_us:
            best, chosen_us = 0, first_us
    graph, out = captures[best]
    captures.clear()
    gc.collect()
    torch.cuda.empty_cache()
    report = CaptureReport(k=k, chosen=best, first_us=first_us, chosen_us=chosen_us,
                           instance_us=tuple(medians))
    logger.info("capture_fastest: %s", report)
    return graph, out, report
