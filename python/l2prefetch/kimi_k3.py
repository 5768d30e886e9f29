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

import math
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

from . import _torch
from .plan import CapSpec, PlanEntry, cap_groups, select_points

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "ATTENTION_INPUTS",
    "DEFAULT_DIMS",
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
    "synthetic_model",
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


# -- a synthetic Kimi-shaped model ---------------------------------------------------------

#: Full (TP 1) dimensions of the synthetic model: Kimi K2's where it has them
#: (hidden 7168, 61 layers, 384 experts, MLA with 64 heads, q-LoRA 1536, KV-LoRA
#: 512, expert width 2048); KDA sized like a 64-head MLA; the MoE latent width
#: (hidden / 4) is a guess.
DEFAULT_DIMS: dict[str, Any] = {
    "hidden": 7168,
    "layers": 61,
    "first_dense": 1,          # layers before the first MoE layer
    "mla_every": 4,            # every 4th layer is MLA (KDA:MLA 3:1)
    "experts": 384,            # router rows
    "moe_latent": 1792,        # latent-down rows of the MoE front
    "shared_intermediate": 2048,
    "kda_heads": 64,
    "kda_head_dim": 128,
    "kda_rank": 128,           # low-rank forget-gate and output-gate width
    "mla_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "dtype": "bfloat16",
}

#: At most this many layers: a controller's layer indices are 0..65535.
MAX_LAYERS = 65536
#: torch's limit on one tensor's bytes (and compute_ranges' on one span).
MAX_TENSOR_BYTES = 2**63 - 1


def _shard(dims: Mapping[str, Any], key: str, tp: int) -> int:
    value = dims[key]
    if value % tp:
        raise ValueError(f"{key}={value} does not split over tp={tp}")
    return value // tp


def _check_dims(d: Mapping[str, Any]) -> None:
    unknown = sorted(set(d) - set(DEFAULT_DIMS))
    if unknown:
        raise ValueError(f"unknown dimensions {unknown}; known: {sorted(DEFAULT_DIMS)}")
    for key, value in d.items():
        if key == "dtype":
            continue
        low = 0 if key == "first_dense" else 1
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"dimension {key} must be an int >= {low}, "
                            f"got {type(value).__name__} {value!r}")
        if value < low:
            raise ValueError(f"dimension {key} must be an int >= {low}, got {value}")
    if d["layers"] > MAX_LAYERS:
        raise ValueError(f"dimension layers must be at most {MAX_LAYERS} (a controller's "
                         f"layers are 0..{MAX_LAYERS - 1}), got {d['layers']}")


def synthetic_model(dims: Optional[Mapping[str, Any]] = None, tp: int = 8,
                         device: str = "meta") -> tuple[Any, list[Any], dict[int, Any]]:
    """A Kimi-shaped model of one TP shard: ``(model, layers, packed)`` for :func:`plan`
    (what ``python -m l2prefetch plan`` plans; shapes only on the meta device).

    ``model`` is an ``nn.Module`` whose ``layers`` hold the duck-typed layers
    (``layer_idx``, ``is_moe_layer``, ``self_attn``, ``mlp``); ``packed[i]`` is
    layer i's front tensor, also the buffer ``layers.i.mlp.front_packed`` so
    plans can be stored as JSON.  Bad dimensions raise ValueError or TypeError
    naming the dimension, a tensor they would make too large ValueError; a ``tp`` that
    is not an int >= 1 or that a sharded dimension does not split over, TypeError or
    ValueError naming ``tp``.
    """
    torch = _torch.require("kimi_k3.synthetic_model")
    from torch import nn

    d = {**DEFAULT_DIMS, **(dims or {})}
    _check_dims(d)
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise TypeError(f"tp must be an int >= 1, the tensor-parallel degree, got "
                        f"{type(tp).__name__} {tp!r}")
    if tp < 1:
        raise ValueError(f"tp must be an int >= 1, the tensor-parallel degree, got {tp}")
    dtype = getattr(torch, str(d["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {d['dtype']!r} is not a torch dtype name")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype {d['dtype']!r} is not a floating-point dtype (the model's "
                         "nn.Linear layers need one)")
    item = torch.empty((), dtype=dtype, device="meta").element_size()
    hidden = d["hidden"]
    factory = {"device": device, "dtype": dtype}

    def fits(what: str, *shape: int) -> tuple[int, ...]:
        if math.prod(shape) * item > MAX_TENSOR_BYTES:
            raise ValueError(f"dimensions too large: {what} would be "
                             f"{' x '.join(map(str, shape))} {d['dtype']}, over 2**63 bytes")
        return shape

    def empty(what: str, *shape: int) -> Any:
        return torch.empty(fits(what, *shape), **factory)

    def linear(what: str, rows: int, columns: int) -> nn.Module:
        fits(what, rows, columns)
        return nn.Linear(columns, rows, bias=False, **factory)

    def kda() -> nn.Module:
        width = _shard(d, "kda_heads", tp) * d["kda_head_dim"]
        attention = nn.Module()
        attention.in_proj_qkvgfab = linear(
            "in_proj_qkvgfab", 3 * width + 2 * d["kda_rank"] + _shard(d, "kda_heads", tp), hidden)
        attention.f_b_proj = linear("f_b_proj", width, d["kda_rank"])
        attention.g_proj = linear("g_proj", width, d["kda_rank"])
        attention.o_proj = linear("o_proj", hidden, width)
        return attention

    def mla() -> nn.Module:
        heads = _shard(d, "mla_heads", tp)
        attention = nn.Module()
        attention.fused_qkv_a_proj = linear(
            "fused_qkv_a_proj", d["q_lora_rank"] + d["kv_lora_rank"] + d["qk_rope_head_dim"],
            hidden)
        attention.q_b_proj = linear(
            "q_b_proj", heads * (d["qk_nope_head_dim"] + d["qk_rope_head_dim"]), d["q_lora_rank"])
        # Plain tensor attributes, as vLLM's MLA keeps its absorbed kv_b halves.
        attention.W_UK_T = empty("W_UK_T", heads, d["qk_nope_head_dim"], d["kv_lora_rank"])
        attention.W_UV = empty("W_UV", heads, d["kv_lora_rank"], d["v_head_dim"])
        attention.o_proj = linear("o_proj", hidden, heads * d["v_head_dim"])
        return attention

    model = nn.Module()
    model.layers = nn.ModuleList()
    packed: dict[int, Any] = {}
    for index in range(d["layers"]):
        layer = nn.Module()
        layer.layer_idx = index
        layer.is_moe_layer = index >= d["first_dense"]
        layer.self_attn = mla() if (index + 1) % d["mla_every"] == 0 else kda()
        layer.mlp = nn.Module()
        if layer.is_moe_layer:
            front = empty("the MoE front", _shard(d, "experts", tp) + _shard(d, "moe_latent", tp),
                          hidden)
            layer.mlp.register_buffer("front_packed", front, persistent=False)
            packed[index] = front
            shared = layer.mlp.shared_experts = nn.Module()
            width = _shard(d, "shared_intermediate", tp)
            shared.gate_up_proj = linear("gate_up_proj", 2 * width, hidden)
            shared.down_proj = linear("down_proj", hidden, width)
        model.layers.append(layer)
    return model, list(model.layers), packed
