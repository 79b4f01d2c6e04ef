"""Enrolment by invite from the outside (PROTOCOL §16): a waiting `mam-orch runner invite`
process, a fresh runner host, and `mam-runner enroll --invite`."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from harness.runnersim import MAM_ORCH, MAM_RUNNER, hub_env
from harness.waiting import PATIENCE_S
from harness.workspace import clean_env, write_env_for


class Invite:
    """A running `mam-orch runner invite`: its code (read from its first stdout line) and stderr file."""

    def __init__(self, hub: Path, session: str, *extra: str) -> None:
        self.err_path = hub.parent / f"invite-{session}.stderr"
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen([*MAM_ORCH, "runner", "invite", "--session", session, *extra,
                                          "--workspace", str(hub)], env=hub_env(), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=err, text=True)
        assert self.proc.stdout is not None
        self.code = self.proc.stdout.readline().strip()  # printed once subscribed
        assert self.code.startswith(f"mam1.{session}."), self.stderr()

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(PATIENCE_S)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def runner_host(broker: Any, workspace: Path, **env: str) -> Path:
    """A fresh runner host: a workspace with the broker settings, no keys, no v1 secret."""
    (workspace / ".git").mkdir(parents=True, exist_ok=True)
    write_env_for(broker, workspace, MAM_DISPATCH_SECRET="", **env)
    return workspace


def enroll(workspace: Path, code: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """`mam-runner enroll --invite CODE` on `workspace`, run to its end."""
    return subprocess.run([*MAM_RUNNER, "enroll", "--invite", code, "--workspace", str(workspace), *extra],
                          env=clean_env(), capture_output=True, text=True, timeout=2 * PATIENCE_S)
