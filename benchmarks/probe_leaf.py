"""Probe (issue 24): what an empty leaf fork costs, by when its node is made.

The executor of a CUDA graph keeps the first-made child of a node on that node's hardware
stream.  A leaf made at the fork is X's first child, so the main path (X -> Y) moves to
another stream at every fork.  Variants of the same forks after every o_proj (HF Llama- or
Qwen3-shaped, 6 layers, planted spin or none), captured into one memory pool per instance
(so every difference is paired by instance; a primer capture first):

  none                no forks
  inline / leaf       as shipped, empty tables
  signal              a one-thread kernel on the captured stream sets a flag; on a side
                      chain with no edge from the main path a one-thread kernel waits for
                      it, then the loader runs (L2PREFETCH_LEAF_EXPERIMENT=3)
  leaf late           the leaf node made at the next fork or join, after X's own edges
                      (L2PREFETCH_LEAF_EXPERIMENT=2)
  ... loads           the same with 24 MiB of that layer's gate_proj

    python -m benchmarks.probe_leaf [MODEL:SITE:SPIN:BATCH ...]     (on the GPU)
"""
from __future__ import annotations

import os
import statistics
import sys

from benchmarks.common import no_gpu

MIB = 1 << 20
INSTANCES = 6
ROUNDS = 40
VARIANTS = {   # name: (graph_fork, experiment, loads)
    "none": (None, 0, False),
    "inline empty": ("inline", 0, False),
    "leaf empty": ("leaf", 0, False),
    "leaf late empty": ("leaf", 2, False),
    "signal empty": ("leaf", 3, False),
    "leaf loads": ("leaf", 0, True),
    "leaf late loads": ("leaf", 2, True),
    "signal loads": ("leaf", 3, True),
}
T975 = {2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 9: 2.262, 11: 2.228}


def paired(x, y):
    d = [a - b for a, b in zip(x, y)]
    n = len(d)
    return statistics.fmean(d), T975.get(n - 1, 2.0) * statistics.stdev(d) / n ** 0.5


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
        mode, exp, with_loads = VARIANTS[variant]
        os.environ["L2PREFETCH_LEAF_EXPERIMENT"] = str(exp)
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
    graphs[("none", 0)].replay()
    torch.cuda.synchronize()
    ref = static.clone()
    same = {}
    for (v, i), g in graphs.items():
        g.replay()
        torch.cuda.synchronize()
        same[v] = same.get(v, True) and bool(torch.equal(ref, static))
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
    for a, b in (("leaf loads", "leaf empty"), ("leaf late loads", "leaf late empty"),
                 ("signal loads", "signal empty")):
        d, w = paired(med[b], med[a])
        print(f"   {a:20} gain vs {b}: {d:+7.2f} +-{w:5.2f} us")
    sys.stdout.flush()
    del graphs, primers
    for c in keep:
        c.close()


def main(argv):
    if no_gpu("benchmarks.probe_leaf"):
        return 0
    specs = argv or ["llama:mlp:40:1", "llama:mlp:40:8", "llama:mlp:0:1", "llama:mlp:0:8",
                     "qwen3:mlp:0:8", "qwen3:mlp:40:1"]
    for spec in specs:
        name, site, spin, batch = spec.split(":")
        run(name, site, int(spin), int(batch))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
