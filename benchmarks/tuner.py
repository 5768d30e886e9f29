"""The tuner's own costs on one GPU: tuning time, loading a profile, a budget too small.

    python -m benchmarks.tuner [--quick] [--budget S] [--parts time,load,budget] [--out PATH]

The model is :class:`l2prefetch.tuning.synthetic.IdleWindowModel` (per layer a
Linear, a ~25 us window in which one CTA spins, a Linear; 4096 x 4096 bf16,
32 MiB each), whose role "after a: b" pays on an H200.

  time    ``tune`` at 2, 4 and 8 layers, batches [1] and [1, 8], each with the
          same budget (--budget): wall time, the tuner's own elapsed time,
          groups measured (one interleaved set of arms over graph
          instances), graphs captured, roles discovered / measured / kept.
  load    a server start: ``PrefetchController.from_profile(path, model)``
          for the profile of the 4-layer [1, 8] run, with a warm kernel cache
          (one untimed load first); median of 20 loads in ms (goal < 50 ms).
  budget  a budget too small: the 8-layer model at [1, 8] with budget_s 5, 15
          and 60: what was measured, what was left out and why, and whether
          each batch's plan is confirmed (its gain's 95% interval above zero)
          or empty; never a plan that was not confirmed.

Prints Markdown tables (and writes them to --out when given); the tuner's
progress lines go to stderr.  Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import statistics
import sys
import tempfile
import time

LAYERS = (2, 4, 8)
BATCH_SETS = ((1,), (1, 8))
#: The budget of each run of the time part (s): the tuner's default is 300; these runs
#: measure how the time grows with layers, roles and batches at one fixed budget.
TIME_BUDGET_S = 60
QUICK_BUDGET_S = 10
#: The budget part's budgets (s), on the largest model at both batch sets.
SMALL_BUDGETS_S = (5, 15, 60)
#: Loads timed in the load part.
LOADS = 20
#: The goal for a load at server start with a warm kernel cache (issue 15).
LOAD_GOAL_MS = 50
#: A progress line of one measured group (tuning.search's Progress): "(N arms x M
#: instances, ~S s)".
GROUP_LINE = re.compile(r"\((\d+) arms x (\d+) instances")


class Progress(io.TextIOBase):
    """The tuner's progress stream: lines go on to ``sink``; groups are counted."""

    def __init__(self, sink):
        self.sink, self.groups, self.graphs, self._line = sink, 0, 0, ""

    def writable(self):
        return True

    def write(self, text):
        self.sink.write(text)
        self._line += text
        *lines, self._line = self._line.split("\n")
        for line in lines:
            match = GROUP_LINE.search(line)
            if match:
                self.groups += 1
                self.graphs += int(match.group(1)) * int(match.group(2))
        return len(text)

    def flush(self):
        self.sink.flush()


def _verdict(rep):
    """A batch's result in words: the confirmed ratio, or why the plan is empty."""
    conf = rep.confirmed
    if conf is None:
        return f"empty ({rep.reason})" if rep.reason else "empty"
    low, high = conf.ratio_interval
    roles = ", ".join(name for name, _ in rep.plan)
    return f"confirmed {conf.ratio:.4f}x ({low:.4f}-{high:.4f}): {roles}"


def _sound(rep):
    """The tuner's promise: a plan is returned only with a confirmed gain."""
    conf = rep.confirmed
    return rep.plan == () or (conf is not None and conf.gain.low > 0)


def _tune(model, step, batches, budget_s):
    from l2prefetch import tuning

    progress = Progress(sys.stderr)
    t0 = time.perf_counter()
    result = tuning.tune(model, step, list(batches), budget_s=budget_s, progress=progress)
    return result, time.perf_counter() - t0, progress


def _model(layers):
    from l2prefetch.tuning import synthetic

    model = synthetic.IdleWindowModel(layers=layers)
    return model, synthetic.idle_window_step(model)


def part_time(budget_s, keep):
    """Tuning time against layers and batches at one budget; keeps the 4-layer [1, 8]
    result and model in ``keep`` for the load part."""
    import torch

    from l2prefetch.tuning.report import table

    rows = []
    for layers in LAYERS:
        model, step = _model(layers)
        for batches in BATCH_SETS:
            result, wall, progress = _tune(model, step, batches, budget_s)
            measured = {r.role for rep in result.batches for r in rep.roles if r.trials}
            kept = {name for rep in result.batches for name, _ in rep.plan}
            rows.append([layers, ",".join(map(str, batches)), len(result.roles), len(measured),
                         len(kept), progress.groups, progress.graphs, f"{wall:.1f}",
                         f"{result.elapsed_s:.1f}",
                         " / ".join(f"{rep.elapsed_s:.1f}" for rep in result.batches),
                         "; ".join(f"B{rep.batch}: {_verdict(rep)}" for rep in result.batches)])
            if layers == 4 and batches == (1, 8):
                keep.update(model=model, result=result)
        if keep.get("model") is not model:
            del model, step
        torch.cuda.empty_cache()
    return (f"### Tuning time against layers and batches (budget {budget_s:.0f} s each)\n\n"
            "`l2prefetch.tuning.tune(model, step, batches, budget_s=...)` on "
            "`tuning.synthetic.IdleWindowModel(layers)` (per layer Linear a, a ~25 us one-CTA "
            "spin, Linear b; 32 MiB weights).  roles: discovered / measured (at least one "
            "trial) / kept (in the returned plan at some batch); groups = interleaved sets "
            "of arms measured, graphs = graph instances captured for them; wall = the "
            "call's wall time, tuner = its own elapsed_s, per batch = each batch's "
            "elapsed_s.\n\n"
            + table(["layers", "batches", "roles", "measured", "kept", "groups", "graphs",
                     "wall s", "tuner s", "per batch s", "result"], rows))


def part_load(keep, budget_s):
    """Loading the profile at server start, warm kernel cache."""
    import torch

    from l2prefetch import PrefetchController
    from l2prefetch.tuning.report import table

    model, result = keep.get("model"), keep.get("result")
    if model is None:
        model, step = _model(4)
        result, _, _ = _tune(model, step, (1, 8), budget_s)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "idle-window.l2p.json")
        result.save(path, model)
        size = os.path.getsize(path)
        PrefetchController.from_profile(path, model).close()   # warm: kernels compiled, cached
        torch.cuda.synchronize()
        ms = []
        for _ in range(LOADS):
            t0 = time.perf_counter()
            controller = PrefetchController.from_profile(path, model)
            ms.append((time.perf_counter() - t0) * 1e3)
            controller.close()
    median = statistics.median(ms)
    rows = [[len(result.plan), f"{size / 1024:.1f}", f"{median:.2f}", f"{min(ms):.2f}",
             f"{max(ms):.2f}", "yes" if median < LOAD_GOAL_MS else "**no**"]]
    note = ("" if result.plan else "  The tuned plan is empty, so the load builds an empty "
            "controller: this times reading and checking the profile only.")
    return ("### Loading a profile at server start (warm kernel cache)\n\n"
            "`PrefetchController.from_profile(path, model)` for the profile of the 4-layer "
            f"run at batches [1, 8] (read, device and model fingerprints checked, plan "
            f"prepared), after one untimed load; {LOADS} loads, each closed before the next."
            f"{note}\n\n"
            + table(["plan entries", "profile KiB", "median ms", "min ms", "max ms",
                     f"median < {LOAD_GOAL_MS} ms"], rows))


def part_budget(budgets):
    """What a budget too small measures and returns."""
    import torch

    from l2prefetch.tuning.report import table

    layers = max(LAYERS)
    model, step = _model(layers)
    rows = []
    for budget_s in budgets:
        result, wall, progress = _tune(model, step, (1, 8), budget_s)
        for rep in result.batches:
            measured = [r.role for r in rep.roles if r.trials]
            left_out = {}
            for r in rep.roles:
                if not r.trials:
                    left_out[r.reason] = left_out.get(r.reason, 0) + 1
            why = "; ".join(f"{n} {reason}" for reason, n in left_out.items()) or "-"
            rows.append([budget_s, f"{wall:.1f}", progress.groups, rep.batch,
                         f"{len(measured)} of {len(rep.roles)}", why,
                         len(rep.confirmations), _verdict(rep),
                         "yes" if _sound(rep) else "**NO**"])
    del model, step
    torch.cuda.empty_cache()
    return (f"### A budget too small ({layers} layers, batches [1, 8])\n\n"
            "The same model tuned with each budget.  measured = roles with at least one "
            "trial; left out = the others, by the tuner's reason; confirmations = plans "
            "confirmed on fresh instances (each try); result = the returned plan; confirmed "
            "or empty = the plan is empty or its confirmation's 95% interval is above zero "
            "(the tuner never returns anything else).\n\n"
            + table(["budget s", "wall s", "groups", "batch", "roles measured", "left out",
                     "confirmations", "result", "confirmed or empty"], rows))


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tuner",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"a {QUICK_BUDGET_S} s budget per run of the time part (default "
                         f"{TIME_BUDGET_S} s)")
    ap.add_argument("--budget", type=float, default=None,
                    help="the budget of each run of the time part, seconds")
    ap.add_argument("--parts", default="time,load,budget",
                    help="comma-separated parts to run (default: time,load,budget)")
    ap.add_argument("--out", default=None, help="also write the tables to this Markdown file")
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in args.parts if p not in ("time", "load", "budget")]
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}; parts: time, load, budget")
    if args.budget is None:
        args.budget = QUICK_BUDGET_S if args.quick else TIME_BUDGET_S
    if not args.budget > 0:
        ap.error(f"--budget must be > 0 seconds, got {args.budget}")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("python -m benchmarks.tuner needs a CUDA GPU; none is visible here.")
        return 0
    from l2prefetch.tuning.rig import Rig

    from .common import device_line

    command = " ".join(["python -m benchmarks.tuner", *argv])
    parts = [f"{device_line(Rig())}\nCommand: `{command}`."]
    print(parts[0], flush=True)
    keep = {}
    t0 = time.perf_counter()
    for part in args.parts:
        if part == "time":
            text = part_time(args.budget, keep)
        elif part == "load":
            text = part_load(keep, args.budget)
        else:
            text = part_budget(SMALL_BUDGETS_S)
        text = text.rstrip("\n")
        print("\n" + text, flush=True)
        parts.append(text)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("# The tuner on this GPU\n\n" + "\n\n".join(parts) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
