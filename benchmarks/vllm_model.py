"""A decoder written the way vLLM writes one, and its decode step (issue 40).

What vLLM's model code does that Hugging Face's does not, kept here:

* fused projections: one ``qkv_proj`` (q, k and v split after the GEMM) and one
  ``gate_up_proj`` followed by SiLU-and-mul;
* RMSNorm with the residual add fused: ``norm(x, residual) -> (normed, x + residual)``,
  so a layer hands its residual stream to the next one;
* rotary embedding from a cos/sin cache indexed by the positions;
* a paged KV cache: ``[blocks, block_size, kv_heads, head_dim]`` per layer, the new
  token's key and value written at its slot, a block table per sequence gathered for
  attention, which ``scaled_dot_product_attention`` computes with a length mask;
* an all-reduce slot after ``o_proj`` and ``down_proj`` as a custom op (identity on one
  GPU; ``spin_us`` plants a compile-proof window in it, a stand-in for a TP all-reduce).

:class:`Decode` is ``step(batch)`` on static buffers for :func:`l2prefetch.tuning.tune`
(capture sizes as vLLM's: 1, 2, 4, 8, 16, 32, 64).  Two ways to capture it, as vLLM
does: FULL (the whole step one CUDA graph: what the tuner's rig captures) and
PIECEWISE (:class:`Piecewise`: a graph per piece between attentions, attention run
between the replays; a controller's pending branch fork is joined at the end of
each piece, since a fork and its join may not sit in different graphs).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import torch
from torch import nn

#: vLLM's decode capture sizes (the first of its default list).
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _slot(after: torch.Tensor, cycles: int) -> None:
    if cycles > 0:
        torch.cuda._sleep(cycles)


# The all-reduce slot: ORDERED-effectful as l2prefetch's own ops, so Dynamo keeps it
# (torch.cuda._sleep alone it drops), and a tensor argument that it follows.
all_reduce_slot = torch.library.custom_op("l2p_vllm::all_reduce_slot", _slot, mutates_args=(),
                                          schema="(Tensor after, int cycles) -> ()")
all_reduce_slot.register_fake(lambda after, cycles: None)
try:
    from torch._library.effects import EffectType

    all_reduce_slot.register_effect(EffectType.ORDERED)
except (ImportError, AttributeError):  # older torch: the slot may be dropped when compiled
    pass


@dataclasses.dataclass(frozen=True)
class Config:
    hidden: int = 3072
    intermediate: int = 8192
    layers: int = 6
    heads: int = 24
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 32000
    block_size: int = 16
    max_len: int = 256          # tokens per sequence the block table covers
    eps: float = 1e-6
    theta: float = 10000.0

    @property
    def blocks_per_seq(self) -> int:
        return math.ceil(self.max_len / self.block_size)


#: The test suite's small one.
TINY = Config(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=64,
              vocab=512, max_len=64)


class RMSNorm(nn.Module):
    """vLLM's RMSNorm: with ``residual``, adds it first and returns (normed, sum)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> Any:
        if residual is not None:
            x = x + residual
            residual = x
        v = x.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * v.to(x.dtype)
        return out if residual is None else (out, residual)


class Rotary(nn.Module):
    """Neox-style rotary embedding from a cos/sin cache (a buffer, not a weight)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        inv = 1.0 / cfg.theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        freqs = torch.outer(torch.arange(cfg.max_len).float(), inv)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], -1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Any:
        cos, sin = self.cos_sin[positions].chunk(2, -1)            # [B, hd/2]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            b, n, d = x.shape
            x1, x2 = x.float().chunk(2, -1)
            c, s = cos[:, None, :], sin[:, None, :]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)
        return rotate(q), rotate(k)


class Attention(nn.Module):
    def __init__(self, cfg: Config, index: int, spin: Callable[[], int]) -> None:
        super().__init__()
        self.cfg, self.index, self.spin = cfg, index, spin
        self.q_size, self.kv_size = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden, bias=False)
        self.rotary = Rotary(cfg)
        self.attn = PagedAttention(cfg)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: "Meta") -> torch.Tensor:
        cfg = self.cfg
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], -1)
        b = x.shape[0]
        q, k = self.rotary(positions, q.view(b, cfg.heads, cfg.head_dim),
                           k.view(b, cfg.kv_heads, cfg.head_dim))
        out = self.attn(q, k, v.view(b, cfg.kv_heads, cfg.head_dim), meta, self.index)
        out = self.o_proj(out.reshape(b, self.q_size))
        all_reduce_slot(out, self.spin())
        return out


class PagedAttention(nn.Module):
    """Decode attention over a paged KV cache (the cache: Meta's tensors, per layer).

    With ``piecewise`` set (:class:`Piecewise`), it runs outside compiled code
    (``torch.compiler.disable``: a graph break, as vLLM's splitting op) and outside the
    CUDA graphs, between the pieces."""

    piecewise = False

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: "Meta",
                layer: int) -> torch.Tensor:
        if self.piecewise:
            return _between_pieces(self, q, k, v, meta, layer)
        return self.attend(q, k, v, meta, layer)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: "Meta",
               layer: int) -> torch.Tensor:
        cfg = self.cfg
        k_cache, v_cache = meta.k_cache[layer], meta.v_cache[layer]
        flat_k = k_cache.view(-1, cfg.kv_heads, cfg.head_dim)
        flat_v = v_cache.view(-1, cfg.kv_heads, cfg.head_dim)
        flat_k.index_copy_(0, meta.slots, k)                       # the new token's slot
        flat_v.index_copy_(0, meta.slots, v)
        b = q.shape[0]
        keys = k_cache[meta.block_table].view(b, -1, cfg.kv_heads, cfg.head_dim)
        values = v_cache[meta.block_table].view(b, -1, cfg.kv_heads, cfg.head_dim)
        mask = meta.mask[:, None, None, :]                         # [B, 1, 1, T]
        groups = cfg.heads // cfg.kv_heads
        out = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None, :], keys.transpose(1, 2).repeat_interleave(groups, 1),
            values.transpose(1, 2).repeat_interleave(groups, 1), attn_mask=mask)
        return out.view(b, cfg.heads, cfg.head_dim)


#: The Piecewise runner capturing or replaying now (its attention calls end a piece).
_RUNNER: Optional["Piecewise"] = None


@torch.compiler.disable
def _between_pieces(module: PagedAttention, *args: Any) -> torch.Tensor:
    runner = _RUNNER
    if runner is not None:
        runner._end_piece()
    out = module.attend(*args)
    if runner is not None:
        runner._begin_piece(module, args, out)
    return out


class MLP(nn.Module):
    def __init__(self, cfg: Config, spin: Callable[[], int]) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden, 2 * cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)
        self.spin = spin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        out = self.down_proj(torch.nn.functional.silu(gate) * up)   # SiLU-and-mul
        all_reduce_slot(out, 0)
        return out


class Layer(nn.Module):
    def __init__(self, cfg: Config, index: int, spin: Callable[[], int]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = Attention(cfg, index, spin)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = MLP(cfg, lambda: 0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: Optional[torch.Tensor], meta: "Meta") -> Any:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Model(nn.Module):
    """The decoder: ``model.layers``, ``model.norm``, ``lm_head`` (the paths the tuner's
    discovery names, as in vLLM's checkpoints)."""

    def __init__(self, cfg: Config = Config(), spin_cycles: int = 0) -> None:
        super().__init__()
        self.cfg, self.spin_cycles = cfg, spin_cycles
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.model.layers = nn.ModuleList(Layer(cfg, i, lambda: self.spin_cycles)
                                          for i in range(cfg.layers))
        self.model.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: "Meta") -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.model.norm(x, residual)
        return self.lm_head(x)


@dataclasses.dataclass
class Meta:
    """One batch's static decode buffers: the paged caches, the block table, the new
    tokens' slots and the attention mask (positions up to each sequence's length)."""

    k_cache: list
    v_cache: list
    block_table: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor


class Decode:
    """``step(batch)``: one decode step of ``model`` on static buffers, every replay the
    same work: each sequence ``prompt_len`` tokens long (random keys and values in its
    blocks), the new token written at position ``prompt_len``.  Returns the logits."""

    def __init__(self, model: Model, prompt_len: int = 32, seed: int = 0) -> None:
        if not 0 < prompt_len < model.cfg.max_len:
            raise ValueError(f"prompt_len must be in 1..{model.cfg.max_len - 1}, got "
                             f"{prompt_len!r}")
        self.model, self.prompt_len, self.seed = model, prompt_len, seed
        self._state: dict[int, tuple] = {}

    def state(self, batch: int) -> tuple:
        if batch in self._state:
            return self._state[batch]
        cfg, model = self.model.cfg, self.model
        param = model.lm_head.weight
        device, dtype = param.device, param.dtype
        g = torch.Generator(device="cpu").manual_seed(self.seed * 1000 + batch)
        nblocks = batch * cfg.blocks_per_seq
        shape = (nblocks, cfg.block_size, cfg.kv_heads, cfg.head_dim)
        k = [torch.randn(shape, generator=g).to(device, dtype) for _ in range(cfg.layers)]
        v = [torch.randn(shape, generator=g).to(device, dtype) for _ in range(cfg.layers)]
        table = torch.randperm(nblocks, generator=g).view(batch, cfg.blocks_per_seq).to(device)
        pos = self.prompt_len
        slots = table[:, pos // cfg.block_size] * cfg.block_size + pos % cfg.block_size
        span = torch.arange(cfg.blocks_per_seq * cfg.block_size, device=device)
        mask = (span <= pos).expand(batch, -1).contiguous()
        ids = torch.randint(0, cfg.vocab, (batch,), generator=g).to(device)
        positions = torch.full((batch,), pos, dtype=torch.long, device=device)
        self._state[batch] = (ids, positions, Meta(k, v, table, slots.contiguous(), mask))
        return self._state[batch]

    def __call__(self, batch: int) -> torch.Tensor:
        ids, positions, meta = self.state(batch)
        return self.model(ids, positions, meta)


class Piecewise:
    """vLLM's PIECEWISE capture of a decode step: a CUDA graph per piece of the step
    between attentions, each attention run eagerly between the replays.

    Sets every :class:`PagedAttention` of the model to run between the pieces (outside
    compiled code and graphs), warms the step up, then captures it: a piece ends where
    an attention begins and the next begins where it returns.  ``join`` (an
    :class:`l2prefetch.hooks.Attachment`'s, say) is called at the end of every piece,
    inside its capture, so that a branch fork forked in a piece is joined in it;
    ``pending`` (the controller's), when given, is asked before each piece ends, and a
    fork still pending then is refused with a ValueError: a CUDA graph cannot hold a
    fork whose join lies in another graph.  :meth:`replay` replays the pieces and runs
    each attention eagerly between them, on the buffers it was captured with.
    """

    def __init__(self, step: Decode, batch: int, join: Callable[[], Any] = lambda: None,
                 pending: Optional[Callable[[], bool]] = None) -> None:
        self.step, self.batch, self.join, self.pending = step, batch, join, pending
        self.graphs: list = []
        self.attentions: list = []      # (module, args, output) between piece i and i+1
        self.output: Optional[torch.Tensor] = None
        self._pool = torch.cuda.graph_pool_handle()
        self._graph: Any = None
        for layer in step.model.model.layers:
            layer.self_attn.attn.piecewise = True
        self._capture()

    def _begin_piece(self, module: Any = None, args: Any = None, out: Any = None) -> None:
        if module is not None:
            self.attentions.append((module, args, out))
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self._pool)

    def _end_piece(self) -> None:
        self.join()
        if self.pending is not None and self.pending():
            graph, self._graph = self._graph, None
            try:
                graph.capture_end()
            except RuntimeError:   # the driver's own refusal of the unjoined fork
                pass
            raise ValueError(f"piece {len(self.graphs)} of the step ends with a fork not "
                             "joined: a fork and its join cannot lie in different CUDA "
                             "graphs; join at the end of each piece (Piecewise(join=...)) "
                             "or fork inline or leaf, which need no join")
        self._graph.capture_end()
        self.graphs.append(self._graph)
        self._graph = None

    def _capture(self) -> None:
        global _RUNNER
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            self.step(self.batch)                 # warm-up: compiles, no capture
            torch.cuda.synchronize()
            _RUNNER = self
            try:
                self._begin_piece()
                self.output = self.step(self.batch)
                self._end_piece()
            finally:
                _RUNNER = None
                if self._graph is not None:       # a failed piece: end its capture
                    try:
                        self._graph.capture_end()
                    except RuntimeError:
                        pass
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def replay(self) -> torch.Tensor:
        with torch.no_grad():
            for i, graph in enumerate(self.graphs):
                graph.replay()
                if i < len(self.attentions):
                    module, args, out = self.attentions[i]
                    out.copy_(module.attend(*args))
        return self.output
