"""The HTTP API of `mam-orch serve --http` without a broker or a server
(PROTOCOL §14): every endpoint through Starlette's TestClient over a `HubService` with a
recording client; bad input gets a JSON 4xx with a reason, never a traceback; the
bearer token; `/metrics` parses as Prometheus text; the live feed's messages."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime

import pytest
from harness.hubclient import RecordingClient, started
from harness.workspace import TEST_SECRET
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from mam.orchestrator.dispatch import DEFAULT_TITLE_CHARS, MAX_TITLE_CHARS, job_title
from mam.orchestrator.http import app as hubhttp
from mam.orchestrator.http.views import LiveFeed
from mam.orchestrator.hub import open_hub
from mam.orchestrator.identity import roster
from mam.orchestrator.queue import RunnerView
from mam.orchestrator.service import HubService
from mam.shared.config import write_env_file
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.crypto import MAX_BRIEF_BYTES
from mam.shared.protocol.crypto.keys import EnrolRequest
from mam.shared.protocol.errors import ConfigError, UsageError
from mam.shared.store import keyfiles
from mam.shared.store.records import QueueTerms
from mam.shared.store.registry import Contract, Registry

pytestmark = pytest.mark.timeout(60)

KEYS = crypto.derive_keys(TEST_SECRET)
TOKEN = "api-token-for-tests-0123456789"


@pytest.fixture
def service(tmp_path):
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    hub_service = HubService(open_hub(tmp_path))
    hub_service.client = RecordingClient()  # type: ignore[assignment]
    return hub_service


@pytest.fixture
def api(service):
    return TestClient(hubhttp.create_app(service), raise_server_exceptions=False)


def runner(session: str, *, status: str = "online", labels=("gpu",), max_jobs: int = 2, running=(),
           verified: bool = True) -> RunnerView:
    return RunnerView(session=session, runner_id="a" * 32, status=status, labels=frozenset(labels),
                      max_jobs=max_jobs, running=frozenset(running), verified=verified, seen_at=time.monotonic(),
                      host=f"{session}.example", version="0.1.0")


def dispatch(api, **body):
    return api.post("/api/jobs", json={"brief": "echo hi", "labels": ["gpu"], **body})


def test_s14_http_runners_show_status_labels_slots_version(service, api):
    service.fleet.update(runner("gpu-box", running=("0badf00d",)))
    service.fleet.update(runner("cpu-box", status="draining", labels=()))
    service.fleet.update(runner("old-box", status="offline"))
    rows = {row["session"]: row for row in api.get("/api/runners").json()["runners"]}
    assert rows["gpu-box"]["status"] == "online" and rows["gpu-box"]["labels"] == ["gpu"]
    assert (rows["gpu-box"]["slots_used"], rows["gpu-box"]["slots_free"]) == (1, 1)
    assert rows["gpu-box"]["version"] == "0.1.0" and rows["gpu-box"]["host"] == "gpu-box.example"
    assert rows["cpu-box"]["status"] == "draining" and rows["cpu-box"]["slots_free"] == 0
    assert rows["old-box"]["status"] == "offline"
    assert abs(rows["gpu-box"]["last_seen"] - time.time()) < 60


def test_s16_7_http_runners_show_a_revoked_runner_as_revoked_with_when(service, api, tmp_path):
    made = keyfiles.create_runner_keys(tmp_path / "runner")
    roster.add(service.registry.root, EnrolRequest.build("old-box", "gpu", made.ed25519_public, made.x25519_public))
    entry = roster.revoke(service.registry.root, "old-box")
    service.fleet.update(runner("old-box"))  # a presence the feed had before the revocation
    service.fleet.update(runner("gpu-box"))
    rows = api.get("/api/runners").json()["runners"]
    assert [(row["session"], row["status"], row["revoked_at"]) for row in rows] == [
        ("gpu-box", "online", None), ("old-box", "revoked", entry.revoked_at)]
    assert rows[1]["slots_free"] == 0 and rows[1]["running"] == []


def test_s14_http_dispatch_queues_through_the_dispatch_path_and_the_queue_says_why(service, api):
    response = dispatch(api, priority=3, retries=1, retry_on=["error"], heartbeat_sec=2, timeout_sec=600,
                        max_turns=4, max_cost_usd=1.5, allow_tools=["Bash(git *)", "Edit"], ask_timeout_s=300,
                        on_ask_timeout="cancel", fresh=True, on_limit="fail", memory="512M", cpus=1.5, pids=256)
    assert response.status_code == 201, response.text
    job_id = response.json()["job_id"]
    assert service.registry.get(job_id)["work"] == {"max_turns": 4, "max_cost_usd": 1.5,
                                                    "allow_tools": ["Bash(git *)", "Edit"], "ask_timeout_s": 300,
                                                    "on_ask_timeout": "cancel", "memory_bytes": 512 << 20,
                                                    "cpus": 1.5, "pids": 256}
    record = service.registry.get(job_id)
    assert record["status"] == "queued" and record["target"] == {"labels": ["gpu"]}
    assert (record["priority"], record["retries"], record["retry_on"]) == (3, 1, ["error"])
    assert (record["fresh"], record["on_limit"]) == (True, "fail")
    assert (record["heartbeat_sec"], record["timeout_sec"]) == (2, 600)
    assert "queue_owner_pid" not in record  # the service publishes it
    assert (names.job_logs_dir(service.registry.root, job_id) / "brief.txt").read_text() == "echo hi"
    service.scan(time.monotonic())
    queue = api.get("/api/queue").json()["queue"]
    assert [row["job_id"] for row in queue] == [job_id]
    assert "no runner has ever announced labels=gpu" in queue[0]["why_waiting"]
    jobs = api.get("/api/jobs", params={"status": "queued"}).json()["jobs"]
    assert [row["job_id"] for row in jobs] == [job_id]
    assert api.get("/api/jobs", params={"status": "completed"}).json()["jobs"] == []


@pytest.mark.parametrize(("body", "why"), [
    (b"{", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "colour": 1}).encode(), "unknown field 'colour'"),
    (json.dumps({"labels": ["gpu"]}).encode(), "'brief' is required"),
    (json.dumps({"brief": "x"}).encode(), "either 'session'"),
    (json.dumps({"brief": "x", "session": "a", "labels": ["b"]}).encode(), "either 'session'"),
    (json.dumps({"brief": "x", "session": "gpu.box"}).encode(), "is invalid"),
    (json.dumps({"brief": "x", "session": ""}).encode(), "is invalid"),
    (json.dumps({"brief": "x", "labels": ["GPU!"]}).encode(), "is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "retries": "3"}).encode(), "expected an integer"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "retries": 11}).encode(), "retries"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "retry_on": ["bored"]}).encode(), "--retry-on"),
    (json.dumps({"brief": "", "labels": ["gpu"]}).encode(), "the brief is empty"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "allow_tools": "Edit"}).encode(), "'allow_tools' is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "allow_tools": ["Bash(x"]}).encode(), "not a tool rule"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "max_turns": 0}).encode(), "max_turns 0 is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "max_cost_usd": "9"}).encode(), "max_cost_usd '9' is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "permission_mode": 3}).encode(), "expected a string"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "ask_timeout_s": "60"}).encode(), "expected whole seconds"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "deny_tools": "Edit"}).encode(), "'deny_tools' is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "ask_timeout_s": 0}).encode(), "ask_timeout_s 0 is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "on_ask_timeout": "later"}).encode(), "on_ask_timeout"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "fresh": "yes"}).encode(), "'fresh' is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "on_limit": 1}).encode(), "'on_limit' is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "on_limit": "later"}).encode(), "--on-limit 'later' is invalid"),
    (json.dumps({"brief": "x", "session": "gpu-box", "on_limit": "move"}).encode(), "--on-limit move needs a label"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "group": ["rel"]}).encode(), "'group' is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "memory": "lots"}).encode(), "memory 'lots' is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "memory": [1]}).encode(), "'memory' is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "memory": 10 ** 30}).encode(), "expected bytes, 4M..16T"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "cpus": "2"}).encode(), "cpus '2' is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "pids": 1}).encode(), "pids 1 is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "group": "a/b"}).encode(), "--group 'a/b' is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "group_limit": 2}).encode(), "--group-limit goes with --group"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "group": "r", "group_limit": "2"}).encode(), "'group_limit' is"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "after": "0badf00d"}).encode(), "'after' is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "after": ["0badf00d"]}).encode(), "no job 0badf00d"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "after": ["../etc"]}).encode(), "--after '../etc' is invalid"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "if": "ended"}).encode(), "--if goes with --after"),
    (json.dumps({"brief": "x", "labels": ["gpu"], "after": ["0badf00d"], "if": 1}).encode(), "'if' is invalid"),
])
def test_s14_http_bad_dispatch_bodies_get_400_with_a_reason(service, api, body, why):
    response = api.post("/api/jobs", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert why in response.json()["error"]
    assert "Traceback" not in response.text
    assert not list(names.jobs_dir(service.registry.root).glob("*.json")) if names.jobs_dir(
        service.registry.root).exists() else True


def test_s14_http_an_oversized_brief_is_400_and_an_oversized_body_413(service, api):
    response = dispatch(api, brief="x" * (MAX_BRIEF_BYTES + 1))
    assert response.status_code == 400 and "larger than" in response.json()["error"]
    response = api.post("/api/jobs", content=b" " * (hubhttp.MAX_BODY_BYTES + 1))
    assert response.status_code == 413 and "larger than" in response.json()["error"]


def test_s14_http_unknown_job_404_bad_id_400_unknown_path_404_wrong_method_405(api):
    for path in ("/api/jobs/0badf00d", "/api/jobs/0badf00d/log"):
        response = api.get(path)
        assert response.status_code == 404 and "0badf00d" in response.json()["error"]
    assert api.post("/api/jobs/0badf00d/cancel").status_code == 404
    response = api.get("/api/jobs/NOT-AN-ID")
    assert response.status_code == 400 and "is invalid" in response.json()["error"]
    assert api.get("/api/jobs", params={"status": "bogus"}).status_code == 400
    assert api.get("/api/nothing").json()["error"].startswith("no such path")
    assert api.delete("/api/jobs").status_code == 405


def test_s14_http_job_detail_has_record_attempts_audit_and_no_token(service, api):
    record = service.registry.register(session="gpu-box", contract=Contract(heartbeat_sec=1, heartbeat_misses=2))
    service.scan(time.monotonic())
    service.on_message(names.events_topic(record["job_id"], service.config.topic_root), started(record),
                       time.monotonic())
    detail = api.get(f"/api/jobs/{record['job_id']}").json()
    assert detail["record"]["status"] == "running"
    assert detail["record"]["auth_token"] == "<set>" and record["auth_token"] not in json.dumps(detail)
    assert [a["attempt_id"] for a in detail["attempts"]] == [1]
    assert detail["attempts"][0]["log"].endswith(f"{record['job_id']}/agent.1.log")
    assert any(line.get("event") == "started" for line in detail["audit"])
    assert detail["job"]["last_event"] == "started"


def test_s14_http_each_attempt_has_its_reason_and_a_job_row_its_labels_and_repo(service, api):
    record = service.registry.register(session="gpu-box")
    service.registry.close(record["job_id"], "agent_blocked")
    service.registry.redispatch(record["job_id"], session="gpu-box")
    detail = api.get(f"/api/jobs/{record['job_id']}").json()
    assert [(a["attempt_id"], a["reason"]) for a in detail["attempts"]] == [(1, "agent_blocked"), (2, None)]
    labelled = service.registry.register(session=None, queue=QueueTerms(target_labels=["gpu", "x"]))
    row = api.get(f"/api/jobs/{labelled['job_id']}").json()["job"]
    assert (row["labels"], row["repo"], detail["job"]["labels"]) == (["gpu", "x"], None, [])


def test_s15_http_job_log_reads_the_hubs_copy_whole_tail_or_from_an_offset(service, api):
    record = service.registry.register(session="gpu-box")
    job_id = record["job_id"]
    empty = api.get(f"/api/jobs/{job_id}/log").json()
    assert (empty["exists"], empty["text"]) == (False, "")
    path = names.hub_log_path(service.registry.root, job_id, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"line one\nline two\n\xff\n")
    whole = api.get(f"/api/jobs/{job_id}/log").json()
    assert whole["text"] == "line one\nline two\n\ufffd\n" and whole["size"] == 20
    assert api.get(f"/api/jobs/{job_id}/log", params={"offset": 9}).json()["text"].startswith("line two")
    assert api.get(f"/api/jobs/{job_id}/log", params={"attempt": 2}).status_code == 400
    assert api.get(f"/api/jobs/{job_id}/log", params={"offset": "-1"}).status_code == 400


def test_s14_http_cancel_a_queued_job_on_the_hub_and_a_published_one_tells_the_runner(service, api):
    queued = dispatch(api).json()["job_id"]
    response = api.post(f"/api/jobs/{queued}/cancel")
    assert response.status_code == 200 and response.json()["changed"] is True
    assert service.registry.get(queued)["status"] == "cancelled"
    assert service.client.published == []  # nothing was published for it (§14)
    assert api.post(f"/api/jobs/{queued}/cancel").json() == {"job_id": queued, "status": "cancelled",
                                                             "attempt_id": 1, "changed": False}
    pending = service.registry.register(session="gpu-box")["job_id"]
    assert api.post(f"/api/jobs/{pending}/cancel").json()["status"] == "cancelled"
    topics = [(topic, retain) for topic, _, retain in service.client.published]
    root = service.config.topic_root
    assert (names.dispatch_topic(pending, root), True) in topics
    assert (names.control_topic(pending, root), True) in topics


def test_s8_http_retry_queues_the_next_attempt_after_cancelling_the_old_one_and_refuses_the_rest(service, api):
    pending = service.registry.register(session="gpu-box")["job_id"]
    refused = api.post(f"/api/jobs/{pending}/retry")  # open, not cancelled: nothing changes
    assert refused.status_code == 409 and f"cancel it first (mam-orch cancel {pending})" in refused.json()["error"]
    assert service.registry.get(pending)["attempt_id"] == 1 and service.client.published == []
    for body, why in (({"fresh": "yes"}, "'fresh' is invalid"), ({"session": "x"}, "'fresh'"), ([1], "'fresh'")):
        bad = api.post(f"/api/jobs/{pending}/retry", json=body)
        assert bad.status_code == 400 and why in bad.json()["error"], bad.text
    assert api.post("/api/jobs/0badf00d/retry").status_code == 404
    assert api.post("/api/jobs/not-hex/retry").status_code == 400
    api.post(f"/api/jobs/{pending}/cancel")
    service.client.published.clear()
    retried = api.post(f"/api/jobs/{pending}/retry", json={"fresh": True})
    assert retried.status_code == 201, retried.text
    assert retried.json() == {"job_id": pending, "status": "queued", "attempt_id": 2, "target": "session=gpu-box"}
    ((topic, payload, retain),) = service.client.published  # attempt 1 is cancelled again, first
    assert topic == names.control_topic(pending, service.config.topic_root) and retain
    assert (wire.decode(payload, "control").attempt_id, wire.decode(payload, "control").reason) == (1, "redispatch")
    done = service.registry.register(session="gpu-box")
    with service.registry.transaction(done["job_id"]) as txn:
        txn.update({**txn.record, "status": "completed", "exit_code": 0}, source="remote_mirror", reason=None)
    again = api.post(f"/api/jobs/{done['job_id']}/retry")
    assert again.status_code == 409 and "the job completed" in again.json()["error"]


def test_s14_http_a_token_is_required_when_set_never_echoed(service):
    api = TestClient(hubhttp.create_app(service, TOKEN), raise_server_exceptions=False)
    for path in ("/api/runners", "/api/jobs", "/metrics", "/api/events"):
        response = api.get(path)
        assert response.status_code == 401, path
        assert TOKEN not in response.text
    assert api.get("/api/runners", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert api.get("/api/runners", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert api.get("/api/runners", params={"token": TOKEN}).status_code == 401  # query only for the stream
    assert api.get("/").status_code == 200  # the page holds no data


def test_s14_http_a_non_loopback_bind_needs_a_token_and_binds_are_checked():
    assert hubhttp.api_token("127.0.0.1", {}) is None and hubhttp.api_token("::1", {}) is None
    with pytest.raises(ConfigError, match="MAM_API_TOKEN"):
        hubhttp.api_token("0.0.0.0", {})
    assert hubhttp.api_token("100.64.0.1", {"MAM_API_TOKEN": TOKEN}) == TOKEN
    assert hubhttp.parse_bind("[::1]:8765") == ("::1", 8765)
    for bad in ("8765", "host:", "host:0", "host:70000", ":80", "host:http"):
        with pytest.raises(UsageError, match="HOST:PORT"):
            hubhttp.parse_bind(bad)


def test_s14_http_an_internal_failure_is_a_json_500_without_traceback(service, api, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire /secret/path")

    monkeypatch.setattr(service.registry, "list", broken)
    response = api.get("/api/jobs")
    assert response.status_code == 500
    assert response.json() == {"error": "internal error: RuntimeError"}


def test_s14_http_metrics_parse_and_count_jobs_runners_and_refusals(service, api):
    service.fleet.update(runner("gpu-box"))
    service.fleet.update(runner("evil-box", verified=False))
    done = service.registry.register(session="gpu-box")
    with service.registry.transaction(done["job_id"]) as txn:
        txn.update({**txn.record, "status": "completed", "exit_code": 0}, source="remote_mirror", reason=None)
    dispatch(api)
    service.scan(time.monotonic())
    pending = service.registry.register(session="gpu-box")
    service.scan(time.monotonic())
    forged = started({**pending, "auth_token": "f" * len(pending["auth_token"])})
    service.on_message(names.events_topic(pending["job_id"], service.config.topic_root), forged, time.monotonic())
    copy = names.hub_log_path(service.registry.root, done["job_id"], 1)
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_bytes(b"x" * 20)
    copy.with_name(copy.name + ".json").write_text(json.dumps({"next": 3, "dropped": 500}))  # the §15 writer's state
    text = api.get("/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("mam_jobs", (("status", "queued"),))] == 1
    assert samples[("mam_jobs", (("status", "completed"),))] == 1
    assert samples[("mam_jobs_finished_total", (("close_reason", "none"), ("outcome", "completed")))] == 1
    assert samples[("mam_queue_depth", ())] == 1
    assert samples[("mam_runners", (("status", "online"),))] == 1
    assert samples[("mam_runners", (("status", "unverified"),))] == 1
    assert samples[("mam_runner_slots", (("session", "gpu-box"), ("state", "free")))] == 2
    assert samples[("mam_retries_total", ())] == 0
    assert samples[("mam_log_received_bytes_total", ())] == 20
    assert samples[("mam_log_dropped_bytes_total", ())] == 500
    assert samples[("mam_messages_refused_total", (("reason", "HMAC verify failed"),))] == 1
    assert samples[("mam_jobs", (("status", "pending"),))] == 1
    assert samples[("mam_runner_status", (("session", "gpu-box"), ("status", "online")))] == 1
    assert samples[("mam_runner_status", (("session", "evil-box"), ("status", "unverified")))] == 1
    assert samples[("mam_runner_jobs", (("session", "gpu-box"),))] == 1  # the pending one; completed ones are not held
    assert samples[("mam_queue_unserved", ())] == 0  # its labels (gpu) are announced
    assert samples[("mam_permission_oldest_age_seconds", ())] == 0
    dispatch(api, labels=["arm"])  # a label no runner has announced
    service.scan(time.monotonic())
    text = api.get("/metrics").text
    unserved = [s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "mam_queue_unserved"]
    assert unserved == [1]


def test_s15_live_feed_sends_runner_queue_job_event_and_log_changes(service):
    feed = LiveFeed(service)
    assert {item["type"] for item in feed.poll()} == {"runners", "queue", "schedules"}
    assert feed.poll() == []  # nothing changed
    service.fleet.update(runner("gpu-box"))
    record = service.registry.register(session="gpu-box", contract=Contract(heartbeat_sec=1, heartbeat_misses=2))
    service.scan(time.monotonic())
    items = feed.poll()
    assert {"runners", "job"} <= {item["type"] for item in items}
    service.on_message(names.events_topic(record["job_id"], service.config.topic_root), started(record),
                       time.monotonic())
    log_path = names.hub_log_path(service.registry.root, record["job_id"], 1)
    log_path.write_bytes(b"hello from the agent\npartial")
    items = feed.poll()
    kinds = [item["type"] for item in items]
    assert "event" in kinds and "log" in kinds
    assert next(item for item in items if item["type"] == "job")["job"]["status"] == "running"
    first = next(item for item in items if item["type"] == "log")
    assert (first["text"], first["offset"], first["size"]) == ("hello from the agent\n", 0, 21)
    with open(log_path, "ab") as log:
        log.write(b" line\n")
    (second,) = [item for item in feed.poll() if item["type"] == "log"]  # where it starts in the hub's copy
    assert (second["text"], second["offset"], second["size"]) == ("partial line\n", 21, 13)
    assert record["auth_token"] not in json.dumps(items)


def test_s14_registry_helpers_stay_in_names():
    assert names.hub_log_path(Registry("/x").root, "0badf00d", 2).name == "agent.2.log"


def test_s14_live_feed_counts_a_retry_that_ends_between_two_polls_as_a_new_finish(service):
    """A retried job whose attempt 2 ends before the feed polls again (the feed saw attempt 1
    `error`, now sees `completed`) finishes twice: the metrics count both outcomes (§14 Retries)."""
    finished: list[str] = []
    feed = LiveFeed(service, on_finish=lambda row: finished.append(row["status"]))
    feed.poll()
    record = service.registry.register(session="gpu-box", contract=Contract(heartbeat_sec=1, heartbeat_misses=2))
    feed.poll()
    service.registry.close(record["job_id"], "agent_blocked")
    feed.poll()
    again = service.registry.redispatch(record["job_id"], session="gpu-box")
    identity = {"attempt_id": again["attempt_id"], "dispatch_token": again["dispatch_token"]}
    service.registry.transition(record["job_id"], "running", source="runner", **identity)
    service.registry.transition(record["job_id"], "completed", source="runner", exit_code=0, **identity)
    feed.poll()
    assert finished == ["error", "completed"]


def test_s15_live_feed_sees_an_ended_job_redispatched_within_one_timestamp_tick(service):
    """A file system stamps with a coarse clock: a redispatch written within the same tick
    as the close keeps the record's mtime; the feed must still send the job again."""
    feed = LiveFeed(service)
    record = service.registry.register(session="gpu-box", contract=Contract(heartbeat_sec=1, heartbeat_misses=2))
    path = names.jobs_dir(service.registry.root) / f"{record['job_id']}.json"
    service.registry.close(record["job_id"], "agent_blocked")
    closed = path.stat()
    assert [item["job"]["status"] for item in feed.poll() if item["type"] == "job"] == ["error"]
    service.registry.redispatch(record["job_id"], session="gpu-box")
    os.utime(path, ns=(closed.st_atime_ns, closed.st_mtime_ns))  # the same tick as the close
    assert [item["job"]["status"] for item in feed.poll() if item["type"] == "job"] == ["pending"]


def test_s19_http_lists_waiting_requests_answers_them_signed_and_refuses_twice(service, api):
    from mam.orchestrator.asks import ANSWERED

    registry = service.registry
    record = registry.register(session="gpu-box", job_id="918b0612")
    rid = "0123456789abcdef"
    registry.append_audit(record["job_id"], {
        "event": "permission_required", "job_id": record["job_id"], "timestamp": "2026-12-04T10:00:00Z",
        "data": {"request_id": rid, "attempt_id": 1, "tool": "Bash", "input": "git push"}})
    waiting = api.get("/api/asks").json()["asks"]
    assert [(a["job_id"], a["request_id"], a["tool"], a["behavior"]) for a in waiting] == [
        ("918b0612", rid, "Bash", None)]
    metrics = api.get("/metrics").text
    assert 'mam_permission_pending{session="gpu-box"} 1.0' in metrics
    oldest = next(s.value for family in text_string_to_metric_families(metrics) for s in family.samples
                  if s.name == "mam_permission_oldest_age_seconds")
    assert oldest >= time.time() - datetime.fromisoformat("2026-12-04T10:00:00+00:00").timestamp() - 1
    bad = api.post(f"/api/jobs/918b0612/asks/{rid}/deny", json={"reason": 5})
    assert bad.status_code == 400 and "'reason'" in bad.json()["error"]
    for body in ({"always": "yes"}, {"why": 1}, [1]):
        assert api.post(f"/api/jobs/918b0612/asks/{rid}/approve", json=body).status_code == 400
    bad = api.post(f"/api/jobs/918b0612/asks/{rid}/deny", json={"always": True})
    assert bad.status_code == 400 and "approve only" in bad.json()["error"]
    assert api.post(f"/api/jobs/918b0612/asks/{rid}/maybe").status_code == 404
    assert api.post("/api/jobs/918b0612/asks/nothex/approve").status_code == 400
    denied = api.post(f"/api/jobs/918b0612/asks/{rid}/deny", json={"reason": "not on main"})
    assert denied.status_code == 200, denied.text
    assert (denied.json()["behavior"], denied.json()["message"]) == ("deny", "not on main")
    topic, payload, retain = service.client.published[-1]
    assert topic.endswith(f"/jobs/918b0612/answers/{rid}") and retain
    control = wire.decode(payload, "control")
    assert (control.action, control.request_id, control.reason) == ("deny", rid, "sealed")
    token = service.registry.get("918b0612")["auth_token"]
    assert crypto.open_answer(token, control) == "not on main" and b"not on main" not in payload
    assert [line["event"] for line in registry.audit("918b0612")][-1] == ANSWERED
    again = api.post(f"/api/jobs/918b0612/asks/{rid}/approve")
    assert again.status_code == 409 and "answered already" in again.json()["error"]
    assert api.get("/api/asks").json()["asks"] == []
    assert api.get("/api/jobs/918b0612/asks").json()["asks"][0]["behavior"] == "deny"
    assert "mam_permission_pending{" not in api.get("/metrics").text
    assert "mam_permission_oldest_age_seconds 0.0" in api.get("/metrics").text


def test_s14_http_a_name_is_loopback_only_if_every_address_it_resolves_to_is(monkeypatch):
    """`localhost` is trusted as loopback only as it resolves here: a hosts file mapping it to a
    tailnet address must not serve the API there without a token."""
    import socket

    assert hubhttp.is_loopback("localhost")  # this host's hosts file: 127.0.0.1 / ::1
    mapped = {"localhost": ["127.0.0.1", "100.64.0.7"], "hub.internal": ["::1"]}

    def fake(host, *args, **kwargs):  # no lookup leaves this host
        if host in mapped:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (addr, 0)) for addr in mapped[host]]
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    assert not hubhttp.is_loopback("localhost")
    with pytest.raises(ConfigError, match="MAM_API_TOKEN"):
        hubhttp.api_token("localhost", {})
    assert hubhttp.is_loopback("hub.internal")
    assert not hubhttp.is_loopback("no-such-host.invalid")


def test_job_title_from_the_option_or_the_brief_capped_and_masked():
    assert job_title("echo hi\n", "  nightly   build ") == "nightly build"
    assert job_title("\n\n   Fix\tthe  flaky test\nthen more\n") == "Fix the flaky test"
    long = job_title("x" * 300)
    assert len(long) == DEFAULT_TITLE_CHARS and long.endswith("…")
    masked = job_title("deploy with API_TOKEN=abc123 and password: hunter2 from https://me:pw@git.example/r")
    assert masked == "deploy with API_TOKEN=*** and password: *** from https://me:***@git.example/r"
    cut = job_title("x" * 70 + " https://me:supersecretpassword@git.example/r")  # masked before it is cut
    assert "supersec" not in cut and cut.endswith("…"), cut
    for hostile in ("", "   ", "two\nlines", "bell\a", "x" * (MAX_TITLE_CHARS + 1)):
        with pytest.raises(UsageError, match="the title is invalid: expected one printable line of 1..120"):
            job_title("echo hi\n", hostile)


def test_http_dispatch_keeps_a_title_and_lists_it(service, api):
    titled = dispatch(api, title="nightly build").json()["job_id"]
    untitled = dispatch(api, brief="\n  run the tests  \nand more").json()["job_id"]
    rows = {row["job_id"]: row["title"] for row in api.get("/api/jobs").json()["jobs"]}
    assert (rows[titled], rows[untitled]) == ("nightly build", "run the tests")
    assert service.registry.get(titled)["title"] == "nightly build"
    for title, why in ((7, "field 'title' is invalid: expected a string"), ("a\nb", "the title is invalid")):
        bad = dispatch(api, title=title)
        assert bad.status_code == 400 and why in bad.json()["error"], bad.text


def test_s14_http_and_python_dispatch_take_a_concurrency_group(service, api):
    grouped = dispatch(api, group="release-1.2", group_limit=2)
    assert grouped.status_code == 201, grouped.text
    record = service.registry.get(grouped.json()["job_id"])
    assert (record["group"], record["group_limit"]) == ("release-1.2", 2)
    from mam.orchestrator.api import Hub

    with Hub(service.registry.root, embedded=False) as hub:  # the terms are checked before anything else
        with pytest.raises(UsageError, match="--group-limit goes with --group"):
            hub.dispatch("echo hi", labels=["gpu"], group_limit=3)
        with pytest.raises(UsageError, match="--group 'a b' is invalid"):
            hub.dispatch("echo hi", labels=["gpu"], group="a b")


def test_s14_a_cancel_in_progress_job_cancels_its_groups_earlier_jobs_and_each_says_why(service, api):
    from mam.orchestrator.queuewait import mark_published

    earlier = dispatch(api, group="rel").json()["job_id"]
    other = dispatch(api, group="other").json()["job_id"]
    out = service.registry.register(session=None, queue=QueueTerms(target_labels=("gpu",), group="rel"))["job_id"]
    mark_published(service.registry, out, "gpu-box")  # published to a runner: out, tracked by the engine
    newest = dispatch(api, group="rel", cancel_in_progress=True).json()["job_id"]
    assert service.registry.get(newest)["cancel_in_progress"] is True
    service.scan(time.monotonic())
    assert service.groups_out() == {"rel": [out]}
    service.plan(time.monotonic())
    status = {job: service.registry.get(job)["status"] for job in (earlier, other, out, newest)}
    assert status == {earlier: "cancelled", other: "queued", out: "cancelled", newest: "queued"}
    topics = [topic for topic, _, _ in service.client.published]
    assert names.control_topic(out, service.config.topic_root) in topics  # its runner is told
    assert names.control_topic(earlier, service.config.topic_root) not in topics  # never published: nothing to tell
    for job in (earlier, out):
        notes = [line["line"] for line in service.registry.audit(job) if line.get("event") == "hub_note"]
        assert notes == [f"job {job}: cancelled: job {newest} of group rel came with --cancel-in-progress"], notes
    service.plan(time.monotonic())  # again: nothing more to cancel, nothing said twice
    assert len([line for line in service.registry.audit(out) if line.get("event") == "hub_note"]) == 1
    bad = dispatch(api, cancel_in_progress=True)
    assert bad.status_code == 400 and "--cancel-in-progress goes with --group" in bad.json()["error"]
    assert dispatch(api, group="rel", cancel_in_progress="yes").status_code == 400


def test_s14_groups_show_in_metrics_the_queue_the_job_rows_and_show(service, api):
    from mam.orchestrator.queuewait import mark_published
    from mam.shared.cli import render

    out = service.registry.register(session=None, queue=QueueTerms(target_labels=("gpu",), group="rel"))["job_id"]
    mark_published(service.registry, out, "gpu-box")
    waiting = dispatch(api, group="rel").json()["job_id"]
    dispatch(api, group="nightly", group_limit=3)
    service.scan(time.monotonic())
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(api.get("/metrics").text) for s in family.samples}
    assert samples[("mam_group_jobs", (("group", "rel"), ("state", "out")))] == 1
    assert samples[("mam_group_jobs", (("group", "rel"), ("state", "queued")))] == 1
    assert samples[("mam_group_jobs", (("group", "nightly"), ("state", "out")))] == 0
    queue = {row["job_id"]: row for row in api.get("/api/queue").json()["queue"]}
    assert queue[waiting]["group"] == "rel"
    jobs = {row["job_id"]: row for row in api.get("/api/jobs").json()["jobs"]}
    assert jobs[out]["group"] == "rel"
    shown = render.show_text(service.registry.get(waiting), [])
    assert "group:      rel (at most 1 at once)" in shown, shown


def test_s15_the_live_feed_reads_only_the_jobs_it_is_told_of(service):
    feed = LiveFeed(service)
    feed.poll()
    told, untold = (service.registry.register(session=None, queue=QueueTerms(target_labels=("x",)))["job_id"]
                    for _ in range(2))
    assert [m["job"]["job_id"] for m in feed.poll({told}) if m["type"] == "job"] == [told]
    assert [m["job"]["job_id"] for m in feed.poll() if m["type"] == "job"] == [untold]  # the full look



def test_s14_http_and_python_dispatch_take_after_and_the_queue_shows_blocked_jobs(service, api):
    first = dispatch(api).json()["job_id"]
    blocked = dispatch(api, after=[first], **{"if": "ended"})
    assert blocked.status_code == 201 and blocked.json()["status"] == "blocked", blocked.text
    job_id = blocked.json()["job_id"]
    service.scan(time.monotonic())
    service.release_blocked()
    rows = {row["job_id"]: row for row in api.get("/api/queue").json()["queue"]}
    assert rows[first]["status"] == "queued"
    assert rows[job_id]["status"] == "blocked"
    assert rows[job_id]["why_waiting"] == f"blocked until job {first} (queued) ends"
    assert 'mam_jobs{status="blocked"} 1.0' in api.get("/metrics").text
    from mam.orchestrator.api import Hub

    with Hub(service.registry.root, embedded=False) as hub:
        with pytest.raises(UsageError, match="no job 0badf00d in this registry"):
            hub.dispatch("echo hi", labels=["gpu"], after="0badf00d")
        with pytest.raises(UsageError, match="--if 'never' is invalid"):
            hub.dispatch("echo hi", labels=["gpu"], after=[first], after_if="never")


def _schedule(service, name: str = "nightly", overlap: str = "skip"):
    from mam.orchestrator import schedules

    return schedules.add(service.registry.root, name, cron="0 3 * * *", tz="UTC", overlap=overlap, catch_up=1,
                         params={"labels": "gpu", "brief": "Update the dependencies"})


def test_s14_http_a_schedules_trigger_token_fires_it_without_the_admin_token_and_is_rate_limited(service):
    from mam.orchestrator import schedules

    _schedule(service, overlap="queue")
    api = TestClient(hubhttp.create_app(service, TOKEN), raise_server_exceptions=False)
    url = "/api/schedules/nightly/run"
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Bearer " + "x" * 100_000}):
        refused = api.post(url, headers=headers)
        assert refused.status_code == 401 and "trigger token" in refused.json()["error"]
    path = schedules.issue_token(service.registry.root, "nightly")
    token = path.read_text().strip()
    assert path.stat().st_mode & 0o777 == 0o600
    assert token not in schedules.Store(service.registry.root).path("nightly").read_text()  # only its SHA-256
    assert api.post("/api/schedules/other/run", headers={"authorization": f"Bearer {token}"}).status_code == 401
    assert api.post("/api/schedules/..%2Fx/run", headers={"authorization": f"Bearer {token}"}).status_code in (400, 404)
    fired = api.post(url, headers={"authorization": f"Bearer {token}"})
    assert fired.status_code == 201, fired.text
    record = service.registry.get(fired.json()["job_id"])
    assert record["schedule"]["name"] == "nightly" and record["schedule"]["trigger"] == {"by": "token",
                                                                                         "from": "testclient"}
    admin = api.post(url, headers={"authorization": f"Bearer {TOKEN}"})
    assert admin.status_code == 201 and service.registry.get(admin.json()["job_id"])["schedule"]["trigger"]["by"] \
        == "api"
    codes = [api.post(url, headers={"authorization": f"Bearer {token}"}).status_code for _ in range(5)]
    assert codes == [201] * 4 + [429]  # 6 a minute
    limited = api.post(url, headers={"authorization": f"Bearer {token}"})
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) > 0
    schedules.revoke_token(service.registry.root, "nightly")
    assert api.post(url, headers={"authorization": f"Bearer {token}"}).status_code == 401
    assert not path.exists()


def test_s14_http_schedules_show_in_the_api_the_feed_and_metrics_and_skip_is_409(service, api):
    feed = LiveFeed(service)
    feed.poll()
    _schedule(service)
    rows = api.get("/api/schedules").json()["schedules"]
    assert [(r["name"], r["cron"], r["target"], r["trigger_token"]) for r in rows] == [
        ("nightly", "0 3 * * *", "labels=gpu", False)]
    assert "brief" not in rows[0] and rows[0]["title"] == "Update the dependencies"  # its first line, as a job's
    assert [item["schedules"][0]["name"] for item in feed.poll() if item["type"] == "schedules"] == ["nightly"]
    text = api.get("/metrics").text
    assert 'mam_schedule_paused{schedule="nightly"} 0.0' in text
    assert 'mam_schedule_last_fire_timestamp_seconds{schedule="nightly"} 0.0' in text
    assert 'mam_schedule_next_fire_timestamp_seconds{schedule="nightly"} 1.' in text  # a Unix time
    first = api.post("/api/schedules/nightly/run")  # loopback without MAM_API_TOKEN: open, as the rest
    assert first.status_code == 201, first.text
    skipped = api.post("/api/schedules/nightly/run")  # its job is still open: --overlap skip
    assert skipped.status_code == 409 and "not fired" in skipped.json()["error"]
    assert api.post("/api/schedules/nope/run").status_code == 404
