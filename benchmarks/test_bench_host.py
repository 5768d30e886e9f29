"""Host-side costs with pytest-benchmark (wall time per call; GPU work is asynchronous).

GPU timings that need CUDA events and flushed caches live in the report's sections
(benchmarks/sections/).
"""

import pytest

from l2prefetch import PrefetchController, PreparedWeightRanges, compute_ranges


def test_compute_ranges_ten_weights(benchmark):
    torch = pytest.importorskip("torch")
    weights = [torch.empty(256, 7168, dtype=torch.bfloat16) for _ in range(10)]
    ranges = benchmark(compute_ranges, weights, 24 << 20)
    assert sum(n for _, n in ranges) == 24 << 20


def _controller(torch):
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    ctrl = PrefetchController(0)
    ctrl.add("p", 0, [1], PreparedWeightRanges([], device=0, carveout=100, priority=True))
    ctrl.add("w", 0, [1], PreparedWeightRanges([w], carveout=100, priority=True))
    return ctrl


def test_fork_join_empty_table(benchmark, cuda):
    ctrl = _controller(cuda)

    def step():
        ctrl.fork("p", 0, 1)
        ctrl.join()

    benchmark.pedantic(step, rounds=2000, iterations=10, warmup_rounds=100)
    cuda.cuda.synchronize()
    assert ctrl.stats()["p"]["forks"] >= 20000
    ctrl.close()


def test_fork_of_unregistered_key(benchmark, cuda):
    ctrl = _controller(cuda)
    assert benchmark(ctrl.fork, "nothing", 0, 1) is False
    ctrl.close()


def test_prepare_table(benchmark, cuda):
    w = cuda.randn(4096, 7168, device="cuda", dtype=cuda.bfloat16)
    PreparedWeightRanges([w])   # compile and load once, outside the timing
    p = benchmark(PreparedWeightRanges, [w], byte_cap=16 << 20, carveout=100, priority=True)
    assert p.nbytes == 16 << 20

