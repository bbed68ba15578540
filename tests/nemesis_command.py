"""The COMMAND of the nemesis campaign (tests/test_nemesis.py), and its guarded writer.

Every record is one line appended to one shared log with a single ``write(2)`` on an
``O_APPEND`` fd, so lines of concurrent processes never interleave. Times are
``time.monotonic_ns()``: CLOCK_MONOTONIC, one clock for every process on the host,
the test included.

    run LOG CID KEY=VALUE...       the COMMAND pearing-run starts (see ``Plan``)
    write LOG CID MODE DELAY RESOURCE TARGET_LOCK
                                   a side effect: after DELAY s, record ``write`` (MODE
                                   ``fence``/``both``: only if ``pearing-guard fence`` accepts
                                   our fence, checked and written under TARGET_LOCK, as a
                                   target that checks fences must do atomically)

Lines (F = $PEARING_FENCE, NS = monotonic ns, PID = this process):

    start F NS PID STARTTIME CID   first thing COMMAND does
    end F NS PID CID HOW           last thing it does (HOW: done, term, refused)
    begin F NS PID CID MODE        a side effect set off (the writer runs)
    write F NS PID CID MODE        a side effect landed
    refused F NS PID CID WHAT      pearing-guard exec / fence / heartbeat said no
    beat F NS0 NS1 PID CID         a heartbeat accepted: pearing-cli started at NS0, ended at NS1
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

BIN = os.path.dirname(sys.executable)
PEARING_CLI = os.path.join(BIN, "pearing-cli")
PEARING_GUARD = os.path.join(BIN, "pearing-guard")
# COMMAND's status when a heartbeat was refused: not 1, which pearing-run itself must never use.
REFUSED = 3


def record(log: str, *words: object) -> None:
    line = (" ".join(str(w) for w in words) + "\n").encode()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def starttime() -> str:
    with open(f"/proc/{os.getpid()}/stat", "rb") as f:
        data = f.read()
    return data[data.rindex(b")") + 2 :].split()[19].decode()


class Plan:
    """What one COMMAND does, from ``KEY=VALUE`` arguments chosen by the test's seeded RNG.

    hold=S          run this long, then end
    until=PATH      ... or end as soon as PATH exists (a test's gate, instead of a guess at how
                    long the others take to start on a loaded machine)
    term=die|S      on SIGTERM: die at once (default action), or take S s to clean up
                    (then record ``end ... term``): the late end where overlaps hide
    hb=auto|P|P:H   --heartbeat manual: heartbeat every P s (stop after H s: a hung agent)
    lease=S         the lease a heartbeat asks for
    guard=none|exec|fence|both   the side effect, half way through the hold
    delay=S         how long the side effect takes before it lands
    max=S           pearing-guard exec --max-seconds
    resource=R      pearing-guard fence --resource
    target=PATH     the target's own lock (fence check and write are one step)
    """

    def __init__(self, args: list[str]) -> None:
        kv = dict(a.split("=", 1) for a in args)
        self.hold = float(kv.get("hold", "0.1"))
        self.term = kv.get("term", "die")
        self.hb = kv.get("hb", "auto")
        self.lease = kv.get("lease", "2")
        self.guard = kv.get("guard", "none")
        self.delay = kv.get("delay", "0")
        self.max = kv.get("max", "1")
        self.resource = kv.get("resource", "nemesis")
        self.target = kv.get("target", "")
        self.until = kv.get("until", "")


def run(log: str, cid: str, plan: Plan) -> int:
    fence = os.environ.get("PEARING_FENCE", "0")
    me = os.getpid()
    if plan.term != "die":
        cleanup = float(plan.term)

        def on_term(signum: int, frame: object) -> None:
            time.sleep(cleanup)  # a handler that flushes state before exiting
            record(log, "end", fence, time.monotonic_ns(), me, cid, "term")
            os._exit(143)

        signal.signal(signal.SIGTERM, on_term)
    record(log, "start", fence, time.monotonic_ns(), me, starttime(), cid)
    started = time.monotonic()
    period, hang_after = None, None
    if plan.hb != "auto":
        p, _, h = plan.hb.partition(":")
        period, hang_after = float(p), float(h) if h else None
    wrote = plan.guard == "none"
    next_hb = started + (period or 0)
    while True:
        now = time.monotonic()
        if now - started >= plan.hold or (plan.until and os.path.exists(plan.until)):
            break
        if not wrote and now - started >= plan.hold / 2:
            wrote = True
            side_effect(log, cid, fence, plan)
            continue
        if period is not None and now >= next_hb and (hang_after is None or now - started < hang_after):
            hb = [PEARING_CLI, "heartbeat-lock-ticket", "--lease-seconds", plan.lease]
            # Every P s from one start to the next (as a cron-like beat is), not P s after the
            # last one ended: on a loaded machine one pearing-cli start takes seconds, and a
            # beat that waited P more after it would not come within every lease period.
            next_hb = max(next_hb + period, now)
            sent = time.monotonic_ns()
            if subprocess.run(hb, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False).returncode:
                # The lease is gone: the caller must stop (SPEC), and does.
                record(log, "refused", fence, time.monotonic_ns(), me, cid, "heartbeat")
                record(log, "end", fence, time.monotonic_ns(), me, cid, "refused")
                return REFUSED
            record(log, "beat", fence, sent, time.monotonic_ns(), me, cid)
            continue
        wake = started + plan.hold
        if period is not None:
            wake = min(wake, next_hb)
        if not wrote:
            wake = min(wake, started + plan.hold / 2)
        time.sleep(max(0.0, min(wake - time.monotonic(), 0.05)))
    record(log, "end", fence, time.monotonic_ns(), me, cid, "done")
    return 0


def side_effect(log: str, cid: str, fence: str, plan: Plan) -> None:
    writer = [sys.executable, "-S", os.path.abspath(__file__), "write", log, cid, plan.guard, plan.delay]
    writer += [plan.resource, plan.target]
    if plan.guard in ("exec", "both"):
        writer = [PEARING_GUARD, "exec", "--max-seconds", plan.max, "--", *writer]
    rc = subprocess.run(writer, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False).returncode
    if rc == 1 and plan.guard in ("exec", "both"):
        record(log, "refused", fence, time.monotonic_ns(), os.getpid(), cid, "guard-exec")


def write(log: str, cid: str, mode: str, delay: str, resource: str, target: str) -> int:
    fence = os.environ.get("PEARING_FENCE", "0")
    record(log, "begin", fence, time.monotonic_ns(), os.getpid(), cid, mode)
    time.sleep(float(delay))  # the push or post takes a while
    if mode not in ("fence", "both"):
        record(log, "write", fence, time.monotonic_ns(), os.getpid(), cid, mode)
        return 0
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        check = [PEARING_GUARD, "fence", "--resource", resource, "--fence", fence]
        if subprocess.run(check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False).returncode:
            record(log, "refused", fence, time.monotonic_ns(), os.getpid(), cid, "fence")
            return 1
        record(log, "write", fence, time.monotonic_ns(), os.getpid(), cid, mode)
        return 0
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    if argv[0] == "run":
        return run(argv[1], argv[2], Plan(argv[3:]))
    if argv[0] == "write":
        return write(*argv[1:7])
    raise SystemExit(f"usage: {__doc__}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
