"""Soak: many fork/join pairs eager and many graph replays; memory must stay flat.

    python benchmarks/soak.py [--pairs 1000000] [--replays 10000]

Prints device free memory and host RSS before and after each phase and exits
non-zero if either grew by more than a small bound (device: 2 MiB, host: 8 MiB).
"""

import argparse
import resource
import sys
import time

import torch

from l2prefetch import PrefetchController, PreparedWeightRanges


def rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def free_mib():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**20


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=1_000_000)
    ap.add_argument("--replays", type=int, default=10_000)
    args = ap.parse_args(argv)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    ctrl = PrefetchController(0)
    ctrl.add("p", 0, [8], PreparedWeightRanges([w], carveout=100, priority=True))
    fork, join = ctrl.fork, ctrl.join
    for _ in range(1000):   # warm-up: allocator, module, streams
        fork("p", 0, 8)
        join()
    ok = True
    d0, h0 = free_mib(), rss_mib()
    t0 = time.perf_counter()
    for _ in range(args.pairs):
        fork("p", 0, 8)
        join()
    t1 = time.perf_counter()
    d1, h1 = free_mib(), rss_mib()
    print(f"eager: {args.pairs} fork/join pairs in {t1 - t0:.1f} s; device free {d0:.0f} -> {d1:.0f} MiB, "
          f"host RSS {h0:.1f} -> {h1:.1f} MiB")
    ok &= d0 - d1 <= 2 and h1 - h0 <= 8

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        y = torch.nn.functional.linear(x, w)
        with torch.cuda.graph(g, stream=s):
            fork("p", 0, 8)
            y = torch.nn.functional.linear(x, w)
            join()
    torch.cuda.current_stream().wait_stream(s)
    ref = torch.nn.functional.linear(x, w)
    for _ in range(100):
        g.replay()
    d0, h0 = free_mib(), rss_mib()
    t0 = time.perf_counter()
    for _ in range(args.replays):
        g.replay()
    d1, h1 = free_mib(), rss_mib()
    same = torch.equal(y, ref)
    print(f"graph: {args.replays} replays in {time.perf_counter() - t0:.1f} s; device free {d0:.0f} -> "
          f"{d1:.0f} MiB, host RSS {h0:.1f} -> {h1:.1f} MiB; output bitwise equal to eager: {same}")
    ok &= d0 - d1 <= 2 and h1 - h0 <= 8 and same
    stats = ctrl.stats()["p"]
    print(f"controller stats: {stats['forks']} forks, {stats['bytes'] / 2**30:.1f} GiB issued")
    ctrl.close()
    print("soak", "OK" if ok else "FAILED: memory grew or outputs differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
