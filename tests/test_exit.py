"""Leaving the interpreter with live objects: no crash, no unraisable warning, nothing left.

Each case runs in a fresh interpreter that uses both stand-ins (the driver with
_C._use_driver, NVRTC with _C._use_nvrtc), makes a PreparedWeightRanges and a
PrefetchController, adds and forks (on an explicit int stream), and then exits
without close(), the objects held in different places.  The process must exit 0
with an empty stderr.

What is still alive afterwards cannot be asked from Python: atexit handlers and
weakref.finalize run before the modules are torn down, and a __del__ runs in an
order the interpreter does not promise.  So a small C library (built here) hands
a C atexit() handler to libc: it runs after Py_FinalizeEx, when every Python
object that will ever be freed has been, and prints the stand-ins' counters.
"""

import os
import subprocess
import sys
import textwrap

import pytest

import l2prefetch
from _fakecuda import build_fakecuda, build_fakenvrtc

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(l2prefetch.__file__)))
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

REPORTER = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void *cuda, *nvrtc;

static void report(void)
{
    long (*live)(const char *) = (long (*)(const char *))dlsym(cuda, "fake_live");
    long (*bad)(void) = (long (*)(void))dlsym(cuda, "fake_bad_destroys");
    long (*progs)(void) = (long (*)(void))dlsym(nvrtc, "fakenvrtc_live_programs");
    char buf[256];
    int n = snprintf(buf, sizeof buf,
                     "after exit: stream=%ld event=%ld module=%ld context=%ld bad_destroys=%ld "
                     "programs=%ld\n",
                     live("stream"), live("event"), live("module"), live("context"), bad(),
                     progs());
    (void)!write(1, buf, (size_t)n);
}

/* Holds both stand-ins loaded (they already are) and reports at exit(). */
int watch(const char *cuda_path, const char *nvrtc_path)
{
    cuda = dlopen(cuda_path, RTLD_NOW | RTLD_NOLOAD);
    nvrtc = dlopen(nvrtc_path, RTLD_NOW | RTLD_NOLOAD);
    if (!cuda || !nvrtc)
        return -1;
    return atexit(report);
}
"""

HEAD = """
import ctypes, sys
sys.path.insert(0, {tests!r})
from _fakecuda import FakeCuda, FakeNvrtc
import l2prefetch
from l2prefetch import _C

CUDA, NVRTC, REPORTER = sys.argv[1:4]
fake = FakeCuda(CUDA)
fake.reset()
FakeNvrtc(NVRTC).reset()
_C._use_driver(CUDA)
_C._use_nvrtc(NVRTC)
assert ctypes.CDLL(REPORTER).watch(CUDA.encode(), NVRTC.encode()) == 0
STREAM = 0x5000

class FakeArray:
    def __init__(self, ptr, shape):
        self.__cuda_array_interface__ = {{"shape": shape, "typestr": "<f2", "data": (ptr, False),
                                          "strides": None, "version": 3}}

def weights(i=0):
    return [FakeArray((1 << 40) + i * 65536, (64,))]   # cuda:0 in the stand-in

def live():
    return {{k: fake.live(k) for k in ("stream", "event", "module", "context")}}
"""

CASES = {
    # nothing deleted: both in module globals, forked and never joined
    "globals": """
        t = l2prefetch.PreparedWeightRanges(weights())
        c = l2prefetch.PrefetchController(device=0)
        c.add("attn", 0, 1, t)
        assert c.fork("attn", 0, 1, stream=STREAM)
        print("before exit:", live())
    """,
    # joined, then the controller kept only by a global; the table only by the controller
    "joined_table_only_in_controller": """
        c = l2prefetch.PrefetchController(device=0)
        c.add("attn", 0, [1, 2], l2prefetch.PreparedWeightRanges(weights()))
        assert c.fork("attn", 0, 1, stream=STREAM)
        c.join(stream=STREAM)
        print("before exit:", live())
    """,
    # a reference cycle through a Python object holding the controller and the table
    "cycle": """
        class Model:
            pass
        m = Model()
        m.me = m
        m.ctl = l2prefetch.PrefetchController(device=0)
        m.table = l2prefetch.PreparedWeightRanges(weights())
        m.ctl.add("attn", 0, 1, m.table)
        m.ctl.fork("attn", 0, 1, stream=STREAM)
        del m
        print("before exit:", live())
    """,
    # the cycle only, the controller's table being in it too, with gc disabled
    "cycle_gc_disabled": """
        import gc
        gc.disable()
        class Model:
            pass
        m = Model()
        m.me = m
        m.ctl = l2prefetch.PrefetchController(device=0)
        m.ctl.add("attn", 0, 1, l2prefetch.PreparedWeightRanges(weights()))
        m.ctl.fork("attn", 0, 1, stream=STREAM)
        del m
        print("before exit:", live())
    """,
    # cycles through the C objects themselves: a subclass instance that holds its
    # model, and a weight that holds the controller its table is registered with
    "cycle_through_the_objects": """
        class Controller(l2prefetch.PrefetchController):
            pass
        class Model:
            pass
        m = Model()
        m.ctl = Controller(device=0)
        m.ctl.model = m
        w = weights()
        w[0].owner = m.ctl
        m.ctl.add("attn", 0, 1, l2prefetch.PreparedWeightRanges(w))
        m.ctl.fork("attn", 0, 1, stream=STREAM)
        del m, w
        print("before exit:", live())
    """,
    # held by other modules: the extension's package, sys and builtins (torn down late)
    "held_by_modules": """
        import builtins
        l2prefetch.kept = l2prefetch.PrefetchController(device=0)
        sys.kept = l2prefetch.PreparedWeightRanges(weights(1))
        builtins.kept = l2prefetch.PrefetchController(device=0)
        l2prefetch.kept.add("attn", 0, 1, sys.kept)
        builtins.kept.add("attn", 0, 1, sys.kept)
        l2prefetch.kept.fork("attn", 0, 1, stream=STREAM)
        builtins.kept.fork("attn", 0, 1, stream=0)
        print("before exit:", live())
    """,
    # sys.exit from inside a function whose frame holds them
    "sys_exit_in_a_function": """
        def main():
            t = l2prefetch.PreparedWeightRanges(weights())
            c = l2prefetch.PrefetchController(device=0)
            c.add("attn", 0, 1, t)
            c.fork("attn", 0, 1, stream=STREAM)
            print("before exit:", live(), flush=True)
            sys.exit(0)
        main()
    """,
    # the default driver and NVRTC back while the objects still hold the stand-in's
    "driver_switched_back": """
        t = l2prefetch.PreparedWeightRanges(weights())
        c = l2prefetch.PrefetchController(device=0)
        c.add("attn", 0, 1, t)
        c.fork("attn", 0, 1, stream=STREAM)
        _C._use_nvrtc(None)
        _C._use_driver(None)
        print("before exit:", live())
    """,
    # a GraphExec (the tuner's graph without forks) left in a global after the driver was
    # switched back: it holds the stand-in's instance (and its context) until it goes
    "graph_exec": """
        t = l2prefetch.PreparedWeightRanges(weights())
        ex = _C._graph_instantiate_without(0x7000, ())
        ex.launch(STREAM)
        del t
        _C._use_driver(None)
        print("before exit:", live())
    """,
}


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("exit")
    src = folder / "reporter.c"
    src.write_text(REPORTER)
    so = folder / "libreporter.so"
    cmd = [os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1", "-Wall", "-o", str(so), str(src)]
    proc = subprocess.run(cmd + ["-ldl"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return build_fakecuda(str(folder)), build_fakenvrtc(str(folder)), str(so)


def run_child(code, libs, tmp_path, *flags):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PYTHON_DIR, os.environ.get("PYTHONPATH")) if p)
    env["L2PREFETCH_CACHE_DIR"] = str(tmp_path / "kcache")
    for key in ("L2PREFETCH_DISABLE", "L2PREFETCH_LIBCUDA", "L2PREFETCH_LIBNVRTC"):
        env.pop(key, None)
    return subprocess.run([sys.executable, *flags, "-c", code, *libs], capture_output=True,
                          text=True, env=env, timeout=120)


@pytest.mark.parametrize("flags", [(), ("-X", "dev")], ids=["plain", "devmode"])
@pytest.mark.parametrize("case", list(CASES))
def test_exit_without_close(libs, tmp_path, case, flags):
    code = textwrap.dedent(HEAD.format(tests=TESTS_DIR)) + textwrap.dedent(CASES[case])
    proc = run_child(code, libs, tmp_path, *flags)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    before = [line for line in lines if line.startswith("before exit:")]
    assert len(before) == 1 and "'module': 1" in before[0], lines  # there was something to free
    assert lines[-1] == ("after exit: stream=0 event=0 module=0 context=0 bad_destroys=0 "
                         "programs=0"), lines


def test_the_reporter_sees_what_is_left(libs, tmp_path):
    # the check above could pass by reporting too early: os._exit() skips the
    # teardown, and exit() with a live object must show it
    code = textwrap.dedent(HEAD.format(tests=TESTS_DIR)) + textwrap.dedent("""
        import os
        t = l2prefetch.PreparedWeightRanges(weights())
        c = l2prefetch.PrefetchController(device=0)
        sys.stdout.flush()
        lib = ctypes.CDLL(None)
        lib.exit(0)      # C exit() without Py_FinalizeEx: nothing is freed
    """)
    proc = run_child(code, libs, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == ("after exit: stream=1 event=1 module=1 context=1 "
                                            "bad_destroys=0 programs=0")
