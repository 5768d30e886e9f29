"""L2PREFETCH_DISABLE, the switch that turns prefetching off, read in one place.

The C controller reads it through the same parser (``_C.env_flag``); this module
adds the warning for a value that is neither on nor off, so that every reader (the
controller, the hooks, the profile loader, the commands) warns alike.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from . import _C

__all__ = ["disabled", "unknown_disable_value"]

logger = logging.getLogger(__name__)

#: L2PREFETCH_DISABLE's values that leave prefetching on without a warning (any case,
#: blanks around them ignored); 1, true, yes and on turn it off.
_ENABLED_WORDS = frozenset({"", "0", "false", "no", "off"})
_warned_values: set[str] = set()


def unknown_disable_value() -> Optional[str]:
    """L2PREFETCH_DISABLE's value where it is neither a word that turns prefetching off
    nor one that leaves it on (``ture``, ``2``): prefetching stays on.  None otherwise."""
    value = os.environ.get("L2PREFETCH_DISABLE")
    if (value is None or _C.env_flag("L2PREFETCH_DISABLE")
            or value.strip(" \t\n\r\v\f").lower() in _ENABLED_WORDS):
        return None
    return value


def disabled() -> bool:
    """Whether L2PREFETCH_DISABLE asks for no prefetching (1, true, yes, on; any case,
    blanks around it ignored): the C controller's rule, read by the C parser.  Any other
    value but 0, false, no, off or empty leaves prefetching on, with a warning (once per
    value; :func:`unknown_disable_value`).  Also ``l2prefetch.disabled`` and
    ``hooks.disabled``."""
    off = _C.env_flag("L2PREFETCH_DISABLE")
    value = unknown_disable_value()
    if value is not None and value not in _warned_values:
        _warned_values.add(value)
        logger.warning("L2PREFETCH_DISABLE=%r is not a word it knows, so prefetching stays "
                       "on: set it to 1 (true, yes, on) to turn prefetching off, or 0 "
                       "(false, no, off) to say it is on", value)
    return off
