"""The runner side of a dispatch, played by a test over a real broker
(PROTOCOL §5, §6, §7, §11), plus a wire recorder.

`SimRunner` subscribes to every dispatch and control, decodes and verifies a
dispatch, opens its seal (proving the brief and auth_token arrive sealed and
correct), mirrors the job into its own registry, clears the retained
dispatch and publishes events through `mam.runner.publish` exactly as the
real runner does. `Wire` subscribes to `ROOT/#` and keeps every message, to
check what crossed the broker.
"""

from __future__ import annotations

import json
import queue
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.waiting import PATIENCE_S, QUIET_S, wait_until
from harness.workspace import TEST_SECRET, clean_env, write_env_for
from mam.runner.publish import PublishRequest, record, send_on
from mam.shared.protocol import crypto, names, wire
from mam.shared.store.registry import Registry
from mam.shared.transport import mqtt

MAM_ORCH = [sys.executable, "-m", "mam.orchestrator.cli"]
MAM_RUNNER = [sys.executable, "-m", "mam.runner"]
AGENTS = Path(__file__).resolve().parents[2] / "examples" / "agents"


@dataclass
class Taken:
    """A dispatch as the runner saw it: decoded, verified and opened."""

    dispatch: Any
    auth_token: str
    brief: str
    raw: bytes


class Wire:
    """Every message under the topic root, as an eavesdropping client sees it."""

    def __init__(self, broker: Any) -> None:
        self.client = mqtt.MqttClient(broker.config(), "wire").connect()
        self.client.subscribe([(f"{broker.topic_root}/#", 1)])
        self.seen: list[mqtt.Message] = []

    def drain(self) -> list[mqtt.Message]:
        while True:
            try:
                self.seen.append(self.client.messages.get_nowait())
            except queue.Empty:
                return self.seen

    def wait_for(self, predicate: Any, timeout_s: float = PATIENCE_S, what: str = "a message") -> mqtt.Message:
        def find() -> Any:
            return next((m for m in self.drain() if predicate(m)), None)
        return wait_until(find, timeout_s, what)

    def close(self) -> None:
        self.client.close()


def retained(broker: Any, topic: str, quiet_s: float = QUIET_S) -> bytes | None:
    """The retained payload of `topic` as a fresh subscriber gets it within `quiet_s`, or None
    (no retained message, or a cleared one). Expecting one, pass PATIENCE_S."""
    with mqtt.MqttClient(broker.config(), "probe") as client:
        client.subscribe([(topic, 1)])
        try:
            message = client.messages.get(timeout=quiet_s)
        except queue.Empty:
            return None
        return message.payload or None


class SimRunner:
    """A runner for `session` over `broker`, its registry in `workspace`."""

    def __init__(self, broker: Any, workspace: Path, session: str = "gpu-box") -> None:
        (workspace / ".git").mkdir(parents=True, exist_ok=True)
        write_env_for(broker, workspace)
        self.registry = Registry(workspace)
        self.session = session
        self.keys = crypto.derive_keys(TEST_SECRET)
        self.client = mqtt.MqttClient(broker.config(), "simrunner").connect()
        root = broker.topic_root
        self.client.subscribe([(names.all_dispatches_filter(root), 1), (names.all_controls_filter(root), 1)])
        self.root = root
        self.controls: list[Any] = []

    def _next(self, leaf: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {leaf} within {timeout_s:g} s")
            try:
                message = self.client.messages.get(timeout=remaining)
            except queue.Empty:
                continue
            parsed = names.parse_job_topic(message.topic, self.root)
            if not message.payload or parsed is None:
                continue
            if parsed[1] == "control":
                control = wire.decode(message.payload, "control")
                crypto.verify(control.to_dict(), self.keys.sign_key)
                self.controls.append(control)
            if parsed[1] == leaf:
                return message

    def take(self, timeout_s: float = PATIENCE_S, *, mirror: bool = True) -> Taken:
        """Wait for a dispatch, verify its sig, open its seal, mirror it and clear it (§5, §11)."""
        message = self._next("dispatch", timeout_s)
        dispatch = wire.decode(message.payload, "dispatch")
        crypto.verify(dispatch.to_dict(), self.keys.sign_key)
        assert dispatch.session == self.session
        auth_token, brief = crypto.open_sealed(self.keys.seal_key, dispatch.sealed, job_id=dispatch.job_id,
                                               attempt_id=dispatch.attempt_id,
                                               dispatch_token=dispatch.dispatch_token)
        if mirror:
            self.registry.mirror(job_id=dispatch.job_id, session=dispatch.session,
                                 attempt_id=dispatch.attempt_id, dispatch_token=dispatch.dispatch_token,
                                 auth_token=auth_token, contract=dispatch.contract,
                                 origin=dispatch.origin)
            self.client.publish(names.dispatch_topic(dispatch.job_id, self.root), b"", retain=True)
        return Taken(dispatch, auth_token, brief, message.payload)

    def wait_control(self, job_id: str, timeout_s: float = PATIENCE_S) -> Any:
        """The first signed cancel seen for `job_id` (§6)."""
        def seen() -> Any:
            while True:
                try:
                    self._next("control", 0.05)
                except AssertionError:
                    break
            return next((c for c in self.controls if c.job_id == job_id), None)
        return wait_until(seen, timeout_s, f"a cancel for {job_id}")

    def publish(self, job_id: str, event: str, detail: str = "", **kwargs: Any) -> Any:
        """Disk first, then event + retained state on this connection (runner.publish)."""
        published = record(self.registry, PublishRequest(job_id, event, detail), source="runner", **kwargs)
        send_on(self.client, published)
        return published

    def presence(self, status: str = "online", *, key: bytes | None = None, session: str | None = None,
                 running: tuple[str, ...] = (), timestamp: Any = None, will: bool = False) -> bytes:
        """Publish a retained presence (§7), signed with the fleet key unless `key` is given;
        `timestamp` (an aware datetime) backdates it; `will`: as a runner's Last Will."""
        body = wire.Presence.build(session or self.session, names.new_runner_id(), status, host="sim-host",
                                   version="0.1.0", max_jobs=1, running=running, timestamp=timestamp)
        message = {**body.to_dict(), **({"will": True} if will else {})}
        payload = wire.encode(crypto.sign(message, key or self.keys.sign_key))
        self.client.publish(names.presence_topic(session or self.session, self.root), payload, retain=True)
        return payload

    def close(self) -> None:
        self.client.close()


def hub_workspace(broker: Any, tmp_path: Path, **extra: str) -> Path:
    """A hub workspace with a `.mam.env` for `broker` (extra values override)."""
    workspace = tmp_path / "hub"
    (workspace / ".git").mkdir(parents=True, exist_ok=True)
    write_env_for(broker, workspace, **extra)
    return workspace


def hub_env(**extra: str) -> dict[str, str]:
    """The environment of a hub CLI process: no developer MQTT_/MAM_ settings."""
    return clean_env(MAM_LOG_LEVEL="INFO", **extra)


def orch(workspace: Path, *args: str, env: dict[str, str] | None = None, stdin: str | None = None,
         timeout_s: float = PATIENCE_S) -> subprocess.CompletedProcess[str]:
    """`mam-orch ARGS --workspace WORKSPACE` run to its end (environment: `hub_env()`)."""
    return subprocess.run([*MAM_ORCH, *args, "--workspace", str(workspace)], env=env or hub_env(),
                          input=stdin, capture_output=True, text=True, timeout=timeout_s)


def start_serve(workspace: Path, *args: str, ready: bytes = b"hub service pid") -> subprocess.Popen[bytes]:
    """`mam-orch serve --workspace WORKSPACE ARGS` (stderr appended to `<workspace>/../serve.stderr`,
    see `serve_log`), once that log shows `ready` (by default: it holds the lock and subscribed)."""
    log_path = workspace.parent / "serve.stderr"
    with open(log_path, "ab") as err:
        offset = err.tell()
        proc = subprocess.Popen([*MAM_ORCH, "serve", "--workspace", str(workspace), *args], env=hub_env(),
                                stdout=subprocess.DEVNULL, stderr=err)
    wait_until(lambda: proc.poll() is not None or ready in log_path.read_bytes()[offset:], what="the hub service up")
    assert proc.poll() is None, serve_log(workspace)
    return proc


def kill_all(*procs: subprocess.Popen[Any]) -> None:
    """SIGKILL each process still running and reap it (a test's teardown)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(PATIENCE_S)


def serve_log(workspace: Path) -> str:
    """What every `start_serve` on `workspace` wrote on stderr."""
    return (workspace.parent / "serve.stderr").read_text(errors="replace")


def job_records(workspace: Path) -> list[Path]:
    """The job records of a workspace (empty when nothing was registered)."""
    folder = names.jobs_dir(workspace)
    return sorted(folder.glob("*.json")) if folder.exists() else []


def start_runner(broker: Any, workspace: Path, session: str, *extra: str, wait_online: bool = True,
                 **env: str) -> subprocess.Popen[bytes]:
    """`mam-runner run --session SESSION [EXTRA...]` with the shell agent in `workspace` (its stderr
    in `<workspace>.stderr`, see `runner_log`), once its signed `online` presence is retained
    (`wait_online`; else at once). The runner gets its own process group (a test may kill -9 it
    with its agents)."""
    (workspace / ".git").mkdir(parents=True, exist_ok=True)
    write_env_for(broker, workspace)
    with open(workspace.parent / f"{workspace.name}.stderr", "wb") as err:
        proc = subprocess.Popen([*MAM_RUNNER, "run", "--session", session, "--exec", str(AGENTS / "shell-agent"),
                                 "--workspace", str(workspace), *extra],
                                env=clean_env(MAM_CANCEL_GRACE_S="1", **env),
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    if not wait_online:
        return proc
    topic = names.presence_topic(session, broker.topic_root)
    wait_until(lambda: proc.poll() is not None or b'"online"' in (retained(broker, topic, 0.3) or b""),
               what="the runner's online presence")
    assert proc.poll() is None, runner_log(workspace)
    return proc


def runner_log(workspace: Path) -> str:
    """The stderr of the runner `start_runner` started in `workspace`."""
    return (workspace.parent / f"{workspace.name}.stderr").read_text(errors="replace")


def ask_step(n: int, tool: str, tool_input: dict[str, Any]) -> str:
    """One shell-agent brief line: `mam-runner ask` (§19), its answer and exit code kept in
    `$OUT.<n>` (written whole, then renamed; a deny is no failure of the step)."""
    ask = shlex.join([*MAM_RUNNER, "ask"])
    return (f'rc=0; {ask} --tool {tool} --input {shlex.quote(json.dumps(tool_input))} > "$OUT.{n}.tmp" || rc=$?; '
            f'echo "rc=$rc" >> "$OUT.{n}.tmp"; mv "$OUT.{n}.tmp" "$OUT.{n}"')
