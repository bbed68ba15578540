"""The readable ``status`` table for a terminal."""

from __future__ import annotations

from typing import Any


def render(locks: list[dict[str, Any]]) -> str:
    header = ("LOCK", "REPO", "STATE", "IDENTITY", "FENCE", "LEASE LEFT", "WAITERS", "ACTIVITY")
    rows = [header]
    for lk in locks:
        h = lk["holder"] or {}
        left = h.get("lease_left")
        rows.append(
            (
                lk["lock_name"],
                lk["repo"],
                lk["state"],
                h.get("identity") or "-",
                str(lk["fence"]),
                "-" if left is None else f"{left:.1f}s",
                str(len(lk["waiters"])),
                (h.get("activity") or "-")[:60],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if not locks:
        lines.append("(no locks)")
    return "\n".join(lines) + "\n"
