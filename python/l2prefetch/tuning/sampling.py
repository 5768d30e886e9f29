"""Measured groups and sequential sampling over a Backend, at one batch.

A group is a set of arms measured on fresh graph instances (one round); a
sequential group is measured again, round after round, while a comparison in it is
undecided (:class:`Check`) and the budget allows.  The rule, with the reasons for
its numbers, is "Sequential sampling" in :mod:`l2prefetch.tuning.search`'s docstring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Optional

from .arms import NO_FORKS, Arm, Backend
from .budget import Budget, Params, Progress
from .results import BatchReport
from .stats import Interval, diff_interval, paired_interval

__all__ = ["Check", "Measured", "Sampler"]


@dataclasses.dataclass(frozen=True)
class Check:
    """A comparison a sequential group decides: x - y (us) is decided when its
    interval lies above zero, or its upper end is below ``floor`` (it cannot pay
    what is worth a fork).  While undecided, x, y and ``also`` are measured again."""

    x: str
    y: str
    floor: float
    also: tuple[str, ...] = ()


class Measured:
    """The rounds of one measured group: per round each measured arm's times
    (one per graph instance), the backend's pairs and references; outputs' bitwise
    checks over all rounds."""

    def __init__(self) -> None:
        self.rounds: list[tuple[dict[str, list[float]], list[set], dict[str, str]]] = []
        self.identical: dict[str, bool] = {}

    def add(self, times: Mapping[str, list[float]], identical: Mapping[str, bool],
            pairs: Sequence[set], references: Optional[Mapping[str, str]] = None) -> None:
        self.rounds.append((dict(times), [set(p) for p in pairs], dict(references or {})))
        for name, ok in identical.items():
            self.identical[name] = self.identical.get(name, True) and ok

    def values(self, name: str) -> list[float]:
        return [t for times, _, _ in self.rounds for t in times.get(name, ())]

    def reference_values(self, y: str) -> list[float]:
        """(a)'s times as compared with y: per round, y's own step without forks where
        the round has one (Backend.references), else (a)'s captures."""
        out = []
        for times, _, references in self.rounds:
            if y in times:
                out += times[self._keys(times, references, NO_FORKS, y)[0]]
        return out

    @staticmethod
    def _keys(times: Mapping[str, list[float]], references: Mapping[str, str], x: str,
              y: str) -> tuple[str, str]:
        """x and y as this round measured them: (a) against an arm is that arm's own
        step without forks where the round has one (Backend.references)."""
        if x == NO_FORKS and references.get(y) in times:
            x = references[y]
        elif y == NO_FORKS and references.get(x) in times:
            y = references[x]
        return x, y

    def _both(self, x: str, y: str) -> list[tuple[list[float], list[float], bool]]:
        """Per round that measured x and y: their times, and whether paired there."""
        out = []
        for times, pairs, references in self.rounds:
            u, v = self._keys(times, references, x, y)
            if u in times and v in times:
                out.append((times[u], times[v], any(u in g and v in g for g in pairs)))
        return out

    def paired(self, x: str, y: str) -> bool:
        """Whether every round that measured both x and y did so in the same graph
        instances (and at least one did)."""
        both = self._both(x, y)
        return bool(both) and all(p for _, _, p in both)

    def diff(self, x: str, y: str) -> Interval:
        """x - y: paired over the rounds that measured both, where each of them did so
        in the same graph instances (then those rounds only), else Welch's interval
        over all their instances."""
        both = self._both(x, y)
        if both and all(p for _, _, p in both):
            return paired_interval([t for xs, _, _ in both for t in xs],
                                   [t for _, ys, _ in both for t in ys])
        xs = self.reference_values(y) if x == NO_FORKS else self.values(x)
        ys = self.reference_values(x) if y == NO_FORKS else self.values(y)
        return diff_interval(xs, ys)


class Sampler:
    """Measures groups of arms at one batch through the backend, within the budget; keeps
    every group's (a) instances (:attr:`no_forks`: the step's instance spread)."""

    def __init__(self, backend: Backend, batch: int, params: Params, budget: Budget,
                 progress: Progress, report: BatchReport) -> None:
        self.backend, self.batch, self.p, self.budget = backend, batch, params, budget
        self.progress, self.report = progress, report
        #: Every group's (a) instances at this batch: the step's instance spread.
        self.no_forks: list[list[float]] = []

    def group(self, label: str, arms: Mapping[str, Arm], eta: Optional[float] = None,
              instances: Optional[int] = None, measured: Optional[Measured] = None
              ) -> Measured:
        """Measure ``arms`` on ``instances`` fresh instances each (one round, added
        to ``measured`` when given)."""
        n = self.p.instances if instances is None else instances
        self.progress.line(f"batch {self.batch}: {label} ({len(arms)} arms x "
                           f"{n} instances, ~{self.budget.group_cost(arms, n):.0f} s)", eta)
        times, identical = self.backend.measure(self.batch, arms, n)
        self.no_forks.append(list(times.get(NO_FORKS, ())))
        out = Measured() if measured is None else measured
        out.add(times, identical, self.backend.pairs, self.backend.references)
        return out

    def sample(self, label: str, arms: Mapping[str, Arm],
               checks: Mapping[str, Check], reserve: float = 0.0,
               eta: Optional[float] = None, extend_reserve: Optional[float] = None
               ) -> Measured:
        """A group measured sequentially: first on ``instances`` instances per arm;
        then, while a check is undecided (:class:`Check`), its arms and (a) get
        ``instances`` more fresh instances (a round ends at ``max_instances``), until
        every check is decided or has ``max_instances`` of its y (the lead: see below),
        or the next round would not leave ``reserve``.
        The check whose y gains most against no forks (the group's lead, what the step
        reports or goes on with) is decided only once also :meth:`resolved`: sampled
        until its paired intervals are ``resolution`` of the step narrow, and for that
        alone up to ``lead_max_instances``, leaving ``extend_reserve`` (default
        ``reserve``) for what comes after.  A decided check is not measured again unless
        it becomes the lead."""
        m = self.group(label, arms, eta)
        while True:
            undecided, room = self._undecided(m, checks)
            if not undecided:
                return m
            n = max(1, min(self.p.instances, min(room)))
            needs = {NO_FORKS} | {key for c in undecided.values() for key in (c.x, c.y, *c.also)}
            again = {key: arm for key, arm in arms.items() if key in needs}
            # a round that takes the lead past max_instances leaves extend_reserve
            past = any(len(m.values(c.y)) >= self.p.max_instances for c in undecided.values())
            keep = extend_reserve if past and extend_reserve is not None else reserve
            if self.budget.group_cost(again, n) + keep > self.budget.left():
                return m
            self.group(f"{label}: {len(undecided)} undecided, more instances", again,
                       instances=n, measured=m)

    def _undecided(self, m: Measured, checks: Mapping[str, Check]
                   ) -> tuple[dict[str, Check], list[int]]:
        """The checks still undecided, and for each the instances its next round may take."""
        # the candidate that gains most against no forks so far leads the group
        lead = max((m.diff(NO_FORKS, c.y).estimate, c.y) for c in checks.values())[1]
        undecided, room = {}, []
        for key, check in checks.items():
            done = len(m.values(check.y))
            resolved = check.y != lead or self.resolved(m, check)
            cap = self.p.max_instances if resolved else self.p.lead_max_instances
            if done >= cap:
                continue
            iv = m.diff(check.x, check.y)
            if (iv.low > 0 or iv.high < check.floor) and resolved:
                continue
            undecided[key] = check
            # a round ends at max_instances before it takes anything past it
            room.append((cap if done >= self.p.max_instances else self.p.max_instances)
                        - done)
        return undecided, room

    def resolved(self, m: Measured, check: Check) -> bool:
        """Whether the check's paired intervals, x - y and (a) - y (the candidate's gain),
        are at most ``resolution`` of the step wide (half-width).  Welch intervals
        (instances not paired) are not held to it: across independent captures the
        instance spread (0.24-4.9% of a step, issue 23) is wider than any budget narrows."""
        limit = self.p.resolution * self.report.step_us
        return all(m.diff(u, v).half_width <= limit
                   for u, v in ((check.x, check.y), (NO_FORKS, check.y)) if m.paired(u, v))
