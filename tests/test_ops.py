"""Operator experience: unit files, log lines, status output, --version, README blocks.

Tests that take ``backend`` (or ``caps``) run on the lock dir and on etcd, where fences are revisions.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from caps import Caps
from helpers import BIN_DIR, PEARING_CLI, PEARING_GUARD, PEARING_RUN, Gate, Procs, holder_pid, q, wait_queued

from singleflight import __version__
from singleflight.core.const import ExitCode

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


# -- systemd and cron --------------------------------------------------------------------


SYSTEMD = ROOT / "contrib/systemd"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("unit", ["pearing-run", "pearing-run-fleet"])
def test_systemd_units_verify_clean(unit: str, tmp_path: Path) -> None:
    """The shipped units pass systemd-analyze verify once their paths point at an install."""
    job = tmp_path / "jobs" / "checkin"
    job.parent.mkdir()
    job.write_text("#!/bin/sh\nexit 0\n")
    job.chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    for name in (f"{unit}@.service", f"{unit}@.timer"):
        text = (SYSTEMD / name).read_text()
        text = text.replace("/usr/local/bin/pearing-run", PEARING_RUN)
        text = text.replace("/usr/local/lib/pearing/jobs", str(job.parent))
        (units / name).write_text(text)
    service = (units / f"{unit}@.service").read_text()
    assert "SuccessExitStatus=75" in service
    assert f"Unit={unit}@%i.service" in (units / f"{unit}@.timer").read_text()
    # Documentation= names what the host itself can open, never a web page that may not exist.
    docs = re.search(r"^Documentation=(.*)$", service, re.M).group(1).split()  # type: ignore[union-attr]
    assert "man:pearing-run(1)" in docs and all(d.startswith(("man:", "file:/")) for d in docs), docs
    grace = int(re.search(r"--kill-grace (\d+)", service).group(1))  # type: ignore[union-attr]
    assert int(re.search(r"TimeoutStopSec=(\d+)", service).group(1)) > grace  # type: ignore[union-attr]
    # Instances are what systemd verifies; link them next to the templates.
    for suffix in ("service", "timer"):
        (units / f"{unit}@checkin.{suffix}").symlink_to(units / f"{unit}@.{suffix}")
    r = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(units / f"{unit}@checkin.service"),
         str(units / f"{unit}@checkin.timer")],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    problems = [line for line in r.stderr.splitlines() if "pearing" in line]
    assert r.returncode == 0 and not problems, r.stderr
    # Hardened: systemd's own review rates the unit "OK" (at most 4.0; it was 9.6 UNSAFE).
    sec = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(units / f"{unit}@checkin.service")],
        capture_output=True,
        text=True,
        check=False,
    )
    score = re.search(r"Overall exposure level for \S+: ([0-9.]+)", sec.stdout + sec.stderr)
    assert score is not None and float(score.group(1)) <= 4.0, sec.stdout[-2000:] + sec.stderr


def test_systemd_fleet_unit_shares_the_hardening_and_needs_its_backend(tmp_path: Path) -> None:
    """pearing-run-fleet@.service is pearing-run@.service's hardening, line for line, plus a shared
    backend whose placeholder fails the unit (64) until filled in: not empty (the local lock dir)
    and not an unreachable host (75, which the unit counts as a success)."""

    def hardening(name: str) -> str:
        text = (SYSTEMD / name).read_text()
        return text[text.index("\n# Hardening") :]

    assert hardening("pearing-run-fleet@.service") == hardening("pearing-run@.service")
    service = (SYSTEMD / "pearing-run-fleet@.service").read_text()
    backends = re.findall(r"^Environment=PEARING_BACKEND=(.+)$", service, re.M)
    assert len(backends) == 1, backends
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEARING_")}
    env.update(PEARING_BACKEND=backends[0], PEARING_LOCK_DIR=str(tmp_path / "ld"))
    r = subprocess.run(
        [PEARING_RUN, "--job", "checkin", "--", "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == ExitCode.USAGE, r
    assert backends[0] in r.stderr, r.stderr


def test_cron_example_hourly_line_runs_once(backend: str, procs: Procs, work: Path) -> None:
    """The crontab's hourly line (its --backend replaced by the test's backend) runs once per period."""
    line = next(x for x in (ROOT / "contrib/cron/crontab.example").read_text().splitlines() if "hourly-sync" in x)
    assert "md5sum" not in line and "--min-interval 50m" in line
    flags = shlex.split(line.split("pearing-run", 1)[1].split(" -- ", 1)[0])
    i = flags.index("--backend")
    del flags[i : i + 2]
    marker = work / "ran"
    cmd = [*flags, "--", "sh", "-c", f"echo x >> {q(marker)}"]
    assert procs.pr_run(*cmd).returncode == 0
    assert procs.pr_run(*cmd).returncode == 0
    assert marker.read_text() == "x\n"


# -- log lines ---------------------------------------------------------------------------


def test_verbose_text_lines_name_each_lifecycle_event(caps: Caps, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    holder = procs.pr("-v", "--job", "j", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    waiter = procs.pr("-v", "--job", "j", "--wait-seconds", "20", "--", "true")
    wait_queued(procs, "j", 1)
    gate.open()
    h, w = procs.finish(holder), procs.finish(waiter)
    assert h.returncode == 0 and w.returncode == 0
    first = re.fullmatch(
        r"pearing-run: acquired lock=j repo=default fence=(\d+) ticket=\S+ waited=\S+s promoted=0", h.err_lines[0]
    )
    assert first, h
    assert re.fullmatch(r"pearing-run: released lock=j ticket=\S+ status=0", h.err_lines[-1])
    assert re.fullmatch(r"pearing-run: waiting lock=j position=1 max_wait=20s", w.err_lines[0])
    second = re.fullmatch(r"pearing-run: acquired .* fence=(\d+) .* promoted=1", w.err_lines[1])
    assert second, w
    assert int(second.group(1)) > int(first.group(1))
    assert not caps.contiguous_fences or (first.group(1), second.group(1)) == ("1", "2")


def test_lease_lost_line_and_json_format(caps: Caps, procs: Procs, work: Path) -> None:
    r = procs.pr_run(
        "-v", "--log-format", "json", "--job", "j", "--heartbeat", "manual", "--lease-seconds", "2",
        "--kill-grace", "2", "--", "sh", "-c", "while :; do sleep 0.05; done",
    )  # fmt: skip
    assert r.returncode == ExitCode.LEASE_LOST
    events = [json.loads(line) for line in r.err_lines]
    assert [e["event"] for e in events] == ["acquired", "heartbeat-missed", "lease-lost"]
    assert events[0]["prog"] == "pearing-run" and events[0]["ts"].endswith("Z")
    assert isinstance(events[0]["fence"], int) and (not caps.contiguous_fences or events[0]["fence"] == 1)
    # Durations are numbers of seconds in JSON, and every line has its level (as journald's).
    assert events[1]["lease"] == 2 and isinstance(events[0]["waited"], float), events
    assert [e["level"] for e in events] == ["info", "warning", "warning"]
    assert events[2]["reason"] == "lease expired"


def test_errors_are_json_too_with_json_format(backend: str, procs: Procs) -> None:
    r = procs.pr_run("--log-format", "json", "--job", "j", "--", "/nonexistent/cmd")
    assert r.returncode == ExitCode.NOTFOUND
    (line,) = r.err_lines
    obj = json.loads(line)
    assert obj["event"] == "error" and "/nonexistent/cmd" in obj["message"]


def test_journald_priority_prefix_when_stderr_is_the_journal_stream(backend: str, procs: Procs, tmp_path: Path) -> None:
    """JOURNAL_STREAM naming our stderr (as systemd sets it) adds <N> priorities."""
    log = tmp_path / "journal"
    with open(log, "wb") as f:
        st = os.fstat(f.fileno())
        env = dict(procs.env, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        p = procs.start([PEARING_RUN, "-v", "--job", "j", "--", "/nonexistent"], env=env, stderr=f)
        procs.finish(p)
    lines = log.read_text().splitlines()
    assert lines[0].startswith("<6>pearing-run: acquired ")
    assert lines[1].startswith("<3>pearing-run: error: command not found")
    assert lines[2].startswith("<6>pearing-run: released ")
    # Not the journal (another inode): no prefixes.
    env = dict(procs.env, JOURNAL_STREAM="1:1")
    r = procs.run([PEARING_RUN, "-v", "--job", "j", "--", "true"], env=env)
    assert r.err_lines[0].startswith("pearing-run: acquired ")


# -- status ----------------------------------------------------------------------------


def _held(procs: Procs, work: Path) -> Gate:
    gate = Gate(work)
    run = procs.pr("--job", "j", "--identity", "codex", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    holder_pid(procs, "j", run.pid)  # recorded (on etcd a moment after COMMAND starts): lease left too
    return gate


def test_status_json_when_not_a_terminal(caps: Caps, procs: Procs, work: Path) -> None:
    gate = _held(procs, work)
    r = procs.run([PEARING_CLI, "status"])
    (lock,) = json.loads(r.stdout)
    assert lock["lock_name"] == "j" and lock["state"] == "held" and lock["fence"] == lock["holder"]["fence"]
    assert not caps.contiguous_fences or lock["fence"] == 1
    assert lock["holder"]["identity"] == "codex" and 0 < lock["holder"]["lease_left"] <= 60
    assert lock["waiters"] == []
    gate.open()


def _on_a_tty(argv: list[str], env: dict[str, str], until: bytes, timeout: float = 15.0) -> bytes:
    """Run argv with stdout on a pseudo-terminal; read (blocking in select) until ``until`` shows up."""
    leader, follower = pty.openpty()
    p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=follower, stderr=subprocess.PIPE)
    os.close(follower)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while until not in b"".join(chunks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"{until!r} did not show on the terminal: {b''.join(chunks)!r}")
            if select.select([leader], [], [], remaining)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: the program closed the terminal
                    break
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        p.kill()
        p.wait()
        os.close(leader)
    return b"".join(chunks)


def test_status_table_on_a_terminal_and_watch(backend: str, procs: Procs, work: Path) -> None:
    gate = _held(procs, work)
    (lock,) = json.loads(procs.run([PEARING_CLI, "status"]).stdout)
    out = _on_a_tty([PEARING_CLI, "status"], procs.env, b"codex")
    lines = out.decode().replace("\r", "").splitlines()
    assert lines[0].split() == ["LOCK", "REPO", "STATE", "IDENTITY", "FENCE", "LEASE", "LEFT", "WAITERS", "ACTIVITY"]
    assert lines[1].split()[:5] == ["j", "default", "held", "codex", str(lock["fence"])]
    # --watch redraws (clear-screen sequence) until interrupted.
    out = _on_a_tty([PEARING_CLI, "status", "--watch", "--interval", "0.2"], procs.env, b"codex", 15)
    assert out.startswith(b"\x1b[H\x1b[2J")
    gate.open()


# -- versions and help -------------------------------------------------------------------


@pytest.mark.parametrize("tool", ["pearing-run", "pearing-cli", "pearing-guard", "pearing-mcp"])
def test_every_command_has_version(tool: str) -> None:
    r = subprocess.run([os.path.join(BIN_DIR, tool), "--version"], capture_output=True, text=True, check=False)
    assert r.returncode == 0 and r.stdout.strip() == f"{tool} {__version__}"


def test_cli_offers_shell_completion() -> None:
    r = subprocess.run([PEARING_CLI, "--help"], capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "--install-completion" in r.stdout


# -- README blocks -----------------------------------------------------------------------


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def test_readme_first_screen_has_exactly_two_setup_commands() -> None:
    head = README.split("## Contents")[0]
    blocks = re.findall(r"```sh\n(.*?)```", head, re.S)
    assert len(blocks) == 2
    assert "pip install" in blocks[0] and "pearing-run" in blocks[0]
    assert "pip install" in blocks[1] and "pytest" in blocks[1]
    ci = (ROOT / ".ci/run").read_text()
    assert "python -m pytest" in blocks[1] and "python -m pytest" in ci


def _slugs(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_readme_and_docs_links_resolve() -> None:
    """Every relative link (and its #anchor) in the README, docs/ and contrib/ reaches a file and a heading,
    and the README's Contents links every docs page."""
    pages = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "CHANGELOG.md"]
    pages += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "contrib").glob("*/README.md"))
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and anchor not in _slugs(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
    contents = README.split("## Contents", 1)[1].split("\n## ", 1)[0]
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{doc.name})" in contents, doc.name


@pytest.mark.local_only("the demo's output shows a fresh lock dir's first fence, 1")
def test_readme_demo_runs(procs: Procs, tmp_path: Path) -> None:
    """The demo one-liner, minus the install (this venv is the install)."""
    demo = _blocks("sh")[0].strip()
    _, _, run = demo.partition(". .venv/bin/activate && ")
    assert run.startswith("pearing-run ")
    env = dict(procs.env, PATH=f"{BIN_DIR}:{os.environ['PATH']}")
    r = procs.run(["sh", "-c", run], env=env)
    assert r.returncode == 0, r
    assert b"fence 1: doing the contested step" in r.stdout
    assert b"a second contender exited 75" in r.stdout


def test_readme_cli_walkthrough_runs(backend: str, procs: Procs) -> None:
    """The pearing-cli block of the README, command for command, with the real ticket id."""
    block = next(b for b in _blocks("sh") if "acquire-lock" in b)
    commands = [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    ticket = None
    env = dict(procs.env, PATH=f"{BIN_DIR}:{os.environ['PATH']}")
    for template in commands:
        command = template.replace("TICKET_ID", ticket) if ticket else template
        r = procs.run(["sh", "-c", command], env=env)
        assert r.returncode == 0, (command, r)
        if "acquire-lock" in command:
            ticket = json.loads(r.stdout)["ticket_id"]
    assert ticket is not None


def test_readme_python_guard_example_runs(caps: Caps, procs: Procs, work: Path) -> None:
    """The Python guard example, run inside a pearing-run with post_reply stubbed to record."""
    code = next(b for b in _blocks("python") if "import guard" in b)
    script = work / "example.py"
    script.write_text(
        "import sys\nposted = []\ndef post_reply(**kw):\n    posted.append(kw)\n"
        + code
        + "\nassert posted == [{'thread': 42, 'body': '...'}], posted\n"
        + "import os\nprint('accepted', verdict.fence, os.environ['PEARING_FENCE'])\n"
    )
    r = procs.pr_run("--job", "thread-work.42", "--", sys.executable, str(script))
    assert r.returncode == 0, r
    word, accepted, fence = r.stdout.decode().split()
    assert (word, accepted) == ("accepted", fence), r
    assert not caps.contiguous_fences or fence == "1"


def test_readme_lock_example_runs(backend: str, procs: Procs, work: Path) -> None:
    """The README's Lock example, as written, with post_reply stubbed to record its fence."""
    code = next(b for b in _blocks("python") if "Lock(" in b)
    script = work / "lock_example.py"
    script.write_text(
        "import json\nposted = []\nevent_id = 'evt_readme_1'\n"
        "def post_reply():\n    posted.append(1)\n" + code + "\nassert posted == [1], posted\n"
    )
    r = procs.run([sys.executable, str(script)], timeout=60)
    assert r.returncode == 0, r
    fence, ticket, token_file, promoted = r.stdout.decode().split()
    assert int(fence) >= 1 and promoted == "False" and token_file.endswith(f"{ticket}.token")


def test_docs_mention_every_exit_code_and_env_name() -> None:
    """The README's reference page for them (docs/exit-codes.md, linked from its Contents)."""
    from singleflight.core import const as _const

    assert "(docs/exit-codes.md)" in README
    page = (ROOT / "docs/exit-codes.md").read_text()
    for code in (0, 1, 64, 70, 73, 74, 75, 77, 124, 126, 127):
        assert re.search(rf"\| (\d+ / )?{code}( / \d+)? \|", page), code
    for name in dir(_const):
        if name.startswith("ENV_") and name not in ("ENV_BACKEND",):
            assert getattr(_const, name) in page, name
    for cmd in (PEARING_GUARD,):
        assert os.path.basename(cmd) in README


def test_readme_recipe_runs_for_two_responders_and_a_replay(caps: Caps, procs: Procs, work: Path) -> None:
    """The recipe block, with stand-ins for the agent and the thread service."""
    block = next(b for b in _blocks("sh") if "handle-thread" in b)
    bin_dir = work / "bin"
    bin_dir.mkdir()
    pushes, answered = work / "pushes", work / "answered"
    (bin_dir / "handle-thread").write_text(
        "#!/bin/sh\nset -e\n"
        'pearing-cli update-user-activity --activity "Revalidating thread #$1 under lock $PEARING_LOCK."\n'
        "pearing-cli heartbeat-lock-ticket --lease-seconds 60 >/dev/null\n"
        f"pearing-guard exec -- sh -c 'echo $PEARING_FENCE $PEARING_PROMOTED >> {q(pushes)}'\n"
        f"touch {q(answered)}\n"
        "pearing-cli update-user-activity --clear >/dev/null\n"
    )
    (bin_dir / "thread-answered").write_text(f"#!/bin/sh\ntest -e {q(answered)}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(procs.env, PATH=f"{bin_dir}:{BIN_DIR}:{os.environ['PATH']}", EVENT_UUID=str(uuid.uuid4()))
    first = procs.run(["sh", "-c", block], env=env)
    assert first.returncode == 0, first
    pushed = pushes.read_text()
    fence, promoted = pushed.split()
    assert promoted == "0" and int(fence) >= 1 and pushed == f"{fence} 0\n", pushed
    assert not caps.contiguous_fences or fence == "1"
    # The replay of the same event: deduplicated, nothing runs.
    assert procs.run(["sh", "-c", block], env=env).returncode == 0
    # The second responder with its own event id: --skip-if sees the work done.
    env2 = dict(env, EVENT_UUID=str(uuid.uuid4()))
    assert procs.run(["sh", "-c", block], env=env2).returncode == 0
    assert pushes.read_text() == pushed


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_readme_guarded_push_runs_only_for_the_live_holder(backend: str, procs: Procs, work: Path) -> None:
    """`pearing-guard exec -- git push ...` from the README, against a local bare origin."""
    line = next(x for b in _blocks("sh") for x in b.splitlines() if x.startswith("pearing-guard exec -- git push"))
    origin, clone = work / "origin.git", work / "clone"
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q", "--bare", str(origin)], check=True)
    subprocess.run([*git, "init", "-q", str(clone)], check=True)
    subprocess.run([*git, "-C", str(clone), "commit", "-q", "--allow-empty", "-m", "progress"], check=True)
    subprocess.run(["git", "-C", str(clone), "remote", "add", "origin", str(origin)], check=True)
    env = dict(procs.env, PATH=f"{BIN_DIR}:{os.environ['PATH']}")
    script = f"cd {q(clone)} && {line} && cp $PEARING_TOKEN_FILE {q(work / 'old.token')}"
    assert procs.pr_run("--job", "thread-work.42", "--", "sh", "-c", script, env=env).returncode == 0
    refs = subprocess.run(["git", "-C", str(origin), "branch", "--list"], capture_output=True, text=True, check=True)
    assert "codex/thread-42" in refs.stdout
    # With the run over, the same push is refused and never reaches the origin.
    subprocess.run(["git", "-C", str(origin), "branch", "-D", "codex/thread-42"], check=True, capture_output=True)
    late = procs.run(
        ["sh", "-c", f"cd {q(clone)} && {line}"], env=dict(env, PEARING_TOKEN_FILE=str(work / "old.token"))
    )
    assert late.returncode == ExitCode.REFUSED
    refs = subprocess.run(["git", "-C", str(origin), "branch", "--list"], capture_output=True, text=True, check=True)
    assert "codex/thread-42" not in refs.stdout
