"""``python -m l2prefetch tune``: tune a Hugging Face causal LM on this GPU, write its profile.

    python -m l2prefetch tune MODEL [--set KEY=VALUE ...] [--batches 1,8] [--budget 300]
                                    [--out PROFILE.json] [--report REPORT.md] [--plot PLOT.png]

MODEL is a local checkpoint directory, a config.json, a config class name
(LlamaConfig) or a model type (llama); the last three get random weights.
``--list-roles`` only discovers the candidate roles (works on the CPU with
``--device cpu``); every option is checked in either mode, before anything is
built (a ``--roles`` name against the roles, once discovered).  Exit status: 0
when tuning finished (an empty plan is a result), 2 for a bad option, ``--set``,
model, checkpoint or output, or no GPU (one line on stderr, checked before
anything is built or measured), 1 when the step fails or cannot be captured.
Options cannot be abbreviated.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import sys
import time
from typing import Any, Optional

from .. import _C
from .._files import check_outputs, files_named, write_atomic
from .._parser import Parser as _Parser  # usage errors as one line, exit status 2
from ..mechanisms import GRAPH_FORKS
from ..plan import MAX_BATCH, MIN_BYTE_CAP
from . import hf, tuner
from .compiled import compile_mode
from .discovery import describe_roles, discovery_step, find_roles, role_hints
from .errors import StepError
from .measure import MAX_ROUNDS, MIN_ROUNDS, ROUNDS_TARGET_US
from .search import DEFAULT_RESOLUTION, MAX_INSTANCES

__all__ = ["add_parser", "main", "run"]

HELP = "measure which prefetches pay for a Hugging Face model on this GPU; write a profile"
#: --out's default (a --list-roles run checks only the outputs given: it writes none).
DEFAULT_OUT = "l2prefetch-profile.json"


def _list(text: str, what: str, kind: type = int, low: float = 0,
          high: float = 2**40) -> list:
    """A comma-separated list of ``kind`` values > 0, at least ``low`` and at most
    ``high``, or an argparse error naming ``what``."""
    noun = "integers" if kind is int else "numbers"
    if text.strip() and any(not x.strip() for x in text.split(",")):
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated {noun} with none "
                                         f"empty, got {text!r}")
    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated {noun}, got "
                                         f"{text!r}") from None
    if not values or not all(0 < v < 2**40 for v in values):
        raise argparse.ArgumentTypeError(f"{what} must be {noun} > 0, got {text!r}")
    if low and not all(v >= low for v in values):
        raise argparse.ArgumentTypeError(f"{what} must be {noun} >= {low:.3g}, got {text!r}")
    if not all(v <= high for v in values):
        raise argparse.ArgumentTypeError(f"{what} must be {noun} <= {high:g}, got {text!r}")
    return values


def positive(kind: type, what: str, low: float = 0.0, high: float = 1e9, *,
             at_least: bool = False) -> Any:
    """An argparse type: ``kind`` in (low, high], or [low, high] where ``at_least``."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{what} must be {'a whole number' if kind is int else 'a number'}, got "
                f"{text!r}") from None
        if not (low <= value if at_least else low < value) or not value <= high:
            bounds = (f"{int(low) + (0 if at_least else 1)}..{int(high)}" if kind is int
                      else f"{'[' if at_least else '('}{low:g}, {high:g}]")
            raise argparse.ArgumentTypeError(f"{what} must be in {bounds}, got {text}")
        return value
    return parse


def _names(text: str, what: str, known: Any, default: Optional[str] = None) -> str:
    """``text``, comma-separated names each in ``known`` (or ``default``), none empty; or
    an argparse error naming ``what`` and the choices.  Returns ``text`` itself."""
    names = [x.strip() for x in text.split(",")]
    choices = ", ".join(([default] if default else []) + list(known))
    if not all(names):
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated names of {choices}, "
                                         f"none empty, got {text!r}")
    bad = [n for n in names if n not in known and n != default]
    if bad:
        raise argparse.ArgumentTypeError(f"{what}: unknown {', '.join(map(repr, bad))}; the "
                                         f"choices are {choices}")
    return text


def _kernel_names(text: str) -> str:
    return _names(text, "--kernels", sorted(_C.kernel_variants()), default="default")


#: How a discovered role is named (tuning.discovery): its site, then its consumer.
ROLE_NAME = re.compile(r"(after|before) \S[^:]*: \S.*")


def _role_name(text: str) -> str:
    if not ROLE_NAME.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(
            f"--roles {text!r} is not a role name: a role is 'after SITE: CONSUMER' or "
            "'before SITE: CONSUMER', as --list-roles prints them")
    return text.strip()


#: What --list-roles' "largest load" column counts (the line under its table).
LARGEST_LOAD = ("\nlargest load: the most one fork of the role can load: its consumer's weights "
                "and those of the reads after it, at most the largest cap, {max_mib:g} MiB "
                "(--caps-mib)")


def compile_forward(model: Any, mode: str) -> None:
    """``model.forward = torch.compile(model.forward, mode=...)``: what --compile does."""
    import torch

    model.forward = torch.compile(model.forward, mode=None if mode == "default" else mode)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a local checkpoint directory, a config.json, a config "
                        "class name (LlamaConfig) or a model type (llama)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="a config field, e.g. num_hidden_layers=8 "
                        "(repeatable; values are read as JSON where they parse)")
    parser.add_argument("--batches", type=lambda t: _list(t, "--batches", high=MAX_BATCH),
                        default=[1, 8],
                        help="decode batches to tune, comma-separated (default 1,8)")
    parser.add_argument("--budget", type=positive(float, "--budget", 0, 86400), default=300.0,
                        help="seconds of measuring, all batches together (default 300)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="the profile to write (default l2prefetch-profile.json)")
    parser.add_argument("--report", default=None,
                        help="the Markdown report (default: the profile's name with .md)")
    parser.add_argument("--plot", default=None,
                        help="a PNG of the gains (needs matplotlib; default: none)")
    parser.add_argument("--device", default="cuda", help="where to build the model (default cuda)")
    parser.add_argument("--dtype", default="bfloat16", help="weight dtype for random weights "
                        "(default bfloat16)")
    parser.add_argument("--seed", type=positive(int, "--seed", -1, hf.MAX_SEED), default=0,
                        help="random-weight seed (default 0)")
    parser.add_argument("--roles", action="append", default=None, metavar="NAME",
                        type=_role_name,
                        help="measure only this role (repeatable; see --list-roles)")
    parser.add_argument("--list-roles", action="store_true",
                        help="only discover and list the candidate roles (no measuring; "
                        "every other option is still checked)")
    parser.add_argument("--instances", type=positive(int, "--instances", 4, 1000), default=5,
                        help="graph instances per variant (>= 5, default 5)")
    parser.add_argument("--max-instances", type=positive(int, "--max-instances", 4, 1000),
                        default=None, help="the most instances per variant a close decision "
                        f"gets (default {MAX_INSTANCES}, at least --instances; a group's "
                        "lead, for --resolution alone, up to twice that)")
    parser.add_argument("--resolution", type=positive(float, "--resolution", 0, 0.5),
                        default=DEFAULT_RESOLUTION, help="95%% half-width, as a share of the "
                        "step, that each group's leading candidate is sampled down to (default "
                        f"{DEFAULT_RESOLUTION:g}, {DEFAULT_RESOLUTION * 100:g}%%)")
    parser.add_argument("--rounds", type=positive(int, "--rounds", 0, 100000),
                        default=None, help="replays of each graph instance per measuring "
                        f"group (default: about {ROUNDS_TARGET_US / 1000:g} ms of the step, "
                        f"{MIN_ROUNDS}-{MAX_ROUNDS})")
    parser.add_argument("--caps-mib", type=lambda t: _list(t, "--caps-mib", float,
                                                           MIN_BYTE_CAP / (1 << 20)),
                        default=[4, 8, 16, 24, 32, 48],
                        help="byte caps to try, in MiB (each at least 16 bytes)")
    parser.add_argument("--grids", type=lambda t: _list(t, "--grids", high=65535),
                        default=[16, 32, 64],
                        help="loader CTA counts to try (default 16,32,64): the sweep runs "
                        "at a role's default (32), the others for promising roles where "
                        "the budget leaves room (the report names those it did not)")
    parser.add_argument("--kernels", default=None, type=_kernel_names,
                        help="kernel variants to try, comma-separated; 'default' is the "
                        "device's (default: the device's, then the other loaders it supports)")
    parser.add_argument("--graph-forks", default=",".join(GRAPH_FORKS),
                        type=lambda t: _names(t, "--graph-forks", GRAPH_FORKS),
                        help=f"how forks go into the graph, comma-separated: any of "
                        f"{', '.join(GRAPH_FORKS)} (default: every one)")
    parser.add_argument("--min-gain-us",
                        type=positive(float, "--min-gain-us", 0, 1e6, at_least=True),
                        default=1.0, help="skip roles whose loads could gain less (us per step)")
    parser.add_argument("--min-bytes-mib", type=positive(float, "--min-bytes-mib", 0, 2**20),
                        default=1.0, help="smallest weight read that counts (MiB, default 1)")
    parser.add_argument("--prompt-len", type=positive(int, "--prompt-len", 0, 1 << 20),
                        default=8, help="prompt tokens in the cache before the step (default 8)")
    parser.add_argument("--max-cache-len", type=positive(int, "--max-cache-len", 1, 1 << 20),
                        default=64, help="StaticCache length (default 64)")
    parser.add_argument("--compile", nargs="?", const="default", default=None,
                        type=compile_mode, metavar="MODE",
                        help="tune the step as vLLM and SGLang run it: the model's forward "
                             "compiled with torch.compile (Inductor; MODE default or "
                             "max-autotune-no-cudagraphs, default: default) and captured in "
                             "CUDA graphs by the tuner; the profile then applies to compiled "
                             "steps only (without --compile: eager steps only)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``tune`` to an argparse subparsers object; its func is :func:`run`."""
    parser = subparsers.add_parser("tune", help=HELP, description=__doc__.split("\n\n")[0],
                                   allow_abbrev=False)
    configure(parser)
    parser.set_defaults(func=run)
    return parser


@dataclasses.dataclass(frozen=True)
class _Options:
    """What ``tune``'s options mean, parsed once from them (nothing checked here): the
    report's path, the outputs to check, and the tuner's lists."""

    report: str
    #: ``(option, path)`` of each output to check before anything is built (a
    #: --list-roles run: only those named on the command line; it writes none).
    outputs: list
    kernels: Optional[list]
    graph_forks: list
    min_bytes: int


def _options(args: argparse.Namespace) -> _Options:
    report = args.report or os.path.splitext(args.out)[0] + ".md"
    outputs = [("--out", args.out),
               ("--report" if args.report else "the report (--report)", report)]
    if args.list_roles:
        outputs = [(option, path) for option, path in outputs
                   if (option == "--out" and path != DEFAULT_OUT) or option == "--report"]
    if args.plot:
        outputs.append(("--plot", args.plot))
    kernels = None if args.kernels is None else [
        None if k.strip() in ("default", "") else k.strip() for k in args.kernels.split(",")]
    return _Options(report=report, outputs=outputs, kernels=kernels,
                    graph_forks=[g.strip() for g in args.graph_forks.split(",") if g.strip()],
                    min_bytes=max(1, int(args.min_bytes_mib * (1 << 20))))


class _Exit(Exception):
    """Ends ``tune``: one line on stderr, and the exit status (2: a bad input, 1: the
    model or the step failed, or the outputs could not be written)."""

    def __init__(self, message: object, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def run(args: argparse.Namespace) -> int:
    """Run ``tune`` with parsed arguments; returns the exit status."""
    try:
        return _run(args)
    except _Exit as exc:
        print(f"l2prefetch tune: {exc}", file=sys.stderr)
        return exc.status


def _run(args: argparse.Namespace) -> int:
    """The steps of ``tune``: every option checked, the model built, then either its roles
    listed or the step tuned and the outputs written."""
    try:
        import torch
    except ImportError:
        raise _Exit(hf.NO_TORCH) from None
    progress = None if args.quiet else sys.stderr
    options = _options(args)
    model, step = _build(args, options, torch, progress)
    if args.compile is not None:
        _compile(args, model, step, progress)
    if args.list_roles:
        return _list_roles(args, options, model, step, torch, progress)
    result = _tune(args, options, model, step, progress)
    return _write(args, options, result, model)


def _check(args: argparse.Namespace, options: _Options, torch: Any) -> tuple[Any, dict]:
    """Every option, before anything is built: those tune's command alone reads, then the
    outputs (_files), --max-instances (the tuner's) and the model's options (hf).  The
    device to build on and the parsed --set."""
    for option, values, noun in (("--batches", args.batches, "batch"),
                                 ("--caps-mib", args.caps_mib, "cap"),
                                 ("--grids", args.grids, "grid"),
                                 ("--kernels", options.kernels or (), "kernel"),
                                 ("--graph-forks", options.graph_forks, "mode"),
                                 ("--roles", args.roles or (), "role")):
        _once(option, list(values), noun)
    if args.max_cache_len <= args.prompt_len:
        raise _Exit(f"--max-cache-len ({args.max_cache_len}) must exceed --prompt-len "
                    f"({args.prompt_len}): the decode steps write after the prompt")
    if not args.list_roles and _C.env_flag("L2PREFETCH_DISABLE"):
        raise _Exit("L2PREFETCH_DISABLE is set, so nothing forks: unset it to tune")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise _Exit("--plot needs matplotlib, which is not installed: pip install matplotlib "
                    "(or leave out --plot)")
    model_files = files_named(args.model, "the model")
    try:   # the profile, the report and the plot can be written, are three files, and
        # none is a file of the model's (its config.json, a checkpoint's weights)
        check_outputs(options.outputs, model_files)
    except (OSError, ValueError) as exc:
        raise _Exit(exc) from None
    try:
        tuner.check_max_instances(args.instances, args.max_instances, options=True)
    except ValueError as exc:
        raise _Exit(exc) from None
    try:
        overrides = hf.model_options(args.dtype, args.overrides)
    except ValueError as exc:
        raise _Exit(str(exc)) from None
    try:
        device = hf.parse_device(args.device)
        if not args.list_roles and device.type != "cuda":
            raise _Exit(f"tuning measures CUDA graphs: --device must be a CUDA device, got "
                        f"{args.device!r} (--list-roles works on the CPU)")
        if not args.list_roles and not torch.cuda.is_available():
            raise _Exit(f"tuning needs a CUDA GPU, and torch {torch.__version__} sees none "
                        "(--list-roles --device cpu discovers roles without one)")
        device = hf.device_of(device)   # against the GPUs torch sees
    except ValueError as exc:
        raise _Exit(f"--device: {exc}") from None
    return device, overrides


def _once(option: str, values: list, noun: str) -> None:
    """Each of an option's values given once: a repeat would measure the same arm twice."""
    twice = sorted({v for v in values if values.count(v) > 1}, key=str)
    if twice:
        shown = ", ".join(map(str if noun in ("batch", "cap", "grid") else repr,
                              ["default" if v is None else v for v in twice]))
        raise _Exit(f"{option} names {shown} more than once: give each {noun} once")


def _build(args: argparse.Namespace, options: _Options, torch: Any,
           progress: Any) -> tuple[Any, Any]:
    """Every option checked (:func:`_check`), then the model and its decode step built."""
    device, overrides = _check(args, options, torch)
    try:
        model = hf.load_model(args.model, overrides=overrides, device=device,
                              dtype=args.dtype, seed=args.seed, progress=progress)
        step = hf.DecodeStep(model, prompt_len=args.prompt_len, max_cache_len=args.max_cache_len,
                             seed=args.seed)
    except ImportError as exc:
        raise _Exit(exc) from None
    except hf.OverrideError as exc:
        raise _Exit(exc.option) from None
    except (ValueError, TypeError, OSError) as exc:
        raise _Exit(f"cannot build {args.model!r}: {exc}") from None
    except torch.OutOfMemoryError as exc:
        raise _Exit(f"building {args.model!r} ran out of memory: {hf.error_line(exc)}",
                    1) from None
    return model, step


def _compile(args: argparse.Namespace, model: Any, step: Any, progress: Any) -> None:
    """--compile: each batch's prompt run eagerly, then the model's forward compiled."""
    try:
        for batch in args.batches:   # the prompts run eagerly: no compile of a prefill
            step.state(batch)
    except Exception as exc:  # noqa: BLE001 - the model's own failure, named
        raise _Exit(f"the prompt at batch {batch} failed: {hf.error_line(exc)}", 1) from None
    compile_forward(model, args.compile)
    if progress is not None:
        print(f"[l2prefetch tune] the model's forward compiled with torch.compile "
              f"(Inductor, mode {args.compile}); the first step of each batch compiles it",
              file=progress, flush=True)


def _list_roles(args: argparse.Namespace, options: _Options, model: Any, step: Any, torch: Any,
                progress: Any) -> int:
    """--list-roles: discover the roles from one step at the first batch and print them."""
    batch = args.batches[0]
    if progress is not None:
        print(f"[l2prefetch tune] discovering the roles: the prompt, then one decode step "
              f"at batch {batch}", file=progress, flush=True)
    first_step = discovery_step(step, batch)
    try:
        if args.compile is not None:
            # the compiled step runs (Inductor's CPU backend without a GPU); discovery
            # then reads the eager module tree: the same modules and weights
            t0 = time.monotonic()
            with torch.no_grad():
                first_step()
            if progress is not None:
                print(f"[l2prefetch tune] the compiled step ran at batch "
                      f"{batch} in {time.monotonic() - t0:.1f} s, compilation "
                      f"included; the roles come from the eager module tree, so they are "
                      f"the eager step's (which sites' forks change Inductor's kernels is "
                      f"screened when tune measures, on a GPU)",
                      file=progress, flush=True)
        roles = find_roles(model, first_step, min_bytes=options.min_bytes)
    except StepError as exc:
        raise _Exit(exc, 1) from None
    except ValueError as exc:
        raise _Exit(exc) from None
    largest = max(args.caps_mib)
    table = describe_roles(roles, cap=int(largest * (1 << 20)))   # printed once --roles holds
    names = [role.name for role in roles]
    unknown = [name for name in args.roles or () if name not in names]
    if unknown:
        raise _Exit(f"--roles: this model has no role {role_hints(unknown, names)}; "
                    "--list-roles without --roles lists its roles")
    print(table, end="")
    print(LARGEST_LOAD.format(max_mib=largest))
    return 0


def _tune(args: argparse.Namespace, options: _Options, model: Any, step: Any,
          progress: Any) -> Any:
    """tune() with the options; its refusals are exit status 2, a failing step 1."""
    try:
        return tuner.tune(model, step, args.batches, candidates=args.roles,
                          budget_s=args.budget, instances=args.instances,
                          max_instances=args.max_instances, resolution=args.resolution,
                          rounds=args.rounds, caps_mib=args.caps_mib, grids=args.grids,
                          kernels=options.kernels, graph_forks=options.graph_forks,
                          min_gain_us=args.min_gain_us, min_bytes=options.min_bytes,
                          progress=progress,
                          compiled=args.compile if args.compile is not None else False)
    except StepError as exc:
        raise _Exit(exc, 1) from None
    except (ValueError, TypeError) as exc:
        raise _Exit(exc) from None


def _write(args: argparse.Namespace, options: _Options, result: Any, model: Any) -> int:
    """The profile, the report and the plot; what was written, on stdout."""
    report = options.report
    try:
        result.save(args.out, model)
        write_atomic(report, result.markdown(), "the report")
        drawn = result.plot(args.plot) if args.plot else None
    except (OSError, ValueError) as exc:  # checked before measuring; changed since
        raise _Exit(f"tuned, but the outputs could not be written: {exc}", 1) from None
    lines = [result.summary(), f"profile: {args.out}", f"report: {report}"]
    if args.plot:
        lines.append(f"plot: {args.plot}" if drawn
                     else "plot: not drawn (matplotlib is not installed)")
    print("\n".join(lines))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m l2prefetch.tuning.cli``: the same as ``python -m l2prefetch tune``."""
    parser = _Parser(prog="l2prefetch tune", description=__doc__.split("\n\n")[0],
                     allow_abbrev=False)
    configure(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:   # as `python -m l2prefetch tune` ends: one line, 130
        print("l2prefetch tune: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
