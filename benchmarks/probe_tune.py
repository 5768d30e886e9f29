"""Probe: tuning.tune unaided on the planted-window HF Llama (issue 24's model).

HF Llama-shaped, 6 layers, a 40 us one-thread spin before every
post_attention_layernorm; roles discovered; every fork mode; the given budget.

    python -m benchmarks.probe_tune [BUDGET_S] [BATCH ...]
"""
import sys

import torch

from benchmarks.sections.planted import _model, _planted
from l2prefetch import tuning
from l2prefetch.tuning.hf import DecodeStep
from l2prefetch.tuning.rig import Rig


def main():

    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 120.0
    batches = [int(b) for b in sys.argv[2:]] or [1]
    rig = Rig(torch.device("cuda", 0))
    model = _model("llama")   # benchmarks/sections/planted.py's Llama shape, random bf16
    _planted(rig, model, "mlp", 40)
    step = DecodeStep(model)
    result = tuning.tune(model, step, batches, budget_s=budget)
    print(result.summary())
    print(result.markdown())


if __name__ == "__main__":
    main()
