"""PreparedWeightRanges against the recording driver stand-in (tests/fakecuda).

Covers the attributes, the exact cuLaunchKernelEx each table records (grid,
block, shared memory, stream, function by table capacity, launch attributes and
the parameter block itself), module sharing, weight retention, argument errors,
and a failure injected into every driver call on the construction and launch
paths (each must raise with the call's name and leak nothing).
"""

import ctypes
import gc
import threading
import weakref

import pytest

import l2prefetch
from l2prefetch import _C
from conftest import FakeArray, device_ptr

PWR = l2prefetch.PreparedWeightRanges
STREAM = 0x5000
# the default variant on sm_90 and its dynamic shared memory (the size is the kernel
# engineer's choice); above 48 KiB each function is opted in with cuFuncSetAttribute
RING_SMEM = l2prefetch.kernel_variants()["ring"]["smem"]
RING_OPTIN = RING_SMEM > 48 * 1024
LIVE_KINDS = ("stream", "event", "module", "context")


# -- helpers --------------------------------------------------------------------------

def arr(i=0, n=1024, device=0, typestr="<f2"):
    """A weight of n elements at the i-th 64 KiB slot of `device` (2 bytes each by default)."""
    return FakeArray(device_ptr(device, i * 65536), (n,), typestr)


def reopen(fake, **config):
    """Configure the stand-in and open it again: device count and driver version are read
    when the driver is opened (compute capability on first use of a device)."""
    fake.configure(**config)
    _C._use_driver(fake.path)


def kv(line):
    return dict(tok.split("=", 1) for tok in line.split()[1:] if "=" in tok)


def names(fake):
    return [line.split(" ", 1)[0] for line in fake.log()]


def one_launch(fake):
    lines = fake.log("cuLaunchKernelEx")
    assert len(lines) == 1, lines
    return kv(lines[0])


def param_table(fields, nranges):
    """The parameter block a launch passed: [count, granules, ptr0, n0, ...]."""
    params = int(fields["params"], 16)
    assert params != 0
    table = ctypes.c_void_p.from_address(params).value
    assert table
    return list((ctypes.c_uint64 * (2 + 2 * nranges)).from_address(table))


def assert_all_released(fake):
    """Drop the driver instance: every module and context must then be gone, once."""
    gc.collect()
    _C._use_driver(None)
    assert {k: fake.live(k) for k in LIVE_KINDS} == dict.fromkeys(LIVE_KINDS, 0)
    assert fake.bad_destroys() == 0


# -- attributes -------------------------------------------------------------------------

def test_attributes_default_ring_at_sm90(fake):
    ws = [arr(0), arr(1, 512), arr(2, 8, typestr="<f4")]
    t = PWR(ws)
    assert isinstance(t.weights, tuple) and len(t.weights) == 3
    assert all(a is b for a, b in zip(t.weights, ws))
    assert t.ranges == ((device_ptr(0), 2048), (device_ptr(0, 65536), 1024),
                        (device_ptr(0, 2 * 65536), 32))
    assert t.nbytes == 2048 + 1024 + 32
    assert (t.grid, t.block, t.smem) == (32, 32, RING_SMEM)
    assert (t.carveout, t.priority, t.launch_priority) == (None, False, None)
    assert (t.device, t.kernel) == (0, "ring")
    assert repr(t) == "<PreparedWeightRanges cuda:0 3 ranges, 3104 bytes, kernel=ring grid=32>"
    with pytest.raises(AttributeError):
        t.grid = 4


def test_attributes_default_load_at_sm86(fake):
    fake.configure(cc_major=8, cc_minor=6)
    t = PWR([arr(0)], grid=7)
    assert (t.kernel, t.grid, t.block, t.smem) == ("load", 7, 256, 0)
    t.launch(stream=STREAM)
    f = one_launch(fake)
    assert (f["grid"], f["block"], f["smem"], f["func"]) == ("7,1,1", "256,1,1", "0", "l2p_prefetch_8")
    # 'load' needs no opt-in shared memory: no cuFuncSetAttribute at all
    assert fake.calls("cuFuncSetAttribute") == 0


def test_byte_cap_caps_in_order(fake):
    t = PWR([arr(0), arr(1), arr(2)], byte_cap=3000)
    # 2048 fits; the rest of the cap (952) rounds down to 944; the walk stops there
    assert t.ranges == ((device_ptr(0), 2048), (device_ptr(0, 65536), 944))
    assert t.nbytes == 2992


def test_priority_and_carveout_attributes(fake):
    t = PWR([arr(0)], priority=True, carveout=100)
    assert (t.priority, t.launch_priority, t.carveout) == (True, -5, 100)
    t.launch(stream=STREAM)
    assert one_launch(fake)["attrs"] == "priority:-5,carveout:100"


@pytest.mark.parametrize("kwargs, attrs", [
    ({}, "none"),
    ({"priority": False, "carveout": None}, "none"),
    ({"priority": True}, "priority:-5"),
    ({"carveout": 0}, "carveout:0"),
    ({"carveout": 37}, "carveout:37"),
    ({"carveout": -1}, "carveout:4294967295"),  # CU_SHAREDMEM_CARVEOUT_DEFAULT as unsigned
])
def test_launch_attributes_only_when_asked(fake, kwargs, attrs):
    t = PWR([arr(0)], **kwargs)
    t.launch(stream=STREAM)
    assert one_launch(fake)["attrs"] == attrs


# -- the launch ----------------------------------------------------------------------------

def test_exact_launch(fake):
    t = PWR([arr(0), arr(1, 512)], grid=12)
    fake.clear_log()
    t.launch(stream=STREAM)
    # a fresh thread state: the context is made current, the stream's context checked
    assert names(fake) == ["cuCtxGetCurrent", "cuCtxSetCurrent", "cuStreamGetCtx",
                           "cuLaunchKernelEx"]
    line = fake.log("cuLaunchKernelEx")[0]
    f = kv(line)
    assert line.startswith(f"cuLaunchKernelEx grid=12,1,1 block=32,1,1 smem={RING_SMEM} "
                           f"stream={STREAM:#x} func=l2p_prefetch_8 attrs=none params=0x")
    assert line.endswith(f" extra=0x0 count=2 granules=192 last={device_ptr(0, 65536):#x}+1024")
    assert "->" not in line
    assert param_table(f, 2) == [2, (2048 + 1024) // 16, device_ptr(0), 2048,
                                 device_ptr(0, 65536), 1024]
    # again: the same configuration and parameter block, the context already current
    fake.clear_log()
    t.launch(STREAM)
    assert names(fake) == ["cuCtxGetCurrent", "cuStreamGetCtx", "cuLaunchKernelEx"]
    assert fake.log("cuLaunchKernelEx")[0] == line


@pytest.mark.parametrize("n, func", [(1, "l2p_prefetch_8"), (8, "l2p_prefetch_8"),
                                     (9, "l2p_prefetch_32"), (32, "l2p_prefetch_32"),
                                     (33, "l2p_prefetch_128"), (128, "l2p_prefetch_128")])
def test_function_by_table_capacity(fake, n, func):
    t = PWR([arr(i, 8 + i) for i in range(n)])
    assert len(t.ranges) == n
    t.launch(stream=STREAM)
    f = one_launch(fake)
    assert f["func"] == func
    words = param_table(f, n)
    assert words[0] == n
    assert words[1] == sum(2 * (8 + i) // 16 for i in range(n))
    assert words[2:] == [x for i in range(n) for x in (device_ptr(0, i * 65536), 2 * (8 + i))]


def test_more_than_max_ranges(fake):
    assert l2prefetch.MAX_RANGES == 128
    with pytest.raises(ValueError, match=r"129 ranges.*at most 128"):
        PWR([arr(i) for i in range(129)])
    # rejected before any device work
    assert fake.calls("cuModuleLoadData") == 0 and fake.live("context") == 0
    # a cap that leaves 128 ranges is fine
    assert len(PWR([arr(i, 8) for i in range(129)], byte_cap=128 * 16).ranges) == 128


def test_empty_weights_still_launch(fake):
    t = PWR([], device=0)
    assert (t.ranges, t.nbytes, t.weights, t.device) == ((), 0, (), 0)
    t.launch(stream=STREAM)
    f = one_launch(fake)
    assert (f["grid"], f["func"], f["stream"]) == ("32,1,1", "l2p_prefetch_8", hex(STREAM))
    assert param_table(f, 0) == [0, 0]
    # empty weights (no bytes) among others add no range and need no pointer lookup
    t2 = PWR([arr(0, 0), arr(1)])
    assert t2.ranges == ((device_ptr(0, 65536), 2048),)
    assert fake.calls("cuPointerGetAttribute") == 1


def test_launch_stream_forms(fake):
    t = PWR([arr(0)])

    class Stream:  # what torch.cuda.Stream offers: .cuda_stream (and .device)
        cuda_stream = 0x7000

    t.launch(stream=Stream())
    t.launch(0)  # the legacy default stream
    t.launch(STREAM)
    lines = fake.log("cuLaunchKernelEx")
    assert [kv(x)["stream"] for x in lines] == ["0x7000", "0x0", hex(STREAM)]
    # only a non-null int handle is checked through the driver (objects by their .device)
    assert [kv(x)["stream"] for x in fake.log("cuStreamGetCtx")] == [hex(STREAM)]


@pytest.mark.parametrize("stream, exc, match", [
    ("0x5000", TypeError, "stream must be None, an int .*, not str$"),
    (1.5, TypeError, "stream must be None, an int .*, not float$"),
    (object(), TypeError, "stream must be None, an int"),
    (-1, ValueError, "non-negative"),
    (2**64, ValueError, "non-negative"),
])
def test_launch_bad_stream(fake, stream, exc, match):
    t = PWR([arr(0)])
    with pytest.raises(exc, match=match):
        t.launch(stream=stream)
    assert fake.calls("cuLaunchKernelEx") == 0


def test_launch_bad_arguments(fake):
    t = PWR([arr(0)])
    with pytest.raises(TypeError, match="at most 1 positional argument"):
        t.launch(STREAM, STREAM)
    with pytest.raises(TypeError, match="unexpected keyword"):
        t.launch(strm=STREAM)
    assert fake.calls("cuLaunchKernelEx") == 0


def test_stream_object_on_another_device(fake):
    reopen(fake, device_count=2)
    t = PWR([arr(0)])

    class Dev:
        index = 1

        def __str__(self):
            return "cuda:1"

    class Stream:
        cuda_stream = STREAM
        device = Dev()

    with pytest.raises(ValueError, match="cuda:1 but the prefetch is for cuda:0"):
        t.launch(stream=Stream())
    assert fake.calls("cuLaunchKernelEx") == 0


def test_stream_of_another_device_context(fake):
    reopen(fake, device_count=2)
    t = PWR([arr(0)])
    other = l2prefetch.PrefetchController(device=1)  # owns a stream of cuda:1
    with pytest.raises(ValueError, match=rf"stream {other.stream_handle:#x} belongs to another "
                                         r"device's context; this table is for cuda:0"):
        t.launch(stream=other.stream_handle)
    assert fake.calls("cuLaunchKernelEx") == 0


def test_launch_with_another_context_current(fake):
    reopen(fake, device_count=2)
    t0 = PWR([arr(0)])
    t1 = PWR([arr(0, device=1)])
    assert t1.device == 1
    t1.launch(stream=0)  # makes cuda:1's context current on this thread
    with pytest.raises(RuntimeError, match="another CUDA context is current.*cuda:0"):
        t0.launch(stream=STREAM)
    assert fake.calls("cuLaunchKernelEx") == 1


# -- modules ---------------------------------------------------------------------------------

def test_module_loaded_once_per_device_and_variant(fake):
    reopen(fake, device_count=2)
    a = PWR([arr(0)])
    b = PWR([arr(i) for i in range(20)], grid=4, priority=True)
    c = PWR([], device=0)
    assert fake.calls("cuModuleLoadData") == 1
    assert [kv(x)["name"] for x in fake.log("cuModuleGetFunction")] == \
        ["l2p_prefetch_8", "l2p_prefetch_32", "l2p_prefetch_128"]
    # more than 48 KiB of dynamic shared memory: opted in once per function
    assert [(kv(x)["attrib"], kv(x)["value"]) for x in fake.log("cuFuncSetAttribute")] == \
        [("8", str(RING_SMEM))] * (3 if RING_OPTIN else 0)
    assert fake.log("cuModuleLoadData")[0].split()[2] == "format=cubin"
    d = PWR([arr(0)], kernel="load")
    assert fake.calls("cuModuleLoadData") == 2
    e = PWR([arr(0, device=1)])
    assert e.device == 1 and fake.calls("cuModuleLoadData") == 3
    assert fake.live("module") == 3 and fake.live("context") == 2
    for t in (a, b, c, d):
        t.launch(stream=STREAM)
    # cuda:1 from its own thread: this one has cuda:0's context current now
    worker = threading.Thread(target=e.launch, args=(0,))
    worker.start()
    worker.join()
    assert [kv(x)["func"] for x in fake.log("cuLaunchKernelEx")] == \
        ["l2p_prefetch_8", "l2p_prefetch_32", "l2p_prefetch_8", "l2p_prefetch_8", "l2p_prefetch_8"]
    assert not any("->" in x for x in fake.log("cuLaunchKernelEx"))
    # dropping the tables keeps the modules for the next ones; the driver instance owns them
    del a, b, c, d, e, t
    gc.collect()
    assert fake.live("module") == 3
    PWR([arr(3)])
    assert fake.calls("cuModuleLoadData") == 3
    assert_all_released(fake)


def test_all_variants_load(fake):
    for name, info in l2prefetch.kernel_variants().items():
        t = PWR([arr(0)], kernel=name)
        assert (t.kernel, t.block, t.smem) == (name, info["block"], info["smem"])
    assert fake.calls("cuModuleLoadData") == len(l2prefetch.kernel_variants())


# -- lifetime ------------------------------------------------------------------------------

def test_weights_are_retained(fake):
    a = arr(0)
    ref = weakref.ref(a)
    t = PWR([a])
    del a
    gc.collect()
    assert ref() is not None and t.weights[0] is ref()
    tref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None and tref() is None


def test_weights_sequence_is_copied(fake):
    ws = [arr(0)]
    t = PWR(ws)
    ws.append(arr(1))
    assert len(t.weights) == 1 and len(t.ranges) == 1


def test_cycle_through_weights_is_collected(fake):
    class Holder(FakeArray):
        pass

    h = Holder(device_ptr(0), (8,))
    h.table = PWR([h])  # weight -> table -> weight
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is None


# -- argument errors -------------------------------------------------------------------------

# Errors found after the device is prepared leave its context retained (once, by the
# driver instance, released with it); the others touch no device at all.
@pytest.mark.parametrize("kwargs, exc, match", [
    ({"grid": 0}, ValueError, r"grid must be in 1\.\.65535"),
    ({"grid": 65536}, ValueError, r"grid must be in 1\.\.65535"),
    ({"grid": -1}, ValueError, "grid"),
    ({"grid": 2**70}, ValueError, "grid"),
    ({"grid": 1.5}, TypeError, "grid must be an int, not float"),
    ({"grid": "32"}, TypeError, "grid must be an int, not str"),
    ({"grid": True}, TypeError, "grid must be an int, not bool"),
    ({"carveout": -2}, ValueError, "carveout"),
    ({"carveout": 101}, ValueError, "carveout"),
    ({"carveout": 50.0}, TypeError, "carveout"),
    ({"priority": 1}, TypeError, "priority must be a bool, not int"),
    ({"priority": None}, TypeError, "priority must be a bool, not NoneType"),
    ({"byte_cap": -1}, ValueError, "byte_cap"),
    ({"byte_cap": "1"}, TypeError, "byte_cap"),
    ({"kernel": "nope"}, ValueError, "unknown kernel variant 'nope'"),
    ({"kernel": 3}, TypeError, r"kernel must be a variant name \(str\) or None, not int"),
    ({"device": -1}, ValueError, "device must be >= 0"),
    ({"device": "cpu"}, ValueError, "device must be a CUDA device"),
    ({"device": 3}, ValueError, r"cuda:3 does not exist \(the driver sees 1 device\)"),
    ({"device": "cuda:3"}, ValueError, "cuda:3 does not exist"),
])
def test_bad_arguments(fake, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        PWR([], **kwargs)
    assert fake.live("module") == 0
    assert fake.live("context") == (1 if kwargs.get("kernel") == "nope" else 0)
    assert_all_released(fake)


def test_bad_argument_device_index_forms(fake):
    assert PWR([], device="cuda:0").device == 0
    assert PWR([], device="cuda").device == 0


@pytest.mark.parametrize("weights, exc, match", [
    (5, TypeError, "weights must be a sequence"),
    ("abc", TypeError, "weights must be a sequence"),
    (FakeArray(device_ptr(0), (8,)), TypeError, "wrap it"),
    ([object()], TypeError, "weight 0 is a object, not a tensor"),
])
def test_bad_weights_type(fake, weights, exc, match):
    with pytest.raises(exc, match=match):
        PWR(weights)


def test_cpu_tensor_rejected(fake):
    torch = pytest.importorskip("torch")
    w = torch.zeros(64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"weight 1 is on cpu.*CUDA"):
        PWR([arr(0), w])
    assert fake.live("context") == 0 and fake.calls("cuModuleLoadData") == 0


def test_weights_on_two_devices(fake):
    reopen(fake, device_count=2)
    with pytest.raises(ValueError, match=r"different devices: weight 0 on cuda:0, weight 2 on cuda:1"):
        PWR([arr(0), arr(1), arr(0, device=1)])
    assert fake.live("context") == 0


def test_device_argument_must_match_weights(fake):
    reopen(fake, device_count=2)
    with pytest.raises(ValueError, match=r"device=cuda:1 but the weights are on cuda:0"):
        PWR([arr(0)], device=1)
    assert PWR([arr(0, device=1)], device=1).device == 1


@pytest.mark.parametrize("ptr", [0x1000, device_ptr(5)])
def test_unknown_address(fake, ptr):
    with pytest.raises(ValueError, match=rf"weight 0 \(__cuda_array_interface__ at {ptr:#x}\) is not "
                                         r"CUDA device memory.*CUDA_ERROR_INVALID_VALUE"):
        PWR([FakeArray(ptr, (8,))])
    assert fake.live("context") == 0


def test_misaligned(fake):
    with pytest.raises(ValueError, match="16-byte aligned.*weight 1.*8 bytes past"):
        PWR([arr(0), FakeArray(device_ptr(0, 65536 + 8), (8,))])
    assert fake.calls("cuPointerGetAttribute") == 0


def test_ring_needs_sm90(fake):
    fake.configure(cc_major=8, cc_minor=6)
    with pytest.raises(ValueError, match=r"'ring' needs sm_90 or newer; cuda:0 is sm_86"):
        PWR([arr(0)], kernel="ring")
    assert fake.calls("cuModuleLoadData") == 0
    assert PWR([arr(0)], kernel="line_prefetch").kernel == "line_prefetch"


def test_old_compute_capability(fake):
    # ValueError, as for a kernel variant the device is too old for (the same check)
    fake.configure(cc_major=7, cc_minor=5)
    with pytest.raises(ValueError, match=r"'load' needs sm_80 or newer; cuda:0 is sm_75 "
                                         r"\(l2prefetch needs compute capability 8\.0 or newer\)"):
        PWR([arr(0)])
    assert fake.calls("cuModuleLoadData") == 0


def test_variant_needing_more_shared_memory_than_the_device_has(fake):
    fake.set_attribute(97, RING_SMEM - 1024)  # max opt-in shared memory per block
    with pytest.raises(ValueError, match=rf"'ring' needs {RING_SMEM} bytes.*allows {RING_SMEM - 1024}"):
        PWR([arr(0)])
    assert fake.calls("cuModuleLoadData") == 0


def test_carveout_needs_driver_12_4(fake):
    reopen(fake, driver_version=12030)
    with pytest.raises(ValueError, match=r"carveout needs a CUDA 12\.4 driver.*12\.3"):
        PWR([arr(0)], carveout=50)
    t = PWR([arr(0)], priority=True)  # everything else works on 12.3
    t.launch(stream=STREAM)
    assert one_launch(fake)["attrs"] == "priority:-5"


# -- injected driver failures ----------------------------------------------------------------

# (entry point, nth call to fail, whether the device (its retained context) survives)
CONSTRUCTION_FAULTS = [
    ("cuDeviceGet", 1, False),
    ("cuDeviceGetAttribute", 1, False),
    ("cuDeviceGetAttribute", 5, False),
    ("cuDevicePrimaryCtxRetain", 1, False),
    ("cuCtxPushCurrent", 1, False),            # device preparation
    ("cuCtxGetStreamPriorityRange", 1, False),
    ("cuCtxPopCurrent", 1, False),
    ("cuCtxPushCurrent", 2, True),             # module load
    ("cuModuleLoadData", 1, True),
    ("cuModuleGetFunction", 1, True),
    ("cuModuleGetFunction", 3, True),
    ("cuFuncSetAttribute", 1, True),
    ("cuFuncSetAttribute", 3, True),
    ("cuCtxPopCurrent", 2, True),
]


@pytest.mark.parametrize("name, nth, device_kept", CONSTRUCTION_FAULTS,
                         ids=[f"{n}-{k}" for n, k, _ in CONSTRUCTION_FAULTS])
def test_construction_fault(fake, name, nth, device_kept):
    if name == "cuFuncSetAttribute" and not RING_OPTIN:
        pytest.skip("the default variant needs no shared-memory opt-in")
    fake.fail(name, nth=nth, code="CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(l2prefetch.CudaError) as info:
        PWR([arr(0)])
    e = info.value
    assert isinstance(e, l2prefetch.Error) and isinstance(e, RuntimeError)
    assert e.name == "CUDA_ERROR_OUT_OF_MEMORY" and e.code == 2
    assert name in e.operation
    assert name in str(e) and "CUDA_ERROR_OUT_OF_MEMORY" in str(e) and "out of memory" in str(e)
    assert fake.log(name)[nth - 1].endswith("-> CUDA_ERROR_OUT_OF_MEMORY")
    gc.collect()
    assert fake.live("module") == 0
    assert fake.live("context") == (1 if device_kept else 0)
    assert fake.bad_destroys() == 0
    # a retry succeeds and launches, loading the module once and retaining the context once
    t = PWR([arr(0)])
    t.launch(stream=STREAM)
    assert one_launch(fake)["func"] == "l2p_prefetch_8"
    assert fake.live("module") == 1 and fake.live("context") == 1
    del t
    assert_all_released(fake)


def test_device_info_names_the_failed_call(fake):
    fake.fail("cuCtxGetStreamPriorityRange", code="CUDA_ERROR_INVALID_CONTEXT")
    with pytest.raises(l2prefetch.CudaError) as info:
        _C.device_info(0)
    assert info.value.operation == "cuCtxGetStreamPriorityRange (preparing cuda:0)"
    assert _C.device_info(0)["greatest_priority"] == -5


def test_device_setup_fails_alike_everywhere(fake):
    """device_info, PreparedWeightRanges and PrefetchController turn a device that
    cannot be set up into the same exception: ValueError for one the driver does
    not have, CudaError naming the call for a failed one."""
    calls = (lambda: _C.device_info(3), lambda: PWR([], device=3),
             lambda: l2prefetch.PrefetchController(device=3))
    for call in calls:
        with pytest.raises(ValueError, match=r"^cuda:3 does not exist \(the driver sees 1 device\)$"):
            call()
    for call in (lambda: _C.device_info(0), lambda: PWR([], device=0),
                 lambda: l2prefetch.PrefetchController(device=0)):
        fake.fail("cuDeviceGetAttribute", code="CUDA_ERROR_NOT_INITIALIZED")
        with pytest.raises(l2prefetch.CudaError) as info:
            call()
        assert info.value.operation == "cuDeviceGetAttribute (preparing cuda:0)"
        assert info.value.name == "CUDA_ERROR_NOT_INITIALIZED"


def test_pointer_lookup_fault(fake):
    fake.fail("cuPointerGetAttribute", code="CUDA_ERROR_NOT_INITIALIZED")
    with pytest.raises(ValueError, match=rf"weight 0 .*{device_ptr(0):#x}.*"
                                         r"cuPointerGetAttribute failed: CUDA_ERROR_NOT_INITIALIZED"):
        PWR([arr(0)])
    assert fake.live("context") == 0 and fake.live("module") == 0
    assert len(PWR([arr(0)]).ranges) == 1
    assert_all_released(fake)


# (entry point, nth call to fail, what the operation says)
LAUNCH_FAULTS = [
    ("cuLaunchKernelEx", 1, "cuLaunchKernelEx"),
    ("cuStreamGetCtx", 1, "cuStreamGetCtx"),
    ("cuCtxGetCurrent", 1, "cuCtxGetCurrent"),
    ("cuCtxSetCurrent", 1, "cuCtxSetCurrent"),
]


@pytest.mark.parametrize("name, nth, op", LAUNCH_FAULTS, ids=[f[0] for f in LAUNCH_FAULTS])
def test_launch_fault(fake, name, nth, op):
    t = PWR([arr(0)])
    fake.fail(name, nth=nth, code="CUDA_ERROR_LAUNCH_FAILED")
    with pytest.raises(l2prefetch.CudaError) as info:
        t.launch(stream=STREAM)
    e = info.value
    assert e.name == "CUDA_ERROR_LAUNCH_FAILED" and e.code == 719
    assert op in e.operation and op in str(e) and "CUDA_ERROR_LAUNCH_FAILED" in str(e)
    # the table is still usable
    t.launch(stream=STREAM)
    lines = fake.log("cuLaunchKernelEx")
    assert not lines[-1].endswith("CUDA_ERROR_LAUNCH_FAILED")
    assert kv(lines[-1])["stream"] == hex(STREAM)
    del t
    assert_all_released(fake)
