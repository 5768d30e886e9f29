"""Probe (run 24's question): do near-empty forks alone make a compiled step faster?

The Llama-shaped model (``benchmarks.common.hf_model("llama")``; ``--model``: another of
its names whose layers have ``o_proj`` and ``gate_proj`` or ``gate_up_proj``), nothing
planted, its forward compiled (Inductor default), each variant captured in
``--instances`` CUDA graphs and replayed interleaved, ``--rounds`` rounds of 20 replays
per graph:

* ``none``: the step compiled without hooks; ``none2``: compiled again (what two
  compilations differ by);
* ``branch``, ``inline``, ``leaf``: a fork after ``o_proj`` in that mode, at every layer
  or at ``--layers``, loading 16 KiB of the MLP's first weight (a table as near empty as a
  plan can make it).

Run 25's next questions: is the gain per fork (one fork: a sixth of it) or the graph's
(one fork: all of it), ``--layers 0``; and is it the Llama-shaped model's only (run 25:
Qwen3's and the vLLM-shaped model's compiled empty forks cost 0.5-1.9 us), ``--model
qwen3``.

Per variant: the mean of per-instance medians (us), and its difference to ``none``:
paired by round (95% interval over the rounds: the replay noise, not the captures'
spread) and over the instances' medians (Welch's 95% interval: the captures' spread
too); and whether the logits are bitwise those of ``none``.

    python -m benchmarks.probe_branch [--batch 1] [--instances 5] [--rounds 20]
                                      [--model llama] [--layers 0,3]
"""
import argparse
import statistics

import torch

from benchmarks.common import hf_model, no_gpu
from l2prefetch import PrefetchController, hooks
from l2prefetch.plan import PlanEntry
from l2prefetch.tuning.cli import compile_forward
from l2prefetch.tuning.compiled import recompile
from l2prefetch.tuning.hf import DecodeStep
from l2prefetch.tuning.rig import Rig
from l2prefetch.tuning.stats import diff_interval, t_quantile


def _capture(rig, step, batch):
    """(graph, its logits as captured) for ``step(batch)``, warmed up and compiled first."""
    with torch.no_grad():
        graph, out = rig.capture(lambda: step(batch))
    graph.replay()
    torch.cuda.synchronize()
    return graph, out.clone()


def fork_layers(layers, chosen):
    """[(index, layer)] of the layers that fork: all, or those in ``chosen`` ("0,3")."""
    if chosen is None:
        return list(enumerate(layers))
    picked = sorted({int(i) for i in chosen.split(",")})
    if not picked or picked[0] < 0 or picked[-1] >= len(layers):
        raise SystemExit(f"--layers {chosen!r}: pick among 0..{len(layers) - 1}")
    return [(i, layers[i]) for i in picked]


def first_mlp_weight(layer):
    """The weight the MLP reads first: ``gate_proj``'s, or the fused ``gate_up_proj``'s."""
    mlp = layer.mlp
    for name in ("gate_proj", "gate_up_proj"):
        if hasattr(mlp, name):
            return getattr(mlp, name).weight
    raise SystemExit(f"{type(mlp).__name__} has neither gate_proj nor gate_up_proj")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probe_branch")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--instances", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--model", default="llama")
    parser.add_argument("--layers", default=None, metavar="I,J",
                        help="fork at these layers only (default: every layer)")
    args = parser.parse_args(argv)
    if no_gpu("benchmarks.probe_branch"):
        return
    rig = Rig()
    model = hf_model(args.model)
    step = DecodeStep(model)
    step.state(args.batch)
    compile_forward(model, "default")
    layers = fork_layers(model.model.layers, args.layers)
    sites = {"o": [(layer.self_attn.o_proj, i) for i, layer in layers]}
    plan = [PlanEntry("o", i, [args.batch], [first_mlp_weight(layer)], byte_cap=16384)
            for i, layer in layers]
    graphs, outs, controllers = {}, {}, []
    for variant in ("none", "branch", "inline", "leaf", "none2"):
        recompile()
        if variant.startswith("none"):
            captured = [_capture(rig, step, args.batch) for _ in range(args.instances)]
        else:
            ctrl = PrefetchController.from_plan(plan, 0, graph_fork=variant, eager=False)
            controllers.append(ctrl)                  # alive while its graphs replay
            with hooks.attach(model, ctrl, sites):
                recompile()
                captured = [_capture(rig, step, args.batch) for _ in range(args.instances)]
        graphs[variant] = [g for g, _ in captured]
        outs[variant] = captured[0][1]
        print(f"{variant}: captured {args.instances}", flush=True)
    recompile()
    per = {v: [[] for _ in gs] for v, gs in graphs.items()}
    for _ in range(args.rounds):
        for v, gs in graphs.items():
            for k, g in enumerate(gs):
                per[v][k].append(rig.time_graph(g, 20))
    means = {v: [statistics.fmean(per[v][k][r] for k in range(len(gs)))
                 for r in range(args.rounds)] for v, gs in graphs.items()}
    ref = outs["none"].view(torch.int16)
    print(f"| variant | batch | step us (mean of instance medians) | instances' range | "
          f"- none us, paired by round (95%) | - none us, over instances (95%) | bitwise |"
          f"\n|---|---:|---:|---|---|---|---|")
    for v, gs in graphs.items():
        inst = [statistics.median(per[v][k]) for k in range(len(gs))]
        diffs = [m - n for m, n in zip(means[v], means["none"])]
        mean = statistics.fmean(diffs)
        half = (t_quantile(0.975, len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5
                if len(diffs) > 1 else 0.0)
        between = (diff_interval(inst, [statistics.median(p) for p in per["none"]])
                   if len(inst) > 1 else None)
        same = torch.equal(outs[v].view(torch.int16), ref)
        print(f"| {v} | {args.batch} | {statistics.fmean(inst):.1f} | "
              f"{min(inst):.1f}-{max(inst):.1f} | {mean:+.2f} [{mean - half:+.2f}, "
              f"{mean + half:+.2f}] | {'' if between is None else between.format(2)} | {same} |",
              flush=True)
    for ctrl in controllers:
        ctrl.close()


if __name__ == "__main__":
    main()
