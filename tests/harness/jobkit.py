"""A hub and a runner workspace sharing one job, for event tests over a real broker.

The hub registers the job (PROTOCOL §8); the runner mirrors it with the same
identity (§11 step 1), as a dispatch would. Both workspaces get a `.mam.env`
for the broker under test. Commands run as real processes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.fleet import Dispatch
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env, write_env_for
from mam.shared.store.registry import Contract, Registry

MAM_ORCH = [sys.executable, "-m", "mam.orchestrator.cli"]
MAM_RUNNER = [sys.executable, "-m", "mam.runner"]


class WatchProcess(Dispatch):
    """`mam-orch watch` running in the background (its own process group), its
    stdout JSON lines and stderr collected (the fleet harness's process handle)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        super().__init__("watch", subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                   text=True, start_new_session=True))

    def kill(self) -> None:
        self.stop()


class JobPair:
    """One job known to a hub workspace and a runner workspace."""

    def __init__(self, broker: Any, tmp_path: Path, contract: Contract | None = None,
                 session: str = "gpu-box") -> None:
        self.broker = broker
        self.hub_ws = tmp_path / "hub"
        self.runner_ws = tmp_path / "runner"
        for ws in (self.hub_ws, self.runner_ws):
            (ws / ".git").mkdir(parents=True, exist_ok=True)
            write_env_for(broker, ws)
        self.hub = Registry(self.hub_ws)
        self.runner = Registry(self.runner_ws)
        self.session = session
        record = self.hub.register(session=session, contract=contract or Contract())
        self.job_id = record["job_id"]
        self.runner.mirror(job_id=self.job_id, session=session, attempt_id=record["attempt_id"],
                           dispatch_token=record["dispatch_token"], auth_token=record["auth_token"],
                           contract=Contract.of_record(record))
        self.env = clean_env()
        self.watchers: list[WatchProcess] = []

    @property
    def record(self) -> dict[str, Any]:
        return self.hub.get(self.job_id)

    def publish(self, event: str, *args: str, timeout_s: float = PATIENCE_S) -> subprocess.CompletedProcess[str]:
        """`mam-runner publish` on the runner host, as an agent would run it."""
        argv = [*MAM_RUNNER, "publish", "--job", self.job_id, "--event", event,
                "--workspace", str(self.runner_ws), *args]
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout_s)

    def watch(self, *args: str) -> WatchProcess:
        """`mam-orch watch <job> --remote` on the hub, in the background."""
        argv = [*MAM_ORCH, "watch", self.job_id, "--remote", "--workspace", str(self.hub_ws), *args]
        watcher = WatchProcess(argv, self.env)
        self.watchers.append(watcher)
        return watcher

    def wait_subscribed(self, watcher: WatchProcess) -> None:
        """The watcher has subscribed once the broker holds its session; poll its log instead."""
        wait_until(lambda: watcher.proc.poll() is not None or any("subscribed" in line for line in watcher.stderr),
                   what="the watcher to subscribe")

    def close(self) -> None:
        for watcher in self.watchers:
            watcher.kill()
