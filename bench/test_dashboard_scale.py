"""The dashboard at scale (run with `make bench`, never by CI): 1,000 jobs and 100 runners.

- `GET /api/jobs` (what the page loads first) answers in under 1 s of server time with 1,000
  hub records; `GET /api/runners` with 100 runners in under 0.2 s.

An in-process hub service (no broker: its fleet is filled directly) behind the real Starlette
app; the time is the median of 5 requests, each printed beside the load of the machine.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
from harness.hubclient import RecordingClient
from harness.workspace import TEST_SECRET
from starlette.testclient import TestClient

from mam.orchestrator.http import app as hubhttp
from mam.orchestrator.hub import open_hub
from mam.orchestrator.queue import RunnerView
from mam.orchestrator.service import HubService
from mam.shared.config import write_env_file

JOBS, RUNNERS, ROUNDS = 1000, 100, 5
JOBS_TARGET_S, RUNNERS_TARGET_S = 1.0, 0.2


def median_s(api: TestClient, path: str) -> float:
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        response = api.get(path)
        times.append(time.perf_counter() - start)
        assert response.status_code == 200, response.text
    return statistics.median(times)


@pytest.mark.timeout(600)
def test_1000_jobs_and_100_runners_listed_within_their_targets(tmp_path):
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    service = HubService(open_hub(tmp_path))
    service.client = RecordingClient()  # type: ignore[assignment]
    registry = service.registry
    for n in range(JOBS):
        record = registry.register(session=f"box-{n % RUNNERS:03d}", title=f"job {n}")
        if n % 4:
            registry.close(record["job_id"], "agent_blocked")
    for n in range(RUNNERS):
        service.fleet.update(RunnerView(session=f"box-{n:03d}", runner_id="a" * 32, status="online",
                                        labels=frozenset({"gpu"}), max_jobs=4, running=frozenset(), verified=True,
                                        seen_at=time.monotonic(), host="h", version="0.1.0"))
    api = TestClient(hubhttp.create_app(service))
    jobs_s, runners_s = median_s(api, "/api/jobs"), median_s(api, "/api/runners")
    assert len(api.get("/api/jobs").json()["jobs"]) == JOBS
    print(f"\nGET /api/jobs with {JOBS} jobs: median {jobs_s * 1000:.0f} ms (target {JOBS_TARGET_S * 1000:.0f}); "
          f"GET /api/runners with {RUNNERS} runners: median {runners_s * 1000:.0f} ms "
          f"(target {RUNNERS_TARGET_S * 1000:.0f}); load {os.getloadavg()[0]:.1f}")
    assert jobs_s < JOBS_TARGET_S and runners_s < RUNNERS_TARGET_S
