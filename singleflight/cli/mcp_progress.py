"""pearing-mcp's progress notifications while ``acquire_lock`` waits in line (issue 26).

A wait may last up to ``wait_seconds`` (validation takes up to ten years), and a model or its
client cannot tell a long wait from a hung server. While the call waits, and only when the
client asked for progress (a ``progressToken``), this sends every PROGRESS_SECONDS one
notification a model can read: ``waiting: position 2 in line, 14 s of 60 s``. Its
``progress`` is the seconds waited and its ``total`` the wait asked for, so both only grow.

The wait itself is untouched: ``ops.acquire`` blocks in its worker thread as before, and the
ticket's place is read beside it, the way ``list_locks`` reads it (``ops.status``). The caller
cancels ``report`` once the wait has ended, before the result goes out, so no notification
follows the result.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

from singleflight import ops
from singleflight.backend import Opened
from singleflight.core.errors import PearingError

# Every 2 s: often enough that a client resetting its request timeout on progress (the
# TypeScript SDK's resetTimeoutOnProgress) never gives up on a live wait, seldom enough that
# reading the line (one backend opened and closed) costs nothing next to the wait.
PROGRESS_SECONDS: Final = 2.0

# ``Ops._call``: a backend opened and closed per call.
Call = Callable[[Callable[[Opened], list[dict[str, Any]]]], list[dict[str, Any]]]
Send = Callable[[float, float, str], Awaitable[None]]


def asked(ctx: Any) -> bool:
    """Whether this request carries a progressToken (the SDK drops progress otherwise: no need to
    read the line for nobody). ``ctx``: the SDK's Context."""
    meta = ctx.request_context.meta
    return bool(meta) and meta.get("progress_token") is not None


def place(call: Call, repo: str, lock_name: str, request_uuid: str) -> int | None:
    """The 1-based place in line of the waiting ticket of ``request_uuid``; None while its agent
    has not joined the line yet (or the ticket no longer waits)."""
    wanted = request_uuid.lower()
    for lock in call(lambda b: ops.status(b, repo, lock_name)):
        for waiter in lock["waiters"]:
            if str(waiter.get("request_uuid", "")).lower() == wanted:  # foreign etcd keys have none
                position = waiter.get("queue_position")
                return position if isinstance(position, int) else None
    return None


def _seconds(value: float) -> str:
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def message(position: int | None, elapsed: float, wait: float, *, known: bool = True) -> str:
    """``known`` False: the line could not be read this time (the wait goes on regardless)."""
    where = "" if not known else "joining the line, " if position is None else f"position {position} in line, "
    return f"waiting: {where}{elapsed:.0f} s of {_seconds(wait)} s"


async def report(send: Send, where: Callable[[], int | None], wait: float) -> None:
    """Send progress every PROGRESS_SECONDS until cancelled, or until ``wait`` seconds have passed.

    ``send``: the SDK's ``Context.report_progress``; ``where``: ``place`` for this call (it
    blocks: run in a worker thread, abandoned if the wait ends meanwhile, so the result is not
    held back by a slow read of the line).
    """
    import anyio
    import anyio.to_thread

    start = anyio.current_time()
    tick = 0
    while True:
        tick += 1
        await anyio.sleep_until(start + tick * PROGRESS_SECONDS)
        known = True
        try:
            position = await anyio.to_thread.run_sync(where, abandon_on_cancel=True)
        except PearingError:  # an etcd member away, say: the wait is not this read's to end
            position, known = None, False
        elapsed = anyio.current_time() - start
        if elapsed >= wait:
            return  # the wait is over: the result is on its way
        try:
            await send(round(elapsed, 1), wait, message(position, elapsed, wait, known=known))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return  # the client is gone; its call is being cancelled, and the wait with it
