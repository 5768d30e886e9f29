"""Create-and-drop loops of 10**5 iterations against the recording driver stand-in.

Each loop runs its body 1000 times to warm up (the kernel module, the
interned point names, the allocators' free lists), then 10**5 times under
tracemalloc.  After the loop and a gc.collect():

* the Python heap grew by less than BOUND (256 KiB: under 3 bytes per
  iteration, so a leak of one small object per iteration fails);
* the stand-in's live streams, events, modules and contexts are back to their
  values after the warm-up, and no handle was destroyed twice;
* objects the loop only reads (the weights given to compute_ranges) have the
  reference counts they started with.

The bodies include the error paths (each iteration raises at least once),
since the cleanup of a half-built object is where leaks hide.  The stand-in
logs every call: the log is cleared every CLEAR_EVERY iterations.  Each loop
prints its time (pytest -s shows it).
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import tracemalloc

import pytest

import l2prefetch
from l2prefetch import _C
from conftest import FakeArray, device_ptr

PWR = l2prefetch.PreparedWeightRanges
PC = l2prefetch.PrefetchController
N = 10**5
WARMUP = 1000
CLEAR_EVERY = 5000
BOUND = 256 * 1024
S = 0x5000
LIVE_KINDS = ("stream", "event", "module", "context")


def arr(i=0, n=1024, device=0):
    return FakeArray(device_ptr(device, i * 65536), (n,))


def live(fake):
    return {kind: fake.live(kind) for kind in LIVE_KINDS}


def in_a_thread(fn):
    """fn() in a fresh thread (a shallow stack: tracemalloc walks all of it on every
    allocation, and pytest's is deep); its result, or its exception raised here."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def run_loop(fake, name, once):
    """Warm up, then run once(i) N times under tracemalloc; check heap and driver objects."""
    return in_a_thread(lambda: _run_loop(fake, name, once))


def _run_loop(fake, name, once):
    """The heap is measured over two halves of the loop and only the second counts: a
    leak grows it in both, while a one-time cost (a cache that some call fills late; seen
    under ASan with torch imported: 290 KB whether the loop ran 10**5 or 2 * 10**5 times)
    lands in the first."""
    for i in range(WARMUP):
        once(i)
    fake.clear_log()
    gc.collect()
    start = live(fake)
    tracemalloc.start()
    try:
        marks = [tracemalloc.get_traced_memory()[0]]
        t0 = time.perf_counter()
        for i in range(N):
            once(i)
            if i % CLEAR_EVERY == CLEAR_EVERY - 1:
                fake.clear_log()
            if i == N // 2 - 1:
                gc.collect()
                marks.append(tracemalloc.get_traced_memory()[0])
        elapsed = time.perf_counter() - t0
        gc.collect()
        marks.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    first, second = marks[1] - marks[0], marks[2] - marks[1]
    print(f"\n{name}: {N} iterations in {elapsed:.2f} s ({elapsed / N * 1e6:.1f} us each, "
          f"under tracemalloc); heap grew {first} bytes in the first half, {second} in the second")
    assert second < BOUND // 2, (f"{name}: the heap grew {second} bytes over the second "
                                 f"{N // 2} iterations (after {first} in the first)")
    assert live(fake) == start
    assert fake.bad_destroys() == 0
    return start


def release_all(fake):
    """Drop the driver instance: every module and context must go too, exactly once."""
    gc.collect()
    _C._use_driver(None)
    assert live(fake) == dict.fromkeys(LIVE_KINDS, 0)
    assert fake.bad_destroys() == 0


@pytest.fixture
def two_devices(fake):
    fake.configure(device_count=2)
    _C._use_driver(fake.path)
    return fake


def test_prepared_weight_ranges_loop(two_devices):
    fake = two_devices
    carveouts = (None, -1, 50, 100)
    misaligned = FakeArray(device_ptr(0, 65536 + 8), (8,))

    def once(i):
        t = PWR([arr(i % 7), arr(7 + i % 5, 8 + i % 100)], byte_cap=(0, 3000)[i % 2],
                grid=1 + i % 64, carveout=carveouts[i % 4], priority=bool(i % 3),
                kernel=(None, "load")[i % 5 == 0])
        t.launch(S)
        assert t.nbytes and t.ranges[0][0] == device_ptr(0, (i % 7) * 65536)
        k = i % 4   # one rejected input per iteration, each failing at another stage
        try:
            if k == 0:
                PWR([arr(0), misaligned])                  # in compute_ranges
            elif k == 1:
                PWR([arr(0), arr(1, device=1)])            # in the device check
            elif k == 2:
                PWR([arr(0)], kernel="nope")               # after the device is prepared
            else:
                t.launch(stream=object())                  # in launch
        except (ValueError, TypeError):
            pass
        else:
            raise AssertionError("the bad input was accepted")

    start = run_loop(fake, "PreparedWeightRanges create/launch/drop", once)
    assert start["stream"] == start["event"] == 0
    assert start["module"] == 2 and start["context"] == 1   # 'ring' and 'load', loaded once
    release_all(fake)


def test_prefetch_controller_loop(two_devices):
    fake = two_devices
    other = PWR([arr(0, device=1)])   # a table of another device, refused by add()

    class Holder(FakeArray):
        pass

    def once(i):
        t = PWR([arr(i % 7), arr(7 + i % 5)])
        c = PC(device=0)
        c.add("attn", i % 3, [1, 2], t)
        c.add("mlp", 0, 1, t)
        assert c.fork("attn", i % 3, 1 + i % 2, stream=S)
        assert c.fork("mlp", 0, 2, stream=S) is False
        c.join(stream=S)
        k = i % 4
        try:
            if k == 0:
                c.add("attn", 0, [1, 0], t)
            elif k == 1:
                c.add("attn", 0, 1, other)
            elif k == 2:
                c.fork("attn", "0", 1, stream=S)
            else:
                assert c.fork("mlp", 0, 1, stream=S)
                c.join(stream=object())        # pending, so the stream is parsed
        except (ValueError, TypeError):
            pass
        else:
            raise AssertionError("the bad input was accepted")
        if c.pending:
            c.join(stream=S)
        if i % 1000 == 0:     # now and then a cycle: controller -> table -> weight -> controller
            h = Holder(device_ptr(0), (8,))
            c.add("cycle", 0, 1, PWR([h]))
            h.controller = c
        how = i % 3
        if how == 0:          # close(), then any use is refused
            c.close()
            try:
                c.fork("attn", 0, 1, stream=S)
            except l2prefetch.Error:
                pass
            else:
                raise AssertionError("a closed controller forked")
        elif how == 1:        # the context manager
            with c:
                pass

    start = run_loop(fake, "PrefetchController create/add/fork/join/close", once)
    assert start["stream"] == start["event"] == 0
    assert start["module"] == start["context"] == 2   # cuda:0, and cuda:1 for `other`
    del other
    release_all(fake)


def test_graph_exec_loop(two_devices):
    """The graph calls of the tuner's rig (csrc/graph.c) and the GraphExec they make
    (csrc/graphexec.c): made, launched, closed or dropped, refused (closed, a bad stream,
    a node named twice, nodes not a tuple): no exec, clone or heap left, and the
    driver instance the execs held is released with the module's."""
    fake = two_devices
    GRAPH = 0x7000
    table = PWR([arr(0)])   # cuda:0 made ready: a context the driver instance holds

    def once(i):
        ex = _C._graph_instantiate_without(GRAPH, ())
        ex.launch(S)
        assert _C._graph_loader_nodes(GRAPH) == () and _C._graph_edges(GRAPH) == ()
        k = i % 4
        try:
            if k == 0:
                ex.close()
                ex.launch(S)
            elif k == 1:
                ex.launch("s")
            elif k == 2:
                _C._graph_instantiate_without(GRAPH, (16, 16))
            else:
                _C._graph_set_loaders(GRAPH, [16], "on")
        except (l2prefetch.Error, TypeError, ValueError):
            pass
        else:
            raise AssertionError("the bad input was accepted")
        if i % 2:
            ex.close()

    start = run_loop(fake, "GraphExec instantiate/launch/close", once)
    assert start["context"] == 1
    assert fake.live("exec") == fake.live("graph") == 0
    kept = _C._graph_instantiate_without(GRAPH, ())   # holds the driver past release_all's swap
    del table
    gc.collect()
    _C._use_driver(None)
    assert fake.live("context") == 1
    del kept
    release_all(fake)


def test_compute_ranges_loop(fake):
    torch = pytest.importorskip("torch")
    base = device_ptr(0, 4096)
    weights = [torch.empty(64, 64), torch.empty(8, 16)[:, ::2], torch.empty(()),
               torch.empty(0, 4), FakeArray(device_ptr(0), (32,)),
               FakeArray(base + 48, (4, 4), "<f4", (-16, 4))]   # lowest byte at base
    expected = l2prefetch.compute_ranges(weights)
    assert len(expected) == 5 and expected[-1] == (base, 64)
    misaligned = torch.empty(9, dtype=torch.float16)[1:]
    too_wide = FakeArray(device_ptr(0), (1 << 62, 4), "|u1", (1 << 62, 1))
    bad = [([weights[0], misaligned], ValueError), ([weights[0], 5], TypeError),
           (weights[0], TypeError), ([too_wide], OverflowError)]
    watched = [*weights, misaligned, too_wide]
    refcounts = [sys.getrefcount(w) for w in watched]

    def once(i):
        if i % 2:
            assert l2prefetch.compute_ranges(weights) == expected
        else:
            assert sum(n for _, n in l2prefetch.compute_ranges(weights, 1000)) <= 1000
        arg, exc = bad[i % 4]
        try:
            l2prefetch.compute_ranges(arg)
        except exc:
            pass
        else:
            raise AssertionError("the bad input was accepted")
        if i % 100 == 0:
            try:
                l2prefetch.compute_ranges(weights, 2**64)
            except OverflowError:
                pass

    start = run_loop(fake, "compute_ranges", once)
    assert start == dict.fromkeys(LIVE_KINDS, 0)   # arithmetic: no driver at all
    assert [sys.getrefcount(w) for w in watched] == refcounts
