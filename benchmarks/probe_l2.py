"""Probe (issue 24): what limits the recovery of large loads, with L2 counters.

Eager on one stream, the L2 flushed first (a read of 8x its size), then one case:

* ``cold``: the consumer, a bf16 GEMV on W of gate_proj's shape in the planted Llama
  ([8192, 3072]: 48 MiB);
* ``load24`` / ``load48``: the default loader on W's first 24 / 48 MiB (grid 32), a 40 us
  one-thread spin (an idle GPU, as in the planted window), then the consumer;
* ``full48``: the same 48 MiB loaded on every SM (the grid the tuner's probe uses for a
  consumer's hot time, its ceiling), then the spin and the consumer;
* ``spin``: the 40 us spin alone, then the consumer (the control of the loads);
* ``hot``: the consumer twice, the second measured (all of W read right before);
* ``up`` / ``load48up``: as ``spin`` / ``load48``, with a GEMV on another 48 MiB weight
  (up_proj's, beside gate_proj in the MLP) between the spin and the consumer: would a
  neighbour's stream through the L2 evict the loaded lines, were it to run between them?
  (Run 26's question: the window role's loads recover 45-75% of the ceiling in the step,
  this probe's whole gap with nothing between; ``benchmarks.probe_order`` shows what the
  step runs there.)

The consumer runs inside the NVTX range ``consumer``, so Nsight Compute can profile it
alone, with the application replayed per pass and the caches left as they are::

    ncu --clock-control none --cache-control none --replay-mode application \\
        --nvtx --nvtx-include "consumer/" --csv --metrics \\
        gpu__time_duration.sum,lts__t_sector_hit_rate.pct,lts__t_sectors.sum,\\
lts__t_sectors_srcunit_ltcfabric.sum,dram__bytes_read.sum \\
        python3 -m benchmarks.probe_l2 --once CASE

(``bash .ci/gpu l2`` runs every case so).  Without ``--once`` it times the consumer with
CUDA events instead: the median of 20 repetitions of the case.

``--spin US`` sets the spin's length (default 40; 0: none, the load right before the
consumer, as the tuner's probe measures the ceiling).  Run 25's question: the tuner's
loads in a 40 us window recover about half of that ceiling; does a loaded line fade while
the GPU idles (``load48`` and ``full48`` at spins of 0 to 80 us: ``bash .ci/gpu fade``)?

``--kernel NAME`` loads with that loader variant (default: the device's; ``ring`` reads
the lines into shared memory, ``bulk_prefetch`` only prefetches them into L2).

    python -m benchmarks.probe_l2 [--once] [--batch B] [--spin US] [--kernel NAME] CASE ...
"""
import argparse
import statistics

import torch

from l2prefetch import _C
from l2prefetch.tuning.rig import Rig

from .common import no_gpu

CASES = ("cold", "spin", "load24", "load48", "full48", "hot", "up", "load48up")
LOADS = {"load24": 24, "load48": 48, "full48": 48, "load48up": 48}
MIB = 1 << 20


def run_case(rig, case, w, x, tables, mark=True, spin_us=40.0, neighbour=None):
    """Flush, the case's set-up, then the consumer (inside the NVTX range if ``mark``);
    the consumer's us by events.  ``neighbour``: the other weight the ``up`` cases read
    between the spin and the consumer."""
    rig.flush()
    if case == "hot":
        torch.nn.functional.linear(x, w)
    elif case in LOADS:
        tables[case].launch()
        rig.spin(spin_us)
    elif case in ("spin", "up"):
        rig.spin(spin_us)
    if case.endswith("up"):
        torch.nn.functional.linear(x, neighbour)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if mark:
        torch.cuda.nvtx.range_push("consumer")
    start.record()
    torch.nn.functional.linear(x, w)
    end.record()
    if mark:
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probe_l2")
    parser.add_argument("--once", action="store_true", help="one repetition (under ncu)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--spin", type=float, default=40.0, metavar="US",
                        help="the spin between the set-up and the consumer (0: none)")
    parser.add_argument("--kernel", default=None, choices=sorted(_C.kernel_variants()),
                        help="the loader variant (default: the device's)")
    parser.add_argument("cases", nargs="+", choices=CASES)
    args = parser.parse_args(argv)
    if args.spin < 0:
        parser.error(f"--spin {args.spin:g}: a spin lasts 0 us or more")
    if no_gpu("benchmarks.probe_l2"):
        return
    rig = Rig(torch.device("cuda", 0))
    torch.manual_seed(0)
    w = torch.randn(8192, 3072, device="cuda", dtype=torch.bfloat16) * 0.02
    neighbour = torch.randn(8192, 3072, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(args.batch, 3072, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    launch = {"kernel": args.kernel} if args.kernel else {}
    tables = {case: _C.PreparedWeightRanges([w], byte_cap=mib * MIB, **launch,
                                            **({"grid": sms} if case.startswith("full") else {}))
              for case, mib in LOADS.items()}
    for case in args.cases:
        run_case(rig, case, w, x, tables, mark=False, spin_us=args.spin,
                 neighbour=neighbour)   # warm-up
        reps = 1 if args.once else 20
        us = [run_case(rig, case, w, x, tables, spin_us=args.spin, neighbour=neighbour)
              for _ in range(reps)]
        print(f"probe_l2 {case} B{args.batch} spin {args.spin:g} us "
              f"{tables[case].kernel if case in tables else '-'}: consumer "
              f"{statistics.median(us):.2f} us (median of {reps})", flush=True)


if __name__ == "__main__":
    main()
