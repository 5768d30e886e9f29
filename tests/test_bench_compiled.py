"""benchmarks/compiled.py's ceiling, on the CPU: what the kept plan can gain at most is
each kept role's consumer gap, once per consumer (issue 40's definition), not the sum of
the chain gaps, which counts a read two chains cover twice (RESULTS run 23)."""

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from benchmarks.compiled import HEADER, ceiling, row, window_ceiling, window_loads  # noqa: E402
from l2prefetch.tuning.results import BatchReport, RoleReport  # noqa: E402
from l2prefetch.tuning.search import NOT_PREPARED, NOTHING_MEASURED  # noqa: E402


def _role(name, gap, chain):
    return SimpleNamespace(role=name, gap_us=gap, chain_gap_us=chain)


def test_the_ceiling_sums_each_kept_consumer_s_own_gap_once():
    rep = SimpleNamespace(roles=[
        _role("after self_attn.o_proj: mlp.gate_proj", 18.0, 30.0),
        _role("before post_attention_layernorm: mlp.gate_proj", 20.0, 30.0),
        _role("after self_attn.q_proj: self_attn.k_proj", 2.0, 40.0),
        _role("after self_attn.k_proj: self_attn.v_proj", 1.5, 38.0),
        _role("after mlp.down_proj: lm_head", None, None)])
    kept = [("before post_attention_layernorm: mlp.gate_proj", None),
            ("after self_attn.q_proj: self_attn.k_proj", None),
            ("after self_attn.k_proj: self_attn.v_proj", None)]
    assert ceiling(rep, kept) == pytest.approx(20.0 + 2.0 + 1.5)
    # nothing kept: every role's consumers, the largest gap of each
    assert ceiling(rep, []) == pytest.approx(20.0 + 2.0 + 1.5)
    assert ceiling(rep, [("after self_attn.o_proj: mlp.gate_proj", None)]) == 20.0


def test_the_window_ceiling_is_the_gap_of_the_consumer_the_plant_precedes():
    def role(name, gap, window):
        return SimpleNamespace(role=name, gap_us=gap, window_us=window)

    rep = SimpleNamespace(roles=[
        role("after self_attn.o_proj: mlp.gate_proj", 28.0, 65.0),
        role("before post_attention_layernorm: mlp.gate_proj", 27.0, 58.0),
        role("before post_attention_layernorm: mlp.gate_up_proj", 19.0, 22.0),
        role("after self_attn.q_proj: self_attn.k_proj", 6.0, 2.5),
        # eager, the attention is a window of its own: not the planted one (run 30)
        role("after self_attn.v_proj: self_attn.o_proj", 15.0, 51.0),
        role("after mlp.down_proj: next self_attn.q_proj", 14.0, 25.0),
        role("after model: lm_head", None, 80.0)])
    assert window_ceiling(rep, 40) == pytest.approx(28.0)
    assert window_ceiling(rep, 20) == pytest.approx(28.0)
    assert window_ceiling(rep, 0) is None
    assert window_ceiling(rep, 100) == 0.0
    # a fused gate_up_proj is the consumer too (Phi-3, the vLLM-shaped model)
    assert window_ceiling(SimpleNamespace(roles=rep.roles[2:]), 20) == pytest.approx(19.0)


def test_the_window_s_loads_are_the_kept_window_roles_own_verified_loads():
    def role(name, window, vs_empty):
        chosen = SimpleNamespace(vs_empty=SimpleNamespace(estimate=vs_empty))
        return SimpleNamespace(role=name, window_us=window, chosen=chosen)

    rep = SimpleNamespace(roles=[
        role("after self_attn.o_proj: mlp.gate_proj", 65.0, 15.5),
        role("before post_attention_layernorm: mlp.gate_proj", 58.0, 14.0),
        role("after self_attn.q_proj: self_attn.k_proj", 2.4, 3.6),
        role("after self_attn.v_proj: self_attn.o_proj", 51.0, 2.8)])
    kept = [("after self_attn.o_proj: mlp.gate_proj", None),
            ("after self_attn.q_proj: self_attn.k_proj", None),
            ("after self_attn.v_proj: self_attn.o_proj", None)]
    # not q -> k's (no window), not o_proj's (the attention's window), not the unkept
    assert window_loads(rep, kept, 40) == pytest.approx(15.5)
    assert window_loads(rep, kept, 0) is None
    assert window_loads(rep, kept[1:], 40) is None


def test_caps_grids_and_roles_reach_tune_as_its_own_arguments():
    from benchmarks.compiled import tune_options

    def args(caps=None, grids=None, roles=None):
        return SimpleNamespace(caps=caps, grids=grids, roles=roles)

    assert tune_options(args()) == {}
    got = tune_options(args("24,48,96", "32,132",
                            "before post_attention_layernorm: mlp.gate_proj; after model: lm_head;"))
    assert got == {"caps_mib": [24.0, 48.0, 96.0], "grids": [32, 132],
                   "candidates": ["before post_attention_layernorm: mlp.gate_proj",
                                  "after model: lm_head"]}


def test_the_branch_probe_forks_at_the_layers_asked_and_reads_the_mlp_s_first_weight():
    torch = pytest.importorskip("torch")
    from benchmarks.probe_branch import first_mlp_weight, fork_layers

    layers = ["l0", "l1", "l2", "l3"]
    assert fork_layers(layers, None) == list(enumerate(layers))
    assert fork_layers(layers, "3,0,3") == [(0, "l0"), (3, "l3")]
    for bad in ("4", "-1"):
        with pytest.raises(SystemExit, match="--layers"):
            fork_layers(layers, bad)
    fused = SimpleNamespace(mlp=SimpleNamespace(gate_up_proj=torch.nn.Linear(2, 4)))
    assert first_mlp_weight(fused) is fused.mlp.gate_up_proj.weight
    with pytest.raises(SystemExit, match="neither"):
        first_mlp_weight(SimpleNamespace(mlp=torch.nn.Identity()))


def test_a_batch_never_probed_has_blank_cells_and_says_why():
    """A batch not prepared (no step time, no probe) and one prepared but with nothing
    measured: their rows leave the step, the ceilings and the shares blank rather than
    'nan' or a ceiling of 0.00, and say which happened; each has the header's columns."""
    columns = HEADER[0].count("|")
    not_prepared = row("qwen3", 0.0, "compiled (default)",
                       BatchReport(batch=8, reason=NOT_PREPARED), 133.0)
    assert not_prepared == ("| qwen3 | 0 | compiled (default) | 8 |  | not prepared (the budget "
                            "ran out) |  |  |  | - | 133 |  |  |  |  |  |")
    assert not_prepared.count("|") == columns
    probed = RoleReport("after self_attn.o_proj: mlp.gate_proj", 6, 48 << 20)
    probed.gap_us, probed.window_us = 20.0, 60.0
    starved = row("llama", 40.0, "eager", BatchReport(batch=1, step_us=1000.0,
                                                      reason=NOTHING_MEASURED,
                                                      roles=[probed]), 100.0)
    assert starved == ("| llama | 40 | eager | 1 | 1000.0 | nothing measured (the budget ran "
                       "out) |  |  |  | - | 100 | 20.00 |  |  | 20.00 |  |")
    assert starved.count("|") == columns


def test_plant_puts_the_spin_at_the_site_asked_for(monkeypatch):
    """``--site oproj``: o_proj's forward hook (where a TP all-reduce sits); ``norm``: the
    norm's pre-hook; another site is refused before anything is registered."""
    import torch

    import benchmarks.compiled as bc

    monkeypatch.setattr(bc, "spin_cycles_per_us", lambda device=None: 1000.0)
    layers = [SimpleNamespace(self_attn=SimpleNamespace(o_proj=torch.nn.Linear(2, 2)),
                              post_attention_layernorm=torch.nn.LayerNorm(2))
              for _ in range(2)]
    model = SimpleNamespace(model=SimpleNamespace(layers=layers))
    handles = bc.plant(model, 40, "oproj")
    assert len(handles) == 2
    for layer in layers:
        assert len(layer.self_attn.o_proj._forward_hooks) == 1
        assert not layer.post_attention_layernorm._forward_pre_hooks
    for h in handles:
        h.remove()
    handles = bc.plant(model, 40)
    for layer in layers:
        assert not layer.self_attn.o_proj._forward_hooks
        assert len(layer.post_attention_layernorm._forward_pre_hooks) == 1
    with pytest.raises(ValueError, match="site must be one of"):
        bc.plant(model, 40, "mlp")
    assert all(len(layer.post_attention_layernorm._forward_pre_hooks) == 1 for layer in layers)
