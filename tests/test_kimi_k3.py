"""The Kimi K3 policy as data reproduces the reference design's controller tables."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from l2prefetch import kimi_k3
from l2prefetch.kimi_k3 import (
    FRONT_GRID,
    NEXT_ATTENTION,
    NEXT_GRID,
    POINTS,
    SHARED_GRID,
    URGENT_CARVEOUT,
    attention_weights,
    hook_points,
    plan,
)
from l2prefetch.plan import PlanEntry

H = 16


def linear(rows, columns=H):
    return nn.Linear(columns, rows, bias=False)


def kda():
    attention = nn.Module()
    attention.in_proj_qkvgfab = linear(64)
    attention.f_b_proj = linear(32, 8)
    attention.g_proj = linear(32, 8)
    attention.o_proj = linear(H, 32)
    return attention


def mla():
    attention = nn.Module()
    attention.fused_qkv_a_proj = linear(24)
    attention.q_b_proj = linear(48, 16)
    attention.W_UK_T = torch.zeros(2, 8, 4)
    attention.W_UV = torch.zeros(2, 4, 8)
    attention.mla_attn = nn.Identity()
    attention.o_proj = linear(H, 16)
    return attention


def make_layers(count=6, first_dense=1):
    """count layers, the first dense, every 4th MLA (3:1), with packed fronts."""
    layers, packed = [], {}
    for index in range(count):
        layer = nn.Module()
        layer.layer_idx = index
        layer.is_moe_layer = index >= first_dense
        layer.self_attn = mla() if (index + 1) % 4 == 0 else kda()
        layer.mlp = nn.Module()
        if layer.is_moe_layer:
            layer.mlp.shared_experts = nn.Module()
            layer.mlp.shared_experts.gate_up_proj = linear(32)
            layer.mlp.shared_experts.down_proj = linear(H, 16)
            layer.mlp.experts = nn.Identity()
            packed[index] = torch.zeros(12, H)
        layers.append(layer)
    return layers, packed


def seed_tables(layers, packed, tp, next_attention=None):
    """The reference controller's __init__, _add_capped and _add, recording instead of preparing.

    Returns {(point, layer, batch): (prepared id, weights, byte_cap, grid, carveout, priority)}.
    """
    tables, made = {}, []

    def prepared(weights, *, byte_cap=0, grid=32, carveout=None, priority=False):
        made.append((tuple(weights), byte_cap, grid, carveout, priority))
        return len(made) - 1

    def add(point, layer, batches, ranges):
        for batch in batches:
            tables[point, layer, batch] = (ranges, *made[ranges])

    following = dict((next_attention or NEXT_ATTENTION)[tp])
    for position, layer in enumerate(layers):
        if not layer.is_moe_layer:
            continue
        index, moe, attention = layer.layer_idx, layer.mlp, layer.self_attn
        ranges = prepared((packed[index],), grid=8, carveout=100, priority=True)
        add("oproj_down", index, range(3, 9), ranges)
        if tp == 8:
            shared = moe.shared_experts
            shared = shared.gate_up_proj.weight, shared.down_proj.weight
            ranges = prepared((packed[index], *shared), grid=32, carveout=100, priority=True)
            batches = range(5, 9) if hasattr(attention, "in_proj_qkvgfab") else (8,)
            add("attention_moe", index, batches, ranges)
        if position + 1 < len(layers):
            weights = attention_weights(layers[position + 1].self_attn)
            groups = {}
            for batch, spec in following.items():
                cap, carveout = spec if isinstance(spec, tuple) else (spec, None)
                if cap:
                    groups.setdefault((cap, carveout), []).append(batch)
            for (cap, carveout), batches in groups.items():
                ranges = prepared(weights, byte_cap=cap * 1024**2, grid=32, carveout=carveout)
                add("next_attention", index, batches, ranges)
    return tables


def plan_tables(entries):
    tables = {}
    for number, entry in enumerate(entries):
        for batch in entry.batches:
            key = entry.point, entry.layer, batch
            assert key not in tables, f"{key} planned twice"
            tables[key] = (number, entry.weights, entry.byte_cap, entry.grid, entry.carveout,
                           entry.priority)
    return tables


def assert_same_tables(ours, seeds):
    assert set(ours) == set(seeds)
    for key in seeds:
        _, weights, *settings = ours[key]
        _, seed_weights, *seed_settings = seeds[key]
        assert settings == seed_settings, key
        assert len(weights) == len(seed_weights) and all(
            a is b for a, b in zip(weights, seed_weights)), key
    # The same batches share one prepared table in both.
    def sharing(tables):
        groups = {}
        for (point, layer, batch), (table, *_) in tables.items():
            groups.setdefault((point, layer, table), set()).add(batch)
        return sorted((p, l, tuple(sorted(b))) for (p, l, _), b in groups.items())
    assert sharing(ours) == sharing(seeds)


#: A next_attention table with caps at every TP (the shipped one is all zeros).
CAPS24 = {tp: {batch: 24 for batch in range(1, 9)} for tp in (1, 2, 4, 8)}
#: The reference module's shape of table: two groups of batches.
GROUPED = {tp: {1: 32, 2: 32, 3: 32, 4: 32, 5: 16, 6: 16, 7: 16, 8: 16} for tp in (1, 2, 4, 8)}


@pytest.mark.parametrize("table", [None, GROUPED])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_plan_with_the_seed_points_matches_the_seed_tables(tp, table):
    layers, packed = make_layers(9)
    assert_same_tables(plan_tables(plan(layers, packed, tp, table, points=kimi_k3.POINTS)),
                       seed_tables(layers, packed, tp, table))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_default_plan_is_the_seed_tables_at_the_default_points(tp):
    layers, packed = make_layers(9)
    table = {tp: {1: 32, 2: 32, 5: (16, 50), 8: 0}}
    seeds = {key: value for key, value in seed_tables(layers, packed, tp, table).items()
             if key[0] in kimi_k3.DEFAULT_POINTS[tp]}
    ours = plan_tables(plan(layers, packed, tp, table))
    assert set(ours) == set(seeds)
    for key in seeds:  # same weights and settings (table numbering differs once points drop)
        assert ours[key][2:] == seeds[key][2:] and all(
            a is b for a, b in zip(ours[key][1], seeds[key][1])), key


def test_default_points():
    assert kimi_k3.POINTS == ("oproj_down", "attention_moe", "next_attention")
    assert sorted(kimi_k3.DEFAULT_POINTS) == [1, 2, 4, 8]
    # Measured on the H200: oproj_down and attention_moe never paid with real
    # glue around them; next_attention stays, with caps of zero.
    assert all(kimi_k3.DEFAULT_POINTS[tp] == ("next_attention",) for tp in (1, 2, 4, 8))
    layers, packed = make_layers(5)
    assert {e.point for e in plan(layers, packed, 1, {1: {4: 8}})} == {"next_attention"}
    # NEXT_ATTENTION is all zeros, so by default nothing forks at any TP ...
    assert all(plan(layers, packed, tp) == [] for tp in (1, 2, 4, 8))
    # ... and caps alone turn next_attention on; attention_moe needs points=.
    assert {e.point for e in plan(layers, packed, 8, CAPS24)} == {"next_attention"}
    assert {e.point for e in plan(layers, packed, 8, points=["attention_moe"])} == {
        "attention_moe"}
    assert [e.point for e in plan(layers, packed, 8, points=["oproj_down"])] == ["oproj_down"] * 4
    assert plan(layers, packed, 8, points=()) == []


def test_plan_tp8_entry_by_entry():
    layers, packed = make_layers(5)  # 0 dense KDA, 1-2 KDA, 3 MLA, 4 KDA (last)
    entries = plan(layers, packed, 8, CAPS24, points=POINTS)
    got = [(e.point, e.layer, e.batches) for e in entries]
    assert got == [
        ("oproj_down", 1, (3, 4, 5, 6, 7, 8)), ("attention_moe", 1, (5, 6, 7, 8)),
        ("next_attention", 1, (1, 2, 3, 4, 5, 6, 7, 8)),
        ("oproj_down", 2, (3, 4, 5, 6, 7, 8)), ("attention_moe", 2, (5, 6, 7, 8)),
        ("next_attention", 2, (1, 2, 3, 4, 5, 6, 7, 8)),
        ("oproj_down", 3, (3, 4, 5, 6, 7, 8)), ("attention_moe", 3, (8,)),
        ("next_attention", 3, (1, 2, 3, 4, 5, 6, 7, 8)),
        ("oproj_down", 4, (3, 4, 5, 6, 7, 8)), ("attention_moe", 4, (5, 6, 7, 8)),
    ]
    front = entries[0]
    assert front == PlanEntry("oproj_down", 1, range(3, 9), (packed[1],), grid=FRONT_GRID,
                              carveout=URGENT_CARVEOUT, priority=True)
    shared = layers[3].mlp.shared_experts
    assert entries[7] == PlanEntry(
        "attention_moe", 3, (8,), (packed[3], shared.gate_up_proj.weight, shared.down_proj.weight),
        grid=SHARED_GRID, carveout=100, priority=True)
    # Layer 2 prefetches layer 3's MLA attention, layer 3 prefetches layer 4's KDA.
    assert entries[5].weights == attention_weights(layers[3].self_attn)
    assert entries[8].weights == attention_weights(layers[4].self_attn)
    assert entries[5].byte_cap == 24 * 2**20
    assert {(e.grid, e.carveout, e.priority) for e in entries if e.point == "next_attention"} == {
        (NEXT_GRID, None, False)}


def test_plan_tp4_has_no_attention_moe():
    layers, packed = make_layers(5)
    points = [e.point for e in plan(layers, packed, 4, CAPS24, points=POINTS)]
    assert "attention_moe" not in points
    assert points.count("oproj_down") == 4 and points.count("next_attention") == 3


def test_dense_layers_get_nothing_and_the_last_layer_no_next_attention():
    layers, packed = make_layers(6, first_dense=3)
    entries = plan(layers, packed, 8, points=POINTS)
    assert {e.layer for e in entries} == {3, 4, 5}
    assert [e.point for e in entries if e.layer == 5] == ["oproj_down", "attention_moe"]
    # Dense layer 2 gets no next_attention although MoE layer 3 follows it.
    assert not [e for e in entries if e.layer < 3]


def test_custom_next_attention_groups_caps_and_carveouts():
    layers, packed = make_layers(3)
    table = {4: {1: 8, 2: (8, 100), 3: 8, 4: 0, 5: (8, None), 6: (24, 100), 7: (8, 100),
                 9: (2, -1)}}
    entries = [e for e in plan(layers, packed, 4, table, points=POINTS)
               if e.point == "next_attention"]
    assert [(e.layer, e.batches, e.byte_cap // 2**20, e.carveout) for e in entries] == [
        (1, (1, 3, 5), 8, None), (1, (2, 7), 8, 100), (1, (6,), 24, 100), (1, (9,), 2, -1)]
    assert all(e.weights == attention_weights(layers[2].self_attn) for e in entries)
    assert_same_tables(plan_tables(plan(layers, packed, 4, table, points=POINTS)),
                       seed_tables(layers, packed, 4, table))


def test_zero_caps_give_no_next_attention():
    layers, packed = make_layers(4)
    entries = plan(layers, packed, 2, {2: {b: 0 for b in range(1, 9)}}, points=POINTS)
    assert [e.point for e in entries] == ["oproj_down"] * 3
    entries = plan(layers, packed, 2, {2: {1: 0, 2: 4}}, points=POINTS)
    assert [(e.layer, e.batches) for e in entries if e.point == "next_attention"] == [
        (1, (2,)), (2, (2,))]


def test_unknown_tp_lists_supported():
    layers, packed = make_layers(3)
    with pytest.raises(ValueError, match=r"tp=3 .*supported: \[1, 2, 4, 8\]"):
        plan(layers, packed, 3)
    with pytest.raises(ValueError, match=r"tp=8 .*supported: \[4\]"):
        plan(layers, packed, 8, {4: {1: 8}})
    with pytest.raises(ValueError, match="supported"):
        plan([], {}, 16)


@pytest.mark.parametrize("tp", [True, False, [8], (8,), 8.0, "8", None])
def test_tp_must_be_an_int(tp):
    # True == 1 and hashes like it: without the check, plan(..., True) was the TP-1 plan.
    layers, packed = make_layers(3)
    with pytest.raises(TypeError, match=r"^tp must be an int, the tensor-parallel degree "
                                        r"\(one of \[1, 2, 4, 8\]\), got "
                                        + type(tp).__name__):
        plan(layers, packed, tp, CAPS24)
    with pytest.raises(TypeError, match=r"^tp must be an int"):
        hook_points(layers, tp)


@pytest.mark.parametrize("tp, error, words", [
    (0, ValueError, r"tp must be an int >= 1, the tensor-parallel degree, got 0$"),
    (-8, ValueError, r"tp must be an int >= 1, the tensor-parallel degree, got -8$"),
    (True, TypeError, r"tp must be an int >= 1, the tensor-parallel degree, got bool True$"),
    (8.0, TypeError, r"tp must be an int >= 1, the tensor-parallel degree, got float 8.0$"),
    (3, ValueError, r"kda_heads=64 does not split over tp=3$"),
])
def test_synthetic_model_refuses_a_bad_tp_naming_it(tp, error, words):
    # 0 was a ZeroDivisionError, -8 torch's negative dimension, True the TP-1 model
    with pytest.raises(error, match="^" + words):
        kimi_k3.synthetic_model({"layers": 2}, tp)


@pytest.mark.parametrize("table, words", [
    ([1, 2], "next_attention must map tp -> {batch: cap_mib or (cap_mib, carveout)}, "
             "e.g. {8: {1: 16, 2: 16}}, got list [1, 2]"),
    ({8: [1, 2]}, "next_attention[8] must map batch -> cap_mib or (cap_mib, carveout), "
                  "e.g. {1: 16, 2: 16}, got list [1, 2]"),
    ({8: 16}, "next_attention[8] must map batch -> cap_mib"),
])
def test_next_attention_must_be_a_table_per_tp(table, words):
    layers, packed = make_layers(3)
    with pytest.raises(TypeError) as info:
        plan(layers, packed, 8, table)
    assert str(info.value) == words or str(info.value).startswith(words)


def test_layers_must_be_a_sequence():
    layers, packed = make_layers(3)
    assert plan(nn.ModuleList(layers), packed, 8, CAPS24) == plan(layers, packed, 8, CAPS24)
    for bad in (None, 3, iter(layers), "layers"):
        with pytest.raises(TypeError, match="layers must be a sequence of decoder layers"):
            plan(bad, packed, 8)


def test_attention_weights_are_not_at_the_package_root():
    import l2prefetch

    assert not hasattr(l2prefetch, "attention_weights")
    assert "attention_weights" not in l2prefetch.__all__
    assert "attention_weights" in kimi_k3.__all__


def test_missing_packed_front_is_a_clear_error():
    layers, packed = make_layers(3)
    del packed[2]
    with pytest.raises(LookupError, match="MoE layer 2"):
        plan(layers, packed, 8)


def test_packed_may_be_a_list():
    layers, packed = make_layers(3)
    as_list = [packed.get(i) for i in range(3)]
    assert plan(layers, as_list, 8) == plan(layers, packed, 8)


def test_next_attention_table_shape():
    assert sorted(NEXT_ATTENTION) == [1, 2, 4, 8]
    for tp, table in NEXT_ATTENTION.items():
        assert table and max(table) <= 8 and min(table) >= 1, tp
        for spec in table.values():
            cap = spec[0] if isinstance(spec, tuple) else spec
            assert isinstance(cap, int) and cap >= 0
    assert (FRONT_GRID, SHARED_GRID, NEXT_GRID, URGENT_CARVEOUT) == (8, 32, 32, 100)


# ----------------------------------------------------------------------------- attention_weights

def weight_of(rows):
    return SimpleNamespace(weight=torch.zeros(rows, 4))


def test_attention_weights_follow_the_seed_order():
    names = ["g_proj", "q_b_proj", "f_b_proj", "kv_a_proj_with_mqa", "q_proj",
             "fused_qkv_a_proj", "fused_qkv_a_g_proj", "in_proj_qkvgfab"]
    attention = SimpleNamespace(**{name: weight_of(i + 1) for i, name in enumerate(names)})
    attention.W_UV, attention.W_UK_T = torch.zeros(1), torch.zeros(2)
    attention.o_proj = weight_of(99)
    got = attention_weights(attention)
    expected = [getattr(attention, name).weight for name in kimi_k3.ATTENTION_INPUTS]
    expected += [attention.W_UK_T, attention.W_UV, attention.o_proj.weight]
    assert len(got) == 11 and all(a is b for a, b in zip(got, expected))
    assert kimi_k3.ATTENTION_INPUTS == (
        "in_proj_qkvgfab", "fused_qkv_a_g_proj", "fused_qkv_a_proj", "q_proj",
        "kv_a_proj_with_mqa", "f_b_proj", "q_b_proj", "g_proj")


def test_attention_weights_skip_absent_and_non_tensors():
    attention = mla()
    got = attention_weights(attention)
    expected = (attention.fused_qkv_a_proj.weight, attention.q_b_proj.weight, attention.W_UK_T,
                attention.W_UV, attention.o_proj.weight)
    assert len(got) == 5 and all(a is b for a, b in zip(got, expected))
    # No weight attribute, a None weight, a non-tensor W_UV: all skipped.
    attention = SimpleNamespace(q_proj=SimpleNamespace(), g_proj=SimpleNamespace(weight=None),
                                W_UK_T=torch.zeros(3), W_UV=lambda: None, o_proj=weight_of(2))
    got = attention_weights(attention)
    assert len(got) == 2 and got[0] is attention.W_UK_T and got[1] is attention.o_proj.weight
    kda_attention = kda()
    assert [w.shape[0] for w in attention_weights(kda_attention)] == [64, 32, 32, H]


# ----------------------------------------------------------------------------- hook points

def test_hook_points_follow_the_plan():
    layers, packed = make_layers(5)
    points = hook_points(layers, 8, points=POINTS)
    assert [(m, l) for m, l in points["oproj_down"]] == [
        (layers[i].self_attn.o_proj, i) for i in range(1, 5)]
    assert points["attention_moe"] == [
        (layers[1].self_attn.in_proj_qkvgfab, 1), (layers[2].self_attn.in_proj_qkvgfab, 2),
        (layers[3].self_attn.mla_attn, 3), (layers[4].self_attn.in_proj_qkvgfab, 4)]
    assert points["next_attention"] == [(layers[i].mlp.experts, i) for i in range(1, 4)]
    planned = {(e.point, e.layer) for e in plan(layers, packed, 8, CAPS24, points=POINTS)}
    hooked = {(point, layer) for point, sites in points.items() for _, layer in sites}
    assert planned == hooked
    # The default points agree too.  next_attention keeps its hooks although the
    # shipped caps are zero: a plan built with next_attention= caps needs them, and a
    # fork of a key the controller does not hold returns False at once.
    planned = {(e.point, e.layer) for e in plan(layers, packed, 8, CAPS24)}
    hooked = {(point, layer) for point, sites in hook_points(layers, 8).items()
              for _, layer in sites}
    assert planned == hooked and "oproj_down" not in hook_points(layers, 8)
    assert "attention_moe" not in hook_points(layers, 4)
    # TP 1 forks no oproj_down by default, so nothing hooks the o-projection there.
    assert sorted(hook_points(layers, 1)) == ["next_attention"]
    assert sorted(hook_points(layers, 1, points=kimi_k3.POINTS)) == ["next_attention",
                                                                     "oproj_down"]
    assert list(hook_points(layers, 8, points=["next_attention"])) == ["next_attention"]


def test_hook_points_missing_module():
    layers, _ = make_layers(5)
    with pytest.raises(LookupError, match="layer 3 has no 'self_attn.core'"):
        hook_points(layers, 8, mla_core="self_attn.core", points=POINTS)
    # The MLA core is needed only where attention_moe forks: TP 8, when asked for.
    assert hook_points(layers, 4, mla_core="self_attn.core", points=POINTS)
    assert hook_points(layers, 8, mla_core="self_attn.core")
