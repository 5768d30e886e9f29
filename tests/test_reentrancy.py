"""Python code that runs inside our C calls (issue 16): hostile objects at every point.

Each test puts a hostile object where the C extension calls Python code — an
``__index__`` of a size, a ``__cuda_array_interface__`` property, a str subclass's
``__hash__``/``__eq__``, the iterator of ``batches``, a stream's ``cuda_stream`` /
``device`` property, torch's Python current-stream fallback, ``torch.cuda.ExternalStream``,
a ``device=`` object's attributes, a warning filter, the finalizer of a table that a
call releases, a collection started by an allocation — and makes that code change what
the call is working on: empty the dict being read, close the controller, replace its
tables, grow them, call it again, swap the module's driver or NVRTC, raise
KeyboardInterrupt.  Each asserts a clean exception or the correct result.  The memory
errors these used to cause (reads of freed dicts, tables and events) are caught by the
sanitizer pass of ./dev.sh test, which runs this file under AddressSanitizer with
PYTHONMALLOC=malloc.  The list of call points is csrc/DESIGN.md's ("Calls take effect at
one point").
"""

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

import l2prefetch
from l2prefetch import _C
from _fakecuda import FakeNvrtc, build_fakenvrtc
from conftest import FakeArray, Raising, device_ptr

PWR = l2prefetch.PreparedWeightRanges
PC = l2prefetch.PrefetchController
Error = l2prefetch.Error
STREAM = 0x5000
P0 = device_ptr(0)


# -- hostile objects -----------------------------------------------------------------------

class Once:
    """action() the first time it is called; how often it ran in .runs."""

    def __init__(self, action):
        self.action, self.runs = action, 0

    def __call__(self):
        self.runs += 1
        if self.runs == 1 and self.action is not None:
            self.action()


class Index:
    """An int-like (not an int) whose __index__ runs hook first."""

    def __init__(self, value, hook):
        self.value, self.hook = value, hook

    def __index__(self):
        self.hook()
        return self.value


class Interface:
    """A device array whose __cuda_array_interface__ is one dict kept here, so that a
    hook can empty it while the C code reads it; the dict holds the only reference to
    its shape and strides tuples."""

    def __init__(self, ptr, shape, typestr="<f2", strides=None):
        self.cai = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
                    "strides": None if strides is None else tuple(strides), "version": 3}

    @property
    def __cuda_array_interface__(self):
        return self.cai


class Stream:
    """A torch-like stream: its cuda_stream (and device) properties run hook first."""

    def __init__(self, hook=None, handle=STREAM, device_hook=None):
        self.hook, self.handle, self.device_hook = hook or (lambda: None), handle, device_hook

    @property
    def cuda_stream(self):
        self.hook()
        return self.handle

    @property
    def device(self):
        if self.device_hook:
            self.device_hook()
        raise AttributeError("device")   # says nothing of its device


class Weight(FakeArray):
    """A device array whose finalizer runs hook: released with the table holding it."""

    def __init__(self, ptr, n, hook):
        super().__init__(ptr, (n,))
        self.hook = hook

    def __del__(self):
        self.hook()


class Bomb:
    """Cyclic garbage whose finalizer runs hook at the next collection, wherever that
    starts (with gc thresholds of 1: at one of the next allocations of a container)."""

    def __init__(self, hook):
        self.hook, self.me = hook, self

    def __del__(self):
        self.hook()


def arm(hook):
    Bomb(hook)


@pytest.fixture
def eager_gc():
    """A collection at almost every container allocation, so an armed Bomb goes off
    inside the next C call that allocates."""
    gc.collect()
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.collect()


def arr(i=0, n=1024):
    return FakeArray(device_ptr(0, i * 65536), (n,))


def kv(line):
    return dict(tok.split("=", 1) for tok in line.split()[1:] if "=" in tok)


def assert_released(fake):
    gc.collect()
    assert (fake.live("stream"), fake.live("event"), fake.bad_destroys()) == (0, 0, 0)


@pytest.fixture
def table(fake):
    return PWR([arr(0), arr(1)])        # 4096 bytes


@pytest.fixture
def other(fake):
    return PWR([arr(2, 512)])           # 1024 bytes


@pytest.fixture
def ctl(fake, table):
    c = PC(device=0)
    c.add("attn", 0, [1, 2], table)
    assert c.fork("attn", 0, 1, stream=STREAM)
    c.join(stream=STREAM)
    c.reset_stats()
    fake.clear_log()
    return c


@pytest.fixture
def python_stream(monkeypatch):
    """torch's Python current-stream fallback forced; current_stream(device) returns
    what stream_factory() gives (a Stream by default)."""
    torch = pytest.importorskip("torch")
    holder = {"factory": lambda: Stream()}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: holder["factory"]())
    _C._set_stream_source("python")
    try:
        yield holder
    finally:
        _C._set_stream_source(None)


# -- compute_ranges and PreparedWeightRanges -----------------------------------------------

# 22 more dims of size 1: tuples longer than CPython's tuple free lists keep (20), so a
# freed one goes back to the allocator, where AddressSanitizer sees a read of it.
ONES = (1,) * 22


@pytest.mark.parametrize("where", ["shape", "strides"])
@pytest.mark.parametrize("entry", ["compute_ranges", "PreparedWeightRanges"])
def test_size_index_empties_the_interface_dict(fake, where, entry):
    w = Interface(P0, (4, 8) + ONES, "<f4", (32, 4) + ONES)
    hook = Once(lambda: w.cai.clear())
    if where == "shape":
        w.cai["shape"] = (4, Index(8, hook)) + ONES
    else:
        w.cai["strides"] = (Index(32, hook), 4) + ONES
    if entry == "compute_ranges":
        assert _C.compute_ranges([w]) == [(P0, 128)]
    else:
        assert PWR([w]).ranges == ((P0, 128),)
    assert hook.runs == 1 and w.cai == {}


def test_size_index_replaces_the_interface_dict_items(fake):
    w = Interface(P0, (4,), "<f4")
    w.cai["shape"] = (Index(4, lambda: w.cai.update(shape=(1,), typestr="<f8", data=(0, 0))),)
    assert _C.compute_ranges([w]) == [(P0, 16)]        # what was read first


def test_size_index_empties_the_weights_list(fake):
    weights = []
    w = Interface(P0, (Index(8, lambda: weights.clear()),), "<f2")
    weights += [w, arr(1, 8)]
    assert _C.compute_ranges(weights) == [(P0, 16), (device_ptr(0, 65536), 16)]
    assert weights == []


def test_tensor_like_whose_calls_drop_its_own_attributes(fake):
    class Tensor:
        def __init__(self):
            self.shape = [Index(8, self.strip), 2]
            self.dtype = "float16"
            self.device = type("D", (), {"type": "cuda", "index": 0, "__str__": lambda s: "cuda:0"})()

        def strip(self):
            self.shape.clear()
            del self.device

        def data_ptr(self):
            return P0

        def stride(self):
            return [2, 1]

        def element_size(self):
            return 2

    assert _C.compute_ranges([Tensor()]) == [(P0, 32)]


@pytest.mark.parametrize("entry", ["compute_ranges", "PreparedWeightRanges"])
def test_keyboard_interrupt_in_the_interface_passes_through(fake, entry):
    call = _C.compute_ranges if entry == "compute_ranges" else PWR
    with pytest.raises(KeyboardInterrupt):
        call([arr(0), Raising(KeyboardInterrupt())])
    with pytest.raises(KeyboardInterrupt):
        call([Interface(P0, (Index(8, Once(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))),))])


def test_an_error_in_the_interface_is_its_own_with_the_weight_named(fake):
    with pytest.raises(RuntimeError, match="boom") as info:
        _C.compute_ranges([arr(0), Raising(RuntimeError("boom"))])
    assert any("weight 1" in note for note in getattr(info.value, "__notes__", []))
    with pytest.raises(TypeError, match=r"weight 1 is a Raising, not a tensor") as info:
        _C.compute_ranges([arr(0), Raising(AttributeError("inner"))])
    assert isinstance(info.value.__cause__, AttributeError)


def test_size_index_swaps_the_driver(fake, monkeypatch):
    """The module's driver replaced while a table reads its weights: the table is made
    with what the module has afterwards (here: none loadable), never a freed one."""
    monkeypatch.setenv("L2PREFETCH_LIBCUDA", "/nonexistent/libcuda.so.1")
    w = Interface(P0, (Index(8, Once(lambda: _C._use_driver(None))),))
    with pytest.raises(l2prefetch.CudaUnavailableError):
        PWR([w])
    _C._use_driver(fake.path)
    assert PWR([w]).ranges == ((P0, 16),)


def test_device_argument_swaps_the_driver(fake):
    class Device:
        type = "cuda"

        @property
        def index(self):
            _C._use_driver(fake.path)      # a new instance; the old one may go
            gc.collect()
            return 0

    t = PWR([arr(0)], device=Device())
    assert t.device == 0 and t.launch(STREAM) is None


def test_finalizer_during_construction_swaps_the_driver(fake, eager_gc):
    hook = Once(lambda: _C._use_driver(fake.path))
    for _ in range(20):
        arm(hook)
        hook.runs = 0
        t = PWR([arr(0), arr(1)])
        assert t.ranges == ((P0, 2048), (device_ptr(0, 65536), 2048))
        t.launch(STREAM)


class Chain:
    """Cyclic garbage whose finalizer runs hook and leaves another Chain behind while
    ``on[0]``: with gc thresholds of 1, hook runs at every collection, so at every
    container allocation of a C call."""

    def __init__(self, hook, on):
        self.hook, self.on, self.me = hook, on, self

    def __del__(self):
        if self.on[0]:
            self.hook()
            Chain(self.hook, self.on)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_finalizer_during_construction_finds_no_half_built_object(fake, eager_gc):
    """A finalizer that runs at each collection mid-construction (the table's and the
    ranges' allocations) and walks gc.get_objects() meets only whole objects: the one
    being built is out of the collector's sight until its table, ranges and kernel are
    in place, and its ranges tuple is tracked only once filled.  Before, it found the
    object with half its ranges and no kernel (its launch failed), and a tuple with NULL
    slots (reading one crashed)."""
    n = 25   # a tuple this long is no free-list one: each pair's allocation can collect
    weights = [arr(i) for i in range(n)]
    keep = PWR([arr(n)])   # a whole one, for the finalizer to find
    seen, on, runs = [], [True], [0]

    def look():
        runs[0] += 1
        for o in gc.get_objects():
            if type(o) is PWR:
                try:
                    o.launch(STREAM)
                    launched = True
                except Exception:
                    launched = False
                seen.append((o, o.ranges, o.nbytes, launched))
            elif type(o) is tuple and len(o) == n:
                list(o)   # a NULL slot: a crash

    def construct(**kwargs):
        runs[0], on[0] = 0, True
        Chain(look, on)
        try:
            return PWR(weights, **kwargs)
        finally:
            on[0] = False

    # the collections before tp_alloc: the same call, refused by its kernel= after
    # the ranges are computed
    with pytest.raises(ValueError):
        construct(kernel="no such kernel")
    before = runs[0]
    t = construct()
    if runs[0] <= before:
        pytest.skip("no collection ran between this Python's allocation of the object and "
                    "its return (3.12+ collects at the eval breaker)")
    assert t.ranges == tuple((device_ptr(0, i * 65536), 2048) for i in range(n))
    assert t in gc.get_objects()   # tracked once whole
    assert sum(o is keep for o, *_ in seen) == runs[0] + before
    # Python 3.12+ may also collect between the return and the finally (the eval
    # breaker), where t is whole: what the finalizer met must be whole wherever it ran.
    assert all(r == t.ranges for o, r, *_ in seen if o is t)
    assert all(launched for *_, launched in seen)
    assert all(sum(b for _, b in r) == nbytes for _, r, nbytes, _ in seen)


@pytest.fixture(scope="module")
def fakenvrtc_path(tmp_path_factory):
    return build_fakenvrtc(str(tmp_path_factory.mktemp("fakenvrtc")))


@pytest.fixture
def fakenvrtc(fakenvrtc_path, monkeypatch, tmp_path):
    monkeypatch.setenv("L2PREFETCH_CACHE_DIR", str(tmp_path / "kcache"))
    nv = FakeNvrtc(fakenvrtc_path)
    nv.reset()
    _C._use_nvrtc(fakenvrtc_path)
    try:
        yield nv
    finally:
        nv.set_compile_delay(0)
        _C._use_nvrtc(None)


def test_warning_filter_swaps_nvrtc_during_a_compile(fakenvrtc):
    """NVRTC cannot build SASS for sm_103 (the stand-in's list): the PTX warning runs a
    showwarning that replaces the module's NVRTC; the compile keeps the one it began with."""
    def swap(*args, **kwargs):
        _C._use_nvrtc(fakenvrtc.path)
        gc.collect()

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        old, warnings.showwarning = warnings.showwarning, swap
        try:
            image, is_ptx = _C._kernel_image("ring", 103)
        finally:
            warnings.showwarning = old
    assert is_ptx and image.startswith(b"// fake ptx")


def test_options_changed_by_another_thread_during_a_compile(fakenvrtc):
    fakenvrtc.set_compile_delay(0.05)
    options = [f"-DX{i}=1" for i in range(50)]

    def meddle():
        # nvrtcCreateProgram comes after the options' copy, with the GIL released: wait
        # for it rather than for a fixed time (a descheduled main thread came later)
        while fakenvrtc.calls("nvrtcCreateProgram") == 0:
            time.sleep(0.001)
        options.clear()
        gc.collect()

    t = threading.Thread(target=meddle)
    t.start()
    image = _C._compile_source("__global__ void k() {}", options)
    t.join()
    assert b"-DX49=1" in image and options == []


class IterHook(list):
    """A list whose iteration (the C side's copy of it) runs hook first."""

    def __init__(self, items, hook):
        super().__init__(items)
        self.hook = hook

    def __iter__(self):
        self.hook()
        return super().__iter__()


@pytest.mark.parametrize("swap", ["fresh", "default"])
def test_options_iteration_swaps_nvrtc_before_a_compile(fakenvrtc, swap):
    """issue 21: copying the options runs their __iter__, which replaces the module's NVRTC
    and frees the instance the compile fetched; it used to take its reference only after
    the copy (heap-use-after-free under the sanitizer pass).  The compile keeps the NVRTC
    it began with."""
    def hook():
        if swap == "fresh":
            _C._use_nvrtc(fakenvrtc.path)   # a new instance; the fetched one is released
        else:
            _C._use_nvrtc(None)             # none until the next use
        gc.collect()

    options = IterHook([f"-DY{i}=1" for i in range(8)], Once(hook))
    image = _C._compile_source("__global__ void k() {}", options)
    assert options.hook.runs == 1
    assert image.startswith(b"\x7fELF") and b"fake cubin" in image and b"-DY7=1" in image
    assert fakenvrtc.live_programs() == 0 and fakenvrtc.bad_destroys() == 0


@pytest.mark.parametrize("call", ["driver_info", "nvrtc_info"])
def test_finalizer_swaps_the_instance_an_info_call_reads(fake, fakenvrtc, eager_gc, call):
    swap = {"driver_info": lambda: _C._use_driver(fake.path),
            "nvrtc_info": lambda: _C._use_nvrtc(fakenvrtc.path)}[call]
    for _ in range(20):
        arm(Once(swap))
        info = getattr(_C, call)()
        assert info["path"] in (fake.path, fakenvrtc.path)


@pytest.mark.parametrize("hook", ["_use_driver", "_use_nvrtc"])
def test_testing_hooks_with_paths_that_cannot_be_encoded(fake, fakenvrtc, hook):
    with pytest.raises(UnicodeEncodeError):
        getattr(_C, hook)("/tmp/\ud800")
    with pytest.raises(ValueError, match="null"):
        getattr(_C, hook)("/tmp/a\0b")
    assert _C.driver_info()["path"] == fake.path            # still the one in use
    assert _C.nvrtc_info()["path"] == fakenvrtc.path


# -- PrefetchController.add ---------------------------------------------------------------

def test_point_name_whose_hash_and_eq_close(fake, ctl, table):
    seen = []

    class Name(str):
        def __hash__(self):
            seen.append("hash")
            ctl.close()
            return 0

        def __eq__(self, other):
            seen.append("eq")
            ctl.close()
            return False

    ctl.add(Name("mlp"), 0, [1], table)
    assert seen == [] and not ctl.closed          # a copy as a plain str is kept
    assert type(ctl.points[1]) is str and ctl.points == ("attn", "mlp")
    assert ctl.fork(Name("mlp"), 0, 1, stream=STREAM) and seen == []


class Batches:
    """An iterable of batches whose iteration runs hook once, midway."""

    def __init__(self, values, hook):
        self.values, self.hook = values, hook

    def __iter__(self):
        for i, v in enumerate(self.values):
            if i == 1:
                self.hook()
            yield v


def test_batches_iteration_closes(fake, ctl, table):
    with pytest.raises(Error, match="closed"):
        ctl.add("mlp", 0, Batches([1, 2, 3], ctl.close), table)
    assert len(ctl) == 0 and ctl.keys() == []
    ctl.close()
    assert_released(fake)


def test_batches_iteration_grows_the_tables(fake, ctl, table, other):
    def grow():
        for layer in range(40):
            ctl.add(f"p{layer % 5}", layer, range(1, 20), other)

    ctl.add("attn", 3, Batches([1, 2, 3], grow), table)
    assert ctl.get("attn", 3, 2) is table and ctl.get("p4", 39, 19) is other
    assert len(ctl) == 2 + 3 + 40 * 19
    assert ctl.fork("attn", 3, 3, stream=STREAM) and ctl.fork("p0", 35, 1, stream=STREAM)
    ctl.join(stream=STREAM)
    assert fake.live("event") == 1 + 1 + 1 + 40      # join, (attn, 0), (attn, 3), 40 more


def test_batches_iteration_adds_the_same_point_and_layer(fake, ctl, table, other):
    ctl.add("mlp", 0, Batches([1, 2], lambda: ctl.add("mlp", 0, [2, 5], other)), table)
    assert [ctl.get("mlp", 0, b) for b in (1, 2, 5)] == [table, table, other]
    assert fake.live("event") == 3                   # join, (attn, 0), (mlp, 0): one each


def test_batches_iteration_forks_and_joins(fake, ctl, table):
    def use():
        assert ctl.fork("attn", 0, 1, stream=STREAM)
        ctl.join(stream=STREAM)

    ctl.add("attn", 0, Batches([1, 2, 7], use), table)
    assert ctl.stats()["attn"]["forks"] == 1 and ctl.get("attn", 0, 7) is table


@pytest.mark.parametrize("action", ["close", "add", "fork", "keys"])
def test_replaced_tables_finalizer_uses_the_controller(fake, ctl, other, action):
    """add() replaces a table whose last reference it holds: the weights' finalizer runs
    after the controller is consistent again, whatever it does there."""
    seen = []

    def hook():
        try:
            if action == "close":
                ctl.close()
            elif action == "add":
                ctl.add("late", 9, range(1, 30), other)
            elif action == "fork":
                seen.append(ctl.fork("attn", 0, 1, stream=STREAM))
            else:
                seen.append(sorted(ctl.keys()))
        except Error as exc:
            seen.append(exc)

    doomed = PWR([Weight(device_ptr(0, 4 << 20), 64, hook)])
    ctl.add("attn", 0, [1, 2], doomed)
    del doomed
    ctl.add("attn", 0, [1, 2], other)              # releases doomed and runs hook
    if action == "close":
        assert ctl.closed and len(ctl) == 0
    else:
        assert ctl.get("attn", 0, 1) is other
    if action == "add":
        assert ctl.get("late", 9, 29) is other
    if action == "fork":
        assert seen == [True]
    if action == "keys":
        assert seen == [[("attn", 0, 1), ("attn", 0, 2)]]
    ctl.close()
    assert_released(fake)


def test_closing_releases_tables_whose_finalizers_use_the_controller(fake, table):
    c = PC(device=0)
    seen = []

    def hook():
        for call in (lambda: c.fork("attn", 0, 1, stream=STREAM), lambda: c.add("x", 0, 1, table)):
            try:
                call()
            except Error as exc:
                seen.append(str(exc))

    doomed = PWR([Weight(P0, 64, hook)])
    c.add("attn", 0, [1], doomed)
    del doomed
    c.close()
    assert len(seen) == 2 and all("closed" in s for s in seen)
    del c
    assert_released(fake)


# -- fork and join: the stream argument and torch's current stream ---------------------------

def test_fork_stream_property_closes(fake, ctl):
    with pytest.raises(Error, match="closed"):
        ctl.fork("attn", 0, 1, stream=Stream(ctl.close))
    assert fake.log("cuLaunchKernelEx") == [] and not ctl.pending
    ctl.close()
    assert_released(fake)


def test_fork_stream_property_replaces_the_table(fake, ctl, other):
    assert ctl.fork("attn", 0, 1, stream=Stream(lambda: ctl.add("attn", 0, [1], other)))
    assert ctl.stats()["attn"] == {"forks": 1, "bytes": other.nbytes}   # the new one
    ctl.join(stream=STREAM)


def test_fork_stream_property_drops_the_last_reference_to_the_table(fake):
    c = PC(device=0)
    c.add("attn", 0, [1], PWR([Weight(P0, 64, lambda: None)]))
    replacement = PWR([arr(3)])
    assert c.fork("attn", 0, 1, stream=Stream(lambda: (c.add("attn", 0, [1], replacement),
                                                       gc.collect())))
    assert c.stats()["attn"]["bytes"] == replacement.nbytes
    c.join(stream=STREAM)


def test_fork_stream_property_grows_the_tables(fake, ctl, other):
    def grow():
        for layer in range(64):
            ctl.add(f"q{layer % 7}", layer, range(1, 9), other)

    assert ctl.fork("attn", 0, 2, stream=Stream(grow))
    assert ctl.stats()["attn"]["forks"] == 1 and len(ctl) == 2 + 64 * 8
    ctl.join(stream=STREAM)


def test_fork_stream_property_forks_and_joins_again(fake, ctl):
    inner = []

    def again():
        inner.append(ctl.fork("attn", 0, 2, stream=STREAM))
        ctl.join(stream=STREAM)

    assert ctl.fork("attn", 0, 1, stream=Stream(again))
    assert inner == [True] and ctl.stats()["attn"]["forks"] == 2 and ctl.pending
    ctl.join(stream=STREAM)
    names = [line.split()[0] for line in fake.log() if line.split()[0] in
             ("cuEventRecord", "cuStreamWaitEvent", "cuLaunchKernelEx")]
    fork, join = ["cuEventRecord", "cuStreamWaitEvent", "cuLaunchKernelEx"], \
        ["cuEventRecord", "cuStreamWaitEvent"]
    assert names == fork + join + fork + join      # the inner calls, then the outer fork


def test_fork_stream_property_raises_keyboard_interrupt(fake, ctl):
    def stop():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ctl.fork("attn", 0, 1, stream=Stream(stop))
    with pytest.raises(KeyboardInterrupt):
        ctl.fork("attn", 0, 1, stream=Stream(device_hook=stop))
    assert fake.log("cuLaunchKernelEx") == [] and not ctl.pending


def test_fork_stream_device_property_closes(fake, ctl):
    with pytest.raises(Error, match="closed"):
        ctl.fork("attn", 0, 1, stream=Stream(device_hook=ctl.close))
    assert fake.log("cuLaunchKernelEx") == []


def test_fork_stream_property_swaps_the_module_driver(fake, ctl, monkeypatch):
    monkeypatch.setenv("L2PREFETCH_LIBCUDA", "/nonexistent/libcuda.so.1")
    assert ctl.fork("attn", 0, 1, stream=Stream(lambda: (_C._use_driver(fake.path), gc.collect())))
    ctl.join(stream=STREAM)                       # the controller keeps its driver


def test_inline_capture_fork_stream_property_replaces_the_table(fake, ctl, other):
    fake.set_capture(7)
    x = fake.add_capture_node(0)
    assert ctl.fork("attn", 0, 1, stream=Stream(lambda: ctl.add("attn", 0, [1], other)))
    launch, = fake.log("cuLaunchKernelEx")
    assert kv(launch)["deps"] == f"[{x}:t1/p2]"          # after X, programmatically
    assert ctl.stats()["attn"]["bytes"] == other.nbytes and not ctl.pending


def test_branch_capture_fork_stream_property_closes(fake, table):
    c = PC(device=0, graph_fork="branch")
    c.add("attn", 0, [1], table)
    fake.set_capture(7)
    with pytest.raises(Error, match="closed"):
        c.fork("attn", 0, 1, stream=Stream(c.close))


@pytest.mark.parametrize("action", ["close", "replace", "raise", "keyboard_interrupt"])
def test_python_current_stream_fallback(fake, ctl, other, python_stream, action):
    def hook():
        if action == "close":
            ctl.close()
        elif action == "replace":
            ctl.add("attn", 0, [1], other)
        elif action == "raise":
            raise RuntimeError("no CUDA in this torch")
        else:
            raise KeyboardInterrupt

    python_stream["factory"] = lambda: Stream(hook)
    if action == "close":
        with pytest.raises(Error, match="closed"):
            ctl.fork("attn", 0, 1)
    elif action == "replace":
        assert ctl.fork("attn", 0, 1)
        assert ctl.stats()["attn"]["bytes"] == other.nbytes
        python_stream["factory"] = lambda: Stream()
        ctl.join()
        assert not ctl.pending
    else:
        with pytest.raises(RuntimeError if action == "raise" else KeyboardInterrupt):
            ctl.fork("attn", 0, 1)
        assert fake.log("cuLaunchKernelEx") == []


@pytest.mark.parametrize("action", ["close", "same_row", "raise", "keyboard_interrupt"])
def test_add_current_stream_lookup(fake, table, other, python_stream, action):
    """The (point, layer) event is recorded on torch's current stream, found through the
    Python fallback here: what that runs must not leave an event behind or made twice."""
    c = PC(device=0)
    events_before = fake.live("event")

    def hook():
        if action == "close":
            c.close()
        elif action == "same_row":
            c.add("attn", 0, [2], other)
        elif action == "raise":
            raise RuntimeError("Torch not compiled with CUDA enabled")
        else:
            raise KeyboardInterrupt

    python_stream["factory"] = lambda: Stream(hook, handle=0x6000)
    if action == "close":
        with pytest.raises(Error, match="closed"):
            c.add("attn", 0, [1], table)
        assert fake.live("event") == 0
    elif action == "same_row":
        c.add("attn", 0, [1], table)
        assert (c.get("attn", 0, 1), c.get("attn", 0, 2)) == (table, other)
        assert fake.live("event") == events_before + 1
    elif action == "raise":                           # an Exception: the legacy stream
        c.add("attn", 0, [1], table)
        assert kv(fake.log("cuEventRecord")[-1])["stream"] == "0x0"
    else:
        with pytest.raises(KeyboardInterrupt):
            c.add("attn", 0, [1], table)
        assert len(c) == 0 and fake.live("event") == events_before
    del c
    assert_released(fake)


def test_join_stream_property_joins_again(fake, ctl):
    assert ctl.fork("attn", 0, 1, stream=STREAM)
    fake.clear_log()
    assert ctl.join(stream=Stream(lambda: ctl.join(stream=STREAM))) is None
    assert len(fake.log("cuStreamWaitEvent")) == 1 and not ctl.pending


def test_join_stream_property_closes(fake, ctl):
    assert ctl.fork("attn", 0, 1, stream=STREAM)
    with pytest.raises(Error, match="closed"):
        ctl.join(stream=Stream(ctl.close))
    ctl.close()
    assert_released(fake)


@pytest.mark.parametrize("action", ["close", "again"])
def test_stream_getter_external_stream(fake, ctl, monkeypatch, action):
    torch = pytest.importorskip("torch")
    made = []

    def external(handle, device):
        if action == "close":
            ctl.close()
        elif not made:
            made.append("inner")
            inner = ctl.stream
            made.append(inner)
        obj = object()
        made.append(obj)
        return obj

    monkeypatch.setattr(torch.cuda, "ExternalStream", external)
    if action == "close":
        with pytest.raises(Error, match="closed"):
            ctl.stream
    else:
        outer = ctl.stream
        assert outer is made[1] and ctl.stream is outer      # the first one made is kept


# -- lookups, construction ------------------------------------------------------------------

@pytest.mark.parametrize("action", ["close", "add"])
@pytest.mark.parametrize("call", ["keys", "stats", "points", "repr", "len"])
def test_finalizer_during_a_lookup(fake, ctl, other, eager_gc, action, call):
    """A collection started by an allocation inside the call runs a finalizer that closes
    or grows the controller: the call answers from what it had read."""
    for i in range(10):
        hook = Once(ctl.close if action == "close" else
                    lambda i=i: ctl.add(f"g{i}", i, range(1, 40), other))
        arm(hook)
        result = {"keys": ctl.keys, "stats": ctl.stats, "points": lambda: ctl.points,
                  "repr": lambda: repr(ctl), "len": lambda: len(ctl)}[call]()
        assert result is not None
        if call == "keys":
            assert result in ([], sorted(result, key=lambda k: (ctl.points.index(k[0]), k[1], k[2])))


def test_init_reentered_from_its_device_argument(fake):
    c = PC.__new__(PC)
    seen = []

    class Device:
        type = "cuda"

        @property
        def index(self):
            for call in (lambda: c.__init__(0), c.close, lambda: c.fork("a", 0, 1, stream=STREAM)):
                try:
                    call()
                except Error as exc:
                    seen.append(str(exc))
            return 0

    c.__init__(device=Device())
    assert len(seen) == 3 and "being initialised" in seen[0] and "not initialised" in seen[1]
    assert c.device == 0 and not c.closed
    with pytest.raises(Error, match="initialised already"):
        c.__init__(device=1)


def test_init_failure_leaves_a_blank_controller(fake):
    c = PC.__new__(PC)
    fake.fail("cuEventCreate", code="CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(l2prefetch.CudaError):
        c.__init__(0)
    assert fake.live("stream") == 0 and repr(c) == "<PrefetchController not initialised>"
    with pytest.raises(Error, match="not initialised"):
        c.fork("a", 0, 1, stream=STREAM)
    c.__init__(0)                                  # a second try is allowed
    assert c.stream_handle and c.fork("a", 0, 1, stream=STREAM) is False
    del c
    assert_released(fake)


def test_subclass_arguments_are_its_own(fake, table):
    class Sub(PC):
        def __init__(self, name, device=None):
            super().__init__(device)
            self.name = name

    s = Sub(1)
    assert (s.name, s.device) == (1, 0)

    class Forgetful(PC):
        def __init__(self):
            pass

    f = Forgetful()
    with pytest.raises(Error, match=r"not initialised.*super\(\).__init__"):
        f.add("a", 0, 1, table)
    assert f.get("a", 0, 1) is None and f.keys() == [] and len(f) == 0


def test_launch_stream_property_swaps_the_module_driver(fake, table, monkeypatch):
    monkeypatch.setenv("L2PREFETCH_LIBCUDA", "/nonexistent/libcuda.so.1")
    table.launch(Stream(lambda: (_C._use_driver(None), gc.collect())))
    assert fake.log("cuLaunchKernelEx")


# A `site` without getsitepackages(), sysconfig.get_paths() replaced by one whose dict a gc
# callback empties when the next container (the list state.c builds of its paths) collects.
SITE_PACKAGES_UAF = textwrap.dedent("""
    import gc, site, sys, sysconfig
    from l2prefetch import _C

    shared, keep, state = {}, [], {"armed": False, "fired": False}

    def on_gc(phase, info):
        if phase == "start" and state["armed"]:
            state["armed"], state["fired"] = False, True
            shared.clear()       # the dict held the only reference to both strings

    def get_paths():
        shared["purelib"] = "/nonexistent/pure" + str(id(keep))   # new strings
        shared["platlib"] = "/nonexistent/plat" + str(id(shared))
        keep.append([[] for _ in range(100)])   # CPython's free list of lists emptied
        state["armed"] = True
        gc.set_threshold(1, 1, 1)   # the next new container (Py_BuildValue's list) collects
        return shared

    del site.getsitepackages          # an old virtualenv's site module
    sysconfig.get_paths = get_paths
    gc.callbacks.append(on_gc)
    gc.collect()
    gc.set_threshold(100000)
    try:
        _C._use_nvrtc("/nonexistent/libnvrtc.so.13")   # l2p_use_nvrtc -> site_dirs()
    except Exception as exc:
        assert type(exc).__name__ == "CudaUnavailableError", exc
    gc.set_threshold(700, 10, 10)
    assert state["fired"]
    print("ok")
""")


def test_site_packages_fallback_survives_a_finalizer_that_drops_the_paths():
    """state.c looks for NVRTC in site-packages; where `site` has no getsitepackages (an
    old virtualenv) it reads sysconfig.get_paths(), whose strings a collection started
    while the list of them is built may free: they are held first (a crash before)."""
    env = dict(os.environ, PYTHONMALLOC="debug")   # freed memory filled with 0xDD
    proc = subprocess.run([sys.executable, "-c", SITE_PACKAGES_UAF], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (
        proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
