"""The small model of the torch.compile tests (test_compile_ops.py, test_compile_gpu.py).

Two decoder-like blocks and a head, bias-free linears and residual adds only,
so a compiler has nothing to change in the numerics (no fusable chain of
pointwise ops whose intermediate rounding it could skip).  Forks follow
``attn.o_proj`` of every layer ("oproj_down") and ``mlp`` of every layer but
the last ("next_attention"); the join follows the head.  :class:`Model` gets
them from ``hooks.attach(model, controller, points(model))``,
:class:`Direct` calls the ops in its own forward.
"""

import torch
from torch import nn

from l2prefetch import ops


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.attn = nn.Module()
        self.attn.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        x = x + self.attn.o_proj(x)
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self, hidden=16, count=2):
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden) for _ in range(count))
        self.head = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Direct(Model):
    """Model's computation with the forks and the join written into forward."""

    def __init__(self, hidden=16, count=2, handle=0):
        super().__init__(hidden, count)
        self.handle = handle

    def forward(self, x):
        batch = x.numel() // x.shape[-1]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = layer.attn.o_proj(x)
            ops.fork(self.handle, "oproj_down", i, batch, after=h)
            x = x + h
            h = layer.mlp(x)
            if i < last:
                torch.ops.l2prefetch.fork(self.handle, "next_attention", i, batch, after=h)
            x = x + h
        out = self.head(x)
        ops.join(self.handle, after=out)
        return out


def points(model):
    """The hook points of Model (and of Direct's hand-written forks)."""
    last = len(model.layers) - 1
    return {
        "oproj_down": [(layer.attn.o_proj, i) for i, layer in enumerate(model.layers)],
        "next_attention": [(layer.mlp, i) for i, layer in enumerate(model.layers) if i < last],
    }


def expected_calls(count, batch):
    """What a recording controller sees for one forward of a count-layer model."""
    calls = []
    for i in range(count):
        calls.append(("fork", "oproj_down", i, batch))
        if i < count - 1:
            calls.append(("fork", "next_attention", i, batch))
    return calls + [("join",)]
