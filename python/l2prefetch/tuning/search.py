"""The tuner's search and acceptance, against any measurement backend.

Per batch, in this order (each step measured on fresh graph instances,
every group interleaving its measurement arms, :class:`~l2prefetch.tuning.arms.Arm`:
:data:`~l2prefetch.tuning.arms.NO_FORKS` (a), :data:`~l2prefetch.tuning.arms.LOADS` (b),
:data:`~l2prefetch.tuning.arms.EMPTY` (d), :data:`~l2prefetch.tuning.arms.PLAN`; see
:mod:`l2prefetch.tuning.arms`):

1. **prepare**: run and capture the step once (a step that fails or cannot
   be captured is a :class:`~l2prefetch.tuning.arms.StepError`), time it, probe the windows and the
   cold-to-hot gaps where the backend can (:meth:`~l2prefetch.tuning.arms.Backend.probe`).
2. **screen**: a role whose gap (the most its loads could gain) is under
   ``min_gain_us`` is not measured; the rest are measured in decreasing gap.
3. **sweep**: per role, one group of (a) no forks and, in every fork mode
   (``graph_forks``, by default every one of :mod:`l2prefetch.mechanisms`),
   (d) the role's forks with empty tables and (b) its loads at each cap, with
   the default kernel and grid.  A backend that switches loader nodes in place
   (:attr:`~l2prefetch.tuning.arms.Backend.pairs`) measures a mode's (d) and (b)s inside the same graph
   instances where the mode is switchable, so their differences are paired and
   the instances' spread cancels.
4. **refine**: for roles whose best setting beat (a) and (d), one group with
   the other grids and kernels at that cap and mode, each with its own (d).
5. **layers**: a role's setting covers every layer, so loads that pay in
   some layers only (hybrid or mixed dense/MoE models) are averaged away by
   the layers where they cost.  So, at the role's best setting, one group
   measures each layer's loads alone (:attr:`~l2prefetch.tuning.arms.Arm.loads_at`: forks at every
   layer, the others' tables empty) against the empty forks, all of one fork
   structure (switched in one graph per instance where the backend switches,
   so each layer costs a replay, not a capture, and is paired with (d));
   the layers whose interval lies above zero, if not all or none, are then
   measured as one setting beside every layer on fresh instances, and that
   group of layers goes on where it gained more.  The promising roles get
   this first, then those that lost the sweep (in decreasing order of what
   their best loads saved against empty forks), while the budget lasts
   beside every verify's sequential sampling (see the budget below).
6. **verify**: the chosen setting of each such role on fresh instances, in decreasing
   gain so far, less the roles whose forks start at a weight where a kept role's forks
   start (at the layers of each one's setting): roles at several sites before one
   consumer are alternatives, since together they load its first bytes twice (a
   policy's points too: kimi_k3's ``oproj_down`` and ``attention_moe`` both start at
   the MoE front, so only the stronger is verified):
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
layer: its share of it; it cannot pay what is worth a fork), and, for the
group's lead (the candidate that gains most against (a) so far, the one the
step goes on with or reports as the role's best), once its paired intervals
are at most ``resolution`` of the step wide (0.05%: issue 23; a loser that
is not the lead stops as soon as it clearly lost).  The undecided
ones, with their (d) and (a), get ``instances`` more fresh instances, again
and again, until decided or at ``max_instances`` (the lead, while its intervals
are wider than ``resolution``, at twice that), while the round fits the
budget beside what the later steps need (in the sweep also the later roles'
sweeps).  Each look can let noise clear zero, so looking again raises that
chance somewhat; the confirmation, at a fixed count of fresh instances, is
what a plan must pass.

**Instance spread.**  Every group holds (a), each time on fresh captures, so
the search ends with many instances of the step without forks; their spread
(:class:`~l2prefetch.tuning.results.InstanceSpread` in the batch's report) says what
keeping the fastest of k captures would save, which the report recommends where it
pays.  With shared placement
(:attr:`~l2prefetch.tuning.arms.Backend.shared_placement`) the arms of one instance
index are placed alike, but each instance is a placement of its own (GraphBackend
shifts each pool by spacers of random sizes: RESULTS run 18), so (a)'s spread
across instances is still that of independent captures.

**Which (a).**  Two captures of the step, even into one memory pool, place its
buffers apart and replay a few us apart, stably, in a pattern of their own per
pair (RESULTS run 18: up to +-7 us between (a) and the empty forks of one
instance at deepseek-v3-6l B1, where (d) and (b), switched states of one graph,
agree to replay noise).  So where the backend returns an arm's own step without
forks (:attr:`~l2prefetch.tuning.arms.Backend.references`: GraphBackend removes the
loader nodes from the arm's captured graph and replays the rest at the same
addresses), every comparison of that arm with (a) takes it instead, paired by
instance; (a)'s own captures still give the instance spread and the bitwise
reference.

The budget is shared by the batches.  Before each group the tuner estimates
its cost from the step's measured capture and replay times; the final
confirmations are reserved first.  The sweeps leave each promising role's verify one
round; refine and the layers step leave each verify to come the most its sequential
sampling can take (up to ``max_instances``: a worst case, so where verifies decide
early some budget goes unused; at the default budget on deepseek-v3-6l B1 the layers
step of lost roles had left two verifies one round of 5 instances, RESULTS run 16);
where that is more than is left, the verifies go in decreasing gain so far, the most
promising first.  A lead sampled past ``max_instances`` for the resolution alone
(up to twice that) gets those rounds only where every verify that may still come
keeps its whole sampling (in the sweep: the later roles' too); the verify reserve
prices ``max_instances``, not that extension.  When the budget is short the search gets coarser (fewer
caps, no refine, no layers, no more instances) and roles that do not fit are
reported as not measured; it never returns a plan that was not confirmed.
"""

from __future__ import annotations

import collections
import dataclasses
import numbers
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from .arms import (DEFAULT_GRID, EMPTY, LOADS, NO_FORKS, PLAN, Arm, Backend, Prepared, Setting,
                   arm_key)
from .discovery import MIB, Role, describe_bytes
from ..mechanisms import GRAPH_FORK_MODES, GRAPH_FORKS
from .results import BatchReport, Confirmation, InstanceSpread, RoleReport, Trial
from .stats import Interval, diff_interval, mean_interval, paired_interval

__all__ = ["DEFAULT_CAPS_MIB", "DEFAULT_GRIDS", "DEFAULT_MIN_GAIN_US", "DEFAULT_RESOLUTION",
           "LEAD_INSTANCES_FACTOR", "MAX_INSTANCES", "MIN_INSTANCES", "lead_max_instances",
           "search"]

#: Caps tried per role, in MiB (limited to what a role can load).
DEFAULT_CAPS_MIB = (4, 8, 16, 24, 32, 48)
#: Loader CTAs tried in the refine step besides the default.
DEFAULT_GRIDS = (16, 32, 64)
#: Graph instances per arm (the issue's floor: instances differ by more than the effects).
MIN_INSTANCES = 5
#: The most instances per arm a close decision gets (sequential sampling: up to five looks).
#: 25: a lead at 15 instances was still 0.053-0.064% wide on mixtral-4l B1 (RESULTS run 15),
#: and the half-width narrows as 1/sqrt(n).
MAX_INSTANCES = 25
#: How many times ``max_instances`` a group's lead may get while only the resolution is
#: unmet (sequential sampling is on): on deepseek-v3-6l B1 one lead's paired a - b varied by
#: SD 3.25 us per instance and needed about 40 for 0.05% of the step (RESULTS run 17).
LEAD_INSTANCES_FACTOR = 2
#: A role whose loads could gain less than this (us per step, summed over layers) is not measured.
DEFAULT_MIN_GAIN_US = 1.0
#: The 95% half-width, as a share of the step, that a group's leading candidate is sampled
#: down to where its comparisons are paired (issue 23: 0.05%).
DEFAULT_RESOLUTION = 0.0005

def lead_max_instances(instances: int, max_instances: int) -> int:
    """The most instances a group's lead gets while its paired intervals are wider than
    the resolution: ``LEAD_INSTANCES_FACTOR`` times ``max_instances``, or
    ``max_instances`` where that equals ``instances`` (sequential sampling off)."""
    if max_instances <= instances:
        return max_instances
    return LEAD_INSTANCES_FACTOR * max_instances


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
    resolution: float

    @property
    def lead_max_instances(self) -> int:
        return lead_max_instances(self.instances, self.max_instances)


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
        #: The sweeps so far: their first rounds' estimated seconds, and the seconds they
        #: took with their sequential rounds (the ETA scales by the ratio).
        self.swept_estimate = self.swept_actual = 0.0

    # ------------------------------------------------------------------ cost
    def cost(self, arms: int, captures: Optional[int] = None,
             instances: Optional[int] = None) -> float:
        """Estimated seconds of one group of ``arms`` arms, of which
        ``captures`` (default: all) are captured (the others switched in place),
        on ``instances`` instances each (default: the first round's).  A backend that
        derives each capture's step without forks (Backend.derives_no_forks) replays
        one more graph per capture but the first, (a)'s own."""
        p = self.prepared
        captures = arms if captures is None else captures
        instances = self.p.instances if instances is None else instances
        if not p:
            return arms * instances * 1.2 + 0.05
        replayed = arms + (max(0, captures - 1) if self.backend.derives_no_forks else 0)
        replay = self.rounds * p.step_us * 1e-6
        return instances * (captures * p.capture_s + replayed * replay) * 1.2 + 0.05

    @property
    def rounds(self) -> int:
        """Replays per graph instance in this batch's groups."""
        rounds = self.prepared.rounds if self.prepared else None
        rounds = self.backend.rounds if rounds is None else rounds
        if isinstance(rounds, bool) or not isinstance(rounds, numbers.Integral) or rounds < 1:
            raise TypeError(f"{type(self.backend).__name__}: replays per instance must be an "
                            f"int >= 1, in Prepared.rounds (from prepare()) or else the "
                            f"backend's rounds; got {rounds!r}")
        return rounds

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

    def verify_cost(self) -> float:
        """Estimated seconds of one verify sampled to the end, at most: three arms, each
        captured, rounds of ``instances`` until ``max_instances``."""
        rounds = -(-self.p.max_instances // self.p.instances)
        return rounds * self.cost(3)

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
        out.add(times, identical, self.backend.pairs, self.backend.references)
        return out

    def sample(self, label: str, arms: Mapping[str, Arm],
               checks: Mapping[str, _Check], reserve: float = 0.0,
               eta: Optional[float] = None, extend_reserve: Optional[float] = None
               ) -> _Measured:
        """A group measured sequentially: first on ``instances`` instances per arm;
        then, while a check is undecided (:class:`_Check`), its arms and (a) get
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
            if not undecided:
                return m
            n = max(1, min(self.p.instances, min(room)))
            needs = {NO_FORKS} | {key for c in undecided.values() for key in (c.x, c.y, *c.also)}
            again = {key: arm for key, arm in arms.items() if key in needs}
            # a round that takes the lead past max_instances leaves extend_reserve
            past = any(len(m.values(c.y)) >= self.p.max_instances for c in undecided.values())
            keep = extend_reserve if past and extend_reserve is not None else reserve
            if self.group_cost(again, n) + keep > self.left():
                return m
            self.group(f"{label}: {len(undecided)} undecided, more instances", again,
                       instances=n, measured=m)

    def resolved(self, m: _Measured, check: _Check) -> bool:
        """Whether the check's paired intervals, x - y and (a) - y (the candidate's gain),
        are at most ``resolution`` of the step wide (half-width).  Welch intervals
        (instances not paired) are not held to it: across independent captures the
        instance spread (0.24-4.9% of a step, issue 23) is wider than any budget narrows."""
        limit = self.p.resolution * self.report.step_us
        return all(m.diff(u, v).half_width <= limit
                   for u, v in ((check.x, check.y), (NO_FORKS, check.y)) if m.paired(u, v))

    # ------------------------------------------------------------------ steps
    def run(self) -> BatchReport:
        t0 = self.clock()
        self.prepared = self.backend.prepare(self.batch)
        self.report.step_us = self.prepared.step_us
        if self.prepared.compile_s:
            self.progress.line(f"batch {self.batch}: compiling the step (without forks, and "
                               f"with a fork at every candidate site) took "
                               f"{self.prepared.compile_s:.1f} s; the step takes "
                               f"{self.prepared.step_us:.1f} us")
        self.report.rounds = self.rounds
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
            started = self.clock()
            # a lead sampled past max_instances for the resolution alone leaves every
            # verify that may come its whole sampling: the promising roles', this one's,
            # the later roles' and the lost ones' (the layers step may make any promising)
            may_verify = len(promising) + len(lost) + len(order) - i
            whole = final_reserve + may_verify * self.verify_cost() + later
            trial = self.sweep(role, caps, rep, eta=self.eta(len(order) - i),
                               reserve=final_reserve + verify_reserve + later,
                               extend_reserve=whole)
            self.swept_estimate += self.sweep_cost(len(caps))
            self.swept_actual += self.clock() - started
            if trial is None:
                lost.append(role)
                continue
            promising.append((role, trial))

        for role, trial in list(promising):
            rep = reports[role.name]
            alternatives = self.alternatives(trial.setting)
            verify_reserve = len(promising) * self.verify_cost()
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
                                 final_reserve + len(promising) * self.verify_cost())
            if better is not None:
                promising[k] = (role, better)
        lost.sort(key=lambda r: -max(t.vs_empty.estimate for t in reports[r.name].trials))
        for role in lost:
            rep = reports[role.name]
            seed = max((t for t in rep.trials if t.stage == "sweep"),
                       key=lambda t: t.vs_empty.estimate)
            better = self.layers(role, seed, rep,
                                 final_reserve + (len(promising) + 1) * self.verify_cost())
            if better is not None:
                promising.append((role, better))
            elif any(t.stage == "layer" for t in rep.trials):
                rep.reason += "; measured per layer, no group of its layers paid"

        # The most promising first, by what each gained against (a) so far.  Roles whose
        # forks load one consumer (discovered at several sites before it) load the same
        # bytes from its start: together they pay no more than one of them, and such a plan
        # lost its confirmation (RESULTS run 22).  So once one is kept, the others are not
        # verified; where it is not kept, the next one is.
        promising.sort(key=lambda rt: -rt[1].gain.estimate)
        kept: list[tuple[Role, Trial]] = []
        loaded: dict[Any, str] = {}     # where a kept role's forks start -> that role
        starts_of = [_starts(role, trial.setting) for role, trial in promising]
        for k, (role, trial) in enumerate(promising):
            rep = reports[role.name]
            starts = starts_of[k]
            other = next((loaded[a] for a in sorted(starts) if a in loaded), None)
            if other is not None:
                rep.reason = (f"not verified: its loads start at the same weights as {other}'s, "
                              "which gained more and passed its verify")
                continue
            if not self.fits(3, final_reserve):
                rep.reason = "not verified: the budget ran out"
                continue
            # one round each: where refine and layers ran, their reserves left every verify
            # its whole sampling; where the sweep left less, the first (most promising)
            # verifies come first
            # (not counting the roles after it that a kept role already stands for)
            rest = sum(1 for later in starts_of[k + 1:] if loaded.keys().isdisjoint(later))
            later = rest * self.cost(3)
            whole = final_reserve + rest * self.verify_cost()
            verified = self.verify(role, trial.setting, rep, final_reserve + later,
                                   extend_reserve=whole)
            if verified is not None:
                kept.append((role, verified))
                loaded.update(dict.fromkeys(starts, role.name))

        self.combine_and_confirm(kept, reports)
        self.report.spread = InstanceSpread.of(self.no_forks, self.prepared.capture_s)
        self.report.elapsed_s = self.clock() - t0
        return self.report

    def eta(self, roles_left: int) -> float:
        """Seconds until the sweeps are done: each one's first round, times what the sweeps
        so far took for their first round's estimate (their sequential rounds), at most
        what is left."""
        more = self.swept_actual / self.swept_estimate if self.swept_estimate > 0 else 1.0
        return min(self.left(),
                   roles_left * self.sweep_cost(len(self.p.caps)) * more + 3 * self.cost(2))

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
        return Trial(stage, setting, mean_interval(m.reference_values(b)),
                     mean_interval(m.values(b)), mean_interval(m.values(d)),
                     m.diff(NO_FORKS, b), m.diff(d, b),
                     len(m.values(b)))

    def vs_empty_checks(self, keys: Mapping[str, tuple[Setting, str]],
                        floor: float) -> dict[str, _Check]:
        """Sequential checks of each (b) against its (d) (see :meth:`sample`)."""
        return {b: _Check(d, b, floor) for b, (_, d) in keys.items()}

    def sweep(self, role: Role, caps: list[int], rep: RoleReport, eta: float,
              reserve: float, extend_reserve: Optional[float] = None) -> Optional[Trial]:
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
                               self.vs_empty_checks(settings, self.p.min_gain_us), reserve, eta,
                               extend_reserve)
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
               reserve: float, extend_reserve: Optional[float] = None) -> Optional[Trial]:
        arms = {NO_FORKS: Arm(), EMPTY: Arm(((role.name, setting),), empty=True),
                LOADS: Arm(((role.name, setting),))}
        measured = self.sample(f"{role.name}: verify {setting.label()}", arms,
                               {"gain": _Check(NO_FORKS, LOADS, self.p.min_gain_us,
                                               also=(EMPTY,)),
                                "vs_empty": _Check(EMPTY, LOADS, 0.0)}, reserve,
                               extend_reserve=extend_reserve)
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
            a, with_plan = measured.reference_values(PLAN), measured.values(PLAN)
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


def _starts(role: Role, setting: Setting) -> set:
    """Where ``role``'s forks start loading (each one's first weight, its consumer's), at
    the layers ``setting`` forks at: the first weights' addresses (a weight without one,
    or empty: the object), not their names, which a plan's roles may not know."""
    def start(weight: Any) -> Any:
        data_ptr = getattr(weight, "data_ptr", None)
        address = data_ptr() if callable(data_ptr) else 0
        return address if isinstance(address, int) and address else id(weight)

    layers = None if setting.layers is None else set(setting.layers)
    return {start(s.weights[0]) for s in role.sites
            if s.weights and (layers is None or s.layer in layers)}


def search(backend: Backend, roles: Sequence[Role], batches: Sequence[int], *,
           budget_s: float, instances: int = MIN_INSTANCES,
           max_instances: Optional[int] = None,
           caps_mib: Sequence[float] = DEFAULT_CAPS_MIB, grids: Sequence[int] = DEFAULT_GRIDS,
           kernels: Sequence[Optional[str]] = (None,),
           graph_forks: Sequence[str] = GRAPH_FORKS,
           min_gain_us: float = DEFAULT_MIN_GAIN_US, resolution: float = DEFAULT_RESOLUTION,
           progress: Any = sys.stderr,
           clock: Callable[[], float] = time.monotonic) -> list[BatchReport]:
    """Run the search of the module's docstring for each batch; the budget is
    split evenly over the batches still to do.  ``max_instances`` (None:
    MAX_INSTANCES, or ``instances`` if more) bounds the sequential sampling;
    ``resolution`` (a share of the step) is the half-width it samples a group's
    leading candidate down to.
    Arguments are checked by :func:`l2prefetch.tuning.tune`."""
    if max_instances is None:
        max_instances = max(MAX_INSTANCES, instances)
    params = _Params(instances=instances, max_instances=max(max_instances, instances),
                     caps=tuple(int(c * MIB) for c in caps_mib),
                     grids=tuple(grids), kernels=tuple(kernels), graph_forks=tuple(graph_forks),
                     min_gain_us=min_gain_us, resolution=resolution)
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
