"""What the tuner's search found: per batch the roles' trials, the confirmations, the
plan and the instance spread of the step.  Their ``as_dict`` is the profile's
``results`` (:mod:`l2prefetch.profile`): changing a field changes the profile's format.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping, Sequence
from typing import Optional

from .arms import EMPTY, LOADS, NO_FORKS, PLAN, Setting
from .stats import Interval, expected_min

__all__ = ["BEST_OF_KS", "BatchReport", "Confirmation", "InstanceSpread", "RoleReport", "Trial"]

#: The captures per step best-of-k is estimated for (InstanceSpread.best_of).
BEST_OF_KS = (2, 4, 8, 16)


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
    """The plan against the step without forks (a) on fresh instances, beside the same
    plan's forks with empty tables: ``gain`` is a - plan (what the user's step gains),
    ``loads`` is empty plan - plan (what the loads gain over their own forks, the right
    control for a prefetch) and ``forks`` is a - empty plan (what the forks alone do:
    negative where they cost, positive where their graph topology alone makes the
    step faster, as branch forks did in compiled steps, RESULTS run 24)."""

    roles: tuple[tuple[str, Setting], ...]
    a: Interval
    plan: Interval
    gain: Interval
    identical: bool
    loads: Optional[Interval] = None
    forks: Optional[Interval] = None
    #: Whether the plan's forks with empty tables kept the outputs too (only the plan's
    #: own ``identical`` says whether its loads did).
    empty_identical: bool = True

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
                "identical": self.identical,
                "loads": None if self.loads is None else self.loads.as_dict(),
                "forks": None if self.forks is None else self.forks.as_dict(),
                "empty_identical": self.empty_identical}


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
    #: Replays per graph instance in this batch's groups (None: not measured).
    rounds: Optional[int] = None
    #: Roles promising after the sweep whose other grids and kernels the budget left
    #: untried (search step 4): their settings keep the default grid and kernel.  (A role
    #: that lost the sweep and paid in some layers only is never refined, nor named here.)
    not_refined: list[str] = dataclasses.field(default_factory=list)

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
        return {"batch": self.batch,   # null: not prepared (JSON has no NaN)
                "step_us": None if math.isnan(self.step_us) else self.step_us,
                "plan": [[name, s.as_dict()] for name, s in self.plan],
                "confirmed": None if confirmed is None else confirmed.as_dict(),
                "confirmations": [c.as_dict() for c in self.confirmations],
                "roles": [r.as_dict() for r in self.roles], "reason": self.reason,
                "elapsed_s": self.elapsed_s, "rounds": self.rounds,
                "not_refined": list(self.not_refined),
                "spread": None if self.spread is None else self.spread.as_dict()}
