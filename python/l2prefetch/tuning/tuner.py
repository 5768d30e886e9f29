"""``tune()``: find the fork points that pay for a model on this GPU, and prove them.

See :mod:`l2prefetch.tuning.search` for the procedure and its acceptance
rule, :mod:`l2prefetch.tuning.rig` for how steps are measured, and
:mod:`l2prefetch.profile` for the file a server loads.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from .. import _C, hooks
from ..mechanisms import GRAPH_FORKS, graph_fork_choices
from ..model_paths import compiled_module
from ..plan import check_batches
from .discovery import Role, check_candidates, resolve_roles
from ..profile import (EAGER_STEP, describe_step, profile_document, save_profile, step_compiled,
                       step_mode, step_record, versions)
from . import measure  # GraphBackend looked up when tune() runs (the tests replace it)
from .arms import Backend, Setting
from .compiled import (COMPILE_MODES, OWN_GRAPH_MODES, compilations_differ, own_graphs,
                       recompile, step_is_compiled)
from .errors import StepError
from .report import markdown, plot
from .results import BatchReport
from .search import (CONFIRMED_UNVERIFIED, DEFAULT_CAPS_MIB, DEFAULT_GRIDS,
                     DEFAULT_MIN_GAIN_US, DEFAULT_RESOLUTION, MAX_INSTANCES, MIN_INSTANCES,
                     NOT_PREPARED, NOTHING_MEASURED, REFUSED_OUTPUTS, lead_max_instances,
                     search)

__all__ = ["TuneResult", "check_max_instances", "tune"]

logger = logging.getLogger(__name__)

#: Loaders the refine step tries besides the device's default (where the device has them):
#: 16-byte loads and the bulk L2 prefetch (benchmarks/RESULTS.md, "glue": the loaders differ
#: most beside small kernels).
ALTERNATIVE_KERNELS = ("load", "bulk_prefetch")


@dataclasses.dataclass
class TuneResult:
    """What :func:`tune` found: per batch the roles measured and the confirmed plan.

    ``plan`` is the merged plan (one :class:`~l2prefetch.plan.PlanEntry` per
    kept role, layer and setting, holding the batches where it was kept);
    ``sites`` the fork site of each (point, layer): ``(path, layer)``, or
    ``(path, layer, "before")`` for a site hooked before its module; ``batches`` the
    per-batch reports.  An empty plan is a valid, common result.
    """

    batches: list[BatchReport]
    roles: list[Role]
    plan: list
    sites: dict[str, list[tuple]]
    budget_s: float
    elapsed_s: float
    settings: dict
    device: Optional[dict] = None
    versions: Optional[dict] = None
    #: How the tuned step ran (:func:`l2prefetch.profile.step_record`): eager, or
    #: compiled with its Inductor mode; a profile refuses a step run the other way.
    step: dict = dataclasses.field(default_factory=lambda: dict(EAGER_STEP))

    @property
    def empty(self) -> bool:
        return not self.plan

    def summary(self) -> str:
        """A line saying how the step ran, then one per batch: what was kept and the
        confirmed ratio."""
        lines = [f"tuned on the {describe_step(self.step)} step: its profile applies to "
                 f"{'compiled steps only' if step_compiled(self.step) else 'eager steps only'}"]
        for rep in self.batches:
            conf = rep.confirmed
            if conf is None:
                lines.append(f"batch {rep.batch}: empty plan ({rep.reason})")
            else:
                low, high = conf.ratio_interval
                roles = ", ".join(f"{name} [{s.label()}]" for name, s in rep.plan)
                lines.append(f"batch {rep.batch}: {conf.ratio:.4f}x ({low:.4f}-{high:.4f}), "
                             f"{conf.gain.format(2)} us per step: {roles}")
            spread = rep.spread
            if spread is not None and spread.recommended_k() > 1:
                k = spread.recommended_k()
                lines.append(f"batch {rep.batch}: graph captures of the step differ by "
                             f"{spread.spread_pct:.2f}%; keeping the fastest of {k} "
                             f"(l2prefetch.graphs.capture_fastest) is expected to save "
                             f"{spread.best_of[k]:.1f} us per step")
        return "\n".join(lines)

    # ---------------------------------------------------------------- profile
    def to_profile(self, model: Any) -> dict:
        """The profile's JSON object for ``model`` (:func:`l2prefetch.profile.profile_document`)."""
        return profile_document(
            model, self.plan, self.sites, batches=[rep.batch for rep in self.batches],
            device=self.device, versions=self.versions, step=self.step,
            tuning={"budget_s": self.budget_s, "elapsed_s": self.elapsed_s, **self.settings},
            results=[rep.as_dict() for rep in self.batches])

    def save(self, path: Union[str, os.PathLike], model: Any) -> None:
        """Write the profile for ``model`` to ``path`` (atomically: a temporary file
        renamed into place, so a server never reads half a profile)."""
        if self.device is None:
            raise ValueError("this result has no device fingerprint (it was not measured on a "
                             "GPU), so it cannot be saved as a profile")
        save_profile(path, self.to_profile(model))

    # ---------------------------------------------------------------- report
    def markdown(self) -> str:
        """The report: per batch the verdict, then per role what was measured."""
        return markdown(self)

    def plot(self, path: Union[str, os.PathLike]) -> bool:
        """A PNG of each role's gain against no forks, with intervals, per batch.
        Returns False (and draws nothing) where matplotlib is not installed."""
        return plot(self, os.fspath(path))


def _check_number(name: str, value: object, low: float, integer: bool = False) -> Any:
    """``value`` as a plain int or float (a numpy scalar too: the profile is JSON) that
    is at least ``low``; else a TypeError/ValueError naming ``name``."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} must be {'an int' if integer else 'a number'} >= {low}, got "
                        f"{type(value).__name__} {value!r}")
    if not (value >= low) or (not integer and not math.isfinite(value)):
        raise ValueError(f"{name} must be {'an int' if integer else 'a finite number'} >= {low}, "
                         f"got {value!r}")
    return _plain(value)


def _plain(value: Any) -> Any:
    """A checked number as a Python int (an integral one) or float."""
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _check_compiled(compiled: object) -> Optional[str]:
    """The Inductor mode ``tune(compiled=...)`` names (None: not named)."""
    if compiled is None or isinstance(compiled, bool):
        return None
    if not isinstance(compiled, str) or not compiled.strip():
        error = ValueError if isinstance(compiled, str) else TypeError
        raise error(f"compiled must be None (found out), a bool, or the Inductor mode "
                    f"the step was compiled with (e.g. 'default'), got {compiled!r}")
    if compiled not in COMPILE_MODES:
        raise ValueError(f"compiled={compiled!r}: the tuner measures steps compiled in the "
                         f"Inductor modes {', '.join(map(repr, COMPILE_MODES))}, which leave "
                         "CUDA graphs to the caller; "
                         + (f"{compiled!r} captures CUDA graphs of its own: compile the step "
                            "in one of those (the server's capture then holds the forks)"
                            if compiled in OWN_GRAPH_MODES else
                            "('reduce-overhead' and 'max-autotune' capture their own); pass "
                            "compiled=True for other torch.compile settings"))
    return compiled


def merge_plan(roles: Sequence[Role], reports: Sequence[BatchReport], *,
               warm_activation: bool = False) -> tuple[list, dict]:
    """One plan for all batches: an entry per kept (role, setting) and layer, holding the
    batches where that setting was confirmed at that layer (a setting for a group of
    layers covers those only), each with ``warm_activation`` as measured; and each
    point's sites (:meth:`RoleSite.hook_site`), by layer."""
    by_name = {role.name: role for role in roles}
    batches_of: dict[tuple[str, Setting], dict[int, list[int]]] = {}
    for rep in reports:
        for name, setting in rep.plan:
            layers = by_name[name].layers if setting.layers is None else setting.layers
            per_layer = batches_of.setdefault((name, dataclasses.replace(setting, layers=None)),
                                              {})
            for layer in layers:
                per_layer.setdefault(layer, []).append(rep.batch)
    plan, sites = [], {}
    for (name, setting), per_layer in batches_of.items():
        layers_of: dict[tuple[int, ...], list[int]] = {}
        for layer, batches in per_layer.items():
            layers_of.setdefault(tuple(sorted(batches)), []).append(layer)
        for batches, layers in layers_of.items():
            role = by_name[name].restrict(layers)
            plan += role.entries(batches, byte_cap=setting.byte_cap, grid=setting.grid,
                                 kernel=setting.kernel, graph_fork=setting.graph_fork,
                                 warm_activation=warm_activation)
            point_sites = sites.setdefault(name, [])
            for site in role.sites:
                if site.hook_site() not in point_sites:
                    point_sites.append(site.hook_site())
    for point_sites in sites.values():
        point_sites.sort(key=lambda site: site[1])
    return plan, sites


def tune(model: Any, step: Callable[[int], Any], batches: Sequence[int], *,
         candidates: Optional[Sequence[Union[str, Role]]] = None, budget_s: float = 300,
         instances: int = MIN_INSTANCES, max_instances: Optional[int] = None,
         rounds: Optional[int] = None,
         caps_mib: Sequence[float] = DEFAULT_CAPS_MIB, grids: Sequence[int] = DEFAULT_GRIDS,
         kernels: Optional[Sequence[Optional[str]]] = None,
         graph_forks: Sequence[str] = GRAPH_FORKS,
         min_gain_us: float = DEFAULT_MIN_GAIN_US, min_bytes: int = 1 << 20,
         resolution: float = DEFAULT_RESOLUTION, device: Any = None, progress: Any = sys.stderr,
         backend: Optional[Backend] = None,
         compiled: Union[None, bool, str] = None) -> TuneResult:
    """Measure which prefetches pay for ``model`` on this GPU, and return the confirmed plan.

    ``step(batch)`` runs one capturable decode step at that batch on static
    buffers (:class:`~l2prefetch.tuning.hf.DecodeStep` is one for Hugging Face
    causal LMs) and returns its output; it is called eagerly to warm up and
    inside ``torch.cuda.graph`` to capture, so each replay must do the same
    work.  ``candidates``: None to discover the roles from one eager step at
    the first batch (:func:`~l2prefetch.tuning.discover`, reads of at least
    ``min_bytes``), role names to measure only those, or :class:`Role` objects
    (e.g. from :func:`~l2prefetch.tuning.roles_from_plan`).

    ``budget_s`` bounds the measuring (seconds, all batches together);
    ``instances`` graph instances per measurement arm (at least 5), ``rounds`` replays
    of each per group (None: per batch, about 40 ms of the step, 10-20:
    :func:`~l2prefetch.tuning.measure.rounds_for`); a candidate whose interval is still
    undecided gets ``instances`` more at a time up to ``max_instances`` (None: 25, or
    ``instances`` if more; equal to ``instances``: no sequential sampling).
    Each measured group's leading candidate is also sampled, for that alone up to
    twice that bound, until its paired 95% intervals are at most ``resolution`` of
    the step wide (half-width; default 0.0005, 0.05%).
    The search covers ``caps_mib``, ``grids``, ``kernels`` (None: the device's
    default; names from :func:`l2prefetch.kernel_variants`) and
    ``graph_forks``; the first of each list is the default setting, and each
    role's layers alone and in groups (:attr:`~l2prefetch.tuning.Setting.layers`).
    ``progress``: a text stream for one line per measured group (None: quiet).
    ``backend``: None to measure the step on the GPU
    (:class:`~l2prefetch.tuning.measure.GraphBackend`), or any
    :class:`~l2prefetch.tuning.arms.Backend` (the tests' fake one plants effects; it
    runs the step where it likes and replays as often as it says, so ``device`` and
    ``rounds`` are then checked but not used).

    ``compiled``: how ``step`` runs the model.  None (the default): found out by
    running it once, or twice where frames compiled before the check's hooks hide the
    model (:func:`~l2prefetch.tuning.compiled.step_is_compiled`; with a
    ``backend`` given, its :attr:`~l2prefetch.tuning.arms.Backend.compiled`); True, or
    the Inductor mode it was compiled with (``"default"``,
    ``"max-autotune-no-cudagraphs"``; recorded in the profile), for a step that runs
    the model in code ``torch.compile`` made (of the model, its ``forward`` or a
    function that calls it); False for an eager step.  A compiled step is measured
    as compiled: discovery reads the eager module tree, every arm runs in the
    compiled, captured step, which is compiled twice per batch shape (without forks,
    and with a fork at every candidate site, switched per arm; in a mode whose
    compilations differ, ``max-autotune-no-cudagraphs``, each arm's outputs are compared
    with its own graph without forks, in the same compiled code); Dynamo's caches are
    reset before and after (``torch._dynamo.reset()``: the caller's next call
    compiles again).  The profile records how the step ran, and a controller made
    from it refuses forks that run the other way
    (:class:`~l2prefetch.profile.StepMismatchError`).

    Raises TypeError/ValueError for bad arguments, naming them (also a model compiled to
    capture graphs of its own, or with hooks attached), :class:`~l2prefetch.tuning.StepError`
    when the step fails or cannot be captured at a batch.  The result's plan is empty
    when nothing was confirmed to pay; never one slower than no plan in its confirmation.
    """
    budget_s = _check_model_and_step(model, step, budget_s, backend, progress)
    instances, max_instances, min_gain_us, resolution, min_bytes = _check_sampling(
        instances, max_instances, min_gain_us, resolution, min_bytes)
    caps_mib, grids, graph_forks, kernels, known = _check_settings(caps_mib, grids,
                                                                   graph_forks, kernels)
    mode = _check_compiled(compiled)
    model, batches = _check_with_their_modules(model, batches, rounds, backend, device, candidates)
    t0 = time.monotonic()
    if backend is None:
        backend, compiled, kernels = _graph_backend(model, step, batches[0], compiled, mode,
                                                    device, rounds, kernels, known)
    elif compiled is None:
        compiled = backend.compiled   # the backend runs the step: it knows
    if kernels is None:
        kernels = (None,)
    compiled = bool(compiled)
    step_info = step_record(compiled, mode if compiled else None)
    try:
        roles, not_offered = _offered_roles(backend, model, step, batches[0], candidates,
                                            min_bytes, caps_mib, compiled, progress)
        if progress is not None:
            print(f"[l2prefetch tune] {len(roles)} candidate roles, batches {list(batches)}, "
                  f"budget {budget_s:.0f} s, the {describe_step(step_info)} step"
                  + ("; outputs compared within one compilation (two compilations in this "
                     "mode can differ bitwise)" if backend.within_compilation else ""),
                  file=progress, flush=True)
        roles_s = time.monotonic() - t0
        remaining = budget_s - roles_s
        reports = search(backend, roles, batches, budget_s=max(remaining, 0.0),
                         instances=instances, max_instances=max_instances,
                         caps_mib=caps_mib, grids=grids, kernels=kernels,
                         graph_forks=graph_forks, min_gain_us=min_gain_us,
                         resolution=resolution, progress=progress)
    finally:
        backend.close()
    fingerprint = backend.device_fingerprint()
    plan, sites = merge_plan(roles, reports,
                             warm_activation=not compiled and backend.warm_activation)
    result = TuneResult(
        batches=reports, roles=roles, plan=plan, sites=sites, budget_s=float(budget_s),
        elapsed_s=time.monotonic() - t0,
        settings={"instances": instances, "max_instances": max_instances,
                  "lead_max_instances": lead_max_instances(instances, max_instances),
                  "rounds": backend.rounds,
                  "caps_mib": list(caps_mib), "grids": list(grids), "kernels": list(kernels),
                  "graph_forks": list(graph_forks), "min_gain_us": min_gain_us,
                  "min_bytes": min_bytes, "resolution": resolution, "roles": len(roles),
                  **({"not_offered": not_offered} if not_offered else {}),
                  **({"within_compilation": True} if backend.within_compilation else {})},
        device=fingerprint, versions=versions(), step=step_info)
    logger.info("tuned %d roles at batches %s in %.0f s: %s", len(roles), list(batches),
                result.elapsed_s, "empty plan" if result.empty else
                f"{len(plan)} entries over {len(sites)} roles")
    _last_lines(result, roles_s, backend, progress)
    return result


def _last_lines(result: TuneResult, roles_s: float, backend: Any, progress: Any) -> None:
    """tune's last words: for a compiled step whose mode was not named as one whose
    compilations differ and whose roles' outputs differed across compilations, the
    likely cause and what to do; where the budget ran out before any role was measured,
    that; where it left promising roles unrefined, that; then where the time went."""
    compiled = step_compiled(result.step)
    unnamed = compiled and not compilations_differ(step_mode(result.step))
    refused = sum(r.reason.startswith(REFUSED_OUTPUTS)
                  for rep in result.batches for r in rep.roles)
    starved = [rep.batch for rep in result.batches
               if rep.reason in (NOTHING_MEASURED, NOT_PREPARED)]
    hints = []
    if unnamed and refused and not backend.within_compilation:
        hints.append(f"{refused} role(s) refused because the outputs with forks differed from "
                     "the step compiled without them; if the step was compiled with "
                     "max-autotune, two compilations differ on their own: name the mode "
                     "(tune(compiled='max-autotune-no-cudagraphs'), or --compile "
                     "max-autotune-no-cudagraphs) so that outputs are compared within one "
                     "compilation")
    if starved:
        prepared = any(not math.isnan(rep.step_us) for rep in result.batches)
        hints.append(f"at batch(es) {', '.join(map(str, starved))} the budget ran out before "
                     f"any role was measured: finding{' and screening' if compiled else ''} "
                     f"the roles"
                     + (f" and preparing each batch{' (its compilations)' if compiled else ''}"
                        if prepared else "")
                     + " took it (see below); raise budget_s (--budget)")
    said = [(logging.WARNING, hint) for hint in hints]
    coarse = [rep.batch for rep in result.batches if rep.not_refined]
    if coarse:   # not a fault (logged as info): the result stands, a larger budget may find more
        names = {name for rep in result.batches for name in rep.not_refined}
        said.append((logging.INFO,
                     f"at batch(es) {', '.join(map(str, coarse))} the budget left no room to "
                     f"try other grids and kernels for {len(names)} promising role(s) (the "
                     "report names them); a larger budget_s (--budget), or fewer roles "
                     "(candidates=, --roles), tries them"))
    alone = [rep.batch for rep in result.batches
             if any(r.reason == CONFIRMED_UNVERIFIED for r in rep.roles)]
    if alone:   # the plan stands (confirmed), on fewer measurements than usual
        said.append((logging.INFO,
                     f"at batch(es) {', '.join(map(str, alone))} no verify fit the budget: "
                     "the plan is the lead role alone, kept on its confirmation; a larger "
                     "budget_s (--budget) verifies and combines the others"))
    for level, text in said:
        logger.log(level, "%s", text)
        if progress is not None:
            print(f"[l2prefetch tune] {text}", file=progress, flush=True)
    if progress is not None:
        went = _time_went(roles_s, result.batches, compiled)
        print(f"[l2prefetch tune] done in {result.elapsed_s:.0f} s: {went}", file=progress,
              flush=True)


def _time_went(roles_s: float, reports: Sequence[Any], compiled: bool) -> str:
    """Where tune's time went, for its last progress line."""
    first = ("finding the roles and screening their sites" if compiled
             else "finding the roles")
    return ", ".join([f"{first} {roles_s:.0f} s"]
                     + [f"batch {r.batch} {r.elapsed_s:.0f} s"
                        + (" (compilations included)" if compiled else "")
                        if not math.isnan(r.step_us) else f"batch {r.batch} not prepared"
                        for r in reports])


def _check_model_and_step(model: Any, step: object, budget_s: object, backend: object,
                          progress: object) -> float:
    """tune()'s model (a torch.nn.Module), step (a callable), budget, backend and progress
    stream; the budget."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(step):
        raise TypeError(f"step must be a callable step(batch) -> output, got "
                        f"{type(step).__name__}")
    if backend is not None and not isinstance(backend, Backend):
        raise TypeError(f"backend must be None (measure on the GPU) or a "
                        f"l2prefetch.tuning.arms.Backend (derive from it), got "
                        f"{type(backend).__name__}")
    if progress is not None and not callable(getattr(progress, "write", None)):
        raise TypeError(f"progress must be None (quiet) or a text stream (with write(), e.g. "
                        f"sys.stderr), got {type(progress).__name__}")
    if _check_number("budget_s", budget_s, 0) == 0:
        raise ValueError("budget_s must be > 0 seconds (the default is 300); a tuner with no "
                         "time can confirm nothing")
    return float(budget_s)


def check_max_instances(instances: int, max_instances: object, *,
                        options: bool = False) -> int:
    """``max_instances`` resolved: None is :data:`~l2prefetch.tuning.search.MAX_INSTANCES`
    (or ``instances`` if more); else an int >= ``instances``.  The one check of it, for
    tune() and ``tune --max-instances`` (``options``: messages name the options)."""
    if max_instances is None:
        return max(MAX_INSTANCES, instances)
    many, few, kind = (("--max-instances", "--instances", "") if options
                       else ("max_instances", "instances", "None or an int "))
    if isinstance(max_instances, bool) or not isinstance(max_instances, numbers.Integral):
        raise TypeError(f"{many} must be {kind}>= {few} ({instances}), "
                        f"got {type(max_instances).__name__} {max_instances!r}")
    if max_instances < instances:
        raise ValueError(f"{many} must be {kind}>= {few} ({instances}), got {max_instances}; "
                         f"equal to {few} turns sequential sampling off")
    return int(max_instances)


def _check_sampling(instances: object, max_instances: object, min_gain_us: object,
                    resolution: object, min_bytes: object) -> tuple:
    """tune()'s sampling arguments (rounds: :func:`_check_with_their_modules`) and the
    smallest read discovery counts, before the step runs; as checked, ``max_instances``
    resolved."""
    instances = _check_number("instances", instances, MIN_INSTANCES, integer=True)
    max_instances = check_max_instances(instances, max_instances)
    min_gain_us = _check_number("min_gain_us", min_gain_us, 0)
    resolution = _check_number("resolution", resolution, 0)
    if resolution >= 1:
        raise ValueError(f"resolution is a share of the step (0.0005 is 0.05%), got {resolution!r}")
    min_bytes = _check_number("min_bytes", min_bytes, 1, integer=True)
    return instances, max_instances, min_gain_us, resolution, min_bytes


def _check_settings(caps_mib: object, grids: object, graph_forks: object,
                    kernels: object) -> tuple:
    """tune()'s lists of settings to search, as lists (each value once: a repeat would
    measure the same arm twice); then the loader kernels this build has."""
    for name, values, kind in (("caps_mib", caps_mib, numbers.Real),
                               ("grids", grids, numbers.Integral)):
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise TypeError(f"{name} must be a non-empty sequence, got {values!r}")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, kind) or not v > 0:
                raise ValueError(f"{name} must hold numbers > 0, got {v!r}")
    if any(not 1 <= g <= 65535 for g in grids):
        raise ValueError(f"grids must hold loader CTA counts in 1..65535, got {list(grids)}")
    if any(c * (1 << 20) >= 2**63 for c in caps_mib):
        raise ValueError(f"caps_mib must be below 2**43 MiB, got {list(caps_mib)}")
    if any(int(c * (1 << 20)) < 16 for c in caps_mib):
        # A cap is whole bytes; under 16 it would be 0 (no cap) or load nothing.
        raise ValueError(f"caps_mib must each be at least 16 bytes ({16 / (1 << 20):.3g} MiB), "
                         f"got {list(caps_mib)}")
    if isinstance(graph_forks, str) or not graph_forks or any(
            g not in GRAPH_FORKS for g in graph_forks):
        raise ValueError(f"graph_forks must be a non-empty sequence of {graph_fork_choices()} "
                         f"(l2prefetch.mechanisms), got {graph_forks!r}")
    known = _C.kernel_variants()
    if kernels is not None:
        if isinstance(kernels, str) or not isinstance(kernels, Sequence) or not kernels:
            raise TypeError(f"kernels must be None or a non-empty sequence of kernel names "
                            f"(None in it: the device's default), got {kernels!r}")
        bad = [k for k in kernels if k is not None and k not in known]
        if bad:
            raise ValueError(f"unknown kernel(s) {bad}; kernels are {sorted(known)} (None: the "
                             "device's default)")
    lists = {"caps_mib": [_plain(c) for c in caps_mib], "grids": [int(g) for g in grids],
             "graph_forks": list(graph_forks),
             "kernels": None if kernels is None else list(kernels)}
    for name, values in lists.items():
        twice = [v for i, v in enumerate(values or ()) if v in values[:i]]
        if twice:
            raise ValueError(f"{name} gives {twice[0]!r} more than once, {values!r}: give each "
                             "once")
    return (*lists.values(), known)


def _check_with_their_modules(model: Any, batches: object, rounds: object,
                              backend: Optional[Backend], device: Any,
                              candidates: object) -> tuple[Any, tuple[int, ...]]:
    """tune()'s checks that other modules make, after its own, a module at a time: the
    batches (plan), a model compiled to capture CUDA graphs of its own (compiled), hooks
    attached and, for the GPU's backend, forks turned off (hooks), the rounds and the
    device (measure), the candidates (discovery).  The module tuned (a
    ``torch.compile(model)`` wrapper's: its paths and hooks) and the batches, as
    checked."""
    batches = check_batches(batches, "batches")
    own = own_graphs(model)
    if own is not None:
        raise ValueError(f"model: compiled with {own}, which captures CUDA graphs of its own, "
                         f"and the tuner captures the compiled step itself: compile it in "
                         f"{' or '.join(map(repr, COMPILE_MODES))} (the server's capture then "
                         "holds the forks)")
    module = compiled_module(model)   # torch.compile(model): its module's paths and hooks
    if hooks.attached(model):
        raise ValueError("model: l2prefetch hooks are attached to it (hooks.attach), and their "
                         "forks would run in the tuner's arms, those without forks too: "
                         "detach them (Attachment.detach()) before tuning")
    if backend is None and hooks.disabled():   # every arm would be the step without forks
        raise ValueError("L2PREFETCH_DISABLE is set, so nothing forks: unset it to tune")
    measure.check_rounds(rounds)
    check_candidates(module, candidates)   # before the step runs: names, or Role objects
    # a bad device= refused in any case, a CPU model only for the GPU's backend (a given
    # backend runs the step where it likes), before the step runs (compiles)
    if backend is None or device is not None:
        measure.cuda_device(module, device)
    return module, batches


def _graph_backend(model: Any, step: Callable[[int], Any], batch: int,
                   compiled: Union[None, bool, str], mode: Optional[str], device: Any,
                   rounds: Optional[int],
                   kernels: Optional[Sequence[Optional[str]]],
                   known: dict) -> tuple[Backend, bool, Optional[Sequence[Optional[str]]]]:
    """The GPU's backend (forks on and its device checked: :func:`_check_with_their_modules`),
    with how ``step`` runs the model (found out at ``batch``, and checked against
    ``compiled`` where given) and, where ``kernels`` is None, the device's default loader
    and the :data:`ALTERNATIVE_KERNELS` it supports."""
    try:
        found = step_is_compiled(model, step, batch)
    except Exception as exc:
        raise StepError(f"step({batch}) failed while finding out whether it runs the model "
                        f"compiled: {type(exc).__name__}: {exc}") from exc
    if compiled is not None and bool(compiled) != found:
        raise ValueError(f"compiled={compiled!r}, but step({batch}) runs the model "
                         f"{'in compiled code' if found else 'eagerly'}; pass "
                         f"compiled={found} (or None: found out)")
    if found:
        recompile()   # the detection's hooks may be in a frame compiled just now
    backend = measure.GraphBackend(model, step, device=device, rounds=rounds, compiled=found,
                                   within_compilation=found and compilations_differ(mode))
    if kernels is None:
        sm = _C.device_info(backend.device.index)["sm"]
        kernels = (None, *(k for k in ALTERNATIVE_KERNELS
                           if k in known and known[k]["min_sm"] <= sm))
    return backend, found, kernels


def _offered_roles(backend: Backend, model: Any, step: Callable[[int], Any], batch: int,
                   candidates: object, min_bytes: int, caps_mib: Sequence[float],
                   compiled: bool, progress: Any) -> tuple[list[Role], dict]:
    """The candidate roles the backend takes (:meth:`Backend.offer`), and those its
    screen leaves out, each with the reason."""
    roles = resolve_roles(model, step, batch, candidates, min_bytes)
    caps_bytes = [int(c * (1 << 20)) for c in caps_mib]
    if compiled and progress is not None:
        print("[l2prefetch tune] screening the fork sites: Inductor's kernels without "
              "forks and with them (compilations)", file=progress, flush=True)
    t_screen = time.monotonic()
    roles, not_offered = backend.offer(roles, caps_bytes, batch)
    not_offered = dict(not_offered)
    if compiled and progress is not None:
        print(f"[l2prefetch tune] screened in {time.monotonic() - t_screen:.1f} s: "
              + (f"{len(not_offered)} roles not offered (a fork at their site changes "
                 f"the compiled code): {', '.join(sorted(not_offered))}" if not_offered
                 else "every site leaves the compiled code as it was"),
              file=progress, flush=True)
    return roles, not_offered
