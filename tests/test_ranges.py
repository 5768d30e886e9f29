"""compute_ranges (csrc/ranges.c) against the reference design's range rules.

The seed (PreparedWeightRanges.__init__) walks the weights in order, skips
empty ones, requires each range to start 16-byte aligned, spans
``1 + sum((n - 1) * stride)`` elements, and with a byte cap spends the cap in
order in multiples of 16, stopping once fewer than 16 bytes remain (the
weights past that are still checked: a list is valid or not whatever the cap,
issue 21, so the references here check every weight's alignment first).  The C
code generalises that to negative strides (lowest to highest byte) and to
objects with __cuda_array_interface__.  Everything here is arithmetic: CPU and
meta tensors, and fake device arrays.
"""

import gc
import random
import sys

import pytest
import torch

import l2prefetch
from conftest import FakeArray

compute_ranges = l2prefetch.compute_ranges

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64, torch.uint8]
DEVICES = ["cpu", "meta"]


# ---------------------------------------------------------------- references


class Misaligned(Exception):
    def __init__(self, index):
        self.index = index


def check_alignment(weights, lowest_byte):
    """Every non-empty weight starts 16-byte aligned, whatever the cap (issue 21: the
    reference design's walk stopped at a spent cap and never looked further)."""
    for index, weight in enumerate(weights):
        _, shape, _, _ = describe(weight)
        if not any(n == 0 for n in shape) and lowest_byte(weight) % 16:
            raise Misaligned(index)


def seed_ranges(weights, byte_cap=0):
    """The seed's loop, verbatim but for the table (torch tensors only), after the
    alignment of every weight is checked (check_alignment)."""
    check_alignment(weights, lambda w: w.data_ptr())
    ranges, remaining = [], byte_cap
    for index, weight in enumerate(weights):
        if weight.numel() == 0:
            continue
        if weight.data_ptr() % 16:
            raise Misaligned(index)
        span = 1 + sum((n - 1) * s for n, s in zip(weight.shape, weight.stride()))
        size = span * weight.element_size()
        if byte_cap:
            size = min(size, remaining) // 16 * 16
            remaining -= size
        if size:
            ranges.append((weight.data_ptr(), size))
        if byte_cap and remaining < 16:
            break
    return ranges


def describe(weight):
    """(ptr, shape, byte strides, item size) of a tensor or a CAI object."""
    if isinstance(weight, torch.Tensor):
        item = weight.element_size()
        return (weight.data_ptr(), tuple(weight.shape),
                tuple(s * item for s in weight.stride()), item)
    cai = weight.__cuda_array_interface__
    item = int(cai["typestr"][2:])
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    if strides is None:  # C-contiguous
        strides, acc = [], item
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    return cai["data"][0], shape, tuple(strides), item


def lowest_byte(weight):
    ptr, shape, strides, _ = describe(weight)
    return ptr + sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)


def reference_ranges(weights, byte_cap=0):
    """The seed's rules over lowest..highest byte (any stride sign, CAI too)."""
    check_alignment(weights, lowest_byte)
    ranges, remaining = [], byte_cap
    for index, weight in enumerate(weights):
        ptr, shape, strides, item = describe(weight)
        if any(n == 0 for n in shape):
            continue
        lo = ptr + sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
        if lo % 16:
            raise Misaligned(index)
        size = sum((n - 1) * abs(s) for n, s in zip(shape, strides)) + item
        if byte_cap:
            size = min(size, remaining) // 16 * 16
            remaining -= size
        if size:
            ranges.append((lo, size))
        if byte_cap and remaining < 16:
            break
    return ranges


def outcome(fn, weights, byte_cap):
    """The ranges, or ('misaligned', index)."""
    try:
        return fn(weights, byte_cap)
    except Misaligned as exc:
        return ("misaligned", exc.index)


def c_outcome(weights, byte_cap):
    try:
        return compute_ranges(weights, byte_cap)
    except ValueError as exc:
        msg = str(exc)
        assert "16-byte aligned" in msg, msg
        index = int(msg.split("weight ", 1)[1].split(" ", 1)[0])
        return ("misaligned", index)


# ------------------------------------------------------------ random weights


def random_view(rng, device):
    """A random tensor view: strided, transposed, sliced, expanded, 0-dim, empty."""
    dtype = rng.choice(DTYPES)
    kind = rng.choice(["plain", "scalar", "empty", "transpose", "step", "offset", "expand",
                       "permute", "narrow", "as_strided", "offset_aligned"])
    dims = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
    if kind == "scalar":
        return torch.zeros((), dtype=dtype, device=device)
    if kind == "empty":
        dims[rng.randrange(len(dims))] = 0
        t = torch.empty(dims, dtype=dtype, device=device)
        return t[1:] if rng.random() < 0.5 and dims[0] > 1 else t
    if kind == "transpose":
        t = torch.empty(dims + [rng.randint(1, 6)], dtype=dtype, device=device)
        return t.transpose(0, -1)
    if kind == "step":
        t = torch.empty(dims + [rng.randint(2, 9)], dtype=dtype, device=device)
        return t[..., ::rng.randint(2, 3)]
    if kind == "offset":  # may or may not stay 16-byte aligned
        t = torch.empty([rng.randint(2, 6)] + dims, dtype=dtype, device=device)
        return t[rng.randint(1, t.shape[0] - 1):]
    if kind == "offset_aligned":  # rows of 16 bytes: every row starts aligned
        item = torch.empty((), dtype=dtype).element_size()
        t = torch.empty(rng.randint(2, 6), 16 // item * rng.randint(1, 3), dtype=dtype,
                        device=device)
        return t[rng.randint(1, t.shape[0] - 1):]
    if kind == "expand":
        t = torch.empty([1] + dims, dtype=dtype, device=device)
        return t.expand([rng.randint(1, 5)] + dims)
    if kind == "permute":
        t = torch.empty(dims + [2, 3], dtype=dtype, device=device)
        order = list(range(t.dim()))
        rng.shuffle(order)
        return t.permute(order)
    if kind == "narrow":
        t = torch.empty(dims + [rng.randint(2, 8)], dtype=dtype, device=device)
        return t.narrow(-1, 0, rng.randint(1, t.shape[-1]))
    if kind == "as_strided":
        t = torch.empty(512, dtype=dtype, device=device)
        shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        strides = [rng.randint(0, 8) for _ in shape]
        return t.as_strided(shape, strides, rng.choice([0, 0, 16, 32, rng.randint(1, 40)]))
    return torch.empty(dims, dtype=dtype, device=device)


def random_cai(rng):
    item = rng.choice([1, 2, 4, 8, 16])
    typestr = {1: "|u1", 2: "<f2", 4: "<f4", 8: "<f8", 16: "<c16"}[item]
    shape = tuple(rng.choice([0, 1, 2, 3, 5, 8]) if rng.random() < 0.1 else rng.randint(1, 8)
                  for _ in range(rng.randint(0, 3)))
    if rng.random() < 0.3:
        strides = None
    else:
        strides = tuple(rng.choice([-1, 1, 1, 2]) * item * rng.randint(0, 16) for _ in shape)
    # A base far enough from 0 for any negative stride, usually aligned.
    ptr = (1 << 32) + 16 * rng.randint(0, 1 << 12) + rng.choice([0, 0, 0, 0, item, 8])
    neg = -sum((n - 1) * s for n, s in zip(shape, strides or ()) if s < 0 and n > 0)
    if rng.random() < 0.7:
        ptr += (-(ptr - neg)) % 16  # lowest byte aligned
    return FakeArray(ptr, shape, typestr, strides)


def random_caps(rng, weights):
    try:
        total = sum(size for _, size in reference_ranges(weights))
    except Misaligned:
        total = 1 << 16
    return sorted({0, rng.randint(1, 15), 16, total, total + rng.randint(1, 100),
                   max(total - rng.randint(1, 40), 1), rng.randint(1, max(total, 1)),
                   16 * rng.randint(1, 64), total // 16 * 16})


# ------------------------------------------------------------ randomized cases


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("device", DEVICES)
def test_random_tensors_match_seed(seed, device):
    rng = random.Random(seed * 7919 + len(device))
    weights = [random_view(rng, device) for _ in range(rng.randint(0, 8))]
    for cap in random_caps(rng, weights):
        expected = outcome(seed_ranges, weights, cap)
        assert c_outcome(weights, cap) == expected, (cap, [
            (tuple(w.shape), w.stride(), w.dtype, w.data_ptr()) for w in weights])
        # The generalised reference agrees with the reference design on tensors.
        assert outcome(reference_ranges, weights, cap) == expected


@pytest.mark.parametrize("seed", range(60))
def test_random_cai_and_mixed_match_reference(seed):
    rng = random.Random(1_000_003 * seed)
    weights = []
    for _ in range(rng.randint(1, 8)):
        if rng.random() < 0.7:
            weights.append(random_cai(rng))
        else:
            weights.append(random_view(rng, rng.choice(DEVICES)))
    for cap in random_caps(rng, weights):
        assert c_outcome(weights, cap) == outcome(reference_ranges, weights, cap), (
            cap, [describe(w) for w in weights])


@pytest.mark.parametrize("seed", range(20))
def test_random_caps_never_exceed_cap_and_stay_granular(seed):
    rng = random.Random(seed)
    # at least 16 bytes each: a capped size is then 0 only once the cap is spent
    weights = [torch.empty(rng.randint(16, 300), dtype=rng.choice(DTYPES))
               for _ in range(rng.randint(1, 6))]
    full = compute_ranges(weights)
    for cap in random_caps(rng, weights):
        got = compute_ranges(weights, byte_cap=cap)
        assert sum(n for _, n in got) <= cap if cap else got == full
        if cap:
            assert all(n % 16 == 0 and n > 0 for _, n in got)
            # ranges are prefixes of the uncapped ones, in order
            assert [p for p, _ in got] == [p for p, _ in full[:len(got)]]
            assert all(n <= m for (_, n), (_, m) in zip(got, full))


# ------------------------------------------------------------ explicit tensors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_contiguous_size_is_numel_times_itemsize(device, dtype):
    t = torch.empty(3, 7, dtype=dtype, device=device)
    assert compute_ranges([t]) == [(t.data_ptr(), 21 * t.element_size())]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_dim_tensor_is_one_element(device, dtype):
    t = torch.zeros((), dtype=dtype, device=device)
    assert compute_ranges([t]) == [(t.data_ptr(), t.element_size())]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0,), (0, 4), (4, 0), (2, 0, 3)])
def test_empty_weights_are_skipped(device, shape):
    a = torch.empty(8, device=device)
    b = torch.empty(shape, device=device)
    c = torch.empty(4, dtype=torch.float64, device=device)
    assert compute_ranges([a, b, c]) == [(a.data_ptr(), 32), (c.data_ptr(), 32)]
    assert compute_ranges([b]) == []
    assert compute_ranges([]) == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0,), (4, 0), (0, 3, 2)])
@pytest.mark.parametrize("offset", [1, 4, 8])
def test_empty_weight_is_skipped_even_when_misaligned(device, shape, offset):
    # (torch reports data_ptr() 0 for empty tensors: a device array stands in)
    t = torch.empty(8, device=device)
    empty = FakeArray(0x1000 + offset, shape, "<f4")
    assert compute_ranges([empty, t, empty]) == [(t.data_ptr(), 32)]
    assert compute_ranges([empty, t], byte_cap=16) == [(t.data_ptr(), 16)]
    with pytest.raises(ValueError, match="16-byte aligned"):
        compute_ranges([FakeArray(0x1000 + offset, (1,), "<f4")])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("view, span", [
    (lambda x: x[:, ::2], 1 + 3 * 16 + 7 * 2),   # (4, 8) stride (16, 2)
    (lambda x: x.t(), 1 + 15 * 1 + 3 * 16),      # (16, 4) stride (1, 16)
    (lambda x: x[::2], 1 + 1 * 32 + 15),         # (2, 16) stride (32, 1)
    (lambda x: x[:, :5], 1 + 3 * 16 + 4),        # (4, 5)
    (lambda x: x[:1], 16),
    (lambda x: x[:, 3:3], 0),
])
def test_strided_views(device, dtype, view, span):
    base = torch.empty(4, 16, dtype=dtype, device=device)
    v = view(base)
    expected = [(v.data_ptr(), span * v.element_size())] if span else []
    assert compute_ranges([v]) == expected
    assert compute_ranges([v]) == seed_ranges([v])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_slice_that_keeps_alignment(device, dtype):
    item = torch.empty((), dtype=dtype).element_size()
    base = torch.empty(5, 32 // item, dtype=dtype, device=device)  # 32-byte rows
    v = base[1:]
    assert v.data_ptr() == base.data_ptr() + 32
    assert compute_ranges([v]) == [(base.data_ptr() + 32, 4 * 32)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_expand_zero_strides(device, dtype):
    row = torch.empty(1, 8, dtype=dtype, device=device)
    e = row.expand(1000, 8)
    assert e.stride()[0] == 0
    assert compute_ranges([e]) == [(row.data_ptr(), 8 * row.element_size())]
    s = torch.empty((), dtype=dtype, device=device).expand(3, 4, 5)
    assert compute_ranges([s]) == [(s.data_ptr(), s.element_size())]


def test_weights_in_order_and_any_iterable():
    ws = [torch.empty(n, dtype=torch.float32) for n in (4, 8, 12)]
    expected = [(w.data_ptr(), w.numel() * 4) for w in ws]
    assert compute_ranges(ws) == expected
    assert compute_ranges(tuple(ws)) == expected
    assert compute_ranges(iter(ws)) == expected
    assert compute_ranges(w for w in ws) == expected
    assert compute_ranges(ws[::-1]) == expected[::-1]
    assert compute_ranges(weights=ws, byte_cap=0) == expected


@pytest.mark.parametrize("cap, expected_sizes", [
    (0, [100, 64, 40]),
    (1, []),
    (15, []),
    (16, [16]),
    (31, [16]),
    (96, [96]),
    (100, [96]),        # 4 bytes left: the walk stops
    (112, [96, 16]),
    (160, [96, 64]),
    (170, [96, 64]),    # 10 left: stops before the third
    (176, [96, 64, 16]),
    (204, [96, 64, 32]),  # the exact total
    (10_000, [96, 64, 32]),
])
def test_cap_spent_in_order(cap, expected_sizes):
    sizes = [100, 64, 40]
    ws = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    got = compute_ranges(ws, byte_cap=cap)
    assert [n for _, n in got] == expected_sizes
    assert [p for p, _ in got] == [w.data_ptr() for w in ws[:len(got)]]
    assert got == seed_ranges(ws, cap)


@pytest.mark.parametrize("cap", [0, 1, 16, 64, 80, 1 << 40])
def test_misaligned_weight_past_a_spent_cap_still_raises(cap):
    # issue 21: with cap=64 the first weight spends the cap, and the walk used to stop
    # before looking at the second; the verdict must not depend on the cap.
    t = torch.empty(16, dtype=torch.float32)
    bad = torch.empty(9, dtype=torch.float32)[1:]
    with pytest.raises(ValueError, match=r"16-byte aligned: weight 1 \("):
        compute_ranges([t, bad], byte_cap=cap)
    aligned = FakeArray(0x10000, (32,), "<f2")  # 64 bytes
    empty = FakeArray(0x20001, (0,), "<f2")     # empty: no alignment to check
    late = FakeArray(0x1004A, (32,), "<f2")
    with pytest.raises(ValueError, match=r"16-byte aligned: weight 2 \(.*0x1004a, 10 bytes"):
        compute_ranges([aligned, empty, late], byte_cap=cap)


def test_cap_smaller_than_granule_still_checks_first_weight():
    bad = torch.empty(9, dtype=torch.float32)[1:]
    assert compute_ranges([torch.empty(4)], byte_cap=8) == []
    with pytest.raises(ValueError, match="16-byte aligned"):
        compute_ranges([bad], byte_cap=8)


# ------------------------------------------------------------ CAI objects


class CaiV2:
    """v2 interface without a strides key at all."""

    def __init__(self, ptr, shape, typestr):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (ptr, False), "version": 2}


@pytest.mark.parametrize("typestr, item", [("|u1", 1), ("|i1", 1), ("<f2", 2), ("<f4", 4),
                                           ("<f8", 8), ("<c16", 16), ("<i8", 8)])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4)])
def test_cai_none_strides_is_contiguous(typestr, item, shape):
    ptr = 0x7F00_0000_0000
    numel = 1
    for n in shape:
        numel *= n
    assert compute_ranges([FakeArray(ptr, shape, typestr)]) == [(ptr, numel * item)]
    assert compute_ranges([CaiV2(ptr, shape, typestr)]) == [(ptr, numel * item)]


@pytest.mark.parametrize("shape, strides, typestr, size", [
    ((3, 5), (20, 4), "<f4", 60),            # contiguous, explicit
    ((3, 5), (40, 4), "<f4", 2 * 40 + 4 * 4 + 4),
    ((5, 3), (4, 20), "<f4", 4 * 4 + 2 * 20 + 4),   # transposed
    ((4,), (0,), "<f8", 8),                  # broadcast
    ((2, 3), (6, 2), "|u1", 6 + 4 + 1),      # byte strides need not be item multiples
    ((1 << 40, 1 << 40), (0, 0), "<f2", 2),  # huge broadcast, one element
])
def test_cai_byte_strides(shape, strides, typestr, size):
    ptr = 0x10_0000
    a = FakeArray(ptr, shape, typestr, strides)
    assert compute_ranges([a]) == [(ptr, size)]
    assert compute_ranges([a]) == reference_ranges([a])


@pytest.mark.parametrize("shape, strides, typestr", [
    ((4,), (-4,), "<f4"),
    ((4, 3), (-12, 4), "<f4"),
    ((4, 3), (12, -4), "<f4"),
    ((4, 3), (-12, -4), "<f4"),
    ((2, 5, 3), (-2, 16, -64), "<f2"),
    ((8,), (-1,), "|u1"),
])
def test_cai_negative_strides_cover_lowest_to_highest(shape, strides, typestr):
    item = int(typestr[2:])
    below = -sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    above = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
    lowest = 0x20_0000
    a = FakeArray(lowest + below, shape, typestr, strides)
    assert compute_ranges([a]) == [(lowest, below + above + item)]
    # The same view with its lowest byte off a 16-byte boundary is refused.
    b = FakeArray(lowest + below + item, shape, typestr, strides)
    with pytest.raises(ValueError, match="16-byte aligned"):
        compute_ranges([b])


def test_cai_negative_strides_below_address_zero():
    with pytest.raises(ValueError, match="below address 0"):
        compute_ranges([FakeArray(16, (4,), "<f4", (-16,))])
    with pytest.raises(ValueError, match="weight 1"):
        compute_ranges([FakeArray(0, (1,)), FakeArray(0, (2, 2), "<f4", (-8, 4))])
    # Exactly reaching 0 is fine.
    assert compute_ranges([FakeArray(48, (4,), "<f4", (-16,))]) == [(0, 52)]


def test_cai_empty_is_skipped():
    assert compute_ranges([FakeArray(3, (0, 4)), FakeArray(64, (2,))]) == [(64, 4)]


def test_mixed_tensors_and_cai():
    t = torch.empty(10, dtype=torch.float16)
    a = FakeArray(0x4000, (3, 3), "<f8")
    assert compute_ranges([a, t, a]) == [(0x4000, 72), (t.data_ptr(), 20), (0x4000, 72)]
    # 64 of a (36 left), 16 of t (20 left), 16 of a again (4 left: stop)
    assert compute_ranges([a, t, a], byte_cap=100) == [(0x4000, 64), (t.data_ptr(), 16),
                                                       (0x4000, 16)]


# ------------------------------------------------------------ errors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8, torch.float64])
@pytest.mark.parametrize("position", [0, 2])
def test_misaligned_tensor_message(device, dtype, position):
    base = torch.empty(3, 5, dtype=dtype, device=device)
    bad = base.flatten()[1:].view(2, 7)
    assert bad.data_ptr() % 16
    ok = torch.empty(4, device=device)
    weights = [ok, ok, ok]
    weights[position] = bad
    with pytest.raises(ValueError) as info:
        compute_ranges(weights)
    msg = str(info.value)
    assert "16-byte aligned" in msg
    assert f"weight {position}" in msg
    assert str(bad.shape) in msg and "[2, 7]" in msg
    assert str(bad.dtype) in msg
    assert hex(bad.data_ptr()) in msg
    assert f"{bad.data_ptr() % 16} bytes past" in msg
    assert "%" not in msg  # every format code was filled in


@pytest.mark.parametrize("offset", [1, 2, 4, 8, 12, 15])
def test_misaligned_cai_message(offset):
    ptr = 0x1000 + offset
    with pytest.raises(ValueError) as info:
        compute_ranges([FakeArray(0x2000, (4,)), FakeArray(ptr, (3, 5), "<f2")])
    msg = str(info.value)
    assert "16-byte aligned" in msg and "weight 1" in msg
    assert "(3, 5)" in msg and "<f2" in msg
    assert hex(ptr) in msg and f"{offset} bytes past" in msg


@pytest.mark.parametrize("weights", [5, 3.5, None, object()])
def test_non_sequence_is_type_error(weights):
    with pytest.raises(TypeError, match="sequence") as info:
        compute_ranges(weights)
    assert type(weights).__name__ in str(info.value)


@pytest.mark.parametrize("single", [
    lambda: torch.empty(4),
    lambda: torch.empty(4, device="meta"),
    lambda: FakeArray(0x1000, (4,)),
    lambda: "abc",
    lambda: b"abc",
])
def test_single_weight_says_wrap(single):
    with pytest.raises(TypeError, match="wrap") as info:
        compute_ranges(single())
    assert "%" not in str(info.value)


@pytest.mark.parametrize("bad, name", [(5, "int"), ("x", "str"), (None, "NoneType"),
                                       (object(), "object"), ([1, 2], "list")])
@pytest.mark.parametrize("index", [0, 1, 3])
def test_non_tensor_element_names_index(bad, name, index):
    weights = [torch.empty(4) for _ in range(4)]
    weights[index] = bad
    with pytest.raises(TypeError) as info:
        compute_ranges(weights)
    msg = str(info.value)
    assert f"weight {index}" in msg and "not a tensor" in msg
    assert f"is a {name}" in msg


@pytest.mark.parametrize("cap", [-1, -16, -(1 << 40)])
def test_negative_cap(cap):
    with pytest.raises(ValueError, match="byte_cap"):
        compute_ranges([torch.empty(4)], byte_cap=cap)
    with pytest.raises(ValueError, match="byte_cap"):
        compute_ranges([], cap)


@pytest.mark.parametrize("cap", [True, False, "16", 16.0, None, [16]])
def test_cap_must_be_int(cap):
    with pytest.raises(TypeError, match="byte_cap") as info:
        compute_ranges([torch.empty(4)], byte_cap=cap)
    assert type(cap).__name__ in str(info.value)


def test_cap_beyond_int64_is_overflow():
    with pytest.raises(OverflowError):
        compute_ranges([torch.empty(4)], byte_cap=1 << 64)


def test_argument_errors():
    with pytest.raises(TypeError):
        compute_ranges()
    with pytest.raises(TypeError):
        compute_ranges([], 0, 0)
    with pytest.raises(TypeError):
        compute_ranges([], bogus=1)
    with pytest.raises(TypeError):
        compute_ranges([], 16, byte_cap=16)


@pytest.mark.parametrize("shape, strides, typestr", [
    ((1 << 62, 4), (1 << 62, 1), "|u1"),               # (n-1) * stride
    ((1 << 40, 1 << 40), None, "<f2"),                 # numel
    ((1 << 31, 1 << 31), None, "<f8"),                 # numel * item
    ((3, 1 << 62), (1 << 61, 1), "|u1"),               # 2**63 - 1, then + item
    ((1 << 62, 1 << 62), (-2, 1), "|u1"),              # high - low
    ((2, 2), (1 << 62, 1 << 62), "|u1"),               # sum of positive offsets
    ((1 << 63,), (1,), "|u1"),                         # size beyond int64
    ((2,), (1 << 63,), "|u1"),                         # stride beyond int64
    ((2,), ((1 << 63) - 8,), "<c16"),                  # offset fits, + item does not
])
def test_absurd_spans_overflow(shape, strides, typestr):
    with pytest.raises(OverflowError):
        compute_ranges([FakeArray(1 << 20, shape, typestr, strides)])


@pytest.mark.parametrize("ptr, shape, typestr", [
    ((1 << 64) - 16, (3,), "<f8"),
    ((1 << 64) - 256, (1 << 10,), "<f4"),
    ((1 << 63), (1 << 62, 2), "<f2"),
])
def test_range_past_top_of_address_space_overflows(ptr, shape, typestr):
    with pytest.raises(OverflowError):
        compute_ranges([FakeArray(ptr, shape, typestr)])


def test_range_ending_at_top_of_address_space_is_fine():
    ptr = (1 << 64) - 32
    assert compute_ranges([FakeArray(ptr, (4,), "<f8")]) == [(ptr, 32)]


@pytest.mark.parametrize("shape", [(-1,), (3, -2), (-5, 0)])
def test_cai_negative_size(shape):
    with pytest.raises(ValueError, match="negative size"):
        compute_ranges([FakeArray(0x1000, shape)])


class RawCai:
    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


GOOD_CAI = {"shape": (4,), "typestr": "<f4", "data": (0x1000, False), "version": 3}


@pytest.mark.parametrize("missing", ["shape", "typestr", "data"])
def test_cai_missing_keys(missing):
    assert compute_ranges([RawCai(dict(GOOD_CAI))]) == [(0x1000, 16)]
    cai = {k: v for k, v in GOOD_CAI.items() if k != missing}
    with pytest.raises(ValueError, match="weight 1") as info:
        compute_ranges([torch.empty(4), RawCai(cai)])
    assert "__cuda_array_interface__" in str(info.value)


@pytest.mark.parametrize("change", [
    {"shape": [4]}, {"typestr": b"<f4"}, {"data": 0x1000}, {"data": ()},
    {"typestr": "<f"}, {"typestr": "<f0"}, {"data": (-16, False)}, {"data": (None, False)},
    {"strides": (4, 4)},
])
def test_cai_malformed(change):
    with pytest.raises(ValueError):
        compute_ranges([RawCai({**GOOD_CAI, **change})])


def test_cai_not_a_dict():
    with pytest.raises(TypeError, match="dict") as info:
        compute_ranges([RawCai([("shape", (4,))])])
    assert "list" in str(info.value)


# ------------------------------------------------------------ references held


def test_no_reference_leak():
    t = torch.empty(4, 8)
    v = t[:, ::2]
    a = FakeArray(0x1000, (4, 4), "<f4", (-16, 4))
    a.ptr += 48
    bad = torch.empty(9)[1:]
    gc.collect()
    before = [sys.getrefcount(x) for x in (t, v, a, bad)]
    for _ in range(1000):
        out = compute_ranges([t, v, a], byte_cap=0)
        compute_ranges([t, v, a], byte_cap=64)
        with pytest.raises(ValueError):
            compute_ranges([t, a, bad])
        with pytest.raises(TypeError):
            compute_ranges([t, v, 5])
        with pytest.raises(TypeError):
            compute_ranges(t)
    del out
    gc.collect()
    assert [sys.getrefcount(x) for x in (t, v, a, bad)] == before


def test_weights_released_after_call():
    import weakref

    t = torch.empty(16)
    ref = weakref.ref(t)
    ranges = compute_ranges([t])
    del t
    gc.collect()
    assert ref() is None
    assert len(ranges) == 1
