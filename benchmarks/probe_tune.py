"""Probe: tuning.tune unaided on a planted-window HF model (issue 24's check of the tuner).

A model of benchmarks.common.hf_model (the planted section's llama or qwen3, 6 layers,
or a benchmarks/configs name), random bf16; a one-thread spin before every MLP or
attention (or nothing planted: then the tuned plan must be empty or a confirmed gain);
roles discovered, every fork mode, the given budget; the GraphBackend's placement
(shared: the arms of an instance index share a memory pool and are paired, (a) too).
Prints the summary (with the instance spread and the best-of-k advice) and the report.

    python -m benchmarks.probe_tune [--model NAME] [--site mlp|attention|none] [--spin US]
                                    [--budget S] [--placement private|shared] [BATCH ...]
"""
import argparse

import torch

from benchmarks.common import hf_model, no_gpu
from benchmarks.sections.planted import SITES, _planted
from l2prefetch import tuning
from l2prefetch.tuning.hf import DecodeStep
from l2prefetch.tuning.measure import PLACEMENTS, GraphBackend
from l2prefetch.tuning.rig import Rig


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probe_tune")
    parser.add_argument("--model", default="llama", help="llama, qwen3 or a benchmarks/configs "
                        "name (default llama)")
    parser.add_argument("--site", choices=(*SITES, "none"), default="mlp",
                        help="where the spin goes (none: nothing planted)")
    parser.add_argument("--spin", type=float, default=40.0, help="the spin, us (default 40)")
    parser.add_argument("--budget", type=float, default=120.0, help="tune's budget, s")
    parser.add_argument("--placement", choices=PLACEMENTS, default="shared")
    parser.add_argument("batches", type=int, nargs="*", default=[1])
    args = parser.parse_args(argv)
    if no_gpu("benchmarks.probe_tune"):
        return
    rig = Rig(torch.device("cuda", 0))
    model = hf_model(args.model)
    if args.site != "none":
        if not hasattr(model, "model") or not hasattr(model.model, "layers"):
            parser.error(f"--site {args.site}: {args.model} has no model.layers to plant in")
        _planted(rig, model, args.site, args.spin)
    step = DecodeStep(model)
    planted = "nothing planted" if args.site == "none" else \
        f"{args.spin:g} us before every {args.site}"
    print(f"probe_tune: {args.model}, {planted}, budget {args.budget:g} s, "
          f"{args.placement} placement, batches {args.batches}")
    backend = GraphBackend(model, step, placement=args.placement)
    result = tuning.tune(model, step, args.batches, budget_s=args.budget, backend=backend)
    print(result.summary())
    print(result.markdown())


if __name__ == "__main__":
    main()
