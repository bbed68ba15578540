"""A hostile or wrong peer in the etcd member list, and corrupt values in etcd (issue 22, 7-9).

- A peer that drips its answer a byte at a time never trips a per-read timeout: every request
  has a deadline on the whole exchange, then the next member is asked; with none left the
  command says the backend is unreachable (75, one line), as a dead cluster does.
- A peer that answers HTTP 200 with something that is not etcd's (``hello``, ``{}``, ``[]``,
  a header without a revision) is a member that failed, never an internal error (70); a
  proxy's error page of several lines is still one line in the error.
- A member that answers etcd's error for a member that cannot serve yet or is behind
  (``not capable``, a future revision: gRPC codes that otherwise refuse the request) is a
  member that failed too; a genuine refusal (a lease that is gone) stands, on the first member.
- A fence ledger key whose value is not a fence is a corrupt record (74) naming the key,
  and is left as it is.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from etcd_cluster import Cluster as EtcdCluster
from helpers import PEARING_CLI, PEARING_GUARD, Gate, Procs, wait_for
from hostile_peer import KINDS, HostilePeer

from singleflight.core.const import ENV_BACKEND, MAX_FENCE, ExitCode
from singleflight.core.errors import BackendUnavailable
from singleflight.etcd.client import Cluster, Refused
from singleflight.etcd.lock import Mutex

pytestmark = pytest.mark.etcd

NOT_ETCD = [k for k in KINDS if k != "drip"]
# Each drip-fed request costs one request timeout (2 s for the front ends), and a command
# makes only a few before it fails over for good: this is many times what it needs.
BOUND = 15.0


def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def urls(bad: int, etcd: EtcdCluster) -> tuple[str, str]:
    """(the hostile peer alone, the hostile peer first and then a good member), in a tenant."""
    t = tenant()
    return f"etcd://127.0.0.1:{bad}/{t}", f"etcd://127.0.0.1:{bad},{etcd.members[0].endpoint}/{t}"


def status(procs: Procs, url: str) -> tuple[int, str, float]:
    procs.env[ENV_BACKEND] = url
    r = procs.run_text([PEARING_CLI, "status", "--json"], timeout=30)
    return r.returncode, r.stderr, r.elapsed


def assert_unreachable(rc: int, err: str, url: str) -> None:
    assert rc == ExitCode.BUSY, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "unreachable" in lines[0] and url.split("/")[2] in lines[0], err


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_member_alone_is_an_unreachable_backend(
    kind: str, peer: HostilePeer, procs: Procs, etcd: EtcdCluster
) -> None:
    alone, _ = urls(peer.start(kind), etcd)
    rc, err, elapsed = status(procs, alone)
    assert_unreachable(rc, err, alone)
    assert elapsed < BOUND, elapsed


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_member_first_is_failed_over(kind: str, peer: HostilePeer, procs: Procs, etcd: EtcdCluster) -> None:
    _, first = urls(peer.start(kind), etcd)
    rc, err, elapsed = status(procs, first)
    assert rc == 0, err
    assert elapsed < BOUND, elapsed
    assert peer.connections >= 1  # it was asked, and passed over


@pytest.mark.parametrize("kind", KINDS)
def test_a_fence_through_a_hostile_member(kind: str, peer: HostilePeer, procs: Procs, etcd: EtcdCluster) -> None:
    """The ledger's read and compare-and-swap: a ``{}`` answer used to read as "no key" and
    "not succeeded", and the compare-and-swap loop never ended."""
    alone, first = urls(peer.start(kind), etcd)
    fence = [PEARING_GUARD, "fence", "--resource", "r1", "--fence", "5"]
    procs.env[ENV_BACKEND] = alone
    r = procs.run_text(fence, timeout=30)
    assert_unreachable(r.returncode, r.stderr, alone)
    assert r.elapsed < BOUND, r
    procs.env[ENV_BACKEND] = first
    r = procs.run_text(fence, timeout=30)
    assert r.returncode == 0, r
    assert r.elapsed < BOUND, r


@pytest.mark.parametrize("kind", ["drip", "{}", "not-capable", "behind"])
def test_a_run_through_a_hostile_member_first(kind: str, peer: HostilePeer, procs: Procs, etcd: EtcdCluster) -> None:
    """pearing-run, its holder and its release all pass the hostile member over."""
    _, first = urls(peer.start(kind), etcd)
    r = procs.pr_run("--backend", first, "--job", "j", "--", "sh", "-c", "echo ran", timeout=30)
    assert r.returncode == 0, r
    assert r.stdout == b"ran\n", r


@pytest.mark.parametrize("kind", ["not-capable", "behind"])
def test_a_wait_through_a_member_that_cannot_serve_yet(
    kind: str, peer: HostilePeer, procs: Procs, work: Path, etcd: EtcdCluster
) -> None:
    """The member every process asks first answers as an etcd member still starting ("not
    capable") or behind the leader: the waiter's keepalives, reads and watch pass it over all
    through its wait, and it runs once the holder ends. Its answer, read as a refusal of the
    request, made the first run exit 70 ("internal error") at its first request."""
    _, first = urls(peer.start(kind), etcd)
    procs.env[ENV_BACKEND] = first
    gate = Gate(work)
    holder = procs.pr("--job", "j", "--", "sh", "-c", gate.script())
    gate.wait_ready(timeout=30)
    waiter = procs.pr("--job", "j", "--wait-seconds", "60", "--lease-seconds", "3", "--", "true")
    line = Mutex(Cluster(first), "default", "j")
    wait_for(lambda: len(line.queue()[0]) >= 2, 30, "the waiter in line")
    line.cluster.close()
    assert waiter.poll() is None, procs.finish(waiter)
    gate.open()
    assert procs.finish(holder).returncode == 0
    w = procs.finish(waiter, timeout=60)
    assert w.returncode == 0, w
    assert peer.connections >= 2  # both runs asked it, and passed it over


@pytest.mark.parametrize("kind", ["not-capable", "behind"])
def test_a_member_that_cannot_serve_yet_is_passed_over(kind: str, peer: HostilePeer, etcd: EtcdCluster) -> None:
    _, first = urls(peer.start(kind), etcd)
    client = Cluster(first)
    lease = client.grant(5)
    assert lease > 0 and client.current == 1  # the answer of the member after it
    client.close()


def test_a_genuine_refusal_stands_on_the_first_member(peer: HostilePeer, etcd: EtcdCluster) -> None:
    """A lease that is gone is gone on every member: refused, the next member not asked."""
    _, first = urls(peer.start("lease-not-found"), etcd)
    client = Cluster(first)
    with pytest.raises(Refused) as refused:
        client.ttl(0x1234)
    client.close()
    assert refused.value.code == 5 and "lease not found" in str(refused.value)
    assert client.current == 0


# -- corrupt ledger values ---------------------------------------------------------------------

BAD_FENCES = [
    b"garbage",
    b"1e3",
    b"",
    b"-5",
    b"0",
    b"+5",
    b" 5",
    b"5\n",
    b"007",
    b"1_000",
    "\u0663".encode(),  # ARABIC-INDIC DIGIT THREE: int() of the text reads 3
    str(MAX_FENCE + 1).encode(),
    b"9" * 5000,  # int() refuses it (CVE-2020-10735 limit): still corrupt, never 70
]


@pytest.mark.parametrize("value", BAD_FENCES, ids=lambda v: repr(v) if len(v) < 24 else f"{len(v)}-digits")
def test_a_corrupt_ledger_value_is_74_and_kept(value: bytes, procs: Procs, etcd: EtcdCluster) -> None:
    url = f"{etcd.url}/{tenant()}"
    client = Cluster(url)
    key = f"{client.root}ledger/r1"
    client.put(key, value)
    before = client.get(key)
    procs.env[ENV_BACKEND] = url
    r = procs.run_text([PEARING_GUARD, "fence", "--resource", "r1", "--fence", "7"])
    assert r.returncode == ExitCode.IOERR, r
    line = r.one_line()
    assert key in line and "corrupt" in line, line
    after = client.get(key)
    client.close()
    assert after == before


def test_a_good_ledger_value_is_read_and_raised(procs: Procs, etcd: EtcdCluster) -> None:
    url = f"{etcd.url}/{tenant()}"
    client = Cluster(url)
    key = f"{client.root}ledger/r1"
    client.put(key, b"5")
    procs.env[ENV_BACKEND] = url
    for fence, rc in (("4", ExitCode.REFUSED), ("5", ExitCode.OK), ("7", ExitCode.OK)):
        r = procs.run_text([PEARING_GUARD, "fence", "--resource", "r1", "--fence", fence])
        assert r.returncode == rc, r
    kv = client.get(key)
    client.close()
    assert kv is not None and kv["value"] == b"7"


def test_a_leader_election_is_waited_out_for_one_request_timeout(peer: HostilePeer) -> None:
    """Every member answering "leader changed" (an election, over in moments): the request is
    asked again for one more request timeout before the cluster counts as out of reach. A waiter
    once gave up (75) on the first such round, its two members mid-election under CI's load."""
    port = peer.start("electing")
    cluster = Cluster(f"etcd://127.0.0.1:{port}", timeout=0.5)
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match="leader changed"):
        cluster.get(cluster.root + "k")
    assert time.monotonic() - started >= 0.45
    assert peer.requests >= 5, peer.requests  # asked again, every 50 ms
