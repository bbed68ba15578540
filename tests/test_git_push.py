"""Acceptance tests for ``pearing-guard git-push``: a fenced, atomic git push.

Real git and real processes: bare repos over file:// (and one over smart HTTP) in the
test's tmp dir, pearing-guard started as a process in a work repo. git reads no global
or system config, and has an identity of its own. Every wait is on a file or on a
process the test started.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import git_http
import pytest
from helpers import PEARING_GUARD, PEARING_RUN, Procs, TextResult, q, wait_for

from singleflight import gitpush
from singleflight.cli import guard as guard_cli
from singleflight.core.const import ENV_FENCE, ENV_LOCK, ENV_REPO, ExitCode
from singleflight.core.errors import BadValue

SCOPE, LOCK = "S", "L"
FENCE_REF = f"refs/pearing/fence/{SCOPE}/{LOCK}"
MAIN = "refs/heads/main"
TARGET = ["--lock", LOCK, "--repo", SCOPE]
# A pre-receive hook that, when the push carries PEARING_TEST_GATE, says it is running and
# waits (at most 60 s) for the test's go file: the remote is slow while the test acts.
HOOK = """#!/bin/sh
cat > /dev/null
if [ -n "$PEARING_TEST_GATE" ]; then
  touch "$PEARING_TEST_GATE.ready"
  i=0
  while [ ! -e "$PEARING_TEST_GATE.go" ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done
fi
"""
_PUSH_SECONDS = 90.0


class Git:
    """A bare remote and a work repo with one commit, both in the test's tmp dir."""

    def __init__(self, env: dict[str, str], root: Path) -> None:
        self.env, self.root = env, root
        self.bare, self.work = root / "remote.git", root / "work"
        self.run("init", "-q", "--bare", "-b", "main", str(self.bare), cwd=root)
        self.run("init", "-q", "-b", "main", str(self.work), cwd=root)
        self.url = self.bare.as_uri()
        self.empty_tree = self.run("hash-object", "-w", "-t", "tree", "/dev/null")

    def run(self, *args: str, cwd: Path | None = None) -> str:
        r = subprocess.run(
            ["git", *args], cwd=cwd or self.work, env=self.env, capture_output=True, text=True, timeout=60, check=False
        )
        assert r.returncode == 0, (args, r.stderr)
        return r.stdout.strip()

    def remote(self, *args: str) -> str:
        return self.run(f"--git-dir={self.bare}", *args)

    def commit(self, message: str) -> str:
        self.run("commit", "-q", "--allow-empty", "-m", message)
        return self.run("rev-parse", "HEAD")

    def refs(self) -> dict[str, str]:
        """The remote's refs, as ``git show-ref`` lists them (it exits 1 for none)."""
        r = subprocess.run(
            ["git", f"--git-dir={self.bare}", "show-ref"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return {ref: sha for sha, ref in (line.split(" ", 1) for line in r.stdout.splitlines())}

    def fences(self, ref: str = FENCE_REF) -> list[str]:
        """The messages of the remote's fence ref history, newest first."""
        return self.remote("log", "--format=%B", ref).split("\n\n")

    def fence(self) -> int | None:
        """The fence the remote's fence ref holds now."""
        if FENCE_REF not in self.refs():
            return None
        message = self.remote("log", "-1", "--format=%B", FENCE_REF)
        match = re.fullmatch(r"pearing fence (\d+)", message)
        assert match, message
        return int(match[1])

    def hook(self, text: str = HOOK) -> None:
        path = self.bare / "hooks" / "pre-receive"
        path.write_text(text)
        path.chmod(0o755)


def _git_env(env: dict[str, str]) -> None:
    """git for a fresh machine: no global or system config, an identity, no proxy, nothing of the caller's."""
    for name in list(env):
        if name.startswith("GIT_") or name.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
            del env[name]
    env.update(
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_AUTHOR_NAME="Tester",
        GIT_AUTHOR_EMAIL="tester@example.invalid",
        GIT_COMMITTER_NAME="Tester",
        GIT_COMMITTER_EMAIL="tester@example.invalid",
        GIT_TERMINAL_PROMPT="0",
    )


@pytest.fixture
def repos(env: dict[str, str], procs: Procs, tmp_path: Path) -> Git:
    _git_env(env)  # procs starts its processes with this same dict
    g = Git(env, tmp_path)
    procs.cwd = g.work
    return g


def push(procs: Procs, *args: str, env: dict[str, str] | None = None) -> TextResult:
    return procs.run_text([PEARING_GUARD, "git-push", *args], env=env, timeout=_PUSH_SECONDS)


def pushed(procs: Procs, *args: str, env: dict[str, str] | None = None) -> TextResult:
    r = push(procs, *args, env=env)
    assert r.returncode == 0, r
    return r


# -- what one push does -----------------------------------------------------------------------


def test_a_first_push_creates_the_branch_and_the_fence_ref(procs: Procs, repos: Git) -> None:
    c1 = repos.commit("c1")
    pushed(procs, "--fence", "3", *TARGET, repos.url, f"HEAD:{MAIN}")
    refs = repos.refs()
    assert refs[MAIN] == c1 and set(refs) == {MAIN, FENCE_REF}, refs
    assert repos.fences() == ["pearing fence 3"]
    # On the empty tree, the way the SPEC writes a fence commit.
    assert repos.remote("rev-parse", f"{FENCE_REF}^{{tree}}") == repos.empty_tree


def test_a_higher_fence_moves_both_refs_and_keeps_the_fence_history(procs: Procs, repos: Git) -> None:
    repos.commit("c1")
    pushed(procs, "--fence", "3", *TARGET, repos.url, f"HEAD:{MAIN}")
    first = repos.refs()[FENCE_REF]
    c2 = repos.commit("c2")
    pushed(procs, "--fence", "7", *TARGET, repos.url, f"HEAD:{MAIN}")
    refs = repos.refs()
    assert refs[MAIN] == c2
    assert repos.fences() == ["pearing fence 7", "pearing fence 3"]
    assert repos.remote("rev-parse", f"{FENCE_REF}^") == first


def test_a_stale_push_is_refused_and_moves_nothing(procs: Procs, repos: Git) -> None:
    repos.commit("c1")
    pushed(procs, "--fence", "5", *TARGET, repos.url, f"HEAD:{MAIN}")
    before = repos.refs()
    repos.commit("c2")
    r = push(procs, "--fence", "4", *TARGET, repos.url, f"HEAD:{MAIN}")
    assert r.returncode == ExitCode.REFUSED, r
    assert r.one_line() == "pearing-guard: refused: stale fence 4 < 5"
    assert r.stdout == ""
    assert repos.refs() == before


def test_the_same_fence_pushed_twice_is_accepted(procs: Procs, repos: Git) -> None:
    repos.commit("c1")
    pushed(procs, "--fence", "4", *TARGET, repos.url, f"HEAD:{MAIN}")
    c2 = repos.commit("c2")
    pushed(procs, "--fence", "4", *TARGET, repos.url, f"HEAD:{MAIN}")
    assert repos.refs()[MAIN] == c2
    assert repos.fences() == ["pearing fence 4", "pearing fence 4"]


def test_a_rejected_branch_update_moves_the_fence_ref_neither(procs: Procs, repos: Git) -> None:
    """All or nothing: git refuses the branch (not a fast-forward), so the fence stays too;
    git's status and words come through."""
    repos.commit("c1")
    pushed(procs, "--fence", "1", *TARGET, repos.url, f"HEAD:{MAIN}")
    before = repos.refs()
    repos.run("checkout", "-q", "--orphan", "other")
    repos.commit("unrelated")
    r = push(procs, "--fence", "2", *TARGET, repos.url, f"HEAD:{MAIN}")
    assert r.returncode == 1, r
    assert "pearing-guard" not in r.stderr and "failed to push some refs" in r.stderr, r
    assert repos.refs() == before


# -- races and kills --------------------------------------------------------------------------


def test_racing_pushes_end_under_the_highest_fence(procs: Procs, repos: Git, tmp_path: Path) -> None:
    """Eight holders on eight machines (repos) push at once, each its own commit, forced: the
    branch ends at the highest fence's commit, and no push lands under a fence lower than one before it."""
    fences = list(range(1, 9))
    random.shuffle(fences)
    go = tmp_path / "go"
    started, commits = {}, {}
    for n in fences:
        clone = tmp_path / f"holder{n}"
        repos.run("init", "-q", str(clone), cwd=tmp_path)
        commits[n] = repos.run("commit-tree", repos.empty_tree, "-m", f"work of fence {n}", cwd=clone)
        ready = tmp_path / f"ready{n}"
        script = (
            f"touch {q(ready)}; while [ ! -e {q(go)} ]; do sleep 0.01; done; "
            f"exec {q(PEARING_GUARD)} git-push --fence {n} --lock {LOCK} --repo {SCOPE} {q(repos.url)} "
            f"+{commits[n]}:{MAIN}"
        )
        procs.cwd = clone
        started[n] = procs.start(["sh", "-c", script], text=True)
    for n in fences:
        wait_for((tmp_path / f"ready{n}").exists, 30, f"racer {n} to start")
    go.touch()
    results = {}
    for n, p in started.items():
        _, err = p.communicate(timeout=180)
        results[n] = (p.returncode, err)
    assert all(rc in (0, 1, 75) for rc, _ in results.values()), results
    assert results[8][0] == 0, results
    for n, (rc, err) in results.items():
        if rc == 1:
            match = re.fullmatch(r"pearing-guard: refused: stale fence (\d+) < (\d+)\n", err)
            assert match and int(match[1]) == n < int(match[2]), (n, err)
    assert repos.refs()[MAIN] == commits[8]
    assert repos.fence() == 8
    history = [int(m.removeprefix("pearing fence ")) for m in repos.fences()]
    assert history == sorted(history, reverse=True), history  # newest first, never lower than before
    assert {n for n, (rc, _) in results.items() if rc == 0} == set(history), (results, history)


def _group_alive(pgid: int) -> bool:
    """Some process of process group ``pgid`` is still running (a zombie counts as gone)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _kill_mid_push(procs: Procs, repos: Git, tmp_path: Path, fence: int, remote: str) -> int:
    """Start a fenced push whose remote waits in pre-receive; kill -9 its process group there.
    Returns the group's id."""
    gate = tmp_path / f"gate{fence}"
    env = {**procs.env, "PEARING_TEST_GATE": str(gate)}
    p = procs.start([PEARING_GUARD, "git-push", "--fence", str(fence), *TARGET, remote, f"HEAD:{MAIN}"], env=env)
    wait_for(Path(f"{gate}.ready").exists, 60, "the remote's pre-receive hook to run")
    os.killpg(p.pid, signal.SIGKILL)  # start_new_session: its pid is its group's id
    p.communicate(timeout=30)
    Path(f"{gate}.go").touch()  # anything that outlived the kill may go on now
    return p.pid


def _branch_and_fence_agree(repos: Git, fence_of: dict[str, int]) -> None:
    """Both refs moved or neither: the branch's commit is the one pushed with the fence ref's fence."""
    assert fence_of[repos.refs()[MAIN]] == repos.fence(), (repos.refs(), fence_of)


def test_a_push_killed_mid_push_moves_both_refs_or_neither(procs: Procs, repos: Git, tmp_path: Path) -> None:
    fence_of = {repos.commit("c1"): 1}
    pushed(procs, "--fence", "1", *TARGET, repos.url, f"HEAD:{MAIN}")
    repos.hook()
    for fence in (2, 3, 4):
        before = repos.refs()
        fence_of[repos.commit(f"c{fence}")] = fence
        pgid = _kill_mid_push(procs, repos, tmp_path, fence, repos.url)
        wait_for(lambda pgid=pgid: not _group_alive(pgid), 30, "the killed push's processes to be gone")
        assert repos.refs() == before  # killed before the remote took it: neither moved
        _branch_and_fence_agree(repos, fence_of)
    # The remote is not wedged (no ref lock left behind): the next holder pushes.
    c5 = repos.commit("c5")
    pushed(procs, "--fence", "5", *TARGET, repos.url, f"HEAD:{MAIN}")
    assert repos.refs()[MAIN] == c5 and repos.fence() == 5


@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid(1) to keep the remote side out of the kill")
def test_a_push_killed_while_the_remote_goes_on_moves_both_refs(procs: Procs, repos: Git, tmp_path: Path) -> None:
    """The other half: the remote (its receive-pack in a session of its own) outlives the kill
    of the pushing side, finishes, and updates both refs together."""
    fence_of = {repos.commit("c1"): 1}
    pushed(procs, "--fence", "1", *TARGET, repos.url, f"HEAD:{MAIN}")
    repos.hook()
    repos.run("remote", "add", "slow", repos.url)
    repos.run("config", "remote.slow.receivepack", "setsid git-receive-pack")
    for fence in (2, 3, 4):
        fence_of[repos.commit(f"c{fence}")] = fence
        _kill_mid_push(procs, repos, tmp_path, fence, "slow")
        wait_for(lambda f=fence: repos.fence() == f, 60, f"the remote to take fence {fence}")
        procs.wait_idle(60)
        _branch_and_fence_agree(repos, fence_of)


# -- where fence, lock and scope come from; bad input ------------------------------------------


def test_fence_lock_and_scope_default_from_the_environment(procs: Procs, repos: Git) -> None:
    repos.commit("c1")
    env = {**procs.env, ENV_FENCE: "6", ENV_LOCK: "deploy", ENV_REPO: "team/site"}
    pushed(procs, repos.url, f"HEAD:{MAIN}", env=env)
    assert "refs/pearing/fence/team/site/deploy" in repos.refs()
    assert repos.fences("refs/pearing/fence/team/site/deploy") == ["pearing fence 6"]


def test_the_flags_win_over_the_environment(procs: Procs, repos: Git) -> None:
    repos.commit("c1")
    env = {**procs.env, ENV_FENCE: "2", ENV_LOCK: "other", ENV_REPO: "elsewhere"}
    pushed(procs, "--fence", "5", *TARGET, repos.url, f"HEAD:{MAIN}", env=env)
    assert set(repos.refs()) == {MAIN, FENCE_REF}
    assert repos.fence() == 5
    # PEARING_FENCE alone now, lower than the remote's: the environment's fence is the one judged.
    r = push(procs, *TARGET, repos.url, f"HEAD:{MAIN}", env=env)
    assert r.returncode == 1 and r.one_line() == "pearing-guard: refused: stale fence 2 < 5", r


@pytest.mark.parametrize(
    ("missing", "flag"), [(ENV_FENCE, "--fence N"), (ENV_LOCK, "--lock NAME"), (ENV_REPO, "--repo SCOPE")]
)
def test_a_missing_fence_lock_or_scope_is_usage_and_pushes_nothing(
    procs: Procs, repos: Git, missing: str, flag: str
) -> None:
    repos.commit("c1")
    env = {**procs.env, ENV_FENCE: "1", ENV_LOCK: LOCK, ENV_REPO: SCOPE}
    del env[missing]
    r = push(procs, repos.url, f"HEAD:{MAIN}", env=env)
    assert r.returncode == ExitCode.USAGE, r
    line = r.one_line()
    assert line.startswith("pearing-guard: error: git-push needs ") and flag in line and missing in line, line
    assert repos.refs() == {}


@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5", "", " 1", "9223372036854775808"])
def test_a_bad_fence_is_usage_and_pushes_nothing(procs: Procs, repos: Git, value: str) -> None:
    repos.commit("c1")
    r = push(procs, "--fence", value, *TARGET, repos.url, f"HEAD:{MAIN}")
    assert r.returncode == ExitCode.USAGE, r
    assert r.one_line().startswith("pearing-guard: error: bad fence "), r
    r = push(procs, *TARGET, repos.url, f"HEAD:{MAIN}", env={**procs.env, ENV_FENCE: value})
    assert r.returncode == ExitCode.USAGE, r
    assert repos.refs() == {}


def test_a_fence_with_a_nul_byte_is_usage(
    repos: Git, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """No argv or environment can carry a NUL: the same front end, called in-process."""
    monkeypatch.chdir(repos.work)
    repos.commit("c1")
    code = guard_cli.main(["git-push", "--fence", "1\0", *TARGET, repos.url, f"HEAD:{MAIN}"])
    assert code == ExitCode.USAGE
    assert capfd.readouterr().err.startswith("pearing-guard: error: bad fence '1\\x00'")
    assert repos.refs() == {}


@pytest.mark.parametrize(
    "args",
    [
        ["--lock", "bad name", "--repo", SCOPE],
        ["--lock", LOCK, "--repo", "a//b"],
        ["--lock", "x.lock", "--repo", SCOPE],
        ["--lock", LOCK, "--repo", "a/.hidden"],
    ],
)
def test_a_bad_lock_or_scope_is_usage_and_pushes_nothing(procs: Procs, repos: Git, args: list[str]) -> None:
    repos.commit("c1")
    r = push(procs, "--fence", "1", *args, repos.url, f"HEAD:{MAIN}")
    assert r.returncode == ExitCode.USAGE, r
    assert r.one_line().startswith("pearing-guard: error: bad "), r
    assert repos.refs() == {}


@pytest.mark.parametrize(
    "words",
    [
        [],
        ["REMOTE"],
        ["--", "HEAD:refs/heads/main"],
        ["REMOTE", "--force"],
        ["REMOTE", "HEAD:refs/heads/main", "--delete"],
        ["REMOTE", "HEAD:refs/pearing/fence/S/L"],
        ["REMOTE", ""],
    ],
)
def test_bad_remote_or_refspecs_are_usage_and_push_nothing(procs: Procs, repos: Git, words: list[str]) -> None:
    """A word that would reach git as an option, no refspec at all, or a hand-made push to the fences."""
    repos.commit("c1")
    words = [repos.url if w == "REMOTE" else w for w in words]
    r = push(procs, "--fence", "1", *TARGET, *words)
    assert r.returncode == ExitCode.USAGE, r
    assert r.one_line().startswith("pearing-guard: error: "), r
    assert repos.refs() == {}


@pytest.mark.parametrize(
    ("scope", "lock"),
    [("S", "L"), ("a.b", "c.d"), ("a..b", "L"), (".a", "L"), ("a.lock", "L"), ("S", "L."), ("a./b", "L"), ("S", "L_")],
)
def test_fence_ref_names_follow_git_check_ref_format(scope: str, lock: str) -> None:
    ref = f"refs/pearing/fence/{scope}/{lock}"
    git_says = (
        subprocess.run(["git", "check-ref-format", ref], capture_output=True, check=False, timeout=30).returncode == 0
    )
    try:
        ours = gitpush.fence_ref(scope, lock) == ref
    except BadValue:
        ours = False
    assert ours == git_says, ref


@pytest.mark.parametrize(
    ("message", "fence"),
    [
        (b"pearing fence 7\n", 7),
        (b"pearing fence 7", 7),
        (b"pearing fence 07\n", None),
        (b"pearing fence 0\n", None),
        (b"pearing fence 7\n\nSigned-off-by: x\n", None),
        (b"pearing fence \n", None),
        (b"pearing fence\xd9\xa7\n", None),
        (b"hello\n", None),
    ],
)
def test_only_the_exact_message_is_a_fence(message: bytes, fence: int | None) -> None:
    assert gitpush.parse_fence(b"tree 4b825dc642cb6eb9a060e54bf8d69288fbee4904\n\n" + message) == fence


def test_shown_remotes_carry_no_password() -> None:
    assert gitpush.shown_remote("https://me:s3cret@host/r.git") == "https://host/r.git"
    assert gitpush.shown_remote("origin") == "origin"
    assert gitpush.shown_remote("git@host:r.git") == "git@host:r.git"


# -- git's failures, and remotes that cannot be fenced -------------------------------------------


def test_a_git_failure_keeps_gits_status_and_words(procs: Procs, repos: Git, tmp_path: Path) -> None:
    repos.commit("c1")
    r = push(procs, "--fence", "1", *TARGET, (tmp_path / "missing.git").as_uri(), f"HEAD:{MAIN}")
    assert r.returncode == 128, r
    assert "does not appear to be a git repository" in r.stderr and "pearing-guard" not in r.stderr, r


def test_outside_a_git_repo_git_says_so(procs: Procs, repos: Git, tmp_path: Path) -> None:
    procs.cwd = tmp_path / "plain"
    procs.cwd.mkdir()
    env = {**procs.env, "GIT_CEILING_DIRECTORIES": str(tmp_path)}
    r = push(procs, "--fence", "1", *TARGET, repos.url, f"HEAD:{MAIN}", env=env)
    assert r.returncode == 128 and "not a git repository" in r.stderr, r
    assert repos.refs() == {}


def test_without_git_on_path_it_says_so(procs: Procs, repos: Git, tmp_path: Path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    r = push(procs, "--fence", "1", *TARGET, repos.url, f"HEAD:{MAIN}", env={**procs.env, "PATH": str(empty)})
    assert r.returncode == ExitCode.NOTFOUND, r
    assert r.one_line() == "pearing-guard: error: git not found on PATH"


def test_a_corrupt_remote_fence_ref_is_74_and_left_alone(procs: Procs, repos: Git) -> None:
    bogus = repos.remote("commit-tree", repos.empty_tree, "-m", "not a fence")
    repos.remote("update-ref", FENCE_REF, bogus)
    repos.commit("c1")
    r = push(procs, "--fence", "9", *TARGET, repos.url, f"HEAD:{MAIN}")
    assert r.returncode == ExitCode.IOERR, r
    assert FENCE_REF in r.one_line() and "corrupt fence ref" in r.one_line(), r
    assert repos.refs() == {FENCE_REF: bogus}


def test_a_remote_without_atomic_push_is_refused(procs: Procs, repos: Git) -> None:
    repos.remote("config", "receive.advertiseAtomic", "false")
    repos.commit("c1")
    r = push(procs, "--fence", "1", *TARGET, repos.url, f"HEAD:{MAIN}")
    assert r.returncode == ExitCode.REFUSED, r
    assert r.one_line() == f"pearing-guard: refused: {repos.url} does not support atomic push; nothing pushed"
    assert repos.refs() == {}


# -- lost races, made to happen: a git on PATH that moves the fence just before each push -------------

_INTERLOPER = """#!/bin/sh
# Before pearing-guard's push (once, or every time): another holder pushes fence $MOVE_FENCE
# (a commit of its own: another committer, so never the very commit pearing-guard made).
if [ "$1" = push ] && [ "$2" = --atomic ] && { [ -z "$MOVE_ONCE" ] || [ ! -e "$MOVE_ONCE" ]; }; then
  [ -n "$MOVE_ONCE" ] && touch "$MOVE_ONCE"
  cur=$("$REAL_GIT" ls-remote "$MOVE_REMOTE" "$MOVE_REF" | cut -f1)
  new=$(GIT_COMMITTER_NAME=Other "$REAL_GIT" commit-tree "$MOVE_TREE" ${cur:+-p "$cur"} \
        -m "pearing fence $MOVE_FENCE") || exit 99
  "$REAL_GIT" push -q -f "$MOVE_REMOTE" "$new:$MOVE_REF" || exit 99
  echo x >> "$MOVE_LOG"
fi
exec "$REAL_GIT" "$@"
"""


@pytest.fixture
def interloper(procs: Procs, repos: Git, tmp_path: Path) -> Iterator[dict[str, str]]:
    """An environment whose ``git`` moves the remote's fence ref before each fenced push."""
    bin_dir = tmp_path / "interloper-bin"
    bin_dir.mkdir()
    (bin_dir / "git").write_text(_INTERLOPER)
    (bin_dir / "git").chmod(0o755)
    real = shutil.which("git", path=procs.env.get("PATH"))
    assert real is not None
    yield {
        **procs.env,
        "PATH": f"{bin_dir}{os.pathsep}{procs.env.get('PATH', '')}",
        "REAL_GIT": real,
        "MOVE_REMOTE": repos.url,
        "MOVE_REF": FENCE_REF,
        "MOVE_TREE": repos.empty_tree,
        "MOVE_LOG": str(tmp_path / "moves"),
    }


def test_a_lost_race_is_read_again_and_pushed(
    procs: Procs, repos: Git, tmp_path: Path, interloper: dict[str, str]
) -> None:
    c1 = repos.commit("c1")
    env = {**interloper, "MOVE_FENCE": "2", "MOVE_ONCE": str(tmp_path / "moved")}
    pushed(procs, "--fence", "3", *TARGET, repos.url, f"HEAD:{MAIN}", env=env)
    assert (tmp_path / "moves").read_text() == "x\n"  # one lost lease, then the retry
    assert repos.refs()[MAIN] == c1
    assert repos.fences() == ["pearing fence 3", "pearing fence 2"]  # ours on top of the one read again


def test_a_lost_race_to_a_higher_fence_is_refused(
    procs: Procs, repos: Git, tmp_path: Path, interloper: dict[str, str]
) -> None:
    repos.commit("c1")
    env = {**interloper, "MOVE_FENCE": "9", "MOVE_ONCE": str(tmp_path / "moved")}
    r = push(procs, "--fence", "3", *TARGET, repos.url, f"HEAD:{MAIN}", env=env)
    assert r.returncode == ExitCode.REFUSED and r.one_line() == "pearing-guard: refused: stale fence 3 < 9", r
    assert set(repos.refs()) == {FENCE_REF} and repos.fence() == 9


def test_every_race_lost_is_busy(procs: Procs, repos: Git, tmp_path: Path, interloper: dict[str, str]) -> None:
    repos.commit("c1")
    r = push(procs, "--fence", "1", *TARGET, repos.url, f"HEAD:{MAIN}", env={**interloper, "MOVE_FENCE": "1"})
    assert r.returncode == ExitCode.BUSY, r
    assert r.one_line().startswith(f"pearing-guard: error: fence ref {FENCE_REF} on {repos.url} moved under each of 10")
    assert (tmp_path / "moves").read_text() == "x\n" * gitpush.MAX_TRIES
    assert set(repos.refs()) == {FENCE_REF}  # the branch never went


# -- smart HTTP --------------------------------------------------------------------------------


@pytest.mark.skipif(not git_http.available(), reason=f"{git_http.BACKEND} not found (git's http-backend)")
def test_a_fenced_push_over_smart_http(procs: Procs, repos: Git) -> None:
    repos.remote("config", "http.receivepack", "true")
    c1 = repos.commit("c1")
    with git_http.serve(repos.root, procs.env) as base:
        url = f"{base}/{repos.bare.name}"
        pushed(procs, "--fence", "2", *TARGET, url, f"HEAD:{MAIN}")
        assert repos.refs() == {MAIN: c1, FENCE_REF: repos.refs()[FENCE_REF]} and repos.fence() == 2
        r = push(procs, "--fence", "1", *TARGET, url, f"HEAD:{MAIN}")
        assert r.returncode == 1 and r.one_line() == "pearing-guard: refused: stale fence 1 < 2", r
        # Another holder's clone, which has never seen the fence commit: it is fetched over HTTP.
        other = repos.root / "other"
        repos.run("clone", "-q", url, str(other), cwd=repos.root)
        c2 = repos.commit("c2")
        repos.run("push", "-q", str(other), "HEAD:refs/heads/next")
        repos.run("checkout", "-q", "next", cwd=other)
        procs.cwd = other
        pushed(procs, "--fence", "3", *TARGET, url, f"HEAD:{MAIN}")
    assert repos.refs()[MAIN] == c2
    assert repos.fences() == ["pearing fence 3", "pearing fence 2"]


# -- the front end -------------------------------------------------------------------------------


def test_help_lists_git_push(procs: Procs) -> None:
    overview = procs.run_text([PEARING_GUARD, "--help"])
    assert overview.returncode == 0 and "git-push REMOTE REFSPEC..." in overview.stdout, overview
    own = procs.run_text([PEARING_GUARD, "git-push", "-h"])
    assert own.returncode == 0, own
    usage = "usage: pearing-guard git-push [--fence N] [--lock NAME --repo SCOPE] REMOTE REFSPEC...\n"
    assert own.stdout.startswith(usage), own
    for word in (ENV_FENCE, ENV_LOCK, ENV_REPO):
        assert word in own.stdout
    unknown = procs.run_text([PEARING_GUARD, "git-pull"])
    assert unknown.returncode == ExitCode.USAGE
    assert unknown.one_line() == "pearing-guard: error: unknown command 'git-pull': use verify, exec, fence or git-push"


def test_under_pearing_run_the_runs_fence_is_pushed(procs: Procs, repos: Git) -> None:
    """The way it is meant to be used: COMMAND gets PEARING_FENCE, PEARING_LOCK and PEARING_REPO."""
    c1 = repos.commit("c1")
    script = f"{q(PEARING_GUARD)} git-push {q(repos.url)} HEAD:{MAIN}"
    r = procs.run_text([PEARING_RUN, "--job", "deploy", "--repo", "team/site", "--", "sh", "-c", script])
    assert r.returncode == 0, r
    ref = "refs/pearing/fence/team/site/deploy"
    assert repos.refs()[MAIN] == c1 and ref in repos.refs()
    [message] = repos.fences(ref)
    assert re.fullmatch(r"pearing fence [1-9]\d*", message), message
