"""How pearing-run's holder is born: forked by the wrapper and detached (its own session, none
of the caller's fds) as the run starts to wait, and handed the grip (``go``) once first: what
``Grip.handover`` says and the grip's fds (the lock dir's flocked fd, over a socketpair), so no
fork lies between the previous holder's release and COMMAND's start. A run that gets the lock
at once, or whose standby holder died, forks it with the grip instead. The child then takes
the lease and serves it (``holder.Holder``) until the run is over."""

from __future__ import annotations

import os
import signal

from singleflight.backend import Opened
from singleflight.core import fault, protocol
from singleflight.core.const import TYPE_CHECKING, ExitCode
from singleflight.core.errors import NotHeld, PearingError
from singleflight.core.protocol import Channel
from singleflight.core.reasons import EndReason, Loss
from singleflight.core.tokens import token_hash
from singleflight.holder import HOLDER_SIGNALS, Holder, HolderConfig, detach

if TYPE_CHECKING:
    from typing import Any

    from singleflight.backend import Grip
    from singleflight.core.ticket import Ticket
    from singleflight.runopts import RunOptions


def fork_holder(o: RunOptions, ticket: Ticket, grip: Grip | None) -> tuple[int, Channel]:
    """The holder's pid and the wrapper's end of their channel. Forked without the grip, the
    holder hears from us over a socketpair, which can carry the grip's fds with ``go``."""
    cfg = HolderConfig(
        heartbeat_auto=o.heartbeat_auto,
        max_runtime=o.max_runtime,
        kill_grace=o.kill_grace,
        request_uuid=o.request_uuid,
        dedupe_window=o.dedupe_window,
        record_success=o.min_interval is not None,
    )
    to_r, to_w = os.pipe() if grip is not None else protocol.socketpair()
    from_r, from_w = os.pipe()
    # Until the holder's own handlers are in place (Holder() unblocks them), a stop
    # signal or a poke stays pending instead of hitting the wrapper's handlers in it.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, HOLDER_SIGNALS)
    pid = os.fork()
    if pid == 0:  # the holder
        code = ExitCode.SOFTWARE
        try:
            os.close(to_w)
            os.close(from_r)
            detach({*(grip.handover()[1] if grip is not None else ()), to_r, from_w})
            code = _serve(o, ticket, grip, cfg, Channel(to_r, from_w))
        finally:
            os._exit(int(code))
    signal.pthread_sigmask(signal.SIG_SETMASK, old)
    os.close(to_r)
    os.close(from_w)
    return pid, Channel(from_r, to_w)


def _serve(o: RunOptions, ticket: Ticket, grip: Grip | None, cfg: HolderConfig, chan: Channel) -> ExitCode:
    """In the forked holder: take ownership, report, and serve the lease. Forked without the
    grip (as the run started to wait), first wait for it."""
    try:
        # Fresh handles: detaching closed every fd of the wrapper's but the grip's.
        at = Opened(o.backend, o.lock_dir)
        lk = at.backend.lock(o.repo, o.job, create=False)
        held: Grip | dict[str, Any] | None = grip
        if held is None:
            token_hash("")  # its hash module loaded now, while the run waits, not after the fence
            msg, fds = chan.recv_fds()
            if msg is None or msg.kind != protocol.GO:
                for fd in fds:
                    os.close(fd)
                return ExitCode.OK  # the run ended without the lock (timed out, busy, killed)
            # What ``Grip.handover`` described and the grip's fds (ours now, the wrapper keeps
            # its own): ``take`` takes them as the grip.
            held = {**msg.info, "fds": fds}
        fault.pause("pause-holder-start")
        try:
            lease, taken = lk.take(held, ticket, promoted=ticket.promoted, kill_grace=o.kill_grace)
        except NotHeld:
            # Released by its owner as its turn came: COMMAND never starts. The wrapper lets go
            # of the lock (its grip) and exits as a run that lost it.
            record = lk.read(ticket.ticket_id)
            loss = record.loss() if record is not None else None
            chan.send(protocol.lost(loss or Loss(EndReason.LAPSED_BEFORE_START)))
            return ExitCode.OK
        chan.send(protocol.ready(taken))
        Holder(at, lk, lease, cfg, chan).serve()
    except PearingError as exc:
        chan.send(protocol.error(exc.exit_code, str(exc)))
        return exc.exit_code
    except BaseException as exc:  # noqa: BLE001 - the holder must report, never vanish silently
        chan.send(protocol.error(ExitCode.SOFTWARE, EndReason.INTERNAL.text(repr(exc))))
        return ExitCode.SOFTWARE
    return ExitCode.OK
