"""How a console script ends."""

from __future__ import annotations

import contextlib
import os
import sys

from singleflight.core.const import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import NoReturn


def script(main: Callable[[], int]) -> NoReturn:
    """A console script: ``main()``, its output flushed, then out without tearing the
    interpreter down. Freeing every module's objects costs milliseconds of CPU, and
    pearing-run's exit falls right on the next run's hand-over (one of two cores, on a
    small host). Nothing of ours needs a teardown: no atexit hook, no thread."""
    try:
        code = main()
    except SystemExit as exc:  # as sys.exit would report it
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if isinstance(exc.code, str):
            sys.stderr.write(exc.code + "\n")
    for stream in (sys.stdout, sys.stderr):  # None when started with that fd closed
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing more to say there
            if stream is not None:
                stream.flush()
    os._exit(code)
