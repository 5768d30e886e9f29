"""The real-model proof: Hugging Face DeepSeek-V3 decoding with l2prefetch's hooks.

    python -m benchmarks.deepseek [--quick] [--out DEEPSEEK.md] [--device cuda|cpu]
                                  [--tiny] [--batches 1,2,4,8] [--points next_attention]

Builds a random DeepSeek-V3 (``transformers.DeepseekV3ForCausalLM`` from a
``DeepseekV3Config``; weights are never downloaded): hidden 4096, 6 layers,
the first dense, 32 routed experts top-8, one shared expert, q-LoRA 1536,
kv-LoRA 512, bf16, vocab 4096, seed 0, experts as ``grouped_mm``, a
``StaticCache`` of 64 tokens.  Per batch (1, 2, 4, 8) it prefills an 8-token
prompt, then times one decode step (CUDA events around CUDA-graph replays,
median; every step is the same step: the cache counters and the static
position buffer are reset to the prompt length before each replay):

  (a) no prefetch;
  (b) l2prefetch attached with ``hooks.attach(model, controller,
      lambda m: deepseek_v3.hook_points(m, points))``, ``controller =
      PrefetchController.from_plan(deepseek_v3.plan(model, points=points), 0)``
      (``--points``, comma-separated; default next_attention, the candidate:
      ``deepseek_v3.DEFAULT_POINTS`` is empty, as this benchmark found that
      next_attention does not pay; ``--points oproj_down,next_attention`` adds
      the router prefetch): the forks and the join are recorded into the graph at
      capture;
  (d) the empty-fork control: the same points, layers and batches registered
      with empty tables (same grid, carveout, priority, nothing loaded), so
      the graph has the same fork nodes;
  (c) "hot before step": graph (a) replayed right after the plan's bytes for
      that batch were read on the main stream (latest layer first).  The plan
      reads ~80 MiB per step against a 60 MiB L2, and layer 0's dense MLP and
      every MoE layer's routed experts stream hundreds of MiB through L2
      before the planned consumers run, so little of it is still hot when
      used: expect (c) close to (a).  It is reported as "hot before step",
      not as the step's physical limit (that is about one consumer's
      cold-to-hot gap, ~2 us, per fork).

It also times eager steps (no graph) with and without prefetch, and checks
that the logits of the same step are bitwise identical with and without
prefetch, eager and in graph replay (and with the empty forks); that the
forks fire at the planned points; and that a replayed step advances the
static cache.  The run exits non-zero when a check fails.

``--device cpu`` runs everything but graphs and timing: the model eager, with
a fake controller that counts fork/join calls (``PrefetchController`` needs a
GPU), checking the hook points, batch detection, the cache counters and
bitwise logits with and without hooks.  ``--tiny`` uses a small config (the
GPU test's scale) for a fast check.

Default: 7 graph instances x 200 replays and 100 eager steps per variant and
batch, about three minutes on an H200 after the ~6.6 GiB model is built
(``--quick``: 100 replays and 8 eager steps).
Capture, the interleaved replays and the empty-fork control are the
package's (:mod:`l2prefetch.tuning.rig`).  Results go to stdout, and to
--out (Markdown) when given.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import statistics
import sys
import time
import traceback
from collections import Counter

import torch

import l2prefetch
from l2prefetch import deepseek_v3, hooks
from l2prefetch.plan import format_plan
from l2prefetch.tuning.hf import cache_keyword
from l2prefetch.tuning.report import table
from l2prefetch.tuning.rig import Rig, empty_controller
from l2prefetch.tuning.stats import diff_interval

MIB = 2**20
BATCHES = (1, 2, 4, 8)
PROMPT_LEN = 8
MAX_CACHE_LEN = 64
SEED = 0

#: The benchmark model: the facts' DeepSeek-V3 (h200-facts.md, last section).  The dense
#: layer's intermediate size is not in the facts: 12288 here (288 MiB of MLP).
BENCH_CONFIG = dict(
    vocab_size=4096, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
    num_hidden_layers=6, first_k_dense_replace=1, n_routed_experts=32, num_experts_per_tok=8,
    n_shared_experts=1, n_group=8, topk_group=4, num_attention_heads=32, num_key_value_heads=32,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, num_mtp_layers=0, max_position_embeddings=4096, tie_word_embeddings=False)

#: A small model of the same structure (3 layers, the first dense): for --tiny and the tests.
TINY_CONFIG = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, n_group=2, topk_group=1, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    num_mtp_layers=0, max_position_embeddings=256, tie_word_embeddings=False)


# ---------------------------------------------------------------- the model

def build_model(config_kwargs, device, seed=SEED):
    """A random bf16 DeepseekV3ForCausalLM on device: sdpa attention, grouped_mm experts, eval."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(**config_kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    target = torch.device(device)
    if any(t.device.type != target.type for t in (*model.parameters(), *model.buffers())):
        model.to(target)                    # should not happen: built under the device context
    # The default eager experts loop syncs the host (nonzero) and cannot be captured.
    model.set_experts_implementation("grouped_mm")
    model.eval()
    return model


class Decoder:
    """One batch's decode state: a StaticCache after the prefill, static ids and positions.

    ``step()`` is one decode step: the model's forward on the static ``ids``
    at the static ``pos`` (the cache advances its own counters on the
    device), then ``pos += 1``; all of it can be captured into a CUDA graph.
    ``reset()`` puts the counters and ``pos`` back to the prompt length, so
    every step after it is the same step (same kernels, same inputs).
    """

    def __init__(self, model, batch, prompt_len=PROMPT_LEN, max_cache_len=MAX_CACHE_LEN,
                 seed=SEED):
        from transformers import StaticCache

        device = model.device
        self.model, self.batch, self.prompt_len = model, batch, prompt_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        self.inputs = {cache_keyword(model): self.cache, "use_cache": True}
        generator = torch.Generator().manual_seed(seed * 1000 + batch)
        self.prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                                    generator=generator).to(device)
        positions = torch.arange(prompt_len, device=device).expand(batch, -1)
        logits = model(input_ids=self.prompt, position_ids=positions, **self.inputs).logits
        self.ids = logits[:, -1:].argmax(-1).contiguous()            # [B, 1], static
        self.pos = torch.full((batch, 1), prompt_len, dtype=torch.long, device=device)
        # StaticLayer.cumulative_length: a device tensor since the prefill's lazy init.
        self.lengths = [layer.cumulative_length for layer in self.cache.layers]
        if not all(isinstance(t, torch.Tensor) for t in self.lengths):
            raise RuntimeError("StaticCache layers have no tensor cumulative_length: this "
                               "transformers version does not keep the cache position on the device")

    def step(self):
        out = self.model(input_ids=self.ids, position_ids=self.pos, **self.inputs)
        self.pos.add_(1)
        return out.logits

    def reset(self):
        for length in self.lengths:
            length.fill_(self.prompt_len)
        self.pos.fill_(self.prompt_len)

    def counters(self):
        """(cache lengths per layer, positions) as ints (synchronises)."""
        return [int(t) for t in self.lengths], sorted(set(self.pos.flatten().tolist()))


class FakeController:
    """fork/join that count calls (for CPU runs): fork is True where plan registers the key."""

    def __init__(self, plan):
        self.keys = {(e.point, e.layer, b) for e in plan for b in e.batches}
        self.calls = Counter()
        self.joins = 0

    def fork(self, point, layer, batch):
        self.calls[(point, layer, batch)] += 1
        return (point, layer, batch) in self.keys

    def join(self):
        self.joins += 1

    def reset_stats(self):
        self.calls.clear()
        self.joins = 0

    def stats(self):
        out = {}
        for key, n in self.calls.items():
            if key in self.keys:            # like the real one: only forks that launch count
                out.setdefault(key[0], {"forks": 0, "bytes": 0})["forks"] += n
        return out


def expected_forks(plan, batch):
    """{point: forks per step} that plan registers for batch (each (point, layer) once)."""
    return dict(Counter(e.point for e in plan if batch in e.batches))


def fork_counts(stats):
    return {point: s["forks"] for point, s in stats.items() if s["forks"]}


def bitwise_equal(a, b):
    """Bitwise equality (NaNs included), not value equality."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def max_abs_diff(a, b):
    return float((a.float() - b.float()).abs().max())


def plan_views(plan, batch):
    """The bytes plan loads at batch, as tensor views, latest consumer first."""
    order = {"oproj_down": 0, "next_attention": 1}     # within a layer: router, then next attn
    entries = sorted((e for e in plan if batch in e.batches),
                     key=lambda e: (e.layer, order.get(e.point, 2)), reverse=True)
    views = []
    for entry in entries:
        by_ptr = {w.data_ptr(): w for w in entry.weights}
        for ptr, nbytes in l2prefetch.compute_ranges(entry.weights, entry.byte_cap):
            w = by_ptr[ptr]
            views.append(w.reshape(-1)[: nbytes // w.element_size()])
    return views


def model_summary(model, plan):
    layers = deepseek_v3.decoder_layers(model)
    attn = sum(w.numel() * w.element_size()
               for w in deepseek_v3.attention_weights(layers[0].self_attn))
    dense = next((l for l in layers if not deepseek_v3.is_moe_layer(l)), None)
    moe = next((l for l in layers if deepseek_v3.is_moe_layer(l)), None)

    def size(module):
        return sum(p.numel() * p.element_size() for p in module.parameters())

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    parts = [f"attention projections {attn / MIB:.1f} MiB per layer"]
    if dense is not None:
        parts.append(f"dense MLP {size(dense.mlp) / MIB:.0f} MiB")
    if moe is not None:
        parts.append(f"routed experts {size(moe.mlp.experts) / MIB:.0f} MiB, shared experts "
                     f"{size(moe.mlp.shared_experts) / MIB:.0f} MiB, router "
                     f"{size(moe.mlp.gate) / MIB:.2f} MiB per MoE layer")
    cfg = model.config
    return (f"{len(layers)} layers ({sum(map(deepseek_v3.is_moe_layer, layers))} MoE), hidden "
            f"{cfg.hidden_size}, {cfg.n_routed_experts} routed experts top-"
            f"{cfg.num_experts_per_tok}, {cfg.n_shared_experts} shared, q-LoRA {cfg.q_lora_rank}, "
            f"kv-LoRA {cfg.kv_lora_rank}, vocab {cfg.vocab_size}, {model.dtype}; "
            + "; ".join(parts) + f"; {total / 2**30:.2f} GiB in all. StaticCache "
            f"{MAX_CACHE_LEN} tokens, prompt {PROMPT_LEN} tokens; experts "
            f"{cfg._experts_implementation}, attention {cfg._attn_implementation}.")


def yes(ok):
    return "yes" if ok else "**NO**"


def counts_text(counts):
    return ", ".join(f"{p} {n}" for p, n in sorted(counts.items())) or "none"


# ---------------------------------------------------------------- checks shared by CPU and GPU

def hook_sites(points=None):
    """The hook sites of points for hooks.attach, where deepseek_v3.plan(..., points=points)
    forks (None: deepseek_v3.DEFAULT_POINTS, as both default to)."""
    return lambda model: deepseek_v3.hook_points(model, points)


def eager_pair(dec, controller, points=None):
    """Logits of the same step without and with hooks; the controller's stats of that step."""
    dec.reset()
    ref = dec.step().clone()
    dec.reset()
    controller.reset_stats()
    attachment = hooks.attach(dec.model, controller, hook_sites(points))
    try:
        if not attachment.attached:
            raise RuntimeError("hooks.attach attached nothing (L2PREFETCH_DISABLE is set?)")
        got = dec.step().clone()
    finally:
        attachment.detach()
    return ref, got, controller.stats()


# ---------------------------------------------------------------- CPU run

def run_cpu(args, config):
    failures = []
    t0 = time.perf_counter()
    model = build_model(config, "cpu")
    plan = deepseek_v3.plan(model, points=args.points)
    points = deepseek_v3.hook_points(model, args.points)
    lines = [f"DeepSeek-V3 on the CPU (eager, fake controller): transformers "
             f"{_transformers_version()}, torch {torch.__version__}, built in "
             f"{time.perf_counter() - t0:.1f} s; points {', '.join(args.points)}.", "",
             model_summary(model, plan), "", format_plan(plan)]

    sites = {(point, layer) for point, pairs in points.items() for _m, layer in pairs}
    planned = {(e.point, e.layer) for e in plan}
    ok = sites == planned
    lines.append(f"Plan keys match the hook sites: {yes(ok)} ({len(sites)} sites)"
                 + ("" if ok else f"; only in plan {sorted(planned - sites)}, only hooked "
                    f"{sorted(sites - planned)}"))
    if not ok:
        failures.append("plan keys != hook sites")

    rows = []
    for batch in args.batches:
        t1 = time.perf_counter()
        dec = Decoder(model, batch)
        lengths, positions = dec.counters()
        prefill_ok = lengths == [PROMPT_LEN] * len(lengths) and positions == [PROMPT_LEN]
        fake = FakeController(plan)
        ref, got, _stats = eager_pair(dec, fake, args.points)
        same = bitwise_equal(ref, got)
        calls = dict(fake.calls)
        want = {(e.point, e.layer, batch): 1 for e in plan if batch in e.batches}
        forks_ok = calls == want and fake.joins == 1
        lengths, positions = dec.counters()
        advanced = lengths == [PROMPT_LEN + 1] * len(lengths) and positions == [PROMPT_LEN + 1]
        # A second step without reset: the cache and positions advance again; its logits
        # agree (bf16 rounding aside) with a full forward over prompt + two tokens.
        second = dec.step()
        lengths, positions = dec.counters()
        advanced2 = lengths == [PROMPT_LEN + 2] * len(lengths) and positions == [PROMPT_LEN + 2]
        full = model(input_ids=torch.cat([dec.prompt, dec.ids, dec.ids], dim=1)).logits[:, -1:]
        cos = float(torch.nn.functional.cosine_similarity(second.float().flatten(1),
                                                          full.float().flatten(1)).min())
        argmax = bool(torch.equal(second.argmax(-1), full.argmax(-1)))
        rows.append([batch, yes(prefill_ok), yes(same), counts_text(fork_counts(fake.stats())),
                     fake.joins, yes(forks_ok), yes(advanced and advanced2),
                     f"{cos:.5f} / {'same' if argmax else 'differs'}",
                     f"{time.perf_counter() - t1:.1f}"])
        for name, good in (("prefill counters", prefill_ok), ("bitwise logits", same),
                           ("forks", forks_ok), ("cache advances", advanced and advanced2),
                           ("cached step vs full forward", cos > 0.99)):
            if not good:
                failures.append(f"batch {batch}: {name}")
        if not forks_ok:
            lines.append(f"batch {batch}: fork calls {sorted(calls.items())}, wanted "
                         f"{sorted(want.items())}, joins {fake.joins}")
    lines += ["", table(["batch", "prefill counters", "logits bitwise equal with hooks",
                         "forks per step", "joins", "forks as planned", "cache advances",
                         "2nd step vs uncached forward: min cos / argmax (info)", "s"], rows)]
    return lines, failures


# ---------------------------------------------------------------- GPU run

def median(xs):
    return statistics.median(xs)


def spread(xs):
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / 2


def time_eager(variants, reps):
    """Eager steps, interleaved: variants {name: (before or None, run)}, the order rotated
    each round.  Returns ({name: GPU us of each run(), between CUDA events}, {name: host us
    of each run(), perf_counter}).  (Graph replays are timed by the package's Rig.)"""
    names = list(variants)
    pairs = {name: [] for name in names}
    host = {name: [] for name in names}
    for rep in range(reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            before, run = variants[name]
            if before is not None:
                before()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            run()
            end.record()
            host[name].append((time.perf_counter() - t0) * 1e6)
            pairs[name].append((start, end))
    torch.cuda.synchronize()
    return {name: [s.elapsed_time(e) * 1e3 for s, e in ps] for name, ps in pairs.items()}, host


def instance_ratio(a, b):
    """"a/b (low-high)": the ratio of the means of two lists of per-instance medians, and
    the ratio at the ends of the 95% Welch interval of mean(a) - mean(b), mean(a) held
    (l2prefetch.tuning.stats, as the tuner accepts; instances vary more than replays of
    one instance do).  One instance each: the ratio alone."""
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    if min(len(a), len(b)) < 2:
        return f"{ma / mb:.4f}"
    d = diff_interval(a, b)
    return f"{ma / mb:.4f} ({ma / (ma - d.low):.4f}-{ma / (ma - d.high):.4f})"


@contextlib.contextmanager
def attached(model, controller, points=None):
    if controller is None:
        yield None
        return
    attachment = hooks.attach(model, controller, hook_sites(points))
    if not attachment.attached:
        raise RuntimeError("hooks.attach attached nothing (L2PREFETCH_DISABLE is set?)")
    try:
        yield attachment
    finally:
        attachment.detach()


class Toggle:
    """Hooks of controller on model at points, attached or not."""

    def __init__(self, model, controller, points=None):
        self.model, self.controller, self.attachment = model, controller, None
        self.points = points

    def set(self, on):
        if on and self.attachment is None:
            self.attachment = hooks.attach(self.model, self.controller, hook_sites(self.points))
            if not self.attachment.attached:
                raise RuntimeError("hooks.attach attached nothing (L2PREFETCH_DISABLE is set?)")
        elif not on and self.attachment is not None:
            self.attachment.detach()
            self.attachment = None


def capture(rig, dec, controller, warmup=2, points=None):
    """Capture one decode step with rig (with controller's hooks at points when not
    None): (graph, logits, stats).  The warm-up steps run on the rig's capture stream,
    each from the prompt length; the stats count the captured forks only."""
    with attached(dec.model, controller, points):
        rig.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(rig.stream):
            for _ in range(warmup):
                dec.reset()
                dec.step()
        torch.cuda.current_stream().wait_stream(rig.stream)
        dec.reset()
        torch.cuda.synchronize()
        if controller is not None:
            controller.reset_stats()
        graph, logits = rig.capture(dec.step, warmup=0)
        stats = controller.stats() if controller is not None else {}
    torch.cuda.synchronize()
    return graph, logits, stats


def locate_capture_failure(dec):
    """Capture again with a global pre-hook that notes the module entered last."""
    names = {module: name for name, module in dec.model.named_modules()}
    last = ["(before the first module)"]

    def note(module, args):
        last[0] = f"{names.get(module, '?')} ({type(module).__name__})"

    handle = torch.nn.modules.module.register_module_forward_pre_hook(note)
    try:
        dec.reset()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dec.step()
        return None
    except Exception as exc:                                   # noqa: BLE001
        return f"{last[0]}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        handle.remove()
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()


NOTE_C = (
    "(c) is not the step's physical limit: the plan reads ~16 MiB per layer and the L2 holds "
    "60 MiB (~40 MiB usable for re-reads), and the dense MLP of layer 0 and the routed experts "
    "of every MoE layer stream hundreds of MiB through L2 between the pre-step read and the "
    "planned consumers, so most of what (c) loads is evicted before use (a-c near 0 says so). "
    "The prize per fork is its consumer's cold-to-hot gap (1.3-2.6 us at 16 MiB, less under "
    "graph capture; h200-facts.md), so the step's limit is of the order of forks x 2 us.")


class Results:
    """The tables' rows and the failures, filled batch by batch."""

    def __init__(self):
        self.graph, self.eager, self.checks, self.notes, self.failures = [], [], [], [], []
        self.branch, self.instances = [], []

    def check(self, ok, message):
        if not ok:
            self.failures.append(message)
        return ok

    def tables(self):
        out = [
            "Decode step in CUDA-graph replay, median us (+- half the interquartile range): "
            "(a) no prefetch, (b) l2prefetch forks (graph_fork='inline', the default), (d) the "
            "same forks with empty tables (the "
            "control), (c) graph (a) right after the plan's bytes were read (hot before step). "
            "a-b > 0: prefetch is faster; d-b: the loads' gain net of the fork nodes.", "",
            table(["batch", "(a) none", "(b) prefetch", "(d) empty forks",
                   "(c) hot before step", "a/b", "a-b", "d-b", "a-c", "forks in graph",
                   "MiB per step", "MiB read for (c)"], self.graph),
            "", "The same plan with graph_fork='branch' (each fork a side branch of the graph, "
            "the join at the end; the default 'inline' puts the loader on the captured stream "
            "with launch-order edges), same run, median us:", "",
            table(["batch", "(a) none", "(e) branch prefetch", "(f) branch empty forks", "a/e",
                   "f-a: cost of the empty branch forks", "d-a: cost of the empty inline forks"],
                  self.branch),
            "", "Median per graph instance (each variant captured and instantiated separately; "
            "the tables above pool the instances), us, and the ratios of the instances' means "
            "with their 95% intervals (Welch, over the instances: instances differ more than "
            "replays of one do):", "",
            table(["batch", "(a) none", "(b) prefetch", "(d) empty forks", "a/b by instances",
                   "a/d by instances"], self.instances),
            "", "Eager decode step (no graph; host-bound), median us: GPU time between CUDA "
            "events (+- half the interquartile range) with no hooks, with the plan's hooks and "
            "controller (eager forks), and with the same hooks on a controller made with "
            "eager=False (its forks return False outside a capture); and the host's time to "
            "issue the step (perf_counter):", "",
            table(["batch", "no prefetch", "prefetch", "ratio", "prefetch, eager=False",
                   "ratio, eager=False", "host: no prefetch", "host: prefetch", "host ratio",
                   "forks per eager step"], self.eager),
            "", "Checks on the same step's logits (bitwise: the bytes are equal):", "",
            table(["batch", "eager: prefetch == none", "graph: prefetch == none",
                   "graph: empty forks == none", "replays advance the cache",
                   "graph vs eager: max abs diff / argmax (info)"], self.checks),
            "", NOTE_C]
        if self.notes:
            out += [""] + [f"- {note}" for note in self.notes]
        return out


def measure_batch(args, rig, model, plan, controller, empty, batch, res, branch=(None, None),
                  capture_only=None):
    tb = time.perf_counter()
    dec = Decoder(model, batch)
    want = expected_forks(plan, batch)

    # -- eager: bitwise and forks, then time
    ref, got, stats = eager_pair(dec, controller, args.points)
    eager_forks = fork_counts(stats)
    eager_same = res.check(bitwise_equal(ref, got),
                           f"batch {batch}: eager logits differ with prefetch "
                           f"(max abs diff {max_abs_diff(ref, got):.3g})")
    res.check(eager_forks == want, f"batch {batch}: eager forks {eager_forks}, planned {want}")
    if capture_only is not None:
        # eager=False: the hooks run, the forks return False outside a capture.
        ref2, got2, stats2 = eager_pair(dec, capture_only, args.points)
        res.check(bitwise_equal(ref2, got2) and not any(fork_counts(stats2).values()),
                  f"batch {batch}: eager=False forked {fork_counts(stats2)} in an eager step "
                  f"or changed its logits")
    toggles = {"none": None, "prefetch": Toggle(model, controller, args.points)}
    if capture_only is not None:
        toggles["eager=False"] = Toggle(model, capture_only, args.points)

    def select(name):
        for other, toggle in toggles.items():
            if toggle is not None and other != name:
                toggle.set(False)
        if toggles[name] is not None:
            toggles[name].set(True)

    for name in toggles:                               # warm every path once
        select(name)
        dec.reset()
        dec.step()
    # Hooks are attached or removed before the start event: only the step is timed
    # (eager timing is host-bound, so the forks' host cost is in it).  Each timed step
    # follows an untimed one in the same state: a server keeps its hooks attached, and
    # the first step after attaching them is not what it runs.
    def before(name):
        select(name)
        dec.reset()
        dec.step()
        dec.reset()

    times, host = time_eager(
        {name: (lambda name=name: before(name), dec.step) for name in toggles}, args.eager_reps)
    select("none")
    ea, eb = median(times["none"]), median(times["prefetch"])
    ha, hb = median(host["none"]), median(host["prefetch"])
    row = [batch, f"{ea:.0f} +-{spread(times['none']):.0f}",
           f"{eb:.0f} +-{spread(times['prefetch']):.0f}", f"{ea / eb:.3f}"]
    if "eager=False" in times:
        ec = median(times["eager=False"])
        row += [f"{ec:.0f} +-{spread(times['eager=False']):.0f}", f"{ea / ec:.3f}"]
    else:
        row += ["-", "-"]
    row += [f"{ha:.0f}", f"{hb:.0f}", f"{ha / hb:.3f}", counts_text(eager_forks)]
    res.eager.append(row)

    # -- graphs: capture (a), (b), (d)
    graphs = {}
    variants = [("a", None), ("b", controller), ("d", empty)]
    if branch[0] is not None:
        variants += [("e", branch[0]), ("f", branch[1])]
    for name, ctrl in variants:
        try:
            graphs[name] = capture(rig, dec, ctrl, points=args.points)
        except Exception as exc:                                  # noqa: BLE001
            traceback.print_exc()
            if ctrl is not None:
                with contextlib.suppress(Exception):
                    ctrl.join()
            where = locate_capture_failure(dec)
            first = str(exc).splitlines()[0] if str(exc) else ""
            res.check(False, f"batch {batch}: capture of ({name}) failed: "
                             f"{type(exc).__name__}: {first}"
                             + (f"; without hooks the capture fails in {where}" if where else
                                "; without hooks the step captures, so the hooks are to blame"))
            res.checks.append([batch, yes(eager_same), "-", "-", "-", "-"])
            return

    outs = {}
    for name, (graph, logits, _stats) in graphs.items():
        dec.reset()
        graph.replay()
        outs[name] = logits.clone()
    dec.reset()                                        # a replayed step advances the cache
    graphs["a"][0].replay()
    graphs["a"][0].replay()
    lengths, positions = dec.counters()
    advances = res.check(lengths == [PROMPT_LEN + 2] * len(lengths)
                         and positions == [PROMPT_LEN + 2],
                         f"batch {batch}: two replays leave cache lengths {lengths}, "
                         f"positions {positions} (want {PROMPT_LEN + 2})")
    graph_same = res.check(bitwise_equal(outs["a"], outs["b"]),
                           f"batch {batch}: graph logits differ with prefetch (max abs diff "
                           f"{max_abs_diff(outs['a'], outs['b']):.3g})")
    empty_same = res.check(bitwise_equal(outs["a"], outs["d"]),
                           f"batch {batch}: graph logits differ with empty forks")
    graph_forks, empty_forks = fork_counts(graphs["b"][2]), fork_counts(graphs["d"][2])
    res.check(graph_forks == want and empty_forks == want,
              f"batch {batch}: forks captured {graph_forks} (empty tables: {empty_forks}), "
              f"planned {want}")
    graph_mib = sum(s["bytes"] for s in graphs["b"][2].values()) / MIB
    res.checks.append([batch, yes(eager_same), yes(graph_same), yes(empty_same), yes(advances),
                       f"{max_abs_diff(outs['a'], ref):.3g} / "
                       + ("same" if torch.equal(outs["a"].argmax(-1), ref.argmax(-1))
                          else "differs")])

    # -- time the replays, interleaved
    views = plan_views(plan, batch)
    hot_mib = sum(v.numel() * v.element_size() for v in views) / MIB

    def hot():
        dec.reset()
        for view in views:
            view.sum()

    # A graph's replay time depends on the instance (the same capture, instantiated again,
    # can differ by tens of us), so every variant is captured args.instances times and its
    # samples are pooled over the instances.  (c) replays (a)'s first instance after the
    # plan's bytes were read.
    replayed = {(name, 0): graph for name, (graph, _l, _s) in graphs.items()}
    for i in range(1, args.instances):
        for name, ctrl in variants:
            replayed[name, i] = capture(rig, dec, ctrl, points=args.points)[0]
    replayed["c", 0] = graphs["a"][0]
    raw = rig.replays(replayed, args.graph_reps,
                      lambda key: hot() if key[0] == "c" else dec.reset())
    del replayed
    times, per_instance = {}, {}
    for (name, _i), xs in raw.items():
        times.setdefault(name, []).extend(xs)
        per_instance.setdefault(name, []).append(median(xs))
    res.instances.append([batch] + [
        " / ".join(f"{m:.1f}" for m in per_instance[k]) for k in "abd"]
        + [instance_ratio(per_instance["a"], per_instance[k]) for k in "bd"])
    a, b, d, c = (median(times[k]) for k in "abdc")
    cell = {k: f"{median(times[k]):.1f} +-{spread(times[k]):.1f}" for k in times}
    res.graph.append([batch] + [cell[k] for k in "abdc"]
                     + [f"{a / b:.4f}", f"{a - b:+.1f}", f"{d - b:+.1f}", f"{a - c:+.1f}",
                        counts_text(graph_forks), f"{graph_mib:.1f}", f"{hot_mib:.1f}"])
    if "e" in times:
        e, f = median(times["e"]), median(times["f"])
        res.branch.append([batch, cell["a"], cell["e"], cell["f"], f"{a / e:.4f}",
                           f"{f - a:+.1f}", f"{d - a:+.1f}"])
        res.check(bitwise_equal(outs["a"], outs["e"]) and bitwise_equal(outs["a"], outs["f"]),
                  f"batch {batch}: graph logits differ with graph_fork='branch'")
    print(f"batch {batch}: graph a {a:.1f} b {b:.1f} d {d:.1f} c {c:.1f} us; eager {ea:.0f} / "
          f"{eb:.0f} us; bitwise eager {eager_same}, graph {graph_same}, empty {empty_same}; "
          f"{time.perf_counter() - tb:.1f} s", flush=True)


def run_gpu(args, config):
    from l2prefetch import _C

    if hooks.disabled() or l2prefetch.disabled():
        return ["L2PREFETCH_DISABLE is set: nothing to measure; unset it."], ["disabled"]
    torch.cuda.set_device(0)
    rig = Rig(0)
    info, drv = _C.device_info(0), _C.driver_info()
    t0 = time.perf_counter()
    model = build_model(config, "cuda:0")
    torch.cuda.synchronize()
    built = time.perf_counter() - t0
    plan = deepseek_v3.plan(model, points=args.points)
    if args.no_carveout or args.no_priority:
        import dataclasses

        plan = [dataclasses.replace(e, carveout=None if args.no_carveout else e.carveout,
                                    priority=False if args.no_priority else e.priority)
                for e in plan]
    t1 = time.perf_counter()
    controller = l2prefetch.PrefetchController.from_plan(plan, 0, kernel=args.kernel)
    empty = empty_controller(plan, 0, kernel=args.kernel)
    # The same plan forked to the side stream inside the graph (graph_fork="branch").
    branch = l2prefetch.PrefetchController.from_plan(plan, 0, kernel=args.kernel,
                                                     graph_fork="branch")
    branch_empty = empty_controller(plan, 0, kernel=args.kernel, graph_fork="branch")
    capture_only = l2prefetch.PrefetchController.from_plan(plan, 0, kernel=args.kernel,
                                                           eager=False)
    prepared = time.perf_counter() - t1
    header = (f"Device: {torch.cuda.get_device_name(0)} (sm_{info['sm']}, {info['sm_count']} "
              f"SMs, L2 {info['l2_bytes'] / MIB:.0f} MiB), driver {drv['version'] // 1000}."
              f"{drv['version'] % 1000 // 10}, torch {torch.__version__}, transformers "
              f"{_transformers_version()}, l2prefetch {l2prefetch.__version__}, "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.\n"
              f"Command: `{' '.join(['python -m benchmarks.deepseek', *args.argv])}`; model "
              "built in "
              f"{built:.1f} s, controllers prepared in {prepared * 1e3:.0f} ms; points "
              f"{', '.join(args.points)}; "
              f"{args.instances} graph instances x {args.graph_reps} replays and "
              f"{args.eager_reps} eager steps per variant "
              "and batch.")
    lines = [header, "", model_summary(model, plan), "", format_plan(plan)]
    print("\n".join(lines), flush=True)

    res = Results()
    for batch in args.batches:
        try:
            measure_batch(args, rig, model, plan, controller, empty, batch, res,
                          branch=(branch, branch_empty), capture_only=capture_only)
        except Exception as exc:                                  # noqa: BLE001
            traceback.print_exc()
            first = str(exc).splitlines()[0] if str(exc) else ""
            res.check(False, f"batch {batch}: {type(exc).__name__}: {first}")
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    tables = res.tables()
    print("\n" + "\n".join(tables), flush=True)
    for ctl in (controller, empty, branch, branch_empty, capture_only):
        ctl.close()
    return lines + [""] + tables, res.failures


def _transformers_version():
    import transformers

    return transformers.__version__


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.deepseek",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small model (fast; the tests' scale)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)),
                    help="comma-separated decode batches (default 1,2,4,8)")
    ap.add_argument("--instances", type=int, default=7,
                    help="graph instances per variant (replay time varies by instance)")
    ap.add_argument("--kernel", default=None,
                    help="prefetch kernel variant (default: the device's; see kernel_variants())")
    ap.add_argument("--no-carveout", action="store_true",
                    help="drop the plan's shared-memory carveout attributes")
    ap.add_argument("--no-priority", action="store_true",
                    help="drop the plan's stream-priority attributes")
    ap.add_argument("--points", default="next_attention",
                    help="comma-separated deepseek_v3 points to plan and hook (default "
                         "next_attention, the candidate; the policy's own default forks "
                         f"nowhere; all: {','.join(deepseek_v3.POINTS)})")
    ap.add_argument("--out", default=None,
                    help="also write the report to this Markdown file (default: print only)")
    args = ap.parse_args(argv)
    args.argv = argv
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.points = tuple(p for p in args.points.split(",") if p)
    unknown = [p for p in args.points if p not in deepseek_v3.POINTS]
    if unknown or not args.points:
        ap.error(f"--points: unknown point(s) {unknown}; choose from {deepseek_v3.POINTS}"
                 if unknown else f"--points: name at least one of {deepseek_v3.POINTS}")
    args.graph_reps, args.eager_reps = (100, 8) if args.quick else (200, 100)
    if importlib.util.find_spec("transformers") is None:
        print("benchmarks.deepseek needs transformers (5.17): pip install transformers==5.17.0")
        return 2
    if _transformers_version().split(".")[:2] != ["5", "17"]:
        print(f"warning: written against transformers 5.17, this is {_transformers_version()}")
    config = TINY_CONFIG if args.tiny else BENCH_CONFIG
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible: run with --device cpu for the CPU checks")
        return 2
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            if args.device == "cpu":
                lines, failures = run_cpu(args, config)
            else:
                lines, failures = run_gpu(args, config)
    except Exception as exc:                                      # noqa: BLE001
        traceback.print_exc()
        lines = [f"The run stopped: {type(exc).__name__}: {exc}"]
        failures = [f"{type(exc).__name__} before any batch was measured (traceback above)"]
    text = "\n".join(lines)
    if args.device == "cpu":
        print(text)
    verdict = ("All checks passed." if not failures else
               "FAILED checks:\n" + "\n".join(f"- {f}" for f in failures))
    print(f"\n{verdict}\n({time.perf_counter() - t0:.0f} s)")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("# DeepSeek-V3 (Hugging Face) with l2prefetch\n\n" + text + "\n\n"
                    + verdict + "\n")
        print(f"wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
