"""`serve --alert-webhook` without a broker (PROTOCOL §14 "Alerts"): the options refuse bad
input in one line that never shows a webhook's path; the conditions read from a real
`HubService` (runner offline holding a job, a job queued too long, labels nobody serves, a
permission request unanswered, a job failed after its last retry); each fires once and
resolves once; a webhook that fails is tried again, against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from harness.waiting import wait_until
from test_hub_http import runner, service  # noqa: F401 - `service` is a fixture

from mam.orchestrator.http import alerts
from mam.orchestrator.http.alerts import Alerter, AlertOptions, Sender
from mam.shared.protocol.errors import UsageError
from mam.shared.store.records import QueueTerms

pytestmark = pytest.mark.timeout(30)

SECRET_PATH = "/services/T000/B000/XXXXsecretXXXX"


def outbox(alerter: Alerter) -> list[dict]:
    """What the (not started) sender of the first webhook was given, emptied."""
    found = []
    while not alerter.senders[0].outbox.empty():
        found.append(alerter.senders[0].outbox.get_nowait())
    return found


@pytest.mark.parametrize(("urls", "queue_s", "said"), [
    (["ftp://hooks.example" + SECRET_PATH], 600, "not an http:// or https:// URL with a host"),
    (["https://" + SECRET_PATH], 600, "not an http:// or https:// URL with a host"),
    (["https://hooks.example:99999" + SECRET_PATH], 600, "not a URL"),
    (["https://hooks.example" + SECRET_PATH + "\r\nX-Injected: 1"], 600, "blanks or control characters"),
    (["https://hooks.example/" + "x" * 3000], 600, "longer than 2048 characters"),
    (["https://hooks.example" + SECRET_PATH] * 9, 600, "at most 8 webhooks"),
    (["https://hooks.example" + SECRET_PATH], -1, "--alert-queue-s: must be a number of seconds > 0"),
    (["https://hooks.example" + SECRET_PATH], float("nan"), "--alert-queue-s: must be a number of seconds > 0"),
    (["https://hooks.example" + SECRET_PATH], float("inf"), "--alert-queue-s: must be a number of seconds > 0"),
])
def test_s14_bad_alert_options_refused_in_one_line_without_the_webhooks_path(urls, queue_s, said):
    with pytest.raises(UsageError) as refused:
        AlertOptions.parse(urls, queue_s=queue_s)
    message = str(refused.value)
    assert said in message and "\n" not in message
    assert "secret" not in message and len(message) < 300


def test_s14_a_webhook_is_shown_by_its_host_only():
    assert alerts.shown("https://user:pw@hooks.example:8443" + SECRET_PATH) == "https://hooks.example:8443/…"


def test_s14_a_runner_offline_holding_a_job_fires_once_and_resolves_once(service):
    alerter = Alerter(service, AlertOptions.parse(["http://127.0.0.1:9/hook"]))
    service.fleet.update(runner("gpu-box", running=("0badf00d",)))
    service.sessions["0badf00d"] = "gpu-box"
    now = time.monotonic()
    alerter.check(now, time.time())
    assert outbox(alerter) == []  # online: nothing to say
    service.fleet.update(replace(runner("gpu-box", status="offline"), will=True))  # its Last Will (§7)
    alerter.check(now, time.time())
    alerter.check(now, time.time())
    (fired,) = outbox(alerter)
    assert (fired["status"], fired["kind"], fired["session"], fired["job_ids"]) == (
        "firing", "runner_offline", "gpu-box", ["0badf00d"])
    assert "runner gpu-box went offline (Last Will) holding 1 job(s): 0badf00d" in fired["text"]
    del service.sessions["0badf00d"]  # the job was closed (or retried elsewhere)
    alerter.check(now, time.time())
    alerter.check(now, time.time())
    (resolved,) = outbox(alerter)
    assert (resolved["status"], resolved["key"], resolved["since"]) == ("resolved", fired["key"], fired["since"])
    assert resolved["text"].startswith("[mam-fleet ") and "RESOLVED: runner gpu-box" in resolved["text"]


def test_s14_a_job_queued_too_long_and_labels_nobody_serves(service):
    alerter = Alerter(service, AlertOptions.parse(["http://127.0.0.1:9/hook"], queue_s=60))
    service.fleet.update(runner("gpu-box"))
    served = service.registry.register(session=None, queue=QueueTerms(target_labels=["gpu"]))
    unserved = service.registry.register(session=None, queue=QueueTerms(target_labels=["arm"]))
    service.scan(time.monotonic())  # a busy runner is not enough to publish: plan is not called here
    assert {served["job_id"], unserved["job_id"]} <= set(service.queued)
    alerter.check(time.monotonic(), time.time())
    (nobody,) = outbox(alerter)
    assert (nobody["kind"], nobody["job_ids"]) == ("unserved", [unserved["job_id"]])
    assert "no runner serves labels=arm: 1 job(s) wait" in nobody["summary"]
    alerter.check(time.monotonic(), time.time() + 120)  # both have now waited longer than 60 s
    late = outbox(alerter)
    assert sorted((body["kind"], body["job_id"]) for body in late) == sorted(
        [("queue_wait", served["job_id"]), ("queue_wait", unserved["job_id"])])
    assert all("in the queue: " in body["summary"] and body["why"] for body in late)


def test_s14_a_permission_request_unanswered_too_long(service):
    alerter = Alerter(service, AlertOptions.parse(["http://127.0.0.1:9/hook"], ask_s=60))
    record = service.registry.register(session="gpu-box", job_id="918b0612")
    service.scan(time.monotonic())
    rid = "0123456789abcdef"
    service.registry.append_audit(record["job_id"], {
        "event": "permission_required", "job_id": record["job_id"], "timestamp": "2026-12-04T10:00:00Z",
        "data": {"request_id": rid, "attempt_id": 1, "tool": "Bash", "input": "git push"}})
    asked = alerts.iso_epoch("2026-12-04T10:00:00Z")
    assert asked is not None
    alerter.check(time.monotonic(), asked + 30)
    assert outbox(alerter) == []  # not yet
    alerter.check(time.monotonic(), asked + 120)
    (fired,) = outbox(alerter)
    assert (fired["kind"], fired["job_id"], fired["request_id"], fired["tool"]) == ("ask_wait", "918b0612", rid, "Bash")
    assert f"mam-orch approve|deny 918b0612 {rid}" in fired["summary"] and "(git push)" in fired["summary"]


def test_s14_a_job_failed_after_its_last_retry_fires_once_and_a_completed_one_does_not(service):
    alerter = Alerter(service, AlertOptions.parse(["http://127.0.0.1:9/hook"]))
    failed = service.registry.register(session="gpu-box")
    service.registry.close(failed["job_id"], "agent_blocked")
    service.retry(failed["job_id"], time.monotonic())  # what the service does once a job ended
    (fired,) = outbox(alerter)
    assert (fired["kind"], fired["job_id"], fired["close_reason"]) == ("job_failed", failed["job_id"], "agent_blocked")
    assert f"job {failed['job_id']} failed (agent_blocked) on gpu-box, attempt 1" in fired["summary"]
    done = service.registry.register(session="gpu-box")
    identity = {"attempt_id": done["attempt_id"], "dispatch_token": done["dispatch_token"]}
    service.registry.transition(done["job_id"], "running", source="runner", **identity)
    service.registry.transition(done["job_id"], "completed", source="runner", exit_code=0, **identity)
    service.retry(done["job_id"], time.monotonic())
    assert outbox(alerter) == []


def test_s14_a_failing_observer_never_ends_the_engine(service):
    failed = service.registry.register(session="gpu-box")
    service.registry.close(failed["job_id"], "agent_blocked")

    def broken(_record):
        raise RuntimeError("boom")

    service.on_failed = broken
    service.retry(failed["job_id"], time.monotonic())  # logged, not raised
    assert service.stats.handler_errors == 0 and service.registry.get(failed["job_id"])["status"] == "error"


class Hook(BaseHTTPRequestHandler):
    """Answers 500 to the first `fail_first` POSTs, then 204; keeps every body."""

    bodies: list[dict] = []
    fail_first = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        self.send_response(500 if len(type(self).bodies) <= type(self).fail_first else 204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_s14_a_webhook_that_fails_is_tried_again_and_gets_each_notification_in_order():
    Hook.bodies, Hook.fail_first = [], 2
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sender = Sender(f"http://127.0.0.1:{server.server_address[1]}/hook", delays_s=(0.01, 0.01, 0.01))
    sender.thread.start()
    try:
        sender.send({"summary": "one", "text": "one"})
        sender.send({"summary": "two", "text": "two"})
        wait_until(lambda: len(Hook.bodies) >= 4, timeout_s=10, what="both notifications delivered")
        assert [body["summary"] for body in Hook.bodies] == ["one", "one", "one", "two"]
    finally:
        sender.stopping.set()
        sender.outbox.put(None)
        sender.thread.join(5)
        server.shutdown()
        server.server_close()


def test_s14_a_webhook_that_never_answers_is_given_up_after_its_tries():
    tried = []

    def refuse(url, body):
        tried.append(body)
        raise ConnectionRefusedError("refused")

    sender = Sender("http://127.0.0.1:9/hook", post=refuse, delays_s=(0.01,))
    sender.thread.start()
    sender.send({"summary": "lost", "text": "lost"})
    sender.send({"summary": "next", "text": "next"})
    wait_until(lambda: len(tried) >= 4, timeout_s=10, what="two tries of each")
    sender.outbox.put(None)
    sender.thread.join(5)
    assert not sender.thread.is_alive() and [json.loads(body)["summary"] for body in tried] == [
        "lost", "lost", "next", "next"]
