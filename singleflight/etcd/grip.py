"""The grip on etcd: our key first in line, its token, and the holder's lease, as the wrapper
holds it and hands it to its holder (``handover`` / ``from_handover``)."""

from __future__ import annotations

import contextlib
import time

from singleflight.core.cadence import Cadence
from singleflight.core.const import TYPE_CHECKING
from singleflight.core.errors import BackendUnavailable
from singleflight.etcd.client import Cluster, Refused, b64, unb64
from singleflight.etcd.lock import WAIT_TTL

if TYPE_CHECKING:
    from typing import Any


class EtcdGrip:
    """Our key, first in line, its token, and the holder's lease: what the wrapper hands its
    holder. No fd.

    Wrapper and holder both keep the lease alive, so a frozen holder cannot let it lapse
    into a second COMMAND; it is revoked by the holder, or by the wrapper once COMMAND is
    dead. Until the holder has settled, the key may still ride on its waiting lease: that
    one is kept alive (and revoked) with it.
    """

    def __init__(
        self,
        cluster: Cluster,
        lease: int,
        kv: dict[str, Any],
        ttl: int,
        *,
        kept_at: float,
        token: str,
        waiting_lease: int = 0,
        waiting_kept_at: float = 0.0,
        keep_lease: int = 0,
    ) -> None:
        self.cluster, self.lease, self.kv, self.token = cluster, lease, kv, token
        self.waiting_lease = waiting_lease
        self.keep_lease = keep_lease  # an hour's lease for the end record, granted while waiting
        # When the last keepalive that succeeded was sent, of the holder's lease and of the
        # waiting lease (which the key rides on until the holder settles).
        self.kept_at, self.waiting_kept_at = kept_at, waiting_kept_at
        self.ttl = ttl
        # A promoted waiter's key rides on its waiting lease until the holder settles.
        if waiting_lease:
            self._cadence = Cadence(ttl, WAIT_TTL, at=min(kept_at, waiting_kept_at))
        else:
            self._cadence = Cadence(ttl, at=kept_at)

    def handover(self) -> tuple[dict[str, Any], set[int]]:
        """All of it is data: the lease and key (no fd)."""
        kv = self.kv
        info = {
            "kv": {
                "key": str(kv["key"]),
                "value": b64(kv["value"]),
                "create_revision": int(kv["create_revision"]),
                "mod_revision": int(kv["mod_revision"]),
                "lease": int(kv.get("lease") or 0),
            },
            "lease": self.lease,
            "ttl": self.ttl,
            "token": self.token,
            "kept_at": self.kept_at,
            "waiting_lease": self.waiting_lease,
            "waiting_kept_at": self.waiting_kept_at,
            "keep_lease": self.keep_lease,
        }
        return info, set()

    @classmethod
    def from_handover(cls, cluster: Cluster, info: dict[str, Any]) -> EtcdGrip:
        """The grip ``handover`` described (monotonic stamps are the host's, shared by its processes)."""
        kv = dict(info["kv"])
        kv["value"] = unb64(str(kv["value"]))
        return cls(
            cluster,
            int(info["lease"]),
            kv,
            int(info["ttl"]),
            kept_at=float(info["kept_at"]),
            token=str(info["token"]),
            waiting_lease=int(info["waiting_lease"]),
            waiting_kept_at=float(info["waiting_kept_at"]),
            keep_lease=int(info["keep_lease"]),
        )

    def keep(self) -> float:
        """A keepalive of every lease the key may ride on, once a third of the shortest has gone
        since the last try; how long until the next is due."""
        if (left := self._cadence.due()) > 0:
            return left
        self._keepalive()
        return self._cadence.every

    def _keepalive(self) -> None:
        with contextlib.suppress(BackendUnavailable, Refused):
            sent = time.monotonic()
            if self.cluster.keepalive(self.lease) > 0:
                self.kept_at = sent
            if self.waiting_lease and self.cluster.keepalive(self.waiting_lease) > 0:
                self.waiting_kept_at = sent

    def still_ours(self) -> bool:
        """Every lease the key may ride on kept alive within half its TTL: certainly ours, no
        request (the usual hand-over). Else (wrapper and holder were both frozen, or the
        cluster was slow) look: a lease that lapsed took the key with it, and the next waiter
        may be running already."""
        now = time.monotonic()
        fresh = now - self.kept_at < self.ttl / 2
        if self.waiting_lease:
            fresh = fresh and now - self.waiting_kept_at < WAIT_TTL / 2
        if fresh:
            return True
        self._keepalive()
        try:
            kv = self.cluster.get(str(self.kv["key"]))
        except BackendUnavailable:
            return False
        return kv is not None and kv["create_revision"] == self.kv["create_revision"]

    def close(self) -> None:
        """The lease lives in the cluster; the holder lets go of the key when it hands over."""

    def release(self) -> None:
        self.cluster.revoke(self.lease)
        if self.waiting_lease:
            self.cluster.revoke(self.waiting_lease)
