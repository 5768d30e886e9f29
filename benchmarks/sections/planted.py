"""planted: planted idle windows in Hugging Face models' captured decode steps (issue 24).

HF Llama- and Qwen3-shaped models (random bf16, 6 layers, ``hf.DecodeStep``), a one-thread
spin of ``SPINS_US`` before every MLP (a forward pre-hook on ``post_attention_layernorm``)
or, separately, before every attention (on ``input_layernorm``), and the same models with
nothing planted.  For the roles whose window it is (discovered by ``tuning.discover``: the
gate_proj after o_proj and before post_attention_layernorm, the next layer's q_proj after
down_proj and before input_layernorm), per fork mode and cap, side by side in one run, through
the tuner's own backend (``tuning.measure.GraphBackend``):

* (a) no forks, (d) the same forks with empty tables, (b) the loads: a mode's (d) and (b)s
  are switched states of shared graph instances (``tuning.rig.LoaderSwitch``), so (d) - (b)
  is paired; (a) - (d), the forks' own cost, is compared across instances (Welch);
* the prize: the consumers' cold-to-hot gap summed over the layers (``GraphBackend.probe``:
  the consumer timed inside the graph cold, and after its weights were read right before it),
  and the share of it the loads recover, (d) - (b) over the gap.

    python -m benchmarks.report --sections planted [--quick]    (--quick: the 40 us windows only)
"""

from __future__ import annotations

import statistics
import sys

import torch

from l2prefetch.mechanisms import GRAPH_FORKS
from l2prefetch.tuning.report import table
from l2prefetch.tuning.arms import EMPTY, LOADS, NO_FORKS, arm_key
from l2prefetch.tuning.stats import diff_interval, paired_interval

MIB = 1 << 20
#: The planted windows (us) and where: before the MLP or before the attention.
SPINS_US = (10, 20, 40)
SITES = ("mlp", "attention")
#: Where the probes may also plant: "oproj", in a forward hook of o_proj, right after its
#: GEMV and before the residual add, where a tensor-parallel o_proj's all-reduce runs.
PLANT_SITES = SITES + ("oproj",)
MODES = GRAPH_FORKS
CAPS_MIB = (24, 48)
BATCHES = (1, 8)
INSTANCES = 4
#: The models' shapes (transformers config fields; 6 layers, random bf16).
MODELS = {
    "llama": ("LlamaConfig", dict(hidden_size=3072, intermediate_size=8192,
                                  num_attention_heads=24, num_key_value_heads=8)),
    "qwen3": ("Qwen3Config", dict(hidden_size=2560, intermediate_size=9728,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128)),
}
#: The roles that each site's window serves: {kind: its fork site's suffix}, its consumer's
#: suffix.  "module": after the read before the window; "before": hooked ahead of the norm
#: whose pre-hook is the planted spin, so the fork's next kernel is the window's own.  At
#: "oproj" the "module" role's fork (hooked ahead of o_proj's other forward hooks) is right
#: before the window, and the "before" role's comes after it.
ROLES = {"mlp": ({"module": "self_attn.o_proj", "before": "post_attention_layernorm"},
                 "mlp.gate_proj"),
         "oproj": ({"module": "self_attn.o_proj", "before": "post_attention_layernorm"},
                   "mlp.gate_proj"),
         "attention": ({"module": "mlp.down_proj", "before": "input_layernorm"},
                       "self_attn.q_proj")}
KINDS = ("module", "before")


def _model(name):
    import transformers as tf

    cls, shape = MODELS[name]
    config = getattr(tf, cls)(num_hidden_layers=6, vocab_size=32000,
                              max_position_embeddings=256, **shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                   attn_implementation="sdpa").eval()


def _role(model, step, site, kind="module"):
    """The discovered role of ``kind`` whose forks serve ``site``'s window."""
    from l2prefetch.tuning import candidates, discover

    forks, consumer = ROLES[site]
    roles = candidates(model, discover(model, lambda: step(1)))
    for role in roles:
        if (role.kind == kind and role.site.endswith(forks[kind])
                and role.consumer.endswith(consumer)):
            return role
    raise RuntimeError(f"no discovered {kind} role forks at {forks[kind]} for {consumer}: "
                       f"{[r.name for r in roles]}")


def _planted(rig, model, site, spin, layers=None):
    """Hooks that spin ``spin`` us before the MLP or attention of each layer (of the
    layer indices ``layers`` only, when given), or right after its o_proj ("oproj":
    a forward hook returning None, so o_proj's output is unchanged); returns them."""
    chosen = [layer for i, layer in enumerate(model.model.layers)
              if layers is None or i in layers]
    if site == "oproj":
        return [layer.self_attn.o_proj.register_forward_hook(
            lambda m, a, o: (rig.spin(spin), None)[1]) for layer in chosen]
    norm = "post_attention_layernorm" if site == "mlp" else "input_layernorm"
    return [getattr(layer, norm).register_forward_pre_hook(lambda m, a: rig.spin(spin))
            for layer in chosen]


def _measure(backend, role, batch, modes, caps):
    from l2prefetch.tuning.arms import Arm, Setting

    arms = {NO_FORKS: Arm()}
    for mode in modes:
        base = Setting(byte_cap=caps[0] * MIB, graph_fork=mode)
        arms[arm_key(EMPTY, mode)] = Arm(((role.name, base),), empty=True)
        for cap in caps:
            arms[arm_key(LOADS, mode, cap)] = Arm(((role.name, Setting(cap * MIB, graph_fork=mode)),))
    times, identical = backend.measure(batch, arms, INSTANCES)
    paired = any({arm_key(EMPTY, m), arm_key(LOADS, m, caps[0])} <= g
                 for g in backend.pairs for m in modes)
    return times, identical, paired


def run(rig, quick):
    from l2prefetch.tuning.hf import DecodeStep
    from l2prefetch.tuning.measure import GraphBackend

    spins = (40,) if quick else SPINS_US
    sites = SITES
    rows = []
    for name in MODELS:
        model = _model(name)
        step = DecodeStep(model)
        for site in sites:
            for spin in (0,) + spins:
                hooks = _planted(rig, model, site, spin) if spin else []
                try:
                    for batch, kind in [(b, k) for b in BATCHES for k in KINDS]:
                        role = _role(model, step, site, kind)
                        backend = GraphBackend(model, step, rounds=30)
                        backend.use_roles([role], [c * MIB for c in CAPS_MIB])
                        backend.prepare(batch)
                        probe = (backend.probe(batch, [role]) or {}).get(role.name)
                        gap = probe.gap_us if probe else None
                        times, identical, paired = _measure(backend, role, batch, MODES, CAPS_MIB)
                        a = times[NO_FORKS]
                        for mode in MODES:
                            d = times[arm_key(EMPTY, mode)]
                            cost = diff_interval(d, a)
                            for cap in CAPS_MIB:
                                b = times[arm_key(LOADS, mode, cap)]
                                vs_d = (paired_interval if paired else diff_interval)(d, b)
                                vs_a = diff_interval(a, b)
                                # the prize of the bytes loaded: the gap's share of them
                                # (the loads start with the consumer's own weights)
                                own = role.sites[0].nbytes[0]
                                prize = gap * min(1.0, cap * MIB / own) if gap else None
                                share = (f"{100 * vs_d.estimate / prize:.0f}%"
                                         if prize and prize > 0 else "n/a")
                                rows.append([name, site, f"{spin}" if spin else "none", batch,
                                             role.name.split(":")[0], mode,
                                             cap, f"{statistics.mean(a):.1f}", cost.format(1),
                                             vs_d.format(1), vs_a.format(1),
                                             f"{gap:.1f}" if gap is not None else "n/a", share,
                                             "yes" if identical.get(arm_key(LOADS, mode, cap))
                                             else "NO"])
                        # progress, and what survives a run cut short (stderr: the report
                        # itself goes to stdout or --out)
                        shown = "n/a" if gap is None else f"{gap:.1f}"
                        where = f"a {spin} us window at {site}" if spin else "no window"
                        print(f"planted: {name}, {where}, batch {batch}, {role.name}: "
                              f"gap {shown} us; "
                              + "; ".join(f"{r[5]} {r[6]} MiB (d)-(a) {r[8]}, (d)-(b) {r[9]}"
                                          for r in rows[-len(MODES) * len(CAPS_MIB):]),
                              file=sys.stderr, flush=True)
                finally:
                    for h in hooks:
                        h.remove()
        del model, step
        torch.cuda.empty_cache()
    head = ["model", "window before", "spin us", "batch", "fork", "mode", "cap MiB", "(a) us",
            "(d) - (a) us", "(d) - (b) us, paired", "(a) - (b) us", "gap us", "recovered",
            "bitwise"]
    return ("### planted: planted idle windows in HF models' graphs\n\n"
            f"6 layers, random bf16, {INSTANCES} graph instances per structure, 30 rounds; "
            "the roles are the window's (gate_proj after o_proj and before "
            "post_attention_layernorm for the MLP, q_proj after the previous layer's down_proj "
            "and before input_layernorm for the attention); 95% intervals; gap: the consumers' "
            "cold-to-hot gap over all layers (the most all of their bytes can save); "
            "recovered: (d) - (b) over the prize of the bytes loaded (the gap times the share "
            "of the consumer's weights the cap covers).\n\n" + table(head, rows) + "\n")
