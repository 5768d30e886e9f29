"""Probe: tuning.tune unaided on a planted-window HF model (issue 24's check of the tuner).

A model of benchmarks.common.hf_model (the planted section's llama or qwen3, 6 layers,
or a benchmarks/configs name), random bf16; a one-thread spin before every MLP or
attention (or nothing planted: then the tuned plan must be empty or a confirmed gain);
roles discovered, every fork mode, the given budget; the GraphBackend's placement
(shared: the arms of an instance index share a memory pool and are paired, (a) too).
Prints the summary (with the instance spread and the best-of-k advice) and the report.

    python -m benchmarks.probe_tune [--model NAME] [--site mlp|attention|oproj|none] [--spin US]
                                    [--layers I,J,..] [--budget S] [--placement private|shared]
                                    [--hand] [--rounds N] [--dump FILE.json] [BATCH ...]

``--rounds`` is tune's replays per instance in a group (default: by the step's time,
10-20); ``--dump`` writes every measured group's per-instance medians per arm (JSON), to see where an interval's width comes
from.  ``--hand`` then measures the tuned plan beside hand-placed plans of the planted window's role
(benchmarks/RESULTS.md, run 14).
"""
import argparse
import json

import torch

from benchmarks.common import hf_model, no_gpu
from benchmarks.sections.planted import MIB, PLANT_SITES, _planted, _role
from l2prefetch import tuning
from l2prefetch.tuning.arms import NO_FORKS, Arm, Setting
from l2prefetch.tuning.stats import diff_interval, paired_interval
from l2prefetch.tuning.hf import DecodeStep
from l2prefetch.tuning.measure import MAX_ROUNDS, MIN_ROUNDS, PLACEMENTS, GraphBackend
from l2prefetch.tuning.rig import Rig


def layer_indices(text):
    """``--layers``: comma-separated layer indices, as a set."""
    try:
        layers = {int(x) for x in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated layer indices") from None
    if min(layers) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: layer indices are >= 0")
    return layers


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probe_tune")
    parser.add_argument("--model", default="llama", help="llama, qwen3 or a benchmarks/configs "
                        "name (default llama)")
    parser.add_argument("--site", choices=(*PLANT_SITES, "none"), default="mlp",
                        help="where the spin goes: before the MLP's norm, before attention's, "
                             "in o_proj's forward hook (oproj), none: nothing planted")
    parser.add_argument("--spin", type=float, default=40.0, help="the spin, us (default 40)")
    parser.add_argument("--layers", type=layer_indices, default=None,
                        help="plant in these layers only (comma-separated indices; default all)")
    parser.add_argument("--budget", type=float, default=120.0, help="tune's budget, s")
    parser.add_argument("--placement", choices=PLACEMENTS, default="shared")
    parser.add_argument("--hand", action="store_true",
                        help="then measure the tuned plan beside hand-placed ones (the planted "
                             "window's role at 24 and 48 MiB, leaf and branch, at the planted "
                             f"layers), {HAND_INSTANCES} instances")
    parser.add_argument("--rounds", type=int, default=None,
                        help="replays of each instance per group (default: by the step's time, "
                             f"{MIN_ROUNDS}-{MAX_ROUNDS}, rounds_for)")
    parser.add_argument("--dump", default=None, metavar="FILE.json",
                        help="write every group's per-instance medians per arm")
    parser.add_argument("batches", type=int, nargs="*", default=[1])
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.hand and args.site == "none":
        parser.error("--hand compares plans for a planted window: give --site mlp or attention")
    if args.dump:
        try:
            open(args.dump, "w").close()       # writable, before minutes of tuning
        except OSError as exc:
            parser.error(f"--dump {args.dump}: {exc}")
    if no_gpu("benchmarks.probe_tune"):
        return
    rig = Rig(torch.device("cuda", 0))
    model = hf_model(args.model)
    if args.site != "none":
        if not hasattr(model, "model") or not hasattr(model.model, "layers"):
            parser.error(f"--site {args.site}: {args.model} has no model.layers to plant in")
        if args.layers is not None and max(args.layers) >= len(model.model.layers):
            parser.error(f"--layers {sorted(args.layers)}: {args.model} has "
                         f"{len(model.model.layers)} layers")
        _planted(rig, model, args.site, args.spin, args.layers)
    step = DecodeStep(model)
    where = "every" if args.layers is None else f"layers {sorted(args.layers)}"
    planted = "nothing planted" if args.site == "none" else \
        f"{args.spin:g} us after {where} o_proj" if args.site == "oproj" else \
        f"{args.spin:g} us before {where} {args.site}"
    print(f"probe_tune: {args.model}, {planted}, budget {args.budget:g} s, "
          f"{args.placement} placement, batches {args.batches}")
    backend = GraphBackend(model, step, placement=args.placement, rounds=args.rounds)
    groups = []
    if args.dump:
        measure = backend.measure

        def recorded(batch, arms, instances):
            times, identical = measure(batch, arms, instances)
            groups.append({"batch": batch, "times": {str(k): list(v) for k, v in times.items()}})
            return times, identical
        backend.measure = recorded
    try:
        result = tuning.tune(model, step, args.batches, budget_s=args.budget, backend=backend)
    finally:
        if args.dump:
            with open(args.dump, "w") as f:
                json.dump(groups, f)
    print(result.summary())
    print(result.markdown())
    if args.hand:
        hand(backend, model, step, result, args)


#: Graph instances per arm in the --hand group.
HAND_INSTANCES = 8


def hand(backend, model, step, result, args):
    """The tuned plan beside hand-placed plans of the planted window's role, in one group:
    with shared placement every arm is paired with no forks by instance (else Welch)."""
    role = _role(model, step, args.site)
    layers = None if args.layers is None else tuple(sorted(args.layers))
    for rep in result.batches:
        arms = {NO_FORKS: Arm()}
        if rep.plan:
            arms["tuned"] = Arm(tuple(rep.plan))
        for mode in ("leaf", "branch"):
            for cap in (24, 48):
                arms[f"hand {mode} {cap} MiB"] = Arm(
                    ((role.name, Setting(cap * MIB, graph_fork=mode, layers=layers)),))
        times, identical = backend.measure(rep.batch, arms, HAND_INSTANCES)
        interval = paired_interval if backend.shared_placement else diff_interval
        print(f"== batch {rep.batch}: no forks {sum(times[NO_FORKS]) / HAND_INSTANCES:.1f} us; "
              f"gain against no forks ({'paired' if backend.shared_placement else 'Welch'}, 95%), "
              f"hand plans: {role.name} at "
              f"{'every layer' if layers is None else f'layers {list(layers)}'}")
        for name in arms:
            if name == NO_FORKS:
                continue
            gain = interval(times[NO_FORKS], times[name])
            same = "same" if identical[name] else "DIFFERENT"
            print(f"   {name:22} {gain.format(2)} us  bitwise {same}")


if __name__ == "__main__":
    main()
