"""table: where the range table lives, kernel parameters (shipped) or device memory.

The device-memory form is the same kernel source built with
``-DL2P_TABLE_GLOBAL=1`` and launched through cuda-bindings with a pointer to
a CUDA tensor holding the same bytes.  Compared: the loader alone on a cold
L2 (the table itself flushed too), for few and many ranges.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

import l2prefetch
from l2prefetch import PreparedWeightRanges, _C
from l2prefetch.tuning.report import table

from ..common import weight

KERNEL_SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "prefetch.cu"


def run(rig, quick):
    from cuda.bindings import driver as cu

    reps = 60 if quick else 200
    sm = _C.device_info(rig.device.index)["sm"]
    info = l2prefetch.kernel_variants()["ring"]
    src = KERNEL_SOURCE.read_text(encoding="utf-8")
    image = _C._compile_source(src, [f"--gpu-architecture=sm_{sm}", "-std=c++17",
                                     "-DL2P_TABLE_GLOBAL=1", *info["defines"].split()])
    err, mod = cu.cuModuleLoadData(image)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    rows = []
    for mib, pieces in ((16, 1), (16, 24), (32, 1), (32, 100)):
        w = weight(rig, mib)
        ws = list(torch.chunk(w, pieces, dim=0)) if pieces > 1 else [w]
        ws = [t for t in ws if t.data_ptr() % 16 == 0]
        p = PreparedWeightRanges(ws, carveout=100)
        cap = next(c for c in (8, 32, 128) if c >= len(p.ranges))
        words = [len(p.ranges), sum(n // 16 for _, n in p.ranges)]
        for ptr, nb in p.ranges:
            words += [ptr, nb]
        words += [0] * (2 + 2 * cap - len(words))
        dev_table = torch.tensor(words, dtype=torch.int64, device=rig.device)
        err, fn = cu.cuModuleGetFunction(mod, f"l2p_prefetch_{cap}".encode())
        cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                              info["smem"])
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        attr.value.sharedMemCarveout = 100
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = p.grid, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = p.block, 1, 1
        config.sharedMemBytes, config.attrs, config.numAttrs = p.smem, [attr], 1
        pointer = ctypes.c_void_p(dev_table.data_ptr())
        args = (ctypes.c_void_p * 1)(ctypes.addressof(pointer))

        def launch_global():
            config.hStream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
            err, = cu.cuLaunchKernelEx(config, fn, ctypes.addressof(args), 0)
            assert err == cu.CUresult.CUDA_SUCCESS, err

        graphs = {"param": rig.capture(lambda: p.launch())[0],
                  "global": rig.capture(launch_global)[0]}
        t = rig.time_graphs(graphs, reps, lambda _key: rig.flush())
        rows.append((mib, len(p.ranges), f"{t['param']:.2f}", f"{t['global']:.2f}",
                     f"{t['global'] - t['param']:+.2f}"))
    cu.cuModuleUnload(mod)
    return ("### table: where the range table lives (loader alone on a cold L2, default ring, "
            "grid 32; us)\n\n"
            + table(["W MiB", "ranges", "parameter block (shipped)", "device memory (reference "
                     "design)", "difference"], rows))
