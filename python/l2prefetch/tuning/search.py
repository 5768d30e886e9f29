"""The tuner's search and acceptance, against any measurement backend.

Per batch, in this order (each step measured on fresh graph instances,
every group interleaving its measurement arms, :class:`Arm`: :data:`NO_FORKS`
(a), :data:`LOADS` (b), :data:`EMPTY` (d), :data:`PLAN`; see
:mod:`l2prefetch.tuning.rig`):

1. **prepare**: run and capture the step once (a step that fails or cannot
   be captured is a :class:`StepError`), time it, probe the windows and the
   cold-to-hot gaps where the backend can (:meth:`Backend.probe`).
2. **screen**: a role whose gap (the most its loads could gain) is under
   ``min_gain_us`` is not measured; the rest are measured in decreasing gap.
3. **sweep**: per role, one group of (a) no forks and, in every fork mode
   (``graph_forks``, by default every one of :mod:`l2prefetch.mechanisms`),
   (d) the role's forks with empty tables and (b) its loads at each cap, with
   the default kernel and grid.  A backend that switches loader nodes in place
   (:attr:`Backend.pairs`) measures a mode's (d) and (b)s inside the same graph
   instances where the mode is switchable, so their differences are paired and
   the instances' spread cancels.
4. **refine**: for roles whose best setting beat (a) and (d), one group with
   the other grids and kernels at that cap and mode, each with its own (d).
5. **layers**: a role's setting covers every layer, so loads that pay in
   some layers only (hybrid or mixed dense/MoE models) are averaged away by
   the layers where they cost.  So, at the role's best setting, one group
   measures each layer's loads alone (:attr:`Arm.loads_at`: forks at every
   layer, the others' tables empty) against the empty forks, all of one fork
   structure (switched in one graph per instance where the backend switches,
   so each layer costs a replay, not a capture, and is paired with (d));
   the layers whose interval lies above zero, if not all or none, are then
   measured as one setting beside every layer on fresh instances, and that
   group of layers goes on where it gained more.  The promising roles get
   this first, then those that lost the sweep (in decreasing order of what
   their best loads saved against empty forks), while the budget lasts.
6. **verify**: the chosen setting of each such role on fresh instances:
   kept only if the 95% intervals of its gain over (a) and of its loads
   against (d) both lie above zero (forks that pay with empty tables, or
   by noise, are not a prefetch that pays).  Choosing the best of several
   settings on one set of instances favours noise; verifying on fresh ones
   does not.
7. **combine**: kept roles in decreasing gain; the plans made of the first
   1, 2, ... of them in one group; the best one goes on.
8. **confirm**: that plan against (a) on fresh instances (paired by instance
   where the backend pairs them: GraphBackend's ``placement="shared"``); if the interval of
   its gain is not above zero, the weakest role is dropped and the rest is
   confirmed again.  **A plan is returned only if its confirmation is a
   gain**; otherwise the batch's plan is empty, which is a valid result.

**Sequential sampling.**  The groups of steps 3 to 6 are measured on
``instances`` instances per arm first.  A candidate is then decided
when the 95% interval of its loads against (d) (in verify: also of its gain
over (a)) lies above zero, or its upper end is below ``min_gain_us`` (a
layer: its share of it; it cannot pay what is worth a fork).  The undecided
ones, with their (d) and (a), get ``instances`` more fresh instances, again
and again, until decided or at ``max_instances``, while the round fits the
budget beside what the later steps need (in the sweep also the later roles'
sweeps).  Each look can let noise clear zero, so looking again raises that
chance somewhat; the confirmation, at a fixed count of fresh instances, is
what a plan must pass.

**Instance spread.**  Every group holds (a), each time on fresh captures, so
the search ends with many instances of the step without forks; their spread
(:class:`InstanceSpread` in the batch's report) says what keeping the
fastest of k captures would save, which the report recommends where it pays.

The budget is shared by the batches.  Before each group the tuner estimates
its cost from the step's measured capture and replay times; the final
confirmations are reserved first.  When the budget is short the search gets
coarser (fewer caps, no refine, no layers, no more instances) and roles that
do not fit are reported as not measured; it never returns a plan that was
not confirmed.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import math
import sys
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Optional

from .discover import MIB, Role, describe_bytes
from ..mechanisms import DEFAULT_GRAPH_FORK, GRAPH_FORK_MODES, GRAPH_FORKS
from .stats import Interval, diff_interval, expected_min, mean_interval, paired_interval

__all__ = ["ARM_KINDS", "Arm", "Backend", "BatchReport", "EMPTY", "InstanceSpread", "LOADS",
           "NO_FORKS", "PLAN", "Probe", "RoleReport", "Setting", "StepError", "Trial", "arm_key",
           "parse_arm_key", "search"]

#: Caps tried per role, in MiB (limited to what a role can load).
DEFAULT_CAPS_MIB = (4, 8, 16, 24, 32, 48)
#: Loader CTAs tried in the refine step besides the default.
DEFAULT_GRIDS = (16, 32, 64)
DEFAULT_GRID = 32
#: Graph instances per arm (the issue's floor: instances differ by more than the effects).
MIN_INSTANCES = 5
#: The most instances per arm a close decision gets (sequential sampling: three looks).
MAX_INSTANCES = 15
#: A role whose loads could gain less than this (us per step, summed over layers) is not measured.
DEFAULT_MIN_GAIN_US = 1.0
#: The captures per step best-of-k is estimated for (InstanceSpread.best_of).
BEST_OF_KS = (2, 4, 8, 16)


class StepError(RuntimeError):
    """The step could not be run or captured at a batch (the cause is chained)."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """How a role's forks load: byte cap, loader CTAs, kernel variant (None: the
    device's default), how a fork goes into a captured graph, and the role's layers
    it forks at (None: every layer; else a sorted tuple, a group of layers).  In a
    trial of the layers step's stage ``"layer"``, ``layers`` names the one layer
    whose forks loaded; the forks ran at every layer (:attr:`Arm.loads_at`)."""

    byte_cap: int
    grid: int = DEFAULT_GRID
    kernel: Optional[str] = None
    graph_fork: str = DEFAULT_GRAPH_FORK
    layers: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.layers is None:
            return
        if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Iterable):
            raise TypeError(f"layers must be None (every layer of the role) or a sequence of "
                            f"layer indices, got {type(self.layers).__name__}")
        values = tuple(self.layers)
        if not values or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise ValueError(f"layers must be None (every layer of the role) or name at least "
                             f"one layer by its int index, got {values!r}")
        object.__setattr__(self, "layers", tuple(sorted(set(values))))

    def label(self) -> str:
        kernel = self.kernel or "default kernel"
        layers = "" if self.layers is None else \
            f", layer{'s' if len(self.layers) > 1 else ''} {', '.join(map(str, self.layers))}"
        return (f"{describe_bytes(self.byte_cap)}, grid {self.grid}, {kernel}, "
                f"{self.graph_fork}{layers}")

    def launch_key(self) -> tuple:
        """What the empty-fork control must share with this setting."""
        return (self.grid, self.kernel, self.graph_fork, self.layers)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["layers"] = None if self.layers is None else list(self.layers)
        return out


# The measurement arms.  A measured group maps a key per arm to an :class:`Arm`; the
# key's kind says what the arm is, its tags tell arms of one kind apart.  The letters are
# the report's, and the profile's field names (Trial.as_dict, Confirmation.as_dict: changing
# one changes the profile's format); (c), the benchmarks' computed limit, is not measured here.
#: (a) the step as it is, no forks: every group holds it, the reference of the bitwise check.
NO_FORKS = "a"
#: (b) a role's forks with their loads.
LOADS = "b"
#: (d) the same forks with empty tables: what the forks cost, the control of (b).
EMPTY = "d"
#: Several kept roles' loads together (combine: ``plan:1``, ``plan:2``...; confirm: ``plan``).
PLAN = "plan"
ARM_KINDS = (NO_FORKS, LOADS, EMPTY, PLAN)


def arm_key(kind: str, *tags: object) -> str:
    """The key of an arm in a group: its kind, then the tags that tell arms of one kind
    apart, joined by ':' (``arm_key(LOADS, "leaf", 4194304)`` is ``'b:leaf:4194304'``,
    ``arm_key(NO_FORKS)`` is ``'a'``)."""
    if kind not in ARM_KINDS:
        raise ValueError(f"arm kind must be one of {ARM_KINDS}, got {kind!r}")
    parts = [str(tag) for tag in tags]
    if any(not part or ":" in part for part in parts):
        raise ValueError(f"arm tags must be non-empty and hold no ':', got {tags!r}")
    return ":".join((kind, *parts))


def parse_arm_key(key: str) -> tuple[str, tuple[str, ...]]:
    """``(kind, tags)`` of a key made by :func:`arm_key`; ValueError for any other."""
    kind, *tags = key.split(":") if isinstance(key, str) else [None]
    if kind not in ARM_KINDS or not all(tags):
        raise ValueError(f"not an arm key (kind {'/'.join(ARM_KINDS)}, then ':'-separated "
                         f"tags): {key!r}")
    return kind, tuple(tags)


@dataclasses.dataclass(frozen=True)
class Arm:
    """A measurement arm, one way to run the step: the roles that fork and their
    settings; ``empty``: the same forks with empty tables (the control).  No roles:
    the step as it is.  ``loads_at``: None, or the only layers whose forks load (a
    sorted tuple; the forks at the arm's other layers launch empty tables), so that
    each layer's loads alone are one structure with the empty forks and can be
    switched in one graph (the search's layers step)."""

    roles: tuple[tuple[str, Setting], ...] = ()
    empty: bool = False
    loads_at: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.loads_at is not None:
            values = tuple(self.loads_at) if isinstance(self.loads_at, Iterable) and \
                not isinstance(self.loads_at, (str, bytes)) else ()
            if not values or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
                raise ValueError(f"Arm.loads_at must be None or name at least one layer by its "
                                 f"int index, got {self.loads_at!r}")
            if self.empty:
                raise ValueError("an empty arm loads nowhere: give loads_at=None with empty=True")
            if not self.roles:
                raise ValueError("loads_at names layers of the arm's roles, and it has none")
            object.__setattr__(self, "loads_at", tuple(sorted(set(values))))

    def loads(self, layer: int) -> bool:
        """Whether the arm's fork at ``layer`` loads (not empty, and in loads_at if given)."""
        return not self.empty and (self.loads_at is None or layer in self.loads_at)

    def structure(self) -> tuple:
        """Its forks' structure (roles, fork modes, layers): arms with the same one
        differ in their tables only, so a backend can switch one graph between them."""
        return tuple(sorted((name, s.graph_fork, s.layers or ()) for name, s in self.roles))


@dataclasses.dataclass(frozen=True)
class Probe:
    """What a probe of the step found for one role at one batch: the window from
    the fork to the consumer (us, mean over layers), the consumer's cold-to-hot
    gap (us, summed over layers) and that of every read its largest load
    covers (``chain_gap_us``: the most its loads could gain)."""

    window_us: Optional[float]
    gap_us: Optional[float]
    chain_gap_us: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The step at one batch: replay time and the host cost of one capture."""

    step_us: float
    capture_s: float


class Backend(abc.ABC):
    """What the search (and :func:`~l2prefetch.tuning.tune`) needs of a measurement
    backend.  :class:`l2prefetch.tuning.measure.GraphBackend` captures the real step;
    tests plant effects in a fake (tests/_tuning_fakes.py).  A backend derives from
    this class: :meth:`prepare`, :meth:`probe`, :meth:`measure` and :attr:`rounds` are
    its own; :attr:`pairs`, :attr:`switches`, :meth:`use_roles` and
    :meth:`device_fingerprint` have the defaults below (no pairing, no switching,
    roles not needed, no device).  Every member is read directly: nothing is probed
    with ``hasattr``."""

    #: Replays per graph instance in a group (the budget's estimate counts them).
    rounds: int
    #: After each measure(): the sets of arm keys measured in the same graph
    #: instances (instance i of each), whose differences are paired; none by default.
    pairs: Sequence[set] = ()
    #: Whether measure() captures each fork structure once per instance and switches
    #: its tables in place (what the budget estimate assumes); False by default.
    switches: bool = False

    def use_roles(self, roles: Sequence[Role], caps_bytes: Sequence[int]) -> None:
        """Called by :func:`~l2prefetch.tuning.tune` once, before the search: the roles
        the arms will name and the caps (bytes) the search tries.  Default: nothing."""

    def device_fingerprint(self) -> Optional[dict]:
        """The device measured on (:func:`l2prefetch.tuning.profile.device_fingerprint`),
        stored in the result; None (the default) for a backend that measures no GPU:
        such a result cannot be saved as a profile."""
        return None

    @abc.abstractmethod
    def prepare(self, batch: int) -> Prepared:
        """Run and capture the step once at ``batch``, time it (:class:`StepError` if
        it fails or cannot be captured)."""

    @abc.abstractmethod
    def probe(self, batch: int, roles: Sequence[Role]) -> Optional[dict[str, Probe]]:
        """Each role's window and cold-to-hot gaps at ``batch``, by role name; None
        where the backend cannot probe (then every role is measured)."""

    @abc.abstractmethod
    def measure(self, batch: int, arms: Mapping[str, Arm],
                instances: int) -> tuple[dict[str, list[float]], dict[str, bool]]:
        """Per arm key, one time (us) per instance, and whether its outputs are
        bitwise those of the arm keyed :data:`NO_FORKS` (every group holds it).
        An arm's :attr:`Arm.loads_at` must be honoured: forks at every layer of its
        settings, loads only at those layers (the others' tables empty)."""


@dataclasses.dataclass
class Trial:
    """One setting of one role as measured in a group against that group's (a)
    and its own (d): times are means of per-instance medians with intervals."""

    stage: str
    setting: Setting
    a: Interval
    b: Interval
    d: Interval
    gain: Interval      # a - b: what the loads and forks save against no forks
    vs_empty: Interval  # d - b: what the loads save against the same forks empty
    instances: int = 0  # graph instances of (b): more where the decision was close

    def as_dict(self) -> dict:
        return {"stage": self.stage, "setting": self.setting.as_dict(),
                NO_FORKS: self.a.as_dict(), LOADS: self.b.as_dict(), EMPTY: self.d.as_dict(),
                "gain": self.gain.as_dict(),
                "vs_empty": self.vs_empty.as_dict(), "instances": self.instances}


@dataclasses.dataclass
class RoleReport:
    """What the tuner did with one role at one batch."""

    role: str
    layers: int
    max_bytes: int
    window_us: Optional[float] = None
    gap_us: Optional[float] = None
    chain_gap_us: Optional[float] = None
    trials: list[Trial] = dataclasses.field(default_factory=list)
    chosen: Optional[Trial] = None
    kept: bool = False
    reason: str = "not measured"

    def as_dict(self) -> dict:
        return {"role": self.role, "layers": self.layers, "max_bytes": self.max_bytes,
                "window_us": self.window_us, "gap_us": self.gap_us,
                "chain_gap_us": self.chain_gap_us, "trials": [t.as_dict() for t in self.trials],
                "chosen": None if self.chosen is None else self.chosen.as_dict(),
                "kept": self.kept, "reason": self.reason}


@dataclasses.dataclass
class Confirmation:
    roles: tuple[tuple[str, Setting], ...]
    a: Interval
    plan: Interval
    gain: Interval
    identical: bool

    @property
    def ratio(self) -> float:
        """Step time without prefetch over step time with the plan (> 1: faster)."""
        return self.a.estimate / self.plan.estimate

    @property
    def ratio_interval(self) -> tuple[float, float]:
        """The ratio at the ends of the gain's interval, (a) held at its mean."""
        a = self.a.estimate
        return a / (a - self.gain.low), a / (a - self.gain.high)

    def as_dict(self) -> dict:
        low, high = self.ratio_interval
        return {"roles": [[name, s.as_dict()] for name, s in self.roles],
                NO_FORKS: self.a.as_dict(), PLAN: self.plan.as_dict(), "gain": self.gain.as_dict(),
                "ratio": self.ratio, "ratio_low": low, "ratio_high": high,
                "identical": self.identical}


@dataclasses.dataclass(frozen=True)
class InstanceSpread:
    """How far graph instances of the step without forks differ, over every (a) the
    search measured at one batch (each a fresh capture): their count, mean, SD and
    range (us), and per k of :data:`BEST_OF_KS` the us per step that keeping the
    fastest of k captures (:func:`l2prefetch.graphs.capture_fastest`) is expected to
    save (:func:`~l2prefetch.tuning.stats.expected_min`).  Each group's instances
    count as deviations from that group's mean (plus the mean over all), so drift
    between groups (clocks, heat) is not taken for a difference between captures;
    the estimate still assumes each capture's time is known exactly when choosing,
    so it is an upper one.  ``capture_s``: the host time of one capture, what each
    extra capture adds to start-up."""

    instances: int
    mean_us: float
    sd_us: float
    low_us: float
    high_us: float
    best_of: Mapping[int, float] = dataclasses.field(hash=False)
    capture_s: float = 0.0

    @classmethod
    def of(cls, groups: Sequence[Sequence[float]], capture_s: float
           ) -> Optional["InstanceSpread"]:
        """The spread of the per-instance times of these groups (None for fewer than
        two instances in groups of at least two)."""
        groups = [list(g) for g in groups if len(g) >= 2]
        n = sum(len(g) for g in groups)
        if n < 2:
            return None
        mean = math.fsum(x for g in groups for x in g) / n
        times = [x - math.fsum(g) / len(g) + mean for g in groups for x in g]
        dof = n - len(groups)
        sd = math.sqrt(math.fsum((t - mean) ** 2 for t in times) / dof) if dof > 0 else 0.0
        best_of = types.MappingProxyType({k: mean - expected_min(times, k) for k in BEST_OF_KS})
        return cls(n, mean, sd, min(times), max(times), best_of, capture_s)

    @property
    def spread_pct(self) -> float:
        """The range as a percentage of the mean (0 for a mean that is not positive)."""
        return 100.0 * (self.high_us - self.low_us) / self.mean_us if self.mean_us > 0 else 0.0

    def recommended_k(self, min_gain_pct: float = 0.1) -> int:
        """The fewest captures worth keeping the fastest of: 1 where even the largest
        k saves less than ``min_gain_pct`` of the step, else the smallest k that
        saves at least 80% of what the largest k does."""
        if not self.best_of or self.mean_us <= 0:
            return 1
        top = self.best_of[max(self.best_of)]
        if top < min_gain_pct / 100.0 * self.mean_us:
            return 1
        return min(k for k, gain in self.best_of.items() if gain >= 0.8 * top)

    def as_dict(self) -> dict:
        return {"instances": self.instances, "mean_us": self.mean_us, "sd_us": self.sd_us,
                "low_us": self.low_us, "high_us": self.high_us,
                "best_of_us": {str(k): v for k, v in self.best_of.items()},
                "capture_s": self.capture_s, "recommended_k": self.recommended_k()}


@dataclasses.dataclass
class BatchReport:
    """The result for one batch: the roles, the confirmations, the plan, and the
    instance spread of the step without forks (None before two were measured)."""

    batch: int
    step_us: float = math.nan
    roles: list[RoleReport] = dataclasses.field(default_factory=list)
    confirmations: list[Confirmation] = dataclasses.field(default_factory=list)
    plan: tuple[tuple[str, Setting], ...] = ()
    reason: str = ""
    elapsed_s: float = 0.0
    spread: Optional[InstanceSpread] = None

    @property
    def confirmed(self) -> Optional[Confirmation]:
        """The confirmation of the returned plan (None for an empty plan)."""
        if not self.plan:
            return None
        for c in reversed(self.confirmations):
            if c.roles == self.plan:
                return c
        return None

    def as_dict(self) -> dict:
        confirmed = self.confirmed
        return {"batch": self.batch, "step_us": self.step_us,
                "plan": [[name, s.as_dict()] for name, s in self.plan],
                "confirmed": None if confirmed is None else confirmed.as_dict(),
                "confirmations": [c.as_dict() for c in self.confirmations],
                "roles": [r.as_dict() for r in self.roles], "reason": self.reason,
                "elapsed_s": self.elapsed_s,
                "spread": None if self.spread is None else self.spread.as_dict()}


class Progress:
    """One line per measured group on a stream (stderr), with elapsed time and an ETA."""

    def __init__(self, stream: Any, budget_s: float, clock: Callable[[], float]) -> None:
        self.stream, self.budget_s, self.clock = stream, budget_s, clock
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def line(self, text: str, eta_s: Optional[float] = None) -> None:
        if self.stream is None:
            return
        elapsed = self.elapsed()
        eta = "" if eta_s is None else f", ETA {max(0.0, eta_s):.0f} s"
        print(f"[l2prefetch tune {elapsed:5.0f}/{self.budget_s:.0f} s{eta}] {text}",
              file=self.stream, flush=True)


@dataclasses.dataclass
class _Params:
    instances: int
    max_instances: int
    caps: tuple[int, ...]
    grids: tuple[int, ...]
    kernels: tuple[Optional[str], ...]
    graph_forks: tuple[str, ...]
    min_gain_us: float


@dataclasses.dataclass(frozen=True)
class _Check:
    """A comparison a sequential group decides: x - y (us) is decided when its
    interval lies above zero, or its upper end is below ``floor`` (it cannot pay
    what is worth a fork).  While undecided, x, y and ``also`` are measured again."""

    x: str
    y: str
    floor: float
    also: tuple[str, ...] = ()


class _Measured:
    """The rounds of one measured group: per round each measured arm's times
    (one per graph instance) and the backend's pairs; outputs' bitwise checks
    over all rounds."""

    def __init__(self) -> None:
        self.rounds: list[tuple[dict[str, list[float]], list[set]]] = []
        self.identical: dict[str, bool] = {}

    def add(self, times: Mapping[str, list[float]], identical: Mapping[str, bool],
            pairs: Sequence[set]) -> None:
        self.rounds.append((dict(times), [set(p) for p in pairs]))
        for name, ok in identical.items():
            self.identical[name] = self.identical.get(name, True) and ok

    def values(self, name: str) -> list[float]:
        return [t for times, _ in self.rounds for t in times.get(name, ())]

    def diff(self, x: str, y: str) -> Interval:
        """x - y: paired over the rounds that measured both, where each of them did so
        in the same graph instances (then those rounds only), else Welch's interval
        over all their instances."""
        both = [(times, pairs) for times, pairs in self.rounds if x in times and y in times]
        if both and all(any(x in g and y in g for g in pairs) for _, pairs in both):
            return paired_interval([t for times, _ in both for t in times[x]],
                                   [t for times, _ in both for t in times[y]])
        return diff_interval(self.values(x), self.values(y))


class _Batch:
    """The search at one batch (see the module's docstring)."""

    def __init__(self, backend: Backend, roles: Sequence[Role], batch: int, params: _Params,
                 progress: Progress, deadline: float, clock: Callable[[], float]) -> None:
        self.backend, self.roles, self.batch, self.p = backend, list(roles), batch, params
        self.progress, self.deadline, self.clock = progress, deadline, clock
        self.report = BatchReport(batch)
        self.prepared: Optional[Prepared] = None
        #: Every group's (a) instances at this batch: the step's instance spread.
        self.no_forks: list[list[float]] = []

    # ------------------------------------------------------------------ cost
    def cost(self, arms: int, captures: Optional[int] = None,
             instances: Optional[int] = None) -> float:
        """Estimated seconds of one group of ``arms`` arms, of which
        ``captures`` (default: all) are captured (the others switched in place),
        on ``instances`` instances each (default: the first round's)."""
        p = self.prepared
        captures = arms if captures is None else captures
        instances = self.p.instances if instances is None else instances
        if not p:
            return arms * instances * 1.2 + 0.05
        replay = self.backend.rounds * p.step_us * 1e-6
        return instances * (captures * p.capture_s + arms * replay) * 1.2 + 0.05

    def switched(self, mode: str) -> bool:
        """Whether the backend measures a fork mode's arms as switched states of one
        graph per instance (it switches, and the mode's loader nodes are switchable)."""
        return self.backend.switches and GRAPH_FORK_MODES[mode].switchable

    def group_cost(self, arms: Mapping[str, Arm],
                   instances: Optional[int] = None) -> float:
        """cost() of these arms: a switching backend captures one graph per structure
        (of switchable fork modes; the others, one per arm)."""
        if not self.backend.switches:
            return self.cost(len(arms), None, instances)
        per_structure = collections.Counter(arm.structure() for arm in arms.values())
        captures = sum(1 if all(self.switched(mode) for _, mode, _ in structure) else n
                       for structure, n in per_structure.items())
        return self.cost(len(arms), captures, instances)

    def sweep_cost(self, caps: int) -> float:
        """Estimated seconds of a role's sweep: (a), and per mode (d) and the caps; a
        pairing backend captures each (switchable) mode once per instance."""
        modes = self.p.graph_forks
        captures = 1 + sum(1 if self.switched(mode) else caps + 1 for mode in modes)
        return self.cost(1 + len(modes) * (caps + 1), captures)

    def left(self) -> float:
        return self.deadline - self.clock()

    def fits(self, arms: int, reserve: float = 0.0) -> bool:
        return self.cost(arms) + reserve <= self.left()

    def group(self, label: str, arms: Mapping[str, Arm], eta: Optional[float] = None,
              instances: Optional[int] = None, measured: Optional[_Measured] = None
              ) -> _Measured:
        """Measure ``arms`` on ``instances`` fresh instances each (one round, added
        to ``measured`` when given)."""
        n = self.p.instances if instances is None else instances
        self.progress.line(f"batch {self.batch}: {label} ({len(arms)} arms x "
                           f"{n} instances, ~{self.group_cost(arms, n):.0f} s)", eta)
        times, identical = self.backend.measure(self.batch, arms, n)
        self.no_forks.append(list(times.get(NO_FORKS, ())))
        out = _Measured() if measured is None else measured
        out.add(times, identical, self.backend.pairs)
        return out

    def sample(self, label: str, arms: Mapping[str, Arm],
               checks: Mapping[str, _Check], reserve: float = 0.0,
               eta: Optional[float] = None) -> _Measured:
        """A group measured sequentially: first on ``instances`` instances per arm;
        then, while a check is undecided (:class:`_Check`), its arms and (a) get
        ``instances`` more fresh instances, until every check is decided or has
        ``max_instances`` of its y, or the next round would not leave ``reserve``.
        A decided check is not measured again."""
        m = self.group(label, arms, eta)
        undecided = dict(checks)
        while True:
            for key, check in list(undecided.items()):
                iv = m.diff(check.x, check.y)
                if (iv.low > 0 or iv.high < check.floor
                        or len(m.values(check.y)) >= self.p.max_instances):
                    del undecided[key]
            if not undecided:
                return m
            done = max(len(m.values(c.y)) for c in undecided.values())
            n = max(1, min(self.p.instances, self.p.max_instances - done))
            needs = {NO_FORKS} | {key for c in undecided.values() for key in (c.x, c.y, *c.also)}
            again = {key: arm for key, arm in arms.items() if key in needs}
            if self.group_cost(again, n) + reserve > self.left():
                return m
            self.group(f"{label}: {len(undecided)} undecided, more instances", again,
                       instances=n, measured=m)

    # ------------------------------------------------------------------ steps
    def run(self) -> BatchReport:
        t0 = self.clock()
        self.prepared = self.backend.prepare(self.batch)
        self.report.step_us = self.prepared.step_us
        reports = {role.name: RoleReport(role.name, len(role.sites), role.max_bytes)
                   for role in self.roles}
        self.report.roles = list(reports.values())
        probes = self.backend.probe(self.batch, self.roles) or {}
        for name, probe in probes.items():
            if name in reports:
                rep = reports[name]
                rep.window_us, rep.gap_us = probe.window_us, probe.gap_us
                rep.chain_gap_us = probe.gap_us if probe.chain_gap_us is None \
                    else probe.chain_gap_us

        # screen, then the most promising roles first
        order = []
        for role in self.roles:
            rep = reports[role.name]
            if rep.chain_gap_us is not None and rep.chain_gap_us < self.p.min_gain_us:
                rep.reason = (f"screened out: its loads could gain at most "
                              f"{rep.chain_gap_us:.2f} us per step "
                              f"(min_gain_us={self.p.min_gain_us})")
                continue
            order.append(role)
        order.sort(key=lambda r: -(reports[r.name].gap_us or 0.0))

        final_reserve = 3 * self.cost(2)
        promising: list[tuple[Role, Trial]] = []
        lost: list[Role] = []
        for i, role in enumerate(order):
            rep = reports[role.name]
            verify_reserve = (len(promising) + 1) * self.cost(3)
            caps = self.caps_for(role)
            while caps and self.sweep_cost(len(caps)) + final_reserve + verify_reserve > self.left():
                caps = self.coarser(caps)
            if not caps:
                rep.reason = "not measured: the budget ran out"
                continue
            # the later roles' sweeps come before more instances for this one
            later = sum(self.sweep_cost(len(self.caps_for(r))) for r in order[i + 1:])
            trial = self.sweep(role, caps, rep, eta=self.eta(len(order) - i),
                               reserve=final_reserve + verify_reserve + later)
            if trial is None:
                lost.append(role)
                continue
            promising.append((role, trial))

        for role, trial in list(promising):
            rep = reports[role.name]
            alternatives = self.alternatives(trial.setting)
            verify_reserve = len(promising) * self.cost(3)
            if alternatives and self.fits(2 * len(alternatives) + 3,
                                          final_reserve + verify_reserve):
                better = self.refine(role, trial, alternatives, rep,
                                     final_reserve + verify_reserve)
                if better is not None:
                    promising[promising.index((role, trial))] = (role, better)

        # layers: the promising roles' first, then those that lost the sweep (a window in
        # some layers only is averaged away by the layers where its loads cost)
        for k, (role, trial) in enumerate(list(promising)):
            better = self.layers(role, trial, reports[role.name],
                                 final_reserve + len(promising) * self.cost(3))
            if better is not None:
                promising[k] = (role, better)
        lost.sort(key=lambda r: -max(t.vs_empty.estimate for t in reports[r.name].trials))
        for role in lost:
            rep = reports[role.name]
            seed = max((t for t in rep.trials if t.stage == "sweep"),
                       key=lambda t: t.vs_empty.estimate)
            better = self.layers(role, seed, rep,
                                 final_reserve + (len(promising) + 1) * self.cost(3))
            if better is not None:
                promising.append((role, better))
            elif any(t.stage == "layer" for t in rep.trials):
                rep.reason += "; measured per layer, no group of its layers paid"

        kept: list[tuple[Role, Trial]] = []
        for k, (role, trial) in enumerate(promising):
            rep = reports[role.name]
            if not self.fits(3, final_reserve):
                rep.reason = "not verified: the budget ran out"
                continue
            later = (len(promising) - k - 1) * self.cost(3)
            verified = self.verify(role, trial.setting, rep, final_reserve + later)
            if verified is not None:
                kept.append((role, verified))

        self.combine_and_confirm(kept, reports)
        self.report.spread = InstanceSpread.of(self.no_forks, self.prepared.capture_s)
        self.report.elapsed_s = self.clock() - t0
        return self.report

    def eta(self, roles_left: int) -> float:
        return min(self.left(), roles_left * self.sweep_cost(len(self.p.caps)) + 3 * self.cost(2))

    def caps_for(self, role: Role) -> list[int]:
        fallback = role.default("byte_cap", 0)
        caps = sorted({min(c, role.max_bytes) for c in self.p.caps})
        if fallback and fallback not in caps:
            caps.append(fallback)
        return sorted(set(caps))

    @staticmethod
    def coarser(caps: list[int]) -> list[int]:
        """Fewer caps: keep every other one, always the largest; then none."""
        if len(caps) <= 1:
            return []
        return sorted(set(caps[1::2]) | {caps[-1]})

    def default_setting(self, role: Role, cap: int) -> Setting:
        return Setting(byte_cap=cap, grid=role.default("grid", DEFAULT_GRID),
                       kernel=self.p.kernels[0], graph_fork=self.p.graph_forks[0])

    def trial(self, stage: str, setting: Setting, m: _Measured, b: str, d: str) -> Trial:
        return Trial(stage, setting, mean_interval(m.values(NO_FORKS)),
                     mean_interval(m.values(b)), mean_interval(m.values(d)),
                     m.diff(NO_FORKS, b), m.diff(d, b),
                     len(m.values(b)))

    def vs_empty_checks(self, keys: Mapping[str, tuple[Setting, str]],
                        floor: float) -> dict[str, _Check]:
        """Sequential checks of each (b) against its (d) (see :meth:`sample`)."""
        return {b: _Check(d, b, floor) for b, (_, d) in keys.items()}

    def sweep(self, role: Role, caps: list[int], rep: RoleReport, eta: float,
              reserve: float) -> Optional[Trial]:
        base = self.default_setting(role, caps[0])
        arms = {NO_FORKS: Arm()}
        settings = {}
        for mode in self.p.graph_forks:
            m = dataclasses.replace(base, graph_fork=mode)
            d = arm_key(EMPTY, mode)
            arms[d] = Arm(((role.name, m),), empty=True)
            for cap in caps:
                s = dataclasses.replace(m, byte_cap=cap)
                b = arm_key(LOADS, mode, cap)
                settings[b] = (s, d)
                arms[b] = Arm(((role.name, s),))
        measured = self.sample(f"{role.name}: caps {', '.join(describe_bytes(c) for c in caps)}"
                               f" x forks {', '.join(self.p.graph_forks)}", arms,
                               self.vs_empty_checks(settings, self.p.min_gain_us), reserve, eta)
        trials = [self.trial("sweep", s, measured, key, d) for key, (s, d) in settings.items()]
        rep.trials += trials
        best = max(trials, key=lambda t: t.gain.estimate)
        if best.gain.estimate <= 0 or best.vs_empty.estimate <= 0:
            rep.reason = (f"lost in the sweep: best {best.setting.label()} saved "
                          f"{best.gain.estimate:+.2f} us against no forks, "
                          f"{best.vs_empty.estimate:+.2f} us against empty forks")
            return None
        rep.reason = "promising after the sweep"
        return best

    def alternatives(self, setting: Setting) -> list[Setting]:
        out = []
        for grid in self.p.grids:
            if grid != setting.grid:
                out.append(dataclasses.replace(setting, grid=grid))
        for kernel in self.p.kernels:
            if kernel != setting.kernel:
                out.append(dataclasses.replace(setting, kernel=kernel))
        return out

    def refine(self, role: Role, best: Trial, alternatives: list[Setting],
               rep: RoleReport, reserve: float) -> Optional[Trial]:
        arms = {NO_FORKS: Arm()}
        keys: dict[str, tuple[Setting, str]] = {}
        controls: dict[tuple, str] = {}
        for i, s in enumerate([best.setting] + alternatives):
            d = controls.get(s.launch_key())
            if d is None:
                d = arm_key(EMPTY, len(controls))
                controls[s.launch_key()] = d
                arms[d] = Arm(((role.name, s),), empty=True)
            arms[arm_key(LOADS, i)] = Arm(((role.name, s),))
            keys[arm_key(LOADS, i)] = (s, d)
        measured = self.sample(f"{role.name}: grids and kernels at "
                               f"{describe_bytes(best.setting.byte_cap)}", arms,
                               self.vs_empty_checks(keys, self.p.min_gain_us), reserve)
        trials = [self.trial("refine", s, measured, key, d) for key, (s, d) in keys.items()]
        rep.trials += trials
        good = [t for t in trials if t.vs_empty.estimate > 0]
        return max(good, key=lambda t: t.gain.estimate) if good else None

    def layers(self, role: Role, base: Trial, rep: RoleReport,
               reserve: float) -> Optional[Trial]:
        """Each layer's loads alone against the empty forks, at ``base``'s setting with
        forks at every layer (one structure: a switching backend captures it once per
        instance, so each layer's difference is paired); then the layers whose loads
        beat the empty forks (95% interval above zero), if not all or none, beside every
        layer on fresh instances.  Returns that group of layers' trial where it gained
        more than every layer (and than no forks), else None.  A layer's trial has
        ``layers=(layer,)``; its ``gain`` is against no forks at all, so it includes the
        other layers' empty forks: its ``vs_empty`` is what decides."""
        if len(role.sites) < 2:
            return None
        every = dataclasses.replace(base.setting, layers=None)
        # One fork structure, forks at every layer: (d) all empty, (b) all loading (the
        # graph a switching backend captures), and per layer its loads alone
        # (Arm.loads_at), so every layer is switched in the same instances, paired with (d).
        arms = {NO_FORKS: Arm(), EMPTY: Arm(((role.name, every),), empty=True),
                LOADS: Arm(((role.name, every),))}
        checks: dict[str, _Check] = {}
        keys: dict[str, tuple[Setting, str]] = {}
        for layer in role.layers:
            b = arm_key(LOADS, layer)
            arms[b] = Arm(((role.name, every),), loads_at=(layer,))
            keys[b] = (dataclasses.replace(every, layers=(layer,)), EMPTY)
            # a layer's share of what is worth a fork; where the backend switches, (b)
            # every layer is measured again too (it is the graph the others switch)
            checks[b] = _Check(EMPTY, b, self.p.min_gain_us / len(role.sites),
                               also=(LOADS,) if self.switched(every.graph_fork) else ())
        compare = self.cost(5, 3 if self.switched(every.graph_fork) else None)
        if self.group_cost(arms) + compare + reserve > self.left():
            return None
        measured = self.sample(f"{role.name}: each of {len(role.sites)} layers' loads alone at "
                               f"{every.label()}", arms, checks, reserve + compare)
        trials = [self.trial("layer", s, measured, key, d) for key, (s, d) in keys.items()]
        rep.trials += trials
        paying = tuple(t.setting.layers[0] for t in trials if t.vs_empty.low > 0)
        if not paying or len(paying) == len(role.sites):
            return None
        some = dataclasses.replace(every, layers=paying)
        d_some, b_some = arm_key(EMPTY, "some"), arm_key(LOADS, "some")
        arms = {NO_FORKS: Arm(), EMPTY: Arm(((role.name, every),), empty=True),
                LOADS: Arm(((role.name, every),)),
                d_some: Arm(((role.name, some),), empty=True),
                b_some: Arm(((role.name, some),))}
        if self.group_cost(arms) + reserve > self.left():
            return None
        measured = self.group(f"{role.name}: layers {', '.join(map(str, paying))} against all "
                              f"{len(role.sites)}", arms)
        t_every = self.trial("layers", every, measured, LOADS, EMPTY)
        t_some = self.trial("layers", some, measured, b_some, d_some)
        rep.trials += [t_every, t_some]
        if t_some.gain.estimate > max(t_every.gain.estimate, 0.0) and t_some.vs_empty.estimate > 0:
            rep.reason = (f"promising after the layers: {some.label()} saved "
                          f"{t_some.gain.estimate:+.2f} us, every layer "
                          f"{t_every.gain.estimate:+.2f} us")
            return t_some
        return None

    def verify(self, role: Role, setting: Setting, rep: RoleReport,
               reserve: float) -> Optional[Trial]:
        arms = {NO_FORKS: Arm(), EMPTY: Arm(((role.name, setting),), empty=True),
                LOADS: Arm(((role.name, setting),))}
        measured = self.sample(f"{role.name}: verify {setting.label()}", arms,
                               {"gain": _Check(NO_FORKS, LOADS, self.p.min_gain_us,
                                               also=(EMPTY,)),
                                "vs_empty": _Check(EMPTY, LOADS, 0.0)}, reserve)
        trial = self.trial("verify", setting, measured, LOADS, EMPTY)
        rep.trials.append(trial)
        rep.chosen = trial
        if not measured.identical.get(LOADS, True):
            rep.reason = "refused: outputs with its loads differ from the step's (a bug: report it)"
            return None
        if not trial.gain.excludes_zero_above():
            rep.reason = (f"not shown on fresh instances: gain {trial.gain.format(2)} us "
                          "(95% interval includes zero or less)")
            return None
        if not trial.vs_empty.excludes_zero_above():
            rep.reason = (f"its loads are not shown to beat its empty forks: "
                          f"{trial.vs_empty.format(2)} us (95% interval includes zero or less)")
            return None
        rep.kept = True
        rep.reason = f"kept: gain {trial.gain.format(2)} us per step"
        return trial

    def combine_and_confirm(self, kept: list[tuple[Role, Trial]],
                            reports: dict[str, RoleReport]) -> None:
        kept = sorted(kept, key=lambda rt: -rt[1].gain.estimate)
        chosen = [(role.name, trial.setting) for role, trial in kept]
        if not chosen:
            self.report.reason = "no role paid at this batch"
            return
        if len(chosen) > 1 and self.fits(len(chosen) + 1, 3 * self.cost(2)):
            arms = {NO_FORKS: Arm()}
            for n in range(1, len(chosen) + 1):
                arms[arm_key(PLAN, n)] = Arm(tuple(chosen[:n]))
            measured = self.group(f"combine {len(chosen)} kept roles", arms)
            gains = {n: measured.diff(NO_FORKS, arm_key(PLAN, n)).estimate
                     for n in range(1, len(chosen) + 1)}
            best = max(gains, key=lambda n: (gains[n], -n))
            for name, _ in chosen[best:]:
                reports[name].kept = False
                reports[name].reason = (f"dropped when combining: the first {best} kept "
                                        f"role(s) gained more without it")
            chosen = chosen[:best]
        while chosen:
            if not self.fits(2):
                self.report.reason = "the budget ran out before the plan was confirmed"
                for name, _ in chosen:
                    reports[name].kept = False
                    reports[name].reason += "; not confirmed (budget)"
                return
            plan = tuple(chosen)
            measured = self.group(f"confirm {len(plan)} role(s)",
                                  {NO_FORKS: Arm(), PLAN: Arm(plan)})
            a, with_plan = measured.values(NO_FORKS), measured.values(PLAN)
            conf = Confirmation(plan, mean_interval(a), mean_interval(with_plan),
                                measured.diff(NO_FORKS, PLAN), measured.identical.get(PLAN, True))
            self.report.confirmations.append(conf)
            if conf.identical and conf.gain.excludes_zero_above():
                self.report.plan = plan
                self.report.reason = (f"confirmed: {conf.gain.format(2)} us per step, "
                                      f"{conf.ratio:.4f}x")
                return
            name, _ = chosen.pop()
            reports[name].kept = False
            reports[name].reason = ("dropped at confirmation: the plan with it was not a "
                                    f"confirmed gain ({conf.gain.format(2)} us)")
        self.report.reason = "no combination of the kept roles was confirmed"


def search(backend: Backend, roles: Sequence[Role], batches: Sequence[int], *,
           budget_s: float, instances: int = MIN_INSTANCES,
           max_instances: Optional[int] = None,
           caps_mib: Sequence[float] = DEFAULT_CAPS_MIB, grids: Sequence[int] = DEFAULT_GRIDS,
           kernels: Sequence[Optional[str]] = (None,),
           graph_forks: Sequence[str] = GRAPH_FORKS,
           min_gain_us: float = DEFAULT_MIN_GAIN_US, progress: Any = sys.stderr,
           clock: Callable[[], float] = time.monotonic) -> list[BatchReport]:
    """Run the search of the module's docstring for each batch; the budget is
    split evenly over the batches still to do.  ``max_instances`` (None:
    MAX_INSTANCES, or ``instances`` if more) bounds the sequential sampling.
    Arguments are checked by :func:`l2prefetch.tuning.tune`."""
    if max_instances is None:
        max_instances = max(MAX_INSTANCES, instances)
    params = _Params(instances=instances, max_instances=max(max_instances, instances),
                     caps=tuple(int(c * MIB) for c in caps_mib),
                     grids=tuple(grids), kernels=tuple(kernels), graph_forks=tuple(graph_forks),
                     min_gain_us=min_gain_us)
    meter = Progress(progress, budget_s, clock)
    start = clock()
    reports = []
    for i, batch in enumerate(batches):
        share = (budget_s - (clock() - start)) / (len(batches) - i)
        searcher = _Batch(backend, roles, batch, params, meter, clock() + share, clock)
        report = searcher.run()
        meter.line(f"batch {batch}: {report.reason}")
        reports.append(report)
    return reports
