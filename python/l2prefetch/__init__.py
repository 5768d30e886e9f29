"""l2prefetch: pull the weights the next kernels read into L2, beside them.

Small-batch decode is bound by HBM bandwidth.  At fixed points of each layer,
:class:`PrefetchController` launches a small kernel (on a side CUDA stream, or in
a captured graph beside the step's kernels) that loads the byte ranges of the
weights the next kernels will read into L2, so they start warm.  See README.md
for how to integrate it.

Importing this package needs neither a GPU, nor the CUDA driver, nor torch:
the driver and NVRTC are loaded on first use.  ``L2PREFETCH_DISABLE=1`` in the
environment turns every controller into a no-op without a code change.
"""

import logging

from ._version import __version__
from . import _C
from ._C import (
    MAX_RANGES,
    CudaError,
    CudaUnavailableError,
    Error,
    NvrtcError,
    PreparedWeightRanges,
    compute_ranges,
    kernel_variants,
)
from .controller import PrefetchController
from .disable import disabled
from .plan import PlanEntry

# Modules log to child loggers (l2prefetch.controller, l2prefetch.hooks); the
# application decides where records go.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "__version__",
    "CudaError",
    "CudaUnavailableError",
    "Error",
    "MAX_RANGES",
    "NvrtcError",
    "PlanEntry",
    "PrefetchController",
    "PreparedWeightRanges",
    "compute_ranges",
    "disabled",
    "kernel_variants",
]

