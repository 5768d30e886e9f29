"""Build and drive tests/fakecuda/fakecuda.c, the recording stand-in for libcuda.

    so = build_fakecuda(tmp_dir)          # cc -shared ... -> tmp_dir/libfakecuda.so
    fake = FakeCuda(so)
    fake.reset(); fake.configure(device_count=2)
    fake.fail("cuEventCreate", nth=2, code="CUDA_ERROR_OUT_OF_MEMORY")
    ... point the extension at `so` and run it ...
    assert fake.live("event") == 0 and fake.bad_destroys() == 0
    fake.log("cuLaunchKernelEx")          # ['cuLaunchKernelEx grid=... func=... attrs=...']

The library keeps its state per process: every FakeCuda (and the extension, when
it dlopen()s the same path) sees the same log and counters.
"""

import ctypes
import os
import subprocess
import tempfile
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint, c_ulonglong, c_void_p
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "fakecuda" / "fakecuda.c"

ERRORS = {
    "CUDA_SUCCESS": 0, "CUDA_ERROR_INVALID_VALUE": 1, "CUDA_ERROR_OUT_OF_MEMORY": 2,
    "CUDA_ERROR_NOT_INITIALIZED": 3, "CUDA_ERROR_DEINITIALIZED": 4, "CUDA_ERROR_NO_DEVICE": 100,
    "CUDA_ERROR_INVALID_DEVICE": 101, "CUDA_ERROR_INVALID_IMAGE": 200,
    "CUDA_ERROR_INVALID_CONTEXT": 201, "CUDA_ERROR_NO_BINARY_FOR_GPU": 209,
    "CUDA_ERROR_INVALID_PTX": 218, "CUDA_ERROR_INVALID_HANDLE": 400, "CUDA_ERROR_NOT_FOUND": 500,
    "CUDA_ERROR_ILLEGAL_ADDRESS": 700, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES": 701,
    "CUDA_ERROR_LAUNCH_FAILED": 719, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED": 900,
    "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED": 901, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED": 904,
    "CUDA_ERROR_UNKNOWN": 999,
}


class CUlaunchAttribute(ctypes.Structure):
    class _Value(ctypes.Union):
        _fields_ = [("pad", ctypes.c_char * 64), ("priority", c_int),
                    ("sharedMemCarveout", c_uint)]

    _fields_ = [("id", c_int), ("pad", ctypes.c_char * 4), ("value", _Value)]


class CUlaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint),
                ("blockDimX", c_uint), ("blockDimY", c_uint), ("blockDimZ", c_uint),
                ("sharedMemBytes", c_uint), ("hStream", c_void_p),
                ("attrs", POINTER(CUlaunchAttribute)), ("numAttrs", c_uint)]


_PV, _PI = POINTER(c_void_p), POINTER(c_int)

# name -> (ABI version the extension asks for, argument types); all return CUresult.
ENTRY_POINTS = {
    "cuGetErrorName": (6000, [c_int, POINTER(c_char_p)]),
    "cuGetErrorString": (6000, [c_int, POINTER(c_char_p)]),
    "cuInit": (2000, [c_uint]),
    "cuDriverGetVersion": (2020, [_PI]),
    "cuGetProcAddress": (12000, [c_char_p, _PV, c_int, c_ulonglong, _PI]),
    "cuDeviceGetCount": (2000, [_PI]),
    "cuDeviceGet": (2000, [_PI, c_int]),
    "cuDeviceGetAttribute": (2000, [_PI, c_int, c_int]),
    "cuDevicePrimaryCtxRetain": (7000, [_PV, c_int]),
    "cuDevicePrimaryCtxRelease": (11000, [c_int]),
    "cuCtxGetCurrent": (4000, [_PV]),
    "cuCtxSetCurrent": (4000, [c_void_p]),
    "cuCtxPushCurrent": (4000, [c_void_p]),
    "cuCtxPopCurrent": (4000, [_PV]),
    "cuCtxGetDevice": (2000, [_PI]),
    "cuCtxGetStreamPriorityRange": (5050, [_PI, _PI]),
    "cuModuleLoadData": (2000, [_PV, c_void_p]),
    "cuModuleUnload": (2000, [c_void_p]),
    "cuModuleGetFunction": (2000, [_PV, c_void_p, c_char_p]),
    "cuFuncSetAttribute": (9000, [c_void_p, c_int, c_int]),
    "cuLaunchKernelEx": (11060, [POINTER(CUlaunchConfig), c_void_p, _PV, _PV]),
    "cuStreamCreateWithPriority": (5050, [_PV, c_uint, c_int]),
    "cuStreamDestroy": (4000, [c_void_p]),
    "cuStreamGetCtx": (9020, [c_void_p, _PV]),
    "cuStreamGetCaptureInfo": (12030, [c_void_p, _PI, POINTER(c_ulonglong), _PV, _PV, _PV,
                                       POINTER(c_size_t)]),
    "cuEventCreate": (2000, [_PV, c_uint]),
    "cuEventDestroy": (4000, [c_void_p]),
    "cuEventRecord": (2000, [c_void_p, c_void_p]),
    "cuStreamWaitEvent": (3020, [c_void_p, c_void_p, c_uint]),
    "cuStreamSynchronize": (2000, [c_void_p]),
    "cuPointerGetAttribute": (4000, [c_void_p, c_int, c_ulonglong]),
    "cuStreamUpdateCaptureDependencies": (12030, [c_void_p, _PV, c_void_p, c_size_t, c_uint]),
    "cuGraphNodeGetType": (10000, [c_void_p, _PI]),
}

LIVE_KINDS = ("stream", "event", "module", "context", "graph", "exec")


def _build_shared_library(source, outdir, name, what):
    """Compile source to outdir/name unless that is newer; temp file + rename."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    out = outdir / name
    if out.exists() and out.stat().st_mtime >= source.stat().st_mtime:
        return str(out)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".so", dir=outdir)
    os.close(fd)
    cmd = [os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1", "-std=c11", "-Wall",
           "-pthread", "-o", tmp, str(source)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building {what} failed: {' '.join(cmd)}\n"
                               f"{proc.stdout}{proc.stderr}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(out)


def build_fakecuda(outdir):
    """Compile fakecuda.c to outdir/libfakecuda.so unless that is newer than the source.

    The library is written under a temporary name and renamed into place, so
    concurrent builders (pytest-xdist workers) never load a half-written file.
    Returns the path as a str.
    """
    return _build_shared_library(SOURCE, outdir, "libfakecuda.so", "the fake CUDA driver")


def error_code(code):
    """An int, or a name from ERRORS ("CUDA_ERROR_OUT_OF_MEMORY")."""
    return ERRORS[code] if isinstance(code, str) else int(code)


class FakeCuda:
    """ctypes wrapper over the control API of libfakecuda.so."""

    def __init__(self, path):
        self.path = str(path)
        self.lib = lib = ctypes.CDLL(self.path)
        sigs = {
            "fake_reset": (None, []),
            "fake_configure": (None, [c_int, c_int, c_int, c_int]),
            "fake_set_attribute": (c_int, [c_int, c_int]),
            "fake_fail": (c_int, [c_char_p, c_int, c_int]),
            "fake_calls": (c_int, [c_char_p]),
            "fake_log": (c_char_p, []),
            "fake_clear_log": (None, []),
            "fake_live": (ctypes.c_long, [c_char_p]),
            "fake_bad_destroys": (ctypes.c_long, []),
            "fake_set_capture": (None, [c_ulonglong]),
            "fake_add_capture_node": (c_size_t, [c_int]),
            "fake_set_uninitialized_error": (None, [c_int]),
            "cuGetProcAddress_v2": (c_int, ENTRY_POINTS["cuGetProcAddress"][1]),
        }
        for name, (restype, argtypes) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes

    # -- control ---------------------------------------------------------------
    def reset(self):
        """Defaults again: 1 device, cc 9.0, driver 13000, not initialized, empty log."""
        self.lib.fake_reset()

    def configure(self, device_count=1, cc_major=9, cc_minor=0, driver_version=13000):
        self.lib.fake_configure(device_count, cc_major, cc_minor, driver_version)

    def set_attribute(self, attrib, value):
        """Override cuDeviceGetAttribute(attrib) on every device until reset()."""
        if self.lib.fake_set_attribute(attrib, value) != 0:
            raise RuntimeError("too many attribute overrides")

    def fail(self, name, nth=1, code="CUDA_ERROR_UNKNOWN"):
        """Make the nth next call (1 = the very next) of entry point `name` return `code`."""
        if self.lib.fake_fail(name.encode(), nth, error_code(code)) != 0:
            raise ValueError(f"cannot inject a failure into {name!r} (nth={nth})")

    def calls(self, name):
        """Calls of entry point `name` since reset(), failed ones included."""
        n = self.lib.fake_calls(name.encode())
        if n < 0:
            raise ValueError(f"unknown entry point {name!r}")
        return n

    def log(self, name=None):
        """Log lines in call order; only those of entry point `name` if given."""
        lines = self.lib.fake_log().decode("utf-8", "replace").splitlines()
        if name is not None:
            lines = [line for line in lines if line.split(" ", 1)[0] == name]
        return lines

    def clear_log(self):
        self.lib.fake_clear_log()

    def live(self, kind):
        """Live objects of `kind`: 'stream', 'event', 'module', 'context' (retains), 'graph'
        (clones) or 'exec' (instantiated graphs)."""
        n = self.lib.fake_live(kind.encode())
        if n < 0:
            raise ValueError(f"unknown kind {kind!r}, expected one of {LIVE_KINDS}")
        return n

    def bad_destroys(self):
        """Destroys/unloads/releases of unknown or already destroyed handles."""
        return self.lib.fake_bad_destroys()

    def set_capture(self, capture_id):
        """Non-zero: cuStreamGetCaptureInfo reports ACTIVE with this id; 0: NONE."""
        self.lib.fake_set_capture(capture_id)

    def add_capture_node(self, node_type):
        """While capturing: capture a node of node_type (1 memcpy, 2 memset, ...); its index."""
        return self.lib.fake_add_capture_node(node_type)

    def set_uninitialized_error(self, code):
        """Non-zero: cuInit fails with `code` (e.g. CUDA_ERROR_NO_DEVICE)."""
        self.lib.fake_set_uninitialized_error(error_code(code))

    # -- calling the fake driver as the extension would ---------------------------
    def get_proc(self, name, version=None, flags=0):
        """Raw cuGetProcAddress_v2: (CUresult, address or None, symbolStatus)."""
        if version is None:
            version = ENTRY_POINTS[name][0] if name in ENTRY_POINTS else 12000
        pfn, status = c_void_p(), c_int(-1)
        rc = self.lib.cuGetProcAddress_v2(name.encode(), ctypes.byref(pfn), version, flags,
                                          ctypes.byref(status))
        return rc, pfn.value, status.value

    def fn(self, name, version=None):
        """Entry point `name` resolved through cuGetProcAddress_v2, as a ctypes function."""
        rc, addr, status = self.get_proc(name, version)
        if rc != 0 or not addr:
            raise LookupError(f"cuGetProcAddress_v2({name!r}) -> {rc} (status {status})")
        proto = ctypes.CFUNCTYPE(c_int, *ENTRY_POINTS[name][1])
        return proto(addr)


# -- NVRTC --------------------------------------------------------------------------
#
#     so = build_fakenvrtc(tmp_dir)        # -> tmp_dir/libfakenvrtc.so
#     nv = FakeNvrtc(so)
#     nv.reset(); nv.fail("nvrtcGetCUBIN", nth=1, code="NVRTC_ERROR_COMPILATION")
#     _C._use_nvrtc(so) ... compile ...
#     assert nv.live_programs() == 0

NVRTC_SOURCE = Path(__file__).resolve().parent / "fakecuda" / "fakenvrtc.c"

NVRTC_ERRORS = {
    "NVRTC_SUCCESS": 0, "NVRTC_ERROR_OUT_OF_MEMORY": 1,
    "NVRTC_ERROR_PROGRAM_CREATION_FAILURE": 2, "NVRTC_ERROR_INVALID_INPUT": 3,
    "NVRTC_ERROR_INVALID_PROGRAM": 4, "NVRTC_ERROR_INVALID_OPTION": 5,
    "NVRTC_ERROR_COMPILATION": 6, "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE": 7,
    "NVRTC_ERROR_INTERNAL_ERROR": 11,
}

NVRTC_FUNCTIONS = (
    "nvrtcGetErrorString", "nvrtcVersion", "nvrtcGetNumSupportedArchs", "nvrtcGetSupportedArchs",
    "nvrtcCreateProgram", "nvrtcDestroyProgram", "nvrtcCompileProgram", "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog", "nvrtcGetPTXSize", "nvrtcGetPTX", "nvrtcGetCUBINSize", "nvrtcGetCUBIN",
)


def build_fakenvrtc(outdir):
    """Compile fakenvrtc.c to outdir/libfakenvrtc.so, as build_fakecuda does. Returns the path."""
    return _build_shared_library(NVRTC_SOURCE, outdir, "libfakenvrtc.so", "the fake NVRTC")


def nvrtc_error_code(code):
    """An int, or a name from NVRTC_ERRORS ("NVRTC_ERROR_COMPILATION")."""
    return NVRTC_ERRORS[code] if isinstance(code, str) else int(code)


class FakeNvrtc:
    """ctypes wrapper over the control API of libfakenvrtc.so."""

    def __init__(self, path):
        self.path = str(path)
        self.lib = lib = ctypes.CDLL(self.path)
        sigs = {
            "fakenvrtc_reset": (None, []),
            "fakenvrtc_fail": (c_int, [c_char_p, c_int, c_int]),
            "fakenvrtc_calls": (c_int, [c_char_p]),
            "fakenvrtc_live_programs": (ctypes.c_long, []),
            "fakenvrtc_bad_destroys": (ctypes.c_long, []),
            "fakenvrtc_set_compile_delay_us": (None, [ctypes.c_long]),
            "nvrtcGetErrorString": (c_char_p, [c_int]),
        }
        for name, (restype, argtypes) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes

    def reset(self):
        """No programs, counters or pending failures."""
        self.lib.fakenvrtc_reset()

    def fail(self, name, nth=1, code="NVRTC_ERROR_COMPILATION"):
        """Make the nth next call (1 = the very next) of `name` return `code`."""
        if self.lib.fakenvrtc_fail(name.encode(), nth, nvrtc_error_code(code)) != 0:
            raise ValueError(f"cannot inject a failure into {name!r} (nth={nth})")

    def calls(self, name):
        """Calls of `name` since reset(), failed ones included."""
        n = self.lib.fakenvrtc_calls(name.encode())
        if n < 0:
            raise ValueError(f"unknown NVRTC function {name!r}")
        return n

    def set_compile_delay(self, seconds):
        """Each compile first sleeps this long (0: none), outside the stand-in's lock."""
        self.lib.fakenvrtc_set_compile_delay_us(int(seconds * 1e6))

    def live_programs(self):
        """Programs created and not destroyed since reset()."""
        return self.lib.fakenvrtc_live_programs()

    def bad_destroys(self):
        """nvrtcDestroyProgram calls on unknown or already destroyed programs."""
        return self.lib.fakenvrtc_bad_destroys()

    def error_string(self, code):
        """What nvrtcGetErrorString returns for `code`."""
        return self.lib.nvrtcGetErrorString(nvrtc_error_code(code)).decode()
