"""``pearing-guard git-push``: one atomic git push of the refspecs and the lock's fence ref.

The remote keeps the newest fence of a lock in ``refs/pearing/fence/SCOPE/LOCK``: a
commit on the empty tree whose message is ``pearing fence N``, its parent the fence
commit before it. A push reads that ref, refuses a fence lower than the one it holds,
then pushes the refspecs and a new fence commit in one ``git push --atomic``, leased
(``--force-with-lease``) on the value just read. The remote applies every ref or none,
and none if anybody moved the fence meanwhile: so a detached process of an earlier
holder can never push after the next holder has. A lost race is read again and retried.

Only git is spoken to, as a subprocess in the caller's cwd, exactly as ``git push``
would be run there: no backend, no lock dir.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Final, NamedTuple

from singleflight.core import names
from singleflight.core.errors import (
    BadValue,
    CorruptFenceRef,
    FenceContended,
    Refused,
    StaleRefFence,
    ToolFailed,
    ToolNotFound,
    UsageError,
)

FENCE_REFS: Final = "refs/pearing/fence"
# The remote's fence commit is fetched to here: a ref keeps it (the next fence's parent) from gc.
REMOTE_FENCE_REFS: Final = "refs/pearing/remote-fence"
MAX_TRIES: Final = 10
MESSAGE: Final = "pearing fence "
# Racers that lost one round together would meet again at once: each waits up to this much
# more per round lost, at random.
_BACKOFF_SECONDS: Final = 0.05
# What git says (in the C locale) when the receiving end cannot take an atomic push:
# send-pack's own check, and a remote helper's.
_NO_ATOMIC: Final = (b"does not support --atomic", b"does not support atomic push")


class Output(NamedTuple):
    """What a git command did: its status (128 + N when killed by signal N) and its output."""

    status: int
    stdout: bytes
    stderr: bytes


class Fence(NamedTuple):
    """The remote's fence ref as read: the commit it points at and the fence in its message."""

    sha: str
    fence: int


def git(*args: str, check: bool = True, env: Mapping[str, str] | None = None, stdin: bytes = b"") -> Output:
    """Run ``git ARGS`` in our cwd; ToolFailed (with git's own status and output) if it fails."""
    argv = ["git", *args]
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, env=env, check=False)
    except FileNotFoundError:
        raise ToolNotFound("git") from None
    status = done.returncode if done.returncode >= 0 else 128 - done.returncode  # as a shell reports it
    out = Output(status, done.stdout, done.stderr)
    if check and status != 0:
        raise ToolFailed(argv, status, out.stdout, out.stderr)
    return out


def fence_ref(scope: str, lock: str, root: str = FENCE_REFS) -> str:
    """``refs/pearing/fence/SCOPE/LOCK``, once both are valid names and make a valid git ref.

    The lock name and scope rules leave only git-check-ref-format(1)'s dot rules to check:
    no part may start with '.', hold '..' or end in '.lock', and the ref may not end in '.'.
    """
    names.scope(scope, "--repo scope")
    names.lock_name(lock, "--lock")
    for what, value in (("--repo scope", scope), ("--lock", lock)):
        for part in value.split("/"):
            if part.startswith(".") or ".." in part or part.endswith(".lock"):
                raise BadValue(
                    what, value, "must make a git ref: no part starting with '.', holding '..' or ending in '.lock'"
                )
    if lock.endswith("."):
        raise BadValue("--lock", lock, "must make a git ref: it may not end in '.'")
    return f"{root}/{scope}/{lock}"


def shown_remote(remote: str) -> str:
    """The remote as an error line may name it: without the user:password of a URL."""
    scheme, sep, rest = remote.partition("://")
    authority, slash, path = rest.partition("/")
    if not sep or "@" not in authority:
        return remote
    return f"{scheme}://{authority.rpartition('@')[2]}{slash}{path}"


def _check_args(remote: str, refspecs: Sequence[str]) -> None:
    """A word starting with '-' would reach git as an option: refused, like every bad value."""
    if not remote or remote.startswith("-"):
        raise BadValue("REMOTE", remote, "must name a remote or a URL, not be empty or start with '-'")
    if not refspecs:
        raise UsageError("git-push needs REMOTE and at least one REFSPEC")
    for spec in refspecs:
        if not spec or spec.startswith("-"):
            raise BadValue(
                "REFSPEC", spec, "must be a refspec, not be empty or start with '-' (options go before REMOTE)"
            )
        if "refs/pearing/" in spec:
            # The fence ref is pushed by us alone; a second update of it would race our lease.
            raise BadValue("REFSPEC", spec, "refs/pearing/ holds the fences: it is never pushed by hand")


def parse_fence(commit: bytes) -> int | None:
    """N of a fence commit's message ``pearing fence N`` (with its one newline); None otherwise."""
    _, sep, message = commit.partition(b"\n\n")
    try:
        text = message.decode("ascii")
    except UnicodeDecodeError:
        return None
    text = text.removesuffix("\n")
    digits = text.removeprefix(MESSAGE)
    # The message is written by us alone: one spelling, no leading zeros, no trailers.
    if not sep or digits == text or not digits.isascii() or not digits.isdigit() or digits != str(int(digits)):
        return None
    try:
        return names.fence(digits)
    except BadValue:
        return None


def read_fence(remote: str, ref: str, local: str) -> Fence | None:
    """The remote's fence ref now: None when it has none. CorruptFenceRef if it is not a fence."""
    listed = git("ls-remote", remote, ref).stdout.decode(errors="replace")
    # ls-remote matches patterns on their tail: keep the ref of exactly this name.
    shas = [line.split("\t")[0] for line in listed.splitlines() if line.partition("\t")[2] == ref]
    if not shas:
        return None
    sha = shas[0]
    if git("cat-file", "-e", sha, check=False).status != 0:
        git("fetch", "--no-tags", remote, f"+{ref}:{local}")
        # What was fetched, which is newer if the ref moved since ls-remote: the lease must be on it.
        sha = git("rev-parse", "--verify", "--quiet", local).stdout.decode().strip()
    kind = git("cat-file", "-t", sha).stdout.decode().strip()
    fence = parse_fence(git("cat-file", "commit", sha).stdout) if kind == "commit" else None
    if fence is None:
        what = "commit" if kind == "commit" else kind or "object"
        raise CorruptFenceRef(shown_remote(remote), ref, f"{sha[:12]} is a {what} without the message '{MESSAGE}N'")
    return Fence(sha, fence)


def fence_commit(tree: str, fence: int, parent: Fence | None) -> str:
    """A new fence commit on the empty tree, on top of the one read: the fences keep their history."""
    parents = ["-p", parent.sha] if parent is not None else []
    return git("commit-tree", tree, *parents, "-m", f"{MESSAGE}{fence}").stdout.decode().strip()


def _push_once(remote: str, refspecs: Sequence[str], ref: str, lease: Fence | None, new: str) -> Output:
    expect = lease.sha if lease is not None else ""  # empty: the ref must not exist yet
    args = ["push", "--atomic", "--porcelain", f"--force-with-lease={ref}:{expect}", remote, *refspecs, f"{new}:{ref}"]
    # The C locale: what we look for in git's messages is git's English wording.
    return git(*args, check=False, env={**os.environ, "LC_ALL": "C"})


def _lease_lost(out: Output, ref: str) -> bool:
    """git's porcelain line for the fence ref says the lease failed (it moved since we read it)."""
    for line in out.stdout.decode(errors="replace").splitlines():
        flag, _, rest = line.partition("\t")
        spec, _, summary = rest.partition("\t")
        if flag == "!" and spec.endswith(f":{ref}") and "stale info" in summary:
            return True
    return False


def _moved(remote: str, ref: str, lease: Fence | None) -> bool:
    """The fence ref is no longer what we leased on: the remote took another push meanwhile
    (its own check under its ref lock, after git's lease check passed)."""
    out = git("ls-remote", remote, ref, check=False)
    if out.status != 0:
        return False
    listed = out.stdout.decode(errors="replace").splitlines()
    now = next((line.split("\t")[0] for line in listed if line.partition("\t")[2] == ref), None)
    return now != (lease.sha if lease is not None else None)


def _rejected(out: Output) -> bool:
    # A '!' line is a rejected ref, whatever the status says.
    return out.status != 0 or any(line.startswith("!\t") for line in out.stdout.decode(errors="replace").splitlines())


def push(remote: str, refspecs: Sequence[str], *, fence: int, scope: str, lock: str) -> Output:
    """Push ``refspecs`` to ``remote`` under ``fence``, all or nothing; git's output on success.

    Raises BadValue (nothing run), StaleRefFence, Refused (no atomic push), CorruptFenceRef,
    FenceContended (every try lost the race), ToolNotFound, ToolFailed (git's own failure).
    """
    fence = names.fence(fence)
    ref = fence_ref(scope, lock)
    local = fence_ref(scope, lock, REMOTE_FENCE_REFS)
    _check_args(remote, refspecs)
    # Written (-w), not only hashed: the pack pushed must be able to hold it.
    tree = git("hash-object", "-w", "-t", "tree", "--stdin").stdout.decode().strip()
    for attempt in range(MAX_TRIES):
        if attempt:
            time.sleep(random.uniform(0, _BACKOFF_SECONDS * attempt))
        current = read_fence(remote, ref, local)
        if current is not None and fence < current.fence:
            raise StaleRefFence(ref, fence, current.fence)
        out = _push_once(remote, refspecs, ref, current, fence_commit(tree, fence, current))
        if not _rejected(out):
            return out
        if _lease_lost(out, ref):
            continue
        if any(text in out.stderr for text in _NO_ATOMIC):
            raise Refused(f"{shown_remote(remote)} does not support atomic push; nothing pushed")
        if _moved(remote, ref, current):
            continue
        raise ToolFailed(["git", "push"], out.status or 1, out.stdout, out.stderr)
    raise FenceContended(f"fence ref {ref} on {shown_remote(remote)}", MAX_TRIES, done="nothing pushed")
