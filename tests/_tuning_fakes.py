"""A measurement backend with planted effects, and small module trees, for the tuner's CPU tests.

:class:`PlantedBackend` answers :meth:`measure` the way a GPU would if each
role had the effect it is given: every graph instance gets its own offset
(instances differ by more than the effects, as on the H200), every arm
with forks pays each role's fork cost, loads save the role's gain (a
function of the setting, its layers included: :class:`PerLayer` plants a
gain per layer), and a pair of roles can interfere.  A seeded generator
makes every run the same.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping
from typing import Optional

import torch
from torch import nn

from l2prefetch.tuning.discovery import Role, RoleSite
from l2prefetch.tuning.arms import (NO_FORKS, Arm, Backend, Prepared, Probe, Setting,
                                      no_forks_of, parse_arm_key)
from l2prefetch.tuning.errors import StepError

MIB = 1 << 20


class Clock:
    """A clock the backend advances by what each group would cost on a GPU."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class PerLayer:
    """A role's gain as the sum of its layers': ``gains[layer]`` us (or a function of
    the setting) for each layer the setting forks at (all ``layers`` of the role when
    its layers are None); a layer not in ``gains`` gains ``other``."""

    def __init__(self, gains: Mapping[int, float | Callable[[Setting], float]], layers: int = 4,
                 other: float | Callable[[Setting], float] = 0.0) -> None:
        self.gains, self.layers, self.other = dict(gains), layers, other

    def __call__(self, setting: Setting) -> float:
        layers = range(self.layers) if setting.layers is None else setting.layers
        total = 0.0
        for layer in layers:
            gain = self.gains.get(layer, self.other)
            total += gain(setting) if callable(gain) else gain
        return total


class PlantedBackend(Backend):
    """Planted gains; instance i of every arm shares offset i.  With ``paired``,
    arms of one fork structure (same roles and modes) are measured as switched
    states of one instance (their own noise 0.2 us) and reported in ``pairs``.
    Every arm key must be one :func:`~l2prefetch.tuning.arms.arm_key` makes."""

    rounds = 10

    def __init__(self, gains: Mapping[str, Callable[[Setting], float]], *,
                 fork_cost_us: float = 0.5, instance_sd_us: float = 1.0, step_us: float = 2000.0,
                 interference: Mapping[frozenset, float] = (), gaps: Mapping[str, float] = (),
                 seed: int = 0, clock: Clock | None = None, capture_s: float = 0.02,
                 fail: Mapping[int, Exception] = (), differs: frozenset = frozenset(),
                 paired: bool = False, shared: bool = False, capture_sd_us: float = 0.0,
                 derives: bool = False) -> None:
        self.gains = dict(gains)
        self.fork_cost_us, self.sd, self.step_us = fork_cost_us, instance_sd_us, step_us
        self.interference = dict(interference)
        self.gaps = dict(gaps)
        self.rng = random.Random(seed)
        self.clock = clock
        self.capture_s = capture_s
        self.fail = dict(fail)
        self.differs = differs
        self.groups: list[dict[str, Arm]] = []
        #: The instances of each measured group (every group holds (a)).
        self.instances: list[int] = []
        self.prepared: list[int] = []
        self.switches = paired
        #: Every arm of an instance index shares its placement: all are paired, (a) too.
        self.shared_placement = shared
        self.pairs: list[set[str]] = []
        #: Where each capture's buffers land, even in a shared pool: per capture (a fork
        #: structure, or (a) itself) and instance, an offset of this SD (RESULTS run 18).
        self.capture_sd = capture_sd_us
        #: Each fork structure also replays without its forks (Backend.references).
        self.derives_no_forks = derives
        self.references: dict[str, str] = {}

    def prepare(self, batch: int) -> Prepared:
        if batch in self.fail:
            raise StepError(f"step({batch}) failed") from self.fail[batch]
        self.prepared.append(batch)
        return Prepared(step_us=self.step_us, capture_s=self.capture_s)

    def probe(self, batch, roles):
        return {name: Probe(window_us=10.0, gap_us=gap) for name, gap in self.gaps.items()}

    def time(self, arm: Arm, offset: float) -> float:
        t = self.step_us + offset + self.rng.gauss(0.0, 0.2)
        names = set()
        for name, setting in arm.roles:
            t += self.fork_cost_us * 1  # one fork node per role (the layers are folded in)
            if not arm.empty:
                # loads at some layers only: the gain of those layers (PerLayer sums them)
                loaded = setting if arm.loads_at is None else \
                    dataclasses.replace(setting, layers=arm.loads_at)
                t -= self.gains.get(name, lambda s: 0.0)(loaded)
                names.add(name)
        for pair, penalty in self.interference.items():
            if pair <= names:
                t += penalty
        return t

    def measure(self, batch, arms, instances):
        for key in arms:
            parse_arm_key(key)
        self.groups.append(dict(arms))
        self.instances.append(instances)
        offsets = [self.rng.gauss(0.0, self.sd) for _ in range(instances)]
        structures: dict[tuple, set[str]] = {}
        for name, v in arms.items():
            if v.roles:
                structures.setdefault(v.structure(), set()).add(name)
        self.pairs = [g for g in structures.values() if len(g) > 1] if self.switches else []
        shared = {n: k for k, g in enumerate(self.pairs) for n in g}
        group_offsets = [[self.rng.gauss(0.0, self.sd) for _ in range(instances)]
                         for _ in self.pairs]
        # a capture's own placement: per structure (switched arms share it) or arm
        heads = {name: min(g) for g in structures.values() for name in g} if self.switches \
            else {name: name for name in arms}
        bias = {head: [self.rng.gauss(0.0, self.capture_sd) if self.capture_sd else 0.0
                       for _ in range(instances)]
                for head in sorted(set(heads.values()) | {NO_FORKS})}
        heads[NO_FORKS] = NO_FORKS
        if self.shared_placement:
            self.pairs, shared = [set(arms)], {}
        own = {name: (0.2 if name in shared or self.shared_placement else self.sd)
               for name in arms}
        times = {name: [self.time(v, offsets[i] + (group_offsets[shared[name]][i]
                                                    if name in shared else 0.0)
                                  + bias[heads.get(name, name)][i]
                                  + self.rng.gauss(0.0, own[name]))
                        for i in range(instances)] for name, v in arms.items()}
        self.references = {}
        if self.derives_no_forks:
            for name, arm in arms.items():
                if arm.roles:
                    key = no_forks_of(heads[name])
                    self.references[name] = key
                    if key not in times:
                        times[key] = [t - self.time(arms[heads[name]], 0.0)
                                      + self.time(Arm(), 0.0)
                                      for t in times[heads[name]]]
            for g in self.pairs:
                g.update(self.references[n] for n in list(g) if n in self.references)
        if self.clock is not None:
            self.clock.t += len(arms) * instances * (
                self.capture_s + self.rounds * self.step_us * 1e-6)
        identical = {name: not (set(n for n, _ in v.roles) & self.differs) or v.empty
                     for name, v in arms.items()}
        return times, identical


def role(name: str, layers: int = 4, mib: float = 32, site: str = "x",
         like: Optional[Role] = None) -> Role:
    """A role with ``layers`` sites, each loading one CPU tensor of ``mib`` MiB, the
    weights of read ``{name}.{layer}``; with ``like``, its consumer's weights and reads
    instead (a role at another site before the same consumer)."""
    sites = []
    for layer in range(layers):
        if like is not None:
            same = like.sites[layer]
            reads, t = same.reads, same.weights[0]
        else:
            reads, t = (f"{name}.{layer}",), torch.empty(int(mib * MIB) // 2,
                                                        dtype=torch.bfloat16)
        sites.append(RoleSite(layer=layer, site=f"layers.{layer}.{site}", reads=reads,
                              weights=(t,), nbytes=(t.numel() * 2,)))
    return Role(name=name, consumer=name if like is None else like.consumer, site=site,
                kind="module", next_layer=False, sites=tuple(sites))


# ------------------------------------------------------------------ module trees

class RMSNorm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x):
        return x * self.weight


def _zeros_like_out(x, n):
    return x.new_zeros(*x.shape[:-1], n)


class Dense(nn.Linear):
    """A Linear whose forward only makes a zero tensor of the right shape (fast on CPU)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = n_in, n_out
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=torch.bfloat16),
                                   requires_grad=False)
        self.bias = None

    def forward(self, x):
        return _zeros_like_out(x, self.out_features)


class Attention(nn.Module):
    def __init__(self, h: int, q: int, kv: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = Dense(h, q), Dense(h, kv), Dense(h, kv)
        self.o_proj = Dense(q, h)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(q + 0 * k.sum() + 0 * v.sum())


class MLP(nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = Dense(h, i), Dense(h, i), Dense(i, h)

    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * self.up_proj(x))


class FusedExperts(nn.Module):
    """HF-style fused experts: stacked [E, 2I, H] and [E, H, I] parameters."""

    def __init__(self, e: int, h: int, i: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=torch.bfloat16),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=torch.bfloat16),
                                      requires_grad=False)

    def forward(self, x):
        return x + 0 * self.gate_up_proj[0, 0, 0] + 0 * self.down_proj[0, 0, 0]


class ListExperts(nn.Module):
    """Mixtral-style experts: one module per expert, a batch-dependent subset runs."""

    def __init__(self, e: int, h: int, i: int, top: int = 2) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            nn.ModuleDict({"w1": Dense(h, i), "w2": Dense(i, h), "w3": Dense(h, i)})
            for _ in range(e))
        self.top = top

    def forward(self, x):
        out = x
        for expert in list(self.experts)[: self.top]:
            out = out + expert["w2"](expert["w1"](x) * expert["w3"](x))
        return out


class MoE(nn.Module):
    def __init__(self, h: int, i: int, e: int, shared: bool, fused: bool = True) -> None:
        super().__init__()
        self.gate = Dense(h, e)
        self.experts = FusedExperts(e, h, i) if fused else ListExperts(e, h, i)
        self.shared_experts = MLP(h, i) if shared else None

    def forward(self, x):
        self.gate(x)
        y = self.experts(x)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class Layer(nn.Module):
    def __init__(self, h: int, mlp: nn.Module, q: int = 0, kv: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(h)
        self.self_attn = Attention(h, q or h, kv or h // 4)
        self.post_attention_layernorm = RMSNorm(h)
        self.mlp = mlp

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, layers: list[nn.Module], h: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(h)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class CausalLM(nn.Module):
    def __init__(self, layers: list[nn.Module], h: int, vocab: int) -> None:
        super().__init__()
        self.model = Decoder(layers, h)
        self.lm_head = Dense(h, vocab)

    def forward(self, x):
        return self.lm_head(self.model(x))


def llama(n_layers: int = 3, h: int = 1024, i: int = 2048, kv: int = 256) -> CausalLM:
    return CausalLM([Layer(h, MLP(h, i), kv=kv) for _ in range(n_layers)], h, 4096)


def moe(n_layers: int = 3, h: int = 1024, i: int = 512, e: int = 8, fused: bool = True,
        shared: bool = False) -> CausalLM:
    return CausalLM([Layer(h, MoE(h, i, e, shared=shared, fused=fused)) for _ in range(n_layers)],
                    h, 4096)


def deepseek_like(n_layers: int = 3, h: int = 1024) -> CausalLM:
    """First layer dense, the rest MoE with a shared expert (HF DeepSeek-V3's order)."""
    layers = [Layer(h, MLP(h, 2048))] + [Layer(h, MoE(h, 512, 8, shared=True))
                                          for _ in range(n_layers - 1)]
    return CausalLM(layers, h, 4096)


class KimiAttention(nn.Module):
    """Kimi's KDA attention at TP8 shard sizes: a fused input projection, then o_proj."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.in_proj_qkvgfab = Dense(h, 1152)
        self.o_proj = Dense(1024, h)

    def forward(self, x):
        return self.o_proj(self.in_proj_qkvgfab(x)[..., :1024])


class KimiMoE(nn.Module):
    """The MoE front (router + latent down, packed), a shared expert, fused routed experts."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.front = Dense(h, 512)
        self.shared_experts = nn.ModuleDict({"gate_up_proj": Dense(h, 384),
                                             "down_proj": Dense(192, h)})
        self.experts = FusedExperts(8, h, 256)

    def forward(self, x):
        self.front(x)
        g = self.shared_experts["gate_up_proj"](x)
        return self.experts(x) + self.shared_experts["down_proj"](g[..., :192])


def kimi(n_layers: int = 2, h: int = 7168) -> CausalLM:
    layers = []
    for _ in range(n_layers):
        layer = Layer(h, KimiMoE(h))
        layer.self_attn = KimiAttention(h)
        layers.append(layer)
    return CausalLM(layers, h, 4096)


FAKE_DEVICE = {"name": "NVIDIA H200", "sm": 90, "sm_count": 132, "l2_bytes": 60 << 20,
               "driver_version": 13000}


class DeviceBackend(PlantedBackend):
    """A planted backend that also says which (fake) device it measured on, and whose
    arms (as GraphBackend's on an eager step) read their site's activation last."""

    warm_activation = True

    def device_fingerprint(self) -> dict:
        return dict(FAKE_DEVICE)
