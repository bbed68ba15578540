"""The thread service on etcd: keys under the tenant prefix, beside the scope's locks.

    /PREFIX/SCOPE/#thread/N/fence        the highest fence the thread accepted (decimal)
    /PREFIX/SCOPE/#thread/N/r/REPLY_ID   a reply (JSON); the thread's order is their create revision

``#`` is in no scope segment (``[A-Za-z0-9._-]``) and locks live under ``@``: a thread's keys
never meet another scope's or a lock's. A reply lands in one transaction that compares the
fence key's mod revision with the one read, only while its value is the fence the rule judged
(rules/threads.py), so a lower fence is never stored after a higher one. Sent twice (a member
that applied it and died before answering), it finds its own key and is done.
"""

from __future__ import annotations

import json
from typing import Any

from singleflight.core.errors import CorruptRecord
from singleflight.core.record import loads, stored_reply
from singleflight.etcd.client import Cluster, cmp, op_put


class Threads:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def _base(self, repo: str, thread: int) -> str:
        return f"{self.cluster.root}{repo}/#thread/{thread}/"

    def read(self, repo: str, thread: int) -> tuple[list[dict[str, Any]], int | None]:
        base = self._base(repo, thread)
        kvs, _ = self.cluster.range_prefix(base)  # oldest create revision first: the order accepted
        highest = None
        replies = []
        for kv in kvs:
            if kv["key"] == base + "fence":
                highest = self._fence(kv)
            elif kv["key"].startswith(base + "r/"):
                replies.append(self._reply(kv))
        return replies, highest

    def add(self, repo: str, thread: int, reply: dict[str, Any], *, highest: int | None) -> bool:
        """``Backend.add_reply``: one txn over the fence key as read, and the reply's key unused."""
        base = self._base(repo, thread)
        key, fence_key = base + "r/" + reply["reply_id"], base + "fence"
        if self._mine(key, reply):
            return True  # our earlier attempt was applied
        top = self.cluster.get(fence_key)
        if (self._fence(top) if top is not None else None) != highest:
            return False  # another writer's fence landed since the rule read it
        checks = [
            cmp(fence_key, "MOD", "EQUAL", top["mod_revision"])
            if top is not None
            else cmp(fence_key, "CREATE", "EQUAL", 0),
            cmp(key, "CREATE", "EQUAL", 0),
        ]
        fence = reply["fence"]
        puts = [op_put(key, json.dumps(reply, sort_keys=True).encode())]
        if fence is not None and (highest is None or fence > highest):
            puts.append(op_put(fence_key, str(fence).encode()))
        # Failed: the fence moved, or our key is there (a resend the first member had applied).
        return bool(self.cluster.txn(checks, puts, []).get("succeeded")) or self._mine(key, reply)

    def _mine(self, key: str, reply: dict[str, Any]) -> bool:
        found = self.cluster.get(key)
        return found is not None and self._reply(found)["reply_id"] == reply["reply_id"]

    @staticmethod
    def _fence(kv: dict[str, Any]) -> int:
        text = kv["value"].decode(errors="replace")
        if not (text.isascii() and text.isdigit() and len(text) <= 19 and int(text) >= 1):
            raise CorruptRecord(f"etcd:{kv['key']}", f"not a fence: {text[:40]!r}")
        return int(text)

    @staticmethod
    def _reply(kv: dict[str, Any]) -> dict[str, Any]:
        where = f"etcd:{kv['key']}"
        try:
            r = loads(kv["value"])
        except ValueError as exc:
            raise CorruptRecord(where, f"not a reply: {exc}") from None
        reply = stored_reply(r)
        if reply is None:
            raise CorruptRecord(where, "a reply field holds a value of the wrong type")
        return reply
