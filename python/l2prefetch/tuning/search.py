"""The tuner's search and acceptance, against any measurement backend.

Per batch, in this order (each step measured on fresh graph instances,
every group interleaving its measurement arms, :class:`~l2prefetch.tuning.arms.Arm`:
:data:`~l2prefetch.tuning.arms.NO_FORKS` (a), :data:`~l2prefetch.tuning.arms.LOADS` (b),
:data:`~l2prefetch.tuning.arms.EMPTY` (d), :data:`~l2prefetch.tuning.arms.PLAN`; see
:mod:`l2prefetch.tuning.arms`):

1. **prepare**: run and capture the step once (a step that fails or cannot
   be captured is a :class:`~l2prefetch.tuning.StepError`), time it, probe the windows and the
   cold-to-hot gaps where the backend can (:meth:`~l2prefetch.tuning.arms.Backend.probe`).
   A batch whose share of the budget is no more than the last batch's preparation took
   (a compiled step's compilations) and the least measuring that can ship a plan (one
   role's sweep, the combine and confirm steps) is not prepared (:data:`NOT_PREPARED`):
   nothing is measured there, and its share goes to the batches after it.
2. **screen**: a role whose gap (the most its loads could gain) is under
   ``min_gain_us`` is not measured; the rest are measured in decreasing gap.
3. **sweep**: per role, one group of (a) no forks and, in every fork mode
   (``graph_forks``, by default every one of :mod:`l2prefetch.mechanisms`),
   (d) the role's forks with empty tables and (b) its loads at each cap, with
   the default kernel and grid.  A backend that switches loader nodes in place
   (:attr:`~l2prefetch.tuning.arms.Backend.pairs`) measures a mode's (d) and (b)s inside the
   same graph instances where the mode is switchable, so their differences are paired and
   the instances' spread cancels.
4. **refine**: for roles whose best setting beat (a) and (d), in decreasing gain, one
   group with the other grids and kernels at that cap and mode, each with its own (d).
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
   where the backend pairs them: GraphBackend's ``placement="shared"``), beside the
   plan's forks with empty tables (the report splits the gain into the loads' share and
   the forks' own); if the interval of its gain is not above zero, the weakest role is
   dropped and the rest is confirmed again.  Where the budget had room for no verify, the
   lead alone is confirmed, and kept only if its loads against its empty forks are shown
   too (what its verify would have asked).  **A plan is returned only if its confirmation
   is a gain**; otherwise the batch's plan is empty, which is a valid result.

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
round, and the lead's refine (the role gaining most so far) its first round: a later
sweep gets fewer caps, or none, before the lead goes unrefined (a refined grid kept
57% of a window's ceiling where the default kept 45%, RESULTS run 28).  That refine
runs where it leaves each verify one round; the other refines, more instances of any,
and the layers step leave each verify to come the most its sequential
sampling can take (up to ``max_instances``: a worst case, so where verifies decide
early some budget goes unused; at the default budget on deepseek-v3-6l B1 the layers
step of lost roles had left two verifies one round of 5 instances, RESULTS run 16);
where that is more than is left, the verifies go in decreasing gain so far, the most
promising first.  A lead sampled past ``max_instances`` for the resolution alone
(up to twice that) gets those rounds only where every verify that may still come
keeps its whole sampling (in the sweep: the later roles' too); the verify reserve
prices ``max_instances``, not that extension.  When the budget is short the search gets
coarser (fewer caps, no refine, no layers, no more instances): roles that do not fit are
reported as not measured, promising roles left unrefined are named
(``BatchReport.not_refined``); it never returns a plan that was not confirmed.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from .arms import (DEFAULT_GRID, EMPTY, EMPTY_PLAN, LOADS, NO_FORKS, PLAN, Arm, Backend, Setting,
                   arm_key)
from .budget import LEAD_INSTANCES_FACTOR, Budget, Params, Progress, lead_max_instances
from .discovery import MIB, Role, describe_bytes
from ..mechanisms import GRAPH_FORKS
from .results import BatchReport, Confirmation, InstanceSpread, RoleReport, Trial
from .sampling import Check, Measured, Sampler
from .stats import mean_interval

__all__ = ["CONFIRMED_UNVERIFIED", "DEFAULT_CAPS_MIB", "DEFAULT_GRIDS", "DEFAULT_MIN_GAIN_US",
           "DEFAULT_RESOLUTION", "LEAD_INSTANCES_FACTOR", "MAX_INSTANCES", "MIN_INSTANCES",
           "NOTHING_MEASURED", "NOT_PREPARED", "NOT_VERIFIED", "REFUSED_OUTPUTS",
           "UNVERIFIED_LEAD_LOST", "lead_max_instances", "search"]

#: A role's reason where its verified loads changed the step's outputs.
REFUSED_OUTPUTS = "refused: outputs with its loads differ from the step's"
#: A role's reason where the plan's forks with empty tables (confirm's control) changed
#: the outputs: the forks, not the loads, at fault.
EMPTY_FORKS_DIFFER = ("dropped at confirmation: the plan's forks with empty tables changed "
                      "the outputs (a bug: report it)")
#: A role's reason where the budget had no room for its verify.
NOT_VERIFIED = "not verified: the budget ran out"
#: A role's reason where the budget had room for no verify and it, the lead, was
#: confirmed without one (its gain and its loads against its empty forks both shown).
CONFIRMED_UNVERIFIED = ("kept without a verify (the budget ran out before it): its "
                        "confirmation showed its gain, and its loads against its empty forks")
#: A batch's reason where no verify fit the budget and its lead alone was not confirmed.
UNVERIFIED_LEAD_LOST = ("no verify fit the budget, and the lead alone was not confirmed "
                        "(raise the budget: budget_s, --budget)")
#: A role's reason where the budget ran out before its sweep.
UNMEASURED = "not measured: the budget ran out"
#: A batch's reason where the budget ran out before any role was measured (tune's last
#: lines then say where the time went).
NOTHING_MEASURED = ("nothing measured: the budget ran out before the first role "
                    "(raise the budget: budget_s, --budget)")
#: A batch's reason where its share of the budget was too small to prepare it and
#: measure a role, so it was not prepared (its share went to the batches after it).
NOT_PREPARED = ("not prepared: its share of the budget was less than preparing a batch "
                "and measuring one role takes (raise the budget: budget_s, --budget)")
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
#: A role whose loads could gain less than this (us per step, summed over layers) is not measured.
DEFAULT_MIN_GAIN_US = 1.0
#: The 95% half-width, as a share of the step, that a group's leading candidate is sampled
#: down to where its comparisons are paired (issue 23: 0.05%).
DEFAULT_RESOLUTION = 0.0005


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
    params = Params(instances=instances, max_instances=max(max_instances, instances),
                    caps=tuple(int(c * MIB) for c in caps_mib),
                    grids=tuple(grids), kernels=tuple(kernels), graph_forks=tuple(graph_forks),
                    min_gain_us=min_gain_us, resolution=resolution)
    meter = Progress(progress, budget_s, clock)
    start = clock()
    reports = []
    last: Optional[_State] = None   # the last batch prepared: the next one's estimates
    for i, batch in enumerate(batches):
        share = (budget_s - (clock() - start)) / (len(batches) - i)
        measure_s = 0.0 if last is None else last.least_measure_s()
        if share <= (0.0 if last is None else last.prepare_s) + measure_s:
            # preparing would spend the batch's share (a compiled step's compilations:
            # 13-32 s a batch, RESULTS run 26) and leave nothing to measure; its share
            # goes to the batches after it
            meter.line(f"batch {batch}: {max(share, 0.0):.0f} s of the budget left for it"
                       + ("" if last is None else
                          f", less than preparing the last batch took ({last.prepare_s:.0f}"
                          f" s) and measuring one role takes ({measure_s:.0f} s)"))
            report = BatchReport(batch, reason=NOT_PREPARED)
        else:
            budget = Budget(backend, params, clock() + share, clock)   # the batch's share
            last = _State.at(backend, roles, batch, params, budget, meter, clock)
            report = _search_batch(last)
        meter.line(f"batch {batch}: {report.reason}")
        reports.append(report)
    return reports


@dataclasses.dataclass
class _State:
    """What the steps at one batch share: the backend, the budget, the sampler, the
    reports."""

    backend: Backend
    roles: list[Role]
    batch: int
    p: Params
    clock: Callable[[], float]
    budget: Budget
    sampler: Sampler
    report: BatchReport
    #: Each role's report, by name.
    reports: dict[str, RoleReport] = dataclasses.field(default_factory=dict)
    #: Seconds the prepare step took (capture, compilations, probes).
    prepare_s: float = 0.0

    @classmethod
    def at(cls, backend: Backend, roles: Sequence[Role], batch: int, params: Params,
           budget: Budget, progress: Progress, clock: Callable[[], float]) -> "_State":
        report = BatchReport(batch)
        sampler = Sampler(backend, batch, params, budget, progress, report)
        return cls(backend, list(roles), batch, params, clock, budget, sampler, report)

    @property
    def progress(self) -> Progress:
        return self.sampler.progress

    def least_measure_s(self) -> float:
        """The least a batch measures that can ship a plan, priced at this batch's step:
        one role's sweep at one cap, then the combine and confirm steps."""
        if not self.budget.prepared:
            return 0.0
        return self.budget.sweep_cost(1) + self.budget.final_estimate()


def _search_batch(st: _State) -> BatchReport:
    """The steps of the module's docstring, in order, at one batch."""
    t0 = st.clock()
    _prepare(st)                                       # 1. prepare (and probe)
    st.prepare_s = st.clock() - t0
    order = _screen(st)                                # 2. screen
    promising, lost = _sweep_roles(st, order)          # 3. sweep
    _refine_roles(st, promising)                       # 4. refine
    _layer_roles(st, promising, lost)                  # 5. layers
    kept = _verify_roles(st, promising)                # 6. verify
    chosen = _combine(st, kept)                        # 7. combine
    lead = None if chosen else _unverified_lead(st, promising)
    _confirm(st, [lead] if lead else chosen,           # 8. confirm
             unverified=lead is not None)
    st.report.spread = InstanceSpread.of(st.sampler.no_forks, st.budget.prepared.capture_s)
    st.report.elapsed_s = st.clock() - t0
    return st.report


# ---------------------------------------------------------------- 1-2. prepare, screen

def _prepare(st: _State) -> None:
    """Capture and time the step (the budget's estimates start from it), probe the roles."""
    prepared = st.budget.prepared = st.budget.check_prepared(st.backend.prepare(st.batch))
    st.report.step_us = prepared.step_us
    if prepared.compile_s:
        st.progress.line(f"batch {st.batch}: compiling the step (without forks, and with a "
                         f"fork at every candidate site) took {prepared.compile_s:.1f} s; "
                         f"the step takes {prepared.step_us:.1f} us")
    st.report.rounds = st.budget.rounds
    st.reports = {role.name: RoleReport(role.name, len(role.sites), role.max_bytes)
                  for role in st.roles}
    st.report.roles = list(st.reports.values())
    probes = st.backend.probe(st.batch, st.roles) or {}
    for name, probe in probes.items():
        if name in st.reports:
            rep = st.reports[name]
            rep.window_us, rep.gap_us = probe.window_us, probe.gap_us
            rep.chain_gap_us = probe.gap_us if probe.chain_gap_us is None \
                else probe.chain_gap_us


def _screen(st: _State) -> list[Role]:
    """The roles worth measuring, the most promising (largest gap) first."""
    order = []
    for role in st.roles:
        rep = st.reports[role.name]
        if rep.chain_gap_us is not None and rep.chain_gap_us < st.p.min_gain_us:
            rep.reason = (f"screened out: its loads could gain at most "
                          f"{rep.chain_gap_us:.2f} us per step "
                          f"(min_gain_us={st.p.min_gain_us})")
            continue
        order.append(role)
    order.sort(key=lambda r: -(st.reports[r.name].gap_us or 0.0))
    return order


# ------------------------------------------------------------------------ helpers

def _default_setting(st: _State, role: Role, cap: int) -> Setting:
    return Setting(byte_cap=cap, grid=role.default("grid", DEFAULT_GRID),
                   kernel=st.p.kernels[0], graph_fork=st.p.graph_forks[0])


def _trial(stage: str, setting: Setting, m: Measured, b: str, d: str) -> Trial:
    return Trial(stage, setting, mean_interval(m.reference_values(b)),
                 mean_interval(m.values(b)), mean_interval(m.values(d)),
                 m.diff(NO_FORKS, b), m.diff(d, b), len(m.values(b)))


def _vs_empty_checks(keys: Mapping[str, tuple[Setting, str]],
                     floor: float) -> dict[str, Check]:
    """Sequential checks of each (b) against its (d) (see :meth:`Sampler.sample`)."""
    return {b: Check(d, b, floor) for b, (_, d) in keys.items()}


# ---------------------------------------------------------------------- 3. sweep

def _sweep_roles(st: _State, order: list[Role]
                 ) -> tuple[list[tuple[Role, Trial]], list[Role]]:
    """Each role's sweep, within the budget: the promising (role, best trial) and the
    roles that lost.  Once a role is promising, the later sweeps leave the lead's (the
    most gaining so far) refine group its first round (:func:`_refine_roles`); a role
    that becomes the lead in the last sweep had only the former lead's refine held back,
    so where that prices fewer alternatives its own may not fit."""
    final_reserve = st.budget.final_reserve()
    promising: list[tuple[Role, Trial]] = []
    lost: list[Role] = []
    for i, role in enumerate(order):
        rep = st.reports[role.name]
        # one round of each verify to come, and of the lead's refine so far
        held_back = (len(promising) + 1) * st.budget.cost(3) + _lead_refine_cost(st, promising)
        caps = st.budget.caps_for(role)
        while caps and (st.budget.sweep_cost(len(caps)) + final_reserve + held_back
                        > st.budget.left()):
            caps = st.budget.coarser(caps)
        if not caps:
            rep.reason = UNMEASURED
            continue
        # the later roles' sweeps come before more instances for this one
        later = sum(st.budget.sweep_cost(len(st.budget.caps_for(r))) for r in order[i + 1:])
        started = st.clock()
        # a lead sampled past max_instances for the resolution alone leaves every
        # verify that may come its whole sampling: the promising roles', this one's,
        # the later roles' and the lost ones' (the layers step may make any promising)
        may_verify = len(promising) + len(lost) + len(order) - i
        whole = final_reserve + may_verify * st.budget.verify_cost() + later
        trial = _sweep(st, role, caps, rep, eta=st.budget.eta(len(order) - i),
                       reserve=final_reserve + held_back + later, extend_reserve=whole)
        st.budget.swept_estimate += st.budget.sweep_cost(len(caps))
        st.budget.swept_actual += st.clock() - started
        if trial is None:
            lost.append(role)
        else:
            promising.append((role, trial))
    return promising, lost


def _sweep(st: _State, role: Role, caps: list[int], rep: RoleReport, eta: float,
           reserve: float, extend_reserve: Optional[float] = None) -> Optional[Trial]:
    """One role: (a), and per fork mode its empty forks and its loads at each cap."""
    base = _default_setting(st, role, caps[0])
    arms = {NO_FORKS: Arm()}
    settings = {}
    for mode in st.p.graph_forks:
        m = dataclasses.replace(base, graph_fork=mode)
        d = arm_key(EMPTY, mode)
        arms[d] = Arm(((role.name, m),), empty=True)
        for cap in caps:
            s = dataclasses.replace(m, byte_cap=cap)
            b = arm_key(LOADS, mode, cap)
            settings[b] = (s, d)
            arms[b] = Arm(((role.name, s),))
    measured = st.sampler.sample(
        f"{role.name}: caps {', '.join(describe_bytes(c) for c in caps)}"
        f" x forks {', '.join(st.p.graph_forks)}", arms,
        _vs_empty_checks(settings, st.p.min_gain_us), reserve, eta, extend_reserve)
    trials = [_trial("sweep", s, measured, key, d) for key, (s, d) in settings.items()]
    rep.trials += trials
    best = max(trials, key=lambda t: t.gain.estimate)
    if best.gain.estimate <= 0 or best.vs_empty.estimate <= 0:
        rep.reason = (f"lost in the sweep: best {best.setting.label()} saved "
                      f"{best.gain.estimate:+.2f} us against no forks, "
                      f"{best.vs_empty.estimate:+.2f} us against empty forks")
        return None
    rep.reason = "promising after the sweep"
    return best


# --------------------------------------------------------------------- 4. refine

def _refine_roles(st: _State, promising: list[tuple[Role, Trial]]) -> None:
    """Each promising role's other grids and kernels, in decreasing gain; a better trial
    replaces the role's in ``promising``.  The lead (the first) is refined where its
    first round leaves every verify one round, as the sweeps left it; the others where
    theirs leaves every verify its whole sampling, and more instances of any refine only
    where that is left too.  A role the budget leaves unrefined is named in the report
    (``not_refined``)."""
    final_reserve = st.budget.final_reserve()
    whole = final_reserve + len(promising) * st.budget.verify_cost()
    for i, (role, trial) in enumerate(_by_gain(promising)):
        group = _refine_group(st, role, trial.setting)
        if group is None:
            continue
        first = final_reserve + len(promising) * st.budget.cost(3) if i == 0 else whole
        if st.budget.group_cost(group[0]) + first > st.budget.left():
            st.report.not_refined.append(role.name)
            continue
        better = _refine(st, role, trial, group, st.reports[role.name], whole)
        if better is not None:
            promising[promising.index((role, trial))] = (role, better)


def _by_gain(roles: list[tuple[Role, Trial]]) -> list[tuple[Role, Trial]]:
    """(role, trial)s in decreasing gain so far (stable: ties keep their order)."""
    return sorted(roles, key=lambda p: -p[1].gain.estimate)


def _lead_refine_cost(st: _State, promising: list[tuple[Role, Trial]]) -> float:
    """The first round of the lead's refine group (0 with no role promising, or nothing
    else to try): what the sweeps keep back for it."""
    if not promising:
        return 0.0
    role, trial = _by_gain(promising)[0]
    group = _refine_group(st, role, trial.setting)
    return 0.0 if group is None else st.budget.group_cost(group[0])


def _alternatives(st: _State, setting: Setting) -> list[Setting]:
    out = []
    for grid in st.p.grids:
        if grid != setting.grid:
            out.append(dataclasses.replace(setting, grid=grid))
    for kernel in st.p.kernels:
        if kernel != setting.kernel:
            out.append(dataclasses.replace(setting, kernel=kernel))
    return out


_Group = tuple[dict[str, Arm], dict[str, tuple[Setting, str]]]


def _refine_group(st: _State, role: Role, best: Setting) -> Optional[_Group]:
    """The refine group's arms, and each loads arm's (setting, empty-fork control): (a),
    ``best`` and its alternatives, each launch shape with its own (d); None where there
    is no alternative."""
    alternatives = _alternatives(st, best)
    if not alternatives:
        return None
    arms = {NO_FORKS: Arm()}
    keys: dict[str, tuple[Setting, str]] = {}
    controls: dict[tuple, str] = {}
    for i, s in enumerate([best] + alternatives):
        d = controls.get(s.launch_key())
        if d is None:
            d = arm_key(EMPTY, len(controls))
            controls[s.launch_key()] = d
            arms[d] = Arm(((role.name, s),), empty=True)
        arms[arm_key(LOADS, i)] = Arm(((role.name, s),))
        keys[arm_key(LOADS, i)] = (s, d)
    return arms, keys


def _refine(st: _State, role: Role, best: Trial, group: _Group, rep: RoleReport,
            reserve: float) -> Optional[Trial]:
    arms, keys = group
    measured = st.sampler.sample(f"{role.name}: grids and kernels at "
                                 f"{describe_bytes(best.setting.byte_cap)}", arms,
                                 _vs_empty_checks(keys, st.p.min_gain_us), reserve)
    trials = [_trial("refine", s, measured, key, d) for key, (s, d) in keys.items()]
    rep.trials += trials
    good = [t for t in trials if t.vs_empty.estimate > 0]
    return max(good, key=lambda t: t.gain.estimate) if good else None


# --------------------------------------------------------------------- 5. layers

def _layer_roles(st: _State, promising: list[tuple[Role, Trial]], lost: list[Role]) -> None:
    """The layers step for the promising roles first, then those that lost the sweep (a
    window in some layers only is averaged away by the layers where its loads cost); a
    group of layers that pays replaces the role's trial, or makes a lost role promising."""
    final_reserve = st.budget.final_reserve()
    for k, (role, trial) in enumerate(list(promising)):
        better = _layers(st, role, trial, st.reports[role.name],
                         final_reserve + len(promising) * st.budget.verify_cost())
        if better is not None:
            promising[k] = (role, better)
    lost = sorted(lost, key=lambda r: -max(t.vs_empty.estimate
                                           for t in st.reports[r.name].trials))
    for role in lost:
        rep = st.reports[role.name]
        seed = max((t for t in rep.trials if t.stage == "sweep"),
                   key=lambda t: t.vs_empty.estimate)
        better = _layers(st, role, seed, rep,
                         final_reserve + (len(promising) + 1) * st.budget.verify_cost())
        if better is not None:
            promising.append((role, better))
        elif any(t.stage == "layer" for t in rep.trials):
            rep.reason += "; measured per layer, no group of its layers paid"


def _layers(st: _State, role: Role, base: Trial, rep: RoleReport,
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
    checks: dict[str, Check] = {}
    keys: dict[str, tuple[Setting, str]] = {}
    switched = st.budget.switched(every.graph_fork)
    for layer in role.layers:
        b = arm_key(LOADS, layer)
        arms[b] = Arm(((role.name, every),), loads_at=(layer,))
        keys[b] = (dataclasses.replace(every, layers=(layer,)), EMPTY)
        # a layer's share of what is worth a fork; where the backend switches, (b)
        # every layer is measured again too (it is the graph the others switch)
        checks[b] = Check(EMPTY, b, st.p.min_gain_us / len(role.sites),
                          also=(LOADS,) if switched else ())
    compare = st.budget.cost(5, 3 if switched else None)
    if st.budget.group_cost(arms) + compare + reserve > st.budget.left():
        return None
    measured = st.sampler.sample(f"{role.name}: each of {len(role.sites)} layers' loads "
                                 f"alone at {every.label()}", arms, checks, reserve + compare)
    trials = [_trial("layer", s, measured, key, d) for key, (s, d) in keys.items()]
    rep.trials += trials
    paying = tuple(t.setting.layers[0] for t in trials if t.vs_empty.low > 0)
    if not paying or len(paying) == len(role.sites):
        return None
    return _some_layers(st, role, every, paying, rep, reserve)


def _some_layers(st: _State, role: Role, every: Setting, paying: tuple[int, ...],
                 rep: RoleReport, reserve: float) -> Optional[Trial]:
    """The paying layers as one setting beside every layer, on fresh instances."""
    some = dataclasses.replace(every, layers=paying)
    d_some, b_some = arm_key(EMPTY, "some"), arm_key(LOADS, "some")
    arms = {NO_FORKS: Arm(), EMPTY: Arm(((role.name, every),), empty=True),
            LOADS: Arm(((role.name, every),)),
            d_some: Arm(((role.name, some),), empty=True),
            b_some: Arm(((role.name, some),))}
    if st.budget.group_cost(arms) + reserve > st.budget.left():
        return None
    measured = st.sampler.group(f"{role.name}: layers {', '.join(map(str, paying))} against "
                                f"all {len(role.sites)}", arms)
    t_every = _trial("layers", every, measured, LOADS, EMPTY)
    t_some = _trial("layers", some, measured, b_some, d_some)
    rep.trials += [t_every, t_some]
    if t_some.gain.estimate > max(t_every.gain.estimate, 0.0) and t_some.vs_empty.estimate > 0:
        rep.reason = (f"promising after the layers: {some.label()} saved "
                      f"{t_some.gain.estimate:+.2f} us, every layer "
                      f"{t_every.gain.estimate:+.2f} us")
        return t_some
    return None


# --------------------------------------------------------------------- 6. verify

def _verify_roles(st: _State, promising: list[tuple[Role, Trial]]
                  ) -> list[tuple[Role, Trial]]:
    """The promising roles verified on fresh instances, the most promising first (by what
    each gained against (a) so far): the kept (role, trial)s.

    Roles whose forks load one consumer (discovered at several sites before it) load the
    same bytes from its start: together they pay no more than one of them, and such a
    plan lost its confirmation (RESULTS run 22).  So once one is kept, the others are not
    verified; where it is not kept, the next one is."""
    final_reserve = st.budget.final_reserve()
    promising = _by_gain(promising)
    kept: list[tuple[Role, Trial]] = []
    loaded: dict[Any, str] = {}     # where a kept role's forks start -> that role
    starts_of = [_starts(role, trial.setting) for role, trial in promising]
    for k, (role, trial) in enumerate(promising):
        rep = st.reports[role.name]
        starts = starts_of[k]
        other = next((loaded[a] for a in sorted(starts) if a in loaded), None)
        if other is not None:
            rep.reason = (f"not verified: its loads start at the same weights as {other}'s, "
                          "which gained more and passed its verify")
            continue
        if not st.budget.fits(3, final_reserve):
            rep.reason = NOT_VERIFIED
            continue
        # one round each: where refine and layers ran, their reserves left every verify
        # its whole sampling; where the sweep left less, the first (most promising)
        # verifies come first (not counting the roles after it that a kept role already
        # stands for)
        rest = sum(1 for later in starts_of[k + 1:] if loaded.keys().isdisjoint(later))
        later = rest * st.budget.cost(3)
        whole = final_reserve + rest * st.budget.verify_cost()
        verified = _verify(st, role, trial.setting, rep, final_reserve + later,
                           extend_reserve=whole)
        if verified is not None:
            kept.append((role, verified))
            loaded.update(dict.fromkeys(starts, role.name))
    return kept


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


def _verify(st: _State, role: Role, setting: Setting, rep: RoleReport,
            reserve: float, extend_reserve: Optional[float] = None) -> Optional[Trial]:
    arms = {NO_FORKS: Arm(), EMPTY: Arm(((role.name, setting),), empty=True),
            LOADS: Arm(((role.name, setting),))}
    measured = st.sampler.sample(f"{role.name}: verify {setting.label()}", arms,
                                 {"gain": Check(NO_FORKS, LOADS, st.p.min_gain_us,
                                                also=(EMPTY,)),
                                  "vs_empty": Check(EMPTY, LOADS, 0.0)}, reserve,
                                 extend_reserve=extend_reserve)
    trial = _trial("verify", setting, measured, LOADS, EMPTY)
    rep.trials.append(trial)
    rep.chosen = trial
    if not measured.identical.get(LOADS, True):
        rep.reason = f"{REFUSED_OUTPUTS} (a bug: report it)"
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


# ----------------------------------------------------------- 7-8. combine, confirm

def _combine(st: _State, kept: list[tuple[Role, Trial]]) -> list[tuple[str, Setting]]:
    """The kept roles in decreasing gain; where several and the budget allows, the plans
    of the first 1, 2, ... of them in one group, and the best one's roles."""
    kept = _by_gain(kept)
    chosen = [(role.name, trial.setting) for role, trial in kept]
    if not chosen:
        # roles left unmeasured for want of budget: all of them (none has a trial; roles
        # screened out have none either), or some beside roles that lost
        unmeasured = sum(r.reason == UNMEASURED for r in st.reports.values())
        st.report.reason = (
            NOTHING_MEASURED if unmeasured and not any(r.trials for r in st.reports.values())
            else "no role paid at this batch" + (f" ({unmeasured} not measured: the budget "
                                                 "ran out)" if unmeasured else ""))
        return chosen
    if len(chosen) > 1 and st.budget.fits(len(chosen) + 1, 2 * st.budget.confirm_cost()):
        arms = {NO_FORKS: Arm()}
        for n in range(1, len(chosen) + 1):
            arms[arm_key(PLAN, n)] = Arm(tuple(chosen[:n]))
        measured = st.sampler.group(f"combine {len(chosen)} kept roles", arms)
        gains = {n: measured.diff(NO_FORKS, arm_key(PLAN, n)).estimate
                 for n in range(1, len(chosen) + 1)}
        best = max(gains, key=lambda n: (gains[n], -n))
        for name, _ in chosen[best:]:
            st.reports[name].kept = False
            st.reports[name].reason = (f"dropped when combining: the first {best} kept "
                                       f"role(s) gained more without it")
        chosen = chosen[:best]
    return chosen


def _unverified_lead(st: _State, promising: list[tuple[Role, Trial]]
                     ) -> Optional[tuple[str, Setting]]:
    """Where the budget had room for no verify (every promising role's reason is
    :data:`NOT_VERIFIED`), the lead's (role name, setting): confirmation alone is on
    fresh instances, so it can stand for the verify of one role (RESULTS run 29: a
    compiled batch 8 whose compilations took twice batch 1's found +54.7 us and shipped
    nothing)."""
    if not promising or any(st.reports[role.name].reason != NOT_VERIFIED
                            for role, _ in promising):
        return None
    role, trial = _by_gain(promising)[0]
    return role.name, trial.setting


def _confirm(st: _State, chosen: list[tuple[str, Setting]], unverified: bool = False
             ) -> None:
    """The plan against (a) on fresh instances; the weakest role dropped while its
    confirmation is not a gain.  Sets the batch's plan only on a confirmed gain; with
    ``unverified`` (one role that skipped its verify, :func:`_unverified_lead`) only where
    its loads against its empty forks are shown too, as a verify asks."""
    if not chosen:
        return
    reports = st.reports
    while chosen:
        plan = tuple(chosen)
        arms = {NO_FORKS: Arm(), PLAN: Arm(plan), EMPTY_PLAN: Arm(plan, empty=True)}
        if st.budget.group_cost(arms) > st.budget.left():
            st.report.reason = "the budget ran out before the plan was confirmed"
            for name, _ in chosen:
                reports[name].kept = False
                reports[name].reason += "; not confirmed (budget)"
            return
        measured = st.sampler.group(f"confirm {len(plan)} role(s)", arms)
        a, with_plan = measured.reference_values(PLAN), measured.values(PLAN)
        conf = Confirmation(plan, mean_interval(a), mean_interval(with_plan),
                            measured.diff(NO_FORKS, PLAN), measured.identical.get(PLAN, True),
                            loads=measured.diff(EMPTY_PLAN, PLAN),
                            forks=measured.diff(NO_FORKS, EMPTY_PLAN),
                            empty_identical=measured.identical.get(EMPTY_PLAN, True))
        st.report.confirmations.append(conf)
        loads_shown = not unverified or (conf.loads is not None
                                         and conf.loads.excludes_zero_above())
        if (conf.identical and conf.empty_identical and conf.gain.excludes_zero_above()
                and loads_shown):
            st.report.plan = plan
            st.report.reason = (f"confirmed: {conf.gain.format(2)} us per step, "
                                f"{conf.ratio:.4f}x")
            if unverified:   # its row shows the confirmed setting and numbers
                rep = reports[plan[0][0]]
                rep.kept, rep.reason = True, CONFIRMED_UNVERIFIED
                rep.chosen = _trial("confirm", plan[0][1], measured, PLAN, EMPTY_PLAN)
                rep.trials.append(rep.chosen)
            return
        name, _ = chosen.pop()
        reports[name].kept = False
        reports[name].reason = (
            f"{REFUSED_OUTPUTS} (the plan with it, at confirmation)" if not conf.identical
            else EMPTY_FORKS_DIFFER if not conf.empty_identical
            else "dropped at confirmation: the plan with it was not a confirmed gain "
                 f"({conf.gain.format(2)} us)" if not conf.gain.excludes_zero_above()
            else "not verified (the budget ran out), and its confirmation did not show its "
                 "loads against its empty forks"
                 + ("" if conf.loads is None else f" ({conf.loads.format(2)} us)"))
    st.report.reason = (UNVERIFIED_LEAD_LOST if unverified
                        else "no combination of the kept roles was confirmed")
