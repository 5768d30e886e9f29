"""layer, layer_glue: a decode step of two Kimi-shaped MoE layers at TP8 shard sizes.

One CUDA graph, with ``kimi_k3.plan``'s forks at :data:`LAYER_POINTS` (the
candidate; the shipped default forks nowhere): no prefetch, l2prefetch, the
empty-fork control, the limit, and the loaders of :data:`LAYER_ALT_KERNELS`,
at batches 1-8.  The attention core and the all-reduces are stand-ins: spins
(layer) or chains of small kernels (layer_glue).  :func:`kimi_layers` and
:func:`layer_step` are also the caps section's and benchmarks.allreduce's
(``--layer``, with real all-reduces).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch

from l2prefetch import PrefetchController
from l2prefetch.tuning.report import table
from l2prefetch.tuning.rig import empty_controller

from ..common import K, MIB, glue_chain, pct

#: Stand-ins for a Kimi MoE decode layer at TP8 (per rank, bf16): weight shapes
#: [out, in] of each GEMV, in the order a layer runs them.
LAYER_WEIGHTS = (
    ("attn_in", (1152, K)),        # attention input projection (KDA in_proj_qkvgfab stand-in)
    ("o_proj", (K, 1024)),         # 64 heads x 128 / 8 ranks -> hidden
    ("front", (512, K)),           # packed [router 384 rows; latent-down shard 128 rows]
    ("shared_gate_up", (384, K)),  # shared expert gate_up shard
    ("shared_down", (K, 384)),     # shared expert down shard (reads gate_up's output)
    ("experts", (2176, K)),        # routed experts: one GEMV over ~30 MiB
)
#: Attention core stand-in: one CTA spinning (reads no weights, leaves HBM idle).
LAYER_CORE_US = 20
#: TP8 all-reduce stand-in (after o_proj and after the MoE): one CTA spinning.
LAYER_ALLREDUCE_US = 8
#: layer_glue: about how long one small kernel of the glue chain runs in a graph at
#: batch 1-8 (RESULTS.md, "Older runs", run 8: 6 kernels took 19-24 us, 30 took 88-99 us).
GLUE_KERNEL_US = 3.2
#: Graph instances per variant (Rig.measure).
INSTANCES = 3
#: The fork points (kimi_k3.plan's points=): the candidate, which kimi_k3 shipped at
#: TP 8 until run 9 (attention_moe at B5-8; the next_attention caps are 0).
LAYER_POINTS = ("attention_moe", "next_attention")
#: Loader kernel variants also tried in (b)'s place.
LAYER_ALT_KERNELS = ("line_prefetch", "bulk_prefetch")


def _glue(h, us):
    """Enqueue about us microseconds of the glue chain on h, at least one kernel."""
    glue_chain(h, max(1, round(us / GLUE_KERNEL_US)))


def _covered(intervals, start, nbytes):
    """Bytes of [start, start + nbytes) inside the union of intervals [(lo, hi)]."""
    merged = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    end = start + nbytes
    return sum(max(0, min(hi, end) - max(lo, start)) for lo, hi in merged)


def kimi_layers(tp, device, count=2):
    """``count`` Kimi-shaped MoE layers on ``device`` with LAYER_WEIGHTS scaled from TP8 to
    ``tp`` (the sharded dimension grows by 8 / tp; the router's 384 rows of front are not
    sharded), as objects kimi_k3.plan reads; returns (layers, packed)."""
    scale = 8 // tp
    layers = []
    for index in range(count):
        ws = {}
        for name, (rows, cols) in LAYER_WEIGHTS:
            if name == "front":
                rows = 384 + (rows - 384) * scale
            elif name in ("o_proj", "shared_down"):
                cols *= scale
            else:
                rows *= scale
            ws[name] = torch.randn(rows, cols, device=device,
                                   dtype=torch.float32).to(torch.bfloat16)
        attention = NS(in_proj_qkvgfab=NS(weight=ws["attn_in"]), o_proj=NS(weight=ws["o_proj"]))
        shared = NS(gate_up_proj=NS(weight=ws["shared_gate_up"]),
                    down_proj=NS(weight=ws["shared_down"]))
        layers.append(NS(is_moe_layer=True, layer_idx=index, self_attn=attention,
                         mlp=NS(shared_experts=shared), ws=ws))
    return layers, {layer.layer_idx: layer.ws["front"] for layer in layers}


def layer_step(rig, layers, ctrl, batch, h, a, s, allreduce, glue=False):
    """The step: the layers' GEMVs, the stand-ins, the reference design's forks (when
    ctrl is not None) and one join at the end.  h [B, 7168], a and s: the inputs of
    o_proj and shared_down.  allreduce: the all-reduce's stand-in in us (a spin), or a
    callable that runs a real one (benchmarks.allreduce --layer).  glue: the stand-ins
    are chains of small kernels that touch memory instead of spins."""
    lin = torch.nn.functional.linear

    def wait(us):
        if glue:
            _glue(h, us)
        else:
            rig.spin(us)

    if not callable(allreduce):
        allreduce_us = allreduce

        def allreduce():
            wait(allreduce_us)

    def fork(point, index):
        if ctrl is not None:
            ctrl.fork(point, index, batch)

    def fn():
        for layer in layers:
            ws, i = layer.ws, layer.layer_idx
            lin(h, ws["attn_in"])
            fork("attention_moe", i)       # after the KDA input projection
            wait(LAYER_CORE_US)            # attention core
            lin(a, ws["o_proj"])
            fork("oproj_down", i)          # after the o-projection
            allreduce()                    # all-reduce
            lin(h, ws["front"])            # router + latent-down
            lin(h, ws["shared_gate_up"])
            lin(s, ws["shared_down"])
            lin(h, ws["experts"])
            fork("next_attention", i)      # once the routed experts are launched
            allreduce()                    # all-reduce
        if ctrl is not None:
            ctrl.join()                    # one join, at the end of the step
    return fn


def run(rig, quick, glue=False):
    """Two Kimi-shaped MoE decode layers (TP8 shard sizes) in one graph with the reference
    design's forks; with glue, the attention-core and all-reduce stand-ins are small
    kernels, not spins."""
    from l2prefetch import kimi_k3

    dev = rig.device.index
    batches = [1, 8] if quick else [1, 2, 4, 8]
    reps = 60 if quick else 150
    lin = torch.nn.functional.linear
    shapes = dict(LAYER_WEIGHTS)
    layers, packed = kimi_layers(8, rig.device)
    entries = kimi_k3.plan(layers, packed, 8, points=LAYER_POINTS)
    ctrl_b = PrefetchController.from_plan(entries, dev)   # graph_fork='inline', as shipped
    ctrl_d = empty_controller(entries, dev)
    ctrl_alt = {k: PrefetchController.from_plan(entries, dev, kernel=k) for k in LAYER_ALT_KERNELS}
    rows, raw = [], []
    for batch in batches:
        h = torch.randn(batch, K, device=rig.device, dtype=torch.bfloat16)
        a = torch.randn(batch, shapes["o_proj"][1], device=rig.device, dtype=torch.bfloat16)
        s = torch.randn(batch, shapes["shared_down"][1], device=rig.device, dtype=torch.bfloat16)
        inputs = {"o_proj": a, "shared_down": s}

        def step(ctrl, batch=batch, h=h, a=a, s=s):
            return layer_step(rig, layers, ctrl, batch, h, a, s, LAYER_ALLREDUCE_US, glue)

        fns = {"a": step(None), "b": step(ctrl_b), "d": step(ctrl_d)}
        fns.update({k: step(c) for k, c in ctrl_alt.items()})
        warm = set()
        # What the forks load at this batch, and which GEMVs read it.
        active = [(p, l) for p, l, bb in ctrl_b.keys() if bb == batch]
        intervals, loaded = [], 0
        for p, l in active:
            prepared = ctrl_b.get(p, l, batch)
            loaded += prepared.nbytes
            intervals += [(ptr, ptr + n) for ptr, n in prepared.ranges]
        consumers = {}
        for layer in layers:
            for name, wt in layer.ws.items():
                frac = _covered(intervals, wt.data_ptr(), wt.nbytes) / wt.nbytes
                if frac > 0:
                    consumers[f"L{layer.layer_idx} {name}"] = (wt, inputs.get(name, h), frac)
        reads = {}
        for key, (wt, xin, _) in consumers.items():
            def gemv(wt=wt, xin=xin):
                lin(xin, wt)

            fns["cold " + key] = fns["hot " + key] = gemv
            warm.add("hot " + key)
            reads["hot " + key] = gemv

        def prepare(name):
            rig.flush()            # a real step's weights are cold
            if name in warm:
                reads[name]()      # hot: the weight read just before

        m = rig.measure(fns, INSTANCES, reps, before=prepare)
        t = {name: m.pooled_median(name) for name in fns}
        spread = {name: m.spread(name) for name in ("a", "b")}
        saving = sum(frac * max(0.0, t["cold " + key] - t["hot " + key])
                     for key, (_, _, frac) in consumers.items())
        ta, tb, td = t["a"], t["b"], t["d"]
        tc = ta - saving
        share = (ta - tb) / (ta - tc) if ta - tc > 0.5 else float("nan")
        points = sorted({p for p, _ in active})
        raw.append({"batch": batch, "a": ta, "b": tb, "d": td, "c": tc, "share": share,
                    "points": points, "loaded": loaded, "consumers": list(consumers),
                    "alt": {k: t[k] for k in LAYER_ALT_KERNELS}})
        rows.append((batch, ", ".join(points) or "-", f"{loaded / MIB:.1f}", f"{ta:.2f}",
                     f"{tb:.2f}", f"{td:.2f}", f"{tc:.2f}", f"{ta / tb:.3f}x", f"{ta - tb:+.2f}",
                     f"{td - tb:+.2f}", f"{ta - tc:.2f}", "-" if share != share else pct(share),
                     f"{spread['a']:.2f} / {spread['b']:.2f}",
                     *(f"{t[k]:.2f} ({ta / t[k]:.3f}x)" for k in LAYER_ALT_KERNELS)))
    for ctrl in (ctrl_b, ctrl_d, *ctrl_alt.values()):
        ctrl.close()
    per_layer = sum(wt.nbytes for wt in layers[0].ws.values())
    sizes = ", ".join(f"{name} [{r} x {c}] {r * c * 2 / MIB:.2f} MiB"
                      for name, (r, c) in LAYER_WEIGHTS)
    for row in raw:
        ok_speed = row["a"] / row["b"] >= 0.99
        limited = row["a"] - row["c"] > 0.5
        ok_share = (not limited) or row["share"] >= 0.85
        row["goal"] = ok_speed and ok_share
    misses = [f"B{row['batch']}" for row in raw if not row["goal"]]
    if glue:
        x1 = torch.randn(1, K, device=rig.device, dtype=torch.bfloat16)
        lengths = rig.time_graphs({us: rig.capture(lambda us=us: _glue(x1, us))[0]
                                   for us in (LAYER_CORE_US, LAYER_ALLREDUCE_US)}, reps)
        title = "layer_glue: a decode step with real glue, small kernels for the spins"
        core = (f"{round(LAYER_CORE_US / GLUE_KERNEL_US)} small kernels (RMSNorm, scale, add "
                f"on x [B, 7168]; {lengths[LAYER_CORE_US]:.1f} us alone at B1)")
        ar = (f"{round(LAYER_ALLREDUCE_US / GLUE_KERNEL_US)} such kernels "
              f"({lengths[LAYER_ALLREDUCE_US]:.1f} us at B1)")
    else:
        title = "layer: a decode step of two Kimi-shaped MoE layers at TP8"
        core = f"spin({LAYER_CORE_US} us) (one CTA, reads no weights)"
        ar = f"spin({LAYER_ALLREDUCE_US} us)"
    text = (f"### {title} (step time, us)\n\n"
            f"One CUDA graph of two layers back to back, per layer: GEMV attn_in; "
            f"[attention_moe]; attention core stand-in = {core}; GEMV o_proj; [oproj_down]; "
            f"all-reduce stand-in = {ar}; GEMVs front, shared gate_up, shared down, routed "
            f"experts; [next_attention]; all-reduce stand-in = {ar}; "
            "one join at the end of the step.  Weights (bf16, hidden 7168, per TP8 rank, "
            f"{per_layer / MIB:.1f} MiB per layer): {sizes}; norms, activations and routing "
            "are left out, every GEMV reads fixed random inputs.  Forks, weights, batches, "
            "grids, carveouts and priorities come from `l2prefetch.kimi_k3.plan(layers, "
            f"packed, tp=8, points={LAYER_POINTS!r})` (shipped points: "
            f"{', '.join(kimi_k3.DEFAULT_POINTS[8]) or 'none'}; KDA attention: attention_moe at B5-8 "
            "with front + shared expert, grid 32, carveout 100, priority; next_attention: "
            "layer 1's attn_in + o_proj capped at NEXT_ATTENTION[8] "
            f"= {kimi_k3.NEXT_ATTENTION[8]}, grid 32), graph_fork='inline'.  "
            f"Each variant captured {INSTANCES} times (graph instances of one capture differ), "
            "all replays interleaved, each after a flush (a real step's weights are cold): (a) no "
            "prefetch, (b) l2prefetch, (d) the same forks with empty tables (control), and (b) "
            "with the loader kernel " + " or ".join(LAYER_ALT_KERNELS) + " (last columns; "
            "a/that in brackets).  (c) "
            "the limit: (a) minus, for every GEMV whose weight the forks load at that batch, "
            "its cold - hot time measured alone (hot = weight read just before; scaled by the "
            "share of the weight loaded), interleaved with the rest.  It is computed rather "
            "than replayed because the step streams "
            f"{2 * per_layer / MIB:.0f} MiB, more than L2: weights read before the step would "
            "be evicted before their GEMV runs.  share = (a-b)/(a-c), shown where a-c > 0.5 "
            "us.  points = forks that launch at that batch; MiB = bytes they load; spread = "
            "max - min of the per-instance medians of a and of b.\n\n"
            + table(["batch", "points", "MiB", "a: none", "b: l2prefetch", "d: empty forks",
                     "c: limit", "a/b", "a-b", "d-b", "a-c", "share of limit",
                     "spread a / b", *(f"b: {k}" for k in LAYER_ALT_KERNELS)], rows)
            + "\nGoal: at least 85% of the limit where the limit exceeds 0.5 us, and never "
            "slower than 0.99x (a/b >= 0.99): "
            + ("met at every batch." if not misses else f"missed at {', '.join(misses)}."))
    return text, raw


def run_glue(rig, quick):
    return run(rig, quick, glue=True)
