"""Probe (run 30's question), on the CPU: where does Inductor put a fork and the planted
spin among a layer's kernels?  The compiled rows' window roles kept 100-118% of the
window's ceiling where the spin sits in o_proj's forward hook and 9-80% where it sits in
post_attention_layernorm's pre-hook (RESULTS runs 25-30), until the fork before the norm
followed the add that the spin realizes (run 34: 100-115% there too).  The order of the
compiled code's calls says why, and Inductor's scheduler orders them alike for the CPU
and the GPU: a one-layer Llama-shaped model (hidden 64) with the spin planted at
``--site`` (:func:`benchmarks.compiled.plant`; the spin a no-op on the CPU) and one fork
at each ``--forks`` site (``oproj_after``: after o_proj; ``norm_before`` /
``norm_after``: before / after post_attention_layernorm; a stand-in controller: nothing
is launched) is compiled by Inductor and the calls of its generated ``call()`` from the
attention's output projection on are printed: kernels, extern kernels (a GEMM), the spin
and the fork.

    python -m benchmarks.probe_schedule [--site norm|oproj] [--forks oproj_after,...]
"""
import argparse
import functools
import re

import torch

from benchmarks.compiled import SITES, plant, spin_op
from l2prefetch import hooks

FORKS = ("oproj_after", "norm_before", "norm_after")
_CALL = re.compile(r"^\s*(?:\w+ = )?((?:cpp_fused|triton_)\w*|extern_kernels\.\w+|"
                   r"torch\.ops\.\w+\.\w+\.default)\(")


class _Controller:
    """What :func:`l2prefetch.hooks.attach` needs of a controller: forks that do nothing."""

    def fork(self, point, layer, batch):
        return True

    def join(self):
        pass


def _model(site, fork):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    plant(model, 1.0, site, cycles=1000)
    layer = model.model.layers[0]
    sites = {"oproj_after": (layer.self_attn.o_proj, 0),
             "norm_before": (layer.post_attention_layernorm, 0, "before"),
             "norm_after": (layer.post_attention_layernorm, 0)}
    controller = _Controller()
    hooks.attach(model, controller, {"p": [sites[fork]]})
    return model, controller


@functools.cache
def _spin_on_cpu():
    """The spin's CPU kernel, a no-op (registered once per process)."""
    spin_op.register_kernel("cpu")(lambda after, cycles: None)


def schedule(site, fork):
    """The compiled layer's calls in order after its attention: the kernel or op names,
    the spin as ``spin`` and the fork as ``fork``."""
    from torch._inductor.utils import run_and_get_code
    _spin_on_cpu()
    model, controller = _model(site, fork)   # the controller lives while it is compiled
    step = torch.compile(model.forward)
    ids = torch.zeros((1, 1), dtype=torch.long)
    with torch.no_grad():
        _, codes = run_and_get_code(lambda: step(input_ids=ids, use_cache=False))
    code = codes[-1]
    calls = [m.group(1) for m in map(_CALL.match, code[code.index("def call("):].splitlines())
             if m]
    names = ["spin" if c.startswith("torch.ops.l2p_bench.spin") else
             "fork" if c.startswith("torch.ops.l2prefetch.fork") else c for c in calls]
    last = max(i for i, n in enumerate(names) if "attention" in n)
    return names[last + 1:]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--site", choices=SITES, default="norm")
    p.add_argument("--forks", default=",".join(FORKS))
    args = p.parse_args(argv)
    for fork in args.forks.split(","):
        if fork not in FORKS:
            p.error(f"--forks: {fork!r} is none of {', '.join(FORKS)}")
        print(f"spin at {args.site}, fork {fork}: " + " -> ".join(schedule(args.site, fork)))


if __name__ == "__main__":
    main()
