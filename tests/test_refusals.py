"""Refusals read word for word the same on every backend.

Each situation is produced for real (runs that end, expire, are superseded; a forged token; a
ticket still in line) and its refusal line, with times, ids and numbers masked, must equal the
one template below. The templates are the same for every backend, so a backend whose wording
drifts fails here.
"""

from __future__ import annotations

import json
import re
import secrets
import uuid
from pathlib import Path

from helpers import PEARING_CLI, PEARING_GUARD, Gate, Procs, TextResult

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
