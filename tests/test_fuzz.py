"""Fuzz every file the tool reads, with real processes: garbage in a record is a clear error.

For each file of the lock dir that a command reads, hypothesis plants a content (random bytes,
a real record with one field replaced by a wrong type, a traversal string, a NUL byte, a huge
number, deep nesting) or a directory, a symlink or a FIFO in its place, in a fresh copy of a
lock dir that has seen fences 1..3. Then the real commands that read that file run, and each
must end in

- 0 (it ran, with a fence above every fence issued before), 1 (a refusal) or 75 (busy), or
- 73 / 74 / 77 with one line on stderr naming the planted path;

never 70, never a Python traceback, never a path created where the layout has none (a
traversal string used as a file name), never a fence at or below one already issued, never a
stale fence accepted by the ledger.

The number of examples is bounded (PEARING_FUZZ_EXAMPLES per file, default 6) so the whole file
runs in about a minute; raise it for a longer soak (PEARING_FUZZ_SHRINK=0 skips shrinking).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from helpers import MARKER_VAR, PEARING_CLI, PEARING_GUARD, PEARING_RUN, Procs, Result, q, tree
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from singleflight.core.const import ENV_IDENTITY, ENV_LOCK_DIR, MAX_FENCE, ExitCode

EXAMPLES = int(os.environ.get("PEARING_FUZZ_EXAMPLES", "6"))
# Shrinking a failure re-runs real processes hundreds of times; PEARING_FUZZ_SHRINK=0 reports
# the first failing example as found.
PHASES = tuple(p for p in Phase if os.environ.get("PEARING_FUZZ_SHRINK", "1") != "0" or p is not Phase.shrink)
IDENTITY = "fuzz@host"
LOCK = "locks/default/@J"
# What a command may end with, whatever it was fed.
CLEAN_EXITS = {0, int(ExitCode.REFUSED), int(ExitCode.BUSY)}
NAMED_EXITS = {int(ExitCode.CANTCREAT), int(ExitCode.IOERR), int(ExitCode.NOPERM)}

_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
# Every path the tool may create in a lock dir (docs/state.md, "Where state lives").
LAYOUT = re.compile(
    rf"""^(
        locks | locks/default | {LOCK}
      | {LOCK}/(lock|state\.lock|guard\.lock|fence|holder|success|\.housekeeping|tickets|ended|requests|tokens|queue)
      | {LOCK}/(tickets|ended|requests)/{_UUID}\.json
      | {LOCK}/tokens/{_UUID}\.token
      | {LOCK}/queue/(\.seq|[0-9]{{20,}}\.{_UUID})
      | activity | activity/{re.escape(IDENTITY)}
      | ledger\.json | ledger\.json\.lock
    )$""",
    re.VERBOSE,
)


# -- a lock dir that has seen everything, copied for each example -----------------------------------


@dataclass
class Base:
    lock_dir: Path
    t1: str  # ended ticket of the first run (request U1, fence 1)
    u1: str
    t3: str  # held by a live CLI agent (fence 3), with its token file
    token3: str
    highest: int
    records: dict[str, Any] = field(default_factory=dict)


def _env(lock_dir: Path, marker: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("PEARING_")}
    e[ENV_LOCK_DIR] = str(lock_dir)
    e[ENV_IDENTITY] = IDENTITY
    e[MARKER_VAR] = marker
    return e


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Base]:
    root = tmp_path_factory.mktemp("fuzz-base")
    lock_dir = root / "lockdir"
    procs = Procs(_env(lock_dir, uuid.uuid4().hex), root, lock_dir)
    try:
        u1 = str(uuid.uuid4())
        for args in (["--request-uuid", u1, "--min-interval", "1s"], []):
            r = procs.pr_run("--job", "J", *args, "--", "true")
            assert r.returncode == 0, r
        c = procs.run_text(
            [PEARING_CLI, "acquire-lock", "J", "--request-uuid", str(uuid.uuid4()), "--lease-seconds", "3600"]
        )
        assert c.returncode == 0, c
        held = c.json
        assert held["fence"] == 3, held
        # A waiter that gives up leaves the queue counter behind.
        w = procs.pr_run("--job", "J", "--wait-seconds", "0.2", "--", "true")
        assert w.returncode == int(ExitCode.BUSY), w
        assert procs.run([PEARING_CLI, "update-user-activity", "--activity", "fuzzing"]).returncode == 0
        assert procs.run([PEARING_GUARD, "fence", "--resource", "r", "--fence", "3"]).returncode == 0
        d = lock_dir / LOCK
        t1 = json.loads((d / "requests" / f"{u1}.json").read_text())["ticket_id"]
        token3 = json.loads(Path(held["token_file"]).read_text())["token"]
        b = Base(lock_dir, t1, u1, held["ticket_id"], token3, 3)
        for rel in TARGETS:
            path = lock_dir / rel.format(b=b)
            assert path.is_file(), f"the base lock dir lacks {rel}"
            with contextlib.suppress(ValueError):
                b.records[rel] = json.loads(path.read_bytes())
        yield b
    finally:
        procs.cleanup()


# -- what to plant -----------------------------------------------------------------------------------

NASTY_TEXT = [
    "../../x",
    "../../../../../../../../tmp/pearing-fuzz-escape",
    "/etc/passwd",
    "..",
    ".",
    "",
    "\x00",
    "a\x00b",
    "x" * 300,
    "\u202e",
    "\uff13",
    "held",
    "00000000-0000-4000-8000-000000000000",
]
NASTY_NUMBERS = [0, -1, 2**63, MAX_FENCE, 10**30, 1e308, float("inf"), float("nan"), -0.0, True]

json_leaf = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(NASTY_TEXT)
    | st.sampled_from(NASTY_NUMBERS)
)
json_any = st.recursive(
    json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=8
)
deep = st.builds(
    lambda n, opener: opener * n, st.integers(500, 200_000), st.sampled_from([b"[", b'{"a":', b'{"fence":['])
)
numbers_as_text = st.one_of(
    st.integers().map(str),
    st.sampled_from(["9" * 5000, str(2**63), str(MAX_FENCE), "-3", "0", " 7 ", "7 8", "1e3", "0x10", "\uff13"]),
).map(lambda s: s.encode() + b"\n")
raw = st.binary(max_size=64) | st.sampled_from(NASTY_TEXT).map(lambda s: s.encode())


def _dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


@st.composite
def record_content(draw: st.DrawFn, rel: str, base: Base) -> bytes:
    """Bytes to plant at a JSON record: mostly the real record with one field broken."""
    rec = base.records.get(rel)
    choice = draw(st.sampled_from(["mutate", "mutate", "mutate", "json", "raw", "deep", "text"]))
    if choice == "mutate" and isinstance(rec, dict):
        out = dict(rec)
        key = draw(st.sampled_from([*sorted(rec), "previous", "extra"]))
        if draw(st.booleans()) and key in out:
            del out[key]
        else:
            out[key] = draw(json_any)
        return _dumps(out)
    if choice == "json":
        return _dumps(draw(json_any))
    if choice == "deep":
        return draw(deep)
    if choice == "text":
        return draw(numbers_as_text)
    return draw(raw)


@st.composite
def text_content(draw: st.DrawFn, rel: str, base: Base) -> bytes:
    """Bytes to plant at a one-line file (a fence, the holder pointer, the queue counter)."""
    content = numbers_as_text | raw | deep | st.just(base.t1.encode()) | st.just(base.t1.upper().encode())
    if rel.endswith(".seq"):
        # Known: the queue counter of thousands of digits is a 70 (test_queue_counter_of_thousands_of_digits).
        content = content.filter(lambda b: not (b.strip().isdigit() and len(b.strip()) > 4300))
    return draw(content)


@dataclass
class Plant:
    kind: str  # file, dir, symlink, fifo
    content: bytes


def plants(rel: str, base: Base) -> st.SearchStrategy[Plant]:
    content = (
        record_content(rel, base) if rel.endswith((".json", ".token", IDENTITY, "success")) else text_content(rel, base)
    )
    kinds = st.sampled_from(["file", "file", "file", "file", "file", "dir", "symlink", "fifo"])
    return st.builds(Plant, kinds, content)


# -- the commands that read each file ----------------------------------------------------------------


class Example:
    """One planted lock dir and the commands run against it."""

    def __init__(self, procs: Procs, base: Base, root: Path, rel: str) -> None:
        self.procs, self.base, self.root = procs, base, root
        self.lock_dir = root / "lockdir"
        shutil.copytree(base.lock_dir, self.lock_dir, symlinks=True)
        self.env = {**procs.env, ENV_LOCK_DIR: str(self.lock_dir), ENV_IDENTITY: IDENTITY}
        self.rel = rel.format(b=base)
        self.path = self.lock_dir / self.rel
        self.fences = root / "fences"
        self.outside = root / "outside"
        self.outside.mkdir()
        self.target = self.outside / "target"
        self.token_file = root / "token.json"
        claim = {
            "lock": "J",
            "repo": "default",
            "ticket": base.t3,
            "token": base.token3,
            "lock_dir": str(self.lock_dir),
        }
        self.token_file.write_text(json.dumps(claim))
        self.token_file.chmod(0o600)

    def plant(self, p: Plant) -> None:
        self.original = self.path.read_bytes()
        self.path.unlink()
        self.target.write_bytes(self.original)
        if p.kind == "dir":
            self.path.mkdir()
        elif p.kind == "symlink":
            self.path.symlink_to(self.target)
        elif p.kind == "fifo":
            os.mkfifo(self.path, 0o600)
        else:
            self.path.write_bytes(p.content)
            self.path.chmod(0o600)
        self.before_tree = tree(self.lock_dir)
        self.before_root = sorted(
            tree(self.root) - {os.path.join("lockdir", x) for x in self.before_tree} - {"lockdir"}
        )

    def beside(self) -> list[str]:
        """Every path of the example outside its lock dir."""
        return sorted(p for p in tree(self.root) if p != "lockdir" and not p.startswith("lockdir/"))

    def run(self, args: list[str]) -> Result:
        r = self.procs.run(args, env=self.env, timeout=30)
        self.check(r, args)
        return r

    def check(self, r: Result, args: list[str]) -> None:
        err = r.stderr.decode(errors="replace")
        what = f"{args[0].rsplit('/', 1)[-1]} {' '.join(args[1:])} with {self.rel} planted: {r!r}"
        assert "Traceback" not in err, what
        assert r.returncode in CLEAN_EXITS | NAMED_EXITS, what
        if r.returncode in NAMED_EXITS:
            lines = err.strip().splitlines()
            assert len(lines) == 1, what
            assert str(self.path) in lines[0], what

    def pearing_run(self, *flags: str) -> Result:
        return self.run(
            [PEARING_RUN, "--job", "J", *flags, "--", "sh", "-c", f"echo $PEARING_FENCE >> {q(self.fences)}"]
        )

    def without_fence_file(self) -> Result:
        """A run after the fence file is lost: it reads every record to continue above them."""
        if self.rel != f"{LOCK}/fence":
            (self.lock_dir / LOCK / "fence").unlink(missing_ok=True)
        return self.pearing_run()

    def cli(self, *args: str) -> Result:
        return self.run([PEARING_CLI, *args])

    def acquire(self, request_uuid: str) -> None:
        r = self.cli("acquire-lock", "J", "--request-uuid", request_uuid, "--lease-seconds", "60")
        if r.returncode == 0:
            t = json.loads(r.stdout)
            if t["state"] == "held":
                self.issued(t["fence"])
            self.cli("release-lock-ticket", "J", t["ticket_id"])

    def busy_waiter(self) -> None:
        """Hold the lock (a CLI agent), then queue behind it: enqueueing reads the queue counter."""
        r = self.cli("acquire-lock", "J", "--request-uuid", str(uuid.uuid4()), "--lease-seconds", "60")
        if r.returncode != 0:
            return
        t = json.loads(r.stdout)
        self.issued(t["fence"])
        w = self.pearing_run("--wait-seconds", "0.2")
        assert w.returncode != 0, "ran while the lock was held"
        self.cli("release-lock-ticket", "J", t["ticket_id"])

    def guard_fence(self, n: int, planted: Plant) -> None:
        r = self.run([PEARING_GUARD, "fence", "--resource", "r", "--fence", str(n)])
        if r.returncode == 0:
            # Accepted: only right if what was planted is a valid ledger that has not seen more.
            table = _ledger(planted) if self.rel == "ledger.json" else {"r": 3}
            assert table is not None and n >= table.get("r", 0), f"stale fence {n} accepted over {planted!r}"

    def issued(self, fence: int) -> None:
        with self.fences.open("a") as f:
            f.write(f"{fence}\n")

    def verify(self, token_file: Path | None = None) -> None:
        self.run([PEARING_GUARD, "verify", "--token-file", str(token_file or self.token_file)])

    def finish(self) -> None:
        # A holder tidies up after its pearing-run returned: its writes are part of what we check.
        self.procs.wait_idle()
        issued = [int(x) for x in self.fences.read_text().split()] if self.fences.exists() else []
        assert all(f > self.base.highest for f in issued), f"a fence reissued or lowered: {issued}"
        assert issued == sorted(set(issued)), f"fences not strictly increasing: {issued}"
        created = tree(self.lock_dir) - self.before_tree
        strays = sorted(p for p in created if not LAYOUT.match(p) and not p.startswith(self.rel + "/"))
        assert strays == [], f"created outside the layout: {strays}"
        assert [p for p in self.beside() if p != "fences"] == self.before_root, "a file appeared beside the lock dir"
        assert self.target.read_bytes() == self.original, "written through a planted symlink"
        assert not Path("/tmp/pearing-fuzz-escape").exists(), "a traversal string escaped the lock dir"


def _ledger(p: Plant) -> dict[str, int] | None:
    """The planted ledger if it is a valid one, else None."""
    if p.kind != "file":
        return None
    try:
        obj = json.loads(p.content)
    except (ValueError, RecursionError):
        return None
    if isinstance(obj, dict) and all(
        isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_FENCE for v in obj.values()
    ):
        return obj
    return None


def _commands(ex: Example, planted: Plant) -> None:
    b, rel = ex.base, ex.rel
    if rel.endswith("/fence"):
        ex.cli("status", "J")
        ex.verify()
        ex.pearing_run()
    elif rel.endswith("/holder"):
        ex.cli("status", "J")
        ex.pearing_run()
    elif rel.endswith("/success"):
        ex.pearing_run("--min-interval", "1h")
        ex.without_fence_file()
    elif rel.endswith(f"tickets/{b.t3}.json"):
        ex.cli("status", "J")
        ex.cli("get-lock-ticket", "J", b.t3)
        ex.verify()
        ex.pearing_run()
    elif rel.endswith(f"ended/{b.t1}.json"):
        ex.cli("get-lock-ticket", "J", b.t1)
        ex.pearing_run("--request-uuid", b.u1)
        ex.without_fence_file()
    elif rel.endswith(f"requests/{b.u1}.json"):
        ex.pearing_run("--request-uuid", b.u1)
        ex.acquire(b.u1)
        ex.without_fence_file()
    elif rel.endswith("queue/.seq"):
        ex.busy_waiter()
    elif rel.endswith(".token"):
        ex.verify(ex.path)
        ex.cli("status", "J")
        ex.pearing_run()
    elif rel.startswith("activity/"):
        ex.cli("status", "J")
        ex.cli("get-lock-ticket", "J", b.t1)
    elif rel == "ledger.json":
        ex.guard_fence(2, planted)
        ex.guard_fence(5, planted)
    else:
        pytest.fail(f"no commands for {rel}")
    ex.finish()


TARGETS = [
    f"{LOCK}/fence",
    f"{LOCK}/holder",
    f"{LOCK}/success",
    LOCK + "/tickets/{b.t3}.json",
    LOCK + "/ended/{b.t1}.json",
    LOCK + "/requests/{b.u1}.json",
    f"{LOCK}/queue/.seq",
    LOCK + "/tokens/{b.t3}.token",
    f"activity/{IDENTITY}",
    "ledger.json",
]


IDS = ["fence", "holder", "success", "tickets", "ended", "requests", "queue-seq", "tokens", "activity", "ledger"]


@pytest.mark.parametrize("rel", TARGETS, ids=IDS)
def test_planted_content_is_a_clear_error_never_a_crash(procs: Procs, base: Base, tmp_path: Path, rel: str) -> None:
    counter = iter(range(1_000_000))

    @settings(
        max_examples=EXAMPLES,
        phases=PHASES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(planted=plants(rel, base))
    def case(planted: Plant) -> None:
        ex = Example(procs, base, tmp_path / f"ex{next(counter)}", rel)
        ex.plant(planted)
        _commands(ex, planted)

    case()


def test_queue_counter_of_thousands_of_digits(procs: Procs, base: Base, tmp_path: Path) -> None:
    ex = Example(procs, base, tmp_path / "ex", f"{LOCK}/queue/.seq")
    ex.plant(Plant("file", b"9" * 5000 + b"\n"))
    _commands(ex, Plant("file", b""))
