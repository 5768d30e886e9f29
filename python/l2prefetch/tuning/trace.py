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

The work is done in five modules, one job each, whose public names this module
re-exports (``from l2prefetch.tuning import trace`` is the API):
:mod:`~l2prefetch.tuning.trace_events` (profiler-event parsing),
:mod:`~l2prefetch.tuning.trace_analysis` (per fork, its loader, window and consumer),
:mod:`~l2prefetch.tuning.trace_render` (the Markdown and the plot),
:mod:`~l2prefetch.tuning.trace_dot` (the graph's nodes) and
:mod:`~l2prefetch.tuning.trace_capture` (what to fork, and the captures on the GPU).
"""

from __future__ import annotations

from .trace_analysis import (BEFORE, GEMM_NAME, HELD_US, ForkTrace, Layout, Row, analyze,
                             layout_of)
from .trace_capture import (MAX_FILE_BYTES, WARM_REPLAYS, Forks, capture_graph,
                            forks_of_profile, forks_of_role, profile_replays, trace)
from .trace_dot import dot_neighbours
from .trace_events import (LOADER_PREFIX, MAX_US, Kernel, TraceError, kernel_events,
                           median_timeline, split_replays, timeline)
from .trace_render import MAX_ROWS, TraceResult

__all__ = ["BEFORE", "ForkTrace", "Forks", "GEMM_NAME", "HELD_US", "Kernel",
           "LOADER_PREFIX", "Layout", "MAX_FILE_BYTES", "MAX_ROWS", "MAX_US", "Row",
           "TraceError", "TraceResult", "WARM_REPLAYS", "analyze", "capture_graph",
           "dot_neighbours", "forks_of_profile", "forks_of_role", "kernel_events",
           "layout_of", "median_timeline", "profile_replays", "split_replays",
           "timeline", "trace"]
