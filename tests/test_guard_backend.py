"""pearing-guard --backend URL, as pearing-run and pearing-cli take it (default PEARING_BACKEND)."""

from __future__ import annotations

from helpers import PEARING_GUARD, Procs, q

from singleflight.core.const import ENV_BACKEND, ENV_TOKEN_FILE, ExitCode


def _without_backend(procs: Procs) -> dict[str, str]:
    """The test's environment, but nothing names the backend: only the flag may."""
    return {k: v for k, v in procs.env.items() if k != ENV_BACKEND}


def test_fence_lands_in_the_ledger_of_the_backend_named(backend: str, procs: Procs) -> None:
    args = [PEARING_GUARD, "fence", "--backend", backend, "--resource", "r", "--fence", "2"]
    r = procs.run_text(args, env=_without_backend(procs))
    assert r.returncode == 0, r
    # The backend's own ledger (reached through PEARING_BACKEND this time) has it.
    r = procs.run_text([PEARING_GUARD, "fence", "--resource", "r", "--fence", "1"])
    assert r.returncode == ExitCode.REFUSED, r
    assert "stale fence 1 < 2" in r.one_line()


def test_verify_and_exec_read_a_token_from_the_environment_on_the_backend_named(backend: str, procs: Procs) -> None:
    # Inside the run only PEARING_TOKEN, PEARING_LOCK and PEARING_REPO are left to name the token.
    guard = f"env -u {ENV_BACKEND} -u {ENV_TOKEN_FILE} {q(PEARING_GUARD)}"
    script = f"{guard} verify --backend {q(backend)} && {guard} exec --backend {q(backend)} -- true"
    r = procs.pr_run("--job", "J", "--", "sh", "-c", script)
    assert r.returncode == 0, r


def test_a_bad_backend_is_a_usage_error_and_nothing_is_created(procs: Procs) -> None:
    for sub in (["verify"], ["exec", "--", "true"], ["fence", "--resource", "r", "--fence", "1"]):
        args = [PEARING_GUARD, sub[0], "--backend", "gopher://x", *sub[1:]]
        r = procs.run_text(args, env=_without_backend(procs))
        assert r.returncode == ExitCode.USAGE, r
        assert "backend" in r.one_line()
    assert not procs.lock_dir.exists()
