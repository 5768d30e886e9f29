"""Probe: tuning.tune unaided on a planted-window HF model (issue 24's check of the tuner).

One of benchmarks/sections/planted.py's models (6 layers, random bf16), a one-thread
spin before every MLP or attention (or nothing planted: then the tuned plan must be
empty or a confirmed gain), roles discovered, every fork mode, the given budget.
Prints the summary (with the instance spread and the best-of-k advice) and the report.

    python -m benchmarks.probe_tune [--model llama|qwen3] [--site mlp|attention|none]
                                    [--spin US] [--budget S] [BATCH ...]
"""
import argparse

import torch

from benchmarks.sections.planted import MODELS, SITES, _model, _planted
from l2prefetch import tuning
from l2prefetch.tuning.hf import DecodeStep
from l2prefetch.tuning.rig import Rig


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probe_tune")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    parser.add_argument("--site", choices=(*SITES, "none"), default="mlp",
                        help="where the spin goes (none: nothing planted)")
    parser.add_argument("--spin", type=float, default=40.0, help="the spin, us (default 40)")
    parser.add_argument("--budget", type=float, default=120.0, help="tune's budget, s")
    parser.add_argument("batches", type=int, nargs="*", default=[1])
    args = parser.parse_args(argv)
    rig = Rig(torch.device("cuda", 0))
    model = _model(args.model)
    if args.site != "none":
        _planted(rig, model, args.site, args.spin)
    step = DecodeStep(model)
    planted = "nothing planted" if args.site == "none" else \
        f"{args.spin:g} us before every {args.site}"
    print(f"probe_tune: {args.model}, {planted}, budget {args.budget:g} s, "
          f"batches {args.batches}")
    result = tuning.tune(model, step, args.batches, budget_s=args.budget)
    print(result.summary())
    print(result.markdown())


if __name__ == "__main__":
    main()
