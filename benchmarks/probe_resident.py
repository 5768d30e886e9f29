"""Probe (issue 24): one resident loader per step, woken by cheap triggers on the main stream.

Why: an inline loader K overlaps only the node right after it, because that node's
completion is held until K's (one hardware queue completes in order, RESULTS "Why inline
does not overlap"); a loader on its own branch (leaf, branch) overlaps a whole window
but each fork costs 1.5-3.6 us, and the cost follows the number of cross-stream
edges, not the loader's work (run 14, "What an empty fork costs").  So: fork once per
step, and make the per-layer part as cheap as an instant kernel on the main stream.

  * At the step's start the flag (one u32) is zeroed and ONE resident kernel R is
    forked to a side stream (joined at the step's end): its CTAs wait until
    ``flag > s`` and then load slot s (a layer's bytes), for s = 0, 1, ...
  * After each layer's o_proj a trigger sets ``flag = layer + 1`` on the main stream.
    Nothing on the main stream waits for R, and the trigger finishes at once, so
    the node after it is not held.  R exits after its last slot, or after a timeout
    (a trigger that never comes costs a late join, never a hang).

Triggers compared (each with empty slots, ``... empty``: what the mechanism costs,
and with 24 MiB of the layer's gate_proj, ``... loads``):

  kernel   a one-thread kernel (an ordinary edge from o_proj's kernel)
  pdl      the same launched with programmatic stream serialization: it launches while
           o_proj finishes and waits in griddepcontrol.wait (sm_90+)
  memset   cuMemsetD32Async of the flag (a memset node)
  wv       cuStreamWriteValue32_v2 (a memory-operation node)

and two more without R (run 18 found R's residence costing 85-145 us per step):

  kernel alone  the kernel trigger with no R (what six triggers cost by themselves)
  graph         after each o_proj a one-thread kernel launches that layer's loader graph
                from the device, fire and forget (a device graph, uploaded, its one
                kernel node loading the slot): the child runs beside the main stream and
                the step's graph completes after it, as a leaf fork's loader.  Its kernel
                is built with -rdc and linked against libcudadevrt.a (the toolkit's, or
                $L2PREFETCH_CUDADEVRT); without one the variants are not usable.  The
                driver runs the child only from a graph instantiated for device launch, so
                these steps are (``DeviceLaunched``), and so are the controls ``none@dl``,
                ``inline empty@dl`` and ``leaf-ld loads@dl`` (the same captures).
                Run 19: that instantiation costs 10-12 us per step, each launch 3.6-4.9 us.
  graphpdl      the same, the trigger launched as a programmatic dependent of o_proj

and one of the library's own forks placed differently:

  pre           the inline fork (its ring loader) in the first forward pre-hook of each
                post_attention_layernorm, so before the planted spin: the fork's next
                kernel is the window's own, the one node an inline loader overlaps (run 12,
                "Why inline does not overlap"); a site just before a window's long kernel
                is one of issue 24's candidates for a whole window at inline's cost

  post          the inline fork in the first forward hook of each o_proj (prepended), so
                right after its GEMV: with SITE oproj (the spin in a later forward hook of
                o_proj, as a tensor-parallel o_proj's all-reduce) the fork's next kernel is
                the window's, and the kernel before it a cuBLAS GEMV, which lets its
                programmatic dependents launch early (run 20: ``pre`` follows an add and
                costs 1.1-1.3 us a fork, inline after o_proj 0.03-0.4 us)

  beside        (SITE mlp) the inline fork in a forward pre-hook of each
                post_attention_layernorm registered after the planted spin's, so right
                after the window's kernel:
                the shipped loader waits for that kernel (griddepcontrol.wait) and loads
                after it; a loader built without the wait (an experiment) loads beside it

beside no forks and the library's own forks after every o_proj as controls (hooked after
o_proj's other forward hooks, so with SITE oproj after the spin: ``post`` is where
``hooks.attach`` now forks; ``leaf``:
a side branch per fork, the loads overlap the window, with its sm_90 ``ring`` loader and,
``leaf-ld``, with its ``load`` kernel, R's kind of load; ``inline``: the cheap fork).
Deciding: ``T empty`` against ``inline empty`` (does a step's one fork plus six triggers
cost what six inline forks do?) and ``T loads`` against ``leaf-ld loads`` (do the loads
overlap the window as a leaf's do?).  R counts its timeouts and the slots it reached
after the next trigger had come (it was behind), so a late or starved R shows, and
stamps (%globaltimer) when each trigger ran, when R woke for it and when its loads
were done (a 40 us window should hold both).
Every variant is captured into one memory pool per instance (paired by instance, a
primer capture first); medians of ROUNDS interleaved replays; paired 95% intervals.

    python -m benchmarks.probe_resident [--variants MODE,...] [MODEL:SITE:SPIN:BATCH ...]

(on the GPU; MODE: none leaf leaf-ld inline pre post beside kernel pdl memset wv graph graphpdl,
the first word of a variant's name; default: all; SITE: mlp or attention, the planted
section's spin before the norm, or oproj, the spin in a forward hook of o_proj, right after
its GEMV, where a tensor-parallel o_proj's all-reduce runs)

R's loads are ld.global.cg.v4 at every 16 bytes, four in flight per thread (ptxas
narrows each to the 4 bytes used, as in the library's ``load`` kernel: every sector is
still read; real loads leave a copy near the loading SM, RESULTS run 10), 32 CTAs x 256
threads; the triggers and R are built here with NVRTC
(through l2prefetch._C) and launched through ctypes on libcuda: an experiment, not the
library's code.
"""
from __future__ import annotations

import ctypes
import statistics
import sys
from typing import Optional

from benchmarks.common import bitwise_by_variant, no_gpu, paired

MIB = 1 << 20
INSTANCES = 6
ROUNDS = 40
LOAD_BYTES = 24 * MIB
R_GRID, R_BLOCK = 32, 256       # the library's `load` kernel: grid 32 (its default), 256
TIMEOUT_NS = 20_000_000          # R gives up 20 ms after it starts (a step is 1-5 ms)
TRIGGERS = ("kernel", "pdl", "memset", "wv")
DEVGRAPH_MODES = ("graph", "graphpdl")
CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH = 4

# Both modules' loads: this CTA's share of [base, base + bytes), each thread with four
# 16-byte loads in flight (as the library's `load` kernel); what it returns keeps them.
COMMON = r"""
typedef unsigned long long u64;

#define LOAD16(r, p) asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" \
    : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p))

__device__ __forceinline__ unsigned load_share(u64 base, u64 bytes) {
    const u64 granules = bytes / 16;
    const u64 per = (granules + gridDim.x - 1) / gridDim.x;
    const u64 g0 = per * blockIdx.x;
    const u64 g1 = g0 + per < granules ? g0 + per : granules;
    const u64 step = blockDim.x;
    unsigned acc = 0;
    u64 g = g0 + threadIdx.x;
    for (; g + 3 * step < g1; g += 4 * step) {
        unsigned a[4], b[4], c[4], d[4];
        LOAD16(a, base + 16 * g);
        LOAD16(b, base + 16 * (g + step));
        LOAD16(c, base + 16 * (g + 2 * step));
        LOAD16(d, base + 16 * (g + 3 * step));
        acc ^= a[0] ^ b[1] ^ c[2] ^ d[3];
    }
    for (; g < g1; g += step) {
        unsigned a[4];
        LOAD16(a, base + 16 * g);
        acc ^= a[0];
    }
    return acc;
}
"""

SOURCE = COMMON + r"""

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ unsigned acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}


// slots: nslots pairs (address, bytes, a multiple of 16).  Slot s is loaded once
// *flag > s; every CTA loads its share of each slot, each thread with four 16-byte
// loads in flight (as the library's `load` kernel).  counts (CTA 0 adds): [0] times R
// gave up waiting (timeout), [1] slots whose next trigger had come already when R got
// to them (R behind the main stream), [2] runs.  stamps (%globaltimer ns, the last
// replay's): [s] the trigger of slot s (kernel triggers only), [n + s] when R saw it,
// [2n + s] when the last CTA finished slot s's loads.
extern "C" __global__ void resident(const u64 *slots, int nslots, const unsigned *flag,
                                    u64 timeout_ns, unsigned *counts, u64 *stamps) {
    __shared__ int go;
    const u64 start = now_ns();
    unsigned acc = 0;
    if (blockIdx.x == 0 && threadIdx.x == 0)
        atomicAdd(&counts[2], 1u);
    for (int s = 0; s < nslots; ++s) {
        if (threadIdx.x == 0) {
            int ok = 1;
            unsigned v;
            while ((v = acquire(flag)) <= (unsigned)s) {
                if (now_ns() - start > timeout_ns) { ok = 0; break; }
                __nanosleep(128);
            }
            if (blockIdx.x == 0 && !ok)
                atomicAdd(&counts[0], 1u);
            if (blockIdx.x == 0 && ok && v > (unsigned)s + 1)
                atomicAdd(&counts[1], 1u);
            if (blockIdx.x == 0 && ok)
                stamps[nslots + s] = now_ns();
            go = ok;
        }
        __syncthreads();
        if (!go)
            break;
        acc ^= load_share(slots[2 * s], slots[2 * s + 1]);
        __syncthreads();
        if (threadIdx.x == 0)
            atomicMax(&stamps[2 * nslots + s], now_ns());
    }
    // ptxas deletes a load whose value is dead (kernels/prefetch.cu): keep acc observable
    // behind a branch no launch takes
    if (timeout_ns == 0 && acc == 0x9e3779b9u)
        __trap();
}

extern "C" __global__ void trigger(unsigned *flag, unsigned value, u64 *stamps) {
    stamps[value - 1] = now_ns();
    atomicExch(flag, value);
}

extern "C" __global__ void trigger_pdl(unsigned *flag, unsigned value, u64 *stamps) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    stamps[value - 1] = now_ns();
    atomicExch(flag, value);
}
"""


# The device-graph variants: built with -rdc, linked against libcudadevrt.a.
DEVGRAPH_SOURCE = COMMON + r"""
// One slot, R's loads.
extern "C" __global__ void loader(u64 base, u64 bytes) {
    const unsigned acc = load_share(base, bytes);
    if (bytes == 1 && acc == 0x9e3779b9u)   // keeps the loads (never taken: bytes % 16 == 0)
        __trap();
}

// errors: [0] launches the device runtime refused, [1] calls outside a graph (the eager
// warm-up: nothing launched), [2] the last refusal's cudaError_t.
extern "C" __global__ void trigger_graph(u64 exec, unsigned *errors) {
    if (cudaGetCurrentGraphExec() == 0) {
        atomicAdd(&errors[1], 1u);
        return;
    }
    cudaError_t e = cudaGraphLaunch((cudaGraphExec_t)exec, cudaStreamGraphFireAndForget);
    if (e != cudaSuccess) {
        atomicAdd(&errors[0], 1u);
        errors[2] = (unsigned)e;
    }
}
"""


def cudadevrt() -> Optional[str]:
    """libcudadevrt.a: $L2PREFETCH_CUDADEVRT, else beside nvcc or in the usual places."""
    import glob
    import os
    import shutil

    found = os.environ.get("L2PREFETCH_CUDADEVRT")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for root in filter(None, roots):
        for sub in ("lib64", "lib", "targets/*/lib"):
            hits = glob.glob(os.path.join(root, sub, "libcudadevrt.a"))
            if hits:
                return hits[0]
    return None


class _KernelNodeParams(ctypes.Structure):     # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3),
                ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


CU_JIT_INPUT_CUBIN, CU_JIT_INPUT_OBJECT, CU_JIT_INPUT_LIBRARY = 0, 3, 4


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("i", ctypes.c_int)]


class _Attr(ctypes.Structure):          # CUlaunchAttribute: the value is 8-byte aligned
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):        # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("nattrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6


class Driver:
    """The few driver calls the probe makes, through ctypes (torch's context is current)."""

    def __init__(self, image: bytes) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.module = ctypes.c_void_p()
        self.check(self.cu.cuModuleLoadData(ctypes.byref(self.module), image), "cuModuleLoadData")
        self.fn = {}
        for name in ("resident", "trigger", "trigger_pdl"):
            f = ctypes.c_void_p()
            self.check(self.cu.cuModuleGetFunction(ctypes.byref(f), self.module, name.encode()),
                       f"cuModuleGetFunction({name})")
            self.fn[name] = f

    def check(self, rc, what):
        if rc != 0:
            name = ctypes.c_char_p()
            self.cu.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what}: {name.value.decode() if name.value else rc}")

    @staticmethod
    def _params(args):
        return (ctypes.c_void_p * len(args))(
            *[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])

    def launch(self, name, grid, block, stream, *args, pdl=False):
        params = self._params(args)
        if not pdl:
            self.check(self.cu.cuLaunchKernel(self.fn[name], grid, 1, 1, block, 1, 1, 0,
                                              ctypes.c_void_p(stream), params, None), name)
            return
        attr = _Attr(id=PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value.i = 1
        config = _Config((grid, 1, 1), (block, 1, 1), 0, ctypes.c_void_p(stream),
                         ctypes.pointer(attr), 1)
        self.check(self.cu.cuLaunchKernelEx(ctypes.byref(config), self.fn[name], params, None),
                   f"{name} (programmatic)")

    def link_devgraph(self, image: bytes, library: str) -> None:
        """Load DEVGRAPH_SOURCE's relocatable cubin linked against libcudadevrt.a."""
        cu = self.cu
        state = ctypes.c_void_p()
        self.check(cu.cuLinkCreate_v2(0, None, None, ctypes.byref(state)), "cuLinkCreate")
        try:
            # a relocatable cubin (NVRTC -rdc); as an object where the linker wants one
            rc = cu.cuLinkAddData_v2(state, CU_JIT_INPUT_CUBIN, image, ctypes.c_size_t(len(image)),
                                     b"devgraph", 0, None, None)
            if rc != 0:
                rc = cu.cuLinkAddData_v2(state, CU_JIT_INPUT_OBJECT, image,
                                         ctypes.c_size_t(len(image)), b"devgraph", 0, None, None)
            self.check(rc, "cuLinkAddData")
            self.check(cu.cuLinkAddFile_v2(state, CU_JIT_INPUT_LIBRARY, library.encode(), 0, None,
                                           None), f"cuLinkAddFile({library})")
            out, size = ctypes.c_void_p(), ctypes.c_size_t()
            self.check(cu.cuLinkComplete(state, ctypes.byref(out), ctypes.byref(size)),
                       "cuLinkComplete")
            module = ctypes.c_void_p()
            self.check(cu.cuModuleLoadData(ctypes.byref(module), out), "cuModuleLoadData(devgraph)")
        finally:
            cu.cuLinkDestroy(state)
        for name in ("loader", "trigger_graph"):
            f = ctypes.c_void_p()
            self.check(cu.cuModuleGetFunction(ctypes.byref(f), module, name.encode()),
                       f"cuModuleGetFunction({name})")
            self.fn[name] = f

    def device_graph(self, base: int, nbytes: int, stream: int) -> int:
        """A graph of one `loader` kernel node, instantiated for device launch and
        uploaded; its executable handle (kept for the process)."""
        cu = self.cu
        graph, node = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(cu.cuGraphCreate(ctypes.byref(graph), 0), "cuGraphCreate")
        args = [ctypes.c_uint64(base), ctypes.c_uint64(nbytes)]
        params = self._params(args)
        p = _KernelNodeParams(self.fn["loader"], (R_GRID, 1, 1), (R_BLOCK, 1, 1), 0,
                              ctypes.cast(params, ctypes.c_void_p), None, None, None)
        self.check(cu.cuGraphAddKernelNode_v2(ctypes.byref(node), graph, None, ctypes.c_size_t(0),
                                              ctypes.byref(p)), "cuGraphAddKernelNode")
        exec_ = self.instantiate_for_device_launch(graph, stream, "the loader")
        cu.cuGraphDestroy(graph)
        return exec_.value

    def instantiate_for_device_launch(self, graph, stream: int, what: str) -> ctypes.c_void_p:
        """``graph`` (a CUgraph) instantiated for device launch and uploaded on
        ``stream``; the executable's handle (kept for the process)."""
        exec_ = ctypes.c_void_p()
        self.check(self.cu.cuGraphInstantiateWithFlags(
            ctypes.byref(exec_), graph, ctypes.c_ulonglong(CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH)),
            f"cuGraphInstantiateWithFlags({what}, device launch)")
        self.check(self.cu.cuGraphUpload(exec_, ctypes.c_void_p(stream)), f"cuGraphUpload({what})")
        return exec_

    def memset32(self, address, value, stream):
        self.check(self.cu.cuMemsetD32Async(ctypes.c_uint64(address), ctypes.c_uint(value),
                                            ctypes.c_size_t(1), ctypes.c_void_p(stream)),
                   "cuMemsetD32Async")

    def write32(self, address, value, stream):
        self.check(self.cu.cuStreamWriteValue32_v2(ctypes.c_void_p(stream),
                                                   ctypes.c_uint64(address),
                                                   ctypes.c_uint32(value), ctypes.c_uint(0)),
                   "cuStreamWriteValue32_v2")



class DeviceLaunched:
    """A captured graph (``keep_graph=True``) instantiated again for device launch and
    uploaded; ``replay()`` launches it on the current stream.  Holds the torch graph,
    whose pool its nodes use; the executable lives as long as the process."""

    def __init__(self, drv, graph):
        import torch

        self.drv, self.graph = drv, graph
        self.exec = drv.instantiate_for_device_launch(
            ctypes.c_void_p(graph.raw_cuda_graph()), torch.cuda.current_stream().cuda_stream,
            "the step")

    def replay(self):
        import torch

        self.drv.check(self.drv.cu.cuGraphLaunch(self.exec, ctypes.c_void_p(
            torch.cuda.current_stream().cuda_stream)), "cuGraphLaunch(the step)")


def run(drv, name, site, spin, batch, modes=None):
    import torch

    from benchmarks.sections.planted import _model, _planted
    from l2prefetch import PrefetchController, PreparedWeightRanges
    from l2prefetch.tuning.hf import DecodeStep
    from l2prefetch.tuning.rig import Rig

    rig = Rig(torch.device("cuda", 0))
    model = _model(name)
    step = DecodeStep(model)
    layers = model.model.layers
    planted = _planted(rig, model, site, spin) if spin else []
    weights = [layer.mlp.gate_proj.weight for layer in layers]
    assert all(w.is_contiguous() and w.numel() * w.element_size() >= LOAD_BYTES for w in weights)
    slots = {
        "loads": torch.tensor([v for w in weights for v in (w.data_ptr(), LOAD_BYTES)],
                              dtype=torch.int64, device="cuda"),
        "empty": torch.tensor([v for w in weights for v in (w.data_ptr(), 0)],
                              dtype=torch.int64, device="cuda"),
    }
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    counts = {}    # per resident variant: R's timeouts, slots it came to late, runs
    stamps = {}    # per resident variant: trigger, wake and end times per slot (ns)
    side = torch.cuda.Stream()
    lib_empty = PreparedWeightRanges([], grid=32, device=0)
    lib_loads = [PreparedWeightRanges([w], byte_cap=LOAD_BYTES, grid=32, device=0)
                 for w in weights]
    # the library's `load` kernel is R's kind of load; `ring` is its sm_90 default
    lib_loads_ld = [PreparedWeightRanges([w], byte_cap=LOAD_BYTES, grid=32, device=0,
                                         kernel="load") for w in weights]
    variants = ["none", "leaf empty", "leaf loads", "leaf-ld loads", "inline empty",
                "pre empty", "pre loads", "post empty", "post loads", "beside empty",
                "beside loads"]
    variants += [f"{t} {k}" for t in TRIGGERS for k in ("empty", "loads")]
    variants += ["kernel alone", "graph empty", "graph loads", "graphpdl empty", "graphpdl loads"]
    variants = [v for v in variants if v == "none" or modes is None or v.split(" ")[0] in modes]
    # A device-side graph launch works only from a graph instantiated for device launch
    # (benchmarks/devlaunch/minimal.cu, run 19): the graph variants replay only that way,
    # and with them some controls replay both ways, from the same capture ("@dl").
    devgraph = [v for v in variants if v.split(" ")[0] in DEVGRAPH_MODES]
    dl_controls = [v for v in ("none", "inline empty", "leaf-ld loads") if v in variants] \
        if devgraph else []
    for v in variants:
        if v.split(" ")[0] in TRIGGERS:
            counts[v] = torch.zeros(3, dtype=torch.int32, device="cuda")
            stamps[v] = torch.zeros(3 * len(layers), dtype=torch.int64, device="cuda")
    # the device-graph variants: one loader graph per layer and table, launched from the
    # device; errors: refused launches, calls outside a graph, the last refusal's code
    execs, errors = {}, {}
    if "trigger_graph" in drv.fn:
        stream = torch.cuda.current_stream().cuda_stream
        for what in ("empty", "loads"):
            execs[what] = [drv.device_graph(w.data_ptr(), LOAD_BYTES if what == "loads" else 0,
                                            stream) for w in weights]
            for mode in DEVGRAPH_MODES:
                errors[f"{mode} {what}"] = torch.zeros(3, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
    with torch.no_grad():
        static = step(batch).clone()
    torch.cuda.synchronize()
    keep = []

    def trigger(variant, kind, value):
        stream = torch.cuda.current_stream().cuda_stream
        if kind == "kernel":
            drv.launch("trigger", 1, 1, stream, ctypes.c_uint64(flag.data_ptr()),
                       ctypes.c_uint(value), ctypes.c_uint64(stamps[variant].data_ptr()))
        elif kind == "pdl":
            drv.launch("trigger_pdl", 1, 1, stream, ctypes.c_uint64(flag.data_ptr()),
                       ctypes.c_uint(value), ctypes.c_uint64(stamps[variant].data_ptr()),
                       pdl=True)
        elif kind == "memset":
            drv.memset32(flag.data_ptr(), value, stream)
        else:
            drv.write32(flag.data_ptr(), value, stream)

    def capture(variant, pool, warmup):
        hooks, c, kind, table = [], None, None, None
        mode, what = variant.split(" ") if " " in variant else (variant, None)
        if mode in ("leaf", "leaf-ld", "inline", "pre", "post", "beside"):
            inline = mode in ("inline", "pre", "post", "beside")
            c = PrefetchController(0, graph_fork="inline" if inline else "leaf", eager=False)
            keep.append(c)
            table_for = lib_loads_ld if mode == "leaf-ld" else lib_loads
            for i, layer in enumerate(layers):
                c.add("p", i, [batch], table_for[i] if what == "loads" else lib_empty)
                if mode == "pre":
                    # first of post_attention_layernorm's pre-hooks, so before the planted
                    # spin: the fork's next kernel is the window's (the hook returns None,
                    # the norm's input unchanged)
                    hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(
                        lambda m, a, i=i: (c.fork("p", i, batch), None)[1], prepend=True))
                    continue
                if mode == "beside":
                    # after the planted spin's pre-hook (registered before any capture)
                    hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(
                        lambda m, a, i=i: (c.fork("p", i, batch), None)[1]))
                    continue
                if mode == "post":
                    # first of o_proj's forward hooks: right after its GEMV, before what
                    # its other hooks queue (site "oproj": the planted spin)
                    hooks.append(layer.self_attn.o_proj.register_forward_hook(
                        lambda m, a, o, i=i: (c.fork("p", i, batch), None)[1], prepend=True))
                    continue
                # the hook returns None: a returned False would replace o_proj's output
                hooks.append(layer.self_attn.o_proj.register_forward_hook(
                    lambda m, a, o, i=i: (c.fork("p", i, batch), None)[1]))
        elif mode in TRIGGERS:
            kind, table = mode, slots.get(what)      # "kernel alone": triggers, no R
            for i, layer in enumerate(layers):
                hooks.append(layer.self_attn.o_proj.register_forward_hook(
                    lambda m, a, o, i=i: trigger(variant, mode, i + 1)))
        elif mode in DEVGRAPH_MODES:
            if what not in execs:
                raise RuntimeError("no device-graph kernels (libcudadevrt.a not found or not "
                                   "linked: see the start of the output)")

            def launch_graph(i):
                # the driver refuses the kernel outside a capture (CUDA_ERROR_NOT_SUPPORTED):
                # the eager warm-up goes without it
                if torch.cuda.is_current_stream_capturing():
                    drv.launch("trigger_graph", 1, 1, torch.cuda.current_stream().cuda_stream,
                               ctypes.c_uint64(execs[what][i]),
                               ctypes.c_uint64(errors[variant].data_ptr()),
                               pdl=mode == "graphpdl")

            for i, layer in enumerate(layers):
                hooks.append(layer.self_attn.o_proj.register_forward_hook(
                    lambda m, a, o, i=i: launch_graph(i)))

        def fn():
            main = torch.cuda.current_stream()
            if table is not None:
                flag.zero_()
                side.wait_stream(main)
                drv.launch("resident", R_GRID, R_BLOCK, side.cuda_stream,
                           ctypes.c_uint64(table.data_ptr()), ctypes.c_int(len(layers)),
                           ctypes.c_uint64(flag.data_ptr()), ctypes.c_uint64(TIMEOUT_NS),
                           ctypes.c_uint64(counts[variant].data_ptr()),
                           ctypes.c_uint64(stamps[variant].data_ptr()))
            with torch.no_grad():
                out = step(batch)
            if c is not None:
                c.join()
            if table is not None:
                main.wait_stream(side)
            static.copy_(out)
            return static
        try:
            graph, _ = rig.capture(fn, warmup=warmup, pool=pool, keep_graph=True)
        finally:
            for h in hooks:
                h.remove()
        if mode in DEVGRAPH_MODES:
            return DeviceLaunched(drv, graph)
        return graph

    # each variant once on its own first: a trigger the capture refuses is dropped, not fatal
    usable = []
    for v in variants + [f"{v}@dl" for v in dl_controls]:
        try:
            if v.endswith("@dl"):
                DeviceLaunched(drv, capture(v[:-3], torch.cuda.graph_pool_handle(), 1)).replay()
            else:
                capture(v, torch.cuda.graph_pool_handle(), 1).replay()
            torch.cuda.synchronize()
            usable.append(v)
        except Exception as exc:      # noqa: BLE001 - report and go on without it
            print(f"   {v}: not usable: {type(exc).__name__}: {exc}", flush=True)
    graphs, primers = {}, []
    for i in range(INSTANCES):
        pool = torch.cuda.graph_pool_handle()
        primers.append(capture("none", pool, 0))
        own = [v for v in usable if not v.endswith("@dl")]
        k = i % len(own)
        for v in own[k:] + own[:k]:
            graphs[(v, i)] = capture(v, pool, 0)
            if f"{v}@dl" in usable:    # the same capture, instantiated for device launch
                graphs[(f"{v}@dl", i)] = DeviceLaunched(drv, graphs[(v, i)])
    for c in [*counts.values(), *errors.values()]:   # the warm-ups and usability pass not counted
        c.zero_()
    med = rig.instance_medians(graphs, ROUNDS)
    for s in stamps.values():          # the stamps of the bitwise pass's replays only
        s.zero_()
    same = bitwise_by_variant(graphs, static)
    for h in planted:
        h.remove()
    base = med["none"]
    print(f"== {name} site={site} spin={spin} us batch={batch}: none "
          f"{statistics.fmean(base):.1f} us (instances {min(base):.1f}-{max(base):.1f}); "
          f"{INSTANCES} instances x {ROUNDS} rounds, paired 95%, 6 forks or triggers per step",
          flush=True)
    for v in usable[1:]:
        d, w = paired(med[v], base)
        print(f"   {v:14} vs none {d:+7.2f} +-{w:5.2f} us   bitwise "
              f"{'same' if same[v] else 'DIFFERENT'}", flush=True)
    for a in [v for v in usable if v.endswith(" loads")]:
        b = "leaf empty" if a == "leaf-ld loads" else a[:-len("loads")] + "empty"
        if b in med:
            d, w = paired(med[b], med[a])
            print(f"   {a:14} gain vs {b}: {d:+7.2f} +-{w:5.2f} us", flush=True)
    # the deciding comparisons (negative: faster than the control): a trigger's cost against
    # the inline fork's, and its loads against the leaf's with the same kind of load; the
    # device-graph variants against controls instantiated the same way
    deciding = [(f"{t} {x}", y) for t in TRIGGERS
                for x, y in (("empty", "inline empty"), ("loads", "leaf-ld loads"))]
    deciding += [("pre empty", "inline empty"), ("pre loads", "leaf loads"),
                 ("post empty", "inline empty"), ("post loads", "leaf loads"),
                 ("beside empty", "inline empty"), ("beside loads", "leaf loads")]
    deciding += [(f"{c}@dl", c) for c in dl_controls]
    deciding += [(f"{t} {x}", f"{y}@dl") for t in DEVGRAPH_MODES
                 for x, y in (("empty", "none"), ("empty", "inline empty"),
                              ("loads", "leaf-ld loads"))]
    for x, y in deciding:
        if x in med and y in med:
            d, w = paired(med[x], med[y])
            print(f"   {x:14} vs {y:14} {d:+7.2f} +-{w:5.2f} us", flush=True)
    torch.cuda.synchronize()
    n = len(layers)
    def us(pairs):   # per slot, "-" where a stamp is missing (no trigger stamp, a timeout)
        return ", ".join(f"{(b - a) / 1e3:.1f}" if a and b else "-" for a, b in pairs)

    for v in [v for v in usable if v in errors]:
        refused, outside, code = (int(x) for x in errors[v].tolist())
        print(f"   {v:14} device launches refused: {refused} (last error {code}); trigger "
              f"calls outside a graph: {outside}", flush=True)
    for v in [v for v in usable if v in counts and v != "kernel alone"]:
        timeouts, late, runs = (int(x) for x in counts[v].tolist())
        t = stamps[v].tolist()
        trig, wake, end = t[:n], t[n:2 * n], t[2 * n:]
        print(f"   {v:14} R ran {runs} times in the timed and bitwise replays: {timeouts} "
              f"timed out, {late} slots came late (of {runs * n}); the last replay per slot: "
              f"woke {us(zip(trig, wake))} us after its trigger, loaded in "
              f"{us(zip(wake, end))} us", flush=True)
    del graphs, primers
    for c in keep:
        c.close()


def main(argv):
    if no_gpu("benchmarks.probe_resident"):
        return 0
    import torch

    from l2prefetch import _C

    torch.zeros(1, device="cuda")                 # torch's context current on this thread
    major, minor = torch.cuda.get_device_capability()
    image = _C._compile_source(SOURCE, [f"--gpu-architecture=sm_{major}{minor}"])
    if image[:4] != b"\x7fELF":
        image += b"\0"                             # PTX text: the driver wants it terminated
    drv = Driver(image)
    modes = None
    if argv[:1] == ["--variants"] and len(argv) > 1:
        modes = set(argv[1].split(","))
        unknown = modes - {"leaf", "leaf-ld", "inline", "pre", "post", "beside", *DEVGRAPH_MODES,
                           *TRIGGERS}
        if unknown:
            print(f"probe_resident: --variants: unknown {sorted(unknown)}", file=sys.stderr)
            return 2
        argv = argv[2:]
    if modes is None or modes & set(DEVGRAPH_MODES):
        library = cudadevrt()
        try:
            if library is None:
                raise RuntimeError("libcudadevrt.a not found (set L2PREFETCH_CUDADEVRT)")
            drv.link_devgraph(_C._compile_source(
                DEVGRAPH_SOURCE, [f"--gpu-architecture=sm_{major}{minor}", "-rdc=true"]), library)
            print(f"device-graph kernels linked against {library}", flush=True)
        except Exception as exc:      # noqa: BLE001 - the other variants still run
            print(f"device-graph variants not usable: {type(exc).__name__}: {exc}", flush=True)
    specs = argv or ["llama:mlp:40:1", "llama:mlp:40:8", "llama:mlp:0:1", "qwen3:mlp:40:1"]
    for spec in specs:
        name, site, spin, batch = spec.split(":")
        run(drv, name, site, int(spin), int(batch), modes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
