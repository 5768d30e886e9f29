"""Rendering for :mod:`l2prefetch.tuning.trace`: what a trace found
(:class:`TraceResult`) as a Markdown timeline per fork, and as a PNG (matplotlib),
written atomically through ``_files``.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Optional

from .._files import write_atomic
from .trace_analysis import ForkTrace
from .trace_events import LOADER_PREFIX, Kernel

__all__ = ["MAX_ROWS", "TraceResult"]

#: The most rows of one fork's table.
MAX_ROWS = 40


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
