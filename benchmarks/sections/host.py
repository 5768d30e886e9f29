"""host: the host cost of one eager fork + join, and of building a controller.

Per pair: the controller from Python, a Python reference (torch events and a
cuda-bindings launch, as the reference design forked), the same driver calls
from C (the floor) and the custom ops; then the 61-layer Kimi-sized TP8
plan's controller built in fresh processes (benchmarks/construct.py), with
a cold and a warm kernel cache.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from l2prefetch import PrefetchController, PreparedWeightRanges, _C
from l2prefetch.tuning.report import table

CONSTRUCT = Path(__file__).resolve().parents[1] / "construct.py"


def _python_reference(p, n, dev):
    """Fork + join the reference design's way: torch events and streams, a cuda-bindings
    cuLaunchKernelEx of the same kernel.  Microseconds per pair over n pairs."""
    from cuda.bindings import driver as cu

    image, _ = _C._kernel_image(p.kernel, _C.device_info(dev)["sm"])
    err, mod = cu.cuModuleLoadData(image)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    err, fn = cu.cuModuleGetFunction(mod, b"l2p_prefetch_8")
    cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, p.smem)
    words = [len(p.ranges), sum(n // 16 for _, n in p.ranges)]
    for ptr, nb in p.ranges:
        words += [ptr, nb]
    words += [0] * (2 + 2 * 8 - len(words))
    block = (ctypes.c_uint64 * len(words))(*words)
    args = (ctypes.c_void_p * 1)(ctypes.addressof(block))
    attrs = []
    top = cu.CUlaunchAttribute()
    top.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PRIORITY
    top.value.priority = _C.device_info(dev)["greatest_priority"]
    attrs.append(top)
    smem = cu.CUlaunchAttribute()
    smem.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    smem.value.sharedMemCarveout = 100
    attrs.append(smem)
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = p.grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = p.block, 1, 1
    config.sharedMemBytes, config.attrs, config.numAttrs = p.smem, attrs, len(attrs)
    side = torch.cuda.Stream(dev)
    event = torch.cuda.Event()
    handle = cu.CUstream(side.cuda_stream)
    address = ctypes.addressof(args)

    def fork_join():
        event.record(torch.cuda.current_stream(dev))
        side.wait_event(event)
        config.hStream = handle
        err, = cu.cuLaunchKernelEx(config, fn, address, 0)
        torch.cuda.current_stream(dev).wait_stream(side)

    fork_join()
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fork_join()
    t1 = time.perf_counter_ns()
    torch.cuda.synchronize()
    cu.cuModuleUnload(mod)
    return (t1 - t0) / n / 1e3


def run(rig, quick):
    dev = rig.device.index
    n = 5000 if quick else 20000
    # An empty table: the kernel returns at once, so the GPU never falls behind
    # and back-pressure cannot throttle the host loop being measured.
    p = PreparedWeightRanges([], device=dev, grid=32, carveout=100, priority=True)
    ctrl = PrefetchController(dev)
    ctrl.add("p", 0, [1], p)
    fork, join = ctrl.fork, ctrl.join

    def controller_us():
        for _ in range(200):
            fork("p", 0, 1)
            join()
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fork("p", 0, 1)
            join()
        t1 = time.perf_counter_ns()
        torch.cuda.synchronize()
        return (t1 - t0) / n / 1e3

    def floor_us():
        _C._floor_fork_join(p, 200, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        return _C._floor_fork_join(p, n, torch.cuda.current_stream().cuda_stream) / n / 1e3

    def op_us():
        from l2prefetch import ops

        handle = ops.register(ctrl)
        op_fork, op_join = torch.ops.l2prefetch.fork, torch.ops.l2prefetch.join
        try:
            for _ in range(200):
                op_fork(handle, "p", 0, 1)
                op_join(handle)
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(n):
                op_fork(handle, "p", 0, 1)
                op_join(handle)
            t1 = time.perf_counter_ns()
            torch.cuda.synchronize()
        finally:
            ops.unregister(handle)
        return (t1 - t0) / n / 1e3

    a = statistics.median(controller_us() for _ in range(5))
    c = statistics.median(floor_us() for _ in range(5))
    d = statistics.median(op_us() for _ in range(5))
    try:
        b = statistics.median(_python_reference(p, n // 4, dev) for _ in range(3))
    except ImportError:
        b = float("nan")
    unknown = time.perf_counter_ns()
    for _ in range(n):
        fork("nothing", 0, 1)
    unknown = (time.perf_counter_ns() - unknown) / n / 1e3
    ctrl.close()

    # Construction of the Kimi-sized 61-layer TP8 plan, each in a fresh process.
    times, plan_note = {}, "plan size unknown"
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, L2PREFETCH_CACHE_DIR=tmp)
        for label in ("cold NVRTC cache", "warm disk cache"):
            out = subprocess.run([sys.executable, str(CONSTRUCT)], env=env, capture_output=True,
                                 text=True)
            if out.returncode:
                times[label] = "failed: " + out.stderr.strip().splitlines()[-1]
                continue
            ms, entries, tables = out.stdout.split()
            times[label] = f"{float(ms):.1f} ms"
            plan_note = f"{entries} entries, {tables} prepared tables"
    rows = [("(a) PrefetchController.fork + join, from Python", f"{a:.2f}", f"{a / c:.2f}x"),
            ("(b) Python reference (torch events, cuda-bindings launch)", f"{b:.2f}",
             f"{b / c:.2f}x"),
            ("(c) floor: the same driver calls from C", f"{c:.2f}", "1.00x"),
            ("(d) torch.ops.l2prefetch.fork + join (the custom ops, eager)", f"{d:.2f}",
             f"{d / c:.2f}x"),
            ("fork of an unregistered key (returns False)", f"{unknown:.3f}", "")]
    return ("### host: host cost of one fork + join (eager, us per pair, median of 5 runs of "
            f"{n})\n\n" + table(["path", "us", "vs floor"], rows)
            + f"\n(a) is {b / a:.1f}x cheaper than (b).  Current stream found through: "
            f"`{_C.stream_source()}`.\n\n"
            "Building a controller for the 61-layer Kimi-sized TP8 plan with the reference "
            f"design's points and next_attention at 24 MiB ({plan_note}), in a "
            "fresh process (benchmarks/construct.py): "
            + ", ".join(f"{k} {v}" for k, v in times.items()) + ".")
