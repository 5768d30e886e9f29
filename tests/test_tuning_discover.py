"""Discovery of weight reads and candidate roles on module trees shaped like real models (CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from l2prefetch import tuning
from l2prefetch.tuning import Read, candidates, discover

import _tuning_fakes as fakes

MIB = 1 << 20


def x_for(model, batch=1):
    h = model.model.layers[0].input_layernorm.weight.numel()
    return torch.zeros(batch, 1, h, dtype=torch.bfloat16)


def reads_of(model, **kw):
    x = x_for(model)
    return discover(model, lambda: model(x), **kw)


def test_llama_reads_in_execution_order_with_layers_and_sizes():
    model = fakes.llama(n_layers=3, h=1024, i=2048, kv=256)
    reads = reads_of(model, min_bytes=256 * 1024)
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    expected = [f"model.layers.{l}.{p}" for l in range(3) for p in per_layer] + ["lm_head"]
    assert [r.path for r in reads] == expected
    assert [r.order for r in reads] == list(range(len(expected)))
    assert [r.layer for r in reads] == [l for l in range(3) for _ in per_layer] + [None]
    q, k = reads[0], reads[1]
    assert q.nbytes == 1024 * 1024 * 2 and k.nbytes == 256 * 1024 * 2
    assert q.params == ("model.layers.0.self_attn.q_proj.weight",)
    assert q.relative == "self_attn.q_proj" and reads[-1].relative == "lm_head"
    assert not any(r.routed for r in reads)
    # Norms and the (absent) embedding are below min_bytes or not reads at all.
    assert all("layernorm" not in r.path for r in reads)


def test_min_bytes_filters_and_bad_arguments():
    model = fakes.llama(n_layers=1, h=1024, i=2048, kv=256)
    big = reads_of(model, min_bytes=2 * MIB)  # q (2 MiB), o (2 MiB), the MLP (4 MiB each), lm_head
    assert "model.layers.0.self_attn.k_proj" not in [r.path for r in big]
    assert "model.layers.0.self_attn.q_proj" in [r.path for r in big]
    with pytest.raises(ValueError, match=r"no module read a weight of at least .* lower "
                                         r"min_bytes \(tune's --min-bytes-mib\)"):
        reads_of(model, min_bytes=1 << 40)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        discover(object(), lambda: None)
    with pytest.raises(TypeError, match="run must be a callable"):
        discover(model, None)
    with pytest.raises(ValueError, match="min_bytes must be an int >= 1"):
        discover(model, lambda: None, min_bytes=0)
    with pytest.raises(TypeError, match="min_bytes must be an int"):
        discover(model, lambda: None, min_bytes=1.5)


def test_run_errors_propagate_and_hooks_are_removed():
    model = fakes.llama(n_layers=1)

    def run():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        discover(model, run)
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_llama_roles_module_and_block_sites():
    model = fakes.llama(n_layers=3, h=1024, i=2048, kv=256)
    reads = reads_of(model, min_bytes=256 * 1024)
    roles = {r.name: r for r in candidates(model, reads)}
    o = roles["after self_attn.v_proj: self_attn.o_proj"]
    assert o.kind == "module" and o.layers == (0, 1, 2) and not o.next_layer
    assert [s.site for s in o.sites] == [f"model.layers.{l}.self_attn.v_proj" for l in range(3)]
    # The load starts with the consumer and goes on in execution order up to 48 MiB.
    assert o.sites[0].reads[:3] == ("model.layers.0.self_attn.o_proj",
                                    "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")
    assert o.sites[0].weights[0] is model.model.layers[0].self_attn.o_proj.weight
    # gate_proj after o_proj, and after the whole attention block.
    assert roles["after self_attn.o_proj: mlp.gate_proj"].kind == "module"
    block = roles["after self_attn: mlp.gate_proj"]
    assert block.kind == "block" and block.sites[1].site == "model.layers.1.self_attn"
    # The next layer's q_proj after the MLP: one level inside the decoder layer.
    nxt = roles["after mlp: next self_attn.q_proj"]
    assert nxt.next_layer and nxt.layers == (0, 1) and nxt.sites[0].site == "model.layers.0.mlp"
    assert nxt.sites[0].reads[0] == "model.layers.1.self_attn.q_proj"
    assert "after mlp.down_proj: next self_attn.q_proj" in roles
    # lm_head after the last layer; ModuleLists never fork (they are not called).
    assert "after mlp.down_proj: lm_head" in roles
    assert not any(r.sites[0].site == "model.layers" for r in roles.values())
    # A role is one name per place: one site per layer.
    for r in roles.values():
        assert len(set(r.layers)) == len(r.layers)


def test_llama_roles_before_the_norms():
    """A "before" site is a part of a layer (or a module outside the layers) that runs
    between two reads, neither an ancestor of the consumer nor inside the previous read."""
    model = fakes.llama(n_layers=3, h=1024, i=2048, kv=256)
    reads = reads_of(model, min_bytes=256 * 1024)
    assert reads.calls.index("model.layers.0.post_attention_layernorm") < \
        reads.calls.index("model.layers.0.mlp") < reads.calls.index("model.layers.0.mlp.gate_proj")
    before = {r.name: r for r in candidates(model, reads) if r.kind == "before"}
    assert sorted(before) == ["before input_layernorm: self_attn.q_proj",
                              "before model.norm: lm_head",
                              "before post_attention_layernorm: mlp.gate_proj"]
    mlp = before["before post_attention_layernorm: mlp.gate_proj"]
    assert mlp.layers == (0, 1, 2) and not mlp.next_layer
    assert [(s.site, s.hook) for s in mlp.sites] == [
        (f"model.layers.{l}.post_attention_layernorm", "before") for l in range(3)]
    assert mlp.sites[0].reads[0] == "model.layers.0.mlp.gate_proj"
    assert mlp.hook_sites(model) == [(layer.post_attention_layernorm, l, "before")
                                     for l, layer in enumerate(model.model.layers)]
    assert mlp.sites[1].hook_site() == ("model.layers.1.post_attention_layernorm", 1, "before")
    # the next layer's q_proj, from the layer it is in (layer 0's has no read before it)
    attn = before["before input_layernorm: self_attn.q_proj"]
    assert attn.layers == (1, 2) and not attn.next_layer
    assert attn.sites[0].reads[0] == "model.layers.1.self_attn.q_proj"
    head = before["before model.norm: lm_head"]
    assert head.sites[0].site == "model.norm" and head.sites[0].reads == ("lm_head",)
    # after-sites keep their pairs
    after = next(r for r in candidates(model, reads) if r.kind == "module")
    assert after.sites[0].hook == "after" and len(after.hook_sites(model)[0]) == 2
    # without the call order (reads that are a plain list) there are no before-sites
    assert not [r for r in candidates(model, list(reads)) if r.kind == "before"]
    assert {r.kind for r in candidates(model, reads, kinds=("before",))} == {"before"}


def test_a_module_run_twice_is_no_before_site():
    """Phi's decoder layer runs one resid_dropout after the attention and after the MLP: a
    pre-hook on it would fork twice per layer, the second time after the consumer."""
    model = fakes.llama(n_layers=2, h=1024, i=2048, kv=256)
    for layer in model.model.layers:
        layer.dropout = torch.nn.Dropout(0.0)

        def forward(x, layer=layer):
            x = x + layer.dropout(layer.self_attn(layer.input_layernorm(x)))
            return x + layer.dropout(layer.mlp(layer.post_attention_layernorm(x)))
        layer.forward = forward
    reads = reads_of(model, min_bytes=256 * 1024)
    assert "model.layers.0.dropout" in reads.repeated
    assert "model.layers.0.post_attention_layernorm" not in reads.repeated
    names = [r.name for r in candidates(model, reads) if r.kind == "before"]
    assert "before post_attention_layernorm: mlp.gate_proj" in names
    assert not [n for n in names if "dropout" in n], names


def test_roles_from_plan_keep_a_sites_hook():
    from l2prefetch import PlanEntry

    model = fakes.llama(n_layers=2, h=1024, i=2048, kv=256)
    layers = model.model.layers
    plan = [PlanEntry("mlp", i, (1,), (layer.mlp.gate_proj.weight,)) for i, layer in
            enumerate(layers)]
    points = {"mlp": [(layers[0].post_attention_layernorm, 0, "before"),
                      (layers[1].self_attn.o_proj, 1)]}
    (role,) = tuning.roles_from_plan(model, plan, points)
    assert [(s.site, s.hook) for s in role.sites] == [
        ("model.layers.0.post_attention_layernorm", "before"),
        ("model.layers.1.self_attn.o_proj", "after")]
    assert role.hook_sites(model) == points["mlp"]


def test_cap_chain_stops_at_max_bytes():
    model = fakes.llama(n_layers=3, h=1024, i=2048, kv=256)
    reads = reads_of(model, min_bytes=256 * 1024)
    roles = candidates(model, reads, max_bytes=5 * MIB)
    o = next(r for r in roles if r.name == "after self_attn.v_proj: self_attn.o_proj")
    # o_proj 2 MiB + gate 4 MiB reaches 5 MiB: the chain stops there.
    assert o.sites[0].reads == ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj")
    assert o.max_bytes == 6 * MIB
    with pytest.raises(ValueError, match="kinds"):
        candidates(model, reads, kinds=("elsewhere",))
    only_modules = candidates(model, reads, kinds=("module",))
    assert {r.kind for r in only_modules} == {"module"}
    with pytest.raises(TypeError, match="reads\\[0\\] must be a Read"):
        candidates(model, ["model.layers.0.self_attn.q_proj"])


@pytest.mark.parametrize("fused", [True, False])
def test_moe_routed_experts_are_recorded_not_prefetched(fused):
    model = fakes.moe(n_layers=2, fused=fused)
    reads = reads_of(model, min_bytes=16 * 1024)
    routed = [r for r in reads if r.routed]
    assert routed, "the experts are reads"
    if fused:
        assert [r.path for r in routed] == ["model.layers.0.mlp.experts",
                                            "model.layers.1.mlp.experts"]
        assert routed[0].params == ("model.layers.0.mlp.experts.gate_up_proj",
                                    "model.layers.0.mlp.experts.down_proj")
    else:
        assert all(".experts.experts." in r.path for r in routed)
    roles = candidates(model, reads)
    for role in roles:
        for site in role.sites:
            assert not any(".experts" in read for read in site.reads), role.name
    names = {r.name for r in roles}
    assert "after self_attn.o_proj: mlp.gate" in names
    # After the experts (the end of the MoE block) the next layer's attention.
    assert "after mlp: next self_attn.q_proj" in names


def test_deepseek_like_dense_then_moe_layers():
    model = fakes.deepseek_like(n_layers=3)
    reads = reads_of(model, min_bytes=16 * 1024)
    roles = {r.name: r for r in candidates(model, reads)}
    # The shared experts follow the routed experts (HF DeepSeek-V3's order).
    shared = roles["after mlp.experts: mlp.shared_experts.gate_proj"]
    assert shared.layers == (1, 2)
    # The dense layer's MLP and the MoE layers' routers are roles of their own places.
    assert roles["after self_attn.o_proj: mlp.gate_proj"].layers == (0,)
    assert roles["after self_attn.o_proj: mlp.gate"].layers == (1, 2)
    # The next-attention role after the MLP block holds every layer but the last.
    assert roles["after mlp: next self_attn.q_proj"].layers == (0, 1)


def test_kimi_shaped_layers():
    model = fakes.kimi(n_layers=2)
    reads = reads_of(model)
    paths = [r.path for r in reads]
    assert paths[:4] == ["model.layers.0.self_attn.in_proj_qkvgfab", "model.layers.0.self_attn.o_proj",
                         "model.layers.0.mlp.front", "model.layers.0.mlp.shared_experts.gate_up_proj"]
    roles = {r.name: r for r in candidates(model, reads)}
    front = roles["after self_attn.o_proj: mlp.front"]
    assert front.layers == (0, 1)
    # The chain stops at the routed experts, which run before the shared expert's down_proj.
    assert front.sites[0].reads == ("model.layers.0.mlp.front",
                                    "model.layers.0.mlp.shared_experts.gate_up_proj")
    assert "after mlp: next self_attn.in_proj_qkvgfab" in roles


def test_roles_from_a_policy_plan():
    from l2prefetch import deepseek_v3

    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=64,
        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        vocab_size=512, n_group=1, topk_group=1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plan = deepseek_v3.plan(model, points=deepseek_v3.POINTS)
    roles = tuning.roles_from_plan(model, plan, lambda m: deepseek_v3.hook_points(
        m, deepseek_v3.POINTS))
    by = {r.name: r for r in roles}
    assert set(by) == {e.point for e in plan}
    nxt = by["next_attention"]
    assert nxt.kind == "policy" and nxt.layers == (0, 1)
    assert nxt.sites[0].site == "model.layers.0.mlp"
    assert nxt.default("byte_cap", None) == deepseek_v3.NEXT_ATTENTION_MIB * MIB
    with pytest.raises(ValueError, match="no hook site"):
        tuning.roles_from_plan(model, plan, {"next_attention": []})
    with pytest.raises(TypeError, match="plan\\[0\\] must be a PlanEntry"):
        tuning.roles_from_plan(model, [object()], {})


def test_hf_models_discover_unchanged():
    pytest.importorskip("transformers")
    from l2prefetch.tuning import hf

    small = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=1024)
    cases = {
        "llama": small,
        "qwen3": dict(small, head_dim=64),
        "qwen3_moe": dict(small, head_dim=64, moe_intermediate_size=256, num_experts=8,
                          num_experts_per_tok=2),
        "mixtral": dict(small, num_local_experts=4, num_experts_per_tok=2),
    }
    for model_type, overrides in cases.items():
        model = hf.load_model(model_type, overrides=overrides, device="cpu", dtype="float32")
        step = hf.DecodeStep(model, max_cache_len=16)
        reads = discover(model, lambda: step(1), min_bytes=256 * 1024)
        assert reads[0].path == "model.layers.0.self_attn.q_proj", model_type
        assert reads[-1].path == "lm_head", model_type
        roles = {r.name for r in candidates(model, reads)}
        assert "after self_attn.v_proj: self_attn.o_proj" in roles, (model_type, roles)
        assert "after mlp: next self_attn.q_proj" in roles, (model_type, roles)
        # DecodeStep runs the model twice (a prefill, then the decode step): each module
        # runs once per forward, so none is taken for a module run twice
        assert not reads.repeated, (model_type, reads.repeated)
        assert "before input_layernorm: self_attn.q_proj" in roles, (model_type, roles)
        dense = "moe" not in model_type and model_type != "mixtral"
        assert ("before post_attention_layernorm: mlp.gate_proj" in roles) == dense, roles
        if "moe" in model_type or model_type == "mixtral":
            assert any(r.routed for r in reads), model_type


def test_a_read_derives_its_path_below_the_layer_from_its_path():
    """Read's constructor is as it was (relative is not an argument), and a copy with
    another path gets that path's relative."""
    read = Read("model.layers.3.mlp.gate_proj", 3, 1 << 20, 0, ("w",), False, None, ())
    assert read.relative == "mlp.gate_proj"
    moved = dataclasses.replace(read, path="lm_head", layer=None)
    assert moved.relative == "lm_head"
