"""What each backend's store can do, as the tests need to know it: one table.

A behaviour test that expects something different on one backend asks for the property
that makes it differ (``caps.contiguous_fences``), never for the backend's name, so a new
backend runs the suite unchanged once it has a row here. This is the only place in the
tests that maps a backend's name to what it can do (tests/test_architecture.py checks that
no other test compares the name).
"""

from __future__ import annotations

import dataclasses
from typing import Final

from singleflight.core.const import MIN_LEASE_SECONDS


@dataclasses.dataclass(frozen=True)
class Caps:
    name: str
    # A lock's fences count 1, 2, 3... from its first holder, none skipped, each lock on its own
    # (etcd's are create revisions: shared by every key, so they start anywhere and skip).
    contiguous_fences: bool
    # Tickets, requests and the fence are files in the lock dir that a test may read directly,
    # before any command of the product sweeps them.
    records_in_lock_dir: bool
    # A held lock is a kernel flock on the lock's file in the lock dir, which the holder keeps open.
    lock_is_flock: bool
    # Neither a held lock nor a place in line lapses while its processes are frozen: nothing
    # has to be renewed (the kernel keeps the flock; etcd's leases lapse unless kept alive).
    outlives_freeze: bool
    # The wrapper keeps the holder's lease alive by itself, so a holder frozen past its lease
    # may wake still holding it.
    wrapper_renews_lease: bool
    # The holder lets go a margin before the store would expire its lease: within a short lease
    # that margin covers only a small kill grace (docs/backends.md: lease >= 3 x (grace + 1)).
    holder_gives_up_early: bool
    # The shortest lease, in seconds, the store keeps as asked (etcd counts whole seconds, at least 2).
    shortest_lease: float
    # How much earlier than the truth a reported lease_expires_at may be, in seconds (etcd
    # reports a lease's remaining whole seconds).
    expiry_rounding: float
    # A killed waiter stops blocking the line within this many seconds (the kernel drops a lock
    # dir waiter at once; an etcd waiter's key lives until its lease expires: the SPEC's 5 s).
    dead_waiter_bound: float
    # Several hosts (each with its own lock dir) share one lock through the store.
    shared_by_hosts: bool
    # Tickets and records are rows of SQL tables in the backend URL's schema, which a test may
    # read (``helpers.pg_query``); else, a store with a URL keeps them as etcd keys.
    records_in_tables: bool = False
    # What the store's own client loads as it connects, which a run on it cannot do without
    # (tests/test_startup.py): psycopg imports these (ssl through asyncio), and libpq links
    # OpenSSL's libcrypto. Every other store's run must load none of them.
    client_modules: frozenset[str] = frozenset()
    client_links_openssl: bool = False
    # The URL lists several endpoints, and the client asks the next when one fails or answers
    # garbage (etcd's members): a hostile peer can be put among them.
    endpoints_in_url: bool = False


# The lock dir's row is also what a local_only test (no ``backend``, so no ``caps``) passes on.
LOCAL: Final = Caps(
    name="local",
    contiguous_fences=True,
    records_in_lock_dir=True,
    lock_is_flock=True,
    outlives_freeze=True,
    wrapper_renews_lease=False,
    holder_gives_up_early=False,
    shortest_lease=MIN_LEASE_SECONDS,
    expiry_rounding=0.0,
    dead_waiter_bound=1.0,
    shared_by_hosts=False,
)
ETCD: Final = Caps(
    name="etcd",
    contiguous_fences=False,
    records_in_lock_dir=False,
    lock_is_flock=False,
    outlives_freeze=False,
    wrapper_renews_lease=True,
    holder_gives_up_early=True,
    shortest_lease=2.0,
    expiry_rounding=1.0,
    dead_waiter_bound=5.0,
    shared_by_hosts=True,
    endpoints_in_url=True,
)
# PostgreSQL: leases on the database's clock, kept by wrapper and holder alike (as etcd's), a
# waiter's place renewed every second and lapsing within 3 s; fences count 1, 2, 3 per lock.
POSTGRES: Final = Caps(
    name="postgres",
    contiguous_fences=True,
    records_in_lock_dir=False,
    lock_is_flock=False,
    outlives_freeze=False,
    wrapper_renews_lease=True,
    holder_gives_up_early=True,
    shortest_lease=2.0,
    expiry_rounding=0.0,
    dead_waiter_bound=5.0,
    shared_by_hosts=True,
    records_in_tables=True,
    client_modules=frozenset(
        {"psycopg", "ctypes", "inspect", "json", "subprocess", "threading", "typing", "ssl", "_ssl"}
    ),
    client_links_openssl=True,
)
CAPS: Final = {c.name: c for c in (LOCAL, ETCD, POSTGRES)}


def caps_of(backend: str) -> Caps:
    """The Caps of a ``backend`` fixture's value: a name (``local``, ``etcd``) or a URL (``etcd://...``)."""
    scheme = backend.partition("://")[0]
    scheme = "postgres" if scheme == "postgresql" else scheme
    try:
        return CAPS[scheme]
    except KeyError:
        raise LookupError(f"no Caps row for backend {backend!r}: add one to tests/caps.py") from None
