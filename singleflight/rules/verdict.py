"""The guard's verdict, once for every backend: is a token the live holder's right now, and if
not, why. A backend only reads what it knows of the claimed ticket (``Facts``); the order of
the checks and every refusal's wording live here, so a refusal reads the same on every store.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from singleflight.core.const import HELD, TYPE_CHECKING, WAITING
from singleflight.core.errors import BackendUnavailable, NotHeld
from singleflight.core.record import rfc3339
from singleflight.core.ticket import Ticket
from singleflight.core.tokens import Claim, Facts, Verdict, same_secret, token_hash

if TYPE_CHECKING:
    from collections.abc import Iterator

    from singleflight.backend import Backend

# Every refusal the guard gives, as users read it (tests compare them across backends).
UNKNOWN = "unknown or forged token"
NOT_YET_HELD = "not yet held: waiting in line"
HOLDER_GONE = "holder gone"
CUT_OFF = "lease expired: its holder cannot reach the backend"


def superseded(fence: int) -> str:
    return f"superseded by fence {fence}"


def lease_expired(t: Ticket) -> str:
    return f"lease expired at {rfc3339(t.lease_expires_at)}"


def judge(claim: Claim, facts: Facts, digest: str | None = None) -> Verdict:
    """The verdict on ``claim`` from what the store knows. ``digest``: the token's hash, if the
    caller has it already."""
    t = facts.ticket
    if t is None:
        return claim.refuse(UNKNOWN, ticket_id="")
    if t.state == WAITING:
        # Ticket ids and states are public (status lists them): saying so reveals nothing.
        return claim.refuse(NOT_YET_HELD, ticket_id=t.ticket_id)
    digest = digest or token_hash(claim.token)
    # Constant-time compare: a forger learns nothing from timing.
    if t.token_hash is None or not same_secret(t.token_hash, digest):
        return claim.refuse(UNKNOWN, ticket_id="")
    # With --slots other runs hold larger fences at the same time: a run's own ticket says.
    if t.slots == 1 and t.fence is not None and facts.fence_now is not None and facts.fence_now > t.fence:
        return claim.refuse(superseded(facts.fence_now), ticket_id=t.ticket_id, fence=t.fence)
    if t.state != HELD:
        return claim.refuse(t.describe_end(), ticket_id=t.ticket_id, fence=t.fence)
    if not facts.holder_alive:
        return claim.refuse(HOLDER_GONE, ticket_id=t.ticket_id, fence=t.fence)
    left = t.lease_left(time.monotonic())
    if left is not None and left <= 0:
        return claim.refuse(lease_expired(t), ticket_id=t.ticket_id, fence=t.fence)
    if facts.cut_off is not None and facts.cut_off():
        return claim.refuse(CUT_OFF, ticket_id=t.ticket_id, fence=t.fence)
    return claim.live(t.fence, ticket_id=t.ticket_id)


def verify(backend: Backend, claim: Claim) -> Verdict:
    """Is this token the live holder's right now? Never raises for a refusal."""
    digest = token_hash(claim.token)
    try:
        with backend.guard(claim, digest, None) as facts:
            return judge(claim, facts, digest)
    except BackendUnavailable as exc:
        return claim.refuse(str(exc))


@contextmanager
def hold_off(backend: Backend, claim: Claim, seconds: float) -> Iterator[Verdict]:
    """Verify, then keep expiry and hand-over waiting (at most ``seconds``) while inside.

    The hold is taken first and the token judged inside it: a verdict taken before could be
    stale by the time the side effect starts. NotHeld when the token is not live.
    """
    digest = token_hash(claim.token)
    if not claim.ticket_id:
        # PEARING_TOKEN + PEARING_LOCK + PEARING_REPO alone: a hold names its ticket, so find
        # the ticket by its token first (judged again below, once the hold is in place).
        with backend.guard(claim, digest, None) as facts:
            found = judge(claim, facts, digest)
        if not found.ok:
            raise NotHeld(found.ticket_id or "-", found.reason)
        claim = claim.of_ticket(found.ticket_id)
    with backend.guard(claim, digest, seconds) as facts:  # no ticket to hold: it went meanwhile
        verdict = judge(claim, facts, digest)
        if not verdict.ok:
            raise NotHeld(verdict.ticket_id or "-", verdict.reason)
        yield verdict
