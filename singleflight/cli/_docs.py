"""Write (or check) the man pages and shell completions of the four commands.

    python -m singleflight.cli._docs           # rewrite man/*.1 and contrib/completion/*
    python -m singleflight.cli._docs --check   # exit 1 naming each file that is not current

They are generated from the tables ``--help`` renders (cli/_pages.py), and committed:
tests/test_docs.py fails when one is stale. Run from the source tree: the files live beside
the package, not in it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from singleflight.cli import _completion, _manpage
from singleflight.cli._pages import Page, pages

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "python -m singleflight.cli._docs"

# (where, under ROOT, a command's file goes; how it is written)
_KINDS: list[tuple[str, Callable[[Page], str]]] = [
    ("man/{prog}.1", _manpage.render),
    ("contrib/completion/bash/{prog}", _completion.bash),
    ("contrib/completion/zsh/_{prog}", _completion.zsh),
    ("contrib/completion/fish/{prog}.fish", _completion.fish),
]


def generated() -> dict[Path, str]:
    """Every file's path (relative to ROOT) and the text it must hold."""
    return {Path(where.format(prog=p.prog)): write(p) for p in pages() for where, write in _KINDS}


def stale(root: Path = ROOT) -> list[str]:
    """The files under ``root`` that differ from what the tables make now."""
    out = []
    for rel, text in generated().items():
        path = root / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            out.append(str(rel))
    return out


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        old = stale()
        for name in old:
            sys.stderr.write(f"not current: {name} (regenerate: {REGENERATE})\n")
        return 1 if old else 0
    if argv:
        sys.stderr.write(f"usage: {REGENERATE} [--check]\n")
        return 64
    for rel, text in generated().items():
        path = ROOT / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
