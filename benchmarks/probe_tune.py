"""Probe: tuning.tune unaided on the planted-window HF Llama (issue 24's model).

HF Llama-shaped, 6 layers, a 40 us one-thread spin before every
post_attention_layernorm; roles discovered; every fork mode; the given budget.

    python -m benchmarks.probe_tune [BUDGET_S] [BATCH ...]
"""
import sys

import torch

from l2prefetch import tuning
from l2prefetch.tuning.hf import DecodeStep
from l2prefetch.tuning.rig import Rig


def main():
    import transformers as tf

    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 120.0
    batches = [int(b) for b in sys.argv[2:]] or [1]
    rig = Rig(torch.device("cuda", 0))
    cfg = tf.LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=6,
                         num_attention_heads=24, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=256)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    for layer in model.model.layers:
        layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a: rig.spin(40))
    step = DecodeStep(model)
    result = tuning.tune(model, step, batches, budget_s=budget)
    print(result.summary())
    print(result.markdown())


if __name__ == "__main__":
    main()
