"""Why the CUDA driver or NVRTC cannot be used: CudaUnavailableError and its .reason.

The driver is opened on first use, never at import.  The cases that need a
fresh process (no driver opened yet, torch unimportable, NVRTC not loaded) run
in a subprocess; the rest swap drivers in-process with _C._use_driver, which
keeps the old driver when the new one fails.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import l2prefetch
from l2prefetch import _C

# Where this process imported l2prefetch from (the installed package, or python/
# with an in-place build), so that subprocesses import the same one.
PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(l2prefetch.__file__)))

# Prints what the first use of the driver raised, as JSON.
PROBE = textwrap.dedent("""
    import json, l2prefetch
    from l2prefetch import _C
    try:
        {call}
    except l2prefetch.CudaUnavailableError as e:
        print(json.dumps({{"type": type(e).__name__, "reason": getattr(e, "reason", None),
                           "message": str(e), "import_error": isinstance(e, ImportError)}}))
    else:
        print(json.dumps({{"type": None}}))
""")


def run(code, **env):
    return run_lines(code, **env)[-1]


def run_lines(code, timeout=120, **env):
    full = dict(os.environ)
    full["PYTHONPATH"] = os.pathsep.join(p for p in (PYTHON_DIR, os.environ.get("PYTHONPATH")) if p)
    for key, value in env.items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()


def probe(call="_C.driver_info()", timeout=120, **env):
    return json.loads(run_lines(PROBE.format(call=call), timeout=timeout, **env)[-1])


def test_exception_hierarchy():
    assert issubclass(l2prefetch.CudaUnavailableError, ImportError)
    assert issubclass(l2prefetch.CudaError, l2prefetch.Error)
    assert issubclass(l2prefetch.NvrtcError, l2prefetch.Error)
    assert issubclass(l2prefetch.Error, RuntimeError)
    assert not issubclass(l2prefetch.CudaUnavailableError, l2prefetch.Error)


def test_driver_not_found():
    out = probe(L2PREFETCH_LIBCUDA="/nonexistent/libcuda.so.1")
    assert out["type"] == "CudaUnavailableError" and out["import_error"]
    assert out["reason"] == "not_found"
    assert "/nonexistent/libcuda.so.1: not found" in out["message"]
    assert "looked in" in out["message"] and "L2PREFETCH_LIBCUDA" in out["message"]


def test_driver_not_found_default_search():
    out = probe(L2PREFETCH_LIBCUDA=None)
    if out["type"] is None:
        pytest.skip("this machine has a CUDA driver")
    if out["reason"] != "not_found":
        pytest.skip(f"a libcuda.so.1 is here but unusable: {out['reason']}")
    for where in ("libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1",
                  "/usr/lib/wsl/lib/libcuda.so.1"):
        assert where in out["message"]


def test_driver_not_a_library(tmp_path):
    bogus = tmp_path / "libcuda.so.1"
    bogus.write_text("this is not an ELF file\n" * 64)
    out = probe(L2PREFETCH_LIBCUDA=str(bogus))
    assert out["reason"] == "load_failed"
    assert "found but could not be loaded" in out["message"]
    assert str(bogus) in out["message"]
    # the dynamic loader's own words
    assert "ELF" in out["message"] or "too short" in out["message"]


def not_a_file(tmp_path, kind, name):
    """A FIFO or a folder where a library is looked for."""
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    return path


@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize("var, call, reason", [
    ("L2PREFETCH_LIBCUDA", "_C.driver_info()", "load_failed"),
    ("L2PREFETCH_LIBNVRTC", "_C.nvrtc_info()", "nvrtc_load_failed"),
])
def test_library_path_that_is_not_a_regular_file(tmp_path, kind, var, call, reason):
    """issue 21: dlopen() opens its file with a blocking open(), so a FIFO at the path
    hung the process; only a regular file is loaded."""
    path = not_a_file(tmp_path, kind, "libx.so")
    out = probe(call, timeout=30, **{var: str(path)})
    assert (out["type"], out["reason"]) == ("CudaUnavailableError", reason)
    word = "a FIFO" if kind == "fifo" else "a directory"
    assert str(path) in out["message"]
    assert f": not a regular file ({word})" in out["message"]


def test_nvrtc_search_skips_a_fifo(tmp_path):
    """The same in the folders searched for NVRTC (site-packages, CUDA_HOME)."""
    site_dir, cuda = tmp_path / "site", tmp_path / "cuda"
    fifos = [not_a_file(site_dir, "fifo", "nvidia/cu13/lib/libnvrtc.so.13"),
             not_a_file(cuda, "fifo", "lib64/libnvrtc.so.12")]
    code = textwrap.dedent(f"""
        import json, site
        site.getsitepackages = lambda: [{str(site_dir)!r}]
        site.ENABLE_USER_SITE = False
        from l2prefetch import _C, CudaUnavailableError
        try:
            print(json.dumps({{"path": _C.nvrtc_info()["path"]}}))
        except CudaUnavailableError as e:
            print(json.dumps({{"message": str(e), "reason": e.reason}}))
    """)
    out = json.loads(run_lines(code, timeout=30, L2PREFETCH_LIBNVRTC=None, CUDA_HOME=str(cuda),
                               CUDA_PATH=None)[-1])
    if "path" in out:        # found on the loader's path or in /usr/local/cuda
        assert str(tmp_path) not in out["path"], out
        return
    for fifo in fifos:
        assert f"{fifo}: not a regular file (a FIFO)" in out["message"]
    assert out["reason"] == "nvrtc_load_failed"


@pytest.mark.parametrize("var, call, reason", [
    ("L2PREFETCH_LIBCUDA", "_C.driver_info()", "not_found"),
    ("L2PREFETCH_LIBNVRTC", "_C.nvrtc_info()", "nvrtc_not_found"),
])
def test_library_path_that_is_not_utf8(var, call, reason):
    """issue 21: such a path raised UnicodeDecodeError in place of the reason; its bytes
    are shown escaped."""
    path = os.fsdecode(b"/nonexistent/\xff\xfe/libx.so")
    out = probe(call, **{var: path})
    assert (out["type"], out["reason"]) == ("CudaUnavailableError", reason)
    assert "/nonexistent/\\xff\\xfe/libx.so" in out["message"]


def test_info_with_a_driver_path_that_is_not_utf8():
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR,
               L2PREFETCH_LIBCUDA=os.fsdecode(b"/nonexistent/\xff/libcuda.so.1"))
    proc = subprocess.run([sys.executable, "-m", "l2prefetch", "info"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "/nonexistent/\\xff/libcuda.so.1: not found" in proc.stdout


def long_path(tmp_path, total):
    """A folder under tmp_path whose path is about total characters long."""
    folder = str(tmp_path)
    while len(folder) < total:
        folder = os.path.join(folder, "d" * min(200, max(1, total - len(folder) - 1)))
    os.makedirs(folder, exist_ok=True)
    return folder


def test_long_library_paths_are_kept_whole(fake, tmp_path):
    """A driver path of 700 and an NVRTC path of 1100 characters: driver_info() and
    nvrtc_info() used to name them cut to 511 and 1023 characters."""
    from _fakecuda import build_fakenvrtc
    driver = os.path.join(long_path(tmp_path / "a", 700), "libcuda.so.1")
    os.symlink(fake.path, driver)
    nvrtc = build_fakenvrtc(long_path(tmp_path / "b", 1100))
    _C._use_driver(driver)
    assert _C.driver_info()["path"] == driver
    _C._use_nvrtc(nvrtc)
    try:
        assert _C.nvrtc_info()["path"] == nvrtc
    finally:
        _C._use_nvrtc(None)


def test_paths_longer_than_path_max_are_named():
    """No path is cut short to fit a buffer: one that no open() takes is named."""
    too_long = "/" + "x" * 5000
    out = probe(L2PREFETCH_LIBCUDA=too_long + "/libcuda.so.1")
    assert out["reason"] == "not_found"
    assert f"/{'x' * 63}... (5014 bytes): not found: the path is longer than PATH_MAX" in (
        out["message"])
    code = textwrap.dedent("""
        import json, site
        site.getsitepackages = lambda: []
        site.ENABLE_USER_SITE = False
        from l2prefetch import _C, CudaUnavailableError
        try:
            print(json.dumps({"path": _C.nvrtc_info()["path"]}))
        except CudaUnavailableError as e:
            print(json.dumps({"message": str(e), "reason": e.reason}))
    """)
    out = json.loads(run(code, L2PREFETCH_LIBNVRTC=None, CUDA_HOME=too_long, CUDA_PATH=None))
    if "path" in out:
        pytest.skip(f"NVRTC found in /usr/local/cuda or on the loader's path: {out['path']}")
    assert "CUDA_HOME: not searched: its value is longer than PATH_MAX" in out["message"]
    assert too_long[:1000] not in out["message"]


def test_every_use_raises_the_same_way():
    for call in ("_C.device_info(0)", "l2prefetch.PreparedWeightRanges([], device=0)",
                 "l2prefetch.PrefetchController(device=0)"):
        out = probe(call, L2PREFETCH_LIBCUDA="/nonexistent/libcuda.so.1", L2PREFETCH_DISABLE=None)
        assert (out["type"], out["reason"]) == ("CudaUnavailableError", "not_found"), call


def test_import_needs_no_driver_and_no_torch(fakecuda_path):
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # import torch fails
        import l2prefetch
        from l2prefetch import _C
        loaded = open("/proc/self/maps").read()
        assert "libfakecuda" not in loaded, "the driver was loaded at import"
        assert "nvrtc" not in loaded, "NVRTC was loaded at import"
        assert _C.stream_source() == "unresolved"
        print(l2prefetch.__version__)
    """)
    out = run(code, L2PREFETCH_LIBCUDA=fakecuda_path)
    assert out == l2prefetch.__version__


def test_disabled_controller_needs_no_driver():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None
        import l2prefetch
        c = l2prefetch.PrefetchController(device=0)
        print(c.enabled, c.fork("a", 0, 1), c.join())
    """)
    out = run(code, L2PREFETCH_DISABLE="1", L2PREFETCH_LIBCUDA="/nonexistent/libcuda.so.1")
    assert out == "False False None"


def test_no_stream_without_torch(fakecuda_path):
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None
        import l2prefetch
        from l2prefetch import _C
        t = l2prefetch.PreparedWeightRanges([], device=0)
        c = l2prefetch.PrefetchController(device=0)
        c.add("a", 0, 1, t)
        for call in (t.launch, lambda: c.fork("a", 0, 1)):
            try:
                call()
            except RuntimeError as e:
                print("RuntimeError:", e)
        t.launch(stream=0x5000)
        print(c.fork("a", 0, 1, stream=0x5000), _C.stream_source())
    """)
    lines = run_lines(code, L2PREFETCH_LIBCUDA=fakecuda_path, L2PREFETCH_NO_DISK_CACHE="1",
                      L2PREFETCH_DISABLE=None)
    assert lines[-1] == "True unresolved"
    assert len(lines) == 3
    for line in lines[:2]:
        assert line.startswith("RuntimeError: no stream was given and torch is not imported")
        assert "pass stream=" in line


# -- in-process: the stand-in -----------------------------------------------------------------

def test_driver_too_old(fake):
    fake.configure(driver_version=11080)
    with pytest.raises(l2prefetch.CudaUnavailableError) as info:
        _C._use_driver(fake.path)
    assert info.value.reason == "driver_too_old"
    assert "11.8" in str(info.value) and "12.0" in str(info.value)
    # the driver in use is kept
    fake.configure()
    assert _C.driver_info()["version"] == 13000


def test_driver_init_fails_no_device(fake):
    fake.set_uninitialized_error(100)
    with pytest.raises(l2prefetch.CudaUnavailableError) as info:
        _C._use_driver(fake.path)
    assert info.value.reason == "init_failed"
    assert "CUDA_ERROR_NO_DEVICE" in str(info.value)
    assert "cuInit failed" in str(info.value) and "sees no CUDA device" in str(info.value)


def test_driver_init_fails_other(fake):
    fake.set_uninitialized_error("CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(l2prefetch.CudaUnavailableError) as info:
        _C._use_driver(fake.path)
    assert info.value.reason == "init_failed"
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(info.value) and "no CUDA device" not in str(info.value)


def test_driver_init_names_the_call_that_failed(fake):
    # cuInit passes, cuDeviceGetCount fails: the message names cuDeviceGetCount
    fake.fail("cuDeviceGetCount", code="CUDA_ERROR_UNKNOWN")
    with pytest.raises(l2prefetch.CudaUnavailableError) as info:
        _C._use_driver(fake.path)
    assert info.value.reason == "init_failed"
    assert "cuDeviceGetCount failed: CUDA_ERROR_UNKNOWN" in str(info.value)
    assert "cuInit" not in str(info.value)


def test_driver_symbol_missing(fake):
    # the third lookup (cuInit) reports "not found"
    fake.fail("cuGetProcAddress_v2", nth=3, code="CUDA_ERROR_NOT_FOUND")
    with pytest.raises(l2prefetch.CudaUnavailableError) as info:
        _C._use_driver(fake.path)
    assert info.value.reason == "symbol_missing"
    assert "cuInit" in str(info.value)


def test_driver_without_devices(fake):
    fake.configure(device_count=0)
    _C._use_driver(fake.path)
    assert _C.driver_info()["device_count"] == 0
    with pytest.raises(ValueError, match=r"cuda:0 does not exist \(the driver sees 0 devices\)"):
        l2prefetch.PreparedWeightRanges([], device=0)
    with pytest.raises(ValueError, match="cuda:0 does not exist"):
        l2prefetch.PrefetchController(device=0)


def test_use_driver_bad_argument(fake):
    with pytest.raises(TypeError, match="path must be a str or None, not int"):
        _C._use_driver(3)
    assert _C.driver_info()["path"] == fake.path


# -- NVRTC ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, reasons", [
    ("/nonexistent/libnvrtc.so", {"nvrtc_not_found"}),
    ("/etc/hostname", {"nvrtc_load_failed"}),
])
def test_nvrtc_unavailable(path, reasons):
    if not os.path.exists("/etc/hostname") and "hostname" in path:
        pytest.skip("no /etc/hostname")
    out = probe("_C.compile('ring', 90)", L2PREFETCH_LIBNVRTC=path)
    assert out["type"] == "CudaUnavailableError" and out["import_error"]
    assert out["reason"] in reasons
    assert path in out["message"]


def test_nvrtc_error_carries_numbered_source():
    try:
        _C.nvrtc_info()
    except l2prefetch.CudaUnavailableError as exc:
        pytest.skip(f"no NVRTC here: {exc.reason}")
    with pytest.raises(l2prefetch.NvrtcError) as info:
        _C._compile_source("__global__ void k() {}\nint broken = ;\n", ["-DX=1"])
    e = info.value
    assert e.name == "NVRTC_ERROR_COMPILATION" and e.operation == "nvrtcCompileProgram"
    assert e.source == "   1  __global__ void k() {}\n   2  int broken = ;\n"
    assert e.options == ["-DX=1"] and "(2)" in e.log
    assert "options: ['-DX=1']" in str(e) and e.log in str(e)


def test_nvrtc_is_searched_only_under_site_packages(tmp_path):
    """Where NVRTC is looked for when none is loaded: the wheel's folders under each
    site-packages folder, CUDA_HOME, /usr/local/cuda, the loader's path; never under
    the other sys.path entries, of which the working directory is one with `python -m`
    (a planted nvidia/cu13/lib/libnvrtc.so.13 there would be code execution)."""
    site_dir, cwd_dir = tmp_path / "site", tmp_path / "cwd"
    site_dir.mkdir()
    cwd_dir.mkdir()
    code = textwrap.dedent(f"""
        import json, site, sys
        sys.path.insert(0, {str(cwd_dir)!r})
        site.getsitepackages = lambda: [{str(site_dir)!r}]
        site.ENABLE_USER_SITE = False
        from l2prefetch import _C, CudaUnavailableError
        try:
            print(json.dumps({{"path": _C.nvrtc_info()["path"]}}))
        except CudaUnavailableError as e:
            print(json.dumps({{"message": str(e), "reason": e.reason}}))
    """)
    out = json.loads(run(code, L2PREFETCH_LIBNVRTC=None, CUDA_HOME=str(tmp_path / "cuda"),
                         CUDA_PATH=None))
    if "path" in out:        # found on the loader's path or in /usr/local/cuda
        assert not out["path"].startswith(str(cwd_dir)), out
        return
    looked = out["message"]
    assert f"{site_dir}/nvidia/cu13/lib/libnvrtc.so.13: not found" in looked
    assert f"{site_dir}/nvidia/cuda_nvrtc/lib/libnvrtc.so.12: not found" in looked
    assert f"{tmp_path}/cuda/lib64/libnvrtc.so.13: not found" in looked
    assert "/usr/local/cuda/lib64/libnvrtc.so.13" in looked
    assert str(cwd_dir) not in looked and out["reason"] == "nvrtc_not_found"
