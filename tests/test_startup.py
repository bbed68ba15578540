"""What a start costs, and that the cheaper ways give the same results.

The holder mints the token and hashes it before COMMAND may start; pearing-guard verify hashes
and compares it before a guarded write may go. Neither loads OpenSSL (hashlib, hmac, secrets):
CPython's own SHA-256 and constant-time compare do the same work without it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import string
import subprocess
import sys
from pathlib import Path

import pytest
from caps import Caps
from helpers import PEARING_GUARD, PEARING_RUN, Gate, Procs, holder_pid
from hypothesis import given, settings
from hypothesis import strategies as st

from singleflight.core import jsontext
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


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(
            st.text(max_size=8) | st.integers() | st.floats() | st.booleans() | st.none(), inner, max_size=5
        )
    ),
    max_leaves=20,
)


def _outcome(fn: object, arg: object) -> tuple[str, object]:
    try:
        return "value", repr(fn(arg))  # type: ignore[operator]
    except Exception as exc:
        return "error", (type(exc), str(exc))


@settings(max_examples=300, deadline=None)
@given(_JSON_VALUES)
def test_jsontext_writes_and_reads_what_json_does(value: object) -> None:
    """Records are written and read with json's C codec alone (core.jsontext): the same text as
    ``json.dumps`` and, read back, the same value as ``json.loads`` (NaN compared as NaN)."""
    text = jsontext.dumps(value)
    assert text == json.dumps(value)
    assert _outcome(jsontext.loads, text) == _outcome(json.loads, text)
    assert _outcome(jsontext.loads, f" \n{text}\t\r") == _outcome(json.loads, f" \n{text}\t\r")


_JSONISH = st.text(alphabet=' \t\n\r\x0b\x0c\xa0{}[]:,"\\0123456789.eE+-truefalsnNaIiy\ufeff\x01é', max_size=30)
_SPACES = st.text(" \t\n\r\x0b\x0c\xa0\ufeffx", max_size=3)


@settings(max_examples=500, deadline=None)
@given(_JSONISH | st.tuples(_SPACES, _JSON_VALUES.map(json.dumps), _SPACES).map("".join))
def test_jsontext_reads_bad_json_as_json_does(text: str) -> None:
    """Any text, well formed or not: the same value, or json's own error and wording."""
    assert _outcome(jsontext.loads, text) == _outcome(json.loads, text)
    for data in (text.encode(), text.encode("utf-16-le"), text.encode("utf-32"), b"\xef\xbb\xbf" + text.encode()):
        assert _outcome(jsontext.loads, data) == _outcome(json.loads, data)
        assert _outcome(jsontext.loads, bytearray(data)) == _outcome(json.loads, bytearray(data))


def test_jsontext_refuses_what_json_refuses_in_its_words() -> None:
    circular: list[object] = []
    circular.append(circular)
    for bad in ({"a": object()}, {(1,): 2}, b"bytes", circular):
        assert _outcome(jsontext.dumps, bad) == _outcome(json.dumps, bad)
    for bad in (None, 1, "\ufeff{}", "", "[1,]", '{"a": 1} x', b'{"a": "\xff"}', b'["\xed\xa0\x80"]', b"[\x00]"):
        assert _outcome(jsontext.loads, bad) == _outcome(json.loads, bad)
    assert math.isnan(jsontext.loads("NaN")) and jsontext.dumps(math.inf) == "Infinity"


_CHILD_READS = """
import sys
from singleflight.core import jsontext
assert "json" not in sys.modules, "json was loaded"
for doc in sys.stdin.read().split("\\0"):
    try:
        print(repr(jsontext.loads(doc)))
    except Exception as exc:
        print(type(exc).__name__, exc)
"""


def test_jsontext_reads_bad_json_as_json_does_where_json_was_never_loaded() -> None:
    """pearing-run, its holder and verify never load json: the C scanner then finds no
    json.decoder to word its error with (it does not import it), and json's own error must still
    come out, as it does in this test's process, where json is loaded."""
    docs = ["{not json", "[1,", '"abc', '{"a" 1}', "", "1 2", '["\\u0001"]', '["\x01"]', "\ufeff{}", '{"a": [1, 2.5]}']
    r = subprocess.run(
        [sys.executable, "-c", _CHILD_READS], input="\0".join(docs), capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, r.stderr
    want = []
    for doc in docs:
        try:
            want.append(repr(json.loads(doc)))
        except ValueError as exc:
            want.append(f"{type(exc).__name__} {exc}")
    assert r.stdout.splitlines() == want


def test_neither_the_holder_nor_the_guard_loads_openssl(caps: Caps, procs: Procs, work: Path) -> None:
    """The holder's memory has no libcrypto mapped while COMMAND runs, and a guarded COMMAND's
    ``pearing-guard verify``, traced with ``-X importtime``, accepts the token without importing
    any of hashlib, hmac or secrets, nor any module an uncontended run does without."""
    gate = Gate(work)
    trace = work / "imports"
    script = f'{sys.executable} -X importtime {PEARING_GUARD} verify 2>"{trace}" && {gate.script()}'
    run = procs.pr("--job", "J", "--", "sh", "-c", script)
    gate.wait_ready()
    holder = holder_pid(procs, "J", run.pid)
    maps = Path(f"/proc/{holder}/maps").read_text()
    if not caps.client_links_openssl:  # libpq (postgres) links it: the holder talks to the store
        assert "libcrypto" not in maps, [line for line in maps.splitlines() if "libcrypto" in line][:3]
    imported = {line.split("|")[-1].strip() for line in trace.read_text().splitlines() if "|" in line}
    assert "singleflight.cli.guard" in imported, "the trace is not of pearing-guard"
    assert not imported & set(OPENSSL) - caps.client_modules, sorted(imported & set(OPENSSL))
    # Nor anything else an uncontended run does without (below), nor the pipe protocol: verify is
    # every guarded write's. (etcd's guard recipe is verify's own.)
    never = (NOT_ON_THE_HOT_PATH - {"singleflight.etcd.guard"} - caps.client_modules) | {"singleflight.core.protocol"}
    assert not imported & never, sorted(imported & never)
    gate.open()
    assert procs.finish(run).returncode == 0


# What an uncontended pearing-run never needs before COMMAND starts, each a few ms or more:
# libffi (ctypes: the inotify of a head of the line waiting on --slots), OpenSSL, typer, the
# subprocess and threading machinery, inspect (dataclasses). (socket is etcd's client's.) Nor,
# each a few ms: typing (its names are the type checker's) and the json package (records are
# read and written with its C half, core.jsontext), nor the idna codec's unicodedata and stringprep
# (etcd's client resolves an address without them). (re stays: pip's console-script wrapper
# imports it before our first line. importlib and warnings are left too, on a regular install:
# an editable install's import hook, as here, loads them itself.)
NOT_ON_THE_HOT_PATH = {
    *("ctypes", "hashlib", "hmac", "secrets", "typer", "subprocess", "threading", "inspect"),
    *("typing", "json", "unicodedata", "stringprep"),
    # Ours, each a rare option's or another command's: --request-key's UUIDv5, the line as status
    # and a waiter read it, a waiter's ticket deadline, pearing-guard fence's ledger and etcd's
    # guard recipe (verify's and exec's), prune's idle lock.
    *("singleflight.core.keys", "singleflight.core.line", "singleflight.rules.tickets"),
    *("singleflight.rules.records", "singleflight.etcd.guard", "singleflight.core.idle"),
}


def test_an_uncontended_run_imports_none_of_the_costly_modules(caps: Caps, procs: Procs, work: Path) -> None:
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
    never = NOT_ON_THE_HOT_PATH - caps.client_modules
    assert not imported & never, sorted(imported & never)
    # A store's driver only on its own path: the lock dir and etcd never load psycopg.
    assert "psycopg" not in imported or "psycopg" in caps.client_modules, "psycopg loaded off the postgres path"
