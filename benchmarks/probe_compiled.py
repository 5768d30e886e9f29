"""Probe: what fork ops change in Inductor's code for a compiled HF decode step.

A small Llama (as tests/test_compiled_gpu.py) with its forward compiled; the step's
generated code without forks, then with a switchboard hooked at each site kind alone
(forking nowhere): per site kind, whether the kernel calls are the same and whether
the captured logits are bitwise the same, and where the kernel lists first differ.

    python -m benchmarks.probe_compiled [--mode default|max-autotune-no-cudagraphs]
"""
import argparse
import difflib
import re

import torch
import transformers
from torch._inductor.utils import run_and_get_code

from l2prefetch.tuning.cli import compile_forward
from l2prefetch.tuning.compiled import Switchboard, recompile
from l2prefetch.tuning.hf import DecodeStep

KERNEL = re.compile(r"^\s+((?:triton_|cpp_fused_|extern_kernels\.)\w*|\w+\.run\(|"
                    r"torch\.ops\.\w+\.\w+)")


def kinds(model):
    out = {}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for name, site in [("before input_layernorm", (layer.input_layernorm, i, "before")),
                           ("after q_proj", (attn.q_proj, i, "after")),
                           ("after k_proj", (attn.k_proj, i, "after")),
                           ("after o_proj", (attn.o_proj, i, "after")),
                           ("after self_attn", (attn, i, "after")),
                           ("before post_attention_layernorm",
                            (layer.post_attention_layernorm, i, "before")),
                           ("before mlp", (mlp, i, "before")),
                           ("after gate_proj", (mlp.gate_proj, i, "after")),
                           ("after mlp", (mlp, i, "after"))]:
            out.setdefault(name, []).append(site)
    return out


def calls(code):
    found = []
    for line in code.splitlines():
        m = KERNEL.match(line)
        if m:
            found.append(re.sub(r"_\d+$", "", m.group(1).split("(")[0]))
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probe_compiled")
    parser.add_argument("--mode", default="default")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816,
                                      num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=4096)
    model = transformers.LlamaForCausalLM(config).to(args.device, torch.bfloat16).eval()
    step = DecodeStep(model, prompt_len=16, max_cache_len=32)
    step.state(args.batch)
    compile_forward(model, args.mode)
    with torch.no_grad():
        ref, codes = run_and_get_code(step, args.batch)
        ref = ref.clone()
    base = calls("\n".join(codes))
    print(f"{args.mode}, batch {args.batch}: {len(base)} calls without forks")
    for name, sites in kinds(model).items():
        board = Switchboard(model, sites)
        board.on = True
        recompile()
        with torch.no_grad():
            out, codes = run_and_get_code(step, args.batch)
        mine = calls("\n".join(codes))
        board.close()
        same = torch.equal(out.view(torch.int16), ref.view(torch.int16))
        kernels = [c for c in mine if "l2prefetch" not in c]
        print(f"{name:34s} bitwise {same!s:5s} kernels same {kernels == base!s:5s} "
              f"({len(kernels)} vs {len(base)}; {len(mine) - len(kernels)} forks)")
        if kernels != base:
            for line in list(difflib.unified_diff(base, kernels, lineterm="", n=1))[2:14]:
                print("    " + line)


if __name__ == "__main__":
    main()
