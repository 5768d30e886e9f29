"""The tuner: find, on this GPU and this model, the prefetches that pay, and prove them.

    reads = discover(model, lambda: model(input_ids=ids))   # which weights, in order (CPU too)
    roles = candidates(model, reads)                         # where a fork could load each
    result = tune(model, step, [1, 8])                       # measure in the real CUDA graph
    result.save("model.l2p.json", model)                     # the profile a server loads
    profile = load_profile("model.l2p.json", model)          # refused on another GPU or model

:func:`tune` measures each candidate role inside the captured decode step
against no forks and against the same forks with empty tables, keeps a role
only when the 95% interval of its gain is above zero, and returns a plan only
after confirming it on fresh graph instances; an empty plan is a valid
result.  ``python -m l2prefetch tune`` does all of it for a Hugging Face
model (:mod:`l2prefetch.tuning.hf`).  Discovery and the search logic need
no GPU; measuring needs torch with CUDA.
"""

from .discovery import Read, Reads, Role, RoleSite, candidates, discover, roles_from_plan
from ..profile import Profile, ProfileMismatchError, load_profile
from .arms import Setting
from .errors import StepError
from .tuner import TuneResult, tune

__all__ = [
    "Profile",
    "ProfileMismatchError",
    "Read",
    "Reads",
    "Role",
    "RoleSite",
    "Setting",
    "StepError",
    "TuneResult",
    "candidates",
    "discover",
    "load_profile",
    "roles_from_plan",
    "tune",
]
