"""A PostgreSQL backend's URL, ``postgresql://USER[:PASS]@HOST[:PORT]/DB[?sslmode=...&schema=NAME]``
(also ``postgres://``): checked once, before any connection, and masked wherever it is shown.

``schema=`` (or ``prefix=``) is the tenant: every table lives in that schema (default
``pearing``), so two teams or environments can share one database. ``listen=0`` makes waiters
poll instead of LISTEN (a pooler in transaction mode drops a session's LISTEN: docs/backends.md).
Every other query parameter goes to libpq as it is (``sslmode``, ``connect_timeout``...).
"""

from __future__ import annotations

from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from singleflight.core.errors import BadValue

DEFAULT_SCHEMA = "pearing"
FORM = "postgresql://USER[:PASS]@HOST[:PORT]/DB[?schema=NAME]"
_RULE = f"must be {FORM} (or postgres://)"
_SCHEMA_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")
# Ours, not libpq's: taken out of the connection string.
_OURS = ("schema", "prefix", "listen")


class PgUrl:
    """The parts of a checked URL: what libpq gets, the tenant schema, and whether to LISTEN."""

    __slots__ = ("conninfo", "listen", "masked", "schema")

    def __init__(self, conninfo: str, schema: str, listen: bool, masked: str) -> None:
        self.conninfo, self.schema, self.listen, self.masked = conninfo, schema, listen, masked


def mask(url: str) -> str:
    """``url`` with its password (if any) shown as ``***``: the only form ever printed."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "postgresql://***"
    if parts.password is None:
        return url
    user = quote(parts.username or "", safe="")
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def parse_url(url: str) -> PgUrl:
    masked = mask(url)
    if not url.startswith(("postgresql://", "postgres://")):
        raise BadValue("backend", masked, _RULE)
    try:
        parts = urlsplit(url)
        _ = parts.port  # a port that is not a number raises here
        query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise BadValue("backend", masked, _RULE) from None
    db = parts.path.lstrip("/")
    if not parts.hostname or not db or "/" in db:
        raise BadValue("backend", masked, _RULE)
    ours = {k: v for k, v in query if k in _OURS}
    schema = ours.get("schema") or ours.get("prefix") or DEFAULT_SCHEMA
    if len(schema) > 40 or not set(schema) <= _SCHEMA_CHARS or schema[0].isdigit() or schema.startswith("pg_"):
        raise BadValue("backend", masked, f"{_RULE}; schema is a name of [a-z0-9_] (not pg_...), at most 40")
    listen = ours.get("listen", "1") not in ("0", "false", "no", "off")
    rest = urlencode([(k, v) for k, v in query if k not in _OURS])
    conninfo = urlunsplit(("postgresql", parts.netloc, parts.path, rest, ""))
    return PgUrl(conninfo, schema, listen, masked)
