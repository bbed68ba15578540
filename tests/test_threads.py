"""The thread service as a fenced target (SPEC "The thread service"), on every backend.

``get-thread-tree`` / ``create-reply`` run as real ``pearing-cli`` processes; a reply is
accepted only under a fence >= the thread's highest, in the same step that stores it.
"""

from __future__ import annotations

import json
import random
import sqlite3
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest
from caps import Caps
from helpers import PEARING_CLI, Gate, Procs, backend_url, cli_json, lock_status, pg_query, q, wait_for
from test_mcp import serve, server_args  # noqa: F401 - server_args is a fixture

from singleflight.core.const import ExitCode

REPO = "teams/platform/website"
UUID = "a2b6da75-a87d-44e0-b413-484354289702"


def tree(procs: Procs, thread: int = 42, repo: str = REPO) -> dict[str, Any]:
    found = cli_json(procs, "get-thread-tree", repo, str(thread))
    assert isinstance(found, dict)
    return found


def reply(procs: Procs, *args: str, thread: int = 42, env: dict[str, str] | None = None) -> Any:
    return procs.run([PEARING_CLI, "create-reply", REPO, str(thread), *args], env=env)


def flat(t: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    stack = list(reversed(t["replies"]))
    while stack:
        r = stack.pop()
        out.append(r)
        stack.extend(reversed(r["replies"]))
    return out


def test_the_seeds_walkthrough_runs_as_written(backend: str, procs: Procs) -> None:
    """The user's page, all eight lines, with the ticket id the first one returned."""
    ticket = cli_json(
        procs,
        *("acquire-lock", "thread-work.42", "--request-uuid", UUID, "--lease-seconds", "60"),
        *("--wait-seconds", "30", "--repo", REPO),
    )
    assert ticket["state"] == "held", ticket
    tid = ticket["ticket_id"]
    assert cli_json(procs, "get-lock-ticket", "thread-work.42", tid, "--repo", REPO)["ticket_id"] == tid
    activity = f"Revalidating {REPO} thread #42 under lock thread-work.42."
    assert cli_json(procs, "update-user-activity", "--activity", activity)["activity"] == activity
    empty = tree(procs)
    assert empty == {"repo": REPO, "thread": 42, "lock_name": "thread-work.42", "fence": None, "replies": []}
    assert cli_json(procs, "heartbeat-lock-ticket", "thread-work.42", tid, "--lease-seconds", "60", "--repo", REPO)
    body = "Claimed current work; pushed recoverable progress before the long validation step."
    stored = cli_json(
        procs,
        *("create-reply", REPO, "42", "--kind", "implementation", "--body", body),
        *("--link", "branch:codex/thread-42"),
    )
    assert (stored["fence"], stored["ticket_id"], stored["links"]) == (ticket["fence"], tid, ["branch:codex/thread-42"])
    assert cli_json(procs, "release-lock-ticket", "thread-work.42", tid, "--repo", REPO)["state"] == "released"
    assert cli_json(procs, "update-user-activity", "--clear")["activity"] is None
    after = tree(procs)
    assert after["fence"] == ticket["fence"]
    assert [(r["kind"], r["body"], r["fence"]) for r in after["replies"]] == [("implementation", body, ticket["fence"])]


def test_a_stale_fence_is_refused_and_nothing_is_written(backend: str, procs: Procs) -> None:
    assert reply(procs, "--kind", "implementation", "--body", "new", "--fence", "7").returncode == 0
    before = tree(procs)
    r = reply(procs, "--kind", "implementation", "--body", "old", "--fence", "6")
    assert r.returncode == ExitCode.REFUSED, r
    assert b"stale fence 6 < 7" in r.stderr and r.stdout == b"", r
    assert tree(procs) == before
    assert reply(procs, "--kind", "implementation", "--body", "same holder again", "--fence", "7").returncode == 0


def test_concurrent_replies_never_store_a_lower_fence_after_a_higher_one(backend: str, procs: Procs) -> None:
    fences = list(range(1, 17))
    random.Random(42).shuffle(fences)
    writers = [
        (f, procs.start([PEARING_CLI, "create-reply", REPO, "42", "--kind", "k", "--body", f"f{f}", "--fence", str(f)]))
        for f in fences
    ]
    codes = {f: procs.finish(p, timeout=120) for f, p in writers}
    for f, r in codes.items():
        assert r.returncode in (0, ExitCode.REFUSED), (f, r)
        if r.returncode == ExitCode.REFUSED:
            assert b"stale fence" in r.stderr, r
    assert codes[16].returncode == 0, "the highest fence is always accepted"
    stored = [r["fence"] for r in tree(procs)["replies"]]
    assert stored == sorted(stored), f"a lower fence landed after a higher one: {stored}"
    assert sorted(stored) == sorted(f for f, r in codes.items() if r.returncode == 0)
    assert tree(procs)["fence"] == 16


def test_a_process_an_earlier_holder_left_behind_cannot_reply_after_the_next_holder(
    backend: str, procs: Procs, work: Path
) -> None:
    """Holder 1 leaves a detached process that replies late, with the fence of its COMMAND's
    environment; holder 2 replied meanwhile: the late reply is refused."""
    go, done = work / "go", work / "late.rc"
    late = (
        f"while [ ! -e {q(go)} ]; do sleep 0.01; done; "
        f"{q(PEARING_CLI)} create-reply {REPO} 42 --kind implementation --body late 2>{q(work / 'late.err')}; "
        f"echo $? > {q(done)}"
    )
    first = procs.pr_run(
        *("--job", "thread-work.42", "--repo", REPO, "--"),
        *("sh", "-c", f"setsid sh -c {q(late)} </dev/null >/dev/null 2>&1 &"),
    )
    assert first.returncode == 0, first
    second = procs.pr_run(
        *("--job", "thread-work.42", "--repo", REPO, "--"),
        *(q(PEARING_CLI), "create-reply", REPO, "42", "--kind", "implementation", "--body", "second"),
    )
    assert second.returncode == 0, second
    go.touch()
    wait_for(lambda: done.exists() and done.read_text().strip(), 30, "the late reply to finish")
    assert done.read_text().strip() == str(int(ExitCode.REFUSED)), (work / "late.err").read_text()
    assert "stale fence" in (work / "late.err").read_text()
    bodies = [(r["body"], r["ticket_id"] is not None) for r in tree(procs)["replies"]]
    assert bodies == [("second", True)], bodies


def test_replies_nest_under_their_parents_in_the_order_accepted(backend: str, procs: Procs) -> None:
    def add(body: str, parent: str | None = None) -> str:
        args = ["--kind", "note", "--body", body, "--unfenced", *(["--parent", parent] if parent else [])]
        r = reply(procs, *args)
        assert r.returncode == 0, r
        return str(json.loads(r.stdout)["reply_id"])

    a = add("a")
    b = add("b")
    a1 = add("a1", a)
    add("a1x", a1)
    add("a2", a)
    add("b1", b)
    t = tree(procs)
    shape = [(r["body"], [(c["body"], [g["body"] for g in c["replies"]]) for c in r["replies"]]) for r in t["replies"]]
    assert shape == [("a", [("a1", ["a1x"]), ("a2", [])]), ("b", [("b1", [])])]
    assert t["fence"] is None and all(r["fence"] is None for r in flat(t))
    # A parent that is not a reply of this thread: 64, nothing written.
    other = json.loads(reply(procs, "--kind", "note", "--body", "elsewhere", "--unfenced", thread=7).stdout)
    for parent in (other["reply_id"], "00000000-0000-4000-8000-000000000000"):
        r = reply(procs, "--kind", "note", "--body", "orphan", "--unfenced", "--parent", parent)
        assert r.returncode == ExitCode.USAGE and b"is not a reply of thread" in r.stderr, r
    assert tree(procs) == t


@pytest.mark.parametrize(
    ("args", "thread", "words"),
    [
        (["--body", ""], "42", b"--body"),
        (["--body", "   "], "42", b"--body"),
        (["--body", "x" * (64 * 1024 + 1)], "42", b"at most 65536 bytes"),
        (["--kind", "Implementation"], "42", b"--kind"),
        (["--kind", "k" * 33], "42", b"--kind"),
        (["--kind", "1x"], "42", b"--kind"),
        (["--link", "no-colon"], "42", b"--link"),
        (["--link", "Branch:x"], "42", b"--link"),
        (["--link", "branch:"], "42", b"--link"),
        (["--parent", "not-a-uuid"], "42", b"--parent"),
        (["--fence", "0"], "42", b"--fence"),
        (["--fence", "1.5"], "42", b"--fence"),
        (["--fence", "9" * 40], "42", b"--fence"),
        (["--fence", "3", "--unfenced"], "42", b"not both"),
        ([], "0", b"THREAD"),
        ([], "-1", b"-1"),  # taken for an option: still 64, one line
        ([], "4x", b"THREAD"),
        ([], "1.5", b"THREAD"),
        ([], "\u0664\u0662", b"THREAD"),
    ],
)
def test_bad_input_is_64_one_line_and_nothing_is_written(
    backend: str, procs: Procs, args: list[str], thread: str, words: bytes
) -> None:
    base = {"--kind": "implementation", "--body": "text", "--fence": "5"}
    given = dict(zip(args[::2], args[1::2], strict=False))
    flags = [x for k, v in {**base, **given}.items() if k not in ("--unfenced",) for x in (k, v)]
    if "--unfenced" in args:
        flags.append("--unfenced")
    r = procs.run([PEARING_CLI, "create-reply", REPO, thread, *flags])
    assert r.returncode == ExitCode.USAGE, r
    assert words in r.stderr and r.stderr.count(b"\n") == 1 and r.stdout == b"", r
    assert tree(procs)["replies"] == []


def test_a_reply_with_no_fence_is_refused_unless_it_is_an_unfenced_note(backend: str, procs: Procs) -> None:
    r = reply(procs, "--kind", "implementation", "--body", "who am I")
    assert r.returncode == ExitCode.REFUSED and b"no fence" in r.stderr and b"--unfenced" in r.stderr, r
    assert tree(procs)["replies"] == []
    note = reply(procs, "--kind", "note", "--body", "a person's note", "--unfenced")
    assert note.returncode == 0 and json.loads(note.stdout)["fence"] is None, note


def test_the_fence_comes_from_the_flag_then_the_commands_environment_then_the_held_ticket(
    backend: str, procs: Procs, work: Path
) -> None:
    gate = Gate(work)
    holder = procs.pr("--job", "thread-work.42", "--repo", REPO, "--", "sh", "-c", gate.script())
    gate.wait_ready()
    status = cli_json(procs, "status", "thread-work.42", "--repo", REPO)[0]
    held = status["holder"]["fence"]
    # A ticket held by another identity is not ours to use; pearing-run holds as this identity.
    r = reply(procs, "--kind", "k", "--body", "by the held ticket")
    assert r.returncode == 0 and json.loads(r.stdout)["fence"] == held, r
    env = {**procs.env, "PEARING_LOCK": "thread-work.42", "PEARING_REPO": REPO, "PEARING_FENCE": str(held + 5)}
    r = reply(procs, "--kind", "k", "--body", "by the environment", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["fence"] == held + 5, r
    other_lock = {**env, "PEARING_LOCK": "thread-work.7"}
    r = reply(procs, "--kind", "k", "--body", "another lock's fence is not this thread's", env=other_lock)
    assert r.returncode == ExitCode.REFUSED and b"stale fence" in r.stderr, r  # fell back to the held one
    r = reply(procs, "--kind", "k", "--body", "by the flag", "--fence", str(held + 9), env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["fence"] == held + 9, r
    someone = {**procs.env, "PEARING_IDENTITY": "someone-else"}
    r = reply(procs, "--kind", "k", "--body", "not my ticket", env=someone)
    assert r.returncode == ExitCode.REFUSED and b"no fence" in r.stderr, r
    gate.open()
    assert procs.finish(holder).returncode == 0


def test_the_python_thread_replies_under_the_blocks_fence(backend: str, procs: Procs) -> None:
    code = textwrap.dedent(f"""
        import json
        from singleflight import Lock, Thread
        t = Thread({REPO!r}, 42)
        with Lock("thread-work.42", repo={REPO!r}) as held:
            assert t.tree()["replies"] == []
            top = t.reply("implementation", "done", links=["branch:codex/thread-42"], fence=held.fence)
            t.reply("note", "and a child", parent=top["reply_id"])  # the held ticket's fence
        print(json.dumps([held.fence, t.tree()]))
    """)
    r = procs.run([sys.executable, "-c", code])
    assert r.returncode == 0, r
    fence, found = json.loads(r.stdout)
    assert [(x["body"], x["fence"]) for x in flat(found)] == [("done", fence), ("and a child", fence)]


@pytest.mark.parametrize("what", ["reply", "fence"])
def test_a_corrupt_reply_or_fence_is_74_naming_where_and_kept(
    backend: str, procs: Procs, caps: Caps, lock_dir: Path, what: str
) -> None:
    """Garbage written by hand into a reply or the thread's fence: 74 naming the file or key, for
    the read and for a write (which must not judge a fence against garbage), and left as it is."""
    assert reply(procs, "--kind", "k", "--body", "fine", "--fence", "3").returncode == 0
    if caps.records_in_lock_dir:
        db = sqlite3.connect(lock_dir / "threads.sqlite3")
        if what == "reply":
            db.execute("UPDATE replies SET links = ?", (b"\x00not json",))
        else:
            db.execute("UPDATE threads SET fence = ?", ("garbage",))
        db.commit()
        db.close()
        where = b"threads.sqlite3"
    elif caps.records_in_tables:
        url = backend_url(procs.env)
        assert url is not None
        if what == "reply":
            pg_query(url, """UPDATE {s}.replies SET body = '{"reply_id": 5}'""")
        else:
            pg_query(url, "UPDATE {s}.threads SET fence = -1000")
        where = b"table replies key" if what == "reply" else b"table threads key"
    else:
        from singleflight.etcd.client import Cluster

        url = backend_url(procs.env)
        assert url is not None
        cluster = Cluster(url)
        mark = "/#thread/42/r/" if what == "reply" else "/#thread/42/fence"
        [kv] = [kv for kv in cluster.range_prefix(cluster.root)[0] if mark in kv["key"]]
        cluster.put(kv["key"], b'{"reply_id": 5}' if what == "reply" else b"-1e3\x00")
        cluster.close()
        where = mark.encode()
    for args in (
        ["get-thread-tree", REPO, "42"],
        ["create-reply", REPO, "42", "--kind", "k", "--body", "x", "--fence", "9"],
    ):
        r = procs.run([PEARING_CLI, *args])
        assert r.returncode == ExitCode.IOERR and where in r.stderr and r.stderr.count(b"\n") == 1, r


def test_the_largest_thread_and_fence_validation_accepts_are_stored(backend: str, procs: Procs) -> None:
    top_thread, top_fence = 10**15, 2**63 - 1
    r = reply(procs, "--kind", "k", "--body", "edge", "--fence", str(top_fence), thread=top_thread)
    assert r.returncode == 0 and json.loads(r.stdout)["fence"] == top_fence, r
    t = tree(procs, thread=top_thread)
    assert t["fence"] == top_fence and t["thread"] == top_thread and len(t["replies"]) == 1
    over = reply(procs, "--kind", "k", "--body", "edge", "--fence", str(top_fence + 1), thread=top_thread)
    assert over.returncode == ExitCode.USAGE, over


def test_the_mcp_thread_tools(backend: str, tmp_path: Path, server_args: list[str]) -> None:  # noqa: F811

    async def main() -> None:
        async with serve(tmp_path, set(), *server_args) as c:  # no ticket is taken: no agent to reap
            empty = await c.call("get_thread_tree", repo=REPO, thread=42)
            assert empty["replies"] == [] and empty["fence"] is None
            no_fence = await c.error("create_reply", repo=REPO, thread=42, kind="implementation", body="x")
            assert "no fence" in no_fence
            top = await c.call("create_reply", repo=REPO, thread=42, kind="implementation", body="x", fence=4)
            child = await c.call(
                "create_reply", repo=REPO, thread=42, kind="note", body="y", parent_id=top["reply_id"], unfenced=True
            )
            stale = await c.error("create_reply", repo=REPO, thread=42, kind="implementation", body="z", fence=3)
            assert "stale fence 3 < 4" in stale
            bad = await c.error("create_reply", repo=REPO, thread="42", kind="implementation", body="z", fence=5)
            assert "thread" in bad
            found = await c.call("get_thread_tree", repo=REPO, thread=42)
            assert found["fence"] == 4
            assert [r["reply_id"] for r in found["replies"]] == [top["reply_id"]]
            assert [r["reply_id"] for r in found["replies"][0]["replies"]] == [child["reply_id"]]

    anyio.run(main)


ANSWERED = Path(__file__).resolve().parents[1] / "contrib" / "thread" / "thread-answered"


def test_the_readmes_recipe_a_promoted_waiter_skips_work_already_replied_for(
    backend: str, procs: Procs, work: Path
) -> None:
    """Two responders woken by one event: the first replies; the second, promoted after it,
    reads the thread in its --skip-if and skips (exit 0, no second reply)."""
    gate = Gate(work)
    handle = (
        f'{gate.script()}; {q(PEARING_CLI)} create-reply {REPO} 42 --kind implementation --body "by $PEARING_FENCE"'
    )
    args = ("--repo", REPO, "--job", "thread-work.42", "--wait-seconds", "60")
    skip = ("--skip-if", f"{q(sys.executable)} {q(ANSWERED)} {REPO} 42")
    env = {**procs.env, "PATH": f"{Path(PEARING_CLI).parent}:{procs.env.get('PATH', '')}"}  # as installed
    first = procs.pr(*args, *skip, "--", "sh", "-c", handle, env=env)
    gate.wait_ready()
    second = procs.pr(*args, *skip, "--", "sh", "-c", f"touch {q(work / 'second-ran')}", env=env)
    wait_for(lambda: lock_status(procs, "thread-work.42", REPO)["waiters"], 15, "the waiter")
    gate.open()
    assert procs.finish(first).returncode == 0
    assert procs.finish(second, timeout=60).returncode == 0
    assert not (work / "second-ran").exists(), "the promoted waiter did the work again"
    replies = tree(procs)["replies"]
    assert [r["kind"] for r in replies] == ["implementation"], replies


def test_the_terminal_tree_nests_and_escapes_control_characters() -> None:
    from singleflight.cli._table import render_thread

    def node(body: str, kids: list[dict[str, Any]], fence: int | None = 3) -> dict[str, Any]:
        return {
            "reply_id": "r",
            "kind": "note",
            "identity": "a@h",
            "fence": fence,
            "created_at": "T",
            "body": body,
            "links": ["branch:x\x1b[2J"],
            "replies": kids,
        }

    t = {"repo": "s", "thread": 4, "lock_name": "thread-work.4", "fence": 3}
    text = render_thread({**t, "replies": [node("top\x1b]0;pwned\x07", [node("kid", [], None)]), node("b", [])]})
    assert "\x1b" not in text and "\\x1b]0;pwned" in text
    assert text.splitlines()[1].startswith("├─ note by a@h, fence 3")
    assert any(line.startswith("│  └─ note by a@h, unfenced") for line in text.splitlines())
    assert render_thread({**t, "fence": None, "replies": []}).endswith("(no replies)\n")


def test_a_store_appends_only_while_the_fence_is_the_one_judged(backend: str, procs: Procs, lock_dir: Path) -> None:
    """The store's half of the rule (rules/threads.py judges the fence): an append made against a
    highest fence that moved meanwhile is refused (False) and writes nothing; sent twice, once."""
    from singleflight.backend import open_backend

    assert reply(procs, "--kind", "k", "--body", "first", "--fence", "5").returncode == 0
    b = open_backend(backend_url(procs.env), str(lock_dir))
    try:
        row = {
            "reply_id": "00000000-0000-4000-8000-000000000001",
            "parent_id": None,
            "kind": "k",
            "body": "judged against an old fence",
            "links": [],
            "identity": "a@h",
            "fence": 4,
            "ticket_id": None,
            "created_at": 1.0,
        }
        assert b.add_reply(REPO, 42, row, highest=None) is False  # the thread has fence 5 now
        assert b.add_reply(REPO, 42, {**row, "fence": 6}, highest=5) is True
        assert b.add_reply(REPO, 42, {**row, "fence": 6}, highest=5) is True  # sent again: one reply
        rows, highest = b.read_thread(REPO, 42)
    finally:
        b.close()
    assert highest == 6 and [r["body"] for r in rows] == ["first", "judged against an old fence"]
