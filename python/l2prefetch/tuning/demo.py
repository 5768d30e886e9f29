"""``python -m l2prefetch demo``: the whole flow on a small built-in model, about two minutes.

    python -m l2prefetch demo [--out DIR] [--budget S] [--compile [MODE]] [--spin-us US]
                              [--all-roles] [--set KEY=VALUE ...] [--quiet]

On a GPU it builds a small Hugging Face Llama (:data:`CONFIG`: 4 layers, hidden 2048,
16 query and 4 KV heads, vocab 8192, random bf16 weights) and tunes it at batch 1 twice,
``--budget`` seconds each: *plain*, the model as built, then *planted*, with a spin of
``--spin-us`` before every layer's ``post_attention_layernorm`` (one CTA waiting while
the rest of the GPU idles, as while an all-reduce waits).  The spin is the effectful
custom op ``l2prefetch_demo::spin`` (:func:`spin_op`, registered when the demo first
plants it): torch.compile keeps it where it drops a plain ``torch.cuda._sleep``.  Per
case it writes to ``--out`` the profile, the Markdown report and the plot of the gains,
and, where a plan was kept, the trace of where its loads ran (Markdown and a plot;
eager steps only: ``trace`` has no compiled mode), then prints per case the step's
time, the plan kept and its confirmed ratio with its 95% interval.

It measures the roles that load the MLP's first weight (``mlp.gate_proj``: the three
fork sites before it, one of them beside the spin), so that 40 s covers them;
``--all-roles`` measures every role the model has (give it ``--budget 300``).  Eager
by default: the compiled step (``--compile``) adds Inductor's compilations to each
case (the fork-site screen, and two per batch shape), which count in the budget, so
its default budget is :data:`COMPILED_BUDGET_S`.

Without a GPU, or without torch, transformers or NVRTC, it says what it would do and
what is missing (with the extra that brings it), then does what this machine can:
builds the model on the CPU and lists its roles (as ``tune --list-roles``), shows the
plan of the role beside the spin as a profile holds it, and compiles the loader kernel
for sm_90 with NVRTC; exit status 0.

Every option and every output is checked first, in either mode, before anything is
built: the outputs are files in ``--out`` (created if missing, on a GPU), checked by
:func:`l2prefetch._files.check_outputs` and written atomically.  Exit status: 0 done
(an empty plan is a result), 2 a bad option or output (one line on stderr), 1 when the
step or CUDA fails.  Importing this module, and ``--help``, need no torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from .. import _C
from ..disable import disabled
from .._torch import cuda_reason, driver_reason
from .._version import __version__
from .cli import compile_forward, positive
from .compiled import compile_mode
from .discovery import (DEFAULT_MAX_BYTES, MIB, candidates, describe_roles, discover,
                        discovery_step)
from .errors import StepError

__all__ = ["CASES", "CONFIG", "add_parser", "build_model", "gpu_reason", "make_config",
           "outputs", "plant", "run", "spin_op"]

logger = logging.getLogger(__name__)

HELP = ("the whole flow on a small built-in model, tuned with a planted spin and without "
        "(about two minutes on a GPU)")
#: The built-in model: a Llama small enough to build in seconds, large enough that each
#: layer streams more than an H200's L2 holds (96 MiB of bf16 weights a layer), so that
#: replays back to back leave no layer's weights hot.  ``--set`` changes any field.
CONFIG = {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4,
          "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 8192,
          "max_position_embeddings": 256}
BATCH = 1
DEFAULT_OUT = "l2prefetch-demo"
BUDGET_S = 40.0
#: The default budget of each case with --compile: compiling the step (the screen's two
#: compilations and the search's two per batch shape) counts in it.
COMPILED_BUDGET_S = 150.0
SPIN_US = 40.0
SPIN_OP = "l2prefetch_demo::spin"
#: The module before which the spin runs (its forward pre-hook), and the weight read
#: after it: the roles that load it are those the demo measures.
SPIN_SITE = "post_attention_layernorm"
CONSUMER = "mlp.gate_proj"
#: The role whose fork runs beside the spin, and the setting the CPU shows its plan at:
#: what paid before the norm on an H200 (benchmarks/RESULTS.md, run 22).
PLANTED_ROLE = f"before {SPIN_SITE}: {CONSUMER}"
PLAN_CAP = 24 * MIB
PLAN_FORK = "inline"
#: The loader kernel the CPU compiles: the default on sm_90 (H100, H200).
KERNEL, SM = "ring", 90
#: The two cases, in the order they run and are reported: the realistic answer first.
CASES = ("plain", "planted")
EMPTY_PLAIN = ("nothing paid: the realistic answer for a model without an idle window")


class _Bad(Exception):
    """A bad option or output: one line on stderr, exit status 2."""


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


# -- the parser ------------------------------------------------------------------------------

def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``demo`` to an argparse subparsers object; its func is :func:`run`."""
    parser = subparsers.add_parser(
        "demo", help=HELP, allow_abbrev=False,
        description="The whole flow on a small built-in model, in about two minutes on a "
                    "GPU: a 4-layer Llama (random bf16 weights) tuned at batch 1 as built, "
                    "then with a spin before each layer's MLP norm (an idle GPU, as while "
                    "an all-reduce waits).  Per case: its profile, report, plot of the "
                    "gains and, where a plan was kept, where its loads ran, in --out; then "
                    "per case the step's time, the plan kept and its confirmed ratio.  "
                    "Without a GPU (or torch, transformers, NVRTC): what it would do, then "
                    "the model's roles, a plan and the kernel compiled, on the CPU.",
        epilog="Exit status: 0 done (an empty plan is a result); 1 the step or CUDA failed; "
               "2 a bad option or output (one line on stderr).")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"where the files go (default ./{DEFAULT_OUT}/; created if "
                             "missing)")
    parser.add_argument("--budget", type=positive(float, "--budget", 0, 86400), default=None,
                        metavar="S", help=f"seconds of tuning per case (default {BUDGET_S:g}; "
                        f"with --compile {COMPILED_BUDGET_S:g}: compiling counts in it)")
    parser.add_argument("--compile", nargs="?", const="default", default=None,
                        type=compile_mode, metavar="MODE",
                        help="tune the step compiled by torch.compile (Inductor, MODE "
                             "default or max-autotune-no-cudagraphs), as vLLM and SGLang "
                             "run it; minutes more (default: the eager step)")
    parser.add_argument("--spin-us", type=positive(float, "--spin-us", 0, 1000),
                        default=SPIN_US, metavar="US",
                        help=f"microseconds of the planted spin before each MLP norm "
                             f"(default {SPIN_US:g})")
    parser.add_argument("--all-roles", action="store_true",
                        help=f"measure every role, not only those that load {CONSUMER} "
                             "(give it --budget 300)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="a field of the built-in model's LlamaConfig, e.g. "
                             "num_hidden_layers=8 (repeatable)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.set_defaults(func=run)
    return parser


# -- what this machine has -------------------------------------------------------------------

def _import_torch() -> Any:
    """torch, or None where it is not installed (without torch's warning that numpy is
    missing: the command's stderr is its errors and progress)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
        try:
            import torch
        except ModuleNotFoundError as exc:
            if exc.name != "torch":
                raise
            return None
    return torch


def gpu_reason(torch: Any) -> Optional[str]:
    """None where the demo can measure on a GPU here; else the whole reason why not, as
    ``info`` decides (``torch``: the module, or None where it is missing)."""
    reason = driver_reason()
    if reason is not None:
        return reason
    if torch is None:
        return "torch is not installed (measuring needs it)"
    return cuda_reason(torch)


def _nvrtc() -> tuple[Optional[dict], Optional[str]]:
    """(NVRTC's info, None), or (None, why it is not available)."""
    try:
        return _C.nvrtc_info(), None
    except (_C.CudaUnavailableError, _C.Error) as exc:
        return None, str(exc)


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# -- the model -------------------------------------------------------------------------------

def make_config(overrides: Optional[Mapping[str, Any]] = None) -> Any:
    """The built-in model's ``LlamaConfig``: :data:`CONFIG` with ``overrides`` (each a
    field of LlamaConfig with a value of its type, checked as ``tune --set`` checks
    them; :class:`~l2prefetch.tuning.hf.OverrideError` or ValueError otherwise)."""
    from . import hf

    tf = hf.import_transformers()
    return hf.make_config(tf, tf.LlamaConfig, CONFIG, dict(overrides or {}), None)


def _describe(config: Any) -> str:
    return (f"a Llama of {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"intermediate {config.intermediate_size}, {config.num_attention_heads} query "
            f"and {config.num_key_value_heads} KV heads, vocab {config.vocab_size}, random "
            "bf16 weights")


def _check_fits(config: Any, device: Any) -> None:
    """Refuse (ValueError) a model that, with what building and running it take, does not
    fit ``device`` (as ``tune`` refuses one: tuning.hf)."""
    import torch

    from . import hf

    model_cls = hf.import_transformers().LlamaForCausalLM
    count, nbytes = hf.model_bytes(model_cls, config, torch.bfloat16)
    hf.check_fits(f"the demo's model ({config.num_hidden_layers} layers, bf16)", count,
                   nbytes, torch.device(device), config.num_hidden_layers)


def build_model(config: Any, device: Any, seed: int = 0) -> Any:
    """The built-in model of ``config`` (:func:`make_config`) on ``device``, random bf16
    weights from ``seed``, in eval mode."""
    import torch

    from . import hf

    model_cls = hf.import_transformers().LlamaForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls._from_config(config, dtype=torch.bfloat16,
                                       attn_implementation="sdpa")
    return model.eval()


_spin_lock = threading.Lock()
_spin: Any = None


def spin_op() -> Any:
    """``l2prefetch_demo::spin(Tensor after, int cycles) -> ()``: one CTA waiting
    ``cycles`` clock cycles (``torch.cuda._sleep``) once ``after`` is made; a custom op
    marked ORDERED-effectful, so torch.compile keeps it.  Registered on the first call
    (by the demo only: importing this module registers nothing)."""
    global _spin
    with _spin_lock:
        if _spin is None:
            import torch

            from .. import ops   # imports torch: not at the demo's import (its --help)

            def spin(after: Any, cycles: int) -> None:
                torch.cuda._sleep(cycles)

            op = torch.library.custom_op(SPIN_OP, spin, mutates_args=(),
                                         schema="(Tensor after, int cycles) -> ()")
            op.register_fake(lambda after, cycles: None)
            ops.mark_ordered(op)
            _spin = op
    return _spin


def plant(model: Any, spin_us: float, device: Any = None) -> list:
    """A spin of ``spin_us`` before every layer's ``post_attention_layernorm`` (a forward
    pre-hook calling :func:`spin_op`); the hooks' handles, to remove them."""
    import torch

    from .rig import spin_cycles_per_us

    spin_op()
    cycles = int(spin_us * spin_cycles_per_us(device))
    return [getattr(layer, SPIN_SITE).register_forward_pre_hook(
        lambda module, args: torch.ops.l2prefetch_demo.spin(args[0], cycles))
        for layer in model.model.layers]


def _roles(model: Any, step: Any, where: str) -> list:
    """The model's candidate roles, from one decode step at BATCH."""
    t0 = time.monotonic()
    logger.info("one decode step on %s, to find the weights it reads and the roles", where)
    try:
        reads = discover(model, discovery_step(step, BATCH))
    except StepError as exc:   # a --set the config takes and the forward does not
        raise _Bad(f"--set: the model it builds fails its decode step: {exc}") from None
    roles = candidates(model, reads)
    logger.info("%d candidate roles in %.1f s", len(roles), time.monotonic() - t0)
    return roles


def _measured(roles: Sequence[Any], every: bool) -> list:
    """The roles the demo tunes: those that load CONSUMER (all with ``every``, or where
    none does)."""
    chosen = [role for role in roles if role.consumer == CONSUMER and not role.next_layer]
    return list(roles) if every or not chosen else chosen


# -- the outputs -----------------------------------------------------------------------------

def _tag(compiled: Optional[str]) -> str:
    return "eager" if compiled is None else "compiled"


def outputs(out: str, compiled: Optional[str]) -> dict[str, list[tuple[str, str]]]:
    """Per case, the files the demo writes in ``out``: (what, path) of the profile, the
    report, the plot of the gains and, for eager steps, the trace and its plot."""
    files = {}
    for case in CASES:
        stem = os.path.join(out, f"{case}-{_tag(compiled)}")
        named = [(f"the {case} profile", stem + ".json"), (f"the {case} report", stem + ".md"),
                 (f"the {case} plot", stem + ".png")]
        if compiled is None:
            named += [(f"the {case} trace", stem + "-trace.md"),
                      (f"the {case} trace plot", stem + "-trace.png")]
        files[case] = named
    return files


def _check_out(out: str, files: Mapping[str, list]) -> None:
    """--out and the files in it, before any work: --out must be a directory or be
    creatable as one; where it is one, each file must be writable (nothing in its way)."""
    from .._files import check_outputs

    if not out:
        raise _Bad("--out is empty: name a directory (created if missing), e.g. --out "
                   f"{DEFAULT_OUT}")
    if os.path.lexists(out) and not os.path.isdir(out):
        kind = "a link to nothing" if os.path.islink(out) else "a file"
        raise _Bad(f"--out {out} is {kind}, not a directory: name a directory (created if "
                   "missing)")
    if not os.path.isdir(out):
        parent = os.path.dirname(os.path.abspath(out))
        while not os.path.lexists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise _Bad(f"--out {out} cannot be created: {parent} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise _Bad(f"--out {out} cannot be created: {parent} is not writable")
        return
    try:
        check_outputs([pair for case in CASES for pair in files[case]])
    except (OSError, ValueError) as exc:
        raise _Bad(exc) from None


# -- the command -----------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    """Run ``demo`` with parsed arguments; returns the exit status."""
    handler = None
    if not args.quiet:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[l2prefetch demo] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    try:
        return _run(args)
    except _Bad as exc:
        print(f"l2prefetch demo: {_one_line(exc)}", file=sys.stderr)
        return 2
    finally:
        if handler is not None:
            logger.removeHandler(handler)
            logger.propagate = True


def _run(args: argparse.Namespace) -> int:
    from . import hf

    try:
        overrides = hf.parse_overrides(args.overrides)
    except ValueError as exc:
        raise _Bad(f"--set: {exc}") from None
    budget = args.budget if args.budget is not None else (
        BUDGET_S if args.compile is None else COMPILED_BUDGET_S)
    files = outputs(args.out, args.compile)
    _check_out(args.out, files)
    if disabled():   # nothing would fork, with a GPU or without one (README, Configuration)
        raise _Bad("L2PREFETCH_DISABLE is set, so nothing forks: unset it to run the demo")
    torch = _import_torch()
    config = None
    if torch is not None and _installed("transformers"):
        try:
            config = make_config(overrides)
        except hf.OverrideError as exc:
            raise _Bad(exc.option) from None
        except ValueError as exc:
            raise _Bad(f"--set: {exc}") from None
    missing = []
    reason = gpu_reason(torch)
    if reason is not None:
        missing.append(f"no GPU to measure on: {reason}")
    if torch is None:
        missing.append("torch is not installed: install torch 2.11-2.13 (README, Install)")
    if not _installed("transformers"):
        missing.append("transformers, which builds the model, is not installed: install "
                       "l2prefetch's 'tune' extra (README, Install)")
    nvrtc, no_nvrtc = _nvrtc()
    if nvrtc is None:
        missing.append(f"NVRTC, which compiles the loader kernel, is not available (pip "
                       f"install 'nvidia-cuda-nvrtc>=13,<14'): {no_nvrtc}")
    if config is not None:   # the model must fit where it is to be built
        try:
            _check_fits(config, "cpu" if missing else
                        torch.device("cuda", torch.cuda.current_device()))
        except ValueError as exc:
            raise _Bad(f"--set: {exc}") from None
    if missing:
        return _without_gpu(args, torch, config, budget, missing)
    return _on_gpu(args, torch, config, budget, files)


# -- without a GPU ---------------------------------------------------------------------------

def _would(args: argparse.Namespace, config: Any, budget: float) -> str:
    model = _describe(config) if config is not None else _describe(argparse.Namespace(**CONFIG))
    roles = "every role" if args.all_roles else f"the roles that load {CONSUMER}"
    step = "eager step" if args.compile is None else f"step compiled by torch.compile " \
                                                     f"({args.compile})"
    lines = [f"On a GPU this command would, in about {_minutes(budget, args.compile)}:",
             f"- build {model};",
             f"- tune its {step} at batch {BATCH} for {budget:g} s, measuring {roles}, as "
             f"built, then with a {args.spin_us:g} us spin before each layer's {SPIN_SITE} "
             "(an idle GPU, as while an all-reduce waits);",
             "- write each case's profile, report and plot of the gains"
             + (", and the trace of a plan kept," if args.compile is None else "")
             + f" to {os.path.join(args.out, '')};",
             "- print per case the step's time, the plan kept and its confirmed ratio with "
             "its 95% interval."]
    return "\n".join(textwrap.fill(line, width=92, subsequent_indent="  ",
                                   break_long_words=False, break_on_hyphens=False)
                     for line in lines)


def _minutes(budget: float, compiled: Optional[str]) -> str:
    """The demo's time on a GPU, roughly: the two budgets and half a minute of imports,
    building, saving and tracing (95 s in all at the default budget on an H100; compiled
    steps: compiling is in the budget)."""
    total = 2 * budget + (30 if compiled is None else 20)
    return f"{total / 60:.0f} minutes" if total >= 90 else f"{total:.0f} s"


def _without_gpu(args: argparse.Namespace, torch: Any, config: Any, budget: float,
                 missing: list[str]) -> int:
    print(f"l2prefetch {__version__} demo: nothing is measured here, for want of:")
    for line in missing:
        print(textwrap.indent(line, "  "))
    print()
    print(_would(args, config, budget))
    print("\nWhat this machine can do without them:\n")
    if config is None:
        print("The model's roles and a plan: skipped (building the model needs torch and "
              "transformers: l2prefetch's 'tune' extra).\n")
    else:
        _roles_and_plan(args, config)
    _print_kernel()
    if not _installed("matplotlib"):
        print("\nThe plots need matplotlib too: l2prefetch's 'tune' extra.")
    return 0


def _roles_and_plan(args: argparse.Namespace, config: Any) -> None:
    from ..plan import format_plan
    from . import hf

    t0 = time.monotonic()
    logger.info("building %s on the CPU", _describe(config))
    model = build_model(config, "cpu")
    logger.info("model ready in %.1f s", time.monotonic() - t0)
    step = hf.DecodeStep(model)
    try:
        roles = _roles(model, step, "the CPU")
    except ValueError as exc:   # no read of a megabyte: a model --set made too small
        print(f"The model's roles: none ({_one_line(exc)}).\n")
        return
    measured = _measured(roles, args.all_roles)
    print("The model's candidate roles (where a fork could load which weights), from one "
          "decode\nstep on the CPU:\n")
    print(describe_roles(roles, cap=DEFAULT_MAX_BYTES), end="")
    print(f"\nlargest load: the most one fork of the role can load (its consumer's weights "
          f"and those\nread after it, up to {DEFAULT_MAX_BYTES // MIB} MiB; the tuner tries "
          "smaller caps too)")
    print("\n" + textwrap.fill(
        f"The demo measures {len(measured)} of them: " + (
            "every role." if len(measured) == len(roles) else
            "; ".join(f"'{role.name}'" for role in measured) + "."), width=92) + "\n")
    role = next((r for r in roles if r.name == PLANTED_ROLE), None)
    if role is None:
        print(f"\nNo plan: the model has no role '{PLANTED_ROLE}'.\n")
        return
    entries = role.entries((BATCH,), byte_cap=PLAN_CAP, grid=32, graph_fork=PLAN_FORK)
    print(textwrap.fill(
        f"A plan of the role beside the spin, as a profile holds it: '{role.name}' capped at "
        f"{PLAN_CAP // MIB} MiB, grid 32, {PLAN_FORK} (what paid there on an H200: "
        "benchmarks/RESULTS.md, run 22).  On a GPU the tuner measures which roles and "
        "settings pay, and keeps only what its confirmation shows faster:", width=92))
    print()
    print(format_plan(entries), end="")
    print()


def _print_kernel() -> None:
    t0 = time.monotonic()
    logger.info("compiling the loader kernel '%s' for sm_%d with NVRTC", KERNEL, SM)
    try:
        nvrtc = _C.nvrtc_info()
        built = _C.compile(KERNEL, SM)
    except (_C.CudaUnavailableError, _C.Error) as exc:
        print("The loader kernel: not compiled, NVRTC is not available (pip install "
              "'nvidia-cuda-nvrtc>=13,<14'):")
        print(textwrap.indent(str(exc), "  "))
        return
    logger.info("compiled in %.1f s", time.monotonic() - t0)
    print(f"The loader kernel: NVRTC {nvrtc['version'][0]}.{nvrtc['version'][1]} compiled "
          f"'{KERNEL}' for sm_{SM} (H100, H200): {len(built['image'])} bytes of CUBIN.")


# -- on a GPU --------------------------------------------------------------------------------

def _on_gpu(args: argparse.Namespace, torch: Any, config: Any, budget: float,
            files: Mapping[str, list]) -> int:
    from .. import hooks
    from . import hf

    if hooks.disabled():
        raise _Bad("L2PREFETCH_DISABLE is set, so nothing forks: unset it to run the demo")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        raise _Bad(f"--out {args.out} cannot be created: {exc.strerror}") from None
    _check_out(args.out, files)
    device = torch.device("cuda", torch.cuda.current_device())
    t_start = time.monotonic()
    logger.info("building %s on %s", _describe(config), device)
    try:
        model = build_model(config, device)
        step = hf.DecodeStep(model)
        roles = _measured(_roles(model, step, str(device)), args.all_roles)
        if args.compile is not None:
            step.state(BATCH)        # the prompt runs eagerly: no compile of a prefill
            compile_forward(model, args.compile)
            logger.info("the model's forward compiled with torch.compile (Inductor, mode %s)",
                        args.compile)
        summaries = []
        for n, case in enumerate(CASES, 1):
            logger.info("case %d of %d, %s: tuning %d roles at batch %d for %g s", n,
                        len(CASES), _what(case, args.spin_us), len(roles), BATCH, budget)
            summaries.append(_case(args, case, model, step, roles, budget, files[case]))
    except StepError as exc:
        print(f"l2prefetch demo: {_one_line(exc)}", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError as exc:
        print(f"l2prefetch demo: out of GPU memory: {_one_line(exc)}", file=sys.stderr)
        return 1
    except _Failed as exc:
        print(f"l2prefetch demo: {_one_line(exc)}", file=sys.stderr)
        return 1
    props = torch.cuda.get_device_properties(device)
    l2 = _C.device_info(device.index)["l2_bytes"]
    step_name = "eager step" if args.compile is None else f"compiled step ({args.compile})"
    print(f"l2prefetch {__version__} demo on {props.name} (L2 {l2 / MIB:.0f} MiB, torch "
          f"{torch.__version__}): {_describe(config)}; its {step_name} at batch {BATCH}, "
          f"{budget:g} s of tuning per case, {len(roles)} roles measured; "
          f"{time.monotonic() - t_start:.0f} s in all.\n")
    print("\n\n".join(summaries))
    return 0


class _Failed(Exception):
    """A failure after tuning began (the outputs, the trace): exit status 1."""


def _what(case: str, spin_us: float) -> str:
    return ("plain, the model as built" if case == "plain" else
            f"planted, a {spin_us:g} us spin before each layer's {SPIN_SITE}")


def _case(args: argparse.Namespace, case: str, model: Any, step: Any, roles: list,
          budget: float, files: list) -> str:
    """Tune one case, write its files; its summary."""
    from .._files import write_atomic
    from .tuner import tune

    paths = dict(zip(("profile", "report", "plot", "trace", "trace plot"),
                     (path for _, path in files)))
    handles = plant(model, args.spin_us) if case == "planted" else []
    try:
        result = tune(model, step, [BATCH], candidates=roles, budget_s=budget,
                      progress=None if args.quiet else sys.stderr,
                      compiled=args.compile if args.compile is not None else False)
        try:
            result.save(paths["profile"], model)
            write_atomic(paths["report"], result.markdown(), "the report")
            drawn = result.plot(paths["plot"])
        except (OSError, ValueError) as exc:   # checked before tuning; changed since
            raise _Failed(f"tuned {case}, but its outputs could not be written: {exc}") \
                from None
        written = [f"{paths['profile']} (profile)", f"{paths['report']} (report)",
                   f"{paths['plot']} (the gains)" if drawn else
                   "no plot (matplotlib is not installed: l2prefetch's 'tune' extra)"]
        rep = result.batches[0]
        if not result.empty and "trace" in paths:
            written += _trace(model, step, case, paths)
        elif not result.empty:
            written.append("no trace (trace has no compiled mode)")
    finally:
        for handle in handles:
            handle.remove()
    return _summary(case, args, rep, written)


def _trace(model: Any, step: Any, case: str, paths: Mapping[str, str]) -> list[str]:
    """Where the kept plan's loads ran: the trace's Markdown and plot; their lines."""
    from .._files import write_atomic
    from ..profile import load_profile
    from . import trace

    t0 = time.monotonic()
    logger.info("%s: tracing where the kept plan's loads ran (five captures, profiled)", case)
    try:
        profile = load_profile(paths["profile"], model)
        result = trace.trace(model, step, BATCH, trace.forks_of_profile(model, profile),
                             title=f"the demo's Llama, {case}, batch {BATCH}")
    except (trace.TraceError, OSError, ValueError) as exc:
        raise _Failed(f"tracing the {case} plan failed: {exc}") from None
    try:
        write_atomic(paths["trace"], result.markdown(), "the trace")
        try:
            result.plot(paths["trace plot"])
            plot = f"{paths['trace plot']} (the trace's plot)"
        except ImportError:
            plot = "no trace plot (matplotlib is not installed: l2prefetch's 'tune' extra)"
    except (OSError, ValueError) as exc:
        raise _Failed(f"traced {case}, but its outputs could not be written: {exc}") from None
    logger.info("%s: traced in %.1f s", case, time.monotonic() - t0)
    return [f"{paths['trace']} (where the loads ran)", plot]


def _summary(case: str, args: argparse.Namespace, rep: Any, written: list[str]) -> str:
    lines = [f"{_what(case, args.spin_us)}: " + (
        "the step was not measured" if math.isnan(rep.step_us)
        else f"the step takes {rep.step_us:.1f} us")]
    conf = rep.confirmed
    if conf is None:
        why = EMPTY_PLAIN + "; the tuner: " if case == "plain" else ""
        hint = ("; a larger --budget gives it more time"
                if "budget" in rep.reason and "--budget" not in rep.reason else "")
        lines.append(f"  plan: empty ({why}{rep.reason}{hint})")
    else:
        low, high = conf.ratio_interval
        for name, setting in rep.plan:
            lines.append(f"  plan: {name} [{setting.label()}]")
        lines.append(f"  confirmed: {conf.ratio:.4f}x faster (95% interval {low:.4f}-"
                     f"{high:.4f}), {conf.gain.format(2)} us per step, logits "
                     + ("bitwise those without forks" if conf.identical else "NOT bitwise"))
    lines += [f"  file: {line}" for line in written]
    return "\n".join(lines)
