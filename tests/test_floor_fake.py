"""csrc/bench.c's host-cost floor (_C._floor_fork_join) against the recording driver
stand-in: a bounded n, and a signal that ends its loop (issue 38.7).  Failures of its
driver calls are tests/test_controller_fake.py's."""

import signal

import pytest

import l2prefetch
from l2prefetch import _C
from _fakecuda import error_code
from conftest import FakeArray, device_ptr

STREAM = 0x5000
MAX_N = 10_000_000


def table():
    return l2prefetch.PreparedWeightRanges([FakeArray(device_ptr(0, 0), (1024,))])


@pytest.mark.parametrize("n", [-1, MAX_N + 1, 2**63, 2**70])
def test_an_unreasonable_n_is_refused_before_any_driver_call(fake, n):
    """n is in 0..10,000,000: before, any n up to LONG_MAX looped in C (one process was
    OOM-killed as the stand-in's call log grew), and a negative one ran nothing."""
    p = table()
    # were n taken, the call stops at once instead of looping for minutes
    fake.fail("cuStreamCreateWithPriority", code=error_code("CUDA_ERROR_OUT_OF_MEMORY"))
    with pytest.raises(ValueError, match=r"_floor_fork_join: n must be in 0\.\.10000000 "
                       rf"\(iterations of the fork/join sequence\), got {n}"):
        _C._floor_fork_join(p, n, STREAM)
    assert fake.calls("cuStreamCreateWithPriority") == 0


def test_the_largest_n_and_none_are_taken(fake):
    p = table()
    assert _C._floor_fork_join(p, 0, STREAM) >= 0
    assert fake.calls("cuEventRecord") == 0
    assert _C._floor_fork_join(p, 3, STREAM) >= 0
    assert fake.calls("cuEventRecord") == 6


class Alarm(Exception):
    """What the test's SIGALRM handler raises."""


def test_a_signal_ends_the_loop_and_releases_its_stream_and_events(fake):
    """A signal whose handler raises (Ctrl-C) ends the loop within 1024 iterations: the
    call raises the handler's exception, having released its stream and events."""
    p = table()
    # a stop for the loop, were the signal never checked: its 200,001st event record fails
    fake.fail("cuEventRecord", nth=200_001, code=error_code("CUDA_ERROR_OUT_OF_MEMORY"))

    def handler(signum, frame):
        raise Alarm()
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Alarm):
            _C._floor_fork_join(p, MAX_N, STREAM)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert 0 < fake.calls("cuEventRecord") < 200_000
    assert (fake.live("stream"), fake.live("event"), fake.bad_destroys()) == (0, 0, 0)
    assert fake.calls("cuStreamSynchronize") == 1      # nothing left running on its stream
    # the next call runs as ever
    assert _C._floor_fork_join(p, 2, STREAM) >= 0
