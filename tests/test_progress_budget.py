"""The per-namespace progress budget over HTTP (#59: tested on the index only).

`MEGACACHE_PROGRESS_NAMESPACE_ATTEMPTS` bounds the job attempt summaries one namespace's
index keeps. What docs/configuration.md and docs/security.md promise: past it the
namespace's longest-silent jobs go whole, nothing is refused, and other namespaces are
untouched. Here a tenant posts more attempts than its budget through the real route, with
another tenant's job the longest silent of all; on each index backend.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import _configured, backend_args
from helpers import ServerProcess, token_client

from megacache_client.wire import routes

BUDGET = 64  # the least the setting allows (a job's attempts)
JOBS, ATTEMPTS = 40, 2  # 80 attempts: past the budget by 16


@pytest.fixture(scope="module", params=["sqlite+fs", "redis+fs"])
def budget_server(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args, env = backend_args(request.param, request)
    proc = _configured(ServerProcess(
        tmp_path_factory.mktemp("budget") / "data", *args, "--auth",
        env={**env, "MEGACACHE_PROGRESS_NAMESPACE_ATTEMPTS": str(BUDGET),
             "MEGACACHE_VIEW_BURST": "1000", "MEGACACHE_TOKEN_CACHE_S": "0"}),
        request.param, args).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()


def post(c: httpx.Client, job: str, attempt: int, at: float) -> int:
    r = c.post(routes.JOB_PROGRESS.url(job=job),
               json={"attempt": attempt, "records": [{"kind": "start", "at": at}]})
    return r.status_code


def attempts_kept(c: httpx.Client, job: str) -> int:
    """How many attempts of `job` the server still shows its namespace (0: the job is gone)."""
    r = c.get(routes.JOB_ETT.url(job=job))
    if r.status_code == 404:
        return 0
    assert r.status_code == 200, r.text
    return len(r.json()["attempts"])


def test_a_namespace_past_its_progress_budget_loses_its_longest_silent_jobs_only(
        budget_server: ServerProcess) -> None:
    flood = token_client(budget_server, "read,write", "team-flood")
    calm = token_client(budget_server, "read,write", "team-calm")
    now = time.time()
    assert post(calm, "calm", 0, now - 900) == 202  # the longest silent job of all
    codes = [post(flood, f"j{i:02}", attempt, now - 800 + i)
             for i in range(JOBS) for attempt in range(ATTEMPTS)]
    assert set(codes) == {202}, codes  # nothing refused: the budget drops, never refuses
    kept = {f"j{i:02}": attempts_kept(flood, f"j{i:02}") for i in range(JOBS)}
    assert sum(kept.values()) <= BUDGET, kept
    # whole jobs go, the longest silent first, and no more than needed
    gone = [job for job, n in kept.items() if n == 0]
    assert gone == [f"j{i:02}" for i in range(len(gone))], kept
    assert all(n == ATTEMPTS for job, n in kept.items() if job not in gone), kept
    assert sum(kept.values()) > BUDGET - ATTEMPTS, kept
    # the other namespace keeps its job, and its posts are taken as before
    assert attempts_kept(calm, "calm") == 1
    assert post(calm, "calm", 1, now - 100) == 202
    assert attempts_kept(calm, "calm") == 2
    # a namespace's budget is its own: the flood's jobs are not the calm tenant's to see
    assert attempts_kept(calm, f"j{JOBS - 1:02}") == 0
