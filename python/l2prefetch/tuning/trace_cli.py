"""``python -m l2prefetch trace``: where the prefetch loads ran inside the captured decode step.

    python -m l2prefetch trace MODEL [--set KEY=VALUE ...] [--batch 1]
        (--profile PROFILE.json | --role NAME [--cap-mib 24] [--mode inline|branch|leaf]
                                              [--grid 32] [--kernel NAME])
        [--replays 5] [--out TRACE.md] [--plot TRACE.png] [--dot GRAPH.dot]

MODEL is what ``tune`` takes (a checkpoint directory, a config.json, a config
class name or a model type, with ``--set`` overrides).  The forks are a
profile written by ``tune`` or one role of the model (``tune MODEL
--list-roles`` names them) with its settings.  Writes a Markdown timeline per
fork (:mod:`l2prefetch.tuning.trace`) to ``--out`` (default stdout).  Exit
status: 0 traced, 2 a bad option, model, profile, role or output, or no GPU
(one line on stderr), 1 when CUDA fails or the step cannot be captured.  The
options, the profile as a file (``parse_profile``) and every output (``_files``,
as ``tune``'s: no directory, no output naming the profile or another output) are
checked before torch is asked for a GPU; the profile's fit to the model and the
GPU once the model is built, before anything is captured.  Outputs are written
atomically, replacing a link rather than writing through it.  Importing this
module and ``--help`` need no torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

from .. import _C, hooks
from .._files import check_outputs, files_named, read_text, write_atomic
from ..mechanisms import DEFAULT_GRAPH_FORK, GRAPH_FORKS
from ..profile import (describe_step, load_profile, parse_profile, profile_batches,
                       profile_step, step_compiled)
from . import hf
from .discovery import candidates, discover
from .errors import StepError

__all__ = ["add_parser", "run"]

HELP = "show where the prefetch loads ran inside the captured decode step (a Markdown timeline)"
MIB = 1 << 20


def _int(what: str, low: int, high: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an int, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} must be in {low}..{high}, got {value}")
        return value
    return parse


def _mib(what: str) -> Any:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number of MiB, got "
                                             f"{text!r}") from None
        if not 0 <= value <= 2**20:
            raise argparse.ArgumentTypeError(f"{what} must be in 0..{2**20} MiB, got {text}")
        return value
    return parse


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``trace`` to an argparse subparsers object; its func is :func:`run`."""
    parser = subparsers.add_parser("trace", help=HELP, description=__doc__.split("\n\n")[0],
                                   allow_abbrev=False)
    parser.add_argument("model", help="a local checkpoint directory, a config.json, a config "
                        "class name (LlamaConfig) or a model type (llama)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="a config field, e.g. num_hidden_layers=8 "
                        "(repeatable; values are read as JSON where they parse)")
    parser.add_argument("--device", default="cuda", help="where to build the model (default "
                        "cuda; trace needs a CUDA GPU)")
    parser.add_argument("--dtype", default="bfloat16", help="weight dtype for random weights "
                        "(default bfloat16)")
    parser.add_argument("--seed", type=_int("--seed", 0, hf.MAX_SEED), default=0,
                        help="random-weight seed (default 0)")
    parser.add_argument("--batch", type=_int("--batch", 1, 65535), default=None,
                        help="the decode batch (default: the first the profile forks at, else 1)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--profile", "--plan", dest="profile", metavar="PROFILE.json",
                      help="trace the forks of this profile (as `tune` writes it)")
    what.add_argument("--role", metavar="NAME",
                      help="trace one role of the model (`tune MODEL --list-roles` lists them)")
    parser.add_argument("--cap-mib", type=_mib("--cap-mib"), default=None,
                        help="with --role: MiB each fork loads (default 24; 0: all it reads)")
    parser.add_argument("--mode", choices=GRAPH_FORKS, default=None,
                        help=f"with --role: how forks go into the graph (default "
                        f"{DEFAULT_GRAPH_FORK})")
    parser.add_argument("--grid", type=_int("--grid", 1, 65535), default=None,
                        help="with --role: loader CTAs (default 32)")
    parser.add_argument("--kernel", default=None,
                        help="with --role: the loader variant (default: the device's)")
    parser.add_argument("--replays", type=_int("--replays", 1, 1000), default=5,
                        help="profiled replays of each graph; times are their medians "
                        "(default 5)")
    parser.add_argument("--out", default=None, help="the Markdown timeline (default stdout)")
    parser.add_argument("--plot", default=None,
                        help="also a PNG, one Gantt row per stream (needs matplotlib)")
    parser.add_argument("--dot", default=None, help="also the loads graph's nodes and edges "
                        "(cuGraphDebugDotPrint) in this file")
    parser.add_argument("--min-bytes-mib", type=_mib("--min-bytes-mib"), default=None,
                        help="with --role: smallest weight read that counts (MiB, default 1)")
    parser.add_argument("--prompt-len", type=_int("--prompt-len", 1, 1 << 20), default=8,
                        help="prompt tokens in the cache before the step (default 8)")
    parser.add_argument("--max-cache-len", type=_int("--max-cache-len", 2, 1 << 20),
                        default=64, help="StaticCache length (default 64)")
    parser.set_defaults(func=run)
    return parser


class _Bad(Exception):
    """A bad input: one line on stderr, exit status 2."""


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _check_profile(args: argparse.Namespace) -> None:
    """The profile as a file, read through ``_files`` and checked by ``parse_profile``
    (not yet against the model or the GPU), and the batch it forks at."""
    given = [f"--{o.replace('_', '-')}" for o in ("cap_mib", "mode", "grid", "kernel",
                                                    "min_bytes_mib")
             if getattr(args, o) is not None]
    if given:
        raise _Bad(f"{', '.join(given)} set with --profile: a profile's entries carry "
                   "their own settings (use --role to choose them)")
    try:
        data = parse_profile(read_text(args.profile, "profile"), args.profile)
    except FileNotFoundError:
        raise _Bad(f"--profile {args.profile}: no such file (write one with `python -m "
                   "l2prefetch tune MODEL --out PROFILE.json`)") from None
    except (OSError, ValueError) as exc:   # a directory, a FIFO, not a profile
        raise _Bad(f"--profile: {exc}") from None
    _check_profile_data(args, data)


def _check_profile_data(args: argparse.Namespace, data: dict) -> None:
    """A read profile's step (eager) and batches (``args.batch`` among them, the first
    forked one if not given): for the first read, and again for the second, which
    another writer may have replaced meanwhile."""
    step = profile_step(data)
    if step_compiled(step):
        raise _Bad(f"--profile {args.profile} was tuned on the {describe_step(step)} step; "
                   "trace captures the step eagerly, where its forks are not the ones "
                   "measured (tracing a compiled step is not supported): its tune report "
                   "has what each fork gained")
    _, forked = profile_batches(data)
    if not forked:
        raise _Bad(f"--profile {args.profile}: its plan is empty, so nothing forks (the "
                   "tuner found no prefetch that pays); trace a role with --role")
    if args.batch is None:   # the first batch it forks at (an empty plan at batch 1 is common)
        args.batch, args.batch_of_profile = forked[0], True
    if args.batch not in forked:
        given = ("the batch it forked at first" if getattr(args, "batch_of_profile", False)
                 else "--batch")
        raise _Bad(f"{given} {args.batch}: the profile forks at batches {forked} only")


def _check(args: argparse.Namespace) -> None:
    """Everything that can be checked before torch sees the GPU: the options, the
    profile as a file and every output (as ``tune`` checks its own, by ``_files``)."""
    if not str(args.device).startswith("cuda"):
        raise _Bad(f"trace needs a CUDA GPU: --device must be a CUDA device, got "
                   f"{args.device!r}")
    if args.profile is not None:
        _check_profile(args)
    if args.kernel is not None:
        if args.kernel not in _C.kernel_variants():
            raise _Bad(f"--kernel {args.kernel!r} is not a loader variant; known: "
                       f"{', '.join(sorted(_C.kernel_variants()))}")
    outputs = [(f"--{o}", getattr(args, o)) for o in ("out", "plot", "dot")
               if getattr(args, o) is not None]
    try:
        check_outputs(outputs, ([("--profile", args.profile)] if args.profile else [])
                      + files_named(args.model, "the model"))
    except (OSError, ValueError) as exc:
        raise _Bad(exc) from None
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise _Bad("--plot needs matplotlib, which is not installed: pip install matplotlib "
                   "(or leave out --plot)")


def _forks(args: argparse.Namespace, model: Any, step: Any, trace: Any) -> tuple[Any, int, str]:
    """(forks, batch, what is traced) from --profile or --role."""
    if args.profile is not None:
        # _check read the file and its batches; here its fit to the model and the GPU.
        try:
            profile = load_profile(args.profile, model)
        except (ValueError, OSError) as exc:
            raise _Bad(f"--profile: {exc}") from None
        try:   # the file may have been replaced since _check read it
            _check_profile_data(args, profile.data)
        except _Bad as exc:
            raise _Bad(f"--profile {args.profile} changed since trace first read it: "
                       f"{exc}") from None
        return trace.forks_of_profile(model, profile), args.batch, f"profile {args.profile}"
    batch = args.batch if args.batch is not None else 1
    try:
        reads = discover(model, lambda: step(batch),
                         min_bytes=max(1, int((args.min_bytes_mib or 1.0) * MIB)))
    except ValueError as exc:
        raise _Bad(str(exc)) from None
    roles = {role.name: role for role in candidates(model, reads)}
    role = roles.get(args.role)
    if role is None:
        raise _Bad(f"--role {args.role!r} is not a role of this model; its roles: "
                   + "; ".join(repr(name) for name in roles))
    mode = args.mode or DEFAULT_GRAPH_FORK
    cap = 24.0 if args.cap_mib is None else args.cap_mib
    try:   # the eager step's forks as tune() measures them: warm_activation
        forks = trace.forks_of_role(model, role, batch, byte_cap=int(cap * MIB),
                                    grid=args.grid or 32, kernel=args.kernel, mode=mode,
                                    warm_activation=True)
    except (ValueError, TypeError) as exc:
        raise _Bad(exc) from None
    return (forks, batch,
            f"role '{role.name}', {cap:g} MiB, grid {args.grid or 32}, {mode}, warm activation")


def run(args: argparse.Namespace) -> int:
    """Run ``trace`` with parsed arguments; returns the exit status."""
    try:
        return _run(args)
    except _Bad as exc:
        print(f"l2prefetch trace: {_one_line(exc)}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    _check(args)
    try:
        import torch
    except ImportError:
        raise _Bad(hf.NO_TORCH) from None
    from . import trace   # here: the parser (and --help) loads none of the trace modules

    try:   # the options that name the model, before the GPU is asked for
        overrides = hf.model_options(args.dtype, args.overrides)
    except ValueError as exc:
        raise _Bad(str(exc)) from None
    if args.max_cache_len <= args.prompt_len:
        raise _Bad(f"--max-cache-len ({args.max_cache_len}) must exceed --prompt-len "
                   f"({args.prompt_len}): the decode steps write after the prompt")
    if hooks.disabled():
        raise _Bad("L2PREFETCH_DISABLE is set, so nothing forks: unset it to trace")
    if not torch.cuda.is_available():
        raise _Bad(f"trace needs a CUDA GPU, and torch {torch.__version__} sees none")
    try:
        model = hf.load_model(args.model, overrides=overrides,
                              device=args.device, dtype=args.dtype, seed=args.seed)
        step = hf.DecodeStep(model, prompt_len=args.prompt_len,
                             max_cache_len=args.max_cache_len, seed=args.seed)
    except ImportError as exc:
        raise _Bad(exc) from None
    except (ValueError, TypeError, OSError) as exc:
        raise _Bad(f"cannot build {args.model!r}: {exc}") from None
    forks, batch, what = _forks(args, model, step, trace)
    try:
        result = trace.trace(model, step, batch, forks, replays=args.replays, dot=args.dot,
                             title=f"{type(model).__name__}, batch {batch}, {what}")
    except (StepError, trace.TraceError, _C.Error, OSError) as exc:
        print(f"l2prefetch trace: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as exc:  # settings the controller refused (a kernel name)
        raise _Bad(exc) from None
    props = torch.cuda.get_device_properties(next(model.parameters()).device)
    result.notes.insert(0, f"{props.name}, torch {torch.__version__}; {len(result.forks)} "
                        "loader kernels in the step.")
    text = result.markdown()
    try:   # checked before the trace; what changed since is exit status 1
        if args.out is None:
            sys.stdout.write(text)
        else:
            write_atomic(args.out, text, "--out")
            print(f"trace: {args.out}")
        if args.plot is not None:
            result.plot(args.plot)
            print(f"plot: {args.plot}")
    except (OSError, ValueError) as exc:
        print(f"l2prefetch trace: traced, but the outputs could not be written: "
              f"{_one_line(exc)}", file=sys.stderr)
        return 1
    return 0
