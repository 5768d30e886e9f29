"""Eager against compiled, side by side: the step, the tuned plan, the ceiling (issue 40).

For each model (benchmarks.common.hf_model: ``llama``, ``qwen3`` or a
benchmarks/configs name; ``vllm``: benchmarks/vllm_model.py's decoder), each window (a
spin of that many us before every MLP, planted as a custom op that torch.compile keeps:
``l2p_bench::spin``, in each layer's post_attention_layernorm pre-hook, or with ``--site
oproj`` in o_proj's forward hook, where a TP all-reduce sits (:func:`plant`); 0: nothing
planted) and each way the step runs (``eager``; ``compiled``: the model's forward
compiled by torch.compile with ``--mode``, the prompts run eagerly first), tune runs
unaided (discovered roles, every fork mode, ``--budget`` s) and a row per batch gives:
the step's us, the tuned plan's ratio with its 95% interval and gain, bitwise equality,
the tuning time (compilation included) and the ceiling (:func:`ceiling`: per kept
role's consumer, the probe's cold minus hot time of it, the largest of the roles
sharing it, summed over distinct consumers, over all layers even where a kept setting
loads only some); tuned / ceiling is the gain over that.  Beside the gain against the
step without forks, the plan's loads against its own forks with empty tables (the
confirmation's control: in compiled steps branch forks alone made the step faster,
RESULTS run 24), over the ceiling; and the loads of the kept roles in the planted
window (:func:`window_loads`, their verify's (d) - (b)) over that window's own ceiling
(:func:`window_ceiling`: the gap of the consumer the window precedes, the MLP's first
weight).

    python -m benchmarks.compiled [--models llama] [--windows 0,40] [--ways eager,compiled]
                                  [--batches 1] [--budget 120] [--mode default]
                                  [--site norm|oproj] [--out F.md]
                                  [--reports DIR] [--caps MIB,..] [--grids N,..]
                                  [--roles "NAME;NAME"]

``--caps``, ``--grids`` and ``--roles`` go to tune as ``caps_mib``, ``grids`` and
``candidates`` (role names, ';' between them): a run that asks whether the window's role
reaches its ceiling with caps up to the whole weight and the full grid, the budget
spent on that role alone (run 25: no compiled tune reached the refine step).
"""
import argparse
import math
import os
import sys
import time

import torch

from benchmarks import vllm_model as vm
from benchmarks.common import hf_model, no_gpu
from l2prefetch import tuning
from l2prefetch.tuning.cli import compile_forward
from l2prefetch.tuning.compiled import recompile
from l2prefetch.tuning.hf import DecodeStep
from l2prefetch.tuning.search import NOT_PREPARED, NOTHING_MEASURED
from l2prefetch.tuning.rig import spin_cycles_per_us


def _spin(after, cycles):
    torch.cuda._sleep(cycles)


spin_op = torch.library.custom_op("l2p_bench::spin", _spin, mutates_args=(),
                                  schema="(Tensor after, int cycles) -> ()")
spin_op.register_fake(lambda after, cycles: None)
# ORDERED-effectful, as l2prefetch.ops' fork and join: Dynamo and AOTAutograd keep it
from torch._library.effects import EffectType  # noqa: E402

spin_op.register_effect(EffectType.ORDERED)


#: Where :func:`plant` puts the spin in an HF model's layers (both before the MLP).
SITES = ("norm", "oproj")


def plant(model, us, site="norm", cycles=None):
    """A spin of ``us`` in every layer, as an effectful custom op (Dynamo keeps it where
    it drops ``torch.cuda._sleep``): ``site`` ``norm``, in post_attention_layernorm's
    pre-hook, reading the residual sum (compiled, Inductor runs the add and the norm's
    reduction before it; a fork before the norm follows that kernel since RESULTS run 34,
    and ran beside it before: runs 27, 30); ``oproj``, in
    o_proj's forward hook, reading its output, where a tensor-parallel all-reduce sits
    (compiled, before the add+norm, as the vLLM-shaped model's all-reduce slot).
    ``cycles``: the spin's clock cycles (default: ``us`` at this GPU's clock)."""
    if cycles is None:
        cycles = int(us * spin_cycles_per_us())
    if site == "oproj":
        return [layer.self_attn.o_proj.register_forward_hook(
            lambda m, args, out: torch.ops.l2p_bench.spin(out, cycles))
            for layer in model.model.layers]
    if site != "norm":
        raise ValueError(f"site must be one of {SITES}, not {site!r}")
    return [layer.post_attention_layernorm.register_forward_pre_hook(
        lambda m, args: torch.ops.l2p_bench.spin(args[0], cycles))
        for layer in model.model.layers]


def build(name, window, site="norm"):
    """(model, step, handles to remove) for ``name``: an HF model with ``window`` us
    planted before every MLP at ``site`` (:func:`plant`), or ``vllm``:
    benchmarks/vllm_model.py's default decoder, its spin in the all-reduce slot after
    o_proj (also before the MLP; ``site`` does not apply)."""
    if name == "vllm":
        cycles = int(window * spin_cycles_per_us()) if window else 0
        torch.manual_seed(0)
        model = vm.Model(vm.Config(), spin_cycles=cycles).to("cuda", torch.bfloat16).eval()
        return model, vm.Decode(model), []
    model = hf_model(name)
    planted = plant(model, window, site) if window else []
    return model, DecodeStep(model), planted


def ceiling(rep, kept):
    """The most the kept plan can gain (us), as issue 40 defines it: per role, its
    consumer's cold time less its time right after a full-grid read of what the role
    can load (the probe's gap, summed over layers), summed over the kept roles'
    distinct consumers (the role name after ':'), the largest gap where two roles share
    one.  Not the chain gaps: the chains of two kept roles cover the same later reads,
    and their sum counted them twice (run 23's eager row).  The probe times the step
    eagerly (the same weights and GEMVs); no plan kept: every role's consumers."""
    best = {}
    for role in rep.roles:
        consumer = role.role.split(": ", 1)[-1]
        if role.gap_us is not None:
            best[consumer] = max(best.get(consumer, 0.0), role.gap_us)
    consumers = {name.split(": ", 1)[-1] for name, _ in kept} or set(best)
    return sum(best.get(c, 0.0) for c in consumers)


#: The weight the MLP reads first, right after every planted window (:func:`plant`, the
#: vLLM-shaped model's all-reduce slot): the planted window's consumer in each model this
#: benchmark builds.  A Mixtral-shaped MLP has none (its experts are routed, no role).
WINDOW_CONSUMERS = ("mlp.gate_proj", "mlp.gate_up_proj")


def _in_window(role, window):
    """Whether ``role`` loads across the planted ``window``: its consumer is the one the
    window precedes and its measured window (fork to consumer) covers the spin.  Not the
    window alone: eager, the attention's kernels give o_proj's role a window of 48-61 us
    that holds no planted spin, and counting its gap made run 29's eager share 73% where
    the planted window's own role kept 91% (RESULTS run 30)."""
    consumer = role.role.split(": ", 1)[-1]
    return consumer in WINDOW_CONSUMERS and (role.window_us or 0.0) >= window


def window_ceiling(rep, window):
    """The planted window's own ceiling (us): the largest consumer gap of the roles that
    load across it (:func:`_in_window`; 0.0 where none does, None for 0: nothing
    planted).  A plan also keeps roles beside other windows (branch forks over a GEMV,
    the attention), whose gains come on top of it."""
    if not window:
        return None
    gaps = [role.gap_us for role in rep.roles
            if role.gap_us is not None and _in_window(role, window)]
    return max(gaps, default=0.0)


def window_loads(rep, kept, window):
    """What the kept roles that load across the planted ``window`` gain by their loads
    alone: their verified (d) - (b) (a lead kept without a verify: its confirmation's),
    summed (None for 0 or none kept there): the numerator beside :func:`window_ceiling`."""
    if not window:
        return None
    kept_names = {name for name, _ in kept}
    gains = [r.chosen.vs_empty.estimate for r in rep.roles
             if r.role in kept_names and r.chosen is not None and _in_window(r, window)]
    return sum(gains) if gains else None


def tune_options(args):
    """tune's keyword arguments from the command line's ``--caps``, ``--grids`` and
    ``--roles`` (those not given: tune's defaults)."""
    out = {}
    if args.caps:
        out["caps_mib"] = [float(c) for c in args.caps.split(",")]
    if args.grids:
        out["grids"] = [int(g) for g in args.grids.split(",")]
    if args.roles:
        out["candidates"] = [r.strip() for r in args.roles.split(";") if r.strip()]
    return out


def _share(value, of):
    return f"{value / of:.0%}" if value is not None and of else ""


#: The table's header lines (:func:`row` gives a batch's row).
HEADER = ("| model | window | step | batch | step us | tuned ratio (95%) | gain us | "
          "of which loads us | bitwise | kept | tune s | ceiling us | tuned / ceiling | "
          "loads / ceiling | window ceiling us | window roles' loads / window ceiling |",
          "|---|---:|---|---:|---:|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")


def row(name, window, step_name, rep, took, label=None):
    """One batch's row of the table (its header: :data:`HEADER`; ``label``: the window
    cell, default ``window``): a batch not prepared or never probed has blank step,
    ceiling and share cells, and says why."""
    conf = rep.confirmed
    kept = list(rep.plan) if conf is not None else []
    probed = any(role.gap_us is not None for role in rep.roles)
    top = ceiling(rep, kept) if probed else None   # None: never probed
    own = window_ceiling(rep, window) if probed else None
    gain_us = loads_us = None
    if conf is None:
        ratio = ("nothing measured (the budget ran out)" if rep.reason == NOTHING_MEASURED
                 else "not prepared (the budget ran out)" if rep.reason == NOT_PREPARED
                 else "empty plan")
        gain, loads, same = "", "", ""
    else:
        low, high = conf.ratio_interval
        ratio = f"{conf.ratio:.4f} ({low:.4f}-{high:.4f})"
        gain, same = conf.gain.format(2), str(conf.identical)
        gain_us = conf.gain.estimate
        loads = "" if conf.loads is None else conf.loads.format(2)
        loads_us = None if conf.loads is None else conf.loads.estimate
    roles = "; ".join(f"{n} [{s.label()}]" for n, s in kept) or "-"
    label = f"{window:g}" if label is None else label
    return (f"| {name} | {label} | {step_name} | {rep.batch} | "
            f"{'' if math.isnan(rep.step_us) else f'{rep.step_us:.1f}'} | "
            f"{ratio} | {gain} | {loads} | {same} | "
            f"{roles} | {took:.0f} | {'' if top is None else f'{top:.2f}'} | "
            f"{_share(gain_us, top)} | {_share(loads_us, top)} | "
            f"{'' if own is None else f'{own:.2f}'} | "
            f"{_share(window_loads(rep, kept, window), own)} |")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compiled")
    parser.add_argument("--models", default="llama")
    parser.add_argument("--windows", default="0,40")
    parser.add_argument("--ways", default="eager,compiled")
    parser.add_argument("--batches", default="1")
    parser.add_argument("--budget", type=float, default=120.0)
    parser.add_argument("--mode", default="default")
    parser.add_argument("--site", default="norm", choices=SITES,
                        help="where an HF model's spin sits (plant(); default norm)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--reports", default=None, metavar="DIR",
                        help="write each tune's Markdown report there (every role's gaps)")
    parser.add_argument("--caps", default=None, metavar="MIB,..",
                        help="the sweep's caps in MiB (tune's caps_mib; default: tune's)")
    parser.add_argument("--grids", default=None, metavar="N,..",
                        help="the refine step's grids (tune's grids; default: tune's)")
    parser.add_argument("--roles", default=None, metavar="NAME;NAME",
                        help="measure only these roles (tune's candidates), ';' between")
    args = parser.parse_args(argv)
    options = tune_options(args)
    if no_gpu("benchmarks.compiled"):
        return
    if args.reports and not os.path.isdir(args.reports):   # before minutes of tuning
        raise SystemExit(f"--reports {args.reports!r}: not a directory")
    batches = [int(b) for b in args.batches.split(",")]
    rows = list(HEADER)
    for name in args.models.split(","):
        for window in [float(w) for w in args.windows.split(",")]:
            # the window column and report name: the spin's site where it is not norm's
            label = f"{window:g}" if args.site == "norm" or name == "vllm" or not window \
                else f"{window:g}-{args.site}"
            for way in args.ways.split(","):
                model, step, planted = build(name, window, args.site)
                for b in batches:
                    step.state(b)
                if way == "compiled":
                    compile_forward(model, args.mode)
                recompile()
                t0 = time.monotonic()
                result = tuning.tune(model, step, batches, budget_s=args.budget,
                                     progress=sys.stderr, **options,
                                     compiled=args.mode if way == "compiled" else False)
                took = time.monotonic() - t0
                if args.reports:
                    path = os.path.join(args.reports, f"{name}-{label}-{way}.md")
                    with open(path, "w") as f:
                        f.write(result.markdown())
                step_name = way if way == "eager" else f"compiled ({args.mode})"
                for rep in result.batches:
                    rows.append(row(name, window, step_name, rep, took, label))
                    print(rows[-1], flush=True)
                for handle in planted:
                    handle.remove()
                del model, step, result
                recompile()
                torch.cuda.empty_cache()
    text = "\n".join(rows) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
