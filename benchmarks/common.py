"""What the single-GPU benchmarks share: the effect's step, the glue chain, weights.

Capture, graph instances, interleaved replays, the L2 flush and the
empty-fork control are the package's (:mod:`l2prefetch.tuning.rig`); this
module holds only the benchmarks' own workloads.
"""

from __future__ import annotations

import datetime
import statistics

import torch

import l2prefetch
from l2prefetch import PrefetchController, _C

MIB = 2**20
#: The hidden size of the benchmarks' GEMVs (Kimi and DeepSeek-V3: 7168).
K = 7168

_GAMMAS: dict = {}


def weight(rig, mib, cols=K):
    """A random bf16 [N, cols] weight of about ``mib`` MiB, N a multiple of 32."""
    rows = max(32, int(mib * MIB / (cols * 2)) // 32 * 32)
    return torch.randn(rows, cols, device=rig.device, dtype=torch.float32).to(torch.bfloat16)


def pct(x):
    return f"{100 * x:.0f}%"


def device_line(rig):
    """One line naming the device, driver and versions, and the time (UTC)."""
    info = _C.device_info(rig.device.index)
    drv = _C.driver_info()
    return (f"Device: {torch.cuda.get_device_name(rig.device)} (sm_{info['sm']}, "
            f"{info['sm_count']} SMs, L2 {info['l2_bytes'] / MIB:.0f} MiB), driver "
            f"{drv['version'] // 1000}.{drv['version'] % 1000 // 10}, torch {torch.__version__}, "
            f"l2prefetch {l2prefetch.__version__}, NVRTC "
            f"{'.'.join(map(str, _C.nvrtc_info()['version']))}, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.")


def glue_chain(h, kernels):
    """Enqueue ``kernels`` small kernels that touch memory: RMSNorm, scale and add on
    h [B, hidden] in turn (the glue section's window and the layer_glue stand-ins)."""
    key = (h.device, h.dtype, h.shape[-1])
    gamma = _GAMMAS.get(key)
    if gamma is None:
        gamma = _GAMMAS[key] = torch.ones(h.shape[-1], device=h.device, dtype=h.dtype)
    v = h
    for k in range(kernels):
        if k % 3 == 0:
            v = torch.nn.functional.rms_norm(v, (h.shape[-1],), gamma)
        elif k % 3 == 1:
            v = v * 0.5
        else:
            v = v + h
    return v


def run_sequence(rig, w, batch, window, prepared_by_name, reps, window_fn=None, instances=1):
    """The effect's step: cold / prepared variants / hot, medians (us).

    Step = small op, [fork] spin(window) GEMV over w [join]; ``window_fn()``
    enqueues the window instead of the spin when given.  ``prepared_by_name``
    maps a variant name to the table its fork loads (a name ending in
    " (branch)" forks with graph_fork='branch').  Every variant is captured
    ``instances`` times, all graphs replayed interleaved; cold is flushed
    before each replay, hot replays cold's graphs after a flush and a read of
    w.  Returns {variant: median of its instances' medians}, and with
    instances > 1 out["spread"] = {variant: max - min of those medians}.
    """
    dev = rig.device.index
    x = torch.randn(batch, K, device=rig.device, dtype=torch.bfloat16)
    ctrls = {mode: PrefetchController(dev, graph_fork=mode) for mode in ("inline", "branch")}
    for name, p in prepared_by_name.items():
        base = name[: -len(" (branch)")] if name.endswith(" (branch)") else name
        ctrls["branch" if base != name else "inline"].add(base, 0, [batch], p)

    before = torch.zeros(256, device=rig.device)

    def step(name=None):
        ctrl, point = None, name
        if name:
            mode = "branch" if name.endswith(" (branch)") else "inline"
            ctrl, point = ctrls[mode], name[: -len(" (branch)")] if mode == "branch" else name

        def fn():
            before.add_(1.0)   # the work the fork follows: the fork is mid-graph, as in a layer
            if ctrl:
                ctrl.fork(point, 0, batch)
            if window_fn is None:
                rig.spin(window)
            else:
                window_fn()
            torch.nn.functional.linear(x, w)
            if ctrl:
                ctrl.join()
        return fn

    graphs = {}
    for i in range(instances):
        graphs["cold", i] = graphs["hot", i] = rig.capture(step())[0]
        for name in prepared_by_name:
            graphs[name, i] = rig.capture(step(name))[0]

    def prepare(key):
        rig.flush()
        if key[0] == "hot":
            torch.nn.functional.linear(x, w)

    per = rig.instance_medians(graphs, reps, prepare)
    del graphs
    out = {name: statistics.median(m) for name, m in per.items()}
    if instances > 1:
        out["spread"] = {name: max(m) - min(m) for name, m in per.items()}
    for ctrl in ctrls.values():
        ctrl.close()
    return out


def paired(x, y):
    """mean(x - y) over instances and its 95% half-width (Student's t), as a tuple."""
    from l2prefetch.tuning.stats import paired_interval

    iv = paired_interval(x, y)
    return iv.estimate, iv.half_width


def bitwise_by_variant(graphs, static, reference=("none", 0)):
    """Per variant of ``graphs`` ((variant, instance) -> graph whose replay writes
    ``static``): whether every instance's output equals the reference graph's, each
    read right after its own replay (bit for bit: tuning.outputs.bitwise_equal)."""
    from l2prefetch.tuning.outputs import bitwise_equal

    graphs[reference].replay()
    torch.cuda.synchronize()
    ref = static.clone()
    same = {}
    for (variant, _), graph in graphs.items():
        graph.replay()
        torch.cuda.synchronize()
        same[variant] = same.get(variant, True) and bitwise_equal(ref, static)
    return same


def no_gpu(prog):
    """True, having said so, where torch sees no CUDA GPU (a benchmark then exits 0)."""
    if torch.cuda.is_available():
        return False
    print(f"python -m {prog} needs a CUDA GPU; none is visible here.")
    return True


def hf_model(name):
    """An HF causal LM for the probes, random bf16 on the GPU: a planted section's model
    (``llama``, ``qwen3``: benchmarks/sections/planted.py) or a config of
    benchmarks/configs by its file name (``mixtral-4l``, ``deepseek-v3-6l``, ...)."""
    import pathlib

    from l2prefetch.tuning import hf

    from .sections.planted import MODELS, _model

    if name in MODELS:
        return _model(name)
    path = pathlib.Path(__file__).parent / "configs" / f"{name}.json"
    if not path.is_file():
        known = sorted([*MODELS, *(p.stem for p in path.parent.glob("*.json"))])
        raise SystemExit(f"unknown model {name!r}: one of {', '.join(known)}")
    return hf.load_model(str(path))
