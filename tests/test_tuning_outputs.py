"""The measuring rig's output checks (tuning.outputs) on CPU tensors: bitwise means the
bytes, whatever the layout, the rank or the values (NaN, signed zeros)."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from l2prefetch.tuning.outputs import bitwise_equal, compare_outputs  # noqa: E402


def test_bitwise_equal_compares_bytes_in_every_layout():
    x = torch.tensor([[1.0, float("nan")], [-0.0, 2.0]], dtype=torch.bfloat16)
    assert bitwise_equal(x, x.clone())
    assert bitwise_equal(x.t(), x.clone().t())            # non-contiguous, NaN included
    assert bitwise_equal(x.t(), x.t().contiguous())       # the same values, another layout
    assert not bitwise_equal(x, torch.where(x == 0, torch.zeros_like(x), x))   # -0.0, +0.0
    assert not bitwise_equal(x.t(), x)                    # the same bytes, transposed values


def test_bitwise_equal_takes_a_scalar_and_nested_outputs():
    loss = torch.tensor(1.5)
    assert bitwise_equal(loss, torch.tensor(1.5))         # 0-dim: no view as bytes raised
    assert not bitwise_equal(loss, torch.tensor(1.25))
    assert not bitwise_equal(loss, torch.tensor([1.5]))   # shapes differ
    assert not bitwise_equal(loss, torch.tensor(1.5, dtype=torch.float64))
    out = (torch.ones(2), [None, loss])
    assert bitwise_equal(out, (torch.ones(2), [None, torch.tensor(1.5)]))
    assert not bitwise_equal(out, (torch.ones(2), [loss, None]))
    assert not bitwise_equal(out, (torch.ones(2),))


class _Graph:
    """A stand-in for a captured graph: replay() writes its value into a shared buffer."""

    def __init__(self, buffer, value):
        self.buffer, self.value = buffer, value

    def replay(self):
        self.buffer.copy_(self.value)


def test_compare_outputs_reads_each_graph_right_after_its_replay(caplog):
    buffer = torch.empty(3)
    same, other = torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([1.0, 2.0, 3.0])
    graphs = {("none", 0): _Graph(buffer, same), ("a", 0): _Graph(buffer, same),
              ("a", 1): _Graph(buffer, same), ("b", 0): _Graph(buffer, same),
              ("b", 1): _Graph(buffer, other)}
    out_of = {key: buffer for key in graphs}
    with caplog.at_level(logging.WARNING, "l2prefetch.tuning.measure"):
        identical = compare_outputs(1, graphs, out_of, lambda: None)
    assert identical == {"none": True, "a": True, "b": False}
    assert "arm b: outputs of instances [1] differ" in caplog.text
