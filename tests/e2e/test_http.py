"""`mam-orch serve --http` against real brokers and runners (PROTOCOL §14):
the API dispatches, follows, lists, cancels; the event stream carries the job's changes;
`/metrics` after a scripted run (3 completed, 1 error, 1 cancelled, 1 retry) equals what
happened; a non-loopback address without MAM_API_TOKEN is refused; a token is enforced."""

from __future__ import annotations

import socket
import subprocess

import pytest
from harness.brokers import free_port
from harness.httpserve import Serve, Stream, gated
from harness.runnersim import MAM_ORCH, hub_env, hub_workspace, start_runner
from harness.waiting import PATIENCE_S, wait_until
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(180)]

TOKEN = "e2e-api-token-0123456789abcdef"


def test_s14_http_api_dispatch_stream_detail_log_cancel(broker, tmp_path):
    hub = hub_workspace(broker, tmp_path)
    runner = start_runner(broker, tmp_path / "gpu", "gpu-box", "--labels", "gpu", "--max-jobs", "2")
    serve = Serve(hub)
    stream = Stream(serve.url)
    try:
        wait_until(lambda: [r["status"] for r in serve.http.get("/api/runners").json()["runners"]] == ["online"],
                   what="the runner online in /api/runners")
        job_id = serve.dispatch("echo hello-from-the-agent", labels=["gpu"])
        wait_until(lambda: serve.status(job_id) == "completed", what="the job completed")
        wait_until(lambda: "completed" in stream.job_statuses(job_id), what="completed on the stream")
        assert stream.job_statuses(job_id)[-1] == "completed"  # a queued job may leave within one poll
        assert {"started", "completed"} <= set(stream.events(job_id))
        detail = serve.http.get(f"/api/jobs/{job_id}").json()
        assert detail["job"]["session"] == "gpu-box" and detail["job"]["duration_s"] is not None
        assert [a["status"] for a in detail["attempts"]] == ["completed"]
        assert serve.http.get(f"/api/jobs/{job_id}/log").status_code == 200
        rows = serve.http.get("/api/jobs", params={"status": "completed"}).json()["jobs"]
        assert [row["job_id"] for row in rows] == [job_id]

        long = serve.dispatch(gated(tmp_path, "never"), session="gpu-box")
        wait_until(lambda: serve.status(long) == "running", what="the gated job running")
        response = serve.http.post(f"/api/jobs/{long}/cancel")
        assert response.status_code == 200 and response.json()["changed"] is True
        wait_until(lambda: long not in serve.http.get("/api/runners").json()["runners"][0]["running"],
                   what="the runner stopped the cancelled agent")
        assert serve.status(long) == "cancelled"
        assert serve.http.post("/api/jobs", content=b"{nope").status_code == 400
        assert serve.http.get("/api/jobs/0badf00d").status_code == 404
    finally:
        stream.close()
        assert serve.stop() == 0, serve.log()
        runner.terminate()
        runner.wait(PATIENCE_S)
    assert "Traceback" not in serve.log()


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_s14_metrics_after_a_scripted_run_equal_what_happened(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    runner = start_runner(nats_broker, tmp_path / "gpu", "gpu-box", "--labels", "gpu", "--max-jobs", "3")
    serve = Serve(hub)
    try:
        flaky = f"bash -c 'if [ -e {tmp_path}/tried ]; then exit 0; fi; touch {tmp_path}/tried; exit 3'"
        jobs = [serve.dispatch("true", labels=["gpu"]), serve.dispatch("true", labels=["gpu"]),
                serve.dispatch(flaky, labels=["gpu"], retries=1, retry_on=["error"]),
                serve.dispatch("exit 3", labels=["gpu"])]
        cancelled = serve.dispatch(gated(tmp_path, "never"), labels=["gpu"])
        wait_until(lambda: serve.status(cancelled) == "running", what="the gated job running")
        assert serve.http.post(f"/api/jobs/{cancelled}/cancel").json()["status"] == "cancelled"
        wait_until(lambda: all(serve.status(job) in ("completed", "error") for job in jobs), what="4 jobs ended")
        expected = {
            ("mam_jobs_finished_total", (("close_reason", "none"), ("outcome", "completed"))): 3,
            ("mam_jobs_finished_total", (("close_reason", "none"), ("outcome", "error"))): 1,
            ("mam_jobs_finished_total", (("close_reason", "cancelled"), ("outcome", "cancelled"))): 1,
            ("mam_retries_total", ()): 1,
            ("mam_jobs", (("status", "completed"),)): 3,
            ("mam_jobs", (("status", "error"),)): 1,
            ("mam_jobs", (("status", "cancelled"),)): 1,
            ("mam_jobs", (("status", "queued"),)): 0,
            ("mam_queue_depth", ()): 0,
            ("mam_runners", (("status", "online"),)): 1,
            ("mam_events_accepted_total", (("event", "started"),)): 6,  # 5 jobs, one of them twice
            ("mam_events_accepted_total", (("event", "completed"),)): 3,
            ("mam_events_accepted_total", (("event", "error"),)): 2,  # the flaky first attempt and `exit 3`
            ("mam_job_duration_seconds_count", (("outcome", "completed"),)): 3,
        }

        def mismatched() -> dict:
            samples = metric_samples(serve.http.get("/metrics").text)
            return {key: (samples.get(key), value) for key, value in expected.items() if samples.get(key) != value}

        try:
            wait_until(lambda: not mismatched(), what="the metrics to equal the scripted run")
        except AssertionError:
            raise AssertionError(f"metrics (got, expected) differ from the scripted run: {mismatched()}") from None
        samples = metric_samples(serve.http.get("/metrics").text)
        assert samples[("mam_messages_accepted_total", (("kind", "events"),))] >= 14
        assert 5 <= samples[("mam_queue_wait_seconds_count", ())] <= 6  # the retry's first attempt may pass unseen
        assert samples[("mam_dispatch_started_seconds_count", ())] == 6
    finally:
        assert serve.stop() == 0, serve.log()
        runner.terminate()
        runner.wait(PATIENCE_S)


def test_s14_http_non_loopback_needs_a_token_a_busy_port_exits_64_a_token_is_enforced(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    refused = subprocess.run([*MAM_ORCH, "serve", "--workspace", str(hub), "--http", f"0.0.0.0:{free_port()}"],
                             env=hub_env(), capture_output=True, text=True, timeout=PATIENCE_S)
    assert refused.returncode == 64
    assert "MAM_API_TOKEN" in refused.stderr and len(refused.stderr.strip().splitlines()) <= 2
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = subprocess.run([*MAM_ORCH, "serve", "--workspace", str(hub), "--http",
                               f"127.0.0.1:{taken.getsockname()[1]}"], env=hub_env(), capture_output=True, text=True,
                              timeout=PATIENCE_S)
    assert busy.returncode == 64 and "cannot listen there" in busy.stderr, busy.stderr
    serve = Serve(hub, ("MAM_API_TOKEN", TOKEN))
    try:
        assert "bearer token MAM_API_TOKEN required" in serve.log() and TOKEN not in serve.log()
        assert serve.http.get("/api/runners").status_code == 401
        assert serve.http.get("/metrics").status_code == 401
        ok = serve.http.get("/api/runners", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and ok.json() == {"runners": []}
    finally:
        assert serve.stop() == 0, serve.log()
    assert TOKEN not in serve.log()


def test_s14_a_schedules_trigger_token_fires_one_job_from_outside_and_is_audited(nats_broker, tmp_path):
    """§14 Schedules "Triggers from outside": CI holds a schedule's trigger token, not the hub's
    MAM_API_TOKEN: its POST fires one job that runs on a real runner, the job's record says
    the trigger fired it, the service logs who; a wrong token is 401; neither token is ever
    in the service's log."""
    hub = hub_workspace(nats_broker, tmp_path)
    runner = start_runner(nats_broker, tmp_path / "runner", "gpu-box")
    added = subprocess.run([*MAM_ORCH, "schedule", "add", "deploy", "--cron", "0 3 * * *", "--workspace", str(hub),
                            "--", "--session", "gpu-box", "--brief", "echo deployed", "--heartbeat", "1"],
                           env=hub_env(), capture_output=True, text=True, timeout=PATIENCE_S)
    assert added.returncode == 0, added.stderr
    made = subprocess.run([*MAM_ORCH, "schedule", "token", "deploy", "--workspace", str(hub)], env=hub_env(),
                          capture_output=True, text=True, timeout=PATIENCE_S)
    assert made.returncode == 0, made.stderr
    path = hub / ".mam" / "schedules" / "deploy.token"
    token = path.read_text().strip()
    assert token not in made.stdout + made.stderr and str(path) in made.stderr
    serve = Serve(hub, ("MAM_API_TOKEN", TOKEN))
    try:
        assert serve.http.post("/api/schedules/deploy/run", headers={"Authorization": "Bearer nope"}).status_code \
            == 401
        fired = serve.http.post("/api/schedules/deploy/run", headers={"Authorization": f"Bearer {token}"})
        assert fired.status_code == 201, fired.text
        job_id = fired.json()["job_id"]
        auth = {"Authorization": f"Bearer {TOKEN}"}
        wait_until(lambda: serve.http.get(f"/api/jobs/{job_id}", headers=auth).json()["job"]["status"] == "completed",
                   PATIENCE_S, "the triggered job to complete")
        record = serve.http.get(f"/api/jobs/{job_id}", headers=auth).json()["record"]
        assert record["schedule"]["trigger"] == {"by": "token", "from": "127.0.0.1"}
        listed = serve.http.get("/api/schedules", headers=auth).json()["schedules"]
        assert listed[0]["last_job"] == job_id and listed[0]["trigger_token"] is True
        assert f"schedule deploy: job {job_id} fired by a trigger (token from 127.0.0.1)" in serve.log()
        assert "schedule deploy: a trigger from 127.0.0.1 was refused: missing or wrong token" in serve.log()
    finally:
        assert serve.stop() == 0, serve.log()
        runner.terminate()
        runner.wait(PATIENCE_S)
    assert token not in serve.log() and TOKEN not in serve.log()
