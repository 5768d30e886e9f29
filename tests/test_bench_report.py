"""The benchmark report's CPU-side logic: the effect section's break-even (where a fork
stops losing, and whether the gate agrees), the plots, and the report CLI's options.

Pure arithmetic and drawing over made-up rows; runs without a GPU.  ``benchmarks`` is
imported as a package from the repository root, which is on sys.path when pytest runs
as ``python -m pytest`` from there (as dev.sh and CI run it).
"""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("benchmarks", reason="the benchmarks package is importable from the "
                    "repository root: run python -m pytest there")

from benchmarks import plots, report  # noqa: E402
from benchmarks.sections import effect  # noqa: E402
from conftest import CXX_THROW_ABORTS  # noqa: E402

MIB = 2**20

#: matplotlib's ft2font throws a C++ exception at import (conftest.CXX_THROW_ABORTS).
needs_plain_matplotlib = pytest.mark.skipif(
    CXX_THROW_ABORTS, reason="matplotlib's C++ throw aborts under ASan preloaded without "
    "libstdc++")


def rows(mib, batch, losses):
    """Effect rows for one (W, batch): {T: cold - prefetched}."""
    return [(mib, batch, t, {"cold": 10.0 + v, "prefetched": 10.0}, float("nan"))
            for t, v in losses.items()]


def test_break_even_is_the_first_window_from_which_on_nothing_loses():
    raw = (rows(16, 1, {0: -3.0, 5: -0.5, 10: +0.8, 20: +1.2, 40: -0.2})
           + rows(16, 8, {0: -2.0, 5: +0.1, 10: -0.6, 20: +1.0, 40: +1.1})
           + rows(32, 1, {0: -5.0, 5: -3.0, 10: -1.0, 20: -0.4, 40: -0.9}))
    got = effect.break_even(raw, noise=0.3, bytes_per_us=3.2e6)
    assert [(m, b, t) for m, b, t, _g, _ok in got] == [(16, 1, 10), (16, 8, 20), (32, 1, None)]
    gate = {(m, b): (g, ok) for m, b, _t, g, ok in got}
    assert gate[16, 1][0] == pytest.approx(16 * MIB / 3.2e6)      # 5.24 us
    assert gate[16, 1][1] is True       # the gate forks at 10, 20, 40: none loses over 0.3
    assert gate[16, 8][1] is False      # it would fork at 10, which lost 0.6
    assert gate[32, 1][1] is False


def test_break_even_uses_the_plans_rate_by_default_and_renders():
    from l2prefetch.plan import GATE_BYTES_PER_US

    raw = rows(8, 1, {0: -1.0, 5: 0.0})
    (mib, batch, first, gate_us, ok), = effect.break_even(raw)
    assert (mib, batch, first, ok) == (8, 1, 5, True)
    assert gate_us == pytest.approx(8 * MIB / GATE_BYTES_PER_US)
    text = effect.break_even_table(raw)
    assert "| 8 | 1 | 5 | 2.6 | yes |" in text


@needs_plain_matplotlib
def test_plot_writes_one_png_per_size_and_the_layer_bars(tmp_path):
    pytest.importorskip("matplotlib")
    effect = [(mib, b, t, {"cold": 20.0 + t, "empty": 20.5 + t, "prefetched": 18.5 + t,
                          "hot": 18.0 + t}, 0.9)
              for mib in (16, 32) for b in (1, 8) for t in (0, 10, 20)]
    layer = [{"batch": b, "a": 100.0, "b": 99.0} for b in (1, 8)]
    glue = [{"batch": 8, "a": 100.0, "b": 102.0}]
    paths, note = plots.plot({"effect": effect, "layer": layer, "layer_glue": glue},
                              str(tmp_path))
    assert note == ""
    assert sorted(os.path.basename(p) for p in paths) == [
        "effect_16mib.png", "effect_32mib.png", "layer_speedup.png"]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@needs_plain_matplotlib
def test_plot_without_sections_writes_nothing(tmp_path):
    pytest.importorskip("matplotlib")
    assert plots.plot({}, str(tmp_path)) == ([], "")
    assert list(tmp_path.iterdir()) == []


def test_report_writes_nothing_without_out_and_rejects_unknown_sections(capsys, monkeypatch):
    import torch

    assert report.parse([]).out is None
    assert report.parse([]).names == list(report.SECTIONS)
    with pytest.raises(SystemExit):
        report.parse(["--sections", "effect,nosuch"])
    assert "unknown section(s) nosuch" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert report.main(["--sections", "effect"]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_every_section_module_imports_and_has_its_function():
    for name in report.SECTIONS:
        assert callable(report.section(name)), name


def test_the_tuner_benchmark_counts_the_groups_the_search_measures():
    """benchmarks.tuner reads groups off the tuner's progress lines: against a planted
    backend every measured group is counted once, with its graphs."""
    import io

    from benchmarks import tuner
    from l2prefetch.tuning import search

    from _tuning_fakes import Clock, PlantedBackend, role

    clock = Clock()
    backend = PlantedBackend({"A": lambda s: 12.0, "B": lambda s: -6.0}, seed=1, clock=clock)
    progress = tuner.Progress(io.StringIO())
    (report,) = search.search(backend, [role("A"), role("B")], (1,), budget_s=300.0,
                              progress=progress, clock=clock)
    assert progress.groups == len(backend.groups) > 0
    assert progress.graphs == sum(len(g) for g in backend.groups) * search.MIN_INSTANCES
    assert tuner._sound(report) and tuner._verdict(report).startswith("confirmed")
    assert tuner.parse(["--quick"]).budget == tuner.QUICK_BUDGET_S
    with pytest.raises(SystemExit):
        tuner.parse(["--parts", "time,nosuch"])


def test_measurement_pools_replays_and_spreads_instances():
    from l2prefetch.tuning.rig import Measurement

    m = Measurement(medians={"a": [10.0, 12.0, 11.0]},
                    replays={"a": [[9.0, 10.0, 11.0], [12.0], [11.0, 13.0]]},
                    outputs={"a": [None] * 3}, capture_s=0.0, replay_s=0.0)
    assert m.pooled_median("a") == 11.0
    assert m.spread("a") == 2.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the probes do without a GPU")
@pytest.mark.parametrize("module, argv", [("probe_spread", ["mixtral-4l"]),
                                          ("probe_spread", ["--batches", "1,8", "mixtral-4l"]),
                                          ("probe_bestof", ["--k", "2", "llama"]),
                                          ("probe_tune", ["--site", "none", "1"]),
                                          ("probe_l2", ["cold", "hot"]),
                                          ("probe_l2", ["up", "load48up"]),
                                          ("probe_order", ["--model", "qwen3"]),
                                          ("probe_forkcost", ["oproj:module:8"])])
def test_the_probes_say_they_need_a_gpu(module, argv, capsys):
    import importlib

    probe = importlib.import_module(f"benchmarks.{module}")
    assert probe.main(argv) is None
    assert capsys.readouterr().out == f"python -m benchmarks.{module} needs a CUDA GPU; none is visible here.\n"


def test_probe_spread_takes_its_batches_comma_separated(capsys):
    from benchmarks.probe_spread import batch_list

    assert batch_list("1,8") == [1, 8] and batch_list("4") == [4]
    for bad in ("1,x", "0", "", "1 8"):
        with pytest.raises(Exception, match="--batches must be comma-separated integers >= 1"):
            batch_list(bad)


def test_the_probes_models_are_the_planted_ones_or_configs():
    from benchmarks.common import hf_model

    with pytest.raises(SystemExit, match=r"unknown model 'mixtral': one of .*deepseek-v3-6l.*"
                                         r"llama.*mixtral-4l.*qwen3, qwen3-8l, qwen3-moe-6l"):
        hf_model("mixtral")


def test_a_planted_window_goes_before_the_named_layers_only():
    from benchmarks.sections.planted import _planted

    spins = []

    class Rig:
        def spin(self, us):
            spins.append(us)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.post_attention_layernorm = torch.nn.Identity()
            self.input_layernorm = torch.nn.Identity()
            self.self_attn = torch.nn.Module()
            self.self_attn.o_proj = torch.nn.Linear(2, 2)

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList(Layer() for _ in range(6))
    hooks = _planted(Rig(), model, "mlp", 40, layers={1, 3, 5})
    assert len(hooks) == 3
    x = torch.zeros(1)
    for i, layer in enumerate(model.model.layers):
        layer.post_attention_layernorm(x)
        layer.input_layernorm(x)
        assert len(spins) == (i + 1) // 2, i   # after layers 1, 3, 5 only, and not before attention
    assert spins == [40, 40, 40]
    for h in hooks:
        h.remove()
    assert len(_planted(Rig(), model, "attention", 10)) == 6
    # "oproj": in o_proj's forward hook, its output unchanged
    spins.clear()
    hooks = _planted(Rig(), model, "oproj", 20, layers={2})
    o_proj = model.model.layers[2].self_attn.o_proj
    y = torch.ones(2)
    assert torch.equal(o_proj(y), torch.nn.functional.linear(y, o_proj.weight, o_proj.bias))
    model.model.layers[1].self_attn.o_proj(y)
    assert spins == [20] and len(hooks) == 1


@pytest.mark.parametrize("site, kind, name, layers", [
    ("mlp", "module", "after self_attn.o_proj: mlp.gate_proj", (0, 1, 2)),
    ("mlp", "before", "before post_attention_layernorm: mlp.gate_proj", (0, 1, 2)),
    ("attention", "module", "after mlp.down_proj: next self_attn.q_proj", (0, 1)),
    ("attention", "before", "before input_layernorm: self_attn.q_proj", (1, 2)),
])
def test_the_planted_section_measures_both_roles_of_each_window(site, kind, name, layers):
    """After the read before the window, and before the norm whose pre-hook plants it."""
    import _tuning_fakes as fakes
    from benchmarks.sections.planted import _role

    model = fakes.llama(n_layers=3, h=1024, i=2048, kv=256)
    x = torch.zeros(1, 1, 1024, dtype=torch.bfloat16)
    role = _role(model, lambda batch: model(x), site, kind)
    assert (role.name, role.kind, role.layers) == (name, kind, layers)


@pytest.mark.parametrize("argv, message", [
    (["--site", "none", "--hand", "1"], "--hand compares plans for a planted window"),
    (["--layers", "1,x", "1"], "'1,x' is not comma-separated layer indices"),
    (["--layers", "-1", "1"], "layer indices are >= 0"),
    (["--rounds", "0", "1"], "--rounds must be >= 1, got 0"),
    (["--dump", "/nonexistent/x.json", "1"], "--dump /nonexistent/x.json: [Errno 2]"),
])
def test_probe_tune_refuses_bad_options_before_it_needs_a_gpu(argv, message, capsys):
    from benchmarks import probe_tune

    with pytest.raises(SystemExit) as exc:
        probe_tune.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert probe_tune.layer_indices("5,1,3") == {1, 3, 5}


@pytest.mark.parametrize("argv, message", [
    (["mlp:after:1"], "'mlp:after:1': want SITE:KIND:BATCH"),
    (["gate:module:1"], "'gate:module:1': want SITE:KIND:BATCH"),
    (["oproj:module:0"], "'oproj:module:0': want SITE:KIND:BATCH"),
    (["oproj:module"], "'oproj:module': want SITE:KIND:BATCH"),
    (["mlp:module:1:x"], "'mlp:module:1:x': want SITE:KIND:BATCH"),
    (["--replays", "0"], "--replays must be >= 1, got 0"),
])
def test_probe_forkcost_refuses_bad_specs_before_it_needs_a_gpu(argv, message, capsys):
    from benchmarks import probe_forkcost

    with pytest.raises(SystemExit) as exc:
        probe_forkcost.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_probe_forkcost_names_where_the_delay_changed():
    from types import SimpleNamespace

    from benchmarks.probe_forkcost import changes

    names = [f"k{j}" for j in range(10)]
    # the fork before kernel 3; its delay grows at 4, holds, and shrinks at 6 and 8
    fork = SimpleNamespace(after=3, lags_us=(0.7, 0.9, 0.9, 0.3, 0.3, 0.1),
                           lags_floor_us=(0.0, 0.05, 0.0, 0.0, 0.1, 0.0))
    assert changes(fork, names) == (
        "#4 k4 (+0.70 -> +0.90; without forks twice: +0.00 -> +0.05), "
        "#6 k6 (+0.90 -> +0.30; without forks twice: +0.00 -> +0.00), "
        "#8 k8 (+0.30 -> +0.10; without forks twice: +0.10 -> +0.00)")
    assert changes(fork, names, most=1) == \
        "#6 k6 (+0.90 -> +0.30; without forks twice: +0.00 -> +0.00)"
    # no floor measured; nothing that changed by min_us
    fork.lags_floor_us = ()
    assert changes(fork, names, min_us=0.5) == "#6 k6 (+0.90 -> +0.30)"
    fork.lags_us = (0.7, 0.75)
    assert changes(fork, names) == "none by 0.15 us or more"
