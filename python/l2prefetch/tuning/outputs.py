"""A step's outputs in the measuring rig: copied out of a graph's pool, compared bitwise.

An output is a tensor, or a tuple or list of outputs (None allowed): what a decode
step returns (its logits), which every measured arm must reproduce bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Optional

from .arms import NO_FORKS, SAME_CODE

__all__ = ["bitwise_equal", "clone", "compare_outputs", "compare_within", "copy_into",
           "max_diff"]

logger = logging.getLogger("l2prefetch.tuning.measure")   # the measuring rig's messages


def bitwise_equal(x: Any, y: Any) -> bool:
    """Whether outputs ``x`` and ``y`` have the same structure, shapes, dtypes and bits."""
    import torch

    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        # compared as bytes, whatever the layout or the rank: by value, NaN would differ
        # from itself and -0.0 equal +0.0
        return (x.shape == y.shape and x.dtype == y.dtype
                and bool(torch.equal(_bytes(x), _bytes(y))))
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(bitwise_equal(a, b) for a, b in zip(x, y))
    return x is None and y is None


def _bytes(x: Any) -> Any:
    """A tensor's bytes, in its logical order (a 0-dim tensor's too)."""
    import torch

    return x.detach().contiguous().reshape(-1).view(torch.uint8)


def clone(x: Any) -> Any:
    """A copy of an output that later replays cannot overwrite."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (tuple, list)):
        return type(x)(clone(v) for v in x)
    return x


def copy_into(dst: Any, src: Any) -> bool:
    """Copy output ``src`` into buffers ``dst`` of the same structure, shapes and
    dtypes; False (nothing copied) where they differ."""
    import torch

    def fits(d: Any, s: Any) -> bool:
        if isinstance(d, torch.Tensor) and isinstance(s, torch.Tensor):
            return d.shape == s.shape and d.dtype == s.dtype and d.device == s.device
        if isinstance(d, (tuple, list)) and isinstance(s, (tuple, list)):
            return len(d) == len(s) and all(fits(a, b) for a, b in zip(d, s))
        return d is None and s is None

    def copy(d: Any, s: Any) -> None:
        if isinstance(d, torch.Tensor):
            d.copy_(s)
        elif isinstance(d, (tuple, list)):
            for a, b in zip(d, s):
                copy(a, b)

    if not fits(dst, src):
        return False
    copy(dst, src)
    return True


def max_diff(x: Any, y: Any) -> Optional[float]:
    """The largest absolute difference of two tensors of one shape (else None)."""
    import torch

    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape:
        return (x.float() - y.float()).abs().max().item()
    return None


def compare_outputs(batch: int, graphs: Mapping[tuple[str, int], Any],
                    out_of: Mapping[tuple[str, int], Any],
                    synchronize: Callable[[], None],
                    against: Optional[Mapping[str, str]] = None,
                    first: str = NO_FORKS) -> dict[str, bool]:
    """Per arm (``graphs`` and ``out_of`` are keyed ``(arm, instance)``), whether the
    outputs of all its instances are bitwise those of ``(first, 0)``, by default the
    no-fork step's first instance; an arm named in ``against`` is compared instead with
    that arm's graph of the same instance (its own step without forks: one compilation,
    where two compilations of the step differ).  Each graph is replayed once more and its output
    compared right after (an ``against`` reference replayed and copied just before):
    graphs that share a pool (or a switched graph's states) share buffers, so a later
    replay overwrites an earlier output.  Differences are logged with their size."""
    against = against or {}

    def replay(key: tuple[str, int]) -> Any:
        graphs[key].replay()
        synchronize()
        return out_of[key]

    common = clone(replay((first, 0))) if (first, 0) in graphs else None
    differ: dict[str, list[tuple[int, Optional[float]]]] = {}
    for key in graphs:
        name, i = key
        own = (against[name], i) if name in against else None
        reference = clone(replay(own)) if own in graphs else common
        out = replay(key)
        differ.setdefault(name, [])
        if not bitwise_equal(reference, out):
            differ[name].append((i, max_diff(reference, out)))
    for name, bad in differ.items():
        if bad:
            what = (f"{against[name]!r} (its own step without forks)" if name in against
                    else "the no-fork step's first instance" if first == NO_FORKS
                    else f"{first!r}'s first instance")
            logger.warning("batch %d, arm %s: outputs of instances %s differ from %s (max "
                           "abs diff %s)", batch, name, [i for i, _ in bad], what,
                           [d for _, d in bad])
    return {name: not bad for name, bad in differ.items()}


def compare_within(batch: int, graphs: Mapping[tuple[str, int], Any],
                   out_of: Mapping[tuple[str, int], Any], synchronize: Callable[[], None],
                   references: Mapping[str, str]) -> dict[str, bool]:
    """:func:`compare_outputs` within one compilation, where :data:`SAME_CODE` was
    captured: each arm with its own step without forks (``references``: arm -> key) where
    it has one, every other graph with SAME_CODE's first instance, (a), compiled apart,
    with itself; an arm whose own step without forks is not the code's fails with it."""
    identical = compare_outputs(batch, graphs, out_of, synchronize,
                                {NO_FORKS: NO_FORKS, **references}, first=SAME_CODE)
    for name, key in references.items():
        identical[name] = identical.get(name, True) and identical.get(key, True)
    return identical
