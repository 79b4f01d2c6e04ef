"""A repository job's result where code and people read it (PROTOCOL §18): the HTTP API
(`GET /api/jobs/{id}/result`, `.../result/patch` to download, the job detail's `result`)
and `mam.Hub`'s `job.result()` / `job.patch()`, over a hub whose inbox assembled real
signed, sealed chunks; no broker. Bad ids, attempts and jobs without a result get a JSON
4xx with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.hubclient import RecordingClient
from harness.results import PATCH, deliver_result
from harness.workspace import TEST_SECRET
from starlette.testclient import TestClient

from mam import Hub
from mam.orchestrator.http import app as hubhttp
from mam.orchestrator.hub import open_hub
from mam.orchestrator.results import MAX_NOTES_SHOWN, Result, format_result
from mam.orchestrator.service import HubService
from mam.shared.config import write_env_file

pytestmark = pytest.mark.timeout(60)

TOKEN = "api-token-for-tests-0123456789"


@pytest.fixture
def service(tmp_path: Path) -> HubService:
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    hub_service = HubService(open_hub(tmp_path))
    hub_service.client = RecordingClient()  # type: ignore[assignment]
    return hub_service


def deliver(service: HubService, job_id: str, tmp_path: Path, *, patch: bytes | None = PATCH) -> None:
    deliver_result(service.registry, job_id, tmp_path / "runner", patch=patch)


def test_s18_http_result_patch_and_job_detail(service: HubService, tmp_path: Path) -> None:
    api = TestClient(hubhttp.create_app(service, TOKEN), raise_server_exceptions=False)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    job_id = service.registry.register(session="gpu-box")["job_id"]
    missing = api.get(f"/api/jobs/{job_id}/result", headers=auth)
    assert missing.status_code == 404 and "has no result" in missing.json()["error"]
    assert api.get(f"/api/jobs/{job_id}", headers=auth).json()["result"] is None
    deliver(service, job_id, tmp_path)
    result = api.get(f"/api/jobs/{job_id}/result", headers=auth).json()
    assert result["ready"] and result["head_sha"] == "b" * 40 and result["has_patch"] and result["attempt_id"] == 1
    assert api.get(f"/api/jobs/{job_id}", headers=auth).json()["result"]["files_total"] == 1
    patch = api.get(f"/api/jobs/{job_id}/result/patch?token={TOKEN}")  # a download link carries the token
    assert patch.status_code == 200 and patch.content == PATCH
    assert "attachment" in patch.headers["content-disposition"] and f"mam-{job_id}-1.patch" in \
        patch.headers["content-disposition"]
    assert api.get(f"/api/jobs/{job_id}/result/patch").status_code == 401
    assert api.get(f"/api/jobs/{job_id}/result?token={TOKEN}").status_code == 401  # JSON routes: header only


@pytest.mark.parametrize("path, status, words", [
    ("/api/jobs/{id}/result?attempt=2", 400, "attempt must be 1..1"),
    ("/api/jobs/{id}/result?attempt=0", 400, "attempt must be 1..1"),
    ("/api/jobs/{id}/result?attempt=-1", 400, "non-negative integer"),
    ("/api/jobs/{id}/result?attempt=" + "9" * 5000, 400, "at most 15 digits"),
    ("/api/jobs/{id}/log?offset=" + "9" * 5000, 400, "at most 15 digits"),
    ("/api/jobs/.._etc/result", 400, "invalid"),
    ("/api/jobs/0badf00d/result", 404, ""),
    ("/api/jobs/0badf00d/result/patch", 404, ""),
])
def test_s18_http_bad_result_requests_get_a_json_reason(service: HubService, tmp_path: Path, path: str,
                                                         status: int, words: str) -> None:
    api = TestClient(hubhttp.create_app(service), raise_server_exceptions=False)
    job_id = service.registry.register(session="gpu-box")["job_id"]
    deliver(service, job_id, tmp_path)
    response = api.get(path.replace("{id}", job_id))
    assert response.status_code == status and words in response.json()["error"]


def test_s18_http_a_result_without_a_change_has_no_patch_and_says_why(service: HubService, tmp_path: Path) -> None:
    api = TestClient(hubhttp.create_app(service), raise_server_exceptions=False)
    job_id = service.registry.register(session="gpu-box")["job_id"]
    deliver(service, job_id, tmp_path, patch=None)
    assert api.get(f"/api/jobs/{job_id}/result").json()["note"] == "no_changes"
    response = api.get(f"/api/jobs/{job_id}/result/patch")
    assert response.status_code == 404 and "no_changes" in response.json()["error"]


def test_s18_http_and_python_api_list_and_download_artifacts(service: HubService, tmp_path: Path) -> None:
    api = TestClient(hubhttp.create_app(service, TOKEN), raise_server_exceptions=False)
    job_id = service.registry.register(session="gpu-box")["job_id"]
    report = bytes(range(256)) * 40
    deliver_result(service.registry, job_id, tmp_path / "runner", artifacts={"report.bin": report, "a.txt": b"a\n"})
    detail = api.get(f"/api/jobs/{job_id}", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert detail["result"]["artifacts"] == ["a.txt", "report.bin"]
    got = api.get(f"/api/jobs/{job_id}/artifacts/report.bin?token={TOKEN}")
    assert got.status_code == 200 and got.content == report and "report.bin" in got.headers["content-disposition"]
    for name, status in (("nope.txt", 404), ("...", 400), (".hidden", 400), ("a%2F..%2F..%2Fx", 404)):
        bad = api.get(f"/api/jobs/{job_id}/artifacts/{name}?token={TOKEN}")
        assert bad.status_code == status, (name, bad.text)
    assert api.get(f"/api/jobs/{job_id}/artifacts/a.txt").status_code == 401
    hub = Hub(tmp_path, embedded=False)
    paths = hub.job(job_id).artifacts()
    assert sorted(paths) == ["a.txt", "report.bin"] and paths["report.bin"].read_bytes() == report
    hub.close()


def test_s18_python_api_job_result_and_patch(service: HubService, tmp_path: Path) -> None:
    job_id = service.registry.register(session="gpu-box")["job_id"]
    hub = Hub(tmp_path, embedded=False)
    job = hub.job(job_id)
    assert job.result() is None and job.patch() is None
    deliver(service, job_id, tmp_path)
    result = job.result()
    assert result is not None and result["base_sha"] == "a" * 40 and result["files"][0]["path"] == "NOTES.md"
    assert job.patch() == PATCH
    hub.close()


def test_s18_the_human_result_view_says_what_was_left_out_escaped_and_capped(tmp_path: Path) -> None:
    notes = ["artifact 'core' left out: not a regular file", "artifact '\x1b[2Jx' left out: its name is not allowed",
             *[f"artifacts_too_large: 'a{n}' left out" for n in range(12)]]
    summary = {"repo": "demo", "ref": "main", "base_sha": "a" * 40, "head_sha": "b" * 40, "files": [],
               "artifact_notes": notes}
    text = format_result(Result(job_id="918b0612", attempt_id=1, root=tmp_path, folder=tmp_path / "r",
                                summary=summary))
    shown = [line for line in text.splitlines() if line.startswith("  left out: ")]
    assert shown[0] == "  left out: artifact 'core' left out: not a regular file"
    assert "\x1b" not in text and len(shown) == MAX_NOTES_SHOWN + 1
    assert shown[-1] == f"  left out: {len(notes) - MAX_NOTES_SHOWN} more (see result.json)"


def test_s18_http_and_python_api_give_the_transcript(service: HubService, tmp_path: Path) -> None:
    api = TestClient(hubhttp.create_app(service, TOKEN), raise_server_exceptions=False)
    session, lines = "8d99b0b5-6eb4-42d6-86de-f6ab1a4fe0ee", b'{"type":"user"}\n{"type":"assistant"}\n'
    job_id = service.registry.register(session="gpu-box")["job_id"]
    deliver_result(service.registry, job_id, tmp_path / "runner", transcript=(session, lines))
    got = api.get(f"/api/jobs/{job_id}/result/transcript?token={TOKEN}")
    assert got.status_code == 200 and got.content == lines
    assert f"mam-{job_id}-1-{session}.jsonl" in got.headers["content-disposition"]
    assert api.get(f"/api/jobs/{job_id}/result/transcript").status_code == 401
    bare = service.registry.register(session="gpu-box")["job_id"]
    deliver(service, bare, tmp_path / "bare")
    missing = api.get(f"/api/jobs/{bare}/result/transcript?token={TOKEN}")
    assert missing.status_code == 404 and "has no transcript" in missing.json()["error"]
    with Hub(service.registry.root, embedded=False) as hub:
        assert hub.job(job_id).transcript() == lines and hub.job(bare).transcript() is None

