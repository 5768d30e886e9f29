"""Fork and join under torch.compile: the l2prefetch::fork / join ops (CPU).

A recording controller stands in for PrefetchController (which needs a GPU);
it reaches the ops through l2prefetch.ops' registry like the real one.  The
model (tests/_compile_model.py) forks at two points per layer and joins at
the end, through hooks.attach and written into forward (Direct).  Checked:
no graph break (fullgraph=True), the ops in the traced graphs in order and
behind the work they follow, one run-time fork per site and one join per
call, the registry's errors and weak references, detach unregistering.
test_compile_gpu.py runs the same model under Inductor and CUDA graphs.
"""

from __future__ import annotations

import gc
import logging
import operator
import re
import shutil
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend

from _compile_model import Direct, Model, expected_calls, points
from conftest import CXX_THROW_ABORTS
from l2prefetch import hooks, ops

FORK = torch.ops.l2prefetch.fork.default
JOIN = torch.ops.l2prefetch.join.default
aten = torch.ops.aten
MATMULS = {torch._C._nn.linear, F.linear, aten.linear.default, aten.mm.default,
           aten.addmm.default, aten.bmm.default}
FORK_ARGS = ("handle", "point", "layer", "batch", "after")
JOIN_ARGS = ("handle", "after")
BATCH = 3

#: Tests in which an exception crosses torch's C++ code (an op's Python kernel
#: raising, Dynamo raising out of a compiled frame): skipped where a C++ throw
#: aborts the process (conftest.CXX_THROW_ABORTS: ASan preloaded without libstdc++).
throws_through_torch = pytest.mark.skipif(
    CXX_THROW_ABORTS, reason="a C++ throw aborts under ASan preloaded without libstdc++")


class Recorder:
    """A controller stand-in: records fork and join; fork answers True."""

    def __init__(self):
        self.calls = []

    def fork(self, point, layer, batch):
        self.calls.append(("fork", point, layer, batch))
        return True

    def join(self):
        self.calls.append(("join",))


class Graphs:
    """A backend that records every graph it gets, then runs it as is (Dynamo's
    graph, like backend="eager") or through AOTAutograd (its forward graph,
    with the effect tokens, like backend="aot_eager")."""

    def __init__(self, aot=False, dce=False):
        self.graphs, self.aot, self.dce = [], aot, dce

    def __call__(self, gm, example_inputs):
        if not self.aot:
            if self.dce:
                gm.graph.eliminate_dead_code()
                gm.recompile()
            self.graphs.append(gm.graph)
            return gm.forward

        def forward(fw, inputs):
            self.graphs.append(fw.graph)
            return fw
        return aot_autograd(fw_compiler=forward)(gm, example_inputs)

    def events(self):
        return [event for graph in self.graphs for event in graph_events(graph)]


def _bound(names, args, kwargs):
    values = dict(zip(names, args))
    values.update(kwargs)
    return values


def _op(node):
    """(target, args) of a call, seeing through with_effects(token, op, *args)."""
    target, args = node.target, node.args
    if target is torch.ops.higher_order.with_effects:
        target, args = args[1], args[2:]
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    return target, args


def _matmul_of(node):
    """The matmul node that produced node, seeing through views and reshapes."""
    while isinstance(node, torch.fx.Node):
        target, _ = _op(node)
        if node.op == "call_function" and target in MATMULS:
            return node
        node = node.args[0] if node.args else None
    return None


def graph_events(graph):
    """The matmuls, forks and joins of an FX graph in node order.

    "mm" for a matmul; ("fork", point, layer, batch) for a fork, after checking
    that its ``after`` tensor comes from the matmul just before it; ("join",).
    """
    events, last_mm = [], None
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target, args = _op(node)
        if target in MATMULS:
            events.append("mm")
            last_mm = node
        elif target is FORK:
            a = _bound(FORK_ARGS, args, node.kwargs)
            assert last_mm is not None and _matmul_of(a["after"]) is last_mm, (
                f"fork {a['point']} {a['layer']}: after={a.get('after')} is not the output of "
                f"the matmul before it ({last_mm})")
            events.append(("fork", a["point"], a["layer"], a["batch"]))
        elif target is JOIN:
            a = _bound(JOIN_ARGS, args, node.kwargs)
            assert a.get("after") is not None and _matmul_of(a["after"]) is last_mm
            events.append(("join",))
    return events


def expected_events(count, batch):
    """Each fork right after the matmul it follows, the join after the head's."""
    events = []
    for i in range(count):
        events += ["mm", ("fork", "oproj_down", i, batch), "mm"]
        if i < count - 1:
            events.append(("fork", "next_attention", i, batch))
    return events + ["mm", ("join",)]


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("L2PREFETCH_DISABLE", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def hooked(count=2):
    torch.manual_seed(0)
    model, controller = Model(count=count), Recorder()
    attachment = hooks.attach(model, controller, points(model))
    return model, controller, attachment


def direct(count=2):
    torch.manual_seed(0)
    controller = Recorder()
    model = Direct(count=count, handle=ops.register(controller))
    return model, controller


def callables(kind):
    """(compile target, controller, keep-alive): the hooked model itself, a step
    function calling it, or Direct."""
    if kind == "direct":
        model, controller = direct()
        return model, controller, model
    model, controller, attachment = hooked()
    if kind == "hooked-model":
        return model, controller, attachment
    return (lambda x: model(x)), controller, attachment


KINDS = ["hooked-model", "hooked-step", "direct"]


# ---- graphs ----

@pytest.mark.parametrize("kind", KINDS)
def test_dynamo_graph_holds_the_ops_in_order(kind):
    target, controller, _keep = callables(kind)
    backend = Graphs()
    torch.compile(target, fullgraph=True, backend=backend)(torch.randn(BATCH, 1, 16))
    assert backend.events() == expected_events(2, BATCH)
    # torch.compile(model) runs the root's forward hooks as a frame of their
    # own: the join is in a second graph, captured (and run) after forward's.
    assert len(backend.graphs) == (2 if kind == "hooked-model" else 1)


def test_wrap_top_frame_puts_the_join_in_the_forward_graph():
    """What mode="reduce-overhead" needs of torch.compile(model): one graph per step."""
    model, controller, _attachment = hooked()
    backend = Graphs()
    with torch._dynamo.config.patch(wrap_top_frame=True):
        torch.compile(model, fullgraph=True, backend=backend)(torch.randn(BATCH, 1, 16))
    assert len(backend.graphs) == 1
    assert graph_events(backend.graphs[0]) == expected_events(2, BATCH)
    assert controller.calls == expected_calls(2, BATCH)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("kind", KINDS)
def test_aot_graph_threads_the_token_through_the_ops_in_order(kind, grad):
    target, controller, _keep = callables(kind)
    backend = Graphs(aot=True)
    with torch.set_grad_enabled(grad):
        torch.compile(target, fullgraph=True, backend=backend)(torch.randn(BATCH, 1, 16))
    assert backend.events() == expected_events(2, BATCH)
    effects = [n for g in backend.graphs for n in g.nodes
               if n.target is torch.ops.higher_order.with_effects]
    assert len(effects) == 4 and all(_op(n)[0] in (FORK, JOIN) for n in effects)
    # each takes the token the previous one returned
    for before, after in zip(effects, effects[1:]):
        if before.graph is after.graph:
            assert after.args[0].args[0] is before


def test_dead_code_elimination_keeps_the_ops():
    assert torch._library.utils.is_impure(FORK) and torch._library.utils.is_impure(JOIN)
    target, _controller, _keep = callables("hooked-step")
    backend = Graphs(dce=True)
    torch.compile(target, fullgraph=True, backend=backend)(torch.randn(BATCH, 1, 16))
    assert backend.events() == expected_events(2, BATCH)


def test_tracing_needs_no_controller():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 3)
        FORK(10**9, "p", 0, 2, x)          # the fake kernels look nothing up
        JOIN(10**9, x)
        torch.ops.l2prefetch.fork(10**9, "p", 0, 2)


# ---- run time ----

@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_calls_reach_the_controller(kind, backend):
    target, controller, _keep = callables(kind)
    x = torch.randn(BATCH, 1, 16)
    with torch.no_grad():
        expected = target(x)
    assert controller.calls == expected_calls(2, BATCH)      # eager: plain calls
    controller.calls.clear()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(target, fullgraph=True, backend=counter)
    out = compiled(x)
    frames = counter.frame_count
    for _ in range(2):
        assert torch.equal(compiled(x), out)
    assert counter.frame_count == frames                     # no recompiles
    assert torch.equal(out, expected)
    assert controller.calls == expected_calls(2, BATCH) * 3  # one join per call


def test_dynamic_batch_reaches_the_controller():
    model, controller, _attachment = hooked()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x: model(x), fullgraph=True, dynamic=True, backend=counter)
    for batch in (3, 5, 2):
        compiled(torch.randn(batch, 1, 16))
    assert counter.frame_count == 1
    assert controller.calls == (expected_calls(2, 3) + expected_calls(2, 5)
                                + expected_calls(2, 2))


def test_batch_fn_under_compile():
    torch.manual_seed(0)
    model, controller = Model(count=1), Recorder()
    hooks.attach(model, controller, points(model), batch_fn=lambda m, a, k: a[0].shape[0] * 7)
    torch.compile(model, fullgraph=True, backend="aot_eager")(torch.randn(2, 1, 16))
    assert controller.calls == [("fork", "oproj_down", 0, 14), ("join",)]


def test_a_dynamic_batch_from_batch_fn_reaches_the_controller():
    """batch_fn's result is checked; a symbolic batch (dynamic=True) passes as it is."""
    model, controller = Model(count=1), Recorder()
    hooks.attach(model, controller, points(model), batch_fn=lambda m, a, k: a[0].shape[0] * 7)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x: model(x), fullgraph=True, dynamic=True, backend=counter)
    for batch in (3, 5):
        compiled(torch.randn(batch, 1, 16))
    assert counter.frame_count == 1
    assert controller.calls == [("fork", "oproj_down", 0, 21), ("join",),
                                ("fork", "oproj_down", 0, 35), ("join",)]


@throws_through_torch
def test_a_negative_batch_from_batch_fn_is_refused_under_compile():
    model, controller = Model(count=1), Recorder()
    hooks.attach(model, controller, points(model), batch_fn=lambda m, a, k: -1)
    with pytest.raises(ValueError, match=r"^batch_fn returned -1 at point 'oproj_down', "
                                         r"layer 0: it must return an int >= 0"):
        torch.compile(model, backend="aot_eager")(torch.randn(2, 1, 16))   # fullgraph:
    assert controller.calls == []                       # Dynamo's Unsupported, naming it


@pytest.mark.parametrize("aot", [False, True], ids=["dynamo", "aot"])
def test_a_before_site_forks_behind_its_modules_input(aot):
    """A site hooked before the MLP forks after the o_proj matmul and the residual add
    that make the MLP's input (``after`` is that input), before the MLP's matmul."""
    torch.manual_seed(0)
    model, controller = Model(count=2), Recorder()
    hooks.attach(model, controller,
                 {"mlp": [(layer.mlp, i, "before") for i, layer in enumerate(model.layers)]})
    backend = Graphs(aot=aot)
    x = torch.randn(BATCH, 1, 16)
    with torch.no_grad():
        expected = model(x)
        controller.calls.clear()
        out = torch.compile(lambda x: model(x), fullgraph=True, backend=backend)(x)
    assert torch.equal(out, expected)
    forks, order = [], []
    for graph in backend.graphs:
        for node in graph.nodes:
            target, args = _op(node)
            if node.op != "call_function":
                continue
            if target in MATMULS:
                order.append("mm")
            elif target is FORK:
                a = _bound(FORK_ARGS, args, node.kwargs)
                forks.append(a["after"])
                order.append(("fork", a["point"], a["layer"], a["batch"]))
            elif target is JOIN:
                order.append(("join",))
    assert order == ["mm", ("fork", "mlp", 0, BATCH), "mm", "mm", ("fork", "mlp", 1, BATCH),
                     "mm", "mm", ("join",)]
    for after in forks:       # the residual add of the o_proj output: the MLP's input
        assert _op(after)[0] in (operator.add, aten.add.Tensor), after
    assert controller.calls == [("fork", "mlp", 0, BATCH), ("fork", "mlp", 1, BATCH), ("join",)]


def test_a_before_site_whose_input_is_a_keyword_forks_behind_it():
    """A module called as ``m(3, hidden_states=x)``: the batch and ``after`` are x's."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16, bias=False)

        def forward(self, scale, hidden_states):
            return self.proj(hidden_states) * scale

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(16, 16, bias=False)
            self.inner = Scaled()

        def forward(self, x):
            return self.inner(3, hidden_states=self.first(x))

    torch.manual_seed(0)
    model, controller = Outer(), Recorder()
    hooks.attach(model, controller, {"p": [(model.inner, 0, "before")]})
    backend = Graphs()
    torch.compile(model, fullgraph=True, backend=backend)(torch.randn(BATCH, 1, 16))
    forks = [_bound(FORK_ARGS, _op(n)[1], n.kwargs) for g in backend.graphs for n in g.nodes
             if n.op == "call_function" and _op(n)[0] is FORK]
    assert [(f["point"], f["batch"]) for f in forks] == [("p", BATCH)]
    assert _matmul_of(forks[0]["after"]) is not None      # behind first's matmul, not None


def test_attachment_join_in_compiled_code():
    torch.manual_seed(0)
    model, controller = Model(), Recorder()
    attachment = hooks.attach(model, controller, points(model), join=False)

    def step(x):
        out = model(x)
        attachment.join(after=out)
        return out

    backend = Graphs()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    compiled(torch.randn(BATCH, 1, 16))
    compiled(torch.randn(BATCH, 1, 16))
    assert backend.events() == expected_events(2, BATCH)
    assert controller.calls == expected_calls(2, BATCH) * 2


def test_attach_to_the_torch_compile_wrapper_hooks_its_module():
    """attach(torch.compile(model), ...): the hooks go on the module, the join's too, so
    the compiled code holds every op as where they were attached before compiling."""
    torch.manual_seed(0)
    model, controller = Model(), Recorder()
    backend = Graphs()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with hooks.attach(compiled, controller, points(model)):
        assert not compiled._forward_hooks
        compiled(torch.randn(BATCH, 1, 16))
    assert backend.events() == expected_events(2, BATCH)
    assert controller.calls == expected_calls(2, BATCH)


def _compiled(model, how):
    """``model`` compiled one of three ways (backend "eager"); what to call."""
    if how == "wrapper":
        return torch.compile(model, backend="eager")
    if how == "forward":
        model.forward = torch.compile(model.forward, backend="eager")
    else:
        model.compile(backend="eager")
    return model


@pytest.mark.parametrize("how", ["wrapper", "forward", "module.compile()"])
def test_attach_after_the_first_compiled_call_warns_that_nothing_forks(how, caplog):
    """Dynamo does not guard on a module's empty hook dicts: frames traced before attach
    run none of its hooks (torch.compile of a function that calls the model: not seen)."""
    torch.manual_seed(0)
    model, controller = Model().eval(), Recorder()
    target = _compiled(model, how)
    x = torch.randn(BATCH, 1, 16)
    target(x)
    with caplog.at_level(logging.WARNING, logger="l2prefetch.hooks"):
        with hooks.attach(target, controller, points(model)):
            target(x)
    assert "torch.compile already traced Model.forward" in caplog.text
    assert not any(call[0] == "fork" for call in controller.calls)   # what it warns of


class _NoGrad(Model):
    @torch.no_grad()
    def forward(self, x):
        return super().forward(x)


class _InferenceMode(Model):
    @torch.inference_mode()
    def forward(self, x):
        return super().forward(x)


@pytest.mark.parametrize("how", ["wrapper", "forward", "module.compile()"])
@pytest.mark.parametrize("cls", [_NoGrad, _InferenceMode])
def test_attach_after_the_first_compiled_call_of_a_decorated_forward_warns(cls, how, caplog):
    """A forward decorated with torch.no_grad() or torch.inference_mode(): Dynamo
    compiles the function it wraps, or the frame torch.compile puts around a callable it
    does not trace (the decorator is torch's), not the class's forward: still seen.  An
    attachment before the first call, or again after a compiled one, does not warn."""
    torch.manual_seed(0)
    model, controller = cls().eval(), Recorder()
    target = _compiled(model, how)
    x = torch.randn(BATCH, 1, 16)
    with caplog.at_level(logging.WARNING, logger="l2prefetch.hooks"):
        with hooks.attach(target, Recorder(), points(model)):
            target(x)
        assert "already traced" not in caplog.text
        with hooks.attach(target, Recorder(), points(model)) as again:
            target(x)
        assert "already traced" not in caplog.text
        assert again._controller.calls == expected_calls(2, BATCH)
        torch._dynamo.reset()
        target(x)
        with hooks.attach(target, controller, points(model)):
            target(x)
    assert f"torch.compile already traced {cls.__name__}.forward" in caplog.text
    assert not any(call[0] == "fork" for call in controller.calls)   # what it warns of


def test_attach_after_each_layer_was_compiled_and_called_warns_that_nothing_forks(caplog):
    """``layer.compile()`` (the README's advice against it aside): frames of a module
    above a site, compiled before attach, run none of its hooks either.  Attached before
    the first call, and again after a compiled attachment, it forks without a warning."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, 1, 16)
    model = Model().eval()
    for layer in model.layers:
        layer.compile(backend="eager")
    first, second, late = Recorder(), Recorder(), Recorder()
    with caplog.at_level(logging.WARNING, logger="l2prefetch.hooks"):
        with hooks.attach(model, first, points(model)):
            model(x)
        with hooks.attach(model, second, points(model)):
            model(x)
        assert "already traced" not in caplog.text
        assert first.calls == second.calls == expected_calls(2, BATCH)
        torch._dynamo.reset()
        model(x)
        with hooks.attach(model, late, points(model)):
            model(x)
    assert "torch.compile already traced Block.forward (for this model or another Block" \
        in caplog.text
    assert not any(call[0] == "fork" for call in late.calls)   # what it warns of


def test_attach_after_another_instance_was_compiled_warns_so(caplog):
    """Every instance of a class shares its forward's frames: one compiled and run
    without hooks (a draft model of the target's class) leaves a second instance,
    attached before its own first call, without forks; the warning says why."""
    torch.manual_seed(0)
    first, second, controller = Model().eval(), Model().eval(), Recorder()
    x = torch.randn(BATCH, 1, 16)
    torch.compile(first, backend="eager")(x)
    with caplog.at_level(logging.WARNING, logger="l2prefetch.hooks"):
        with hooks.attach(second, controller, points(second)):
            torch.compile(second, backend="eager")(x)
    assert "for this model or another Model: every instance shares its frames" in caplog.text
    assert "torch._dynamo.reset()" in caplog.text
    assert not any(call[0] == "fork" for call in controller.calls)


def test_ops_traced_names_the_compilations_that_traced_a_handle():
    model, controller = Model().eval(), Recorder()
    with hooks.attach(model, controller, points(model)) as attachment:
        handle = attachment.op_handle
        assert ops.traced(handle) == frozenset()
        model(torch.randn(BATCH, 1, 16))                     # eager: nothing traced
        assert ops.traced(handle) == frozenset()
        torch.compile(model, backend="eager")(torch.randn(BATCH, 1, 16))
        made = {made_by for _, made_by, _ in hooks._entries_of(hooks._forwards(model))}
        assert made and made <= ops.traced(handle)
    assert ops.traced(handle) == frozenset()                 # unregistered by detach


@throws_through_torch
def test_a_traced_attachment_whose_compiled_call_failed_counts_as_traced(caplog):
    """What marks an attachment's frames as traced with its hooks is the trace itself
    (the ops' fake implementations run), not a compiled call that completed: a profile
    refused on the first compiled call (tuned eagerly) leaves frames that guard on its
    hooks, so the right profile attached next is traced anew and gets no warning."""
    from l2prefetch.profile import EAGER_STEP, StepMismatchError

    torch.manual_seed(0)
    model = Model().eval()
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(BATCH, 1, 16)
    wrong = Recorder()
    wrong.tuned_step = dict(EAGER_STEP)
    with hooks.attach(compiled, wrong, points(model)):
        with pytest.raises(StepMismatchError):
            compiled(x)
    right = Recorder()
    with caplog.at_level(logging.WARNING, logger="l2prefetch.hooks"):
        with hooks.attach(compiled, right, points(model)):
            compiled(x)
    assert "already traced" not in caplog.text
    assert right.calls == expected_calls(2, BATCH)


def _a_late_attach_forks_nothing(model, x, caplog):
    """Attach to ``model`` (a Model) and call it compiled, where its class's forward was
    compiled before without hooks: the warning says so, and nothing forks."""
    controller = Recorder()
    with caplog.at_level(logging.WARNING, logger="l2prefetch.hooks"):
        with hooks.attach(model, controller, points(model)):
            torch.compile(model, backend="eager")(x)
    assert "torch.compile already traced Model.forward" in caplog.text
    assert not any(call[0] == "fork" for call in controller.calls)


@pytest.mark.parametrize("target_compiled", [False, True])
def test_another_instance_compiled_without_hooks_beside_an_attachment_still_warns(
        target_compiled, caplog):
    """A draft model of the target's class compiled and run without hooks while the
    target's attachment is on: the draft's frame runs none of the hooks a later attach
    puts on it.  The target's detach marks as traced with its hooks only the frames of
    compilations that traced its ops: none where the target ran eagerly, the target's
    own where it ran compiled, not the draft's."""
    torch.manual_seed(0)
    target, draft = Model().eval(), Model().eval()
    x = torch.randn(BATCH, 1, 16)
    with hooks.attach(target, Recorder(), points(target)):
        (torch.compile(target, backend="eager") if target_compiled else target)(x)
        torch.compile(draft, backend="eager")(x)
    _a_late_attach_forks_nothing(draft, x, caplog)


def test_a_reset_while_attached_forgets_the_compilations_before_it(caplog):
    """torch._dynamo.reset() numbers compilations from 0 again: a draft compiled after a
    reset (as the README's advice has it) gets the compile id of the target's first
    compilation before it, and must not count as traced with the target's hooks."""
    torch.manual_seed(0)
    target, draft = Model().eval(), Model().eval()
    x = torch.randn(BATCH, 1, 16)
    with hooks.attach(target, Recorder(), points(target)) as attachment:
        torch.compile(target, backend="eager")(x)
        assert ops.traced(attachment.op_handle)
        torch._dynamo.reset()
        assert ops.traced(attachment.op_handle) == frozenset()
        torch.compile(draft, backend="eager")(x)
    _a_late_attach_forks_nothing(draft, x, caplog)


class _BreaksFirst(Model):
    def forward(self, x):
        torch._dynamo.graph_break()   # the hooks' ops are traced in the resume frames
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_frames_that_traced_none_of_the_ops_are_not_counted_as_hooked(caplog):
    """Two cases where a frame compiled during an attachment runs none of a later
    attachment's hooks although the attachment's ops were traced elsewhere: another
    instance's forward, compiled while the target ran inside a compiled function (its
    ops traced in that function's frame); and a forward whose frame ends at a graph
    break after a module the first attachment left unhooked.  Both must warn."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, 1, 16)
    target, other = Model().eval(), Model().eval()
    step = torch.compile(lambda v: target(v), backend="eager")
    with hooks.attach(target, Recorder(), points(target)):
        step(x)
        torch.compile(other, backend="eager")(x)
    _a_late_attach_forks_nothing(other, x, caplog)

    class _BreaksAfterFirst(Model):
        def forward(self, x):
            x = self.layers[0](x)
            torch._dynamo.graph_break()
            return self.head(self.layers[1](x))

    torch._dynamo.reset()
    caplog.clear()
    model = _BreaksAfterFirst().eval()
    compiled = torch.compile(model, backend="eager")
    with hooks.attach(compiled, Recorder(), {"p": [(model.layers[1].mlp, 1)]}):
        compiled(x)
    swapped = Recorder()
    with caplog.at_level(logging.WARNING, logger="l2prefetch.hooks"):
        with hooks.attach(compiled, swapped, {"p": [(model.layers[0].mlp, 0)]}):
            compiled(x)
    assert "torch.compile already traced _BreaksAfterFirst.forward" in caplog.text


@pytest.mark.parametrize("cls", [Model, _BreaksFirst])
def test_attach_again_after_a_compiled_attachment_forks(cls, caplog):
    """Frames traced while an attachment's hooks were on guard on them: a later
    attachment (a server swapping profiles) is traced anew and forks, with no warning.
    Where the forward's own frame ends at a graph break before any hooked module
    (_BreaksFirst), its resume frames trace the ops and guard on the hooks, so the
    second attachment forks too; attach cannot tell that frame from one that runs hooked
    modules (it traced no op) and warns: a warning too many, where guessing (marking
    it) hid warnings that were due."""
    torch.manual_seed(0)
    model = cls().eval()
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(BATCH, 1, 16)
    with hooks.attach(compiled, Recorder(), points(model)):
        compiled(x)
    second = Recorder()
    with caplog.at_level(logging.WARNING, logger="l2prefetch.hooks"):
        with hooks.attach(compiled, second, points(model)):
            compiled(x)
    assert second.calls == expected_calls(2, BATCH)
    if cls is Model:
        assert "already traced" not in caplog.text


def test_attach_before_the_first_compiled_call_does_not_warn(caplog):
    torch.manual_seed(0)
    model, controller = Model().eval(), Recorder()
    compiled = torch.compile(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="l2prefetch.hooks"):
        with hooks.attach(compiled, controller, points(model)):
            compiled(torch.randn(BATCH, 1, 16))
    assert "already traced" not in caplog.text
    assert controller.calls == expected_calls(2, BATCH)


@throws_through_torch
def test_eager_hooks_do_not_go_through_the_registry():
    model, controller, attachment = hooked()
    ops.unregister(attachment.op_handle)
    x = torch.randn(BATCH, 1, 16)
    model(x)
    assert controller.calls == expected_calls(2, BATCH)
    with pytest.raises(LookupError, match=f"handle {attachment.op_handle}"):
        torch.compile(model, fullgraph=True, backend="eager")(x)


_CXX = any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.skipif(not _CXX, reason="Inductor's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("kind", ["hooked-step", "direct"])
def test_inductor_keeps_each_fork_behind_its_matmul(kind):
    """In Inductor's generated code each fork follows the matmul it was hooked
    to and precedes the next one; the join follows the last.  (Without the
    ``after`` tensor Inductor hoists all of them above the first matmul.)"""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    target, controller, _keep = callables(kind)
    x = torch.randn(BATCH, 1, 16)
    with torch.no_grad():
        expected = target(x)
        controller.calls.clear()
        with config.patch(compile_threads=1):
            compiled = torch.compile(target, fullgraph=True)
            out, codes = run_and_get_code(compiled, x)
    assert torch.equal(out, expected)
    assert controller.calls == expected_calls(2, BATCH)
    events, last_out = [], None
    for line in "\n".join(codes).splitlines():
        line = line.strip()
        if re.match(r"extern_kernels\.(mm|addmm|bmm)\(", line):
            events.append("mm")
            last_out = re.search(r"out=(buf\d+)", line).group(1)
        elif m := re.match(r"torch\.ops\.l2prefetch\.fork\.default\((\d+), '(\w+)', (\d+), (\d+), ",
                           line):
            assert re.search(rf"\b{last_out}\b", line), line     # after= the matmul's output
            events.append(("fork", m.group(2), int(m.group(3)), int(m.group(4))))
        elif line.startswith("torch.ops.l2prefetch.join.default("):
            events.append(("join",))
    assert events == expected_events(2, BATCH)


def _kernels(code):
    """The fused and extern kernels that Inductor's generated ``code`` calls, in order."""
    return re.findall(r"^\s+(cpp_fused_\w+|extern_kernels\.\w+)\(", code, re.M)


class NormBlock(torch.nn.Module):
    """A Llama-like layer in bf16: o_proj, the residual add, an RMSNorm that computes in
    float32 (Inductor inlines the add into the norm's kernel, unrounded), then a GEMV."""

    def __init__(self, hidden=64):
        super().__init__()
        self.o_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.norm = RMSNorm(hidden)
        self.up = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, residual):
        h = residual + self.o_proj(x)
        return h + self.up(self.norm(h))


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, x):
        v = x.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * v.to(x.dtype)


@pytest.mark.skipif(not _CXX, reason="Inductor's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("where", ["before", "after"])
def test_a_fork_on_a_fused_input_leaves_inductor_fusing_as_without_it(where):
    """A fork before the norm (its input: the residual add) or after it: Inductor
    generates the same kernels as without the fork and the output is bitwise the
    same; the fork still follows the matmul the add reads (ops._lower_off_the_data_path).
    Realizing the add for the op instead split the add from the norm and changed the
    bf16 output (the compiled-profile logits of issue 40)."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    block = NormBlock().to(torch.bfloat16)
    x, residual = torch.randn(2, 1, 64).bfloat16(), torch.randn(2, 1, 64).bfloat16()

    with torch.no_grad(), config.patch(compile_threads=1):
        torch._dynamo.reset()
        expected, (plain,) = run_and_get_code(torch.compile(block, fullgraph=True), x,
                                              residual)
        controller = Recorder()
        with hooks.attach(block, controller, {"p": [(block.norm, 0, where)]}, join=False):
            torch._dynamo.reset()
            out, (forked,) = run_and_get_code(torch.compile(block, fullgraph=True), x,
                                              residual)
        torch._dynamo.reset()
    assert controller.calls == [("fork", "p", 0, 2)]
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert _kernels(forked) == _kernels(plain)
    lines = [line.strip() for line in forked.splitlines()]
    at = next(i for i, line in enumerate(lines) if line.startswith("torch.ops.l2prefetch.fork"))
    first_mm = next(i for i, line in enumerate(lines) if line.startswith("extern_kernels.mm"))
    assert first_mm < at



def _touch(after):
    """Reads nothing: an extern op Inductor cannot fuse, as a planted spin or an
    all-reduce in the norm's pre-hook is."""


touch_op = torch.library.custom_op("l2p_test::touch", _touch, mutates_args=(),
                                   schema="(Tensor after) -> ()")
touch_op.register_fake(lambda after: None)
ops.mark_ordered(touch_op)


@pytest.mark.skipif(not _CXX, reason="Inductor's CPU backend needs a C++ compiler")
def test_a_before_site_whose_input_a_fallback_op_reads_next_forks_behind_that_input():
    """An extern op in the norm's pre-hook (a planted spin) reads the residual add, so
    Inductor realizes the add for it anyway: the fork before the norm then follows the
    add's kernel itself, right before that op (not the matmul before the add), with the
    kernels and the output bitwise as without the fork."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    block = NormBlock().to(torch.bfloat16)
    planted = block.norm.register_forward_pre_hook(
        lambda m, args: torch.ops.l2p_test.touch(args[0]))
    x, residual = torch.randn(2, 1, 64).bfloat16(), torch.randn(2, 1, 64).bfloat16()

    def calls(code):
        return [line.strip() for line in code.splitlines()
                if re.match(r"\s+(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.)\S*\(", line)]

    try:
        with torch.no_grad(), config.patch(compile_threads=1):
            torch._dynamo.reset()
            expected, (plain,) = run_and_get_code(torch.compile(block, fullgraph=True), x,
                                                  residual)
            controller = Recorder()
            with hooks.attach(block, controller, {"p": [(block.norm, 0, "before")]},
                              join=False):
                torch._dynamo.reset()
                out, (forked,) = run_and_get_code(torch.compile(block, fullgraph=True), x,
                                                  residual)
            torch._dynamo.reset()
    finally:
        planted.remove()
    assert controller.calls == [("fork", "p", 0, 2)]
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    lines = calls(forked)
    at = next(i for i, line in enumerate(lines) if line.startswith("torch.ops.l2prefetch.fork"))
    assert [re.sub(r"buf\d+", "buf", line) for line in lines[:at] + lines[at + 1:]] == \
        [re.sub(r"buf\d+", "buf", line) for line in calls(plain)]
    touched = re.fullmatch(r"torch\.ops\.l2p_test\.touch\.default\((buf\d+)\)", lines[at + 1])
    assert touched, lines[at + 1]
    assert lines[at].endswith(f", {touched.group(1)})"), lines[at]
    assert lines[at - 1].startswith("cpp_fused_") and touched.group(1) in lines[at - 1]



def _copy(x):
    return x.clone()


copy_op = torch.library.custom_op("l2p_test::copy", _copy, mutates_args=(),
                                  schema="(Tensor x) -> Tensor")
copy_op.register_fake(lambda x: torch.empty_like(x))


def _sum_bits(t):
    return t.view(torch.int16).long().sum().item()


def _compiled_without_and_with(step, *inputs):
    """``step(handle, *inputs, False)`` then ``step(handle, *inputs, True)``, ``handle``
    a registered :class:`Recorder`'s, each compiled by Inductor (fullgraph, after a
    Dynamo reset) and run on copies of ``inputs`` (a step may mutate them), no grad:
    (the recorder's calls, [(output, generated code)] of both)."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    controller = Recorder()
    handle = ops.register(controller)
    results = []
    try:
        with torch.no_grad(), config.patch(compile_threads=1):
            for with_ops in (False, True):
                def run(*args, with_ops=with_ops):
                    return step(handle, *args, with_ops)
                torch._dynamo.reset()
                out, (code,) = run_and_get_code(torch.compile(run, fullgraph=True),
                                                *(x.clone() for x in inputs))
                results.append((out, code))
            torch._dynamo.reset()
    finally:
        ops.unregister(handle)
    return controller.calls, results


@pytest.mark.skipif(not _CXX, reason="Inductor's CPU backend needs a C++ compiler")
def test_a_fork_whose_next_reader_is_a_fallback_without_effects_stays_off_the_data_path():
    """A custom op that is not effectful (an all-reduce) next reads the fork's ``after``:
    Inductor hands it a copy of the unrealized add, so the fork must not realize the
    add itself (the norm would then read it rounded): it follows the matmul, with the
    kernels and the output bitwise as without the fork."""
    torch.manual_seed(0)
    o, up = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)
    o, up = o.bfloat16(), up.bfloat16()
    def step(handle, x, residual, forked):
        h = (residual + o(x)) * 1.7      # pointwise on the matmul (the add alone folds in)
        if forked:
            ops.fork(handle, "p", 0, 2, after=h)
        v = torch.ops.l2p_test.copy(h).float()
        n = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
        out = h + up(n) * h.float().sum(-1, keepdim=True).to(h.dtype)
        if forked:      # an op after the copy: the effect tokens sink after it, not the fork
            ops.join(handle, after=out)
        return out

    x, residual = torch.randn(2, 64).bfloat16(), torch.randn(2, 64).bfloat16()

    calls, ((expected, plain), (out, forked)) = _compiled_without_and_with(step, x, residual)
    assert calls == [("fork", "p", 0, 2), ("join",)]
    assert _sum_bits(out) == _sum_bits(expected)
    assert _kernels(forked) == _kernels(plain)
    fork = next(line.strip() for line in forked.splitlines()
                if line.strip().startswith("torch.ops.l2prefetch.fork"))
    first_mm = re.findall(r"^\s+extern_kernels\.(?:mm|addmm)\(.*out=(buf\d+)\)$", forked,
                          re.M)[0]
    assert fork.endswith(f", {first_mm})"), fork


@pytest.mark.skipif(not _CXX, reason="Inductor's CPU backend needs a C++ compiler")
def test_a_join_after_work_on_the_graphs_inputs_alone_runs_after_that_work():
    """The join's ``after`` reads only the graph's inputs (no matmul before it): the op
    gets an empty tensor on that device, so Inductor's CPU backend emits it after the
    fused kernel (with no tensor at all it went before that kernel, after the kernel's
    inputs were freed, and the compiled code failed); the kernels and the output are
    those of the function compiled without the join."""
    def step(handle, a, r, joined):
        v = a.float()
        out = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(a.dtype) + r
        if joined:
            ops.join(handle, after=out)
        return out

    a, r = torch.randn(2, 64).bfloat16(), torch.randn(2, 64).bfloat16()
    calls, ((expected, plain), (out, code)) = _compiled_without_and_with(step, a, r)
    assert calls == [("join",)]
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    calls = [line.strip() for line in code.splitlines()
             if re.match(r"\s+(cpp_fused_\w+|torch\.ops\.)\S*\(", line)]
    assert calls[0].startswith("cpp_fused_") and calls[1].startswith(
        "torch.ops.l2prefetch.join.default("), calls
    assert _kernels(code) == _kernels(plain)


@pytest.mark.skipif(not _CXX, reason="Inductor's CPU backend needs a C++ compiler")
def test_a_join_after_work_on_an_input_the_graph_mutates_stays_after_the_fork():
    """The join's ``after`` reads only an input that the graph mutates in place: the op
    reads no input (handed one, it was ordered before the kernel that writes the input
    back, ahead of the fork it closes), so the fork runs first."""
    def step(handle, x, r, w, with_ops):
        m = (r * 2) @ w
        if with_ops:
            ops.fork(handle, "p", 0, 2, after=m)
        r.add_(1)
        out = torch.relu(m) + x      # not m + x: the fork, a second user of m, keeps
        # Inductor from folding that add into the matmul (addmm), DESIGN.md says
        if with_ops:
            ops.join(handle, after=r * 5)
        return out

    x, w = torch.randn(2, 64), torch.randn(64, 64)
    calls, ((expected, plain), (out, code)) = _compiled_without_and_with(
        step, x, torch.randn(2, 64), w)
    assert calls == [("fork", "p", 0, 2), ("join",)]
    assert torch.equal(out, expected)
    assert _kernels(code) == _kernels(plain)


# ---- the registry ----

def test_register_lookup_unregister():
    a, b = Recorder(), Recorder()
    ha, hb, ha2 = ops.register(a), ops.register(b), ops.register(a)
    assert len({ha, hb, ha2}) == 3 and all(isinstance(h, int) for h in (ha, hb, ha2))
    assert ops.lookup(ha) is a and ops.lookup(ha2) is a and ops.lookup(hb) is b
    ops.fork(ha, "p", 1, 2)
    torch.ops.l2prefetch.join(ha2)
    assert a.calls == [("fork", "p", 1, 2), ("join",)] and b.calls == []
    ops.unregister(ha)
    assert ops.lookup(ha2) is a                    # the other handle is its own
    ops.unregister(ha)                             # unknown: ignored
    ops.unregister(ha2)
    ops.unregister(hb)


@pytest.mark.parametrize("call", [
    pytest.param(lambda h: ops.fork(h, "p", 0, 1), id="fork", marks=throws_through_torch),
    pytest.param(lambda h: torch.ops.l2prefetch.fork(h, "p", 0, 1, after=torch.zeros(1)),
                 id="fork-after", marks=throws_through_torch),
    pytest.param(lambda h: ops.join(h), id="join", marks=throws_through_torch),
    pytest.param(lambda h: torch.ops.l2prefetch.join.default(h, None), id="join-default",
                 marks=throws_through_torch),
    pytest.param(lambda h: ops.lookup(h), id="lookup"),
])
def test_unknown_handle_is_a_clear_error(call):
    with pytest.raises(LookupError, match=r"no controller is registered under handle 987654321 "
                                          r"\(never registered, or unregistered"):
        call(987654321)
    handle = ops.register(Recorder())
    ops.unregister(handle)
    with pytest.raises(LookupError, match=f"handle {handle} "):
        call(handle)


@pytest.mark.parametrize("call", [
    pytest.param(lambda h: ops.fork(h, "p", 0, 1), id="fork"),
    pytest.param(lambda h: ops.join(h), id="join"),
    pytest.param(lambda h: ops.lookup(h), id="lookup"),
    pytest.param(lambda h: ops.unregister(h), id="unregister"),
    pytest.param(lambda h: ops.traced(h), id="traced"),
])
@pytest.mark.parametrize("handle", [True, 1.0, [1], None], ids=repr)
def test_a_handle_that_is_not_an_int_is_refused(call, handle, monkeypatch):
    """True and 1.0 equal handle 1 (and hash as it): refused, not taken for it."""
    controller = Recorder()
    monkeypatch.setitem(ops._registry, 1, weakref.ref(controller))
    with pytest.raises(TypeError, match=r"^handle must be the int l2prefetch.ops.register "
                                        rf"returned, got {type(handle).__name__} "):
        call(handle)
    assert controller.calls == [] and ops.lookup(1) is controller   # not forked, still there


@throws_through_torch
@pytest.mark.parametrize("op", ["fork", "join"])
def test_a_handle_that_is_not_an_int_is_refused_in_compiled_code(op, monkeypatch):
    controller = Recorder()
    monkeypatch.setitem(ops._registry, 1, weakref.ref(controller))

    def step(x):
        y = x * 2
        if op == "fork":
            ops.fork(True, "p", 0, 1, after=y)
        else:
            ops.join(True, after=y)
        return y + 1

    with pytest.raises(TypeError, match="handle must be the int l2prefetch.ops.register "
                                        "returned, got bool True"):
        torch.compile(step, backend=Graphs())(torch.ones(2))   # fullgraph: Unsupported
    assert controller.calls == []


@pytest.mark.parametrize("call", [
    pytest.param(lambda h, a, y: ops.fork(h, "p", 0, 1, after=y), id="ops.fork"),
    pytest.param(lambda h, a, y: ops.join(h, after=y), id="ops.join"),
    pytest.param(lambda h, a, y: a.join(after=y), id="Attachment.join"),
])
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=throws_through_torch)])
def test_an_after_that_is_not_a_tensor_is_refused_eagerly_as_compiled(call, compiled):
    """The ops' schema takes a tensor or None as ``after``: a step's whole output (a
    tuple, a mapping) is refused by name run eagerly too, not only by torch's schema
    error once the step is compiled."""
    model, controller, attachment = hooked()
    handle = attachment.op_handle

    def step(x):
        y = x * 2
        call(handle, attachment, (y,))
        return y + 1

    run = torch.compile(step, backend="eager") if compiled else step
    with pytest.raises(TypeError, match=r"^after must be a torch.Tensor or None .* got tuple"):
        run(torch.ones(2))
    assert controller.calls == []
    call(handle, attachment, None)   # None, and a tensor, as before
    call(handle, attachment, torch.ones(2))


class _IntsOnly(Recorder):
    """Refuses a bool layer or batch, as the C controller does."""

    def fork(self, point, layer, batch):
        if isinstance(layer, bool) or isinstance(batch, bool):
            raise TypeError("layer and batch must be ints, not bool")
        return super().fork(point, layer, batch)


@pytest.mark.parametrize("layer, batch", [(True, 1), (0, False)])
@throws_through_torch
def test_a_bool_layer_or_batch_is_refused_in_compiled_code_as_eagerly(layer, batch):
    """The op's schema casts a bool to 0 or 1, so compiled code forked (point, 1, 1)
    where the controller refuses the call eagerly: ops.fork refuses it while tracing, and
    the frame falls back to eager, where the controller refuses it."""
    controller = _IntsOnly()
    handle = ops.register(controller)
    try:
        def step(x):
            y = x * 2
            ops.fork(handle, "attn", layer, batch, after=y)
            return y + 1

        with pytest.raises(TypeError, match="bool"):
            torch.compile(step, backend="eager")(torch.ones(2))
        assert controller.calls == []
    finally:
        ops.unregister(handle)


@throws_through_torch
def test_unknown_handle_fails_when_compiled_code_runs_not_when_traced():
    def step(x):
        y = x * 2
        ops.fork(987654321, "p", 0, 1, after=y)
        return y + 1

    backend = Graphs()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    with pytest.raises(LookupError, match="handle 987654321"):
        compiled(torch.ones(2))
    assert len(backend.graphs) == 1            # traced and compiled; the run raised


@throws_through_torch
def test_registry_holds_weak_references():
    controller = Recorder()
    ref = weakref.ref(controller)
    handle = ops.register(controller)
    refcount = sys.getrefcount(controller)
    ops.register(controller)
    assert sys.getrefcount(controller) == refcount
    del controller
    gc.collect()
    assert ref() is None
    with pytest.raises(LookupError, match=f"handle {handle} was garbage-collected"):
        torch.ops.l2prefetch.fork(handle, "p", 0, 1)
    with pytest.raises(LookupError, match="garbage-collected"):
        ops.join(handle)
    ops.unregister(handle)
    with pytest.raises(LookupError, match="no controller is registered"):
        ops.join(handle)


@throws_through_torch
def test_compiled_code_after_its_controller_died():
    model, controller = direct(count=1)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(BATCH, 1, 16)
    compiled(x)
    assert controller.calls == expected_calls(1, BATCH)
    del controller
    gc.collect()
    with pytest.raises(LookupError, match="garbage-collected"):
        compiled(x)


def test_register_refuses_what_cannot_serve():
    with pytest.raises(TypeError, match="has no join"):
        ops.register(type("C", (), {"fork": lambda *a: True})())

    class Slotted:
        __slots__ = ()

        def fork(self, point, layer, batch):
            return True

        def join(self):
            pass
    with pytest.raises(TypeError, match=r"Slotted cannot be weakly referenced"):
        ops.register(Slotted())


# ---- attach and detach ----

def test_attach_registers_and_detach_unregisters():
    before = dict(ops._registry)
    model, controller, attachment = hooked()
    handle = attachment.op_handle
    assert isinstance(handle, int) and ops.lookup(handle) is controller
    assert set(ops._registry) - set(before) == {handle}
    attachment.detach()
    assert attachment.op_handle is None and not attachment.attached
    with pytest.raises(LookupError, match=f"handle {handle} "):
        ops.lookup(handle)
    attachment.detach()
    assert ops._registry.keys() == before.keys()
    attachment.join()                         # still reaches the controller, eagerly
    assert controller.calls == [("join",)]


@pytest.mark.parametrize("kind", ["hooked-model", "hooked-step"])
def test_detach_recompiles_without_forks(kind):
    target, controller, attachment = callables(kind)
    compiled = torch.compile(target, fullgraph=True, backend="aot_eager")
    x = torch.randn(BATCH, 1, 16)
    out = compiled(x)
    attachment.detach()                 # Dynamo guards on the hooks: no stale handle runs
    controller.calls.clear()
    assert torch.equal(compiled(x), out)
    assert controller.calls == []


def test_context_manager_unregisters():
    torch.manual_seed(0)
    model, controller = Model(), Recorder()
    with hooks.attach(model, controller, points(model)) as attachment:
        handle = attachment.op_handle
        torch.compile(model, fullgraph=True, backend="eager")(torch.randn(BATCH, 1, 16))
    assert controller.calls == expected_calls(2, BATCH)
    with pytest.raises(LookupError):
        ops.lookup(handle)


def test_disabled_attach_registers_nothing(monkeypatch):
    monkeypatch.setenv("L2PREFETCH_DISABLE", "1")
    before = dict(ops._registry)
    model = Model()
    attachment = hooks.attach(model, Recorder(), points(model))
    assert attachment.op_handle is None and ops._registry.keys() == before.keys()


@throws_through_torch
def test_controller_without_weak_references_works_eagerly(caplog):
    class Slotted:
        __slots__ = ("calls",)

        def __init__(self):
            self.calls = []

        def fork(self, point, layer, batch):
            self.calls.append(("fork", point, layer, batch))
            return True

        def join(self):
            self.calls.append(("join",))

    torch.manual_seed(0)
    model, controller = Model(), Slotted()
    with caplog.at_level(logging.WARNING, logger="l2prefetch"):
        attachment = hooks.attach(model, controller, points(model))
    assert attachment.op_handle is None and attachment.attached
    assert any("cannot be weakly referenced" in r.getMessage() for r in caplog.records)
    x = torch.randn(BATCH, 1, 16)
    model(x)
    assert controller.calls == expected_calls(2, BATCH)
    # Compiled: the hooks raise while Dynamo traces, so fullgraph fails and a
    # plain compile falls back to running them eagerly.
    with pytest.raises(Exception):
        torch.compile(model, fullgraph=True, backend="eager")(x)
    torch._dynamo.reset()
    controller.calls.clear()
    torch.compile(model, backend="eager")(x)
    assert controller.calls == expected_calls(2, BATCH)


def test_import_stays_free():
    code = ("import sys, l2prefetch; from l2prefetch import hooks; "
            "assert 'torch' not in sys.modules and 'l2prefetch.ops' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('torch', 'l2prefetch')))")
    subprocess.run([sys.executable, "-c", code], check=True)
