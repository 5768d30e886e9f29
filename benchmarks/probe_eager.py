"""Where the eager (no graph) decode step of benchmarks/deepseek.py loses time with prefetch.

deepseek.py measures the eager step ~3% slower with the plan's forks
(~350 us of a ~12.5 ms host-bound step, for 10 forks and a join), far more
than a fork's host cost (~4 us).  This probe times the same eager step,
interleaved, with:

  none         no hooks
  noop hooks   the hooks of deepseek_v3.hook_points(model, ("next_attention",)),
               calling a Python object
               whose fork() returns False and join() does nothing
  empty        the hooks calling a controller with the plan's keys and empty tables
  plan         the hooks calling the controller of the shipped plan
  plan, timed  the same controller behind a Python proxy that times each
               fork() and join() call with perf_counter (the proxy adds ~0.3 us)

and reports the host time of one step (perf_counter, the step's Python) and
the GPU time between CUDA events around it, for the first step after the
hooks are attached and for the one after it (deepseek.py attaches the hooks
before every timed step).  Run on a GPU:

    python benchmarks/probe_eager.py [--reps 60] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepseek  # noqa: E402  (benchmarks/deepseek.py: model, decoder, empty controller)

import l2prefetch  # noqa: E402
from l2prefetch import deepseek_v3, hooks  # noqa: E402


NEXT = ("next_attention",)


def sites(model):
    return deepseek_v3.hook_points(model, NEXT)


class NoopController:
    def fork(self, point, layer, batch):
        return False

    def join(self):
        pass


class Timed:
    """controller's fork() and join(), each call's host time kept (us)."""

    def __init__(self, controller):
        self.controller, self.forks, self.joins = controller, [], []

    def fork(self, point, layer, batch):
        t0 = time.perf_counter()
        out = self.controller.fork(point, layer, batch)
        self.forks.append((time.perf_counter() - t0) * 1e6)
        return out

    def join(self):
        t0 = time.perf_counter()
        self.controller.join()
        self.joins.append((time.perf_counter() - t0) * 1e6)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_eager.py needs a CUDA GPU")
        return 0
    with torch.no_grad():
        model = deepseek.build_model(deepseek.BENCH_CONFIG, "cuda:0")
        plan = deepseek_v3.plan(model, points=NEXT)       # the default plan is empty
        controllers = {"none": None, "noop hooks": NoopController(),
                       "empty": deepseek.empty_controller(plan, 0),
                       "plan": l2prefetch.PrefetchController.from_plan(plan, 0)}
        timed = Timed(l2prefetch.PrefetchController.from_plan(plan, 0))
        controllers["plan, timed"] = timed
        print("| batch | variant | step | host us (step's Python) | GPU us (events) | "
              "vs none, host | vs none, GPU |")
        print("|---|---|---|---|---|---|---|")
        for batch in (int(b) for b in args.batches.split(",")):
            dec = deepseek.Decoder(model, batch)
            host = {(name, k): [] for name in controllers for k in ("first", "second")}
            gpu = {key: [] for key in host}
            for rep in range(args.reps + 3):
                names = list(controllers)
                names = names[rep % len(names):] + names[:rep % len(names)]
                for name in names:
                    ctrl = controllers[name]
                    att = hooks.attach(model, ctrl, sites) if ctrl else None
                    # The first step after attaching the hooks, then a second one.
                    for k in ("first", "second"):
                        dec.reset()
                        torch.cuda.synchronize()
                        s = torch.cuda.Event(enable_timing=True)
                        e = torch.cuda.Event(enable_timing=True)
                        t0 = time.perf_counter()
                        s.record()
                        dec.step()
                        e.record()
                        t1 = time.perf_counter()
                        torch.cuda.synchronize()
                        if rep >= 3:
                            host[name, k].append((t1 - t0) * 1e6)
                            gpu[name, k].append(s.elapsed_time(e) * 1e3)
                    if att:
                        att.detach()
            for k in ("first", "second"):
                h0 = statistics.median(host["none", k])
                g0 = statistics.median(gpu["none", k])
                for name in controllers:
                    h, g = statistics.median(host[name, k]), statistics.median(gpu[name, k])
                    print(f"| {batch} | {name} | {k} | {h:.0f} | {g:.0f} | {h - h0:+.0f} | "
                          f"{g - g0:+.0f} |", flush=True)
            if timed.forks and timed.joins:
                print(f"\nbatch {batch}, in the step: fork() median "
                      f"{statistics.median(timed.forks):.1f} us (p90 "
                      f"{statistics.quantiles(timed.forks, n=10)[-1]:.1f}, "
                      f"{len(timed.forks)} calls), join() median "
                      f"{statistics.median(timed.joins):.1f} us\n", flush=True)
            timed.forks.clear()
            timed.joins.clear()
            del dec
    return 0


if __name__ == "__main__":
    sys.exit(main())
