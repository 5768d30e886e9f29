"""Probe (issue 24): what an empty fork costs, per mode, paired by graph instance.

An inline loader K is a programmatic dependent of the kernel X before it (csrc/capture.c,
NOTE [inline graph fork]): it launches while X finishes and waits for X in
griddepcontrol.wait, so its launch is off the main path.  Run 15 measured that against
the ordinary edge in an experiment build (benchmarks/run15/pdl-experiment.log);
this probe measures the modes as shipped.  Forks after every o_proj (HF Llama- or
Qwen3-shaped, 6 layers, planted spin or none), every variant captured into one memory
pool per instance (paired by instance; a primer capture first):

  none                no forks
  MODE empty          forks with empty tables
  MODE loads          the same with 24 MiB of that layer's gate_proj

    python -m benchmarks.probe_pdl [MODEL:SITE:SPIN:BATCH ...]     (on the GPU)
"""
from __future__ import annotations

import statistics
import sys

from benchmarks.common import bitwise_by_variant, no_gpu, paired

MIB = 1 << 20
INSTANCES = 6
ROUNDS = 40
VARIANTS = {   # name: (graph_fork, loads)
    "none": (None, False),
    "inline empty": ("inline", False),
    "leaf empty": ("leaf", False),
    "branch empty": ("branch", False),
    "inline loads": ("inline", True),
    "leaf loads": ("leaf", True),
    "branch loads": ("branch", True),
}



def run(name, site, spin, batch):
    import torch

    from benchmarks.sections.planted import _model, _planted
    from l2prefetch import PrefetchController, PreparedWeightRanges, _C
    from l2prefetch.tuning.hf import DecodeStep
    from l2prefetch.tuning.rig import Rig

    rig = Rig(torch.device("cuda", 0))
    model = _model(name)
    step = DecodeStep(model)
    layers = model.model.layers
    planted = _planted(rig, model, site, spin) if spin else []
    empty = PreparedWeightRanges([], grid=32, device=0)
    loads = [PreparedWeightRanges([layer.mlp.gate_proj.weight], byte_cap=24 * MIB, grid=32,
                                  device=0) for layer in layers]
    with torch.no_grad():
        static = step(batch).clone()
    torch.cuda.synchronize()
    keep = []

    def capture(variant, pool, warmup):
        mode, with_loads = VARIANTS[variant]
        hooks, c = [], None
        if mode is not None:
            c = PrefetchController(0, graph_fork=mode, eager=False)
            keep.append(c)
            for i, layer in enumerate(layers):
                c.add("p", i, [batch], loads[i] if with_loads else empty)
                hooks.append(layer.self_attn.o_proj.register_forward_hook(
                    lambda m, a, o, i=i: c.fork("p", i, batch) and None))

        def fn():
            with torch.no_grad():
                out = step(batch)
            if c is not None:
                c.join()
            static.copy_(out)
            return static
        try:
            graph, _ = rig.capture(fn, warmup=warmup, pool=pool, keep_graph=True)
        finally:
            for h in hooks:
                h.remove()
        return graph

    graphs, primers, nodes = {}, [], {}
    names = list(VARIANTS)
    for i in range(INSTANCES):
        pool = torch.cuda.graph_pool_handle()
        primers.append(capture("none", pool, 1 if i == 0 else 0))
        k = i % len(names)
        for v in names[k:] + names[:k]:
            g = capture(v, pool, 0)
            graphs[(v, i)] = g
            if i == 0:
                nodes[v] = len(_C._graph_loader_nodes(g.raw_cuda_graph()))
    med = rig.instance_medians(graphs, ROUNDS)
    # bitwise: each graph's output right after its own replay, against none's first
    same = bitwise_by_variant(graphs, static)
    for h in planted:
        h.remove()
    base = med["none"]
    print(f"== {name} site={site} spin={spin} us batch={batch}: none "
          f"{statistics.fmean(base):.1f} us (instances {min(base):.1f}-{max(base):.1f}); "
          f"{INSTANCES} instances x {ROUNDS} rounds, paired 95%")
    for v in names[1:]:
        d, w = paired(med[v], base)
        print(f"   {v:20} vs none {d:+7.2f} +-{w:5.2f} us   loader nodes {nodes[v]}  "
              f"bitwise {'same' if same[v] else 'DIFFERENT'}")
    for a in [v for v in names if v.endswith(" loads")]:
        b = a[:-len("loads")] + "empty"
        d, w = paired(med[b], med[a])
        print(f"   {a:20} gain vs {b}: {d:+7.2f} +-{w:5.2f} us")
    sys.stdout.flush()
    del graphs, primers
    for c in keep:
        c.close()


def main(argv):
    if no_gpu("benchmarks.probe_pdl"):
        return 0
    specs = argv or ["llama:mlp:0:1", "llama:mlp:0:8", "qwen3:mlp:0:1", "qwen3:mlp:0:8",
                     "llama:mlp:40:1", "llama:attn:40:8"]
    for spec in specs:
        name, site, spin, batch = spec.split(":")
        run(name, site, int(spin), int(batch))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
