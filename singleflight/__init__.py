"""pearing singleflight: exactly one responder does the contested step.

    from singleflight import Busy, LeaseLost, Lock

Importing the package is cheap on purpose: ``pearing-run`` and ``pearing-guard
verify`` are on hot paths, so the public names load their modules only when
first used.
"""

from __future__ import annotations

from singleflight.core.const import TYPE_CHECKING

__version__ = "0.2.0"
__all__ = [
    "AsyncLock",
    "BadValue",
    "Busy",
    "LeaseLost",
    "Lock",
    "NotHeld",
    "PearingError",
    "StaleFence",
    "Thread",
    "UsageError",
    "__version__",
]
_ERRORS = ("BadValue", "NotHeld", "PearingError", "StaleFence", "UsageError")

if TYPE_CHECKING:
    from typing import Any

    from singleflight.api import AsyncLock, Busy, LeaseLost, Lock, Thread
    from singleflight.core.errors import BadValue, NotHeld, PearingError, StaleFence, UsageError


def __getattr__(name: str) -> Any:
    if name in ("AsyncLock", "Busy", "LeaseLost", "Lock", "Thread"):
        from singleflight import api

        return getattr(api, name)
    if name in _ERRORS:
        from singleflight.core import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'singleflight' has no attribute {name!r}")
