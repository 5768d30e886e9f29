"""Probe (issue 23, item 3): the fastest of k captures against fresh ones, in HF models.

Per model and batch: graphs.capture_fastest(step, k) (its start-up time), then 8 fresh
captures; the kept one and the fresh ones replayed in rotated rounds: the gain of the kept
one against the mean fresh capture (what a server would get without the choice).

    python -m benchmarks.probe_bestof [--k K] [--batches 1 8] [MODEL ...]

MODEL: llama, qwen3 (the planted section's) or a benchmarks/configs name (mixtral-4l,
deepseek-v3-6l, qwen3-moe-6l, qwen3-8l); default llama and qwen3.
"""
import argparse
import statistics
import time

import torch

from l2prefetch import graphs
from l2prefetch.tuning.hf import DecodeStep
from l2prefetch.tuning.rig import Rig
from l2prefetch.tuning.stats import t_quantile

from .common import hf_model, no_gpu


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probe_bestof")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("models", nargs="*", default=["llama", "qwen3"])
    args = parser.parse_args(argv)
    if no_gpu("benchmarks.probe_bestof"):
        return
    rig = Rig(torch.device("cuda", 0))
    for name in args.models:
        model = hf_model(name)
        step = DecodeStep(model)
        for batch in args.batches:
            with torch.no_grad():
                step(batch)
                t0 = time.perf_counter()
                g, _, rep = graphs.capture_fastest(lambda: step(batch), k=args.k)
                cost = time.perf_counter() - t0
                fresh = {("fresh", i): rig.capture(lambda: step(batch), warmup=0)[0]
                         for i in range(8)}
            fresh[("kept", 0)] = g
            med = rig.instance_medians(fresh, 40)
            f, kept = med["fresh"], med["kept"][0]
            m = statistics.mean(f)
            half = t_quantile(0.975, len(f) - 1) * statistics.stdev(f) / len(f) ** 0.5
            print(f"{name} B{batch}: kept {kept:.1f} us, fresh mean {m:.1f} +-{half:.1f} "
                  f"(range {min(f):.1f}-{max(f):.1f}): gain {100 * (m - kept) / m:+.2f}% "
                  f"(+-{100 * half / m:.2f}); start-up {cost:.1f} s; {rep}", flush=True)
            del fresh, g
            torch.cuda.empty_cache()
        model = step = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
