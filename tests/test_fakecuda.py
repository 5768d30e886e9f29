"""Self-tests of the fake CUDA driver, through ctypes and cuGetProcAddress_v2 only."""

import ctypes
import os
import re
import shutil
import subprocess
import threading
from ctypes import byref, c_char_p, c_int, c_size_t, c_ulonglong, c_void_p

import pytest

from _fakecuda import (ENTRY_POINTS, ERRORS, SOURCE, CUlaunchAttribute, CUlaunchConfig,
                       FakeCuda, build_fakecuda)

NOT_INIT, INVALID_VALUE, INVALID_DEVICE = 3, 1, 101
INVALID_CONTEXT, INVALID_HANDLE, NOT_FOUND = 201, 400, 500


@pytest.fixture(scope="session")
def fake_path(tmp_path_factory):
    return build_fakecuda(tmp_path_factory.mktemp("fakecuda"))


@pytest.fixture
def fake(fake_path):
    f = FakeCuda(fake_path)
    f.reset()
    yield f
    f.reset()


class Driver:
    """Entry points resolved lazily through cuGetProcAddress_v2: drv.cuInit(0)."""

    def __init__(self, fake):
        self._fake = fake

    def __getattr__(self, name):
        fn = self._fake.fn(name)
        setattr(self, name, fn)
        return fn


@pytest.fixture
def drv(fake):
    return Driver(fake)


@pytest.fixture
def ctx(fake, drv):
    """Initialized driver with device 0's primary context current."""
    assert drv.cuInit(0) == 0
    c = c_void_p()
    assert drv.cuDevicePrimaryCtxRetain(byref(c), 0) == 0
    assert drv.cuCtxSetCurrent(c) == 0
    return c.value


def make(drv, creator, *args):
    h = c_void_p()
    rc = getattr(drv, creator)(byref(h), *args)
    return rc, h.value


def load_function(drv, name=b"prefetch_kernel"):
    rc, mod = make(drv, "cuModuleLoadData", b"// ptx\n.version 8.0\n")
    assert rc == 0
    rc, fn = make(drv, "cuModuleGetFunction", c_void_p(mod), name)
    assert rc == 0
    return mod, fn


def launch(drv, fn, grid=(1, 1, 1), block=(128, 1, 1), smem=0, stream=None, attrs=(), params=None):
    arr = (CUlaunchAttribute * max(1, len(attrs)))()
    for i, (aid, val) in enumerate(attrs):
        arr[i].id = aid
        if aid == 8:
            arr[i].value.priority = val
        else:
            arr[i].value.sharedMemCarveout = val
    cfg = CUlaunchConfig(*grid, *block, smem, stream, arr if attrs else None, len(attrs))
    return drv.cuLaunchKernelEx(byref(cfg), c_void_p(fn), params, None)


# -- building -------------------------------------------------------------------------

def test_build_is_cached_and_warning_free(tmp_path):
    path = build_fakecuda(tmp_path)
    # a known mtime, newer than the source (so up to date), that a rebuild would replace
    stamp = os.stat(path).st_mtime_ns + 10**12
    os.utime(path, ns=(stamp, stamp))
    first = os.stat(path).st_mtime_ns
    assert build_fakecuda(tmp_path) == path and os.stat(path).st_mtime_ns == first
    os.utime(path, ns=(0, 0))  # older than the source: rebuilt
    build_fakecuda(tmp_path)
    assert os.stat(path).st_mtime_ns > 0
    cc = shutil.which(os.environ.get("CC", "cc"))
    proc = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-std=c11", "-Wall", "-Wextra",
                           "-Werror", "-pthread", "-o", str(tmp_path / "strict.so"), str(SOURCE)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_exports_only_driver_and_control_names(fake_path):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not available")
    out = subprocess.run([nm, "-D", "--defined-only", fake_path], capture_output=True,
                         text=True, check=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.split()[-2] in "TtDdBb"}
    assert set(ENTRY_POINTS) <= names
    assert {"cuGetProcAddress_v2", "fake_reset", "fake_log"} <= names
    assert all(n.startswith(("cu", "fake_")) for n in names if not n.startswith("_")), names


def test_plain_symbols_are_the_same_functions(fake, fake_path):
    lib = ctypes.CDLL(fake_path)
    for name in ENTRY_POINTS:
        rc, addr, status = fake.get_proc(name)
        assert (rc, status) == (0, 0), name
        expect = "cuGetProcAddress_v2" if name == "cuGetProcAddress" else name
        assert addr == ctypes.cast(getattr(lib, expect), c_void_p).value, name


# -- cuGetProcAddress ---------------------------------------------------------------------

def test_get_proc_address_unknown_and_versions(fake):
    assert fake.get_proc("cuNoSuchThing", 12000) == (NOT_FOUND, None, 1)
    fake.configure(driver_version=12040)
    assert fake.get_proc("cuEventRecord", 12050) == (NOT_FOUND, None, 2)  # newer than the driver
    assert fake.get_proc("cuEventRecord", 12040)[0] == 0
    assert fake.get_proc("cuStreamGetCaptureInfo", 12000)[:2] == (NOT_FOUND, None)  # older ABI
    assert fake.get_proc("cuLaunchKernelEx", 11060)[0] == 0
    assert fake.calls("cuGetProcAddress_v2") == 5
    assert fake.log()[0] == "cuGetProcAddress_v2 symbol=cuNoSuchThing version=12000 flags=0x0 -> CUDA_ERROR_NOT_FOUND"


def test_get_proc_address_is_injectable(fake):
    fake.fail("cuGetProcAddress_v2", 2, "CUDA_ERROR_UNKNOWN")
    assert fake.get_proc("cuInit")[0] == 0
    assert fake.get_proc("cuInit") == (999, None, -1)  # out-pointers untouched
    assert fake.get_proc("cuInit")[0] == 0


# -- init, devices, errors -------------------------------------------------------------

def test_calls_before_init_fail_not_initialized(fake, drv):
    n = c_int()
    assert drv.cuDeviceGetCount(byref(n)) == NOT_INIT
    assert drv.cuDriverGetVersion(byref(n)) == 0 and n.value == 13000
    s = c_char_p()
    assert drv.cuGetErrorName(3, byref(s)) == 0 and s.value == b"CUDA_ERROR_NOT_INITIALIZED"
    assert fake.log("cuDeviceGetCount") == ["cuDeviceGetCount -> CUDA_ERROR_NOT_INITIALIZED"]
    assert drv.cuInit(0) == 0
    assert drv.cuDeviceGetCount(byref(n)) == 0 and n.value == 1


def test_uninitialized_error(fake, drv):
    fake.set_uninitialized_error("CUDA_ERROR_NO_DEVICE")
    assert drv.cuInit(0) == 100
    n = c_int()
    assert drv.cuDeviceGetCount(byref(n)) == NOT_INIT
    fake.set_uninitialized_error(0)
    assert drv.cuInit(0) == 0


def test_device_attributes(fake, drv):
    fake.configure(device_count=2, cc_major=8, cc_minor=6, driver_version=12080)
    assert drv.cuInit(0) == 0
    d, v = c_int(), c_int()
    assert drv.cuDeviceGet(byref(d), 1) == 0 and d.value == 1
    assert drv.cuDeviceGet(byref(d), 2) == INVALID_DEVICE
    expect = {75: 8, 76: 6, 16: 132, 38: 62914560, 97: 232448, 1: 0}
    for attrib, value in expect.items():
        assert drv.cuDeviceGetAttribute(byref(v), attrib, 1) == 0 and v.value == value
    assert drv.cuDeviceGetAttribute(byref(v), 75, 2) == INVALID_DEVICE
    fake.set_attribute(38, 40 << 20)
    assert drv.cuDeviceGetAttribute(byref(v), 38, 0) == 0 and v.value == 40 << 20
    assert "cuDeviceGetAttribute attrib=38 dev=0 value=41943040" in fake.log()


@pytest.mark.parametrize("code,name", [(c, n) for n, c in ERRORS.items()])
def test_error_names(drv, code, name):
    s = c_char_p()
    assert drv.cuGetErrorName(code, byref(s)) == 0 and s.value.decode() == name
    assert drv.cuGetErrorString(code, byref(s)) == 0 and s.value and s.value.decode() != name


def test_unknown_error_code(drv):
    s = c_char_p(b"sentinel")
    assert drv.cuGetErrorName(12345, byref(s)) == INVALID_VALUE and s.value is None
    s = c_char_p(b"sentinel")
    assert drv.cuGetErrorString(-1, byref(s)) == INVALID_VALUE and s.value is None


# -- contexts ---------------------------------------------------------------------------

def test_primary_contexts_and_stack(fake, drv):
    fake.configure(device_count=2)
    assert drv.cuInit(0) == 0
    rc, c0 = make(drv, "cuDevicePrimaryCtxRetain", 0)
    rc1, c1 = make(drv, "cuDevicePrimaryCtxRetain", 1)
    assert rc == rc1 == 0 and c0 and c1 and c0 != c1
    assert make(drv, "cuDevicePrimaryCtxRetain", 0)[1] == c0  # fixed per device
    assert fake.live("context") == 3
    assert make(drv, "cuCtxGetCurrent")[1] is None
    d = c_int()
    assert drv.cuCtxGetDevice(byref(d)) == INVALID_CONTEXT
    assert drv.cuCtxSetCurrent(c_void_p(c0)) == 0
    assert drv.cuCtxPushCurrent(c_void_p(c1)) == 0
    assert drv.cuCtxGetDevice(byref(d)) == 0 and d.value == 1
    assert make(drv, "cuCtxPopCurrent") == (0, c1)
    assert make(drv, "cuCtxGetCurrent") == (0, c0)
    assert drv.cuCtxPopCurrent(None) == 0
    assert drv.cuCtxPopCurrent(None) == INVALID_CONTEXT
    assert drv.cuCtxSetCurrent(c_void_p(0x1234)) == INVALID_CONTEXT
    lo, hi = c_int(9), c_int(9)
    assert drv.cuCtxGetStreamPriorityRange(byref(lo), byref(hi)) == 0 and (lo.value, hi.value) == (0, -5)
    for dev in (0, 0, 1):
        assert drv.cuDevicePrimaryCtxRelease(dev) == 0
    assert fake.live("context") == 0 and fake.bad_destroys() == 0
    assert drv.cuDevicePrimaryCtxRelease(1) == INVALID_HANDLE and fake.bad_destroys() == 1
    assert drv.cuCtxSetCurrent(c_void_p(c0)) == INVALID_CONTEXT  # released: gone


def test_context_stack_is_per_thread(fake, drv, ctx):
    seen = []
    t = threading.Thread(target=lambda: seen.append(make(drv, "cuCtxGetCurrent")))
    t.start()
    t.join()
    assert seen == [(0, None)]
    assert make(drv, "cuCtxGetCurrent") == (0, ctx)


# -- events and streams -----------------------------------------------------------------

def test_event_create_destroy_counting(fake, drv, ctx):
    events = [make(drv, "cuEventCreate", 2) for _ in range(3)]
    assert all(rc == 0 for rc, _ in events)
    handles = [h for _, h in events]
    assert len(set(handles)) == 3 and all(handles)
    assert fake.live("event") == 3 and fake.calls("cuEventCreate") == 3
    for h in handles:
        assert drv.cuEventDestroy(c_void_p(h)) == 0
    assert fake.live("event") == 0 and fake.bad_destroys() == 0
    assert drv.cuEventDestroy(c_void_p(handles[0])) == INVALID_HANDLE  # double free
    assert drv.cuEventDestroy(c_void_p(0xdead0)) == INVALID_HANDLE  # never created
    assert fake.bad_destroys() == 2
    assert fake.log("cuEventCreate")[0] == f"cuEventCreate flags=0x2 event={handles[0]:#x}"
    assert fake.log("cuEventDestroy")[-1] == "cuEventDestroy event=0xdead0 -> CUDA_ERROR_INVALID_HANDLE"


def test_injected_failure_on_second_call(fake, drv, ctx):
    fake.fail("cuEventCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
    assert make(drv, "cuEventCreate", 0)[0] == 0
    h = c_void_p(0x77)
    assert drv.cuEventCreate(byref(h), 0) == 2 and h.value == 0x77  # untouched
    assert make(drv, "cuEventCreate", 0)[0] == 0  # once only
    assert fake.calls("cuEventCreate") == 3 and fake.live("event") == 2
    assert fake.log("cuEventCreate")[1] == "cuEventCreate flags=0x0 -> CUDA_ERROR_OUT_OF_MEMORY"


def test_several_pending_failures(fake, drv, ctx):
    fake.fail("cuStreamSynchronize", 1, 719)
    fake.fail("cuStreamSynchronize", 3, 700)
    fake.fail("cuEventRecord", 1, 12345)
    rcs = [drv.cuStreamSynchronize(None) for _ in range(4)]
    assert rcs == [719, 0, 700, 0]
    assert drv.cuEventRecord(c_void_p(0x10), None) == 12345
    assert fake.log("cuEventRecord")[0].endswith(" -> CUDA_ERROR_12345")
    with pytest.raises(ValueError):
        fake.fail("cuNoSuchThing", 1, 1)
    with pytest.raises(ValueError):
        fake.fail("cuInit", 0, 1)


def test_injected_failure_precedes_init_check(fake, drv):
    fake.fail("cuDeviceGetCount", 1, 999)
    n = c_int()
    assert drv.cuDeviceGetCount(byref(n)) == 999
    assert drv.cuDeviceGetCount(byref(n)) == NOT_INIT


def test_stream_lifecycle_and_ctx(fake, drv):
    fake.configure(device_count=2)
    assert drv.cuInit(0) == 0
    assert make(drv, "cuStreamCreateWithPriority", 1, -5)[0] == INVALID_CONTEXT  # no context
    rc, c1 = make(drv, "cuDevicePrimaryCtxRetain", 1)
    rc, c0 = make(drv, "cuDevicePrimaryCtxRetain", 0)
    assert drv.cuCtxSetCurrent(c_void_p(c1)) == 0
    rc, s = make(drv, "cuStreamCreateWithPriority", 1, -5)
    assert rc == 0 and s
    assert fake.log("cuStreamCreateWithPriority")[-1] == f"cuStreamCreateWithPriority flags=0x1 priority=-5 stream={s:#x}"
    assert drv.cuCtxSetCurrent(c_void_p(c0)) == 0
    out = c_void_p()
    assert drv.cuStreamGetCtx(c_void_p(s), byref(out)) == 0 and out.value == c1  # creation device
    assert drv.cuStreamGetCtx(None, byref(out)) == 0 and out.value == c0  # legacy: current
    assert drv.cuStreamGetCtx(c_void_p(0x7f0012345670), byref(out)) == 0 and out.value == c0  # foreign
    assert fake.live("stream") == 1
    assert drv.cuStreamDestroy(c_void_p(s)) == 0 and fake.live("stream") == 0
    assert drv.cuStreamSynchronize(c_void_p(s)) == INVALID_HANDLE  # use after destroy
    assert drv.cuStreamGetCtx(c_void_p(s), byref(out)) == INVALID_HANDLE
    assert drv.cuStreamDestroy(c_void_p(s)) == INVALID_HANDLE and fake.bad_destroys() == 1


def test_event_record_and_wait_log(fake, drv, ctx):
    rc, s = make(drv, "cuStreamCreateWithPriority", 1, 0)
    rc, e = make(drv, "cuEventCreate", 2)
    record, wait, sync = drv.cuEventRecord, drv.cuStreamWaitEvent, drv.cuStreamSynchronize
    fake.clear_log()
    assert record(c_void_p(e), None) == 0
    assert wait(c_void_p(s), c_void_p(e), 0) == 0
    assert sync(c_void_p(s)) == 0
    assert fake.log() == [f"cuEventRecord event={e:#x} stream=0x0",
                          f"cuStreamWaitEvent stream={s:#x} event={e:#x} flags=0",
                          f"cuStreamSynchronize stream={s:#x}"]
    assert drv.cuEventRecord(None, None) == INVALID_HANDLE


def test_event_record_across_devices_is_rejected(fake, drv):
    fake.configure(device_count=2)
    assert drv.cuInit(0) == 0
    _, c0 = make(drv, "cuDevicePrimaryCtxRetain", 0)
    _, c1 = make(drv, "cuDevicePrimaryCtxRetain", 1)
    drv.cuCtxSetCurrent(c_void_p(c0))
    _, e0 = make(drv, "cuEventCreate", 2)
    drv.cuCtxSetCurrent(c_void_p(c1))
    _, s1 = make(drv, "cuStreamCreateWithPriority", 1, 0)
    assert drv.cuEventRecord(c_void_p(e0), c_void_p(s1)) == INVALID_HANDLE
    assert drv.cuStreamWaitEvent(c_void_p(s1), c_void_p(e0), 0) == 0  # cross-device wait is fine


def test_capture_info(fake, drv, ctx):
    st, cid, graph, n = c_int(7), c_ulonglong(7), c_void_p(), c_size_t(7)
    f = drv.cuStreamGetCaptureInfo
    assert f(None, byref(st), byref(cid), byref(graph), None, None, byref(n)) == 0
    assert (st.value, cid.value, graph.value, n.value) == (0, 0, None, 0)
    fake.set_capture(42)
    assert f(None, byref(st), None, None, None, None, None) == 0 and st.value == 1
    assert f(None, byref(st), byref(cid), byref(graph), None, None, byref(n)) == 0
    assert (st.value, cid.value, n.value) == (1, 42, 0) and graph.value
    assert f(None, None, None, None, None, None, None) == INVALID_VALUE


# -- modules and launches -------------------------------------------------------------

def test_module_load_unload(fake, drv, ctx):
    assert make(drv, "cuModuleLoadData", None)[0] == INVALID_VALUE
    mod, fn = load_function(drv)
    assert fake.live("module") == 1
    assert re.fullmatch(r"cuModuleLoadData image=0x[0-9a-f]+ format=ptx module=0x[0-9a-f]+",
                        fake.log("cuModuleLoadData")[-1])
    assert fake.log("cuModuleGetFunction") == [
        f"cuModuleGetFunction module={mod:#x} name=prefetch_kernel func={fn:#x}"]
    assert drv.cuModuleUnload(c_void_p(mod)) == 0 and fake.live("module") == 0
    assert drv.cuModuleUnload(c_void_p(mod)) == INVALID_HANDLE and fake.bad_destroys() == 1
    assert launch(drv, fn) == INVALID_HANDLE  # function of an unloaded module
    assert make(drv, "cuModuleGetFunction", c_void_p(mod), b"k")[0] == INVALID_HANDLE


def test_launch_log_format(fake, drv, ctx):
    _, fn = load_function(drv)
    _, s = make(drv, "cuStreamCreateWithPriority", 1, -5)
    assert drv.cuFuncSetAttribute(c_void_p(fn), 8, 100 * 1024) == 0
    params = (c_void_p * 2)()
    rc = launch(drv, fn, grid=(132, 1, 1), block=(256, 1, 1), smem=100 * 1024, stream=s,
                attrs=[(8, -5), (14, 100)], params=params)
    assert rc == 0
    line = fake.log("cuLaunchKernelEx")[-1]
    assert line == (f"cuLaunchKernelEx grid=132,1,1 block=256,1,1 smem=102400 stream={s:#x} "
                    f"func=prefetch_kernel attrs=priority:-5,carveout:100 "
                    f"params={ctypes.addressof(params):#x} extra=0x0")
    assert launch(drv, fn, grid=(2, 3, 4), block=(32, 2, 1)) == 0
    assert "grid=2,3,4 block=32,2,1 smem=0 stream=0x0 func=prefetch_kernel attrs=none params=0x0" in \
        fake.log("cuLaunchKernelEx")[-1]


def test_launch_checks(fake, drv, ctx):
    _, fn = load_function(drv)
    assert launch(drv, fn, smem=48 * 1024) == 0
    assert launch(drv, fn, smem=48 * 1024 + 1) == INVALID_VALUE  # attribute never raised
    assert fake.log("cuLaunchKernelEx")[-1].endswith(" -> CUDA_ERROR_INVALID_VALUE")
    assert drv.cuFuncSetAttribute(c_void_p(fn), 8, 232448 + 1) == INVALID_VALUE
    assert launch(drv, fn, block=(1024, 2, 1)) == INVALID_VALUE
    assert launch(drv, fn, grid=(0, 1, 1)) == INVALID_VALUE
    assert drv.cuLaunchKernelEx(None, c_void_p(fn), None, None) == INVALID_VALUE
    assert launch(drv, 0x1230) == INVALID_HANDLE
    assert "func=?" in fake.log("cuLaunchKernelEx")[-1]


def test_launch_on_other_devices_stream_is_rejected(fake, drv):
    fake.configure(device_count=2)
    drv.cuInit(0)
    _, c0 = make(drv, "cuDevicePrimaryCtxRetain", 0)
    _, c1 = make(drv, "cuDevicePrimaryCtxRetain", 1)
    drv.cuCtxSetCurrent(c_void_p(c0))
    _, fn0 = load_function(drv)
    drv.cuCtxSetCurrent(c_void_p(c1))
    _, s1 = make(drv, "cuStreamCreateWithPriority", 1, 0)
    assert launch(drv, fn0, stream=s1) == INVALID_HANDLE
    assert launch(drv, fn0, stream=0x7f0000001000) == 0  # foreign stream: not checked


# -- pointers ---------------------------------------------------------------------------

@pytest.mark.parametrize("ptr,expect", [((1 << 40), 0), ((2 << 40) - 8, 0), ((2 << 40) + 4096, 1),
                                        ((3 << 40), None), (4096, None), (0, None)])
def test_pointer_device_ordinal(fake, drv, ptr, expect):
    fake.configure(device_count=2)
    drv.cuInit(0)
    d = c_int(-7)
    rc = drv.cuPointerGetAttribute(byref(d), 9, ptr)
    if expect is None:
        assert rc == INVALID_VALUE and d.value == -7
    else:
        assert rc == 0 and d.value == expect
        assert fake.log("cuPointerGetAttribute")[-1] == f"cuPointerGetAttribute attribute=9 ptr={ptr:#x} device={expect}"


def test_pointer_other_attribute(drv):
    drv.cuInit(0)
    d = c_int()
    assert drv.cuPointerGetAttribute(byref(d), 1, 1 << 40) == INVALID_VALUE


# -- reset, log size, threads -----------------------------------------------------------

def test_reset_clears_everything(fake, drv, ctx):
    _, e = make(drv, "cuEventCreate", 0)
    fake.fail("cuEventCreate", 1, 2)
    fake.set_capture(5)
    fake.reset()
    assert fake.log() == [] and fake.calls("cuEventCreate") == 0
    assert fake.live("event") == 0 and fake.live("context") == 0 and fake.bad_destroys() == 0
    assert drv.cuInit(0) == 0
    assert make(drv, "cuCtxGetCurrent") == (0, None)
    assert drv.cuEventDestroy(c_void_p(e)) == INVALID_HANDLE  # handles from before reset are stale
    with pytest.raises(ValueError):
        fake.live("bogus")
    with pytest.raises(ValueError):
        fake.calls("bogus")


def test_large_log(fake, drv):
    f = drv.cuDriverGetVersion
    v = c_int()
    fake.clear_log()
    for _ in range(100_000):
        f(byref(v))
    lines = fake.log()
    assert len(lines) == 100_000 and lines[-1] == "cuDriverGetVersion version=13000"
    fake.clear_log()
    assert fake.log() == [] and fake.calls("cuDriverGetVersion") == 100_000


def test_threads(fake, drv, ctx):
    create, destroy, set_cur = drv.cuEventCreate, drv.cuEventDestroy, drv.cuCtxSetCurrent
    errors = []

    def work():
        try:
            assert set_cur(c_void_p(ctx)) == 0
            for _ in range(5000):
                h = c_void_p()
                assert create(byref(h), 2) == 0
                assert destroy(h) == 0
        except AssertionError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert fake.calls("cuEventCreate") == 10_000 and fake.live("event") == 0
    assert fake.bad_destroys() == 0
    assert len(fake.log("cuEventDestroy")) == 10_000
