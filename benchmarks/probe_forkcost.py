"""probe_forkcost: where an empty inline fork's cost arises in a planted HF graph (issue 24).

Run 21 left this open: an empty inline fork costs 0.15-0.39 us after a cuBLAS GEMV and
0.7-0.9 us after torch's residual add or a spin, even when the loader launches while a
40 us kernel runs.  Here ``tuning.trace`` captures the planted Llama (6 layers, random
bf16, ``hf.DecodeStep``) with the inline forks of one role with loads, with empty tables
and without forks, and prints per fork the kernel before it and after it and how much
later, with empty tables than without forks, the kernel after it started (relative to the
kernel before it) and the step reached the next fork (``ForkTrace.delay_us``,
``delay_to_next_us``), then each fork's whole timeline.

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

    for fork in result.forks:
        before = fork.before.name[:50] if fork.before else "-"
        after = next((r.kernel.name[:50] for r in fork.rows if r.index == fork.after), "-")
        print(f"   fork {fork.number}: after {before} | next {after} | next kernel's start "
              f"{us(fork.delay_us)} us (two captures without forks: "
              f"{us(fork.delay_floor_us)}) | to the next fork {us(fork.delay_to_next_us)} us",
              flush=True)
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
