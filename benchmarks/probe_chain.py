"""Why a chain of small kernels can replay slower *without* a fork node.

In run 9 (benchmarks/RESULTS.md) the glue section's no-fork graph ("cold":
small op, 3n small kernels, GEMV) replayed 2-11 us slower than the same graph
with an empty inline fork, in some processes and not others.  This probe
tells the candidate causes apart, each variant captured --instances times
and replayed interleaved after a flush (medians of the instances' medians):

  plain, first    no fork, captured before every other variant
  empty fork      the inline empty fork of the glue section
  plain, last     no fork, captured after the empty fork
  plain node      no fork; a plain kernel (a zero-length spin) where the fork was

"plain, first" against "plain, last" is the capture order; "plain" against
"plain node" is one more node; "plain node" against "empty fork" is the
programmatic launch-order edge.  Needs a GPU:

    python benchmarks/probe_chain.py [--rounds 2,10] [--batches 1,8] [--instances 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py: Rig, glue_chain, weight)

from l2prefetch import PrefetchController, PreparedWeightRanges  # noqa: E402

VARIANTS = ("plain, first", "empty fork", "plain, last", "plain node")


def measure(rig, w, batch, rounds, instances, reps):
    """{variant: median of the instances' medians (us)}, and the largest spread."""
    h = torch.randn(batch, report.K, device=report.DEV, dtype=torch.bfloat16)
    x = torch.randn(batch, report.K, device=report.DEV, dtype=torch.bfloat16)
    before = torch.zeros(256, device=report.DEV)
    ctrl = PrefetchController(0)
    ctrl.add("e", 0, [batch], PreparedWeightRanges([], device=0, carveout=100))

    def step(kind):
        def fn():
            before.add_(1.0)
            if kind == "empty fork":
                ctrl.fork("e", 0, batch)
            elif kind == "plain node":
                torch.cuda._sleep(0)
            report.glue_chain(h, 3 * rounds)
            torch.nn.functional.linear(x, w)
            if kind == "empty fork":
                ctrl.join()
        return fn

    graphs = {(kind, i): rig.capture(step(kind)) for i in range(instances) for kind in VARIANTS}
    us = rig.replays(graphs, {key: rig.flush for key in graphs}, reps)
    ctrl.close()
    per = {kind: [statistics.median(us[kind, i]) for i in range(instances)] for kind in VARIANTS}
    return ({kind: statistics.median(m) for kind, m in per.items()},
            max(max(m) - min(m) for m in per.values()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", default="2,10", help="glue rounds (3 kernels each)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--instances", type=int, default=5)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--mib", type=int, default=16, help="the GEMV's weight, MiB")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/probe_chain.py needs a CUDA GPU; none is visible here.")
        return 0
    rig = report.Rig()
    w = report.weight(args.mib)
    rows = []
    for batch in map(int, args.batches.split(",")):
        for rounds in map(int, args.rounds.split(",")):
            t, spread = measure(rig, w, batch, rounds, args.instances, args.reps)
            base = t["plain, first"]
            rows.append([batch, 3 * rounds]
                        + [f"{t[k]:.2f}" + ("" if k == VARIANTS[0] else f" ({t[k] - base:+.2f})")
                           for k in VARIANTS] + [f"{spread:.2f}"])
    print(f"### A chain of small kernels with and without a fork node ({rig.name}; "
          f"`python benchmarks/probe_chain.py {' '.join(argv if argv is not None else sys.argv[1:])}`)"
          "\n\nstep = small op, [node], 3n small kernels (RMSNorm, scale, add on [B, 7168]), "
          f"GEMV over {args.mib} MiB; replay us after a flush, median of {args.instances} "
          f"instances' medians of {args.reps} replays; in brackets: against 'plain, first'; "
          "spread = the largest max - min of a variant's instance medians.\n")
    print(report.table(["batch", "kernels", *VARIANTS, "spread"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
