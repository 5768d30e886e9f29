"""``python -m l2prefetch plan``: the Kimi plan of a synthetic model on the meta device."""

from __future__ import annotations

import json
import re

import pytest
import torch

from l2prefetch import kimi_k3
from l2prefetch.cli import plan_main
from l2prefetch.kimi_k3 import DEFAULT_DIMS, synthetic_model as build_synthetic_kimi
from l2prefetch.plan import PLAN_JSON_VERSION, plan_from_json

MIB = 2**20


def needs_c():
    return pytest.importorskip("l2prefetch._C", reason="needs the C extension (build it first)")


def totals(text):
    """{point: 'MiB per step' cell} from the totals table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[1].isdigit() and cells[2].isdigit():
            rows[cells[0]] = cells[4]
    return rows


def test_synthetic_model_is_kimi_shaped_and_costs_nothing():
    model, layers, packed = build_synthetic_kimi(tp=8)
    assert len(layers) == 61 and not layers[0].is_moe_layer
    assert all(layer.is_moe_layer for layer in layers[1:])
    mla = [i for i, layer in enumerate(layers) if hasattr(layer.self_attn, "W_UK_T")]
    assert mla == list(range(3, 61, 4))
    assert all(hasattr(layers[i].self_attn, "in_proj_qkvgfab") for i in range(61) if i not in mla)
    assert all(t.device.type == "meta" for t in model.parameters())
    assert sorted(packed) == list(range(1, 61))
    assert packed[1] is layers[1].mlp.front_packed
    assert packed[1].shape == ((384 + 1792) // 8, 7168)
    assert layers[3].self_attn.o_proj.weight.shape == (7168, 64 // 8 * 128)
    assert layers[1].mlp.shared_experts.gate_up_proj.weight.dtype == torch.bfloat16
    # TP shards: TP 1 is 8x wider than TP 8 where the design shards.
    _, full, _ = build_synthetic_kimi(tp=1)
    full_mla, shard_mla = full[3].self_attn, layers[3].self_attn
    assert full_mla.q_b_proj.weight.shape[0] == 8 * shard_mla.q_b_proj.weight.shape[0]
    assert full_mla.fused_qkv_a_proj.weight.shape == shard_mla.fused_qkv_a_proj.weight.shape


def test_plan_tp8_prints_points_and_totals(capsys):
    needs_c()
    assert plan_main(["--tp", "8"]) == 0
    out = capsys.readouterr().out    # kimi_k3.DEFAULT_POINTS and NEXT_ATTENTION (all zero)
    assert "oproj_down" not in out and "next_attention" not in out
    assert "attention_moe" not in out
    assert "No entries: by default the Kimi plan prefetches nothing" in out
    assert "| point |" not in out                 # no empty table
    assert plan_main(["--tp", "8", "--all-points", "--next-attention-mib", "24"]) == 0
    out = capsys.readouterr().out
    assert "TP 8" in out and "61 layers (60 MoE)" in out
    for point in ("oproj_down", "attention_moe", "next_attention"):
        assert f"| {point} | 1 |" in out
    assert "| next_attention | 60 |" not in out  # the last layer has no next attention
    assert "| attention_moe | 3 | 8 |" in out    # MLA layer: batch 8 only
    assert "| attention_moe | 4 | 5-8 |" in out  # KDA layer
    # Totals agree with the plan and the seed's range rules on meta tensors.
    _, layers, packed = build_synthetic_kimi(tp=8)
    front = packed[1].numel() * 2
    rows = totals(out)
    assert rows["oproj_down"] == f"3-8: {60 * front / MIB:.2f}"
    assert rows["next_attention"] == f"1-8: {59 * 24:.2f}"   # --next-attention-mib 24
    assert set(rows) == {"oproj_down", "attention_moe", "next_attention", "all"}
    share = re.search(r"\| oproj_down \| 1 \| 3-8 \| 1 \| ([\d.]+) \| ([\d.]+)% \|", out)
    assert share and float(share.group(2)) == pytest.approx(100 * front / (60 * MIB), abs=0.05)


def test_plan_tp4_and_other_l2(capsys):
    needs_c()
    assert plan_main(["--tp", "4", "--l2-mib", "40", "--next-attention-mib", "24"]) == 0
    out = capsys.readouterr().out
    assert "attention_moe" not in out and "against 40.00 MiB" in out
    assert "| next_attention | 1 | 1-8 | 4 | 24.00 | 60.0% |" in out


def test_plan_json_round_trips_without_c(capsys):
    assert plan_main(["--tp", "2", "--json", "--layers", "6", "--all-points",
                      "--next-attention-mib", "24"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["version"] == PLAN_JSON_VERSION
    assert data["entries"][0]["weights"] == ["layers.1.mlp.front_packed"]
    # Layer 2 prefetches layer 3's attention, an MLA with plain tensor attributes.
    layer2 = [e for e in data["entries"] if e["point"] == "next_attention" and e["layer"] == 2]
    assert layer2[0]["weights"] == [
        "layers.3.self_attn.fused_qkv_a_proj.weight", "layers.3.self_attn.q_b_proj.weight",
        "layers.3.self_attn.W_UK_T", "layers.3.self_attn.W_UV",
        "layers.3.self_attn.o_proj.weight"]
    model, layers, packed = build_synthetic_kimi({"layers": 6}, tp=2)
    assert plan_from_json(json.dumps(data), model) == kimi_k3.plan(
        layers, packed, 2, {2: {b: 24 for b in range(1, 9)}}, points=kimi_k3.POINTS)


def test_shapes_file_and_options(tmp_path, capsys):
    needs_c()
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"hidden": 4096, "layers": 5, "experts": 64, "moe_latent": 64}))
    assert plan_main(["--tp", "8", "--shapes", str(shapes), "--seed-points"]) == 0  # old name
    out = capsys.readouterr().out
    assert "5 layers (4 MoE)" in out and "hidden 4096" in out
    front = (64 // 8 + 64 // 8) * 4096 * 2
    assert f"| oproj_down | 1 | 3-8 | 1 | {front / MIB:.2f} |" in out
    assert plan_main(["--shapes", str(shapes), "--hidden", "2048", "--tp", "8"]) == 0
    assert "hidden 2048" in capsys.readouterr().out


@pytest.mark.parametrize("content, words", [
    ('{"heads": 3}', "unknown dimensions ['heads']"),
    ('[1, 2]', "JSON object"),
    ('{"mla_heads": 12}', "mla_heads=12 does not split over tp=8"),
    ('{"dtype": "bfloat17"}', "not a torch dtype"),
    ("{", "Expecting"),
    # which file is not JSON, not only where in it (issue 41.7)
    ('{"hidden": 4096,\n', "is not JSON (Expecting property name enclosed in double quotes: "
                           "line 2 column 1 (char 17)): it must hold a JSON object"),
])
def test_bad_shapes_are_usage_errors(tmp_path, capsys, content, words):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(content)
    assert plan_main(["--shapes", str(shapes)]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.splitlines()) == 1, err
    if "JSON (" in words:
        assert err.startswith(f"l2prefetch plan: --shapes {shapes} is not JSON"), err


def test_usage(capsys):
    assert plan_main(["--help"]) == 0
    assert "--shapes" in capsys.readouterr().out
    assert plan_main(["--tp", "3"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert plan_main(["--next-attention-mib", "-1"]) == 2
    assert "--next-attention-mib: must be an int of MiB in 0..8796093022207, got -1" in \
        capsys.readouterr().err
    assert plan_main(["--shapes", "/nonexistent/shapes.json"]) == 2
    assert set(DEFAULT_DIMS) >= {"hidden", "layers", "mla_every", "experts"}


# -- bad input: exit status 2 and one line on stderr, never a traceback (issue 16) -----------

def run_plan(*args, no_torch=False):
    """`python -m l2prefetch plan ARGS` in a fresh interpreter (without torch if asked)."""
    import os
    import subprocess
    import sys

    import l2prefetch

    code = ("import sys, runpy\n"
            + ("sys.modules['torch'] = None\n" if no_torch else "")
            + "runpy.run_module('l2prefetch', run_name='__main__')\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(l2prefetch.__file__)))
    return subprocess.run([sys.executable, "-c", code, "plan", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def deep_json(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100000)
    return str(path)


@pytest.mark.parametrize("args, no_torch, words", [
    (["--l2-mib", "1e308"], False, r"argument --l2-mib: must be below 2\*\*63 bytes"),
    (["--hidden", "4611686018427387904"], False,
     r"dimensions too large: in_proj_qkvgfab would be 3336 x 4611686018427387904 bfloat16"),
    (["--shapes", "DEEP"], False, r"deep.json: JSON nested too deeply"),
    ([], True, r"^l2prefetch plan: needs torch, which is not installed: "
               r"install torch 2.11-2.13 \(README, Install\)$"),
])
def test_issue_16_inputs_exit_2_with_one_line(tmp_path, args, no_torch, words):
    args = [deep_json(tmp_path) if a == "DEEP" else a for a in args]
    proc = run_plan(*args, no_torch=no_torch)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and re.search(words, proc.stderr), proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("shapes, words", [
    ('{"hidden": 1.5}', "dimension hidden must be an int >= 1, got float 1.5"),
    ('{"hidden": 1e999}', "hidden is 1e999, past the largest float; write a finite number"),
    ('{"layers": true}', "dimension layers must be an int >= 1, got bool True"),
    ('{"layers": 65537}', "dimension layers must be at most 65536"),
    ('{"hidden": ' + "9" * 5000 + "}", "hidden is a 5000-digit number"),
    ('{"dtype": "complex64"}', "not a floating-point dtype"),
    ('{"dtype": ["bfloat16"]}', "is not a torch dtype name"),
    ('{"kda_heads": 4611686018427387904, "kda_head_dim": 4}', "dimensions too large"),
    ('{"mla_heads": 8, "kv_lora_rank": 2**62}'.replace("2**62", str(2**62)),
     "dimensions too large: fused_qkv_a_proj"),
    ('"7168"', "must hold a JSON object of dimensions, not a str"),
    ("[" * 100000 + "]" * 100000, "JSON nested too deeply"),  # deeper than 3.11's and 3.12's limits
    (b"\xff\xfe", "is not UTF-8 text"),
    (None, "is a directory, not a regular file"),
])
def test_bad_shapes_files(tmp_path, capsys, shapes, words):
    path = tmp_path / "shapes.json"
    if shapes is None:
        path.mkdir()
    elif isinstance(shapes, bytes):
        path.write_bytes(shapes)
    else:
        path.write_text(shapes)
    assert plan_main(["--shapes", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and words in err, err


@pytest.mark.parametrize("args, words", [
    (["--l2-mib", "1e-300"], "--l2-mib: must be a finite number of MiB, at least one byte"),
    (["--l2-mib", "inf"], "--l2-mib: must be a finite number of MiB"),
    (["--l2-mib", "8796093022208"], "--l2-mib: must be below 2**63 bytes"),
    (["--next-attention-mib", "8796093022208"], "--next-attention-mib: must be an int of MiB"),
    (["--next-attention-mib", "1.5"], "--next-attention-mib: not an int: '1.5'"),
    (["--layers", "65537"], "dimension layers must be at most 65536"),
    (["--hidden", "0"], "dimension hidden must be an int >= 1, got 0"),
    (["--hidden", "9" * 5000], "--hidden: invalid int value"),
])
def test_bad_options(capsys, args, words):
    assert plan_main(args) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and words in err, err


def test_huge_but_valid_dimensions_plan(capsys):
    needs_c()
    # Every tensor just under torch's 2**63-byte limit at TP 8: the plan's sums are exact.
    assert plan_main(["--layers", "2", "--hidden", str(2**40), "--all-points",
                      "--next-attention-mib", "24"]) == 0
    assert "| oproj_down | 1 | 3-8 |" in capsys.readouterr().out
