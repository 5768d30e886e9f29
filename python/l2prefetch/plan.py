"""Prefetch plans as plain data: what to prefetch where, for which batches.

A plan is a list of :class:`PlanEntry`.  Each entry says: at fork point
``point`` of decoder layer ``layer``, for each decode batch in ``batches``,
prefetch the byte ranges of ``weights`` (in order, capped at ``byte_cap``
bytes when it is not 0) with a loader of ``grid`` CTAs, an optional
shared-memory ``carveout``, when ``priority`` is true the greatest stream
priority, the loader ``kernel`` variant (None: the device's default) and, in a
CUDA graph being captured, the ``graph_fork`` mode (None: the controller's), and
whether an eager fork also reads its site's activation last (``warm_activation``).
Policies (:mod:`l2prefetch.kimi_k3`, :mod:`l2prefetch.deepseek_v3`)
build plans; the controller turns each entry into one prepared range table and
launches it from ``fork(point, layer, batch)``.

This module also renders a plan for people (:func:`format_plan`) and stores it
as JSON with weights named by their module path, never by pointer
(:func:`plan_to_json`, :func:`plan_from_json`), so a plan survives a restart
and can be reviewed or edited by hand.

Importing this module imports no torch: a plan can only hold tensors if torch
is already imported, so the type check looks torch up in ``sys.modules``.  The
C extension, which ``import l2prefetch`` loads anyway (without touching the
driver), checks kernel names against ``l2prefetch.kernel_variants()`` and
counts an entry's bytes.  Weights are named by their paths in the model
through :mod:`l2prefetch.model_paths`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import itertools
import numbers
import reprlib
import sys
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from . import _C
from ._files import loads_json
# How a fork goes into a CUDA graph being captured: the modes are named in mechanisms.py.
from .mechanisms import GRAPH_FORKS, GraphFork, graph_fork_choices
from .model_paths import named_tensors, tensor_paths

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "CapSpec",
    "DEFAULT_L2_BYTES",
    "GRAPH_FORKS",
    "GraphFork",
    "KernelName",
    "MAX_BATCH",
    "MAX_LAYER",
    "MIN_BYTE_CAP",
    "PLAN_JSON_VERSION",
    "PlanEntry",
    "cap_groups",
    "check_batches",
    "check_plan",
    "check_settings",
    "compact_batches",
    "format_plan",
    "gate",
    "mib_by_batch",
    "GATE_BYTES_PER_US",
    "GATE_MIN_BYTES",
    "plan_from_json",
    "plan_to_json",
    "select_points",
    "shown",
]

#: The H200's L2 (60 MiB): the default for "share of L2".
DEFAULT_L2_BYTES = 60 * 2**20
#: The version plan_to_json writes; plan_from_json reads this one and version 1
#: (written before entries had ``kernel`` and ``graph_fork``).
PLAN_JSON_VERSION = 2
#: The largest layer index and batch the controller's table takes (csrc/controller.c,
#: MAX_LAYER and MAX_BATCH).
MAX_LAYER = 65535
MAX_BATCH = 65535
MIB = 2**20
#: The smallest byte cap that loads anything: a capped range is cut down to a
#: multiple of 16 bytes and none is made from fewer (compute_ranges' rule).
MIN_BYTE_CAP = 16

#: A per-batch cap of a capped point: the cap in MiB, or (cap in MiB, carveout).
CapSpec = Union[int, tuple[int, Optional[int]]]


#: The loader kernel variants, as ``l2prefetch.kernel_variants()`` names them
#: (tests/test_plan.py checks that the two lists agree).
KernelName = Literal["ring", "bulk_prefetch", "line_prefetch", "load"]

# The fields of an entry in each plan JSON version.
_JSON_FIELDS: dict[int, tuple[str, ...]] = {
    1: ("point", "layer", "batches", "weights", "byte_cap", "grid", "carveout", "priority"),
}
_JSON_FIELDS[2] = (*_JSON_FIELDS[1], "kernel", "graph_fork", "warm_activation")


def _tensor_type() -> type | None:
    """torch.Tensor if torch is imported; None means nothing can be a tensor yet."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.Tensor


class _Shown(reprlib.Repr):
    """reprlib's shortened repr, with an int past 160 bits (its repr may pass CPython's
    4300-digit limit) named by its size and sign, as csrc's ``l2p_shown`` names it."""

    def repr1(self, x: Any, level: int) -> str:
        if isinstance(x, int) and not isinstance(x, bool):
            bits = int.bit_length(x)   # int's own: an int subclass's methods do not run
            if bits > 4 * self.maxlong:
                return f"<{'a negative' if int.__lt__(x, 0) else 'an'} int of {bits} bits>"
        return super().repr1(x, level)


_SHOWN = _Shown()
_SHOWN.maxstring = _SHOWN.maxother = 200   # module paths are long; whole values are not
_SHOWN.maxlong = 40


def shown(value: object) -> str:
    """A value for a message: its repr, shortened (a list of 65535 batches, an int of
    5000 digits, a field of megabytes)."""
    return _SHOWN.repr(value)


def _check_int(field: str, value: object, low: int, high: int | None = None) -> int:
    """Return value if it is an int (not a bool) in [low, high]; raise otherwise."""
    allowed = f"an int >= {low}" if high is None else f"an int in {low}..{high}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"PlanEntry.{field} must be {allowed}, "
                        f"got {type(value).__name__} {shown(value)}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"PlanEntry.{field} must be {allowed}, got {shown(value)}")
    return value


def check_batches(value: object, name: str = "PlanEntry.batches", *,
                   allow_empty: bool = False) -> tuple[int, ...]:
    """``value`` as decode batches, in the order given: an iterable (not a str) of
    distinct ints (not bools) in 1..MAX_BATCH, at least one unless ``allow_empty``;
    messages call it ``name``.  The one check of a list of batches: PlanEntry's, the
    policies' and tune()'s."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an iterable of decode batches (ints >= 1), e.g. "
                        f"range(1, 9), got {type(value).__name__} {shown(value)}")
    if isinstance(value, Mapping):   # a cap table passed for its batches, say
        raise TypeError(f"{name} must be an iterable of decode batches, got "
                        f"{type(value).__name__} {shown(value)}, a mapping (it iterates its "
                        "keys): pass its keys, list(mapping), if they are the batches")
    # read one past the most there can be: an endless iterator is refused, not stored
    batches = tuple(itertools.islice(value, MAX_BATCH + 1))
    if not batches and not allow_empty:
        raise ValueError(f"{name} must name at least one batch, got none")
    for batch in batches:
        if isinstance(batch, bool) or not isinstance(batch, numbers.Integral):
            raise TypeError(f"{name} must hold ints >= 1, got {type(batch).__name__} "
                            f"{shown(batch)} in {shown(batches)}")
        if batch < 1:
            raise ValueError(f"{name} must hold ints >= 1, got {shown(batch)} in "
                             f"{shown(batches)}")
        if batch > MAX_BATCH:
            raise ValueError(f"{name} must hold batches of at most {MAX_BATCH} (the "
                             f"controller's limit), got {shown(batch)}")
    batches = tuple(int(batch) for batch in batches)
    if len(set(batches)) != len(batches):
        counts = Counter(batches)
        repeated = sorted(b for b, n in counts.items() if n > 1)
        raise ValueError(f"{name} must name each batch once, {shown(repeated)} repeat "
                         f"in {shown(batches)}")
    return batches


def _describe(tensor: Any) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')} on {tensor.device}"


def _check_weights(value: object) -> tuple[Any, ...]:
    tensor = _tensor_type()
    if tensor is not None and isinstance(value, tensor):
        raise TypeError("PlanEntry.weights must be a sequence of tensors, not one tensor "
                        f"({_describe(value)}): wrap it as (tensor,)")
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError("PlanEntry.weights must be a sequence of tensors, "
                        f"got {type(value).__name__} {value!r}")
    if isinstance(value, (AbstractSet, Mapping)):
        # The loader reads the weights in order and a cap cuts the last ones:
        # an unordered collection would make both depend on hashing.
        kind = "a set" if isinstance(value, AbstractSet) else "a mapping (it iterates its keys)"
        raise TypeError(f"PlanEntry.weights must be an ordered sequence of tensors, got "
                        f"{type(value).__name__}, {kind}; pass a list or tuple in the order "
                        "the kernels read them")
    weights = tuple(value)
    if not weights:
        raise ValueError("PlanEntry.weights must hold at least one tensor, got none")
    first: dict[int, int] = {}   # id(tensor) -> its first index
    for i, weight in enumerate(weights):
        if tensor is None or not isinstance(weight, tensor):
            raise TypeError(f"PlanEntry.weights[{i}] must be a torch.Tensor, "
                            f"got {type(weight).__name__}")
        j = first.setdefault(id(weight), i)
        if j != i:   # its bytes would be counted and loaded twice, and no plan JSON holds it
            raise ValueError(f"PlanEntry.weights[{i}] is weights[{j}] again ({_describe(weight)}"
                             "; a tied weight reached by two names is one tensor): list each "
                             "tensor once")
    devices = {w.device for w in weights}
    if len(devices) > 1:
        listed = ", ".join(f"[{i}] {_describe(w)}" for i, w in enumerate(weights))
        raise ValueError("PlanEntry.weights must all be on one device (one range table per "
                         f"entry), got {listed}")
    return weights


def _check_kernel(value: object) -> None:
    if not isinstance(value, str):
        raise TypeError("PlanEntry.kernel must be a kernel variant name (str) or None (the "
                        f"device's default), got {type(value).__name__} {value!r}")
    known = sorted(_C.kernel_variants())
    if value not in known:
        raise ValueError(f"PlanEntry.kernel {value!r} is not a kernel variant; known: "
                         f"{', '.join(known)} (or None for the device's default)")


def _check_graph_fork(value: object) -> None:
    known = graph_fork_choices()
    if not isinstance(value, str):
        raise TypeError(f"PlanEntry.graph_fork must be {known}, or None (the controller's "
                        f"mode), got {type(value).__name__} {value!r}")
    if value not in GRAPH_FORKS:
        raise ValueError(f"PlanEntry.graph_fork must be {known}, or None (the controller's "
                         f"mode), got {value!r}")


def check_settings(byte_cap: object = 0, grid: object = 32, carveout: object = None,
                   priority: object = False, kernel: object = None, graph_fork: object = None,
                   warm_activation: object = False) -> None:
    """A plan entry's settings, the fields after its weights, with PlanEntry's defaults:
    the one check of them, for :class:`PlanEntry` and for a profile's entries before a
    model is built (:func:`l2prefetch.profile.parse_profile`).  TypeError for a wrong
    type, ValueError for a bad value, each naming the field."""
    _check_int("byte_cap", byte_cap, 0)
    if byte_cap >= 2**63:  # what PreparedWeightRanges can take
        raise ValueError(f"PlanEntry.byte_cap must be an int >= 0 below 2**63, "
                         f"got {shown(byte_cap)}")
    if 0 < byte_cap < MIN_BYTE_CAP:
        raise ValueError(f"PlanEntry.byte_cap must be 0 (no cap) or at least "
                         f"{MIN_BYTE_CAP} bytes (ranges are cut to 16-byte units, so a "
                         f"smaller cap loads nothing), got {byte_cap}")
    _check_int("grid", grid, 1, 65535)
    if carveout is not None:
        _check_int("carveout", carveout, -1, 100)
    if not isinstance(priority, bool):
        raise TypeError("PlanEntry.priority must be a bool, "
                        f"got {type(priority).__name__} {priority!r}")
    if kernel is not None:
        _check_kernel(kernel)
    if graph_fork is not None:
        _check_graph_fork(graph_fork)
    if not isinstance(warm_activation, bool):
        raise TypeError("PlanEntry.warm_activation must be a bool, "
                        f"got {type(warm_activation).__name__} "
                        f"{warm_activation!r}")


@dataclasses.dataclass(frozen=True, eq=False, repr=False, slots=True)
class PlanEntry:
    """One prefetch: at ``point`` of ``layer``, for each of ``batches``, load ``weights``.

    ``batches`` becomes a sorted tuple of distinct ints in 1..65535 and
    ``weights`` a tuple of tensors in the order given (all on one device, since
    the controller builds one range table per entry).  ``layer`` is in
    0..65535.  ``byte_cap`` is in bytes (0: no cap, else at least 16: a smaller
    cap would load nothing); ``grid`` is the number of
    loader CTAs; ``carveout`` is the preferred shared-memory carveout in
    percent (-1 is the driver's default, None sets no attribute); ``priority``
    asks for the greatest stream priority.  ``kernel`` names the loader
    variant (one of ``l2prefetch.kernel_variants()``; None: the device's
    default, or ``from_plan(kernel=...)``).  ``graph_fork`` says how this
    entry's forks go into a CUDA graph being captured (one of :data:`GRAPH_FORKS`,
    the modes of :mod:`l2prefetch.mechanisms`; None: the controller's
    ``graph_fork``).  ``warm_activation`` makes each eager fork end its loads by
    reading the tensor its hook sees (the module's input before it, its output
    after it), which the next kernel reads first and the loads would otherwise
    evict (benchmarks/RESULTS.md, run 36); a fork inside ``torch.compile``'d code
    does not see that tensor and loads the weights alone.  Wrong types raise
    TypeError, bad values ValueError, both naming the field.

    Entries compare and hash by value, with weights by identity (two entries
    are equal when they would prefetch the same tensor objects the same way).
    """

    point: str
    layer: int
    batches: Sequence[int]
    weights: Sequence[torch.Tensor]
    byte_cap: int = 0
    grid: int = 32
    carveout: Optional[int] = None
    priority: bool = False
    kernel: Optional[KernelName] = None
    graph_fork: Optional[GraphFork] = None
    warm_activation: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.point, str):
            raise TypeError("PlanEntry.point must be a non-empty str, "
                            f"got {type(self.point).__name__} {self.point!r}")
        if not self.point:
            raise ValueError("PlanEntry.point must be a non-empty str, got ''")
        _check_int("layer", self.layer, 0)
        if self.layer > MAX_LAYER:
            raise ValueError(f"PlanEntry.layer must be at most {MAX_LAYER} (the controller's "
                             f"limit), got {shown(self.layer)}")
        object.__setattr__(self, "batches", tuple(sorted(check_batches(self.batches))))
        object.__setattr__(self, "weights", _check_weights(self.weights))
        check_settings(self.byte_cap, self.grid, self.carveout, self.priority, self.kernel,
                       self.graph_fork, self.warm_activation)

    @property
    def nbytes(self) -> int:
        """Bytes this entry prefetches: the sum of its ranges (``compute_ranges``' rules).

        Needs the C extension (``l2prefetch._C.compute_ranges``), which works
        on CPU and meta tensors as well as CUDA ones.
        """
        return sum(n for _, n in _C.compute_ranges(self.weights, self.byte_cap))

    @property
    def settings(self) -> tuple[tuple[int, ...], int, int, Optional[int], bool, Optional[str],
                                bool]:
        """What fixes the prepared table: (weight ids, byte_cap, grid, carveout, priority,
        kernel, warm_activation).

        Entries with equal settings can share one prepared table (the ids
        stay valid while an entry holds its weights).  ``graph_fork`` is not
        among them: it is how the controller forks, not part of the table.
        """
        return (tuple(id(w) for w in self.weights), self.byte_cap, self.grid, self.carveout,
                self.priority, self.kernel, self.warm_activation)

    def _key(self) -> tuple:
        return (self.point, self.layer, self.batches, *self.settings, self.graph_fork)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PlanEntry):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        # Never print tensor contents: on a GPU that would synchronise and copy.
        weights = ", ".join(_describe(w) for w in self.weights)
        optional = "".join(f", {name}={value!r}" for name, value in
                           (("kernel", self.kernel), ("graph_fork", self.graph_fork),
                            ("warm_activation", self.warm_activation or None))
                           if value is not None)
        return (f"PlanEntry(point={self.point!r}, layer={self.layer}, "
                f"batches={compact_batches(self.batches)}, weights=[{weights}], "
                f"byte_cap={self.byte_cap}, grid={self.grid}, carveout={self.carveout}, "
                f"priority={self.priority}{optional})")


def select_points(points: object, known: tuple[str, ...],
                  default: Iterable[str]) -> frozenset:
    """The policy points a plan is asked for: ``default`` when ``points`` is None.

    Raises TypeError for a ``points`` that is a str or not a collection,
    ValueError for a name not in ``known``.
    """
    if points is None:
        return frozenset(default)
    if isinstance(points, str) or not isinstance(points, Collection):
        raise TypeError(f"points must be a collection of point names from {known}, "
                        f"got {type(points).__name__} {points!r}")
    unknown = [p for p in points if p not in known]
    if unknown:
        raise ValueError(f"unknown point(s) {unknown!r}: points must be names from {known}")
    return frozenset(points)


def check_plan(plan: object, name: str = "plan") -> list[PlanEntry]:
    """``plan`` as a list of :class:`PlanEntry`, read once (a generator is used up here,
    so a caller that reads it twice reads this list); TypeError naming ``name`` for
    anything else.  The one check of a whole plan: its formatters' and controllers'."""
    if isinstance(plan, PlanEntry):
        raise TypeError(f"{name} must be an iterable of PlanEntry, got one PlanEntry: wrap "
                        "it as [entry]")
    if isinstance(plan, (str, bytes, Mapping)) or not isinstance(plan, Iterable):
        raise TypeError(f"{name} must be an iterable of PlanEntry (a list), got "
                        f"{type(plan).__name__} {shown(plan)}")
    entries = list(plan)
    for i, entry in enumerate(entries):
        if not isinstance(entry, PlanEntry):
            raise TypeError(f"{name}[{i}] must be a PlanEntry, not {type(entry).__name__}")
    return entries


def cap_groups(table: Mapping[int, CapSpec]) -> list[tuple[int, Optional[int], tuple[int, ...]]]:
    """Group a per-batch cap table into ``(cap_mib, carveout, batches)``.

    ``table`` maps a batch to its cap in MiB, or to ``(cap_mib, carveout)``.
    Batches with equal (cap, carveout) share one group (so one prepared
    table); groups come in the order their first batch appears in ``table``
    and batches keep the table's order.  A zero cap means no prefetch and
    yields no group.
    """
    if not isinstance(table, Mapping):
        raise TypeError(f"the cap table must map batches to caps in MiB, e.g. {{1: 24, 8: 16}}, "
                        f"got {type(table).__name__} {shown(table)}")
    groups: dict[tuple[int, Optional[int]], list[int]] = {}
    for batch, spec in table.items():
        if isinstance(batch, bool) or not isinstance(batch, int):
            raise TypeError(f"cap table batches must be ints >= 1, got {batch!r}")
        if batch < 1:
            raise ValueError(f"cap table batches must be ints >= 1, got {batch}")
        if isinstance(spec, tuple):
            if len(spec) != 2:
                raise ValueError(f"cap table entry for batch {batch} must be cap_mib or "
                                 f"(cap_mib, carveout), got {spec!r}")
            cap, carveout = spec
        else:
            cap, carveout = spec, None
        if isinstance(cap, bool) or not isinstance(cap, int):
            raise TypeError(f"cap table entry for batch {batch}: cap must be an int >= 0 "
                            f"(MiB), got {cap!r}")
        if cap < 0:
            raise ValueError(f"cap table entry for batch {batch}: cap must be an int >= 0 "
                             f"(MiB), got {cap}")
        if carveout is not None and (isinstance(carveout, bool) or not isinstance(carveout, int)):
            raise TypeError(f"cap table entry for batch {batch}: carveout must be None or an "
                            f"int, got {carveout!r}")
        if cap:
            groups.setdefault((cap, carveout), []).append(batch)
    return [(cap, carveout, tuple(batches)) for (cap, carveout), batches in groups.items()]


def compact_batches(batches: Iterable[int]) -> str:
    """Batches as runs: ``(3, 4, 5, 6, 7, 8)`` -> ``'3-8'``, ``(1, 2, 5)`` -> ``'1-2,5'``."""
    runs: list[list[int]] = []
    for batch in sorted(set(batches)):
        if runs and batch == runs[-1][1] + 1:
            runs[-1][1] = batch
        else:
            runs.append([batch, batch])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def mib_by_batch(totals: Mapping[int, int]) -> str:
    """Bytes per batch as MiB, runs of equal totals joined: ``{1: x, 2: x, 3: y}`` ->
    ``'1-2: x; 3: y'`` (x and y in MiB, two decimals)."""
    parts: list[tuple[list[int], int]] = []
    for batch in sorted(totals):
        value = totals[batch]
        if parts and parts[-1][1] == value and parts[-1][0][-1] == batch - 1:
            parts[-1][0].append(batch)
        else:
            parts.append(([batch], value))
    return "; ".join(f"{compact_batches(b)}: {v / MIB:.2f}" for b, v in parts)


def format_plan(plan: Iterable[PlanEntry], l2_bytes: int | None = None) -> str:
    """A plan as two Markdown tables: one row per entry, then totals per point.

    Entry rows: point, layer, batches (as runs), tensors, MiB prefetched and
    that as a share of L2 (``l2_bytes``, default the H200's 60 MiB), then a
    ``kernel`` and a ``graph fork`` column where some entry sets one
    (``default`` and ``controller`` for the entries that do not).  Totals:
    per point the entries, the layers, and the MiB prefetched per decode step
    at each batch (entries for other batches do not fire, so this sums only
    the entries that hold the batch), plus the largest entry's share of L2.
    A last ``all`` row sums the points.  Needs ``l2prefetch._C`` (for
    :attr:`PlanEntry.nbytes`).
    """
    plan = check_plan(plan)
    l2 = DEFAULT_L2_BYTES if l2_bytes is None else l2_bytes
    if isinstance(l2, bool) or not isinstance(l2, int) or not 0 < l2 < 2**63:
        raise ValueError(f"l2_bytes must be a positive int (bytes) below 2**63, or None, got "
                         f"{shown(l2_bytes)}")
    sizes = [entry.nbytes for entry in plan]
    # Columns for the per-entry settings, only where some entry sets them.
    extra = [(title, field, unset) for title, field, unset in
             (("kernel", "kernel", "default"), ("graph fork", "graph_fork", "controller"),
              ("warm activation", "warm_activation", "no"))
             if any(getattr(entry, field) not in (None, False) for entry in plan)]
    whose = " (an H200's)" if l2_bytes is None else ""
    lines = [f"L2 prefetch plan: {len(plan)} entries; share of L2 against {l2 / MIB:.2f} MiB"
             f"{whose}",
             "",
             "| point | layer | batches | tensors | MiB | % of L2 |"
             + "".join(f" {title} |" for title, _, _ in extra),
             "|---|---:|---|---:|---:|---:|" + "---|" * len(extra)]
    for entry, size in zip(plan, sizes):
        cells = "".join(f" {_cell(getattr(entry, field), unset)} |" for _, field, unset in extra)
        lines.append(f"| {entry.point} | {entry.layer} | {compact_batches(entry.batches)} | "
                     f"{len(entry.weights)} | {size / MIB:.2f} | {100 * size / l2:.1f}% |"
                     + cells)

    points: dict[str, list[tuple[PlanEntry, int]]] = {}
    for entry, size in zip(plan, sizes):
        points.setdefault(entry.point, []).append((entry, size))
    lines += ["",
              "| point | entries | layers | batches | MiB per step, by batch | largest, % of L2 |",
              "|---|---:|---:|---|---|---:|"]
    everything: dict[int, int] = {}
    for point, rows in points.items():
        per_batch: dict[int, int] = {}
        for entry, size in rows:
            for batch in entry.batches:
                per_batch[batch] = per_batch.get(batch, 0) + size
                everything[batch] = everything.get(batch, 0) + size
        layers = len({entry.layer for entry, _ in rows})
        largest = max(size for _, size in rows)
        lines.append(f"| {point} | {len(rows)} | {layers} | {compact_batches(per_batch)} | "
                     f"{mib_by_batch(per_batch)} | {100 * largest / l2:.1f}% |")
    if plan:
        largest = max(sizes)
        lines.append(f"| all | {len(plan)} | {len({e.layer for e in plan})} | "
                     f"{compact_batches(everything)} | {mib_by_batch(everything)} | "
                     f"{100 * largest / l2:.1f}% |")
    return "\n".join(lines) + "\n"


def _cell(value: object, unset: str) -> str:
    return "yes" if value is True else str(value or unset)


def plan_to_json(plan: Iterable[PlanEntry], model: Any) -> str:
    """The plan as JSON, each weight named by its path in ``model``.

    A weight is named by identity: it must be one of the model's parameters,
    buffers or plain tensor attributes of its submodules (a view or copy of
    one is a different tensor and cannot be named).  Raises ValueError naming
    the entry and weight otherwise.
    """
    plan = check_plan(plan)
    names = tensor_paths(model)
    entries = []
    for i, entry in enumerate(plan):
        weights = []
        for j, weight in enumerate(entry.weights):
            found = names.get(id(weight))
            if found is None:
                raise ValueError(
                    f"plan entry {i} ({entry.point!r}, layer {entry.layer}): weights[{j}] "
                    f"({_describe(weight)}) is not a parameter, buffer or tensor attribute of "
                    "the model, so it has no name to store; register it on a module "
                    "(a view or copy of a parameter is a different tensor)")
            weights.append(found)
        entries.append({"point": entry.point, "layer": entry.layer,
                        "batches": list(entry.batches), "weights": weights,
                        "byte_cap": entry.byte_cap, "grid": entry.grid,
                        "carveout": entry.carveout, "priority": entry.priority,
                        "kernel": entry.kernel, "graph_fork": entry.graph_fork,
                        **({"warm_activation": True} if entry.warm_activation else {})})
    return json.dumps({"version": PLAN_JSON_VERSION, "entries": entries}, indent=1)


def plan_from_json(text: str, model: Any) -> list[PlanEntry]:
    """Read a plan written by :func:`plan_to_json`, resolving names in ``model``.

    Reads version 2 (``warm_activation`` written only where true) and version 1
    (whose entries have no ``kernel`` and ``graph_fork``: both None).  Raises TypeError
    for a ``text`` that is not str or bytes, ValueError for malformed or too deeply
    nested JSON, a key given twice in one object, a number too long to convert,
    another version, missing or unknown fields, a weight listed twice in an
    entry, two entries for one (point, layer, batch), or a weight name that does
    not resolve (with the closest names); TypeError/ValueError from
    :class:`PlanEntry` for bad field values, prefixed with the entry.
    """
    if not isinstance(text, (str, bytes, bytearray)):
        raise TypeError(f"text must be the plan JSON as str (plan_to_json's), got "
                        f"{type(text).__name__}; for a file, read it first")
    try:
        data = loads_json(text, "plan JSON")
    except json.JSONDecodeError as exc:
        raise ValueError(f"plan JSON does not parse: {exc}") from exc
    except RecursionError:
        # json's scanner recurses once per nesting level; a plan nests four deep.
        raise ValueError("plan JSON does not parse: it is nested too deeply (a plan is an "
                         "object of entries, each a flat object)") from None
    if not isinstance(data, dict) or "version" not in data:
        raise ValueError("plan JSON must be an object with 'version' and 'entries'")
    version = data["version"]
    if isinstance(version, bool) or not isinstance(version, int) or version not in _JSON_FIELDS:
        readable = " and ".join(str(v) for v in sorted(_JSON_FIELDS))
        raise ValueError(f"plan JSON version {version!r} is not supported; "
                         f"this l2prefetch reads versions {readable}")
    fields_of_version = _JSON_FIELDS[version]
    raw_entries = data.get("entries")
    if not isinstance(raw_entries, list):
        raise ValueError("plan JSON 'entries' must be a list")
    tensors = named_tensors(model)
    plan: list[PlanEntry] = []
    owner: dict[tuple, int] = {}   # (point, layer, batch) -> the entry that plans it
    for i, raw in enumerate(raw_entries):
        if not isinstance(raw, dict):
            raise ValueError(f"plan JSON entry {i} must be an object, got {raw!r}")
        missing = [f for f in ("point", "layer", "batches", "weights") if f not in raw]
        unknown = sorted(set(raw) - set(fields_of_version))
        if missing or unknown:
            raise ValueError(f"plan JSON entry {i}: missing fields {missing}, "
                             f"unknown fields {unknown}; fields of version {version} are "
                             f"{list(fields_of_version)}")
        names = raw["weights"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"plan JSON entry {i}: 'weights' must be a list of names, "
                             f"got {names!r}")
        repeated = sorted(n for n, count in Counter(names).items() if count > 1)
        if repeated:
            raise ValueError(f"plan JSON entry {i}: 'weights' lists {repeated} more than once "
                             "(an entry loads each weight once)")
        weights = []
        for name in names:
            if name not in tensors:
                close = difflib.get_close_matches(name, list(tensors), n=3)
                hint = f"; closest: {', '.join(close)}" if close else ""
                raise ValueError(f"plan JSON entry {i} ({raw['point']!r}, layer "
                                 f"{raw['layer']!r}): weight {name!r} is not a parameter, "
                                 f"buffer or tensor attribute of the model{hint}")
            weights.append(tensors[name])
        fields = {k: v for k, v in raw.items() if k != "weights"}
        try:
            entry = PlanEntry(weights=tuple(weights), **fields)
        except (TypeError, ValueError) as exc:
            if type(exc) not in (TypeError, ValueError):
                raise
            raise type(exc)(f"plan JSON entry {i}: {exc}") from None
        for batch in entry.batches:
            key = (entry.point, entry.layer, batch)
            if key in owner:
                raise ValueError(f"plan JSON entries {owner[key]} and {i} both prefetch at "
                                 f"point {entry.point!r}, layer {entry.layer}, batch {batch} "
                                 "(one entry per point, layer and batch: the controller keeps "
                                 "only the last)")
            owner[key] = i
        plan.append(entry)
    return plan


#: The gate's rate: a fork pays when the bandwidth-idle window after it lasts at
#: least its bytes / 3.2 TB/s (the H200's break-even, benchmarks/RESULTS.md,
#: Headlines, "where a fork cannot pay").  Count only time in which the GPU is
#: nearly idle: a window of small memory-touching kernels, of compute-bound
#: GEMMs or of an NCCL all-reduce is no window (same table).
GATE_BYTES_PER_US = 3.2e6

#: The smallest load that can pay for its fork: at 2-8 MiB the cold-to-hot gap is
#: about what the fork node itself costs (RESULTS.md, Headlines and "The
#: effect"; 8-16 MiB was not measured).  Opt-in:
#: ``gate(plan, windows, min_bytes=GATE_MIN_BYTES)``.
GATE_MIN_BYTES = 16 << 20


def gate(plan: Sequence[PlanEntry], windows_us: Mapping[str, float], *,
         bytes_per_us: float = GATE_BYTES_PER_US, min_bytes: int = 0) -> list[PlanEntry]:
    """The entries of plan whose fork can pay: those whose point's bandwidth-idle
    window (``windows_us[point]``, microseconds) is long enough to load their
    bytes at ``bytes_per_us``.  Entries of points not in windows_us are kept.
    A window is time in which the GPU is nearly idle: no memory-touching,
    compute-bound or collective kernel runs (see :data:`GATE_BYTES_PER_US`).
    With ``min_bytes`` (e.g. :data:`GATE_MIN_BYTES`), entries that load fewer
    bytes are dropped too, whatever their point.

    Raises TypeError for an entry that is not a PlanEntry or a window or rate
    that is not a number, ValueError for a negative or NaN window or a rate
    that is not a positive finite number; the same for a ``min_bytes`` that is
    not an int >= 0.
    """
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, numbers.Integral):
        raise TypeError(f"min_bytes must be an int >= 0, got {type(min_bytes).__name__} "
                        f"{min_bytes!r}")
    if min_bytes < 0:
        raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes}")
    if isinstance(bytes_per_us, bool) or not isinstance(bytes_per_us, numbers.Real):
        raise TypeError(f"bytes_per_us must be a number > 0, got {type(bytes_per_us).__name__} "
                        f"{bytes_per_us!r}")
    if not (0 < bytes_per_us < math.inf):
        raise ValueError(f"bytes_per_us must be a finite number > 0, got {bytes_per_us}")
    if not isinstance(windows_us, Mapping):
        raise TypeError("windows_us must map point names to windows in microseconds, "
                        f"got {type(windows_us).__name__}")
    for point, window in windows_us.items():
        if isinstance(window, bool) or not isinstance(window, numbers.Real):
            raise TypeError(f"windows_us[{point!r}] must be a number of microseconds >= 0, "
                            f"got {type(window).__name__} {window!r}")
        try:
            float(window)   # the bytes it holds are a float
        except OverflowError:
            raise ValueError(f"windows_us[{point!r}] must be a number of microseconds >= 0, "
                             f"got {shown(window)}, past a float's range") from None
        if not window >= 0:
            raise ValueError(f"windows_us[{point!r}] must be a number of microseconds >= 0, "
                             f"got {window}")
    kept = []
    for entry in check_plan(plan):
        if entry.nbytes < min_bytes:
            continue
        window = windows_us.get(entry.point)
        if window is None or entry.nbytes <= window * bytes_per_us:
            kept.append(entry)
    return kept
