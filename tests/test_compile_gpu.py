"""torch.compile on the GPU: Inductor and CUDA graphs with real forks.  Skipped without a GPU.

The model of test_compile_ops.py (tests/_compile_model.py) in bf16 on
cuda:0, with a PrefetchController whose tables prefetch, at each fork, the
weight the next matmul reads ("oproj_down" at layer i: layer i's mlp;
"next_attention" at layer i: layer i+1's o_proj).  Forked through
hooks.attach and through the ops written into forward (Direct), compiled
with the default Inductor backend and with mode="reduce-overhead" (Inductor
plus CUDA-graph trees).  A compiled step function holds the forks and the join
in one graph; ``torch.compile(model)`` compiles the root's join hook as a
graph of its own, which is fine without CUDA graphs, and under CUDA-graph
trees needs ``torch._dynamo.config.wrap_top_frame = True`` (README):

* the forks launch: controller.stats() counts them (for reduce-overhead, at
  the warm-up and recording runs only: replays run the captured graph, whose
  kernel nodes the counters never see), and nothing is left pending;
* CUDA graphs are not skipped because of the ops;
* the output is bitwise identical to the uncompiled model's without any
  prefetch (the model is bias-free matmuls and adds, so the compiler has
  nothing to round differently; a compiled control without prefetch is
  checked first, so a failure says which of compiler and prefetch changed it);
* in Inductor's code each fork stays behind the matmul it follows.
"""

import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from _compile_model import Direct, Model, points  # noqa: E402
from l2prefetch import PrefetchController, PreparedWeightRanges, hooks, ops  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda:0"
HIDDEN = 2048          # 8 MiB of bf16 per weight
LAYERS = 3
BATCH = 4
STEPS = 10


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("L2PREFETCH_DISABLE", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    from torch._inductor import cudagraph_trees

    cudagraph_trees.reset_cudagraph_trees()


def _model(cls=Model):
    torch.manual_seed(0)
    with torch.device(DEV):
        return cls(hidden=HIDDEN, count=LAYERS).to(torch.bfloat16).eval()


def _controller(model):
    ctrl = PrefetchController(0)
    for i, layer in enumerate(model.layers):
        ctrl.add("oproj_down", i, [BATCH], PreparedWeightRanges([layer.mlp.weight]))
        if i + 1 < len(model.layers):
            nxt = model.layers[i + 1].attn.o_proj.weight
            ctrl.add("next_attention", i, [BATCH], PreparedWeightRanges([nxt]))
    return ctrl


def _input():
    g = torch.Generator(device=DEV).manual_seed(1)
    return torch.randn(BATCH, 1, HIDDEN, device=DEV, generator=g).to(torch.bfloat16)


def _setup(kind):
    """(callable to compile, controller, keep-alive)."""
    if kind.startswith("hooks"):
        model = _model()
        ctrl = _controller(model)
        attachment = hooks.attach(model, ctrl, points(model))
        target = (lambda x: model(x)) if kind == "hooks-step" else model
        return target, ctrl, (model, attachment)
    model = _model(Direct)
    ctrl = _controller(model)
    model.handle = ops.register(ctrl)
    return model, ctrl, model


def _run(fn, x, steps):
    outs = []
    with torch.no_grad():
        for _ in range(steps):
            outs.append(fn(x).clone())
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("kind, mode, wrap", [
    ("hooks-step", "default", False),
    ("hooks-step", "reduce-overhead", False),
    ("hooks-model", "default", False),
    ("hooks-model", "reduce-overhead", True),
    ("direct", "default", False),
    ("direct", "reduce-overhead", False),
])
def test_compiled_forks_launch_and_keep_outputs_bitwise(kind, mode, wrap):
    with torch._dynamo.config.patch(wrap_top_frame=wrap):
        _check_compiled(kind, mode)


def _check_compiled(kind, mode):
    x = _input()
    plain = _model()
    with torch.no_grad():
        reference = plain(x)                         # uncompiled, no prefetch
    control = torch.compile(plain, fullgraph=True, mode=mode)
    for out in _run(control, x, 3):
        assert torch.equal(out, reference), "the compiler alone changed the output"
    torch._dynamo.reset()

    fn, ctrl, _keep = _setup(kind)
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, mode=mode)
    outs = _run(compiled, x, STEPS)
    assert not ctrl.pending
    for out in outs:
        assert torch.equal(out, reference)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])

    stats = ctrl.stats()
    forks = {point: s["forks"] for point, s in stats.items()}
    nbytes = HIDDEN * HIDDEN * 2
    if mode == "default":
        assert forks == {"oproj_down": STEPS * LAYERS, "next_attention": STEPS * (LAYERS - 1)}
        assert stats["oproj_down"]["bytes"] == STEPS * LAYERS * nbytes
    else:
        # Warm-up and recording call the ops; replays do not reach Python.
        runs = forks["oproj_down"] // LAYERS
        assert 1 <= runs < STEPS and forks == {"oproj_down": runs * LAYERS,
                                               "next_attention": runs * (LAYERS - 1)}
        ctrl.reset_stats()
        outs = _run(compiled, x, STEPS)
        assert all(torch.equal(out, reference) for out in outs)
        assert ctrl.stats()["oproj_down"]["forks"] == 0, "replays went back to Python"
        assert not ctrl.pending


def test_inductor_cuda_code_keeps_each_fork_behind_its_matmul():
    """Inductor's CUDA code: each fork right after the matmul it follows."""
    from torch._inductor.utils import run_and_get_code

    fn, ctrl, _keep = _setup("hooks-step")
    x = _input()
    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(fn, fullgraph=True), x)
    events = []
    for line in "\n".join(codes).splitlines():
        line = line.strip()
        if re.match(r"extern_kernels\.(mm|addmm|bmm)\(", line):
            events.append("mm")
        elif m := re.match(r"torch\.ops\.l2prefetch\.fork\.default\(\d+, '(\w+)', (\d+), ", line):
            events.append((m.group(1), int(m.group(2))))
        elif line.startswith("torch.ops.l2prefetch.join.default("):
            events.append("join")
    expected = []
    for i in range(LAYERS):
        expected += ["mm", ("oproj_down", i), "mm"]
        if i < LAYERS - 1:
            expected.append(("next_attention", i))
    assert events == expected + ["mm", "join"]
    torch.cuda.synchronize()
    assert ctrl.stats()["oproj_down"]["forks"] == LAYERS


def test_detach_under_reduce_overhead_recompiles_without_forks():
    """After detach the hooks are gone and the handle unregistered: the step is
    recompiled (Dynamo guards on the hooks) and runs without forks."""
    fn, ctrl, (model, attachment) = _setup("hooks-step")
    x = _input()
    compiled = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    _run(compiled, x, 3)
    attachment.detach()            # the hooks changed: Dynamo recompiles
    ctrl.reset_stats()
    with torch.no_grad():
        reference = _model()(x)
    outs = _run(compiled, x, 3)
    assert all(torch.equal(out, reference) for out in outs)
    assert ctrl.stats()["oproj_down"]["forks"] == 0


def test_reduce_overhead_model_without_wrap_top_frame():
    """torch.compile(model) without wrap_top_frame compiles the root's join hook
    as a graph of its own, so the CUDA-graph capture of forward holds forks
    without their join: expected to fail.  Run in a fresh process, since a
    failed capture leaves torch's CUDA RNG and graph state broken for every
    later test.  Passing means torch keeps the join in forward's capture."""
    script = ("import sys; sys.path[:0] = [%r]; import test_compile_gpu as t; "
              "t._check_compiled('hooks-model', 'reduce-overhead')"
              % os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env.pop("L2PREFETCH_DISABLE", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=600)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.xfail("without wrap_top_frame the join hook is outside forward's CUDA graph: "
                     + last)
