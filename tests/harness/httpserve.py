"""`mam-orch serve --http` as a test process: start it on a free loopback port, call its
API with httpx, read its event stream (`GET /api/events`) in a thread."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx2 as httpx  # the httpx API; starlette.testclient wants this package too

from harness.brokers import free_port
from harness.runnersim import MAM_ORCH, hub_env
from harness.waiting import PATIENCE_S, wait_until

FAST = {"heartbeat_sec": 1, "heartbeat_misses": 5, "ack_timeout_sec": int(PATIENCE_S)}


class Serve:
    """`mam-orch serve --http 127.0.0.1:PORT` on a workspace, once it listens."""

    def __init__(self, workspace: Path, *extra_env: tuple[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workspace.parent / "serve.stderr"
        with open(self.log_path, "ab") as err:
            self.proc = subprocess.Popen([*MAM_ORCH, "serve", "--workspace", str(workspace), "--http",
                                          f"127.0.0.1:{self.port}"], env=hub_env(**dict(extra_env)),
                                         stdout=subprocess.DEVNULL, stderr=err)
        wait_until(lambda: self.proc.poll() is not None or b"dashboard and API on" in self.log_path.read_bytes(),
                   what="serve --http listening")
        assert self.proc.poll() is None, self.log()
        self.http = httpx.Client(base_url=self.url, timeout=PATIENCE_S)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def dispatch(self, brief: str, **body: Any) -> str:
        response = self.http.post("/api/jobs", json={"brief": brief, **FAST, **body})
        assert response.status_code == 201, response.text
        return str(response.json()["job_id"])

    def status(self, job_id: str) -> str:
        return str(self.http.get(f"/api/jobs/{job_id}").json()["record"]["status"])

    def stop(self) -> int:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(PATIENCE_S)


class Stream:
    """`GET /api/events` read in a thread into a list of (event, data)."""

    def __init__(self, url: str) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []
        self.client = httpx.Client(timeout=httpx.Timeout(PATIENCE_S, read=None))
        self.open = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()
        assert self.open.wait(PATIENCE_S), "the event stream did not open"

    def _read(self, url: str) -> None:
        try:
            with self.client.stream("GET", f"{url}/api/events") as response:
                self.open.set()
                kind = ""
                for line in response.iter_lines():
                    if line.startswith("event: "):
                        kind = line[len("event: "):]
                    elif line.startswith("data: "):
                        self.items.append((kind, json.loads(line[len("data: "):])))
        except httpx.HTTPError:
            return

    def job_statuses(self, job_id: str) -> list[str]:
        return [data["job"]["status"] for kind, data in list(self.items)
                if kind == "job" and data["job"]["job_id"] == job_id]

    def events(self, job_id: str) -> list[str]:
        return [data["event"]["event"] for kind, data in list(self.items)
                if kind == "event" and data["job_id"] == job_id]

    def close(self) -> None:
        self.client.close()


def gated(tmp_path: Path, name: str) -> str:
    return f"bash -c 'while [ ! -e {tmp_path}/{name} ]; do sleep 0.1; done'"
