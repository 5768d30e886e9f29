"""A prefetch policy for Hugging Face transformers' DeepSeek-V3 (``DeepseekV3ForCausalLM``).

A decode layer leaves HBM bandwidth idle in its norms, its router and its
attention glue; this policy maps two points of the Kimi policy onto HF's
modules (:data:`POINTS`).  **By default it forks nowhere**
(:data:`DEFAULT_POINTS` is empty): neither point paid on the H200
(benchmarks/RESULTS.md, Headlines: ``next_attention`` in HF DeepSeek-V3
decode graphs, ``oproj_down`` in the Kimi-shaped layers).  Pass ``points=``
to opt in, and measure against the empty-fork control:

* ``oproj_down``: after ``self_attn.o_proj`` of each MoE layer, prefetch the
  router weight ``mlp.gate.weight``, which the router's GEMV reads after the
  post-attention RMSNorm.  Critical path, so the Kimi front's settings: grid
  8, carveout 100, top priority.  A router weight is small (0.25 MiB in the
  benchmark model), and a load that small gains less than its fork costs
  (RESULTS.md, "The effect").  ``include_shared_experts=True`` adds the shared
  experts to this entry, for measuring: in HF's ``DeepseekV3MoE.forward`` they
  run after the routed experts, which stream hundreds of MiB through L2 and
  evict what was loaded before them.

* ``next_attention``: after ``mlp`` (the whole MLP / MoE block) of every
  layer that has a following layer, prefetch the next layer's attention
  weights in consumption order (``q_a_proj`` or ``q_proj``, ``q_b_proj``,
  ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``), capped per batch.  The
  window is the residual add and the next input RMSNorm (~15 us), so the cap
  is 16 MiB.  The fork is after ``mlp`` rather than the router or
  ``mlp.experts`` because in HF the shared experts come last: forking earlier
  makes the loader compete with the HBM-bound expert GEMMs.  Dense layers get
  it too: a dense MLP also streams far more than L2 and is followed by the
  same norm window.  In the real model its loads made the step slower than
  the same forks with empty tables, because a norm is a small kernel that
  touches memory, and the loader slows such kernels by about what it saves
  (RESULTS.md, Headlines, "small kernels that touch memory").

Layer indices are positions in the decoder's ``layers`` list (HF's
``layer_idx``); :func:`plan` and :func:`hook_points` agree on them.  Every
weight is the model's own tensor, so plans can be stored with
:func:`l2prefetch.plan.plan_to_json`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

from .plan import CapSpec, PlanEntry, cap_groups, check_batches, select_points

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "ATTENTION_PROJECTIONS",
    "DEFAULT_POINTS",
    "FRONT_CARVEOUT",
    "FRONT_GRID",
    "NEXT_ATTENTION_MIB",
    "NEXT_GRID",
    "POINTS",
    "attention_weights",
    "decoder_layers",
    "hook_points",
    "is_moe_layer",
    "plan",
]

#: Loader CTAs for the router weight (small, a few MiB at most): as Kimi's front.
FRONT_GRID = 8
#: Shared-memory carveout (percent) of the critical-path router load.
FRONT_CARVEOUT = 100
#: Loader CTAs for the next attention (the default ring kernel at 32 CTAs: ~2 TB/s).
NEXT_GRID = 32
#: next_attention cap in MiB when that point is chosen: fits the ~15 us norm window.
NEXT_ATTENTION_MIB = 16

#: The policy's fork points, in a layer's order.
POINTS = ("oproj_down", "next_attention")

#: The points :func:`plan` and :func:`hook_points` fork at by default: none, as
#: neither paid on the H200 (see the module docstring).  ``points=POINTS`` or
#: ``points=("next_attention",)`` opt in.
DEFAULT_POINTS: tuple[str, ...] = ()

#: Attention projections in the order HF's DeepseekV3Attention.forward reads them.
ATTENTION_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                         "o_proj")


def _points(points: Optional[Collection[str]]) -> frozenset:
    return select_points(points, POINTS, DEFAULT_POINTS)


def decoder_layers(model: Any) -> Sequence[Any]:
    """The decoder layers of an HF DeepSeek-V3 model: ``model.model.layers`` or ``model.layers``."""
    for owner in (getattr(model, "model", None), model):
        layers = getattr(owner, "layers", None)
        if layers is not None and all(hasattr(l, "self_attn") and hasattr(l, "mlp")
                                      for l in layers):
            return layers
    raise ValueError(f"{type(model).__name__} has no decoder layers with self_attn and mlp at "
                     "model.model.layers or model.layers")


def is_moe_layer(layer: Any) -> bool:
    """True for a DeepseekV3MoE layer (a router ``mlp.gate`` and ``mlp.experts``)."""
    return hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")


def attention_weights(attention: Any) -> tuple[torch.Tensor, ...]:
    """The attention's projection weights in consumption order (``q_proj`` without q-LoRA)."""
    weights = []
    for name in ATTENTION_PROJECTIONS:
        module = getattr(attention, name, None)
        if module is not None:
            weights.append(module.weight)
    if not weights or getattr(attention, "o_proj", None) is None:
        raise ValueError(f"{type(attention).__name__} has none of the DeepSeek-V3 projections "
                         f"{ATTENTION_PROJECTIONS} or no o_proj")
    return tuple(weights)


def _front_weights(mlp: Any, include_shared_experts: bool) -> tuple[Any, ...]:
    weights = [mlp.gate.weight]
    if include_shared_experts:
        shared = mlp.shared_experts
        weights += [shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight]
    return tuple(weights)


def plan(model: Any, batches: Iterable[int] = range(1, 9),
         next_attention_mib: Union[int, Mapping[int, CapSpec]] = NEXT_ATTENTION_MIB, *,
         include_shared_experts: bool = False,
         points: Optional[Collection[str]] = None) -> list[PlanEntry]:
    """The DeepSeek-V3 plan for ``model`` (see the module docstring for why).

    ``batches`` are the decode batches that fork at all.  ``next_attention_mib``
    is one cap in MiB for every batch, or a per-batch table ``{batch: cap_mib
    | (cap_mib, carveout)}`` like Kimi's (batches it leaves out, and zero
    caps, get no next_attention).  Entries per layer: ``oproj_down`` (MoE
    layers), then the ``next_attention`` groups (layers with a following one),
    but only for the points in ``points``: by default :data:`DEFAULT_POINTS`
    (none: the plan is empty); ``points=("next_attention",)`` or
    ``points=POINTS`` opt in.
    ``include_shared_experts=True`` adds the shared experts to the
    ``oproj_down`` entries, so it changes nothing unless ``oproj_down`` is
    among the points.  Raises TypeError for ``batches`` that are not an
    iterable of ints, a ``next_attention_mib`` that is neither an int nor a
    mapping, a non-bool ``include_shared_experts`` or a ``points`` that is a
    str or not a collection; ValueError for a batch outside 1..65535 or named
    twice, a negative cap or an unknown point.
    """
    wanted = _points(points)
    # The arguments are checked whatever the points.
    batches = check_batches(batches, "batches", allow_empty=True)
    if not isinstance(include_shared_experts, bool):
        raise TypeError("include_shared_experts must be a bool, got "
                        f"{type(include_shared_experts).__name__} {include_shared_experts!r}")
    if isinstance(next_attention_mib, Mapping):
        table = next_attention_mib
    elif isinstance(next_attention_mib, bool) or not isinstance(next_attention_mib, int):
        raise TypeError("next_attention_mib must be a cap in MiB (an int >= 0) or a table "
                        "{batch: cap_mib or (cap_mib, carveout)}, got "
                        f"{type(next_attention_mib).__name__} {next_attention_mib!r}")
    elif next_attention_mib < 0:
        raise ValueError("next_attention_mib must be a cap in MiB >= 0 (0: no next_attention), "
                         f"got {next_attention_mib}")
    else:
        table = {batch: next_attention_mib for batch in batches}
    groups = [(cap, carveout, tuple(b for b in group if b in batches))
              for cap, carveout, group in cap_groups(table)]
    groups = [group for group in groups if group[2]] if "next_attention" in wanted else []
    layers = decoder_layers(model)
    entries: list[PlanEntry] = []
    for index, layer in enumerate(layers):
        if "oproj_down" in wanted and is_moe_layer(layer):
            entries.append(PlanEntry("oproj_down", index, batches,
                                     _front_weights(layer.mlp, include_shared_experts),
                                     grid=FRONT_GRID, carveout=FRONT_CARVEOUT, priority=True))
        if groups and index + 1 < len(layers):
            weights = attention_weights(layers[index + 1].self_attn)
            for cap, carveout, group in groups:
                entries.append(PlanEntry("next_attention", index, group, weights,
                                         byte_cap=cap * 2**20, grid=NEXT_GRID, carveout=carveout))
    return entries


def hook_points(model: Any, points: Optional[Collection[str]] = None
                ) -> dict[str, list[tuple[Any, int]]]:
    """Where :func:`plan`'s points fork, for :func:`l2prefetch.hooks.attach`.

    ``oproj_down``: after ``self_attn.o_proj`` of each MoE layer;
    ``next_attention``: after ``mlp`` of each layer that has a following layer.
    Only the points in ``points`` get a key, with :func:`plan`'s default
    (:data:`DEFAULT_POINTS`), so ``hooks.attach(model, controller,
    deepseek_v3.hook_points)`` hooks where the default plan forks; for other
    points pass ``lambda m: deepseek_v3.hook_points(m, points)``.
    """
    wanted = _points(points)
    layers = decoder_layers(model)
    sites: dict[str, list[tuple[Any, int]]] = {}
    if "oproj_down" in wanted:
        sites["oproj_down"] = [(layer.self_attn.o_proj, index)
                               for index, layer in enumerate(layers) if is_moe_layer(layer)]
    if "next_attention" in wanted:
        sites["next_attention"] = [(layer.mlp, index) for index, layer in enumerate(layers)
                                   if index + 1 < len(layers)]
    return sites
