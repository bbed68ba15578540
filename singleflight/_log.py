"""Lifecycle lines: part of the interface, asserted by tests.

One line per event on stderr, ``PROG: EVENT key=value ...``, only with ``-v``;
errors always, as ``PROG: error: MESSAGE``.
"""

from __future__ import annotations

import contextlib
import os
import sys


class Log:
    def __init__(self, prog: str, verbose: bool = False) -> None:
        self.prog, self.verbose = prog, verbose

    def event(self, name: str, **fields: object) -> None:
        if self.verbose:
            tail = "".join(f" {k}={v}" for k, v in fields.items() if v is not None)
            self._write(f"{self.prog}: {name}{tail}")

    def error(self, message: str) -> None:
        self._write(f"{self.prog}: error: {message}")

    def refused(self, reason: str) -> None:
        """A refusal is an answer, not an error: ``PROG: refused: REASON``."""
        self._write(f"{self.prog}: refused: {reason}")

    def _write(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            os.write(sys.stderr.fileno(), (line + "\n").encode(errors="replace"))
