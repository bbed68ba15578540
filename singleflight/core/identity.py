"""Who holds: ``--identity``, else PEARING_IDENTITY, else user@host.

An identity names a file in the lock dir and shows in ``status``, so the derived one is
held to the same rule as ``--identity`` (``names.identity``). $USER and $LOGNAME are whatever
the caller's environment says (cron, sudo, a container, an attacker's wrapper): a value that
breaks the rule is never used, not even cleaned up, because two different bad names could
clean up to the same good one. The numeric uid stands in for it, and ``localhost`` for a
hostname that breaks the rule.
"""

from __future__ import annotations

import os

from singleflight.core import names
from singleflight.core.const import ENV_IDENTITY, TYPE_CHECKING
from singleflight.core.errors import BadValue

if TYPE_CHECKING:
    from typing import Final

FALLBACK_HOST: Final = "localhost"


def resolve(flag: str | None = None) -> str:
    """The identity given (exit 64 if it is bad), else the one derived from the login."""
    value = flag if flag is not None else os.environ.get(ENV_IDENTITY)
    if value is not None:
        return names.identity(value)
    return derived()


def derived() -> str:
    """``user@host``: $USER, else $LOGNAME, else the passwd name; ``uid<N>`` / ``localhost`` when bad."""
    host = os.uname().nodename
    if not _part_ok(host):
        host = FALLBACK_HOST
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or _passwd_name()
    if user is None or not _part_ok(user) or not _ok(f"{user}@{host}"):
        user = f"uid{os.geteuid()}"
    return names.identity(f"{user}@{host}")


def _passwd_name() -> str | None:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid with no passwd entry, common in containers
        return None


def _part_ok(value: str) -> bool:
    """One side of user@host: itself a valid identity, without an '@' that would blur the two."""
    return "@" not in value and _ok(value)


def _ok(value: str) -> bool:
    try:
        names.identity(value)
    except BadValue:
        return False
    return True
