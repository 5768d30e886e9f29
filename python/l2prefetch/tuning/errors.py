"""The tuner's one error of its own: :class:`StepError`, a step that failed.

The tuner runs the caller's step to discover its weights, to find out whether it
runs compiled, to capture and to measure it; wherever that fails, the step's own
exception is chained to a StepError that names the batch and what was being done.
"""

from __future__ import annotations

__all__ = ["StepError"]


class StepError(RuntimeError):
    """The step could not be run or captured at a batch (the cause is chained)."""
