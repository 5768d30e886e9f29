"""Probe (run 26's question): one decode step's kernels in order, eager and compiled,
without forks and with a role's loads.  In the step the window role's loads recover
45-75% of what ``benchmarks.probe_l2`` measures for the same load with nothing between it
and the consumer, and no loaded line fades (RESULTS run 26): what runs between the
window's loads and their consumer, when do the loads end, and what does the consumer's
GEMV take in the step with and without them?

The model is :func:`benchmarks.compiled.build`'s (``--window`` us planted before every
MLP).  Per way (``eager``; ``compiled``: its forward compiled with ``--mode``) and arm
(``none``; with ``--role NAME``, also ``empty``, the role's forks with empty tables, and
``loads``, its forks loading ``--cap`` MiB at ``--grid`` in ``--fork`` mode, attached
before compiling as a server would; with ``--tail``, eager only, also ``tail``: the same
loads with ``warm_activation``, so the loader ends by re-reading the hooked module's
input, what the next kernel reads first: does the eager norm's first kernel then start
warm (run 35's question; run 36 ran it as a table registered anew at each call, before
the library had the flag)?), the step is captured in a CUDA graph and replayed
under ``torch.profiler`` as ``python -m l2prefetch trace`` does (5 replays, their median
timeline).  Printed: ``--kernels`` kernels from the first spin (the planted window; from
the first kernel when nothing is planted), each with its start and end relative to it,
its stream and its name cut to 90 characters; beside them every loader of the step
(``l2p_prefetch_*``), also those that start before the spin or after the last kernel
shown; and the step's span, the first kernel's start to the last kernel's end.

    python -m benchmarks.probe_order [--model llama] [--window 40] [--batch 1]
        [--ways eager,compiled] [--kernels 40] [--role NAME --cap 48 --grid 32 --fork branch]
        [--tail]
"""
import argparse

import torch

from benchmarks.common import no_gpu
from benchmarks.compiled import build
from l2prefetch import hooks
from l2prefetch.mechanisms import GRAPH_FORKS
from l2prefetch.tuning import candidates, discover
from l2prefetch.tuning.cli import compile_forward
from l2prefetch.tuning.compiled import recompile
from l2prefetch.tuning.trace_capture import capture_graph, forks_of_role, profile_replays
from l2prefetch.tuning.trace_events import LOADER_PREFIX, timeline

MIB = 1 << 20
REPLAYS = 5


def role_named(model, step, batch, name):
    roles = candidates(model, discover(model, lambda: step(batch)))
    for role in roles:
        if role.name == name:
            return role
    raise SystemExit(f"--role {name!r}: not one of this model's roles: "
                     f"{[r.name for r in roles]}")


def one(args, way, arm):
    """Build, attach (arm empty / loads), compile (way compiled), capture, profile."""
    model, step, planted = build(args.model, args.window)
    step.state(args.batch)
    attachment = None
    try:
        if arm != "none":
            role = role_named(model, step, args.batch, args.role)
            forks = forks_of_role(model, role, args.batch, byte_cap=int(args.cap * MIB),
                                  grid=args.grid, mode=args.fork,
                                  warm_activation=arm == "tail")
            attachment = hooks.attach(model, forks.build(arm == "empty"), forks.points)
        if way == "compiled":
            compile_forward(model, args.mode)
        recompile()
        with torch.no_grad():
            graph = capture_graph(torch, lambda: step(args.batch), torch.cuda.Stream())
        return timeline(profile_replays(torch, graph, REPLAYS), REPLAYS)
    finally:
        if attachment is not None:
            attachment.detach()
        for handle in planted:
            handle.remove()
        recompile()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probe_order")
    parser.add_argument("--model", default="llama")
    parser.add_argument("--window", type=float, default=40.0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ways", default="eager,compiled")
    parser.add_argument("--mode", default="default")
    parser.add_argument("--kernels", type=int, default=40)
    parser.add_argument("--role", default=None, help="a discovered role's name")
    parser.add_argument("--cap", type=float, default=48.0, metavar="MIB")
    parser.add_argument("--grid", type=int, default=32)
    parser.add_argument("--fork", default="branch", choices=GRAPH_FORKS,
                        help="the forks' graph mode")
    parser.add_argument("--tail", action="store_true",
                        help="eager: also the arm whose table ends with the module's input")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.kernels < 1 or args.grid < 1 or args.window < 0 or args.cap <= 0:
        parser.error("--batch, --kernels and --grid are at least 1, --window at least 0, "
                     "--cap above 0")
    ways = args.ways.split(",")
    for way in ways:
        if way not in ("eager", "compiled"):
            parser.error(f"--ways: {way!r} is neither eager nor compiled")
    if args.tail and (not args.role or ways != ["eager"]):
        parser.error("--tail needs --role and --ways eager")
    if no_gpu("benchmarks.probe_order"):
        return
    arms = ("none", "empty", "loads") if args.role else ("none",)
    for way in ways:
        for arm in arms + (("tail",) if args.tail else ()):
            kernels = one(args, way, arm)
            spin = next((k for k in kernels
                         if "sleep" in k.name.lower() or "spin" in k.name.lower()), None)
            first = spin if spin is not None else (kernels[0] if kernels else None)
            print(f"probe_order {args.model} {way} B{args.batch} window {args.window:g} us, "
                  f"{arm}{'' if arm == 'none' else f' ({args.role}, {args.cap:g} MiB, grid {args.grid}, {args.fork})'}: "
                  f"{len(kernels)} kernels a step (median of {REPLAYS} replays), times from "
                  f"the first {'spin' if spin is not None else 'kernel'}'s start:", flush=True)
            if first is None:
                continue
            shown = [k for k in kernels if k.start >= first.start][:args.kernels]
            loaders = [k for k in kernels if k.name.startswith(LOADER_PREFIX) and k not in shown]
            for k in sorted(shown + loaders, key=lambda k: k.start):
                print(f"  {k.start - first.start:9.2f} {k.end - first.start:9.2f} "
                      f"{k.dur:8.2f} us  stream {k.stream}  {k.name[:90]}", flush=True)
            print(f"probe_order {args.model} {way} {arm}: the step spans "
                  f"{max(k.end for k in kernels) - min(k.start for k in kernels):.2f} us "
                  f"(first kernel's start to last kernel's end)", flush=True)


if __name__ == "__main__":
    main()
