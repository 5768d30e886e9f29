"""Hugging Face DeepSeek-V3 with l2prefetch's hooks on the GPU: numerics and forks.

A tiny random ``DeepseekV3ForCausalLM`` (3 layers, the first dense; weights
from a config, never downloaded) decodes one step from a ``StaticCache``
with and without ``hooks.attach(model, controller, deepseek_v3.hook_points)``:
the logits must be bitwise identical, eager and in CUDA-graph replay, and the
controller must count one fork per planned point and layer, with the default
points (none: only the join hook is attached), with ``next_attention`` and with
every point (``points=deepseek_v3.POINTS``: the router prefetch after
``o_proj`` too).
Needs transformers 5 (``set_experts_implementation("grouped_mm")``, a
StaticCache that keeps its position on the device); skipped without it or
without a GPU.
benchmarks/deepseek.py is the full-size version with timings.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from collections import Counter  # noqa: E402

from l2prefetch import PrefetchController, deepseek_v3, hooks  # noqa: E402
from l2prefetch.tuning.hf import cache_keyword  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda:0"
PROMPT = 8
CACHE = 32
CONFIG = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, n_group=2, topk_group=1, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    num_mtp_layers=0, max_position_embeddings=256, tie_word_embeddings=False)


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    monkeypatch.delenv("L2PREFETCH_DISABLE", raising=False)


@pytest.fixture(scope="module")
def model():
    config = transformers.DeepseekV3Config(**CONFIG)
    torch.manual_seed(0)
    with torch.device(DEV):
        m = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                          attn_implementation="sdpa")
    m.set_experts_implementation("grouped_mm")   # the eager experts loop cannot be captured
    return m.eval()


class Step:
    """One decode step of batch rows after an 8-token prefill; reset() makes it the same step."""

    def __init__(self, model, batch):
        self.model = model
        self.cache = transformers.StaticCache(config=model.config, max_cache_len=CACHE)
        self.inputs = {cache_keyword(model): self.cache, "use_cache": True}
        generator = torch.Generator().manual_seed(batch)
        prompt = torch.randint(0, CONFIG["vocab_size"], (batch, PROMPT), generator=generator)
        prompt = prompt.to(DEV)
        positions = torch.arange(PROMPT, device=DEV).expand(batch, -1)
        logits = model(input_ids=prompt, position_ids=positions, **self.inputs).logits
        self.ids = logits[:, -1:].argmax(-1).contiguous()
        self.pos = torch.full((batch, 1), PROMPT, dtype=torch.long, device=DEV)
        self.lengths = [layer.cumulative_length for layer in self.cache.layers]

    def __call__(self):
        logits = self.model(input_ids=self.ids, position_ids=self.pos, **self.inputs).logits
        self.pos.add_(1)
        return logits

    def reset(self):
        for length in self.lengths:
            length.fill_(PROMPT)
        self.pos.fill_(PROMPT)


def planned_forks(plan, batch):
    return dict(Counter(e.point for e in plan if batch in e.batches))


def forks(controller):
    return {point: s["forks"] for point, s in controller.stats().items() if s["forks"]}


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def sites_of(points):
    """The hook sites of points, for hooks.attach (the plan of the same points forks there)."""
    return lambda model: deepseek_v3.hook_points(model, points)


#: The points the tests run with, and the forks per step of the 3-layer model (one dense).
NEXT = ("next_attention",)
POINT_SETS = {"default": (None, {}),
              "next": (NEXT, {"next_attention": 2}),
              "every": (deepseek_v3.POINTS, {"next_attention": 2, "oproj_down": 2})}


def capture(step, controller=None, points=None):
    attachment = None
    if controller is not None:
        attachment = hooks.attach(step.model, controller, sites_of(points))
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step.reset()
                step()
        torch.cuda.current_stream().wait_stream(side)
        step.reset()
        torch.cuda.synchronize()
        if controller is not None:
            controller.reset_stats()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()
    finally:
        if attachment is not None:
            attachment.detach()
    torch.cuda.synchronize()
    return graph, logits


def test_plan_matches_hook_points(model):
    assert deepseek_v3.plan(model) == [] and deepseek_v3.hook_points(model) == {}
    plan = deepseek_v3.plan(model, points=NEXT)
    sites = {(point, layer) for point, pairs in deepseek_v3.hook_points(model, NEXT).items()
             for _module, layer in pairs}
    assert sites == {(e.point, e.layer) for e in plan}
    assert sites == {("next_attention", 0), ("next_attention", 1)}
    plan = deepseek_v3.plan(model, points=deepseek_v3.POINTS)
    sites = {(point, layer)
             for point, pairs in deepseek_v3.hook_points(model, deepseek_v3.POINTS).items()
             for _module, layer in pairs}
    assert sites == {(e.point, e.layer) for e in plan}
    assert sites == {("next_attention", 0), ("next_attention", 1), ("oproj_down", 1),
                     ("oproj_down", 2)}


@pytest.mark.parametrize("which", sorted(POINT_SETS))
@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_eager_step_bitwise_identical_with_prefetch(model, batch, which):
    points, expected = POINT_SETS[which]
    plan = deepseek_v3.plan(model, points=points)
    step = Step(model, batch)
    step.reset()
    ref = step().clone()
    with PrefetchController.from_plan(plan, 0) as controller:
        step.reset()
        with hooks.attach(model, controller, sites_of(points)) as attachment:
            assert attachment.attached
            got = step().clone()
        torch.cuda.synchronize()
        assert forks(controller) == planned_forks(plan, batch) == expected
        assert not controller.pending          # the root hook joined
    assert same_bits(ref, got)
    assert [int(t) for t in step.lengths] == [PROMPT + 1] * 3
    assert int(step.pos[0, 0]) == PROMPT + 1


@pytest.mark.parametrize("which", sorted(POINT_SETS))
@pytest.mark.parametrize("batch", [1, 4])
@torch.no_grad()
def test_graph_replay_bitwise_identical_with_prefetch(model, batch, which):
    points, expected = POINT_SETS[which]
    plan = deepseek_v3.plan(model, points=points)
    step = Step(model, batch)
    with PrefetchController.from_plan(plan, 0) as controller:
        plain, plain_logits = capture(step)
        fetched, fetched_logits = capture(step, controller, points)
        captured = forks(controller)
        assert captured == planned_forks(plan, batch) == expected
        assert not controller.pending
        for _ in range(3):
            step.reset()
            plain.replay()
            ref = plain_logits.clone()
            step.reset()
            fetched.replay()
            got = fetched_logits.clone()
            torch.cuda.synchronize()
            assert same_bits(ref, got)
        assert forks(controller) == captured   # replays run no Python: the counts stay
        # the replayed step advances the static cache and the positions
        step.reset()
        fetched.replay()
        fetched.replay()
        torch.cuda.synchronize()
        assert [int(t) for t in step.lengths] == [PROMPT + 2] * 3
        assert int(step.pos[0, 0]) == PROMPT + 2
        del plain, fetched


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@torch.no_grad()
def test_hooked_model_runs_compiled(model, mode):
    """The hooked real model under torch.compile (default Inductor, and CUDA graphs):
    the hooks emit the custom ops, the forks launch while the compiled code runs
    them, and the logits match the uncompiled model without prefetch to bf16
    tolerance (Inductor may fuse differently around the ops' `after` tensors,
    so bit equality is not asked here; tests/test_compile_gpu.py asks it of a
    bias-free model)."""
    import torch._dynamo

    torch._dynamo.reset()
    batch = 2
    plan = deepseek_v3.plan(model, points=NEXT)
    step = Step(model, batch)
    step.reset()
    ref = step().clone()
    with PrefetchController.from_plan(plan, 0) as controller:
        with hooks.attach(model, controller, sites_of(NEXT)):
            compiled = torch.compile(step.__call__, mode=mode)
            outs = []
            for _ in range(4):                 # warm-up, recording, replays
                step.reset()
                outs.append(compiled().clone())
            torch.cuda.synchronize()
        counted = forks(controller)
        assert not controller.pending
    torch._dynamo.reset()
    # every planned point forked at least once (replays of a CUDA graph run no Python,
    # so their forks are not counted: at least the first call's are)
    assert set(counted) == set(planned_forks(plan, batch)), counted
    assert all(n >= planned_forks(plan, batch)[p] for p, n in counted.items()), counted
    for out in outs:
        assert out.shape == ref.shape and torch.isfinite(out.float()).all()
        torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=5e-2)
