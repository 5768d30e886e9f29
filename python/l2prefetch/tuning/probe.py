"""The probe: each discovered role's window and the most its loads could save.

Two extra graphs of the step are captured with timing events recorded inside them
(``torch.cuda.Event(external=True)``): in the first, events at each fork site and
around each consumer give the window from a fork to its consumer and the
consumer's cold time; in the second, each consumer's weights are loaded on the
main stream right before it, which gives its hot time.  The difference is the
most a prefetch of it can save.  A compiled step is probed in its eager module
tree (:func:`~l2prefetch.tuning.discovery.eager_stance`): an estimate that orders
the roles, not a measurement of the compiled code.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Optional

from .. import PreparedWeightRanges
from ..hooks import register_site_hook
from .arms import Probe
from .discovery import KINDS, Role, eager_stance

__all__ = ["PROBE_REPLAYS", "WindowProbe"]

logger = logging.getLogger("l2prefetch.tuning.measure")   # the measuring rig's messages

#: Replays of each probe graph (medians of the event intervals).
PROBE_REPLAYS = 20


class WindowProbe:
    """Probes ``model``'s roles in graphs of ``fn(batch)`` (the step as the rig captures
    it) captured by ``rig``; ``compiled``: the step runs in code torch.compile made."""

    def __init__(self, model: Any, rig: Any, fn: Callable[[int], Callable[[], Any]],
                 compiled: bool) -> None:
        import torch

        self.torch, self.model, self.rig, self.fn, self.compiled = torch, model, rig, fn, compiled

    def probe(self, batch: int, roles: Sequence[Role],
              caps_bytes: Sequence[int] = ()) -> Optional[dict[str, Probe]]:
        """Windows and cold-to-hot gaps of the discovered roles, counting each chain's
        reads up to the largest of ``caps_bytes``; None where events cannot be recorded
        in a capture or the probe fails (it is advisory: measuring goes on without it)."""
        torch = self.torch
        try:
            torch.cuda.Event(enable_timing=True, external=True)
        except TypeError:
            logger.info("torch %s cannot record timing events inside a graph capture: "
                        "windows and gaps are not probed", torch.__version__)
            return None
        discovered = [r for r in roles if r.kind in KINDS]
        if not discovered:
            return None
        try:
            with eager_stance() if self.compiled else contextlib.nullcontext():
                cold = self._graph(batch, discovered, hot=False)
                hot = self._graph(batch, discovered, hot=True)
        except Exception as exc:  # noqa: BLE001 - advisory
            logger.warning("probing windows at batch %d failed (%s: %s); measuring every role",
                           batch, type(exc).__name__, exc)
            return None
        return {role.name: self._role(role, cold, hot, max(caps_bytes, default=0))
                for role in discovered}

    def _role(self, role: Role, cold: dict, hot: dict, largest: int) -> Probe:
        def gap(read: str) -> float:
            if read in cold["dur"] and read in hot["dur"]:
                return cold["dur"][read] - hot["dur"][read]
            return 0.0

        windows, consumer_gap, chain_gap = [], 0.0, 0.0
        for site in role.sites:
            consumer = site.reads[0]
            start = cold["start"].get(consumer)
            at = cold["site"].get((site.site, site.hook))
            if start is not None and at is not None:
                windows.append(start - at)
            consumer_gap += gap(consumer)
            loaded = 0
            for read, nbytes in zip(site.reads, self._read_bytes(site)):
                if largest and loaded >= largest:
                    break
                chain_gap += gap(read)
                loaded += nbytes
        return Probe(statistics.fmean(windows) if windows else None, consumer_gap, chain_gap)

    def _read_bytes(self, site: Any) -> list[int]:
        """Bytes of each read of a site's chain (its weights grouped by module)."""
        sizes = []
        for path in site.reads:
            module = self.model.get_submodule(path)
            sizes.append(sum(p.numel() * p.element_size()
                             for p in module.parameters(recurse=False)))
        return sizes

    def _graph(self, batch: int, roles: Sequence[Role], hot: bool) -> dict[str, dict]:
        """One probe graph captured and replayed: per read its start and duration, per
        site its time (us from the step's start, medians over PROBE_REPLAYS)."""
        torch, model, device = self.torch, self.model, self.rig.device
        reads = sorted({read for role in roles for site in role.sites for read in site.reads})
        sites = sorted({(site.site, site.hook) for role in roles for site in role.sites})
        events: dict[tuple[str, Any], Any] = {}

        def event(kind: str, path: Any) -> Any:
            ev = events.get((kind, path))
            if ev is None:
                ev = events[(kind, path)] = torch.cuda.Event(enable_timing=True, external=True)
            return ev

        loaders = {}
        if hot:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            for path in reads:
                tensors = list(model.get_submodule(path).parameters(recurse=False))
                loaders[path] = PreparedWeightRanges(tensors, grid=sms, device=device.index)
        handles = []
        origin = torch.cuda.Event(enable_timing=True, external=True)
        try:
            for path in reads:
                module = model.get_submodule(path)

                def pre(module: Any, args: Any, path: str = path) -> None:
                    if hot:
                        loaders[path].launch()
                    event("start", path).record()

                def post(module: Any, args: Any, output: Any, path: str = path) -> None:
                    event("end", path).record()
                handles.append(module.register_forward_pre_hook(pre))
                handles.append(module.register_forward_hook(post))
            for path, hook in sites:
                module = model.get_submodule(path) if path else model

                def at(module: Any, *args: Any, path: str = path, hook: str = hook) -> None:
                    event("site", (path, hook)).record()
                handles.append(register_site_hook(module, hook, at))   # where attach forks
            inner = self.fn(batch)

            def fn() -> Any:
                origin.record()
                return inner()
            graph, _ = self.rig.capture(fn, warmup=1)
        finally:
            for handle in handles:
                handle.remove()
        return self._replayed(graph, events, origin)

    def _replayed(self, graph: Any, events: dict, origin: Any) -> dict[str, dict]:
        torch = self.torch
        samples: dict[tuple[str, Any], list[float]] = {key: [] for key in events}
        with torch.cuda.device(self.rig.device):
            for _ in range(PROBE_REPLAYS):
                graph.replay()
                torch.cuda.synchronize()
                for key, ev in events.items():
                    samples[key].append(origin.elapsed_time(ev) * 1e3)
        med = {key: statistics.median(v) for key, v in samples.items()}
        out: dict[str, dict] = {"start": {}, "site": {}, "dur": {}}
        for (kind, path), t in med.items():
            if kind == "start":
                out["start"][path] = t
                if ("end", path) in med:
                    out["dur"][path] = med[("end", path)] - t
            elif kind == "site":
                out["site"][path] = t
        return out
