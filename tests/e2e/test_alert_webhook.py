"""`mam-orch serve --alert-webhook` (PROTOCOL §14 "Alerts") over real brokers, a real runner and a
real hub service, with the webhook a small Starlette app on 127.0.0.1 in this test: a runner
killed with kill -9 while it runs a job gives exactly one `runner_offline` alert and, once the
hub closed the job, one resolution; a job waiting for a label nobody serves gives one `unserved`
alert, resolved once it is cancelled."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from harness.runnersim import hub_workspace, orch, runner_log, start_runner, start_serve
from harness.waiting import PATIENCE_S, wait_until
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mam.shared.store.registry import Registry

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(4 * PATIENCE_S)]

FAST = ["--heartbeat", "1", "--heartbeat-misses", "3"]


class Receiver:
    """The webhook: every JSON body POSTed to /hook, in order."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

        async def hook(request: Request) -> Response:
            self.bodies.append(await request.json())
            return Response(status_code=204)

        self.app = Starlette(routes=[Route("/hook", hook, methods=["POST"])])

    def of(self, kind: str, status: str) -> list[dict]:
        return [body for body in self.bodies if body["kind"] == kind and body["status"] == status]


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    got = Receiver()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(got.app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, what="the webhook receiver to listen")
    try:
        yield got, f"http://127.0.0.1:{sock.getsockname()[1]}/hook"
    finally:
        server.should_exit = True
        thread.join(PATIENCE_S)
        sock.close()


def start_alerting_serve(hub: Path, *args: str) -> subprocess.Popen[bytes]:
    return start_serve(hub, *args, ready=b"alerts: 1 webhook(s)")


def test_s14_runner_kill9_and_an_unserved_label_each_alert_once_and_resolve_once(broker, tmp_path, receiver):
    got, url = receiver
    hub = hub_workspace(broker, tmp_path)
    runner = start_runner(broker, tmp_path / "runner", "gpu-box", "--labels", "x")
    serve = start_alerting_serve(hub, "--alert-webhook", url)
    serve_log = hub.parent / "serve.stderr"
    try:
        sent = orch(hub, "dispatch", "--labels", "x", "--detach", "--json", "--brief", "sleep 120\n", *FAST)
        assert sent.returncode == 0, sent.stderr
        job_id = Registry(hub).list()[0][0]["job_id"]
        wait_until(lambda: Registry(hub).get(job_id)["status"] == "running", what="the job running")
        waiting = orch(hub, "dispatch", "--labels", "arm", "--detach", "--json", "--brief", "true\n")
        assert waiting.returncode == 0, waiting.stderr
        arm_job = next(r["job_id"] for r in Registry(hub).list()[0] if r["job_id"] != job_id)
        wait_until(lambda: got.of("unserved", "firing"), what="the unserved alert")
        assert got.of("unserved", "firing")[0]["job_ids"] == [arm_job]

        os.killpg(runner.pid, signal.SIGKILL)  # the runner and its agent, as a host dying would
        runner.wait(PATIENCE_S)
        wait_until(lambda: got.of("runner_offline", "firing"), what="the runner_offline alert",
                   timeout_s=PATIENCE_S)
        fired = got.of("runner_offline", "firing")[0]
        assert (fired["session"], fired["job_ids"]) == ("gpu-box", [job_id]), fired
        assert "runner gpu-box went offline (Last Will) holding 1 job(s)" in fired["text"]
        wait_until(lambda: got.of("runner_offline", "resolved"), what="the runner_offline resolution",
                   timeout_s=PATIENCE_S)
        assert Registry(hub).get(job_id)["close_reason"] == "runner_lost"
        wait_until(lambda: got.of("job_failed", "firing"), what="the job_failed alert")

        assert orch(hub, "cancel", arm_job).returncode in (0, 4)
        wait_until(lambda: got.of("unserved", "resolved"), what="the unserved resolution")
        assert {(b["kind"], b["status"]) for b in got.bodies} == {
            ("unserved", "firing"), ("unserved", "resolved"), ("runner_offline", "firing"),
            ("runner_offline", "resolved"), ("job_failed", "firing")}, got.bodies
        assert len(got.bodies) == 5, got.bodies  # each exactly once
        assert "/hook" not in serve_log.read_text()  # only the webhook's host is logged, never its path
    finally:
        serve.terminate()
        serve.wait(PATIENCE_S)
        if runner.poll() is None:
            runner.kill()
        print(runner_log(tmp_path / "runner"))
