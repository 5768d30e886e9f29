"""Does a deep launch queue change what report.py measures?

report.Rig.replays enqueues every replay of a section (flush, event, graph,
event; thousands of them) before it synchronizes, so the host blocks on a
full launch queue for most of the run.  In run 9 (benchmarks/RESULTS.md) the
glue section's no-fork graph replayed 2-11 us slower than the same graph with
an empty fork in some processes.  This runs the glue section (--quick)
alternately with the deep queue and with a synchronize after every round of
replays (Rig.sync_rounds), in one process, and prints both tables each time:

    python benchmarks/probe_queue.py [--passes 2]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/probe_queue.py needs a CUDA GPU; none is visible here.")
        return 0
    rig = report.Rig()
    for i in range(args.passes):
        for sync in (False, True):
            rig.sync_rounds = sync
            text, _ = report.section_glue(rig, quick=True)
            table = text[text.index("| W MiB"):]
            print(f"\n#### Pass {i + 1}, {'synchronize after every round' if sync else 'deep queue'}"
                  f"\n\n{table}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
