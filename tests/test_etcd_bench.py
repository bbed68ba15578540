"""The benchmark's etcd pairing keeps working: pearing-run and etcdctl lock hand over in FIFO
order on one cluster, next to the lock dir, in one run (the figures themselves belong to
``python -m bench``, not to a test)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

needs_tools = pytest.mark.skipif(
    (shutil.which("etcd") is None or shutil.which("etcdctl") is None) and os.environ.get("CI") != "true",
    reason="etcd and etcdctl are not installed (apt-get install etcd-server etcd-client)",
)

SNIPPET = """
import json, sys, tempfile
from pathlib import Path
from bench.__main__ import etcd_handover
with tempfile.TemporaryDirectory() as t:
    print(json.dumps(etcd_handover(Path(t), 3, 1)))
"""


@needs_tools
def test_the_etcd_pairing_runs_both_tools_in_fifo_order() -> None:
    r = subprocess.run(
        [sys.executable, "-c", SNIPPET], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.splitlines()[-1])
    assert result["fifo_kept"] is True
    for tool in ("pearing-run --backend etcd", "etcdctl lock", "pearing-run (lock dir)"):
        assert result[tool]["n"] == 3
        assert 0 < result[tool]["p50_ms"] <= result[tool]["max_ms"]
    assert "p50_difference_ms" in result
