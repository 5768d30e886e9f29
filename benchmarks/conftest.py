"""pytest-benchmark runs: `pytest benchmarks/ --benchmark-only`.  GPU benchmarks skip
with the reason where there is no GPU; `python -m benchmarks.report` is the full report."""

import pytest


def gpu_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch {torch.__version__}"
    return None


@pytest.fixture
def cuda():
    reason = gpu_reason()
    if reason:
        pytest.skip(f"needs a GPU: {reason}")
    import torch

    return torch
