"""A compiled step, on the CPU: the tuner's switchboard, step detection, and profiles
that know how their step ran (issue 40).

The switchboard (tuning/compiled.py) is hooked once at every candidate site and
compiled once with its forks; each measurement arm is a selection of controller and
points at run time.  Checked with recording controllers: with the board off the
compiled code holds no fork op; on, each arm's forks reach its controller at its own
point names, in the order given, with no compilation per arm.  Then step_is_compiled
on eager, compiled-and-run and compiled-not-yet-run steps, and the step record:
parse_profile's checks, check_step's refusals, the hooks' and ops' refusals of a
controller tuned the other way, and tune() recording the step.
"""

from __future__ import annotations

import json
import unittest.mock

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from _compile_model import Model, expected_calls, points
from conftest import CXX_THROW_ABORTS
from l2prefetch import hooks, ops, tuning
from l2prefetch.plan import PlanEntry
from l2prefetch.profile import (EAGER_STEP, StepMismatchError, check_step, describe_step,
                                load_profile, parse_profile, profile_document, save_profile,
                                step_record, versions)
from l2prefetch.tuning.compiled import Switchboard, recompile, step_is_compiled

BATCH = 3

throws_through_torch = pytest.mark.skipif(
    CXX_THROW_ABORTS, reason="a C++ throw aborts under ASan preloaded without libstdc++")


class Recorder:
    def __init__(self, tuned_step=None):
        self.calls = []
        if tuned_step is not None:
            self.tuned_step = tuned_step

    def fork(self, point, layer, batch):
        self.calls.append(("fork", point, layer, batch))
        return True

    def join(self):
        self.calls.append(("join",))


@pytest.fixture(autouse=True)
def _fresh():
    recompile()
    yield
    recompile()


def _all_sites(model):
    return [(module, layer, "after") for sites in points(model).values()
            for module, layer in sites]


def test_switchboard_off_compiles_no_fork_and_on_routes_each_arm_without_recompiling():
    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(BATCH, 1, 16)
    with torch.no_grad():
        expected = model(x)
    board = Switchboard(model, _all_sites(model))
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda v: model(v), backend=counter)
    try:
        with torch.no_grad():
            assert torch.equal(step(x), expected)          # off: no fork op compiled in
            assert counter.op_count and not any(
                "l2prefetch" in str(n.target) for g in counter.graphs for n in g.graph.nodes)
            a, b = Recorder(), Recorder()
            with board.selected(a, points(model)):
                assert torch.equal(step(x), expected)
            with board.selected(b, {"mine": [(model.layers[1].attn.o_proj, 1)]}):
                step(x)
            with board.selected(None, None):
                step(x)
            frames = counter.frame_count
            with board.selected(a, points(model)):
                step(x)
            assert counter.frame_count == frames == 2       # off and on, once each
        assert a.calls == expected_calls(2, BATCH) * 2
        assert b.calls == [("fork", "mine", 1, BATCH), ("join",)]
    finally:
        board.close()
    with torch.no_grad():
        step(x)                                             # detached: traced anew, no board
    assert not ops._registry.get(board.attachment.op_handle)


def test_switchboard_forks_two_points_of_one_site_in_the_order_given():
    model = Model().eval()
    site = model.layers[0].attn.o_proj
    board = Switchboard(model, [(site, 0, "after")])
    try:
        rec = Recorder()
        board.select(rec, {"second": [(site, 0)], "first": [(site, 0)]})
        board.fork("after:layers.0.attn.o_proj", 0, 2)
        assert rec.calls == [("fork", "second", 0, 2), ("fork", "first", 0, 2)]
        board.fork("after:layers.0.attn.o_proj", 1, 2)     # a layer no route names
        assert rec.calls[2:] == []
    finally:
        board.close()


def test_switchboard_refuses_a_site_it_was_not_hooked_at():
    model = Model().eval()
    board = Switchboard(model, [(model.layers[0].attn.o_proj, 0, "after")])
    try:
        with pytest.raises(ValueError, match="not hooked at"):
            board.select(Recorder(), {"p": [(model.layers[0].mlp, 0)]})
        with pytest.raises(ValueError, match="not hooked at"):
            board.select(Recorder(), {"p": [(model.layers[0].attn.o_proj, 0, "before")]})
        with pytest.raises(ValueError, match="not a module of"):
            board.select(Recorder(), {"p": [(torch.nn.Linear(2, 2), 0)]})
        # a layer equal to 0 but no int (attach refuses it too)
        for layer in (False, 0.0, "0"):
            with pytest.raises(TypeError, match=r"arm point 'p': layer must be an int >= 0"):
                board.select(Recorder(), {"p": [(model.layers[0].attn.o_proj, layer)]})
        # refused inside selected(): the board stays off, forking nowhere
        with pytest.raises(ValueError, match="not hooked at"):
            with board.selected(Recorder(), {"p": [(model.layers[0].mlp, 0)]}):
                pass
        assert board.on is False
        board.on = True
        with pytest.raises(ValueError, match="not hooked at"):
            with board.selected(Recorder(), {"p": [(model.layers[0].mlp, 0)]}):
                pass
        assert board.on is True
    finally:
        board.close()


@pytest.mark.parametrize("how", ["eager", "forward-compiled-run", "model-compiled-unrun",
                                 "step-compiled-run"])
def test_step_is_compiled(how):
    model = Model().eval()
    x = torch.randn(BATCH, 1, 16)
    if how == "eager":
        step = lambda batch: model(x)                                       # noqa: E731
    elif how == "forward-compiled-run":
        model.forward = torch.compile(model.forward, backend="eager")
        model(x)
        step = lambda batch: model(x)                                       # noqa: E731
    elif how == "model-compiled-unrun":
        compiled = torch.compile(model, backend="eager")
        step = lambda batch: compiled(x)                                    # noqa: E731
    else:
        fn = torch.compile(lambda: model(x), backend="eager")
        fn()
        step = lambda batch: fn()                                           # noqa: E731
    assert step_is_compiled(model, step, BATCH) == (how != "eager")
    assert all(not m._forward_pre_hooks for m in model.modules())          # hooks removed


class _Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Model()

    def forward(self, x):
        return self.inner(x)


class _WithHead(torch.nn.Module):
    """vLLM's shape: the decoder compiled, the head (compute_logits) run eagerly."""

    def __init__(self):
        super().__init__()
        self.model = _Decoder()
        self.lm_head = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.lm_head(self.model(x))


@pytest.mark.parametrize("how", ["module.compile()", "forward"])
def test_a_warmed_compiled_decoder_beside_an_eager_head_is_found_compiled(how):
    """The warm-up traced the decoder before the detection's hooks existed, so its frames
    run none of them; only the eager head's did."""
    lm = _WithHead().eval()
    if how == "module.compile()":
        lm.model.compile(backend="eager")
    else:
        lm.model.forward = torch.compile(lm.model.forward, backend="eager")
    x = torch.randn(BATCH, 1, 16)
    with torch.no_grad():     # the server's warm-up, in the grad mode the detection runs in
        lm(x)
    assert step_is_compiled(lm, lambda batch: lm(x), BATCH)
    assert all(not m._forward_pre_hooks for m in lm.modules())


def test_an_eager_step_that_leaves_a_module_unused_is_found_eager():
    model = _WithHead().eval()
    x = torch.randn(BATCH, 1, 16)
    assert not step_is_compiled(model, lambda batch: model.model(x), BATCH)   # no lm_head


def test_a_step_that_fails_while_tune_finds_out_how_it_runs_is_a_step_error(monkeypatch):
    from l2prefetch.tuning import StepError, measure, tune

    monkeypatch.setattr(measure, "cuda_device", lambda model, device=None: device)
    model = Model().eval()

    def step(batch):
        raise RuntimeError("boom")

    with pytest.raises(StepError, match=r"step\(1\) failed while finding out whether it "
                                        r"runs the model compiled: RuntimeError: boom"):
        tune(model, step, [1], progress=None)


def test_tune_refuses_a_cpu_model_before_running_its_step():
    """The step runs (and a compiled one compiles: seconds to minutes) only once the
    model is known to be on a CUDA device."""
    from l2prefetch.tuning import tune

    model = Model().eval()
    ran = []
    with pytest.raises(ValueError, match="tuning measures CUDA graphs: the model is on cpu"):
        tune(model, lambda batch: ran.append(batch), [1], progress=None)
    assert ran == []


def test_tune_refuses_to_measure_with_prefetching_switched_off(monkeypatch):
    """Under L2PREFETCH_DISABLE no hook forks: every arm would be the step without forks,
    and minutes of measuring would end in 'nothing paid'."""
    from l2prefetch.tuning import tune

    model = Model().eval()
    ran = []
    monkeypatch.setenv("L2PREFETCH_DISABLE", "1")
    with pytest.raises(ValueError, match="L2PREFETCH_DISABLE is set, so nothing forks: unset "
                                         "it to tune"):
        tune(model, lambda batch: ran.append(batch), [1], progress=None)
    assert ran == []


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune", "maxautotune"])
def test_tune_refuses_an_inductor_mode_that_captures_its_own_graphs_or_none(mode):
    from l2prefetch.tuning import tune

    model = Model().eval()
    with pytest.raises(ValueError, match=rf"compiled='{mode}': the tuner measures steps "
                                         r"compiled in the Inductor modes 'default', "
                                         r"'max-autotune-no-cudagraphs'"):
        tune(model, lambda batch: None, [1], progress=None, compiled=mode)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_a_mode_that_captures_its_own_graphs_is_told_to_compile_in_another(mode):
    from l2prefetch.tuning import tune

    with pytest.raises(ValueError) as caught:
        tune(Model().eval(), lambda batch: None, [1], progress=None, compiled=mode)
    assert f"{mode!r} captures CUDA graphs of its own: compile the step in one of " \
           "those" in str(caught.value)
    assert "pass compiled=True" not in str(caught.value)


# ---- the step record ----

def _profile(step=None):
    data = {"format": "l2prefetch-profile", "version": 1,
            "device": {"name": "X", "sm": 90, "sm_count": 1, "l2_bytes": 1},
            "model": {"layers": 0, "weights": {}}, "batches": [1], "plan": []}
    if step is not None:
        data["step"] = step
    return json.dumps(data)


def test_parse_profile_reads_and_checks_the_step():
    assert "step" not in parse_profile(_profile())          # written before: eager
    good = step_record(True, "max-autotune-no-cudagraphs")
    assert parse_profile(_profile(good))["step"] == good
    assert good["torch"] == torch.__version__
    for bad, match in [({"compiled": "yes", "mode": None, "torch": None}, "step.compiled"),
                       ({"compiled": True, "torch": None}, "step.mode"),
                       ({"compiled": False, "mode": "default", "torch": None},
                        "an eager step has no compile mode"),
                       ({"compiled": True, "mode": 3, "torch": None}, "step.mode"),
                       ({"compiled": True, "mode": "reduce-overhead", "torch": None},
                        "'step.mode' is 'reduce-overhead': the tuner measures steps compiled "
                        "in 'default' or 'max-autotune-no-cudagraphs'"),
                       ({"compiled": True, "mode": None, "torch": None, "x": 1},
                        "unknown fields"),
                       ([], "'step' must be")]:
        with pytest.raises(ValueError, match=match):
            parse_profile(_profile(bad), "p.json")


def test_describe_and_check_step():
    compiled = step_record(True, "default")
    assert describe_step(EAGER_STEP) == "eager"
    assert describe_step(compiled) == f"compiled (torch.compile, mode default, torch {torch.__version__})"
    assert "mode not recorded" in describe_step(step_record(True))
    check_step(None, True)
    check_step(EAGER_STEP, False)
    check_step(compiled, True)
    with pytest.raises(StepMismatchError, match="tuned on an eager step.*--compile"):
        check_step(EAGER_STEP, True)
    with pytest.raises(StepMismatchError, match="tuned on a compiled .* runs eagerly"):
        check_step(compiled, False)
    # given the controller: refused only where its fork would launch
    check_step(compiled, False, Quiet(compiled))
    check_step(EAGER_STEP, True, Quiet(compiled, enabled=False, eager=True))
    with pytest.raises(StepMismatchError, match="runs eagerly"):
        check_step(compiled, False, Quiet(compiled, eager=True))
    with pytest.raises(StepMismatchError, match="runs eagerly"):
        check_step(compiled, False, object())   # no enabled / eager: counts as launching


def test_check_step_reads_the_controllers_device_as_the_fork_takes_it(monkeypatch):
    """A controller with eager=False refuses an eager fork only on a stream being
    captured on its own device; a device that is not a CUDA index names none (torch's
    current device), and an index this host lacks counts as launching, not as a torch
    error (torch.cuda faked: one GPU, capturing on device 0 only)."""
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing",
                        lambda: current[-1:] in ([], [0]))

    class Device:   # torch.cuda.device, recorded
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            current.append(self.index)

        def __exit__(self, *exc):
            current.pop()

    monkeypatch.setattr(torch.cuda, "device", Device)
    compiled = step_record(True, "default")
    for device in (None, 0, "cuda:0", torch.device("cuda", 0), "cpu", "cpu:0"):
        with pytest.raises(StepMismatchError, match="runs eagerly"):
            check_step(compiled, False, Quiet(compiled, device=device))
    with pytest.raises(StepMismatchError, match="runs eagerly"):
        check_step(compiled, False, Quiet(compiled, device="cuda:1"))   # no such GPU
    current.append(1)   # torch's current device 1, capturing nowhere but on 0
    check_step(compiled, False, Quiet(compiled, device="cpu:0"))


def test_an_eager_fork_of_a_controller_tuned_compiled_is_refused():
    model = Model().eval()
    refused = Recorder(tuned_step=step_record(True, "default"))
    with hooks.attach(model, refused, points(model)):
        with pytest.raises(StepMismatchError, match="runs eagerly"):
            model(torch.randn(BATCH, 1, 16))
    assert refused.calls == []
    model2 = Model().eval()
    fine = Recorder(tuned_step=dict(EAGER_STEP))
    with hooks.attach(model2, fine, points(model2)):
        model2(torch.randn(BATCH, 1, 16))
    assert fine.calls == expected_calls(2, BATCH)


@throws_through_torch
def test_a_compiled_fork_of_a_controller_tuned_eagerly_is_refused():
    model = Model().eval()
    refused = Recorder(tuned_step=dict(EAGER_STEP))
    with hooks.attach(model, refused, points(model)):
        step = torch.compile(lambda v: model(v), backend="aot_eager", fullgraph=True)
        with pytest.raises(StepMismatchError, match="tuned on an eager step"):
            step(torch.randn(BATCH, 1, 16))
    assert refused.calls == []
    recompile()
    model2 = Model().eval()
    fine = Recorder(tuned_step=step_record(True, "default"))
    with hooks.attach(model2, fine, points(model2)):
        torch.compile(lambda v: model2(v), backend="aot_eager")(torch.randn(BATCH, 1, 16))
    assert fine.calls == expected_calls(2, BATCH)


class Quiet(Recorder):
    """A controller whose forks do nothing outside a capture (``eager=False``), or
    nothing at all (disabled)."""

    def __init__(self, tuned_step, enabled=True, eager=False, device=None):
        super().__init__(tuned_step)
        self.enabled, self.eager, self.device = enabled, eager, device


def test_a_fork_that_would_not_launch_is_not_refused(monkeypatch):
    """A server whose prefill runs eagerly beside a compiled, captured decode (SGLang,
    ``generate``): a profile's ``eager=False`` controller forks nothing outside a capture,
    so its eager forks there pass; in a capture, or from an ``eager=True`` controller,
    they are refused."""
    compiled = step_record(True, "default")
    for quiet in (Quiet(compiled), Quiet(compiled, enabled=False, eager=True)):
        model = Model().eval()
        with hooks.attach(model, quiet, points(model)):
            model(torch.randn(BATCH, 1, 16))
        assert quiet.calls == expected_calls(2, BATCH)
    launching = Quiet(compiled, eager=True)
    model = Model().eval()
    with hooks.attach(model, launching, points(model)):
        with pytest.raises(StepMismatchError, match="runs eagerly"):
            model(torch.randn(BATCH, 1, 16))
    assert launching.calls == []
    # the same eager=False controller while its stream is being captured: the stream of
    # its own device, which the fork takes
    import contextlib

    current = [0]

    @contextlib.contextmanager
    def device(index):
        old, current[0] = current[0], index
        try:
            yield
        finally:
            current[0] = old
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current[0] == 1)
    capturing = Quiet(compiled)
    capturing.device = 1
    model = Model().eval()
    with hooks.attach(model, capturing, points(model)):
        with pytest.raises(StepMismatchError, match="runs eagerly"):
            model(torch.randn(BATCH, 1, 16))
    assert capturing.calls == []
    elsewhere = Quiet(compiled)     # its device (0) is not capturing: its fork does nothing
    elsewhere.device = 0
    with hooks.attach(model, elsewhere, points(model)):
        model(torch.randn(BATCH, 1, 16))
    assert elsewhere.calls == expected_calls(2, BATCH)
    for spelled in ("cuda:1", torch.device("cuda", 1)):   # a stand-in's device, any spelling
        named = Quiet(compiled)
        named.device = spelled
        with hooks.attach(model, named, points(model)):
            with pytest.raises(StepMismatchError, match="runs eagerly"):
                model(torch.randn(BATCH, 1, 16))


def test_a_disabled_profile_controller_refuses_no_fork(monkeypatch):
    """L2PREFETCH_DISABLE: fork does nothing, through the ops too (a profile's
    controller is made disabled all the same, and keeps its tuned step)."""
    from l2prefetch import PrefetchController

    monkeypatch.setenv("L2PREFETCH_DISABLE", "1")
    for tuned, compiled in ((step_record(True, "default"), False), (dict(EAGER_STEP), True)):
        controller = PrefetchController(eager=False)
        controller.tuned_step = tuned
        handle = ops.register(controller)
        try:
            assert not controller.enabled
            if compiled:
                torch.ops.l2prefetch.fork(handle, "p", 0, BATCH)
            else:
                ops.fork(handle, "p", 0, BATCH)
            ops.join(handle)
        finally:
            ops.unregister(handle)
            controller.close()


def test_a_closed_profile_controller_says_it_is_closed_not_that_the_step_differs(fake):
    """A fork that runs the other way on a closed controller launches nothing: the error
    is the controller's closed one (the hooks': detach them), not StepMismatchError."""
    from l2prefetch import Error, PrefetchController

    controller = PrefetchController()
    controller.tuned_step = step_record(True, "default")
    model = Model().eval()
    with hooks.attach(model, controller, points(model)):
        controller.close()
        with pytest.raises(Error, match="is closed, and its hooks are still on: detach them"):
            model(torch.randn(BATCH, 1, 16))
    handle = ops.register(controller)
    try:
        with pytest.raises(Error, match="closed"):
            ops.fork(handle, "p", 0, BATCH)
    finally:
        ops.unregister(handle)


class _HandWritten(torch.nn.Module):
    """Layer code that forks and joins through l2prefetch.ops itself."""

    def __init__(self, handle):
        super().__init__()
        self.handle = handle
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        ops.fork(self.handle, "p", 0, x.shape[0], after=h)
        out = self.lin(h)
        ops.join(self.handle, after=out)
        return out


def _hand_written_step(tuned_step, compiled, controller=None):
    """The calls a profile's controller (tuned as ``tuned_step``; a Recorder unless
    given) got from _HandWritten run eagerly or compiled; StepMismatchError where it
    refused."""
    controller = Recorder(tuned_step=tuned_step) if controller is None else controller
    handle = ops.register(controller)
    try:
        model = _HandWritten(handle).eval()
        step = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        step(torch.randn(BATCH, 16))
    finally:
        ops.unregister(handle)
    return controller.calls


def test_hand_written_ops_run_eagerly_fork_as_an_eager_step():
    """vLLM's enforce_eager: ops.fork called eagerly is the controller's own call."""
    assert _hand_written_step(dict(EAGER_STEP), compiled=False) == [
        ("fork", "p", 0, BATCH), ("join",)]
    with pytest.raises(StepMismatchError, match="runs eagerly"):
        _hand_written_step(step_record(True, "default"), compiled=False)
    # an eager=False controller outside a capture forks nothing: not refused
    quiet = Quiet(step_record(True, "default"))
    assert _hand_written_step(None, compiled=False, controller=quiet) == [
        ("fork", "p", 0, BATCH), ("join",)]


@throws_through_torch
def test_hand_written_ops_compiled_fork_as_a_compiled_step():
    assert _hand_written_step(step_record(True, "default"), compiled=True) == [
        ("fork", "p", 0, BATCH), ("join",)]
    recompile()
    with pytest.raises(StepMismatchError, match="tuned on an eager step"):
        _hand_written_step(dict(EAGER_STEP), compiled=True)
    recompile()   # a compiled prefill beside an eager, captured decode: not refused
    quiet = Quiet(dict(EAGER_STEP))
    assert _hand_written_step(None, compiled=True, controller=quiet) == [
        ("fork", "p", 0, BATCH), ("join",)]


# ---- screening the sites (Inductor's CPU backend) ----

def test_tune_refuses_a_model_compiled_with_cuda_graphs_of_its_own():
    """reduce-overhead and max-autotune, set by the caller in any way the model holds,
    are refused as when named (compiled=...), before the step runs."""
    from l2prefetch.tuning.compiled import OWN_GRAPH_MODES, own_graphs

    def wrapped(model, mode):
        return torch.compile(model, mode=mode)

    def forward(model, mode):
        model.forward = torch.compile(model.forward, mode=mode)
        return model

    def method(model, mode):
        model.compile(mode=mode)
        return model
    ran = []
    for make, how in ((wrapped, "torch.compile(model)"),
                      (forward, "model.forward = torch.compile"), (method, "model.compile()")):
        assert own_graphs(make(Model(), "max-autotune-no-cudagraphs")) is None
        assert own_graphs(make(Model(), None)) is None
        for mode in OWN_GRAPH_MODES:
            model = make(Model(), mode)
            assert how in own_graphs(model)
            with pytest.raises(ValueError, match=r"^model: compiled with .*triton.cudagraphs.*"
                               r"captures CUDA graphs of its own.* compile it in 'default' or "):
                tuning.tune(model, ran.append, [1], progress=None)
    assert own_graphs(Model()) is None
    assert ran == []
    # the option itself, and what only looks compiled
    option = torch.compile(Model(), options={"triton.cudagraphs": True})
    assert "triton.cudagraphs" in own_graphs(option)
    mocked = Model()
    mocked.forward = unittest.mock.MagicMock()
    assert own_graphs(mocked) is None


def test_discover_reads_a_model_compiled_and_warmed_before_it():
    """A frame compiled before discovery's hooks runs none of them: discover runs the
    step eagerly, so it reads what the eager model reads (the whole model compiled, or
    the decoder compiled beside an eager head, as vLLM runs lm_head)."""
    x = torch.randn(BATCH, 1, 16)
    eager = Model().eval()
    want = [r.path for r in tuning.discover(eager, lambda: eager(x), min_bytes=1)]
    assert len(want) > 2
    whole = Model().eval()
    whole.forward = torch.compile(whole.forward, backend="aot_eager")
    with torch.no_grad():   # as discover runs it: no guard fails, the frame is reused
        whole(x)
    assert [r.path for r in tuning.discover(whole, lambda: whole(x), min_bytes=1)] == want
    parts = Model().eval()
    for block in parts.layers:
        block.forward = torch.compile(block.forward, backend="aot_eager")
    with torch.no_grad():
        parts(x)
    assert [r.path for r in tuning.discover(parts, lambda: parts(x), min_bytes=1)] == want


def test_tune_refuses_a_model_with_hooks_attached():
    """A server's attachment left on: its forks would run in every arm, those measured as
    without forks too."""
    model, first, second = Model().eval(), Recorder(), Recorder()
    assert hooks.attached(model) == []
    ran = []
    with hooks.attach(model, first, points(model)), hooks.attach(model, second, points(model)):
        assert hooks.attached(torch.compile(model)) == [first, second]
        with pytest.raises(ValueError, match=r"^model: l2prefetch hooks are attached to it "
                                             r".* detach them \(Attachment.detach\(\)\)"):
            tuning.tune(model, ran.append, [1], progress=None)
    assert hooks.attached(model) == [] and ran == []


def test_kernel_numbers_are_dropped_in_cpu_and_gpu_code():
    """Inductor's CPU code calls ``cpp_fused_add_3(...)``, its GPU code
    ``triton_poi_fused_add_3.run(...)``: both lose the number, so that one kernel more
    does not change the names of all after it."""
    from l2prefetch.tuning.compiled import calls_in

    cpu = "    cpp_fused_add_3(buf0, arg1)\n    extern_kernels.mm(buf0, arg2, out=buf1)\n"
    gpu = ("        triton_poi_fused_add_3.run(buf0, arg1, 1024, stream=stream0)\n"
           "        torch.ops.l2prefetch.fork.default(1, 'after_o', 0, 1, buf1)\n"
           "        buf3 = torch.ops.l2prefetch.join.default(1, buf2)\n"
           "        triton_red_fused_mean_pow_12.run(buf2, 4096, stream=stream0)\n")
    assert calls_in([cpu]) == ["cpp_fused_add", "extern_kernels.mm"]
    assert calls_in([gpu]) == ["triton_poi_fused_add", "fork after_o",
                               "triton_red_fused_mean_pow"]
    assert calls_in([gpu.replace("_3.run", "_4.run").replace("_12.", "_13.")]) == calls_in([gpu])


def _screened(monkeypatch, model, sites, kind_of, differs):
    """screen_sites over a stand-in of Inductor: the step's kernels are ``k`` x 10, the
    last one ``k2`` where ``differs(kinds hooked)``, the forks first (beside no
    difference); returns (the kinds refused, the sets of kinds compiled)."""
    import l2prefetch.tuning.compiled as C

    hooked = []

    class Board(C.Switchboard):
        def __init__(self, model, sites):
            super().__init__(model, sites)
            hooked.append(self)

        def close(self):
            hooked.remove(self)
            super().close()

    compiled = []

    def kernel_calls(step, batch):
        kinds = {kind_of(s) for b in hooked for s in b.all_sites()}
        compiled.append(kinds)
        forks = [f"fork {p}" for b in hooked for p in b.sites]
        return forks + ["k"] * 9 + ["k2" if differs(kinds) else "k"]

    monkeypatch.setattr(C, "Switchboard", Board)
    monkeypatch.setattr(C, "kernel_calls", kernel_calls)
    return C.screen_sites(model, lambda b: None, BATCH, sites, kind_of), compiled


def test_the_screen_refuses_kinds_that_change_the_kernels_only_together(monkeypatch):
    """The measuring board compiles the kinds offered together: of two that change
    Inductor's kernels only together, beside no difference, one is refused (the other
    alone changes nothing); the kinds that change nothing are offered; and what is
    offered was compiled together once."""
    model = Model().eval()
    names = {}
    for i, layer in enumerate(model.layers):
        names[layer.attn.o_proj], names[layer.mlp], names[layer.attn] = "o", "mlp", "attn"
    sites = [(m, i, "after") for i, layer in enumerate(model.layers)
             for m in (layer.attn.o_proj, layer.mlp, layer.attn)]

    def kind_of(site):
        return names[site[0]]

    bad, compiled = _screened(monkeypatch, model, sites, kind_of,
                              lambda kinds: {"o", "mlp"} <= kinds)
    assert set(bad) == {"o"}
    assert {"attn", "mlp"} in compiled
    # the pair split across the bisect's halves, beside kinds that change nothing
    layer_kind = {**{layer.attn.o_proj: "o" for layer in model.layers},
                  **{layer.mlp: "mlp" for layer in model.layers}}
    sites = [(m, i, "after") for i, layer in enumerate(model.layers)
             for m in (layer.attn.o_proj, layer.mlp)]
    bad, compiled = _screened(monkeypatch, model, sites,
                              lambda s: f"{layer_kind[s[0]]}{s[1]}",
                              lambda kinds: {"mlp0", "o0"} <= kinds)
    assert len(bad) == 1 and set(bad) <= {"mlp0", "o0"}, bad
    assert {"mlp0", "mlp1", "o0", "o1"} - set(bad) in compiled
    # one kind alone at fault: it alone is refused, each set of kinds compiled once
    bad, compiled = _screened(monkeypatch, model, sites, kind_of, lambda kinds: "mlp" in kinds)
    assert set(bad) == {"mlp"}
    assert len(compiled) == len({frozenset(k) for k in compiled})

def test_screen_sites_names_the_kinds_that_change_inductors_kernels():
    """A tiny HF Llama on Inductor's CPU backend: forks before the MLP's norm, before the
    MLP and after k_proj split or move a fusion there (seen on torch 2.13); after q_proj,
    o_proj, gate_proj and the MLP they leave the kernels as they were."""
    import re
    import shutil

    transformers = pytest.importorskip("transformers")
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("Inductor's CPU backend needs a C++ compiler")
    from l2prefetch.tuning.cli import compile_forward
    from l2prefetch.tuning.compiled import kernel_calls, screen_sites
    from l2prefetch.tuning.hf import DecodeStep

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=512)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    step = DecodeStep(model, prompt_len=8, max_cache_len=16)
    step.state(1)
    compile_forward(model, "default")
    paths = {id(m): p for p, m in model.named_modules()}
    sites = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        sites += [(attn.q_proj, i, "after"), (attn.k_proj, i, "after"),
                  (attn.o_proj, i, "after"), (layer.post_attention_layernorm, i, "before"),
                  (mlp, i, "before"), (mlp.gate_proj, i, "after"), (mlp, i, "after")]

    def kind(site):
        return re.sub(r"(?<=\.)\d+(?=\.|$)", "#", paths[id(site[0])]) + ":" + site[2]

    lines = []
    bad = screen_sites(model, step, 1, sites, kind, progress=lines.append)
    assert set(bad) == {"model.layers.#.post_attention_layernorm:before",
                        "model.layers.#.mlp:before", "model.layers.#.self_attn.k_proj:after"}
    assert all("not offered under torch.compile" in why for why in bad.values())
    assert re.fullmatch(r"\d+ compilations; 3 of 7 site kinds change .*", lines[-1])
    # what is left compiles as without forks: the forks sit between the same kernels
    plain = kernel_calls(step, 1)
    board = Switchboard(model, [s for s in sites if kind(s) not in bad])
    board.on = True
    try:
        forked = kernel_calls(step, 1)
    finally:
        board.close()
    assert [c for c in forked if not c.startswith("fork ")] == plain
    assert sum(c.startswith("fork ") for c in forked) == 8


def _roles_of_a_small_llama():
    from _tuning_fakes import llama
    from l2prefetch.tuning.discovery import candidates, discover

    model = llama(2, h=64, i=128, kv=16)
    x = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    return model, x, candidates(model, discover(model, lambda: model(x), min_bytes=1))[:3]


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("bad", [False, True])
def test_the_switchboard_is_back_to_measure_with_after_the_screen(monkeypatch, bad):
    """GraphBackend.screen closes its board to compile boards of its own; measuring then
    needs it back, also where every role is offered (hooks attached to code compiled
    without them never run: a compiled tune measured the plain step in every arm)."""
    import contextlib

    import l2prefetch.tuning.compiled as C
    import l2prefetch.tuning.measure as M
    from l2prefetch.tuning import tuner

    model, x, roles = _roles_of_a_small_llama()

    def screen_sites(model, step, batch, sites, kind_of, progress=None):
        kinds = sorted({kind_of(s) for s in sites})
        return {kinds[0]: "planted"} if bad else {}
    monkeypatch.setattr(C, "screen_sites", screen_sites)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    backend = M.GraphBackend.__new__(M.GraphBackend)
    backend.torch, backend.device, backend.model, backend.compiled = \
        torch, torch.device("cpu"), model, True
    backend.step = lambda batch: model(x)
    try:
        offered, not_offered = tuner._offered_roles(backend, model, backend.step, 1,
                                                    [r.name for r in roles], 1, [16], True,
                                                    None)
        assert offered and bool(not_offered) == bad
        assert backend._board is not None
        hooked = {(id(m), layer, hook) for m, layer, hook in backend._board.all_sites()}
        for role in offered:
            for module, layer, *rest in role.hook_sites(model):
                assert (id(module), layer, rest[0] if rest else "after") in hooked
    finally:
        backend.close()
    assert _hook_count(model) == 0


def test_a_switchboard_interrupted_while_dropping_frames_leaves_no_hook(monkeypatch):
    import l2prefetch.tuning.compiled as C

    model, _, roles = _roles_of_a_small_llama()

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(C, "recompile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        C.board_for_roles(model, roles)
    assert _hook_count(model) == 0


def test_the_screen_refuses_sites_whose_hooks_run_outside_the_compiled_code():
    """A step that compiles only the first layer runs the second's hooks eagerly: a fork
    there would be an eager one, which a profile tuned on the compiled step refuses at
    deploy (StepMismatchError), so the screen does not offer it (any backend)."""
    from l2prefetch.tuning.compiled import EAGER_SITE, screen_sites

    model = Model().eval()
    x = torch.randn(BATCH, 1, 16)
    first = torch.compile(model.layers[0], backend="eager")

    def step(batch):
        return model.layers[1](first(x))

    sites = [(layer.attn.o_proj, i, "after") for i, layer in enumerate(model.layers)] + \
            [(model.layers[1].mlp, 1, "before")]
    lines = []
    bad = screen_sites(model, step, BATCH, sites, lambda s: f"{s[2]}{s[1]}",
                       progress=lines.append)
    assert bad == {"after1": EAGER_SITE, "before1": EAGER_SITE}
    # no Inductor code to read (the eager backend): said all the same
    assert lines == ["1 compilation; 0 of 1 site kinds change Inductor's kernels; 2 run "
                     "their hooks outside the compiled code: after1, before1"]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())



# ---- torch.compile(model): the wrapper's paths are its module's ----

def _saved_profile(tmp_path, model):
    entry = PlanEntry("p", 0, [1], (model.layers[1].attn.o_proj.weight,))
    document = profile_document(
        model, [entry], {"p": [("layers.0.mlp", 0)]}, batches=[1],
        device={"name": "X", "sm": 90, "sm_count": 1, "l2_bytes": 1, "driver_version": 1},
        versions=versions(), step=step_record(True, "default"), tuning={}, results=[])
    path = tmp_path / "p.json"
    save_profile(path, document)
    return path, document


def test_a_profile_loads_for_the_torch_compile_wrapper_of_its_model(tmp_path):
    model = Model().eval()
    path, _ = _saved_profile(tmp_path, model)
    compiled = torch.compile(model, backend="eager")     # an OptimizedModule: _orig_mod.*
    loaded = load_profile(path, compiled, check_device=False)
    loaded.check_model(compiled)
    loaded.check_model(model)
    assert loaded.hook_points(compiled) == {"p": [(model.layers[0].mlp, 0)]}
    assert loaded.plan[0].weights[0] is model.layers[1].attn.o_proj.weight


@pytest.mark.parametrize("step_torch, warned", [
    ("another", True),        # Inductor's kernels can differ under another torch
    ("this", False),
    (None, False),            # not recorded
])
def test_a_compiled_profile_from_another_torch_warns_and_loads(tmp_path, caplog,
                                                               step_torch, warned):
    model = Model().eval()
    path, document = _saved_profile(tmp_path, model)
    document["step"]["torch"] = {"another": "1.0.0+other", "this": torch.__version__,
                                 None: None}[step_torch]
    path.write_text(json.dumps(document))
    with caplog.at_level("WARNING", logger="l2prefetch"):
        loaded = load_profile(path, model, check_device=False)
    said = [r.getMessage() for r in caplog.records if "1.0.0+other" in r.getMessage()]
    assert len(said) == int(warned)
    if warned:
        assert torch.__version__ in said[0] and "tune again" in said[0]
    assert len(loaded.plan) == 1   # the plan applies


def test_an_eager_profile_names_no_torch_to_compare(tmp_path, caplog):
    model = Model().eval()
    path, document = _saved_profile(tmp_path, model)
    document["step"] = {"compiled": False, "mode": None, "torch": "1.0.0+other"}
    path.write_text(json.dumps(document))
    with caplog.at_level("WARNING", logger="l2prefetch"):
        load_profile(path, model, check_device=False)
    assert not [r for r in caplog.records if "1.0.0+other" in r.getMessage()]


def test_a_profile_written_for_the_wrapper_names_the_models_own_paths(tmp_path):
    model = Model().eval()
    _, document = _saved_profile(tmp_path, torch.compile(model, backend="eager"))
    assert document["model"]["class"] == "Model"
    assert list(document["model"]["weights"]) == ["layers.1.attn.o_proj.weight"]


def test_roles_of_the_wrapper_name_its_modules_paths():
    """tune(torch.compile(model), candidates=...) measures the module the wrapper wraps:
    the roles the public builders make of the wrapper resolve there."""
    model = Model().eval()
    compiled = torch.compile(model, backend="eager")
    plan = [PlanEntry("p", 0, [1], (model.layers[1].attn.o_proj.weight,))]
    (role,) = tuning.roles_from_plan(compiled, plan, {"p": [(model.layers[0].mlp, 0)]})
    assert role.hook_sites(model) == [(model.layers[0].mlp, 0)]
    x = torch.randn(BATCH, 1, 16)
    with torch.compiler.set_stance("force_eager"):
        reads = tuning.discover(compiled, lambda: compiled(x), min_bytes=1)
    roles = tuning.candidates(compiled, reads)
    assert roles and not any("_orig_mod" in role.name for role in roles)
    for role in roles:
        assert role.hook_sites(model)
