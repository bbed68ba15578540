"""The tables, created on first use and moved forward by numbered migrations.

``pearing_schema`` holds the versions applied. A connection reads it once; below ``VERSION``
it applies the missing steps in one transaction, holding that table's lock (a table lock, not
an advisory one: a pooler in transaction mode keeps it to the transaction), so two first users
at once apply each step once. ``pearing-cli init-db --print-sql`` prints the same statements
for a DBA to run when the role that pearing connects as may not CREATE.
"""

from __future__ import annotations

from singleflight.core.const import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Final

# Step N's statements; a step is never changed once released, only followed by another.
_STEPS: Final = (
    (
        # The lock's row: its fence lives here, rises in the transaction that promotes a holder,
        # and outlives prune (a lock that comes back continues above its last fence): prune
        # only marks it ``pruned``. ``used_at``: its last promotion, for prune's idle time.
        """CREATE TABLE IF NOT EXISTS {s}.locks (
            scope text NOT NULL, name text NOT NULL, fence bigint NOT NULL DEFAULT 0,
            used_at timestamptz, pruned boolean NOT NULL DEFAULT false, PRIMARY KEY (scope, name))""",
        # A ticket: in line (waiting or holding) while ``line``; ``seq`` is its place (FIFO).
        # ``place_until`` (a waiter) and ``held_until`` (a holder) are on the database's clock;
        # ``ver`` counts the writes of ``body`` (compare-and-set).
        """CREATE TABLE IF NOT EXISTS {s}.tickets (
            id text PRIMARY KEY, scope text NOT NULL, name text NOT NULL,
            seq bigserial NOT NULL, line boolean NOT NULL, hold boolean NOT NULL DEFAULT false,
            fence bigint, slot integer, place_until timestamptz, held_until timestamptz,
            ended_at timestamptz, ver bigint NOT NULL DEFAULT 0, body jsonb NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS tickets_line ON {s}.tickets (scope, name, seq) WHERE line",
        "CREATE INDEX IF NOT EXISTS tickets_ended ON {s}.tickets (ended_at) WHERE NOT line",
        # Records (a lock's last success and requests; the backend's activity and fence ledger).
        """CREATE TABLE IF NOT EXISTS {s}.records (
            scope text NOT NULL, name text NOT NULL, key text NOT NULL, body bytea NOT NULL,
            version bigint NOT NULL, run text, expires_at timestamptz,
            PRIMARY KEY (scope, name, key))""",
        # A guarded command in flight (pearing-guard exec): the next holder waits for it.
        """CREATE TABLE IF NOT EXISTS {s}.guards (
            id text PRIMARY KEY, scope text NOT NULL, name text NOT NULL, ticket_id text NOT NULL,
            until timestamptz NOT NULL)""",
        # The thread service: a thread's highest fence, and its replies in the order accepted.
        """CREATE TABLE IF NOT EXISTS {s}.threads (
            scope text NOT NULL, thread bigint NOT NULL, fence bigint, PRIMARY KEY (scope, thread))""",
        """CREATE TABLE IF NOT EXISTS {s}.replies (
            scope text NOT NULL, thread bigint NOT NULL, reply_id text NOT NULL, seq bigserial NOT NULL,
            body jsonb NOT NULL, PRIMARY KEY (scope, thread, reply_id))""",
    ),
)
VERSION: Final = len(_STEPS)

_HEAD: Final = (
    'CREATE SCHEMA IF NOT EXISTS "{name}"',
    """CREATE TABLE IF NOT EXISTS {s}.pearing_schema (
        version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())""",
)


def head(name: str) -> list[str]:
    """The schema and its version table."""
    return [sql.format(name=name, s=f'"{name}"') for sql in _HEAD]


def steps(name: str, after: int) -> list[tuple[int, list[str]]]:
    """The steps above version ``after``, each with its statements, in order."""
    s = f'"{name}"'
    return [(i + 1, [sql.format(s=s) for sql in step]) for i, step in enumerate(_STEPS) if i + 1 > after]


def print_sql(name: str) -> str:
    """Every statement, for a DBA (``pearing-cli init-db --print-sql``)."""
    s = f'"{name}"'
    lines = ["BEGIN;", *(f"{sql};" for sql in head(name))]
    for version, stmts in steps(name, 0):
        lines += [f"{sql};" for sql in stmts]
        lines.append(f"INSERT INTO {s}.pearing_schema (version) VALUES ({version}) ON CONFLICT DO NOTHING;")
    lines.append("COMMIT;")
    return "\n".join(lines) + "\n"
