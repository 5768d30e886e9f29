"""Bad input for every public entry point, as one table (issue "Reliability").

Each row is one test: the entry point, the input in words, the call, and what
must happen: ``Raises(exact exception type, regex the message must match)``,
``Returns(value)`` where the input is valid after all (zero-size and zero-dim
tensors, unknown points) or ``Exits(status, regex on stderr)`` for the command
line.  The regex names the problem (the argument, the weight, the device, the
alignment), so that a message that stops saying what went wrong fails here.

CUDA is the recording stand-in (tests/fakecuda) with two devices; the side
stream is always an explicit handle (``stream=S``).  Device tensors are
``FakeArray``s (``__cuda_array_interface__``) or meta tensors that say they
live on ``cuda:N`` (:func:`cuda_tensor`).  After every row no stream or event
is left alive and nothing was destroyed twice.

Many of these cases are also tested next to the code they exercise
(test_ranges.py, test_prepared_fake.py, test_controller_fake.py, test_plan.py,
test_hooks.py, test_cli_plan.py ...); this file is the summary, README.md's
bad-input table the short form of it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import gc
import json
import os
import pickle
import re
import subprocess
import sys
import types
from typing import Any, Callable
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import l2prefetch  # noqa: E402
from l2prefetch import PlanEntry, _C, deepseek_v3, hooks, kimi_k3, tuning  # noqa: E402
from l2prefetch.__main__ import main  # noqa: E402
from l2prefetch.cli import build_synthetic_kimi, plan_main  # noqa: E402
from l2prefetch.controller import empty_controller  # noqa: E402
from l2prefetch.plan import (cap_groups, format_plan, gate, plan_from_json,  # noqa: E402
                             plan_to_json)
from l2prefetch.profile import model_fingerprint, profile_document, save_profile  # noqa: E402
from l2prefetch.tuning import load_profile  # noqa: E402
from conftest import FakeArray, Raising, cuda_tensor, device_ptr  # noqa: E402

compute_ranges = l2prefetch.compute_ranges
PWR = l2prefetch.PreparedWeightRanges
PC = l2prefetch.PrefetchController
Error, CudaError = l2prefetch.Error, l2prefetch.CudaError

S = 0x5000                  # a stream handle (the stand-in accepts any)
P0, P1 = device_ptr(0), device_ptr(1)   # addresses on cuda:0 and cuda:1
TOO_WIDE = ((1 << 62, 4), "|u1", (1 << 62, 1))   # shape, typestr, strides: span > 2**64


# -- outcomes -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Raises:
    exc: type                # the exact type, not a base class
    match: str               # re.search on str(exception)


@dataclasses.dataclass(frozen=True)
class Returns:
    value: Any               # == the call's result


@dataclasses.dataclass(frozen=True)
class Exits:
    status: int              # the call returns an exit status
    match: str               # re.search on what it wrote to stderr


# -- inputs ---------------------------------------------------------------------------------

def arr(i=0, n=1024, device=0, typestr="<f2"):
    """A device array of n elements at the i-th 64 KiB slot of `device`."""
    return FakeArray(device_ptr(device, i * 65536), (n,), typestr)





def cpu(*shape, dtype=torch.float16):
    return torch.zeros(*shape, dtype=dtype)


def misaligned_cpu():
    return cpu(9)[1:]   # 2 bytes past the (64-byte aligned) allocation


def deepseek_model(layers=2):
    """The module names deepseek_v3.plan reads (HF's DeepseekV3), on the meta device."""
    model = nn.Module()
    model.layers = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        layer.self_attn = nn.Module()
        for name in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            setattr(layer.self_attn, name, nn.Linear(4, 4, bias=False, device="meta"))
        layer.mlp = nn.Module()
        layer.mlp.gate = nn.Linear(4, 2, bias=False, device="meta")
        layer.mlp.experts = nn.ModuleList()
        model.layers.append(layer)
    return model


def kimi_layer(layer_idx):
    """A Kimi-shaped MoE layer whose layer_idx is whatever the row says."""
    linear = types.SimpleNamespace(weight=torch.empty(4, 4, device="meta"))
    return types.SimpleNamespace(
        layer_idx=layer_idx, is_moe_layer=True,
        self_attn=types.SimpleNamespace(o_proj=linear),
        mlp=types.SimpleNamespace(shared_experts=types.SimpleNamespace(gate_up_proj=linear,
                                                                      down_proj=linear)))


class ReprRaises(int):
    """An int whose repr raises: a message showing it passes the error on, not a label."""

    def __repr__(self):
        raise ValueError("its repr raised")


def _document(e, sites):
    """profile_document for e.model, a plan of its one weight at ('attn', 0), and sites."""
    plan = [PlanEntry("attn", 0, [1], (e.model[0].weight,))]
    return profile_document(e.model, plan, sites, batches=[1], device=None, versions=None,
                            step={"compiled": False}, tuning={}, results=[])


def plan_json(version=1, **fields):
    entry = {"point": "attn", "layer": 0, "batches": [1], "weights": ["0.weight"], **fields}
    return json.dumps({"version": version, "entries": [entry]})


class AddWithoutGraphFork(PC):
    """A controller whose add() takes no graph_fork= (the C type's before it did)."""

    def add(self, point, layer, batches, ranges):
        return super().add(point, layer, batches, ranges)


class AddWithGraphFork(PC):
    """A controller whose add() takes graph_fork= and records what it was given."""

    def add(self, point, layer, batches, ranges, **graph_fork):
        self.__dict__.setdefault("modes", {})[(point, layer)] = graph_fork.pop("graph_fork",
                                                                             "not passed")
        assert not graph_fork, graph_fork
        return super().add(point, layer, batches, ranges)


def subprocess_status(*args):
    """Run `python -m l2prefetch ARGS`; copy its stderr to ours; return its exit status."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(l2prefetch.__path__[0]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "l2prefetch", *args], capture_output=True,
                          text=True, env=env, timeout=120)
    sys.stderr.write(proc.stderr)
    return proc.returncode


class RaisingStream:
    """A stream whose cuda_stream raises exc."""

    def __init__(self, exc):
        self.exc = exc

    @property
    def cuda_stream(self):
        raise self.exc


def odd_device_tensor(index):
    """A meta tensor whose device says cuda with this index (not a torch.device)."""

    class OddDeviceTensor(torch.Tensor):
        @property
        def device(self):
            return types.SimpleNamespace(type="cuda", index=index)

        def data_ptr(self):
            return P0

    return torch.Tensor._make_subclass(OddDeviceTensor, torch.empty(8, device="meta"))


class SubController(PC):
    """A subclass with a constructor argument of its own (not a device)."""

    def __init__(self, name, device=None):
        super().__init__(device)
        self.name = name


class ForgetfulController(PC):
    """A subclass whose __init__ never calls the base's."""

    def __init__(self):
        pass


def disabled_everywhere(value):
    """(hooks.disabled(), l2prefetch.disabled(), not PrefetchController().enabled) under
    L2PREFETCH_DISABLE=value: one parser, one rule."""
    with mock.patch.dict(os.environ, {"L2PREFETCH_DISABLE": value}):
        return hooks.disabled(), l2prefetch.disabled(), not PC(device=0).enabled


CHILD_NVRTC = """
import json, os, site, sys
planted = os.path.join(os.getcwd(), "nvidia", "cu13", "lib", "libnvrtc.so.13")
sys.path[1:1] = ["/nonexistent/\\udcff"]       # a sys.path entry that is not UTF-8
real = site.getsitepackages
site.getsitepackages = lambda: real() + ["/nonexistent/\\udcff", "/nonexistent/\\ud800"]
from l2prefetch import _C, CudaUnavailableError
try:
    path = _C.nvrtc_info()["path"]
except CudaUnavailableError as exc:
    path = str(exc)
print(json.dumps(planted in path))
"""


def planted_nvrtc_loaded(tmp_path, fakenvrtc):
    """`python -m` from a folder holding nvidia/cu13/lib/libnvrtc.so.13 (a loadable NVRTC,
    the stand-in): whether NVRTC is looked for (or loaded) there.  sys.path[0] is that
    folder, and a non-UTF-8 entry is on sys.path and site-packages."""
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnvrtc.so.13").write_bytes(open(fakenvrtc, "rb").read())
    (tmp_path / "probe_nvrtc.py").write_text(CHILD_NVRTC)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(l2prefetch.__path__[0]))
    env.pop("L2PREFETCH_LIBNVRTC", None)
    proc = subprocess.run([sys.executable, "-m", "probe_nvrtc"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _loaded_after(change):
    """A row's call: load_profile (no device check) of e.profile(change) for e.model."""
    return lambda e: load_profile(e.profile(change), e.model, check_device=False)


def _changed_after_load(e, change):
    """load_profile for e.model, then ``change(e.model)``, then the profile's check_model."""
    profile = load_profile(e.profile(), e.model, check_device=False)
    change(e.model)
    return profile.check_model(e.model)


def exit_status(fn, *args):
    """fn(*args)'s return value, or the code of the SystemExit it raised."""
    try:
        return fn(*args)
    except SystemExit as exc:
        return exc.code


class Env:
    """What the rows use, made on first use (each row gets a fresh one)."""

    def __init__(self, fake, tmp_path):
        self.fake, self.tmp_path = fake, tmp_path

    @functools.cached_property
    def table(self):        # a prepared table on cuda:0, 4 KiB in two ranges
        return PWR([arr(0), arr(1)])

    @functools.cached_property
    def table1(self):       # one on cuda:1
        return PWR([arr(0, device=1)])

    @functools.cached_property
    def ctl(self):          # a controller of cuda:0 with ("attn", 0, 1..2) registered
        c = PC(device=0)
        c.add("attn", 0, [1, 2], self.table)
        return c

    @functools.cached_property
    def pending(self):      # ... after a fork: join() has work to do
        assert self.ctl.fork("attn", 0, 1, stream=S)
        return self.ctl

    @functools.cached_property
    def closed(self):
        self.ctl.close()
        return self.ctl

    @functools.cached_property
    def ctl1(self):         # a controller of cuda:1 (its side stream is of cuda:1's context)
        return PC(device=1)

    @functools.cached_property
    def stream1(self):      # a torch-like stream of cuda:1
        return types.SimpleNamespace(cuda_stream=S, device=torch.device("cuda", 1))

    @functools.cached_property
    def entry(self):        # a plan entry of cuda:0 weights
        return PlanEntry("attn", 0, [1], (cuda_tensor(P0),))

    @functools.cached_property
    def entry_branch(self):  # ... whose forks go into a captured graph as a side branch
        return PlanEntry("attn", 0, [1], (cuda_tensor(P0),), graph_fork="branch")

    @functools.cached_property
    def model(self):        # a one-layer CPU model for hooks and plan JSON
        return nn.Sequential(nn.Linear(4, 4))

    @functools.cached_property
    def twin(self):         # another model of self.model's shapes
        return nn.Sequential(nn.Linear(4, 4))

    def attach(self, controller, points=...):
        """hooks.attach on self.model; by default a fork of ("attn", 0) after its Linear."""
        return hooks.attach(self.model, controller,
                            {"attn": [(self.model[0], 0)]} if points is ... else points)

    def forward(self):
        return self.model(torch.zeros(2, 4)).shape

    def shapes_status(self, dims):
        """plan_main(["--shapes", FILE]) with dims written to FILE."""
        path = self.tmp_path / "shapes.json"
        path.write_text(json.dumps(dims))
        return plan_main(["--shapes", str(path)])

    def profile(self, change=None, text=None):
        """The path of a profile of self.model (one entry: "attn" at layer 0, batch 1),
        after ``change(data)``, or of ``text`` itself."""
        data = {"format": "l2prefetch-profile", "version": 1,
                "device": {"name": "NVIDIA H200", "sm": 90, "sm_count": 132,
                           "l2_bytes": 60 << 20, "driver_version": 13000},
                "model": {"class": "Sequential", "layers": 1,
                          "weights": {"0.weight": [[4, 4], "float32"]}},
                "batches": [1],
                "plan": [{"point": "attn", "layer": 0, "batches": [1], "weights": ["0.weight"],
                          "site": "0"}]}
        if change is not None:
            change(data)
        path = self.tmp_path / "p.json"
        path.write_text(json.dumps(data) if text is None else text)
        return path

    def fifo(self, name="fifo.json"):
        path = self.tmp_path / name
        os.mkfifo(path)
        return str(path)

    def tune_status(self, *argv):
        """l2prefetch tune ARGV (in this process), argparse's exits included."""
        from l2prefetch.tuning import cli as tuning_cli

        return exit_status(tuning_cli.main, list(argv))

    @functools.cached_property
    def fakenvrtc(self):    # the NVRTC stand-in, built once per session
        from _fakecuda import build_fakenvrtc
        return build_fakenvrtc(str(self.tmp_path.parent / "fakenvrtc-bad-inputs"))

    @functools.cached_property
    def kimi(self):         # (model, layers, packed) of a 3-layer synthetic Kimi on meta
        return build_synthetic_kimi({"layers": 3}, tp=8)


def row(entry: str, case: str, call: Callable[[Env], Any], outcome):
    return pytest.param(call, outcome, id=f"{entry}: {case}")


# -- the table ------------------------------------------------------------------------------

# fmt: off
ROWS = [
    # ---- compute_ranges(weights, byte_cap=0): arithmetic on any device ------------------------
    row("compute_ranges", "weights None", lambda e: compute_ranges(None),
        Raises(TypeError, r"weights must be a sequence of tensors, not NoneType")),
    row("compute_ranges", "weights an int", lambda e: compute_ranges(5),
        Raises(TypeError, r"weights must be a sequence of tensors, not int")),
    row("compute_ranges", "a single tensor, not a list", lambda e: compute_ranges(cpu(4)),
        Raises(TypeError, r"not a single Tensor; wrap it: \(w,\)")),
    row("compute_ranges", "a str", lambda e: compute_ranges("abc"),
        Raises(TypeError, r"not a single str; wrap it")),
    row("compute_ranges", "a None weight", lambda e: compute_ranges([cpu(8), None]),
        Raises(TypeError, r"weight 1 is a NoneType, not a tensor")),
    row("compute_ranges", "a non-tensor weight", lambda e: compute_ranges([object()]),
        Raises(TypeError, r"weight 0 is a object, not a tensor")),
    row("compute_ranges", "a Mock weight", lambda e: compute_ranges([mock.MagicMock()]),
        Raises(ValueError, r"weight 0: data_ptr\(\) must be a non-negative integer")),
    row("compute_ranges", "byte_cap None", lambda e: compute_ranges([cpu(8)], None),
        Raises(TypeError, r"byte_cap must be an int \(bytes\), not NoneType")),
    row("compute_ranges", "byte_cap a str", lambda e: compute_ranges([cpu(8)], "16"),
        Raises(TypeError, r"byte_cap must be an int \(bytes\), not str")),
    row("compute_ranges", "byte_cap a bool", lambda e: compute_ranges([cpu(8)], True),
        Raises(TypeError, r"byte_cap must be an int \(bytes\), not bool")),
    row("compute_ranges", "byte_cap a float", lambda e: compute_ranges([cpu(8)], 16.0),
        Raises(TypeError, r"byte_cap must be an int \(bytes\), not float")),
    row("compute_ranges", "byte_cap negative", lambda e: compute_ranges([cpu(8)], -16),
        Raises(ValueError, r"byte_cap must be >= 0 bytes \(0: no cap\), got -16")),
    row("compute_ranges", "byte_cap beyond 64 bits", lambda e: compute_ranges([cpu(8)], 2**64),
        Raises(OverflowError, r"byte_cap=18446744073709551616 does not fit in 63 bits")),
    row("compute_ranges", "byte_cap of 5000 digits", lambda e: compute_ranges([cpu(8)], 10**5000),
        Raises(OverflowError, r"byte_cap=<an int of 16610 bits> does not fit in 63 bits")),
    row("compute_ranges", "a data pointer of 5000 digits",
        lambda e: compute_ranges([FakeArray(10**5000, (8,))]),
        Raises(ValueError, r"must be a non-negative integer, got <an int of 16610 bits>")),
    row("compute_ranges", "no arguments", lambda e: compute_ranges(),
        Raises(TypeError, r"missing required argument 'weights'")),
    row("compute_ranges", "three arguments", lambda e: compute_ranges([], 0, 0),
        Raises(TypeError, r"takes at most 2 positional arguments \(3 given\)")),
    row("compute_ranges", "unknown keyword", lambda e: compute_ranges([], cap=16),
        Raises(TypeError, r"compute_ranges\(\) got an unexpected keyword argument 'cap'")),
    row("compute_ranges", "CPU tensor (valid: arithmetic)", lambda e: len(compute_ranges([cpu(8)])),
        Returns(1)),
    row("compute_ranges", "zero-dim tensor (valid: one element)",
        lambda e: compute_ranges([cuda_tensor(P0, ())]), Returns([(P0, 2)])),
    row("compute_ranges", "zero-size tensor (valid: skipped)",
        lambda e: compute_ranges([cuda_tensor(P0, (0, 8)), cuda_tensor(P0 + 4096, (8,))]),
        Returns([(P0 + 4096, 16)])),
    row("compute_ranges", "zero-size misaligned tensor (valid: skipped unchecked)",
        lambda e: compute_ranges([cuda_tensor(P0 + 2, (0,))]), Returns([])),
    row("compute_ranges", "no weights (valid)", lambda e: compute_ranges([]), Returns([])),
    row("compute_ranges", "misaligned CPU tensor", lambda e: compute_ranges([cpu(8), misaligned_cpu()]),
        Raises(ValueError, r"16-byte aligned: weight 1 \(shape torch.Size\(\[8\]\), dtype "
                           r"torch.float16, on cpu\) starts at 0x[0-9a-f]+, 2 bytes past")),
    row("compute_ranges", "misaligned device array",
        lambda e: compute_ranges([FakeArray(P0 + 4, (8,))]),
        Raises(ValueError, r"16-byte aligned: weight 0 .*4 bytes past a 16-byte boundary")),
    row("compute_ranges", "span beyond 64 bits", lambda e: compute_ranges([FakeArray(P0, *TOO_WIDE)]),
        Raises(OverflowError, r"weight 0: the span of shape .* with strides .* does not fit in 64 bits")),
    row("compute_ranges", "range past the top of the address space",
        lambda e: compute_ranges([FakeArray((1 << 64) - 16, (3,), "<f8")]),
        Raises(OverflowError, r"weight 0: its range runs past the end of the 64-bit address space")),
    row("compute_ranges", "negative size", lambda e: compute_ranges([FakeArray(P0, (4, -2))]),
        Raises(ValueError, r"weight 0: negative size -2 in shape \(4, -2\)")),
    row("compute_ranges", "strides below address 0",
        lambda e: compute_ranges([FakeArray(16, (4,), "<f4", (-16,))]),
        Raises(ValueError, r"weight 0: strides reach below address 0")),
    row("compute_ranges", "a set of weights", lambda e: compute_ranges({cpu(8)}),
        Raises(TypeError, r"weights must be an ordered sequence of tensors \(a list or tuple\), not a set")),
    row("compute_ranges", "a frozenset of weights", lambda e: compute_ranges(frozenset()),
        Raises(TypeError, r"ordered sequence of tensors .*, not a frozenset")),
    row("compute_ranges", "a dict of weights", lambda e: compute_ranges({"w": cpu(8)}),
        Raises(TypeError, r"ordered sequence of tensors .*, not a dict")),
    row("compute_ranges", "byte cap spent, then a non-tensor", lambda e: compute_ranges([arr(0), object()], 16),
        Raises(TypeError, r"weight 1 is a object, not a tensor")),
    row("compute_ranges", "byte cap spent, then a span beyond 64 bits",
        lambda e: compute_ranges([arr(0), FakeArray(P0, *TOO_WIDE)], 16),
        Raises(OverflowError, r"weight 1: the span .* does not fit in 64 bits")),
    row("compute_ranges", "byte cap spent, then a misaligned array (checked all the same)",
        lambda e: compute_ranges([arr(0), FakeArray(P0 + 4, (8,))], 16),
        Raises(ValueError, r"16-byte aligned: weight 1 \(shape \(8,\).* 4 bytes past")),
    row("compute_ranges", "zero-size with huge other sizes (valid: skipped)",
        lambda e: compute_ranges([FakeArray(P0, (0, 2**62, 2**62)),
                                  FakeArray(P0, (2**62, 0), "<f8", (2**62, 2**62))]), Returns([])),
    row("compute_ranges", "a shape element beyond 64 bits", lambda e: compute_ranges([FakeArray(P0, (2**64,))]),
        Raises(OverflowError, r"weight 0: shape element 0 is 18446744073709551616, which does not fit in 64 bits")),
    row("compute_ranges", "a float shape element", lambda e: compute_ranges([arr(0), FakeArray(P0, (4, 2.0))]),
        Raises(TypeError, r"weight 1: shape element 1 must be an int, not float")),
    row("compute_ranges", "a str stride", lambda e: compute_ranges([FakeArray(P0, (4,), "<f2", ("2",))]),
        Raises(TypeError, r"weight 0: strides element 0 must be an int, not str")),
    row("compute_ranges", "KeyboardInterrupt in __cuda_array_interface__ (passes through)",
        lambda e: compute_ranges([arr(0), Raising(KeyboardInterrupt())]), Raises(KeyboardInterrupt, r"")),
    row("compute_ranges", "an error in __cuda_array_interface__ (its own)",
        lambda e: compute_ranges([Raising(RuntimeError("no device"))]), Raises(RuntimeError, r"no device")),
    row("compute_ranges", "device.index 2**32", lambda e: compute_ranges([odd_device_tensor(2**32)]),
        Raises(ValueError, r"weight 0: device.index must be a CUDA device index in 0\.\.2147483647, got 4294967296")),
    row("compute_ranges", "device.index -1", lambda e: compute_ranges([odd_device_tensor(-1)]),
        Raises(ValueError, r"weight 0: device.index must be a CUDA device index .*, got -1")),

    # ---- PreparedWeightRanges(weights, *, byte_cap, grid, carveout, priority, kernel, device) --
    row("PreparedWeightRanges", "weights None", lambda e: PWR(None),
        Raises(TypeError, r"weights must be a sequence of tensors, not NoneType")),
    row("PreparedWeightRanges", "a single array, not a list", lambda e: PWR(arr(0)),
        Raises(TypeError, r"not a single FakeArray; wrap it")),
    row("PreparedWeightRanges", "a None weight", lambda e: PWR([arr(0), None]),
        Raises(TypeError, r"weight 1 is a NoneType, not a tensor")),
    row("PreparedWeightRanges", "no arguments", lambda e: PWR(),
        Raises(TypeError, r"'weights'.*\(pos 1\)")),
    row("PreparedWeightRanges", "grid positional", lambda e: PWR([], 8),
        Raises(TypeError, r"takes at most 1 positional argument")),
    row("PreparedWeightRanges", "CPU tensor", lambda e: PWR([arr(0), cpu(64)]),
        Raises(ValueError, r"weight 1 is on cpu, not on a CUDA device: PreparedWeightRanges needs "
                           r"CUDA tensors")),
    row("PreparedWeightRanges", "zero-size CPU tensor", lambda e: PWR([cpu(0)]),
        Raises(ValueError, r"weight 0 is on cpu, not on a CUDA device")),
    row("PreparedWeightRanges", "meta tensor", lambda e: PWR([torch.empty(8, device="meta")]),
        Raises(ValueError, r"weight 0 is on meta, not on a CUDA device")),
    row("PreparedWeightRanges", "weights on two devices", lambda e: PWR([arr(0), arr(1), arr(0, device=1)]),
        Raises(ValueError, r"different devices: weight 0 on cuda:0, weight 2 on cuda:1")),
    row("PreparedWeightRanges", "tensors on two devices",
        lambda e: PWR([cuda_tensor(P1, device=1), cuda_tensor(P0)]),
        Raises(ValueError, r"different devices: weight 0 on cuda:1, weight 1 on cuda:0")),
    row("PreparedWeightRanges", "weights on cuda:0, device=1", lambda e: PWR([arr(0)], device=1),
        Raises(ValueError, r"device=cuda:1 but the weights are on cuda:0")),
    row("PreparedWeightRanges", "address no device owns", lambda e: PWR([FakeArray(0x1000, (8,))]),
        Raises(ValueError, r"weight 0 \(__cuda_array_interface__ at 0x1000\) is not CUDA device memory")),
    row("PreparedWeightRanges", "misaligned pointer", lambda e: PWR([arr(0), FakeArray(P0 + 65536 + 8, (8,))]),
        Raises(ValueError, r"16-byte aligned: weight 1 .*8 bytes past a 16-byte boundary")),
    row("PreparedWeightRanges", "misaligned tensor", lambda e: PWR([cuda_tensor(P0 + 2)]),
        Raises(ValueError, r"16-byte aligned: weight 0 .*on cuda:0\) starts at 0x[0-9a-f]+, 2 bytes past")),
    row("PreparedWeightRanges", "span beyond 64 bits", lambda e: PWR([FakeArray(P0, *TOO_WIDE)]),
        Raises(OverflowError, r"weight 0: the span .* does not fit in 64 bits")),
    row("PreparedWeightRanges", "a set of weights", lambda e: PWR({arr(0)}),
        Raises(TypeError, r"ordered sequence of tensors .*, not a set")),
    row("PreparedWeightRanges", "byte cap spent, then a non-tensor", lambda e: PWR([arr(0), object()], byte_cap=16),
        Raises(TypeError, r"weight 1 is a object, not a tensor")),
    row("PreparedWeightRanges", "device.index 2**32", lambda e: PWR([odd_device_tensor(2**32)]),
        Raises(ValueError, r"weight 0: device.index must be a CUDA device index")),
    row("PreparedWeightRanges", "KeyboardInterrupt in __cuda_array_interface__ (passes through)",
        lambda e: PWR([Raising(KeyboardInterrupt())]), Raises(KeyboardInterrupt, r"")),
    row("PreparedWeightRanges", "pickled", lambda e: pickle.dumps(e.table),
        Raises(TypeError, r"cannot pickle a PreparedWeightRanges")),
    row("PreparedWeightRanges", "copied", lambda e: copy.copy(e.table),
        Raises(TypeError, r"cannot pickle a PreparedWeightRanges")),
    row("PreparedWeightRanges", "129 ranges", lambda e: PWR([arr(i, 8) for i in range(129)]),
        Raises(ValueError, r"129 ranges, but one PreparedWeightRanges holds at most 128")),
    row("PreparedWeightRanges", "zero-dim tensor (valid: one element)",
        lambda e: PWR([cuda_tensor(P0, ())]).ranges, Returns(((P0, 2),))),
    row("PreparedWeightRanges", "zero-size tensor (valid: no range, its device)",
        lambda e: (lambda t: (t.ranges, t.device))(PWR([cuda_tensor(P1, (0, 4), device=1)])),
        Returns(((), 1))),
    row("PreparedWeightRanges", "no weights (valid: empty launch on the default device)",
        lambda e: (lambda t: (t.ranges, t.nbytes, t.device))(PWR([])), Returns(((), 0, 0))),
    row("PreparedWeightRanges", "no weights, device=1 (valid)", lambda e: PWR([], device=1).device,
        Returns(1)),
    row("PreparedWeightRanges", "grid 0", lambda e: PWR([], grid=0),
        Raises(ValueError, r"grid must be in 1\.\.65535, got 0")),
    row("PreparedWeightRanges", "grid negative", lambda e: PWR([], grid=-1),
        Raises(ValueError, r"grid must be in 1\.\.65535, got -1")),
    row("PreparedWeightRanges", "grid 65536", lambda e: PWR([], grid=65536),
        Raises(ValueError, r"grid must be in 1\.\.65535, got 65536")),
    row("PreparedWeightRanges", "grid huge", lambda e: PWR([], grid=2**70),
        Raises(ValueError, r"grid must be in 1\.\.65535, got 1180591620717411303424")),
    row("PreparedWeightRanges", "grid None", lambda e: PWR([], grid=None),
        Raises(TypeError, r"grid must be an int, not NoneType")),
    row("PreparedWeightRanges", "grid a float", lambda e: PWR([], grid=1.5),
        Raises(TypeError, r"grid must be an int, not float")),
    row("PreparedWeightRanges", "grid a str", lambda e: PWR([], grid="32"),
        Raises(TypeError, r"grid must be an int, not str")),
    row("PreparedWeightRanges", "grid a bool", lambda e: PWR([], grid=True),
        Raises(TypeError, r"grid must be an int, not bool")),
    row("PreparedWeightRanges", "carveout -2", lambda e: PWR([], carveout=-2),
        Raises(ValueError, r"carveout \(percent .*\) must be in -1\.\.100, got -2")),
    row("PreparedWeightRanges", "carveout 101", lambda e: PWR([], carveout=101),
        Raises(ValueError, r"carveout \(percent .*\) must be in -1\.\.100, got 101")),
    row("PreparedWeightRanges", "carveout huge", lambda e: PWR([], carveout=2**70),
        Raises(ValueError, r"carveout \(percent .*\) must be in -1\.\.100")),
    row("PreparedWeightRanges", "carveout a float", lambda e: PWR([], carveout=50.0),
        Raises(TypeError, r"carveout \(percent .*\) must be an int, not float")),
    row("PreparedWeightRanges", "carveout a bool", lambda e: PWR([], carveout=True),
        Raises(TypeError, r"carveout \(percent .*\) must be an int, not bool")),
    row("PreparedWeightRanges", "carveout -1 and 100 (valid)",
        lambda e: (PWR([], carveout=-1).carveout, PWR([], carveout=100).carveout), Returns((-1, 100))),
    row("PreparedWeightRanges", "byte_cap negative", lambda e: PWR([], byte_cap=-1),
        Raises(ValueError, r"byte_cap must be in 0\.\.9223372036854775807, got -1")),
    row("PreparedWeightRanges", "byte_cap beyond 63 bits", lambda e: PWR([], byte_cap=2**64),
        Raises(ValueError, r"byte_cap must be in 0\.\.9223372036854775807, got 18446744073709551616")),
    row("PreparedWeightRanges", "byte_cap 8 (a table that loads nothing)", lambda e: PWR([arr(0)], byte_cap=8),
        Raises(ValueError, r"byte_cap must be 0 \(no cap\) or at least 16 bytes \(ranges are cut to "
                           r"16-byte units, so a smaller cap loads nothing\), got 8")),
    row("PreparedWeightRanges", "grid of 5000 digits", lambda e: PWR([], grid=10**5000),
        Raises(ValueError, r"grid must be in 1\.\.65535, got <an int of 16610 bits>")),
    row("PreparedWeightRanges", "byte_cap None", lambda e: PWR([], byte_cap=None),
        Raises(TypeError, r"byte_cap must be an int, not NoneType")),
    row("PreparedWeightRanges", "priority an int", lambda e: PWR([], priority=1),
        Raises(TypeError, r"priority must be a bool, not int")),
    row("PreparedWeightRanges", "priority None", lambda e: PWR([], priority=None),
        Raises(TypeError, r"priority must be a bool, not NoneType")),
    row("PreparedWeightRanges", "kernel an int", lambda e: PWR([], kernel=3),
        Raises(TypeError, r"kernel must be a variant name \(str\) or None, not int")),
    row("PreparedWeightRanges", "kernel unknown", lambda e: PWR([], kernel="nope"),
        Raises(ValueError, r"unknown kernel variant 'nope'")),
    row("PreparedWeightRanges", "kernel with a NUL inside", lambda e: PWR([], kernel="ring\0x"),
        Raises(ValueError, r"unknown kernel variant 'ring\\x00x'")),
    row("PreparedWeightRanges", "kernel not UTF-8 (a lone surrogate)", lambda e: PWR([], kernel="\udc80"),
        Raises(ValueError, r"unknown kernel variant '\\udc80'")),
    row("PreparedWeightRanges", "device negative", lambda e: PWR([], device=-1),
        Raises(ValueError, r"device must be >= 0, got -1")),
    row("PreparedWeightRanges", "device 3 of 2", lambda e: PWR([], device=3),
        Raises(ValueError, r"cuda:3 does not exist \(the driver sees 2 devices\)")),
    row("PreparedWeightRanges", "device 2**32", lambda e: PWR([], device=2**32),
        Raises(ValueError, r"device 4294967296 is not a CUDA device index")),
    row("PreparedWeightRanges", "device 'cpu'", lambda e: PWR([], device="cpu"),
        Raises(ValueError, r"device must be a CUDA device \('cuda' or 'cuda:N'\), got 'cpu'")),
    row("PreparedWeightRanges", "device 'cuda:4294967296'", lambda e: PWR([], device="cuda:4294967296"),
        Raises(ValueError, r"device must be a CUDA device .*got 'cuda:4294967296'")),
    row("PreparedWeightRanges", "device torch.device('cpu')", lambda e: PWR([], device=torch.device("cpu")),
        Raises(ValueError, r"device must be a CUDA device .*got device\(type='cpu'\)")),
    row("PreparedWeightRanges", "device a float", lambda e: PWR([], device=1.5),
        Raises(TypeError, r"device must be a CUDA device \(an int, 'cuda:N' or a torch.device\), not float")),
    row("PreparedWeightRanges", "device a bool", lambda e: PWR([], device=True),
        Raises(TypeError, r"device must be a CUDA device .*, not bool")),
    row("PreparedWeightRanges", "device forms 1, 'cuda:1', torch.device (valid)",
        lambda e: {PWR([], device=d).device for d in (1, "cuda:1", torch.device("cuda", 1))},
        Returns({1})),

    # ---- PreparedWeightRanges.launch(stream=None) ------------------------------------------------
    row("PreparedWeightRanges.launch", "stream a str", lambda e: e.table.launch("0x5000"),
        Raises(TypeError, r"stream must be None, an int CUstream handle or a torch.cuda.Stream, not str")),
    row("PreparedWeightRanges.launch", "stream a float", lambda e: e.table.launch(stream=1.5),
        Raises(TypeError, r"stream must be None, an int .*, not float")),
    row("PreparedWeightRanges.launch", "stream a bool", lambda e: e.table.launch(stream=True),
        Raises(TypeError, r"stream must be None, an int .*, not bool")),
    row("PreparedWeightRanges.launch", "stream a Mock", lambda e: e.table.launch(stream=mock.MagicMock()),
        Raises(TypeError, r"stream.cuda_stream must be an int CUstream handle, not MagicMock")),
    row("PreparedWeightRanges.launch", "stream handle negative", lambda e: e.table.launch(stream=-1),
        Raises(ValueError, r"stream handle must be a non-negative int, got -1")),
    row("PreparedWeightRanges.launch", "stream handle beyond 64 bits", lambda e: e.table.launch(stream=2**64),
        Raises(ValueError, r"stream handle must be a non-negative int, got 18446744073709551616")),
    row("PreparedWeightRanges.launch", "stream handle of 5000 digits, negative",
        lambda e: e.table.launch(stream=-10**5000),
        Raises(ValueError, r"stream handle must be a non-negative int, got <a negative int of 16610 "
                           r"bits>")),
    row("PreparedWeightRanges.launch", "stream object of another device",
        lambda e: e.table.launch(stream=e.stream1),
        Raises(ValueError, r"the stream is on cuda:1 but the prefetch is for cuda:0")),
    row("PreparedWeightRanges.launch", "stream handle of another device",
        lambda e: e.table.launch(stream=e.ctl1.stream_handle),
        Raises(ValueError, r"stream 0x[0-9a-f]+ belongs to another device's context; this table is for cuda:0")),
    row("PreparedWeightRanges.launch", "two streams", lambda e: e.table.launch(S, S),
        Raises(TypeError, r"launch\(\) takes at most 1 positional argument \(2 given\)")),
    row("PreparedWeightRanges.launch", "unknown keyword", lambda e: e.table.launch(strm=S),
        Raises(TypeError, r"launch\(\) got an unexpected keyword argument 'strm'")),
    row("PreparedWeightRanges.launch", "an empty table (valid: the empty launch)",
        lambda e: PWR([], device=0).launch(stream=S), Returns(None)),

    # ---- module functions and the NVRTC search --------------------------------------------------
    row("_C._use_driver", "a path that cannot be encoded", lambda e: _C._use_driver("/x/\ud800"),
        Raises(UnicodeEncodeError, r"surrogates not allowed")),
    row("_C._use_driver", "a path with a NUL", lambda e: _C._use_driver("/x/a\0b"),
        Raises(ValueError, r"embedded null byte")),
    row("_C._use_nvrtc", "a path that cannot be encoded", lambda e: _C._use_nvrtc("/x/\ud800"),
        Raises(UnicodeEncodeError, r"surrogates not allowed")),
    row("NVRTC search", "python -m from a folder with a planted NVRTC, non-UTF-8 path entries "
        "(valid: not looked for there)", lambda e: planted_nvrtc_loaded(e.tmp_path, e.fakenvrtc),
        Returns(False)),
    row("_C.env_flag", "a name with a NUL", lambda e: _C.env_flag("A\0B"),
        Raises(ValueError, r"name must not contain a NUL")),
    row("_C.env_flag", "name None", lambda e: _C.env_flag(None),
        Raises(TypeError, r"name must be a str, not NoneType")),

    # ---- PrefetchController(device=None) ------------------------------------------------------------
    row("PrefetchController", "device 'cpu'", lambda e: PC(device="cpu"),
        Raises(ValueError, r"device must be a CUDA device .*got 'cpu'")),
    row("PrefetchController", "device negative", lambda e: PC(device=-1),
        Raises(ValueError, r"device must be >= 0, got -1")),
    row("PrefetchController", "device 3 of 2", lambda e: PC(device=3),
        Raises(ValueError, r"cuda:3 does not exist \(the driver sees 2 devices\)")),
    row("PrefetchController", "device 2**31 (not cuda:0)", lambda e: PC(device=2**31),
        Raises(ValueError, r"device 2147483648 is not a CUDA device index")),
    row("PrefetchController", "device beyond 64 bits", lambda e: PC(device=2**64),
        Raises(ValueError, r"device 18446744073709551616 is not a CUDA device index")),
    row("PrefetchController", "device of 5000 digits", lambda e: PC(device=10**5000),
        Raises(ValueError, r"device <an int of 16610 bits> is not a CUDA device index")),
    row("PrefetchController", "device of 5000 digits, negative", lambda e: PC(device=-10**5000),
        Raises(ValueError, r"device must be >= 0, got <a negative int of 16610 bits>")),
    row("PrefetchController", "device a float", lambda e: PC(device=1.5),
        Raises(TypeError, r"device must be a CUDA device .*, not float")),
    row("PrefetchController", "device a list", lambda e: PC([0]),
        Raises(TypeError, r"device must be a CUDA device .*, not list")),
    row("PrefetchController", "two arguments", lambda e: PC(0, 1),
        Raises(TypeError, r"takes at most 1 positional argument \(2 given\)")),
    row("PrefetchController", "graph_fork unknown", lambda e: PC(graph_fork="fast"),
        Raises(ValueError, r"graph_fork must be 'inline' \(the default\), 'branch' or 'leaf', not 'fast'")),
    row("PrefetchController", "graph_fork None", lambda e: PC(graph_fork=None),
        Raises(TypeError, r"graph_fork must be 'inline' .*, 'branch' or 'leaf', not NoneType")),
    row("PrefetchController", "graph_fork an int", lambda e: PC(graph_fork=1),
        Raises(TypeError, r"graph_fork must be 'inline' .*, 'branch' or 'leaf', not int")),
    row("PrefetchController", "graph_fork positional", lambda e: PC(0, "branch"),
        Raises(TypeError, r"takes at most 1 positional argument \(2 given\)")),
    row("PrefetchController", "graph_fork 'branch' (valid)", lambda e: PC(graph_fork="branch").graph_fork,
        Returns("branch")),
    row("PrefetchController", "unknown keyword", lambda e: PC(devic=0),
        Raises(TypeError, r"'devic' is an invalid keyword argument")),
    row("PrefetchController", "device None (valid: the current device)", lambda e: PC().device, Returns(0)),
    row("PrefetchController", "eager a str", lambda e: PC(eager="no"),
        Raises(TypeError, r"eager must be a bool, not str")),
    row("PrefetchController", "eager an int", lambda e: PC(eager=0),
        Raises(TypeError, r"eager must be a bool, not int")),
    row("PrefetchController", "a subclass's own argument (valid: not the device)",
        lambda e: (lambda c: (c.name, c.device))(SubController(1)), Returns((1, 0))),
    row("PrefetchController", "__init__ called again", lambda e: e.ctl.__init__(device=1),
        Raises(Error, r"__init__\(\) called on a controller that is initialised already \(cuda:0\)")),
    row("PrefetchController", "a subclass that skips __init__, then fork",
        lambda e: ForgetfulController().fork("attn", 0, 1, stream=S),
        Raises(Error, r"not initialised: .*super\(\).__init__")),
    row("PrefetchController", "pickled with protocol 0", lambda e: pickle.dumps(e.ctl, protocol=0),
        Raises(TypeError, r"a PrefetchController cannot be pickled or copied")),
    row("PrefetchController", "deep-copied", lambda e: copy.deepcopy(e.ctl),
        Raises(TypeError, r"a PrefetchController cannot be pickled or copied")),
    row("_C.PrefetchController", "pickled (the C type alone)",
        lambda e: pickle.dumps(_C.PrefetchController(0)),
        Raises(TypeError, r"cannot pickle a PrefetchController: it owns a CUDA stream")),
    row("L2PREFETCH_DISABLE", "' 1' (valid: off for the hooks and the controller)",
        lambda e: disabled_everywhere(" 1"), Returns((True, True, True))),
    row("L2PREFETCH_DISABLE", "'Yes\\n' (valid: off everywhere)",
        lambda e: disabled_everywhere("Yes\n"), Returns((True, True, True))),
    row("L2PREFETCH_DISABLE", "' 0 ' (valid: on everywhere)",
        lambda e: disabled_everywhere(" 0 "), Returns((False, False, False))),
    row("L2PREFETCH_DISABLE", "'1x' (valid: on everywhere)",
        lambda e: disabled_everywhere("1x"), Returns((False, False, False))),

    # ---- PrefetchController.add(point, layer, batches, ranges) ---------------------------------------
    row("PrefetchController.add", "point None", lambda e: e.ctl.add(None, 0, 1, e.table),
        Raises(TypeError, r"point must be a non-empty str, not None")),
    row("PrefetchController.add", "point empty", lambda e: e.ctl.add("", 0, 1, e.table),
        Raises(TypeError, r"point must be a non-empty str, not ''")),
    row("PrefetchController.add", "layer None", lambda e: e.ctl.add("a", None, 1, e.table),
        Raises(TypeError, r"layer must be an int, not NoneType")),
    row("PrefetchController.add", "layer a str", lambda e: e.ctl.add("a", "0", 1, e.table),
        Raises(TypeError, r"layer must be an int, not str")),
    row("PrefetchController.add", "layer a bool", lambda e: e.ctl.add("a", True, 1, e.table),
        Raises(TypeError, r"layer must be an int, not bool")),
    row("PrefetchController.add", "layer negative", lambda e: e.ctl.add("a", -1, 1, e.table),
        Raises(ValueError, r"layer must be in 0\.\.65535, got -1")),
    row("PrefetchController.add", "layer huge", lambda e: e.ctl.add("a", 2**80, 1, e.table),
        Raises(ValueError, r"layer must be in 0\.\.65535, got 1208925819614629174706176")),
    row("PrefetchController.add", "layer of 5000 digits", lambda e: e.ctl.add("a", 10**5000, 1, e.table),
        Raises(ValueError, r"layer must be in 0\.\.65535, got <an int of 16610 bits>")),
    row("PrefetchController.add", "batches a dict (a cap table)", lambda e: e.ctl.add("a", 0, {1: 16}, e.table),
        Raises(TypeError, r"batches must be an int or an iterable of ints, not a dict \(dict: it "
                          r"iterates its keys\)")),
    row("PrefetchController.add", "batches without end", lambda e: e.ctl.add("a", 0, itertools.count(1), e.table),
        Raises(ValueError, r"batch must be in 1\.\.65535, got 65536")),
    row("PrefetchController.add", "65536 batches", lambda e: e.ctl.add("a", 0, itertools.repeat(1, 65536), e.table),
        Raises(ValueError, r"batches holds more than 65535 items, as many as there are batch sizes: "
                           r"name each batch once")),
    row("PrefetchController.add", "an int batch of 5000 digits", lambda e: e.ctl.add("a", 0, 10**5000, e.table),
        Raises(ValueError, r"batch must be in 1\.\.65535, got <an int of 16610 bits>")),
    row("PrefetchController.add", "a batch of 5000 digits", lambda e: e.ctl.add("a", 0, [1, 10**5000], e.table),
        Raises(ValueError, r"batch must be in 1\.\.65535, got <an int of 16610 bits>")),
    row("PrefetchController.add", "a batch iterator that raises",
        lambda e: e.ctl.add("a", 0, map(lambda b: 1 // (b - 2), [3, 2]), e.table),
        Raises(ZeroDivisionError, r"by zero")),
    row("PrefetchController.add", "a batch whose int subclass's repr raises (passes through)",
        lambda e: e.ctl.add("a", 0, [ReprRaises(0)], e.table),
        Raises(ValueError, r"^its repr raised$")),
    row("PrefetchController.add", "batches None", lambda e: e.ctl.add("a", 0, None, e.table),
        Raises(TypeError, r"batches must be an int or an iterable of ints, not NoneType")),
    row("PrefetchController.add", "batches a float", lambda e: e.ctl.add("a", 0, 2.0, e.table),
        Raises(TypeError, r"batches must be an int or an iterable of ints, not float")),
    row("PrefetchController.add", "a str batch", lambda e: e.ctl.add("a", 0, [1, "2"], e.table),
        Raises(TypeError, r"each batch must be an int, not str")),
    row("PrefetchController.add", "a bool batch", lambda e: e.ctl.add("a", 0, True, e.table),
        Raises(TypeError, r"each batch must be an int, not bool")),
    row("PrefetchController.add", "batches empty", lambda e: e.ctl.add("a", 0, [], e.table),
        Raises(ValueError, r"batches is empty: name at least one batch size")),
    row("PrefetchController.add", "batch 0", lambda e: e.ctl.add("a", 0, [0], e.table),
        Raises(ValueError, r"batch must be in 1\.\.65535, got 0")),
    row("PrefetchController.add", "batch huge", lambda e: e.ctl.add("a", 0, [2**40], e.table),
        Raises(ValueError, r"batch must be in 1\.\.65535, got 1099511627776")),
    row("PrefetchController.add", "ranges None", lambda e: e.ctl.add("a", 0, 1, None),
        Raises(TypeError, r"ranges must be a PreparedWeightRanges, not NoneType")),
    row("PrefetchController.add", "ranges a list of arrays", lambda e: e.ctl.add("a", 0, 1, [arr(0)]),
        Raises(TypeError, r"ranges must be a PreparedWeightRanges, not list")),
    row("PrefetchController.add", "ranges of another device", lambda e: e.ctl.add("a", 0, 1, e.table1),
        Raises(ValueError, r"ranges are prepared for cuda:1 but this controller is for cuda:0")),
    row("PrefetchController.add", "three arguments", lambda e: e.ctl.add("a", 0, 1),
        Raises(TypeError, r"add\(\) takes exactly 4 positional arguments \(3 given\)")),
    row("PrefetchController.add", "graph_fork unknown", lambda e: e.ctl.add("a", 0, 1, e.table, graph_fork="fast"),
        Raises(ValueError, r"graph_fork must be 'inline', 'branch', 'leaf' or None \(the controller's\), not 'fast'")),
    row("PrefetchController.add", "graph_fork an int", lambda e: e.ctl.add("a", 0, 1, e.table, graph_fork=1),
        Raises(TypeError, r"graph_fork must be 'inline', 'branch', 'leaf' or None .*, not int")),
    row("PrefetchController.add", "graph_fork positional", lambda e: e.ctl.add("a", 0, 1, e.table, "branch"),
        Raises(TypeError, r"add\(\) takes exactly 4 positional arguments \(5 given\)")),
    row("PrefetchController.add", "unknown keyword", lambda e: e.ctl.add("a", 0, 1, e.table, mode="branch"),
        Raises(TypeError, r"add\(\) got an unexpected keyword argument 'mode'")),
    row("PrefetchController.add", "graph_fork 'branch' (valid: those keys' mode)",
        lambda e: (e.ctl.add("a", 0, [1, 2], e.table, graph_fork="branch"),
                   e.ctl.get_mode("a", 0, 2), e.ctl.get_mode("attn", 0, 1)), Returns((None, "branch", "inline"))),
    row("PrefetchController.add", "graph_fork None (valid: the controller's)",
        lambda e: (e.ctl.add("a", 0, 1, e.table, graph_fork=None), e.ctl.get_mode("a", 0, 1)),
        Returns((None, "inline"))),
    row("PrefetchController.add", "layer and batch 65535 (valid: sparse tables)",
        lambda e: (e.ctl.add("p", 65535, [65535], e.table), e.ctl.add("p", 0, [65535], e.table),
                   e.ctl.get("p", 65535, 65535) is e.table, len(e.ctl)), Returns((None, None, True, 4))),
    row("PrefetchController.add", "a point name of a str subclass (valid: kept as a str)",
        lambda e: (e.ctl.add(type("Name", (str,), {"__hash__": lambda s: 1 // 0})("b"), 0, 1, e.table),
                   type(e.ctl.points[-1]).__name__), Returns((None, "str"))),
    row("PrefetchController.add", "an empty table (valid: its fork launches nothing)",
        lambda e: (e.ctl.add("e", 0, 1, PWR([], device=0)), e.ctl.fork("e", 0, 1, stream=S),
                   e.ctl.stats()["e"]), Returns((None, True, {"forks": 1, "bytes": 0}))),

    # ---- PrefetchController.fork(point, layer, batch, stream=None) ----------------------------------
    row("PrefetchController.fork", "point None", lambda e: e.ctl.fork(None, 0, 1, stream=S),
        Raises(TypeError, r"point must be a str, not NoneType")),
    row("PrefetchController.fork", "layer a str", lambda e: e.ctl.fork("attn", "0", 1, stream=S),
        Raises(TypeError, r"layer must be an int, not str")),
    row("PrefetchController.fork", "layer a float", lambda e: e.ctl.fork("attn", 0.0, 1, stream=S),
        Raises(TypeError, r"layer must be an int, not float")),
    row("PrefetchController.fork", "batch None", lambda e: e.ctl.fork("attn", 0, None, stream=S),
        Raises(TypeError, r"batch must be an int, not NoneType")),
    row("PrefetchController.fork", "batch a bool", lambda e: e.ctl.fork("attn", 0, True, stream=S),
        Raises(TypeError, r"batch must be an int, not bool")),
    row("PrefetchController.fork", "two arguments", lambda e: e.ctl.fork("attn", 0),
        Raises(TypeError, r"fork\(\) takes at least 3 positional arguments \(2 given\)")),
    row("PrefetchController.fork", "unknown keyword", lambda e: e.ctl.fork("attn", 0, 1, strm=S),
        Raises(TypeError, r"fork\(\) got an unexpected keyword argument 'strm'")),
    row("PrefetchController.fork", "unknown point (valid: False)", lambda e: e.ctl.fork("nope", 0, 1, stream=S),
        Returns(False)),
    row("PrefetchController.fork", "empty point (valid: False)", lambda e: e.ctl.fork("", 0, 1, stream=S),
        Returns(False)),
    row("PrefetchController.fork", "unregistered layer (valid: False)",
        lambda e: e.ctl.fork("attn", 7, 1, stream=S), Returns(False)),
    row("PrefetchController.fork", "negative layer (valid: False)",
        lambda e: e.ctl.fork("attn", -1, 1, stream=S), Returns(False)),
    row("PrefetchController.fork", "huge layer (valid: False)",
        lambda e: e.ctl.fork("attn", 10**30, 1, stream=S), Returns(False)),
    row("PrefetchController.fork", "batch 0 (valid: False)", lambda e: e.ctl.fork("attn", 0, 0, stream=S),
        Returns(False)),
    row("PrefetchController.fork", "unregistered batch (valid: False)",
        lambda e: e.ctl.fork("attn", 0, 3, stream=S), Returns(False)),
    row("PrefetchController.fork", "stream a str", lambda e: e.ctl.fork("attn", 0, 1, stream="0x5000"),
        Raises(TypeError, r"stream must be None, an int CUstream handle or a torch.cuda.Stream, not str")),
    row("PrefetchController.fork", "stream a Mock", lambda e: e.ctl.fork("attn", 0, 1, stream=mock.MagicMock()),
        Raises(TypeError, r"stream.cuda_stream must be an int CUstream handle, not MagicMock")),
    row("PrefetchController.fork", "stream handle negative", lambda e: e.ctl.fork("attn", 0, 1, stream=-1),
        Raises(ValueError, r"stream handle must be a non-negative int, got -1")),
    row("PrefetchController.fork", "stream object of another device",
        lambda e: e.ctl.fork("attn", 0, 1, stream=e.stream1),
        Raises(ValueError, r"the stream is on cuda:1 but the prefetch is for cuda:0")),
    # A handle is not looked up on the hot path: the driver refuses it (the stand-in as CUDA does).
    row("PrefetchController.fork", "stream handle of another device",
        lambda e: e.ctl.fork("attn", 0, 1, stream=e.ctl1.stream_handle),
        Raises(CudaError, r"cuEventRecord failed: CUDA_ERROR_INVALID_HANDLE")),
    # Nothing to launch, so the stream is not looked at.
    row("PrefetchController.fork", "the capture-state query fails",
        lambda e: (e.ctl, e.fake.fail("cuStreamGetCaptureInfo"), e.ctl.fork("attn", 0, 1, stream=S)),
        Raises(CudaError, r"cuStreamGetCaptureInfo failed: CUDA_ERROR_UNKNOWN")),
    row("PrefetchController.fork", "KeyboardInterrupt in stream.cuda_stream (passes through)",
        lambda e: e.ctl.fork("attn", 0, 1, stream=RaisingStream(KeyboardInterrupt())),
        Raises(KeyboardInterrupt, r"")),
    row("PrefetchController.fork", "an error in stream.cuda_stream (its own)",
        lambda e: e.ctl.fork("attn", 0, 1, stream=RaisingStream(RuntimeError("stream gone"))),
        Raises(RuntimeError, r"stream gone")),
    row("PrefetchController.fork", "unknown point, stream of another device (valid: False)",
        lambda e: e.ctl.fork("nope", 0, 1, stream=e.stream1), Returns(False)),

    # ---- PrefetchController.join(stream=None) ---------------------------------------------------------
    row("PrefetchController.join", "stream a float, fork pending", lambda e: e.pending.join(stream=1.5),
        Raises(TypeError, r"stream must be None, an int .*, not float")),
    row("PrefetchController.join", "stream object of another device, fork pending",
        lambda e: e.pending.join(stream=e.stream1),
        Raises(ValueError, r"the stream is on cuda:1 but the prefetch is for cuda:0")),
    row("PrefetchController.join", "stream a Mock, fork pending",
        lambda e: e.pending.join(stream=mock.MagicMock()),
        Raises(TypeError, r"stream.cuda_stream must be an int CUstream handle, not MagicMock")),
    row("PrefetchController.join", "two streams", lambda e: e.ctl.join(S, S),
        Raises(TypeError, r"join\(\) takes at most 1 positional argument \(2 given\)")),
    row("PrefetchController.join", "unknown keyword", lambda e: e.ctl.join(strm=S),
        Raises(TypeError, r"join\(\) got an unexpected keyword argument 'strm'")),
    # Nothing pending: join makes no call and does not look at the stream.
    row("PrefetchController.join", "stream of another device, nothing pending (valid: None)",
        lambda e: e.ctl.join(stream=e.stream1), Returns(None)),

    # ---- PrefetchController.get / keys / stats / reset_stats / close -----------------------------------
    row("PrefetchController.get", "point None", lambda e: e.ctl.get(None, 0, 1),
        Raises(TypeError, r"point must be a str, not NoneType")),
    row("PrefetchController.get", "layer a str", lambda e: e.ctl.get("attn", "0", 1),
        Raises(TypeError, r"layer must be an int, not str")),
    row("PrefetchController.get", "batch a float", lambda e: e.ctl.get("attn", 0, 1.0),
        Raises(TypeError, r"batch must be an int, not float")),
    row("PrefetchController.get", "two arguments", lambda e: e.ctl.get("attn", 0),
        Raises(TypeError, r"get\(\) takes exactly 3 positional arguments \(2 given\)")),
    row("PrefetchController.get", "unknown point (valid: None)", lambda e: e.ctl.get("nope", 0, 1),
        Returns(None)),
    row("PrefetchController.get", "huge batch (valid: None)", lambda e: e.ctl.get("attn", 0, 10**30),
        Returns(None)),
    row("PrefetchController.get_mode", "point None", lambda e: e.ctl.get_mode(None, 0, 1),
        Raises(TypeError, r"point must be a str, not NoneType")),
    row("PrefetchController.get_mode", "two arguments", lambda e: e.ctl.get_mode("attn", 0),
        Raises(TypeError, r"get_mode\(\) takes exactly 3 positional arguments \(2 given\)")),
    row("PrefetchController.get_mode", "unknown key (valid: None)", lambda e: e.ctl.get_mode("attn", 0, 3),
        Returns(None)),
    row("PrefetchController.keys", "an argument", lambda e: e.ctl.keys(1),
        Raises(TypeError, r"keys\(\) takes no arguments \(1 given\)")),
    row("PrefetchController.stats", "an argument", lambda e: e.ctl.stats("attn"),
        Raises(TypeError, r"stats\(\) takes no arguments \(1 given\)")),
    row("PrefetchController.reset_stats", "an argument", lambda e: e.ctl.reset_stats(0),
        Raises(TypeError, r"reset_stats\(\) takes no arguments \(1 given\)")),
    row("PrefetchController.close", "an argument", lambda e: e.ctl.close(True),
        Raises(TypeError, r"close\(\) takes no arguments \(1 given\)")),

    # ---- a closed controller -----------------------------------------------------------------------------
    row("PrefetchController.add", "closed", lambda e: e.closed.add("attn", 0, 1, e.table),
        Raises(Error, r"this PrefetchController is closed: make a new one")),
    row("PrefetchController.fork", "closed", lambda e: e.closed.fork("attn", 0, 1, stream=S),
        Raises(Error, r"this PrefetchController is closed")),
    row("PrefetchController.fork", "closed, unknown point", lambda e: e.closed.fork("nope", 0, 1, stream=S),
        Raises(Error, r"this PrefetchController is closed")),
    row("PrefetchController.join", "closed", lambda e: e.closed.join(stream=S),
        Raises(Error, r"this PrefetchController is closed")),
    row("PrefetchController.stream", "closed", lambda e: e.closed.stream,
        Raises(Error, r"this PrefetchController is closed")),
    # Lookups answer from the tables close() emptied; close() again does nothing.
    row("PrefetchController.get", "closed (valid: None)", lambda e: e.closed.get("attn", 0, 1), Returns(None)),
    row("PrefetchController.keys/len", "closed (valid: empty)",
        lambda e: (e.closed.keys(), len(e.closed), e.closed.stream_handle), Returns(([], 0, 0))),
    row("PrefetchController.stats", "closed (valid: the counters so far)",
        lambda e: (e.pending.join(stream=S), e.closed.stats())[1],
        Returns({"attn": {"forks": 1, "bytes": 4096}})),
    row("PrefetchController.close", "closed (valid: None)", lambda e: e.closed.close(), Returns(None)),

    # ---- PrefetchController.from_plan(plan, device=None, *, kernel=None, graph_fork='inline', eager=True)
    # ---- and pickling or copying a controller
    row("PrefetchController.from_plan", "plan None", lambda e: PC.from_plan(None),
        Raises(TypeError, r"plan must be an iterable of PlanEntry \(a list\), got NoneType None")),
    row("PrefetchController.from_plan", "one PlanEntry", lambda e: PC.from_plan(e.entry),
        Raises(TypeError, r"plan must be an iterable of PlanEntry, got one PlanEntry: wrap it as "
                          r"\[entry\]")),
    row("PrefetchController.from_plan", "a mapping", lambda e: PC.from_plan({"attn": e.entry}),
        Raises(TypeError, r"plan must be an iterable of PlanEntry \(a list\), got dict")),
    row("PrefetchController.from_plan", "a None entry", lambda e: PC.from_plan([e.entry, None]),
        Raises(TypeError, r"plan\[1\] must be a PlanEntry, not NoneType")),
    row("PrefetchController.from_plan", "a str plan", lambda e: PC.from_plan("attn"),
        Raises(TypeError, r"plan must be an iterable of PlanEntry \(a list\), got str 'attn'")),
    row("empty_controller", "a None entry", lambda e: empty_controller([e.entry, None]),
        Raises(TypeError, r"plan\[1\] must be a PlanEntry, not NoneType")),
    row("empty_controller", "two entries for one key",
        lambda e: empty_controller([e.entry, PlanEntry("attn", 0, [1, 2], (cuda_tensor(P0),))]),
        Raises(ValueError, r"plan\[0\] and plan\[1\] both prefetch at point 'attn', layer 0, "
                           r"batch 1: give each \(point, layer, batch\) one entry")),
    row("PrefetchController.from_plan", "CPU weights",
        lambda e: PC.from_plan([PlanEntry("attn", 0, [1], (cpu(64),))], device=0),
        Raises(ValueError, r"weight 0 is on cpu, not on a CUDA device")),
    row("PrefetchController.from_plan", "weights of cuda:1, device=0",
        lambda e: PC.from_plan([PlanEntry("attn", 0, [1], (cuda_tensor(P1, device=1),))], device=0),
        Raises(ValueError, r"device=cuda:0 but the weights are on cuda:1")),
    row("PrefetchController.from_plan", "misaligned weight",
        lambda e: PC.from_plan([PlanEntry("attn", 0, [1], (cuda_tensor(P0 + 8),))]),
        Raises(ValueError, r"16-byte aligned: weight 0 .*8 bytes past")),
    row("PrefetchController.from_plan", "kernel an int", lambda e: PC.from_plan([e.entry], kernel=3),
        Raises(TypeError, r"kernel must be a variant name \(str\) or None, not int")),
    row("PrefetchController.from_plan", "device 'cpu'", lambda e: PC.from_plan([e.entry], device="cpu"),
        Raises(ValueError, r"device must be a CUDA device .*got 'cpu'")),
    row("PrefetchController.from_plan", "a zero-size weight (valid: an empty table)",
        lambda e: PC.from_plan([PlanEntry("attn", 0, [1], (cuda_tensor(P0, (0, 8)),))]).get("attn", 0, 1).ranges,
        Returns(())),
    row("PrefetchController.from_plan", "empty plan (valid: no entries)", lambda e: len(PC.from_plan([])),
        Returns(0)),
    row("PrefetchController.from_plan", "graph_fork unknown",
        lambda e: PC.from_plan([e.entry], graph_fork="side"),
        Raises(ValueError, r"graph_fork must be 'inline' \(the default\), 'branch' or 'leaf', not 'side'")),
    row("PrefetchController.from_plan", "graph_fork 'branch' (valid: passed on)",
        lambda e: PC.from_plan([e.entry], graph_fork="branch").graph_fork, Returns("branch")),
    row("PrefetchController.from_plan", "eager False (valid: passed on)",
        lambda e: PC.from_plan([e.entry], eager=False).eager, Returns(False)),

    row("PrefetchController.from_plan", "weights of cuda:1, no device= (the default is cuda:0)",
        lambda e: PC.from_plan([PlanEntry("attn", 0, [1], (cuda_tensor(P1, device=1),))]),
        Raises(ValueError, r"plan entry 0 \('attn', layer 0\): the weights are on cuda:1, but no "
                           r"device= was given and the controller defaulted to cuda:0 .*pass device=1")),
    row("PrefetchController.from_plan", "weights of cuda:1, device=1 (valid)",
        lambda e: PC.from_plan([PlanEntry("attn", 0, [1], (cuda_tensor(P1, device=1),))], device=1).device,
        Returns(1)),
    row("PrefetchController.from_plan", "an entry's graph_fork, add() without that keyword",
        lambda e: AddWithoutGraphFork.from_plan([e.entry_branch]),
        Raises(NotImplementedError, r"plan entry 0 \('attn', layer 0\) sets graph_fork='branch', but "
                                    r"this build's PrefetchController.add\(\) takes no graph_fork.*"
                                    r"from_plan\(graph_fork=...\)")),
    row("PrefetchController.from_plan", "an entry's graph_fork (valid: passed to add() only where set)",
        lambda e: AddWithGraphFork.from_plan([e.entry_branch, PlanEntry("attn", 1, [1], (cuda_tensor(P0),))]).modes,
        Returns({("attn", 0): "branch", ("attn", 1): "not passed"})),
    row("PrefetchController.from_plan", "an entry's kernel (valid: it beats kernel=)",
        lambda e: PC.from_plan([PlanEntry("attn", 0, [1], (cuda_tensor(P0),), kernel="load")],
                               kernel="ring").get("attn", 0, 1).kernel,
        Returns("load")),
    row("pickle.dumps(PrefetchController)", "a controller", lambda e: pickle.dumps(e.ctl),
        Raises(TypeError, r"a PrefetchController cannot be pickled or copied: it holds this process's "
                          r"CUDA stream, events and prepared tables; send the plan instead")),
    row("copy.copy(PrefetchController)", "a controller", lambda e: copy.copy(e.ctl),
        Raises(TypeError, r"a PrefetchController cannot be pickled or copied")),

    # ---- PlanEntry(point, layer, batches, weights, byte_cap=0, grid=32, carveout=None, priority=False,
    #                kernel=None, graph_fork=None)
    row("PlanEntry", "point None", lambda e: PlanEntry(None, 0, [1], (cpu(4),)),
        Raises(TypeError, r"PlanEntry.point must be a non-empty str, got NoneType None")),
    row("PlanEntry", "point empty", lambda e: PlanEntry("", 0, [1], (cpu(4),)),
        Raises(ValueError, r"PlanEntry.point must be a non-empty str, got ''")),
    row("PlanEntry", "layer None", lambda e: PlanEntry("p", None, [1], (cpu(4),)),
        Raises(TypeError, r"PlanEntry.layer must be an int >= 0, got NoneType None")),
    row("PlanEntry", "layer a str", lambda e: PlanEntry("p", "0", [1], (cpu(4),)),
        Raises(TypeError, r"PlanEntry.layer must be an int >= 0, got str '0'")),
    row("PlanEntry", "layer negative", lambda e: PlanEntry("p", -1, [1], (cpu(4),)),
        Raises(ValueError, r"PlanEntry.layer must be an int >= 0, got -1")),
    row("PlanEntry", "batches None", lambda e: PlanEntry("p", 0, None, (cpu(4),)),
        Raises(TypeError, r"PlanEntry.batches must be an iterable of decode batches \(ints >= 1\).*got NoneType None")),
    row("PlanEntry", "batches an int", lambda e: PlanEntry("p", 0, 8, (cpu(4),)),
        Raises(TypeError, r"PlanEntry.batches must be an iterable of decode batches \(ints >= 1\).*got int 8")),
    row("PlanEntry", "a float batch", lambda e: PlanEntry("p", 0, [1, 2.0], (cpu(4),)),
        Raises(TypeError, r"PlanEntry.batches must hold ints >= 1, got float 2.0")),
    row("PlanEntry", "batch 0", lambda e: PlanEntry("p", 0, [0], (cpu(4),)),
        Raises(ValueError, r"PlanEntry.batches must hold ints >= 1, got 0")),
    row("PlanEntry", "batches empty", lambda e: PlanEntry("p", 0, [], (cpu(4),)),
        Raises(ValueError, r"PlanEntry.batches must name at least one batch")),
    row("PlanEntry", "weights None", lambda e: PlanEntry("p", 0, [1], None),
        Raises(TypeError, r"PlanEntry.weights must be a sequence of tensors, got NoneType None")),
    row("PlanEntry", "a single tensor", lambda e: PlanEntry("p", 0, [1], cpu(4)),
        Raises(TypeError, r"PlanEntry.weights must be a sequence of tensors, not one tensor .*\(tensor,\)")),
    row("PlanEntry", "a None weight", lambda e: PlanEntry("p", 0, [1], (cpu(4), None)),
        Raises(TypeError, r"PlanEntry.weights\[1\] must be a torch.Tensor, got NoneType")),
    row("PlanEntry", "weights empty", lambda e: PlanEntry("p", 0, [1], ()),
        Raises(ValueError, r"PlanEntry.weights must hold at least one tensor")),
    row("PlanEntry", "weights on two devices",
        lambda e: PlanEntry("p", 0, [1], (cuda_tensor(P0), cuda_tensor(P1, device=1))),
        Raises(ValueError, r"PlanEntry.weights must all be on one device .*cuda:0.*cuda:1")),
    row("PlanEntry", "grid 0", lambda e: PlanEntry("p", 0, [1], (cpu(4),), grid=0),
        Raises(ValueError, r"PlanEntry.grid must be an int in 1\.\.65535, got 0")),
    row("PlanEntry", "grid negative", lambda e: PlanEntry("p", 0, [1], (cpu(4),), grid=-1),
        Raises(ValueError, r"PlanEntry.grid must be an int in 1\.\.65535, got -1")),
    row("PlanEntry", "grid huge", lambda e: PlanEntry("p", 0, [1], (cpu(4),), grid=2**70),
        Raises(ValueError, r"PlanEntry.grid must be an int in 1\.\.65535, got 1180591620717411303424")),
    row("PlanEntry", "grid a str", lambda e: PlanEntry("p", 0, [1], (cpu(4),), grid="32"),
        Raises(TypeError, r"PlanEntry.grid must be an int in 1\.\.65535, got str '32'")),
    row("PlanEntry", "carveout -2", lambda e: PlanEntry("p", 0, [1], (cpu(4),), carveout=-2),
        Raises(ValueError, r"PlanEntry.carveout must be an int in -1\.\.100, got -2")),
    row("PlanEntry", "carveout 101", lambda e: PlanEntry("p", 0, [1], (cpu(4),), carveout=101),
        Raises(ValueError, r"PlanEntry.carveout must be an int in -1\.\.100, got 101")),
    row("PlanEntry", "carveout a float", lambda e: PlanEntry("p", 0, [1], (cpu(4),), carveout=50.0),
        Raises(TypeError, r"PlanEntry.carveout must be an int in -1\.\.100, got float 50.0")),
    row("PlanEntry", "byte_cap negative", lambda e: PlanEntry("p", 0, [1], (cpu(4),), byte_cap=-16),
        Raises(ValueError, r"PlanEntry.byte_cap must be an int >= 0, got -16")),
    row("PlanEntry", "byte_cap 15 (a table that loads nothing)",
        lambda e: PlanEntry("p", 0, [1], (cpu(4),), byte_cap=15),
        Raises(ValueError, r"PlanEntry.byte_cap must be 0 \(no cap\) or at least 16 bytes .*got 15")),
    row("PlanEntry", "byte_cap beyond 63 bits", lambda e: PlanEntry("p", 0, [1], (cpu(4),), byte_cap=2**64),
        Raises(ValueError, r"PlanEntry.byte_cap must be an int >= 0 below 2\*\*63, got 18446744073709551616")),
    row("PlanEntry", "priority an int", lambda e: PlanEntry("p", 0, [1], (cpu(4),), priority=1),
        Raises(TypeError, r"PlanEntry.priority must be a bool, got int 1")),
    row("PlanEntry", "zero-size and zero-dim weights (valid: their bytes)",
        lambda e: (PlanEntry("p", 0, [1], (cpu(0),)).nbytes,
                   PlanEntry("p", 0, [1], (torch.zeros((), dtype=torch.float32),)).nbytes),
        Returns((0, 4))),
    # Alignment is a property of the tensor's memory: checked when bytes are computed.
    row("PlanEntry.nbytes", "misaligned weight", lambda e: PlanEntry("p", 0, [1], (misaligned_cpu(),)).nbytes,
        Raises(ValueError, r"16-byte aligned: weight 0 .*on cpu\) starts at 0x[0-9a-f]+, 2 bytes past")),

    row("PlanEntry", "layer 65536 (past the controller's limit)", lambda e: PlanEntry("p", 65536, [1], (cpu(4),)),
        Raises(ValueError, r"PlanEntry.layer must be at most 65535 \(the controller's limit\), got 65536")),
    row("PlanEntry", "layer 2**40", lambda e: PlanEntry("p", 2**40, [1], (cpu(4),)),
        Raises(ValueError, r"PlanEntry.layer must be at most 65535 .*got 1099511627776")),
    row("PlanEntry", "layer 65535 (valid)", lambda e: PlanEntry("p", 65535, [1], (cpu(4),)).layer, Returns(65535)),
    row("PlanEntry", "batch 2**40", lambda e: PlanEntry("p", 0, [1, 2**40], (cpu(4),)),
        Raises(ValueError, r"PlanEntry.batches must hold batches of at most 65535 \(the controller's "
                           r"limit\), got 1099511627776")),
    row("PlanEntry", "batch 65535 (valid)", lambda e: PlanEntry("p", 0, [65535], (cpu(4),)).batches,
        Returns((65535,))),
    row("PlanEntry", "weights a set", lambda e: PlanEntry("p", 0, [1], {cpu(4), cpu(8)}),
        Raises(TypeError, r"PlanEntry.weights must be an ordered sequence of tensors, got set, a set; "
                          r"pass a list or tuple in the order the kernels read them")),
    row("PlanEntry", "weights a frozenset", lambda e: PlanEntry("p", 0, [1], frozenset([cpu(4)])),
        Raises(TypeError, r"must be an ordered sequence of tensors, got frozenset, a set")),
    row("PlanEntry", "weights a dict", lambda e: PlanEntry("p", 0, [1], {"w": cpu(4)}),
        Raises(TypeError, r"must be an ordered sequence of tensors, got dict, a mapping \(it iterates its keys\)")),
    row("PlanEntry", "weights a generator (valid: taken in order)",
        lambda e: len(PlanEntry("p", 0, [1], (cpu(4) for _ in range(3))).weights), Returns(3)),
    row("PlanEntry", "kernel an int", lambda e: PlanEntry("p", 0, [1], (cpu(4),), kernel=3),
        Raises(TypeError, r"PlanEntry.kernel must be a kernel variant name \(str\) or None \(the "
                          r"device's default\), got int 3")),
    row("PlanEntry", "kernel unknown", lambda e: PlanEntry("p", 0, [1], (cpu(4),), kernel="fast"),
        Raises(ValueError, r"PlanEntry.kernel 'fast' is not a kernel variant; known: bulk_prefetch, .*ring")),
    row("PlanEntry", "kernel 'ring' (valid)", lambda e: PlanEntry("p", 0, [1], (cpu(4),), kernel="ring").kernel,
        Returns("ring")),
    row("PlanEntry", "graph_fork an int", lambda e: PlanEntry("p", 0, [1], (cpu(4),), graph_fork=1),
        Raises(TypeError, r"PlanEntry.graph_fork must be 'inline', 'branch' or 'leaf', or None \(the "
                          r"controller's mode\), got int 1")),
    row("PlanEntry", "graph_fork a bool", lambda e: PlanEntry("p", 0, [1], (cpu(4),), graph_fork=True),
        Raises(TypeError, r"PlanEntry.graph_fork must be 'inline', 'branch' or 'leaf'.*got bool True")),
    row("PlanEntry", "graph_fork unknown", lambda e: PlanEntry("p", 0, [1], (cpu(4),), graph_fork="side"),
        Raises(ValueError, r"PlanEntry.graph_fork must be 'inline', 'branch' or 'leaf', or None .*got 'side'")),
    row("PlanEntry", "a weight twice", lambda e: PlanEntry("p", 0, [1], (e.model[0].weight, cpu(4),
                                                                        e.model[0].weight)),
        Raises(ValueError, r"PlanEntry.weights\[2\] is weights\[0\] again \(\(4, 4\) float32 on cpu; "
                           r"a tied weight reached by two names is one tensor\): list each tensor once")),
    row("PlanEntry", "batches a mapping (a cap table)", lambda e: PlanEntry("p", 0, {1: 16, 8: 32}, (cpu(4),)),
        Raises(TypeError, r"PlanEntry.batches must be an iterable of decode batches, got dict "
                          r"\{1: 16, 8: 32\}, a mapping \(it iterates its keys\): pass its keys")),
    row("PlanEntry", "batches without end", lambda e: PlanEntry("p", 0, itertools.count(1), (cpu(4),)),
        Raises(ValueError, r"PlanEntry.batches must hold batches of at most 65535 \(the controller's "
                           r"limit\), got 65536")),
    row("PlanEntry", "batches 65536 of them", lambda e: PlanEntry("p", 0, [1] * 70000, (cpu(4),)),
        Raises(ValueError, r"PlanEntry.batches must name each batch once, \[1\] repeat in \(1, 1, 1, "
                           r"1, 1, 1, \.\.\.\)")),
    row("PlanEntry", "layer of 5000 digits", lambda e: PlanEntry("p", 10**5000, [1], (cpu(4),)),
        Raises(ValueError, r"PlanEntry.layer must be at most 65535 \(the controller's limit\), got "
                           r"<an int of 16610 bits>")),
    row("PlanEntry", "layer of 5000 digits, negative", lambda e: PlanEntry("p", -10**5000, [1], (cpu(4),)),
        Raises(ValueError, r"PlanEntry.layer must be an int >= 0, got <a negative int of 16610 bits>")),
    row("PlanEntry", "grid of 5000 digits", lambda e: PlanEntry("p", 0, [1], (cpu(4),), grid=10**5000),
        Raises(ValueError, r"PlanEntry.grid must be an int in 1..65535, got <an int of 16610 bits>")),
    row("plan.format_plan", "an int entry", lambda e: format_plan([1]),
        Raises(TypeError, r"plan\[0\] must be a PlanEntry, not int")),
    row("plan.format_plan", "l2_bytes of 5000 digits", lambda e: format_plan([], l2_bytes=10**5000),
        Raises(ValueError, r"l2_bytes must be a positive int \(bytes\) below 2\*\*63, or None, got "
                           r"<an int of 16610 bits>")),
    row("plan.plan_to_json", "an int entry", lambda e: plan_to_json([1], e.model),
        Raises(TypeError, r"plan\[0\] must be a PlanEntry, not int")),
    row("plan.cap_groups", "a list", lambda e: cap_groups([16]),
        Raises(TypeError, r"the cap table must map batches to caps in MiB, e.g. \{1: 24, 8: 16\}, got "
                          r"list \[16\]")),
    row("PlanEntry", "graph_fork 'branch' (valid)",
        lambda e: PlanEntry("p", 0, [1], (cpu(4),), graph_fork="branch").graph_fork, Returns("branch")),

    # ---- kimi_k3.plan(layers, packed, tp, next_attention=None) --------------------------------------
    row("kimi_k3.plan", "tp 3", lambda e: kimi_k3.plan(e.kimi[1], e.kimi[2], 3),
        Raises(ValueError, r"tp=3 has no next_attention table; supported: \[1, 2, 4, 8\]")),
    row("kimi_k3.plan", "tp a str", lambda e: kimi_k3.plan(e.kimi[1], e.kimi[2], "8"),
        Raises(TypeError, r"tp must be an int, the tensor-parallel degree \(one of \[1, 2, 4, 8\]\), got str '8'")),
    row("kimi_k3.plan", "tp None", lambda e: kimi_k3.plan(e.kimi[1], e.kimi[2], None),
        Raises(TypeError, r"tp must be an int, .*got NoneType None")),
    row("kimi_k3.plan", "layers None", lambda e: kimi_k3.plan(None, {}, 8),
        Raises(TypeError, r"layers must be a sequence of decoder layers \(a list or nn.ModuleList\), got NoneType")),
    row("kimi_k3.plan", "a MoE layer without its packed front", lambda e: kimi_k3.plan(e.kimi[1], {}, 8),
        Raises(LookupError, r"packed has no front tensor for MoE layer 1")),
    row("kimi_k3.plan", "layer_idx a str", lambda e: kimi_k3.plan([kimi_layer("1")], {"1": cpu(4)}, 4,
                                                                    points=kimi_k3.POINTS),
        Raises(TypeError, r"PlanEntry.layer must be an int >= 0, got str '1'")),
    row("kimi_k3.plan", "a negative cap", lambda e: kimi_k3.plan(e.kimi[1], e.kimi[2], 8, {8: {1: -1}}),
        Raises(ValueError, r"cap table entry for batch 1: cap must be an int >= 0 \(MiB\), got -1")),
    row("kimi_k3.plan", "a str cap", lambda e: kimi_k3.plan(e.kimi[1], e.kimi[2], 8, {8: {1: "32"}}),
        Raises(TypeError, r"cap table entry for batch 1: cap must be an int >= 0 \(MiB\), got '32'")),
    row("kimi_k3.plan", "a float batch in the cap table",
        lambda e: kimi_k3.plan(e.kimi[1], e.kimi[2], 8, {8: {1.5: 32}}),
        Raises(TypeError, r"cap table batches must be ints >= 1, got 1.5")),
    row("kimi_k3.plan", "no layers (valid: no entries)", lambda e: kimi_k3.plan([], {}, 8), Returns([])),
    row("kimi_k3.plan", "points a str", lambda e: kimi_k3.plan(e.kimi[1], e.kimi[2], 8, points="oproj_down"),
        Raises(TypeError, r"points must be a collection of point names from \('oproj_down', "
               r"'attention_moe', 'next_attention'\), got str 'oproj_down'")),
    row("kimi_k3.plan", "points None inside", lambda e: kimi_k3.plan(e.kimi[1], e.kimi[2], 8, points=[None]),
        Raises(ValueError, r"unknown point\(s\) \[None\]: points must be names from")),
    row("kimi_k3.plan", "an unknown point", lambda e: kimi_k3.plan(e.kimi[1], e.kimi[2], 8, points=["oproj"]),
        Raises(ValueError, r"unknown point\(s\) \['oproj'\]: points must be names from")),
    row("kimi_k3.hook_points", "an unknown point",
        lambda e: kimi_k3.hook_points(e.kimi[1], 8, points=["next"]),
        Raises(ValueError, r"unknown point\(s\) \['next'\]")),

    row("kimi_k3.plan", "tp a bool (True is not TP 1)", lambda e: kimi_k3.plan(e.kimi[1], e.kimi[2], True),
        Raises(TypeError, r"tp must be an int, the tensor-parallel degree .*got bool True")),
    row("kimi_k3.plan", "tp a list", lambda e: kimi_k3.plan(e.kimi[1], e.kimi[2], [8]),
        Raises(TypeError, r"tp must be an int, the tensor-parallel degree .*got list \[8\]")),
    row("kimi_k3.plan", "tp 3 of a custom table", lambda e: kimi_k3.plan(e.kimi[1], e.kimi[2], 3, {8: {1: 16}}),
        Raises(ValueError, r"tp=3 has no next_attention table; supported: \[8\] \(pass next_attention=")),
    row("kimi_k3.plan", "next_attention a list", lambda e: kimi_k3.plan(e.kimi[1], e.kimi[2], 8, [1, 2]),
        Raises(TypeError, r"next_attention must map tp -> \{batch: cap_mib or \(cap_mib, carveout\)\}, "
                          r"e.g. \{8: \{1: 16, 2: 16\}\}, got list \[1, 2\]")),
    row("kimi_k3.plan", "next_attention[tp] a list", lambda e: kimi_k3.plan(e.kimi[1], e.kimi[2], 8, {8: [1, 2]}),
        Raises(TypeError, r"next_attention\[8\] must map batch -> cap_mib or \(cap_mib, carveout\), "
                          r"e.g. \{1: 16, 2: 16\}, got list \[1, 2\]")),
    row("kimi_k3.plan", "layers an int", lambda e: kimi_k3.plan(3, {}, 8),
        Raises(TypeError, r"layers must be a sequence of decoder layers .*got int")),
    row("kimi_k3.plan", "layer_idx 2**40", lambda e: kimi_k3.plan([kimi_layer(2**40)], {2**40: cpu(4)}, 4,
                                                                    points=kimi_k3.POINTS),
        Raises(ValueError, r"PlanEntry.layer must be at most 65535 .*got 1099511627776")),
    row("kimi_k3.hook_points", "tp a bool", lambda e: kimi_k3.hook_points(e.kimi[1], True),
        Raises(TypeError, r"tp must be an int, the tensor-parallel degree .*got bool True")),
    row("kimi_k3.hook_points", "tp a list", lambda e: kimi_k3.hook_points(e.kimi[1], [8]),
        Raises(TypeError, r"tp must be an int, .*got list \[8\]")),

    # ---- deepseek_v3.plan(model, batches=range(1, 9), next_attention_mib=16, *, ...) ---------------
    row("deepseek_v3.plan", "model None", lambda e: deepseek_v3.plan(None),
        Raises(ValueError, r"NoneType has no decoder layers with self_attn and mlp")),
    row("deepseek_v3.plan", "model without layers", lambda e: deepseek_v3.plan(nn.Linear(2, 2)),
        Raises(ValueError, r"Linear has no decoder layers with self_attn and mlp")),
    row("deepseek_v3.plan", "batches None", lambda e: deepseek_v3.plan(deepseek_model(), None),
        Raises(TypeError, r"batches must be an iterable of decode batches \(ints >= 1\), e.g. range\(1, 9\), got NoneType None")),
    row("deepseek_v3.plan", "batches an int", lambda e: deepseek_v3.plan(deepseek_model(), 8),
        Raises(TypeError, r"batches must be an iterable of decode batches .*got int 8")),
    row("deepseek_v3.plan", "batch 0", lambda e: deepseek_v3.plan(deepseek_model(), [0]),
        Raises(ValueError, r"batches must hold ints >= 1, got 0")),
    row("deepseek_v3.plan", "a str batch", lambda e: deepseek_v3.plan(deepseek_model(), ["1"]),
        Raises(TypeError, r"batches must hold ints >= 1, got str '1'")),
    row("deepseek_v3.plan", "cap negative", lambda e: deepseek_v3.plan(deepseek_model(), [1], -1),
        Raises(ValueError, r"next_attention_mib must be a cap in MiB >= 0 \(0: no next_attention\), got -1")),
    row("deepseek_v3.plan", "cap None", lambda e: deepseek_v3.plan(deepseek_model(), [1], None),
        Raises(TypeError, r"next_attention_mib must be a cap in MiB \(an int >= 0\) or a table \{batch: cap_mib or \(cap_mib, carveout\)\}, got NoneType None")),
    row("deepseek_v3.plan", "cap a float", lambda e: deepseek_v3.plan(deepseek_model(), [1], 1.5),
        Raises(TypeError, r"next_attention_mib must be a cap in MiB .*got float 1.5")),
    row("deepseek_v3.plan", "a negative cap in a table",
        lambda e: deepseek_v3.plan(deepseek_model(), [1], {1: -1}),
        Raises(ValueError, r"cap table entry for batch 1: cap must be an int >= 0 \(MiB\), got -1")),
    row("deepseek_v3.plan", "no batches",
        lambda e: deepseek_v3.plan(deepseek_model(), (), points=deepseek_v3.POINTS),
        Raises(ValueError, r"PlanEntry.batches must name at least one batch")),
    row("deepseek_v3.plan", "no batches, default points (valid: no entries)",
        lambda e: deepseek_v3.plan(deepseek_model(), ()), Returns([])),
    row("deepseek_v3.plan", "points a str",
        lambda e: deepseek_v3.plan(deepseek_model(), points="oproj_down"),
        Raises(TypeError, r"points must be a collection of point names from \('oproj_down', "
               r"'next_attention'\), got str 'oproj_down'")),
    row("deepseek_v3.plan", "points None inside",
        lambda e: deepseek_v3.plan(deepseek_model(), points=[None]),
        Raises(ValueError, r"unknown point\(s\) \[None\]: points must be names from")),
    row("deepseek_v3.plan", "an unknown point",
        lambda e: deepseek_v3.plan(deepseek_model(), points=["attention_moe"]),
        Raises(ValueError, r"unknown point\(s\) \['attention_moe'\]: points must be names from")),
    row("deepseek_v3.hook_points", "an unknown point",
        lambda e: deepseek_v3.hook_points(deepseek_model(), points=["next"]),
        Raises(ValueError, r"unknown point\(s\) \['next'\]")),

    row("deepseek_v3.plan", "batches a str", lambda e: deepseek_v3.plan(deepseek_model(), "18"),
        Raises(TypeError, r"batches must be an iterable of decode batches .*got str '18'")),
    row("deepseek_v3.plan", "a bool batch", lambda e: deepseek_v3.plan(deepseek_model(), [True]),
        Raises(TypeError, r"batches must hold ints >= 1, got bool True")),
    row("deepseek_v3.plan", "cap a bool", lambda e: deepseek_v3.plan(deepseek_model(), [1], True),
        Raises(TypeError, r"next_attention_mib must be a cap in MiB .*got bool True")),
    row("deepseek_v3.plan", "cap a list", lambda e: deepseek_v3.plan(deepseek_model(), [1], [16]),
        Raises(TypeError, r"next_attention_mib must be a cap in MiB .*got list \[16\]")),
    row("deepseek_v3.plan", "include_shared_experts a str",
        lambda e: deepseek_v3.plan(deepseek_model(), include_shared_experts="no"),
        Raises(TypeError, r"include_shared_experts must be a bool, got str 'no'")),

    # ---- hooks.attach(model, controller, points, *, batch_fn=None, join=True) -------------------------
    row("hooks.attach", "model None", lambda e: hooks.attach(None, e.ctl, {}),
        Raises(TypeError, r"model must be a torch.nn.Module, got NoneType")),
    row("hooks.attach", "controller None", lambda e: e.attach(None),
        Raises(TypeError, r"controller must have fork\(point, layer, batch\) and join\(\); NoneType has no fork\(\)")),
    row("hooks.attach", "points None", lambda e: e.attach(e.ctl, None),
        Raises(TypeError, r"points must map point names to fork sites, got NoneType")),
    row("hooks.attach", "points a list", lambda e: e.attach(e.ctl, [("attn", [])]),
        Raises(TypeError, r"points must map point names to fork sites, got list")),
    row("hooks.attach", "point name an int", lambda e: e.attach(e.ctl, {3: [(e.model[0], 0)]}),
        Raises(TypeError, r"point names must be non-empty str, got 3")),
    row("hooks.attach", "sites None", lambda e: e.attach(e.ctl, {"attn": None}),
        Raises(TypeError, r"points\['attn'\] must be a list of \(module, layer\) .*got NoneType")),
    row("hooks.attach", "a site that is not a pair", lambda e: e.attach(e.ctl, {"attn": [e.model[0]]}),
        Raises(TypeError, r"points\['attn'\] must hold \(module, layer\) or \(module, layer, "
                          r"hook\) tuples")),
    row("hooks.attach", "a site's hook unknown",
        lambda e: e.attach(e.ctl, {"attn": [(e.model[0], 0, "around")]}),
        Raises(ValueError, r"points\['attn'\]: a site's hook must be 'after' or 'before', "
                           r"got 'around'")),
    row("hooks.attach", "site module None", lambda e: e.attach(e.ctl, {"attn": [(None, 0)]}),
        Raises(TypeError, r"points\['attn'\]: NoneType is not an nn.Module")),
    row("hooks.attach", "site layer a str", lambda e: e.attach(e.ctl, {"attn": [(e.model[0], "0")]}),
        Raises(TypeError, r"points\['attn'\]: layer must be an int in 0\.\.65535, got '0'")),
    row("hooks.attach", "site layer negative", lambda e: e.attach(e.ctl, {"attn": [(e.model[0], -1)]}),
        Raises(ValueError, r"points\['attn'\]: the site '0' \(after\) has layer -1, outside "
                           r"0\.\.65535")),
    row("hooks.attach", "site layer over 65535",
        lambda e: e.attach(e.ctl, {"attn": [(e.model[0], 65536)]}),
        Raises(ValueError, r"points\['attn'\]: the site '0' \(after\) has layer 65536, outside "
                           r"0\.\.65535")),
    row("hooks.attach", "site layer of 5000 digits",
        lambda e: e.attach(e.ctl, {"attn": [(e.model[0], 10**5000)]}),
        Raises(ValueError, r"points\['attn'\]: the site '0' \(after\) has layer <an int of 16610 "
                           r"bits>, outside 0\.\.65535")),
    row("hooks.attach", "batch_fn giving a negative int of 5000 digits",
        lambda e: (hooks.attach(e.model, e.ctl, {"attn": [(e.model[0], 0)]},
                                batch_fn=lambda *a: -10**5000), e.forward()),
        Raises(ValueError, r"batch_fn returned <a negative int of 16610 bits> at point 'attn', "
                           r"layer 0")),
    row("hooks.attach", "a point the controller does not know (valid: forks return False)",
        lambda e: (e.attach(e.ctl, {"nope": [(e.model[0], 0)]}), e.forward(), e.ctl.stats())[2],
        Returns({"attn": {"forks": 0, "bytes": 0}})),
    row("hooks.attach", "batch_fn giving a str: the forward's fork raises",
        lambda e: (hooks.attach(e.model, e.ctl, {"attn": [(e.model[0], 0)]}, batch_fn=lambda *a: "2"),
                   e.forward()),
        Raises(TypeError, r"batch_fn returned str '2' at point 'attn', layer 0: it must "
                          r"return an int >= 0")),
    row("hooks.attach", "a zero-size input (valid: batch 0, no fork)",
        lambda e: (e.attach(e.ctl), e.model(torch.zeros(0, 4)), e.ctl.stats())[2],
        Returns({"attn": {"forks": 0, "bytes": 0}})),
    row("hooks.attach", "a closed controller: the forward's fork raises, naming the hooks",
        lambda e: (e.attach(e.closed), e.forward()),
        Raises(Error, r"the PrefetchController that hooks.attach hooked into this model is "
                      r"closed, and its hooks are still on: detach them")),

    # ---- plan.plan_from_json(text, model) --------------------------------------------------------------
    row("plan_from_json", "text None", lambda e: plan_from_json(None, e.model),
        Raises(TypeError, r"text must be the plan JSON as str \(plan_to_json's\), got NoneType; for a "
                          r"file, read it first")),
    row("plan_from_json", "model None", lambda e: plan_from_json(plan_json(), None),
        Raises(TypeError, r"model must be the nn.Module whose tensors the plan names, got NoneType")),
    row("plan_from_json", "not JSON", lambda e: plan_from_json("{", e.model),
        Raises(ValueError, r"plan JSON does not parse")),
    row("plan_from_json", "a list", lambda e: plan_from_json("[]", e.model),
        Raises(ValueError, r"plan JSON must be an object with 'version' and 'entries'")),
    row("plan_from_json", "version 3", lambda e: plan_from_json('{"version": 3, "entries": []}', e.model),
        Raises(ValueError, r"plan JSON version 3 is not supported; this l2prefetch reads versions 1 and 2")),
    row("plan_from_json", "version true", lambda e: plan_from_json('{"version": true, "entries": []}', e.model),
        Raises(ValueError, r"plan JSON version True is not supported")),
    row("plan_from_json", "entries an object", lambda e: plan_from_json('{"version": 1, "entries": {}}', e.model),
        Raises(ValueError, r"plan JSON 'entries' must be a list")),
    row("plan_from_json", "an entry without weights",
        lambda e: plan_from_json('{"version": 1, "entries": [{"point": "a", "layer": 0, "batches": [1]}]}', e.model),
        Raises(ValueError, r"plan JSON entry 0: missing fields \['weights'\]")),
    row("plan_from_json", "weights a str", lambda e: plan_from_json(plan_json(weights="0.weight"), e.model),
        Raises(ValueError, r"plan JSON entry 0: 'weights' must be a list of names, got '0.weight'")),
    row("plan_from_json", "a weight the model lacks", lambda e: plan_from_json(plan_json(weights=["0.wieght"]), e.model),
        Raises(ValueError, r"weight '0.wieght' is not a parameter, buffer or tensor attribute .*closest: 0.weight")),
    row("plan_from_json", "layer a str", lambda e: plan_from_json(plan_json(layer="0"), e.model),
        Raises(TypeError, r"PlanEntry.layer must be an int >= 0, got str '0'")),
    row("plan_from_json", "grid 0", lambda e: plan_from_json(plan_json(grid=0), e.model),
        Raises(ValueError, r"PlanEntry.grid must be an int in 1\.\.65535, got 0")),

    row("plan_from_json", "100000 nested brackets", lambda e: plan_from_json("[" * 100000, e.model),
        Raises(ValueError, r"plan JSON does not parse: it is nested too deeply")),
    row("plan_from_json", "entries nested 100000 deep",
        lambda e: plan_from_json('{"version": 2, "entries": ' + "[" * 100000, e.model),
        Raises(ValueError, r"plan JSON does not parse: it is nested too deeply")),
    row("plan_from_json", "version 1.0", lambda e: plan_from_json('{"version": 1.0, "entries": []}', e.model),
        Raises(ValueError, r"plan JSON version 1.0 is not supported; this l2prefetch reads versions 1 and 2")),
    row("plan_from_json", "layer 2**40", lambda e: plan_from_json(plan_json(layer=2**40), e.model),
        Raises(ValueError, r"PlanEntry.layer must be at most 65535 .*got 1099511627776")),
    row("plan_from_json", "a version 1 entry with a kernel",
        lambda e: plan_from_json(plan_json(kernel="ring"), e.model),
        Raises(ValueError, r"plan JSON entry 0: missing fields \[\], unknown fields \['kernel'\]; "
                           r"fields of version 1 are")),
    row("plan_from_json", "an unknown kernel", lambda e: plan_from_json(plan_json(2, kernel="nope"), e.model),
        Raises(ValueError, r"PlanEntry.kernel 'nope' is not a kernel variant; known:")),
    row("plan_from_json", "an unknown graph_fork", lambda e: plan_from_json(plan_json(2, graph_fork="side"), e.model),
        Raises(ValueError, r"PlanEntry.graph_fork must be 'inline', 'branch' or 'leaf', or None .*got 'side'")),
    row("plan_from_json", "version 2 with kernel and graph_fork (valid)",
        lambda e: [(x.kernel, x.graph_fork) for x in
                   plan_from_json(plan_json(2, kernel="ring", graph_fork="branch"), e.model)],
        Returns([("ring", "branch")])),
    row("plan_from_json", "a version 1 file (valid: kernel and graph_fork None)",
        lambda e: [(x.kernel, x.graph_fork) for x in plan_from_json(plan_json(), e.model)],
        Returns([(None, None)])),

    row("plan_from_json", "a key given twice (json keeps the last)",
        lambda e: plan_from_json(plan_json(2, byte_cap=4096)[:-3] + ', "byte_cap": 0}]}', e.model),
        Raises(ValueError, r"plan JSON: entries\[0\] gives the key 'byte_cap' more than once")),
    row("plan_from_json", "two entries for one point, layer and batch",
        lambda e: plan_from_json(json.dumps({"version": 2, "entries": [json.loads(plan_json())["entries"][0]] * 2}),
                                 e.model),
        Raises(ValueError, r"plan JSON entries 0 and 1 both prefetch at point 'attn', layer 0, batch 1")),
    row("plan_from_json", "a weight named twice in an entry",
        lambda e: plan_from_json(plan_json(weights=["0.weight", "0.weight"]), e.model),
        Raises(ValueError, r"plan JSON entry 0: 'weights' lists \['0.weight'\] more than once")),
    row("plan_from_json", "a 5000-digit layer", lambda e: plan_from_json(plan_json().replace('"layer": 0', '"layer": ' + "9" * 5000), e.model),
        Raises(ValueError, r"plan JSON: entries\[0\].layer is a 5000-digit number")),
    row("plan_from_json", "byte_cap 8", lambda e: plan_from_json(plan_json(byte_cap=8), e.model),
        Raises(ValueError, r"plan JSON entry 0: PlanEntry.byte_cap must be 0 \(no cap\) or at least 16 bytes")),

    # ---- tuning.load_profile(path, model, *, device=None, check_device=True) -----------------------------
    row("load_profile", "a valid profile (check_device=False)",
        lambda e: len(load_profile(e.profile(), e.model, check_device=False).plan), Returns(1)),
    row("load_profile", "a FIFO (no hang)", lambda e: load_profile(e.fifo(), e.model, check_device=False),
        Raises(ValueError, r"profile .*fifo.json is a FIFO, not a regular file")),
    row("load_profile", "a directory", lambda e: load_profile(e.tmp_path, e.model, check_device=False),
        Raises(ValueError, r"profile .* is a directory, not a regular file")),
    row("load_profile", "\"plan\" given twice", lambda e: load_profile(
            e.profile(text=e.profile().read_text()[:-1] + ', "plan": []}'), e.model, check_device=False),
        Raises(ValueError, r"profile .*p.json: the top level gives the key 'plan' more than once")),
    row("load_profile", "two entries for one key",
        lambda e: load_profile(e.profile(lambda d: d["plan"].append(dict(d["plan"][0]))), e.model,
                               check_device=False),
        Raises(ValueError, r"profile .*p.json: plan\[0\] and plan\[1\] both prefetch at point 'attn', layer 0")),
    row("load_profile", "an entry for a batch not in 'batches'",
        lambda e: load_profile(e.profile(lambda d: d["plan"][0].update(batches=[2])), e.model,
                               check_device=False),
        Raises(ValueError, r"plan\[0\].batches holds 2, which is not one of the profile's batches \[1\]")),
    row("load_profile", "a layer-0 entry whose site is in layer 1",
        lambda e: load_profile(e.profile(lambda d: d["plan"][0].update(site="layers.1.mlp")), e.model,
                               check_device=False),
        Raises(ValueError, r"plan\[0\].site 'layers.1.mlp' is in layer 1, but the entry is for layer 0")),
    row("load_profile", "one weight listed three times",
        lambda e: load_profile(e.profile(lambda d: d["plan"][0].update(weights=["0.weight"] * 3)),
                               e.model, check_device=False),
        Raises(ValueError, r"plan\[0\].weights lists \['0.weight'\] more than once")),
    row("load_profile", "batches [10**30]",
        lambda e: load_profile(e.profile(lambda d: d.update(batches=[10**30])), e.model, check_device=False),
        Raises(ValueError, r"'batches' must be a non-empty list of ints in 1..65535")),
    row("load_profile", "a fingerprint weight of 5",
        lambda e: load_profile(e.profile(lambda d: d["model"]["weights"].update({"0.weight": 5})),
                               e.model, check_device=False),
        Raises(ValueError, r"profile .*p.json: 'model.weights'\['0.weight'\] must be \[shape, dtype\]")),
    row("load_profile", "versions a str",
        lambda e: load_profile(e.profile(lambda d: d.update(versions="x")), e.model, check_device=False),
        Raises(ValueError, r"profile .*p.json: 'versions' must be an object, got 'x'")),
    row("load_profile", "a 5000-digit number",
        lambda e: load_profile(e.profile(text=json.dumps({"format": "l2prefetch-profile", "version": 1,
                                                          "batches": [1]}).replace("[1]", "[1" + "0" * 5000 + "]")),
                               e.model, check_device=False),
        Raises(ValueError, r"profile .*p.json: batches\[0\] is a 5001-digit number")),
    row("load_profile", "device='cpu'", lambda e: load_profile(e.profile(), e.model, device="cpu"),
        Raises(ValueError, r"device must be a CUDA device \('cuda' or 'cuda:N'\), got 'cpu'")),
    row("load_profile", "a torch that sees no GPU", lambda e: load_profile(e.profile(), e.model),
        Raises(l2prefetch.CudaUnavailableError, r"torch .* sees no CUDA device .*check_device=False")),
    row("load_profile", "another class's profile",
        _loaded_after(lambda d: d["model"].update({"class": "LlamaForCausalLM"})),
        Raises(tuning.ProfileMismatchError, r"class 'LlamaForCausalLM' in the profile, Sequential here")),
    row("load_profile", "a misspelt top-level field (Step)",
        _loaded_after(lambda d: d.update(Step={"compiled": True})),
        Raises(ValueError, r"profile .*p.json: unknown fields \['Step'\]")),
    row("load_profile", "an unknown device field",
        _loaded_after(lambda d: d["device"].update(mig="1g")),
        Raises(ValueError, r"unknown fields \['device.mig'\]")),
    row("load_profile", "an unknown model field",
        _loaded_after(lambda d: d["model"].update(klass="x")),
        Raises(ValueError, r"unknown fields \['model.klass'\]")),
    row("load_profile", "a point named by a lone surrogate",
        _loaded_after(lambda d: d["plan"][0].update(point="\ud800")),
        Raises(ValueError, r"plan\[0\].point must be a non-empty str of printable characters")),
    row("load_profile", "a site whose layer is a superscript digit",
        _loaded_after(lambda d: d["plan"][0].update(site="layers.\u00b2.mlp")),
        Raises(tuning.ProfileMismatchError, r"plan\[0\] forks at .*, which is not a module of this model")),
    row("load_profile", "a site with a 5000-digit layer",
        _loaded_after(lambda d: d["plan"][0].update(site="l." + "1" * 5000)),
        Raises(tuning.ProfileMismatchError, r"which is not a module of this model")),
    row("load_profile", "source an int", lambda e: load_profile(3, e.model, check_device=False),
        Raises(TypeError, r"source must be the profile's path \(str or os.PathLike\), got int")),
    row("load_profile", "model None", lambda e: load_profile(e.profile(), None, check_device=False),
        Raises(TypeError, r"model must be the torch.nn.Module the profile was tuned for, got NoneType")),
    row("Profile.check_model", "the model converted to float16 after loading",
        lambda e: _changed_after_load(e, lambda m: m.half()),
        Raises(tuning.ProfileMismatchError, r"0.weight is \[4, 4\] float16 here, \[4, 4\] float32")),
    row("Profile.check_model", "a weight assigned anew after loading",
        lambda e: _changed_after_load(e, lambda m: setattr(m[0], "weight", nn.Parameter(torch.zeros(4, 4)))),
        Raises(tuning.ProfileMismatchError, r"plan\[0\] \('attn', layer 0\) holds weights that are not "
                                            r"this Sequential's")),
    row("save_profile", "path an int", lambda e: save_profile(5, json.loads(e.profile().read_text())),
        Raises(TypeError, r"path must be a str or os.PathLike naming the profile file, got int")),
    row("save_profile", "a set in the document",
        lambda e: save_profile(e.tmp_path / "p.json", {**json.loads(e.profile().read_text()),
                                                       "tuning": {"grids": {16, 32}}}),
        Raises(TypeError, r"profile .*p.json: Object of type set is not JSON serializable; a profile "
                          r"holds only JSON's types")),
    row("profile_document", "a site that is a weight, not a module",
        lambda e: _document(e, {"attn": [("0.weight", 0)]}),
        Raises(ValueError, r"sites\['attn'\] holds '0.weight', which is not a module path of the model")),
    row("profile_document", "a site given as a module object",
        lambda e: _document(e, {"attn": [(e.model[0], 0)]}),
        Raises(ValueError, r"sites\['attn'\] holds Linear\(.*\), which is not a module path")),
    row("profile_document", "an entry without a site", lambda e: _document(e, {}),
        Raises(ValueError, r"plan entry 'attn' layer 0 has no site in sites\['attn'\]")),
    row("profile.model_fingerprint", "a weight path the model lacks",
        lambda e: model_fingerprint(e.model, ["nope"]),
        Raises(ValueError, r"weights holds 'nope', which is not a tensor path of the model")),
    row("save_profile", "a directory as the path",
        lambda e: save_profile(e.tmp_path, json.loads(e.profile().read_text())),
        Raises(ValueError, r"profile .* is a directory: name a file to write")),
    row("from_profile", "a profile loaded for another model of the same shapes",
        lambda e: PC.from_profile(load_profile(e.profile(), e.twin, check_device=False), e.model),
        Raises(tuning.ProfileMismatchError, r"was loaded for another Sequential object, not this Sequential")),
    row("from_profile", "device='cpu'", lambda e: PC.from_profile(e.profile(), e.model, device="cpu"),
        Raises(ValueError, r"device must be a CUDA device")),

    # ---- plan.gate(plan, windows_us, *, bytes_per_us=3.2e6, min_bytes=0) --------------------------------
    row("plan.gate", "plan None", lambda e: gate(None, {}),
        Raises(TypeError, r"plan must be an iterable of PlanEntry \(a list\), got NoneType None")),
    row("plan.gate", "a None entry", lambda e: gate([e.entry, None], {}),
        Raises(TypeError, r"plan\[1\] must be a PlanEntry, not NoneType")),
    row("plan.gate", "windows None", lambda e: gate([e.entry], None),
        Raises(TypeError, r"windows_us must map point names to windows in microseconds, got NoneType")),
    row("plan.gate", "a str window", lambda e: gate([e.entry], {"attn": "10"}),
        Raises(TypeError, r"windows_us\['attn'\] must be a number of microseconds >= 0, got str '10'")),
    row("plan.gate", "a window past a float's range", lambda e: gate([e.entry], {"attn": 10**400}),
        Raises(ValueError, r"windows_us\['attn'\] must be a number of microseconds >= 0, got "
                           r"<an int of 1329 bits>, past a float's range")),
    row("plan.gate", "a negative window", lambda e: gate([e.entry], {"attn": -1.0}),
        Raises(ValueError, r"windows_us\['attn'\] must be a number of microseconds >= 0, got -1.0")),
    row("plan.gate", "a NaN window", lambda e: gate([e.entry], {"attn": float("nan")}),
        Raises(ValueError, r"windows_us\['attn'\] must be a number of microseconds >= 0, got nan")),
    row("plan.gate", "bytes_per_us 0", lambda e: gate([e.entry], {}, bytes_per_us=0),
        Raises(ValueError, r"bytes_per_us must be a finite number > 0, got 0")),
    row("plan.gate", "bytes_per_us NaN", lambda e: gate([e.entry], {}, bytes_per_us=float("nan")),
        Raises(ValueError, r"bytes_per_us must be a finite number > 0, got nan")),
    row("plan.gate", "bytes_per_us None", lambda e: gate([e.entry], {}, bytes_per_us=None),
        Raises(TypeError, r"bytes_per_us must be a number > 0, got NoneType None")),
    row("plan.gate", "min_bytes negative", lambda e: gate([e.entry], {}, min_bytes=-1),
        Raises(ValueError, r"min_bytes must be an int >= 0, got -1")),
    row("plan.gate", "min_bytes a float", lambda e: gate([e.entry], {}, min_bytes=4.0),
        Raises(TypeError, r"min_bytes must be an int >= 0, got float 4.0")),
    row("plan.gate", "min_bytes None", lambda e: gate([e.entry], {}, min_bytes=None),
        Raises(TypeError, r"min_bytes must be an int >= 0, got NoneType None")),
    row("plan.gate", "min_bytes a bool", lambda e: gate([e.entry], {}, min_bytes=True),
        Raises(TypeError, r"min_bytes must be an int >= 0, got bool True")),
    row("plan.gate", "an unknown point (valid: kept)", lambda e: gate([e.entry], {"nope": 0.0}) == [e.entry],
        Returns(True)),
    row("plan.gate", "a zero-size entry, window 0 (valid: kept)",
        lambda e: len(gate([PlanEntry("attn", 0, [1], (cpu(0),))], {"attn": 0.0})), Returns(1)),

    # ---- python -m l2prefetch plan (cli.plan_main) and python -m l2prefetch -----------------------------
    row("cli plan", "--tp 3", lambda e: plan_main(["--tp", "3"]),
        Exits(2, r"argument --tp: invalid choice: 3 \(choose from 1, 2, 4, 8\)")),
    row("cli plan", "--tp x", lambda e: plan_main(["--tp", "x"]),
        Exits(2, r"argument --tp: invalid int value: 'x'")),
    row("cli plan", "--bogus", lambda e: plan_main(["--bogus"]),
        Exits(2, r"unrecognized arguments: --bogus")),
    row("cli plan", "--layers 0", lambda e: plan_main(["--layers", "0"]),
        Exits(2, r"l2prefetch plan: dimension layers must be an int >= 1, got 0")),
    row("cli plan", "--layers -1", lambda e: plan_main(["--layers", "-1"]),
        Exits(2, r"dimension layers must be an int >= 1, got -1")),
    row("cli plan", "--hidden -5", lambda e: plan_main(["--hidden", "-5"]),
        Exits(2, r"dimension hidden must be an int >= 1, got -5")),
    row("cli plan", "--l2-mib 0", lambda e: plan_main(["--l2-mib", "0"]),
        Exits(2, r"argument --l2-mib: must be a finite number of MiB, at least one byte, got 0")),
    row("cli plan", "--l2-mib nan", lambda e: plan_main(["--l2-mib", "nan"]),
        Exits(2, r"argument --l2-mib: must be a finite number of MiB.*got nan")),
    row("cli plan", "--l2-mib x", lambda e: plan_main(["--l2-mib", "x"]),
        Exits(2, r"argument --l2-mib: not a number: 'x'")),
    row("cli plan", "--shapes without a file name", lambda e: plan_main(["--shapes"]),
        Exits(2, r"argument --shapes: expected one argument")),
    row("cli plan", "--shapes of a missing file", lambda e: plan_main(["--shapes", "/nonexistent/shapes.json"]),
        Exits(2, r"l2prefetch plan: .*No such file or directory: '/nonexistent/shapes.json'")),
    row("cli plan", "--shapes with mla_every 0", lambda e: e.shapes_status({"mla_every": 0}),
        Exits(2, r"dimension mla_every must be an int >= 1, got 0")),
    row("cli plan", "--shapes with a str dimension", lambda e: e.shapes_status({"layers": "x"}),
        Exits(2, r"dimension layers must be an int >= 1, got str 'x'")),
    row("cli plan", "--shapes with an integer dtype", lambda e: e.shapes_status({"dtype": "int8"}),
        Exits(2, r"dtype 'int8' is not a floating-point dtype")),
    row("cli plan", "--shapes with an unknown dimension", lambda e: e.shapes_status({"heads": 3}),
        Exits(2, r"unknown dimensions \['heads'\]")),
    row("cli plan", "--shapes a FIFO (no hang)", lambda e: plan_main(["--shapes", e.fifo()]),
        Exits(2, r"l2prefetch plan: --shapes file .*fifo.json is a FIFO, not a regular file")),
    row("cli plan", "--shapes with a key twice", lambda e: plan_main(["--shapes", str(e.profile(text='{"layers": 2, "layers": 3}'))]),
        Exits(2, r"the top level gives the key 'layers' more than once")),
    row("cli plan", "--all-p (an abbreviation)", lambda e: plan_main(["--all-p"]),
        Exits(2, r"unrecognized arguments: --all-p")),
    row("cli tune", "--dtype bf16", lambda e: e.tune_status("llama", "--dtype", "bf16", "--list-roles"),
        Exits(2, r"l2prefetch tune: --dtype: dtype must name a floating-point torch dtype")),
    row("cli tune", "--device gpu", lambda e: e.tune_status("llama", "--device", "gpu", "--list-roles"),
        Exits(2, r"l2prefetch tune: --device: device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'")),
    row("cli tune", "--caps-mib 1e-9", lambda e: e.tune_status("llama", "--caps-mib", "1e-9"),
        Exits(2, r"argument --caps-mib: --caps-mib must be numbers >= 1.53e-05")),
    row("cli tune", "--list-role (an abbreviation)", lambda e: e.tune_status("llama", "--list-role"),
        Exits(2, r"unrecognized arguments: --list-role")),
    row("python -m l2prefetch plan", "--tp 3 (the real command)", lambda e: subprocess_status("plan", "--tp", "3"),
        Exits(2, r"argument --tp: invalid choice: 3")),
    row("python -m l2prefetch", "--bogus", lambda e: exit_status(main, ["--bogus"]),
        Exits(2, r"python -m l2prefetch: error: unrecognized arguments: --bogus")),
    row("python -m l2prefetch", "--bogus (the real command)", lambda e: subprocess_status("--bogus"),
        Exits(2, r"python -m l2prefetch: error: unrecognized arguments: --bogus")),
]
# fmt: on


def test_the_table_has_one_row_per_id():
    ids = [p.id for p in ROWS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """Keep what exists now out of the collections after every row (torch's heap makes
    each gc.collect() take ~50 ms otherwise)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture
def two_devices(fake):
    """The stand-in with two sm_90 devices, opened again (it reads the count on open)."""
    fake.configure(device_count=2)
    _C._use_driver(fake.path)
    return fake


@pytest.mark.parametrize("call, outcome", ROWS)
def test_bad_input(two_devices, tmp_path, capsys, call, outcome):
    fake = two_devices
    env = Env(fake, tmp_path)
    if isinstance(outcome, Raises):
        try:
            result = call(env)
        except BaseException as exc:  # noqa: BLE001 - the row names the exact type
            raised, message = type(exc), str(exc)
        else:
            pytest.fail(f"expected {outcome.exc.__name__}, returned {result!r}")
        assert raised is outcome.exc, f"{raised.__name__}: {message}"
        assert re.search(outcome.match, message), message
    elif isinstance(outcome, Returns):
        assert call(env) == outcome.value
    else:
        status = call(env)
        err = capsys.readouterr().err
        assert status == outcome.status, err
        assert re.search(outcome.match, err), err
    # Nothing the row made outlives it, and nothing was destroyed twice.
    del env
    gc.collect()
    assert (fake.live("stream"), fake.live("event"), fake.bad_destroys()) == (0, 0, 0)
