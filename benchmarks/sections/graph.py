"""graph: what an empty fork costs inside a replayed graph.

Mid-graph and at the graph's root, inline (as shipped) and as a side branch,
against no fork and against one plain kernel node in its place; in a short
graph and in a chain of 300 cuBLAS GEMVs (a decode step's shape).
"""

from __future__ import annotations

import statistics

import torch

from l2prefetch import PrefetchController, PreparedWeightRanges
from l2prefetch.tuning.report import table

from ..common import K, weight

#: Graph instances per variant (an empty fork costs about as much as two instances of
#: one capture differ).
GRAPH_INSTANCES = 9


def run(rig, quick):
    dev = rig.device.index
    reps = 200 if quick else 500
    w = weight(rig, 8)
    x = torch.randn(1, K, device=rig.device, dtype=torch.bfloat16)
    empty = PreparedWeightRanges([], device=dev)
    ctrls = {mode: PrefetchController(dev, graph_fork=mode) for mode in ("inline", "branch")}
    for ctrl in ctrls.values():
        ctrl.add("e", 0, [1], empty)

    def seq(where, mode):
        # mode "plain": no fork, one plain kernel node (a zero-length spin) in its place:
        # the floor of what any node added to the graph costs.
        ctrl = ctrls.get(mode)

        def fn():
            if where == "root":
                ctrl.fork("e", 0, 1)
            rig.spin(5)
            if where == "mid":
                if ctrl is None:
                    torch.cuda._sleep(0)
                else:
                    ctrl.fork("e", 0, 1)
            torch.nn.functional.linear(x, w)
            rig.spin(5)
            torch.nn.functional.linear(x, w)
            if where and ctrl is not None:
                ctrl.join()
        return fn

    # A chain of 300 cuBLAS GEMVs (2048 x 2048 bf16, batch 1), each followed by a scale:
    # the shape of a decode step's graph, where a side branch costs tens of us.
    wc = torch.randn(2048, 2048, device=rig.device, dtype=torch.bfloat16)
    hc = torch.randn(1, 2048, device=rig.device, dtype=torch.bfloat16)

    def chain(mode):
        def fn():
            v = hc
            for i in range(300):
                v = torch.nn.functional.linear(v, wc) * 0.01
                if mode and i == 150:
                    ctrls[mode].fork("e", 0, 1)
            if mode:
                ctrls[mode].join()
        return fn

    # Instances of one capture differ (placement) by about as much as a fork costs, so
    # each variant is captured GRAPH_INSTANCES times and compared by the median of its
    # instances' medians.
    short = {(None, None): seq(None, "inline")}
    for mode in ("inline", "branch"):
        for where in ("mid", "root"):
            short[(where, mode)] = seq(where, mode)
    short[("mid", "plain")] = seq("mid", "plain")
    chains = {mode: chain(mode) for mode in (None, "inline", "branch")}
    per_short = rig.measure(short, GRAPH_INSTANCES, reps).medians
    per_chain = rig.measure(chains, GRAPH_INSTANCES, reps // 10).medians
    label = {"short": "spin 5 us, GEMV 8 MiB, spin 5 us, GEMV",
             "chain": "300 x (GEMV 2048 x 2048, scale)"}
    rows = []
    for shape, per in (("short", per_short),
                       ("chain", {("mid", m): v for m, v in per_chain.items()})):
        base = statistics.median(per[next(iter(per))])
        for (where, mode), meds in per.items():
            m = statistics.median(meds)
            if mode is None:
                what = "no fork"
            elif mode == "plain":
                what = "no fork; a plain kernel node mid-graph (a zero-length spin): the floor"
            else:
                what = f"empty fork {'mid-graph' if where == 'mid' else 'at the root'}, {mode}"
            rows.append((label[shape], what, f"{m:.2f}", f"{min(meds):.2f}-{max(meds):.2f}",
                         "" if mode is None else f"{m - base:+.2f}"))
    for ctrl in ctrls.values():
        ctrl.close()
    return ("### graph: cost of a fork inside a replayed graph (us)\n\n"
            "One empty fork and the join at the end, as shipped (graph_fork='inline') and as a "
            f"side branch ('branch'), against the same graph without it.  Each variant captured "
            f"{GRAPH_INSTANCES} times, all replays interleaved; replay us = the median of the "
            f"instances' medians, range = the lowest and highest instance median.\n\n"
            + table(["graph", "fork", "replay us", "instances' range", "vs no fork"], rows))
