"""Exit codes, environment names and defaults: the contract, defined once."""

from __future__ import annotations

from enum import IntEnum

# typing.TYPE_CHECKING without importing typing, about 6 ms of every start: False at run time,
# and mypy reads any TYPE_CHECKING as typing's, so what a module imports under `if TYPE_CHECKING:`
# (typing's names, collections.abc's, the Protocols' base) is the checker's only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final


class ExitCode(IntEnum):
    OK = 0
    REFUSED = 1
    USAGE = 64
    UNAVAILABLE = 69  # a part of the install is missing (pearing-mcp without its extra)
    SOFTWARE = 70
    CANTCREAT = 73
    IOERR = 74
    BUSY = 75
    NOPERM = 77
    LEASE_LOST = 124
    NOEXEC = 126
    NOTFOUND = 127
    INTERRUPTED = 130  # ^C at a front end: 128 + SIGINT, as shells report it


ENV_LOCK: Final = "PEARING_LOCK"
ENV_REPO: Final = "PEARING_REPO"
ENV_TICKET: Final = "PEARING_TICKET"
ENV_FENCE: Final = "PEARING_FENCE"
ENV_TOKEN: Final = "PEARING_TOKEN"
ENV_TOKEN_FILE: Final = "PEARING_TOKEN_FILE"
ENV_LOCK_DIR: Final = "PEARING_LOCK_DIR"
ENV_PROMOTED: Final = "PEARING_PROMOTED"
ENV_SLOT: Final = "PEARING_SLOT"
ENV_IDENTITY: Final = "PEARING_IDENTITY"
ENV_BACKEND: Final = "PEARING_BACKEND"
ENV_METRICS_DIR: Final = "PEARING_METRICS_DIR"
# Test-only fault injection: "POINT" or "POINT,POINT"; see singleflight/_fault.py.
ENV_FAULT: Final = "PEARING_FAULT"

DEFAULT_SCOPE: Final = "default"
DEFAULT_LEASE_SECONDS: Final = 60.0
# pearing-cli prune's --older-than: a week without use, longer than any daily or weekly job's
# --min-interval; a job with a longer one needs a longer --older-than (docs/choices.md).
DEFAULT_PRUNE_AGE: Final = "7d"
DEFAULT_KILL_GRACE: Final = 10.0
DEFAULT_DEDUPE_WINDOW: Final = 24 * 3600.0
DEFAULT_GUARD_MAX_SECONDS: Final = 60.0
# A shorter lease cannot be renewed in time: the holder renews every third of it, and a
# CLI heartbeat or an MCP round trip takes tens of milliseconds.
MIN_LEASE_SECONDS: Final = 0.5
# Every duration a user gives is at most ten years: timers must honour what validation accepts.
MAX_SECONDS: Final = 10 * 365 * 86400.0
# Fences are etcd revisions on the etcd backend, which are int64.
MAX_FENCE: Final = 2**63 - 1
ROOT_LOCK_DIR: Final = "/var/lib/pearing"
# A waiting ticket's place in a shared store's line lapses this long after it was last kept
# (by its waiter, or by its owner until the agent that waits for it has started): a waiter or
# owner killed with -9 stops blocking the line within it.
PLACE_TTL: Final = 3
# Ended tickets stay readable (get-lock-ticket, idempotent release) this long.
ENDED_TICKET_RETENTION: Final = 3600.0
# How long a request's record that names its ticket (pearing-cli acquire-lock's: a retry of the
# uuid finds that ticket) is kept, on every store; a claim whose run is gone goes after it too.
REQUEST_RETENTION: Final = 24 * 3600.0
# Pruning and sweeping a lock's records happens at most this often.
HOUSEKEEPING_EVERY: Final = 60.0

# Ticket states, as SPEC.md names them.
WAITING: Final = "waiting"
HELD: Final = "held"
RELEASED: Final = "released"
EXPIRED: Final = "expired"
CANCELLED: Final = "cancelled"

# --heartbeat: the lease is renewed while COMMAND lives, or only by its own heartbeats.
HEARTBEAT_AUTO: Final = "auto"
HEARTBEAT_MANUAL: Final = "manual"
HEARTBEAT_MODES: Final = (HEARTBEAT_AUTO, HEARTBEAT_MANUAL)

# An identity's activity text: shown on its tickets and in a status table row, so bounded.
MAX_ACTIVITY: Final = 1000

# --queue: FIFO waiters keep their order; a `latest` waiter replaces older `latest` ones.
QUEUE_FIFO: Final = "fifo"
QUEUE_LATEST: Final = "latest"
QUEUE_MODES: Final = (QUEUE_FIFO, QUEUE_LATEST)
SUPERSEDED: Final = "superseded by "
# --max-waiting: how many may wait in a lock's line before a newcomer is turned away (busy).
MAX_WAITING: Final = 10000
# --slots: at most this many COMMANDs of one lock at once (each holds a flocked file of its own).
MAX_SLOTS: Final = 1000

# Request-uuid records: one run of a request is in flight (active) or ended.
REQUEST_ACTIVE: Final = "active"
REQUEST_SUCCEEDED: Final = "succeeded"
REQUEST_FAILED: Final = "failed"

# A claim on a request uuid, before running: run it, it is done, or it is in flight.
CLAIM_RUN: Final = "run"
CLAIM_DONE: Final = "done"
CLAIM_BUSY: Final = "busy"
