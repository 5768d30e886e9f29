"""A prefetch policy for Hugging Face transformers' DeepSeek-V3 (``DeepseekV3ForCausalLM``).

Where a decode layer leaves HBM bandwidth idle, and what it reads next
(one MoE layer at batch 1 in graph replay on the H200, h200-facts.md)::

    input RMSNorm 15 us | q_a_proj 12 MiB | q_a_layernorm 14 us | q_b_proj 18 MiB
    | kv_a_proj 4.5 MiB | kv_a_layernorm 15 us | RoPE + cache 37 us | kv_b_proj 8 MiB
    | copies + SDPA 35 us | o_proj 32 MiB | post-attention RMSNorm 15 us
    | router 56 us (22 small kernels) | routed experts 193 us (HBM-bound, evict L2)
    | shared experts 3 x 12 MiB

The idle windows are the norms (11-21 us), the router (56-68 us) and the
attention glue (35-49 us).  The loader moves about 2 TB/s x (window - 2 us)
and a fork costs 0.3-1.0 us in a replayed graph even when empty.  This policy
maps two points of the Kimi policy onto HF's modules (:data:`POINTS`).  **By
default it forks nowhere** (:data:`DEFAULT_POINTS` is empty): on the H200 neither
point paid in the benchmark model (benchmarks/RESULTS.md, run 8); pass
``points=`` to opt in and measure against the empty-fork control:

* ``oproj_down``, *not forked by default*: after ``self_attn.o_proj`` of each
  MoE layer, prefetch the router weight ``mlp.gate.weight``.  Its window is
  the post-attention RMSNorm; the router's GEMV reads it right after.
  Critical path, so the Kimi front's settings: grid 8, carveout 100, top
  priority.  Left out because the router weight is too small to pay for its
  fork: 0.25 MiB in the benchmark model, and on the H200 the effect table
  (benchmarks/RESULTS.md, W = 1.8 MiB rows) shows a cold-to-hot gap of at
  most ~0.2 us at that size, while an inline fork node costs ~0.3-0.5 us in a
  replayed graph; in the Kimi-shaped two-layer benchmark the same point never
  paid at any TP (caps section, "The other points").  ``points=POINTS`` (or
  ``points=("oproj_down", "next_attention")``) restores it.

  The shared experts are *not* prefetched there even then, by default.  In
  HF's ``DeepseekV3MoE.forward`` they run after the routed experts, which
  stream hundreds of MiB through the 60 MiB L2 and evict anything loaded
  before them; and forking after the routed experts leaves no window (the
  loader would compete with the shared experts themselves: -1.1 to -2.9 us at
  32 MiB and T=0 in the facts).  ``include_shared_experts=True`` adds them to
  the ``oproj_down`` entry anyway, for measuring that claim (it changes
  nothing unless ``oproj_down`` is among the points).

* ``next_attention``, *not forked by default either*: after ``mlp`` (the whole
  MLP / MoE block) of every layer that has a following layer, prefetch the
  next layer's attention weights in consumption order (``q_a_proj`` or
  ``q_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``,
  ``o_proj``), capped per batch.  The window is the residual add and the next
  input RMSNorm (~15 us), so the cap is 16 MiB (~10 us of loading plus the
  launch).  Measured in HF DeepSeek-V3 decode graphs (7 instances per variant)
  the five forks' loads made the step 8-19 us slower than the same forks with
  empty tables at every batch (0.9915-0.9963x against no forks), and the
  report's glue section shows why: in a window of small kernels that touch
  memory (a norm is one), the loader slows those kernels by about what it
  saves the consumer, while a spin of the same length showed a gain.
  ``points=("next_attention",)`` turns it on.  The fork is after ``mlp`` rather
  than after ``mlp.experts`` or the router because in HF the shared experts
  come last: forking earlier makes the loader compete with HBM-bound expert
  GEMMs (or be evicted by them).  Dense layers get it too: a dense MLP also
  streams far more than L2 and is followed by the same norm window.

Layer indices are positions in the decoder's ``layers`` list (HF's
``layer_idx``); :func:`plan` and :func:`hook_points` agree on them.  Every
weight is the model's own tensor, so plans can be stored with
:func:`l2prefetch.plan.plan_to_json`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Optional, Union

from .plan import CapSpec, PlanEntry, cap_groups, select_points

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
#: Loader CTAs for the next attention (the facts' 32-CTA bulk-copy ring: ~2.1 TB/s).
NEXT_GRID = 32
#: next_attention cap in MiB when that point is chosen: fits the ~15 us norm window.
#: Not forked by default (see :data:`DEFAULT_POINTS`).
NEXT_ATTENTION_MIB = 16

#: The policy's fork points, in a layer's order.
POINTS = ("oproj_down", "next_attention")

#: The points :func:`plan` and :func:`hook_points` fork at by default: none.
#: ``oproj_down`` loads just the router weight ``mlp.gate.weight`` (0.25 MiB in
#: the benchmark model); on the H200 the effect table (benchmarks/RESULTS.md,
#: W = 1.8 MiB rows) puts the cold-to-hot gap of a weight that small at ~0.2 us
#: at most, while an inline fork node costs ~0.3-0.9 us in a replayed graph, and
#: in the Kimi-shaped two-layer benchmark the oproj_down point never paid at any
#: TP (caps section, "The other points").  ``next_attention``'s loads lost 8-19 us
#: per step against its empty-fork control in the real model at batch 1-8
#: (RESULTS.md, "Run 8, continued").  ``points=("next_attention",)`` or
#: ``points=POINTS`` opt in.
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


def attention_weights(attention: Any) -> tuple[Any, ...]:
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
    among the points.  Raises TypeError for a ``points`` that is a str or not
    a collection, ValueError for an unknown point.
    """
    wanted = _points(points)
    batches = tuple(batches)
    # The batches and caps are checked whatever the points (cap_groups raises).
    if isinstance(next_attention_mib, Mapping):
        table = next_attention_mib
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
