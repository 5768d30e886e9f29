"""PrefetchController.from_plan and the Python subclass, against the recording driver stand-in.

Per-entry kernel and graph_fork carried into the C controller, the device a
plan's weights are on, pickling refused, the bounds PlanEntry shares with the
C controller, and the INFO logging of what was loaded and what was prepared.
"""

from __future__ import annotations

import copy
import gc
import logging
import pickle

import pytest

torch = pytest.importorskip("torch")

import l2prefetch  # noqa: E402
from l2prefetch import _C, controller as controller_module  # noqa: E402
from l2prefetch.plan import MAX_BATCH, MAX_LAYER, PlanEntry  # noqa: E402
from conftest import cuda_tensor as fake_cuda_tensor, device_ptr  # noqa: E402

PC = l2prefetch.PrefetchController
PWR = l2prefetch.PreparedWeightRanges
STREAM = 0x5000
MIB = 2**20


def cuda_tensor(offset=0, n=1024, device=0):
    """A fake CUDA tensor of n halves at ``offset`` into cuda:``device``'s fake memory."""
    return fake_cuda_tensor(device_ptr(device, offset), n, device)


def assert_nothing_alive(fake):
    gc.collect()
    assert (fake.live("stream"), fake.live("event"), fake.bad_destroys()) == (0, 0, 0)


@pytest.fixture
def two_devices(fake):
    fake.configure(device_count=2)
    _C._use_driver(fake.path)
    return fake


# -- kernel per entry ------------------------------------------------------------------------------

def test_an_entrys_kernel_beats_the_default_and_tables_share_by_the_kernel_used(fake):
    a, b = cuda_tensor(0), cuda_tensor(65536, 512)
    plan = [PlanEntry("attn", 0, [1], (a, b)),                     # kernel=... below
            PlanEntry("attn", 1, [1], (a, b), kernel="load"),      # the same kernel: shared
            PlanEntry("attn", 2, [1], (a, b), kernel="line_prefetch"),
            PlanEntry("mlp", 0, [1], (b,), kernel="load")]
    c = PC.from_plan(plan, device=0, kernel="load")
    tables = [c.get(e.point, e.layer, 1) for e in plan]
    assert [t.kernel for t in tables] == ["load", "load", "line_prefetch", "load"]
    assert tables[0] is tables[1] and tables[2] is not tables[0] and tables[3] is not tables[0]
    # Without kernel=, an entry without one gets the device's default (sm_90: ring).
    c = PC.from_plan(plan, device=0)
    assert [c.get(e.point, e.layer, 1).kernel for e in plan] == [
        "ring", "load", "line_prefetch", "load"]
    assert c.fork("attn", 2, 1, stream=STREAM)
    c.join(stream=STREAM)


# -- graph_fork per entry --------------------------------------------------------------------------

class Recording(PC):
    """A controller whose add() takes graph_fork= and records how it was called."""

    def add(self, point, layer, batches, ranges, **kwargs):
        self.__dict__.setdefault("calls", []).append((point, layer, kwargs))
        return super().add(point, layer, batches, ranges)


class Positional(PC):
    """A controller whose add() takes no keywords, as the C type's did before graph_fork=."""

    def add(self, point, layer, batches, ranges):
        return super().add(point, layer, batches, ranges)


class Refusing(PC):
    """A controller whose add() raises a TypeError of its own."""

    def add(self, point, layer, batches, ranges, **kwargs):
        raise TypeError("point must be a non-empty str, not 'x'")


def mixed_plan():
    a = cuda_tensor(0)
    return [PlanEntry("attn", 0, [1], (a,), graph_fork="branch"),
            PlanEntry("attn", 1, [1], (a,)),
            PlanEntry("attn", 2, [1], (a,), graph_fork="inline")]


def test_graph_fork_is_passed_to_add_only_where_an_entry_sets_it(fake):
    c = Recording.from_plan(mixed_plan(), device=0, graph_fork="inline")
    assert c.calls == [("attn", 0, {"graph_fork": "branch"}), ("attn", 1, {}),
                       ("attn", 2, {"graph_fork": "inline"})]
    assert c.graph_fork == "inline" and len(c) == 3


def test_graph_fork_without_support_in_add_is_a_clear_error(fake):
    with pytest.raises(NotImplementedError) as info:
        Positional.from_plan(mixed_plan(), device=0)
    message = str(info.value)
    assert message.startswith("plan entry 0 ('attn', layer 0) sets graph_fork='branch', but "
                              "this build's PrefetchController.add() takes no graph_fork")
    assert "from_plan(graph_fork=...)" in message
    assert isinstance(info.value.__cause__, TypeError)
    assert_nothing_alive(fake)
    # A plan that sets no graph_fork needs no such support.
    assert len(Positional.from_plan([PlanEntry("attn", 0, [1], (cuda_tensor(0),))], device=0)) == 1


def test_other_type_errors_of_add_pass_through(fake):
    with pytest.raises(TypeError, match=r"^point must be a non-empty str, not 'x'$"):
        Refusing.from_plan(mixed_plan(), device=0)
    assert_nothing_alive(fake)


def add_takes_graph_fork(fake):
    probe = PC(device=0)
    try:
        probe.add("probe", 0, 1, PWR([], device=0), graph_fork="branch")
    except TypeError as exc:
        assert "keyword" in str(exc)
        return False
    finally:
        probe.close()
    return True


def test_graph_fork_with_the_c_controller(fake):
    """Whichever C extension this is: per-entry graph forks work or are refused clearly."""
    if add_takes_graph_fork(fake):
        c = PC.from_plan(mixed_plan(), device=0)
        assert sorted(c.keys()) == [("attn", 0, 1), ("attn", 1, 1), ("attn", 2, 1)]
        assert [c.get_mode("attn", layer, 1) for layer in range(3)] == [
            e.graph_fork or "inline" for e in mixed_plan()]
        c.close()
    else:
        with pytest.raises(NotImplementedError, match="takes no graph_fork"):
            PC.from_plan(mixed_plan(), device=0)
    assert_nothing_alive(fake)


# -- the device ------------------------------------------------------------------------------------

def test_weights_on_another_device_than_the_default(two_devices):
    plan = [PlanEntry("attn", 0, [1], (cuda_tensor(0),)),
            PlanEntry("mlp", 3, [1, 2], (cuda_tensor(0, device=1),))]
    with pytest.raises(ValueError) as info:
        PC.from_plan(plan)
    assert str(info.value) == (
        "plan entry 1 ('mlp', layer 3): the weights are on cuda:1, but no device= was given "
        "and the controller defaulted to cuda:0 (torch's current device); pass device=1 to "
        "from_plan (or make that device current)")
    assert_nothing_alive(two_devices)
    # Asked for: the prepared table names both devices.
    with pytest.raises(ValueError, match="device=cuda:0 but the weights are on cuda:1"):
        PC.from_plan(plan, device=0)
    for device in (1, "cuda:1", torch.device("cuda", 1)):
        assert PC.from_plan(plan[1:], device=device).device == 1
    assert PC.from_plan(plan[:1]).device == 0
    assert_nothing_alive(two_devices)


# -- pickling --------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", [*(lambda c, p=p: pickle.dumps(c, protocol=p)
                                   for p in range(pickle.HIGHEST_PROTOCOL + 1)),
                                 copy.copy, copy.deepcopy])
def test_a_controller_cannot_be_pickled_or_copied(fake, how):
    c = PC.from_plan([PlanEntry("attn", 0, [1], (cuda_tensor(0),))], device=0)
    with pytest.raises(TypeError, match=r"^a PrefetchController cannot be pickled or copied: "
                                        r"it holds this process's CUDA stream, events and "
                                        r"prepared tables; send the plan instead "
                                        r"\(l2prefetch.plan.plan_to_json\)"):
        how(c)
    assert c.fork("attn", 0, 1, stream=STREAM)  # still usable
    c.join(stream=STREAM)


# -- bounds shared with the C controller -----------------------------------------------------------

def test_plan_entry_bounds_are_the_c_controllers(fake):
    c, table = PC(device=0), PWR([], device=0)
    with pytest.raises(ValueError, match=rf"layer must be in 0\.\.{MAX_LAYER}, got {MAX_LAYER + 1}"):
        c.add("p", MAX_LAYER + 1, 1, table)
    with pytest.raises(ValueError, match=rf"batch must be in 1\.\.{MAX_BATCH}, got {MAX_BATCH + 1}"):
        c.add("p", 0, [MAX_BATCH + 1], table)
    c.add("p", MAX_LAYER, 1, table)
    c.close()
    c = PC(device=0)  # a dense table: the largest layer and batch in one is 32 GiB
    c.add("q", 0, [MAX_BATCH], table)
    c.close()


# -- logging ---------------------------------------------------------------------------------------

@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """As in a new process: nothing logged yet.  Returns the l2prefetch records so far."""
    monkeypatch.setattr(controller_module, "_runtime_logged", False)
    monkeypatch.setattr(controller_module, "_kernels_logged", set())
    monkeypatch.delattr(_C, "kernel_cache_info", raising=False)

    def records():
        return [r for r in caplog.records if r.name.startswith("l2prefetch")]
    return records


def messages(records):
    return [r.getMessage() for r in records]


def test_the_first_controller_logs_the_driver_and_nvrtc_once(fake, fresh_log, caplog):
    with caplog.at_level(logging.INFO, logger="l2prefetch"):
        PC(device=0)
        PC(device=0)
    records = fresh_log()
    assert {r.name for r in records} == {"l2prefetch.controller"}
    assert {r.levelno for r in records} == {logging.INFO}
    nvrtc = _C.nvrtc_info()
    assert messages(records) == [
        f"CUDA driver 13.0 from {fake.path} (1 device)",
        f"NVRTC {'.'.join(map(str, nvrtc['version']))} from {nvrtc['path']}"]


def test_with_info_off_nothing_is_loaded_for_the_log(fake, fresh_log, caplog, monkeypatch):
    calls = []
    monkeypatch.setattr(_C, "nvrtc_info", lambda: calls.append("nvrtc_info") or {})
    monkeypatch.setattr(_C, "driver_info", lambda: calls.append("driver_info") or {})
    with caplog.at_level(logging.WARNING, logger="l2prefetch"):
        PC(device=0)
    assert calls == [] and fresh_log() == []
    # The first controller built while INFO is on logs them.
    with caplog.at_level(logging.INFO, logger="l2prefetch"):
        PC(device=0)
    assert calls == ["driver_info", "nvrtc_info"]


def test_an_unavailable_nvrtc_is_logged_not_raised(fake, fresh_log, caplog, monkeypatch):
    def missing():
        raise l2prefetch.CudaUnavailableError("libnvrtc.so not found\nlooked in: /nowhere")

    monkeypatch.setattr(_C, "nvrtc_info", missing)
    with caplog.at_level(logging.INFO, logger="l2prefetch"):
        PC(device=0)
    assert messages(fresh_log())[-1] == (
        "NVRTC: unavailable (libnvrtc.so not found); kernels can come only from the disk cache")


def test_a_disabled_controller_logs_no_driver(fake, fresh_log, caplog, monkeypatch):
    monkeypatch.setenv("L2PREFETCH_DISABLE", "1")
    with caplog.at_level(logging.INFO, logger="l2prefetch"):
        PC.from_plan([PlanEntry("attn", 0, [1], (cuda_tensor(0),))], device=0)
    assert messages(fresh_log()) == ["L2PREFETCH_DISABLE is set: 1 plan entries not prepared"]


def test_from_plan_logs_a_summary(fake, fresh_log, caplog):
    a, b = cuda_tensor(0, 1024), cuda_tensor(65536, 512)    # 2048 and 1024 bytes
    plan = [PlanEntry("attn", 0, [1, 2], (a, b)),
            PlanEntry("attn", 1, [1, 2], (a, b)),             # shares entry 0's table
            PlanEntry("mlp", 0, [3], (b,), kernel="load", graph_fork="branch")]
    with caplog.at_level(logging.INFO, logger="l2prefetch"):
        Recording.from_plan(plan, device=0)
    summary = messages(fresh_log())[-1]
    per_step = 2 * 3072 / MIB
    assert summary == (
        "from_plan: 3 entries in 2 tables on cuda:0; points attn (2), mlp (1); kernels load, "
        "ring; graph_fork 'inline' ('branch' for 1 entry); MiB per decode step by batch (1-3): "
        f"1-2: {per_step:.2f}; 3: {1024 / MIB:.2f}")


def test_kernels_are_logged_once_each_when_the_extension_reports_them(fake, fresh_log, caplog,
                                                                      monkeypatch):
    info = [{"variant": "ring", "sm": 90, "source": "compiled", "ms": 12.25},
            {"variant": "load", "sm": 90, "cache_hit": True, "ms": 0.4, "path": "/c/load.cubin"}]
    monkeypatch.setattr(_C, "kernel_cache_info", lambda: list(info), raising=False)
    plan = [PlanEntry("attn", 0, [1], (cuda_tensor(0),))]
    with caplog.at_level(logging.INFO, logger="l2prefetch"):
        PC.from_plan(plan, device=0)
        PC.from_plan(plan, device=0)
        info.append({"variant": "line_prefetch", "sm": 90, "cache_hit": False, "ms": 30})
        PC.from_plan(plan, device=0)
    kernels = [m for m in messages(fresh_log()) if m.startswith("kernel ")]
    assert kernels == ["kernel ring for sm_90: compiled in 12.2 ms",
                       "kernel load for sm_90: disk cache hit in 0.4 ms (path=/c/load.cubin)",
                       "kernel line_prefetch for sm_90: compiled in 30.0 ms"]


def test_kernel_records_keyed_by_name_are_logged_too(fake, fresh_log, caplog, monkeypatch):
    monkeypatch.setattr(_C, "kernel_cache_info",
                        lambda: {"ring": {"sm": 90, "source": "disk cache hit", "ms": 1.5}},
                        raising=False)
    with caplog.at_level(logging.INFO, logger="l2prefetch"):
        PC.from_plan([PlanEntry("attn", 0, [1], (cuda_tensor(0),))], device=0)
    assert "kernel ring for sm_90: disk cache hit in 1.5 ms" in messages(fresh_log())


def test_without_kernel_cache_info_no_kernel_is_logged(fake, fresh_log, caplog):
    assert not hasattr(_C, "kernel_cache_info")
    with caplog.at_level(logging.INFO, logger="l2prefetch"):
        PC.from_plan([PlanEntry("attn", 0, [1], (cuda_tensor(0),))], device=0)
    assert not any(m.startswith("kernel ") for m in messages(fresh_log()))


def test_loggers_are_children_of_the_package_logger():
    from l2prefetch import hooks

    package = logging.getLogger("l2prefetch")
    assert any(isinstance(h, logging.NullHandler) for h in package.handlers)
    assert controller_module.logger.name == "l2prefetch.controller"
    assert hooks.logger.name == "l2prefetch.hooks"
    assert controller_module.logger.parent is package and hooks.logger.parent is package


def test_two_entries_for_one_point_layer_and_batch_are_refused(fake):
    # Issue 21 (8): add() replaces what a key holds, so the first entry's batch 2 was lost.
    a = PlanEntry("p", 0, [1, 2], (cuda_tensor(0),))
    b = PlanEntry("p", 0, [2, 3], (cuda_tensor(4096),), grid=8)
    with pytest.raises(ValueError, match=r"^plan\[0\] and plan\[1\] both prefetch at point 'p', "
                                         r"layer 0, batch 2: give each \(point, layer, batch\) "
                                         r"one entry$"):
        PC.from_plan([a, b], 0)
    assert fake.log("cuStreamCreateWithPriority") == []    # refused before anything was made
    other_layer = PlanEntry("p", 1, [2], (cuda_tensor(4096),))
    with PC.from_plan([a, other_layer], 0) as controller:
        assert controller.get("p", 0, 2).nbytes == 2048
    assert_nothing_alive(fake)


# -- build_controller: the tuner's arms --------------------------------------------------------

def test_build_controller_empties_the_entries_a_function_names(fake):
    """empty=f: the entries f picks launch an empty table of their own launch settings,
    the others load; every entry keeps its key (one fork structure for the tuner's
    per-layer arms)."""
    w = [cuda_tensor(i * 65536, 1024) for i in range(3)]
    plan = [PlanEntry("mlp", layer, [1, 8], (w[layer],), grid=16, graph_fork="leaf")
            for layer in range(3)]
    c = controller_module.build_controller(plan, 0, empty=lambda e: e.layer != 1)
    assert sorted(c.keys()) == sorted((e.point, e.layer, b) for e in plan for b in (1, 8))
    loaded = c.get("mlp", 1, 1)
    assert loaded.nbytes == w[1].numel() * 2 and loaded is c.get("mlp", 1, 8)
    for layer in (0, 2):
        table = c.get("mlp", layer, 8)
        assert table.nbytes == 0 and table.grid == 16
    assert c.get("mlp", 0, 1) is c.get("mlp", 2, 8)   # one empty table per launch setting
    assert c.graph_fork == "leaf"
    every = controller_module.build_controller(plan, 0, empty=True)
    assert sorted(every.keys()) == sorted(c.keys()) and every.get("mlp", 1, 1).nbytes == 0
    none = controller_module.build_controller(plan, 0, empty=lambda e: False)
    assert all(none.get("mlp", e.layer, 1).nbytes > 0 for e in plan)
    for ctl in (c, every, none):
        ctl.close()
    with pytest.raises(TypeError, match="empty must be a bool or a function of a plan entry"):
        controller_module.build_controller(plan, 0, empty="yes")
    # two entries for one key are refused before the split, as from_plan refuses them
    twice = plan + [PlanEntry("mlp", 1, [8], (w[0],), grid=16, graph_fork="leaf")]
    with pytest.raises(ValueError, match=r"plan\[1\] and plan\[3\] both prefetch at point 'mlp', "
                                         "layer 1, batch 8"):
        controller_module.build_controller(twice, 0, empty=lambda e: e.grid == 16 and
                                           e.weights[0] is w[0])
    assert_nothing_alive(fake)


def test_build_controller_reads_a_generator_plan_once(fake):
    """A plan given as a generator builds the same controller as the list, with every
    kind of ``empty``: the plan is read once (its graph fork modes were read first,
    which used the generator up and left an empty controller)."""
    w = [cuda_tensor(i * 65536, 1024) for i in range(2)]
    plan = [PlanEntry("mlp", layer, [1, 8], (w[layer],)) for layer in range(2)]
    want = sorted((e.point, e.layer, b) for e in plan for b in (1, 8))
    for empty in (False, True, lambda e: e.layer == 0):
        c = controller_module.build_controller((e for e in plan), 0, empty=empty)
        assert sorted(c.keys()) == want, empty
        c.close()
    assert_nothing_alive(fake)


def test_the_tuners_per_layer_arms_switch_from_the_every_layer_capture(fake):
    """GraphBackend pairs arms of one structure by switching the captured (head) graph's
    tables: from the capture that loads at every layer, each layer's loads alone and the
    empty forks are mappings of its ranges; from a capture that loads at one layer only
    they are not (its empty forks' ranges are one key for several tables)."""
    from l2prefetch.tuning.measure import switch_states

    w = [cuda_tensor(i * 65536, 1024) for i in range(3)]
    plan = [PlanEntry("mlp", layer, [1], (w[layer],)) for layer in range(3)]
    build = controller_module.build_controller
    ctl = {"b": build(plan, 0), "d": build(plan, 0, empty=True),
           **{f"b:{k}": build(plan, 0, empty=lambda e, k=k: e.layer != k) for k in range(3)}}
    names = list(ctl)
    states = switch_states(names, "b", ctl)
    captured = {layer: ctl["b"].get("mlp", layer, 1).ranges for layer in range(3)}
    assert len(set(captured.values())) == 3
    for k in range(3):
        for layer in range(3):
            table = states[f"b:{k}"][captured[layer]]
            assert table is ctl[f"b:{k}"].get("mlp", layer, 1)
            assert (table.nbytes > 0) == (layer == k)
    assert all(states["d"][r].nbytes == 0 for r in captured.values())
    assert switch_states(names, "b:0", ctl) is None
    for c in ctl.values():
        c.close()


def test_a_warm_table_is_not_switched_into_a_node_captured_without_its_activation(fake):
    """warm_activation: a node the head captured with an empty (never warm) table has no
    activation range, so a warm table switched into it would load without the read it
    makes when deployed: such a group is captured unpaired (switch_states: None)."""
    from l2prefetch.tuning.measure import switch_states

    w = [cuda_tensor(i * 65536, 1024) for i in range(2)]
    plan = [PlanEntry("mlp", layer, [1], (w[layer],), warm_activation=True) for layer in range(2)]
    build = controller_module.build_controller
    ctl = {f"b:{k}": build(plan, 0, empty=lambda e, k=k: e.layer != k) for k in range(2)}
    assert ctl["b:1"].get("mlp", 1, 1).warm_activation
    assert not ctl["b:0"].get("mlp", 1, 1).warm_activation   # empty: never warm
    assert switch_states(list(ctl), "b:0", ctl) is None
    for c in ctl.values():
        c.close()
