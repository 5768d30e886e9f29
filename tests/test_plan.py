"""PlanEntry validation, cap grouping, format_plan and the JSON form of plans (CPU only)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
from typing import get_args

import pytest

import torch
from torch import nn

import l2prefetch
from l2prefetch.plan import (
    DEFAULT_L2_BYTES,
    GRAPH_FORKS,
    MAX_BATCH,
    MAX_LAYER,
    GraphFork,
    KernelName,
    PlanEntry,
    cap_groups,
    compact_batches,
    format_plan,
    plan_from_json,
    plan_to_json,
)

from test_ranges import seed_ranges  # the seed's rules, one transcription

MIB = 2**20


@pytest.fixture
def fake_c(monkeypatch):
    """Stand in for l2prefetch._C with the seed's rules (formatting tests need no C build)."""
    fake = types.ModuleType("l2prefetch._C")
    fake.compute_ranges = seed_ranges
    monkeypatch.setitem(sys.modules, "l2prefetch._C", fake)
    monkeypatch.setattr(l2prefetch, "_C", fake, raising=False)
    monkeypatch.setattr(l2prefetch.plan, "_C", fake)   # plan.py imports _C at its top
    return fake


def w(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


# ----------------------------------------------------------------------------- PlanEntry

def test_entry_normalises_batches_and_weights():
    a, b = w(4, 8), w(8)
    entry = PlanEntry("next_attention", 3, [8, 5, 6, 7], [a, b])
    assert entry.batches == (5, 6, 7, 8)
    assert isinstance(entry.weights, tuple)
    assert entry.weights[0] is a and entry.weights[1] is b
    assert PlanEntry("p", 0, range(3, 9), (a,)).batches == (3, 4, 5, 6, 7, 8)
    assert (entry.byte_cap, entry.grid, entry.carveout, entry.priority) == (0, 32, None, False)


def test_entry_is_frozen_and_slotted():
    entry = PlanEntry("p", 0, (1,), (w(4),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.layer = 2  # type: ignore[misc]
    assert not hasattr(entry, "__dict__")


GOOD = dict(point="p", layer=0, batches=(1,), byte_cap=0, grid=32, carveout=None, priority=False)


@pytest.mark.parametrize("field, value, error, words", [
    ("point", 3, TypeError, ["point", "3", "non-empty str"]),
    ("point", "", ValueError, ["point", "non-empty"]),
    ("layer", -1, ValueError, ["layer", "-1", ">= 0"]),
    ("layer", 1.0, TypeError, ["layer", "float", "int"]),
    ("layer", True, TypeError, ["layer", "bool"]),
    ("batches", (), ValueError, ["batches", "at least one"]),
    ("batches", 8, TypeError, ["batches", "iterable"]),
    ("batches", "38", TypeError, ["batches", "iterable"]),
    ("batches", (0, 1), ValueError, ["batches", "0", ">= 1"]),
    ("batches", (1, 2.0), TypeError, ["batches", "float"]),
    ("batches", (3, 4, 3), ValueError, ["batches", "once", "[3]"]),
    ("byte_cap", -16, ValueError, ["byte_cap", "-16", ">= 0"]),
    ("byte_cap", 1.5, TypeError, ["byte_cap", "float"]),
    ("grid", 0, ValueError, ["grid", "0", "1..65535"]),
    ("grid", 65536, ValueError, ["grid", "65536", "1..65535"]),
    ("grid", "32", TypeError, ["grid", "str"]),
    ("carveout", 101, ValueError, ["carveout", "101", "-1..100"]),
    ("carveout", -2, ValueError, ["carveout", "-2", "-1..100"]),
    ("carveout", 50.0, TypeError, ["carveout", "float"]),
    ("priority", 1, TypeError, ["priority", "bool", "1"]),
])
def test_entry_rejects_bad_fields(field, value, error, words):
    with pytest.raises(error) as info:
        PlanEntry(**{**GOOD, field: value}, weights=(w(4),))
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("grid", 1), ("grid", 65535), ("carveout", -1), ("carveout", 0), ("carveout", 100),
    ("byte_cap", 16), ("layer", 60), ("priority", True),
])
def test_entry_accepts_boundaries(field, value):
    assert getattr(PlanEntry(**{**GOOD, field: value}, weights=(w(4),)), field) == value


def test_entry_rejects_bad_weights():
    with pytest.raises(ValueError, match="at least one tensor"):
        PlanEntry("p", 0, (1,), ())
    with pytest.raises(TypeError, match=r"not one tensor.*\(tensor,\)"):
        PlanEntry("p", 0, (1,), w(4, 4))
    with pytest.raises(TypeError, match=r"weights\[1\] must be a torch.Tensor, got list"):
        PlanEntry("p", 0, (1,), (w(4), [1, 2]))
    with pytest.raises(TypeError, match="sequence of tensors"):
        PlanEntry("p", 0, (1,), 5)
    meta = torch.empty(4, device="meta")
    with pytest.raises(ValueError, match="one device.*cpu.*meta"):
        PlanEntry("p", 0, (1,), (w(4), meta))


def test_entry_equality_is_by_weight_identity():
    a, b = w(4, 4), w(4, 4)
    one = PlanEntry("p", 1, (2, 1), (a,))
    assert one == PlanEntry("p", 1, [1, 2], [a])
    assert hash(one) == hash(PlanEntry("p", 1, [1, 2], [a]))
    assert one != PlanEntry("p", 1, (1, 2), (b,))  # equal values, another tensor: no exception
    assert one != PlanEntry("p", 1, (1, 2), (a,), grid=8)
    assert len({one, PlanEntry("p", 1, (1, 2), (a,))}) == 1


def test_settings_decide_table_sharing():
    a, b = w(4, 4), w(8)
    one = PlanEntry("next_attention", 1, (1, 2), (a, b), byte_cap=MIB, carveout=50)
    other = PlanEntry("oproj_down", 7, (5,), [a, b], byte_cap=MIB, carveout=50)
    assert one.settings == other.settings == ((id(a), id(b)), MIB, 32, 50, False, None,
                                                False)
    assert one.settings != PlanEntry("p", 1, (1,), (b, a), byte_cap=MIB, carveout=50).settings
    assert one.settings != PlanEntry("p", 1, (1,), (a, b), byte_cap=MIB).settings
    assert one.settings != PlanEntry("p", 1, (1,), (a, b), byte_cap=MIB, carveout=50,
                                     priority=True).settings


def test_repr_shows_shapes_not_values():
    entry = PlanEntry("p", 2, (3, 4, 5, 8), (torch.full((3, 5), 7.25),))
    text = repr(entry)
    assert "7.25" not in text
    assert "(3, 5) float32 on cpu" in text and "batches=3-5,8" in text


def test_import_plan_does_not_import_torch():
    import subprocess

    code = "import sys, l2prefetch.plan; print('torch' in sys.modules)"
    env_path = str(l2prefetch.plan.__file__).rsplit("/l2prefetch/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=env_path), check=True)
    assert out.stdout.strip() == "False"


def test_names_are_not_weights():
    # Weights are tensors; names belong in the JSON form only.
    with pytest.raises(TypeError):
        PlanEntry("p", 0, (1,), ("model.layers.0.weight",))


def test_layer_and_batches_are_bounded_like_the_controller():
    assert (MAX_LAYER, MAX_BATCH) == (65535, 65535)
    assert PlanEntry("p", MAX_LAYER, (MAX_BATCH,), (w(4),)).layer == MAX_LAYER
    with pytest.raises(ValueError, match=r"layer must be at most 65535 \(the controller's limit\), "
                                         r"got 65536"):
        PlanEntry("p", MAX_LAYER + 1, (1,), (w(4),))
    with pytest.raises(ValueError, match=r"at most 65535 .*got 1099511627776"):
        PlanEntry("p", 0, (1, 2**40), (w(4),))


@pytest.mark.parametrize("weights, kind", [
    (lambda a, b: {a, b}, "set"), (lambda a, b: frozenset((a,)), "frozenset"),
    (lambda a, b: {"a": a}, "dict"), (lambda a, b: {a: 1}.keys(), "dict_keys"),
])
def test_weights_must_be_ordered(weights, kind):
    a, b = w(4), w(8)
    with pytest.raises(TypeError, match=f"ordered sequence of tensors, got {kind}, .*list or tuple"):
        PlanEntry("p", 0, (1,), weights(a, b))
    # Ordered collections keep their order.
    assert PlanEntry("p", 0, (1,), {"a": a, "b": b}.values()).weights == (a, b)
    assert PlanEntry("p", 0, (1,), [b, a]).weights == (b, a)


# ----------------------------------------------------------------------------- kernel, graph_fork

def test_kernel_names_are_the_c_extensions():
    pytest.importorskip("l2prefetch._C", reason="needs the C extension (build it first)")
    from l2prefetch import _C

    assert set(get_args(KernelName)) == set(_C.kernel_variants()), (
        "plan.KernelName must list exactly l2prefetch.kernel_variants(): update it")
    from l2prefetch.mechanisms import GRAPH_FORK_MODES

    assert GRAPH_FORKS == tuple(GRAPH_FORK_MODES) == get_args(GraphFork)


def test_annotations_name_the_literal_types():
    from collections.abc import Sequence
    from typing import Optional, get_type_hints

    from l2prefetch import PrefetchController, hooks

    hints = get_type_hints(PlanEntry, localns={"torch": torch})
    assert hints["kernel"] == Optional[KernelName]
    assert hints["graph_fork"] == Optional[GraphFork]
    assert hints["weights"] == Sequence[torch.Tensor]
    hints = get_type_hints(PrefetchController.from_plan, localns={"torch": torch})
    assert hints["kernel"] == Optional[KernelName] and hints["graph_fork"] == GraphFork
    hints = get_type_hints(hooks.attach, localns={"torch": torch})
    assert hints["model"] is torch.nn.Module and hints["controller"] is hooks.Controller


def test_kernel_and_graph_fork_default_to_none():
    entry = PlanEntry("p", 0, (1,), (w(4),))
    assert (entry.kernel, entry.graph_fork) == (None, None)
    for kernel in get_args(KernelName):
        assert PlanEntry("p", 0, (1,), (w(4),), kernel=kernel).kernel == kernel
    for mode in GRAPH_FORKS:
        assert PlanEntry("p", 0, (1,), (w(4),), graph_fork=mode).graph_fork == mode


@pytest.mark.parametrize("field, value, error, words", [
    ("kernel", 3, TypeError, ["PlanEntry.kernel", "variant name (str) or None", "int 3"]),
    ("kernel", b"ring", TypeError, ["PlanEntry.kernel", "bytes"]),
    ("kernel", "Ring", ValueError, ["'Ring' is not a kernel variant", "known: ", "load, ring",
                                    "line_prefetch", "None for the device's default"]),
    ("kernel", "", ValueError, ["'' is not a kernel variant"]),
    ("graph_fork", 0, TypeError, ["PlanEntry.graph_fork", "'inline', 'branch' or 'leaf'", "int 0"]),
    ("graph_fork", "Inline", ValueError, ["'inline', 'branch' or 'leaf', or None", "'Inline'"]),
])
def test_kernel_and_graph_fork_are_checked(field, value, error, words):
    with pytest.raises(error) as info:
        PlanEntry(**{**GOOD, field: value}, weights=(w(4),))
    for word in words:
        assert word in str(info.value)


def test_kernel_is_checked_only_when_named(fake_c):
    # The stand-in _C has no kernel_variants: entries without a kernel never ask for it.
    PlanEntry("p", 0, (1,), (w(4),), graph_fork="branch")
    fake_c.kernel_variants = lambda: {"only": {}}
    assert PlanEntry("p", 0, (1,), (w(4),), kernel="only").kernel == "only"
    with pytest.raises(ValueError, match="known: only "):
        PlanEntry("p", 0, (1,), (w(4),), kernel="ring")


def test_settings_and_equality_with_kernel_and_graph_fork():
    a = w(4, 4)
    plain = PlanEntry("p", 0, (1,), (a,))
    ring = PlanEntry("p", 0, (1,), (a,), kernel="ring")
    branch = PlanEntry("p", 0, (1,), (a,), graph_fork="branch")
    # kernel changes the table; graph_fork only how the controller forks.
    assert ring.settings[5] == "ring" and ring.settings != plain.settings
    assert branch.settings == plain.settings
    assert len({plain, ring, branch}) == 3
    assert branch == PlanEntry("p", 0, (1,), (a,), graph_fork="branch")
    assert branch != PlanEntry("p", 0, (1,), (a,), graph_fork="inline")


def test_warm_activation_is_a_bool_of_the_table():
    a = w(4)
    plain, warm = PlanEntry("p", 0, (1,), (a,)), PlanEntry("p", 0, (1,), (a,), warm_activation=True)
    assert plain.warm_activation is False and warm.warm_activation is True
    assert plain != warm and plain.settings[-1] is False and warm.settings[-1] is True
    assert "warm_activation" not in repr(plain)
    assert repr(warm).endswith("priority=False, warm_activation=True)")
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="PlanEntry.warm_activation must be a bool"):
            PlanEntry("p", 0, (1,), (a,), warm_activation=bad)


def test_repr_shows_kernel_and_graph_fork_only_when_set():
    a = w(4)
    assert "kernel" not in repr(PlanEntry("p", 0, (1,), (a,)))
    assert "graph_fork" not in repr(PlanEntry("p", 0, (1,), (a,)))
    text = repr(PlanEntry("p", 0, (1,), (a,), kernel="load", graph_fork="branch"))
    assert text.endswith("priority=False, kernel='load', graph_fork='branch')")
    assert "graph_fork" not in repr(PlanEntry("p", 0, (1,), (a,), kernel="load"))


# ----------------------------------------------------------------------------- nbytes

def test_nbytes_follows_the_seed_rules():
    pytest.importorskip("l2prefetch._C", reason="needs the C extension (build it first)")
    a = w(64, 128)                 # 16 KiB
    t = w(128, 64).t()             # transposed: span is the whole storage
    empty = w(0, 7)
    b = w(1000, dtype=torch.float32)
    assert PlanEntry("p", 0, (1,), (a,)).nbytes == 64 * 128 * 2
    assert PlanEntry("p", 0, (1,), (t, empty, b)).nbytes == 128 * 64 * 2 + 4000
    # Capped: each size min(size, remaining) // 16 * 16, stop below 16 bytes left.
    capped = PlanEntry("p", 0, (1,), (a, b), byte_cap=16 * 1024 + 100)
    assert capped.nbytes == 16 * 1024 + 96
    assert PlanEntry("p", 0, (1,), (a, b), byte_cap=1000).nbytes == 992
    for cap in (0, 16, 17, 10_000, 40_000):
        entry = PlanEntry("p", 0, (1,), (a, t, empty, b), byte_cap=cap)
        assert entry.nbytes == sum(n for _, n in seed_ranges(entry.weights, cap))


@pytest.mark.parametrize("cap", [1, 8, 15])
def test_a_cap_under_16_bytes_is_refused(cap):
    # Issue 21 (9): such a cap makes a table that loads nothing (compute_ranges stops
    # below 16 bytes), while the entry says it prefetches.
    a = w(64, 128)
    with pytest.raises(ValueError, match=f"PlanEntry.byte_cap must be 0 \\(no cap\\) or at "
                       f"least 16 bytes .*got {cap}$"):
        PlanEntry("p", 0, (1,), (a,), byte_cap=cap)
    assert PlanEntry("p", 0, (1,), (a,), byte_cap=16).byte_cap == 16


def test_nbytes_works_on_meta_tensors():
    pytest.importorskip("l2prefetch._C", reason="needs the C extension (build it first)")
    meta = torch.empty(1024, 7168, dtype=torch.bfloat16, device="meta")
    assert PlanEntry("p", 0, (1,), (meta,)).nbytes == 1024 * 7168 * 2
    assert PlanEntry("p", 0, (1,), (meta,), byte_cap=MIB).nbytes == MIB


# ----------------------------------------------------------------------------- cap_groups

def test_cap_groups_group_in_first_appearance_order():
    table = {1: 32, 2: (16, 100), 3: 32, 4: 0, 5: (32, None), 6: (16, 100), 7: (16, -1)}
    assert cap_groups(table) == [(32, None, (1, 3, 5)), (16, 100, (2, 6)), (16, -1, (7,))]
    assert cap_groups({8: 16, 1: 32}) == [(16, None, (8,)), (32, None, (1,))]
    assert cap_groups({1: 0, 2: (0, 100)}) == []


@pytest.mark.parametrize("table, error", [
    ({0: 16}, ValueError), ({"1": 16}, TypeError), ({1: -1}, ValueError), ({1: 1.5}, TypeError),
    ({1: (16,)}, ValueError), ({1: (16, "max")}, TypeError), ({True: 16}, TypeError),
])
def test_cap_groups_reject_bad_tables(table, error):
    with pytest.raises(error, match="cap table"):
        cap_groups(table)


def test_compact_batches():
    assert compact_batches((3, 4, 5, 6, 7, 8)) == "3-8"
    assert compact_batches((8,)) == "8"
    assert compact_batches([5, 1, 2]) == "1-2,5"
    assert compact_batches(range(1, 9)) == "1-8"
    assert compact_batches((1, 3, 5, 6)) == "1,3,5-6"


# ----------------------------------------------------------------------------- format_plan

def test_format_plan_rows_and_totals(fake_c):
    small, big = w(MIB // 2), w(3 * MIB)  # 1 MiB and 6 MiB in bf16
    plan = [
        PlanEntry("oproj_down", 1, range(3, 9), (small,)),
        PlanEntry("next_attention", 1, (1, 2, 3, 4), (big,), byte_cap=4 * MIB),
        PlanEntry("next_attention", 1, (5, 6, 7, 8), (big,), byte_cap=2 * MIB),
        PlanEntry("oproj_down", 2, range(3, 9), (small, big)),
    ]
    text = format_plan(plan)
    lines = text.splitlines()
    assert lines[0].endswith("60.00 MiB (an H200's)") and "4 entries" in lines[0]
    assert "| oproj_down | 1 | 3-8 | 1 | 1.00 | 1.7% |" in lines
    assert "| next_attention | 1 | 1-4 | 1 | 4.00 | 6.7% |" in lines
    assert "| next_attention | 1 | 5-8 | 1 | 2.00 | 3.3% |" in lines
    assert "| oproj_down | 2 | 3-8 | 2 | 7.00 | 11.7% |" in lines
    # Totals per point count only the entries that fire at each batch.
    assert "| oproj_down | 2 | 2 | 3-8 | 3-8: 8.00 | 11.7% |" in lines
    assert "| next_attention | 2 | 1 | 1-8 | 1-4: 4.00; 5-8: 2.00 | 6.7% |" in lines
    assert "| all | 4 | 2 | 1-8 | 1-2: 4.00; 3-4: 12.00; 5-8: 10.00 | 11.7% |" in lines


def test_format_plan_other_l2_and_empty(fake_c):
    plan = [PlanEntry("p", 0, (1,), (w(4 * MIB),))]  # 8 MiB
    assert "| p | 0 | 1 | 1 | 8.00 | 50.0% |" in format_plan(plan, l2_bytes=16 * MIB)
    assert format_plan(plan, l2_bytes=16 * MIB).splitlines()[0].endswith("16.00 MiB")
    assert "12.5%" in format_plan(iter(plan), l2_bytes=64 * MIB)
    assert DEFAULT_L2_BYTES == 60 * MIB
    assert "0 entries" in format_plan([])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="l2_bytes"):
            format_plan(plan, l2_bytes=bad)


def test_format_plan_shows_kernel_and_graph_fork_columns_only_when_set(fake_c):
    fake_c.kernel_variants = lambda: dict.fromkeys(get_args(KernelName), {})
    a = w(MIB // 2)
    plain = [PlanEntry("p", 0, (1,), (a,))]
    assert "kernel" not in format_plan(plain) and "graph fork" not in format_plan(plain)
    lines = format_plan([*plain, PlanEntry("q", 1, (1,), (a,), kernel="load")]).splitlines()
    assert "| point | layer | batches | tensors | MiB | % of L2 | kernel |" in lines
    assert "| p | 0 | 1 | 1 | 1.00 | 1.7% | default |" in lines
    assert "| q | 1 | 1 | 1 | 1.00 | 1.7% | load |" in lines
    assert all("graph fork" not in line for line in lines)
    lines = format_plan([*plain, PlanEntry("q", 1, (1,), (a,), graph_fork="branch"),
                         PlanEntry("r", 1, (1,), (a,), kernel="ring")]).splitlines()
    assert "| point | layer | batches | tensors | MiB | % of L2 | kernel | graph fork |" in lines
    assert "|---|---:|---|---:|---:|---:|---|---|" in lines
    assert "| p | 0 | 1 | 1 | 1.00 | 1.7% | default | controller |" in lines
    assert "| q | 1 | 1 | 1 | 1.00 | 1.7% | default | branch |" in lines
    assert "| r | 1 | 1 | 1 | 1.00 | 1.7% | ring | controller |" in lines
    assert all("warm" not in line for line in lines)
    lines = format_plan([*plain, PlanEntry("q", 1, (1,), (a,), warm_activation=True)]).splitlines()
    assert "| point | layer | batches | tensors | MiB | % of L2 | warm activation |" in lines
    assert "| p | 0 | 1 | 1 | 1.00 | 1.7% | no |" in lines
    assert "| q | 1 | 1 | 1 | 1.00 | 1.7% | yes |" in lines


# ----------------------------------------------------------------------------- JSON

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(16, 32, bias=False)
        self.o_proj = nn.Linear(32, 16, bias=False)
        self.W_UK_T = torch.zeros(2, 4, 8)  # plain tensor attribute, as in vLLM's MLA


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Module(), nn.Module()])
        for layer in self.layers:
            layer.self_attn = Attention()
            layer.register_buffer("front", torch.zeros(8, 16))


@pytest.fixture
def model():
    return Model()


def sample_plan(model):
    one, two = model.layers
    return [
        PlanEntry("oproj_down", 0, range(3, 9), (one.front,), grid=8, carveout=100,
                  priority=True),
        PlanEntry("next_attention", 0, (1, 2), (two.self_attn.q_proj.weight,
                                                two.self_attn.W_UK_T,
                                                two.self_attn.o_proj.weight),
                  byte_cap=16 * MIB, carveout=-1),
    ]


def test_json_round_trip(model):
    plan = sample_plan(model)
    text = plan_to_json(plan, model)
    data = json.loads(text)
    assert data["version"] == 2
    assert data["entries"][0] == {
        "point": "oproj_down", "layer": 0, "batches": [3, 4, 5, 6, 7, 8],
        "weights": ["layers.0.front"], "byte_cap": 0, "grid": 8, "carveout": 100,
        "priority": True, "kernel": None, "graph_fork": None}
    assert data["entries"][1]["weights"] == [
        "layers.1.self_attn.q_proj.weight", "layers.1.self_attn.W_UK_T",
        "layers.1.self_attn.o_proj.weight"]
    assert "0x" not in text and str(model.layers[0].front.data_ptr()) not in text
    back = plan_from_json(text, model)
    assert back == plan
    assert all(a is b for x, y in zip(back, plan) for a, b in zip(x.weights, y.weights))


def test_json_round_trip_of_kernel_and_graph_fork(model):
    one, two = model.layers
    plan = [PlanEntry("oproj_down", 0, (1,), (one.front,), kernel="load", graph_fork="branch"),
            PlanEntry("oproj_down", 1, (1,), (two.front,), graph_fork="inline"),
            PlanEntry("oproj_down", 2, (1,), (two.front,))]
    text = plan_to_json(plan, model)
    entries = json.loads(text)["entries"]
    assert [(e["kernel"], e["graph_fork"]) for e in entries] == [
        ("load", "branch"), (None, "inline"), (None, None)]
    back = plan_from_json(text, model)
    assert back == plan
    assert [(e.kernel, e.graph_fork) for e in back] == [
        ("load", "branch"), (None, "inline"), (None, None)]


def test_json_round_trip_of_warm_activation(model):
    one, two = model.layers
    plan = [PlanEntry("oproj_down", 0, (1,), (one.front,), warm_activation=True),
            PlanEntry("oproj_down", 1, (1,), (two.front,))]
    text = plan_to_json(plan, model)
    entries = json.loads(text)["entries"]
    assert entries[0]["warm_activation"] is True and "warm_activation" not in entries[1]
    back = plan_from_json(text, model)
    assert back == plan and [e.warm_activation for e in back] == [True, False]
    bad = text.replace('"warm_activation": true', '"warm_activation": 1')
    with pytest.raises(TypeError, match="entry 0: PlanEntry.warm_activation must be a bool"):
        plan_from_json(bad, model)


def test_json_reads_version_1(model):
    # What plan_to_json wrote before entries had a kernel and a graph_fork.
    data = json.loads(plan_to_json(sample_plan(model), model))
    for entry in data["entries"]:
        del entry["kernel"], entry["graph_fork"]
    back = plan_from_json(json.dumps({"version": 1, "entries": data["entries"]}), model)
    assert back == sample_plan(model)
    assert all((e.kernel, e.graph_fork) == (None, None) for e in back)
    # Version 1 knows no kernel; version 2 may leave it out.
    data["entries"][0]["kernel"] = "load"
    with pytest.raises(ValueError, match=r"unknown fields \['kernel'\]; fields of version 1"):
        plan_from_json(json.dumps({"version": 1, "entries": data["entries"]}), model)
    del data["entries"][0]["kernel"]
    assert plan_from_json(json.dumps({"version": 2, "entries": data["entries"]}),
                          model) == sample_plan(model)


def test_json_resolves_into_another_instance():
    first, second = Model(), Model()
    back = plan_from_json(plan_to_json(sample_plan(first), first), second)
    assert back[1].weights[1] is second.layers[1].self_attn.W_UK_T
    assert back[0].weights[0] is second.layers[0].front


def test_json_names_tied_weights_by_their_first_name(model):
    model.layers[1].self_attn.o_proj.weight = model.layers[0].self_attn.o_proj.weight
    shared = model.layers[0].self_attn.o_proj.weight
    text = plan_to_json([PlanEntry("p", 0, (1,), (shared,))], model)
    assert json.loads(text)["entries"][0]["weights"] == ["layers.0.self_attn.o_proj.weight"]
    # Either name resolves.
    edited = text.replace("layers.0.self_attn.o_proj", "layers.1.self_attn.o_proj")
    assert plan_from_json(edited, model)[0].weights[0] is shared


def test_json_refuses_unnamed_weights(model):
    view = model.layers[0].self_attn.q_proj.weight[:8]
    with pytest.raises(ValueError, match=r"entry 0 \('p', layer 0\): weights\[1\].*view or copy"):
        plan_to_json([PlanEntry("p", 0, (1,), (model.layers[0].front, view))], model)


def test_json_reports_unresolvable_names(model):
    text = plan_to_json(sample_plan(model), model).replace("layers.1.self_attn.W_UK_T",
                                                           "layers.1.self_attn.W_UK")
    with pytest.raises(ValueError, match=r"'layers.1.self_attn.W_UK'.*closest: "
                                         r"layers.1.self_attn.W_UK_T"):
        plan_from_json(text, model)


@pytest.mark.parametrize("text, words", [
    ("not json", "does not parse"),
    ("[]", "'version'"),
    ('{"version": 3, "entries": []}', "version 3 is not supported; this l2prefetch reads "
                                      "versions 1 and 2"),
    ('{"version": "2", "entries": []}', "version '2' is not supported"),
    ("[" * 100000, "nested too deeply"),
    ('{"version": 1}', "'entries' must be a list"),
    ('{"version": 1, "entries": [3]}', "entry 0 must be an object"),
    ('{"version": 1, "entries": [{"point": "p", "layer": 0, "batches": [1]}]}',
     "missing fields ['weights']"),
    ('{"version": 1, "entries": [{"point": "p", "layer": 0, "batches": [1], "weights": [],'
     ' "pointer": 5}]}', "unknown fields ['pointer']"),
    ('{"version": 1, "entries": [{"point": "p", "layer": 0, "batches": [1], "weights": "x"}]}',
     "list of names"),
])
def test_json_rejects_malformed_input(model, text, words):
    with pytest.raises(ValueError) as info:
        plan_from_json(text, model)
    assert words in str(info.value)


def test_json_field_errors_come_from_plan_entry(model):
    data = json.loads(plan_to_json(sample_plan(model), model))
    data["entries"][0]["grid"] = 0
    with pytest.raises(ValueError, match="grid must be an int in 1..65535, got 0"):
        plan_from_json(json.dumps(data), model)
    data["entries"][0]["grid"] = 8
    data["entries"][0]["priority"] = "yes"
    with pytest.raises(TypeError, match="priority must be a bool"):
        plan_from_json(json.dumps(data), model)
    assert plan_from_json(json.dumps({"version": 1, "entries": []}), model) == []


def plan_entry_json(**fields):
    entry = {"point": "p", "layer": 0, "batches": [1], "weights": ["layers.0.front"], **fields}
    return entry


@pytest.mark.parametrize("text, error, words", [
    # a key twice: json keeps the last, which made a capped entry uncapped
    ('{"version": 2, "entries": [{"point": "p", "layer": 0, "batches": [1], '
     '"weights": ["layers.0.front"], "byte_cap": 4096, "byte_cap": 0}]}', ValueError,
     "plan JSON: entries[0] gives the key 'byte_cap' more than once (JSON would keep only "
     "the last); keep one"),
    ('{"version": 2, "entries": [], "entries": []}', ValueError,
     "plan JSON: the top level gives the key 'entries' more than once"),
    # two entries for one (point, layer, batch): the controller keeps the last
    (json.dumps({"version": 2, "entries": [plan_entry_json(batches=[1, 2]),
                                           plan_entry_json(batches=[2, 3], grid=8)]}),
     ValueError, "plan JSON entries 0 and 1 both prefetch at point 'p', layer 0, batch 2"),
    (json.dumps({"version": 2, "entries": [plan_entry_json(
        weights=["layers.0.front", "layers.1.front", "layers.0.front"])]}), ValueError,
     "plan JSON entry 0: 'weights' lists ['layers.0.front'] more than once"),
    ('{"version": 2, "entries": [{"point": "p", "layer": ' + "9" * 5000 + ', "batches": [1], '
     '"weights": ["layers.0.front"]}]}', ValueError,
     "plan JSON: entries[0].layer is a 5000-digit number"),
    (json.dumps({"version": 2, "entries": [plan_entry_json(byte_cap=8)]}), ValueError,
     "plan JSON entry 0: PlanEntry.byte_cap must be 0 (no cap) or at least 16 bytes"),
    (json.dumps({"version": 2, "entries": [plan_entry_json(layer="0")]}), TypeError,
     "plan JSON entry 0: PlanEntry.layer must be an int >= 0, got str '0'"),
])
def test_json_that_contradicts_itself_is_refused(model, text, error, words):
    with pytest.raises(error) as info:
        plan_from_json(text, model)
    assert type(info.value) is error and words in str(info.value), info.value


def test_gate_keeps_entries_whose_window_loads_their_bytes():
    pytest.importorskip("l2prefetch._C")
    from l2prefetch.plan import GATE_BYTES_PER_US, GATE_MIN_BYTES, gate

    small = PlanEntry("a", 0, [1], (torch.empty(1024, 1024, dtype=torch.bfloat16),))  # 2 MiB
    big = PlanEntry("a", 1, [1], (torch.empty(8192, 2048, dtype=torch.bfloat16),))    # 32 MiB
    other = PlanEntry("b", 0, [1], (torch.empty(8192, 2048, dtype=torch.bfloat16),))
    plan = [small, big, other]
    need_big = big.nbytes / GATE_BYTES_PER_US
    assert gate(plan, {"a": need_big}) == plan                 # exactly enough: kept
    assert gate(plan, {"a": need_big * 0.99}) == [small, other]
    assert gate(plan, {"a": 0.0, "b": 0.0}) == []
    assert gate(plan, {}) == plan                              # unknown points: kept
    # min_bytes drops small loads whatever their point (and keeps exactly min_bytes)
    assert gate(plan, {}, min_bytes=GATE_MIN_BYTES) == [big, other]
    assert gate(plan, {}, min_bytes=small.nbytes) == plan
    assert gate(plan, {}, min_bytes=small.nbytes + 1) == [big, other]
    assert gate(plan, {"a": need_big * 0.99}, min_bytes=GATE_MIN_BYTES) == [other]
    assert 2 << 20 < GATE_MIN_BYTES <= 16 << 20
    with pytest.raises(ValueError):
        gate(plan, {"a": 1.0}, bytes_per_us=0)
