"""torch for the modules that need it, or an ImportError that says how to get it;
a device argument parsed (parse_device).

torch is an optional dependency (the ``torch`` extra): ``import l2prefetch`` and
the C extension work without it; ops, hooks, plans of models, the policies and
``python -m l2prefetch plan`` do not.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any, Optional

from . import _C

#: The one line said wherever torch is missing.
MISSING = "needs torch, which is not installed: install torch 2.11-2.13 (README, Install)"


def require(what: str) -> ModuleType:
    """``import torch``; without it a ModuleNotFoundError ``"<what> needs torch ..."``."""
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise ModuleNotFoundError(f"{what} {MISSING}", name="torch") from None
    return torch


def parse_device(device: Any) -> Any:
    """``device`` as a torch.device of the CPU or CUDA (not checked against the GPUs:
    :func:`l2prefetch.tuning.hf.device_of`); anything else is a ValueError naming the
    choices."""
    import torch

    # A string is checked here first: torch.device throws a C++ exception for a bad one,
    # which aborts a process with ASan preloaded (the CI's sanitizer pass).
    if isinstance(device, str) and not re.fullmatch(r"(cpu|cuda)(:\d{1,9})?", device.strip()):
        found = None
    else:
        try:
            found = torch.device(device.strip() if isinstance(device, str) else device)
        except (RuntimeError, TypeError, ValueError):
            found = None
    if found is None or found.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return found


def driver_reason() -> Optional[str]:
    """None where the CUDA driver loads and sees a device; else the whole reason why not."""
    try:
        count = _C.driver_info()["device_count"]
    except (_C.CudaUnavailableError, _C.Error) as exc:
        return str(exc)
    return "the CUDA driver found no GPU" if count == 0 else None


def cuda_reason(torch: ModuleType) -> Optional[str]:
    """None where ``torch`` has CUDA and sees a device; else why not."""
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (a CPU-only build of torch?)"
    return None
