"""The command line: ``python -m l2prefetch [info | plan | tune | trace | demo] [options]``.

* ``info`` (also what runs with no command): what l2prefetch does on this
  machine.  On a GPU it prepares ~32 MiB of weights, launches the prefetch and
  times a GEMV over them cold, after the prefetch and hot.  Without one it says
  why (the whole reason: where it looked for the driver and what it found),
  then compiles the kernel for sm_90 with NVRTC and sizes the byte ranges of a
  synthetic weight set.
* ``plan``: Kimi K3 only, the :mod:`~l2prefetch.kimi_k3` policy's plan of a
  synthetic Kimi-sized model, which lives on torch's ``meta`` device (shapes
  only: no memory, no GPU); ``tune`` finds the plan of another model.
* ``tune``: from :mod:`l2prefetch.tuning.cli`, where that module exists.
* ``trace``: from :mod:`l2prefetch.tuning.trace_cli`: where the loads ran in the graph.
* ``demo``: from :mod:`l2prefetch.tuning.demo`: the whole flow on a small built-in
  model (``./dev.sh run``'s default).

Every command is a pair ``add_parser(subparsers)``, which adds its parser and
sets ``func=run``, and ``run(args) -> int``, its exit status.

Exit status: 0 when the command did its work (``info`` without a GPU
included); 2, with one line on stderr, for a bad option, a bad dimension, an
unreadable ``--shapes`` file or a missing torch; 1, with the error on stderr,
when CUDA or NVRTC fails while running; 130 on Ctrl-C.  Importing this module,
and ``--help``, do not import torch.

The synthetic model of ``plan``: its dimensions are Kimi-K2-like guesses (the
reference design does not give Kimi K3's shapes); override them with options
or ``--shapes FILE.json`` (a JSON object of the keys of
:data:`l2prefetch.kimi_k3.DEFAULT_DIMS`).
Per TP shard, in bf16 by default (``rows x columns``; ``/tp``: sharded):

* KDA attention (3 of every 4 layers): ``in_proj_qkvgfab`` [3 x kda_heads x
  kda_head_dim / tp + 2 x kda_rank + kda_heads / tp, hidden] (q, k, v, the
  low-rank output gate and forget gate, beta), ``f_b_proj`` and ``g_proj``
  [kda_heads x kda_head_dim / tp, kda_rank], ``o_proj`` [hidden, kda_heads x
  kda_head_dim / tp].
* MLA attention (every 4th layer): ``fused_qkv_a_proj`` [q_lora_rank +
  kv_lora_rank + qk_rope_head_dim, hidden] (replicated), ``q_b_proj``
  [mla_heads / tp x (qk_nope_head_dim + qk_rope_head_dim), q_lora_rank],
  ``W_UK_T`` [mla_heads / tp, qk_nope_head_dim, kv_lora_rank], ``W_UV``
  [mla_heads / tp, kv_lora_rank, v_head_dim], ``o_proj`` [hidden, mla_heads /
  tp x v_head_dim].
* MoE front (packed): [experts / tp + moe_latent / tp, hidden] (router shard
  and latent-down shard); shared expert ``gate_up_proj`` [2 x
  shared_intermediate / tp, hidden], ``down_proj`` [hidden, shared_intermediate
  / tp].  Routed experts and dense MLPs are not modelled: no point reads them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import textwrap
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any, Optional

from . import _C, _torch, __version__
from .disable import disabled, unknown_disable_value
from ._parser import Parser as _Parser
from . import kimi_k3
from .kimi_k3 import DEFAULT_DIMS, MAX_TENSOR_BYTES, synthetic_model as build_synthetic_kimi

__all__ = ["UsageError", "main", "plan_main"]

MIB = 2**20


class UsageError(Exception):
    """A bad option or input, raised by a command's run(): one line on stderr, exit status 2."""


# -- the command line ------------------------------------------------------------------------

def _program() -> str:
    """How the user started us: the ``l2prefetch`` script or ``python -m l2prefetch``."""
    return "l2prefetch" if os.path.basename(sys.argv[0]) == "l2prefetch" else "python -m l2prefetch"


#: The commands of l2prefetch.tuning, each a module whose add_parser(subparsers) adds it.
_TUNING_COMMANDS = ("cli", "trace_cli", "demo")   # tune, trace, demo


def _commands() -> list[Any]:
    """The ``add_parser`` of every command, in ``--help`` order."""
    import importlib

    adders = [_add_info, _add_plan]
    for name in _TUNING_COMMANDS:
        try:
            module = importlib.import_module(f".tuning.{name}", __package__)
        except ImportError as exc:  # no l2prefetch.tuning, or not this module in it
            if exc.name not in ("l2prefetch.tuning", f"l2prefetch.tuning.{name}"):
                raise      # the command exists but cannot import: say so rather than hide it
            continue
        adders.append(module.add_parser)
    return adders


def _parser() -> _Parser:
    parser = _Parser(
        prog=_program(), allow_abbrev=False,
        description="L2 weight prefetch for LLM decode, beside the step's kernels.  With no "
                    "command, runs 'info'.",
        epilog="Exit status: 0 done; 1 CUDA or NVRTC failed while running; 2 a bad option "
               "or input, or torch missing (one line on stderr).  '%(prog)s COMMAND --help' "
               "describes a command.  L2PREFETCH_DISABLE=1 in the environment turns "
               "prefetching off (README, Configuration).")
    parser.add_argument("--version", action="version", version=f"l2prefetch {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="info: also print the kernel's compile options and the mix of "
                             "its PTX instructions")
    parser.set_defaults(func=_run_info, command=None)
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for add_parser in _commands():
        add_parser(subparsers)
    parser.commands = subparsers.choices
    return parser


def _parse(parser: _Parser, argv: list[str]) -> argparse.Namespace:
    """parse_args, with arguments a command does not know blamed on that command."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.commands.get(args.command, parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    return args


def _import_torch(what: str) -> Any:
    """torch (or _torch's ModuleNotFoundError), without its warning that numpy is missing:
    a command's stderr is its errors."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
        return _torch.require(what)


def _exit_code(code: Any) -> int:
    """A SystemExit's code as an exit status (what sys.exit would make of it)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = _parser()
    try:
        args = _parse(parser, sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return _exit_code(exc.code)
    name = f"l2prefetch {args.command or 'info'}"
    try:
        code = args.func(args)
        sys.stdout.flush()   # a closed pipe raises here, not in the exit's flush
        return code
    except SystemExit as exc:
        return _exit_code(exc.code)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # `... | head`: the reader left; say nothing more to it
        from ._files import stdout_to_devnull

        stdout_to_devnull()
        return 141
    except UsageError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except (_C.Error, _C.CudaUnavailableError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1


def plan_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m l2prefetch plan ARGV``; returns the exit status."""
    return main(["plan", *(sys.argv[1:] if argv is None else argv)])


# -- info ------------------------------------------------------------------------------------

def _add_info(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "info", help="what l2prefetch does on this machine (the default)", allow_abbrev=False,
        description="On a GPU: prepare ~32 MiB of weights, launch the prefetch, and time a "
                    "GEMV over them cold, after the prefetch, and hot.  Without one: say why, "
                    "compile the kernel for sm_90 and size a synthetic weight set's ranges.")
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="also print the kernel's compile options and the mix of its PTX "
                             "instructions")
    parser.set_defaults(func=_run_info)


def _run_info(args: argparse.Namespace) -> int:
    unknown = unknown_disable_value()
    if disabled():
        print("L2PREFETCH_DISABLE is set: prefetching is off (controllers prepare nothing, "
              "forks load nothing; tune, trace and demo refuse to run, tune --list-roles "
              "still lists roles)\n")
    elif unknown is not None:   # also logged, where logging shows it
        print(f"L2PREFETCH_DISABLE={unknown!r} is not a word l2prefetch "
              "knows, so prefetching stays on: 1 (true, yes, on) turns it off, 0 (false, "
              "no, off) says it is on\n")
    reason = _why_no_gpu()
    if reason is None:
        return _info_gpu(args.verbose)
    print(f"l2prefetch {__version__}: no GPU to measure on here:")
    print(textwrap.indent(reason, "  "))
    print("\nWithout a GPU, l2prefetch can still compile its kernel and size weight ranges.\n")
    _print_kernel("ring", 90, args.verbose)
    print()
    _print_ranges()
    print(f"\nNext, here: '{_program()} demo' (the whole flow: what the CPU can do of it) or "
          f"'{_program()} tune MODEL --list-roles --device cpu' (a model's candidate fork "
          f"points); on a GPU, '{_program()} tune MODEL' measures them.")
    return 0


def _why_no_gpu() -> Optional[str]:
    """None when info can measure on a GPU here; else the whole reason why not: the
    driver and a device first, then torch with CUDA."""
    reason = _torch.driver_reason()
    if reason is not None:
        return reason
    try:
        torch = _import_torch("measuring on the GPU")
    except ModuleNotFoundError as exc:
        return str(exc)
    return _torch.cuda_reason(torch)


def _instruction_mix(ptx: str) -> Counter:
    ops: Counter = Counter()
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)", line)
        if m and not line.lstrip().startswith((".", "//", "{", "}", "$")):
            op = m.group(1)
            ops[op.split(".")[0] if not op.startswith(("cp.", "mbarrier", "prefetch", "ld.")) else
                ".".join(op.split(".")[:3])] += 1
    return ops


def _resource_use(log: str) -> list[str]:
    """ptxas -v's log as 'entry: resources' lines, one per kernel entry point."""
    lines, entry = [], None
    for line in log.splitlines():
        m = re.search(r"entry function '([^']+)'", line)
        if m:
            entry = m.group(1)
            continue
        m = re.search(r"Used (.*)", line)
        if m and entry:
            lines.append(f"{entry}: {m.group(1).replace(', used ', ', ')}")
            entry = None
    return lines


def _print_kernel(variant: str, sm: int, verbose: bool) -> None:
    """Compile ``variant`` for ``sm`` with NVRTC and say what came out."""
    try:
        nvrtc = _C.nvrtc_info()
        built = _C.compile(variant, sm)
        ptx = _C.compile(variant, sm, ptx=True) if verbose else None
    except (_C.CudaUnavailableError, _C.Error) as exc:
        print("NVRTC, which compiles the kernel, is not available:")
        print(textwrap.indent(str(exc), "  "))
        return
    print(f"NVRTC {nvrtc['version'][0]}.{nvrtc['version'][1]} at {nvrtc['path']}")
    print(f"kernel '{variant}' for sm_{sm}: {len(built['image'])} bytes of CUBIN")
    usage = _resource_use(built["log"])
    if usage:
        print("resources of each entry point (l2p_prefetch_N takes up to N ranges):")
        for line in usage:
            print(f"  {line}")
    if not verbose:
        return
    print(f"NVRTC options: {' '.join(built['options'])}")
    mix = _instruction_mix(ptx["image"].decode(errors="replace"))
    if mix:
        print("PTX instructions, the 12 most frequent over all entry points:")
        for op, n in mix.most_common(12):
            print(f"  {op:40s} {n}")


class _Shape:
    """A weight with a shape, an address and no memory (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, shape: tuple[int, ...]):
        self.ptr, self.shape = ptr, shape

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        # '<f2': 2-byte elements, the size of the bf16 weights they stand for.
        return {"shape": self.shape, "typestr": "<f2", "data": (self.ptr, False),
                "strides": None, "version": 3}


#: A Kimi-like next-layer attention shard (bf16, rows multiples of 32).
SYNTHETIC_SHAPES = ((2336, 7168), (64, 7168), (1024, 1536), (7168, 160))


def _print_ranges(cap_mib: int = 24) -> None:
    """compute_ranges over SYNTHETIC_SHAPES, whole and under a byte cap."""
    weights, ptr = [], 1 << 40
    for shape in SYNTHETIC_SHAPES:
        weights.append(_Shape(ptr, shape))
        ptr += (math.prod(shape) * 2 + 255) // 256 * 256
    whole = _C.compute_ranges(weights)
    capped = _C.compute_ranges(weights, cap_mib * MIB)
    print(f"Byte ranges (compute_ranges) of a Kimi-sized attention shard, 4 bf16 weights "
          f"(sizes only),\nwhole and under a {cap_mib} MiB cap:")
    print(f"  {'weight':6}  {'shape':14}  {'MiB':>6}  {'under the cap':>13}")
    for i, (weight, (_, size)) in enumerate(zip(weights, whole)):
        kept = capped[i][1] / MIB if i < len(capped) else 0.0
        print(f"  {i:<6}  {str(weight.shape):14}  {size / MIB:6.2f}  {kept:13.2f}")
    print(f"  {'total':6}  {'':14}  {sum(n for _, n in whole) / MIB:6.2f}  "
          f"{sum(n for _, n in capped) / MIB:13.2f}")


def _synthetic_weights(device: str) -> list[Any]:
    """SYNTHETIC_SHAPES as bf16 tensors of random values on ``device``."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=torch.float32).to(torch.bfloat16).to(device)
            for s in SYNTHETIC_SHAPES]


def _median_ms(fn: Any, reps: int = 50) -> float:
    import torch

    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn(start, end)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _info_gpu(verbose: bool) -> int:
    import torch

    from . import PreparedWeightRanges

    dev = torch.cuda.current_device()
    info = _C.device_info(dev)
    props = torch.cuda.get_device_properties(dev)
    weights = _synthetic_weights(f"cuda:{dev}")
    w = weights[0]
    prepared = PreparedWeightRanges((w,), grid=32, carveout=100, priority=True)
    print(f"l2prefetch {__version__} on {props.name} (cuda:{dev}, sm_{info['sm']}, "
          f"{info['sm_count']} SMs, L2 {info['l2_bytes'] / MIB:.0f} MiB, driver "
          f"{info['driver_version']}, torch {torch.__version__})")
    print(f"kernel '{prepared.kernel}', grid {prepared.grid} x {prepared.block} threads, "
          f"{prepared.smem} B shared memory, {prepared.nbytes / MIB:.2f} MiB in "
          f"{len(prepared.ranges)} range(s)")
    side = torch.cuda.Stream()
    prepared.launch(side)
    torch.cuda.synchronize()
    host = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        prepared.launch(side)
        host.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    print(f"host time of one launch: median {statistics.median(host) / 1e3:.2f} us")

    flush = torch.empty(512 * MIB // 4, dtype=torch.float32, device=w.device).normal_()
    x = torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device)
    cur = torch.cuda.current_stream()

    def cold(s, e):
        flush.add_(1.0)
        s.record()
        torch.nn.functional.linear(x, w)
        e.record()

    def prefetched(s, e):
        flush.add_(1.0)
        side.wait_stream(cur)
        prepared.launch(side)
        cur.wait_stream(side)
        s.record()
        torch.nn.functional.linear(x, w)
        e.record()

    def hot(s, e):
        flush.add_(1.0)
        torch.nn.functional.linear(x, w)
        s.record()
        torch.nn.functional.linear(x, w)
        e.record()

    results = {name: _median_ms(fn) * 1e3 for name, fn in
               (("cold", cold), ("prefetched", prefetched), ("hot", hot))}
    print(f"GEMV y = x @ W^T, W {tuple(w.shape)} bf16, batch 1 (median of 50, us): "
          + ", ".join(f"{k} {v:.2f}" for k, v in results.items()))
    gap = results["cold"] - results["hot"]
    if gap > 0:
        share = (results["cold"] - results["prefetched"]) / gap
        print(f"the prefetch recovered {100 * share:.0f}% of the cold->hot gap of {gap:.2f} us "
              "(the prefetch ran to completion first; benchmarks/ measures real overlap)")
    if verbose:
        print()
        _print_kernel(prepared.kernel, info["sm"], verbose)
    return 0


# -- plan ------------------------------------------------------------------------------------

def _l2_mib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value * MIB >= 1):
        raise argparse.ArgumentTypeError(
            f"must be a finite number of MiB, at least one byte, got {text}")
    if value * MIB > MAX_TENSOR_BYTES:
        raise argparse.ArgumentTypeError(
            f"must be below 2**63 bytes ({MAX_TENSOR_BYTES // MIB} MiB), got {text}")
    return value


def _mib_cap(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an int: {text!r}") from None
    if not 0 <= value * MIB <= MAX_TENSOR_BYTES:
        raise argparse.ArgumentTypeError(
            f"must be an int of MiB in 0..{MAX_TENSOR_BYTES // MIB}, got {text}")
    return value


def _add_plan(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan", help="Kimi K3 only: the kimi_k3 policy's plan of a synthetic Kimi-sized "
                     "model (for your model: tune)",
        allow_abbrev=False,
        description="Kimi K3 only: print the kimi_k3 policy's prefetch plan of a synthetic "
                    "Kimi-sized model: which weights are prefetched at which point of which "
                    "layer, their MiB, and their share of L2.  It reads no model of yours; "
                    "'tune' finds the plan of yours.  The model has shapes only (torch's meta "
                    "device: no memory, no GPU).  Needs torch.")
    parser.add_argument("--tp", type=int, default=8, choices=(1, 2, 4, 8),
                        help="tensor-parallel size: the model is one shard of this many "
                             "(default 8)")
    parser.add_argument("--shapes", metavar="FILE.json",
                        help="a JSON object of model dimensions to change: "
                             + ", ".join(DEFAULT_DIMS))
    parser.add_argument("--hidden", type=int, metavar="N",
                        help=f"hidden size (default {DEFAULT_DIMS['hidden']})")
    parser.add_argument("--layers", type=int, metavar="N",
                        help=f"decoder layers (default {DEFAULT_DIMS['layers']})")
    parser.add_argument("--l2-mib", type=_l2_mib, default=60.0, metavar="MIB",
                        help="L2 size for the share-of-L2 column (default 60, an H200's)")
    parser.add_argument("--json", action="store_true",
                        help="print the plan as JSON, weights named by module path, instead "
                             "of tables")
    parser.add_argument("--next-attention-mib", type=_mib_cap, metavar="MIB",
                        help="prefetch up to MIB of the next layer's attention weights at "
                             "batches 1-8 (default 0: it did not pay on the H200)")
    parser.add_argument("--all-points", action="store_true",
                        help="plan at every point of the Kimi policy (oproj_down, "
                             "attention_moe, next_attention), also those that made the H200 "
                             "slower (default: kimi_k3.DEFAULT_POINTS)")
    parser.add_argument("--seed-points", action="store_true", dest="all_points",
                        help=argparse.SUPPRESS)  # the old name of --all-points
    parser.set_defaults(func=_run_plan)


def _load_shapes(path: str) -> dict[str, Any]:
    from ._files import loads_json, read_text

    try:
        loaded = loads_json(read_text(path, "--shapes file"), f"--shapes {path}")
    except RecursionError:
        raise UsageError(f"--shapes {path}: JSON nested too deeply for a dimensions object") \
            from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--shapes {path} is not JSON ({exc}): it must hold a JSON object "
                         "of dimensions") from None
    except (OSError, ValueError) as exc:  # ValueError: not a regular file, not UTF-8, a key twice
        raise UsageError(str(exc)) from None
    if not isinstance(loaded, dict):
        raise UsageError(f"{path} must hold a JSON object of dimensions, "
                         f"not a {type(loaded).__name__}")
    return loaded


def _run_plan(args: argparse.Namespace) -> int:
    try:
        _import_torch("python -m l2prefetch plan")
    except ModuleNotFoundError:
        raise UsageError(_torch.MISSING) from None
    dims: dict[str, Any] = _load_shapes(args.shapes) if args.shapes else {}
    for key in ("hidden", "layers"):
        if getattr(args, key) is not None:
            dims[key] = getattr(args, key)
    try:
        model, layers, packed = build_synthetic_kimi(dims, args.tp)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None

    from .plan import format_plan, plan_to_json

    caps = None
    if args.next_attention_mib is not None:
        caps = {args.tp: {batch: args.next_attention_mib for batch in range(1, 9)}}
    try:
        entries = kimi_k3.plan(layers, packed, args.tp, caps,
                               points=kimi_k3.POINTS if args.all_points else None)
    except (TypeError, ValueError, OverflowError) as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(plan_to_json(entries, model))
        return 0
    d = {**DEFAULT_DIMS, **dims}
    moe = sum(1 for layer in layers if layer.is_moe_layer)
    print(f"Kimi K3 plan, synthetic model on meta: {d['layers']} layers ({moe} MoE), KDA:MLA "
          f"{d['mla_every'] - 1}:1, hidden {d['hidden']}, {d['dtype']}, TP {args.tp}\n")
    if not entries:
        print(textwrap.fill(
            "No entries: by default the Kimi plan prefetches nothing (kimi_k3.DEFAULT_POINTS "
            "and NEXT_ATTENTION, as measured on the H200: benchmarks/RESULTS.md).  "
            "--all-points and --next-attention-mib MIB add entries.", width=88))
        return 0
    print(format_plan(entries, l2_bytes=int(args.l2_mib * MIB)), end="")
    return 0
