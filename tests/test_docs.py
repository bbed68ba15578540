"""Help, man pages and shell completions of the four commands (issue 26, "CLI conventions").

One help layout (``_argv.render``), one vocabulary of metavars (``_pages.METAVARS``), and man
pages and completions generated from the tables ``--help`` renders, committed and current.
Fast: one subprocess per help page or shell; groff, zsh and fish are used where installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from singleflight.cli import _docs
from singleflight.cli._argv import NAMES_WIDTH, WIDTH, Option
from singleflight.cli._pages import METAVARS, Page, pages

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
COMPLETION = ROOT / "contrib" / "completion"
PAGES = {p.prog: p for p in pages()}
_CHOICE = re.compile(r"[a-z]+(\|[a-z]+)+")


def _every_option(page: Page) -> list[Option]:
    return [*page.options, *(o for s in page.commands for o in s.options)]


# -- generated files ---------------------------------------------------------------------------


def test_man_pages_and_completions_are_current() -> None:
    stale = _docs.stale()
    assert stale == [], (
        f"generated from the option tables, and not current: {', '.join(stale)}.\n"
        f"Regenerate them: .venv/bin/{_docs.REGENERATE}  (then commit man/ and contrib/completion/)"
    )


def test_a_stale_file_is_found(tmp_path: Path) -> None:
    for rel, text in _docs.generated().items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert _docs.stale(tmp_path) == []
    (tmp_path / "man" / "pearing-run.1").write_text("old\n")
    (tmp_path / "contrib/completion/fish/pearing-cli.fish").unlink()
    assert _docs.stale(tmp_path) == ["man/pearing-run.1", "contrib/completion/fish/pearing-cli.fish"]


def test_each_command_has_a_man_page_and_three_completions() -> None:
    names = {str(rel) for rel in _docs.generated()}
    for prog in ("pearing-run", "pearing-guard", "pearing-cli", "pearing-mcp"):
        assert {
            f"man/{prog}.1",
            f"contrib/completion/bash/{prog}",
            f"contrib/completion/zsh/_{prog}",
            f"contrib/completion/fish/{prog}.fish",
        } <= names


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff not installed (apt-get install groff-base)")
@pytest.mark.parametrize("prog", sorted(PAGES))
def test_man_page_renders_without_warnings(prog: str) -> None:
    out = subprocess.run(
        ["groff", "-man", "-Tutf8", "-ww", str(ROOT / "man" / f"{prog}.1")], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    text = re.sub(".\b", "", out.stdout)  # overstrikes (bold, underline) off
    for section in ("NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "EXIT STATUS"):
        assert re.search(rf"^{section}$", text, re.M), (section, text)
    for o in _every_option(PAGES[prog]):
        assert o.names[-1] in text, o.names


# -- completions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("prog", sorted(PAGES))
def test_bash_completion_loads(prog: str) -> None:
    out = subprocess.run(["bash", "-n", str(COMPLETION / "bash" / prog)], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stderr == "", out.stderr


_BASH = """source "$1"; shift; COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); fn=${1//-/_}; _$fn
printf '%s\\n' "${COMPREPLY[@]}" """


@pytest.mark.parametrize(
    ("words", "offered"),
    [
        (["pearing-run", "--lock"], ["--lock-dir"]),
        (["pearing-run", "--heartbeat", ""], ["auto", "manual"]),
        (["pearing-run", "--queue", "=", "l"], ["latest"]),  # --queue=l: bash splits at the =
        (["pearing-run", "--job", "--lock"], []),  # a value, not an option
        (["pearing-guard", ""], ["verify", "exec", "fence", "git-push"]),
        (["pearing-guard", "fence", "--re"], ["--resource"]),
        (["pearing-cli", "st"], ["status"]),
        (["pearing-cli", "--lock-dir", "/x", "status", "--lock-d"], ["--lock-dir"]),  # after the command too
        (["pearing-cli", "create-reply", "--li"], ["--link"]),
        (["pearing-mcp", "--ba"], ["--backend"]),
    ],
)
def test_bash_completion_offers(words: list[str], offered: list[str]) -> None:
    script = COMPLETION / "bash" / words[0]
    out = subprocess.run(["bash", "-c", _BASH, "-", str(script), *words], capture_output=True, text=True, check=True)
    assert [w for w in out.stdout.splitlines() if w] == offered, out


@pytest.mark.parametrize(
    ("shell", "check"),
    [("zsh", ["zsh", "-n"]), ("fish", ["fish", "--no-execute"])],
)
def test_zsh_and_fish_completions_parse(shell: str, check: list[str]) -> None:
    if shutil.which(check[0]) is None:
        pytest.skip(f"{shell} not installed")
    for path in sorted((COMPLETION / shell).iterdir()):
        out = subprocess.run([*check, str(path)], capture_output=True, text=True, check=False)
        assert out.returncode == 0 and out.stderr == "", (path, out.stderr)


# -- one vocabulary, one layout ------------------------------------------------------------------


@pytest.mark.parametrize("prog", sorted(PAGES))
def test_every_metavar_is_a_word_of_the_vocabulary(prog: str) -> None:
    page = PAGES[prog]
    for o in _every_option(page):
        if o.flag:
            assert o.metavar == "", o.names
        else:
            assert o.metavar in METAVARS or _CHOICE.fullmatch(o.metavar), (o.names, o.metavar)
    for sub in page.commands:
        for metavar, _, _ in sub.arguments:
            assert metavar in METAVARS, (sub.name, metavar)


def _help(*argv: str) -> str:
    out = subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, check=False, timeout=30)
    assert out.returncode == 0 and out.stderr == "", out
    return out.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["pearing-run", "--help"],
        ["pearing-guard", "--help"],
        ["pearing-guard", "exec", "-h"],
        ["pearing-cli", "-h"],
        ["pearing-cli", "create-reply", "--help"],
        ["pearing-mcp", "--help"],
    ],
)
def test_one_help_layout(argv: list[str]) -> None:
    """usage line, what it does, then lowercase sections of two-column rows; the help column at
    NAMES_WIDTH + 3, nothing past WIDTH (but the usage line, or one long word), no typer panel or
    click heading."""
    text = _help(*argv)
    page = PAGES[argv[0]]
    options = page.options if len(argv) == 2 else next(s for s in page.commands if s.name == argv[1]).options
    assert text.startswith(f"usage: {' '.join(argv[:-1])} ") and "\noptions:\n" in text, text
    assert not re.search(r"Usage:|Options:|[╭│─]", text), text
    for line in text.splitlines()[1:]:
        assert len(line) <= WIDTH or " " not in line.strip(), line
    for o in options:
        row = re.search(rf"^  {re.escape(o.label)}( +)\S", text, re.M)
        assert row and len(o.label) + len(row.group(1)) == NAMES_WIDTH + 1, (o.label, text)
