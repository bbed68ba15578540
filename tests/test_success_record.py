"""A success record (--min-interval's last successful start) holding a time no clock can hold is
a corrupt record: exit 74 naming where it is, never a crash (70) and never a skip forever."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from caps import Caps
from helpers import Procs, backend_url, pg_query, store_dir

from singleflight.core.const import ExitCode


def _plant(caps: Caps, procs: Procs, lock_dir: Path, job: str, body: bytes) -> str:
    """Write ``body`` as the lock's success record; where it is, as the error names it."""
    if caps.records_in_lock_dir:
        path = store_dir(lock_dir, job) / "success"
        path.write_bytes(body)
        return str(path)
    if caps.records_in_tables:
        url = backend_url(procs.env)
        assert url is not None
        pg_query(url, "UPDATE {s}.records SET body = %s WHERE name = %s AND key = 'success'", (body, job))
        return f"table records key default/{job}/success"
    from singleflight.etcd.client import Cluster

    url = backend_url(procs.env)
    assert url is not None
    cluster = Cluster(url)
    try:
        key = f"{cluster.root}default/@{job}/s"
        cluster.put(key, body)
    finally:
        cluster.close()
    return key


@pytest.mark.parametrize("started", ["1e300", "NaN", "-1e300", "true", '"soon"'])
def test_a_success_record_out_of_any_clocks_range_is_corrupt(
    backend: str, caps: Caps, work_procs: Procs, lock_dir: Path, work: Path, started: str
) -> None:
    job = f"succ-{uuid.uuid4().hex[:8]}"
    first = work_procs.pr_run("--job", job, "--min-interval", "1h", "--", "true")
    assert first.returncode == 0, first
    work_procs.wait_idle()
    where = _plant(caps, work_procs, lock_dir, job, b'{"started_at": ' + started.encode() + b', "ticket_id": null}')
    r = work_procs.pr_run("--job", job, "--min-interval", "1h", "--", "sh", "-c", "echo ran > ran")
    assert r.returncode == ExitCode.IOERR, r
    assert len(r.err_lines) == 1 and where in r.err_lines[0] and "started_at" in r.err_lines[0], r
    assert not (work / "ran").exists(), "COMMAND ran beside a corrupt success record"
