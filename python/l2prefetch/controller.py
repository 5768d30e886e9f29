"""The controller as users see it: the C type plus building it from a plan."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from . import _C
from .plan import PlanEntry

logger = logging.getLogger("l2prefetch")


class PrefetchController(_C.PrefetchController):
    """Prefetch launches per (point, layer, batch) on one side stream of one device.

    The hot methods (fork, join) are the C type's; this subclass adds only
    :meth:`from_plan`.
    """

    __slots__ = ()

    @classmethod
    def from_plan(cls, plan: Iterable[PlanEntry], device=None, *, kernel: str | None = None,
                  graph_fork: str = "inline", eager: bool = True) -> "PrefetchController":
        """Prepare and register every entry of plan.

        ``graph_fork`` and ``eager`` are the constructor's: how forks go into a
        CUDA graph being captured ('inline', the default, or 'branch'), and
        whether forks outside a capture launch (False: they return False; a
        host-bound eager decode step only pays their host time).

        Entries with the same weights (by identity) and the same byte_cap,
        grid, carveout and priority share one PreparedWeightRanges.  With
        L2PREFETCH_DISABLE set, nothing is prepared (no compile, no GPU work)
        and the controller's forks return False.
        """
        entries = list(plan)
        for i, entry in enumerate(entries):
            if not isinstance(entry, PlanEntry):
                raise TypeError(f"plan[{i}] must be a PlanEntry, not {type(entry).__name__}")
        controller = cls(device, graph_fork=graph_fork, eager=eager)
        if not controller.enabled:
            logger.info("L2PREFETCH_DISABLE is set: %d plan entries not prepared", len(entries))
            return controller
        prepared: dict[tuple, _C.PreparedWeightRanges] = {}
        for entry in entries:
            ranges = prepared.get(entry.settings)
            if ranges is None:
                ranges = _C.PreparedWeightRanges(
                    entry.weights, byte_cap=entry.byte_cap, grid=entry.grid,
                    carveout=entry.carveout, priority=entry.priority, kernel=kernel,
                    device=controller.device)
                prepared[entry.settings] = ranges
            controller.add(entry.point, entry.layer, entry.batches, ranges)
        logger.debug("prepared %d tables for %d plan entries on cuda:%d", len(prepared),
                     len(entries), controller.device)
        return controller
