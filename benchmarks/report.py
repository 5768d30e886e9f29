"""The single-GPU benchmark report: every section in one process, one device call.

    python -m benchmarks.report [--quick] [--sections a,b,...] [--out PATH]

Runs the sections (one module each in benchmarks/sections/) and prints their
Markdown tables with the device, driver, versions and the exact command.
With --out it also writes them to PATH, and PNG plots next to it where
matplotlib is installed (effect_<mib>mib.png, layer_speedup.png); without
it nothing is written.  GPU time comes from CUDA events around CUDA-graph
replays (l2prefetch.tuning.rig), so host launch costs do not blur kernel
times; the variants are replayed interleaved over several graph instances;
L2 is flushed before every cold measurement by reading a buffer 8x its size;
weights are random, never zeros.  A section that fails is reported as
failed (traceback on stderr) and the others still run; the exit status is 1.

Sections:
  effect      a bf16 GEMV after a bandwidth-idle window (a spin): cold, empty
              fork (the control), prefetched, hot; and the break-even table.
  glue        the effect with a window of small kernels that touch memory,
              for several loaders.
  compute     the same with a compute-bound window (GEMMs on L2-resident data).
  persist     the alternative: CUDA L2 persistence, against l2prefetch.
  layer       a decode step of two Kimi-shaped MoE layers at TP8, with the
              reference design's forks; spins stand in for attention and NCCL.
  layer_glue  the same step with small kernels in place of the spins.
  caps        the layer step per TP, batch and next_attention cap, and the
              other points left out (what kimi_k3's defaults were chosen from).
  kernels     the prefetch kernel variants and grids: step time, own time,
              slowdown of a concurrent copy.
  host        host cost of fork + join; controller construction time.
  graph       the cost of an empty fork inside a replayed graph.
  planted     planted idle windows in HF Llama- and Qwen3-shaped models' captured
              decode steps: forked after the read before each window and before
              its norm, every fork mode and cap against no forks, empty forks
              (paired) and the consumers' cold-to-hot gap.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time
import traceback

#: Section name -> (module in benchmarks/sections/, function), in the report's order.
SECTIONS = {
    "effect": ("effect", "run"), "glue": ("glue", "run"), "compute": ("compute", "run"),
    "persist": ("persist", "run"), "layer": ("layer", "run"),
    "layer_glue": ("layer", "run_glue"), "caps": ("caps", "run"),
    "kernels": ("kernels", "run"), "host": ("host", "run"), "graph": ("graph", "run"),
    "planted": ("planted", "run"),
}


def section(name):
    """The function that runs section ``name`` (its module imported on first use)."""
    module, fn = SECTIONS[name]
    return getattr(importlib.import_module(f"{__package__ or 'benchmarks'}.sections.{module}"), fn)


def parse(argv):
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0],
        epilog="Sections: " + ", ".join(SECTIONS) + " (see benchmarks/README.md).")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma-separated sections to run (default: all, in this order)")
    ap.add_argument("--out", default=None,
                    help="also write the report to this Markdown file, and the PNG plots "
                         "next to it (default: print only)")
    args = ap.parse_args(argv)
    args.names = [n for n in args.sections.split(",") if n]
    unknown = [n for n in args.names if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; sections: {', '.join(SECTIONS)}")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("python -m benchmarks.report needs a CUDA GPU; none is visible here.")
        return 0
    from l2prefetch.tuning.rig import Rig

    from .common import device_line

    rig = Rig()
    command = " ".join(["python -m benchmarks.report", *argv])
    header = (f"{device_line(rig)}\nCommand: `{command}` (spin calibrated at "
              f"{rig.cycles_per_us:.0f} cycles/us).")
    print(header, flush=True)
    parts, raws, failed = [header], {}, []
    for name in args.names:
        t0 = time.perf_counter()
        try:
            result = section(name)(rig, args.quick)
        except Exception as exc:  # a failing section must not cost the others their results
            traceback.print_exc()
            failed.append(name)
            result = (f"### {name}: failed\n\n`{type(exc).__name__}: {exc}` "
                      "(traceback on stderr)")
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        text = result[0] if isinstance(result, tuple) else result
        if isinstance(result, tuple):
            raws[name] = result[1]
        text = text.rstrip("\n")
        print("\n" + text + f"\n\n({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
        parts.append(text)
    if args.out:
        from .plots import plot

        try:
            pngs, note = plot(raws, os.path.dirname(os.path.abspath(args.out)))
        except Exception as exc:  # a plot must never cost the report
            print(f"warning: plotting failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            pngs, note = [], f"No PNG plots: plotting failed ({type(exc).__name__}: {exc})."
        if pngs:
            note = "Plots (next to this file): " + ", ".join(
                f"[{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs) + "."
        if note:
            print("\n" + note + ("\n" + "\n".join(pngs) if pngs else ""), flush=True)
            parts.append(note)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("# l2prefetch benchmark report\n\n" + "\n\n".join(parts) + "\n")
        print(f"\nwrote {args.out}")
    if failed:
        print(f"failed sections: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
