"""torch for the modules that need it, or an ImportError that says how to get it.

torch is an optional dependency (the ``torch`` extra): ``import l2prefetch`` and
the C extension work without it; ops, hooks, plans of models, the policies and
``python -m l2prefetch plan`` do not.
"""

from __future__ import annotations

from types import ModuleType

#: The one line said wherever torch is missing.
MISSING = "needs torch, which is not installed: pip install 'l2prefetch[torch]'"


def require(what: str) -> ModuleType:
    """``import torch``; without it a ModuleNotFoundError ``"<what> needs torch ..."``."""
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise ModuleNotFoundError(f"{what} {MISSING}", name="torch") from None
    return torch
