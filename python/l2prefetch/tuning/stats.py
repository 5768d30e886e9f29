"""The statistics of the tuner's acceptance: intervals on per-instance means.

A graph instance is the unit of measurement: two instantiations of one
capture replay at different speeds (a few us in a 2 ms decode step, more
than the effects being measured), while replays of one instance are close
to each other and correlated.  So each instance contributes one number, the
median of its replays, and a variant's time is the mean of its instances'
medians.  A difference of two variants gets Welch's t interval (unequal
variances, few samples): the estimate is mean(a) - mean(b), its standard
error sqrt(var(a)/n_a + var(b)/n_b), its degrees of freedom
Welch-Satterthwaite's.  A gain is accepted when the two-sided 95%
interval's lower end is above zero.

No scipy: :func:`t_quantile` inverts Student's t distribution by bisection
on its CDF, computed from the regularised incomplete beta function.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

__all__ = ["Interval", "diff_interval", "expected_min", "mean_interval", "paired_interval",
           "t_quantile"]

#: The interval's coverage.
CONFIDENCE = 0.95


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t distribution with df degrees of freedom."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if not df > 0:
        raise ValueError(f"df must be > 0, got {df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if _t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


@dataclasses.dataclass(frozen=True)
class Interval:
    """An estimate with its two-sided interval (same unit, here microseconds)."""

    estimate: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def excludes_zero_above(self) -> bool:
        """True when the whole interval is above zero (a gain shown at this confidence)."""
        return self.low > 0.0

    def format(self, digits: int = 1) -> str:
        return f"{self.estimate:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"

    def as_dict(self) -> dict:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "n": self.n}


def _check(name: str, xs: Sequence[float]) -> list[float]:
    values = [float(x) for x in xs]
    if len(values) < 2:
        raise ValueError(f"{name} needs at least 2 instances for an interval, got {len(values)}")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name} holds a value that is not finite: {values}")
    return values


def mean_interval(xs: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """The mean of xs with its t interval."""
    values = _check("xs", xs)
    n = len(values)
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(n)
    half = t_quantile(0.5 + confidence / 2, n - 1) * se
    return Interval(mean, mean - half, mean + half, n)


def diff_interval(a: Sequence[float], b: Sequence[float],
                  confidence: float = CONFIDENCE) -> Interval:
    """mean(a) - mean(b) with Welch's t interval (see the module's docstring)."""
    xa, xb = _check("a", a), _check("b", b)
    na, nb = len(xa), len(xb)
    va, vb = statistics.variance(xa) / na, statistics.variance(xb) / nb
    diff = statistics.fmean(xa) - statistics.fmean(xb)
    se2 = va + vb
    if se2 == 0.0:
        return Interval(diff, diff, diff, na + nb)
    df = se2 * se2 / ((va * va / (na - 1) if va else 0.0) + (vb * vb / (nb - 1) if vb else 0.0))
    half = t_quantile(0.5 + confidence / 2, df) * math.sqrt(se2)
    return Interval(diff, diff - half, diff + half, na + nb)


def paired_interval(a: Sequence[float], b: Sequence[float],
                    confidence: float = CONFIDENCE) -> Interval:
    """mean(a - b) over pairs measured in the same graph instance (a[i] and b[i]),
    with Student's t interval on the differences: the instances' spread cancels."""
    xa, xb = _check("a", a), _check("b", b)
    if len(xa) != len(xb):
        raise ValueError(f"paired samples must have equal lengths, got {len(xa)} and {len(xb)}")
    d = [x - y for x, y in zip(xa, xb)]
    diff = statistics.fmean(d)
    sd = statistics.stdev(d)
    if sd == 0.0:
        return Interval(diff, diff, diff, len(d))
    half = t_quantile(0.5 + confidence / 2, len(d) - 1) * sd / math.sqrt(len(d))
    return Interval(diff, diff - half, diff + half, len(d))


def expected_min(xs: Sequence[float], k: int) -> float:
    """The expected fastest of ``k`` draws (with replacement) from the values ``xs``:
    with x sorted ascending, sum of x[i] * (((n - i) / n)**k - ((n - i - 1) / n)**k),
    the chance that x[i] is the smallest of k draws.  Best-of-k captures: ``xs`` are
    per-instance times of one step, so mean(xs) - expected_min(xs, k) is what keeping
    the fastest of k captures is expected to save (an upper estimate: it assumes
    each instance's time is known exactly when choosing)."""
    values = sorted(_check("xs", xs))
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    n = len(values)
    return math.fsum(x * (((n - i) / n) ** k - ((n - i - 1) / n) ** k)
                     for i, x in enumerate(values))
