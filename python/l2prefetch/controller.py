"""The controller as users see it: the C type, plus building it from a plan.

:class:`PrefetchController` subclasses the C type, so fork and join stay C
methods.  This module adds :meth:`PrefetchController.from_plan` and
:meth:`PrefetchController.from_profile`, refuses
pickling with a clear error, and logs at INFO (logger ``l2prefetch.controller``)
what was loaded the first time an enabled controller is built in the process
(the CUDA driver, NVRTC, the kernels compiled or read from the disk cache) and
a summary of each plan prepared.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Optional, Union

from . import _C
from .disable import disabled
from .mechanisms import DEFAULT_GRAPH_FORK
from .plan import GraphFork, KernelName, PlanEntry, check_plan, compact_batches, mib_by_batch

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["DeviceLike", "PrefetchController", "build_controller", "empty_controller",
           "fork_activation", "warms"]

logger = logging.getLogger(__name__)

#: What ``device=`` takes: None (torch's current device), an index, 'cuda' / 'cuda:N'
#: or a torch.device.
DeviceLike = Union[None, int, str, "torch.device"]

# Whether the driver and NVRTC were logged, and which kernel records were: each
# is logged once per process (only while INFO is enabled, so that building a
# controller with logging off loads nothing extra).
_log_lock = threading.Lock()
_runtime_logged = False
_kernels_logged: set = set()

# The C type's own __init__, if it has one (today it builds everything in __new__).
_BASE_INIT = _C.PrefetchController.__init__


def warms(controller: Any) -> bool:
    """Whether ``controller``'s fork takes ``activation=``: a PrefetchController whose
    fork is the C type's, or an override that accepts it (one with hooks.Controller's
    signature does not).  The hooks and ``ops.fork`` pass an activation only then."""
    if not isinstance(controller, _C.PrefetchController):
        return False
    cls = type(controller)
    found = _fork_takes_activation.get(cls)
    if found is None:   # once per class (ops.fork asks at every eager fork)
        try:
            params = inspect.signature(cls.fork).parameters.values()
        except (TypeError, ValueError):
            params = ()
        found = _fork_takes_activation[cls] = any(
            p.name == "activation" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
            or p.kind is p.VAR_KEYWORD for p in params)
    return found


#: warms()'s answer per controller class (weak: a class made at run time may go).
_fork_takes_activation: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fork_activation(device: int, value: Any) -> Any:
    """The tensor a fork on ``device`` may read last (a ``warm_activation`` table's
    extra range): ``value`` where it is memory of that CUDA device with storage of its
    own, else None (the fork loads the weights alone): a CPU tensor, another GPU's, or a
    wrapper tensor such as a DTensor or a nested tensor, whose data pointer is 0."""
    try:
        if value.device.type != "cuda" or value.device.index != device:
            return None
        return value if value.data_ptr() else None
    except (AttributeError, RuntimeError, NotImplementedError):   # no storage to point at
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _log_runtime() -> None:
    """At INFO, once per process: the CUDA driver and NVRTC in use (paths, versions)."""
    global _runtime_logged
    if _runtime_logged or not logger.isEnabledFor(logging.INFO):
        return
    with _log_lock:
        if _runtime_logged:
            return
        _runtime_logged = True
    try:
        driver = _C.driver_info()
    except Exception as exc:  # noqa: BLE001 - a log line, never a failure
        logger.info("CUDA driver: unavailable (%s)", _first_line(exc))
    else:
        version = driver.get("version")
        if isinstance(version, int):
            version = f"{version // 1000}.{version % 1000 // 10}"
        count = driver.get("device_count")
        logger.info("CUDA driver %s from %s (%s device%s)", version, driver.get("path"), count,
                    "" if count == 1 else "s")
    try:
        nvrtc = _C.nvrtc_info()
    except Exception as exc:  # noqa: BLE001
        logger.info("NVRTC: unavailable (%s); kernels can come only from the disk cache",
                    _first_line(exc))
    else:
        version = nvrtc.get("version")
        if isinstance(version, tuple):
            version = ".".join(str(part) for part in version)
        logger.info("NVRTC %s from %s", version, nvrtc.get("path"))


def _kernel_record(key: Any, record: Any) -> tuple[Any, str]:
    """(identity, text) of one record of ``_C.kernel_cache_info()``.

    A record is a mapping with the variant (``variant`` or ``name``), ``sm``,
    where the image came from (``source``, or a bool ``cache_hit``) and the
    time it took (``ms``); other forms are logged as they are.
    """
    if not isinstance(record, Mapping):
        return (key, repr(record)), f"{key}: {record!r}"
    name = record.get("variant", record.get("name", key))
    sm = record.get("sm")
    source = record.get("source")
    if source is None and "cache_hit" in record:
        source = "disk cache hit" if record["cache_hit"] else "compiled"
    ms = record.get("ms")
    text = f"{name}" + (f" for sm_{sm}" if sm is not None else "")
    text += f": {source}" if source is not None else ""
    text += f" in {ms:.1f} ms" if isinstance(ms, (int, float)) else ""
    known = {"variant", "name", "sm", "source", "cache_hit", "ms"}
    rest = {k: v for k, v in record.items() if k not in known}
    if rest:
        text += " (" + ", ".join(f"{k}={v}" for k, v in rest.items()) + ")"
    return (name, sm, source, ms), text


def _log_kernels() -> None:
    """At INFO: each kernel not logged yet, compiled or a disk-cache hit, and its time.

    Needs ``_C.kernel_cache_info()``; a build without it logs no kernels.
    """
    info_of = getattr(_C, "kernel_cache_info", None)
    if info_of is None or not logger.isEnabledFor(logging.INFO):
        return
    try:
        info = info_of()
    except Exception as exc:  # noqa: BLE001
        logger.debug("kernel_cache_info() failed: %s", _first_line(exc))
        return
    records = info.items() if isinstance(info, Mapping) else enumerate(info)
    for key, record in records:
        identity, text = _kernel_record(key, record)
        with _log_lock:
            if identity in _kernels_logged:
                continue
            _kernels_logged.add(identity)
        logger.info("kernel %s", text)


def _check_default_device(entries: list[PlanEntry], device: int) -> None:
    """Raise if an entry's weights are on another CUDA device than the defaulted one."""
    for i, entry in enumerate(entries):
        where = entry.weights[0].device  # PlanEntry: one device per entry
        if where.type == "cuda" and where.index is not None and where.index != device:
            raise ValueError(
                f"plan entry {i} ({entry.point!r}, layer {entry.layer}): the weights are on "
                f"cuda:{where.index}, but no device= was given and the controller defaulted "
                f"to cuda:{device} (torch's current device); pass device={where.index} to "
                "from_plan (or make that device current)")


def _add(controller: PrefetchController, index: int, entry: PlanEntry,
         ranges: _C.PreparedWeightRanges) -> None:
    """controller.add for one entry, with ``graph_fork=`` only where the entry sets it."""
    if entry.graph_fork is None:
        controller.add(entry.point, entry.layer, entry.batches, ranges)
        return
    try:
        controller.add(entry.point, entry.layer, entry.batches, ranges,  # type: ignore[call-arg]
                       graph_fork=entry.graph_fork)
    except TypeError as exc:
        if "keyword" not in str(exc):
            raise
        raise NotImplementedError(
            f"plan entry {index} ({entry.point!r}, layer {entry.layer}) sets "
            f"graph_fork={entry.graph_fork!r}, but this build's PrefetchController.add() "
            "takes no graph_fork (per-entry graph forks need a newer l2prefetch C "
            "extension); leave PlanEntry.graph_fork None and choose the mode for the "
            "whole controller with from_plan(graph_fork=...)") from exc


def _log_plan(controller: PrefetchController, entries: list[PlanEntry],
              tables: list[_C.PreparedWeightRanges]) -> None:
    """At INFO: entries, tables, points, kernels and bytes per decode step by batch."""
    if not logger.isEnabledFor(logging.INFO):
        return
    points: dict[str, int] = {}
    per_batch: dict[int, int] = {}
    own_modes: dict[str, int] = {}   # entries whose graph_fork is not the controller's
    for entry, ranges in zip(entries, tables):
        points[entry.point] = points.get(entry.point, 0) + 1
        if entry.graph_fork is not None and entry.graph_fork != controller.graph_fork:
            own_modes[entry.graph_fork] = own_modes.get(entry.graph_fork, 0) + 1
        for batch in entry.batches:
            per_batch[batch] = per_batch.get(batch, 0) + ranges.nbytes
    distinct = {id(ranges): ranges for ranges in tables}.values()
    kernels = sorted({ranges.kernel for ranges in distinct})
    logger.info(
        "from_plan: %d entries in %d tables on cuda:%d; points %s; kernels %s; "
        "graph_fork %r%s; MiB per decode step by batch (%s): %s",
        len(entries), len(distinct), controller.device,
        ", ".join(f"{p} ({n})" for p, n in points.items()) or "none",
        ", ".join(kernels) or "none", controller.graph_fork,
        "".join(f" ({mode!r} for {n} entr{'y' if n == 1 else 'ies'})"
                for mode, n in own_modes.items()),
        compact_batches(per_batch) or "none", mib_by_batch(per_batch) or "none")


class PrefetchController(_C.PrefetchController):
    """Prefetch launches per (point, layer, batch) on one side stream of one device.

    The hot methods (fork, join) are the C type's; this subclass adds
    :meth:`from_plan`, logging, and a clear refusal to be pickled or copied
    (a controller holds this process's CUDA stream, events and tables).
    """

    #: ``tuned_step``: how the step ran that this controller's profile was tuned on
    #: (:attr:`l2prefetch.profile.Profile.step`), set by :meth:`from_profile`; unset
    #: (None to ``getattr``) for a controller made otherwise.  Forks check it against
    #: how they run (:func:`l2prefetch.profile.check_step`).
    __slots__ = ("tuned_step",)

    if TYPE_CHECKING:  # the C type's signature, for type checkers
        def __init__(self, device: DeviceLike = None, *, graph_fork: GraphFork = "inline",
                     eager: bool = True) -> None: ...
    else:
        def __init__(self, *args, **kwargs):
            # The C type's __new__ parsed and checked the arguments; forward them to
            # its own __init__ where it has one.
            if _BASE_INIT is not object.__init__:
                _BASE_INIT(self, *args, **kwargs)
            if self.enabled:
                _log_runtime()

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(
            "a PrefetchController cannot be pickled or copied: it holds this process's CUDA "
            "stream, events and prepared tables; send the plan instead "
            "(l2prefetch.plan.plan_to_json) and build a controller where it is used "
            "(PrefetchController.from_plan)")

    def __reduce__(self) -> NoReturn:
        self.__reduce_ex__(0)

    @classmethod
    def from_plan(cls, plan: Iterable[PlanEntry], device: DeviceLike = None, *,
                  kernel: Optional[KernelName] = None, graph_fork: GraphFork = "inline",
                  eager: bool = True) -> PrefetchController:
        """Prepare and register every entry of plan.

        ``device``: where the controller runs (None: torch's current device;
        every entry's weights must be on it).  ``kernel``: the loader variant
        for entries whose ``kernel`` is None (None: the device's default).
        ``graph_fork`` and ``eager`` are the constructor's: how forks go into a
        CUDA graph being captured (:mod:`l2prefetch.mechanisms`: 'inline', the
        default, 'branch' or 'leaf'; an entry's own ``graph_fork`` overrides it for
        that entry), and whether
        forks outside a capture launch (False: they return False; a host-bound
        eager decode step only pays their host time).

        Entries with the same weights (by identity) and the same byte_cap,
        grid, carveout, priority, kernel and warm_activation share one
        PreparedWeightRanges.
        Two entries for one (point, layer, batch) are a ValueError (the
        controller would keep only the last).
        With L2PREFETCH_DISABLE set, nothing is prepared (no compile, no GPU
        work) and the controller's forks return False.
        """
        entries = _check_entries(plan)
        controller = cls(device, graph_fork=graph_fork, eager=eager)
        if not controller.enabled:
            logger.info("L2PREFETCH_DISABLE is set: %d plan entries not prepared", len(entries))
            return controller
        try:
            if device is None:
                _check_default_device(entries, controller.device)
            prepared: dict[tuple, _C.PreparedWeightRanges] = {}
            tables = []
            for i, entry in enumerate(entries):
                table_kernel = entry.kernel if entry.kernel is not None else kernel
                key = (*entry.settings[:5], table_kernel, entry.warm_activation)
                ranges = prepared.get(key)
                if ranges is None:
                    ranges = _C.PreparedWeightRanges(
                        entry.weights, byte_cap=entry.byte_cap, grid=entry.grid,
                        carveout=entry.carveout, priority=entry.priority, kernel=table_kernel,
                        device=controller.device, warm_activation=entry.warm_activation)
                    prepared[key] = ranges
                _add(controller, i, entry, ranges)
                tables.append(ranges)
        except BaseException:
            controller.close()
            raise
        _log_kernels()
        _log_plan(controller, entries, tables)
        return controller

    @classmethod
    def from_profile(cls, profile: Any, model: Any, device: DeviceLike = None, *,
                     eager: bool = False) -> PrefetchController:
        """A controller with a tuned profile's plan, for ``model`` at server start.

        ``profile`` is the path of a profile written by ``python -m l2prefetch
        tune`` (or :meth:`l2prefetch.tuning.TuneResult.save`), or one already
        read with :func:`l2prefetch.profile.load_profile` for this ``model``
        (one loaded for another model object, even of the same shapes, is
        refused: its plan holds that model's weights).  A profile tuned on
        another GPU than ``device`` (checked here for a loaded one too; not while
        L2PREFETCH_DISABLE makes the controller a disabled one, which prepares nothing
        and needs no driver) or another model is refused
        (:class:`~l2prefetch.tuning.ProfileMismatchError`, naming what
        differs).  ``eager=False`` by default: the tuner measured captured
        steps.  Attach the forks with ``hooks.attach(model, controller,
        profile.hook_points)``.  The controller records how the tuned step ran
        (:attr:`tuned_step`: eager, or compiled by torch.compile), and a fork that
        runs the other way and would launch (in a capture, with ``eager=False``)
        raises :class:`~l2prefetch.profile.StepMismatchError` (a fork in compiled
        code is the ``l2prefetch::fork`` op, an eager one is the hook's own call).
        """
        from .profile import Profile, load_profile

        if isinstance(profile, Profile):
            # The plan holds the tensors of the model it was loaded for, and the hooks
            # go on ``model``: they must be one model.
            profile.check_model(model)
        else:
            profile = load_profile(profile, model, device=device, check_device=False)
        # The device: checked before building (its mismatch is the error to see first)
        # unless prefetching is off, when nothing is prepared and no driver is needed;
        # and after building if the controller came up enabled all the same (the flag
        # changed in between): an enabled controller applies the plan only on its GPU.
        checked = not disabled()
        if checked:
            profile.check_device(device)
        controller = build_controller(profile.plan, device, eager=eager)
        try:
            if not isinstance(controller, cls):  # pragma: no cover - a subclass asked for it
                raise TypeError(f"from_profile builds a PrefetchController, not a "
                                f"{cls.__name__}")
            if controller.enabled and not checked:
                profile.check_device(device)
        except BaseException:
            controller.close()
            raise
        controller.tuned_step = profile.step
        return controller


def _check_entries(plan: object) -> list[PlanEntry]:
    """``plan`` as a list of PlanEntry (:func:`~l2prefetch.plan.check_plan`), with one
    entry per (point, layer, batch): add() replaces what a key holds, so an earlier entry
    would be lost."""
    entries = check_plan(plan)
    owner: dict[tuple, int] = {}   # (point, layer, batch) -> the entry that plans it
    for i, entry in enumerate(entries):
        for batch in entry.batches:
            key = (entry.point, entry.layer, batch)
            if key in owner:
                raise ValueError(f"plan[{owner[key]}] and plan[{i}] both prefetch at point "
                                 f"{entry.point!r}, layer {entry.layer}, batch {batch}: "
                                 "give each (point, layer, batch) one entry")
            owner[key] = i
    return entries


def empty_controller(plan: Iterable[Any], device: Any = None, *, kernel: Optional[str] = None,
                     graph_fork: str = DEFAULT_GRAPH_FORK, eager: bool = True) -> Any:
    """The control: ``plan``'s points, layers and batches with empty tables.

    Each entry keeps its grid, carveout, priority, kernel and graph_fork, so
    every fork launches the same (empty) kernel node as the plan's own.
    """
    plan = _check_entries(plan)
    controller = PrefetchController(device, graph_fork=graph_fork, eager=eager)
    try:
        _add_empty(controller, plan, kernel)
    except BaseException:
        controller.close()
        raise
    return controller


def _add_empty(controller: Any, plan: Iterable[PlanEntry], kernel: Optional[str] = None) -> None:
    """Register each entry of ``plan`` with an empty table of its launch settings."""
    tables: dict[tuple, Any] = {}
    for entry in plan:
        entry_kernel = entry.kernel or kernel
        key = (entry.grid, entry.carveout, entry.priority, entry_kernel)
        if key not in tables:
            tables[key] = _C.PreparedWeightRanges(
                [], grid=entry.grid, carveout=entry.carveout, priority=entry.priority,
                device=controller.device, kernel=entry_kernel)
        mode = entry.graph_fork
        if mode is None:
            controller.add(entry.point, entry.layer, entry.batches, tables[key])
        else:
            controller.add(entry.point, entry.layer, entry.batches, tables[key], graph_fork=mode)


def build_controller(plan: Sequence[Any], device: Any = None, *,
                     empty: Union[bool, Callable[[Any], bool]] = False,
                     eager: bool = False) -> Any:
    """A controller for ``plan``.

    ``empty``: False (every entry loads), True (the control: the same forks with
    empty tables), or a function of an entry saying whether that entry's forks
    launch an empty table (the others load): the tuner's per-layer arms, whose
    forks are those of the whole plan.
    When every entry forks the same way into a captured graph, that mode is
    the controller's and the entries carry none (so this works with any C
    build); a plan that mixes modes sets the mode per entry.
    ``eager=False`` by default: a tuned plan is measured and deployed in
    captured decode steps.
    """
    if not isinstance(empty, bool) and not callable(empty):
        raise TypeError(f"empty must be a bool or a function of a plan entry returning one, "
                        f"got {type(empty).__name__}")
    plan = check_plan(plan)   # a list: read below more than once (its keys are checked
    # by the controller built from it, or before the split below)
    modes = {entry.graph_fork or DEFAULT_GRAPH_FORK for entry in plan}
    mode = DEFAULT_GRAPH_FORK
    if len(modes) == 1:
        mode = modes.pop()
        plan = [dataclasses.replace(entry, graph_fork=None)
                if entry.graph_fork is not None else entry for entry in plan]
    if empty is True:
        return empty_controller(plan, device, graph_fork=mode, eager=eager)
    if empty is False:
        return PrefetchController.from_plan(plan, device, graph_fork=mode, eager=eager)
    _check_entries(plan)   # before the split: an emptied entry must not replace a loaded one
    emptied = [bool(empty(entry)) for entry in plan]
    controller = PrefetchController.from_plan(
        [entry for entry, e in zip(plan, emptied) if not e], device, graph_fork=mode, eager=eager)
    if controller.enabled:
        try:
            _add_empty(controller, [entry for entry, e in zip(plan, emptied) if e])
        except BaseException:
            controller.close()
            raise
    return controller
