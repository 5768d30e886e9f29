"""Probe (issue 23, item 3): where the spread between graph instances of one step comes from.

Per model and batch, K instances of one HF decode step in each of three arms, all replayed
in rotated rounds (tuning.rig.Rig.replays), each replay event-timed:

* ``captures``: K captures, each into its own memory pool (the tuner's instances);
* ``one pool``: K captures one after another into one shared pool, so the
  intermediates a capture frees at its end are where the next capture allocates (same
  addresses for most activations; the outputs are overwritten, which timing ignores);
* ``one pool, kept``: the same, each capture's output kept alive (the tuner's shared
  placement before run 13: the next capture cannot reuse that block);
* ``instantiations``: one capture instantiated K times (``cuGraphInstantiateWithFlags`` on
  the same CUgraph: the same nodes with the same addresses), launched with ``cuGraphLaunch``.

Per arm: the range and SD of the per-instance medians (between), the median SD of one
instance's replays (within) and the rank correlation of the instances' first-half and
second-half medians (1.0: a stable order).  If the instantiations differ as much as the
captures, the executor's instantiation is the cause; if they agree and the one-pool
captures do too, it is where the buffers land; if only the instantiations agree, it is
the capture itself (kernels or parameters chosen at capture).

    python -m benchmarks.probe_spread [--k K] [--rounds R] [--batches 1,8] [MODEL ...]

MODEL: as for benchmarks.probe_bestof (default mixtral-4l, whose spread was 4.9% at batch 1).
"""
import argparse
import ctypes
import statistics

import torch

from l2prefetch.tuning.hf import DecodeStep
from l2prefetch.tuning.rig import Rig

from .common import hf_model, no_gpu


class _Driver:
    """The three driver calls the instantiations arm needs, through ctypes."""

    def __init__(self):
        self.lib = lib = ctypes.CDLL("libcuda.so.1")
        lib.cuGraphInstantiateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                                    ctypes.c_void_p, ctypes.c_ulonglong]
        lib.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cuGraphExecDestroy.argtypes = [ctypes.c_void_p]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def check(self, rc, what):
        if rc:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")

    def instantiate(self, graph):
        handle = ctypes.c_void_p()
        self.check(self.lib.cuGraphInstantiateWithFlags(ctypes.byref(handle),
                                                        ctypes.c_void_p(graph), 0),
                   "cuGraphInstantiateWithFlags")
        return handle


class _Exec:
    """One more executable graph of a kept CUgraph; replay() launches it on torch's stream."""

    def __init__(self, driver, graph):
        self.driver, self.handle = driver, driver.instantiate(graph)

    def replay(self):
        stream = torch.cuda.current_stream().cuda_stream
        self.driver.check(self.driver.lib.cuGraphLaunch(self.handle, ctypes.c_void_p(stream)),
                          "cuGraphLaunch")

    def close(self):
        if self.handle:
            self.driver.check(self.driver.lib.cuGraphExecDestroy(self.handle), "cuGraphExecDestroy")
            self.handle = None


def _rank_correlation(x, y):
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0] * len(v)
        for rank, i in enumerate(order):
            r[i] = rank
        return r
    rx, ry = ranks(x), ranks(y)
    n = len(x)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def batch_list(text):
    """'1,8' -> [1, 8] (comma-separated, so the option cannot swallow the model names
    after it, as a space-separated list did)."""
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--batches must be comma-separated integers >= 1, "
                                         f"got {text!r}")
    return values


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probe_spread")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--batches", type=batch_list, default=[1, 8],
                        help="comma-separated batch sizes (default 1,8)")
    parser.add_argument("models", nargs="*", default=["mixtral-4l"])
    args = parser.parse_args(argv)
    if no_gpu("benchmarks.probe_spread"):
        return
    rig = Rig(torch.device("cuda", 0))
    driver = _Driver()
    print(f"probe_spread on {torch.cuda.get_device_name()}: k={args.k}, {args.rounds} rounds")
    for name in args.models:
        model = hf_model(name)
        step = DecodeStep(model)
        for batch in args.batches:
            graphs, keep, execs = {}, [], []
            with torch.no_grad():
                step(batch)
                fn = lambda: step(batch)   # noqa: E731
                for i in range(args.k):
                    graphs[("captures", i)] = rig.capture(fn, warmup=0)[0]
                pool = torch.cuda.graph_pool_handle()
                for i in range(args.k):
                    graphs[("one pool", i)] = rig.capture(fn, warmup=0, pool=pool)[0]
                pool, kept = torch.cuda.graph_pool_handle(), []
                for i in range(args.k):   # as the tuner's shared placement did: outputs alive
                    graphs[("one pool, kept", i)], out = rig.capture(fn, warmup=0, pool=pool)
                    kept.append(out)
                template, _ = rig.capture(fn, warmup=0, keep_graph=True)
                keep.append(template)
                for i in range(args.k):
                    execs.append(_Exec(driver, template.raw_cuda_graph()))
                    graphs[("instantiations", i)] = execs[-1]
            try:
                us = rig.replays(graphs, args.rounds)
            finally:
                torch.cuda.synchronize()
            for arm in ("captures", "one pool", "one pool, kept", "instantiations"):
                per = [us[(arm, i)] for i in range(args.k)]
                med = [statistics.median(x) for x in per]
                half = args.rounds // 2
                first = [statistics.median(x[:half]) for x in per]
                second = [statistics.median(x[half:]) for x in per]
                within = statistics.median(statistics.stdev(x) for x in per)
                mean = statistics.mean(med)
                print(f"{name} B{batch} {arm:>14}: mean {mean:.1f} us, range "
                      f"{min(med):.1f}-{max(med):.1f} ({100 * (max(med) - min(med)) / mean:.2f}%), "
                      f"SD between {statistics.stdev(med):.2f} / within {within:.2f} us, "
                      f"rank correlation of the halves {_rank_correlation(first, second):+.2f}",
                      flush=True)
            for e in execs:
                e.close()
            del graphs, keep, execs, kept
            torch.cuda.empty_cache()
        model = step = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
