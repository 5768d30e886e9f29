"""The DeepSeek-V3 policy on module trees named like Hugging Face's DeepseekV3ForCausalLM."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from l2prefetch import deepseek_v3
from l2prefetch.deepseek_v3 import (
    DEFAULT_POINTS,
    FRONT_CARVEOUT,
    FRONT_GRID,
    NEXT_ATTENTION_MIB,
    NEXT_GRID,
    POINTS,
    attention_weights,
    hook_points,
    plan,
)
from l2prefetch.hooks import attach

H, E, I = 16, 4, 8
MIB = 2**20
NEXT = ("next_attention",)


class Norm(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.weight


class Attention(nn.Module):
    """HF's DeepseekV3Attention module names, with its read order in forward."""

    def __init__(self, q_lora_rank=12):
        super().__init__()
        self.q_lora_rank = q_lora_rank
        if q_lora_rank is None:
            self.q_proj = nn.Linear(H, 24, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, q_lora_rank, bias=False)
            self.q_a_layernorm = Norm(q_lora_rank)
            self.q_b_proj = nn.Linear(q_lora_rank, 24, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, 10, bias=False)
        self.kv_a_layernorm = Norm(8)
        self.kv_b_proj = nn.Linear(8, 32, bias=False)
        self.o_proj = nn.Linear(24, H, bias=False)

    def forward(self, x):
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        kv = self.kv_b_proj(self.kv_a_layernorm(self.kv_a_proj_with_mqa(x)[..., :8]))
        return self.o_proj(q + kv[..., :24])


class MLP(nn.Module):
    def __init__(self, width=I):
        super().__init__()
        self.gate_proj = nn.Linear(H, width, bias=False)
        self.up_proj = nn.Linear(H, width, bias=False)
        self.down_proj = nn.Linear(width, H, bias=False)

    def forward(self, x):
        return self.down_proj(torch.relu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))

    def forward(self, x):
        return nn.functional.linear(x.view(-1, H), self.weight)


class Experts(nn.Module):
    """Fused expert parameters like transformers 5's DeepseekV3NaiveMoe."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.randn(E, H, I))

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for slot in range(top_k_index.shape[1]):
            up = torch.einsum("th,tih->ti", x, self.gate_up_proj[top_k_index[:, slot]])
            gate, up = up.chunk(2, dim=-1)
            down = torch.einsum("ti,thi->th", torch.relu(gate) * up,
                                self.down_proj[top_k_index[:, slot]])
            out = out + down * top_k_weights[:, slot, None]
        return out


class MoE(nn.Module):
    """HF's order: router, routed experts, then the shared experts."""

    def __init__(self):
        super().__init__()
        self.experts = Experts()
        self.gate = Router()
        self.shared_experts = MLP(2 * I)

    def forward(self, x):
        shape = x.shape
        weights, index = self.gate(x).softmax(-1).topk(2, dim=-1)
        routed = self.experts(x.view(-1, H), index, weights).view(*shape)
        return routed + self.shared_experts(x)


class Layer(nn.Module):
    def __init__(self, moe, q_lora_rank=12):
        super().__init__()
        self.self_attn = Attention(q_lora_rank)
        self.mlp = MoE() if moe else MLP()
        self.input_layernorm = Norm(H)
        self.post_attention_layernorm = Norm(H)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, count, first_dense, q_lora_rank):
        super().__init__()
        self.layers = nn.ModuleList(Layer(i >= first_dense, q_lora_rank) for i in range(count))
        self.norm = Norm(H)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class ForCausalLM(nn.Module):
    def __init__(self, count=4, first_dense=1, q_lora_rank=12):
        super().__init__()
        self.model = Decoder(count, first_dense, q_lora_rank)
        self.lm_head = nn.Linear(H, 32, bias=False)

    def forward(self, x):
        return self.lm_head(self.model(x))


class Recorder:
    def __init__(self):
        self.calls = []

    def fork(self, point, layer, batch):
        self.calls.append((point, layer, batch))
        return True

    def join(self):
        self.calls.append(("join",))


def same(a, b):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def test_attention_weights_in_consumption_order():
    attention = Attention()
    assert same(attention_weights(attention), (
        attention.q_a_proj.weight, attention.q_b_proj.weight,
        attention.kv_a_proj_with_mqa.weight, attention.kv_b_proj.weight,
        attention.o_proj.weight))
    plain = Attention(q_lora_rank=None)
    assert same(attention_weights(plain), (
        plain.q_proj.weight, plain.kv_a_proj_with_mqa.weight, plain.kv_b_proj.weight,
        plain.o_proj.weight))
    with pytest.raises(ValueError, match="projections"):
        attention_weights(nn.Module())


def test_plan_entry_by_entry():
    model = ForCausalLM(count=4, first_dense=1)
    layers = model.model.layers
    entries = plan(model, points=POINTS)
    assert [(e.point, e.layer) for e in entries] == [
        ("next_attention", 0),
        ("oproj_down", 1), ("next_attention", 1),
        ("oproj_down", 2), ("next_attention", 2),
        ("oproj_down", 3)]
    for entry in entries:
        assert entry.batches == tuple(range(1, 9))
        if entry.point == "oproj_down":
            assert same(entry.weights, (layers[entry.layer].mlp.gate.weight,))
            assert (entry.byte_cap, entry.grid, entry.carveout, entry.priority) == (
                0, FRONT_GRID, FRONT_CARVEOUT, True)
        else:
            assert same(entry.weights, attention_weights(layers[entry.layer + 1].self_attn))
            assert (entry.byte_cap, entry.grid, entry.carveout, entry.priority) == (
                NEXT_ATTENTION_MIB * MIB, NEXT_GRID, None, False)
    # Every weight is the model's own parameter (so the plan stores as JSON).
    params = {id(p) for p in model.parameters()}
    assert all(id(w) in params for e in entries for w in e.weights)


def test_points_constants():
    assert POINTS == ("oproj_down", "next_attention")
    assert DEFAULT_POINTS == ()
    assert {"POINTS", "DEFAULT_POINTS"} <= set(deepseek_v3.__all__)
    assert deepseek_v3.__all__ == sorted(deepseek_v3.__all__)


def test_default_plan_is_empty_and_points_select():
    model = ForCausalLM(count=4, first_dense=1)
    assert plan(model) == [] and plan(model, points=DEFAULT_POINTS) == []
    assert plan(model, include_shared_experts=True) == []
    entries = plan(model, points=NEXT)
    assert [(e.point, e.layer) for e in entries] == [
        ("next_attention", 0), ("next_attention", 1), ("next_attention", 2)]
    # The same next_attention entries as with every point, and nothing else.
    every = plan(model, points=POINTS)
    assert entries == [e for e in every if e.point == "next_attention"]
    assert plan(model, points=("oproj_down", "next_attention")) == every
    assert plan(model, points=["next_attention", "oproj_down"]) == every   # order does not matter
    assert plan(model, points={"oproj_down"}) == [e for e in every if e.point == "oproj_down"]
    assert plan(model, points=()) == []
    # include_shared_experts only changes the oproj_down entries.
    assert plan(model, include_shared_experts=True, points=NEXT) == entries
    shared = plan(model, include_shared_experts=True, points=POINTS)
    assert [len(e.weights) for e in shared if e.point == "oproj_down"] == [4, 4, 4]


def test_default_hook_points_are_empty_and_points_select():
    model = ForCausalLM(count=4, first_dense=1)
    layers = model.model.layers
    assert hook_points(model) == {}
    points = hook_points(model, NEXT)
    assert list(points) == ["next_attention"]
    assert points["next_attention"] == [(layers[i].mlp, i) for i in (0, 1, 2)]
    assert list(hook_points(model, POINTS)) == ["oproj_down", "next_attention"]
    assert list(hook_points(model, ["oproj_down"])) == ["oproj_down"]
    assert hook_points(model, ()) == {}


@pytest.mark.parametrize("points", [None, POINTS, DEFAULT_POINTS, NEXT, ("oproj_down",), ()],
                         ids=["default", "POINTS", "DEFAULT_POINTS", "next_attention",
                              "oproj_down", "none"])
@pytest.mark.parametrize("first_dense", [0, 1, 4])
def test_plan_and_hook_points_agree(points, first_dense):
    model = ForCausalLM(count=4, first_dense=first_dense)
    planned = {(e.point, e.layer) for e in plan(model, points=points)}
    hooked = {(p, layer) for p, sites in hook_points(model, points).items() for _, layer in sites}
    assert planned == hooked


def test_forward_forks_where_points_say():
    model = ForCausalLM(count=3, first_dense=1)
    controller = Recorder()
    with attach(model, controller, deepseek_v3.hook_points):          # the default: no forks
        model(torch.randn(2, 1, H))
    assert controller.calls == [("join",)]
    controller = Recorder()
    with attach(model, controller, lambda m: deepseek_v3.hook_points(m, NEXT)):
        model(torch.randn(2, 1, H))
    assert controller.calls == [("next_attention", 0, 2), ("next_attention", 1, 2), ("join",)]


@pytest.mark.parametrize("bad, error, message", [
    ("oproj_down", TypeError, r"points must be a collection of point names from \('oproj_down', "
     r"'next_attention'\), got str 'oproj_down'"),
    (3, TypeError, r"points must be a collection of point names from .*, got int 3"),
    (iter(["next_attention"]), TypeError, r"points must be a collection of point names"),
    (["oproj"], ValueError, r"unknown point\(s\) \['oproj'\]: points must be names from "
     r"\('oproj_down', 'next_attention'\)"),
    (["attention_moe", "next_attention"], ValueError, r"unknown point\(s\) \['attention_moe'\]"),
    ([None], ValueError, r"unknown point\(s\) \[None\]"),
], ids=["a str", "an int", "an iterator", "unknown", "a Kimi point", "None inside"])
@pytest.mark.parametrize("call", [lambda m, p: plan(m, points=p), lambda m, p: hook_points(m, p),
                                  lambda m, p: hook_points(m, points=p)],
                         ids=["plan", "hook_points", "hook_points kw"])
def test_bad_points_are_refused(call, bad, error, message):
    with pytest.raises(error, match=message):
        call(ForCausalLM(count=2), bad)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(batches=None), TypeError, r"^batches must be an iterable of decode batches \(ints >= "
                                    r"1\), e\.g\. range\(1, 9\), got NoneType None$"),
    (dict(batches=8), TypeError, r"^batches must be an iterable .*got int 8$"),
    (dict(batches="18"), TypeError, r"^batches must be an iterable .*got str '18'$"),
    (dict(batches=[1, 0]), ValueError, r"^batches must hold ints >= 1, got 0 in \(1, 0\)$"),
    (dict(batches=[1, 2.0]), TypeError,
     r"^batches must hold ints >= 1, got float 2.0 in \(1, 2.0\)$"),
    (dict(batches=[True]), TypeError, r"^batches must hold ints >= 1, got bool True in \(True,\)$"),
    (dict(batches=[1, 65536]), ValueError,
     r"^batches must hold batches of at most 65535 \(the controller's limit\), got 65536$"),
    (dict(batches=[2, 1, 2]), ValueError, r"^batches must name each batch once, \[2\] repeat"),
    (dict(next_attention_mib=None), TypeError,
     r"^next_attention_mib must be a cap in MiB \(an int >= 0\) or a table \{batch: cap_mib "
     r"or \(cap_mib, carveout\)\}, got NoneType None$"),
    (dict(next_attention_mib=True), TypeError, r"^next_attention_mib must be .*got bool True$"),
    (dict(next_attention_mib=16.0), TypeError, r"^next_attention_mib must be .*got float 16.0$"),
    (dict(next_attention_mib=[16]), TypeError, r"^next_attention_mib must be .*got list \[16\]$"),
    (dict(next_attention_mib=-1), ValueError,
     r"^next_attention_mib must be a cap in MiB >= 0 \(0: no next_attention\), got -1$"),
    (dict(include_shared_experts=1), TypeError,
     r"^include_shared_experts must be a bool, got int 1$"),
])
@pytest.mark.parametrize("points", [None, POINTS], ids=["default points", "every point"])
def test_bad_arguments_are_refused_whatever_the_points(kwargs, error, message, points):
    with pytest.raises(error, match=message):
        plan(ForCausalLM(count=2), **kwargs, points=points)


def test_plan_with_shared_experts_and_other_batches():
    model = ForCausalLM(count=3, first_dense=0)
    entries = plan(model, batches=(1, 2, 3), next_attention_mib=8, include_shared_experts=True,
                   points=POINTS)
    mlp = model.model.layers[0].mlp
    front = entries[0]
    assert front.point == "oproj_down" and front.batches == (1, 2, 3)
    assert same(front.weights, (mlp.gate.weight, mlp.shared_experts.gate_proj.weight,
                                mlp.shared_experts.up_proj.weight,
                                mlp.shared_experts.down_proj.weight))
    assert {e.byte_cap for e in entries if e.point == "next_attention"} == {8 * MIB}


def test_plan_with_a_per_batch_table():
    model = ForCausalLM(count=2, first_dense=0)
    table = {1: 32, 2: 32, 3: (16, 100), 4: 0, 9: 64}  # 9 is not among the batches
    entries = [e for e in plan(model, batches=range(1, 5), next_attention_mib=table, points=NEXT)
               if e.point == "next_attention"]
    assert [(e.layer, e.batches, e.byte_cap // MIB, e.carveout) for e in entries] == [
        (0, (1, 2), 32, None), (0, (3,), 16, 100)]
    assert [e for e in plan(model, next_attention_mib=0, points=NEXT)
            if e.point == "next_attention"] == []


def test_plan_q_proj_model_and_all_dense():
    model = ForCausalLM(count=3, first_dense=3, q_lora_rank=None)
    entries = plan(model, points=NEXT)
    assert [e.point for e in entries] == ["next_attention", "next_attention"]
    assert entries[0].weights[0] is model.model.layers[1].self_attn.q_proj.weight


def test_decoder_layers_are_found_or_refused():
    model = ForCausalLM(count=2)
    assert deepseek_v3.decoder_layers(model) is model.model.layers
    assert deepseek_v3.decoder_layers(model.model) is model.model.layers
    with pytest.raises(ValueError, match="decoder layers"):
        deepseek_v3.decoder_layers(nn.Linear(2, 2))


def test_hook_points_fork_where_the_plan_says():
    model = ForCausalLM(count=4, first_dense=1)
    layers = model.model.layers
    points = hook_points(model, POINTS)
    assert points["oproj_down"] == [(layers[i].self_attn.o_proj, i) for i in (1, 2, 3)]
    assert points["next_attention"] == [(layers[i].mlp, i) for i in (0, 1, 2)]
    planned = {(e.point, e.layer) for e in plan(model, points=POINTS)}
    hooked = {(p, layer) for p, sites in points.items() for _, layer in sites}
    assert planned == hooked


def test_forward_forks_after_o_proj_and_after_the_moe_block():
    model = ForCausalLM(count=3, first_dense=1)
    layers = model.model.layers
    order = []
    # Record when the modules that matter finish, next to the forks.
    for name, module in (("shared", layers[1].mlp.shared_experts),
                         ("experts", layers[1].mlp.experts), ("router", layers[1].mlp.gate)):
        module.register_forward_hook(lambda m, a, o, name=name: order.append(name))
    controller = Recorder()
    real_fork = controller.fork
    controller.fork = lambda p, l, b: order.append((p, l)) or real_fork(p, l, b)
    with attach(model, controller, lambda m: deepseek_v3.hook_points(m, POINTS)):
        model(torch.randn(3, 1, H))
    assert controller.calls == [
        ("next_attention", 0, 3), ("oproj_down", 1, 3), ("next_attention", 1, 3),
        ("oproj_down", 2, 3), ("join",)]
    # next_attention of layer 1 forks after the shared experts, not between router and experts.
    assert order[order.index(("oproj_down", 1)):order.index(("next_attention", 1)) + 1] == [
        ("oproj_down", 1), "router", "experts", "shared", ("next_attention", 1)]


def test_plan_json_round_trip():
    from l2prefetch.plan import plan_from_json, plan_to_json

    model = ForCausalLM(count=3)
    entries = plan(model, include_shared_experts=True, points=POINTS)
    text = plan_to_json(entries, model)
    assert '"model.layers.1.mlp.gate.weight"' in text
    assert plan_from_json(text, model) == entries


def test_real_transformers_model():
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed here; the hand-built tree above "
        "mimics DeepseekV3ForCausalLM's module names")
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, num_attention_heads=2,
        num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=64)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    layers = model.model.layers
    assert plan(model) == [] and hook_points(model) == {}     # the default forks nowhere
    entries = plan(model, points=NEXT)
    assert [(e.point, e.layer) for e in entries] == [("next_attention", 0), ("next_attention", 1)]
    assert entries[0].weights[0] is layers[1].self_attn.q_a_proj.weight
    assert entries[0].weights[-1] is layers[1].self_attn.o_proj.weight
    controller = Recorder()
    with attach(model, controller, lambda m: deepseek_v3.hook_points(m, NEXT)), torch.no_grad():
        model(input_ids=torch.zeros(2, 1, dtype=torch.long), use_cache=False)
    assert controller.calls == [("next_attention", 0, 2), ("next_attention", 1, 2), ("join",)]
    # Every point: the router prefetch after o_proj too.
    entries = plan(model, points=POINTS)
    assert [(e.point, e.layer) for e in entries] == [
        ("next_attention", 0), ("oproj_down", 1), ("next_attention", 1), ("oproj_down", 2)]
    assert entries[1].weights[0] is layers[1].mlp.gate.weight
    assert entries[0].weights[0] is layers[1].self_attn.q_a_proj.weight
    assert entries[0].weights[-1] is layers[1].self_attn.o_proj.weight
    controller = Recorder()
    with attach(model, controller, lambda m: deepseek_v3.hook_points(m, POINTS)), torch.no_grad():
        model(input_ids=torch.zeros(2, 1, dtype=torch.long), use_cache=False)
    assert controller.calls == [
        ("next_attention", 0, 2), ("oproj_down", 1, 2), ("next_attention", 1, 2),
        ("oproj_down", 2, 2), ("join",)]
