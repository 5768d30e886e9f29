"""NVRTC and the kernel cache (csrc/kernels.c, csrc/nvrtc.c).

No GPU needed: NVRTC compiles for any architecture it supports, and the disk
cache is plain files.  Each variant is compiled for sm_80, sm_90 and sm_100
(where its instructions exist) to CUBIN and to PTX; the PTX must contain the
instructions the variant is named for, the ptxas log must show no spills and
no stack frame.  The disk cache is driven through _C._kernel_image with
L2PREFETCH_CACHE_DIR pointing at a temporary folder.
"""

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

import l2prefetch
from l2prefetch import _C

VARIANTS = l2prefetch.kernel_variants()
SMS = [80, 90, 100]
ENTRIES = [f"l2p_prefetch_{cap}" for cap in (8, 32, 128)]
MAGIC = b"L2PCACHE1\n"
ELF = b"\x7fELF"
EM_CUDA = 190
PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(l2prefetch.__file__)))

RING_COPY = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
BULK_PREFETCH = "cp.async.bulk.prefetch.L2.global"
LINE_PREFETCH = "prefetch.global.L2"
LOAD = "ld.global.cg.v4.u32"


def family(name):
    for prefix in ("ring", "bulk_prefetch", "line_prefetch", "load"):
        if name.startswith(prefix):
            return prefix
    raise AssertionError(f"variant {name!r} has no known family")


def compile_cases():
    return [(v, sm) for v in sorted(VARIANTS) for sm in SMS]


@pytest.fixture(scope="module")
def nvrtc():
    return _C.nvrtc_info()


# ------------------------------------------------------------ variants


def test_kernel_variants_listing():
    assert VARIANTS is not l2prefetch.kernel_variants()  # a fresh dict each call
    assert VARIANTS == l2prefetch.kernel_variants()
    assert {"ring", "load"} <= set(VARIANTS)
    # The loaders a user or the tuner chooses between, no sweep leftovers (issue 17).
    assert set(VARIANTS) == {"ring", "bulk_prefetch", "line_prefetch", "load"}
    for name, v in VARIANTS.items():
        assert set(v) >= {"min_sm", "block", "smem", "doc", "defines"}, name
        assert isinstance(v["min_sm"], int) and v["min_sm"] >= 80
        assert v["block"] > 0 and v["block"] % 32 == 0
        assert v["doc"]
        # cp.async.bulk (ring, bulk_prefetch) exists from sm_90 on
        if family(name) in ("ring", "bulk_prefetch"):
            assert v["min_sm"] >= 90, name
        assert f"-DL2P_BLOCK={v['block']}" in v["defines"].split()
        defines = dict(d[2:].split("=") for d in v["defines"].split())
        if family(name) == "ring":  # the shared-memory ring
            assert v["smem"] == int(defines["L2P_CHUNK"]) * int(defines["L2P_STAGES"])
        else:
            assert v["smem"] == 0


# ------------------------------------------------------------ CUBIN


@pytest.mark.parametrize("variant, sm", compile_cases())
def test_compile_cubin(variant, sm):
    v = VARIANTS[variant]
    if sm < v["min_sm"]:
        with pytest.raises(ValueError, match=f"sm_{v['min_sm']}"):
            _C.compile(variant, sm)
        return
    out = _C.compile(variant, sm, ptx=False)
    assert out["variant"] == variant
    assert out["arch"] == sm and out["ptx"] is False
    assert f"--gpu-architecture=sm_{sm}" in out["options"]
    assert set(v["defines"].split()) <= set(out["options"])
    assert out["nvrtc_version"] == tuple(_C.nvrtc_info()["version"])
    image = out["image"]
    assert isinstance(image, bytes) and image.startswith(ELF)
    assert image[4] == 2  # ELFCLASS64
    assert int.from_bytes(image[18:20], "little") == EM_CUDA
    for entry in ENTRIES:
        assert entry.encode() in image
    log = out["log"]
    if "ptxas" not in log:
        # Seen on the H200 image (torch's NVRTC 13.0, loaded first): --ptxas-options=-v
        # leaves the program log empty there.  The pip wheel's NVRTC writes it.
        pytest.skip(f"NVRTC at {_C.nvrtc_info()['path']} puts no ptxas report in the log")
    for entry in ENTRIES:
        assert f"Compiling entry function '{entry}' for 'sm_{sm}'" in log
    regs = [int(n) for n in re.findall(r"Used (\d+) registers", log)]
    assert len(regs) == len(ENTRIES) and all(0 < r <= 255 for r in regs)
    assert log.count("0 bytes spill stores") == len(ENTRIES)
    assert log.count("0 bytes spill loads") == len(ENTRIES)
    assert log.count("0 bytes stack frame") == len(ENTRIES)
    assert not re.search(r"[1-9]\d* bytes (spill|stack)", log)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_compile_below_min_sm(variant):
    min_sm = VARIANTS[variant]["min_sm"]
    with pytest.raises(ValueError, match=f"needs sm_{min_sm}"):
        _C.compile(variant, min_sm - 1)
    with pytest.raises(ValueError):
        _C.compile(variant, 70, ptx=True)


def test_compile_argument_errors():
    with pytest.raises(ValueError, match="unknown kernel variant"):
        _C.compile("no_such_variant", 90)
    with pytest.raises(TypeError, match="int"):
        _C.compile(5, 90)
    with pytest.raises(TypeError, match=r"compile\(\) missing required argument 'sm' \(pos 2\)"):
        _C.compile("load")
    with pytest.raises(TypeError, match=r"compile\(\) got an unexpected keyword argument 'bogus'"):
        _C.compile("load", 90, bogus=True)
    with pytest.raises(TypeError, match=r"compile\(\) got multiple values for argument 'variant'"):
        _C.compile("load", 90, variant="ring")
    with pytest.raises(TypeError, match=r"compile\(\) takes exactly 2 positional arguments \(3 given\)"):
        _C.compile("load", 90, True)
    out = _C.compile(variant="load", sm=90, ptx=True)
    assert out["ptx"] is True


@pytest.mark.parametrize("sm", [91, 95, 99])
def test_compile_unsupported_sm_falls_back_to_ptx(sm, nvrtc):
    if sm in nvrtc["archs"]:
        pytest.skip(f"this NVRTC builds sm_{sm} itself")
    best = max(a for a in nvrtc["archs"] if a <= sm)
    out = _C.compile("load", sm)
    assert out["arch"] == best and out["ptx"] is True
    assert f"--gpu-architecture=compute_{best}" in out["options"]
    assert not out["image"].startswith(ELF)
    assert f".target sm_{best}" in out["image"].decode()


# ------------------------------------------------------------ PTX


EXPECTED = {
    "ring": [RING_COPY, "mbarrier.try_wait", "mbarrier.init", "mbarrier.arrive.expect_tx"],
    "bulk_prefetch": [BULK_PREFETCH],
    "line_prefetch": [LINE_PREFETCH],
    "load": [LOAD],
}
ABSENT = {
    "ring": [BULK_PREFETCH, LINE_PREFETCH, LOAD],
    "bulk_prefetch": [RING_COPY, "mbarrier", LINE_PREFETCH, LOAD],
    "line_prefetch": ["cp.async.bulk", "mbarrier", LOAD],
    "load": ["cp.async.bulk", "mbarrier", LINE_PREFETCH],
}


@pytest.mark.parametrize("variant, sm", [(v, sm) for v, sm in compile_cases()
                                         if sm >= VARIANTS[v]["min_sm"]])
def test_compile_ptx_has_the_variants_instructions(variant, sm):
    v = VARIANTS[variant]
    out = _C.compile(variant, sm, ptx=True)
    assert out["ptx"] is True and out["arch"] == sm
    assert f"--gpu-architecture=compute_{sm}" in out["options"]
    image = out["image"]
    assert not image.startswith(ELF)
    text = image.rstrip(b"\0").decode("ascii")
    assert f".target sm_{sm}" in text
    for entry in ENTRIES:
        assert re.search(rf"\.visible \.entry {entry}\(", text), entry
    # __launch_bounds__(L2P_BLOCK) on every entry
    bounds = re.findall(r"^\.maxntid (\d+)(?:, 1, 1)?\s*$", text, re.M)
    assert bounds == [str(v["block"])] * len(ENTRIES)
    fam = family(variant)
    for needle in EXPECTED[fam]:
        assert needle in text, needle
    for needle in ABSENT[fam]:
        assert needle not in text, needle
    assert "evict_last" not in text and "L2::cache_hint" not in text
    if fam == "ring":
        stages = int(dict(d[2:].split("=") for d in v["defines"].split())["L2P_STAGES"])
        # one mbarrier per stage, in static shared memory
        assert re.search(rf"\.shared \.align 8 \.b8 \S+\[{8 * stages}\]", text), stages


# ------------------------------------------------------------ disk cache


def cache_files(folder):
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def parse_cache_file(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data.startswith(MAGIC), data[:16]
    digest, payload = data[len(MAGIC):len(MAGIC) + 64], data[len(MAGIC) + 65:]
    assert data[len(MAGIC) + 64:len(MAGIC) + 65] == b"\n"
    assert digest == hashlib.sha256(payload).hexdigest().encode()
    return payload


def write_cache_file(path, payload):
    with open(path, "wb") as f:
        f.write(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "kcache"
    monkeypatch.setenv("L2PREFETCH_CACHE_DIR", str(folder))
    monkeypatch.delenv("L2PREFETCH_NO_DISK_CACHE", raising=False)
    _C.clear_kernel_cache()
    yield str(folder)
    _C.clear_kernel_cache()


def expected_name(variant, sm):
    major, minor = _C.nvrtc_info()["version"]
    return re.compile(rf"prefetch-{re.escape(variant)}-sm_{sm}-nvrtc{major}\.{minor}-[0-9a-f]{{16}}\.cubin")


CACHE_CASES = [("load", 80), ("line_prefetch", 90), ("ring", 90), ("bulk_prefetch", 100)]


@pytest.mark.parametrize("variant, sm", CACHE_CASES)
def test_first_call_writes_one_named_file(cache, variant, sm):
    image, is_ptx = _C._kernel_image(variant, sm)
    assert is_ptx is False and image.startswith(ELF)
    files = cache_files(cache)
    assert len(files) == 1 and expected_name(variant, sm).fullmatch(files[0]), files
    assert parse_cache_file(os.path.join(cache, files[0])) == image
    # the same binary that compile() builds
    assert image == _C.compile(variant, sm)["image"]


@pytest.mark.parametrize("variant, sm", CACHE_CASES)
def test_second_call_reads_the_disk(cache, variant, sm):
    image, _ = _C._kernel_image(variant, sm)
    (name,) = cache_files(cache)
    path = os.path.join(cache, name)
    before = os.stat(path)
    time.sleep(0.01)
    _C.clear_kernel_cache()
    again, is_ptx = _C._kernel_image(variant, sm)
    assert again == image and again is not image and is_ptx is False
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
        before.st_ino, before.st_mtime_ns, before.st_size)
    assert cache_files(cache) == [name]
    # Prove the hit: a valid file around another payload comes back as is.
    planted = b"not a cubin, but the cache's own " + variant.encode()
    write_cache_file(path, planted)
    _C.clear_kernel_cache()
    assert _C._kernel_image(variant, sm) == (planted, False)
    assert parse_cache_file(path) == planted  # not rewritten


def _truncate(data):
    return data[:len(data) // 2]


def _bad_hash(data):
    digest = data[len(MAGIC):len(MAGIC) + 64]
    flipped = bytes([digest[0] ^ 1]) + digest[1:]
    return data[:len(MAGIC)] + flipped + data[len(MAGIC) + 64:]


def _flip_payload(data):
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def _extra_byte(data):
    return data + b"\0"


def _bad_magic(data):
    return b"L2PCACHE2\n" + data[len(MAGIC):]


def _header_only(data):
    return data[:len(MAGIC) + 65]


def _no_newline(data):
    return data[:len(MAGIC) + 64] + b" " + data[len(MAGIC) + 65:]


CORRUPTIONS = {
    "truncated": _truncate,
    "truncated_header": lambda d: d[:40],
    "header_only": _header_only,
    "bad_hash": _bad_hash,
    "flipped_payload": _flip_payload,
    "extra_byte": _extra_byte,
    "bad_magic": _bad_magic,
    "no_newline": _no_newline,
    "garbage": lambda d: os.urandom(len(d)),
    "empty": lambda d: b"",
    "raw_cubin": lambda d: d[len(MAGIC) + 65:],
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_file_is_recompiled_and_replaced(cache, corruption):
    image, _ = _C._kernel_image("load", 90)
    (name,) = cache_files(cache)
    path = os.path.join(cache, name)
    with open(path, "rb") as f:
        good = f.read()
    with open(path, "wb") as f:
        f.write(CORRUPTIONS[corruption](good))
    _C.clear_kernel_cache()
    again, is_ptx = _C._kernel_image("load", 90)
    assert again == image and is_ptx is False
    assert cache_files(cache) == [name]
    assert parse_cache_file(path) == image
    with open(path, "rb") as f:
        assert f.read() == good


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_no_disk_cache_writes_nothing(cache, monkeypatch, value):
    monkeypatch.setenv("L2PREFETCH_NO_DISK_CACHE", value)
    image, _ = _C._kernel_image("load", 90)
    assert image.startswith(ELF)
    assert cache_files(cache) == []
    assert not os.path.exists(cache)


def test_no_disk_cache_ignores_existing_file(cache, monkeypatch):
    image, _ = _C._kernel_image("load", 90)
    (name,) = cache_files(cache)
    write_cache_file(os.path.join(cache, name), b"planted")
    monkeypatch.setenv("L2PREFETCH_NO_DISK_CACHE", "1")
    _C.clear_kernel_cache()
    assert _C._kernel_image("load", 90)[0] == image


@pytest.mark.parametrize("value", ["0", "", "no"])
def test_no_disk_cache_off_values_still_write(cache, monkeypatch, value):
    monkeypatch.setenv("L2PREFETCH_NO_DISK_CACHE", value)
    _C._kernel_image("load", 90)
    assert len(cache_files(cache)) == 1


def test_xdg_cache_home_is_the_fallback(tmp_path, monkeypatch):
    monkeypatch.delenv("L2PREFETCH_CACHE_DIR", raising=False)
    monkeypatch.delenv("L2PREFETCH_NO_DISK_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _C.clear_kernel_cache()
    try:
        _C._kernel_image("load", 90)
    finally:
        _C.clear_kernel_cache()
    files = cache_files(str(tmp_path / "xdg" / "l2prefetch"))
    assert len(files) == 1 and expected_name("load", 90).fullmatch(files[0])


def test_in_process_cache_returns_the_same_object(cache):
    first = _C._kernel_image("line_prefetch", 90)
    second = _C._kernel_image("line_prefetch", 90)
    assert first[0] is second[0]
    # ... and does not touch the disk: the file can go away
    for name in cache_files(cache):
        os.unlink(os.path.join(cache, name))
    assert _C._kernel_image("line_prefetch", 90)[0] is first[0]
    assert cache_files(cache) == []
    _C.clear_kernel_cache()
    third = _C._kernel_image("line_prefetch", 90)
    assert third[0] is not first[0] and third[0] == first[0]
    assert len(cache_files(cache)) == 1


def test_different_variants_and_archs_get_different_files(cache):
    cases = [("load", 80), ("load", 90), ("line_prefetch", 90), ("bulk_prefetch", 90),
             ("ring", 90), ("ring", 100)]
    images = {case: _C._kernel_image(*case)[0] for case in cases}
    files = cache_files(cache)
    assert len(files) == len(cases)
    for (variant, sm), image in images.items():
        matches = [f for f in files if expected_name(variant, sm).fullmatch(f)]
        assert len(matches) == 1, (variant, sm, files)
        assert parse_cache_file(os.path.join(cache, matches[0])) == image
    hashes = {f.rsplit("-", 1)[1] for f in files}
    assert len(hashes) == len(cases)
    assert len(set(images.values())) == len(cases)


def test_cache_folder_is_created(tmp_path, monkeypatch):
    deep = tmp_path / "a" / "b" / "c"
    monkeypatch.setenv("L2PREFETCH_CACHE_DIR", str(deep))
    monkeypatch.delenv("L2PREFETCH_NO_DISK_CACHE", raising=False)
    _C.clear_kernel_cache()
    try:
        _C._kernel_image("load", 90)
    finally:
        _C.clear_kernel_cache()
    assert len(cache_files(str(deep))) == 1


def run_python(code, env_extra, timeout=120):
    env = dict(os.environ)
    env.pop("L2PREFETCH_NO_DISK_CACHE", None)
    env["PYTHONPATH"] = PYTHON_DIR + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


UNWRITABLE_SCRIPT = """
    import json, warnings
    from l2prefetch import _C
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        images = [_C._kernel_image(v, 90)[0] for v in ("load", "line_prefetch", "load")]
        _C.clear_kernel_cache()
        images.append(_C._kernel_image("load", 90)[0])
    print(json.dumps({
        "elf": [i[:4] == b"\\x7fELF" for i in images],
        "same": images[0] == images[2] == images[3],
        "warnings": [[w.category.__name__, str(w.message)] for w in caught],
    }))
"""


@pytest.mark.parametrize("where", ["under_a_file", "is_a_file", "read_only"])
def test_unwritable_cache_warns_once(tmp_path, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file")
    if where == "under_a_file":
        folder = blocker / "kcache"
    elif where == "is_a_file":
        folder = blocker
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
    proc = run_python(UNWRITABLE_SCRIPT, {"L2PREFETCH_CACHE_DIR": str(folder)})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(result["elf"]) and result["same"]
    assert len(result["warnings"]) == 1, result["warnings"]
    category, message = result["warnings"][0]
    assert category == "RuntimeWarning"
    assert "cache" in message and str(blocker if where != "read_only" else folder) in message
    assert blocker.read_text() == "a regular file"


CONCURRENT_SCRIPT = """
    import hashlib, sys, time
    from l2prefetch import _C
    start = float(sys.argv[1])
    while time.time() < start:
        pass
    image, is_ptx = _C._kernel_image("ring", 90)
    print(hashlib.sha256(image).hexdigest(), is_ptx)
"""


@pytest.mark.parametrize("round_", range(2))
def test_concurrent_writers(tmp_path, round_):
    folder = tmp_path / "shared-cache"
    env = dict(os.environ)
    env.pop("L2PREFETCH_NO_DISK_CACHE", None)
    env["PYTHONPATH"] = PYTHON_DIR + os.pathsep + env.get("PYTHONPATH", "")
    env["L2PREFETCH_CACHE_DIR"] = str(folder)
    start = time.time() + 1.5  # past every child's import
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(CONCURRENT_SCRIPT),
                               str(start)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "Warning" not in err, err
    digests = {out.split()[0] for out, _ in outs}
    assert len(digests) == 1 and all(out.split()[1] == "False" for out, _ in outs)
    files = cache_files(str(folder))
    assert len(files) == 1, files
    assert expected_name("ring", 90).fullmatch(files[0])
    assert not [f for f in files if f.endswith(".tmp")]
    payload = parse_cache_file(str(folder / files[0]))
    assert hashlib.sha256(payload).hexdigest() == digests.pop()


# ------------------------------------------------------------ NVRTC errors


@pytest.mark.parametrize("line", [1, 3, 7])
def test_nvrtc_syntax_error(line):
    body = ["// filler"] * 9
    body[line - 1] = "extern \"C\" __global__ void k(int *p) { p[0] = ; }"
    source = "\n".join(body) + "\n"
    options = ["--gpu-architecture=sm_90", "-std=c++17"]
    with pytest.raises(l2prefetch.NvrtcError) as info:
        _C._compile_source(source, options)
    exc = info.value
    assert isinstance(exc, l2prefetch.Error)
    assert exc.name == "NVRTC_ERROR_COMPILATION"
    assert exc.code == 6
    assert exc.operation == "nvrtcCompileProgram"
    assert f"prefetch.cu({line})" in exc.log
    assert "expected an expression" in exc.log
    assert exc.options == options
    assert exc.log in str(exc)
    assert "nvrtcCompileProgram failed: NVRTC_ERROR_COMPILATION" in str(exc)
    assert repr(options) in str(exc)


@pytest.mark.parametrize("line", [1, 3, 7])
def test_nvrtc_error_carries_numbered_source(line):
    body = [f"// line {i}" for i in range(1, 10)]
    body[line - 1] = "__global__ void k(int *p) { p[0] = ; }"
    source = "\n".join(body) + "\n"
    with pytest.raises(l2prefetch.NvrtcError) as info:
        _C._compile_source(source, ["--gpu-architecture=sm_90"])
    lines = info.value.source.splitlines()
    assert len(lines) == 9
    for i, text in enumerate(body, 1):
        assert lines[i - 1] == f"{i:4d}  {text}"
    assert f"   {line}  __global__ void k" in info.value.source


def test_nvrtc_bad_option():
    options = ["--gpu-architecture=sm_90", "--no-such-option"]
    with pytest.raises(l2prefetch.NvrtcError) as info:
        _C._compile_source('extern "C" __global__ void k() {}\n', options)
    assert info.value.name == "NVRTC_ERROR_INVALID_OPTION"
    assert info.value.options == options


def test_compile_source_success():
    image = _C._compile_source('extern "C" __global__ void k(int *p) { p[0] = 1; }\n',
                               ["--gpu-architecture=sm_90"])
    assert image.startswith(ELF) and b"k" in image


@pytest.mark.parametrize("args", [(b"src", []), ("src", ("--x",)), ("src",), ("src", ["-a", 5])])
def test_compile_source_argument_errors(args):
    with pytest.raises(TypeError):
        _C._compile_source(*args)


def test_nvrtc_info(nvrtc):
    assert os.path.exists(nvrtc["path"]) or nvrtc["path"].startswith("libnvrtc")
    major, minor = nvrtc["version"]
    assert major >= 12 and minor >= 0
    archs = nvrtc["archs"]
    assert archs == sorted(archs) and len(set(archs)) == len(archs)
    assert {80, 90, 100} <= set(archs)
    assert _C.nvrtc_info() == nvrtc
    assert f"libnvrtc.so.{major}" in nvrtc["path"]
