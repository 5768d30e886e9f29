"""tune() end to end against planted effects, profiles and their refusal (CPU)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import math
import os
import random
import sys
import re
import tempfile

import pytest
import torch

from l2prefetch import PlanEntry, hooks, tuning
from l2prefetch import profile as P
from l2prefetch.tuning.arms import Backend
from l2prefetch.tuning.discovery import find_roles
from l2prefetch.tuning.search import NOT_PREPARED, NOTHING_MEASURED

import _tuning_fakes as fakes
import l2prefetch
from _tuning_fakes import FAKE_DEVICE, DeviceBackend, PerLayer
from conftest import CXX_THROW_ABORTS

MIB = 1 << 20
O_PROJ = "after self_attn.v_proj: self_attn.o_proj"
GATE = "after self_attn.o_proj: mlp.gate_proj"
NEXT = "after mlp: next self_attn.q_proj"


def model_and_step():
    model = fakes.llama(n_layers=3, h=1024, i=2048, kv=256)
    xs = {}

    def step(batch):
        x = xs.setdefault(batch, torch.zeros(batch, 1, 1024, dtype=torch.bfloat16))
        return model(x)
    return model, step


def tuned(gains=None, batches=(1, 8), **kw):
    model, step = model_and_step()
    # o_proj's loads pay only as leaf forks: the sweep must try every mode to find them
    gains = gains if gains is not None else {
        O_PROJ: lambda s: (9.0 - 3.0 * (s.grid != 32) - 3.0 * abs(s.byte_cap / 2**20 - 4) / 4
                           if s.graph_fork == "leaf" else -2.0),
        GATE: lambda s: -4.0}
    backend = DeviceBackend(gains, seed=11)
    result = tuning.tune(model, step, list(batches), backend=backend, progress=None,
                         min_bytes=256 * 1024, **kw)
    return model, result


def test_tune_keeps_the_paying_role_for_every_batch_and_merges_the_plan():
    model, result = tuned()
    assert not result.empty
    assert {e.point for e in result.plan} == {O_PROJ}
    layers = sorted(e.layer for e in result.plan)
    assert layers == [0, 1, 2]
    assert all(e.batches == (1, 8) for e in result.plan)
    assert all(e.graph_fork == "leaf" for e in result.plan)
    # an eager step's loads end by reading their site's activation
    assert all(e.warm_activation is True for e in result.plan)
    assert "(warm_activation)" in result.markdown()
    assert result.sites[O_PROJ] == [(f"model.layers.{l}.self_attn.v_proj", l) for l in range(3)]
    assert "batch 1:" in result.summary() and "x (" in result.summary()
    md = result.markdown()
    assert "## Verdict" in md and O_PROJ in md and "kept" in md
    assert "lost in the sweep" in md


def test_a_backend_whose_arms_read_no_activation_gets_a_plan_that_reads_none():
    """The plan marks warm_activation only where the arms measured it: a backend that
    does not read the site's activation (the default) gets entries that do not either."""
    class Cold(DeviceBackend):
        warm_activation = False

    model, step = model_and_step()
    result = tuning.tune(model, step, [1], backend=Cold({O_PROJ: lambda s: 9.0}, seed=11),
                         progress=None, min_bytes=256 * 1024)
    assert result.plan and not any(e.warm_activation for e in result.plan)
    assert Backend.warm_activation is False


def test_the_report_says_what_keeping_the_fastest_capture_would_save(tmp_path):
    """Instances 30 us apart (SD) in a 2 ms step: the summary and the report recommend
    best-of-k captures with the expected saving; the profile records the spread."""
    model, step = model_and_step()
    backend = DeviceBackend({O_PROJ: lambda s: -1.0}, seed=4, instance_sd_us=30.0)
    result = tuning.tune(model, step, [1], backend=backend, progress=None,
                         min_bytes=256 * 1024, budget_s=120)
    (rep,) = result.batches
    k = rep.spread.recommended_k()
    assert k > 1 and rep.spread.instances >= 10
    assert f"keeping the fastest of {k}" in result.summary()
    md = result.markdown()
    assert "Instance spread of the step without forks" in md and f"k={k})" in md
    path = tmp_path / "p.json"
    result.save(path, model)
    saved = json.loads(path.read_text())["results"][0]["spread"]
    assert saved["recommended_k"] == k and saved["instances"] == rep.spread.instances
    # what a server reads back: the k to give graphs.capture_fastest at that batch
    assert tuning.load_profile(path, model, check_device=False).capture_k == {1: k}


def test_an_empty_plan_is_a_result():
    model, result = tuned({O_PROJ: lambda s: -1.0})
    assert result.empty and result.plan == []
    assert all(r.confirmed is None for r in result.batches)
    assert "empty plan" in result.summary()


def test_profile_round_trip(tmp_path, monkeypatch):
    model, result = tuned()
    path = tmp_path / "profile.json"
    result.save(path, model)
    data = json.loads(path.read_text())
    assert data["format"] == P.PROFILE_FORMAT and data["version"] == P.PROFILE_VERSION
    assert data["device"] == FAKE_DEVICE
    assert data["model"]["layers"] == 3 and data["model"]["class"] == "CausalLM"
    assert data["batches"] == [1, 8]
    weights = data["model"]["weights"]
    assert weights["model.layers.0.self_attn.o_proj.weight"] == [[1024, 1024], "bfloat16"]
    assert {tuple(e["batches"]) for e in data["plan"]} == {(1, 8)}
    assert all(e["warm_activation"] is True for e in data["plan"])
    assert data["results"][0]["roles"] and data["results"][0]["confirmed"]["gain"]["low"] > 0
    # the arms keep their letters in the profile: (a) no forks, (b) loads, (d) empty forks
    trial = data["results"][0]["roles"][0]["trials"][0]
    assert {"a", "b", "d", "gain", "vs_empty"} <= set(trial)
    assert {"a", "plan", "gain"} <= set(data["results"][0]["confirmed"])

    monkeypatch.setattr(P, "device_fingerprint", lambda device=None: dict(FAKE_DEVICE))
    profile = tuning.load_profile(path, model)
    assert len(profile.plan) == len(result.plan)
    for a, b in zip(profile.plan, result.plan):
        assert a == b  # same point, layer, batches, weights (identity) and settings
        assert a.warm_activation is True
    points = profile.hook_points(model)
    assert points[O_PROJ][1] == (model.model.layers[1].self_attn.v_proj, 1)
    # inspecting without the GPU
    assert tuning.load_profile(path, model, check_device=False).batches == [1, 8]


BEFORE = "before post_attention_layernorm: mlp.gate_proj"


def test_a_before_role_goes_from_tune_to_the_profile_to_pre_hooks(tmp_path, monkeypatch):
    """A role whose forks are hooked before their module (issue 24) is kept like any other;
    its sites say so in the result, the profile ("hook": "before") and the hook points,
    and attach() hooks them ahead of the module's other pre-hooks."""
    model, result = tuned({BEFORE: lambda s: 9.0 if s.graph_fork == "inline" else -2.0,
                           O_PROJ: lambda s: -3.0, GATE: lambda s: -3.0}, batches=(1,))
    assert {e.point for e in result.plan} == {BEFORE}
    norms = [f"model.layers.{l}.post_attention_layernorm" for l in range(3)]
    assert result.sites[BEFORE] == [(path, l, "before") for l, path in enumerate(norms)]
    path = tmp_path / "profile.json"
    result.save(path, model)
    data = json.loads(path.read_text())
    assert {(e["site"], e["hook"]) for e in data["plan"]} == {(n, "before") for n in norms}
    monkeypatch.setattr(P, "device_fingerprint", lambda device=None: dict(FAKE_DEVICE))
    profile = tuning.load_profile(path, model)
    points = profile.hook_points(model)
    assert points[BEFORE] == [(layer.post_attention_layernorm, l, "before")
                              for l, layer in enumerate(model.model.layers)]
    calls = []
    recorder = type("R", (), {"fork": lambda self, *a: calls.append(a), "join": lambda self: 0})
    norm = model.model.layers[0].post_attention_layernorm
    norm.register_forward_pre_hook(lambda m, a: calls.append("window"))
    with hooks.attach(model, recorder(), points):
        model(torch.zeros(2, 1, 1024, dtype=torch.bfloat16))
    assert calls[:2] == [(BEFORE, 0, 2), "window"]
    # a profile of after-sites only writes no hook (the files written before it stay valid)
    other, plain = tuned()
    plain.save(tmp_path / "plain.json", other)
    assert not any("hook" in e for e in json.loads((tmp_path / "plain.json").read_text())["plan"])


def test_a_profile_of_another_device_or_model_is_refused(tmp_path, monkeypatch):
    model, result = tuned()
    path = tmp_path / "p.json"
    result.save(path, model)
    other = dict(FAKE_DEVICE, name="NVIDIA RTX PRO 6000", l2_bytes=128 << 20, sm=120)
    monkeypatch.setattr(P, "device_fingerprint", lambda device=None: other)
    with pytest.raises(tuning.ProfileMismatchError, match="another GPU.*name: profile "
                       "'NVIDIA H200', this device 'NVIDIA RTX PRO 6000'.*tune again"):
        tuning.load_profile(path, model)
    monkeypatch.setattr(P, "device_fingerprint", lambda device=None: dict(FAKE_DEVICE))
    bigger = fakes.llama(n_layers=4, h=1024, i=2048, kv=256)
    with pytest.raises(tuning.ProfileMismatchError, match="3 decoder layers in the profile, 4"):
        tuning.load_profile(path, bigger)
    wider = fakes.llama(n_layers=3, h=1024, i=4096, kv=256)
    with pytest.raises(tuning.ProfileMismatchError, match="is \\[4096, 1024\\] bfloat16 here"):
        tuning.load_profile(path, wider)


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t[: len(t) // 2], "is not valid JSON.*truncated"),
    (lambda t: "[" * 100000, "is not valid JSON"),
    (lambda t: json.dumps({"format": "x"}), "is not an l2prefetch profile"),
    (lambda t: t.replace('"version": 1', '"version": 7'), "version 7"),
    (lambda t: t.replace('"batches": [1, 8]', '"batches": []'), "'batches' must be"),
    (lambda t: t.replace('"sm_count": 132', '"sm_count": "many"'), "'device.sm_count' must be an int"),
    (lambda t: t.replace('"site": "model.layers.0', '"sight": "model.layers.0'),
     "unknown fields \\['sight'\\]"),
])
def test_corrupted_profiles(tmp_path, mutate, message):
    model, path, _ = saved(tmp_path)
    path.write_text(mutate(path.read_text()))
    with pytest.raises(ValueError, match=message):
        tuning.load_profile(path, model, check_device=False)


def test_a_mismatch_message_cuts_a_huge_field(tmp_path, monkeypatch):
    """Issue 38.6: a ProfileMismatchError names what differs, each value cut at about 200
    characters as parse_profile's errors are, not a 100 kB field echoed whole."""
    model, result = tuned()
    path = tmp_path / "p.json"
    result.save(path, model)
    data = json.loads(path.read_text())
    huge = "x" * 100_000
    first = next(iter(data["model"]["weights"]))
    cases = []
    dtype = json.loads(json.dumps(data))
    dtype["model"]["weights"][first][1] = huge                     # another dtype
    cases.append((dtype, "bfloat16 here"))
    named = json.loads(json.dumps(data))
    named["model"]["weights"][huge] = named["model"]["weights"][first]  # a weight not here
    cases.append((named, "is not in this model"))
    site = json.loads(json.dumps(data))
    site["plan"][0]["site"] = huge                                 # a site not here
    cases.append((site, "which is not a module of this model"))
    device = json.loads(json.dumps(data))
    device["device"]["name"] = huge                                # another GPU
    cases.append((device, "was tuned on another GPU"))
    monkeypatch.setattr(P, "device_fingerprint", lambda device=None: dict(FAKE_DEVICE))
    for n, (mutated, message) in enumerate(cases):
        one = tmp_path / f"huge{n}.json"
        one.write_text(json.dumps(mutated))
        with pytest.raises(tuning.ProfileMismatchError, match=message) as caught:
            tuning.load_profile(one, model)
        assert len(str(caught.value)) < 1000, (message, len(str(caught.value)))
        assert "xxx...xxx" in str(caught.value)


def test_a_profile_holds_a_line_per_interval_not_per_number(tmp_path, monkeypatch):
    model, result = tuned()
    path = tmp_path / "p.json"
    result.save(path, model)
    text = path.read_text()
    data = json.loads(text)
    confirmed = data["results"][0]["confirmed"]["gain"]
    assert f'"gain": {json.dumps(confirmed)}' in text          # an interval on one line
    assert '"batches": [1, 8],' in text
    bare = [line for line in text.splitlines()
            if line.strip().rstrip(",").lstrip("-").replace(".", "").replace("e", "").isdigit()]
    assert bare == []                                          # no number alone on a line
    # the reader takes the compact file and the one-number-per-line files written before
    monkeypatch.setattr(P, "device_fingerprint", lambda device=None: dict(FAKE_DEVICE))
    indented = tmp_path / "indented.json"
    indented.write_text(json.dumps(data, indent=1))
    assert indented.read_text().count("\n") > 2 * text.count("\n")
    for one in (path, indented):
        profile = tuning.load_profile(one, model)
        assert profile.plan == result.plan and profile.batches == [1, 8]


def test_save_needs_a_device_and_writes_atomically(tmp_path):
    model, result = tuned()
    result.save(tmp_path / "p.json", model)
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]
    result.device = None
    with pytest.raises(ValueError, match="no device fingerprint"):
        result.save(tmp_path / "q.json", model)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(budget_s=0), ValueError, "budget_s must be > 0"),
    (dict(budget_s=-1), ValueError, "budget_s must be a finite number >= 0"),
    (dict(budget_s="300"), TypeError, "budget_s must be a number"),
    (dict(instances=3), ValueError, "instances must be an int >= 5"),
    (dict(max_instances=4), ValueError, "max_instances must be None or an int >= instances "
                                        "\\(5\\)"),
    (dict(instances=8, max_instances=6), ValueError, "max_instances .* >= instances \\(8\\)"),
    (dict(max_instances="15"), TypeError, "max_instances must be None or an int"),
    (dict(resolution=-0.001), ValueError, "resolution must be a finite number >= 0"),
    (dict(resolution=5), ValueError, "resolution is a share of the step \\(0.0005 is 0.05%\\)"),
    (dict(resolution="0.05%"), TypeError, "resolution must be a number"),
    (dict(candidates=["after nowhere: nothing"]), ValueError, "unknown role"),
    (dict(candidates=[O_PROJ, O_PROJ[:-1]]), ValueError, "closest"),
    (dict(candidates="roles"), TypeError, "candidates must be None"),
    (dict(candidates=[object()]), TypeError, "candidates\\[0\\] must be a Role"),
    (dict(kernels=["warp_speed"]), ValueError, "unknown kernel"),
    (dict(graph_forks=["sideways"]), ValueError, "graph_forks must be"),
    (dict(grids=[0]), ValueError, "grids must hold numbers > 0"),
    (dict(caps_mib=[]), TypeError, "caps_mib must be a non-empty sequence"),
    (dict(rounds=0), ValueError, "rounds must be None \\(by the step's time\\) or an int >= 1, "
                                 "got int 0"),
    (dict(rounds=True), TypeError, "rounds must be None .* got bool True"),
    (dict(rounds=2.5), TypeError, "rounds must be None .* got float 2.5"),
    # a hostile review's: nothing to measure, the same arm twice, a value that would fail
    # only after the tune (or never be checked), a device torch names in its own words
    (dict(candidates=[]), ValueError, "candidates is empty, so there is nothing to measure"),
    (dict(candidates=[O_PROJ, O_PROJ]), ValueError, "candidates name a role twice"),
    (dict(grids=[16, 16]), ValueError, r"grids gives 16 more than once, \[16, 16\]: give "
                                       "each once"),
    (dict(caps_mib=[4, 4.0]), ValueError, "caps_mib gives 4.0 more than once"),
    (dict(kernels=[None, None]), ValueError, "kernels gives None more than once"),
    (dict(graph_forks=["leaf", "leaf"]), ValueError, "graph_forks gives 'leaf' more than once"),
    (dict(min_bytes=0), ValueError, "min_bytes must be an int >= 1, got 0"),
    (dict(min_bytes="1 MiB"), TypeError, "min_bytes must be an int >= 1, got str"),
    (dict(progress=object()), TypeError, "progress must be None \\(quiet\\) or a text stream"),
    (dict(progress=42), TypeError, "progress must be None .* got int"),
    (dict(device="garbage"), ValueError, "device must be None \\(the model's\\), a CUDA device "
                                         "index, 'cuda', 'cuda:N' or a torch.device of CUDA"),
    (dict(device="cpu"), ValueError, "device must be .* tuning measures CUDA graphs; got str"),
    (dict(device=-1), ValueError, "device must be .* got int -1"),
    (dict(device=3.5), TypeError, "device must be .* got float 3.5"),
])
def test_bad_arguments(kwargs, error, message):
    model, step = model_and_step()
    backend = DeviceBackend({}, seed=0)
    with pytest.raises(error, match=message):
        tuning.tune(model, step, [1], backend=backend, **{
            "progress": None, "min_bytes": 256 * 1024, **kwargs})
    assert backend.prepared == []   # refused before anything was measured


def test_roles_of_another_model_are_refused():
    """Role objects hold tensors: those found in another model would be measured under
    this one's hooks (and its profile could not be saved)."""
    model, step = model_and_step()
    other, other_step = model_and_step()
    theirs = find_roles(other, lambda: other_step(1), min_bytes=256 * 1024)
    with pytest.raises(ValueError, match=r"candidates\[0\] \(.*\) loads a tensor whose "
                                         r"memory is not this model's \(layer 0\): pass roles "
                                         r"found in the model tuned"):
        tuning.tune(model, step, [1], candidates=theirs, backend=DeviceBackend({}, seed=0),
                    progress=None, min_bytes=256 * 1024)
    ours = find_roles(model, lambda: step(1), min_bytes=256 * 1024)
    result = tuning.tune(model, step, [1], candidates=ours[:1], progress=None,
                         backend=DeviceBackend({}, seed=0), min_bytes=256 * 1024)
    assert [role.name for role in result.roles] == [ours[0].name]
    # a policy's plan may load a view of a weight: the model's memory, accepted
    gate = model.model.layers[0].mlp.gate_proj.weight
    plan = [PlanEntry("p", 0, [1], (gate[:512],))]
    roles = tuning.roles_from_plan(model, plan, {"p": [(model.model.layers[0].self_attn, 0)]})
    result = tuning.tune(model, step, [1], candidates=roles, progress=None,
                         backend=DeviceBackend({}, seed=0), min_bytes=256 * 1024)
    assert [role.name for role in result.roles] == ["p"]


def test_candidates_are_checked_before_the_step_runs():
    """With the GPU's backend the step ran (and compiled) before an empty or repeated
    candidates list was refused; now they are refused first, a CPU model's too."""
    model, _ = model_and_step()

    def step(batch):
        pytest.fail("the step ran")
    for candidates, words in (([], "candidates is empty"),
                              ([O_PROJ, O_PROJ], "candidates name a role twice")):
        with pytest.raises(ValueError, match=words):
            tuning.tune(model, step, [1], candidates=candidates, progress=None)


def test_numpy_scalars_are_stored_as_plain_numbers(tmp_path):
    """Checked numbers go into the profile as JSON numbers: numpy scalars passed the
    checks, then failed the save after the whole tune."""
    np = pytest.importorskip("numpy")
    model, result = tuned(batches=(1,), instances=np.int64(5),
                          resolution=np.float32(0.0005), caps_mib=[np.float32(4), 8],
                          grids=[np.int64(32)], min_gain_us=np.float32(1), budget_s=np.int64(60))
    result.save(tmp_path / "p.json", model)
    tuning_settings = json.loads((tmp_path / "p.json").read_text())["tuning"]
    assert tuning_settings["instances"] == 5 and type(tuning_settings["instances"]) is int
    assert tuning_settings["caps_mib"] == [4.0, 8] and tuning_settings["grids"] == [32]
    assert type(result.settings["min_gain_us"]) is float and result.budget_s == 60.0


# ------------------------------------------------------------------ the backend's contract

class Minimal(Backend):
    """Only what a backend must define: rounds, prepare, probe, measure (no device, no
    pairing, no roles needed: Backend's defaults)."""

    rounds = 7

    def __init__(self, planted):
        self.planted = planted

    def prepare(self, batch):
        return self.planted.prepare(batch)

    def probe(self, batch, roles):
        return None

    def measure(self, batch, arms, instances):
        return self.planted.measure(batch, arms, instances)


@pytest.mark.parametrize("field, value", [("capture_s", float("nan")), ("capture_s", -1.0),
                                          ("step_us", 0.0), ("compile_s", float("inf"))])
def test_a_backends_prepared_times_are_checked(field, value):
    """The budget's estimates start from prepare()'s times: a NaN or negative one made
    every estimate fit, and a 5 s budget ran 15-18 s (a hostile review's)."""
    import dataclasses

    class Bad(Minimal):
        def prepare(self, batch):
            return dataclasses.replace(self.planted.prepare(batch), **{field: value})

    model, step = model_and_step()
    with pytest.raises(ValueError, match=rf"^Bad.prepare\(\): Prepared.{field} must be a "
                                         rf"finite number"):
        tuning.tune(model, step, [1], candidates=[O_PROJ], progress=None, budget_s=5,
                    backend=Bad(DeviceBackend({O_PROJ: lambda s: 6.0}, seed=3)),
                    min_bytes=256 * 1024)


def test_a_backend_needs_only_its_own_members():
    model, step = model_and_step()
    backend = Minimal(DeviceBackend({O_PROJ: lambda s: 6.0}, seed=3))
    result = tuning.tune(model, step, [1], candidates=[O_PROJ], backend=backend, progress=None,
                         min_bytes=256 * 1024, rounds=60)
    assert not result.empty
    assert result.device is None                       # Backend.device_fingerprint's default
    assert result.settings["rounds"] == 7              # the backend's, not tune's argument
    assert backend.pairs == () and backend.switches is False


def test_tune_hands_the_backend_its_roles_and_caps():
    class Recording(DeviceBackend):
        def use_roles(self, roles, caps_bytes):
            self.used = ([r.name for r in roles], list(caps_bytes))

    model, step = model_and_step()
    backend = Recording({}, seed=0)
    result = tuning.tune(model, step, [1], candidates=[O_PROJ, GATE], backend=backend,
                         progress=None, min_bytes=256 * 1024, caps_mib=[4, 8.5])
    assert backend.used == ([O_PROJ, GATE], [4 * MIB, int(8.5 * MIB)])
    assert result.device == FAKE_DEVICE


def test_graph_backend_placement_is_checked_first():
    from l2prefetch.tuning.measure import GraphBackend

    model, step = model_and_step()
    with pytest.raises(ValueError, match=r"placement must be one of \('private', 'shared'\), "
                                         r"got 'pooled'"):
        GraphBackend(model, step, placement="pooled")


def test_a_backend_that_is_not_one_is_refused():
    model, step = model_and_step()
    with pytest.raises(TypeError, match="backend must be None .* or a "
                       "l2prefetch.tuning.arms.Backend .*got object"):
        tuning.tune(model, step, [1], backend=object(), progress=None)

    class NoMeasure(Backend):
        rounds = 1

        def prepare(self, batch):
            raise AssertionError

        def probe(self, batch, roles):
            return None
    with pytest.raises(TypeError, match="abstract method.*measure"):
        NoMeasure()


@pytest.mark.parametrize("batches, error, message", [
    ([], ValueError, "^batches must name at least one batch"),
    ([0], ValueError, "^batches must hold ints >= 1, got 0"),
    ([65536], ValueError, "^batches must hold batches of at most 65535"),
    ([1, 1], ValueError, "^batches must name each batch once"),
    ("1,8", TypeError, "^batches must be an iterable of decode batches"),
    ([1.5], TypeError, "^batches must hold ints"),
])
def test_bad_batches(batches, error, message):
    model, step = model_and_step()
    with pytest.raises(error, match=message):
        tuning.tune(model, step, batches, backend=DeviceBackend({}), progress=None)


def test_a_batch_the_step_rejects():
    model, _ = model_and_step()

    def step(batch):
        raise ValueError(f"this server decodes at most 4 sequences, not {batch}")
    with pytest.raises(tuning.StepError, match="step\\(8\\) failed while discovering.*not 8"):
        tuning.tune(model, step, [8], backend=DeviceBackend({}), progress=None)

    def verbose(batch):   # transformers' validation errors span several lines
        raise ValueError("invalid config:\n  hidden_size 64\n\n  is not a multiple of 48")
    with pytest.raises(tuning.StepError) as caught:
        tuning.tune(model, verbose, [8], backend=DeviceBackend({}), progress=None)
    assert str(caught.value) == ("step(8) failed while discovering the weights it reads: "
                                 "ValueError: invalid config: hidden_size 64 is not a "
                                 "multiple of 48")
    assert isinstance(caught.value.__cause__, ValueError)

    def bare(batch):
        raise RuntimeError()
    with pytest.raises(tuning.StepError) as caught:
        tuning.tune(model, bare, [8], backend=DeviceBackend({}), progress=None)
    assert str(caught.value).endswith("reads: RuntimeError")
    # a step that fails at a later batch (its capture, on a GPU) stops tuning there
    model, step = model_and_step()
    backend = DeviceBackend({}, fail={8: RuntimeError("cannot capture")})
    with pytest.raises(tuning.StepError, match="step\\(8\\) failed"):
        tuning.tune(model, step, [1, 8], backend=backend, progress=None, min_bytes=256 * 1024)


def test_roles_by_name_and_progress_lines(capsys):
    import io

    model, step = model_and_step()
    out = io.StringIO()
    result = tuning.tune(model, step, [1], candidates=[O_PROJ], progress=out,
                         backend=DeviceBackend({O_PROJ: lambda s: 5.0}, seed=3),
                         min_bytes=256 * 1024)
    assert [r.name for r in result.roles] == [O_PROJ]
    text = out.getvalue()
    assert "1 candidate roles" in text and "confirm" in text and "ETA" in text
    # the last line: where the time went
    last = text.strip().splitlines()[-1]
    assert re.fullmatch(r"\[l2prefetch tune\] done in \d+ s: finding the roles \d+ s, "
                        r"batch 1 \d+ s", last), last


def test_plan_entries_carry_the_chosen_settings():
    def gain(s):
        return 3.0 + (5.0 if s.graph_fork == "branch" else 0.0) + (2.0 if s.grid == 16 else 0.0)
    model, result = tuned({O_PROJ: gain}, batches=(1,))
    entry = result.plan[0]
    assert isinstance(entry, PlanEntry)
    assert entry.graph_fork == "branch"
    assert entry.byte_cap in [c * MIB for c in (4, 8, 16, 24, 32, 48)]


def test_the_plot_of_tune_plot(tmp_path, monkeypatch):
    """--plot: a PNG where matplotlib (the tune extra's) is installed, False without it."""
    model, result = tuned()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert result.plot(tmp_path / "none.png") is False and not (tmp_path / "none.png").exists()
    monkeypatch.undo()
    if CXX_THROW_ABORTS:
        pytest.skip("matplotlib's C++ throw aborts under ASan preloaded without libstdc++")
    pytest.importorskip("matplotlib")
    assert result.plot(tmp_path / "gains.png") is True
    assert (tmp_path / "gains.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tune_plans_only_the_layers_a_window_pays_in(tmp_path, monkeypatch):
    """o_proj's loads pay in layers 1 and 3 of 4 and cost in 0 and 2 (together a loss):
    the plan and the profile hold entries for layers 1 and 3 only, at both batches."""
    model = fakes.llama(n_layers=4, h=1024, i=2048, kv=256)
    x = {}

    def step(batch):
        return model(x.setdefault(batch, torch.zeros(batch, 1, 1024, dtype=torch.bfloat16)))
    def window(s):  # best at 4 MiB, grid 32, as leaf forks: one setting at both batches
        return (9.0 - 3.0 * (s.grid != 32) - 3.0 * abs(s.byte_cap / MIB - 4) / 4
                if s.graph_fork == "leaf" else -2.0)
    backend = DeviceBackend({O_PROJ: PerLayer({1: window, 3: window}, layers=4, other=-10.0)},
                            seed=15, paired=True)
    result = tuning.tune(model, step, [1, 8], backend=backend, progress=None,
                         min_bytes=256 * 1024)
    assert sorted((e.point, e.layer, e.batches) for e in result.plan) == \
        [(O_PROJ, 1, (1, 8)), (O_PROJ, 3, (1, 8))]
    assert result.sites == {O_PROJ: [(f"model.layers.{l}.self_attn.v_proj", l) for l in (1, 3)]}
    assert all(rep.plan[0][1].layers == (1, 3) for rep in result.batches)
    md = result.markdown()
    assert "layers 1, 3" in md and "layers 1, 3" in result.summary()
    assert "| a - b us | instances |" in md
    assert f"up to {tuning.search.MAX_INSTANCES} for a candidate" in md
    assert result.settings["lead_max_instances"] == 2 * tuning.search.MAX_INSTANCES
    assert f"up to {2 * tuning.search.MAX_INSTANCES} for a group's lead" in md
    path = tmp_path / "p.json"
    result.save(path, model)
    monkeypatch.setattr(P, "device_fingerprint", lambda device=None: dict(FAKE_DEVICE))
    profile = tuning.load_profile(path, model)
    assert profile.plan == result.plan
    assert profile.hook_points(model)[O_PROJ] == [(model.model.layers[l].self_attn.v_proj, l)
                                                  for l in (1, 3)]


def test_merge_plan_per_layer():
    """Layers 1 and 3 kept at batches 1 and 8, the others at batch 8 only: one entry per
    layer, holding the batches where its layer was confirmed."""
    from l2prefetch.tuning.arms import Setting
    from l2prefetch.tuning.results import BatchReport
    from l2prefetch.tuning.tuner import merge_plan

    role = fakes.role("A", layers=4, mib=1)
    s = Setting(MIB, graph_fork="leaf")
    reports = [BatchReport(1, plan=(("A", Setting(MIB, graph_fork="leaf", layers=(1, 3))),)),
               BatchReport(8, plan=(("A", s),))]
    plan, sites = merge_plan([role], reports)
    assert sorted((e.layer, e.batches) for e in plan) == [(0, (8,)), (1, (1, 8)), (2, (8,)),
                                                          (3, (1, 8))]
    assert all(e.graph_fork == "leaf" and e.byte_cap == MIB for e in plan)
    assert [layer for _, layer in sites["A"]] == [0, 1, 2, 3]
    assert not any(e.warm_activation for e in plan)
    warm, _ = merge_plan([role], reports, warm_activation=True)
    assert [e.warm_activation for e in warm] == [True] * 4


def test_a_site_of_max_ranges_weights_loads_them_without_the_activation():
    """A warm table keeps one of MAX_RANGES slots free: Role.entries leaves a site with
    that many weights unwarmed rather than make an entry the controller refuses."""
    import dataclasses

    role = fakes.role("A", layers=2, mib=1)
    many = tuple(torch.empty(8, dtype=torch.bfloat16) for _ in range(l2prefetch.MAX_RANGES))
    wide = dataclasses.replace(role.sites[1], weights=many, nbytes=(16,) * len(many))
    role = dataclasses.replace(role, sites=(role.sites[0], wide))
    assert [e.warm_activation for e in role.entries((1,), byte_cap=0,
                                                     warm_activation=True)] == [True, False]
# -- issue 21: a profile must agree with itself, and is bound to the model it was loaded for ---

@functools.lru_cache(maxsize=None)
def _saved_once():
    """tuned()'s model and the text of its saved profile, made once (a tune() takes ~4 s,
    most of it in its t quantiles): the tests that only load edited copies of it share
    them (loading a profile that is refused leaves the model as it was)."""
    model, result = tuned()
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "p.json")
        result.save(path, model)
        with open(path) as f:
            return model, f.read()


def saved(tmp_path, fresh=False):
    """tuned()'s model, its profile saved as tmp_path/p.json, and that file's JSON;
    ``fresh``: a model of this test's own (one it may drop)."""
    if fresh:
        model, result = tuned()
        result.save(tmp_path / "p.json", model)
        return model, tmp_path / "p.json", json.loads((tmp_path / "p.json").read_text())
    model, text = _saved_once()
    path = tmp_path / "p.json"
    path.write_text(text)
    return model, path, json.loads(text)


def duplicate_plan_key(text):
    """The file with a second, empty "plan" after the real one (json keeps the last)."""
    return text.rstrip().rstrip("}") + ', "plan": []}'


def entry0(data):
    return data["plan"][0]


def split_hook(data):
    """plan[0] for batch 1 only, and a copy of it for batch 8 hooked before its site."""
    entry0(data)["batches"] = [1]
    data["plan"].append(dict(entry0(data), batches=[8], hook="before"))


@pytest.mark.parametrize("setting, value", [
    ("warm_activation", "yes"), ("byte_cap", 8), ("grid", 0), ("carveout", 101),
    ("priority", 1), ("kernel", "fast"), ("graph_fork", "sideways")])
def test_an_entrys_bad_setting_is_refused_before_a_model_is_built(tmp_path, setting, value):
    """parse_profile (what trace --profile checks before building the model) refuses an
    entry's bad setting as load_profile does, with PlanEntry's message."""
    _, path, data = saved(tmp_path)
    entry0(data)[setting] = value
    with pytest.raises((TypeError, ValueError)) as info:
        P.parse_profile(json.dumps(data), str(path))
    assert type(info.value) is ValueError
    assert re.search(rf"plan\[0\] is not a valid plan entry: PlanEntry.{setting} ",
                     str(info.value)), info.value


@pytest.mark.parametrize("change, field", [
    # two entries for one (point, layer, batch): the last would win
    (lambda d: d["plan"].append(dict(entry0(d))), r"plan\[0\] and plan\[\d+\] both prefetch at "
                                                  r"point '.*', layer 0, batch 1"),
    # one point and layer hooked after its site at batch 1, before it at batch 8: attach()
    # hooks per point and layer, for every batch, so it would fork twice
    (split_hook, r"plan\[0\] and plan\[\d+\] fork at point '.*', layer 0 from different "
                 r"sites \('model.layers.0.self_attn.v_proj' after, "
                 r"'model.layers.0.self_attn.v_proj' before\)"),
    # a site hooked neither after nor before its module
    (lambda d: entry0(d).update(hook="during"),
     r"plan\[0\].hook must be 'after' or 'before' \(absent: 'after'\), got 'during'"),
    # an entry for a batch the profile was not tuned at
    (lambda d: entry0(d).update(batches=[1, 4]), r"plan\[0\].batches holds 4, which is not one "
                                                 r"of the profile's batches \[1, 8\]"),
    # a layer-0 entry forking in layer 1
    (lambda d: entry0(d).update(site=entry0(d)["site"].replace("layers.0.", "layers.1.")),
     r"plan\[0\].site 'model.layers.1.self_attn.v_proj' is in layer 1, but the entry is for "
     r"layer 0"),
    # one weight three times
    (lambda d: entry0(d).update(weights=entry0(d)["weights"][:1] * 3 + entry0(d)["weights"]),
     r"plan\[0\].weights lists \['model.layers.0.self_attn.o_proj.weight'\] more than once"),
    (lambda d: d.update(batches=[10**30]), r"'batches' must be a non-empty list of ints in "
                                           r"1..65535, got \[1000000000000000000000000000000\]"),
    (lambda d: d.update(batches=[1, 8, 1]), r"'batches' names a batch more than once"),
    (lambda d: entry0(d).update(layer=2**40), r"plan\[0\].layer must be an int in 0..65535"),
    (lambda d: entry0(d).update(point=""), r"plan\[0\].point must be a non-empty str"),
    (lambda d: entry0(d).update(warm_activation="yes"),
     r"plan\[0\] is not a valid plan entry: PlanEntry.warm_activation must be a bool"),
    (lambda d: entry0(d).update(byte_cap=8), r"plan\[0\] is not a valid plan entry: "
                                             r"PlanEntry.byte_cap must be 0 \(no cap\) or at "
                                             r"least 16 bytes"),
    # corrupt fields of the model's fingerprint and the versions
    *[(lambda d, v=v: d["model"]["weights"].update(
        {"model.layers.0.self_attn.o_proj.weight": v}),
       r"'model.weights'\['model.layers.0.self_attn.o_proj.weight'\] must be \[shape, dtype\]")
      for v in (5, [], None, {}, [[1024, -1], "bfloat16"], [[1024], 7])],
    (lambda d: d.update(versions=[1, 2]), r"'versions' must be an object, got \[1, 2\]"),
    (lambda d: d.update(versions="x"), r"'versions' must be an object, got 'x'"),
    (lambda d: d.update(versions={"torch": 2}), r"'versions'\['torch'\] must be a version "
                                                r"string or null, got 2"),
    (lambda d: d["device"].update(sm_count=-1), r"'device.sm_count' must be an int >= 0"),
    (lambda d: d["device"].update(driver_version="13"), r"'device.driver_version' must be an "
                                                        r"int or null"),
    (lambda d: d["model"].update(layers=True), r"'model.layers' must be an int, got True"),
    # the measured spread the runtime reads (Profile.capture_k)
    (lambda d: d["results"][0].update(spread={"recommended_k": 0}),
     r"'results'\[0\].spread.recommended_k must be an int in 1..64, got 0"),
    (lambda d: d["results"][0].update(spread={"recommended_k": 10**6}),
     r"'results'\[0\].spread.recommended_k must be an int in 1..64"),
    (lambda d: d["results"][1].update(spread=[8]),
     r"'results'\[1\].spread must be an object or null, got \[8\]"),
    (lambda d: d["results"][0].update(batch=4, spread={"recommended_k": 2}),
     r"'results'\[0\].batch must be one of 'batches' \[1, 8\], got 4"),
    (lambda d: d.update(results=[3]), r"'results'\[0\] must be an object, got 3"),
    # two results for one batch: which one's spread would the runtime read?
    (lambda d: d["results"].append(dict(d["results"][0])),
     r"'results'\[2\] is batch 1 again \(also 'results'\[0\]\): one result per batch"),
    (lambda d: d.update(version=1.0), r"has version 1.0; this l2prefetch reads version 1"),
    (lambda d: d.update(results={}), r"'results' must be a list"),
])
def test_a_profile_that_contradicts_itself_is_refused_naming_the_file_and_field(
        tmp_path, change, field):
    model, path, data = saved(tmp_path)
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        tuning.load_profile(path, model, check_device=False)
    assert type(info.value) is ValueError
    assert str(info.value).startswith(f"profile {path}: "), info.value
    assert re.search(field, str(info.value)), info.value


@pytest.mark.parametrize("edit, field", [
    (duplicate_plan_key, r"the top level gives the key 'plan' more than once"),
    (lambda t: t.replace('"byte_cap": ', '"byte_cap": 4096, "byte_cap": ', 1),
     r"plan\[0\] gives the key 'byte_cap' more than once"),
    (lambda t: t.replace('"sm_count": 132', '"sm_count": ' + "7" * 5000),
     r"device.sm_count is a 5000-digit number"),
    (lambda t: t.replace('"budget_s": ', '"budget_s": ' + "7" * 5000 + ", \"x\": ", 1),
     r"tuning.budget_s is a 5000-digit number"),
])
def test_the_json_of_a_profile_is_checked_naming_the_file_and_field(tmp_path, edit, field):
    model, path, _ = saved(tmp_path)
    text = edit(path.read_text())
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        tuning.load_profile(path, model, check_device=False)
    assert type(info.value) is ValueError
    assert str(info.value).startswith(f"profile {path}: "), info.value
    assert re.search(field, str(info.value)), info.value


def finishes(call, fifo):
    """call() in a thread: whether it returned within 30 s (a hang, not a speed check); if
    not, a writer opens the FIFO without blocking, so that a blocked open returns (the
    test fails rather than hangs, also where the call was slow and is not in open)."""
    import os
    import threading

    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(_raised(call)), daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():
        try:                                  # ENXIO when no reader waits
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        thread.join(5)
        return False, outcome
    return True, outcome


def _raised(call):
    try:
        return call()
    except BaseException as exc:  # noqa: BLE001 - the test looks at it
        return exc


def test_a_fifo_is_no_profile_and_does_not_hang(tmp_path):
    import os

    model, _ = model_and_step()
    fifo = tmp_path / "p.json"
    os.mkfifo(fifo)
    done, outcome = finishes(lambda: tuning.load_profile(fifo, model, check_device=False), fifo)
    assert done, "load_profile blocked on a FIFO"
    assert type(outcome[0]) is ValueError
    assert str(outcome[0]) == (f"profile {fifo} is a FIFO, not a regular file: pass the path "
                               "of the profile itself")
    directory = tmp_path / "d"
    directory.mkdir()
    with pytest.raises(ValueError, match=r"profile .*/d is a directory, not a regular file"):
        tuning.load_profile(directory, model, check_device=False)


def test_the_plan_shapes_file_may_not_be_a_fifo(tmp_path, capsys):
    import os

    from l2prefetch.cli import plan_main

    fifo = tmp_path / "shapes.json"
    os.mkfifo(fifo)
    done, outcome = finishes(lambda: plan_main(["--shapes", str(fifo)]), fifo)
    assert done, "plan --shapes blocked on a FIFO"
    assert outcome == [2]
    assert capsys.readouterr().err == (f"l2prefetch plan: --shapes file {fifo} is a FIFO, not "
                                       "a regular file: pass the path of the --shapes file "
                                       "itself\n")


def test_a_profile_is_bound_to_the_model_it_was_loaded_for(tmp_path, monkeypatch, fake):
    from l2prefetch import PrefetchController
    from l2prefetch import controller as rig   # from_profile's builder (the runtime's)

    model, path, _ = saved(tmp_path, fresh=True)             # dropped below
    twin = fakes.llama(n_layers=3, h=1024, i=2048, kv=256)   # the same shapes
    profile = tuning.load_profile(path, model, check_device=False)
    built = []
    made = PrefetchController(device=0)
    monkeypatch.setattr(rig, "build_controller",
                        lambda plan, device=None, eager=False: built.append(plan) or made)
    # torch sees no GPU here: this device is the one the profile was tuned on
    monkeypatch.setattr(P, "device_fingerprint", lambda device=None: dict(profile.data["device"]))
    with pytest.raises(tuning.ProfileMismatchError, match=rf"profile {path} was loaded for "
                       r"another CausalLM object, not this CausalLM: its plan holds that "
                       r"model's weights"):
        PrefetchController.from_profile(profile, twin)
    with pytest.raises(tuning.ProfileMismatchError, match="was loaded for another CausalLM"):
        profile.hook_points(twin)
    assert built == []
    # its own model: the plan goes to the controller, the hooks go on that model's modules
    assert PrefetchController.from_profile(profile, model) is made
    assert built == [profile.plan]
    # loaded without its device checked (check_device=False, for inspection): applying
    # it checks the device, and one tuned on another GPU is refused
    other = dict(profile.data["device"], name="Other GPU")
    monkeypatch.setattr(P, "device_fingerprint", lambda device=None: other)
    with pytest.raises(tuning.ProfileMismatchError, match=rf"profile {path} was tuned on "
                       r"another GPU \(name: profile .*, this device 'Other GPU'\)"):
        PrefetchController.from_profile(profile, model)
    assert built == [profile.plan]
    monkeypatch.setattr(P, "device_fingerprint", lambda device=None: dict(profile.data["device"]))
    assert profile.hook_points(model)[O_PROJ][0][0] is model.model.layers[0].self_attn.v_proj
    # a profile made by hand: the plan's weights decide
    by_hand = P.Profile(data=profile.data, plan=profile.plan, sites=profile.sites)
    by_hand.check_model(model)
    with pytest.raises(tuning.ProfileMismatchError, match=r"plan\[0\] .* holds weights that "
                       r"are not this CausalLM's"):
        by_hand.check_model(twin)
    del model
    import gc

    gc.collect()
    with pytest.raises(tuning.ProfileMismatchError, match="loaded for a model that no longer "
                                                          "exists"):
        profile.hook_points(twin)


def test_without_a_gpu_loading_a_profile_says_so(tmp_path, fake):
    import l2prefetch

    model, path, _ = saved(tmp_path)
    # the driver is there (the stand-in), torch sees no GPU: the name cannot be read
    with pytest.raises(l2prefetch.CudaUnavailableError, match=r"torch .* sees no CUDA device "
                       r"\(a CPU-only build\?\), so the name of cuda:0, which a profile is "
                       r"checked against, cannot be read"):
        tuning.load_profile(path, model)
    with pytest.raises(l2prefetch.CudaUnavailableError, match="sees no CUDA device"):
        l2prefetch.PrefetchController.from_profile(path, model)
    # a device that is not CUDA is a bad argument, as the controller says
    for device in ("cpu", torch.device("cpu")):
        with pytest.raises(ValueError, match=r"device must be a CUDA device"):
            tuning.load_profile(path, model, device=device)
        with pytest.raises(ValueError, match=r"device must be a CUDA device"):
            l2prefetch.PrefetchController.from_profile(path, model, device=device)
    with pytest.raises(ValueError, match=r"cuda:5 does not exist"):
        tuning.load_profile(path, model, device=5)


def test_without_a_driver_loading_a_profile_says_where_it_looked(tmp_path):
    import l2prefetch
    from l2prefetch import _C

    model, path, _ = saved(tmp_path)
    try:
        _C.driver_info()
    except l2prefetch.CudaUnavailableError as exc:
        reason = str(exc).splitlines()[0]
    else:
        pytest.skip("this machine has a CUDA driver")
    with pytest.raises(l2prefetch.CudaUnavailableError) as info:
        tuning.load_profile(path, model)
    assert str(info.value).splitlines()[0] == reason


def test_tune_refuses_caps_under_16_bytes():
    model, step = model_and_step()
    for caps in ([1e-9], [4, 1e-5], [15 / MIB]):
        with pytest.raises(ValueError, match=r"caps_mib must each be at least 16 bytes "
                                             r"\(1.53e-05 MiB\), got"):
            tuning.tune(model, step, [1], backend=DeviceBackend({}), progress=None,
                        caps_mib=caps)
    result = tuning.tune(model, step, [1], backend=DeviceBackend({}), progress=None,
                         caps_mib=[16 / MIB], min_bytes=256 * 1024)
    assert result.settings["caps_mib"] == [16 / MIB]


def test_save_never_writes_through_a_planted_link(tmp_path):
    import os

    model, result = tuned()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    target = tmp_path / "p.json"
    os.symlink(victim, tmp_path / f".p.json.{os.getpid()}.tmp")
    with pytest.raises(ValueError, match=r"is in the way \(a link or a file left behind"):
        result.save(target, model)
    assert victim.read_text() == "keep" and not target.exists()
    os.unlink(tmp_path / f".p.json.{os.getpid()}.tmp")
    os.symlink(victim, target)      # a link at the target itself is replaced, not followed
    result.save(target, model)
    assert victim.read_text() == "keep" and not target.is_symlink()
    assert json.loads(target.read_text())["format"] == P.PROFILE_FORMAT


class _SharedOutput:
    """Fake graphs of one shared pool: each replay writes its value into one tensor."""

    def __init__(self):
        self.out = torch.zeros(4)

    def graph(self, value):
        shared = self.out

        class Graph:
            def replay(self):
                shared.fill_(value)
        return Graph()


def _cpu_graph_backend(monkeypatch):
    from l2prefetch.tuning.measure import GraphBackend

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    backend = GraphBackend.__new__(GraphBackend)
    backend.torch, backend.device = torch, torch.device("cpu")
    return backend


def test_graph_backend_reads_each_output_right_after_its_own_replay(caplog, monkeypatch):
    """Graphs of one shared pool share buffers: here every 'graph' writes its result into
    one tensor. Each arm's output is compared right after its own replay, so the arms
    that compute the step's logits pass and the one that computes others is named."""
    pool, backend = _SharedOutput(), _cpu_graph_backend(monkeypatch)
    Graph = pool.graph
    graphs = {("a", 0): Graph(1.0), ("a", 1): Graph(1.0), ("b", 0): Graph(1.0),
              ("b", 1): Graph(2.0), ("d", 0): Graph(1.0)}
    out_of = {key: pool.out for key in graphs}
    with caplog.at_level(logging.WARNING, "l2prefetch.tuning.measure"):
        identical = backend._check_outputs(1, graphs, out_of)
    assert identical == {"a": True, "b": False, "d": True}
    assert "arm b: outputs of instances [1] differ" in caplog.text and "[1.0]" in caplog.text


@pytest.mark.parametrize("placement", ["shared", "private"])
def test_graph_backend_primes_each_shared_pool_with_an_untimed_capture(placement, monkeypatch):
    """With shared placement each instance's pool gets one capture first that is kept
    alive until the group is measured and never timed (a new pool's first capture lays
    its segments out unlike the captures after it); the timed graphs all come after it,
    in that pool. That capture first allocates two spacers of random sizes (one under
    1 MiB, one of 1-10 MiB), alive until the group is timed, other sizes in each pool
    and each call, so that no instance lands where another did. Private placement
    captures no primer and no spacer."""
    import random
    import weakref

    from l2prefetch.tuning.arms import NO_FORKS, Arm
    from l2prefetch.tuning.measure import GraphBackend

    class Graph:
        def __init__(self, pool, spacers):
            self.pool, self.spacers = pool, spacers

        def replay(self):
            pass

    allocated = []
    real_empty = torch.empty

    def empty(n, **kw):
        t = real_empty(n, **kw)
        allocated.append((n, weakref.ref(t)))
        return t

    class FakeRig:
        def __init__(self):
            self.captures, self.timed = [], None

        def capture(self, fn, warmup=1, pool=None, keep_graph=False):
            before = len(allocated)
            for _ in range(warmup):        # eager: no spacer outside the pool
                fn()
            assert len(allocated) == before
            capturing[0] = True
            try:
                fn()
            finally:
                capturing[0] = False
            g = Graph(pool, [n for n, _ in allocated[before:]])
            self.captures.append(g)
            return g, torch.ones(2)

        def replays(self, graphs, rounds):
            self.timed = dict(graphs)
            # the primers and spacers are still alive while the group is timed
            assert all(sys.getrefcount(g) > 2 for g in self.captures)
            assert all(ref() is not None for _, ref in allocated[-6:])   # this call's
            return {key: [1.0] * rounds for key in graphs}

    pools = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(pools))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch, "empty", empty)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    backend = GraphBackend.__new__(GraphBackend)
    backend.torch, backend.device, backend.rounds = torch, torch.device("cpu"), 3
    backend.shared_placement, backend.switches = placement == "shared", False
    backend._captured, backend._outputs, backend.step = 0, {}, lambda batch: torch.ones(2)
    backend._placements = random.Random(0)
    backend.rig = rig = FakeRig()
    times, identical = backend.measure(1, {NO_FORKS: Arm()}, 3)
    assert times == {NO_FORKS: [1.0, 1.0, 1.0]} and identical == {NO_FORKS: True}
    timed = [rig.timed[(NO_FORKS, i)] for i in range(3)]
    primers = [g for g in rig.captures if all(g is not t for t in timed)]
    if placement == "private":
        assert primers == [] and [g.pool for g in timed] == [None] * 3 and allocated == []
        return
    assert [g.pool for g in primers] == [0, 1, 2] and [g.pool for g in timed] == [0, 1, 2]
    assert [rig.captures.index(p) for p in primers] == [0, 2, 4]   # each before its pool's
    assert all(g.spacers == [] for g in timed)
    sizes = [tuple(p.spacers) for p in primers]
    assert all(len(s) == 2 and s[0] < 2 ** 20 <= s[1] < 10 * 2 ** 20 and s[0] % 512 == 0
               and s[1] % 512 == 0 for s in sizes), sizes
    assert len(set(sizes)) == 3
    assert all(ref() is None for _, ref in allocated)   # freed once the group is measured
    backend.measure(1, {NO_FORKS: Arm()}, 3)
    again = [tuple(g.spacers) for g in rig.captures[6:] if g.spacers]
    assert len(again) == 3 and not set(again) & set(sizes)


@pytest.mark.parametrize("step_us, rounds", [(1850.0, 20), (2050.0, 20), (2133.0, 19),
                                             (3000.0, 13), (3800.0, 11), (3820.0, 10),
                                             (20000.0, 10)])
def test_graph_backend_replays_about_40_ms_of_a_step_per_instance(step_us, rounds, monkeypatch):
    """rounds=None (tune's default): prepare() times the step and says how many replays
    per instance its groups take at that batch (rounds_for: ~40 ms, 10-20); measure()
    replays each batch's own (a batch never prepared: MAX_ROUNDS), and a fixed rounds
    wins over them."""
    from l2prefetch.tuning.arms import NO_FORKS, Arm
    from l2prefetch.tuning.measure import MAX_ROUNDS, GraphBackend, rounds_for

    assert rounds_for(step_us) == rounds
    assert rounds_for(float("nan")) == rounds_for(0.0) == MAX_ROUNDS == 20

    class Graph:
        def replay(self):
            pass

    class FakeRig:
        def __init__(self):
            self.asked, self.step_us = [], step_us

        def capture(self, fn, warmup=1, pool=None, keep_graph=False):
            return Graph(), torch.ones(2)

        def replays(self, graphs, rounds):
            self.asked.append(rounds)
            return {key: [self.step_us] * rounds for key in graphs}

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    backend = GraphBackend.__new__(GraphBackend)
    backend.torch, backend.device, backend.rounds = torch, torch.device("cpu"), None
    backend.shared_placement, backend.switches = False, False
    backend._captured, backend._outputs, backend._rounds_at = 0, {}, {}
    backend.step = lambda batch: torch.ones(2)
    backend._placements = random.Random(0)
    backend.rig = rig = FakeRig()
    prepared = backend.prepare(8)
    assert prepared.step_us == step_us and prepared.rounds == rounds
    rig.step_us = 500.0                                  # a short step at batch 1: 20
    assert backend.prepare(1).rounds == 20
    for batch, expected in ((8, rounds), (1, 20), (8, rounds), (4, MAX_ROUNDS)):
        backend.measure(batch, {NO_FORKS: Arm()}, 2)
        assert rig.asked[-1] == expected, batch
    backend.rounds = 3
    assert backend.prepare(8).rounds == 3
    backend.measure(8, {NO_FORKS: Arm()}, 2)
    assert rig.asked[-1] == 3


@pytest.mark.parametrize("rounds, error", [(0, ValueError), (-1, ValueError), (True, TypeError),
                                           (2.0, TypeError), ("20", TypeError)])
def test_graph_backend_refuses_bad_rounds_first(rounds, error):
    from l2prefetch.tuning.measure import GraphBackend

    model, step = model_and_step()                       # on the CPU: refused for rounds first
    with pytest.raises(error, match="rounds must be None \\(by the step's time\\) or an int >= 1"):
        GraphBackend(model, step, rounds=rounds)


def _graph_backend_arguments(monkeypatch, **tune_kwargs):
    """The keywords tune() makes its GraphBackend with (stopped right there)."""
    from l2prefetch.tuning import measure

    seen = {}

    class Stop(Exception):
        pass

    class Recorder:
        def __init__(self, model, step, **kwargs):
            seen.update(kwargs)
            raise Stop

    monkeypatch.setattr(measure, "GraphBackend", Recorder)
    monkeypatch.setattr(measure, "cuda_device", lambda model, device=None: device)
    model, step = model_and_step()
    with pytest.raises(Stop):
        tuning.tune(model, step, [1], progress=None, kernels=[None], **tune_kwargs)
    return seen


@pytest.mark.parametrize("rounds", [None, 12])
def test_tune_hands_its_rounds_to_the_graph_backend(rounds, monkeypatch):
    assert _graph_backend_arguments(monkeypatch, rounds=rounds)["rounds"] == rounds


@pytest.mark.parametrize("compiled, within", [
    ("max-autotune-no-cudagraphs", True), ("default", False), (True, False), (None, False)])
def test_tune_compares_within_one_compilation_where_compilations_differ(compiled, within,
                                                                         monkeypatch):
    """Under max-autotune two compilations of one step differ bitwise (run 23): the
    backend compares each arm with its own graph without forks; in the default mode, or
    a mode not named, with the step compiled without forks."""
    from l2prefetch.tuning import tuner

    monkeypatch.setattr(tuner, "step_is_compiled", lambda model, step, batch: True)
    monkeypatch.setattr(tuner, "recompile", lambda: None)
    seen = _graph_backend_arguments(monkeypatch, compiled=compiled)
    assert seen["compiled"] is True and seen["within_compilation"] is within


@pytest.mark.parametrize("compiled", [True, False, "max-autotune-no-cudagraphs"])
def test_a_compiled_step_refused_for_its_outputs_names_the_likely_cause(compiled, caplog):
    """Outputs that differ across compilations refuse the role (as any difference does);
    for a compiled step whose mode was not named, tune says why that may be and what to
    pass; for an eager one, or one whose mode was named, it says nothing of the kind."""
    import io

    model, step = model_and_step()
    out = io.StringIO()
    backend = DeviceBackend({O_PROJ: lambda s: 6.0}, seed=3, differs=frozenset({O_PROJ}))
    with caplog.at_level(logging.WARNING, "l2prefetch.tuning.tuner"):
        result = tuning.tune(model, step, [1], candidates=[O_PROJ], progress=out,
                             backend=backend, min_bytes=256 * 1024, budget_s=60,
                             compiled=compiled)
    assert result.empty
    assert result.batches[0].roles[0].reason.startswith("refused: outputs")
    said = "compiled=\'max-autotune-no-cudagraphs\'" in out.getvalue()
    assert said is (compiled is True) and ("--compile max-autotune" in caplog.text) is said


def test_a_plan_whose_outputs_differ_at_confirmation_is_refused_for_its_outputs():
    """Roles that were bitwise alone but whose plan is not, at confirmation: dropped with
    the outputs reason (which the compiled step's hint counts), never shipped."""
    import io

    from l2prefetch.tuning.arms import PLAN

    class PlanDiffers(DeviceBackend):
        def measure(self, batch, arms, instances):
            times, identical = super().measure(batch, arms, instances)
            return times, {n: ok and n != PLAN for n, ok in identical.items()}

    model, step = model_and_step()
    out = io.StringIO()
    result = tuning.tune(model, step, [1], candidates=[O_PROJ], progress=out,
                         backend=PlanDiffers({O_PROJ: lambda s: 6.0}, seed=3),
                         min_bytes=256 * 1024, budget_s=60, compiled=True)
    rep = result.batches[0]
    assert result.empty and rep.confirmations and not rep.confirmations[-1].identical
    assert rep.roles[0].reason == ("refused: outputs with its loads differ from the step's "
                                   "(the plan with it, at confirmation)")
    assert "1 role(s) refused because the outputs" in out.getvalue()


def test_within_one_compilation_each_arm_is_compared_with_its_own_step_without_forks(
        caplog, monkeypatch):
    """within_compilation: an arm against its own graph without forks of the same
    instance (replayed just before it: they share buffers); that graph, and an arm with
    no such graph, against the compiled code forking nowhere (SAME_CODE, captured beside
    (a)); (a), compiled apart, only against itself.  Here (a) computes other logits than
    the compiled code with the fork ops: named are only the arm whose loads changed its
    own code's output and the graph without forks that is not the code's."""
    from l2prefetch.tuning.arms import NO_FORKS, no_forks_of
    from l2prefetch.tuning.arms import SAME_CODE

    pool, backend = _SharedOutput(), _cpu_graph_backend(monkeypatch)
    Graph = pool.graph
    ok, bad, broken = no_forks_of("ok"), no_forks_of("bad"), no_forks_of("broken")
    graphs = {(NO_FORKS, 0): Graph(1.0), (NO_FORKS, 1): Graph(1.0),
              (SAME_CODE, 0): Graph(2.0), (SAME_CODE, 1): Graph(2.0),
              ("ok", 0): Graph(2.0), ("ok", 1): Graph(2.0), (ok, 0): Graph(2.0),
              (ok, 1): Graph(2.0), ("bad", 0): Graph(2.0), ("bad", 1): Graph(3.0),
              (bad, 0): Graph(2.0), (bad, 1): Graph(2.0), ("alone", 0): Graph(2.0),
              ("broken", 0): Graph(5.0), (broken, 0): Graph(5.0)}
    out_of = {key: pool.out for key in graphs}
    references = {"ok": ok, "bad": bad, "broken": broken}
    backend.within_compilation = True
    with caplog.at_level(logging.WARNING, "l2prefetch.tuning.measure"):
        identical = backend._check_outputs(1, graphs, out_of, references)
    assert identical == {NO_FORKS: True, SAME_CODE: True, "ok": True, ok: True,
                         "bad": False, bad: True, "alone": True, "broken": False,
                         broken: False}      # broken: no better than its reference
    assert f"arm bad: outputs of instances [1] differ from {bad!r} (its own step" \
        in caplog.text
    # without SAME_CODE (an eager step's group), or across compilations: against (a)
    del graphs[(SAME_CODE, 0)], graphs[(SAME_CODE, 1)]
    assert backend._check_outputs(1, graphs, out_of, references) == {
        NO_FORKS: True, "ok": False, ok: False, "bad": False, bad: False, "alone": False,
        "broken": False, broken: False}


def test_the_report_says_the_replays_each_batch_took():
    """A backend whose replays depend on the batch (rounds None, Prepared.rounds): the
    profile's settings say None, each batch its own, and the report names them."""
    from l2prefetch.tuning.arms import Prepared

    class ByStep(Minimal):
        rounds = None

        def prepare(self, batch):
            p = self.planted.prepare(batch)
            return Prepared(p.step_us, p.capture_s, rounds={1: 17, 8: 11}[batch])

        def measure(self, batch, arms, instances):
            self.planted.rounds = 17 if batch == 1 else 11
            return self.planted.measure(batch, arms, instances)

    model, step = model_and_step()
    result = tuning.tune(model, step, [1, 8], candidates=[O_PROJ], progress=None,
                         backend=ByStep(DeviceBackend({O_PROJ: lambda s: 6.0}, seed=3)),
                         min_bytes=256 * 1024, budget_s=60)
    assert result.settings["rounds"] is None
    assert [b.rounds for b in result.batches] == [17, 11]
    assert "replays each by the step's time (17 at batch 1, 11 at batch 8)" in result.markdown()
    assert [b.as_dict()["rounds"] for b in result.batches] == [17, 11]   # the profile's results


def test_the_budget_prices_the_same_code_capture_within_one_compilation():
    """A backend comparing within one compilation captures one more graph per instance
    (SAME_CODE, never timed): each group costs that capture more, per instance."""
    from l2prefetch.tuning.arms import Prepared
    from l2prefetch.tuning.budget import Budget, Params

    backend = DeviceBackend({})
    params = Params(instances=5, max_instances=20, caps=(1 << 20,), grids=(32,),
                    kernels=(None,), graph_forks=("inline",), min_gain_us=0.5,
                    resolution=0.0005)
    budget = Budget(backend, params, deadline=100.0, clock=lambda: 0.0)
    budget.prepared = Prepared(step_us=1000.0, capture_s=0.25)
    across = budget.cost(3)
    backend.within_compilation = True
    assert budget.cost(3) == pytest.approx(across + 5 * 0.25 * 1.2)


def test_the_same_code_reference_is_the_compiled_step_forking_nowhere():
    """SAME_CODE is captured with the board on and no route (the compiled code with its
    fork ops, forking nowhere); (a) with the board off (the code compiled without)."""
    import l2prefetch.tuning.measure as M
    from l2prefetch.tuning.arms import NO_FORKS, SAME_CODE, Arm

    selected = []

    class Board:
        @contextlib.contextmanager
        def selected(self, controller, points):
            selected.append((controller, points))
            yield

    class Rig:
        def capture(self, fn, **kw):
            return fn(), None

    backend = M.GraphBackend.__new__(M.GraphBackend)
    backend._board, backend.rig = Board(), Rig()
    for name in (SAME_CODE, NO_FORKS):
        backend._capture(name, Arm(), {}, lambda: 1, warmup=False)
    assert selected == [(None, {}), (None, None)]


@pytest.mark.parametrize("case", ["shared", "private", "refused", "incapable", "not bitwise",
                                  "close fails", "both fail", "within", "within not bitwise"])
def test_graph_backend_pairs_each_fork_arm_with_its_graph_without_forks(case, monkeypatch,
                                                                        caplog):
    """Each captured graph with forks also replays without them (rig.NoForks), keyed
    no_forks_of(arm) (any arm name), paired with the arm (private placement: the two
    alone; shared: with every arm), and closed after the group. A NoForks that cannot
    be made (a driver before 12.3, say) leaves the arm compared with (a)'s captures, with
    a warning (a driver before 12.3: none is made again; one graph refused: that one
    only); one whose output is not the step's is not used. Every graph and controller is
    closed even when one close raises: that error is raised where measuring went well,
    and an error of measuring is what comes out where both fail."""
    import random

    import l2prefetch.tuning.measure as M
    from l2prefetch.tuning.arms import NO_FORKS, SAME_CODE, Arm, Setting, no_forks_of

    made = []

    class Graph:
        def replay(self):
            pass

    class FakeNoForks:
        def __init__(self, graph, nodes=None, *, device=None):
            if case == "refused":
                raise RuntimeError("removing the 1 loader nodes would unorder 1 pairs")
            if case == "incapable":
                raise l2prefetch.Error("a graph without its loader nodes needs driver 12.3")
            self.graph, self.closed = graph, False
            made.append(self)

        def replay(self):
            pass

        def close(self):
            self.closed = True

    closed = []

    class Controller:
        def close(self):
            closed.append(self)
            if case in ("close fails", "both fail") and len(closed) == 1:
                raise l2prefetch.CudaError("cuModuleUnload failed: CUDA_ERROR_UNKNOWN")

    timed = set()

    class FakeRig:
        def replays(self, graphs, rounds):
            timed.update(name for name, _ in graphs)
            if case == "both fail":
                raise l2prefetch.CudaError("cuGraphLaunch failed: CUDA_ERROR_ILLEGAL_ADDRESS")
            return {key: [1.0] * rounds for key in graphs}

    monkeypatch.setattr(M, "NoForks", FakeNoForks)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    backend = M.GraphBackend.__new__(M.GraphBackend)
    backend.torch, backend.device, backend.rounds = torch, torch.device("cpu"), 3
    backend.shared_placement, backend.switches = case != "private", False
    backend.derives_no_forks, backend.references = True, {}
    backend._captured, backend._outputs, backend.step = 0, {}, lambda batch: torch.ones(2)
    backend._placements = random.Random(0)
    backend.rig = FakeRig()
    backend._controller = lambda arm, batch: Controller()
    names = []                          # what each instance captured
    backend._capture = lambda name, *a, **kw: names.append(name) or (Graph(), torch.ones(2))
    within = case.startswith("within")  # a compiled step whose compilations differ
    if within:
        backend.within_compilation, backend._board = True, object()
    checked, handed = {}, []

    def check(batch, graphs, out_of, references=None):
        handed.append(references)
        checked.update({name: True for name, _ in graphs})
        if case.endswith("not bitwise"):
            checked[no_forks_of("tuned")] = False
        return dict(checked)
    backend._check_outputs = check
    arms = {NO_FORKS: Arm(), "tuned": Arm((("r", Setting(1 << 20)),))}
    own = no_forks_of("tuned")
    assert own == "a:of:tuned"
    arms["tuned 2"] = Arm((("r", Setting(2 << 20)),))
    if case in ("close fails", "both fail"):
        with caplog.at_level(logging.WARNING, "l2prefetch.tuning.measure"):
            with pytest.raises(l2prefetch.CudaError,
                               match="cuModuleUnload" if case == "close fails" else "cuGraphLaunch"):
                backend.measure(1, arms, 2)
        assert len(closed) == 2 and made and all(f.closed for f in made)
        assert ("cuModuleUnload" in caplog.text) == (case == "both fail")
        return
    del arms["tuned 2"]
    with caplog.at_level(logging.WARNING, "l2prefetch.tuning.measure"):
        times, identical = backend.measure(1, arms, 2)
    assert all(f.closed for f in made)
    if case in ("refused", "incapable"):
        assert set(times) == set(arms) and backend.references == {} and made == []
        assert "arm tuned: no graph without its forks" in caplog.text
        assert backend.derives_no_forks is (case == "refused")
        assert backend.pairs == [set(arms)]
        return
    assert set(times) == {NO_FORKS, "tuned", own} and len(made) == 2
    assert handed == [{"tuned": own}]
    if case.endswith("not bitwise"):
        assert backend.references == {} and identical[own] is False
        assert backend.pairs == [set(arms)]
        return
    assert backend.references == {"tuned": own}
    assert backend.pairs == ([{NO_FORKS, "tuned", own}] if case != "private" else [{"tuned", own}])
    # within one compilation each instance also captures the compiled code forking
    # nowhere (the bitwise checks' reference), never timed as an arm
    assert names.count(SAME_CODE) == (2 if within else 0)
    assert (SAME_CODE in checked) == within and SAME_CODE not in timed


# -- interrupted, and two writers at once (issue 38.7) -----------------------------------------

class Interrupting(DeviceBackend):
    """A DeviceBackend whose ``at``-th measured group is interrupted (Ctrl-C)."""

    def __init__(self, *args, at=3, **kwargs):
        super().__init__(*args, **kwargs)
        self.at, self.measured = at, 0

    def measure(self, batch, arms, instances):
        self.measured += 1
        if self.measured == self.at:
            raise KeyboardInterrupt
        return super().measure(batch, arms, instances)


def module_hooks(model):
    return [(name, kind) for name, module in model.named_modules()
            for kind in ("_forward_hooks", "_forward_pre_hooks") if getattr(module, kind)]


@pytest.mark.parametrize("where", ["measuring", "discovering"])
def test_a_keyboard_interrupt_during_tune_propagates_and_leaves_the_model_as_it_was(where):
    """Ctrl-C in the middle of tune() is a KeyboardInterrupt out of it (never a StepError,
    a partial result or swallowed), and the model keeps no hook of the tuner's."""
    model, step = model_and_step()
    gains = {O_PROJ: lambda s: 9.0, GATE: lambda s: -4.0}
    backend = Interrupting(gains, seed=11, at=3)
    calls = []

    def interrupted_step(batch):
        calls.append(batch)
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        tuning.tune(model, interrupted_step if where == "discovering" else step, [1, 8],
                    backend=backend, progress=None, min_bytes=256 * 1024)
    assert module_hooks(model) == []
    if where == "measuring":
        assert backend.measured == 3
    else:
        assert calls == [1] and backend.measured == 0
    # the same model tunes as ever afterwards
    result = tuning.tune(model, step, [1], backend=DeviceBackend(gains, seed=11),
                         progress=None, min_bytes=256 * 1024)
    assert not result.empty and module_hooks(model) == []


def test_a_keyboard_interrupt_while_measuring_on_the_gpu_closes_every_graph_and_controller(
        monkeypatch):
    """GraphBackend.measure interrupted while replaying: every controller it made (their
    tables, streams and events) and every graph without forks is closed, then the
    KeyboardInterrupt goes on."""
    import random

    import l2prefetch.tuning.measure as M
    from l2prefetch.tuning.arms import NO_FORKS, Arm, Setting

    closed = []

    class Closing:
        def __init__(self, *args, **kwargs):
            pass

        def replay(self):
            pass

        def close(self):
            closed.append(self)

    class InterruptedRig:
        def replays(self, graphs, rounds):
            raise KeyboardInterrupt

    monkeypatch.setattr(M, "NoForks", Closing)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    backend = M.GraphBackend.__new__(M.GraphBackend)
    backend.torch, backend.device, backend.rounds = torch, torch.device("cpu"), 3
    backend.shared_placement, backend.switches = True, False
    backend.derives_no_forks, backend.references = True, {}
    backend._captured, backend._outputs, backend.step = 0, {}, lambda batch: torch.ones(2)
    backend._placements = random.Random(0)
    backend.rig = InterruptedRig()
    made = []
    backend._controller = lambda arm, batch: made.append(Closing()) or made[-1]
    backend._capture = lambda *a, **kw: (Closing(), torch.ones(2))
    backend._check_outputs = lambda batch, graphs, out_of, references=None: {}
    arms = {NO_FORKS: Arm(), "tuned": Arm((("r", Setting(1 << 20)),))}
    with pytest.raises(KeyboardInterrupt):
        backend.measure(1, arms, 2)
    assert made and all(c in closed for c in made)
    assert len(closed) > len(made)                    # the graphs without forks too


def test_an_interrupted_save_leaves_the_old_profile_whole(tmp_path, monkeypatch):
    """Ctrl-C while the profile is written: the file there before is as it was, and no
    temporary file is left (write_atomic writes beside it and renames)."""
    import os

    from l2prefetch import _files

    model, result = tuned()
    path = tmp_path / "p.json"
    result.save(path, model)
    before = path.read_bytes()
    other_model, other = tuned(batches=(1,))
    real_write = os.write

    def half_then_interrupt(fd, data):
        real_write(fd, bytes(data[:len(data) // 2]))
        raise KeyboardInterrupt
    monkeypatch.setattr(_files.os, "write", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        other.save(path, other_model)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


CONCURRENT_SAVE = """
import os, sys, time
sys.path[:0] = sys.argv[4].split("|")
import torch
import _tuning_fakes as fakes
from l2prefetch import tuning

batches = [int(b) for b in sys.argv[2].split(",")]
model = fakes.llama(n_layers=3, h=1024, i=2048, kv=256)
x = {}
def step(batch):
    return model(x.setdefault(batch, torch.zeros(batch, 1, 1024, dtype=torch.bfloat16)))
result = tuning.tune(model, step, batches, progress=None, min_bytes=256 * 1024,
                     backend=fakes.DeviceBackend({"after self_attn.v_proj: self_attn.o_proj":
                                                  lambda s: 9.0}, seed=11))
print("ready", flush=True)
while not os.path.exists(sys.argv[3]):   # the go: both are ready
    time.sleep(0.001)
for _ in range(60):
    result.save(sys.argv[1], model)
print("saved")
"""


def test_two_processes_saving_one_profile_at_once_leave_one_whole_profile(tmp_path):
    """Two processes save their profiles to one path at once, over and over: each save is
    whole (a reader meanwhile sees one profile or the other, never a mix or half), none
    fails, and no temporary file is left."""
    import os
    import subprocess

    from l2prefetch import _files

    path = tmp_path / "p.json"
    here = os.path.dirname(os.path.abspath(__file__))
    # the l2prefetch this process imported (an installed one, as under dev.sh, has its
    # _C; a fresh clone's python/ has none built in place)
    where = "|".join([here, os.path.dirname(os.path.dirname(l2prefetch.__file__)), *sys.path])
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT_SAVE, str(path), batches,
                               str(go), where], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for batches in ("1", "1,8")]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.communicate(timeout=120)[1]
    go.write_text("")
    seen = set()
    while any(p.poll() is None for p in procs):
        try:
            text = _files.read_text(path, "profile")
        except FileNotFoundError:
            continue
        seen.add(tuple(P.parse_profile(text, str(path))["batches"]))   # whole, or it raises
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "saved", err
    assert tuple(P.parse_profile(path.read_text(), str(path))["batches"]) in {(1,), (1, 8)}
    assert seen <= {(1,), (1, 8)} and seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "p.json"]


def test_two_threads_saving_one_profile_at_once_both_succeed(tmp_path):
    """Two threads of one process save to one path at once: neither takes the other's
    temporary file for one left behind (before, the second failed 'is in the way')."""
    import threading

    from l2prefetch import _files

    model, result = tuned()
    path = tmp_path / "p.json"
    errors, barrier = [], threading.Barrier(2)
    original_create = _files._create

    def slow_create(tmp):
        fd = original_create(tmp)
        barrier.wait(timeout=10)       # both temporaries exist at once
        return fd

    def save():
        try:
            result.save(path, model)
        except BaseException as exc:   # noqa: BLE001 - reported below
            errors.append(exc)
    _files._create = slow_create
    try:
        threads = [threading.Thread(target=save) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        _files._create = original_create
    assert errors == []
    assert json.loads(path.read_text())["format"] == P.PROFILE_FORMAT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


# ---- how the tuned step ran (issue 40) ----

@pytest.mark.parametrize("compiled, step", [
    (None, {"compiled": False, "mode": None}), (False, {"compiled": False, "mode": None}),
    (True, {"compiled": True, "mode": None}),
    ("max-autotune-no-cudagraphs", {"compiled": True, "mode": "max-autotune-no-cudagraphs"})])
def test_the_result_and_its_profile_record_how_the_step_ran(compiled, step, tmp_path):
    model, result = tuned(batches=(1,), compiled=compiled)
    assert {k: result.step[k] for k in ("compiled", "mode")} == step
    assert result.step["torch"] == torch.__version__
    profile = result.to_profile(model)
    assert profile["step"] == result.step
    say = "compiled steps only" if step["compiled"] else "eager steps only"
    assert say in result.summary().splitlines()[0]
    assert say in result.markdown()
    path = tmp_path / "p.json"
    result.save(path, model)
    assert tuning.load_profile(path, model, check_device=False).step == result.step


@pytest.mark.parametrize("bad, error", [(0, TypeError), ("", ValueError), ("  ", ValueError),
                                        (1.5, TypeError), (["default"], TypeError)])
def test_tune_refuses_a_bad_compiled(bad, error):
    model, step = model_and_step()
    with pytest.raises(error, match="compiled must be None"):
        tuning.tune(model, step, [1], backend=DeviceBackend({}, seed=1), progress=None,
                    compiled=bad)


@pytest.mark.parametrize("declared", [False, True])
def test_tune_with_a_backend_records_how_the_backend_s_step_runs(declared):
    """compiled=None is found out; with a backend given, the backend (which runs the
    step) says: its ``compiled``.  A compiled step recorded as eager would make a profile
    whose controller refuses the very forks it was measured with."""
    model, step = model_and_step()
    backend = DeviceBackend({}, seed=1)
    backend.compiled = declared
    result = tuning.tune(model, step, [1], backend=backend, progress=None, budget_s=1,
                         min_bytes=256 * 1024)
    assert result.step["compiled"] is declared
    # named, the caller's word is recorded
    result = tuning.tune(model, step, [1], backend=backend, progress=None, budget_s=1,
                         min_bytes=256 * 1024, compiled=not declared)
    assert result.step["compiled"] is (not declared)


def test_the_report_says_when_only_the_plan_s_empty_forks_changed_the_outputs():
    """A confirmation refused because the plan's forks with empty tables changed the
    outputs (EMPTY_FORKS_DIFFER) is not shown as bitwise equal."""
    from l2prefetch.tuning.arms import Setting
    from l2prefetch.tuning.report import markdown
    from l2prefetch.tuning.results import BatchReport, Confirmation
    from l2prefetch.tuning.stats import Interval
    from l2prefetch.tuning.tuner import TuneResult

    def at(x):
        return Interval(x, x - 1, x + 1, 5)

    def row(**outputs):
        conf = Confirmation(roles=(("r", Setting(4 << 20)),), a=at(100.0), plan=at(90.0),
                            gain=at(10.0), loads=at(9.0), forks=at(1.0), **outputs)
        rep = BatchReport(batch=1, step_us=100.0, confirmations=[conf], reason="-")
        result = TuneResult(batches=[rep], roles=[], plan=[], sites={}, budget_s=1.0,
                            elapsed_s=1.0, settings={})
        line = next(x for x in markdown(result).splitlines() if x.startswith("| r ["))
        return line.rstrip(" |").rsplit("|", 1)[-1].strip()

    assert row(identical=True) == "yes"
    assert row(identical=True, empty_identical=False) == "NO (the empty forks)"
    assert row(identical=False, empty_identical=False) == "NO"


def test_tune_says_when_the_budget_ran_out_before_any_role_was_measured():
    import io

    model, step = model_and_step()
    out = io.StringIO()
    result = tuning.tune(model, step, [1], candidates=[O_PROJ], progress=out, budget_s=0.01,
                         backend=DeviceBackend({O_PROJ: lambda s: 5.0}, seed=3),
                         min_bytes=256 * 1024)
    # Which of the two reasons depends on the wall clock: on a loaded machine finding the
    # roles alone can spend the 10 ms, and the batch is then not prepared at all.  Both
    # are "before any role was measured"; test_tuning_search pins each with a fake clock.
    assert result.batches[0].reason in (NOTHING_MEASURED, NOT_PREPARED)
    text = out.getvalue()
    assert ("at batch(es) 1 the budget ran out before any role was measured" in text
            and "raise budget_s (--budget)" in text), text
    assert text.strip().splitlines()[-1].startswith("[l2prefetch tune] done in")


@pytest.mark.parametrize("budget_s", [8.0, 40.0])
def test_tune_says_which_roles_the_budget_left_unrefined(budget_s):
    """A short budget sweeps the roles at the default grid and kernel only: tune's last
    lines and the report say so and how to have the others tried; a budget with room for
    them says nothing of it."""
    import io

    model, step = model_and_step()
    out = io.StringIO()
    result = tuning.tune(model, step, [1], progress=out, budget_s=budget_s,
                         backend=DeviceBackend({O_PROJ: lambda s: 5.0}, seed=3),
                         min_bytes=256 * 1024)
    (rep,) = result.batches
    text, report = out.getvalue(), result.markdown()
    if budget_s < 10:
        # the paying role leads, and the sweeps kept its refine back (test_tuning_search)
        assert rep.not_refined and O_PROJ not in rep.not_refined
        assert (f"at batch(es) 1 the budget left no room to try other grids and kernels for "
                f"{len(rep.not_refined)} promising role(s)" in text
                and "a larger budget_s (--budget), or fewer roles (candidates=, --roles), "
                    "tries them" in text), text
        assert f"Not refined: {', '.join(rep.not_refined)}." in report
    else:
        assert rep.not_refined == []
        assert "no room to try" not in text and "Not refined" not in report
    assert text.strip().splitlines()[-1].startswith("[l2prefetch tune] done in")


def test_tune_counts_each_unrefined_role_once_over_the_batches():
    import io

    model, step = model_and_step()
    out = io.StringIO()
    result = tuning.tune(model, step, [1, 8], progress=out, budget_s=16.0,
                         backend=DeviceBackend({O_PROJ: lambda s: 5.0}, seed=3),
                         min_bytes=256 * 1024)
    per_batch = [set(rep.not_refined) for rep in result.batches]
    assert all(per_batch) and per_batch[0] & per_batch[1]   # some role left at both
    assert (f"at batch(es) 1, 8 the budget left no room to try other grids and kernels "
            f"for {len(per_batch[0] | per_batch[1])} promising role(s)" in out.getvalue())


def test_a_tune_whose_roles_took_the_budget_saves_a_profile_any_json_reader_reads(tmp_path):
    """Finding the roles spent the whole budget: tune gives the search none (not a
    negative budget), no batch is prepared, and the saved profile says so with a null
    step time, not NaN, which JSON lacks (Python's reader takes it, others refuse it)."""
    model, step = model_and_step()
    backend = DeviceBackend({O_PROJ: lambda s: -1.0}, seed=4)
    out = io.StringIO()
    result = tuning.tune(model, step, [1, 8], backend=backend, progress=out,
                         min_bytes=256 * 1024, budget_s=1e-9)
    assert backend.prepared == []
    # no batch was prepared: the hint blames finding the roles alone
    assert ("at batch(es) 1, 8 the budget ran out before any role was measured: finding "
            "the roles took it (see below)") in out.getvalue(), out.getvalue()
    assert all(rep.reason == NOT_PREPARED for rep in result.batches)
    path = tmp_path / "p.json"
    result.save(path, model)

    def refuse(name):
        raise ValueError(f"{name} in the profile")

    data = json.loads(path.read_text(), parse_constant=refuse)
    assert [r["step_us"] for r in data["results"]] == [None, None]
    assert tuning.load_profile(path, model, check_device=False).plan == []


def test_the_profile_writer_refuses_nan(tmp_path):
    with pytest.raises(ValueError, match="JSON compliant"):
        P._compact_json({"results": [{"step_us": math.nan}]})
    # save_profile names where, and writes nothing
    model, result = tuned()
    document = json.loads(json.dumps(result.to_profile(model)))
    document["results"][1]["spread"] = {"sd_us": math.inf}
    path = tmp_path / "p.json"
    with pytest.raises(ValueError, match=r"results\[1\]\.spread\.sd_us = inf is not a "
                                         r"finite number.*nothing was written"):
        P.save_profile(path, document)
    assert not path.exists()


def test_a_batch_not_prepared_shows_no_step_time():
    """A batch the search did not prepare (its share of the budget was less than the last
    batch's preparation took) has no step time: the report's verdict leaves it blank and
    tune's last line says it was not prepared, neither writes 'nan'."""
    from l2prefetch.tuning.report import markdown
    from l2prefetch.tuning.results import BatchReport
    from l2prefetch.tuning.search import NOTHING_MEASURED
    from l2prefetch.tuning.tuner import TuneResult, _time_went

    reps = [BatchReport(batch=1, step_us=100.0, reason=NOTHING_MEASURED, elapsed_s=12.0),
            BatchReport(batch=8, reason=NOT_PREPARED)]
    result = TuneResult(batches=reps, roles=[], plan=[], sites={}, budget_s=1.0,
                        elapsed_s=1.0, settings={})
    text = markdown(result)
    assert "nan" not in text.lower()
    assert re.search(r"^\| 8 \|  \| empty \|", text, re.M), text
    assert re.search(r"^\| 1 \| 100\.0 \| empty \|", text, re.M), text
    # the step us column stays right-aligned with a blank cell; batch 8's section says
    # why it has no roles table
    assert "|---:|---:|---|" in text, text
    assert "## Batch 8\n\nNot prepared: its share of the budget" in text, text
    went = _time_went(30.0, reps, compiled=True)
    assert went == ("finding the roles and screening their sites 30 s, batch 1 12 s "
                    "(compilations included), batch 8 not prepared")


def test_with_prefetching_off_the_readmes_start_up_runs_without_a_driver(tmp_path,
                                                                         monkeypatch):
    """L2PREFETCH_DISABLE=1: the README's start-up (load_profile, from_profile,
    hooks.attach) runs where no driver is (CPU, CI) or on another GPU than the profile's:
    the device is not checked, since nothing is prepared; the file and the model are."""
    model, result = tuned()
    path = tmp_path / "model.l2p.json"
    result.save(path, model)
    monkeypatch.setenv("L2PREFETCH_DISABLE", "1")
    profile = P.load_profile(path, model)          # checks the device by default
    assert profile.plan
    controller = l2prefetch.PrefetchController.from_profile(profile, model)
    assert controller.fork(profile.plan[0].point, profile.plan[0].layer, 1) is False
    attached = hooks.attach(model, controller, profile.hook_points)
    try:
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    finally:
        attached.detach()
    l2prefetch.PrefetchController.from_profile(path, model).close()   # from the path too
    controller.close()
    # prefetching on again: the profile loaded while it was off is checked before it
    # applies (here: no driver, or a GPU other than the fakes' own)
    monkeypatch.delenv("L2PREFETCH_DISABLE")
    with pytest.raises((l2prefetch.CudaUnavailableError, P.ProfileMismatchError)):
        l2prefetch.PrefetchController.from_profile(profile, model)
    with pytest.raises((l2prefetch.CudaUnavailableError, P.ProfileMismatchError)):
        profile.check_device()          # the public check does not skip: nothing is off
    monkeypatch.setenv("L2PREFETCH_DISABLE", "1")
    with pytest.raises((l2prefetch.CudaUnavailableError, P.ProfileMismatchError)):
        profile.check_device()          # nor with prefetching off: it answers its question
    # the model is still checked: a profile of another model is refused
    other, _ = model_and_step()
    other.model.layers = other.model.layers[:2]
    with pytest.raises(P.ProfileMismatchError, match="decoder layers"):
        P.load_profile(path, other)


def test_loading_a_profile_warns_of_a_switch_value_it_does_not_know(tmp_path, monkeypatch,
                                                                     caplog):
    """L2PREFETCH_DISABLE=ture leaves prefetching on: load_profile, the first thing a
    server's start-up calls, says so before it checks the device (on a machine without
    a driver, that check is what fails next)."""
    from l2prefetch import disable

    _, path, _ = saved(tmp_path)
    model, _ = model_and_step()
    monkeypatch.setenv("L2PREFETCH_DISABLE", "ture")
    monkeypatch.setattr(disable, "_warned_values", set())
    with caplog.at_level(logging.WARNING, logger="l2prefetch"):
        try:
            P.load_profile(path, model)
        except (l2prefetch.CudaUnavailableError, P.ProfileMismatchError):
            pass   # no driver here, or a GPU other than the profile's
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING][:1] == [
        "L2PREFETCH_DISABLE='ture' is not a word it knows, so prefetching stays on: set it "
        "to 1 (true, yes, on) to turn prefetching off, or 0 (false, no, off) to say it is on"]


def test_a_profile_prints_as_one_line(tmp_path):
    """repr(profile): the file, the GPU, the step, the plan's size, not its 100 KB of
    trials (a log line)."""
    model, result = tuned()
    path = tmp_path / "p.json"
    result.save(path, model)
    profile = P.load_profile(path, model, check_device=False)
    text = repr(profile)
    assert "\n" not in text and len(text) < 300, text
    # a hand-made profile missing fields still prints (a repr that raises breaks logging)
    for data in ({}, {"device": "x", "step": {}}, {"step": {"compiled": True}}, None):
        made = repr(P.Profile(data=data, plan=[], sites={1: [], "a": []}))
        assert "\n" not in made and made.startswith(("Profile(", "<l2prefetch.profile.Profile"))
    made = repr(P.Profile(data={"step": {"compiled": True}}, plan=[], sites={}))
    assert made == "Profile(path=None, device=None, step=compiled, entries=0, points=[])", made
    assert text.startswith(f"Profile(path={str(path)!r}, device={FAKE_DEVICE['name']!r}, "
                           f"step=eager, entries={len(profile.plan)}, points=["), text



def test_tune_says_where_a_plan_rests_on_its_confirmation_alone(caplog):
    """A batch whose lead was kept without a verify (no verify fit the budget): tune's
    last lines say so, and how to have the others verified and combined."""
    from types import SimpleNamespace

    from l2prefetch.tuning import search as S, tuner
    from l2prefetch.tuning.results import BatchReport, RoleReport

    def batch(b, reason):
        rep = BatchReport(b)
        rep.step_us, rep.elapsed_s = 1000.0, 50.0
        rep.roles = [RoleReport("r", 6, 1 << 20)]
        rep.roles[0].reason = reason
        return rep

    result = SimpleNamespace(step={"compiled": "default"}, elapsed_s=120.0,
                             batches=[batch(1, "kept: gain +1.00 [+0.50, +1.50] us per step"),
                                      batch(8, S.CONFIRMED_UNVERIFIED)])
    out = io.StringIO()
    with caplog.at_level(logging.INFO, logger=tuner.logger.name):
        tuner._last_lines(result, 10.0, SimpleNamespace(within_compilation=False), out)
    line = ("at batch(es) 8 no verify fit the budget: the plan is the lead role alone, kept "
            "on its confirmation")
    assert line in out.getvalue() and line in caplog.text
    assert "at batch(es) 1" not in out.getvalue()
