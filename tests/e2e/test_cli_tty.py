"""`mam-orch dispatch` as a person sees it on a terminal: a real
broker, a real runner, the hub CLI under a pseudo-terminal — no logger lines in the
view, a final summary line (outcome, duration, runner, the output's place on both
sides, PROTOCOL §15), and a cancel from another shell said in words."""

from __future__ import annotations

import os
import pty
import subprocess
import threading

import pytest
from harness import runnersim
from harness.runnersim import MAM_ORCH, hub_workspace, orch
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env

from mam.shared.protocol import names
from mam.shared.store.registry import Registry

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(120)]
SESSION = "gpu-box"
READ_BYTES = 4096


class OnTerminal:
    """A command whose stdout and stderr are one pseudo-terminal; `text` is what a person saw."""

    def __init__(self, argv: list[str]) -> None:
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                                     env=clean_env(), start_new_session=True)
        os.close(slave)
        self._master, self._seen = master, bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._master, READ_BYTES)
            except OSError:  # EIO: the terminal's last writer is gone
                break
            if not data:
                break
            self._seen += data

    @property
    def text(self) -> str:
        return self._seen.decode("utf-8", "replace").replace("\r\n", "\n")

    def wait(self) -> int:
        code = self.proc.wait(PATIENCE_S * 2)
        self._reader.join(PATIENCE_S)
        os.close(self._master)
        return code


@pytest.fixture
def fleet(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    runner = runnersim.start_runner(nats_broker, tmp_path / "runner", SESSION)
    yield hub
    runner.kill()
    runner.wait(PATIENCE_S)


def dispatch(hub, brief: str) -> OnTerminal:
    return OnTerminal([*MAM_ORCH, "dispatch", "--session", SESSION, "--brief", brief, "--workspace", str(hub)])


def test_dispatch_on_a_terminal_ends_with_a_summary_and_shows_no_log_lines(fleet):
    seen = dispatch(fleet, "echo hello from the agent")
    assert seen.wait() == 0, seen.text
    lines = seen.text.splitlines()
    assert not [line for line in lines if " INFO " in line or "subscribed" in line], seen.text
    job_id = Registry(fleet).list()[0][0]["job_id"]
    assert lines[-1].startswith(f"job {job_id} completed"), seen.text
    assert f"on runner {SESSION}; full output: hub {names.hub_log_path(fleet, job_id, 1)}" in lines[-1]
    assert f".mam/logs/{job_id}/agent.log in runner {SESSION}'s workspace" in lines[-1]


def test_a_cancel_while_watching_is_said_in_words(fleet):
    seen = dispatch(fleet, "sleep 60")
    registry = Registry(fleet)
    wait_until(lambda: [r for r in registry.list()[0] if r["status"] == "running"], what="the job running")
    job_id = registry.list()[0][0]["job_id"]
    assert orch(fleet, "cancel", job_id).returncode == 0
    assert seen.wait() == 4, seen.text
    assert f"job {job_id} was cancelled while it was watched" in seen.text
    assert seen.text.splitlines()[-1].startswith(f"job {job_id} cancelled"), seen.text
