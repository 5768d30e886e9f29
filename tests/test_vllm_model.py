"""The vLLM-shaped decoder of benchmarks/vllm_model.py on the CPU (issue 40): it builds
and decodes at vLLM's capture sizes, discovery finds its fused projections' roles,
hooks fork at them with the decode batch (its attention takes the positions first),
and compiled (Inductor's CPU backend) with a fork at every offered site it computes
what it computes without them.  tests/test_vllm_model_gpu.py captures it."""

from __future__ import annotations

import shutil

import pytest
import torch

from benchmarks import vllm_model as vm
from l2prefetch import hooks
from l2prefetch.tuning import candidates, discover
from l2prefetch.tuning.compiled import Switchboard, recompile


class Recorder:
    def __init__(self):
        self.calls = []

    def fork(self, point, layer, batch):
        self.calls.append((point, layer, batch))
        return True

    def join(self):
        self.calls.append(("join",))


def _model():
    torch.manual_seed(0)
    model = vm.Model(vm.TINY).to(torch.bfloat16).eval()
    return model, vm.Decode(model, prompt_len=20)


def test_it_decodes_at_every_capture_size_and_the_same_twice():
    model, step = _model()
    with torch.no_grad():
        for batch in vm.CAPTURE_SIZES:
            out = step(batch)
            assert out.shape == (batch, vm.TINY.vocab) and torch.isfinite(out.float()).all()
            assert torch.equal(step(batch), out)          # the same work every replay


def test_discovery_finds_the_fused_projections_roles():
    model, step = _model()
    roles = {r.name: r for r in candidates(model, discover(model, lambda: step(2),
                                                           min_bytes=1 << 16))}
    for name in ("after self_attn.qkv_proj: self_attn.o_proj",
                 "after self_attn.o_proj: mlp.gate_up_proj",
                 "before post_attention_layernorm: mlp.gate_up_proj",
                 "after mlp.gate_up_proj: mlp.down_proj",
                 "after mlp.down_proj: next self_attn.qkv_proj"):
        assert name in roles
    assert len(roles["after self_attn.qkv_proj: self_attn.o_proj"].sites) == vm.TINY.layers


def test_hooks_fork_with_the_decode_batch_where_positions_come_first():
    """self_attn's forward(positions [B], hidden [B, H]): the batch is B, not 1."""
    model, step = _model()
    rec = Recorder()
    sites = {"attn": [(layer.self_attn, i) for i, layer in enumerate(model.model.layers)],
             "qkv": [(layer.self_attn.qkv_proj, i)
                     for i, layer in enumerate(model.model.layers)]}
    with hooks.attach(model, rec, sites), torch.no_grad():
        step(8)
    assert rec.calls == [("qkv", 0, 8), ("attn", 0, 8), ("qkv", 1, 8), ("attn", 1, 8),
                         ("join",)]


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="Inductor's CPU backend needs a C++ compiler")
def test_compiled_with_forks_at_after_sites_it_computes_the_same():
    model, step = _model()
    model.forward = torch.compile(model.forward)
    recompile()
    try:
        with torch.no_grad():
            reference = step(2).clone()
        sites = [(layer.self_attn.o_proj, i, "after") for i, layer in
                 enumerate(model.model.layers)]
        sites += [(layer.mlp.gate_up_proj, i, "after") for i, layer in
                  enumerate(model.model.layers)]
        board = Switchboard(model, sites)
        rec = Recorder()
        try:
            with board.selected(rec, {"o": [s[:2] for s in sites[:2]],
                                      "g": [s[:2] for s in sites[2:]]}), torch.no_grad():
                out = step(2)
        finally:
            board.close()
        assert torch.equal(out.view(torch.int16), reference.view(torch.int16))
        assert sorted(c for c in rec.calls if c[0] != "join") == [
            ("g", 0, 2), ("g", 1, 2), ("o", 0, 2), ("o", 1, 2)]
    finally:
        recompile()
