"""Probe (issue 23, item 3): the fastest of k captures against fresh ones, in HF models.

Per model and batch: graphs.capture_fastest(step, k) (its start-up time), then 8 fresh
captures; the kept one and the fresh ones replayed in rotated rounds: the gain of the kept
one against the mean fresh capture (what a server would get without the choice).

    python -m benchmarks.probe_bestof [K]
"""
import statistics
import sys
import time

import torch

from l2prefetch import graphs
from l2prefetch.tuning.hf import DecodeStep
from l2prefetch.tuning.rig import Rig

from .sections.planted import MODELS, _model


def main():
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    rig = Rig(torch.device("cuda", 0))
    for name in MODELS:
        model = _model(name)
        step = DecodeStep(model)
        for batch in (1, 8):
            with torch.no_grad():
                step(batch)
                t0 = time.perf_counter()
                g, _, rep = graphs.capture_fastest(lambda: step(batch), k=k)
                cost = time.perf_counter() - t0
                fresh = {("fresh", i): rig.capture(lambda: step(batch), warmup=0)[0] for i in range(8)}
            fresh[("kept", 0)] = g
            med = rig.instance_medians(fresh, 40)
            f, kept = med["fresh"], med["kept"][0]
            m = statistics.mean(f)
            half = 2.36 * statistics.stdev(f) / len(f) ** 0.5
            print(f"{name} B{batch}: kept {kept:.1f} us, fresh mean {m:.1f} +-{half:.1f} "
                  f"(range {min(f):.1f}-{max(f):.1f}): gain {100 * (m - kept) / m:+.2f}% "
                  f"(+-{100 * half / m:.2f}); start-up {cost:.1f} s; {rep}", flush=True)
            del fresh, g
            torch.cuda.empty_cache()
        del model, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
