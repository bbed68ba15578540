"""Tenants on etcd: the URL's PREFIX is the first segment of every key, so two tenants never
share a key. A nested PREFIX (``acme/prod``) made tenant ``acme/prod``'s scope ``web`` the
same keys as tenant ``acme``'s scope ``prod/web`` (issue 22, item 11): it is refused, 64."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from etcd_cluster import Cluster
from helpers import PEARING_CLI, Gate, Procs

from singleflight.core.const import ENV_BACKEND, ExitCode
from singleflight.core.errors import BadValue
from singleflight.etcd.client import Cluster as Client
from singleflight.etcd.url import parse_url


@pytest.mark.parametrize("path", ["acme/prod", "acme/", "a/b/c", ".", "..", "acme prod", "x" * 201])
def test_a_prefix_is_one_name(path: str) -> None:
    with pytest.raises(BadValue) as err:
        parse_url(f"etcd://127.0.0.1:2379/{path}")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "hosts",
    ["1..2:2379", ".:2379", "a.:2379,:2379", "-a:2379", "a-:2379", "a b:2379", "x" * 64 + ":2379", "[]:2379",
     "[::1:2379", "::1]:2379", "a@b:2379", "a/b:2379", "\u00e9\u0001:2379"],
)  # fmt: skip
def test_a_host_the_resolver_cannot_take_is_64_not_an_internal_error(hosts: str, procs: Procs) -> None:
    """``etcd://1..2:2379`` passed the URL's check and failed at its first request, in the idna
    codec: exit 70, "internal error (a bug)". Refused at once now, in the URL's words."""
    url = f"etcd://{hosts}/t"
    with pytest.raises(BadValue) as err:
        parse_url(url)
    assert "\n" not in str(err.value)
    r = procs.run_text([PEARING_CLI, "status"], env=dict(procs.env, **{ENV_BACKEND: url}))
    assert r.returncode == ExitCode.USAGE and "backend" in r.one_line(), r


@pytest.mark.parametrize(
    "hosts", ["127.0.0.1:2379", "etcd-1.example.:2379", "my_etcd:2379", "[::1]:2379", "b\u00fccher.example:2379"]
)
def test_names_the_resolver_takes_pass(hosts: str) -> None:
    assert parse_url(f"etcd://{hosts}")[0][0][0] == hosts.rpartition(":")[0].strip("[]")


@pytest.mark.parametrize(
    ("path", "prefix"), [("", "pearing"), ("/", "pearing"), ("/team-a", "team-a"), ("/a.b_c", "a.b_c")]
)
def test_a_prefix_names_the_tenant(path: str, prefix: str) -> None:
    assert parse_url(f"etcd://127.0.0.1:2379{path}") == ([("127.0.0.1", 2379)], prefix)


def _keys(url: str, root: str) -> list[str]:
    kvs, _ = Client(url).range_prefix(root, keys_only=True)
    return sorted(kv["key"] for kv in kvs)


def test_a_nested_tenant_is_refused_not_another_tenants_scope(
    procs: Procs, work: Path, env: dict[str, str], etcd: Cluster
) -> None:
    """Tenant ACME holds its lock deploy of scope prod/web. Tenant ACME/prod's deploy of scope
    web was the same keys, so it found ACME's holder and exited busy (75): two tenants in one
    line. Now that URL is refused with one line and exit 64, and never joins."""
    acme = f"acme-{uuid.uuid4().hex[:8]}"
    own, nested = f"{etcd.url}/{acme}", f"{etcd.url}/{acme}/prod"
    gate = Gate(work)
    held = procs.pr("--job", "deploy", "--repo", "prod/web", "--", "sh", "-c", gate.script(),
                    env=dict(env, **{ENV_BACKEND: own}))  # fmt: skip
    gate.wait_ready()
    try:
        nested_env = dict(env, **{ENV_BACKEND: nested})
        run = procs.pr_run("--job", "deploy", "--repo", "web", "--", "touch", str(work / "ran"), env=nested_env)
        cli = procs.run([PEARING_CLI, "status", "deploy", "--repo", "web"], env=nested_env)
        line = _keys(etcd.url, f"/{acme}/prod/web/@deploy/q/")
    finally:
        gate.open()
    for r in (run, cli):
        assert r.returncode == ExitCode.USAGE, r
        assert len(r.err_lines) == 1 and nested in r.err_lines[0], r
    assert not (work / "ran").exists()
    assert len(line) == 1, line  # the holder's key alone: the refused run never joined
    assert procs.finish(held).returncode == 0
