"""A model with a real idle window, to check that the tuner finds what pays on this GPU.

Each layer is ``a`` (a Linear), then a window in which one CTA spins and the
rest of the GPU is idle (as while waiting for a collective), then ``b`` (a
Linear).  A prefetch of ``b``'s weights forked when ``a`` returns runs in the
window and makes ``b`` start warm; every layer streams more than L2 holds,
so replays back to back do not leave ``b`` hot.  The tuner should keep the
role ``after a: b`` and recover most of ``b``'s cold-to-hot gap.

Needs torch with CUDA.
"""

from __future__ import annotations

from typing import Any

from .._torch import require

torch = require("l2prefetch.tuning.synthetic")

__all__ = ["IdleWindowModel", "idle_window_step"]


class _Spin(torch.nn.Module):
    """One CTA waiting ``cycles`` clock cycles (``torch.cuda._sleep``): a nearly idle GPU."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles

    def forward(self, x: Any) -> Any:
        torch.cuda._sleep(self.cycles)
        return x


class _Layer(torch.nn.Module):
    def __init__(self, hidden: int, cycles: int, dtype: Any, device: Any) -> None:
        super().__init__()
        nn = torch.nn
        self.a = nn.Linear(hidden, hidden, bias=False, dtype=dtype, device=device)
        self.window = _Spin(cycles)
        self.b = nn.Linear(hidden, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: Any) -> Any:
        return self.b(self.window(self.a(x)))


class IdleWindowModel(torch.nn.Module):
    """``layers`` of a -> spin of ``window_us`` -> b, each Linear ``hidden`` x ``hidden``
    (4096: 32 MiB in bf16), with random weights."""

    def __init__(self, layers: int = 4, hidden: int = 4096, window_us: float = 25.0, *,
                 dtype: Any = None, device: Any = "cuda", seed: int = 0) -> None:
        super().__init__()
        from .rig import spin_cycles_per_us

        dtype = torch.bfloat16 if dtype is None else dtype
        cycles = int(window_us * spin_cycles_per_us(device))
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList(_Layer(hidden, cycles, dtype, device)
                                          for _ in range(layers))
        self.hidden = hidden

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


def idle_window_step(model: IdleWindowModel) -> Any:
    """``step(batch)`` for :func:`l2prefetch.tuning.tune`: the model on a static input
    of ``[batch, hidden]`` (one buffer per batch, random values)."""
    inputs: dict[int, Any] = {}
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype

    def step(batch: int) -> Any:
        x = inputs.get(batch)
        if x is None:
            g = torch.Generator().manual_seed(batch)
            x = inputs[batch] = (torch.randn(batch, model.hidden, generator=g) * 0.05).to(
                device=device, dtype=dtype)
        return model(x)
    return step
