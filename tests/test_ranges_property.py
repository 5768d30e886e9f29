"""compute_ranges against a pure-Python reference of README.md's range rules (hypothesis).

The rules ("What it guarantees", Ranges): weights in order, empty ones (a zero in the
shape) skipped; each range covers a weight's lowest to highest byte, 1 + sum((n-1)*stride)
elements for non-negative strides, the lowest byte moved down by negative ones; it must
start 16-byte aligned; with a byte cap each size is min(size, remaining) rounded down to
16 and the walk stops when fewer than 16 bytes remain (the weights after it are still
checked, alignment included: a list is valid or invalid whatever the cap, issue 21).  A span or a step that does not fit in
63 bits is an OverflowError, strides that reach below address 0 a ValueError, a range past
the top of the 64-bit address space an OverflowError; never a wrong range.

Inputs: __cuda_array_interface__ objects with random item sizes, shapes with zeros and
huge sizes, strides None / positive / zero / negative / huge, base addresses aligned or
not and near 0 or 2**64, and every kind of cap; and torch tensors (CPU: compute_ranges is
arithmetic) of random dtypes, sliced, strided, transposed, expanded (stride 0) and
as_strided.  hypothesis is pinned in dev.sh's PINS.
"""

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from l2prefetch import compute_ranges  # noqa: E402

I64 = (-(1 << 63), (1 << 63) - 1)
SETTINGS = dict(database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Iface:
    def __init__(self, ptr, shape, item, strides):
        self.ptr, self.shape, self.item, self.strides = ptr, shape, item, strides

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": f"|V{self.item}", "data": (self.ptr, False),
                "strides": self.strides, "version": 3}

    def __repr__(self):
        return f"Iface(ptr={self.ptr:#x}, shape={self.shape}, item={self.item}, strides={self.strides})"


def fits(*values):
    return all(I64[0] <= v <= I64[1] for v in values)


def span(base, shape, strides, item, scale):
    """(lowest byte, bytes) of one weight, None when empty; raises as the rules say."""
    if any(n == 0 for n in shape):
        return None
    if strides is None:                    # C-contiguous
        numel = 1
        for n in shape:
            numel *= n
        if not fits(numel, numel * item):
            raise OverflowError
        lo, nbytes = base, numel * item
    else:
        lo, nbytes = strided(base, shape, strides, item, scale)
    if lo + nbytes - 1 >= 1 << 64:
        raise OverflowError
    return lo, nbytes


def strided(base, shape, strides, item, scale):
    pos = neg = 0
    for n, s in zip(shape, strides):
        step = s * scale
        off = step * (n - 1)
        if not fits(step, off):
            raise OverflowError
        if off < 0:
            neg += off
        else:
            pos += off
        if not fits(pos, neg):
            raise OverflowError
    nbytes = pos - neg
    if not fits(nbytes, nbytes + item):
        raise OverflowError
    nbytes += item
    if base + neg < 0:
        raise ValueError("below address 0")
    return base + neg, nbytes


def reference(described, cap):
    """described: [(base, shape, strides, item, scale)] -> [(ptr, nbytes)] or an exception type."""
    out, remaining, spent = [], cap, False
    try:
        for base, shape, strides, item, scale in described:
            r = span(base, shape, strides, item, scale)
            if r is None:
                continue
            lo, size = r
            if lo % 16:
                raise ValueError("misaligned")
            if spent:
                continue
            if cap:
                size = min(size, remaining) // 16 * 16
                remaining -= size
            if size:
                out.append((lo, size))
            if cap and remaining < 16:
                spent = True
    except (ValueError, OverflowError) as exc:
        return type(exc)
    return out


def actual(weights, cap):
    try:
        return compute_ranges(weights, cap)
    except (ValueError, OverflowError) as exc:
        return type(exc)


# -- __cuda_array_interface__ objects ------------------------------------------------------

sizes = st.one_of(st.integers(0, 6), st.integers(0, 6), st.integers(0, 6),
                  st.sampled_from([1 << 20, 1 << 40, 1 << 62, (1 << 63) - 1]))
strides_of = st.one_of(st.integers(-64, 64), st.integers(-(1 << 20), 1 << 20),
                       st.sampled_from([0, 1 << 40, -(1 << 40), 1 << 62, -(1 << 62), I64[1], I64[0]]))
bases = st.one_of(st.integers(0, 1 << 12).map(lambda i: (1 << 40) + 16 * i),
                  st.integers(0, 1 << 12).map(lambda i: (1 << 40) + i),
                  st.integers(0, 64),
                  st.sampled_from([(1 << 64) - 16, (1 << 64) - 4096, 1 << 63]))
caps = st.one_of(st.just(0), st.integers(0, 1 << 16), st.integers(0, 64),
                 st.sampled_from([15, 16, 17, 31, 32, 1 << 62, (1 << 63) - 1]))


@st.composite
def iface(draw):
    nd = draw(st.integers(0, 4))
    shape = tuple(draw(sizes) for _ in range(nd))
    item = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    strides = None if draw(st.booleans()) else tuple(draw(strides_of) for _ in range(nd))
    return Iface(draw(bases), shape, item, strides)


@settings(max_examples=4000, **SETTINGS)
@given(st.lists(iface(), max_size=6), caps)
def test_interface_objects_follow_the_rules(weights, cap):
    described = [(w.ptr, w.shape, w.strides, w.item, 1) for w in weights]
    assert actual(weights, cap) == reference(described, cap)


# -- torch tensors -------------------------------------------------------------------------

torch = pytest.importorskip("torch")
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
          torch.uint8, torch.int32, torch.int64, torch.complex64, torch.bool]


@st.composite
def tensor(draw):
    dtype = draw(st.sampled_from(DTYPES))
    nd = draw(st.integers(0, 3))
    shape = [draw(st.integers(0, 5)) for _ in range(nd)]
    t = torch.zeros(shape, dtype=dtype)
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["slice", "transpose", "expand", "as_strided", "narrow"]))
        if op == "slice" and t.dim():
            d = draw(st.integers(0, t.dim() - 1))
            start, step = draw(st.integers(0, 2)), draw(st.integers(1, 3))
            t = t[(slice(None),) * d + (slice(start, None, step),)]
        elif op == "transpose" and t.dim() >= 2:
            t = t.transpose(0, t.dim() - 1)
        elif op == "expand":
            t = t.unsqueeze(0).expand(draw(st.integers(0, 4)), *t.shape)   # stride 0
        elif op == "as_strided" and t.numel():
            n = t.untyped_storage().nbytes() // t.element_size()
            size = [draw(st.integers(0, 3)) for _ in range(draw(st.integers(0, 3)))]
            stride = [draw(st.integers(0, 3)) for _ in size]
            reach = sum((s - 1) * k for s, k in zip(size, stride) if s) + 1
            if all(size) and reach + 1 > n:
                continue
            t = torch.as_strided(t, size, stride, draw(st.integers(0, max(0, n - reach - 1))))
        elif op == "narrow" and t.dim() and t.shape[0]:
            t = t.narrow(0, draw(st.integers(0, t.shape[0] - 1)), 1)
    return t


@settings(max_examples=600, **SETTINGS)
@given(st.lists(tensor(), max_size=4), caps)
def test_tensors_follow_the_rules(weights, cap):
    described = [(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size(),
                  t.element_size()) for t in weights]
    assert actual(weights, cap) == reference(described, cap)


def test_the_reference_matches_the_readme_examples():
    """A few cases worked by hand, so that the reference itself is checked."""
    base = 1 << 40
    w = Iface(base, (4, 8), 2, None)                   # 64 bytes
    assert reference([(base, (4, 8), None, 2, 1)], 0) == [(base, 64)]
    assert actual([w], 0) == [(base, 64)]
    assert actual([w, w], 100) == [(base, 64), (base, 32)]          # 100 - 64 = 36 -> 32
    assert actual([w, w, Iface(base + 16, (1,), 2, None)], 64) == [(base, 64)]  # spent first
    # misaligned past the spent cap: refused all the same (issue 21)
    assert actual([w, w, Iface(base + 8, (1,), 2, None)], 64) is ValueError
    assert reference([(base, (4, 8), None, 2, 1), (base + 8, (1,), None, 2, 1)], 64) is ValueError
    assert actual([Iface(base + 64, (3,), 4, (-16,))], 0) == [(base + 32, 36)]  # negative
    assert actual([Iface(base, (0, 1 << 62, 1 << 62), 8, None)], 0) == []      # zero-size
