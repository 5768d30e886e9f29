"""Shared fixtures: the recording driver stand-in, and GPU detection.

Tests marked ``gpu`` need a CUDA GPU with a working driver and a CUDA build of
torch; elsewhere they are skipped with the reason (pytest -ra prints it).
"""

import gc
import inspect
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _fakecuda import FakeCuda, build_fakecuda  # noqa: E402

import l2prefetch  # noqa: E402
from l2prefetch import _C  # noqa: E402


def _gpu_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch {torch.__version__}"
    try:
        _C.driver_info()
    except l2prefetch.CudaUnavailableError as exc:
        return f"CUDA driver unusable: {str(exc).splitlines()[0]}"
    return None


GPU_REASON = _gpu_reason()


def _nvrtc_reason():
    try:
        _C.nvrtc_info()
    except (l2prefetch.CudaUnavailableError, l2prefetch.Error) as exc:
        return str(exc).splitlines()[0]
    return None


#: Why NVRTC did not load (None: it did).  Most tests of the C extension compile the
#: kernel with the real NVRTC, which needs no GPU: dev.sh's PINS install it, and the
#: report's header says where it is missing.
NVRTC_REASON = _nvrtc_reason()

#: A C++ exception aborts the process: ASan preloaded into a python not linked to
#: libstdc++, without libstdc++ preloaded too, has no real __cxa_throw to forward its
#: interceptor to (dev.sh's sanitizer pass preloads both; a bare LD_PRELOAD=libasan.so
#: does not).  Tests whose exceptions cross C++ (torch's, matplotlib's) skip then.
_PRELOAD = os.environ.get("LD_PRELOAD", "")
CXX_THROW_ABORTS = "libasan" in _PRELOAD and "libstdc++" not in _PRELOAD


#: The fixtures of the fake CUDA driver (tests/fakecuda): a test using one, directly or
#: through another fixture, reaches the C extension.
C_FIXTURES = frozenset({"fake", "fakecuda_path"})
#: What a test module's source names when it tests what FLOOR_PINS (dev.sh) hold at their
#: oldest: the tune extra's transformers and matplotlib, NVRTC compiling the kernel.
FLOOR_NAMES = re.compile(r"\btransformers\b|\bmatplotlib\b|\b_C\.compile\(")


def _reaches_c_module(module):
    """Whether a test module holds the C extension, one of its functions or types, the
    fake driver (tests/_fakecuda.py) or conftest's stand-ins that exist to feed C
    (FakeArray, device_ptr, cuda_tensor, Raising): then each of its tests reaches C."""
    for value in vars(module).values():
        if value is _C or getattr(value, "__name__", None) == "_fakecuda":
            return True
        if getattr(value, "__module__", None) in ("l2prefetch._C", "_fakecuda", "conftest") \
                and callable(value):
            return True
    return False


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "reaches_c: the test runs the C extension (set by conftest for tests that "
        "use the fake driver or whose module imports _C or the fakes; the ASan/UBSan pass "
        "of dev.sh runs these); mark a test that reaches C only through the public API")
    config.addinivalue_line(
        "markers", "floor: the test exercises what dev.sh's FLOOR_PINS hold at their oldest "
        "(set by conftest for modules that name transformers, matplotlib or _C.compile)")


def pytest_collection_modifyitems(config, items):
    modules = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        if module not in modules:
            try:
                source = inspect.getsource(module)
            except (OSError, TypeError):
                source = ""
            modules[module] = (_reaches_c_module(module), bool(FLOOR_NAMES.search(source)))
        reaches_c, floor = modules[module]
        if reaches_c or C_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.reaches_c)
        if floor:
            item.add_marker(pytest.mark.floor)
    if GPU_REASON is None:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: {GPU_REASON}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    return [f"l2prefetch {l2prefetch.__version__}: GPU tests "
            + ("run" if GPU_REASON is None else f"skipped ({GPU_REASON})")
            + ("" if NVRTC_REASON is None else
               f"; NVRTC did not load, so the tests that compile the kernel (no GPU "
               f"needed) fail: pip install nvidia-cuda-nvrtc, as dev.sh does "
               f"({NVRTC_REASON})")]


@pytest.fixture(scope="session")
def fakecuda_path(tmp_path_factory):
    return build_fakecuda(str(tmp_path_factory.mktemp("fakecuda")))


@pytest.fixture
def fake(fakecuda_path, monkeypatch, tmp_path):
    """The recording driver stand-in, in use by objects created in the test.

    Objects made during the test keep it; the default driver is restored
    afterwards.  The NVRTC disk cache goes to the test's tmp_path.
    """
    monkeypatch.setenv("L2PREFETCH_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.delenv("L2PREFETCH_DISABLE", raising=False)
    # Garbage of earlier tests (a controller in a reference cycle, say) is destroyed
    # now, against the earlier recording, not in the middle of this test's.  What
    # survives is alive, and frozen (gc.freeze) so that the collections here and in
    # the test walk only what was made since: with torch and transformers loaded each
    # full collection took 0.3 s, twice per test, 228 s of the suite's 640 (issue 41).
    gc.collect()
    gc.freeze()
    drv = FakeCuda(fakecuda_path)
    drv.reset()
    _C._use_driver(fakecuda_path)
    try:
        yield drv
    finally:
        gc.collect()
        _C._use_driver(None)


class FakeArray:
    """A device array described only by __cuda_array_interface__ (v3)."""

    def __init__(self, ptr, shape, typestr="<f2", strides=None):
        self.ptr, self.shape, self.typestr, self.strides = ptr, tuple(shape), typestr, strides

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.typestr, "data": (self.ptr, False),
                "strides": self.strides, "version": 3}


def device_ptr(device=0, offset=0):
    """An address the stand-in maps to `device` (see tests/fakecuda)."""
    return ((device + 1) << 40) + offset


class FakeStorage:
    """A tensor's untyped_storage() in the stand-in's address space: `nbytes` at `ptr`."""

    def __init__(self, ptr, nbytes):
        self.ptr, self.size = ptr, nbytes

    def data_ptr(self):
        return self.ptr

    def nbytes(self):
        return self.size


def storageless(shape, device="cuda:0"):
    """A wrapper tensor on a CUDA device without storage of its own, as a DTensor or a
    nested tensor is: its data_ptr() is 0 (torch need not see a GPU)."""
    import torch

    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, shape):
            return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float16,
                                                       device=device)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(str(func))
    return Wrapper(shape)


def cuda_tensor(ptr, shape=(64,), device=0, dtype=None):
    """A meta tensor that says it lives at ``ptr`` on cuda:``device`` (what ranges.c
    reads): PlanEntry and from_plan take only torch tensors, and torch here may be
    CPU-only.  ``shape`` may be an int."""
    import torch

    class FakeCudaTensor(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", device)

        def data_ptr(self):
            return ptr

        def untyped_storage(self):   # its memory: where ranges.c binds the range
            return FakeStorage(ptr, super().untyped_storage().nbytes())

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return torch.Tensor._make_subclass(
        FakeCudaTensor, torch.empty(shape, dtype=dtype or torch.float16, device="meta"))


class Raising:
    """A weight whose __cuda_array_interface__ raises exc."""

    def __init__(self, exc):
        self.exc = exc

    @property
    def __cuda_array_interface__(self):
        raise self.exc
