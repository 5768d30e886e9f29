"""probe_forkcost: where an empty inline fork's cost arises in a planted HF graph (issue 24).

Run 21 left this open: an empty inline fork costs 0.15-0.39 us after a cuBLAS GEMV and
0.7-0.9 us after torch's residual add or a spin, even when the loader launches while a
40 us kernel runs.  Here ``tuning.trace`` captures the planted Llama (6 layers, random
bf16, ``hf.DecodeStep``) with the inline forks of one role with loads, with empty tables
and without forks, and prints per fork the kernel before it and after it and how much
later, with empty tables than without forks, the kernel after it started (relative to the
kernel before it) and the step reached the next fork (``ForkTrace.delay_us``,
``delay_to_next_us``), the kernels on the way where that delay grew or shrank most
(``lags_us``: run 22 found the next kernel 0.5-1.0 us late at every site, but the next
fork 0.4-0.5 us late after o_proj and 1.0 us after the add), then each fork's whole
timeline.

Roles as the planted section's (``benchmarks/sections/planted.py``, ROLES): for the sites
``mlp`` (the spin before every MLP's norm) and ``oproj`` (in every o_proj's forward hook,
right after the GEMV) ``module`` is ``after self_attn.o_proj: mlp.gate_proj`` (after the
GEMV) and ``before`` is ``before post_attention_layernorm: mlp.gate_proj`` (after the
residual add); for ``attention`` (the spin before every attention's norm) they are after
``mlp.down_proj`` and before ``input_layernorm``.

    python -m benchmarks.probe_forkcost [--replays N] [SITE:KIND:BATCH ...]

(on the GPU; default ``mlp:before:1 oproj:module:1 mlp:module:1``)
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import no_gpu

SPIN_US = 40
MIB = 1 << 20


def changes(fork, names, min_us=0.15, most=4):
    """Where along the way from ``fork`` to the next fork its empty tables' delay grew or
    shrank by ``min_us`` or more (``ForkTrace.lags_us``; ``names``: the step's kernel names
    by index), the ``most`` largest changes in step order, as text: ``#index name (lag
    before -> lag; the two captures without forks: before -> after)``."""
    lags, floor = fork.lags_us, fork.lags_floor_us
    steps = [(abs(lags[j] - lags[j - 1]), j) for j in range(1, len(lags))
             if abs(lags[j] - lags[j - 1]) >= min_us]
    chosen = sorted(j for _, j in sorted(steps, reverse=True)[:most])
    out = []
    for j in chosen:
        index = fork.after + j
        text = f"#{index} {names[index][:40]} ({lags[j - 1]:+.2f} -> {lags[j]:+.2f}"
        if len(floor) == len(lags):
            text += f"; without forks twice: {floor[j - 1]:+.2f} -> {floor[j]:+.2f}"
        out.append(text + ")")
    return ", ".join(out) if out else f"none by {min_us} us or more"


def run(rig, name, site, kind, batch, replays):
    from benchmarks.sections.planted import _model, _planted, _role
    from l2prefetch.tuning import trace as tr
    from l2prefetch.tuning.hf import DecodeStep

    model = _model(name)
    step = DecodeStep(model)
    planted = _planted(rig, model, site, SPIN_US)
    try:
        role = _role(model, step, site, kind)
        forks = tr.forks_of_role(model, role, batch, byte_cap=24 * MIB, mode="inline")
        result = tr.trace(model, step, batch, forks, replays=replays,
                          title=f"{name}, {SPIN_US} us at {site}, {role.name}, batch {batch}")
    finally:
        for handle in planted:
            handle.remove()
    print(f"== {result.title}: the step's kernels span {result.step_us:.1f} us with loads, "
          f"{result.control_step_us:.1f} with empty tables, {result.none_step_us:.1f} without "
          f"forks", flush=True)
    def us(value):
        return "-" if value is None else f"{value:+.2f}"

    names = [k.name for k in result.kernels if not k.loader]
    for fork in result.forks:
        before = fork.before.name[:50] if fork.before else "-"
        after = next((r.kernel.name[:50] for r in fork.rows if r.index == fork.after), "-")
        print(f"   fork {fork.number}: after {before} | next {after} | next kernel's start "
              f"{us(fork.delay_us)} us (two captures without forks: "
              f"{us(fork.delay_floor_us)}) | to the next fork {us(fork.delay_to_next_us)} us",
              flush=True)
        if fork.lags_us:
            print(f"      the delay changed at: {changes(fork, names)}", flush=True)
    print(result.markdown(), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probe_forkcost")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("specs", nargs="*",
                        default=["mlp:before:1", "oproj:module:1", "mlp:module:1"])
    args = parser.parse_args(argv)
    specs = []
    for spec in args.specs:
        parts = spec.split(":")
        site, kind, batch = (parts + ["", "", ""])[:3]
        if len(parts) != 3 or site not in ("mlp", "attention", "oproj") or kind not in ("module", "before") \
                or not batch.isdigit() or int(batch) < 1:
            parser.error(f"{spec!r}: want SITE:KIND:BATCH, SITE mlp, attention or oproj, "
                         "KIND module or before, BATCH >= 1")
        specs.append((site, kind, int(batch)))
    if args.replays < 1:
        parser.error(f"--replays must be >= 1, got {args.replays}")
    if no_gpu("benchmarks.probe_forkcost"):
        return
    import torch

    from l2prefetch.tuning.rig import Rig

    rig = Rig(torch.device("cuda", 0))
    for site, kind, batch in specs:
        run(rig, "llama", site, kind, batch, args.replays)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
