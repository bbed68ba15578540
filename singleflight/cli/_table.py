"""The readable ``status`` table for a terminal."""

from __future__ import annotations

from typing import Any

ACTIVITY_WIDTH = 60


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped the way ``repr`` writes it.

    Activity text (and, from etcd, a foreign holder's key) is anybody's text. Printed raw,
    ESC and the C1 controls (U+0080-U+009F: a lone U+009B is a CSI on many terminals) can set
    the window title, clear the screen or move the cursor; a newline or CR can forge a row;
    bidi overrides (U+202E) can reorder it. ``str.isprintable`` is false for all of these
    (Unicode categories Cc, Cf, Cs, Co, Cn, Zl, Zp, and every space but ' '), so each
    becomes ``\\x1b``, ``\\n``, ``\\t``, ``\\x9b``, ``\\u202e``... A backslash stays as it
    is: the table is for reading, ``--json`` gives the exact text.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def render(locks: list[dict[str, Any]]) -> str:
    header = ("LOCK", "REPO", "STATE", "IDENTITY", "FENCE", "LEASE LEFT", "WAITERS", "ACTIVITY")
    rows: list[tuple[str, ...]] = [header]
    for lk in locks:
        slots = lk.get("slots") or {"used": 0, "total": 1}
        state = str(lk["state"])
        if slots["total"] > 1:
            state += f" {slots['used']}/{slots['total']}"  # --slots: slots used of the lock's
        # One row per holder (with --slots there may be several), the lock's waiters on the first.
        for i, h in enumerate(lk.get("holders") or [lk["holder"] or {}]):
            left = h.get("lease_left")
            cells = (
                str(lk["lock_name"]),
                str(lk["repo"]),
                state,
                str(h.get("identity") or "-"),
                str(h.get("fence") or lk["fence"]) if slots["total"] > 1 else str(lk["fence"]),
                "-" if left is None else f"{left:.1f}s",
                str(len(lk["waiters"])) if i == 0 else "",
                printable(str(h.get("activity") or "-"))[:ACTIVITY_WIDTH],
            )
            # Every cell, not just activity: names are validated on the way in, but a record
            # read back (or a foreign etcd key) is not proof of that.
            rows.append(tuple(printable(c) for c in cells))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if not locks:
        lines.append("(no locks)")
    return "\n".join(lines) + "\n"


def render_thread(tree: dict[str, Any]) -> str:
    """``get-thread-tree`` on a terminal: one line per reply under its parent, then its text.
    Every field is somebody's text: printed through ``printable``."""
    fence = tree["fence"] if tree["fence"] is not None else "none yet"
    lines = [f"{printable(tree['repo'])} #{tree['thread']}  ({tree['lock_name']}, highest fence {fence})"]

    def walk(replies: list[dict[str, Any]], indent: str) -> None:
        for i, r in enumerate(replies):
            last = i == len(replies) - 1
            mark, cont = ("└─ ", "   ") if last else ("├─ ", "│  ")
            fenced = f"fence {r['fence']}" if r["fence"] is not None else "unfenced"
            head = (
                f"{printable(r['kind'])} by {printable(r['identity'])}, {fenced}, {r['created_at']}  [{r['reply_id']}]"
            )
            lines.append(indent + mark + head)
            for text in r["body"].splitlines() or [""]:
                lines.append(indent + cont + "  " + printable(text))
            for link in r["links"]:
                lines.append(indent + cont + "  -> " + printable(link))
            walk(r["replies"], indent + cont)

    walk(tree["replies"], "")
    if not tree["replies"]:
        lines.append("(no replies)")
    return "\n".join(lines) + "\n"
