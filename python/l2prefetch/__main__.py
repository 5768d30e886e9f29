"""``python -m l2prefetch``: the command line of :mod:`l2prefetch.cli`."""

import sys

from .cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
