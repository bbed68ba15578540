"""Who holds: ``--identity``, else PEARING_IDENTITY, else user@host."""

from __future__ import annotations

import os

from singleflight.core import names
from singleflight.core.const import ENV_IDENTITY


def resolve(flag: str | None = None) -> str:
    value = flag if flag is not None else os.environ.get(ENV_IDENTITY)
    if value is not None:
        return names.identity(value)
    user = os.environ.get("USER") or os.environ.get("LOGNAME")
    if not user:
        import pwd

        user = pwd.getpwuid(os.geteuid()).pw_name
    return f"{user}@{os.uname().nodename}"
