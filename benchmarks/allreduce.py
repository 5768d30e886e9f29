"""The all-reduce window: tensor-parallel decode, one process per GPU of one host.

    python -m benchmarks.allreduce [--world 2] [--quick] [--out PATH] [--kimi [--layers 8]]
                                    [--layer] [--layer-only]

At TP = --world, a decode step's all-reduce of the activations x [B, 7168]
bf16 (B = 1, 2, 4, 8) is followed by a bf16 GEMV y = x @ W^T over this rank's
next weight shard W (16 and 32 MiB, random).  The all-reduce is a window in
which HBM is nearly idle: a loader forked before it can pull W into L2.  Per
(W, B, n all-reduces, n = 1 or 2) each rank captures CUDA graphs of

    small op  [fork]  n x all_reduce(x)  y = linear(x, W)  [join]

and replays them interleaved rep by rep (CUDA events around each replay;
before each one the ranks meet at an NCCL barrier and synchronize):

  cold         no fork; L2 flushed (a buffer 8x the L2 read) before the replay.
  empty fork   the same fork with an empty table (the control), flushed.
  prefetched   the fork loads W (grid 32, carveout 100), flushed.
  hot          no fork; flushed, then W read just before (the physical limit).
  branch: ...  empty / prefetched with PrefetchController(graph_fork="branch").
  all-reduce alone / with loader: n all-reduces, no GEMV, without / with the
               fork loading W: how much the loader slows the all-reduce (an
               upper bound: the replay ends when the loader ends too).

Medians per rank (150 replays per variant, --quick 40: W 16 and 32 MiB,
B 1 and 8), then the mean over ranks.  Before measuring, a probe run (its own
processes) checks that each fork mode can be captured with NCCL all-reduces
and gives the right sums; a mode that fails is reported, not measured.

``--kimi`` adds the synthetic Kimi-sized shards of TP = --world
(``l2prefetch.kimi_k3.plan``, --layers layers): every batch-8 entry forked
once per layer inside a captured graph with one GEMV per layer, the forks
counted by ``ctrl.stats()`` per point and rank, and the replay with and
without the forks.

``--layer`` adds the decode step of the report's layer and caps sections
(benchmarks/sections/layer.py: two Kimi-shaped MoE layers, weights sharded
for TP = --world) with its two all-reduce stand-ins replaced by real
all-reduces of x [B, 7168]: no forks, ``kimi_k3.plan`` as shipped (inline
and as side branches), the reference design's points
(``points=kimi_k3.POINTS``), and the shipped forks with empty
tables, at batches 1-8 (--quick: 1, 4, 8).  This checks the caps section's
choices, made with a spin in place of NCCL, against the real collective.
``--layer-only`` skips the W x B table.

Capture, interleaved replays, the flush and the empty-fork control are the
package's (:class:`l2prefetch.tuning.rig.Rig`); :class:`RankRig` adds what
NCCL needs.  Rank 0 prints a Markdown section (and writes it to --out when
given).
NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 unless already set.
Without enough GPUs the script says why and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import l2prefetch
from l2prefetch import PrefetchController, PreparedWeightRanges
from l2prefetch.tuning.report import table
from l2prefetch.tuning.rig import Rig, empty_controller

MIB = 2**20
K = 7168
BACKEND = "nccl"
TIMEOUT = datetime.timedelta(minutes=5)   # a hung collective ends the run, not the session
PROBE_DEADLINE_S = 120
MODES = ("inline", "branch")              # PrefetchController graph_fork values


# ---------------------------------------------------------------- processes

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_reason(world):
    """Why this machine cannot run the benchmark, or None."""
    if world < 1:
        return f"--world must be at least 1, got {world}"
    if not torch.cuda.is_available():
        return (f"benchmarks.allreduce needs {world} CUDA GPUs; none is visible to torch "
                f"{torch.__version__}.")
    if torch.cuda.device_count() < world:
        return (f"benchmarks.allreduce --world {world} needs {world} CUDA GPUs; "
                f"{torch.cuda.device_count()} visible.")
    if not dist.is_available() or not dist.is_nccl_available():
        return f"torch {torch.__version__} has no NCCL backend."
    return None


def setup(rank, world, port):
    """Bind this process to cuda:rank and join the NCCL group."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group(BACKEND, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank), timeout=TIMEOUT)


def teardown():
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- rig

class RankRig(Rig):
    """The package's rig on this rank's GPU, with what NCCL needs: the ranks aligned
    before each replay, and a capture that can reset counters after its warm-up."""

    def __init__(self, rank, world):
        super().__init__(torch.device("cuda", rank))
        self.rank, self.world = rank, world
        self.name = torch.cuda.get_device_properties(rank).name

    def align(self):
        """All ranks at the same point, nothing queued (the last replay done first, so
        the barrier's collective never overlaps a replayed one)."""
        torch.cuda.synchronize()
        dist.barrier(device_ids=[self.rank])
        torch.cuda.synchronize()

    def aligned(self, before=None):
        """A ``before`` for Rig.replays: align the ranks, then ``before(key)``.  Every
        rank replays the same graphs in the same (rotated) order, so the replayed
        collectives match."""
        def run(key):
            self.align()
            if before is not None:
                before(key)
        return run

    def capture_step(self, fn, before_capture=None):
        """A CUDAGraph of fn (Rig.capture: one eager warm-up on the capture stream, which
        also initialises what NCCL and cuBLAS need; every rank captures the same graphs
        in the same order, so the warm-up collectives match), with before_capture() run
        between the warm-up and the capture when given (e.g. ctrl.reset_stats, so that
        the stats count the captured forks only)."""
        if before_capture is None:
            return self.capture(fn)[0]
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.synchronize()
        before_capture()
        return self.capture(fn, warmup=0)[0]


def weight(mib, device):
    """A random bf16 [N, 7168] shard of about mib MiB, N a multiple of 32."""
    rows = max(32, int(mib * MIB / (K * 2)) // 32 * 32)
    return torch.randn(rows, K, device=device, dtype=torch.float32).to(torch.bfloat16)


def make_step(rig, x, n, w=None, ctrl=None, point=None, batch=1):
    """The captured step: small op, [fork], n all-reduces of x, [GEMV over w], [join].

    The small op scales x by 1 / world**n, so that n summing all-reduces leave
    it bounded over any number of replays (and the fork follows a kernel, as in
    a layer)."""
    scale = 1.0 / rig.world ** n

    def fn():
        x.mul_(scale)
        if ctrl is not None:
            ctrl.fork(point, 0, batch)
        for _ in range(n):
            dist.all_reduce(x)
        if w is not None:
            torch.nn.functional.linear(x, w)
        if ctrl is not None:
            ctrl.join()
    return fn


# ---------------------------------------------------------------- probe

def probe_worker(rank, world, port, outdir):
    """Capture and replay the step with no fork, a branch fork and an inline fork.

    Writes {mode: "ok" | error} to outdir/rank<r>.json after each mode (the
    riskiest, inline, last), so what was learned survives a crash or a hang."""
    results = {}
    path = os.path.join(outdir, f"rank{rank}.json")

    def save():
        with open(path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(path + ".tmp", path)

    try:
        setup(rank, world, port)
        rig = RankRig(rank, world)
        w = weight(16, rig.device)
        p = PreparedWeightRanges([w], device=rank, carveout=100)
        n, expected = 2, (world + 1) / 2    # x = rank + 1 on each rank, then the step
        for mode in ("none", "branch", "inline"):
            ctrl = None
            try:
                x = torch.zeros(1, K, device=rig.device, dtype=torch.bfloat16)
                if mode != "none":
                    ctrl = PrefetchController(rank, graph_fork=mode)
                    ctrl.add("w", 0, [1], p)
                g = rig.capture_step(make_step(rig, x, n, w, ctrl, "w"))
                x.fill_(rank + 1)
                rig.align()
                g.replay()
                torch.cuda.synchronize()
                got = x.float()
                if not bool(torch.all((got - expected).abs() <= 0.02 * expected)):
                    raise RuntimeError(f"wrong all-reduce result after replay: expected "
                                       f"{expected}, got {got.min().item()}..{got.max().item()}")
                results[mode] = "ok"
            except Exception as exc:   # noqa: BLE001 - reported, not fatal
                text = str(exc).strip().splitlines()
                results[mode] = f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
                print(f"[rank {rank}] probe {mode}: {results[mode]}", flush=True)
            finally:
                if ctrl is not None:
                    ctrl.close()
            save()
    except Exception:
        print(f"[rank {rank}] probe failed:\n{traceback.format_exc()}", flush=True)
        raise
    finally:
        teardown()


def _probe_done(path):
    """True once a probe rank's file holds a verdict for every mode."""
    try:
        with open(path) as f:
            done = json.load(f)
    except (OSError, ValueError):
        return False
    return all(mode in done for mode in ("none", "branch", "inline"))


def probe(world):
    """{mode: "ok" or why not} for "none", "branch", "inline", agreed over all ranks."""
    with tempfile.TemporaryDirectory() as outdir:
        context = mp.start_processes(probe_worker, args=(world, free_port(), outdir),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + PROBE_DEADLINE_S
        died = None
        try:
            files = [os.path.join(outdir, f"rank{rank}.json") for rank in range(world)]
            while not context.join(timeout=2):
                # Every rank has written its verdicts: do not wait for its exit (tearing
                # down NCCL can hang past the deadline; run 7 lost 120 s to it).
                if all(_probe_done(f) for f in files):
                    break
                if time.monotonic() > deadline:
                    died = f"probe timed out after {PROBE_DEADLINE_S} s"
                    break
        except Exception as exc:       # a rank raised or died
            died = f"probe process failed: {type(exc).__name__}"
        finally:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        per_rank = []
        for rank in range(world):
            try:
                with open(os.path.join(outdir, f"rank{rank}.json")) as f:
                    per_rank.append(json.load(f))
            except (OSError, ValueError):
                per_rank.append({})
    verdict = {}
    for mode in ("none", "branch", "inline"):
        errors = [f"rank {r}: {res.get(mode, died or 'not reached')}"
                  for r, res in enumerate(per_rank) if res.get(mode) != "ok"]
        verdict[mode] = "ok" if not errors else "; ".join(errors)
    return verdict


# ---------------------------------------------------------------- measurement

def run_config(rig, w, batch, n, ctrls, ar_mode, reps):
    """Medians (us) of every variant for one (W, batch, number of all-reduces)."""
    x = torch.randn(batch, K, device=rig.device, dtype=torch.bfloat16)
    plain = rig.capture_step(make_step(rig, x, n, w))
    graphs = {"cold": plain, "hot": plain}
    for mode, prefix in (("inline", ""), ("branch", "branch: ")):
        if mode in ctrls:
            graphs[prefix + "empty"] = rig.capture_step(
                make_step(rig, x, n, w, ctrls[mode], "e", batch))
            graphs[prefix + "prefetched"] = rig.capture_step(
                make_step(rig, x, n, w, ctrls[mode], "w", batch))
    graphs["ar alone"] = rig.capture_step(make_step(rig, x, n))
    if ar_mode:
        graphs["ar with loader"] = rig.capture_step(
            make_step(rig, x, n, None, ctrls[ar_mode], "w", batch))

    def prepare(name):
        rig.flush()
        if name == "hot":
            w.sum()

    out = rig.time_graphs(graphs, reps, rig.aligned(prepare))
    del graphs, plain
    return out


def measure(rig, args, modes):
    """This rank's medians: {("step", W MiB, B, n): {variant: us}, ("loader", W MiB): us}."""
    sizes = [16, 32]
    batches = [1, 8] if args.quick else [1, 2, 4, 8]
    reps = 40 if args.quick else 150
    ar_mode = next((m for m in MODES if m in modes), None)
    empty = PreparedWeightRanges([], device=rig.rank, carveout=100)
    results = {}
    for mib in sizes:
        w = weight(mib, rig.device)
        p = PreparedWeightRanges([w], device=rig.rank, carveout=100)
        label = round(p.nbytes / MIB, 2)
        ctrls = {}
        for mode in modes:
            ctrls[mode] = PrefetchController(rig.rank, graph_fork=mode)
            ctrls[mode].add("w", 0, batches, p)
            ctrls[mode].add("e", 0, batches, empty)
        for batch in batches:
            for n in (1, 2):
                results[("step", label, batch, n)] = run_config(rig, w, batch, n, ctrls, ar_mode,
                                                                reps)
        loader = rig.capture_step(p.launch)  # the loader alone
        results[("loader", label)] = rig.time_graphs(
            {"l": loader}, reps, rig.aligned(lambda _key: rig.flush()))["l"]
        del loader
        for ctrl in ctrls.values():
            ctrl.close()
    return results


def measure_kimi(rig, layers, mode, reps):
    """Synthetic Kimi shards of TP = world: batch-8 forks per layer in one captured graph.

    Returns {"stats": ctrl.stats() of the capture, "no forks": us, "forks": us,
    "entries": plan length, "mode": graph_fork} or {"skipped": why}."""
    from l2prefetch import kimi_k3
    from l2prefetch.cli import build_synthetic_kimi

    if rig.world not in kimi_k3.NEXT_ATTENTION:
        return {"skipped": f"kimi_k3 has no plan for TP {rig.world}"}
    with torch.no_grad():
        _, lys, packed = build_synthetic_kimi({"layers": layers}, tp=rig.world, device=str(rig.device))
        plan = kimi_k3.plan(lys, packed, tp=rig.world)
        # Each layer's GEMV reads its first attention input projection ([rows, hidden]):
        # what the previous layer's next_attention fork loads.
        gemv = [kimi_k3.attention_weights(layer.self_attn)[0] for layer in lys]
        tensors = {id(t): t for entry in plan for t in entry.weights}
        tensors.update({id(t): t for t in gemv})
        for t in tensors.values():          # torch.empty fronts are not random: make all so
            t.normal_()
        forks = {}
        for entry in plan:
            if 8 in entry.batches:
                forks.setdefault(entry.layer, []).append(entry.point)
        ctrl = PrefetchController.from_plan(plan, rig.rank, graph_fork=mode)
        x = torch.randn(8, K, device=rig.device, dtype=torch.bfloat16)

        def step(with_forks):
            def fn():
                for layer, wt in zip(lys, gemv):
                    if with_forks:
                        for point in forks.get(layer.layer_idx, ()):
                            ctrl.fork(point, layer.layer_idx, 8)
                    torch.nn.functional.linear(x, wt)
                if with_forks:
                    ctrl.join()
            return fn

        graphs = {"no forks": rig.capture_step(step(False)),
                  "forks": rig.capture_step(step(True), before_capture=ctrl.reset_stats)}
        stats = ctrl.stats()
        times = rig.time_graphs(graphs, reps, rig.aligned(lambda _key: rig.flush()))
        del graphs
        ctrl.close()
    return {"stats": stats, "entries": len(plan), "mode": mode, **times}


def measure_layer(rig, batches, reps, instances=2):
    """The layer section's two-layer step with real all-reduces, per batch: the median
    over graph instances of each variant's per-instance medians (us), and the shipped
    plan's forks per point."""
    from l2prefetch import kimi_k3

    from .sections.layer import kimi_layers, layer_step

    rig.cycles_per_us  # calibrate the spin now: never inside a capture

    if rig.world not in kimi_k3.NEXT_ATTENTION:
        return {"skipped": f"kimi_k3 has no plan for TP {rig.world}"}
    out = {"batches": {}}
    with torch.no_grad():
        layers, packed = kimi_layers(rig.world, rig.device)
        shapes = {name: tuple(w.shape) for name, w in layers[0].ws.items()}
        shipped = kimi_k3.plan(layers, packed, rig.world)
        reference = kimi_k3.plan(layers, packed, rig.world, points=kimi_k3.POINTS)
        ctrls = {"shipped": PrefetchController.from_plan(shipped, rig.rank),
                 "shipped, branch": PrefetchController.from_plan(shipped, rig.rank,
                                                                 graph_fork="branch"),
                 "reference points": PrefetchController.from_plan(reference, rig.rank),
                 "empty forks": empty_controller(shipped, rig.rank)}
        for batch in batches:
            def rand(n, batch=batch):
                return torch.randn(batch, n, device=rig.device, dtype=torch.bfloat16)

            h, a, xar = rand(K), rand(shapes["o_proj"][1]), rand(K)
            sd = rand(shapes["shared_down"][1])
            scale = 1.0 / rig.world

            def allreduce(xar=xar, scale=scale):
                xar.mul_(scale)               # keeps the summed x bounded over replays
                dist.all_reduce(xar)

            variants = {"none": None, **ctrls}
            graphs, forks = {}, {}
            for i in range(instances):
                for name, ctrl in variants.items():
                    fn = layer_step(rig, layers, ctrl, batch, h, a, sd, allreduce)
                    reset = ctrl.reset_stats if ctrl is not None else None
                    graphs[name, i] = rig.capture_step(fn, before_capture=reset)
                    if name == "shipped" and i == 0:
                        forks = {p: st["forks"] for p, st in ctrl.stats().items()}
            per = rig.instance_medians(graphs, reps, rig.aligned(lambda _key: rig.flush()))
            out["batches"][batch] = {
                "times": {name: statistics.median(per[name]) for name in variants},
                "forks": forks}
            del graphs
        for ctrl in ctrls.values():
            ctrl.close()
    out["instances"] = instances
    return out


def render_layer(per_rank, world):
    title = (f"### The two-layer Kimi step at TP {world} with real all-reduces "
             "(step time, us; mean over ranks of the per-rank medians)")
    skipped = [r["skipped"] for r in per_rank if "skipped" in r]
    if skipped:
        return f"{title}\n\nSkipped: {skipped[0]}."
    names = list(next(iter(per_rank[0]["batches"].values()))["times"])
    rows, worst = [], []
    for batch in per_rank[0]["batches"]:
        t = {n: statistics.mean(r["batches"][batch]["times"][n] for r in per_rank) for n in names}
        forks = ", ".join(f"{p} {c}" for p, c in
                          sorted(per_rank[0]["batches"][batch]["forks"].items()))
        rows.append((batch, forks or "-", *(f"{t[n]:.2f}" for n in names),
                     *(f"{t['none'] / t[n]:.3f}x" for n in names if n != "none")))
        worst.append((t["none"] / t["shipped"], batch))
    lo = min(worst)
    return (f"{title}\n\n"
            "The layer section's step (per layer: GEMV attn_in, [attention_moe], spin 20 us, "
            "GEMV o_proj, [oproj_down], all-reduce, GEMVs front, shared gate_up, shared down, "
            "experts, [next_attention], all-reduce; one join), weights sharded for this TP, "
            "each all-reduce a real `dist.all_reduce` of x [B, 7168] bf16 (after a scale "
            "kernel that keeps it bounded).  shipped = `kimi_k3.plan(layers, packed, tp)` "
            "(graph_fork='inline' unless marked branch); reference points = the same with "
            "`points=kimi_k3.POINTS` (oproj_down too); empty forks = the shipped forks with "
            f"empty tables.  Each variant captured {per_rank[0]['instances']} times, the "
            "replays interleaved, ranks aligned and L2 flushed before each; forks = the "
            "shipped plan's forks per replay (rank 0).\n\n"
            + table(["batch", "forks", *names, *(f"none / {n}" for n in names if n != "none")],
                    rows)
            + f"\nShipped against no forks: {lo[0]:.3f}x at worst (batch {lo[1]}).")


def gather(obj, world):
    everyone = [None] * world
    dist.all_gather_object(everyone, obj)
    return everyone


def emit(text, out, mode):
    """Print text; append or write it to out when given."""
    print("\n" + text, flush=True)
    if out:
        with open(out, mode) as f:
            f.write(("\n" if mode == "a" else "") + text + "\n")
        print(f"\n{'appended to' if mode == 'a' else 'wrote'} {out}", flush=True)


def worker(rank, world, port, args, command, verdict):
    """One rank: measure, gather to rank 0, which renders and prints.

    The main table is printed (and written) before --kimi runs, so a failure
    there loses only the Kimi section."""
    try:
        setup(rank, world, port)
        rig = RankRig(rank, world)
        modes = [m for m in MODES if verdict.get(m) == "ok"]
        if args.layer_only:
            if rank == 0:
                emit(header(rig, command), args.out, "w")
        else:
            everyone = gather(measure(rig, args, modes), world)
            if rank == 0:
                emit(render(header(rig, command), everyone, verdict, world), args.out, "w")
        if args.layer or args.layer_only:
            batches = [1, 4, 8] if args.quick else list(range(1, 9))
            reps = 40 if args.quick else 100
            everyone = gather(measure_layer(rig, batches, reps), world)
            if rank == 0:
                emit(render_layer(everyone, world), args.out, "a")
        if args.kimi:
            reps = 40 if args.quick else 150
            mine = (measure_kimi(rig, args.layers, modes[0], reps) if modes
                    else {"skipped": "no fork mode could be captured"})
            everyone = gather(mine, world)
            if rank == 0:
                emit(render_kimi(everyone, world), args.out, "a")
        dist.barrier(device_ids=[rank])
    except Exception:
        print(f"[rank {rank}] failed:\n{traceback.format_exc()}", flush=True)
        raise
    finally:
        teardown()


# ---------------------------------------------------------------- report

def nccl_version():
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def header(rig, command):
    disabled = "  L2PREFETCH_DISABLE is set: forks do nothing." if l2prefetch.disabled() else ""
    return (f"Device: {rig.name} x {rig.world} (L2 {rig.l2_bytes / MIB:.0f} MiB), TP {rig.world}, "
            f"torch {torch.__version__}, NCCL {nccl_version()}, l2prefetch "
            f"{l2prefetch.__version__}, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.{disabled}\n"
            f"Command: `{command}`")


def average(per_rank):
    """Mean over ranks of each rank's medians: {key: {variant: us}} (or {key: us})."""
    out = {}
    for key in per_rank[0]:
        values = [r[key] for r in per_rank]
        if isinstance(values[0], dict):
            out[key] = {v: statistics.mean(d[v] for d in values) for v in values[0]}
        else:
            out[key] = statistics.mean(values)
    return out


def diff(a, b):
    return None if a is None or b is None else a - b


def fmt(v, sign=False):
    if v is None:
        return "n/a"
    return f"{v:+.2f}" if sign else f"{v:.2f}"


def where(key):
    _, mib, batch, n = key
    return f"W {mib:g} MiB, B {batch}, {n} all-reduce{'s' if n > 1 else ''}"


def summary(steps, loaders):
    """Two or three sentences from the numbers."""
    def extreme(fn, pick):
        found = [(fn(r), k) for k, r in steps.items() if fn(r) is not None]
        return pick(found, key=lambda t: t[0]) if found else None

    # The shipped inline fork's columns, or the side branch's where inline was not measured.
    prefix = "" if any("prefetched" in r for r in steps.values()) else "branch: "
    how = "" if not prefix else " (side-branch fork: the inline fork was not measured)"
    out = []
    loss = extreme(lambda r: diff(r["cold"], r.get(prefix + "prefetched")), min)
    if loss is None:
        out.append("No prefetched numbers: no fork mode could be captured (see the probe note).")
    elif loss[0] < 0:
        out.append(f"The largest loss against not forking{how}: prefetched is {-loss[0]:.2f} us "
                   f"slower than cold at {where(loss[1])}.")
    else:
        out.append(f"Prefetched was never slower than cold{how}: its smallest gain is "
                   f"{loss[0]:.2f} us, at {where(loss[1])}.")
    net = extreme(lambda r: diff(r.get(prefix + "empty"), r.get(prefix + "prefetched")), max)
    if net is not None:
        r = steps[net[1]]
        out.append(f"The best net gain (empty fork - prefetched){how} is {net[0]:+.2f} us at "
                   f"{where(net[1])}, where the gap cold - hot is {r['cold'] - r['hot']:.2f} us.")
    slow = extreme(lambda r: diff(r.get("ar with loader"), r["ar alone"]), max)
    if slow is not None:
        own = ", ".join(f"{us:.2f} us ({mib:g} MiB)" for (_, mib), us in sorted(loaders.items()))
        out.append(f"The loader slows the all-reduce by at most {slow[0]:+.2f} us ({where(slow[1])}); "
                   f"an upper bound, as that replay also waits for the loader, which alone on a "
                   f"cold L2 takes {own}.")
    return " ".join(out)


def render(head, per_rank, verdict, world):
    avg = average(per_rank)
    steps = {k: v for k, v in avg.items() if k[0] == "step"}
    loaders = {k: v for k, v in avg.items() if k[0] == "loader"}
    rows = []
    for key in sorted(steps):
        _, mib, batch, n = key
        r = steps[key]
        get = r.get
        rows.append((f"{mib:.1f}", batch, n, fmt(r["cold"]), fmt(get("empty")),
                     fmt(get("prefetched")), fmt(r["hot"]), fmt(r["cold"] - r["hot"]),
                     fmt(diff(get("empty"), get("prefetched")), True),
                     fmt(diff(r["cold"], get("prefetched")), True),
                     fmt(get("branch: empty")), fmt(get("branch: prefetched")),
                     fmt(r["ar alone"]), fmt(get("ar with loader")),
                     fmt(diff(get("ar with loader"), r["ar alone"]), True)))
    ar_mode = next((m for m in MODES if verdict.get(m) == "ok"), None)
    probe_notes = [f"graph_fork='{m}' could not be captured with NCCL all-reduces and was not "
                   f"measured: {verdict[m]}" for m in MODES if verdict.get(m) != "ok"]
    parts = [
        f"### The all-reduce window: TP {world}, all-reduce then GEMV (step time, us)",
        head,
        "Step = small op, [fork], n x all_reduce(x [B, 7168] bf16, sum, in place), "
        "y = x @ W^T (bf16), [join], replayed as a CUDA graph on every rank, the variants "
        "interleaved, the ranks aligned (NCCL barrier, synchronize) before each replay; the "
        "median per rank, then the mean over ranks.  Loader: default kernel, grid 32, carveout "
        "100, forked before the all-reduces; empty fork = the same fork with an empty table; "
        "columns without a prefix fork inline (graph_fork='inline', as shipped), 'branch:' to "
        "the side stream.  hot = W read just before the replay.  gap = cold - hot (the prize); "
        "net = empty - prefetched (the gain against the control); vs cold = cold - prefetched "
        "(against not forking).  all-reduce alone / with loader: n all-reduces without the GEMV, "
        f"without / with the fork loading W ({ar_mode or 'no'} fork).",
        table(["W MiB", "B", "all-reduces", "cold", "empty fork", "prefetched", "hot",
               "gap (cold-hot)", "net (empty-prefetched)", "vs cold (cold-prefetched)",
               "branch: empty", "branch: prefetched", "all-reduce alone",
               "all-reduce with loader", "loader's slowdown of the all-reduce"], rows),
        summary(steps, loaders),
    ]
    if probe_notes:
        parts.append("Probe: " + "; ".join(probe_notes) + ".")
    return "\n\n".join(part.rstrip("\n") for part in parts)


def render_kimi(per_rank, world):
    title = f"### Kimi-sized shards, TP {world}: batch-8 forks per layer in one captured graph"
    skipped = [r["skipped"] for r in per_rank if "skipped" in r]
    if skipped:
        return f"{title}\n\nSkipped: {skipped[0]}."
    rows = []
    for rank, r in enumerate(per_rank):
        for point, s in sorted(r["stats"].items()):
            rows.append((rank, point, s["forks"], f"{s['bytes'] / MIB:.1f}"))
    no_forks = statistics.mean(r["no forks"] for r in per_rank)
    forks = statistics.mean(r["forks"] for r in per_rank)
    return (f"{title}\n\n"
            f"{per_rank[0]['entries']} plan entries per rank (`kimi_k3.plan`, synthetic layers of "
            "`l2prefetch.cli.build_synthetic_kimi`); each layer forks its batch-8 entries, then "
            f"runs a GEMV over its first attention input projection (x [8, 7168]); "
            f"graph_fork='{per_rank[0]['mode']}'.  Forks and MiB "
            "are `ctrl.stats()` counted over the capture (what one replay launches).\n\n"
            + table(["rank", "point", "forks", "MiB"], rows)
            + f"\nReplay, flushed before, mean of the per-rank medians: {no_forks:.2f} us without "
            f"the forks, {forks:.2f} us with them ({forks - no_forks:+.2f} us).")


# ---------------------------------------------------------------- main

def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.allreduce",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="GPUs = tensor parallelism (default 2)")
    ap.add_argument("--quick", action="store_true",
                    help="B 1 and 8, 40 replays per variant (default: B 1, 2, 4, 8 and 150)")
    ap.add_argument("--out", help="also write the Markdown section to this file")
    ap.add_argument("--kimi", action="store_true",
                    help="add the synthetic Kimi-sized TP shards' batch-8 forks")
    ap.add_argument("--layers", type=int, default=8, help="layers of the --kimi model (default 8)")
    ap.add_argument("--layer", action="store_true",
                    help="add the report's two-layer Kimi step with real all-reduces")
    ap.add_argument("--layer-only", action="store_true",
                    help="only the two-layer step (skip the W x B table)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    command = "python -m benchmarks.allreduce " + " ".join(
        argv if argv is not None else sys.argv[1:])
    reason = gpu_reason(args.world)
    if reason:
        print(reason)
        return 0
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    t0 = time.perf_counter()
    verdict = probe(args.world)
    print(f"probe ({time.perf_counter() - t0:.0f} s): "
          + ", ".join(f"{m}: {v}" for m, v in verdict.items()), flush=True)
    if verdict["none"] != "ok":
        print("the step without a fork could not be captured and replayed; nothing to measure.")
        return 1
    try:
        mp.spawn(worker, args=(args.world, free_port(), args, command.strip(), verdict),
                 nprocs=args.world, join=True)
    except Exception as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        print(f"benchmarks.allreduce failed ({type(exc).__name__}: "
              f"{lines[0].strip(' -') if lines else ''}); the [rank r] tracebacks above say why.")
        return 1
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
