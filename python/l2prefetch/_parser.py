"""The command line's argparse: usage errors as one line on stderr, exit status 2 (the
README's promise for bad input), for ``python -m l2prefetch`` and each command's own."""

from __future__ import annotations

import argparse

__all__ = ["Parser"]


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line on stderr (exit status 2)."""

    #: The top-level parser's commands, name -> parser (set by l2prefetch.cli).
    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")
