"""``python -m l2prefetch plan``: print the Kimi plan for a synthetic Kimi-sized model.

The model lives on the ``meta`` device (shapes, no memory, no GPU), so the
plan's bytes per point and per layer, and their share of L2, can be read on
any machine.  Its dimensions are Kimi-K2-like guesses (the reference design
does not give Kimi K3's shapes); override them with options or ``--shapes
FILE.json`` (a JSON object of the keys of :data:`DEFAULT_DIMS`).

Per TP shard, in bf16 by default (``rows x columns``; ``/tp``: sharded):

* KDA attention (3 of every 4 layers): ``in_proj_qkvgfab`` [3 x kda_heads x
  kda_head_dim / tp + 2 x kda_rank + kda_heads / tp, hidden] (q, k, v, the
  low-rank output gate and forget gate, beta), ``f_b_proj`` and ``g_proj``
  [kda_heads x kda_head_dim / tp, kda_rank], ``o_proj`` [hidden, kda_heads x
  kda_head_dim / tp].
* MLA attention (every 4th layer): ``fused_qkv_a_proj`` [q_lora_rank +
  kv_lora_rank + qk_rope_head_dim, hidden] (replicated), ``q_b_proj``
  [mla_heads / tp x (qk_nope_head_dim + qk_rope_head_dim), q_lora_rank],
  ``W_UK_T`` [mla_heads / tp, qk_nope_head_dim, kv_lora_rank], ``W_UV``
  [mla_heads / tp, kv_lora_rank, v_head_dim], ``o_proj`` [hidden, mla_heads /
  tp x v_head_dim].
* MoE front (packed): [experts / tp + moe_latent / tp, hidden] (router shard
  and latent-down shard); shared expert ``gate_up_proj`` [2 x
  shared_intermediate / tp, hidden], ``down_proj`` [hidden, shared_intermediate
  / tp].  Routed experts and dense MLPs are not modelled: no point reads them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Optional

__all__ = ["DEFAULT_DIMS", "build_synthetic_kimi", "plan_main"]

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


def _shard(dims: Mapping[str, Any], key: str, tp: int) -> int:
    value = dims[key]
    if value % tp:
        raise ValueError(f"{key}={value} does not split over tp={tp}")
    return value // tp


def build_synthetic_kimi(dims: Optional[Mapping[str, Any]] = None, tp: int = 8,
                         device: str = "meta") -> tuple[Any, list[Any], dict[int, Any]]:
    """A Kimi-shaped model of one TP shard: ``(model, layers, packed)`` for ``kimi_k3.plan``.

    ``model`` is an ``nn.Module`` whose ``layers`` hold the duck-typed layers
    (``layer_idx``, ``is_moe_layer``, ``self_attn``, ``mlp``); ``packed[i]`` is
    layer i's front tensor, also the buffer ``layers.i.mlp.front_packed`` so
    plans can be stored as JSON.
    """
    import torch
    from torch import nn

    d = {**DEFAULT_DIMS, **(dims or {})}
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
    dtype = getattr(torch, str(d["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {d['dtype']!r} is not a torch dtype name")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype {d['dtype']!r} is not a floating-point dtype (the model's "
                         "nn.Linear layers need one)")
    hidden = d["hidden"]
    factory = {"device": device, "dtype": dtype}

    def linear(rows: int, columns: int) -> nn.Module:
        return nn.Linear(columns, rows, bias=False, **factory)

    def kda() -> nn.Module:
        width = _shard(d, "kda_heads", tp) * d["kda_head_dim"]
        attention = nn.Module()
        attention.in_proj_qkvgfab = linear(
            3 * width + 2 * d["kda_rank"] + _shard(d, "kda_heads", tp), hidden)
        attention.f_b_proj = linear(width, d["kda_rank"])
        attention.g_proj = linear(width, d["kda_rank"])
        attention.o_proj = linear(hidden, width)
        return attention

    def mla() -> nn.Module:
        heads = _shard(d, "mla_heads", tp)
        attention = nn.Module()
        attention.fused_qkv_a_proj = linear(
            d["q_lora_rank"] + d["kv_lora_rank"] + d["qk_rope_head_dim"], hidden)
        attention.q_b_proj = linear(heads * (d["qk_nope_head_dim"] + d["qk_rope_head_dim"]),
                                    d["q_lora_rank"])
        # Plain tensor attributes, as vLLM's MLA keeps its absorbed kv_b halves.
        attention.W_UK_T = torch.empty(heads, d["qk_nope_head_dim"], d["kv_lora_rank"], **factory)
        attention.W_UV = torch.empty(heads, d["kv_lora_rank"], d["v_head_dim"], **factory)
        attention.o_proj = linear(hidden, heads * d["v_head_dim"])
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
            front = torch.empty(_shard(d, "experts", tp) + _shard(d, "moe_latent", tp), hidden,
                                **factory)
            layer.mlp.register_buffer("front_packed", front, persistent=False)
            packed[index] = front
            shared = layer.mlp.shared_experts = nn.Module()
            width = _shard(d, "shared_intermediate", tp)
            shared.gate_up_proj = linear(2 * width, hidden)
            shared.down_proj = linear(hidden, width)
        model.layers.append(layer)
    return model, list(model.layers), packed


def _l2_mib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value * 2**20 >= 1):
        raise argparse.ArgumentTypeError(
            f"must be a finite number of MiB, at least one byte, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m l2prefetch plan",
        description="Print the Kimi K3 prefetch plan for a synthetic Kimi-sized model on the "
                    "meta device: bytes per point and per layer, and their share of L2.")
    parser.add_argument("--tp", type=int, default=8, choices=(1, 2, 4, 8),
                        help="tensor parallelism (shards the model; picks the cap table)")
    parser.add_argument("--shapes", metavar="FILE.json",
                        help="JSON object overriding dimensions: " + ", ".join(DEFAULT_DIMS))
    parser.add_argument("--hidden", type=int, help=f"hidden size ({DEFAULT_DIMS['hidden']})")
    parser.add_argument("--layers", type=int, help=f"decoder layers ({DEFAULT_DIMS['layers']})")
    parser.add_argument("--l2-mib", type=_l2_mib, default=60.0,
                        help="L2 size for the share column (60: the H200)")
    parser.add_argument("--json", action="store_true",
                        help="print the plan as JSON (weights by module path) instead")
    parser.add_argument("--next-attention-mib", type=int, metavar="MIB",
                        help="one next_attention cap for batches 1-8 (default: "
                             "kimi_k3.NEXT_ATTENTION, 0 at every TP until measured; see its "
                             "docstring)")
    parser.add_argument("--seed-points", action="store_true",
                        help="every point of the seed, oproj_down included (default: "
                             "kimi_k3.DEFAULT_POINTS, the ones that paid on the H200)")
    return parser


def plan_main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``plan`` with ``argv`` (without the ``plan`` word); returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return int(exc.code or 0)
    dims: dict[str, Any] = {}
    try:
        if args.shapes:
            with open(args.shapes, encoding="utf-8") as f:
                loaded = json.load(f)
            if not isinstance(loaded, dict):
                raise ValueError(f"{args.shapes} must hold a JSON object of dimensions")
            dims.update(loaded)
        for key in ("hidden", "layers"):
            if getattr(args, key) is not None:
                dims[key] = getattr(args, key)
        model, layers, packed = build_synthetic_kimi(dims, args.tp)
    except (OSError, ValueError, TypeError) as exc:
        print(f"l2prefetch plan: {exc}", file=sys.stderr)
        return 2

    from . import kimi_k3
    from .plan import format_plan, plan_to_json

    caps = None
    if args.next_attention_mib is not None:
        caps = {args.tp: {batch: args.next_attention_mib for batch in range(1, 9)}}
    try:
        entries = kimi_k3.plan(layers, packed, args.tp, caps,
                               points=kimi_k3.POINTS if args.seed_points else None)
    except (TypeError, ValueError) as exc:
        print(f"l2prefetch plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(plan_to_json(entries, model))
        return 0
    try:
        table = format_plan(entries, l2_bytes=int(args.l2_mib * 2**20))
    except ImportError as exc:
        print(f"l2prefetch plan: needs the C extension l2prefetch._C to size ranges ({exc}); "
              "build it with `pip install -e .`", file=sys.stderr)
        return 1
    d = {**DEFAULT_DIMS, **dims}
    moe = sum(1 for layer in layers if layer.is_moe_layer)
    print(f"Kimi K3 plan, synthetic model on meta: {d['layers']} layers ({moe} MoE), KDA:MLA "
          f"{d['mla_every'] - 1}:1, hidden {d['hidden']}, {d['dtype']}, TP {args.tp}\n")
    print(table, end="")
    if not entries:
        print("\nNo entries: by default the plan forks nowhere (kimi_k3.DEFAULT_POINTS and "
              "NEXT_ATTENTION, measured on the H200: benchmarks/RESULTS.md).  --seed-points "
              "and --next-attention-mib MIB opt in.")
    return 0
