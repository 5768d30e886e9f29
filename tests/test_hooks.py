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


@pytest.mark.parametrize("layer", [-1, 65536, 70000])
def test_attach_refuses_a_layer_the_controller_cannot_take(layer):
    """The C controller takes layers 0..65535: one outside would fork nothing, silently."""
    model = Tiny(1)
    with pytest.raises(ValueError, match=rf"^points\['p'\]: the site 'layers.0.mlp' \(after\) "
                                         rf"has layer {layer}, outside 0\.\.65535 "):
        attach(model, Recorder(), {"p": [(model.layers[0].mlp, layer)]})
    assert all_hooks(model) == []
    for bad in ("0", True, 1.0):
        with pytest.raises(TypeError, match=r"^points\['p'\]: layer must be an int in "
                                            r"0\.\.65535, got "):
            attach(model, Recorder(), {"p": [(model.layers[0].mlp, bad)]})
    controller = Recorder()
    attach(model, controller, {"p": [(model.layers[0].mlp, 65535)]}, join=False)
    model(torch.zeros(2, H))
    assert controller.calls == [("fork", "p", 65535, 2)]


@pytest.mark.parametrize("answer, error, words", [
    (torch.tensor(2), TypeError, r"a Tensor of shape \(\)"),
    (torch.ones(2, 3), TypeError, r"a Tensor of shape \(2, 3\)"),
    (True, TypeError, r"bool True"),
    ("2", TypeError, r"str '2'"),
    (2.0, TypeError, r"float 2.0"),
    (-1, ValueError, r"-1"),
], ids=["scalar-tensor", "tensor", "bool", "str", "float", "negative"])
def test_a_batch_fn_that_gives_no_batch_is_refused_naming_it_and_the_site(answer, error, words):
    model, controller = Tiny(1), Recorder()
    attach(model, controller, {"p": [(model.layers[0].mlp, 1, "before")]},
           batch_fn=lambda module, args, kwargs: answer)
    with pytest.raises(error, match=rf"^batch_fn returned {words} at point 'p', layer 1: it "
                                    r"must return an int >= 0 \(0 or None: no fork\)"):
        model(torch.zeros(2, H))
    assert controller.calls == []


def test_a_batch_fn_may_give_an_index_or_none():
    """A numpy int forks as the int it is; None, like 0, skips the fork."""
    np = pytest.importorskip("numpy")
    model, controller = Tiny(1), Recorder()
    answers = iter([np.int64(3), None, 0, 5])
    attach(model, controller, {"p": [(model.layers[0].mlp, 1)]},
           batch_fn=lambda module, args, kwargs: next(answers), join=False)
    for _ in range(4):
        model(torch.zeros(2, H))
    assert controller.calls == [("fork", "p", 1, 3), ("fork", "p", 1, 5)]
    assert type(controller.calls[0][3]) is int


@pytest.mark.parametrize("model", [None, "model", nn.Parameter(torch.zeros(1))],
                         ids=["None", "str", "Parameter"])
def test_attached_and_register_site_hook_refuse_what_is_not_a_module(model):
    name = type(model).__name__
    with pytest.raises(TypeError, match=rf"^model must be a torch.nn.Module, got {name}$"):
        hooks.attached(model)
    with pytest.raises(TypeError, match=rf"^module must be a torch.nn.Module, got {name}$"):
        hooks.register_site_hook(model, "after", lambda *args: None)


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
    with pytest.raises(ValueError, match="has layer -1, outside 0..65535"):
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
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
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
    # ahead in the order torch runs them and, before torch 2.13, in dict order alike:
    # Dynamo there builds each hook's guard from its dict.keys() position (pytorch#160083)
    if not hooks._torch_at_least(2, 13):
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
    leaves no hook of ours registered (the re-inserting path of torch before 2.13)."""
    from collections import OrderedDict

    from l2prefetch.hooks import register_site_hook

    monkeypatch.setattr(hooks, "_torch_at_least", lambda major, minor: False)

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


@pytest.mark.parametrize("same", [True, False], ids=["same controller", "another"])
def test_a_deepcopy_of_an_attached_model_says_its_hooks_were_copied(same):
    """copy.deepcopy copies the hooks (functions: the same objects), which fork for the
    original's controller and which no detach removes from the copy: attaching to the
    copy says so, rather than "detach the first attachment", which would not help."""
    import copy
    model, controller = Tiny(1), Recorder()
    first = attach(model, controller, points_of(model))
    twin = copy.deepcopy(model)
    hooks_before = all_hooks(twin)
    with pytest.raises(ValueError, match=r"this Tiny carries hooks copied from another "
                                         r"model, on its root .*copy the model before "
                                         r"attaching, or detach before copying"):
        attach(twin, controller if same else Recorder(), points_of(twin))
    assert all_hooks(twin) == hooks_before
    first.detach()   # the original's own go; the copy's stay, and still refuse
    with pytest.raises(ValueError, match="copied from another model"):
        attach(twin, Recorder(), points_of(twin))
    clean = copy.deepcopy(model)   # copied after the detach: nothing to refuse
    attach(clean, controller, points_of(clean))
    clean(torch.zeros(2, 1, H))
    assert controller.calls[-1] == ("join",)


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


# ------------------------------------------------------------------ a hostile review's

class Positions(nn.Module):
    """A vLLM-style layer: forward(positions, hidden_states), positions first."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(H, H)

    def forward(self, positions, hidden_states):
        return self.mlp(hidden_states)


@pytest.mark.parametrize("positions, hidden, batch", [
    (torch.arange(5), torch.zeros(5, H), 5),                  # [T] positions, [T, H]
    (torch.zeros(3, 5, dtype=torch.long), torch.zeros(5, H), 5),   # M-RoPE: [3, T] first
    (torch.zeros(3, 5, dtype=torch.long), torch.zeros(5, 1, H), 5),
])
def test_the_batch_and_a_before_forks_tensor_are_the_hidden_states(positions, hidden, batch):
    """Positions passed first: the batch was read from them (M-RoPE's [3, T] gave 3), and
    a before-site's compiled fork followed them, so Inductor hoisted every such fork to
    the start of the graph.  Both now come from the hidden states."""
    from l2prefetch.hooks import _fork_hook

    calls = []
    hook = _fork_hook(Recorder(), "p", 0, None, torch.Tensor, lambda: True,
                      lambda *a: calls.append(a), 7, before=True)
    module = Positions()
    hook(module, (positions, hidden), {})
    assert len(calls) == 1 and calls[0][:4] == (7, "p", 0, batch)
    assert calls[0][4] is hidden
    calls.clear()
    hook(module, (), {"positions": positions, "hidden_states": hidden})
    assert calls[0][3] == batch and calls[0][4] is hidden


def test_token_ids_alone_give_their_count_as_the_batch():
    """vLLM's embed_tokens(input_ids) takes [T] ids: the batch is T (it read 1)."""
    from l2prefetch.hooks import default_batch

    assert default_batch(None, (torch.arange(6),), {}) == 6
    assert default_batch(None, (torch.zeros(4, 1, dtype=torch.long),), {}) == 4  # HF: [B, S]
    assert default_batch(None, (torch.zeros(H),), {}) == 1                      # one vector
    assert default_batch(None, (torch.tensor(2.0),), {}) == 1
    assert default_batch(None, (3,), {}) == 0


class Closed(Recorder):
    """A closed controller: what a PrefetchController's fork and join raise then."""

    closed = True

    def fork(self, point, layer, batch):
        raise l2prefetch.Error("this PrefetchController is closed: make a new one")

    def join(self):
        raise l2prefetch.Error("this PrefetchController is closed: make a new one")


def test_a_closed_controllers_hooks_say_to_detach_them():
    model = Tiny(1)
    attachment = attach(model, Closed(), {"p": [(model.layers[0].mlp, 0)]})
    with pytest.raises(l2prefetch.Error, match=r"^the Closed that hooks.attach hooked into this "
                                               r"model is closed, and its hooks are still on: "
                                               r"detach them \(Attachment.detach\(\)\)"):
        model(torch.zeros(2, H))
    attachment.detach()
    assert torch.equal(model(torch.ones(2, H)), model(torch.ones(2, H)))
    model, controller = Tiny(1), Closed()
    controller.closed = False          # another failure than a closed controller: as raised
    attach(model, controller, {"p": [(model.layers[0].mlp, 0)]})
    with pytest.raises(l2prefetch.Error, match=r"^this PrefetchController is closed: make"):
        model(torch.zeros(2, H))


def test_attach_refuses_a_bad_batch_fn_a_repeated_site_and_a_module_of_another_model():
    model, other = Tiny(1), Tiny(1)
    with pytest.raises(TypeError, match=r"^batch_fn must be None \(the default batch\) or a "
                                        r"callable batch_fn\(module, args, kwargs\) -> batch, "
                                        r"got int"):
        attach(model, Recorder(), {"p": [(model.layers[0].mlp, 0)]}, batch_fn=3)
    with pytest.raises(ValueError, match=r"^points\['p'\] gives 'layers.0.mlp' \(after\) twice, "
                                         r"which would fork twice a step: give each site once"):
        attach(model, Recorder(), {"p": [(model.layers[0].mlp, 0), (model.layers[0].mlp, 1)]})
    with pytest.raises(ValueError, match=r"^points\['p'\]: the Linear at layer 0 is not a "
                                         r"module of this Tiny: give sites inside the model"):
        attach(model, Recorder(), {"p": [(other.layers[0].mlp, 0)]})
    assert all_hooks(model) == [] and all_hooks(other) == []
    # one module after and before, or at two points: each its own site
    controller = Recorder()
    attach(model, controller, {"p": [(model.layers[0].mlp, 0), (model.layers[0].mlp, 0,
                                                                "before")],
                               "q": [(model.layers[0].mlp, 0)]}, join=False)
    model(torch.zeros(2, H))
    assert sorted(controller.calls) == [("fork", "p", 0, 2)] * 2 + [("fork", "q", 0, 2)]


@pytest.mark.skipif(not hooks._torch_at_least(2, 13), reason="torch before 2.13 re-inserts the "
                    "module's other hooks (pytorch#160083), each missing for an instant")
def test_attach_never_takes_a_servers_hook_out_of_the_dict():
    """A forward on another thread saw a module's own hook (an all-reduce's, say) missing
    while attach re-inserted it: 16 of 115 calls skipped it.  Now it is never removed."""
    from collections import OrderedDict

    class Watched(OrderedDict):
        removed = []

        def __delitem__(self, key):
            self.removed.append(key)
            super().__delitem__(key)

        def pop(self, key, *default):
            self.removed.append(key)
            return super().pop(key, *default)

    model, controller = Tiny(1), Recorder()
    mlp = model.layers[0].mlp
    mlp._forward_hooks = Watched()
    mlp._forward_pre_hooks = Watched()
    own = mlp.register_forward_hook(lambda m, a, o: controller.calls.append("all-reduce"))
    pre = mlp.register_forward_pre_hook(lambda m, a: controller.calls.append("pre"))
    attach(model, controller, {"p": [(mlp, 0)], "q": [(mlp, 0, "before")]}, join=False)
    assert Watched.removed == []
    model(torch.zeros(2, H))
    assert controller.calls == [("fork", "q", 0, 2), "pre", ("fork", "p", 0, 2), "all-reduce"]
    assert list(mlp._forward_hooks)[-1] == own.id and list(mlp._forward_pre_hooks)[-1] == pre.id


def test_reloading_the_ops_module_hands_out_no_handle_twice():
    """importlib.reload(l2prefetch.ops) started the handles at 1 again: a second
    controller got the first's handle, and compiled code forked into it.  In a process
    of its own: a reload replaces the module's functions for every later test."""
    import subprocess
    import sys

    script = (
        "import importlib, sys\n"
        "from l2prefetch import ops\n"
        "class C:\n"
        "    def fork(self, point, layer, batch): return False\n"
        "    def join(self): pass\n"
        "first, second = C(), C()\n"
        "handle = ops.register(first)\n"
        "importlib.reload(ops)\n"
        "again = ops.register(second)\n"
        "assert again != handle, (handle, again)\n"
        "assert ops.lookup(handle) is first and ops.lookup(again) is second\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr


def test_a_detached_attachment_keeps_no_module_alive():
    import gc
    import weakref

    model = Tiny(1)
    attachment = attach(model, Recorder(), {"p": [(model.layers[0].mlp, 0)]})
    assert [p for p, _, _ in attachment.sites] == ["p"]
    weight = weakref.ref(model.layers[0].mlp.weight)
    attachment.detach()
    del model
    gc.collect()
    assert weight() is None and attachment.sites == ()
    assert repr(attachment) == "<Attachment detached, 0 fork sites>"


def test_a_detach_interrupted_mid_way_can_be_done_again():
    model = Tiny(2)
    attachment = attach(model, Recorder(), points_of(model))
    handles = attachment._handles
    real = type(handles[1]).remove
    calls = []

    def remove(handle):
        calls.append(handle)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(handle)
    type(handles[1]).remove = remove
    try:
        with pytest.raises(KeyboardInterrupt):
            attachment.detach()
    finally:
        type(handles[1]).remove = real
    assert attachment.attached and all_hooks(model)
    attachment.detach()
    assert not attachment.attached and all_hooks(model) == []
