"""A failure injected into every NVRTC call on the compile path (csrc/nvrtc.c, kernels.c).

NVRTC is swapped for the recording stand-in tests/fakecuda/fakenvrtc.c with
_C._use_nvrtc, so these run with or without a real NVRTC or GPU.  Each call of
l2p_nvrtc_compile is made to fail, through _C.compile (CUBIN and PTX) and
_C._kernel_image (the memory and disk caches; CUBIN, and PTX for an sm NVRTC
cannot build SASS for), and through PreparedWeightRanges with the driver
stand-in too.

The designed behaviour (l2p_nvrtc_compile):
  - nvrtcCreateProgram, nvrtcCompileProgram, nvrtcGet{CUBIN,PTX}Size and
    nvrtcGet{CUBIN,PTX} failing raise NvrtcError naming that call, with the
    NVRTC error string as .name and the status as .code; the log is the one
    NVRTC gave for the compile ("" when no program was made).
  - nvrtcGetProgramLogSize / nvrtcGetProgramLog failing do not hide a good
    compile: it succeeds with an empty log.  With a failed compile the error is
    the compile's, with an empty log.
  - nvrtcDestroyProgram failing is ignored (the image is good).
In every case no program is left alive (except the one whose destroy was made to
fail), nothing failed is cached in memory or on disk, and the next compile works.
"""

import gc
import os
import re
import warnings

import pytest

import l2prefetch
from l2prefetch import _C
from _fakecuda import NVRTC_ERRORS, FakeNvrtc, build_fakenvrtc
from conftest import FakeArray, device_ptr

PWR = l2prefetch.PreparedWeightRanges
LIVE_KINDS = ("stream", "event", "module", "context")
LOG = "fake log for prefetch.cu"

# mode -> (variant, sm, PTX expected); see build()
MODES = {
    "compile": ("ring", 90, False),        # _C.compile: CUBIN for sm_90
    "compile_ptx": ("ring", 90, True),     # _C.compile(ptx=True): PTX for compute_90
    "image": ("ring", 90, False),          # _C._kernel_image: CUBIN, cached
    "image_ptx": ("ring", 103, True),      # sm_103 is not in the stand-in's list:
                                           # PTX for compute_100
}
SETUP = ["nvrtcCreateProgram", "nvrtcCompileProgram"]
RAISING = {False: SETUP + ["nvrtcGetCUBINSize", "nvrtcGetCUBIN"],
           True: SETUP + ["nvrtcGetPTXSize", "nvrtcGetPTX"]}
LOG_QUERIES = ["nvrtcGetProgramLogSize", "nvrtcGetProgramLog"]
CODES = ["NVRTC_ERROR_COMPILATION", "NVRTC_ERROR_OUT_OF_MEMORY", "NVRTC_ERROR_INTERNAL_ERROR"]


@pytest.fixture(scope="session")
def fakenvrtc_path(tmp_path_factory):
    return build_fakenvrtc(str(tmp_path_factory.mktemp("fakenvrtc")))


@pytest.fixture
def nv(fakenvrtc_path, monkeypatch, tmp_path):
    """The NVRTC stand-in, in use for the test; the disk cache is tmp_path/kcache and
    empty, the in-process cache cleared; the default NVRTC is back afterwards."""
    monkeypatch.setenv("L2PREFETCH_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.delenv("L2PREFETCH_NO_DISK_CACHE", raising=False)
    fake = FakeNvrtc(fakenvrtc_path)
    fake.reset()
    _C._use_nvrtc(fakenvrtc_path)
    _C.clear_kernel_cache()
    try:
        yield fake
    finally:
        _C._use_nvrtc(None)
        _C.clear_kernel_cache()


def cache_files(tmp_path):
    folder = tmp_path / "kcache"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def options_of(mode):
    variant, sm, ptx = MODES[mode]
    arch = 100 if sm == 103 else sm
    defines = l2prefetch.kernel_variants()[variant]["defines"].split()
    return [f"--gpu-architecture={'compute' if ptx else 'sm'}_{arch}", "-std=c++17",
            "--ptxas-options=-v"] + defines


def build(mode, from_memory=False):
    """Runs mode's call; returns (image, log or None).  The PTX fallback's warning is
    checked: _kernel_image gives it on every miss of the in-process cache."""
    variant, sm, ptx = MODES[mode]
    if mode.startswith("compile"):
        out = _C.compile(variant, sm, ptx=ptx)
        assert out["ptx"] is ptx and out["options"] == options_of(mode)
        return out["image"], out["log"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            image, is_ptx = _C._kernel_image(variant, sm)
        finally:
            expected = ["building PTX for compute_100"] if ptx and not from_memory else []
            assert [m for m in expected if not any(m in str(w.message) for w in caught)] == []
            assert len(caught) == len(expected), [str(w.message) for w in caught]
    assert is_ptx is ptx
    return image, None


def assert_good_image(image, mode):
    ptx = MODES[mode][2]
    if ptx:
        text = "// fake ptx for prefetch.cu\n" + "".join(f"// {o}\n" for o in options_of(mode))
        assert image == text.encode() + b"\0"
    else:
        assert image == b"\x7fELFfake cubin for prefetch.cu\n" + "".join(
            f"{o}\n" for o in options_of(mode)).encode()


def assert_clean(nv):
    assert nv.live_programs() == 0
    assert nv.bad_destroys() == 0                             # and none destroyed twice


def expect_next_compile_works(nv, mode, tmp_path):
    """After a failure: the next call compiles afresh (nothing failed was kept) and
    succeeds; _kernel_image then caches it once on disk and in memory."""
    compiles = nv.calls("nvrtcCompileProgram")
    image, log = build(mode)
    assert_good_image(image, mode)
    if log is not None:
        assert log == LOG
    assert nv.calls("nvrtcCompileProgram") == compiles + 1
    if mode.startswith("image"):
        assert len(cache_files(tmp_path)) == 1
        assert build(mode, from_memory=True)[0] is image    # from memory
        assert nv.calls("nvrtcCompileProgram") == compiles + 1
        _C.clear_kernel_cache()
        assert build(mode)[0] == image                       # from disk
        assert nv.calls("nvrtcCompileProgram") == compiles + 1
    else:
        assert cache_files(tmp_path) == []                   # _C.compile skips the caches
    assert_clean(nv)


# ------------------------------------------------------------ the stand-in itself


def test_stand_in_compiles(nv, tmp_path):
    assert _C.nvrtc_info() == {"path": nv.path, "version": (13, 0),
                               "archs": [75, 80, 86, 89, 90, 100, 120]}
    for mode in MODES:
        image, log = build(mode)
        assert_good_image(image, mode)
        assert log in (None, LOG)
    assert nv.calls("nvrtcCompileProgram") == 4
    assert nv.calls("nvrtcGetCUBIN") == 2 and nv.calls("nvrtcGetPTX") == 2
    assert len(cache_files(tmp_path)) == 2
    assert_clean(nv)


def test_fail_rejects_bad_requests(nv):
    for name, nth in [("nvrtcNope", 1), ("nvrtcGetErrorString", 1), ("nvrtcGetCUBIN", 0)]:
        with pytest.raises(ValueError):
            nv.fail(name, nth)
    with pytest.raises(ValueError):
        nv.calls("nvrtcNope")


# ------------------------------------------------------------ every call site


RAISING_CASES = [(mode, op) for mode in MODES for op in RAISING[MODES[mode][2]]]


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("mode, op", RAISING_CASES)
def test_failing_call_raises(nv, tmp_path, mode, op, code):
    nv.fail(op, 1, code)
    with pytest.raises(l2prefetch.NvrtcError) as info:
        build(mode)
    exc = info.value
    assert isinstance(exc, l2prefetch.Error)
    assert exc.operation == op
    assert exc.name == nv.error_string(code) == code
    assert exc.code == NVRTC_ERRORS[code]
    assert str(exc).startswith(f"{op} failed: {code}\noptions: {options_of(mode)!r}\nlog:\n")
    assert exc.options == options_of(mode)
    assert "   1  " in exc.source
    if op == "nvrtcCreateProgram":
        assert exc.log == ""                                  # no program, no log
        assert nv.calls("nvrtcDestroyProgram") == 0
    elif op == "nvrtcCompileProgram":
        assert exc.log == "injected failure in nvrtcCompileProgram"
    else:
        assert exc.log == LOG                                 # the compile's own log
    assert exc.log in str(exc)
    assert_clean(nv)
    assert cache_files(tmp_path) == []
    expect_next_compile_works(nv, mode, tmp_path)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("op", LOG_QUERIES)
def test_failing_log_query_keeps_a_good_compile(nv, tmp_path, mode, op):
    nv.fail(op, 1, "NVRTC_ERROR_INTERNAL_ERROR")
    image, log = build(mode)
    assert_good_image(image, mode)
    if log is not None:
        assert log == ""                                      # lost, not made up
    assert nv.calls(op) == 1
    assert_clean(nv)
    if mode.startswith("image"):
        assert len(cache_files(tmp_path)) == 1                # a good image is cached
        _C.clear_kernel_cache()
        assert build(mode)[0] == image
        assert nv.calls("nvrtcCompileProgram") == 1
    else:
        expect_next_compile_works(nv, mode, tmp_path)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("op", LOG_QUERIES)
def test_failed_compile_and_failed_log_query(nv, tmp_path, mode, op):
    nv.fail("nvrtcCompileProgram", 1, "NVRTC_ERROR_COMPILATION")
    nv.fail(op, 1, "NVRTC_ERROR_INTERNAL_ERROR")
    with pytest.raises(l2prefetch.NvrtcError) as info:
        build(mode)
    exc = info.value
    assert (exc.operation, exc.name, exc.code) == ("nvrtcCompileProgram",
                                                   "NVRTC_ERROR_COMPILATION", 6)
    assert exc.log == ""
    assert_clean(nv)
    assert cache_files(tmp_path) == []
    expect_next_compile_works(nv, mode, tmp_path)


@pytest.mark.parametrize("mode", list(MODES))
def test_failing_destroy_is_ignored(nv, tmp_path, mode):
    nv.fail("nvrtcDestroyProgram", 1, "NVRTC_ERROR_INVALID_PROGRAM")
    image, log = build(mode)
    assert_good_image(image, mode)
    assert nv.calls("nvrtcDestroyProgram") == 1               # once: no retry
    assert nv.live_programs() == 1                            # the stand-in kept it
    assert nv.bad_destroys() == 0
    nv.reset()


def test_unknown_status_gets_nvrtcs_fallback_name(nv, tmp_path):
    nv.fail("nvrtcCompileProgram", 1, 99)
    with pytest.raises(l2prefetch.NvrtcError) as info:
        _C.compile("ring", 90)
    assert (info.value.code, info.value.name) == (99, "NVRTC_ERROR unknown")
    assert str(info.value).startswith("nvrtcCompileProgram failed: NVRTC_ERROR unknown\n")
    assert_clean(nv)


def test_a_later_call_fails_only_that_one(nv, tmp_path):
    # the second _kernel_image of two variants fails; the first stays cached
    nv.fail("nvrtcGetCUBIN", 2, "NVRTC_ERROR_OUT_OF_MEMORY")
    first, _ = _C._kernel_image("load", 90)
    with pytest.raises(l2prefetch.NvrtcError) as info:
        _C._kernel_image("line_prefetch", 90)
    assert info.value.operation == "nvrtcGetCUBIN"
    assert len(cache_files(tmp_path)) == 1 and "prefetch-load-" in cache_files(tmp_path)[0]
    assert _C._kernel_image("load", 90)[0] is first
    assert _C._kernel_image("line_prefetch", 90)[0].startswith(b"\x7fELF")
    assert len(cache_files(tmp_path)) == 2
    assert_clean(nv)


# ------------------------------------------------------------ PreparedWeightRanges


PWR_CASES = [(90, op) for op in RAISING[False]] + [(103, op) for op in RAISING[True]]


@pytest.mark.parametrize("sm, op", PWR_CASES)
def test_prepared_construction_with_failing_nvrtc(fake, nv, tmp_path, sm, op):
    if sm != 90:
        fake.configure(cc_major=sm // 10, cc_minor=sm % 10)
        _C._use_driver(fake.path)
    nv.fail(op, 1, "NVRTC_ERROR_COMPILATION")
    weights = [FakeArray(device_ptr(), (64,))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the PTX fallback's
        with pytest.raises(l2prefetch.NvrtcError) as info:
            PWR(weights)
    assert info.value.operation == op and info.value.name == "NVRTC_ERROR_COMPILATION"
    assert_clean(nv)
    assert cache_files(tmp_path) == []
    gc.collect()
    assert fake.live("module") == 0 and fake.calls("cuModuleLoadData") == 0
    assert fake.live("stream") == 0 and fake.live("event") == 0
    assert fake.live("context") <= 1                          # the driver instance's own
    # the next one compiles and loads the module
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        t = PWR(weights)
    assert t.kernel == "ring"
    assert fake.live("module") == 1
    fmt = "format=ptx" if sm != 90 else "format=cubin"
    assert fake.log("cuModuleLoadData")[0].split()[2] == fmt
    assert len(cache_files(tmp_path)) == 1
    assert_clean(nv)
    del t
    gc.collect()
    _C._use_driver(None)
    assert {k: fake.live(k) for k in LIVE_KINDS} == dict.fromkeys(LIVE_KINDS, 0)
    assert fake.bad_destroys() == 0


def test_prepared_failure_then_nothing_else_leaks(fake, nv, tmp_path):
    nv.fail("nvrtcCompileProgram", 1, "NVRTC_ERROR_COMPILATION")
    with pytest.raises(l2prefetch.NvrtcError):
        PWR([FakeArray(device_ptr(), (64,))])
    gc.collect()
    _C._use_driver(None)
    assert {k: fake.live(k) for k in LIVE_KINDS} == dict.fromkeys(LIVE_KINDS, 0)
    assert fake.bad_destroys() == 0
    assert_clean(nv)


# ------------------------------------------------------------ opening NVRTC


def test_failing_version_query_makes_nvrtc_unusable(nv, fakecuda_path):
    # a library that loads but cannot be used was found: reason nvrtc_load_failed
    nv.fail("nvrtcVersion", 1, "NVRTC_ERROR_INTERNAL_ERROR")
    with pytest.raises(l2prefetch.CudaUnavailableError) as info:
        _C._use_nvrtc(nv.path)
    assert info.value.reason == "nvrtc_load_failed"
    assert f"nvrtcVersion failed for {nv.path}: NVRTC_ERROR_INTERNAL_ERROR" in str(info.value)
    assert _C.nvrtc_info()["path"] == nv.path              # the one in use is kept
    with pytest.raises(l2prefetch.CudaUnavailableError) as info:
        _C._use_nvrtc(fakecuda_path)                       # loads, but no nvrtc* at all
    assert info.value.reason == "nvrtc_load_failed"
    assert "has no nvrtcGetErrorString" in str(info.value)
    assert _C.compile("ring", 90)["image"].startswith(b"\x7fELF")
    assert_clean(nv)


def test_no_supported_arch_at_or_below_the_sm(nv):
    # The stand-in supports sm_75 and up; the testing hook skips the variants'
    # own minimum, so the NVRTC check is what answers (RuntimeError: this NVRTC
    # cannot serve such a GPU, whatever the arguments), and nothing is compiled.
    with pytest.raises(RuntimeError, match=rf"NVRTC 13\.0 \({re.escape(nv.path)}\) supports no "
                                           r"architecture at or below sm_70"):
        _C._kernel_image("load", 70)
    assert nv.calls("nvrtcCompileProgram") == 0
    assert_clean(nv)


@pytest.mark.parametrize("op", ["nvrtcGetNumSupportedArchs", "nvrtcGetSupportedArchs"])
def test_failing_arch_query_trusts_the_sm(nv, tmp_path, op):
    nv.fail(op, 1, "NVRTC_ERROR_INTERNAL_ERROR")
    _C._use_nvrtc(nv.path)
    assert _C.nvrtc_info()["archs"] == []
    out = _C.compile("ring", 90)
    assert (out["arch"], out["ptx"]) == (90, False)
    # without the list an sm NVRTC rejects goes to it as it is, and fails there
    with pytest.raises(l2prefetch.NvrtcError) as info:
        _C.compile("ring", 103)
    assert (info.value.operation, info.value.name) == ("nvrtcCompileProgram",
                                                       "NVRTC_ERROR_INVALID_OPTION")
    assert "--gpu-architecture=sm_103" in info.value.log
    assert_clean(nv)
    _C._use_nvrtc(nv.path)
    assert _C.nvrtc_info()["archs"] == [75, 80, 86, 89, 90, 100, 120]


# ------------------------------------------------------------ kernel_cache_info

def test_kernel_cache_info_says_how_each_image_was_obtained(nv, tmp_path, monkeypatch):
    assert _C.kernel_cache_info() == []
    nv.set_compile_delay(0.02)
    try:
        _C._kernel_image("ring", 90)
    finally:
        nv.set_compile_delay(0)
    info, = _C.kernel_cache_info()
    assert info == {"variant": "ring", "arch": 90, "ptx": False, "source": "compiled",
                    "ms": info["ms"], "nvrtc_version": (13, 0)}
    assert 20 <= info["ms"] < 10_000
    _C._kernel_image("ring", 90)                    # the memory cache: nothing new
    assert _C.kernel_cache_info() == [info]
    info["source"] = "changed"                      # a copy
    assert _C.kernel_cache_info()[0]["source"] == "compiled"
    _C.clear_kernel_cache()
    assert _C.kernel_cache_info() == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _C._kernel_image("ring", 103)               # PTX for compute_100
    _C._kernel_image("ring", 90)                    # the disk cache this time
    got = {(i["arch"], i["ptx"]): i["source"] for i in _C.kernel_cache_info()}
    assert got == {(100, True): "compiled", (90, False): "disk"}
    assert nv.calls("nvrtcCompileProgram") == 2
    monkeypatch.setenv("L2PREFETCH_NO_DISK_CACHE", "1")
    _C.clear_kernel_cache()
    _C._kernel_image("ring", 90)
    assert [i["source"] for i in _C.kernel_cache_info()] == ["compiled"]


def test_kernel_cache_info_of_a_prepared_table(fake, nv):
    PWR([], device=0)
    PWR([], device=0, kernel="load")
    got = sorted((i["variant"], i["source"]) for i in _C.kernel_cache_info())
    assert got == [("load", "compiled"), ("ring", "compiled")]
