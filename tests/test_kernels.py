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
import shutil
import stat
import subprocess
import sys
import textwrap
import time

import pytest

import l2prefetch
from l2prefetch import _C
from _fakecuda import build_fakenvrtc

VARIANTS = l2prefetch.kernel_variants()
SMS = [80, 90, 100]
ENTRIES = [f"l2p_prefetch_{cap}" for cap in (8, 32, 128)]
MAGIC = b"L2PCACHE2\n"
HEAD = len(MAGIC) + 65  # the magic, the SHA-256 in hex, "\n"
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


def read_cache_file(path):
    """(key, payload) of a cache file, its format checked: the magic, the SHA-256 (hex) of
    everything after that line, then the key line and the payload."""
    with open(path, "rb") as f:
        data = f.read()
    assert data.startswith(MAGIC), data[:16]
    digest, body = data[len(MAGIC):len(MAGIC) + 64], data[HEAD:]
    assert data[HEAD - 1:HEAD] == b"\n"
    assert digest == hashlib.sha256(body).hexdigest().encode()
    key, newline, payload = body.partition(b"\n")
    assert newline and payload
    return key, payload


def parse_cache_file(path):
    return read_cache_file(path)[1]


def cache_file_bytes(key, payload):
    body = key + b"\n" + payload
    return MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def write_cache_file(path, payload, key=None):
    """A well-formed cache file around payload, for key (default: the key of the file
    already at path)."""
    if key is None:
        key = read_cache_file(path)[0]
    with open(path, "wb") as f:
        f.write(cache_file_bytes(key, payload))
    os.chmod(path, 0o600)   # as the cache makes them, whatever the umask


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
    os.utime(path, ns=(10**18, 10**18))   # a known mtime (2001) that a rewrite would replace
    before = os.stat(path)
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


def _bad_magic(data):  # the format before the key was inside
    return b"L2PCACHE1\n" + data[len(MAGIC):]


def _header_only(data):
    return data[:HEAD]


def _no_newline(data):
    return data[:HEAD - 1] + b" " + data[HEAD:]


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
    "raw_cubin": lambda d: d[d.index(b"\n", HEAD) + 1:],
    "key_only": lambda d: d[:d.index(b"\n", HEAD) + 1],
}


# the warning (once per process) is asserted in a fresh process below
@pytest.mark.filterwarnings("ignore:l2prefetch. kernel cache file:RuntimeWarning")
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


# ------------------------------------------------ disk cache: what it trusts (issue 21)

SCENARIO_SCRIPT = """
    import hashlib, json, sys, warnings
    from l2prefetch import _C
    cases = json.loads(sys.argv[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        images = [_C._kernel_image(variant, sm)[0] for variant, sm in cases]
    print(json.dumps({
        "sha": [hashlib.sha256(i).hexdigest() for i in images],
        "source": [i["source"] for i in _C.kernel_cache_info()],
        "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
    }))
"""


def images_in_a_new_process(folder, cases=(("load", 90),), timeout=60):
    """What a fresh process (no memory cache, no warning given yet) gets for cases with
    L2PREFETCH_CACHE_DIR=folder: the images' SHA-256, how each was obtained, the
    RuntimeWarnings.  The timeout catches a read that blocks (a FIFO)."""
    env = dict(os.environ, L2PREFETCH_CACHE_DIR=str(folder),
               PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("L2PREFETCH_NO_DISK_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCENARIO_SCRIPT),
                           json.dumps(cases)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sha(data):
    return hashlib.sha256(data).hexdigest()


def file_of(folder, variant, sm):
    (name,) = [f for f in cache_files(folder) if expected_name(variant, sm).fullmatch(f)]
    return os.path.join(folder, name)


def source_hash():
    """The SHA-256 of the kernel source as setup.py embeds it (one line per line)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the checkout
    with open(os.path.join(root, "kernels", "prefetch.cu"), encoding="utf-8") as f:
        text = "".join(line + "\n" for line in f.read().splitlines())
    return sha(text.encode())


@pytest.mark.parametrize("variant, sm", CACHE_CASES)
def test_the_key_in_the_file_is_the_one_its_name_stands_for(cache, variant, sm):
    image, _ = _C._kernel_image(variant, sm)
    path = file_of(cache, variant, sm)
    key, payload = read_cache_file(path)
    major, minor = _C.nvrtc_info()["version"]
    options = " ".join(_C.compile(variant, sm)["options"])
    lib = os.stat(_C.nvrtc_info()["path"])   # the library NVRTC was loaded from
    assert key.decode() == (f"l2prefetch kernel cache 2|variant {variant}|sm_{sm}|"
                            f"nvrtc {major}.{minor} ({lib.st_size} bytes, "
                            f"{lib.st_mtime_ns // 10**9}.{lib.st_mtime_ns % 10**9:09d})|"
                            f"source {source_hash()}|options {options}")
    assert path.endswith(f"-{sha(key)[:16]}.cubin")
    assert payload == image


def test_a_file_renamed_onto_another_variants_name_is_not_served(cache):
    """issue 21: the ring cubin under load's name was served as load's ('disk')."""
    _C._kernel_image("ring", 90)
    load, _ = _C._kernel_image("load", 90)
    load_path = file_of(cache, "load", 90)
    os.replace(file_of(cache, "ring", 90), load_path)
    out = images_in_a_new_process(cache)
    assert out["sha"] == [sha(load)] and out["source"] == ["compiled"]
    assert out["warnings"] == [f"l2prefetch: kernel cache file {load_path} was made for another "
                               "kernel (its key is not this file name's); compiling the kernel "
                               "and replacing it"]
    key, payload = read_cache_file(load_path)
    assert payload == load and b"|variant load|" in key


@pytest.mark.parametrize("planted", ["old_format", "key_of_ring", "no_key"])
def test_a_planted_file_carrying_its_own_hash_is_not_served(cache, planted):
    """issue 21: L2PCACHE1 + sha256(payload) + payload was served as verified."""
    _C._kernel_image("ring", 90)
    load, _ = _C._kernel_image("load", 90)
    path = file_of(cache, "load", 90)
    payload = b"\x7fELF planted " * 64
    if planted == "old_format":
        data = b"L2PCACHE1\n" + sha(payload).encode() + b"\n" + payload
    elif planted == "key_of_ring":
        data = cache_file_bytes(read_cache_file(file_of(cache, "ring", 90))[0], payload)
    else:
        data = MAGIC + sha(payload).encode() + b"\n" + payload
    with open(path, "wb") as f:
        f.write(data)
    out = images_in_a_new_process(cache)
    assert out["sha"] == [sha(load)] and out["source"] == ["compiled"]
    assert len(out["warnings"]) == 1 and path in out["warnings"][0]
    assert parse_cache_file(path) == load


def _fifo(path):
    os.mkfifo(path)


def _directory(path):
    os.mkdir(path)


def _link_to_a_good_copy(path):
    copy = path + ".elsewhere"
    os.rename(path, copy)
    os.symlink(copy, path)


def _dangling_link(path):
    os.symlink(path + ".nowhere", path)


def _oversized(path):
    write_cache_file(path, b"\0" * (16 << 20))


def _writable_by_others(path):
    os.chmod(path, 0o666)


def _writable_by_the_group(path):
    os.chmod(path, 0o620)


def _owned_by_another_user(path):
    if os.geteuid() != 0:
        pytest.skip("only root can give a file away")
    os.chown(path, 65534, 65534)


NOT_OURS = {  # what is put at a cache file's name -> what the warning says
    "fifo": (_fifo, "is not a regular file"),
    "directory": (_directory, "is not a regular file"),
    "link_to_a_good_copy": (_link_to_a_good_copy, "is a symbolic link"),
    "dangling_link": (_dangling_link, "is a symbolic link"),
    "oversized": (_oversized, "is larger than any kernel image (16 MiB)"),
    "writable_by_others": (_writable_by_others, "is writable by its group or by others"),
    "writable_by_the_group": (_writable_by_the_group, "is writable by its group or by others"),
    "owned_by_another_user": (_owned_by_another_user, "is owned by another user"),
}


@pytest.mark.parametrize("kind", sorted(NOT_OURS))
def test_only_a_regular_file_of_ours_is_read(cache, kind):
    """issue 21: a FIFO at a cache file's name hung the read; a link was followed.  Each
    of these is a miss with a warning naming the file, then replaced by a regular file
    (a directory cannot be replaced: the write warns too)."""
    image, _ = _C._kernel_image("load", 90)
    line, _ = _C._kernel_image("line_prefetch", 90)
    path = file_of(cache, "load", 90)
    make, why = NOT_OURS[kind]
    if kind not in ("fifo", "directory", "dangling_link"):
        write_cache_file(path, b"planted payload")   # a valid file of the key, not ours
    else:
        os.unlink(path)
    make(path)
    # a second bad file: the warning about files is given once
    write_cache_file(file_of(cache, "line_prefetch", 90), b"x", key=b"another key")
    out = images_in_a_new_process(cache, [("load", 90), ("line_prefetch", 90)])
    assert out["sha"] == [sha(image), sha(line)]
    assert out["source"] == ["compiled", "compiled"]
    expected = [f"l2prefetch: kernel cache file {path} {why}; compiling the kernel and "
                "replacing it"]
    if kind == "directory":
        assert out["warnings"][0] == expected[0]
        assert len(out["warnings"]) == 2 and f"{path} cannot be written" in out["warnings"][1]
        assert os.path.isdir(path)
        return
    assert out["warnings"] == expected
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) & 0o077 == 0
    assert parse_cache_file(path) == image
    if kind == "link_to_a_good_copy":   # the link's target is left alone
        assert parse_cache_file(path + ".elsewhere") == b"planted payload"


def test_a_symlink_at_the_temporary_name_is_not_followed(cache, tmp_path):
    """issue 21: the temporary file (then <name>.<pid>.tmp) was opened with fopen("wb"),
    which wrote through a planted link into its target, and the link was renamed into
    place."""
    image, _ = _C._kernel_image("load", 90)
    path = file_of(cache, "load", 90)
    os.unlink(path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, f"{path}.{os.getpid()}.tmp")
    _C.clear_kernel_cache()
    again, _ = _C._kernel_image("load", 90)
    assert again == image
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(path) and parse_cache_file(path) == image
    assert not [f for f in cache_files(cache) if f.endswith(".tmp") and
                not os.path.islink(os.path.join(cache, f))]


def _plant_in(folder):
    """A valid file of load's key around a payload of our choosing (the hit we must not
    get from a folder the cache does not trust)."""
    _C._kernel_image("load", 90)
    path = file_of(folder, "load", 90)
    write_cache_file(path, b"planted by someone else")
    return path


@pytest.mark.parametrize("mode, trusted", [
    pytest.param(mode, trusted, id=oct(mode))
    for mode, trusted in [(0o700, True), (0o755, True), (0o555, True), (0o777, False),
                          (0o1777, False), (0o775, False), (0o1770, False), (0o757, False)]])
def test_a_folder_others_can_write_is_not_used(cache, mode, trusted):
    image, _ = _C._kernel_image("load", 90)
    planted = _plant_in(cache)
    os.chmod(cache, mode)
    try:
        out = images_in_a_new_process(cache)
    finally:
        os.chmod(cache, 0o755)
    if trusted:
        assert out["source"] == ["disk"] and out["sha"] == [sha(b"planted by someone else")]
        assert out["warnings"] == []
        return
    assert out["sha"] == [sha(image)] and out["source"] == ["compiled"]
    assert out["warnings"] == [
        f"l2prefetch: kernel cache folder {cache} (from L2PREFETCH_CACHE_DIR) is writable by "
        "its group or by others; going on without the disk cache (set L2PREFETCH_CACHE_DIR, "
        "or L2PREFETCH_NO_DISK_CACHE=1 to silence)"]
    assert cache_files(cache) == [os.path.basename(planted)]   # nothing written there
    assert parse_cache_file(planted) == b"planted by someone else"


def test_a_folder_of_another_user_is_not_used(cache):
    if os.geteuid() != 0:
        pytest.skip("only root can give a folder away")
    image, _ = _C._kernel_image("load", 90)
    _plant_in(cache)
    os.chown(cache, 65534, 65534)
    out = images_in_a_new_process(cache)
    assert out["sha"] == [sha(image)] and out["source"] == ["compiled"]
    assert len(out["warnings"]) == 1
    assert f"folder {cache} (from L2PREFETCH_CACHE_DIR) is owned by another user" in (
        out["warnings"][0])


def test_a_link_to_a_folder_of_ours_is_followed(cache, tmp_path):
    """The folder's path may go through links (~/.cache on another disk): what is
    checked is the folder it leads to."""
    image, _ = _C._kernel_image("load", 90)
    link = tmp_path / "link-to-kcache"
    os.symlink(cache, link)
    out = images_in_a_new_process(link)
    assert out["source"] == ["disk"] and out["sha"] == [sha(image)] and out["warnings"] == []


def long_folder(base, total):
    """A folder path under base about total characters long (components of 200)."""
    folder = str(base)
    while len(folder) < total:
        folder = os.path.join(folder, "d" * min(200, max(1, total - len(folder) - 1)))
    return folder


def test_a_long_cache_folder_is_used(tmp_path, monkeypatch):
    """issue 21: a folder of more than 1023 characters turned the disk cache off
    silently."""
    folder = long_folder(tmp_path, 1500)
    monkeypatch.setenv("L2PREFETCH_CACHE_DIR", folder)
    monkeypatch.delenv("L2PREFETCH_NO_DISK_CACHE", raising=False)
    _C.clear_kernel_cache()
    try:
        image, _ = _C._kernel_image("load", 90)
    finally:
        _C.clear_kernel_cache()
    assert parse_cache_file(file_of(folder, "load", 90)) == image


def test_a_cache_folder_longer_than_path_max_is_named(tmp_path):
    folder = "/" + "x" * 5000
    out = images_in_a_new_process(folder)
    assert out["source"] == ["compiled"]
    assert out["warnings"] == [
        "l2prefetch: the kernel cache folder from L2PREFETCH_CACHE_DIR is 5001 bytes long, "
        f"longer than any path this system opens (PATH_MAX {os.pathconf('/', 'PC_PATH_MAX')}); "
        "going on without the disk cache (set L2PREFETCH_CACHE_DIR, or "
        "L2PREFETCH_NO_DISK_CACHE=1 to silence)"]


PREPARED_FIFO_SCRIPT = """
    import os, sys, warnings
    sys.path.insert(0, sys.argv[1])
    from conftest import FakeArray, device_ptr
    import l2prefetch
    from l2prefetch import _C
    _C._use_driver(sys.argv[2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = l2prefetch.PreparedWeightRanges([FakeArray(device_ptr(0), (64,))], kernel="load")
    print(t.nbytes, [str(w.message) for w in caught])
"""


def test_prepared_table_with_a_fifo_in_the_cache(cache, fakecuda_path):
    """issue 21: PreparedWeightRanges (and from_plan, from_profile, which make them) hung
    on a FIFO at the kernel's cache file."""
    _C._kernel_image("load", 90)             # the stand-in's GPU is sm_90
    path = file_of(cache, "load", 90)
    os.unlink(path)
    os.mkfifo(path)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(PREPARED_FIFO_SCRIPT),
                           os.path.dirname(os.path.abspath(__file__)), fakecuda_path],
                          env=dict(os.environ, L2PREFETCH_CACHE_DIR=cache,
                                   PYTHONPATH=PYTHON_DIR), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("128 ") and f"{path} is not a regular file" in proc.stdout
    assert stat.S_ISREG(os.lstat(path).st_mode)


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


@pytest.mark.parametrize("bad, name", [(5, "int"), (b"-a", "bytes"), (None, "NoneType")])
def test_compile_source_names_an_option_of_the_wrong_type(bad, name):
    with pytest.raises(TypeError, match=f"^NVRTC options must be str, not {name}$"):
        _C._compile_source("src", ["--gpu-architecture=sm_90", bad])


def test_nvrtc_info(nvrtc):
    assert os.path.exists(nvrtc["path"]) or nvrtc["path"].startswith("libnvrtc")
    major, minor = nvrtc["version"]
    assert major >= 12 and minor >= 0
    archs = nvrtc["archs"]
    assert archs == sorted(archs) and len(set(archs)) == len(archs)
    assert {80, 90, 100} <= set(archs)
    assert _C.nvrtc_info() == nvrtc
    assert f"libnvrtc.so.{major}" in nvrtc["path"]


def test_the_disk_cache_is_bound_to_the_nvrtc_build_not_only_its_version(tmp_path, monkeypatch):
    """Another NVRTC build of the same version (a patch release, another toolkit's) is
    not served the first one's CUBIN from disk: the key holds the library file's identity.
    Here the stand-in NVRTC and a copy of it one byte longer, reporting the same 13.0."""
    first = build_fakenvrtc(str(tmp_path / "a"))
    second = str(tmp_path / "b" / os.path.basename(first))
    os.makedirs(os.path.dirname(second))
    shutil.copyfile(first, second)
    with open(second, "ab") as f:
        f.write(b"\0")
    monkeypatch.setenv("L2PREFETCH_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.delenv("L2PREFETCH_NO_DISK_CACHE", raising=False)
    try:
        _C._use_nvrtc(first)
        _C.clear_kernel_cache()
        _C._kernel_image("ring", 90)
        _C._use_nvrtc(second)
        _C.clear_kernel_cache()
        _C._kernel_image("ring", 90)
        info, = _C.kernel_cache_info()
        assert _C.nvrtc_info()["path"] == second
        assert info["source"] == "compiled", info
    finally:
        _C._use_nvrtc(None)
        _C.clear_kernel_cache()
