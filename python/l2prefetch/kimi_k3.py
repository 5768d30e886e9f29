"""The reference design's prefetch policy for the Kimi K3 specialized decode, as data.

This is the seed policy (vllm ... specialized_decode/runtime/prefetch.py)
restated as a plan: the same points, weights, batches, grids, carveouts and
priorities, so that a controller built from ``plan(..., points=POINTS)``
launches what the seed's controller launched.  Two things differ by default,
both measured on the H200 (benchmarks/RESULTS.md): :data:`NEXT_ATTENTION`
(the seed's table is not part of the reference; all zero) and
:data:`DEFAULT_POINTS` (no ``oproj_down`` and no ``attention_moe``: neither
paid).  So ``plan(layers, packed, tp)`` is empty by default; pass
``points=`` and ``next_attention=`` to opt in after measuring.  Three fork
points per MoE layer:

* ``oproj_down``: after the o-projection, at batches 3-8, the MoE front's
  packed copy ``[router shard; latent-down shard]``, which the front GEMM
  reads right after.
* ``attention_moe``: at TP 8 only, after the KDA input projection (batches
  5-8) or after the MLA core (batch 8), the same front rows plus the shared
  expert's weights.
* ``next_attention``: once the routed experts are launched, the next layer's
  attention weights in consumption order, capped per batch by
  :data:`NEXT_ATTENTION`.  Nothing above batch 8, where the HBM-bound experts
  lose more bandwidth to the loader than the attention gains.

The front and shared-expert ranges are on the critical path: they launch with
the greatest stream priority and the full shared-memory carveout.

Layers are duck-typed like the seed's: ``layer.is_moe_layer``,
``layer.layer_idx``, ``layer.self_attn``, ``layer.mlp.shared_experts``, and
``packed[layer.layer_idx]`` is the packed front tensor of a MoE layer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Optional

from .plan import CapSpec, PlanEntry, cap_groups, select_points

__all__ = [
    "ATTENTION_INPUTS",
    "DEFAULT_POINTS",
    "FRONT_GRID",
    "NEXT_ATTENTION",
    "NEXT_GRID",
    "POINTS",
    "SHARED_GRID",
    "URGENT_CARVEOUT",
    "attention_weights",
    "hook_points",
    "plan",
]

#: Loader CTAs for the MoE front alone (``oproj_down``): the seed's 8.
FRONT_GRID = 8
#: Loader CTAs for the front plus the shared expert (``attention_moe``): the seed's 32.
SHARED_GRID = 32
#: Loader CTAs for the next layer's attention (``next_attention``): the seed's 32.
NEXT_GRID = 32
#: Shared-memory carveout (percent) of the critical-path loads, with the greatest priority.
URGENT_CARVEOUT = 100

#: The attention's input projections in the order the seed lists them (its
#: consumption order); the ``.weight`` of each present one is prefetched.
ATTENTION_INPUTS = (
    "in_proj_qkvgfab", "fused_qkv_a_g_proj", "fused_qkv_a_proj", "q_proj",
    "kv_a_proj_with_mqa", "f_b_proj", "q_b_proj", "g_proj",
)

#: next_attention caps per TP: batch -> cap in MiB, or (cap in MiB, carveout).
#: Zero at every TP, by measurement on the H200 (benchmarks/RESULTS.md, run 7):
#: the caps section (two Kimi-shaped MoE layers, every cap of 0-32 MiB at
#: batches 1-8) found no gain at TP 1 (no all-reduce follows the experts: every
#: cap was slower, 16 MiB by 3%) and ~1% at TP 2, 4 and 8 for 24 MiB, but with a
#: spin standing in for the all-reduce; with real NCCL all-reduces at TP 2
#: (``benchmarks/allreduce.py --world 2 --layer-only``) the same 24 MiB fork
#: made the step 0.3-2.0% slower (inline; as a side branch 0.5% slower to 0.5%
#: faster).  TP 4 and 8 could not be measured with real collectives here; the
#: spin's optimism at TP 2 says not to trust it there either.  To turn it on,
#: measure your TP with allreduce.py and pass ``next_attention=`` to
#: :func:`plan`.  Nothing above batch 8.
NEXT_ATTENTION: dict[int, dict[int, CapSpec]] = {
    tp: {batch: 0 for batch in range(1, 9)} for tp in (1, 2, 4, 8)}

#: The seed's fork points, in a layer's order.
POINTS = ("oproj_down", "attention_moe", "next_attention")

#: The points :func:`plan` forks at by default, per TP: the seed's, less those
#: the H200 measured as losing (benchmarks/RESULTS.md).  ``next_attention``
#: stays (its caps, :data:`NEXT_ATTENTION`, are zero: pass ``next_attention=``
#: to turn it on).
#:
#: * ``oproj_down`` is left out at every TP (run 7, caps section, "The other
#:   points").  At TP 1 no all-reduce follows the o-projection, so its load
#:   runs beside the front GEMM that reads the same rows: 10-13 us slower per
#:   two layers at batches 3-8 (3%).  At TP 4 and 8 the step without it was
#:   0.5-3.7 us faster at batches 3-8; at TP 2 it made no difference.
#: * ``attention_moe`` (TP 8 only) is left out since session 5 (RESULTS.md,
#:   runs 9 and 10, layer sections).  With a spin standing in for the
#:   attention core it gained 1.2-1.6 us per two layers at batch 8
#:   (1.007-1.009x, 22-36% of its limit); with small memory-touching kernels
#:   in the spin's place (layer_glue) it lost 4.1-4.7 us in four passes
#:   (0.975-0.978x), and the loader kernels that hold no shared memory did no
#:   better (line_prefetch 0.988-0.991x, bulk_prefetch 0.992-0.997x).
#:
#: ``points=POINTS`` restores the seed's points.
DEFAULT_POINTS: dict[int, tuple[str, ...]] = {tp: ("next_attention",) for tp in (1, 2, 4, 8)}


def _points(tp: Any, points: Optional[Collection[str]]) -> frozenset:
    return select_points(points, POINTS, DEFAULT_POINTS.get(tp, POINTS))


def attention_weights(attention: Any) -> tuple[Any, ...]:
    """An attention's weights in their consumption order, as the seed lists them.

    The ``.weight`` of each present module of :data:`ATTENTION_INPUTS`, then
    ``W_UK_T`` and ``W_UV`` where they are tensors, then ``o_proj.weight``.
    Absent names are skipped; ``o_proj`` must exist.
    """
    import torch

    weights = [getattr(getattr(attention, name, None), "weight", None) for name in ATTENTION_INPUTS]
    weights += [getattr(attention, "W_UK_T", None), getattr(attention, "W_UV", None)]
    return (*(w for w in weights if isinstance(w, torch.Tensor)), attention.o_proj.weight)


def _packed(packed: Any, index: int) -> Any:
    try:
        return packed[index]
    except (KeyError, IndexError) as exc:
        raise LookupError(f"packed has no front tensor for MoE layer {index}") from exc


def plan(layers: Sequence[Any], packed: Any, tp: int,
         next_attention: Optional[Mapping[int, Mapping[int, CapSpec]]] = None, *,
         points: Optional[Collection[str]] = None) -> list[PlanEntry]:
    """The seed's plan for ``layers`` at tensor parallelism ``tp``.

    Only MoE layers get entries, in this order per layer: ``oproj_down``,
    ``attention_moe`` (TP 8), then one ``next_attention`` entry per distinct
    (cap, carveout) of ``(next_attention or NEXT_ATTENTION)[tp]``, in the order
    of each group's first batch in that table (zero caps give no entry).  The
    last layer has no ``next_attention``.  Only the points in ``points`` get
    entries: by default ``DEFAULT_POINTS[tp]`` (the seed's, less the measured
    losers); ``points=POINTS`` gives the seed's plan exactly.  Raises
    ValueError for a ``tp`` the table does not have or an unknown point.
    """
    table = NEXT_ATTENTION if next_attention is None else next_attention
    if tp not in table:
        raise ValueError(f"tp={tp!r} has no next_attention table; supported: {sorted(table)}")
    wanted = _points(tp, points)
    groups = cap_groups(table[tp]) if "next_attention" in wanted else []
    entries: list[PlanEntry] = []
    for position, layer in enumerate(layers):
        if not layer.is_moe_layer:
            continue
        index, attention = layer.layer_idx, layer.self_attn
        # The front GEMM reads [router shard; down shard] from the packed copy.
        front = _packed(packed, index)
        if "oproj_down" in wanted:
            entries.append(PlanEntry("oproj_down", index, range(3, 9), (front,),
                                     grid=FRONT_GRID, carveout=URGENT_CARVEOUT, priority=True))
        if tp == 8 and "attention_moe" in wanted:
            shared = layer.mlp.shared_experts
            batches = range(5, 9) if hasattr(attention, "in_proj_qkvgfab") else (8,)
            entries.append(PlanEntry(
                "attention_moe", index, batches,
                (front, shared.gate_up_proj.weight, shared.down_proj.weight),
                grid=SHARED_GRID, carveout=URGENT_CARVEOUT, priority=True))
        if position + 1 < len(layers):
            weights = attention_weights(layers[position + 1].self_attn)
            for cap, carveout, batches in groups:
                entries.append(PlanEntry("next_attention", index, batches, weights,
                                         byte_cap=cap * 2**20, grid=NEXT_GRID,
                                         carveout=carveout))
    return entries


def _resolve(layer: Any, path: str) -> Any:
    target = layer
    for part in path.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise LookupError(f"layer {layer.layer_idx} has no {path!r} to hook")
    return target


def hook_points(layers: Sequence[Any], tp: int, *, oproj: str = "self_attn.o_proj",
                kda_input: str = "self_attn.in_proj_qkvgfab",
                mla_core: str = "self_attn.mla_attn", experts: str = "mlp.experts",
                points: Optional[Collection[str]] = None) -> dict[str, list[tuple[Any, int]]]:
    """Where each point forks, as ``{point: [(module, layer_idx), ...]}`` for ``hooks.attach``.

    For servers that run Kimi's layers as ``nn.Module``s rather than the seed's
    runtime (which calls ``fork`` itself).  The paths are relative to a layer:
    ``oproj`` (after the o-projection), ``kda_input`` / ``mla_core`` (TP 8,
    after the KDA input projection or the MLA core; the MLA core's name depends
    on the implementation, vLLM's is ``mla_attn``) and ``experts`` (once the
    routed experts are launched).  Only MoE layers are hooked, and only at the
    ``points`` :func:`plan` forks at (the same default); a missing module
    raises LookupError.
    """
    wanted = _points(tp, points)
    sites: dict[str, list[tuple[Any, int]]] = {
        point: [] for point in POINTS if point in wanted and (point != "attention_moe" or tp == 8)}
    for position, layer in enumerate(layers):
        if not layer.is_moe_layer:
            continue
        index = layer.layer_idx
        if "oproj_down" in sites:
            sites["oproj_down"].append((_resolve(layer, oproj), index))
        if "attention_moe" in sites:
            kda = hasattr(layer.self_attn, "in_proj_qkvgfab")
            sites["attention_moe"].append((_resolve(layer, kda_input if kda else mla_core), index))
        if "next_attention" in sites and position + 1 < len(layers):
            sites["next_attention"].append((_resolve(layer, experts), index))
    return sites
