"""The vLLM-shaped decoder (benchmarks/vllm_model.py) compiled and captured on the GPU,
as vLLM runs it (issue 40).  Skipped without a GPU.

* FULL: the whole compiled step one CUDA graph at each of vLLM's capture sizes (the
  first fork mode; the others at batches 1 and 8), with forks after o_proj and
  gate_up_proj: the logits are bitwise those of the compiled step without forks;
* PIECEWISE: a graph per piece between attentions; branch forks joined at the end of
  each piece keep the logits bitwise (those of the same pieces without forks), and a
  fork left pending at a piece's end is refused with a ValueError;
* tune() on the compiled step finds it compiled and ships no loss.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from benchmarks import vllm_model as vm  # noqa: E402
from _captured import captured, fresh_frames  # noqa: E402
from l2prefetch import PrefetchController, hooks  # noqa: E402
from l2prefetch.mechanisms import GRAPH_FORKS  # noqa: E402
from l2prefetch.plan import PlanEntry  # noqa: E402
from l2prefetch.tuning import tune  # noqa: E402
from l2prefetch.tuning.compiled import recompile  # noqa: E402

pytestmark = pytest.mark.gpu

CONFIG = vm.Config(hidden=1024, intermediate=2816, layers=2, heads=8, kv_heads=2,
                   head_dim=128, vocab=4096, max_len=64)


_fresh = pytest.fixture(autouse=True)(fresh_frames)


def _compiled():
    torch.manual_seed(0)
    model = vm.Model(CONFIG).to("cuda", torch.bfloat16).eval()
    step = vm.Decode(model, prompt_len=40)
    for batch in vm.CAPTURE_SIZES:
        step.state(batch)
    model.forward = torch.compile(model.forward)
    return model, step


def _plan(model, batches):
    sites, plan = {}, []
    for i, layer in enumerate(model.model.layers):
        sites.setdefault("o", []).append((layer.self_attn.o_proj, i))
        sites.setdefault("g", []).append((layer.mlp.gate_up_proj, i))
        plan.append(PlanEntry("o", i, batches, [layer.mlp.gate_up_proj.weight],
                              byte_cap=4 << 20))
        plan.append(PlanEntry("g", i, batches, [layer.mlp.down_proj.weight]))
    return sites, plan


def _same(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


#: Every fork mode at these sizes, the first (inline) at every size: each mode's hooks are
#: compiled anew per size, and 4 modes x 7 sizes did not finish in 330 s (RESULTS run 23).
MODE_SIZES = (1, 8)


def test_full_capture_at_every_capture_size_bitwise_in_every_mode():
    model, step = _compiled()
    reference = {b: captured(step, b)[0] for b in vm.CAPTURE_SIZES}
    sites, plan = _plan(model, list(vm.CAPTURE_SIZES))
    for mode in GRAPH_FORKS:
        ctrl = PrefetchController.from_plan(plan, 0, graph_fork=mode, eager=False)
        sizes = vm.CAPTURE_SIZES if mode == GRAPH_FORKS[0] else MODE_SIZES
        try:
            with hooks.attach(model, ctrl, sites):
                recompile()
                for batch in sizes:
                    out, _graph = captured(step, batch)
                    assert _same(out, reference[batch]), (mode, batch)
                stats = ctrl.stats()
                assert stats["o"]["forks"] > 0 and stats["g"]["forks"] > 0, stats
        finally:
            ctrl.close()
        recompile()


def test_piecewise_joins_each_piece_and_refuses_a_fork_left_pending():
    model, step = _compiled()
    # The reference is the step captured piecewise without forks: the graph breaks at
    # attention split what Inductor fuses, and attention runs eagerly between the pieces,
    # so the pieces' logits are not FULL's (they differed on the H100, RESULTS run 24).
    reference = vm.Piecewise(step, 4).replay().clone()
    recompile()
    sites, plan = _plan(model, [4])
    ctrl = PrefetchController.from_plan(plan, 0, graph_fork="branch", eager=False)
    try:
        with hooks.attach(model, ctrl, sites) as attachment:
            recompile()
            runner = vm.Piecewise(step, 4, join=attachment.join,
                                  pending=lambda: ctrl.pending)
            assert len(runner.graphs) == CONFIG.layers + 1
            for _ in range(3):
                assert _same(runner.replay(), reference)
            with pytest.raises(ValueError, match="cannot lie in different CUDA graphs"):
                vm.Piecewise(step, 4, pending=lambda: ctrl.pending)
    finally:
        ctrl.close()


def test_tune_the_compiled_vllm_step():
    model, step = _compiled()
    result = tune(model, step, [1], budget_s=45, progress=None)
    assert result.step["compiled"]
    for rep in result.batches:
        if rep.confirmed is not None:
            assert rep.confirmed.gain.low > 0 and rep.confirmed.identical
