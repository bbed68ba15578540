"""Refusals read word for word the same on every backend.

Each situation is produced for real (runs that end, expire, are superseded; a forged token; a
ticket still in line) and its refusal line, with times, ids and numbers masked, must equal the
one template below. The templates are the same for every backend, so a backend whose wording
drifts fails here.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from caps import Caps
from helpers import PEARING_CLI, PEARING_GUARD, PEARING_RUN, Gate, Procs, TextResult, q, wait_for

from singleflight.core.const import ExitCode

TEMPLATES = {
    "released": "refused: released (command exited 0) at <T>",
    "superseded": "refused: superseded by fence <N>",
    "expired": "refused: expired (lease expired) at <T>",
    "forged": "refused: unknown or forged token",
    "unknown": "refused: unknown or forged token",
    "not yet held": "refused: not yet held: waiting in line",
    "heartbeat released": "error: ticket <ID>: released (command exited 0) at <T>",
    "heartbeat unknown": "error: ticket <ID>: unknown ticket",
}

_MASKS = (
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"), "<T>"),
    (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"), "<ID>"),
    (re.compile(r"(?<=fence )\d+"), "<N>"),
)


def _mask(line: str) -> str:
    # The prefix a front end puts before its line ("pearing-guard: ") is not the refusal.
    line = line.split(": ", 1)[1] if line.startswith("pearing-") else line
    for pattern, repl in _MASKS:
        line = pattern.sub(repl, line)
    return line


def _run_env(work: Path, name: str) -> dict[str, str]:
    """The PEARING_* environment a COMMAND saw (saved by ``_save_env``)."""
    out = {}
    for line in (work / name).read_text().splitlines():
        key, _, value = line.partition("=")
        if key.startswith("PEARING_") and key != "PEARING_TOKEN_FILE":
            out[key] = value
    return out


def _save_env(name: str) -> str:
    return f"env > {name}"


def _verify(procs: Procs, run_env: dict[str, str], **override: str) -> TextResult:
    env = {k: v for k, v in procs.env.items() if not k.startswith("PEARING_TOKEN")}
    env.update(run_env)
    env.update(override)
    return procs.run_text([PEARING_GUARD, "verify"], env=env)


def _refusal(r: TextResult) -> str:
    assert r.returncode == ExitCode.REFUSED, r
    return _mask(r.one_line())


def test_every_refusal_reads_the_same_on_every_backend(backend: str, work_procs: Procs, work: Path) -> None:
    seen: dict[str, str] = {}
    job = f"refusals-{uuid.uuid4().hex[:8]}"

    # A run that ended: its token is refused as released, with the time it ended.
    first = work_procs.pr_run("--job", job, "--", "sh", "-c", _save_env("a.env"))
    assert first.returncode == 0, first
    a = _run_env(work, "a.env")
    seen["released"] = _refusal(_verify(work_procs, a))
    heartbeat = [PEARING_CLI, "heartbeat-lock-ticket", job, a["PEARING_TICKET"], "--lease-seconds", "5"]
    seen["heartbeat released"] = _refusal(work_procs.run_text(heartbeat))

    # A later run held the lock: the first one's token is superseded.
    second = work_procs.pr_run("--job", job, "--", "sh", "-c", _save_env("b.env"))
    assert second.returncode == 0, second
    seen["superseded"] = _refusal(_verify(work_procs, a))

    # A lease that lapsed (nobody heartbeated a manual lease), with no later holder.
    lapsed = f"{job}-x"
    p = work_procs.pr(
        "--job", lapsed, "--heartbeat", "manual", "--lease-seconds", "1", "--", "sh", "-c", "env > c.env; sleep 30"
    )
    assert work_procs.finish(p).returncode == ExitCode.LEASE_LOST
    seen["expired"] = _refusal(_verify(work_procs, _run_env(work, "c.env")))

    # A live holder: a forged token for its ticket, and a ticket that is not there at all.
    gate = Gate(work)
    holder = work_procs.pr("--job", job, "--", "sh", "-c", f"{_save_env('d.env')}; {gate.script()}")
    gate.wait_ready()
    d = _run_env(work, "d.env")
    assert _verify(work_procs, d).returncode == 0
    seen["forged"] = _refusal(_verify(work_procs, d, PEARING_TOKEN=secrets.token_hex(32)))
    seen["unknown"] = _refusal(_verify(work_procs, d, PEARING_TICKET=str(uuid.uuid4())))
    unknown = [PEARING_CLI, "heartbeat-lock-ticket", job, str(uuid.uuid4()), "--lease-seconds", "5"]
    seen["heartbeat unknown"] = _refusal(work_procs.run_text(unknown))

    # A ticket waiting in line behind it.
    acquire = [PEARING_CLI, "acquire-lock", job, "--request-uuid", str(uuid.uuid4()), "--lease-seconds", "30"]
    waiting = work_procs.run_text(acquire)
    assert waiting.returncode == ExitCode.BUSY and waiting.json["state"] == "waiting", waiting
    seen["not yet held"] = _refusal(_verify(work_procs, d, PEARING_TICKET=waiting.json["ticket_id"]))
    release = [PEARING_CLI, "release-lock-ticket", job, waiting.json["ticket_id"]]
    assert work_procs.run_text(release).returncode == 0

    gate.open()
    assert work_procs.finish(holder).returncode == 0
    assert seen == TEMPLATES, json.dumps(seen, indent=2)


def _children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_run_lost_with_its_host_reads_expired_not_unknown(caps: Caps, work_procs: Procs, work: Path) -> None:
    """A run on another host whose wrapper, holder and COMMAND all die together (that host lost
    mid-run): nobody ends its ticket, and from here its processes cannot be looked at. Once its
    lease has run out, its token is refused as a ticket that was held, never as unknown or
    forged, and its ticket reads expired. (etcd, whose key lapses with the lease, forgot the
    ticket: "unknown or forged token", and get-lock-ticket said the lock did not exist.)"""
    if not caps.shared_by_hosts:
        pytest.skip("the lock dir is one host's: a run on another host does not share it")
    namespaces = ["unshare", "--uts", "--mount", "true"]
    if os.geteuid() != 0 or shutil.which("unshare") is None or subprocess.run(namespaces, check=False).returncode:
        pytest.skip("another host is a host name and a boot id of its own (namespaces): root and unshare(1)")
    job = f"gone-{uuid.uuid4().hex[:8]}"
    gate = Gate(work)
    boot = work / "boot_id"
    boot.write_text(f"{uuid.uuid4()}\n")
    script = f"{_save_env('e.env')}; {gate.script()}"
    elsewhere = (
        f"mount --bind {q(boot)} /proc/sys/kernel/random/boot_id && hostname elsewhere-{job} && "
        f"exec {PEARING_RUN} --job {job} --lease-seconds 2 -- sh -c {q(script)}"
    )
    run = work_procs.start(["unshare", "--uts", "--mount", "sh", "-c", elsewhere])
    gate.wait_ready()
    processes = [run.pid, *_children(run.pid)]  # the wrapper, its holder and COMMAND

    def expiry() -> str | None:  # once the store names the holder's own process (etcd: settled)
        out = work_procs.run_text([PEARING_CLI, "status", job, "--json"])
        locks = json.loads(out.stdout or "[]")
        held = [h for h in (locks[0]["holders"] if locks else []) if h.get("holder_pid") in processes[1:]]
        return held[0]["lease_expires_at"] if held else None

    settled = wait_for(expiry, 15, "the holder to be named in the store")
    # A renewal since: the deadline the lost run reports is its last one, not the one it settled with.
    renewed = wait_for(lambda: (e := expiry()) is not None and e > settled and e, 15, "a renewal")
    for pid in processes:
        os.kill(pid, signal.SIGSTOP)  # all at once: none of them sees another die
    for pid in processes:
        os.kill(pid, signal.SIGKILL)
    work_procs.finish(run)
    e = _run_env(work, "e.env")
    get = [PEARING_CLI, "get-lock-ticket", job, e["PEARING_TICKET"]]

    def expired() -> bool:
        out = work_procs.run_text(get)
        assert out.returncode == 0, out  # the ticket is known throughout
        return out.json["state"] == "expired"

    wait_for(expired, 20, "the ticket to read expired")
    refused = _verify(work_procs, e)
    assert refused.returncode == ExitCode.REFUSED, refused
    assert _mask(refused.one_line()) == TEMPLATES["expired"], refused  # SPEC: lease expired (when)
    # One end time, whoever reads it when: before the next run, and after it took the lock (and
    # PostgreSQL's sweep wrote the lapsed row). It was each reader's own time there, and none on
    # etcd, which does not say when a lease ran out: the ticket's copy carries its last deadline.
    before = work_procs.run_text(get).json["ended_at"]
    assert before is not None and before >= renewed, (before, renewed)
    assert work_procs.pr_run("--job", job, "--", "true").returncode == 0
    assert work_procs.run_text(get).json["ended_at"] == before
