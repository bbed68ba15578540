"""What a start costs, and that the cheaper ways give the same results.

The holder mints the token and hashes it before COMMAND may start; pearing-guard verify hashes
and compares it before a guarded write may go. Neither loads OpenSSL (hashlib, hmac, secrets):
CPython's own SHA-256 and constant-time compare do the same work without it.
"""

from __future__ import annotations

import hashlib
import hmac
import string
import sys
from pathlib import Path

import pytest
from helpers import PEARING_GUARD, PEARING_RUN, Gate, Procs, holder_pid
from hypothesis import given, settings
from hypothesis import strategies as st

from singleflight.core.tokens import mint_token, same_secret, token_hash

# The modules that load OpenSSL's libcrypto, or are there only to reach it.
OPENSSL = ("_hashlib", "hashlib", "hmac", "secrets", "_ssl")


def test_a_minted_token_is_256_random_bits_in_hex() -> None:
    tokens = {mint_token() for _ in range(200)}
    assert len(tokens) == 200
    assert all(len(t) == 64 and set(t) <= set(string.hexdigits.lower()) for t in tokens)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=100))
def test_token_hash_is_sha256_with_cpythons_module_and_without_it(token: str) -> None:
    want = hashlib.sha256(token.encode()).hexdigest()
    assert token_hash(token) == want
    with pytest.MonkeyPatch.context() as mp:
        # None in sys.modules makes `from _sha256 import ...` raise ImportError: the fallback.
        mp.setitem(sys.modules, "_sha256", None)
        mp.setitem(sys.modules, "_sha2", None)
        assert token_hash(token) == want


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=70), st.text(max_size=70))
def test_same_secret_is_equality_with_and_without_the_operator_module(a: str, b: str) -> None:
    assert same_secret(a, b) == (a == b) == hmac.compare_digest(a.encode(), b.encode())
    assert same_secret(a, a)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "_operator", None)
        assert same_secret(a, b) == (a == b)


def test_neither_the_holder_nor_the_guard_loads_openssl(backend: str, procs: Procs, work: Path) -> None:
    """The holder's memory has no libcrypto mapped while COMMAND runs, and a guarded COMMAND's
    ``pearing-guard verify``, traced with ``-X importtime``, accepts the token without importing
    any of hashlib, hmac or secrets."""
    gate = Gate(work)
    trace = work / "imports"
    script = f'{sys.executable} -X importtime {PEARING_GUARD} verify 2>"{trace}" && {gate.script()}'
    run = procs.pr("--job", "J", "--", "sh", "-c", script)
    gate.wait_ready()
    holder = holder_pid(procs, "J", run.pid)
    maps = Path(f"/proc/{holder}/maps").read_text()
    assert "libcrypto" not in maps, [line for line in maps.splitlines() if "libcrypto" in line][:3]
    imported = {line.split("|")[-1].strip() for line in trace.read_text().splitlines() if "|" in line}
    assert "singleflight.cli.guard" in imported, "the trace is not of pearing-guard"
    assert not imported & set(OPENSSL), sorted(imported & set(OPENSSL))
    gate.open()
    assert procs.finish(run).returncode == 0


# What an uncontended pearing-run never needs before COMMAND starts, each a few ms or more:
# libffi (ctypes: the inotify of a head of the line waiting on --slots), OpenSSL, typer, the
# subprocess and threading machinery, inspect (dataclasses). (socket is etcd's client's.)
NOT_ON_THE_HOT_PATH = {"ctypes", "hashlib", "hmac", "secrets", "typer", "subprocess", "threading", "inspect"}


def test_an_uncontended_run_imports_none_of_the_costly_modules(backend: str, procs: Procs, work: Path) -> None:
    """The wrapper, traced with ``-X importtime`` (its holder is a fork of it, so what the wrapper
    loaded is the holder's too; the holder's own later imports go to its /dev/null, and the
    OpenSSL test above looks at its memory instead). ctypes once came in with --slots, ~8 ms."""
    trace = work / "imports"
    r = procs.run(
        [sys.executable, "-X", "importtime", PEARING_RUN, "--job", "J", "--", "true"], stderr=trace.open("wb")
    )
    assert r.returncode == 0, r
    imported = {line.split("|")[-1].strip() for line in trace.read_text().splitlines() if "|" in line}
    assert "singleflight.runner" in imported, "the trace is not of pearing-run"
    assert not imported & NOT_ON_THE_HOT_PATH, sorted(imported & NOT_ON_THE_HOT_PATH)
