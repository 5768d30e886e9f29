"""PrefetchController against the recording driver stand-in (tests/fakecuda).

The exact driver calls of construction, add, fork and join; lookups and stats;
argument errors; a failure injected into each driver call (the controller must
raise with the call's name and stay usable); the side stream and every event
destroyed exactly once at close() and at dealloc; graph-capture misuse;
L2PREFETCH_DISABLE; threads; and a create/drop loop for leaks.
"""

import gc
import os
import subprocess
import sys
import textwrap
import threading
import tracemalloc
import types
import weakref

import pytest

import l2prefetch
from l2prefetch import _C
from l2prefetch.mechanisms import GRAPH_FORK_MODES
from conftest import FakeArray, cuda_tensor, device_ptr, storageless

PWR = l2prefetch.PreparedWeightRanges
PC = l2prefetch.PrefetchController
STREAM = 0x5000
CUR = hex(STREAM)
LIVE_KINDS = ("stream", "event", "module", "context")
QUIET = {"cuCtxGetCurrent", "cuStreamGetCaptureInfo"}


# -- helpers --------------------------------------------------------------------------

def arr(i=0, n=1024, device=0):
    return FakeArray(device_ptr(device, i * 65536), (n,))


def kv(line):
    return dict(tok.split("=", 1) for tok in line.split()[1:] if "=" in tok)


def names(fake):
    return [line.split(" ", 1)[0] for line in fake.log()]


def loud(fake):
    """The log without the reads fork/join may make (current context, capture state)."""
    return [line for line in fake.log() if line.split(" ", 1)[0] not in QUIET]


def reopen(fake, **config):
    fake.configure(**config)
    _C._use_driver(fake.path)


def assert_all_released(fake):
    gc.collect()
    _C._use_driver(None)
    assert {k: fake.live(k) for k in LIVE_KINDS} == dict.fromkeys(LIVE_KINDS, 0)
    assert fake.bad_destroys() == 0


@pytest.fixture
def table(fake):
    return PWR([arr(0), arr(1)])  # 4096 bytes


@pytest.fixture
def ctl(fake, table):
    """A controller with ('attn', 0, 1..2) and ('attn', 1, 1) and ('mlp', 0, 1) registered,
    warmed up (this thread's context current), log cleared."""
    c = PC(device=0)
    c.add("attn", 0, [1, 2], table)
    c.add("attn", 1, 1, table)
    c.add("mlp", 0, (1,), table)
    assert c.fork("attn", 0, 1, stream=STREAM)
    c.join(stream=STREAM)
    c.reset_stats()
    fake.clear_log()
    return c


def handles(fake, c):
    """(side stream, join event) from the construction log."""
    side = kv(fake.log("cuStreamCreateWithPriority")[0])["stream"]
    join = kv(fake.log("cuEventCreate")[0])["event"]
    assert int(side, 16) == c.stream_handle
    return side, join


# -- construction and add ------------------------------------------------------------------

def test_construction(fake):
    c = PC(device=0)
    assert fake.log("cuStreamCreateWithPriority")[0].startswith(
        "cuStreamCreateWithPriority flags=0x1 priority=0 stream=0x")  # non-blocking
    assert fake.log("cuEventCreate")[0].startswith("cuEventCreate flags=0x2 event=0x")  # no timing
    assert (fake.calls("cuStreamCreateWithPriority"), fake.calls("cuEventCreate")) == (1, 1)
    assert (fake.live("stream"), fake.live("event")) == (1, 1)
    assert c.stream_handle == int(kv(fake.log("cuStreamCreateWithPriority")[0])["stream"], 16)
    assert (c.device, c.enabled, c.pending, c.closed, c.points, len(c)) == (0, True, False, False, (), 0)
    assert c.keys() == [] and c.stats() == {}
    assert repr(c) == "<PrefetchController cuda:0 0 entries>"
    # created under the device's context, which is not left current
    assert names(fake)[-3:] == ["cuStreamCreateWithPriority", "cuEventCreate", "cuCtxPopCurrent"]
    assert isinstance(c, _C.PrefetchController)


def test_add_creates_and_records_one_event_per_point_and_layer(fake, table):
    c = PC(device=0)
    fake.clear_log()
    c.add("attn", 0, [1, 2], table)
    assert names(fake) == ["cuCtxPushCurrent", "cuEventCreate", "cuEventRecord", "cuCtxPopCurrent"]
    event = kv(fake.log("cuEventCreate")[0])["event"]
    assert kv(fake.log("cuEventRecord")[0])["event"] == event
    fake.clear_log()
    c.add("attn", 0, [3], table)           # same (point, layer): no driver call at all
    c.add("attn", 0, range(4, 6), table)
    assert fake.log() == []
    c.add("attn", 1, 1, table)             # a new layer
    c.add("mlp", 0, 1, table)              # a new point
    assert fake.calls("cuEventCreate") == 1 + 3 and fake.live("event") == 4
    assert len(fake.log("cuEventRecord")) == 2
    assert c.points == ("attn", "mlp")
    assert len(c) == 7


def test_add_replaces_an_entry(fake, table):
    c = PC(device=0)
    other = PWR([arr(5)], grid=3)
    c.add("attn", 0, 1, table)
    c.add("attn", 0, 1, other)
    assert c.get("attn", 0, 1) is other and len(c) == 1
    c.fork("attn", 0, 1, stream=STREAM)
    assert kv(fake.log("cuLaunchKernelEx")[0])["grid"] == "3,1,1"


def test_get_keys_len(fake, ctl, table):
    assert ctl.get("attn", 0, 1) is table and ctl.get("attn", 0, 2) is table
    assert ctl.get("attn", 0, 3) is None and ctl.get("nope", 0, 1) is None
    assert ctl.get("attn", -1, 1) is None and ctl.get("attn", 0, 10**30) is None
    assert sorted(ctl.keys()) == [("attn", 0, 1), ("attn", 0, 2), ("attn", 1, 1), ("mlp", 0, 1)]
    assert len(ctl) == 4
    with pytest.raises(TypeError):
        ctl.get("attn", 0)
    with pytest.raises(TypeError):
        ctl.get("attn", "0", 1)
    assert fake.log() == []


def test_point_lookup_by_value(fake, ctl):
    point = "".join(["at", "tn"])  # an equal str that is not the registered object
    assert point == ctl.points[0] and point is not ctl.points[0]
    assert ctl.fork(point, 0, 1, stream=STREAM) is True
    assert ctl.get(point, 0, 1) is not None


@pytest.mark.parametrize("args, exc, match", [
    ((1, 0, 1), TypeError, "point must be a non-empty str"),
    (("", 0, 1), TypeError, "point must be a non-empty str"),
    (("a", "1", 1), TypeError, "layer must be an int"),
    (("a", 1.0, 1), TypeError, "layer must be an int"),
    (("a", True, 1), TypeError, "layer must be an int"),
    (("a", -1, 1), ValueError, r"layer must be in 0\.\.65535"),
    (("a", 65536, 1), ValueError, r"layer must be in 0\.\.65535"),
    (("a", 2**80, 1), ValueError, "layer must be in"),
    (("a", 0, 2.0), TypeError, "batches must be an int or an iterable of ints, not float"),
    (("a", 0, None), TypeError, "batches must be an int or an iterable"),
    (("a", 0, True), TypeError, "each batch must be an int"),
    (("a", 0, [1, 2.0]), TypeError, "each batch must be an int"),
    (("a", 0, "12"), TypeError, "each batch must be an int"),
    (("a", 0, []), ValueError, "batches is empty"),
    (("a", 0, [0]), ValueError, r"batch must be in 1\.\.65535"),
    (("a", 0, [1, -3]), ValueError, "batch must be in"),
    (("a", 0, [65536]), ValueError, "batch must be in"),
])
def test_add_bad_arguments(fake, table, args, exc, match):
    c = PC(device=0)
    fake.clear_log()
    with pytest.raises(exc, match=match):
        c.add(*args, table)
    # nothing registered, no event made
    assert (len(c), c.points, fake.log()) == (0, (), [])


def test_add_bad_ranges_and_arity(fake, table):
    c = PC(device=0)
    for bad in ("t", None, [arr(0)], c):
        with pytest.raises(TypeError, match="ranges must be a PreparedWeightRanges"):
            c.add("a", 0, 1, bad)
    with pytest.raises(TypeError, match=r"add\(\) takes exactly 4 positional arguments \(3 given\)"):
        c.add("a", 0, 1)
    with pytest.raises(TypeError):
        c.add("a", 0, 1, table, 5)
    assert len(c) == 0


def test_signatures_refuse_a_value_given_twice_or_by_a_positional_only_name(fake, table):
    # one parser (csrc/args.c) for every fast-call method, worded as CPython's
    c = PC(device=0)
    c.add("a", 0, 1, table)
    with pytest.raises(TypeError, match=r"^fork\(\) got multiple values for argument \'stream\'$"):
        c.fork("a", 0, 1, STREAM, stream=STREAM)
    with pytest.raises(TypeError, match=r"^fork\(\) got an unexpected keyword argument 'point'$"):
        c.fork(point="a", layer=0, batch=1)
    with pytest.raises(TypeError, match=r"^join\(\) got multiple values for argument \'stream\'$"):
        c.join(STREAM, stream=STREAM)
    with pytest.raises(TypeError, match=r"^launch\(\) got multiple values for argument \'stream\'$"):
        table.launch(STREAM, stream=STREAM)
    with pytest.raises(TypeError, match=r"^compute_ranges\(\) got multiple values for argument 'weights'$"):
        _C.compute_ranges([], weights=[])
    with pytest.raises(TypeError, match=r"^add\(\) got an unexpected keyword argument 'point'$"):
        c.add("a", 0, 1, table, point="b")
    assert c.fork("a", 0, 1, stream=STREAM) and c.fork("a", 0, 1, STREAM)
    assert c.fork("b", 0, 1) is False
    c.join(stream=STREAM)
    assert len(c) == 1


def test_add_ranges_of_another_device(fake):
    reopen(fake, device_count=2)
    t1 = PWR([arr(0, device=1)])
    c = PC(device=0)
    with pytest.raises(ValueError, match="prepared for cuda:1 but this controller is for cuda:0"):
        c.add("a", 0, 1, t1)
    assert len(c) == 0


def test_add_ranges_of_another_driver_instance(fake, table):
    _C._use_driver(fake.path)  # new objects use a new driver instance
    c = PC(device=0)
    with pytest.raises(ValueError, match="another CUDA driver instance"):
        c.add("a", 0, 1, table)


def test_construction_bad_device(fake):
    with pytest.raises(ValueError, match=r"cuda:2 does not exist \(the driver sees 1 device\)"):
        PC(device=2)
    with pytest.raises(ValueError, match="device must be"):
        PC(device="cpu")
    with pytest.raises(ValueError, match="device must be >= 0"):
        PC(device=-1)
    assert (fake.live("stream"), fake.live("event")) == (0, 0)


# -- fork and join ------------------------------------------------------------------------------

def test_fork_exact_calls(fake, table):
    c = PC(device=0)
    side, join = handles(fake, c)
    c.add("attn", 3, [1, 2], table)
    event = kv(fake.log("cuEventCreate")[-1])["event"]
    c.add("mlp", 0, 1, table)
    c.fork("mlp", 0, 1, stream=STREAM)  # first use on this thread makes the context current
    c.join(stream=STREAM)
    fake.clear_log()
    assert c.fork("attn", 3, 2, stream=STREAM) is True
    assert set(names(fake)) - QUIET == {"cuEventRecord", "cuStreamWaitEvent", "cuLaunchKernelEx"}
    lines = loud(fake)
    assert len(lines) == 3, lines
    assert lines[0] == f"cuEventRecord event={event} stream={CUR}"
    assert lines[1] == f"cuStreamWaitEvent stream={side} event={event} flags=0"
    assert lines[2].startswith(f"cuLaunchKernelEx grid=32,1,1 block=32,1,1 smem={table.smem} "
                               f"stream={side} func=l2p_prefetch_8 attrs=none params=0x")
    assert table.smem == l2prefetch.kernel_variants()["ring"]["smem"]
    assert "->" not in lines[2]
    assert c.pending is True
    # the reads are at most one of each
    assert names(fake).count("cuCtxGetCurrent") <= 1
    assert names(fake).count("cuStreamGetCaptureInfo") <= 1

    fake.clear_log()
    c.join(stream=STREAM)
    assert loud(fake) == [f"cuEventRecord event={join} stream={side}",
                          f"cuStreamWaitEvent stream={CUR} event={join} flags=0"]
    assert set(names(fake)) - QUIET == {"cuEventRecord", "cuStreamWaitEvent"}
    assert c.pending is False


def test_fork_stream_forms(fake, ctl):
    class Stream:
        cuda_stream = 0x7000

    assert ctl.fork("attn", 0, 1, Stream())
    assert ctl.fork("attn", 0, 1, 0x7100)
    assert ctl.fork("attn", 0, 1, stream=0x7200)
    ctl.join(0x7300)
    ctl.join(stream=Stream())  # nothing pending: no call
    assert [kv(x)["stream"] for x in fake.log("cuEventRecord")] == \
        ["0x7000", "0x7100", "0x7200", hex(ctl.stream_handle)]
    assert kv(fake.log("cuStreamWaitEvent")[-1])["stream"] == "0x7300"


@pytest.mark.parametrize("key", [
    ("nope", 0, 1), ("attn", 5, 1), ("attn", 0, 9), ("attn", 0, 3), ("attn", 1, 2),
    ("mlp", 1, 1), ("attn", -1, 1), ("attn", 0, -1), ("attn", 0, 0), ("attn", 10**30, 1),
    ("attn", 0, -10**30), ("", 0, 1),
])
def test_fork_unregistered_is_false_without_calls(fake, ctl, key):
    assert ctl.fork(*key, stream=STREAM) is False
    assert ctl.pending is False
    assert fake.log() == []
    assert ctl.stats() == {"attn": {"forks": 0, "bytes": 0}, "mlp": {"forks": 0, "bytes": 0}}


def test_join_without_pending_makes_no_call(fake, ctl):
    assert ctl.join(stream=STREAM) is None
    assert ctl.join() is None  # not even the stream is looked up
    assert fake.log() == []


def test_several_forks_one_join_and_stats(fake, ctl, table):
    side = hex(ctl.stream_handle)
    assert ctl.fork("attn", 0, 1, stream=STREAM)
    assert ctl.fork("attn", 1, 1, stream=STREAM)
    assert ctl.fork("mlp", 0, 1, stream=STREAM)
    assert ctl.fork("attn", 0, 2, stream=STREAM)
    assert ctl.pending
    assert [kv(x)["stream"] for x in fake.log("cuLaunchKernelEx")] == [side] * 4
    ctl.join(stream=STREAM)
    ctl.join(stream=STREAM)  # the second has nothing to join
    assert len(fake.log("cuStreamWaitEvent")) == 4 + 1
    assert [kv(x)["stream"] for x in fake.log("cuEventRecord")] == [CUR] * 4 + [side]
    assert ctl.stats() == {"attn": {"forks": 3, "bytes": 3 * table.nbytes},
                           "mlp": {"forks": 1, "bytes": table.nbytes}}
    ctl.reset_stats()
    assert ctl.stats() == {"attn": {"forks": 0, "bytes": 0}, "mlp": {"forks": 0, "bytes": 0}}
    assert ctl.fork("mlp", 0, 1, stream=STREAM)
    assert ctl.stats()["mlp"] == {"forks": 1, "bytes": table.nbytes}


def test_stats_bytes_per_table(fake):
    c = PC(device=0)
    small, big = PWR([arr(0, 8)]), PWR([arr(i) for i in range(10)])
    c.add("p", 0, 1, small)
    c.add("p", 0, 2, big)
    c.add("q", 0, 1, small)
    for _ in range(3):
        c.fork("p", 0, 2, stream=STREAM)
    c.fork("p", 0, 1, stream=STREAM)
    assert c.stats() == {"p": {"forks": 4, "bytes": 3 * 20480 + 16}, "q": {"forks": 0, "bytes": 0}}
    assert [kv(x)["func"] for x in fake.log("cuLaunchKernelEx")] == \
        ["l2p_prefetch_32"] * 3 + ["l2p_prefetch_8"]


@pytest.mark.parametrize("args, match", [
    ((1, 0, 1), "point must be a str"),
    ((None, 0, 1), "point must be a str"),
    (("attn", "1", 1), "layer must be an int"),
    (("attn", 1.0, 1), "layer must be an int"),
    (("attn", 0, 2.0), "batch must be an int"),
    (("attn", True, 1), "layer must be an int"),
    (("attn", 0, False), "batch must be an int"),
    (("attn", 0, None), "batch must be an int"),
])
def test_fork_wrong_types(fake, ctl, args, match):
    with pytest.raises(TypeError, match=match):
        ctl.fork(*args, stream=STREAM)
    assert fake.log() == [] and not ctl.pending


def test_fork_join_bad_arity_and_streams(fake, ctl):
    with pytest.raises(TypeError):
        ctl.fork("attn", 0)
    with pytest.raises(TypeError):
        ctl.fork("attn", 0, 1, STREAM, 5)
    with pytest.raises(TypeError):
        ctl.fork("attn", 0, 1, strm=STREAM)
    with pytest.raises(TypeError):
        ctl.join(STREAM, 5)
    with pytest.raises(TypeError):
        ctl.join(strm=STREAM)
    with pytest.raises(TypeError, match="stream must be None, an int"):
        ctl.fork("attn", 0, 1, stream="0x5000")
    with pytest.raises(ValueError, match="non-negative"):
        ctl.fork("attn", 0, 1, stream=-1)
    assert fake.log() == [] and not ctl.pending
    assert ctl.fork("attn", 0, 1, stream=STREAM)
    with pytest.raises(TypeError, match="stream must be None, an int"):
        ctl.join(stream=1.5)
    assert ctl.pending
    ctl.join(stream=STREAM)
    assert not ctl.pending


def test_fork_with_another_device_current(fake):
    reopen(fake, device_count=2)
    t0, t1 = PWR([arr(0)]), PWR([arr(0, device=1)])
    c0, c1 = PC(device=0), PC(device=1)
    c0.add("a", 0, 1, t0)
    c1.add("a", 0, 1, t1)
    assert c1.fork("a", 0, 1, stream=0)  # makes cuda:1 current on this thread
    with pytest.raises(RuntimeError, match="another CUDA device is current.*cuda:0"):
        c0.fork("a", 0, 1, stream=STREAM)
    assert not c0.pending and c0.stats()["a"]["forks"] == 0
    box = []
    worker = threading.Thread(target=lambda: box.append(c0.fork("a", 0, 1, stream=STREAM)))
    worker.start()
    worker.join()
    assert box == [True]


# -- injected failures in fork, join and add ------------------------------------------------

@pytest.mark.parametrize("name, pending_after", [
    ("cuEventRecord", False),      # nothing reached the side stream
    ("cuStreamWaitEvent", False),
    ("cuLaunchKernelEx", True),    # the side stream waits on the current one: join it
    ("cuCtxGetCurrent", False),
])
def test_fork_fault(fake, ctl, table, name, pending_after):
    fake.fail(name, code="CUDA_ERROR_ILLEGAL_ADDRESS")
    with pytest.raises(l2prefetch.CudaError) as info:
        ctl.fork("attn", 0, 1, stream=STREAM)
    e = info.value
    assert e.name == "CUDA_ERROR_ILLEGAL_ADDRESS" and e.code == 700
    assert name in e.operation and name in str(e) and "CUDA_ERROR_ILLEGAL_ADDRESS" in str(e)
    assert ctl.pending is pending_after
    assert ctl.stats()["attn"] == {"forks": 0, "bytes": 0}
    launches = len(fake.log("cuLaunchKernelEx"))
    # still usable
    assert ctl.fork("attn", 0, 1, stream=STREAM) is True
    assert ctl.pending
    ctl.join(stream=STREAM)
    assert not ctl.pending
    assert ctl.stats()["attn"] == {"forks": 1, "bytes": table.nbytes}
    assert len(fake.log("cuLaunchKernelEx")) == launches + 1
    assert not fake.log("cuLaunchKernelEx")[-1].endswith("ILLEGAL_ADDRESS")


@pytest.mark.parametrize("name", ["cuEventRecord", "cuStreamWaitEvent"])
def test_join_fault(fake, ctl, name):
    assert ctl.fork("attn", 0, 1, stream=STREAM)
    fake.clear_log()
    fake.fail(name, code="CUDA_ERROR_LAUNCH_FAILED")
    with pytest.raises(l2prefetch.CudaError) as info:
        ctl.join(stream=STREAM)
    e = info.value
    assert e.name == "CUDA_ERROR_LAUNCH_FAILED" and name in e.operation and name in str(e)
    assert ctl.pending  # still to be joined
    ctl.join(stream=STREAM)
    assert not ctl.pending
    side, cur = hex(ctl.stream_handle), CUR
    waits = fake.log("cuStreamWaitEvent")
    assert kv(waits[-1])["stream"] == cur and not waits[-1].endswith("FAILED")
    assert kv(fake.log("cuEventRecord")[-1])["stream"] == side
    # and the next step works as usual
    assert ctl.fork("mlp", 0, 1, stream=STREAM)
    ctl.join(stream=STREAM)


@pytest.mark.parametrize("name, nth", [("cuStreamCreateWithPriority", 1), ("cuEventCreate", 1),
                                       ("cuCtxPushCurrent", 2), ("cuCtxPopCurrent", 2),
                                       ("cuDevicePrimaryCtxRetain", 1),
                                       ("cuCtxGetStreamPriorityRange", 1)])
def test_construction_fault(fake, name, nth):
    fake.fail(name, nth=nth, code="CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(l2prefetch.CudaError) as info:
        PC(device=0)
    e = info.value
    assert e.name == "CUDA_ERROR_OUT_OF_MEMORY" and name in e.operation
    assert name in str(e) and "CUDA_ERROR_OUT_OF_MEMORY" in str(e)
    gc.collect()
    assert (fake.live("stream"), fake.live("event"), fake.bad_destroys()) == (0, 0, 0)
    # what was created before the failure was destroyed once
    made = lambda entry: sum("->" not in x for x in fake.log(entry))  # noqa: E731
    assert fake.calls("cuStreamDestroy") == made("cuStreamCreateWithPriority")
    assert fake.calls("cuEventDestroy") == made("cuEventCreate")
    c = PC(device=0)
    assert (fake.live("stream"), fake.live("event")) == (1, 1)
    del c
    assert_all_released(fake)


@pytest.mark.parametrize("name", ["cuEventCreate", "cuEventRecord", "cuCtxPushCurrent",
                                  "cuCtxPopCurrent"])
def test_add_fault(fake, table, name):
    c = PC(device=0)
    fake.fail(name, code="CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(l2prefetch.CudaError) as info:
        c.add("attn", 0, [1, 2], table)
    assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY" and name in info.value.operation
    assert len(c) == 0 and c.get("attn", 0, 1) is None
    assert c.fork("attn", 0, 1, stream=STREAM) is False
    # only the join event: a (point, layer) event made before the failure is destroyed
    assert fake.live("event") == 1
    c.add("attn", 0, [1, 2], table)
    assert len(c) == 2 and fake.live("event") == 2
    # calls: the join event's, the (failed or undone) first try's, the retry's
    assert fake.calls("cuEventCreate") == (2 if name == "cuCtxPushCurrent" else 3)
    assert c.fork("attn", 0, 1, stream=STREAM)
    c.join(stream=STREAM)
    del c
    gc.collect()
    assert (fake.live("stream"), fake.live("event"), fake.bad_destroys()) == (0, 0, 0)


# -- lifetime ---------------------------------------------------------------------------------------

def _populated(fake, table, **kw):
    c = PC(device=0, **kw)
    c.add("attn", 0, [1, 2], table)
    c.add("attn", 1, [1], table)
    c.add("mlp", 0, [1], table)
    c.add("mlp", 2, [4], table)
    assert fake.live("event") == 5 and fake.live("stream") == 1
    return c


def _destroyed_once(fake, events=5):
    assert (fake.live("stream"), fake.live("event"), fake.bad_destroys()) == (0, 0, 0)
    assert fake.calls("cuEventDestroy") == events and fake.calls("cuStreamDestroy") == 1
    destroyed = [kv(x)["event"] for x in fake.log("cuEventDestroy")]
    created = [kv(x)["event"] for x in fake.log("cuEventCreate")]
    assert sorted(destroyed) == sorted(created)


def test_close(fake):
    table = PWR([arr(0), arr(1)])
    c = _populated(fake, table)
    assert c.fork("attn", 0, 1, stream=STREAM)
    ref = weakref.ref(table)
    c.close()
    _destroyed_once(fake)
    assert (c.closed, c.pending, len(c), c.keys(), c.stream_handle) == (True, False, 0, [], 0)
    assert repr(c) == "<PrefetchController cuda:0 0 entries closed>"
    c.close()  # twice is fine and destroys nothing more
    _destroyed_once(fake)
    fake.clear_log()
    with pytest.raises(l2prefetch.Error, match="closed"):
        c.fork("attn", 0, 1, stream=STREAM)
    with pytest.raises(l2prefetch.Error, match="closed"):
        c.fork("unknown", 0, 1, stream=STREAM)
    with pytest.raises(l2prefetch.Error, match="closed"):
        c.join(stream=STREAM)
    with pytest.raises(l2prefetch.Error, match="closed"):
        c.add("attn", 0, 1, table)
    assert fake.log() == []
    # the tables (and so the weights) were dropped by close()
    del table
    gc.collect()
    assert ref() is None
    del c
    gc.collect()
    _destroyed_once(fake)


def test_dealloc_destroys_once(fake, table):
    c = _populated(fake, table)
    c.fork("attn", 0, 1, stream=STREAM)
    ref = weakref.ref(c)
    del c
    assert ref() is None  # no cycle: freed at once
    _destroyed_once(fake)


def test_context_manager(fake, table):
    with PC(device=0) as c:
        c.add("attn", 0, 1, table)
        assert c.fork("attn", 0, 1, stream=STREAM)
    assert c.closed
    _destroyed_once(fake, events=2)


def test_cycle_is_collected(fake, table):
    class Holder(FakeArray):
        pass

    h = Holder(device_ptr(0), (8,))
    c = PC(device=0)
    c.add("x", 0, 1, PWR([h]))
    h.controller = c  # controller -> table -> weight -> controller
    del h, c
    gc.collect()
    _destroyed_once(fake, events=2)


def test_close_fault(fake, table):
    c = _populated(fake, table)
    fake.fail("cuEventDestroy", nth=2, code="CUDA_ERROR_INVALID_HANDLE")
    with pytest.raises(l2prefetch.CudaError) as info:
        c.close()
    assert info.value.name == "CUDA_ERROR_INVALID_HANDLE" and info.value.operation == "cuEventDestroy"
    assert c.closed
    # the rest was still destroyed; nothing is tried twice
    assert fake.calls("cuEventDestroy") == 5 and fake.calls("cuStreamDestroy") == 1
    assert (fake.live("stream"), fake.live("event")) == (0, 1)
    c.close()
    del c
    gc.collect()
    assert fake.calls("cuEventDestroy") == 5 and fake.bad_destroys() == 0


def test_dealloc_fault_is_unraisable(fake, table, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook",
                        lambda u: seen.append((u.exc_type, str(u.exc_value), u.object)))
    c = _populated(fake, table)
    fake.fail("cuEventDestroy", nth=1, code="CUDA_ERROR_INVALID_HANDLE")
    fake.fail("cuStreamDestroy", nth=1, code="CUDA_ERROR_INVALID_HANDLE")
    del c  # must not raise
    gc.collect()
    assert len(seen) == 1, seen
    exc_type, message, obj = seen[0]
    assert exc_type is RuntimeWarning
    assert "cuEventDestroy" in message and "CUDA_ERROR_INVALID_HANDLE" in message
    assert obj is _C.PrefetchController or obj is PC or obj is None
    assert fake.calls("cuEventDestroy") == 5 and fake.calls("cuStreamDestroy") == 1
    assert fake.bad_destroys() == 0
    assert (fake.live("stream"), fake.live("event")) == (1, 1)  # the two that failed
    del seen[:]
    gc.collect()
    assert seen == []


def test_dealloc_fault_during_shutdown_is_ignored(fake, table, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    c = _populated(fake, table)
    fake.fail("cuEventDestroy", nth=1, code="CUDA_ERROR_DEINITIALIZED")
    del c
    gc.collect()
    assert seen == []


# -- graph capture ------------------------------------------------------------------------------

@pytest.fixture
def branch(fake, table):
    """A controller that forks to its side stream in captures too (graph_fork="branch")."""
    c = _populated(fake, table, graph_fork="branch")
    fake.clear_log()
    return c


def test_capture_ended_without_join(fake, branch):
    ctl = branch
    fake.set_capture(7)
    assert ctl.fork("attn", 0, 1, stream=STREAM)
    assert ctl.fork("attn", 1, 1, stream=STREAM)  # same capture: fine
    fake.set_capture(8)
    launches = len(fake.log("cuLaunchKernelEx"))
    with pytest.raises(l2prefetch.Error, match=r"join\(\)") as info:
        ctl.fork("mlp", 0, 1, stream=STREAM)
    assert not isinstance(info.value, l2prefetch.CudaError)
    assert len(fake.log("cuLaunchKernelEx")) == launches  # nothing launched
    assert not ctl.pending
    # the new capture can go on
    assert ctl.fork("mlp", 0, 1, stream=STREAM)
    ctl.join(stream=STREAM)
    assert not ctl.pending


def test_capture_then_eager_without_join(fake, branch):
    fake.set_capture(7)
    assert branch.fork("attn", 0, 1, stream=STREAM)
    fake.set_capture(0)
    with pytest.raises(l2prefetch.Error, match=r"join\(\)"):
        branch.fork("attn", 0, 1, stream=STREAM)


@pytest.mark.parametrize("mode", ["inline", "branch"])
def test_capture_with_join_is_fine(fake, table, mode):
    ctl = _populated(fake, table, graph_fork=mode)
    for capture in (7, 8, 0, 9):
        fake.set_capture(capture)
        assert ctl.fork("attn", 0, 1, stream=STREAM)
        assert ctl.fork("mlp", 0, 1, stream=STREAM)
        ctl.join(stream=STREAM)
    assert ctl.stats()["attn"]["forks"] == 4
    assert not ctl.pending


def test_capture_info_missing_from_old_driver(fake):
    reopen(fake, driver_version=12000)  # cuStreamGetCaptureInfo (12.3 ABI) is optional
    c = PC(device=0)
    c.add("attn", 0, 1, PWR([arr(0)]))
    fake.set_capture(7)
    assert c.fork("attn", 0, 1, stream=STREAM)
    fake.set_capture(8)
    assert c.fork("attn", 0, 1, stream=STREAM)  # undetectable, not an error
    assert fake.calls("cuStreamGetCaptureInfo") == 0
    # no edge data either: the inline graph fork falls back to the side stream
    assert fake.calls("cuStreamUpdateCaptureDependencies") == 0
    assert fake.calls("cuStreamWaitEvent") == 2


# -- eager=False: forks only while capturing ----------------------------------------------------

@pytest.mark.parametrize("mode", ["inline", "branch"])
def test_eager_false_forks_only_in_captures(fake, table, mode):
    ctl = _populated(fake, table, graph_fork=mode, eager=False)
    assert ctl.eager is False and PC(device=0).eager is True
    fake.clear_log()
    fake.set_capture(0)
    assert ctl.fork("attn", 0, 1, stream=STREAM) is False      # eager: nothing launched
    assert not ctl.pending
    assert [len(fake.log(c)) for c in ("cuLaunchKernelEx", "cuEventRecord",
                                        "cuStreamWaitEvent")] == [0, 0, 0]
    ctl.join(stream=STREAM)                                     # nothing to join
    assert len(fake.log("cuStreamWaitEvent")) == 0
    assert ctl.stats()["attn"]["forks"] == 0
    fake.set_capture(7)
    assert ctl.fork("attn", 0, 1, stream=STREAM) is True        # captured: launched
    assert len(fake.log("cuLaunchKernelEx")) == 1
    ctl.join(stream=STREAM)
    assert ctl.stats()["attn"] == {"forks": 1, "bytes": table.nbytes}
    fake.set_capture(0)
    assert ctl.fork("mlp", 0, 1, stream=STREAM) is False
    assert len(fake.log("cuLaunchKernelEx")) == 1


def test_eager_false_capture_ended_without_join(fake, table):
    """The check for a capture that ended without join() comes before the eager skip."""
    ctl = _populated(fake, table, graph_fork="branch", eager=False)
    fake.set_capture(7)
    assert ctl.fork("attn", 0, 1, stream=STREAM)
    fake.set_capture(0)
    with pytest.raises(l2prefetch.Error, match=r"join\(\)"):
        ctl.fork("attn", 0, 1, stream=STREAM)
    assert ctl.fork("attn", 0, 1, stream=STREAM) is False


def test_eager_false_needs_capture_info(fake):
    reopen(fake, driver_version=12000)                 # no cuStreamGetCaptureInfo (12.3 ABI)
    with pytest.raises(ValueError, match=r"eager=False needs .*12\.3.* this driver is 12\.0"):
        PC(device=0, eager=False)
    assert fake.live("stream") == 0
    assert PC(device=0).eager is True                  # the default still works there


# -- the inline graph fork (capture.c) -------------------------------------------------------------

def _deps(line):
    """'deps=[1:t0/p0,2:t1/p2]' of a log line -> [(1, 0, 0), (2, 1, 2)]."""
    text = kv(line)["deps"].strip("[]")
    out = []
    for item in filter(None, text.split(",")):
        node, edge = item.split(":")
        t, p = edge.split("/")
        out.append((int(node), int(t[1:]), int(p[1:])))
    return out


def test_graph_fork_names(fake, table):
    assert PC(device=0).graph_fork == "inline"
    assert PC(device=0, graph_fork="branch").graph_fork == "branch"


@pytest.mark.parametrize("upstream_type", [0, 1, 2])
def test_inline_fork_edges(fake, ctl, upstream_type):
    """K depends on X: programmatically when X is a kernel (K launches early and its
    griddepcontrol.wait holds its loads until X is done), by X's own edge otherwise;
    afterwards the stream depends on X as before (its own edge) plus K's launch."""
    fake.set_capture(7)
    x = fake.add_capture_node(upstream_type)
    fake.clear_log()
    assert ctl.fork("attn", 0, 1, stream=STREAM)
    launch, = fake.log("cuLaunchKernelEx")
    assert kv(launch)["stream"] == CUR                       # on the captured stream itself
    k = int(kv(launch)["node"])
    kernel = upstream_type == 0
    assert _deps(launch) == ([(x, 1, 2)] if kernel else [(x, 0, 0)])
    updates = fake.log("cuStreamUpdateCaptureDependencies")
    assert len(updates) == (2 if kernel else 1)
    assert all(kv(u)["flags"] == "1" for u in updates)      # SET
    assert _deps(updates[-1]) == [(x, 0, 0), (k, 1, 2)]
    # no side stream, no events: nothing pending, join() does nothing
    assert fake.log("cuEventRecord") == [] and fake.log("cuStreamWaitEvent") == []
    assert not ctl.pending
    ctl.join(stream=STREAM)
    assert fake.log("cuEventRecord") == []
    assert ctl.stats()["attn"] == {"forks": 1, "bytes": 4096}
    # the next captured node depends on X (its own edge) and on K's launch
    launch_after = PWR([arr(5)]).launch(STREAM)
    assert launch_after is None
    assert _deps(fake.log("cuLaunchKernelEx")[-1]) == [(x, 0, 0), (k, 1, 2)]


def test_inline_forks_back_to_back_keep_every_launch_edge(fake, ctl):
    fake.set_capture(7)
    x = fake.add_capture_node(0)
    fake.clear_log()
    assert ctl.fork("attn", 0, 1, stream=STREAM)
    assert ctl.fork("mlp", 0, 1, stream=STREAM)
    k1, k2 = (int(kv(line)["node"]) for line in fake.log("cuLaunchKernelEx"))
    # K2 after X (programmatic: X is a kernel) and K1 (its launch, as it was)
    assert _deps(fake.log("cuLaunchKernelEx")[1]) == [(x, 1, 2), (k1, 1, 2)]
    assert _deps(fake.log("cuStreamUpdateCaptureDependencies")[-1]) == \
        [(x, 0, 0), (k1, 1, 2), (k2, 1, 2)]


def test_inline_fork_without_node_types_keeps_ordinary_edges(fake, ctl):
    """cuGraphNodeGetType failing (or missing): no node is known to be a kernel, so
    K gets X's own edge, serial and correct."""
    fake.set_capture(7)
    x = fake.add_capture_node(0)
    fake.fail("cuGraphNodeGetType", code="CUDA_ERROR_INVALID_VALUE")
    fake.clear_log()
    assert ctl.fork("attn", 0, 1, stream=STREAM)
    launch, = fake.log("cuLaunchKernelEx")
    assert _deps(launch) == [(x, 0, 0)]


def test_inline_fork_first_in_capture(fake, ctl):
    """No node captured yet: K is a root, the stream then depends on its launch."""
    fake.set_capture(7)
    fake.clear_log()
    assert ctl.fork("attn", 0, 1, stream=STREAM)
    launch, = fake.log("cuLaunchKernelEx")
    assert _deps(launch) == []
    assert _deps(fake.log("cuStreamUpdateCaptureDependencies")[-1]) == [(int(kv(launch)["node"]),
                                                                        1, 2)]


def test_leaf_fork_edges(fake, table):
    """graph_fork='leaf': K depends on X by X's own edge and nothing depends on K: the
    stream's dependencies afterwards are X's alone, the next node does not wait for K."""
    c = PC(device=0, graph_fork="leaf")
    assert c.graph_fork == "leaf"
    c.add("attn", 0, 1, table)
    fake.set_capture(7)
    x = fake.add_capture_node(0)
    fake.clear_log()
    assert c.fork("attn", 0, 1, stream=STREAM)
    launch, = fake.log("cuLaunchKernelEx")
    assert kv(launch)["stream"] == CUR and _deps(launch) == [(x, 0, 0)]
    k = int(kv(launch)["node"])
    update, = fake.log("cuStreamUpdateCaptureDependencies")
    assert kv(update)["flags"] == "1" and _deps(update) == [(x, 0, 0)]
    assert fake.log("cuEventRecord") == [] and fake.log("cuStreamWaitEvent") == []
    assert not c.pending and c.stats()["attn"] == {"forks": 1, "bytes": 4096}
    c.join(stream=STREAM)
    assert fake.log("cuEventRecord") == []
    PWR([arr(5)]).launch(STREAM)
    deps = _deps(fake.log("cuLaunchKernelEx")[-1])
    assert deps == [(x, 0, 0)] and k not in [d[0] for d in deps]


def test_leaf_forks_chain_within_one_capture(fake, table):
    """A second leaf of the same capture depends on its fork's node and on the first
    leaf (one side chain); in another capture the chain starts again."""
    c = PC(device=0, graph_fork="leaf")
    c.add("attn", 0, 1, table)
    c.add("mlp", 0, 1, table)
    fake.set_capture(7)
    x = fake.add_capture_node(0)
    fake.clear_log()
    assert c.fork("attn", 0, 1, stream=STREAM)
    k1 = int(kv(fake.log("cuLaunchKernelEx")[-1])["node"])
    y = fake.add_capture_node(0)
    assert c.fork("mlp", 0, 1, stream=STREAM)
    launch = fake.log("cuLaunchKernelEx")[-1]
    k2 = int(kv(launch)["node"])
    assert sorted(d[0] for d in _deps(launch)) == sorted([y, k1])
    assert _deps(fake.log("cuStreamUpdateCaptureDependencies")[-1]) == [(y, 0, 0)]
    fake.set_capture(8)
    z = fake.add_capture_node(0)
    assert c.fork("attn", 0, 1, stream=STREAM)
    assert _deps(fake.log("cuLaunchKernelEx")[-1]) == [(z, 0, 0)]
    assert x and k2


def test_a_chained_leaf_whose_launch_fails_leaves_the_stream_as_it_was(fake, table):
    """The second leaf's launch fails: the first leaf's edge, added to the stream for it,
    is taken back, so the next captured node waits for its fork's node alone, not for
    the previous loader."""
    c = PC(device=0, graph_fork="leaf")
    c.add("attn", 0, 1, table)
    c.add("mlp", 0, 1, table)
    fake.set_capture(7)
    fake.add_capture_node(0)
    assert c.fork("attn", 0, 1, stream=STREAM)
    y = fake.add_capture_node(0)
    fake.fail("cuLaunchKernelEx", code="CUDA_ERROR_INVALID_VALUE")
    with pytest.raises(l2prefetch.CudaError, match="cuLaunchKernelEx"):
        c.fork("mlp", 0, 1, stream=STREAM)
    fake.clear_log()
    PWR([arr(5)]).launch(STREAM)
    assert _deps(fake.log("cuLaunchKernelEx")[-1]) == [(y, 0, 0)]


def test_leaf_fork_first_in_capture(fake, table):
    """No node captured yet: K is a root and the stream is left with no dependencies."""
    c = PC(device=0)
    c.add("attn", 0, 1, table, graph_fork="leaf")
    assert c.get_mode("attn", 0, 1) == "leaf"
    fake.set_capture(7)
    fake.clear_log()
    assert c.fork("attn", 0, 1, stream=STREAM)
    launch, = fake.log("cuLaunchKernelEx")
    assert _deps(launch) == []
    update, = fake.log("cuStreamUpdateCaptureDependencies")
    assert kv(update)["n"] == "0"
    PWR([arr(5)]).launch(STREAM)
    assert _deps(fake.log("cuLaunchKernelEx")[-1]) == []


def test_leaf_fork_eager_takes_the_side_stream(fake, table):
    c = PC(device=0, graph_fork="leaf")
    c.add("attn", 0, 1, table)
    fake.clear_log()
    assert c.fork("attn", 0, 1, stream=STREAM)
    assert kv(fake.log("cuLaunchKernelEx")[-1])["stream"] != CUR and c.pending
    c.join(stream=STREAM)
    assert not c.pending


@pytest.mark.parametrize("call, nth", [("cuStreamGetCaptureInfo", 2), ("cuLaunchKernelEx", 1),
                                       ("cuStreamGetCaptureInfo", 3),
                                       ("cuStreamUpdateCaptureDependencies", 1),
                                       ("cuStreamUpdateCaptureDependencies", 2)])
def test_inline_fork_faults(fake, ctl, call, nth):
    """Each driver call of the inline fork failing: CudaError naming it, nothing
    counted, the dependency set left usable (never X's programmatic edge, which would
    let the next kernel start before X is done), the controller still working."""
    fake.set_capture(7)
    x = fake.add_capture_node(0)
    fake.fail(call, nth=nth, code="CUDA_ERROR_INVALID_VALUE")
    with pytest.raises(l2prefetch.CudaError, match=call) as info:
        ctl.fork("attn", 0, 1, stream=STREAM)
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE" and info.value.operation == call
    assert ctl.stats()["attn"]["forks"] == 0 and not ctl.pending
    launched = [int(kv(line)["node"]) for line in fake.log("cuLaunchKernelEx")
                if "node" in kv(line)]
    fake.clear_log()
    PWR([arr(5)]).launch(STREAM)
    deps = _deps(fake.log("cuLaunchKernelEx")[-1])
    if launched:   # failed after the launch: the stream follows K with an ordinary edge
        assert deps == [(launched[0], 0, 0)]
    else:          # failed before: X's edge as it was
        assert deps == [(x, 0, 0)]
    assert ctl.fork("attn", 0, 1, stream=STREAM)


def test_inline_fork_restore_failing_too_says_the_capture_is_unusable(fake, ctl):
    """The launch fails and giving the stream X's own edges back fails as well: X's
    programmatic edge is left (the next kernel could start before X is done), so the
    error names the launch's error and says the capture must be discarded."""
    fake.set_capture(7)
    x = fake.add_capture_node(0)
    fake.fail("cuLaunchKernelEx", code="CUDA_ERROR_INVALID_VALUE")
    fake.fail("cuStreamUpdateCaptureDependencies", nth=2, code="CUDA_ERROR_UNKNOWN")
    with pytest.raises(l2prefetch.CudaError, match="capture is unusable, end it and discard") \
            as info:
        ctl.fork("attn", 0, 1, stream=STREAM)
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"
    assert info.value.operation.startswith("cuLaunchKernelEx (and restoring")
    assert ctl.stats()["attn"]["forks"] == 0 and not ctl.pending
    fake.clear_log()
    PWR([arr(5)]).launch(STREAM)
    assert _deps(fake.log("cuLaunchKernelEx")[-1]) == [(x, 1, 2)]   # what the message warns of


def test_inline_fork_before_sm90_keeps_ordinary_edges(fake):
    """Programmatic launch needs compute capability 9.0 (the loader's griddepcontrol.wait
    is compiled for sm_90+ only): on an 8.x device K depends on X by X's own edge."""
    reopen(fake, cc_major=8, cc_minor=6)
    c = PC(device=0)
    c.add("attn", 0, 1, PWR([arr(0)]))
    fake.set_capture(7)
    x = fake.add_capture_node(0)
    fake.clear_log()
    assert c.fork("attn", 0, 1, stream=STREAM)
    launch, = fake.log("cuLaunchKernelEx")
    assert _deps(launch) == [(x, 0, 0)]
    update, = fake.log("cuStreamUpdateCaptureDependencies")    # no re-edging before it
    assert _deps(update) == [(x, 0, 0), (int(kv(launch)["node"]), 1, 2)]


def test_inline_fork_leaks_nothing(fake):
    c = PC(device=0)
    c.add("attn", 0, 1, PWR([arr(0)]))
    fake.set_capture(7)
    for i in range(100):
        fake.add_capture_node(i % 3)
        assert c.fork("attn", 0, 1, stream=STREAM)
    fake.set_capture(0)
    assert c.stats()["attn"]["forks"] == 100
    del c
    assert_all_released(fake)


# -- L2PREFETCH_DISABLE ---------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["1", "true", "YES", "on", " 1", "\ton\n", "True "])
def test_disabled(fake, table, monkeypatch, value):
    monkeypatch.setenv("L2PREFETCH_DISABLE", value)
    fake.clear_log()
    c = PC(device=0)
    assert (c.enabled, c.stream_handle, c.pending) == (False, 0, False)
    assert c.stream is None
    c.add("attn", 0, [1, 2], table)
    assert len(c) == 2 and c.get("attn", 0, 1) is table
    assert c.fork("attn", 0, 1, stream=STREAM) is False
    assert c.fork("attn", 0, 1) is False  # not even the current stream is looked up
    assert c.join() is None and c.join(stream=STREAM) is None
    assert c.stats() == {"attn": {"forks": 0, "bytes": 0}}
    assert "disabled" in repr(c)
    c.close()
    del c
    gc.collect()
    assert fake.log() == []


@pytest.mark.parametrize("value", ["0", "", "no", "off", " ", "1x", "o n", "\u00a01"])
def test_not_disabled(fake, monkeypatch, value):
    monkeypatch.setenv("L2PREFETCH_DISABLE", value)
    assert PC(device=0).enabled


@pytest.mark.parametrize("value", ["1", " 1", "yes\n", "0", "", "1x", "\u00a01", "\x1c1"])
def test_one_rule_for_c_and_python(fake, monkeypatch, value):
    """l2prefetch.disabled() and hooks.disabled() read the flag with the C parser: they
    agree with the controller on every value (Python's str.strip() would also strip
    non-ASCII blanks, and did strip " 1" where C did not)."""
    from l2prefetch import hooks

    monkeypatch.setenv("L2PREFETCH_DISABLE", value)
    off = not PC(device=0).enabled
    assert l2prefetch.disabled() is off and hooks.disabled() is off
    assert _C.env_flag("L2PREFETCH_DISABLE") is off


def test_disabled_needs_no_driver(fake, monkeypatch):
    _C._use_driver(None)
    monkeypatch.setenv("L2PREFETCH_LIBCUDA", "/nonexistent/libcuda.so.1")
    monkeypatch.setenv("L2PREFETCH_DISABLE", "1")
    c = PC(device=0)
    assert not c.enabled and c.fork("a", 0, 1) is False
    monkeypatch.delenv("L2PREFETCH_DISABLE")
    with pytest.raises(l2prefetch.CudaUnavailableError):
        PC(device=0)


# -- from_plan ---------------------------------------------------------------------------------------

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="PlanEntry holds torch tensors")





@needs_torch
def test_from_plan(fake):
    PlanEntry = l2prefetch.PlanEntry
    a, b = cuda_tensor(device_ptr(0), 1024), cuda_tensor(device_ptr(0, 65536), 512)
    plan = [PlanEntry("attn", 0, [1, 2], (a, b)),
            PlanEntry("attn", 1, [1, 2], (a, b)),            # same settings: shares the table
            PlanEntry("attn", 2, [1], (a, b), grid=8),       # another grid: its own
            PlanEntry("mlp", 0, [3], (b,), priority=True, carveout=50)]
    c = PC.from_plan(plan, device=0)
    assert type(c) is PC
    assert sorted(c.keys()) == [("attn", 0, 1), ("attn", 0, 2), ("attn", 1, 1), ("attn", 1, 2),
                                ("attn", 2, 1), ("mlp", 0, 3)]
    shared = c.get("attn", 0, 1)
    assert shared is c.get("attn", 1, 2) and shared is not c.get("attn", 2, 1)
    assert shared.ranges == ((device_ptr(0), 2048), (device_ptr(0, 65536), 1024))
    assert (c.get("attn", 2, 1).grid, c.get("mlp", 0, 3).launch_priority) == (8, -5)
    assert c.get("mlp", 0, 3).carveout == 50
    assert c.points == ("attn", "mlp")
    assert c.fork("mlp", 0, 3, stream=STREAM)
    assert kv(fake.log("cuLaunchKernelEx")[-1])["attrs"] == "priority:-5,carveout:50"
    assert fake.calls("cuModuleLoadData") == 1
    c2 = PC.from_plan(plan[:1], device=0, kernel="load")
    assert c2.get("attn", 0, 1).kernel == "load"


@needs_torch
def test_from_plan_type_errors(fake):
    with pytest.raises(TypeError, match=r"plan\[1\] must be a PlanEntry, not tuple"):
        PC.from_plan([l2prefetch.PlanEntry("a", 0, [1], (torch.zeros(8),)), ("a", 0, 1)])
    with pytest.raises(TypeError):
        PC.from_plan(5)
    assert fake.live("stream") == 0


@needs_torch
def test_from_plan_cpu_weights(fake):
    plan = [l2prefetch.PlanEntry("attn", 0, [1], (torch.zeros(64, dtype=torch.float16),))]
    with pytest.raises(ValueError, match="cpu"):
        PC.from_plan(plan, device=0)
    gc.collect()
    assert (fake.live("stream"), fake.live("event"), fake.bad_destroys()) == (0, 0, 0)


@needs_torch
def test_from_plan_disabled(fake, monkeypatch):
    monkeypatch.setenv("L2PREFETCH_DISABLE", "1")
    plan = [l2prefetch.PlanEntry("attn", 0, [1], (torch.zeros(64, dtype=torch.float16),))]
    fake.clear_log()
    c = PC.from_plan(plan, device=0)
    assert not c.enabled and len(c) == 0 and c.fork("attn", 0, 1) is False
    assert fake.log() == []


def test_tables_are_sparse_within_the_maxima(fake):
    """add() at the documented maxima costs memory for what it registers, not for a dense
    [point][layer][batch] array (32 GiB for add("p", 65535, [65535], t) before): one row
    pointer per layer up to a point's highest, and one slot per key."""
    t = PWR([], device=0)
    c = PC(device=0)
    gc.collect()
    tracemalloc.start()
    try:
        c.add("p", 65535, [65535], t)
        c.add("p", 0, range(1, 65536, 4096), t)     # batches up to 65535, then layer 65535
        c.add("q", 65535, [1, 65535], t)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak
    assert len(c) == 1 + 16 + 2 == len(c.keys())
    assert c.get("p", 65535, 65535) is t and c.get("p", 65535, 1) is None
    assert c.fork("p", 65535, 65535, stream=STREAM) and c.fork("q", 65535, 1, stream=STREAM)
    assert c.fork("p", 65534, 65535, stream=STREAM) is False
    assert c.fork("p", 0, 4097, stream=STREAM) and c.fork("p", 0, 4098, stream=STREAM) is False
    c.join(stream=STREAM)
    assert c.keys()[:3] == [("p", 0, 1), ("p", 0, 4097), ("p", 0, 8193)]


try:
    import _testcapi
except ImportError:  # pragma: no cover - a Python built without it
    _testcapi = None


@pytest.mark.skipif(_testcapi is None, reason="needs _testcapi.set_nomemory")
def test_add_out_of_memory_leaves_a_usable_controller(fake, table):
    """Each allocation of add() failing in turn: MemoryError, and the controller stays
    consistent (what keys() lists, get() finds and fork() launches) and usable."""
    c = PC(device=0)
    c.add("a", 0, [1], table)
    failures = 0
    for start in range(60):
        point, layer = f"p{start % 3}", start
        try:
            _testcapi.set_nomemory(start, start + 1)
            try:
                c.add(point, layer, [1, 2, 3], table)
            finally:
                _testcapi.remove_mem_hooks()
        except MemoryError:
            failures += 1
        keys = c.keys()
        assert len(keys) == len(c)
        for key in keys:
            assert c.get(*key) is table
    assert failures > 3
    for key in c.keys():
        assert c.fork(*key, stream=STREAM)
    c.join(stream=STREAM)
    c.add("b", 1, [4], table)
    assert c.fork("b", 1, 4, stream=STREAM)
    c.join(stream=STREAM)
    del c
    gc.collect()
    assert (fake.live("stream"), fake.live("event"), fake.bad_destroys()) == (0, 0, 0)


# -- threads and leaks -----------------------------------------------------------------------------

def test_two_threads_fork(fake, ctl, table):
    errors, barrier = [], threading.Barrier(2)

    def work(keys):
        try:
            barrier.wait()
            for i in range(1000):
                assert ctl.fork(*keys[i % len(keys)], stream=STREAM) is True
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=([("attn", 0, 1), ("attn", 1, 1)],)),
               threading.Thread(target=work, args=([("mlp", 0, 1), ("attn", 0, 2)],))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert ctl.pending
    ctl.join(stream=STREAM)
    assert not ctl.pending
    assert ctl.stats() == {"attn": {"forks": 1500, "bytes": 1500 * table.nbytes},
                           "mlp": {"forks": 500, "bytes": 500 * table.nbytes}}
    lines = fake.log()
    assert sum(x.startswith("cuLaunchKernelEx") for x in lines) == 2000
    assert not any("->" in x for x in lines)
    # each fork's three calls stay together: record, wait, launch (each new thread makes
    # the context current once)
    loud_names = [x.split(" ", 1)[0] for x in loud(fake)]
    assert loud_names.count("cuCtxSetCurrent") == 2
    loud_names = [x for x in loud_names if x != "cuCtxSetCurrent"]
    assert loud_names == ["cuEventRecord", "cuStreamWaitEvent", "cuLaunchKernelEx"] * 2000 + \
        ["cuEventRecord", "cuStreamWaitEvent"]


def test_create_drop_loop_leaks_nothing(fake):
    def once(i):
        t = PWR([arr(i % 7), arr(7 + i % 5)])
        c = PC(device=0)
        c.add("attn", i % 3, [1, 2], t)
        c.add("mlp", 0, 1, t)
        assert c.fork("attn", i % 3, 1 + i % 2, stream=STREAM)
        c.join(stream=STREAM)
        if i % 2:
            c.close()

    for i in range(200):  # warm up: module, kernel cache, interned names
        once(i)
    fake.clear_log()
    gc.collect()
    # Growth per window of 1000: a leak grows the same every window; warm-up (CPython's
    # caches, which under PYTHONMALLOC=malloc of the sanitizer pass take several thousand
    # iterations to fill) shrinks to nothing.
    growth = []
    tracemalloc.start()
    try:
        for window in range(8):
            before = tracemalloc.get_traced_memory()[0]
            for i in range(1000):
                once(i)
                if i % 500 == 499:
                    fake.clear_log()
            gc.collect()
            growth.append(tracemalloc.get_traced_memory()[0] - before)
            if growth[-1] < 32 * 1024:
                break
    finally:
        tracemalloc.stop()
    assert growth[-1] < 32 * 1024, growth
    n = 200 + 1000 * len(growth)
    assert (fake.live("stream"), fake.live("event"), fake.bad_destroys()) == (0, 0, 0)
    assert fake.live("module") == 1 and fake.live("context") == 1
    assert fake.calls("cuStreamCreateWithPriority") == fake.calls("cuStreamDestroy") == n
    assert fake.calls("cuEventCreate") == fake.calls("cuEventDestroy") == 3 * n
    assert_all_released(fake)


# -- a failed capture-state query; graph_fork per key --------------------------------------------

@pytest.mark.parametrize("mode, eager", [("inline", True), ("branch", True), ("branch", False)])
def test_failed_capture_state_query_is_a_cuda_error(fake, table, mode, eager):
    """Never read as "not capturing": that made a branch fork report a capture that ended
    without join() (and drop pending), eager=False return False inside a capture, and an
    inline fork take the side stream."""
    ctl = _populated(fake, table, graph_fork=mode, eager=eager)
    fake.set_capture(7)
    if GRAPH_FORK_MODES[mode].needs_join:
        assert ctl.fork("attn", 0, 1, stream=STREAM) and ctl.pending
    fake.clear_log()
    fake.fail("cuStreamGetCaptureInfo", code="CUDA_ERROR_INVALID_VALUE")
    with pytest.raises(l2prefetch.CudaError) as info:
        ctl.fork("attn", 1, 1, stream=STREAM)
    assert info.value.operation == "cuStreamGetCaptureInfo"
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"
    assert fake.log("cuLaunchKernelEx") == [] and ctl.pending == GRAPH_FORK_MODES[mode].needs_join
    assert ctl.fork("attn", 1, 1, stream=STREAM)          # the next query works
    ctl.join(stream=STREAM)
    assert not ctl.pending


def _launch_streams(fake):
    return [kv(line)["stream"] for line in fake.log("cuLaunchKernelEx")]


@pytest.mark.parametrize("default", ["inline", "branch"])
def test_graph_fork_per_key_in_one_capture(fake, table, default):
    """A plan mixing inline and branch keys: while capturing each key forks its own way;
    eager forks all take the side stream, as before."""
    other = "branch" if default == "inline" else "inline"
    ctl = PC(device=0, graph_fork=default)
    side = hex(ctl.stream_handle)
    ctl.add("attn", 0, [1, 2], table)                       # the controller's
    ctl.add("mlp", 0, [1], table, graph_fork=other)
    ctl.add("moe", 0, [1], table, graph_fork=default)       # said explicitly: the same
    assert [ctl.get_mode(*k) for k in (("attn", 0, 1), ("mlp", 0, 1), ("moe", 0, 1))] == \
        [default, other, default]
    assert ctl.get_mode("attn", 0, 3) is None and ctl.graph_fork == default
    where = {"inline": CUR, "branch": side}
    fake.set_capture(7)
    fake.add_capture_node(0)
    fake.clear_log()
    for key in (("attn", 0, 1), ("mlp", 0, 1), ("attn", 0, 2), ("moe", 0, 1)):
        assert ctl.fork(*key, stream=STREAM)
    assert _launch_streams(fake) == [where[default], where[other], where[default], where[default]]
    inline_forks = [default, other, default, default].count("inline")
    # two per inline fork: X's kernel node programmatic for K, then X's edge and K's launch
    assert len(fake.log("cuStreamUpdateCaptureDependencies")) == 2 * inline_forks
    assert ctl.pending                                      # a branch fork is in the capture
    ctl.join(stream=STREAM)
    assert not ctl.pending and len(fake.log("cuStreamWaitEvent")) == 4 - inline_forks + 1
    fake.set_capture(0)
    fake.clear_log()
    for key in (("attn", 0, 1), ("mlp", 0, 1)):
        assert ctl.fork(*key, stream=STREAM)
    assert _launch_streams(fake) == [side, side]            # eager: unchanged
    ctl.join(stream=STREAM)
    assert ctl.stats()["mlp"]["forks"] == 2


def test_graph_fork_per_key_replaced_and_reset(fake, table):
    ctl = PC(device=0)
    ctl.add("attn", 0, [1, 2], table, graph_fork="branch")
    ctl.add("attn", 0, [2], table)                          # None: the controller's again
    assert (ctl.get_mode("attn", 0, 1), ctl.get_mode("attn", 0, 2)) == ("branch", "inline")


def test_branch_key_capture_ended_without_join_seen_by_an_inline_key(fake, table):
    ctl = PC(device=0)
    ctl.add("attn", 0, [1], table)
    ctl.add("mlp", 0, [1], table, graph_fork="branch")
    fake.set_capture(7)
    assert ctl.fork("mlp", 0, 1, stream=STREAM) and ctl.pending
    fake.set_capture(8)
    with pytest.raises(l2prefetch.Error, match=r"ended without join\(\)"):
        ctl.fork("attn", 0, 1, stream=STREAM)
    assert not ctl.pending
    assert ctl.fork("attn", 0, 1, stream=STREAM)


@pytest.mark.parametrize("join_capture, said", [(8, "in another capture"), (0, "eagerly")])
def test_join_outside_the_capture_that_forked_is_refused(fake, table, join_capture, said):
    """A branch fork pending in capture 7 joins there only (a PIECEWISE step joins each
    piece's own forks): a join in another capture or eagerly records and waits nothing,
    drops pending and names what to do, instead of the driver's error."""
    ctl = PC(device=0, graph_fork="branch")
    ctl.add("attn", 0, [1], table)
    fake.set_capture(7)
    assert ctl.fork("attn", 0, 1, stream=STREAM) and ctl.pending
    fake.set_capture(join_capture)
    fake.clear_log()
    with pytest.raises(l2prefetch.Error, match=rf"fork was made in a CUDA graph capture, and "
                                               rf"this join\(\) runs {said}"):
        ctl.join(stream=STREAM)
    assert not ctl.pending
    assert fake.log("cuEventRecord") == [] and fake.log("cuStreamWaitEvent") == []
    ctl.join(stream=STREAM)                                # nothing pending: nothing to do
    assert ctl.fork("attn", 0, 1, stream=STREAM) and ctl.pending
    ctl.join(stream=STREAM)                                # in its own capture: joined
    assert not ctl.pending and len(fake.log("cuStreamWaitEvent")) == 2


def test_eager_join_reads_no_capture_state(fake, table):
    """An eager fork's join costs its record and wait only, no capture-state read."""
    ctl = PC(device=0, graph_fork="branch")
    ctl.add("attn", 0, [1], table)
    assert ctl.fork("attn", 0, 1, stream=STREAM) and ctl.pending
    fake.clear_log()
    ctl.join(stream=STREAM)
    assert fake.log("cuStreamGetCaptureInfo") == [] and len(fake.log("cuEventRecord")) == 1


def test_graph_fork_per_key_falls_back_without_edge_data(fake):
    reopen(fake, driver_version=12000)          # no 12.3 capture entry points: side stream
    ctl = PC(device=0)
    ctl.add("attn", 0, [1], PWR([arr(0)]), graph_fork="inline")
    fake.set_capture(7)
    assert ctl.fork("attn", 0, 1, stream=STREAM)
    assert _launch_streams(fake)[-1] == hex(ctl.stream_handle)
    ctl.join(stream=STREAM)


# -- the host-cost floor (_C._floor_fork_join, benchmarks/sections/host.py) ------------------

@pytest.mark.parametrize("name, n", [("cuStreamCreateWithPriority", 3), ("cuEventCreate", 3),
                                     ("cuEventRecord", 3), ("cuStreamSynchronize", 3),
                                     ("cuStreamSynchronize", 0), ("cuCtxPopCurrent", 0)])
def test_floor_fault_names_its_call(fake, name, n):
    """Every failure of the C floor names the driver call that failed (a loop of no pairs
    included) and releases its stream and events."""
    p = PWR([arr(0)])
    assert _C._floor_fork_join(p, 2, STREAM) >= 0
    fake.fail(name, code="CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(l2prefetch.CudaError) as info:
        _C._floor_fork_join(p, n, STREAM)
    expected = "the fork/join sequence" if name == "cuEventRecord" else name
    assert info.value.operation.startswith(expected), info.value.operation
    assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert (fake.live("stream"), fake.live("event"), fake.bad_destroys()) == (0, 0, 0)


# -- warm_activation: a fork that reads its site's activation last ---------------------------

def _table_of(line):
    """(count, granules, last range (ptr, nbytes)) of a logged prefetch launch."""
    f = kv(line)
    ptr, n = f["last"].split("+")
    return int(f["count"]), int(f["granules"]), (int(ptr, 16), int(n))


@pytest.fixture
def warm(fake):
    """A controller with ('mlp', 0, 1): two weights, warm_activation=True (ranges 4096
    bytes), and ('attn', 0, 1): the same without it; log cleared."""
    c = PC(device=0)
    c.add("mlp", 0, 1, PWR([arr(0), arr(1)], warm_activation=True))
    c.add("attn", 0, 1, PWR([arr(0), arr(1)]))
    c.fork("attn", 0, 1, stream=STREAM)
    c.join(stream=STREAM)
    c.reset_stats()
    fake.clear_log()
    return c


def test_warm_table_keeps_a_slot(fake):
    eight = [arr(i, 8) for i in range(8)]
    assert PWR(eight).warm_activation is False
    PWR(eight).launch(STREAM)
    t = PWR(eight, warm_activation=True)
    assert t.warm_activation is True and len(t.ranges) == 8
    t.launch(STREAM)   # a launch of its own appends nothing
    plain, warmed = fake.log("cuLaunchKernelEx")
    assert kv(plain)["func"] == "l2p_prefetch_8" and kv(warmed)["func"] == "l2p_prefetch_32"
    assert _table_of(warmed) == (8, 8, (device_ptr(0, 7 * 65536), 16))
    with pytest.raises(ValueError, match=r"128 ranges, but one PreparedWeightRanges holds at "
                                         r"most 127 with warm_activation=True"):
        PWR([arr(i, 8) for i in range(128)], warm_activation=True)
    with pytest.raises(TypeError, match="warm_activation must be a bool, not int"):
        PWR(eight, warm_activation=1)


def test_fork_appends_the_activation_for_that_launch_only(fake, warm):
    act = arr(9, 100)   # 200 bytes at a 64 KiB boundary
    assert warm.fork("mlp", 0, 1, stream=STREAM, activation=act)
    assert _table_of(fake.log("cuLaunchKernelEx")[-1]) == (3, 256 + 12, (act.ptr, 200))
    warm.join(stream=STREAM)
    assert warm.stats()["mlp"] == {"forks": 1, "bytes": 4096 + 200}
    assert warm.fork("mlp", 0, 1, stream=STREAM)   # no activation: the table as made
    assert _table_of(fake.log("cuLaunchKernelEx")[-1]) == (2, 256, (device_ptr(0, 65536), 2048))
    assert warm.get("mlp", 0, 1).ranges == ((device_ptr(0, 0), 2048), (device_ptr(0, 65536), 2048))
    warm.join(stream=STREAM)


def test_fork_activation_start_rounded_up_to_16_bytes(fake, warm):
    assert warm.fork("mlp", 0, 1, stream=STREAM, activation=FakeArray(device_ptr(0, 9 * 65536 + 4),
                                                                       (50,)))
    assert _table_of(fake.log("cuLaunchKernelEx")[-1])[2] == (device_ptr(0, 9 * 65536 + 16), 88)
    warm.join(stream=STREAM)
    # under 16 bytes left, or empty: nothing appended
    for small in (FakeArray(device_ptr(0, 9 * 65536 + 4), (8,)), FakeArray(device_ptr(0, 0), (0,))):
        assert warm.fork("mlp", 0, 1, stream=STREAM, activation=small)
        assert _table_of(fake.log("cuLaunchKernelEx")[-1])[0] == 2
        warm.join(stream=STREAM)


def test_fork_activation_ignored_where_the_table_does_not_warm(fake, warm):
    class Unread:
        @property
        def __cuda_array_interface__(self):
            raise AssertionError("read")

    assert warm.fork("attn", 0, 1, stream=STREAM, activation=Unread())
    assert _table_of(fake.log("cuLaunchKernelEx")[-1])[0] == 2
    warm.join(stream=STREAM)


def test_fork_activation_on_another_device(fake):
    reopen(fake, device_count=2)
    c = PC(device=0)
    c.add("mlp", 0, 1, PWR([arr(0)], warm_activation=True))
    with pytest.raises(ValueError, match=r"fork\(\): activation is on cuda:1, this controller on "
                                         r"cuda:0; pass a tensor on cuda:0, or None"):
        c.fork("mlp", 0, 1, stream=STREAM, activation=arr(0, 64, device=1))
    assert fake.log("cuLaunchKernelEx") == [] and not c.pending


def test_fork_activation_errors(fake, warm):
    with pytest.raises(ValueError, match=r"activation is not in CUDA device memory; pass a "
                                         r"tensor on this controller's device, cuda:0"):
        warm.fork("mlp", 0, 1, stream=STREAM, activation=FakeArray(0x1000, (64,)))
    with pytest.raises(TypeError, match="not a tensor") as info:
        warm.fork("mlp", 0, 1, stream=STREAM, activation=object())
    assert "while reading fork()'s activation" in "".join(getattr(info.value, "__notes__", []))
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"activation is not in CUDA device memory"):
        warm.fork("mlp", 0, 1, stream=STREAM, activation=torch.zeros(64))
    assert fake.log("cuLaunchKernelEx") == [] and not warm.pending


def test_fork_checks_the_device_of_an_activation_of_any_size(fake, warm):
    """A CPU activation is refused whatever its size: one under 16 bytes (no range to
    read) too, so a bad argument never passes by its length."""
    torch = pytest.importorskip("torch")
    for n in (64, 2):
        with pytest.raises(ValueError, match=r"activation is not in CUDA device memory"):
            warm.fork("mlp", 0, 1, stream=STREAM, activation=torch.zeros(n))
    assert fake.log("cuLaunchKernelEx") == [] and not warm.pending


def test_fork_activation_messages_name_the_activation(fake, warm):
    with pytest.raises(TypeError, match=r"^the activation is a object, not a tensor"):
        warm.fork("mlp", 0, 1, stream=STREAM, activation=object())
    with pytest.raises(ValueError, match=r"^the activation: typestr 'x' gives no item size"):
        warm.fork("mlp", 0, 1, stream=STREAM, activation=types.SimpleNamespace(
            __cuda_array_interface__={"shape": (4,), "typestr": "x", "data": (0x1000, False)}))


def test_fork_activation_driver_failure_is_the_drivers_error(fake, warm):
    """cuPointerGetAttribute failing for another reason than 'not device memory' (a
    sticky error, a context gone) is the driver's error, named, not a bad argument."""
    fake.fail("cuPointerGetAttribute", code="CUDA_ERROR_ILLEGAL_ADDRESS")
    with pytest.raises(l2prefetch.CudaError, match="cuPointerGetAttribute") as info:
        warm.fork("mlp", 0, 1, stream=STREAM,
                  activation=FakeArray(device_ptr(0, 9 * 65536), (64,)))
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in str(info.value)
    assert fake.log("cuLaunchKernelEx") == [] and not warm.pending


def test_fork_refuses_an_activation_without_storage(fake, warm):
    """Its range would start at address 0: the loader would fault on the GPU."""
    torch = pytest.importorskip("torch")
    activation = storageless((4, 64))
    assert activation.data_ptr() == 0
    with pytest.raises(ValueError, match=r"activation has no storage of its own .*"
                                         r"DTensor.to_local\(\)"):
        warm.fork("mlp", 0, 1, stream=STREAM, activation=activation)
    assert fake.log("cuLaunchKernelEx") == [] and not warm.pending


def test_prepared_ranges_refuse_a_weight_without_storage(fake):
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"weight 1 \(on cuda:0\) has no storage of its own"):
        PWR([arr(0), storageless((1024,))])


def _weight_in(storage, ptr, shape=(64,)):
    """A stand-in CUDA tensor at ``ptr`` whose untyped_storage() returns ``storage``."""
    torch = pytest.importorskip("torch")
    base = type(cuda_tensor(ptr, shape))

    class Weight(base):
        def untyped_storage(self):
            return storage() if callable(storage) else storage

    return torch.Tensor._make_subclass(Weight, torch.empty(shape, dtype=torch.float16,
                                                           device="meta"))


def test_prepared_ranges_keep_the_storage_of_each_weight_with_a_range(fake):
    """model.to(dtype) keeps each Parameter but swaps its storage: the table holds the old
    storage too, so its ranges never point at freed memory."""
    from conftest import FakeStorage
    made = []

    def storage():
        made.append(FakeStorage(device_ptr(0), 4096))
        return made[-1]

    w, past_cap = _weight_in(storage, device_ptr(0)), _weight_in(storage, device_ptr(0, 128))
    ranges = PWR([w, past_cap], byte_cap=128)
    assert ranges.ranges == ((device_ptr(0), 128),)
    kept = [weakref.ref(s) for s in made]
    made.clear()
    del w, past_cap
    gc.collect()
    assert kept[0]() is not None, "the storage of the weight with a range was let go"
    assert kept[1]() is None, "a weight past the cap gave no range, its storage need not stay"
    ranges.weights[0].untyped_storage = None   # what the weight says now does not matter
    del ranges
    gc.collect()
    assert kept[0]() is None, "the storage outlived the table"


@pytest.mark.parametrize("entry", ["compute_ranges", "PreparedWeightRanges"])
@pytest.mark.parametrize("where, size", [(16, 4096), (0, 64), (-64, 128)])
def test_a_weight_outside_its_own_storage_is_refused(fake, entry, where, size):
    from conftest import FakeStorage
    call = _C.compute_ranges if entry == "compute_ranges" else PWR
    w = _weight_in(FakeStorage(device_ptr(0, 4096 + where), size), device_ptr(0, 4096))
    words = r"weight 1 \(shape .*\): its 128 bytes at 0x\w+ lie outside its untyped_storage\(\) "
    with pytest.raises(ValueError, match=words + r"\(%d bytes at 0x" % size):
        call([arr(0), w])


@pytest.mark.parametrize("fails", ["untyped_storage()", "untyped_storage().data_ptr()",
                                   "untyped_storage().nbytes()"])
def test_a_storage_that_raises_names_the_weight(fake, fails):
    from conftest import FakeStorage

    class Storage(FakeStorage):
        def data_ptr(self):
            if fails.endswith("data_ptr()"):
                raise RuntimeError("no storage here")
            return super().data_ptr()

        def nbytes(self):
            if fails.endswith("nbytes()"):
                raise RuntimeError("no storage here")
            return super().nbytes()

    def storage():
        if fails == "untyped_storage()":
            raise RuntimeError("no storage here")
        return Storage(device_ptr(0, 4096), 128)

    with pytest.raises(RuntimeError, match="no storage here") as info:
        PWR([arr(0), _weight_in(storage, device_ptr(0, 4096))])
    assert any(f"while reading {fails} of weight 1" in n for n in info.value.__notes__)


def test_a_storage_size_that_is_no_int_is_refused(fake):
    from conftest import FakeStorage
    with pytest.raises(ValueError, match=r"weight 0: untyped_storage\(\).nbytes\(\) must be a "
                                         r"non-negative integer, got -5"):
        PWR([_weight_in(FakeStorage(device_ptr(0), -5), device_ptr(0))])


def test_fork_activation_that_swaps_the_table(fake, warm):
    """Reading the activation runs its Python code: a table registered meanwhile is the one
    launched, without the activation when it does not warm; a closed controller refuses."""
    class Swap(FakeArray):
        def __init__(self, then):
            super().__init__(device_ptr(0, 9 * 65536), (64,))
            self.then = then

        @property
        def __cuda_array_interface__(self):
            self.then()
            return super().__cuda_array_interface__

    assert warm.fork("mlp", 0, 1, stream=STREAM,
                     activation=Swap(lambda: warm.add("mlp", 0, 1, PWR([arr(3)]))))
    assert _table_of(fake.log("cuLaunchKernelEx")[-1]) == (1, 128, (device_ptr(0, 3 * 65536), 2048))
    warm.join(stream=STREAM)
    assert warm.stats()["mlp"]["bytes"] == 2048
    warm.add("mlp", 0, 1, PWR([arr(0)], warm_activation=True))
    with pytest.raises(l2prefetch.Error, match="closed"):
        warm.fork("mlp", 0, 1, stream=STREAM, activation=Swap(warm.close))


@pytest.mark.parametrize("mode", ["inline", "leaf"])
def test_fork_activation_in_a_capture(fake, mode):
    c = PC(device=0, graph_fork=mode, eager=False)
    c.add("mlp", 0, 1, PWR([arr(0)], warm_activation=True))
    fake.set_capture(7)
    fake.add_capture_node(0)
    fake.clear_log()
    act = arr(9, 512)
    assert c.fork("mlp", 0, 1, stream=STREAM, activation=act)
    launch, = fake.log("cuLaunchKernelEx")
    assert kv(launch)["stream"] == CUR
    assert _table_of(launch) == (2, 128 + 64, (act.ptr, 1024))
    c.join(stream=STREAM)


@pytest.mark.parametrize("where", ["before", "after"])
def test_attached_fork_passes_its_site_tensor(fake, where):
    """hooks.attach: an eager fork of a PrefetchController gets the hooked module's input
    (before) or output (after) as its activation; a CPU tensor there is not passed."""
    torch = pytest.importorskip("torch")
    from l2prefetch import hooks

    class Twice(torch.nn.Module):
        def forward(self, x, out):
            return out

    class OnStream(PC):   # torch here has no CUDA stream to default to
        def fork(self, point, layer, batch, stream=None, activation=None):
            return super().fork(point, layer, batch, stream=STREAM, activation=activation)

    model = Twice()
    c = OnStream(device=0)
    c.add("p", 0, 1, PWR([arr(0)], warm_activation=True))
    seen_in, seen_out = cuda_tensor(device_ptr(0, 9 * 65536), 64), \
        cuda_tensor(device_ptr(0, 10 * 65536), 64)
    with hooks.attach(model, c, {"p": [(model, 0, where)]}, batch_fn=lambda *a: 1,
                      join=False):
        fake.clear_log()
        model(seen_in, seen_out)
        expected = seen_in if where == "before" else seen_out
        assert _table_of(fake.log("cuLaunchKernelEx")[-1]) == (2, 128 + 8,
                                                              (expected.data_ptr(), 128))
        c.join(stream=STREAM)
        fake.clear_log()
        model(torch.zeros(64), torch.zeros(64))   # CPU tensors: the weights alone
        assert _table_of(fake.log("cuLaunchKernelEx")[-1])[0] == 1
    c.join(stream=STREAM)


# -- review of warm_activation: the hook's activation and fork's signature -------------------

def _attached_model(torch):
    class Twice(torch.nn.Module):
        def forward(self, x, out):
            return out
    return Twice()


def test_attached_fork_skips_an_activation_on_another_device(fake):
    """A pre-hook sees the module's input before any device move (accelerate moves a
    module's inputs inside its forward, after the pre-hooks): a tensor on another GPU
    there must not make the user's forward raise; the fork loads the weights alone."""
    torch = pytest.importorskip("torch")
    from l2prefetch import hooks

    reopen(fake, device_count=2)

    class OnStream(PC):
        def fork(self, point, layer, batch, stream=None, activation=None):
            return super().fork(point, layer, batch, stream=STREAM, activation=activation)

    model = _attached_model(torch)
    c = OnStream(device=0)
    c.add("p", 0, 1, PWR([arr(0)], warm_activation=True))
    elsewhere = cuda_tensor(device_ptr(1, 9 * 65536), 64, device=1)
    with hooks.attach(model, c, {"p": [(model, 0, "before")]}, batch_fn=lambda *a: 1,
                      join=False):
        fake.clear_log()
        model(elsewhere, elsewhere)   # raised ValueError: activation is on cuda:1
        assert _table_of(fake.log("cuLaunchKernelEx")[-1])[0] == 1
    c.join(stream=STREAM)


def test_attached_fork_of_a_module_whose_output_has_no_storage(fake):
    """A module whose output is a wrapper tensor (a DTensor under tensor parallelism):
    the hook passes no activation, and the fork loads the weights alone."""
    torch = pytest.importorskip("torch")
    from l2prefetch import hooks

    class OnStream(PC):
        def fork(self, point, layer, batch, stream=None, activation=None):
            return super().fork(point, layer, batch, stream=STREAM, activation=activation)

    class Out(torch.nn.Module):
        def forward(self, x):
            return storageless((4, 64))

    model = Out()
    c = OnStream(device=0)
    c.add("p", 0, 1, PWR([arr(0)], warm_activation=True))
    with hooks.attach(model, c, {"p": [(model, 0, "after")]}, batch_fn=lambda *a: 1,
                      join=False):
        fake.clear_log()
        model(torch.zeros(1))
        count, _, last = _table_of(fake.log("cuLaunchKernelEx")[-1])
    c.join(stream=STREAM)
    assert count == 1 and last[0] != 0


def test_ops_fork_run_eagerly_passes_its_tensor_as_the_hooks_do(fake):
    """Layer code's ops.fork(..., after=x) run eagerly (vLLM's enforce_eager) gives a
    warm table x as its activation, as an eager step was tuned; a tensor on another
    device, none."""
    torch = pytest.importorskip("torch")
    from l2prefetch import ops

    reopen(fake, device_count=2)

    class OnStream(PC):
        def fork(self, point, layer, batch, stream=None, activation=None):
            return super().fork(point, layer, batch, stream=STREAM, activation=activation)

    c = OnStream(device=0)
    c.add("p", 0, 1, PWR([arr(0)], warm_activation=True))
    handle = ops.register(c)
    try:
        x = cuda_tensor(device_ptr(0, 9 * 65536), 64)
        fake.clear_log()
        ops.fork(handle, "p", 0, 1, after=x)
        assert _table_of(fake.log("cuLaunchKernelEx")[-1])[0::2] == (2, (x.data_ptr(), 128))
        ops.fork(handle, "p", 0, 1, after=cuda_tensor(device_ptr(1, 9 * 65536), 64, device=1))
        ops.fork(handle, "p", 0, 1, after=torch.zeros(64))
        ops.fork(handle, "p", 0, 1)
        assert [_table_of(line)[0] for line in fake.log("cuLaunchKernelEx")[1:]] == [1, 1, 1]
        c.join(stream=STREAM)
    finally:
        ops.unregister(handle)


def test_attached_fork_of_a_subclass_with_the_protocols_fork(fake):
    """hooks.Controller's fork is fork(point, layer, batch): a PrefetchController subclass
    that overrides it so (as attach() always allowed) must keep working."""
    torch = pytest.importorskip("torch")
    from l2prefetch import hooks

    class Logged(PC):
        calls = []

        def fork(self, point, layer, batch):
            self.calls.append((point, layer, batch))
            return super().fork(point, layer, batch, stream=STREAM)

    model = _attached_model(torch)
    c = Logged(device=0)
    c.add("p", 0, 1, PWR([arr(0)], warm_activation=True))
    t = cuda_tensor(device_ptr(0, 9 * 65536), 64)
    with hooks.attach(model, c, {"p": [(model, 0, "after")]}, batch_fn=lambda *a: 1,
                      join=False):
        model(t, t)   # raised TypeError: fork() got an unexpected keyword 'activation'
    assert Logged.calls == [("p", 0, 1)]
    c.join(stream=STREAM)


def test_fork_signature_says_activation_is_keyword_only(fake):
    """fork takes at most 4 positional arguments: its __text_signature__ (inspect) and the
    stub must say activation is keyword-only."""
    import inspect

    c = PC(device=0)
    c.add("p", 0, 1, PWR([arr(0)], warm_activation=True))
    with pytest.raises(TypeError):
        c.fork("p", 0, 1, STREAM, arr(9, 64))
    params = inspect.signature(PC.fork).parameters
    assert params["activation"].kind is inspect.Parameter.KEYWORD_ONLY


def test_fork_reads_at_most_a_mib_of_the_activation(fake, warm):
    big = arr(9, 3 << 20)   # 6 MiB
    assert warm.fork("mlp", 0, 1, stream=STREAM, activation=big)
    assert _table_of(fake.log("cuLaunchKernelEx")[-1])[2] == (big.ptr, 1 << 20)
    warm.join(stream=STREAM)
    assert warm.stats()["mlp"]["bytes"] == 4096 + (1 << 20)


def test_eager_false_reads_no_activation_outside_a_capture(fake):
    """eager=False forks only while capturing: outside one the activation is not read
    (its Python code would cost every uncaptured step); inside one it is."""
    class Counted(FakeArray):
        reads = 0

        @property
        def __cuda_array_interface__(self):
            Counted.reads += 1
            return super().__cuda_array_interface__

    c = PC(device=0, eager=False)
    c.add("mlp", 0, 1, PWR([arr(0)], warm_activation=True))
    act = Counted(device_ptr(0, 9 * 65536), (64,))
    assert c.fork("mlp", 0, 1, stream=STREAM, activation=act) is False
    assert Counted.reads == 0 and fake.log("cuLaunchKernelEx") == []
    fake.set_capture(7)
    assert c.fork("mlp", 0, 1, stream=STREAM, activation=act) is True
    assert Counted.reads == 1
    assert _table_of(fake.log("cuLaunchKernelEx")[-1]) == (2, 128 + 8, (act.ptr, 128))
    c.join(stream=STREAM)
