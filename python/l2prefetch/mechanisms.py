"""The ways a fork goes into a CUDA graph being captured, and where a hook puts it, named once.

A controller's ``graph_fork`` (and a plan entry's, and the tuner's
``graph_forks``) is one of these modes.  The C controller implements them
(csrc/controller.c ``graph_fork_names``, csrc/capture.c); everything in Python
that lists, checks, describes or defaults a mode takes it from here:
:mod:`l2prefetch.plan` (``GRAPH_FORKS``, ``PlanEntry.graph_fork``), the tuner's
sweep and its measurement backend, ``trace --mode``, the benchmarks.
tests/test_mechanisms.py checks that the C controller accepts exactly these
names, that an unknown one's error lists them, and that each mode's
``needs_join`` and ``switchable`` are what the C side does.

Adding a mode is its entry here (and its name in ``GraphFork``), its C side
(controller.c's enum and ``graph_fork_names``, the fork in capture.c) and its
case in tests/test_mechanisms.py; the tuner then sweeps it.  See
python/l2prefetch/DESIGN.md.

Where a fork's hook runs relative to its module is a *site hook*
(:data:`SITE_HOOKS`): ``"after"`` (a forward hook, the default) or ``"before"``
(a forward pre-hook).  :mod:`l2prefetch.hooks` implements them; a site
``(module, layer, hook)``, a profile entry's ``hook`` and the tuner's
discovered ``before`` roles name them from here.

Importing this module imports nothing else (neither torch nor the C extension).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Literal

__all__ = ["DEFAULT_GRAPH_FORK", "DEFAULT_SITE_HOOK", "GRAPH_FORKS", "GRAPH_FORK_MODES",
           "GraphFork", "GraphForkMode", "SITE_HOOKS", "SiteHook", "graph_fork_choices",
           "site_entry", "site_hook_choices"]


@dataclasses.dataclass(frozen=True)
class GraphForkMode:
    """One way a fork goes into a captured graph.

    ``needs_join``: a fork in this mode leaves the side stream forked into the
    capture, so ``join()`` must be captured before the capture ends (the
    controller raises at the next fork otherwise).  ``switchable``: its loader
    nodes are kernel nodes of the captured graph that csrc/graph.c can switch in
    place (on, empty, off, other tables), so the tuner measures its loads and its
    empty forks paired, inside the same graph instances.
    """

    name: str
    description: str
    needs_join: bool
    switchable: bool


#: GraphForkMode by name, in the C controller's order (csrc/controller.c).
GRAPH_FORK_MODES: Mapping[str, GraphForkMode] = types.MappingProxyType({mode.name: mode for mode in (
    GraphForkMode("inline", "the loader on the captured stream, a programmatic dependent of "
                  "the kernel before it, with launch-order edges: the next node waits for its "
                  "launch, not its end (NOTE [inline graph fork])",
                  needs_join=False, switchable=True),
    GraphForkMode("branch", "the loader on the side stream, as in eager mode: a side branch "
                  "of the graph, joined where join() is captured",
                  needs_join=True, switchable=True),
    GraphForkMode("leaf", "the loader a sink of the graph after the fork's node, chained to "
                  "the capture's previous leaf: nothing waits for it (NOTE [leaf graph fork])",
                  needs_join=False, switchable=True),
)})
#: The mode names, for type checkers (tests/test_mechanisms.py: the same as the registry's).
GraphFork = Literal["inline", "branch", "leaf"]
#: The mode names, in order.
GRAPH_FORKS: tuple[str, ...] = tuple(GRAPH_FORK_MODES)
#: The controller's default mode (``PrefetchController(graph_fork=...)``).
DEFAULT_GRAPH_FORK = "inline"


def _choices(names: tuple[str, ...]) -> str:
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + f" or {quoted[-1]}"


def graph_fork_choices() -> str:
    """The mode names as a message lists them: ``'inline', 'branch' or 'leaf'``."""
    return _choices(GRAPH_FORKS)


#: Where a site's hook runs, by name: its description (l2prefetch.hooks implements them).
SITE_HOOKS: Mapping[str, str] = types.MappingProxyType({
    "after": "a forward hook, ahead of the module's other forward hooks: the fork follows "
             "the kernels the module's forward queued and precedes those its hooks queue "
             "(RESULTS run 21)",
    "before": "a forward pre-hook, ahead of the module's other pre-hooks: the fork precedes "
              "the module's kernels and those its other pre-hooks queue, so an inline "
              "fork's loader runs beside the first of them (RESULTS run 20)",
})
#: The site hook names, for type checkers (tests/test_mechanisms.py: the registry's).
SiteHook = Literal["after", "before"]
#: The hook of a site that names none: ``(module, layer)``.
DEFAULT_SITE_HOOK = "after"


def site_hook_choices() -> str:
    """The site hook names as a message lists them: ``'after' or 'before'``."""
    return _choices(tuple(SITE_HOOKS))


def site_entry(where: object, layer: int, hook: str) -> tuple:
    """A fork site as sites are listed (``hooks.attach``'s points, ``Profile.sites``,
    ``TuneResult.sites``): ``(where, layer)``, with ``hook`` third only where it is not
    :data:`DEFAULT_SITE_HOOK`; ``where`` is a module or its path."""
    return (where, layer) if hook == DEFAULT_SITE_HOOK else (where, layer, hook)
