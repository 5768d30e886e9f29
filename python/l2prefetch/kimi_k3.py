"""The reference design's prefetch policy for the Kimi K3 specialized decode, as data.

The reference design (vLLM's Kimi K3 ``specialized_decode/runtime/prefetch.py``)
forks at three points of each MoE layer; :func:`plan` restates its tables as
a plan, so ``plan(..., points=POINTS)`` launches exactly what the reference
controller launched.  By default the plan is empty: :data:`DEFAULT_POINTS`
leaves out the points that lost on the H200 and :data:`NEXT_ATTENTION`'s caps
are zero (benchmarks/RESULTS.md, Headlines).  Pass ``points=`` and
``next_attention=`` to opt in after measuring your own GPU.  The points:

* ``oproj_down``: after the o-projection, at batches 3-8, the MoE front's
  packed copy ``[router shard; latent-down shard]``, which the front GEMM
  reads right after.
* ``attention_moe``: at TP 8 only, after the KDA input projection (batches
  5-8) or after the MLA core (batch 8), the same front rows plus the shared
  expert's weights.
* ``next_attention``: once the routed experts are launched, the next layer's
  attention weights in consumption order, capped per batch by
  :data:`NEXT_ATTENTION`.  Never above batch 8, where the HBM-bound experts
  lose more bandwidth to the loader than the attention gains.

The front and shared-expert loads are on the critical path: they launch with
the greatest stream priority and the full shared-memory carveout.

Layers are duck-typed as in the reference design: ``layer.is_moe_layer``,
``layer.layer_idx``, ``layer.self_attn``, ``layer.mlp.shared_experts``, and
``packed[layer.layer_idx]`` is the packed front tensor of a MoE layer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

from . import _torch
from .plan import CapSpec, PlanEntry, cap_groups, select_points

if TYPE_CHECKING:  # pragma: no cover
    import torch

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

#: Loader CTAs for the MoE front alone (``oproj_down``), as in the reference design.
FRONT_GRID = 8
#: Loader CTAs for the front plus the shared expert (``attention_moe``).
SHARED_GRID = 32
#: Loader CTAs for the next layer's attention (``next_attention``).
NEXT_GRID = 32
#: Shared-memory carveout (percent) of the critical-path loads, with the greatest priority.
URGENT_CARVEOUT = 100

#: The attention's input projections in consumption order (the reference
#: design's list); the ``.weight`` of each one present is prefetched.
ATTENTION_INPUTS = (
    "in_proj_qkvgfab", "fused_qkv_a_g_proj", "fused_qkv_a_proj", "q_proj",
    "kv_a_proj_with_mqa", "f_b_proj", "q_b_proj", "g_proj",
)

#: next_attention caps per TP: batch -> cap in MiB, or (cap in MiB, carveout).
#: Zero everywhere: on the H200 no cap paid at TP 1, and at TP 2 the best cap
#: (24 MiB) made the step slower before real NCCL all-reduces inline and did
#: not pay as a side branch (benchmarks/RESULTS.md, "Choosing
#: kimi_k3.NEXT_ATTENTION" and "The all-reduce window").  TP 4 and 8 were
#: measured only with a spin standing in for the all-reduce, which overstated
#: the gain at TP 2.  Measure your TP with benchmarks/allreduce.py and pass
#: ``next_attention=`` to :func:`plan` to turn it on.
NEXT_ATTENTION: dict[int, dict[int, CapSpec]] = {
    tp: {batch: 0 for batch in range(1, 9)} for tp in (1, 2, 4, 8)}

#: The reference design's fork points, in a layer's order.
POINTS = ("oproj_down", "attention_moe", "next_attention")

#: The points :func:`plan` forks at by default, per TP: the reference design's
#: less those that lost on the H200 (benchmarks/RESULTS.md, Headlines):
#: ``oproj_down`` never paid at any TP, and ``attention_moe`` paid only with
#: spins standing in for the attention core, not with the small kernels of a
#: real one ("A decode step with real glue").  ``next_attention`` stays, with
#: zero caps.  ``points=POINTS`` restores the reference design's points.
DEFAULT_POINTS: dict[int, tuple[str, ...]] = {tp: ("next_attention",) for tp in (1, 2, 4, 8)}


def _check_tp(tp: object, table: object) -> Mapping[int, Mapping[int, CapSpec]]:
    """The caps table after checking ``tp`` and ``next_attention``'s shape."""
    if not isinstance(table, Mapping):
        raise TypeError("next_attention must map tp -> {batch: cap_mib or (cap_mib, "
                        "carveout)}, e.g. {8: {1: 16, 2: 16}}, got "
                        f"{type(table).__name__} {table!r}")
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise TypeError(f"tp must be an int, the tensor-parallel degree (one of "
                        f"{sorted(table)}), got {type(tp).__name__} {tp!r}")
    if tp not in table:
        raise ValueError(f"tp={tp!r} has no next_attention table; supported: {sorted(table)} "
                         "(pass next_attention={tp: {batch: cap_mib}} for another)")
    caps = table[tp]
    if not isinstance(caps, Mapping):
        raise TypeError(f"next_attention[{tp}] must map batch -> cap_mib or (cap_mib, "
                        "carveout), e.g. {1: 16, 2: 16}, got "
                        f"{type(caps).__name__} {caps!r}")
    return table


def _check_layers(layers: object) -> None:
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__getitem__") \
            or not hasattr(layers, "__len__"):
        raise TypeError("layers must be a sequence of decoder layers (a list or "
                        f"nn.ModuleList), got {type(layers).__name__}")


def _points(tp: int, points: Optional[Collection[str]]) -> frozenset:
    return select_points(points, POINTS, DEFAULT_POINTS.get(tp, POINTS))


def attention_weights(attention: Any) -> tuple[torch.Tensor, ...]:
    """An attention's weights in consumption order, as the reference design lists them.

    The ``.weight`` of each present module of :data:`ATTENTION_INPUTS`, then
    ``W_UK_T`` and ``W_UV`` where they are tensors, then ``o_proj.weight``.
    Absent names are skipped; ``o_proj`` must exist.
    """
    torch = _torch.require("kimi_k3.attention_weights")

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
    """The reference design's plan for ``layers`` at tensor parallelism ``tp``.

    Only MoE layers get entries, in this order per layer: ``oproj_down``,
    ``attention_moe`` (TP 8), then one ``next_attention`` entry per distinct
    (cap, carveout) of ``(next_attention or NEXT_ATTENTION)[tp]``, in the order
    of each group's first batch in that table (zero caps give no entry).  The
    last layer has no ``next_attention``.  Only the points in ``points`` get
    entries: by default ``DEFAULT_POINTS[tp]`` (the reference design's, less
    the measured losers); ``points=POINTS`` gives the reference plan exactly.
    Raises TypeError for a ``tp`` that is not an int (a bool included), a
    ``next_attention`` that is not ``{tp: {batch: cap}}`` or ``layers`` that
    are not a sequence; ValueError for a ``tp`` the table does not have or an
    unknown point.
    """
    table = _check_tp(tp, NEXT_ATTENTION if next_attention is None else next_attention)
    _check_layers(layers)
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
            moe_batches = range(5, 9) if hasattr(attention, "in_proj_qkvgfab") else (8,)
            entries.append(PlanEntry(
                "attention_moe", index, moe_batches,
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

    For servers that run Kimi's layers as ``nn.Module``s rather than the
    reference design's runtime (which calls ``fork`` itself).  The paths are relative to a layer:
    ``oproj`` (after the o-projection), ``kda_input`` / ``mla_core`` (TP 8,
    after the KDA input projection or the MLA core; the MLA core's name depends
    on the implementation, vLLM's is ``mla_attn``) and ``experts`` (once the
    routed experts are launched).  Only MoE layers are hooked, and only at the
    ``points`` :func:`plan` forks at (the same default); a missing module
    raises LookupError; a ``tp`` that is not an int raises TypeError.
    """
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise TypeError(f"tp must be an int, the tensor-parallel degree (one of "
                        f"{sorted(DEFAULT_POINTS)}), got {type(tp).__name__} {tp!r}")
    _check_layers(layers)
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
