"""Forward-hook integration: forks with the right point, layer and batch; join; detach."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import l2prefetch
from l2prefetch import hooks
from l2prefetch.hooks import Attachment, attach

H = 8


class Recorder:
    """A controller stand-in that records calls; fork answers from ``planned``."""

    def __init__(self, planned=None):
        self.calls = []
        self.planned = planned

    def fork(self, point, layer, batch):
        self.calls.append(("fork", point, layer, batch))
        return self.planned is None or (point, layer, batch) in self.planned

    def join(self):
        self.calls.append(("join",))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Module()
        self.attn.o_proj = nn.Linear(H, H)
        self.mlp = nn.Linear(H, H)

    def forward(self, x):
        x = x + self.attn.o_proj(x)
        return x + self.mlp(x)


class Tiny(nn.Module):
    def __init__(self, count=3):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(count))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Keyword(nn.Module):
    """Calls its inner linear with the input as a keyword."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(H, H)

    def forward(self, x):
        return self.inner(input=x)


def points_of(model):
    return {
        "oproj_down": [(layer.attn.o_proj, i) for i, layer in enumerate(model.layers)],
        "next_attention": [(layer.mlp, i) for i, layer in enumerate(model.layers)][:-1],
    }


def all_hooks(model):
    found = []
    for name, module in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                     "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
            found += [(name, attr, key) for key in getattr(module, attr, {})]
    return found


@pytest.fixture(autouse=True)
def enabled(monkeypatch):
    monkeypatch.delenv("L2PREFETCH_DISABLE", raising=False)


@pytest.mark.parametrize("shape, batch", [((5, 1, H), 5), ((3, H), 3), ((2, 2, H), 4)])
def test_forks_in_order_then_join(shape, batch):
    model, controller = Tiny(), Recorder()
    attach(model, controller, points_of(model))
    model(torch.randn(*shape))
    assert controller.calls == [
        ("fork", "oproj_down", 0, batch), ("fork", "next_attention", 0, batch),
        ("fork", "oproj_down", 1, batch), ("fork", "next_attention", 1, batch),
        ("fork", "oproj_down", 2, batch), ("join",)]


def test_hooks_leave_outputs_alone():
    model, x = Tiny(), torch.randn(4, 1, H)
    expected = model(x)
    with attach(model, Recorder(), points_of(model)):
        assert torch.equal(model(x), expected)


def test_fork_answer_does_not_matter_to_the_model():
    model, x = Tiny(), torch.randn(4, 1, H)
    expected = model(x)
    controller = Recorder(planned=set())  # fork returns False everywhere
    attach(model, controller, points_of(model))
    assert torch.equal(model(x), expected)
    assert len(controller.calls) == 6


def test_batch_from_keyword_input_and_none_without_tensors():
    class Untensored(nn.Module):
        def forward(self, n):
            return n

    model, controller = Keyword(), Recorder()
    linear_calls = []
    model.inner.forward = lambda input: linear_calls.append(input.shape) or input
    attach(model, controller, {"p": [(model.inner, 7)]}, join=False)
    model(torch.zeros(6, 1, H))
    assert controller.calls == [("fork", "p", 7, 6)] and linear_calls

    model, controller = Untensored(), Recorder()
    attach(model, controller, {"p": [(model, 0)]})
    model(3)
    assert controller.calls == [("join",)]


def test_batch_fn_overrides_and_zero_skips():
    model, controller = Tiny(1), Recorder()
    seen = []

    def batch_fn(module, args, kwargs):
        seen.append((module, args[0].shape, kwargs))
        return 0 if module is model.layers[0].mlp else 11

    attach(model, controller, {"a": [(model.layers[0].attn.o_proj, 0)],
                               "b": [(model.layers[0].mlp, 0)]}, batch_fn=batch_fn)
    model(torch.zeros(2, 1, H))
    assert controller.calls == [("fork", "a", 0, 11), ("join",)]
    assert seen[0][0] is model.layers[0].attn.o_proj and seen[0][1] == (2, 1, H)


def test_callable_points_get_the_model():
    model, controller = Tiny(2), Recorder()
    got = []

    def sites(m):
        got.append(m)
        return [(m.layers[1].mlp, 1)]

    attach(model, controller, {"next_attention": sites})
    model(torch.zeros(1, 1, H))
    assert got == [model]
    assert controller.calls == [("fork", "next_attention", 1, 1), ("join",)]


def test_detach_removes_every_hook_and_is_idempotent():
    model, controller = Tiny(), Recorder()
    before = all_hooks(model)
    attachment = attach(model, controller, points_of(model))
    assert attachment.attached and len(attachment.sites) == 5
    assert len(all_hooks(model)) > len(before)
    attachment.detach()
    assert all_hooks(model) == before == []
    attachment.detach()
    assert not attachment.attached
    model(torch.zeros(1, 1, H))
    assert controller.calls == []


def test_detach_keeps_foreign_hooks():
    model = Tiny(1)
    foreign = model.layers[0].mlp.register_forward_hook(lambda *a: None)
    attach(model, Recorder(), points_of(model)).detach()
    assert len(model.layers[0].mlp._forward_hooks) == 1
    foreign.remove()


def test_context_manager_detaches():
    model, controller = Tiny(), Recorder()
    with attach(model, controller, points_of(model)) as attachment:
        assert isinstance(attachment, Attachment)
        model(torch.zeros(1, 1, H))
    assert all_hooks(model) == []
    assert controller.calls[-1] == ("join",)


def test_manual_join_and_join_false():
    model, controller = Tiny(1), Recorder()
    attachment = attach(model, controller, points_of(model), join=False)
    model(torch.zeros(2, 1, H))
    assert controller.calls == [("fork", "oproj_down", 0, 2)]
    attachment.join()
    assert controller.calls[-1] == ("join",)
    attachment.detach()
    attachment.join()  # still reaches the controller: forks may be pending
    assert controller.calls[-1] == ("join",) and len(controller.calls) == 3


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", " Yes "])
def test_disabled_by_environment(monkeypatch, caplog, value):
    monkeypatch.setenv("L2PREFETCH_DISABLE", value)
    monkeypatch.setattr(hooks, "_disabled_logged", False)
    model, controller = Tiny(), Recorder()
    with caplog.at_level(logging.INFO, logger="l2prefetch"):
        first = attach(model, controller, points_of(model))
        second = attach(model, controller, points_of(model))
    assert all_hooks(model) == []
    assert not first.attached and not second.attached and first.sites == ()
    messages = [r.getMessage() for r in caplog.records if r.name == "l2prefetch.hooks"]
    assert len(messages) == 1 and "L2PREFETCH_DISABLE" in messages[0]
    model(torch.zeros(1, 1, H))
    first.join()
    first.detach()
    assert controller.calls == []


def test_attach_logs_a_summary_at_info(caplog):
    model, controller = Tiny(3), Recorder()
    with caplog.at_level(logging.INFO, logger="l2prefetch"):
        attachment = attach(model, controller, points_of(model))
        attach(model, Recorder(), {"next_attention": [(model.layers[0].mlp, 0)]}, join=False)
    records = [r for r in caplog.records if r.name == "l2prefetch.hooks"]
    assert [r.levelno for r in records] == [logging.INFO, logging.INFO]
    assert records[0].getMessage() == (
        f"attach: 5 fork hooks on Tiny (oproj_down: 3 sites, next_attention: 2 sites); "
        f"a join hook on the root Tiny; ops handle {attachment.op_handle}")
    assert records[1].getMessage().startswith(
        "attach: 1 fork hook on Tiny (next_attention: 1 site); no join hook; ops handle ")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="l2prefetch"):
        attach(model, Recorder(), points_of(model))
    assert caplog.records == []


@pytest.mark.parametrize("value", ["", "0", "false", "no", "off", " OFF "])
def test_not_disabled_by_false_values(monkeypatch, caplog, value):
    monkeypatch.setenv("L2PREFETCH_DISABLE", value)
    model = Tiny(1)
    with caplog.at_level(logging.WARNING, logger="l2prefetch"):
        assert attach(model, Recorder(), points_of(model)).attached
    assert caplog.records == []


@pytest.mark.parametrize("value", ["2", "y", "disable"])
def test_a_value_the_switch_does_not_know_leaves_prefetching_on_and_says_so(monkeypatch, caplog,
                                                                            value):
    from l2prefetch import disable

    monkeypatch.setenv("L2PREFETCH_DISABLE", value)
    monkeypatch.setattr(disable, "_warned_values", set())
    model = Tiny(1)
    with caplog.at_level(logging.WARNING, logger="l2prefetch"):
        assert attach(model, Recorder(), points_of(model)).attached
        assert not l2prefetch.disabled()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [f"L2PREFETCH_DISABLE={value!r} is not a word it knows, so prefetching "
                      "stays on: set it to 1 (true, yes, on) to turn prefetching off, or 0 "
                      "(false, no, off) to say it is on"]   # once per value


def test_bad_arguments_attach_nothing():
    model = Tiny(2)
    with pytest.raises(TypeError, match="no join"):
        attach(model, type("C", (), {"fork": lambda *a: True})(), points_of(model))
    with pytest.raises(TypeError, match="nn.Module"):
        attach(model, Recorder(), {"p": [(model.layers[0], 0), ("layers.1", 1)]})
    with pytest.raises(TypeError, match="layer must be an int"):
        attach(model, Recorder(), {"p": [(model.layers[0], 0), (model.layers[1], -1)]})
    with pytest.raises(TypeError, match=r"\(module, layer\) or \(module, layer, hook\)"):
        attach(model, Recorder(), {"p": [model.layers[0]]})
    with pytest.raises(ValueError, match="hook must be 'after' or 'before', got 'during'"):
        attach(model, Recorder(), {"p": [(model.layers[0], 0, "before"),
                                         (model.layers[1], 1, "during")]})
    with pytest.raises(TypeError, match="non-empty str"):
        attach(model, Recorder(), {"": []})
    with pytest.raises(TypeError, match="must be a list"):
        attach(model, Recorder(), {"p": 5})
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        attach(object(), Recorder(), {})
    assert all_hooks(model) == []


def test_points_may_be_a_callable_returning_the_mapping():
    model, controller = Tiny(2), Recorder()
    attach(model, controller, points_of)
    model(torch.zeros(3, H))
    assert controller.calls[:2] == [("fork", "oproj_down", 0, 3), ("fork", "next_attention", 0, 3)]
    with pytest.raises(TypeError, match="points must map"):
        attach(model, controller, lambda m: [(m.layers[0], 0)])


def test_a_site_forks_ahead_of_the_module_s_other_hooks():
    """A before-site forks ahead of the module's other pre-hooks, an after-site right
    after the module's own forward, ahead of its other forward hooks (where a server
    may queue the window: a tensor-parallel all-reduce, a planted spin)."""
    model, controller = Tiny(2), Recorder()
    # hooks the server registered first
    model.layers[1].mlp.register_forward_pre_hook(lambda m, a: controller.calls.append("pre"))
    model.layers[1].mlp.register_forward_hook(lambda m, a, o: controller.calls.append("mlp"))
    model.layers[1].attn.o_proj.register_forward_hook(
        lambda m, a, o: controller.calls.append("o_proj"))
    attachment = attach(model, controller, {
        "before": [(layer.mlp, i, "before") for i, layer in enumerate(model.layers)],
        "after": [(model.layers[1].attn.o_proj, 1, "after")]})
    model(torch.zeros(5, 1, H))
    assert controller.calls == [("fork", "before", 0, 5), ("fork", "after", 1, 5), "o_proj",
                                ("fork", "before", 1, 5), "pre", "mlp", ("join",)]
    assert [(p, l) for p, l, _ in attachment.sites] == [("before", 0), ("before", 1),
                                                        ("after", 1)]
    # ahead in the order torch runs them and in dict order alike: Dynamo (torch 2.11)
    # builds each hook's guard from its dict.keys() position (pytorch#160083)
    for module in (model.layers[1].mlp, model.layers[1].attn.o_proj):
        for registered in (module._forward_pre_hooks, module._forward_hooks):
            assert list(dict.keys(registered)) == list(registered.keys())
    attachment.detach()
    assert not model.layers[1].mlp._forward_pre_hooks_with_kwargs
    assert len(model.layers[1].mlp._forward_pre_hooks) == 1       # the server's own stays
    assert len(model.layers[1].attn.o_proj._forward_hooks) == 1
    controller.calls.clear()
    model(torch.zeros(5, 1, H))
    assert controller.calls == ["o_proj", "pre", "mlp"]


def test_a_before_site_reads_the_batch_from_the_input_and_its_keywords():
    model, controller = Keyword(), Recorder()
    attach(model, controller, {"p": [(model.inner, 2, "before")]}, join=False)
    model(torch.zeros(6, 1, H))
    assert controller.calls == [("fork", "p", 2, 6)]
    model, controller = Tiny(1), Recorder()
    attach(model, controller, {"p": [(model.layers[0].mlp, 0, "before")]}, join=False,
           batch_fn=lambda m, a, k: 0 if m is model.layers[0].mlp else 9)
    model(torch.zeros(4, H))
    assert controller.calls == []                       # batch 0 skips, before as after


def test_register_site_hook_checks_where():
    from l2prefetch.hooks import register_site_hook

    module, calls = torch.nn.Identity(), []
    register_site_hook(module, "after", lambda m, a, o: calls.append("first"))
    handle = register_site_hook(module, "after", lambda m, a, o: calls.append("ahead"))
    module(torch.zeros(1))
    assert calls == ["ahead", "first"]
    handle.remove()
    for where in ("middle", None, 1):
        with pytest.raises(ValueError, match="where must be 'after' or 'before', got"):
            register_site_hook(module, where, lambda *a: None)


def test_a_site_hook_interrupted_while_going_ahead_leaves_every_other_hook_in_order(
        monkeypatch):
    """Going ahead re-inserts the module's other hooks; a KeyboardInterrupt mid-way
    (here at the second removal) loses none of them, keeps their running order, and
    leaves no hook of ours registered."""
    from collections import OrderedDict

    from l2prefetch.hooks import register_site_hook

    class Interrupting(OrderedDict):
        deletes = 0

        def __delitem__(self, key):
            Interrupting.deletes += 1
            if Interrupting.deletes == 2:
                raise KeyboardInterrupt
            super().__delitem__(key)

    module, calls = torch.nn.Identity(), []
    for name in ("one", "two", "three"):
        module.register_forward_hook(lambda m, a, o, name=name: calls.append(name))
    module._forward_hooks = Interrupting(module._forward_hooks)
    with pytest.raises(KeyboardInterrupt):
        register_site_hook(module, "after", lambda m, a, o: calls.append("ours"))
    module(torch.zeros(1))
    assert calls == ["one", "two", "three"]
    assert list(dict.keys(module._forward_hooks)) == list(module._forward_hooks)


def test_sites_on_one_module_fork_in_the_order_given():
    model, controller = Tiny(1), Recorder()
    mlp = model.layers[0].mlp
    attach(model, controller, {"p": [(mlp, 0, "before")], "q": [(mlp, 0, "before")],
                               "r": [(mlp, 0)], "s": [(mlp, 0)]}, join=False)
    model(torch.zeros(2, H))
    assert [c[1] for c in controller.calls] == ["p", "q", "r", "s"]


def test_one_controller_attaches_to_one_model_once():
    """Issue 38.7: a second attach of the same controller to the same model (the first not
    detached, kept or not) would fork twice a step and join twice; it is refused before
    any hook is added, and the steps fork once."""
    model, controller = Tiny(1), Recorder()
    first = attach(model, controller, points_of(model))
    hooks_before = all_hooks(model)
    for again in (lambda: attach(model, controller, points_of(model)),
                  lambda: attach(model, controller, points_of(model), join=False),
                  lambda: attach(model, controller, {"other": [(model.layers[0].mlp, 0)]}),
                  lambda: attach(model.layers[0], controller,          # a submodule of it
                                 {"oproj_down": [(model.layers[0].attn.o_proj, 0)]})):
        with pytest.raises(ValueError, match="this Recorder is already attached to this "
                           r".* and would fork twice a step: detach the first attachment"):
            again()
        assert all_hooks(model) == hooks_before
    model(torch.zeros(2, 1, H))
    assert controller.calls == [("fork", "oproj_down", 0, 2), ("join",)]
    # detached, it attaches again; a dropped attachment that was never detached still counts
    first.detach()
    attach(model, controller, points_of(model))
    with pytest.raises(ValueError, match="already attached"):
        attach(model, controller, points_of(model))


def test_other_controllers_and_other_models_attach_as_before():
    model, first, second = Tiny(1), Recorder(), Recorder()
    attach(model, first, points_of(model))
    attach(model, second, points_of(model))          # another controller on the same model
    other = Tiny(1)
    attach(other, first, points_of(other))           # the same controller on another model
    model(torch.zeros(1, 1, H))
    assert first.calls == second.calls == [("fork", "oproj_down", 0, 1), ("join",)]


def test_a_refused_attach_registers_nothing_with_the_ops(monkeypatch):
    from l2prefetch import ops

    model, controller = Tiny(1), Recorder()
    attach(model, controller, points_of(model))
    registered = []
    monkeypatch.setattr(ops, "register", lambda c: registered.append(c) or 1)
    with pytest.raises(ValueError, match="already attached"):
        attach(model, controller, points_of(model))
    assert registered == []
