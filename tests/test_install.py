"""What ``pip install pearing-singleflight`` brings, and pearing-mcp without its extra."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# typer (rich, pydantic and theirs), psutil, platformdirs and us: 15 today (38 with the MCP SDK,
# now the ``mcp`` extra). flock(1) has none; a lock wrapper's install should stay this small.
MAX_PACKAGES = 16


@pytest.mark.slow
def test_a_plain_install_brings_at_most_16_packages_and_no_mcp_sdk(tmp_path: Path) -> None:
    """Resolved in a fresh venv (``pip install --dry-run --report``), as a new user's pip would."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    report = tmp_path / "report.json"
    pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed"]
    r = subprocess.run(
        [*pip, "--report", str(report), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    names = sorted(item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"])
    assert len(names) <= MAX_PACKAGES, names
    assert "pearing-singleflight" in names and "mcp" not in names and "uvicorn" not in names, names


def test_pearing_mcp_without_the_sdk_says_which_extra_and_exits_69(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys

        class NoSDK:
            def find_spec(self, name, path=None, target=None):
                if name == "mcp" or name.startswith("mcp."):
                    raise ModuleNotFoundError(name)
                return None

        sys.meta_path.insert(0, NoSDK())
        from singleflight.cli.mcp import main
        sys.exit(main(["--lock-dir", {str(tmp_path / "ld")!r}]))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 69, r
    assert r.stderr.splitlines() == [
        "pearing-mcp: error: the MCP SDK is not installed: pip install 'pearing-singleflight[mcp]'"
    ], r
    assert r.stdout == ""
