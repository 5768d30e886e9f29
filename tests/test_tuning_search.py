"""The tuner's search and acceptance against a backend with planted effects (CPU)."""

from __future__ import annotations

import dataclasses
import io
import math
import re

import pytest

from l2prefetch.plan import GRAPH_FORKS
from l2prefetch.tuning import arms as A, results as R, search as S
from l2prefetch.tuning.errors import StepError
from l2prefetch.tuning.sampling import Measured
from l2prefetch.tuning.stats import diff_interval, mean_interval, t_quantile

from _tuning_fakes import Clock, PerLayer, PlantedBackend, role

MIB = 1 << 20


def pays(us):
    return lambda setting: us


def pays_at(cap_mib, us):
    """Gains us at cap_mib and less the further the cap is from it."""
    def gain(setting):
        return us - abs(setting.byte_cap / MIB - cap_mib) * 0.5
    return gain


def run(backend, roles, batches=(1,), budget_s=300.0, **kw):
    clock = Clock()
    backend.clock = clock
    out = io.StringIO()
    reports = S.search(backend, roles, batches, budget_s=budget_s, progress=out, clock=clock,
                       **kw)
    return reports, out.getvalue()


def by_name(report):
    return {r.role: r for r in report.roles}


# ------------------------------------------------------------------ statistics

def test_t_quantiles_match_tables():
    for df, q in ((1, 12.7062), (2, 4.3027), (4, 2.7764), (8, 2.3060), (30, 2.0423)):
        assert t_quantile(0.975, df) == pytest.approx(q, abs=2e-4)
    assert t_quantile(0.025, 4) == pytest.approx(-2.7764, abs=2e-4)
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


def test_welch_interval():
    a, b = [10, 11, 12, 10.5, 11.5], [9, 9.5, 10, 8.5, 9]
    d = diff_interval(a, b)
    assert d.estimate == pytest.approx(1.8)
    assert d.low == pytest.approx(0.777, abs=1e-3) and d.high == pytest.approx(2.823, abs=1e-3)
    assert d.excludes_zero_above()
    assert not diff_interval([1, 2, 3], [1, 2, 3]).excludes_zero_above()
    m = mean_interval([1.0, 2.0, 3.0])
    assert m.estimate == 2.0 and m.low < 2.0 < m.high
    with pytest.raises(ValueError, match="at least 2"):
        diff_interval([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="not finite"):
        mean_interval([1.0, float("nan")])


# ------------------------------------------------------------------ acceptance

def test_keeps_exactly_the_paying_role():
    """A pays; B loses; C is within noise; D pays alone but not together with A."""
    roles = [role("A"), role("B"), role("C"), role("D")]
    backend = PlantedBackend(
        {"A": pays(12.0), "B": pays(-6.0), "C": pays(0.0), "D": pays(6.0)},
        interference={frozenset({"A", "D"}): 14.0}, seed=1)
    (report,), log = run(backend, roles)
    roles_by = by_name(report)
    assert [name for name, _ in report.plan] == ["A"]
    assert roles_by["A"].kept
    assert not roles_by["B"].kept and "lost" in roles_by["B"].reason
    assert not roles_by["C"].kept
    assert not roles_by["D"].kept and "dropped" in roles_by["D"].reason
    conf = report.confirmed
    assert conf is not None and conf.gain.low > 0 and conf.ratio > 1
    assert conf.roles == report.plan
    # every measuring group holds the no-fork step, and every group interleaves its variants
    assert all(A.NO_FORKS in g for g in backend.groups)
    assert "batch 1" in log and "ETA" in log


def test_every_group_pairs_each_loads_arm_with_its_own_empty_forks():
    """Every group holds (a); in every group but combine and confirm each (b) has a (d)
    of the same fork structure (same roles, modes and layers), which the search compares
    it with; confirm holds the plan's own forks with empty tables; every key is one
    arm_key() makes (PlantedBackend parses them)."""
    backend = PlantedBackend({"A": PerLayer({1: 6.0}, layers=2, other=-3.0), "B": pays(8.0)},
                             seed=21, paired=True)
    (report,), _ = run(backend, [role("A", layers=2), role("B")])
    assert report.plan
    kinds = set()
    for group in backend.groups:
        assert group[A.NO_FORKS] == A.Arm()
        by_kind = {}
        for key, arm in group.items():
            by_kind.setdefault(A.parse_arm_key(key)[0], []).append(arm)
        kinds |= set(by_kind)
        if A.PLAN in by_kind:
            if A.EMPTY_PLAN in group:   # confirm: the plan beside its own empty forks
                assert set(by_kind) == {A.NO_FORKS, A.PLAN, A.EMPTY}
                assert group[A.EMPTY_PLAN] == A.Arm(group[A.PLAN].roles, empty=True)
            else:                       # combine: the plans of the first 1, 2, ... roles
                assert set(by_kind) == {A.NO_FORKS, A.PLAN}
            continue
        controls = {arm.structure() for arm in by_kind[A.EMPTY]}
        assert all(arm.empty for arm in by_kind[A.EMPTY])
        assert by_kind[A.LOADS] and all(not arm.empty and arm.structure() in controls
                                        for arm in by_kind[A.LOADS])
    assert kinds == set(A.ARM_KINDS)


def test_arm_keys():
    assert A.arm_key(A.NO_FORKS) == "a" and A.arm_key(A.PLAN) == "plan"
    assert A.arm_key(A.LOADS, "leaf", 4 * MIB) == "b:leaf:4194304"
    assert A.parse_arm_key("b:leaf:4194304") == (A.LOADS, ("leaf", "4194304"))
    assert A.parse_arm_key(A.arm_key(A.EMPTY, 3)) == (A.EMPTY, ("3",))
    assert A.parse_arm_key("a") == (A.NO_FORKS, ())
    with pytest.raises(ValueError, match="arm kind must be one of"):
        A.arm_key("c")
    with pytest.raises(ValueError, match="hold no ':'"):
        A.arm_key(A.LOADS, "a:b")
    for bad in ("c", "b:", "", "b::1", None):
        with pytest.raises(ValueError, match="not an arm key"):
            A.parse_arm_key(bad)


def test_empty_plan_when_nothing_pays():
    roles = [role("B"), role("C")]
    backend = PlantedBackend({"B": pays(-3.0), "C": pays(0.0)}, seed=2)
    (report,), _ = run(backend, roles)
    assert report.plan == () and report.confirmed is None
    assert report.reason == "no role paid at this batch"
    assert not any(r.kept for r in report.roles)


def test_the_sweep_finds_the_best_cap_and_verifies_it_on_fresh_instances():
    backend = PlantedBackend({"A": pays_at(16, 8.0)}, seed=3)
    (report,), _ = run(backend, [role("A", mib=64)])
    chosen = by_name(report)["A"].chosen
    assert chosen.stage == "verify" and chosen.setting.byte_cap == 16 * MIB
    stages = [t.stage for t in by_name(report)["A"].trials]
    assert stages.count("sweep") == len(S.DEFAULT_CAPS_MIB) * len(GRAPH_FORKS)
    assert "verify" in stages
    # caps are limited to what the role can load
    (small,), _ = run(PlantedBackend({"A": pays(8.0)}, seed=3), [role("A", mib=6)])
    caps = {t.setting.byte_cap for t in by_name(small)["A"].trials if t.stage == "sweep"}
    assert max(caps) == 6 * MIB and 4 * MIB in caps


def test_refine_picks_branch_or_grid_when_it_pays_more():
    def gain(s):
        return 4.0 + (6.0 if s.graph_fork == "branch" else 0.0) + (1.0 if s.grid == 64 else 0.0)
    backend = PlantedBackend({"A": gain}, seed=4)
    (report,), _ = run(backend, [role("A")])
    (name, setting), = report.plan
    assert setting.graph_fork == "branch"


@pytest.mark.parametrize("budget_s, unrefined", [(12.0, ["B"]), (30.0, [])])
def test_a_promising_role_the_budget_leaves_unrefined_is_named(budget_s, unrefined):
    """Where the budget has no room for a promising role's other grids and kernels (step
    4), the batch's report names it (tune's last lines and report: test_tuning_tune)."""
    backend = PlantedBackend({"A": pays(6.0), "B": pays(5.0), "C": pays(4.0)}, seed=11)
    (rep,), _ = run(backend, [role("A"), role("B"), role("C")], budget_s=budget_s)
    assert rep.not_refined == unrefined
    assert rep.as_dict()["not_refined"] == unrefined
    measured = [r for r in rep.roles if r.trials]
    for r in measured:
        assert any(t.stage == "refine" for t in r.trials) == (r.role not in unrefined), r.role


@pytest.mark.parametrize("budget_s", [10.0, 12.0, 15.0, 20.0])
def test_the_sweeps_keep_back_the_leads_refine(budget_s):
    """Where the budget refines some promising roles but not all, the lead (the role that
    gained most in its sweep) is refined: the later sweeps got fewer caps, or none, first
    (RESULTS run 28: a refined grid kept 57% of a window's ceiling, the default 45%).  At
    these budgets the sweeps used to leave every role unrefined."""
    backend = PlantedBackend({"A": pays(6.0), "B": pays(5.0), "C": pays(4.0)}, seed=11)
    (rep,), _ = run(backend, [role("A"), role("B"), role("C")], budget_s=budget_s)
    a = by_name(rep)["A"]
    assert "A" not in rep.not_refined
    assert any(t.stage == "refine" for t in a.trials)
    assert rep.plan and rep.plan[0][0] == "A"


def test_the_lead_is_refined_first_whatever_the_sweep_order():
    """Refine goes in decreasing gain: a lead swept last is still the one refined."""
    backend = PlantedBackend({"A": pays(4.0), "B": pays(5.0), "C": pays(7.0)}, seed=11)
    (rep,), _ = run(backend, [role("A"), role("B"), role("C")], budget_s=20.0)
    refined = [r.role for r in rep.roles if any(t.stage == "refine" for t in r.trials)]
    assert refined == ["C"] and rep.not_refined == ["A", "B"]


def test_a_role_with_nothing_else_to_try_is_not_named_unrefined():
    """One grid and no other kernel: step 4 has nothing to try, whatever the budget."""
    backend = PlantedBackend({"A": pays(6.0), "B": pays(5.0), "C": pays(4.0)}, seed=11)
    (rep,), _ = run(backend, [role("A"), role("B"), role("C")], budget_s=12.0,
                    grids=(A.DEFAULT_GRID,))
    assert rep.plan and rep.not_refined == []


class OverrunSweeps(PlantedBackend):
    """Each group of more than 5 arms (a sweep) takes ``extra_s`` longer than its
    estimate, as a compiled batch 8 did after its compilations (RESULTS run 29)."""

    def __init__(self, *args, extra_s: float = 2.5, **kw):
        super().__init__(*args, **kw)
        self.extra_s = extra_s

    def measure(self, batch, arms, instances):
        out = super().measure(batch, arms, instances)
        if len(arms) > 5:
            self.clock.t += self.extra_s
        return out


def test_a_lead_the_budget_left_no_verify_is_confirmed_alone():
    """The sweep overran: no verify fits, the confirmation does.  The lead alone is
    confirmed (fresh instances), and kept: its gain and its loads against its empty forks
    are both shown."""
    backend = OverrunSweeps({"A": pays(8.0)}, seed=5)
    (rep,), _ = run(backend, [role("A")], budget_s=9.0)
    a = by_name(rep)["A"]
    assert not any(t.stage == "verify" for t in a.trials)
    assert [name for name, _ in rep.plan] == ["A"]
    assert a.kept and a.reason == S.CONFIRMED_UNVERIFIED
    (conf,) = rep.confirmations
    assert conf.gain.low > 0 and conf.loads.low > 0
    # its chosen trial is the confirmation's: the plan's setting and numbers
    assert a.chosen.stage == "confirm" and a.chosen.setting == rep.plan[0][1]
    assert a.chosen.gain == conf.gain and a.chosen.vs_empty == conf.loads
    # its report row says it skipped the verify, not a plain "kept"
    from types import SimpleNamespace
    from l2prefetch.tuning.report import markdown

    result = SimpleNamespace(roles=[role("A")], batches=[rep], device=None, settings={},
                             step=None, versions={}, budget_s=9.0, elapsed_s=9.0)
    assert f"| {S.CONFIRMED_UNVERIFIED} |" in markdown(result)


def test_an_unverified_lead_whose_forks_alone_pay_is_not_kept():
    """Forks that pay with empty tables: the lead's confirmation shows a gain, but not its
    loads against its empty forks, which its verify would have asked: no plan."""
    backend = OverrunSweeps({"A": pays(0.3)}, fork_cost_us=-6.0, seed=5)
    (rep,), _ = run(backend, [role("A")], budget_s=9.0)
    a = by_name(rep)["A"]
    assert not any(t.stage == "verify" for t in a.trials)
    assert rep.plan == () and not a.kept
    assert rep.confirmations[0].gain.low > 0
    assert "did not show its loads against its empty forks" in a.reason
    assert rep.reason == S.UNVERIFIED_LEAD_LOST


@pytest.mark.parametrize("order", ["ABC", "BAC"])
def test_the_unverified_lead_is_the_role_that_gained_most(order):
    """Two promising roles and no verify fits: the one that gained most in its sweep
    (swept last, or first) is confirmed alone, the other stays not verified."""
    backend = OverrunSweeps({"A": pays(3.0), "B": pays(4.0), "C": pays(9.0)}, seed=5,
                            extra_s=3.0)
    (rep,), _ = run(backend, [role(name) for name in order], budget_s=14.0)
    roles = by_name(rep)
    assert all(not any(t.stage == "verify" for t in r.trials) for r in rep.roles)
    assert [name for name, _ in rep.plan] == ["B"]
    assert roles["B"].reason == S.CONFIRMED_UNVERIFIED
    assert roles["A"].reason == S.NOT_VERIFIED and roles["C"].reason == S.UNMEASURED


def test_no_unverified_lead_is_confirmed_where_a_verify_ran():
    """A verify that ran and failed is a verdict: nothing is confirmed in its place, also
    where the budget left a later role no verify."""
    backend = OverrunSweeps({"A": pays(0.6), "B": pays(0.5)}, fork_cost_us=-3.0, seed=2,
                            extra_s=0.0)
    (rep,), _ = run(backend, [role("A"), role("B")], budget_s=12.0)
    verified = [r.role for r in rep.roles if any(t.stage == "verify" for t in r.trials)]
    assert verified and not any(r.kept for r in rep.roles)
    assert rep.plan == () and rep.confirmations == []


def test_a_loss_beside_its_empty_forks_is_not_kept():
    """Loads that beat (a) but not their own empty forks do not pay for themselves."""
    backend = PlantedBackend({"A": pays(-0.2)}, fork_cost_us=-5.0, seed=5)
    (report,), _ = run(backend, [role("A")])
    assert report.plan == ()
    assert "empty forks" in by_name(report)["A"].reason


def test_screening_by_gap():
    backend = PlantedBackend({"A": pays(10.0), "B": pays(10.0)}, gaps={"A": 20.0, "B": 0.3},
                             seed=6)
    (report,), _ = run(backend, [role("B"), role("A")])
    assert "screened out" in by_name(report)["B"].reason
    assert by_name(report)["B"].trials == []
    assert [n for n, _ in report.plan] == ["A"]
    # the most promising role (largest gap) is measured first
    first = backend.groups[0]
    assert any(n == "A" for v in first.values() for n, _ in v.roles)


def test_confirmation_failure_drops_the_weakest_and_never_ships_a_loss():
    """Both pay in their own groups, but the pair loses: only the stronger one is confirmed."""
    backend = PlantedBackend({"A": pays(10.0), "D": pays(8.0)},
                             interference={frozenset({"A", "D"}): 30.0}, seed=7)
    (report,), _ = run(backend, [role("A"), role("D")])
    assert [n for n, _ in report.plan] == ["A"]
    for conf in report.confirmations:
        if conf.roles == report.plan:
            assert conf.gain.low > 0


def test_roles_that_load_one_consumer_are_verified_once():
    """A and A2 fork at two sites before the same consumer (their loads start at the same
    weights: together they pay what one does); B loads another.  A, which gained more in
    its sweep, is verified and kept; A2 is not verified and never goes into a plan."""
    backend = PlantedBackend({"A": pays(10.0), "A2": pays(8.0), "B": pays(6.0)},
                             interference={frozenset({"A", "A2"}): 8.0}, seed=31)
    a = role("A")
    (report,), _ = run(backend, [role("A2", like=a, site="y"), a, role("B")])
    assert sorted(n for n, _ in report.plan) == ["A", "B"]
    roles_by = by_name(report)
    assert not roles_by["A2"].kept
    assert roles_by["A2"].reason.startswith("not verified: its loads start at the same "
                                            "weights as A's")
    assert not any(t.stage == "verify" for t in roles_by["A2"].trials)
    for group in backend.groups:
        for key, arm in group.items():
            if A.parse_arm_key(key)[0] == A.PLAN:
                assert "A2" not in {name for name, _ in arm.roles}


class VerifyLoses(PlantedBackend):
    """Role ``loser``'s verify (the group of exactly (a), (b), (d) with its forks) shows
    no gain: its loads time as its empty forks and as (a).  Every other group is planted."""

    def __init__(self, *args, loser: str, **kw):
        super().__init__(*args, **kw)
        self.loser = loser

    def measure(self, batch, arms, instances):
        times, identical = super().measure(batch, arms, instances)
        if set(arms) == {A.NO_FORKS, A.LOADS, A.EMPTY} and \
                {n for n, _ in arms[A.LOADS].roles} == {self.loser}:
            times = {**times, A.LOADS: list(times[A.NO_FORKS]),
                     A.EMPTY: list(times[A.NO_FORKS])}
        return times, identical


def _resited(r, name, consumer, **site_fields):
    """Role ``r`` renamed, with ``consumer``, and each of its sites' fields replaced by
    ``site_fields[f](site)``."""
    sites = tuple(dataclasses.replace(s, **{f: fn(s) for f, fn in site_fields.items()})
                  for s in r.sites)
    return dataclasses.replace(r, name=name, consumer=consumer, sites=sites)


def test_roles_alike_are_those_whose_forks_start_at_one_address_not_one_name():
    """V loads A's weights through other tensor objects (views) and under other read names:
    it is A's alternative.  N names A's reads but loads its own tensors: it is not."""
    a = role("A")
    v = _resited(a, "V", "?", weights=lambda s: (s.weights[0][:],), reads=lambda s: ("?",))
    n = _resited(role("N"), "N", a.consumer, reads=lambda s: a.sites[s.layer].reads)
    backend = PlantedBackend({"A": pays(10.0), "V": pays(8.0), "N": pays(6.0)},
                             interference={frozenset({"A", "V"}): 8.0}, seed=33)
    (report,), _ = run(backend, [v, a, n])
    roles_by = by_name(report)
    assert sorted(name for name, _ in report.plan) == ["A", "N"]
    assert roles_by["V"].reason.startswith("not verified: its loads start at the same "
                                           "weights as A's")
    assert any(t.stage == "verify" for t in roles_by["N"].trials)


def test_a_consumers_next_role_is_verified_where_the_first_is_not_kept():
    """A role stands for its consumer only once kept: A fails its verify, so A2, which
    loads the same weights, is verified and kept."""
    backend = VerifyLoses({"A": pays(10.0), "A2": pays(8.0)},
                          interference={frozenset({"A", "A2"}): 8.0}, seed=32, loser="A")
    a = role("A")
    (report,), _ = run(backend, [a, role("A2", like=a, site="y")])
    roles_by = by_name(report)
    assert not roles_by["A"].kept and "not shown on fresh instances" in roles_by["A"].reason
    assert roles_by["A2"].kept
    assert [n for n, _ in report.plan] == ["A2"]


def test_where_forks_start_is_the_first_weights_address_at_the_settings_layers():
    g = role("G", layers=4)
    at_y = role("Y", layers=4, like=g, site="y")
    other = role("O", layers=4)
    every = A.Setting(byte_cap=8 * MIB, grid=32, kernel=None, graph_fork=GRAPH_FORKS[0])
    starts = S._starts(g, every)
    assert starts == {s.weights[0].data_ptr() for s in g.sites} and len(starts) == 4
    assert S._starts(at_y, every) == starts
    assert S._starts(other, every).isdisjoint(starts)
    low, high = (dataclasses.replace(every, layers=layers) for layers in ((0, 1), (2, 3)))
    # one consumer's loads at disjoint layers do not load the same bytes
    assert S._starts(g, low).isdisjoint(S._starts(at_y, high))
    assert S._starts(g, low) <= starts


def test_outputs_that_differ_refuse_the_role():
    backend = PlantedBackend({"A": pays(10.0)}, differs=frozenset({"A"}), seed=8)
    (report,), _ = run(backend, [role("A")])
    assert report.plan == ()
    assert "outputs" in by_name(report)["A"].reason


def test_per_batch_results_and_budget_split():
    backend = PlantedBackend({"A": pays(10.0)}, seed=9)
    reports, _ = run(backend, [role("A")], batches=(1, 8))
    assert [r.batch for r in reports] == [1, 8]
    assert backend.prepared == [1, 8]
    assert all(r.plan for r in reports)


def test_a_small_budget_gets_coarser_and_never_returns_an_unconfirmed_plan():
    roles = [role(n) for n in "ABCDEFGH"]
    gains = {n: pays(10.0) for n in "ABCDEFGH"}
    # Each group costs ~ arms x 5 x (0.02 + 10 x 2 ms) = 0.2 s per arm.
    (report,), _ = run(PlantedBackend(gains, seed=10), roles, budget_s=6.0)
    measured = [r for r in report.roles if r.trials]
    assert measured and len(measured) < len(roles)
    assert any("budget" in r.reason for r in report.roles)
    if report.plan:
        assert report.confirmed is not None and report.confirmed.gain.low > 0
    sweeps = [t for r in measured for t in r.trials if t.stage == "sweep"]
    assert len({t.setting.byte_cap for t in sweeps}) <= len(S.DEFAULT_CAPS_MIB)

    # Too little for anything: an empty plan, with the reason.
    (tiny,), _ = run(PlantedBackend(gains, seed=10), roles, budget_s=0.5)
    assert tiny.plan == ()
    assert all("budget" in r.reason or r.reason == "not measured" for r in tiny.roles)


def test_step_errors_propagate():
    backend = PlantedBackend({"A": pays(1.0)}, fail={8: RuntimeError("batch 8 too big")})
    with pytest.raises(StepError, match="step\\(8\\) failed"):
        run(backend, [role("A")], batches=(1, 8))


def test_the_sweep_tries_every_fork_mode_at_every_cap():
    """A role that pays only as a branch fork is found although the default (inline) loses."""
    backend = PlantedBackend({"A": lambda s: 6.0 if s.graph_fork == "branch" else -3.0}, seed=5)
    (report,), _ = run(backend, [role("A", mib=32)])
    rep = by_name(report)["A"]
    swept = {(t.setting.graph_fork, t.setting.byte_cap) for t in rep.trials if t.stage == "sweep"}
    caps = {min(int(c * MIB), 32 * MIB) for c in S.DEFAULT_CAPS_MIB}
    assert swept == {(m, c) for m in GRAPH_FORKS for c in caps}
    assert rep.kept and rep.chosen.setting.graph_fork == "branch"
    assert report.plan and report.plan[0][1].graph_fork == "branch"


def test_paired_backend_narrows_the_interval_against_empty_forks():
    """Where the backend measures (d) and (b) in the same instances, their difference is
    paired: the instance spread (3 us here) cancels, an unpaired one keeps it."""
    gains = {"A": lambda s: 1.0}
    widths = {}
    for paired in (False, True):
        backend = PlantedBackend(gains, instance_sd_us=3.0, seed=7, paired=paired)
        (report,), _ = run(backend, [role("A", mib=16)], graph_forks=("leaf",))
        sweep = [t for t in by_name(report)["A"].trials if t.stage == "sweep"]
        widths[paired] = max(t.vs_empty.half_width for t in sweep)
        assert bool(backend.pairs) == paired
    assert widths[True] < 0.5 < 2.0 < widths[False]


# ------------------------------------------------------------------ layers

@pytest.mark.parametrize("others, paired", [(-8.0, False), (-8.0, True), (-2.0, False)])
def test_a_window_in_some_layers_is_planned_for_those_layers_only(others, paired):
    """Loads pay in layers 1 and 3 of 4 and cost in the others: with -8 us the role loses
    the sweep over every layer, with -2 us it pays there but less than in 1 and 3 alone."""
    backend = PlantedBackend({"A": PerLayer({1: 6.0, 3: 6.0}, layers=4, other=others)},
                             seed=12, paired=paired)
    (report,), log = run(backend, [role("A", layers=4)])
    rep = by_name(report)["A"]
    (name, setting), = report.plan
    assert name == "A" and setting.layers == (1, 3)
    assert report.confirmed.gain.low > 0 and rep.kept and rep.chosen.setting.layers == (1, 3)
    sweep = [t for t in rep.trials if t.stage == "sweep"]
    assert sweep and all(t.setting.layers is None for t in sweep)
    if others == -8.0:
        assert max(t.gain.estimate for t in sweep) < 0   # every layer together loses
    alone = {t.setting.layers: t for t in rep.trials if t.stage == "layer"}
    assert set(alone) == {(0,), (1,), (2,), (3,)}
    assert alone[(1,)].vs_empty.low > 0 and alone[(3,)].vs_empty.low > 0
    assert alone[(0,)].vs_empty.high < 0 and alone[(2,)].vs_empty.high < 0
    every, some = [t for t in rep.trials if t.stage == "layers"]
    assert every.setting.layers is None and some.setting.layers == (1, 3)
    assert some.gain.estimate > every.gain.estimate
    # each layer's loads alone: forks at every layer, the others' tables empty, so the
    # group is one fork structure ((a), (d), (b) every layer, 4 layers alone); a switching
    # backend measures it in one graph per instance, paired
    one = [g for g in backend.groups if any(v.loads_at == (0,) for v in g.values())][0]
    assert len(one) == 3 + 4
    assert sorted(v.loads_at for v in one.values() if v.loads_at) == [(0,), (1,), (2,), (3,)]
    assert len({v.structure() for v in one.values() if v.roles}) == 1
    assert all(v.roles[0][1].layers is None for v in one.values() if v.roles)
    assert "layers 1, 3" in log


def test_per_layer_loads_narrow_their_interval_when_paired():
    """The layers step measures each layer in one structure: with a switching backend the
    instance spread (3 us here) cancels from each layer's loads against the empty forks."""
    widths = {}
    for paired in (False, True):
        backend = PlantedBackend({"A": PerLayer({1: 6.0}, layers=4, other=-8.0)},
                                 instance_sd_us=3.0, seed=5, paired=paired)
        (report,), _ = run(backend, [role("A", layers=4)], graph_forks=("leaf",))
        alone = [t for t in by_name(report)["A"].trials if t.stage == "layer"]
        assert len(alone) == 4
        widths[paired] = max(t.vs_empty.half_width for t in alone)
    assert widths[True] < 1.2 < 3.0 < widths[False]


def test_arm_loads_at():
    s = A.Setting(MIB)
    assert A.Arm((("A", s),), loads_at=[3, 1, 3]).loads_at == (1, 3)
    arm = A.Arm((("A", s),), loads_at=(1,))
    assert arm.loads(1) and not arm.loads(0)
    assert A.Arm((("A", s),)).loads(5) and not A.Arm((("A", s),), empty=True).loads(5)
    assert arm.structure() == A.Arm((("A", s),), empty=True).structure()
    with pytest.raises(ValueError, match="loads_at must be None or name at least one layer"):
        A.Arm((("A", s),), loads_at=())
    with pytest.raises(ValueError, match="loads_at must be None or name at least one layer"):
        A.Arm((("A", s),), loads_at=("1",))
    with pytest.raises(ValueError, match="an empty arm loads nowhere"):
        A.Arm((("A", s),), empty=True, loads_at=(1,))
    with pytest.raises(ValueError, match="loads_at must be None or name at least one layer"):
        A.Arm((("A", s),), loads_at=5)
    with pytest.raises(ValueError, match="the arm's roles, and it has none"):
        A.Arm(loads_at=(1,))


class UndecidedVerify(PlantedBackend):
    """A verify (the group of exactly (a), (b), (d)) that no count of instances decides:
    per instance (a) - (b) and (d) - (b) alternate +-3 us, so both intervals hold zero
    and reach past min_gain_us through 25 instances.  Every other group is planted."""

    def measure(self, batch, arms, instances):
        times, identical = super().measure(batch, arms, instances)
        if set(arms) == {A.NO_FORKS, A.LOADS, A.EMPTY}:
            swing = [3.0 if i % 2 == 0 else -3.0 for i in range(instances)]
            times = {A.LOADS: [self.step_us] * instances,
                     A.NO_FORKS: [self.step_us + s for s in swing],
                     A.EMPTY: [self.step_us + s for s in swing]}
        return times, identical


@pytest.mark.parametrize("budget_s", [50.0, 60.0, 70.0])
def test_the_layers_step_leaves_each_verify_its_whole_sequential_sampling(budget_s):
    """Each verify gets every round up to max_instances (and, as the lead, more for the
    resolution), although eight roles lost the
    sweep and their layers step, which comes before the verifies, could take the budget
    (before the reserve, at these budgets, verifies got 5-20 instances; the roles the
    layers step makes promising are verified too)."""
    gains = {"P": pays(5.0)}
    gains.update({f"L{k}": PerLayer({1: 0.6}, layers=4, other=-3.0) for k in range(8)})
    roles = [role("P", layers=1)] + [role(f"L{k}") for k in range(8)]
    backend = UndecidedVerify(gains, seed=7, paired=True, instance_sd_us=2.0)
    (report,), _ = run(backend, roles, budget_s=budget_s)
    verifies = [t for r in report.roles for t in r.trials if t.stage == "verify"]
    assert len(verifies) >= 2 and min(t.instances for t in verifies) >= S.MAX_INSTANCES
    assert all(t.gain.low <= 0 < t.gain.high for t in verifies)
    # ... and the reserve did not starve the layers step of every lost role
    assert any(t.stage == "layer" for k in range(8) for t in by_name(report)[f"L{k}"].trials)


class UndecidedAll(UndecidedVerify):
    """Also every refine group (keys ``d:<grid>...``) and layers group (arms with loads_at)
    is undecided: its loads at the step's time, its (a) and empty forks swinging +-3 us."""

    def measure(self, batch, arms, instances):
        times, identical = super().measure(batch, arms, instances)
        refine = any(A.parse_arm_key(k)[0] == A.EMPTY and A.parse_arm_key(k)[1][:1] != ()
                     and A.parse_arm_key(k)[1][0].isdigit() for k in arms)
        layers = any(arm.loads_at is not None for arm in arms.values())
        if refine or layers:
            swing = [3.0 if i % 2 == 0 else -3.0 for i in range(instances)]
            times = {k: [self.step_us] * instances if A.parse_arm_key(k)[0] == A.LOADS
                     else [self.step_us + s for s in swing] for k in times}
        return times, identical


@pytest.mark.parametrize("budget_s", [12.0, 13.0, 15.0])
def test_refine_leaves_the_verify_its_whole_sequential_sampling(budget_s):
    """Refine runs (undecided, it would sample to the end) and still leaves the verify all
    of its rounds (reserving one round, at these budgets the verify got 10-20 or none)."""
    backend = UndecidedAll({"P": pays(5.0)}, seed=7, paired=True, instance_sd_us=2.0)
    (report,), _ = run(backend, [role("P", layers=1)], budget_s=budget_s)
    trials = by_name(report)["P"].trials
    assert any(t.stage == "refine" for t in trials)
    (verify,) = [t.instances for t in trials if t.stage == "verify"]
    assert verify >= S.MAX_INSTANCES


@pytest.mark.parametrize("budget_s", [20.0, 21.0, 22.0])
def test_the_promising_roles_layers_leave_every_verify_its_whole_sequential_sampling(budget_s):
    """A promising role's layers step runs (undecided) and leaves both verifies all their
    rounds (reserving one round each, at these budgets Q's verify got 10-20)."""
    gains = {"P": PerLayer({}, layers=4, other=1.25), "Q": pays(5.0)}
    backend = UndecidedAll(gains, seed=7, paired=True, instance_sd_us=2.0)
    (report,), _ = run(backend, [role("P", layers=4), role("Q", layers=1)],
                       budget_s=budget_s, grids=(A.DEFAULT_GRID,))
    reps = by_name(report)
    assert any(t.stage == "layer" for t in reps["P"].trials)
    verifies = [t.instances for r in ("P", "Q") for t in reps[r].trials if t.stage == "verify"]
    assert len(verifies) == 2 and min(verifies) >= S.MAX_INSTANCES


@pytest.mark.parametrize("budget_s", [15.5, 16.0, 16.5, 17.0])
def test_a_verify_sampled_for_the_resolution_leaves_the_next_its_whole_sampling(budget_s):
    """Both verifies are undecided and wider than the resolution through 25 instances;
    the first may go on for the resolution alone (up to 50) only while the second keeps
    all of its 25 (taking that from it, the first got 40 and the second 5-25 here)."""
    backend = UndecidedVerify({"P": pays(5.0), "Q": pays(4.0)}, seed=7, paired=True,
                              instance_sd_us=2.0)
    (report,), _ = run(backend, [role("P", layers=1), role("Q", layers=1)], budget_s=budget_s,
                       grids=(A.DEFAULT_GRID,))
    reps = by_name(report)
    verifies = [t.instances for r in ("P", "Q") for t in reps[r].trials if t.stage == "verify"]
    assert len(verifies) == 2 and min(verifies) >= S.MAX_INSTANCES


@pytest.mark.parametrize("budget_s", [7.0, 7.5, 8.0, 9.0])
def test_a_sweep_lead_sampled_for_the_resolution_leaves_later_verifies_their_sampling(
        budget_s):
    """W's sweep lead needs 35 instances for 0.05% of a 250 us step; Q, swept after it,
    pays and its verify is undecided through 25.  W goes past 25 only where every verify
    that may come (Q's included) keeps its whole sampling (without that reserve Q's verify
    got 5-10 here)."""
    backend = UndecidedVerify({"W": pays_at(16, -10.0), "Q": pays(5.0)}, seed=3, paired=True,
                              shared=True, step_us=250.0)
    (report,), _ = run(backend, [role("W", layers=1, mib=16), role("Q", layers=1, mib=16)],
                       budget_s=budget_s, graph_forks=("leaf",), caps_mib=(8, 16),
                       grids=(A.DEFAULT_GRID,))
    reps = by_name(report)
    (verify,) = [t.instances for t in reps["Q"].trials if t.stage == "verify"]
    assert verify >= S.MAX_INSTANCES
    lead = max(t.instances for t in reps["W"].trials if t.stage == "sweep")
    assert lead > S.MAX_INSTANCES if budget_s >= 9.0 else lead >= S.MAX_INSTANCES


def test_a_role_that_pays_in_every_layer_keeps_every_layer():
    backend = PlantedBackend({"A": PerLayer({}, layers=4, other=3.0)}, seed=13, paired=True)
    (report,), _ = run(backend, [role("A", layers=4)])
    (_, setting), = report.plan
    assert setting.layers is None
    assert {t.setting.layers for t in by_name(report)["A"].trials if t.stage == "layer"} == \
        {(0,), (1,), (2,), (3,)}
    assert not any(t.stage == "layers" for t in by_name(report)["A"].trials)


def test_role_restrict_and_setting_layers():
    r = role("A", layers=4)
    assert r.restrict([3, 1]).layers == (1, 3) and r.restrict((2,)).name == "A"
    assert len(r.restrict([1, 3]).entries((1,), byte_cap=MIB)) == 2
    with pytest.raises(ValueError, match="layers must name at least one of role 'A'.*\\[7\\]"):
        r.restrict([1, 7])
    with pytest.raises(ValueError, match="layers must name at least one"):
        r.restrict([])
    with pytest.raises(TypeError, match="layers must hold ints"):
        r.restrict(["1"])
    assert A.Setting(MIB, layers=[3, 1, 3]).layers == (1, 3)
    assert "layers 1, 3" in A.Setting(MIB, layers=(1, 3)).label()
    assert A.Setting(MIB, layers=(1, 3)).as_dict()["layers"] == [1, 3]
    with pytest.raises(ValueError, match="layers must be None"):
        A.Setting(MIB, layers=())
    with pytest.raises(TypeError, match="layers must be None"):
        A.Setting(MIB, layers=3)


# ------------------------------------------------------------------ sequential sampling

def test_sequential_sampling_spends_instances_where_the_decision_is_close():
    """Against their empty forks, 'clear' saves 10 us and 'loses' costs 10: both are
    decided on the first 5 instances; 'close' saves 0.3 us, which 5 instances cannot
    tell from zero (paired noise 0.4 us): it gets more, until its interval lies above
    zero (so it did on every seed of 30 tried)."""
    gains = {"close": pays(0.3), "clear": pays(10.0), "loses": pays(-10.0)}
    roles = [role(n, layers=1, mib=16) for n in gains]
    kw = dict(graph_forks=("leaf",), caps_mib=(16,), min_gain_us=0.1)

    def sweep(report, name):
        (trial,) = [t for t in by_name(report)[name].trials if t.stage == "sweep"]
        return trial

    (report,), log = run(PlantedBackend(gains, seed=14, paired=True), roles, max_instances=30,
                         **kw)
    assert sweep(report, "clear").instances == S.MIN_INSTANCES
    assert sweep(report, "loses").instances == S.MIN_INSTANCES
    assert sweep(report, "clear").vs_empty.low > 0 and sweep(report, "loses").vs_empty.high < 0
    close = sweep(report, "close")
    assert S.MIN_INSTANCES < close.instances <= 30
    assert close.vs_empty.low > 0                      # decided, and rightly: it pays
    assert close.vs_empty.estimate == pytest.approx(0.3, abs=0.2)
    assert "undecided, more instances" in log
    verify = by_name(report)["clear"].chosen
    assert verify.stage == "verify" and verify.instances == S.MIN_INSTANCES
    # the same search without sequential sampling could not decide it
    (fixed,), log = run(PlantedBackend(gains, seed=14, paired=True), roles, max_instances=5, **kw)
    assert sweep(fixed, "close").instances == S.MIN_INSTANCES
    assert sweep(fixed, "close").vs_empty.low <= 0 < sweep(fixed, "close").vs_empty.high
    assert "undecided" not in log


def test_the_lead_of_a_group_is_sampled_down_to_the_resolution():
    """A role that clearly loses at both caps: the cap that loses less (the role's
    best, what the report shows) gets instances until its paired intervals, against
    its empty forks and against no forks, are at most 0.05% of the step wide; the
    other cap stops at the first instances.  A coarse resolution stops both there."""
    roles = [role("r", layers=1, mib=16)]
    kw = dict(graph_forks=("leaf",), caps_mib=(8, 16), max_instances=30)

    def backend():   # step 400 us: 0.05% is 0.2 us, paired noise 0.28 us per difference
        return PlantedBackend({"r": pays_at(16, -10.0)}, seed=3, paired=True, shared=True,
                              step_us=400.0)

    (report,), _ = run(backend(), roles, **kw)
    sweep = {t.setting.byte_cap // MIB: t for t in by_name(report)["r"].trials
             if t.stage == "sweep"}
    lead, other = sweep[16], sweep[8]
    assert lead.gain.estimate > other.gain.estimate
    assert lead.gain.high < 0 and other.gain.high < 0          # both lost clearly
    assert other.instances == S.MIN_INSTANCES
    assert S.MIN_INSTANCES < lead.instances <= 30
    assert lead.gain.half_width <= 0.0005 * 400.0
    assert lead.vs_empty.half_width <= 0.0005 * 400.0
    assert other.gain.half_width > 0.0005 * 400.0              # not held to it
    (coarse,), _ = run(backend(), roles, resolution=0.01, **kw)
    assert {t.instances for t in by_name(coarse)["r"].trials if t.stage == "sweep"} == \
        {S.MIN_INSTANCES}


def test_the_lead_gets_up_to_twice_max_instances_for_the_resolution_alone():
    """At max_instances=10 the lead, decided (it loses clearly) but wider than 0.05% of
    the step, gets instances up to twice that, and no further although still wider; the
    other cap stops at the first round; with sequential sampling off (max_instances ==
    instances) the lead gets no more either."""
    roles = [role("r", layers=1, mib=16)]
    kw = dict(graph_forks=("leaf",), caps_mib=(8, 16))

    def sweep(seed, max_instances):
        backend = PlantedBackend({"r": pays_at(16, -10.0)}, seed=seed, paired=True,
                                 shared=True, step_us=400.0)
        (report,), _ = run(backend, roles, max_instances=max_instances, **kw)
        trials = by_name(report)["r"].trials
        return {t.setting.byte_cap // MIB: t for t in trials if t.stage == "sweep"}, report

    (sw, report) = sweep(3, 10)
    assert sw[16].gain.high < 0 and sw[8].instances == S.MIN_INSTANCES
    assert 10 < sw[16].instances <= 20
    assert sw[16].gain.half_width <= 0.0005 * 400.0 and sw[16].vs_empty.half_width <= 0.2
    assert S.lead_max_instances(5, 10) == 20 and S.lead_max_instances(5, 5) == 5
    # seed 5 needs 25 instances: at max_instances=10 the lead stops at 20, still wider
    wide, _ = sweep(5, 10)
    assert wide[16].instances == 20 and wide[16].gain.half_width > 0.0005 * 400.0
    assert sweep(5, 15)[0][16].instances == 25
    off, _ = sweep(3, S.MIN_INSTANCES)
    assert off[16].instances == S.MIN_INSTANCES


def test_a_resolved_lead_still_undecided_stops_at_max_instances():
    """A lead whose intervals are within the resolution (1% of the step here) but still
    hold zero is sampled to max_instances like any undecided candidate, not past it."""
    roles = [role("r", layers=1, mib=16)]
    (report,), _ = run(PlantedBackend({"r": pays(0.0)}, seed=0, paired=True, shared=True,
                                      step_us=400.0), roles, graph_forks=("leaf",),
                       caps_mib=(16,), max_instances=10, min_gain_us=0.001, resolution=0.01)
    (trial,) = [t for t in by_name(report)["r"].trials if t.stage == "sweep"]
    assert trial.instances == 10 and trial.vs_empty.low <= 0 < trial.vs_empty.high
    assert trial.gain.half_width <= 0.01 * 400.0


def test_a_round_stops_at_max_instances_before_the_lead_goes_past_it():
    """instances 5, max_instances 12: the lead takes 5, 5, then 2 to reach 12, and only
    then rounds past it (for the resolution), so no round crosses max_instances
    under the reserve of one below it."""
    roles = [role("r", layers=1, mib=16)]
    (report,), log = run(PlantedBackend({"r": pays_at(16, -10.0)}, seed=5, paired=True,
                                        shared=True, step_us=400.0), roles,
                         graph_forks=("leaf",), caps_mib=(8, 16), max_instances=12)
    rounds = [int(re.search(r"arms x (\d+) instances", line).group(1))
              for line in log.splitlines() if "more instances" in line]
    assert rounds[:3] == [5, 2, 5]
    lead = max(t.instances for t in by_name(report)["r"].trials if t.stage == "sweep")
    assert 12 < lead <= 24


def test_welch_comparisons_are_not_held_to_the_resolution():
    """Unpaired instances (private placement): the lead stops once decided, since
    independent captures spread wider than any budget narrows."""
    roles = [role("r", layers=1, mib=16)]
    (report,), _ = run(PlantedBackend({"r": pays(-10.0)}, seed=3, step_us=400.0), roles,
                       graph_forks=("leaf",), caps_mib=(16,), max_instances=30)
    (trial,) = [t for t in by_name(report)["r"].trials if t.stage == "sweep"]
    assert trial.instances == S.MIN_INSTANCES and trial.gain.half_width > 0.0005 * 400.0


# ------------------------------------------------------------------ instance spread

def test_expected_min_of_k_draws():
    from itertools import product
    from l2prefetch.tuning.stats import expected_min

    xs = [3.0, 1.0, 2.0]
    for k in (1, 2, 3):
        exact = sum(min(draw) for draw in product(xs, repeat=k)) / len(xs) ** k
        assert expected_min(xs, k) == pytest.approx(exact)
    assert expected_min(xs, 1) == pytest.approx(2.0)
    assert expected_min([5.0, 5.0], 8) == pytest.approx(5.0)
    assert expected_min(xs, 200) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        expected_min(xs, 0)
    with pytest.raises(ValueError, match="at least 2 instances"):
        expected_min([1.0], 2)


def test_instance_spread_and_recommended_k():
    wide = R.InstanceSpread.of([[2000.0, 2040.0, 2080.0, 2120.0]], capture_s=0.3)
    assert wide.instances == 4 and wide.mean_us == pytest.approx(2060.0)
    assert (wide.low_us, wide.high_us) == (2000.0, 2120.0)
    assert wide.spread_pct == pytest.approx(100 * 120 / 2060)
    gains = [wide.best_of[k] for k in R.BEST_OF_KS]
    assert gains == sorted(gains) and gains[-1] < 60.0   # never more than mean - min
    k = wide.recommended_k()
    assert k in R.BEST_OF_KS and wide.best_of[k] >= 0.8 * gains[-1]
    assert all(wide.best_of[j] < 0.8 * gains[-1] for j in R.BEST_OF_KS if j < k)
    tight = R.InstanceSpread.of([[2000.0, 2000.5, 2001.0]], capture_s=0.3)
    assert tight.recommended_k() == 1       # saves under 0.1% of the step
    assert R.InstanceSpread.of([[2000.0]], capture_s=0.3) is None
    d = wide.as_dict()
    assert d["recommended_k"] == k and set(d["best_of_us"]) == {str(k) for k in R.BEST_OF_KS}
    hash(wide)                              # frozen, and its best_of read-only
    with pytest.raises(TypeError):
        wide.best_of[2] = 0.0
    zero = R.InstanceSpread.of([[0.0, 0.0]], capture_s=0.0)
    assert zero.spread_pct == 0.0 and zero.recommended_k() == 1


def test_drift_between_groups_is_not_spread_between_captures():
    """Two groups 100 us apart (the GPU got slower between them), instances within each
    identical: no capture is faster than another, so best-of-k saves nothing."""
    spread = R.InstanceSpread.of([[2000.0, 2000.0, 2000.0], [2100.0, 2100.0]], capture_s=0.3)
    assert spread.instances == 5 and spread.mean_us == pytest.approx(2040.0)
    assert spread.sd_us == pytest.approx(0.0, abs=1e-9)
    assert spread.low_us == pytest.approx(spread.high_us)
    assert all(v == pytest.approx(0.0, abs=1e-9) for v in spread.best_of.values())
    assert spread.recommended_k() == 1


def test_the_search_reports_the_spread_of_every_no_fork_instance():
    """Every group's (a) is fresh captures: the batch's spread counts all of them, and the
    report and summary say what best-of-k would save."""
    from l2prefetch.tuning import report as report_module

    backend = PlantedBackend({"A": pays(10.0)}, instance_sd_us=20.0, seed=3)
    (rep,), _ = run(backend, [role("A", layers=1, mib=16)], graph_forks=("leaf",))
    a = sum(backend.instances)
    assert rep.spread is not None and rep.spread.instances == a
    assert rep.spread.sd_us > 5.0 and rep.spread.recommended_k() > 1
    text = report_module.spread_text(rep.spread)
    assert f"{a} captures" in text and "capture_fastest(step, k=" in text
    assert rep.as_dict()["spread"]["instances"] == a


def test_shared_placement_pairs_the_gain_against_no_forks():
    """Where every arm of an instance index shares its placement (GraphBackend's
    placement="shared"), a loads arm's gain over (a) is paired too: the instance spread
    (20 us here, 1% of the step) cancels from its interval, and 6 us of gain that the
    unpaired search cannot show is confirmed."""
    widths = {}
    for shared in (False, True):
        backend = PlantedBackend({"A": pays(6.0)}, instance_sd_us=20.0, seed=9,
                                 paired=True, shared=shared)
        (report,), _ = run(backend, [role("A", layers=1, mib=16)], graph_forks=("leaf",),
                           budget_s=120)
        sweep = [t for t in by_name(report)["A"].trials if t.stage == "sweep"]
        widths[shared] = max(t.gain.half_width for t in sweep)
        if shared:
            assert report.confirmed is not None and report.confirmed.gain.low > 0
            assert report.confirmed.gain.half_width < 1.0
        # each instance index is a placement of its own: (a)'s spread is still reported
        assert report.spread is not None
    assert widths[True] < 1.0 < 10.0 < widths[False]


def test_each_arm_is_paired_with_its_own_step_without_forks():
    """Two captures into one pool still land apart (RESULTS run 18: a pattern of up to
    +-7 us per instance between (a) and the empty forks at deepseek-v3-6l B1). Planted
    here as 5 us per capture: against (a)'s own captures a 3 us gain is lost in it and
    the plan stays empty; where the backend replays each capture without its forks
    (Backend.references) the search compares with that, its intervals are as narrow as
    the switched states' own noise, and the gain is kept and confirmed."""
    results = {}
    for derives in (False, True):
        backend = PlantedBackend({"A": pays(3.0)}, instance_sd_us=20.0, capture_sd_us=5.0,
                                 seed=1, paired=True, shared=True, derives=derives)
        (report,), _ = run(backend, [role("A", layers=1, mib=16)], graph_forks=("leaf",),
                           budget_s=120)
        sweep = [t for t in by_name(report)["A"].trials if t.stage == "sweep"]
        results[derives] = (max(t.gain.half_width for t in sweep), report)
    (wide, before), (narrow, after) = results[False], results[True]
    assert narrow < 1.0 < 2.5 < wide, (narrow, wide)
    assert not before.plan and after.confirmed is not None
    assert after.confirmed.gain.low > 0 and abs(after.confirmed.gain.estimate - 2.5) < 0.5
    # what the report says (a) is, is what the gain was taken against: a - b is the gain
    conf = after.confirmed
    assert conf.a.estimate - conf.plan.estimate == pytest.approx(conf.gain.estimate)
    for t in by_name(after)["A"].trials:
        assert t.a.estimate - t.b.estimate == pytest.approx(t.gain.estimate), t.stage
    # (a)'s own captures are still measured: the instance spread and the bitwise reference
    assert after.spread is not None and after.spread.instances >= 5


def test_measured_pairs_a_with_each_rounds_reference():
    """Measured.diff(a, y) takes, round by round, y's own step without forks where the
    round has one (the keys differ between rounds when the captured head does), and (a)
    itself elsewhere; paired only if every round is."""
    m = Measured()
    m.add({"a": [10.0, 20.0], "b:x": [9.0, 19.0], "a:of:b:x": [12.0, 22.0]}, {},
          [{"a", "b:x", "a:of:b:x"}], {"b:x": "a:of:b:x"})
    m.add({"a": [30.0, 40.0], "b:x": [29.0, 39.0], "a:of:d:x": [33.0, 43.0]}, {},
          [{"a", "b:x", "a:of:d:x"}], {"b:x": "a:of:d:x"})
    gain = m.diff("a", "b:x")
    assert m.paired("a", "b:x") and gain.estimate == pytest.approx(3.5)
    assert m.diff("b:x", "a").estimate == pytest.approx(-3.5)
    m.add({"a": [50.0, 60.0], "b:x": [49.0, 59.0]}, {}, [{"a", "b:x"}])   # no reference
    assert m.diff("a", "b:x").estimate == pytest.approx((3 + 3 + 4 + 4 + 1 + 1) / 6)
    m.add({"a": [70.0], "b:x": [69.0], "a:of:b:x": [71.0]}, {}, [{"b:x", "a:of:b:x"}],
          {"b:x": "a:of:b:x"})
    assert m.paired("a", "b:x")                       # the reference is paired
    m.add({"a": [70.0], "b:x": [69.0], "a:of:b:x": [71.0]}, {}, [], {"b:x": "a:of:b:x"})
    assert not m.paired("a", "b:x")                   # a round that did not pair


def test_the_estimate_counts_the_graphs_replayed_without_forks():
    """A backend that derives each capture's step without forks replays one more graph
    per capture but (a)'s: a sweep's estimate grows by those replays."""
    costs = {}
    for derives in (False, True):
        backend = PlantedBackend({"A": pays(3.0)}, seed=1, paired=True, shared=True,
                                 derives=derives, step_us=20000.0)
        (report,), out = run(backend, [role("A", layers=1, mib=16)], budget_s=600.0)
        first = out.splitlines()[0]
        assert "(13 arms x 5 instances" in first, first
        costs[derives] = float(first[first.rindex("~") + 1:].split()[0])
    # 4 captures (a and three modes) and 13 graphs replayed, 10 x 20 ms each, per
    # instance, +20%: 3 more graphs replayed add 3 x 5 x 0.2 s x 1.2 = 3.6 s
    assert costs[True] - costs[False] == pytest.approx(3.6, abs=1.0)


class PreparedRounds(PlantedBackend):
    """prepare() says the replays per instance at each batch (as GraphBackend does by
    the step's time); the backend's own rounds are None."""

    rounds = None

    def __init__(self, gains, rounds_at, **kw):
        super().__init__(gains, **kw)
        self.rounds_at = rounds_at

    def prepare(self, batch):
        p = super().prepare(batch)
        return A.Prepared(p.step_us, p.capture_s, rounds=self.rounds_at[batch])

    def measure(self, batch, arms, instances):
        self.rounds = self.rounds_at[batch]   # what the fake's clock charges
        try:
            return super().measure(batch, arms, instances)
        finally:
            self.rounds = None


def test_the_search_counts_the_replays_each_batch_prepared():
    """The budget's estimate and the report use Prepared.rounds: 4x the replays make the
    first group's estimate larger, and each batch reports its own."""
    estimates = {}
    for rounds in (10, 40):
        backend = PreparedRounds({"A": pays(3.0)}, {1: rounds, 8: 10}, seed=1)
        reports, out = run(backend, [role("A")], batches=(1, 8), budget_s=60.0)
        assert [r.rounds for r in reports] == [rounds, 10]
        first = out.splitlines()[0]
        estimates[rounds] = float(first[first.rindex("~") + 1:].split()[0])
    assert estimates[40] > 1.5 * estimates[10]
    backend = PlantedBackend({"A": pays(3.0)}, seed=1)          # Prepared.rounds None
    (report,), _ = run(backend, [role("A")], budget_s=30.0)
    assert report.rounds == backend.rounds == 10


def test_a_backend_that_says_no_replays_is_refused():
    """rounds None and prepare() without Prepared.rounds: the budget cannot be estimated;
    a TypeError names the contract (before, the estimate silently counted 1 replay)."""
    backend = PreparedRounds({"A": pays(3.0)}, {1: None}, seed=1)
    with pytest.raises(TypeError, match="PreparedRounds: replays per instance must be an int "
                                        ">= 1, in Prepared.rounds .* got None"):
        run(backend, [role("A")], budget_s=30.0)


class SlowSweeps(PlantedBackend):
    """Every sweep group (keys with a mode and a cap) undecided: its (a) and empty forks
    swing +-3 us per instance, so each sweep samples to max_instances; records the clock
    before each group and whether it was a sweep's."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.log = []

    def measure(self, batch, arms, instances):
        sweep = any(len(A.parse_arm_key(k)[1]) == 2 for k in arms)
        self.log.append((self.clock.t, sweep))
        times, identical = super().measure(batch, arms, instances)
        if sweep:
            swing = [3.0 if i % 2 == 0 else -3.0 for i in range(instances)]
            times = {k: [self.step_us] * instances if A.parse_arm_key(k)[0] == A.LOADS
                     else [self.step_us + s for s in swing] for k in times}
        return times, identical


def test_the_eta_counts_the_sequential_rounds_the_sweeps_so_far_took():
    """Each sweep takes five rounds where its estimate counts one: from the second sweep
    on, the ETA is the sweeps' time still to come (before: a third to a fifth of it)."""
    backend = SlowSweeps({f"R{k}": pays(0.0) for k in range(4)}, seed=3)
    (report,), out = run(backend, [role(f"R{k}") for k in range(4)], budget_s=600.0)
    etas = [(float(line.split()[2].split("/")[0]), float(line.split("ETA ")[1].split()[0]))
            for line in out.splitlines() if "ETA" in line]
    assert len(etas) == 4
    after = [t for t, sweep in backend.log if not sweep]
    sweeps_done = after[0] if after else backend.clock.t
    for elapsed, eta in etas[1:]:
        assert 0.9 * (sweeps_done - elapsed) <= eta <= 1.5 * (sweeps_done - elapsed) + 2


def test_the_steps_keep_back_what_the_sweep_priced_for_the_confirmation(monkeypatch):
    """The reserve for combine and confirm is priced once, after prepare: a backend that
    stops deriving each arm's step without forks (GraphBackend on a driver that cannot
    remove graph nodes) prices groups lower from then on, but the later steps keep back
    what the sweep did."""
    class Flips(PlantedBackend):
        def measure(self, batch, arms, instances):
            out = super().measure(batch, arms, instances)
            self.derives_no_forks = False
            return out

    seen = []
    real = S._verify
    monkeypatch.setattr(S, "_verify", lambda st, r, s, rep, reserve, extend_reserve=None: (
        seen.append((reserve, st.budget.final_reserve(), 3 * st.budget.cost(3))),
        real(st, r, s, rep, reserve, extend_reserve))[1])
    clock = Clock()
    backend = Flips({"A": pays(8.0)}, clock=clock, derives=True, capture_s=0.02)
    S.search(backend, [role("A")], [1], budget_s=600, progress=None, clock=clock)
    assert seen
    reserve, pinned, now = seen[0]
    assert now < pinned and reserve == pytest.approx(pinned)


@pytest.mark.parametrize("fork_cost_us", [0.5, -3.0])
def test_the_confirmation_splits_the_gain_into_the_loads_and_the_forks_own(fork_cost_us):
    """Confirm measures the plan's forks with empty tables beside it: ``loads`` (empty -
    plan) is the loads' gain whatever the forks alone do, ``forks`` (a - empty) is what
    they do: a cost, or a gain where their topology alone speeds the step (branch forks
    in compiled steps, RESULTS run 24), which ``gain`` (a - plan) holds as well."""
    backend = PlantedBackend({"A": pays(8.0)}, seed=5, paired=True, fork_cost_us=fork_cost_us)
    (report,), _ = run(backend, [role("A")])
    conf = report.confirmed
    assert conf is not None and conf.loads is not None and conf.forks is not None
    assert abs(conf.loads.estimate - 8.0) < 0.5 and conf.loads.low > 0
    assert abs(conf.forks.estimate + fork_cost_us) < 0.5
    assert abs(conf.gain.estimate - (8.0 - fork_cost_us)) < 0.5
    data = conf.as_dict()
    assert data["loads"]["estimate"] == conf.loads.estimate
    assert data["forks"]["estimate"] == conf.forks.estimate


class SlowToPrepare(PlantedBackend):
    """Preparing a batch takes ``prepare_s`` on the clock, as a compiled step's
    compilations do (13-32 s a batch, RESULTS run 26)."""

    def __init__(self, *args, prepare_s=30.0, **kw):
        super().__init__(*args, **kw)
        self.prepare_s = prepare_s

    def prepare(self, batch):
        self.clock.t += self.prepare_s
        return super().prepare(batch)


def test_a_batch_whose_share_is_less_than_the_last_preparation_is_not_prepared():
    """The budget split left batch 8 less than preparing batch 1 took: batch 8 is not
    prepared (no compilations past the budget), and says why."""
    backend = SlowToPrepare({"A": pays(8.0)}, seed=3, prepare_s=30.0)
    (first, second), log = run(backend, [role("A")], batches=(1, 8), budget_s=50.0)
    assert backend.prepared == [1]
    assert first.step_us == backend.step_us
    assert second.reason == S.NOT_PREPARED and math.isnan(second.step_us)
    assert "raise the budget" in second.reason
    assert re.search(r"batch 8: \d+ s of the budget left for it, less than preparing the "
                     r"last batch took \(30 s\) and measuring one role takes \(\d+ s\)", log)
    # with a share larger than the last preparation, every batch is prepared
    backend = SlowToPrepare({"A": pays(8.0)}, seed=3, prepare_s=1.0)
    run(backend, [role("A")], batches=(1, 8), budget_s=300.0)
    assert backend.prepared == [1, 8]
    # nothing left at all: not even the first batch, and no preparation is named
    backend = SlowToPrepare({"A": pays(8.0)}, seed=3)
    (only,), log = run(backend, [role("A")], budget_s=0.0)
    assert backend.prepared == [] and only.reason == S.NOT_PREPARED
    assert "batch 1: 0 s of the budget left for it\n" in log
    assert "preparing the last batch" not in log


def test_a_share_that_covers_the_preparation_but_no_measuring_is_not_prepared():
    """Preparing batch 1 took 30 s; batch 8's share (31 s of 62) covers that but not one
    role's sweep and the confirmations after it: it is not prepared either (the waste of
    compiling a batch that can measure nothing)."""
    backend = SlowToPrepare({"A": pays(8.0)}, seed=3, prepare_s=30.0)
    (_, second), _ = run(backend, [role("A")], batches=(1, 8), budget_s=62.0)
    assert backend.prepared == [1] and second.reason == S.NOT_PREPARED


def test_a_batch_not_prepared_passes_its_share_to_the_batches_after_it():
    """Batch 8's share is too small, batch 16 gets its share and batch 8's, and is
    prepared: each batch's verdict says which happened."""
    backend = SlowToPrepare({"A": pays(8.0)}, seed=3, prepare_s=40.0)
    (first, second, third), log = run(backend, [role("A")], batches=(1, 8, 16),
                                      budget_s=100.0)   # shares 33, 30, 60 s
    assert backend.prepared == [1, 16]
    assert first.reason == S.NOTHING_MEASURED   # its 33 s went to its 40 s preparation
    assert second.reason == S.NOT_PREPARED and math.isnan(second.step_us)
    assert third.confirmed is not None and not math.isnan(third.step_us)
    assert "batch 16: confirmed" in log


def test_a_budget_spent_before_the_first_role_says_so_not_that_nothing_paid():
    backend = PlantedBackend({"A": pays(8.0)}, seed=3)
    (report,), log = run(backend, [role("A"), role("B")], budget_s=0.05)
    assert report.reason == S.NOTHING_MEASURED and "raise the budget" in report.reason
    assert all(r.reason == "not measured: the budget ran out" for r in report.roles)
    assert S.NOTHING_MEASURED in log
    # a role measured and lost is no budget shortage
    backend = PlantedBackend({"A": pays(-3.0)}, seed=3)
    (report,), _ = run(backend, [role("A")])
    assert report.reason == "no role paid at this batch"


class EmptyPlanDiffers(PlantedBackend):
    """The confirmation's empty plan (forks with empty tables) changes the outputs."""

    def measure(self, batch, arms, instances):
        times, identical = super().measure(batch, arms, instances)
        if A.EMPTY_PLAN in arms:
            identical = {**identical, A.EMPTY_PLAN: False}
        return times, identical


def test_empty_forks_that_change_the_outputs_at_confirmation_are_not_blamed_on_the_loads():
    (report,), _ = run(EmptyPlanDiffers({"A": pays(8.0)}, seed=5, paired=True),
                       [role("A")])
    assert report.plan == () and report.confirmed is None
    (conf,) = report.confirmations
    assert conf.identical and not conf.empty_identical
    rep = by_name(report)["A"]
    assert not rep.kept and rep.reason == S.EMPTY_FORKS_DIFFER
    assert not rep.reason.startswith(S.REFUSED_OUTPUTS)


def test_the_confirmation_is_priced_as_the_backend_captures_it():
    """A backend that switches the plan and its empty forks in one graph captures two
    graphs per instance for a confirmation, not three (GraphBackend, placement shared)."""
    for paired, captures in ((True, 2), (False, 3)):
        backend = PlantedBackend({"A": pays(8.0)}, seed=5, paired=paired)
        params = S.Params(instances=5, max_instances=25, caps=(4 << 20,), grids=(32,),
                          kernels=(None,), graph_forks=tuple(GRAPH_FORKS), min_gain_us=1.0,
                          resolution=5e-4)
        budget = S.Budget(backend, params, 1e9, lambda: 0.0)
        budget.prepared = backend.prepare(1)
        assert budget.confirm_cost() == pytest.approx(budget.cost(3, captures))
        plan = (("A", A.Setting(4 << 20)),)
        arms = {A.NO_FORKS: A.Arm(), A.PLAN: A.Arm(plan),
                A.EMPTY_PLAN: A.Arm(plan, empty=True)}
        assert budget.group_cost(arms) == pytest.approx(budget.confirm_cost())
