"""The runner daemon `mam-runner run` over a real broker, as real processes
(PROTOCOL §5 dispatch checks, §6 cancel, §7 presence and Last Will, §9 exit
codes, §11 runner side, §12 heartbeat).

The hub side is played by the test: a hub Registry record, a dispatch built
by `orchestrator.dispatch.build_dispatch` and published retained by a test
client; a read-only observer client records everything on the topic root.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness.procs import all_gone, heartbeat_beats, kill_all
from harness.waiting import PATIENCE_S, POLL_INTERVAL_S, QUIET_S, wait_until
from harness.workspace import TEST_SECRET, clean_env, write_env_for

from mam.orchestrator.control import clear_dispatch, publish_cancel
from mam.orchestrator.dispatch import build_dispatch, publish_dispatch
from mam.runner.service import Runner
from mam.runner.settings import options_from_cli
from mam.runner.trust import V1Trust
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import MamError
from mam.shared.store.registry import Contract, Registry
from mam.shared.transport.mqtt import MqttClient

pytestmark = [pytest.mark.broker, pytest.mark.e2e]

AGENTS = Path(__file__).resolve().parents[2] / "examples" / "agents"
SHELL_AGENT = str(AGENTS / "shell-agent")
SLEEP_AGENT = str(AGENTS / "sleep-agent")
EXIT_AGENT = str(AGENTS / "exit-agent")
MAM_RUNNER = [sys.executable, "-m", "mam.runner"]
FAST = Contract(heartbeat_sec=1, heartbeat_misses=10, ack_timeout_sec=60, timeout_sec=120)
SESSION = "gpu-box"


# ------------------------------------------------------------------ harness

class Wire:
    """An observer of everything under the topic root (it only subscribes)."""

    def __init__(self, broker: Any) -> None:
        self.root = broker.topic_root
        self.client = MqttClient(broker.config(), "observer")
        self.client.connect()
        self.client.subscribe([(f"{self.root}/#", 1)])
        self.seen: list[Any] = []

    def poll(self) -> list[Any]:
        while not self.client.messages.empty():
            self.seen.append(self.client.messages.get_nowait())
        return self.seen

    def events(self, job_id: str) -> list[dict[str, Any]]:
        topic = names.events_topic(job_id, self.root)
        return [json.loads(m.payload) for m in self.poll() if m.topic == topic and m.payload]

    def terminal(self, job_id: str) -> list[dict[str, Any]]:
        return [e for e in self.events(job_id) if e["event"] in ("completed", "error")]

    def wait_terminal(self, job_id: str, timeout_s: float = PATIENCE_S) -> dict[str, Any]:
        return wait_until(lambda: (self.terminal(job_id) or [None])[0], timeout_s,
                          f"a terminal event of job {job_id}")

    def presences(self, session: str = SESSION) -> list[dict[str, Any]]:
        topic = names.presence_topic(session, self.root)
        return [json.loads(m.payload) for m in self.poll() if m.topic == topic and m.payload]

    def wait_presence(self, status: str, runner_id: str | None = None, timeout_s: float = PATIENCE_S) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            for p in reversed(self.presences()):
                if p["status"] == status and (runner_id is None or p["runner_id"] == runner_id):
                    return p
            return None
        return wait_until(found, timeout_s, f"presence {status}")

    def close(self) -> None:
        self.client.close()


class Hub:
    """The hub side: a registry, the dispatch keys and a publishing client."""

    def __init__(self, broker: Any, tmp_path: Path) -> None:
        self.ws = tmp_path / "hub"
        write_env_for(broker, self.ws)
        self.registry = Registry(self.ws)
        self.keys = crypto.derive_keys(TEST_SECRET)
        self.client = MqttClient(broker.config(), "hub")
        self.client.connect()
        self.root = broker.topic_root

    def record(self, session: str = SESSION, contract: Contract = FAST) -> dict[str, Any]:
        return self.registry.register(session=session, contract=contract)

    def dispatch(self, brief: str, session: str = SESSION, *, keys: Any = None,
                 issued_at: datetime | None = None, contract: Contract = FAST) -> tuple[dict[str, Any], dict]:
        record = self.record(session, contract)
        signed = build_dispatch(record, brief, keys or self.keys, issued_at=issued_at)
        publish_dispatch(self.client, signed)
        return record, signed

    def publish_raw(self, job_id: str, payload: bytes) -> None:
        self.client.publish(names.dispatch_topic(job_id, self.root), payload, retain=True)

    def retained_dispatch(self, broker: Any, job_id: str, wait_s: float = QUIET_S) -> bytes | None:
        """The retained dispatch of `job_id` as a fresh subscriber sees it within `wait_s`
        (None: none). Expecting one, pass PATIENCE_S: it returns as soon as it arrives."""
        probe = MqttClient(broker.config(), "probe")
        probe.connect()
        try:
            probe.subscribe([(names.dispatch_topic(job_id, self.root), 1)])
            try:
                message = probe.messages.get(timeout=wait_s)
            except Exception:
                return None
            return message.payload or None
        finally:
            probe.close()

    def close(self) -> None:
        self.client.close()


class RunnerProc:
    """`mam-runner run` as a real process; stderr goes to a file we can read."""

    count = 0

    def __init__(self, broker: Any, ws: Path, *, exec_cmd: str = SHELL_AGENT, session: str = SESSION,
                 args: tuple[str, ...] = (), **env_extra: str) -> None:
        RunnerProc.count += 1
        self.ws = ws
        if not (ws / ".mam.env").exists():
            write_env_for(broker, ws)
        self.err_path = ws.parent / f"runner-{ws.name}-{RunnerProc.count}.stderr"
        argv = [*MAM_RUNNER, "run", "--session", session, "--exec", exec_cmd, "--workspace", str(ws), *args]
        env = clean_env(MAM_CANCEL_GRACE_S="1", **env_extra)
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=err)
        self.registry = Registry(ws)

    def log(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout_s: float = PATIENCE_S) -> str:
        def found() -> bool:
            if text in self.log():
                return True
            if self.proc.poll() is not None:
                raise AssertionError(f"runner exited {self.proc.returncode} before logging {text!r}:\n{self.log()}")
            return False
        wait_until(found, timeout_s, f"runner log line {text!r}")
        return self.log()

    def wait_serving(self) -> str:
        """Until it subscribed to dispatches; returns its runner id."""
        log = self.wait_log("serving session")
        line = next(line for line in log.splitlines() if "serving session" in line)
        return line.split("runner ", 1)[1].split()[0]

    def status(self, job_id: str) -> str | None:
        try:
            return self.registry.get(job_id)["status"]
        except Exception:
            return None

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = PATIENCE_S) -> int:
        code = self.proc.wait(timeout_s)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait()


@pytest.fixture
def wire_obs(nats_broker):
    observer = Wire(nats_broker)
    yield observer
    observer.close()


@pytest.fixture
def hub(nats_broker, tmp_path):
    handle = Hub(nats_broker, tmp_path)
    yield handle
    handle.close()


@pytest.fixture
def runners():
    started: list[RunnerProc] = []
    yield started
    for runner in started:
        runner.stop()


def start_runner(runners: list[RunnerProc], broker: Any, ws: Path, **kwargs: Any) -> RunnerProc:
    runner = RunnerProc(broker, ws, **kwargs)
    runners.append(runner)
    return runner


def verify_signed(event: dict[str, Any], record: dict[str, Any]) -> None:
    crypto.verify_event(event, record["auth_token"])
    assert event["data"]["attempt_id"] == record["attempt_id"]
    assert event["data"]["dispatch_token"] == record["dispatch_token"]


# ------------------------------------------------------------------ tests

def test_s11_valid_dispatch_runs_to_completed_and_clears_the_dispatch(broker, tmp_path, runners):
    """§11 steps 1-5 and §7 on both brokers: mirror, clear, started (seq 1), progress from
    the agent's $MAM_PUBLISH_CMD (per-job broker.env), completed, presence online → offline."""
    observer, hub = Wire(broker), Hub(broker, tmp_path)
    try:
        marker = tmp_path / "runs.txt"
        ws = tmp_path / "runner"
        runner = start_runner(runners, broker, ws, args=("--once",), MARKER=str(marker))
        runner_id = runner.wait_serving()
        online = observer.wait_presence("online", runner_id)
        crypto.verify(online, hub.keys.sign_key)
        record, _ = hub.dispatch('echo ran >> "$MARKER"\necho "secret=${MAM_DISPATCH_SECRET:-none}"')
        job_id = record["job_id"]
        done = observer.wait_terminal(job_id)
        assert done["event"] == "completed" and done["data"]["exit_code"] == 0
        assert runner.wait() == 0, runner.log()
        events = observer.events(job_id)
        assert events[0]["event"] == "started" and events[0]["seq"] == 1
        assert any(e["event"] == "progress" and e["detail"] == "step 1/2" for e in events)
        for event in events:
            verify_signed(event, record)
        assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
        assert marker.read_text() == "ran\n"
        assert hub.retained_dispatch(broker, job_id) is None
        local = runner.registry.get(job_id)
        assert local["status"] == "completed" and local["exit_code"] == 0
        assert local["auth_token"] == record["auth_token"]
        agent_log = (ws / ".mam" / "logs" / job_id / "agent.log")
        assert "secret=none" in agent_log.read_text()  # §11: the agent never sees the dispatch secret
        assert not (ws / ".mam" / "logs" / job_id / "broker.env").exists()
        assert (ws / "work" / job_id).is_dir()
        assert any(p["running"] == [job_id] for p in observer.presences())
        offline = observer.wait_presence("offline", runner_id)
        assert offline["running"] == []
        assert TEST_SECRET not in runner.log() and record["auth_token"] not in runner.log()
    finally:
        observer.close()
        hub.close()


def test_s5_replayed_dispatch_is_refused_after_a_restart(nats_broker, tmp_path, hub, wire_obs, runners):
    """§5: a (job_id, attempt) taken once is never run again, even when the retained
    dispatch is re-published (a replay) and the runner restarted."""
    marker = tmp_path / "runs.txt"
    ws = tmp_path / "runner"
    first = start_runner(runners, nats_broker, ws, args=("--once",), MARKER=str(marker))
    first.wait_serving()
    record, signed = hub.dispatch('echo ran >> "$MARKER"')
    job_id = record["job_id"]
    assert wire_obs.wait_terminal(job_id)["event"] == "completed"
    assert first.wait() == 0
    publish_dispatch(hub.client, signed)  # the replay
    second = start_runner(runners, nats_broker, ws, MARKER=str(marker))
    second.wait_serving()
    log = second.wait_log(f"refused dispatch {job_id}: replayed")
    assert len([line for line in log.splitlines() if "refused dispatch" in line]) == 1
    # a valid dispatch afterwards runs: the refusal left the daemon serving
    record2, _ = hub.dispatch('echo ran2 >> "$MARKER"')
    assert wire_obs.wait_terminal(record2["job_id"])["event"] == "completed"
    assert marker.read_text() == "ran\nran2\n"
    assert len([e for e in wire_obs.events(job_id) if e["event"] == "started"]) == 1


def test_s5_bad_dispatches_are_refused_and_the_runner_keeps_serving(nats_broker, tmp_path, hub, wire_obs,
                                                                    runners):
    """§5 refusals, one line each: malformed, bad sig, expired, a seal that does not open;
    another session's dispatch is ignored silently and stays retained; hostile controls too."""
    marker = tmp_path / "runs.txt"
    ws = tmp_path / "runner"
    runner = start_runner(runners, nats_broker, ws, MARKER=str(marker))
    runner.wait_serving()
    brief = 'echo bad >> "$MARKER"'

    malformed = hub.record()
    hub.publish_raw(malformed["job_id"], b"\xff not json {")
    oversized = hub.record()
    huge = build_dispatch(oversized, brief, hub.keys)
    huge["origin"] = "x" * 900_000  # under the broker's 1 MiB cap, far over the field's
    hub.publish_raw(oversized["job_id"], json.dumps(huge).encode())
    deep = hub.record()
    hub.publish_raw(deep["job_id"], b"[" * 5000 + b"]" * 5000)

    bad_sig = hub.record()
    signed = build_dispatch(bad_sig, brief, hub.keys)
    signed["sig"] = "0" * 64
    hub.publish_raw(bad_sig["job_id"], wire.encode(signed))

    other = crypto.derive_keys("another-secret-0123456789abcdef-xyz")
    sealed_wrong = hub.record()
    forged = build_dispatch(sealed_wrong, brief, crypto.DispatchKeys(seal_key=other.seal_key,
                                                                      sign_key=hub.keys.sign_key))
    hub.publish_raw(sealed_wrong["job_id"], wire.encode(forged))

    wrong_secret = hub.record()
    hub.publish_raw(wrong_secret["job_id"], wire.encode(build_dispatch(wrong_secret, brief, other)))

    expired, _ = hub.dispatch(brief, issued_at=datetime.now(UTC) - timedelta(seconds=FAST.ack_timeout_sec + 120))
    elsewhere, _ = hub.dispatch(brief, session="cpu-box")

    mismatched = hub.record()
    moved = build_dispatch(hub.record(), brief, hub.keys)
    hub.publish_raw(mismatched["job_id"], wire.encode(moved))  # a valid dispatch under another job's topic

    control_topic = names.control_topic(malformed["job_id"], hub.root)
    hub.client.publish(control_topic, b"[1, 2]", retain=True)
    forged_cancel = crypto.sign(wire.Control.cancel(expired["job_id"], 1, "operator").to_dict(), other.sign_key)
    hub.client.publish(names.control_topic(expired["job_id"], hub.root), wire.encode(forged_cancel), retain=True)

    expected = {
        malformed["job_id"]: "malformed",
        oversized["job_id"]: "malformed",
        deep["job_id"]: "malformed",
        bad_sig["job_id"]: "dispatch sig verify failed",
        sealed_wrong["job_id"]: "seal does not open",
        wrong_secret["job_id"]: "dispatch sig verify failed",
        expired["job_id"]: "expired",
        mismatched["job_id"]: "malformed: job_id",
    }
    for job_id, reason in expected.items():
        runner.wait_log(f"refused dispatch {job_id}: {reason}")
    runner.wait_log(f"refused control {malformed['job_id']}: malformed")
    runner.wait_log(f"refused control {expired['job_id']}: control sig verify failed")

    good, _ = hub.dispatch('echo good >> "$MARKER"')
    assert wire_obs.wait_terminal(good["job_id"])["event"] == "completed"
    assert marker.read_text() == "good\n"
    assert runner.proc.poll() is None
    log = runner.log()
    assert elsewhere["job_id"] not in log  # silently ignored
    assert hub.retained_dispatch(nats_broker, elsewhere["job_id"], PATIENCE_S) is not None
    taken = {p.stem for p in (ws / ".mam" / "jobs").glob("*.json")}
    assert taken == {good["job_id"]}
    assert "Traceback" not in log


def test_s11_max_jobs_1_runs_two_dispatches_one_after_the_other(nats_broker, tmp_path, hub, wire_obs, runners):
    """§11 capacity: with --max-jobs 1 the second dispatch stays retained until the
    first job ends, then is taken; both complete."""
    go = tmp_path / "go"
    runner = start_runner(runners, nats_broker, tmp_path / "runner", args=("--max-jobs", "1"), GO=str(go))
    runner.wait_serving()
    first, _ = hub.dispatch('while [ ! -e "$GO" ]; do sleep 0.05; done')
    wait_until(lambda: runner.status(first["job_id"]) == "running", what="the first job to start")
    second, _ = hub.dispatch("true")
    runner.wait_log(f"dispatch {second['job_id']} waits for a free slot")
    assert runner.status(second["job_id"]) is None
    assert hub.retained_dispatch(nats_broker, second["job_id"], PATIENCE_S) is not None
    go.touch()
    assert wire_obs.wait_terminal(first["job_id"])["event"] == "completed"
    assert wire_obs.wait_terminal(second["job_id"])["event"] == "completed"
    order = [(json.loads(m.payload)["job_id"], json.loads(m.payload)["event"]) for m in wire_obs.poll()
             if m.payload and m.topic.endswith("/events")]
    assert order.index((first["job_id"], "completed")) < order.index((second["job_id"], "started"))


def test_s6_cancel_kills_the_agent_tree_and_marks_cancelled(nats_broker, tmp_path, hub, wire_obs, runners):
    """§6: a signed cancel → SIGTERM to the group, SIGKILL of the tree after the grace
    (MAM_CANCEL_GRACE_S=1); `error`/`cancelled` on the wire; the runner's record cancelled."""
    pidfile = tmp_path / "pids"
    runner = start_runner(runners, nats_broker, tmp_path / "runner", exec_cmd=SLEEP_AGENT,
                          SLEEP_AGENT_PIDFILE=str(pidfile))
    runner.wait_serving()
    record, _ = hub.dispatch("3600")
    job_id = record["job_id"]
    pids = [int(p) for p in wait_until(lambda: pidfile.exists() and pidfile.read_text().split(),
                                       what="the sleep-agent pids")]
    try:
        publish_cancel(hub.client, record, hub.keys, "operator")
        wait_until(lambda: all_gone(pids), what="the agent and its grandchild to be gone")
        event = wire_obs.wait_terminal(job_id)
        assert event["event"] == "error" and event["detail"] == "cancelled"
        verify_signed(event, record)
        wait_until(lambda: runner.status(job_id) == "cancelled", what="the runner record to be cancelled")
        assert runner.proc.poll() is None  # the daemon keeps serving
        # the retained cancel is seen again after a restart: ignored for a finished job
        runner.signal(signal.SIGTERM)
        assert runner.wait() == 0
        again = start_runner(runners, nats_broker, tmp_path / "runner", exec_cmd=SLEEP_AGENT)
        again.wait_serving()
        again.signal(signal.SIGTERM)
        assert again.wait() == 0
        assert len(wire_obs.terminal(job_id)) == 1
    finally:
        kill_all(pids)


def test_s6_in_cgroup_mode_cancel_kills_a_child_that_escaped_with_its_environment_cleared(
        nats_broker, tmp_path, hub, wire_obs, runners):
    """§6: the runner says once which mode is in force; with cgroups on, a cancel kills a
    child that double-forked into its own session with no MAM_AGENT_TAG, ignoring SIGTERM."""
    pidfile = tmp_path / "escaped"
    runner = start_runner(runners, nats_broker, tmp_path / "runner")
    runner.wait_serving()
    said = runner.wait_log("cgroups ")
    if "cgroups on: " not in said:
        pytest.skip(next(line for line in said.splitlines() if "cgroups off" in line))
    groups = Path(said.split("a group of its own under ", 1)[1].split()[0])
    assert groups.is_dir()
    record, _ = hub.dispatch(f"( env -i /bin/sh -c 'trap \"\" TERM; exec setsid sleep 1000' </dev/null >/dev/null "
                             f"2>&1 & echo $! > {pidfile}.tmp ); mv {pidfile}.tmp {pidfile}; while :; do sleep 1; done")
    pid = int(wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), what="the escaped child"))
    try:
        publish_cancel(hub.client, record, hub.keys, "operator")
        terminal = wire_obs.wait_terminal(record["job_id"])
        assert terminal["detail"] == "cancelled"
        cpu_s = terminal["data"]["usage"]["cpu_s"]  # the whole job's CPU time, from its group
        assert isinstance(cpu_s, float) and cpu_s >= 0, terminal["data"]
        wait_until(lambda: all_gone([pid]), what="the escaped child to be gone")
        runner.signal(signal.SIGTERM)
        assert runner.wait() == 0
        assert not groups.exists()  # the runner removes its groups when it stops
    finally:
        kill_all([pid])


def test_s11_the_agents_program_runs_only_once_started_is_acknowledged(nats_broker, tmp_path, hub, wire_obs,
                                                                          runners):
    """§11.3: `started` is recorded and acknowledged before the agent's program runs, also
    when (cgroups on) its process was started earlier and held while it joined its groups:
    the program's first step finds the record `running` and `started`'s outbox entry gone."""
    ws = tmp_path / "runner"
    start_runner(runners, nats_broker, ws).wait_serving()
    seen = tmp_path / "seen"
    record, _ = hub.dispatch(f'ls "$MAM_REAL_ROOT/.mam/outbox" > {seen}.outbox; '
                             f'cat "$MAM_REAL_ROOT/.mam/jobs/$JOB_ID.json" > {seen}.record')
    job_id = record["job_id"]
    assert wire_obs.wait_terminal(job_id)["event"] == "completed"
    assert json.loads(Path(f"{seen}.record").read_text())["status"] == "running"
    assert f"{job_id}.1.1.json" not in Path(f"{seen}.outbox").read_text().split()


def test_s6_kill9_of_the_runner_stops_its_agents_at_once(nats_broker, tmp_path, hub, wire_obs, runners):
    """§6 "The daemon's death": after `kill -9` of the runner its deadman helper stops the agent
    tree with no restart: the agent and a child that left its session, ignores SIGTERM and (in
    cgroup mode) cleared its environment. The helper says so in the runner's log and exits;
    a restarted runner then ends the attempt `runner restarted; agent lost`."""
    pidfile = tmp_path / "escaped"
    ws = tmp_path / "runner"
    runner = start_runner(runners, nats_broker, ws)
    runner.wait_serving()
    cgroup_mode = "cgroups on: " in runner.wait_log("cgroups ")
    shell = "env -i /bin/sh" if cgroup_mode else "/bin/sh"  # process-group mode finds it by its tag
    record, _ = hub.dispatch(f"( {shell} -c 'trap \"\" TERM; exec setsid sleep 1000' </dev/null >/dev/null 2>&1 & "
                             f"echo $! > {pidfile}.tmp ); mv {pidfile}.tmp {pidfile}; while :; do sleep 1; done")
    job_id = record["job_id"]
    escaped = int(wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), what="the escaped child"))
    agent_file = ws / ".mam" / "logs" / job_id / "agent.pid"
    agent = wait_until(lambda: agent_file.exists() and json.loads(agent_file.read_text()).get("pid"),
                       what="agent.pid to name the agent")
    helper = next(p for p in psutil.Process(runner.proc.pid).children() if "mam.runner.deadman" in p.cmdline())
    try:
        killed_at = time.monotonic()
        runner.proc.kill()
        runner.wait()
        wait_until(lambda: all_gone([agent, escaped]), what="the agent tree to be gone")
        print(f"\nkill -9 of the runner -> its agent tree gone in {time.monotonic() - killed_at:.2f} s "
              f"({'cgroup' if cgroup_mode else 'process-group'} mode)")
        wait_until(lambda: not helper.is_running() or helper.status() == psutil.STATUS_ZOMBIE,
                   what="the helper to exit")
        assert f"stopping the agents of {job_id}-{record['attempt_id']}" in runner.log()
        again = start_runner(runners, nats_broker, ws, args=("--replace",))
        again.wait_serving()
        terminal = wire_obs.wait_terminal(job_id)
        assert (terminal["event"], terminal["detail"]) == ("error", "runner restarted; agent lost")
    finally:
        kill_all([agent, escaped])


def test_s11_exit_code_and_agent_own_terminal_event(nats_broker, tmp_path, hub, wire_obs, runners):
    """§11 step 5: exit 3 → `error` with data.exit_code 3; an agent that publishes its own
    `completed` and exits 0 → exactly one terminal event on the wire."""
    runner = start_runner(runners, nats_broker, tmp_path / "runner", args=("--max-jobs", "2"))
    runner.wait_serving()
    failing, _ = hub.dispatch("exit 3")
    own, _ = hub.dispatch('eval "$MAM_PUBLISH_CMD --event completed --detail done-by-agent"')
    event = wire_obs.wait_terminal(failing["job_id"])
    assert event["event"] == "error" and event["data"]["exit_code"] == 3
    assert event["detail"] == "agent exited with code 3"
    assert runner.registry.get(failing["job_id"])["exit_code"] == 3
    runner.wait_log(f"job {own['job_id']} already ended")
    terminal = wire_obs.terminal(own["job_id"])
    assert [(e["event"], e["detail"]) for e in terminal] == [("completed", "done-by-agent")]
    verify_signed(terminal[0], own)
    assert runner.status(own["job_id"]) == "completed"


def test_s7_sigterm_drains_then_second_signal_cancels(nats_broker, tmp_path, hub, wire_obs, runners):
    """§7/§11: SIGTERM → presence draining, the running job completes, nothing new is
    taken, exit 0 with presence offline. A second SIGTERM cancels the running job."""
    go = tmp_path / "go"
    ws = tmp_path / "runner"
    runner = start_runner(runners, nats_broker, ws, args=("--max-jobs", "2"), GO=str(go))
    runner_id = runner.wait_serving()
    first, _ = hub.dispatch('while [ ! -e "$GO" ]; do sleep 0.05; done')
    wait_until(lambda: runner.status(first["job_id"]) == "running", what="the job to start")
    runner.signal(signal.SIGTERM)
    draining = wire_obs.wait_presence("draining", runner_id)
    assert draining["running"] == [first["job_id"]]
    late, _ = hub.dispatch("true")
    runner.wait_log(f"dispatch {late['job_id']} left retained: this runner is draining")
    go.touch()
    assert wire_obs.wait_terminal(first["job_id"])["event"] == "completed"
    assert runner.wait() == 0
    wire_obs.wait_presence("offline", runner_id)
    assert runner.status(late["job_id"]) is None
    assert hub.retained_dispatch(nats_broker, late["job_id"], PATIENCE_S) is not None

    # second signal: cancel (clear the waiting dispatch first so it is not taken)
    hub.client.publish(names.dispatch_topic(late["job_id"], hub.root), b"", retain=True)
    pidfile = tmp_path / "pids"
    again = start_runner(runners, nats_broker, ws, exec_cmd=SLEEP_AGENT, SLEEP_AGENT_PIDFILE=str(pidfile))
    again_id = again.wait_serving()
    job, _ = hub.dispatch("3600")
    pids = [int(p) for p in wait_until(lambda: pidfile.exists() and pidfile.read_text().split(),
                                       what="the sleep-agent pids")]
    try:
        again.signal(signal.SIGTERM)
        wire_obs.wait_presence("draining", again_id)
        again.signal(signal.SIGTERM)
        assert again.wait(PATIENCE_S) == 0
        event = wire_obs.wait_terminal(job["job_id"])
        assert (event["event"], event["detail"]) == ("error", "cancelled")
        assert again.status(job["job_id"]) == "cancelled"
        assert all_gone(pids)
        wire_obs.wait_presence("offline", again_id)
    finally:
        kill_all(pids)


def test_s7_kill9_last_will_offline_and_heartbeat_stops(broker, tmp_path, runners):
    """§7 Last Will and §12 from the daemon (§17), on both brokers: a daemon job's beats come
    from the daemon itself (no timer process, no timer pid file), each with the attempt's
    identity; after kill -9 of the runner the broker publishes the signed `offline` presence,
    and for one period and a margin after it no beat arrives and none is recorded."""
    observer, hub = Wire(broker), Hub(broker, tmp_path)
    pidfile = tmp_path / "pids"
    ws = tmp_path / "runner"
    runner = start_runner(runners, broker, ws, exec_cmd=SLEEP_AGENT, SLEEP_AGENT_PIDFILE=str(pidfile))
    pids: list[int] = []
    try:
        runner_id = runner.wait_serving()
        record, _ = hub.dispatch("3600")
        job_id = record["job_id"]
        pids = [int(p) for p in wait_until(lambda: pidfile.exists() and pidfile.read_text().split(),
                                           what="the sleep-agent pids")]
        wait_until(lambda: len(heartbeat_beats(observer.events(job_id))) >= 2, what="two heartbeat beats")
        for beat in heartbeat_beats(observer.events(job_id)):
            verify_signed(beat, record)
        # one process beats: the daemon; every process it started belongs to the agent's tree,
        # but for its deadman helper (§6), which never beats
        agent_tree = {pids[0], *(c.pid for c in psutil.Process(pids[0]).children(recursive=True))}
        started = [c for c in psutil.Process(runner.proc.pid).children(recursive=True)
                   if "mam.runner.deadman" not in c.cmdline()]
        assert {c.pid for c in started} <= agent_tree
        assert not names.heartbeat_path(ws, job_id, "pid").exists()
        runner.proc.kill()
        runner.wait()
        at_death = runner.registry.get(job_id)["last_seq"]
        will = observer.wait_presence("offline", runner_id)
        crypto.verify(will, hub.keys.sign_key)
        assert will["will"] is True  # the hub shows it `lost`, not stopped (§7)
        period_s = FAST.heartbeat_sec
        quiet_until = time.monotonic() + period_s + QUIET_S  # an absence check: one period and a margin
        while time.monotonic() < quiet_until:
            assert max(e["seq"] for e in observer.events(job_id)) <= at_death, "a beat after the runner died"
            time.sleep(POLL_INTERVAL_S)
        assert runner.registry.get(job_id)["last_seq"] == at_death  # nothing recorded after the death
        assert runner.status(job_id) == "running"  # nobody published a terminal event
    finally:
        kill_all(pids)
        observer.close()
        hub.close()


def test_s7_second_runner_same_session_refused_unless_replace(nats_broker, tmp_path, wire_obs, runners):
    """§7: a runner that finds another live runner online under its session exits 64
    with one clear line; --replace starts anyway."""
    first = start_runner(runners, nats_broker, tmp_path / "a")
    first_id = first.wait_serving()
    wire_obs.wait_presence("online", first_id)
    second = start_runner(runners, nats_broker, tmp_path / "b")
    assert second.wait(PATIENCE_S) == 64
    errors = [line for line in second.log().splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1 and "held by another live runner" in errors[0] and first_id in errors[0]
    assert wire_obs.presences()[-1]["runner_id"] == first_id  # the refused runner published nothing
    third = start_runner(runners, nats_broker, tmp_path / "c", args=("--replace",))
    third_id = third.wait_serving()
    assert third_id != first_id
    wire_obs.wait_presence("online", third_id)
    # the replaced runner drains and leaves the presence to the new one (no `offline` over it)
    first.wait_log("took over this session")
    assert first.wait(PATIENCE_S) == 0
    assert third.proc.poll() is None
    assert [p["runner_id"] for p in wire_obs.presences()][-1] == third_id
    assert not [p for p in wire_obs.presences() if p["runner_id"] == first_id and p["status"] == "offline"]


def test_lifecycle_serve_once_shutdown_idempotent(nats_broker, tmp_path, wire_obs):
    """STYLE lifecycle: no side effects in __init__, serve() refuses a second start,
    shutdown() is idempotent and ends serve() with presence offline (§7)."""


    ws = tmp_path / "runner"
    options = options_from_cli(session=SESSION, exec_cmd=SHELL_AGENT, workspace=str(ws), workdir=None,
                               max_jobs=2, once=False, replace=False, environ=clean_env())
    runner = Runner(options, config=nats_broker.config(), trust=V1Trust(crypto.derive_keys(TEST_SECRET)))
    assert runner.client is None and not ws.exists()
    runner.shutdown()  # before serve: a no-op
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(runner.serve()))
    thread.start()
    try:
        wire_obs.wait_presence("online", runner.runner_id)
        with pytest.raises(MamError, match="already"):
            runner.serve()
        assert thread.is_alive() and runner.client.connected.is_set()
    finally:
        runner.shutdown(timeout_s=PATIENCE_S)
        runner.shutdown(timeout_s=1)
        thread.join(PATIENCE_S)
    assert result == [0]
    assert wire_obs.wait_presence("offline", runner.runner_id)["max_jobs"] == 2


@pytest.mark.parametrize("args, needle", [
    (["--session", "gpu.box", "--exec", SHELL_AGENT], "session name 'gpu.box' is invalid"),
    (["--session", "a/b", "--exec", SHELL_AGENT], "session name 'a/b' is invalid"),
    (["--session", "+", "--exec", SHELL_AGENT], "session name '+' is invalid"),
    (["--session", "", "--exec", SHELL_AGENT], "session name '' is invalid"),
    (["--session", "x" * 64, "--exec", SHELL_AGENT], "is invalid"),
    (["--session", "ok", "--exec", ""], "--exec '' is empty"),
    (["--session", "ok", "--exec", "   "], "is empty"),
    (["--session", "ok", "--exec", "'unbalanced"], "cannot be split"),
    (["--session", "ok", "--exec", "/nonexistent/agent"], "not found"),
    (["--session", "ok", "--exec", SHELL_AGENT, "--max-jobs", "0"], "--max-jobs 0 is invalid"),
    (["--session", "ok", "--exec", SHELL_AGENT, "--max-jobs", "65"], "--max-jobs 65 is invalid"),
    (["--session", "ok", "--exec", SHELL_AGENT, "--workdir", "/proc/forbidden/x"], "--workdir"),
])
def test_s9_bad_cli_input_exits_64_with_one_line(tmp_path, args, needle):
    """§1, §9: bad arguments → exit 64, one line on stderr, nothing written."""
    ws = tmp_path / "ws"
    ws.mkdir()
    done = subprocess.run([*MAM_RUNNER, "run", *args, "--workspace", str(ws)], env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 64, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], done.stderr
    assert not (ws / ".mam").exists()


def test_s5_missing_dispatch_secret_exits_64(tmp_path):
    """§5, §13: `run` needs MAM_DISPATCH_SECRET; without it one line and exit 64."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / ".mam.env").write_text("MQTT_BROKER=127.0.0.1\nMQTT_PORT=1\n")
    done = subprocess.run([*MAM_RUNNER, "run", "--session", "ok", "--exec", SHELL_AGENT, "--workspace", str(ws)],
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 64
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "MAM_DISPATCH_SECRET" in done.stderr


def test_s8_redispatched_attempt_runs_after_the_cancelled_one(nats_broker, tmp_path, hub, wire_obs, runners):
    """§5/§8: attempt 1 cancelled, the hub redispatches attempt 2 (new token): the runner
    takes it although it holds attempt 1; re-publishing attempt 1 is refused as replayed."""
    go = tmp_path / "go"
    runner = start_runner(runners, nats_broker, tmp_path / "runner", GO=str(go))
    runner.wait_serving()
    record, first = hub.dispatch('while [ ! -e "$GO" ]; do sleep 0.05; done')
    job_id = record["job_id"]
    wait_until(lambda: runner.status(job_id) == "running", what="attempt 1 to start")
    hub.registry.request_cancel(job_id)
    publish_cancel(hub.client, record, hub.keys, "operator")
    wait_until(lambda: runner.status(job_id) == "cancelled", what="attempt 1 cancelled")
    second = hub.registry.redispatch(job_id)
    go.touch()
    publish_dispatch(hub.client, build_dispatch(second, 'echo two', hub.keys))
    wait_until(lambda: any(e["event"] == "completed" and e["data"]["attempt_id"] == 2
                           for e in wire_obs.events(job_id)), what="attempt 2 to complete")
    local = runner.registry.get(job_id)
    assert (local["attempt_id"], local["status"]) == (2, "completed")
    publish_dispatch(hub.client, first)
    runner.wait_log(f"refused dispatch {job_id}: replayed: attempt 1")


# ------------------------------------------------------------------ orphans of a killed runner (§6)

class Arrivals:
    """A subscriber thread that notes, the moment each terminal event arrives, whether
    that job's agent processes were already gone (§6: stopped BEFORE `error` is published)."""

    def __init__(self, broker: Any, procs: dict[str, list[psutil.Process]]) -> None:
        self.root = broker.topic_root
        self.procs = procs
        self.seen: dict[str, tuple[dict[str, Any], bool]] = {}
        self.client = MqttClient(broker.config(), "observer")
        self.client.connect()
        self.client.subscribe([(names.events_topic(job_id, self.root), 1) for job_id in procs])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                message = self.client.messages.get(timeout=0.05)
            except queue.Empty:
                continue
            if not message.payload:
                continue
            event = json.loads(message.payload)
            if event["event"] in ("completed", "error") and event["job_id"] not in self.seen:
                gone = all_gone([p.pid for p in self.procs[event["job_id"]]])
                self.seen[event["job_id"]] = (event, gone)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()


def alive(procs: list[psutil.Process]) -> bool:
    return all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)


def test_s6_orphans_of_a_killed_runner_are_stopped_before_their_terminal_event(nats_broker, tmp_path, hub,
                                                                                runners):
    """§6/§11 after `kill -9` of the runner (agents reparented to init, still running): the
    restarted runner stops each orphaned agent tree (SIGTERM, SIGKILL of the grandchild that
    ignores it) BEFORE publishing its terminal event: `error`/`cancelled` (record cancelled)
    for the job the hub cancelled meanwhile, `runner restarted; agent stopped` for a live one,
    `...; agent lost` for one whose agent died or whose agent.pid is garbage (hostile
    file); broker.env (MQTT_PASSWORD) and agent.pid are removed; the slots free up."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    ws = tmp_path / "runner"
    exec_cmd = f"bash -c 'SLEEP_AGENT_PIDFILE=\"$PIDDIR/$MAM_JOB_ID\" exec {SLEEP_AGENT}'"
    first = start_runner(runners, nats_broker, ws, exec_cmd=exec_cmd, args=("--max-jobs", "4"),
                         PIDDIR=str(piddir))
    first.wait_serving()
    jobs = {name: hub.dispatch("3600")[0] for name in ("cancelled", "alive", "lost", "garbled")}
    logs = {name: ws / ".mam" / "logs" / record["job_id"] for name, record in jobs.items()}
    procs: dict[str, list[psutil.Process]] = {}
    try:
        for name, record in jobs.items():
            pidfile = piddir / record["job_id"]
            pids = wait_until(lambda: pidfile.exists() and pidfile.read_text().split(), what=f"{name} agent pids")
            procs[name] = [psutil.Process(int(p)) for p in pids]
            wait_until(lambda: json.loads((logs[name] / "agent.pid").read_text()).get("pid") == int(pids[0]),
                       what=f"{name} agent.pid to name the agent")
            assert (logs[name] / "agent.pid").stat().st_mode & 0o777 == 0o600
            assert (logs[name] / "broker.env").exists()
        # the runner and its deadman helper both die (say, the OOM killer's pick): the agents run on
        helper = next(p for p in psutil.Process(first.proc.pid).children() if "mam.runner.deadman" in p.cmdline())
        helper.kill()
        first.proc.kill()
        first.wait()
        wait_until(lambda: all(p.ppid() != first.proc.pid for ps in procs.values() for p in ps),
                   what="the agents to be reparented")
        assert all(alive(ps) for ps in procs.values())  # kill -9 of the runner left them running
        for name in ("lost", "garbled"):
            kill_all([p.pid for p in procs[name]])
            wait_until(lambda: all_gone([p.pid for p in procs[name]]), what=f"the {name} agent to die")
        (logs["garbled"] / "agent.pid").write_bytes(b"\xff{not json" * 1000)
        publish_cancel(hub.client, jobs["cancelled"], hub.keys, "operator")  # retained, as the hub does
        arrivals = Arrivals(nats_broker, {record["job_id"]: procs[name] for name, record in jobs.items()})
        try:
            second = start_runner(runners, nats_broker, ws, exec_cmd=exec_cmd, args=("--replace", "--max-jobs", "4"),
                                  PIDDIR=str(piddir))
            second.wait_serving()
            wait_until(lambda: len(arrivals.seen) == 4, what="four terminal events")
        finally:
            arrivals.close()
        expected = {"cancelled": ("cancelled", "cancelled"), "alive": ("runner restarted; agent stopped", "error"),
                    "lost": ("runner restarted; agent lost", "error"),
                    "garbled": ("runner restarted; agent lost", "error")}
        for name, (detail, status) in expected.items():
            record = jobs[name]
            event, gone_on_arrival = arrivals.seen[record["job_id"]]
            assert gone_on_arrival, f"{name}: the agent still ran when its terminal event arrived"
            assert (event["event"], event["detail"]) == ("error", detail), name
            assert "exit_code" not in event["data"]
            verify_signed(event, record)
            wait_until(lambda: second.status(record["job_id"]) == status, what=f"the {name} record to be {status}")
            assert not (logs[name] / "broker.env").exists(), name
            assert not (logs[name] / "agent.pid").exists(), name
        log = second.log()
        assert "agent.pid is unreadable (larger than 4096 bytes)" in log
        assert "Traceback" not in log and "had no supervisor here" not in log
        # the orphans' slots are free again: a new job runs to completion
        fresh, _ = hub.dispatch("0")
        wire = Wire(nats_broker)
        try:
            assert wire.wait_terminal(fresh["job_id"])["event"] == "completed"
        finally:
            wire.close()
        assert second.proc.poll() is None
    finally:
        kill_all([p.pid for ps in procs.values() for p in ps])


def test_s6_a_job_of_another_live_runner_in_the_same_workspace_is_left_alone(nats_broker, tmp_path, hub,
                                                                             wire_obs, runners):
    """Two runners (two sessions) sharing one workspace: the second one's start-up finds the
    first one's running job, whose runner is alive, and neither stops nor ends it."""
    pidfile = tmp_path / "pids"
    ws = tmp_path / "runner"
    first = start_runner(runners, nats_broker, ws, exec_cmd=SLEEP_AGENT, SLEEP_AGENT_PIDFILE=str(pidfile))
    first.wait_serving()
    record, _ = hub.dispatch("3600")
    pids = [int(p) for p in wait_until(lambda: pidfile.exists() and pidfile.read_text().split(),
                                       what="the sleep-agent pids")]
    try:
        wait_until(lambda: (ws / ".mam" / "logs" / record["job_id"] / "agent.pid").exists(), what="agent.pid")
        other = start_runner(runners, nats_broker, ws, session="cpu-box", exec_cmd=SLEEP_AGENT)
        other.wait_serving()
        publish_cancel(hub.client, record, hub.keys, "operator")  # both see it; only the owner acts
        event = wire_obs.wait_terminal(record["job_id"])
        assert (event["event"], event["detail"]) == ("error", "cancelled")
        first.wait_log(f"job {record['job_id']}: agent cancelled")
        assert "has no supervisor" not in other.log()
        assert len(wire_obs.terminal(record["job_id"])) == 1
    finally:
        kill_all(pids)


def test_s6_retained_cancel_ends_a_record_left_without_identity(nats_broker, tmp_path, hub, wire_obs, runners):
    """A pending record of another session with no agent.pid (its runner died before
    recording itself) is not judged at start-up; the hub's signed cancel for that attempt
    ends it: `error`/`cancelled`, record cancelled."""
    ws = tmp_path / "runner"
    record = hub.record(session="cpu-box")
    Registry(ws).mirror(job_id=record["job_id"], session="cpu-box", attempt_id=1,
                        dispatch_token=record["dispatch_token"], auth_token=record["auth_token"], contract=FAST)
    runner = start_runner(runners, nats_broker, ws)
    runner.wait_serving()
    assert "has no supervisor" not in runner.log()  # adoption at start-up is logged before serving
    assert runner.status(record["job_id"]) == "pending"
    publish_cancel(hub.client, record, hub.keys, "operator")
    event = wire_obs.wait_terminal(record["job_id"])
    assert (event["event"], event["detail"]) == ("error", "cancelled")
    verify_signed(event, record)
    wait_until(lambda: runner.status(record["job_id"]) == "cancelled", what="the record to be cancelled")
    assert "no agent identity recorded" in runner.log()


# ------------------------------------------------------------------ the hub's registry is not a runner's (§8)

def test_s8_runner_refuses_to_start_in_the_hubs_registry(nats_broker, tmp_path):
    """§8: hub and runner in one workspace (no --workspace) → the runner would refuse every
    dispatch as its own hub record; it refuses to start instead: exit 64, one line."""
    ws = tmp_path / "shared"
    write_env_for(nats_broker, ws)
    job_id = Registry(ws).register(session=SESSION, contract=FAST)["job_id"]
    done = subprocess.run([*MAM_RUNNER, "run", "--session", SESSION, "--exec", SHELL_AGENT, "--workspace", str(ws)],
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 64, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("ERROR: ") and "hub's registry" in lines[0] and job_id in lines[0]
    assert "mam-runner run --workspace DIR" in lines[0]
    assert Registry(ws).get(job_id)["status"] == "pending"


def test_s8_dispatch_of_a_hub_record_here_is_refused_by_name_not_as_replayed(nats_broker, tmp_path, hub,
                                                                             runners):
    """§8 defensively: a hub that starts dispatching from the runner's workspace after the
    runner started gets one error line naming the cause; the hub's record is untouched."""
    ws = tmp_path / "runner"
    runner = start_runner(runners, nats_broker, ws)
    runner.wait_serving()
    shared = Registry(ws)
    record = shared.register(session=SESSION, contract=FAST)
    publish_dispatch(hub.client, build_dispatch(record, "true", hub.keys))
    log = runner.wait_log(f"refused dispatch {record['job_id']}: ")
    line = next(line for line in log.splitlines() if f"refused dispatch {record['job_id']}" in line)
    assert "hub's registry" in line and "--workspace" in line and "replayed" not in line
    local = shared.get(record["job_id"])
    assert (local["role"], local["status"], local["attempt_id"]) == ("hub", "pending", 1)
    assert hub.retained_dispatch(nats_broker, record["job_id"], PATIENCE_S) is not None  # not taken, not cleared
    assert runner.proc.poll() is None


# ------------------------------------------------------------------ leftovers of a finished agent (§11)

LEFTOVER_BRIEF = ("(trap '' TERM; exec sleep 62) </dev/null >/dev/null 2>&1 & echo $! > \"$PIDF.tmp\"; "
                  "mv \"$PIDF.tmp\" \"$PIDF\"\n"
                  "while [ ! -e \"$GO\" ]; do sleep 0.05; done\n")


@pytest.mark.parametrize("how", ["exit-0", "kill-9-of-the-leader"])
def test_s11_leftover_processes_are_stopped_before_the_terminal_event(nats_broker, tmp_path, hub, runners, how):
    """§11 step 5 (like CI runners): a background child that ignores SIGTERM outlives its
    leader (exit 0, or `kill -9` of the leader); the runner stops it (SIGTERM, SIGKILL after
    MAM_CANCEL_GRACE_S) BEFORE the terminal event is on the wire, and logs how many."""
    pidf, go = tmp_path / "child.pid", tmp_path / "go"
    ws = tmp_path / "runner"
    runner = start_runner(runners, nats_broker, ws, PIDF=str(pidf), GO=str(go))
    runner.wait_serving()
    record, _ = hub.dispatch(LEFTOVER_BRIEF)
    job_id = record["job_id"]
    agent_file = ws / ".mam" / "logs" / job_id / "agent.pid"
    leader = wait_until(lambda: agent_file.exists() and json.loads(agent_file.read_text()).get("pid"),
                        what="agent.pid to name the agent")
    child = psutil.Process(int(wait_until(lambda: pidf.exists() and pidf.read_text().strip(), what="the child")))
    arrivals = Arrivals(nats_broker, {job_id: [child]})
    try:
        if how == "exit-0":
            go.touch()
        else:
            os.kill(leader, signal.SIGKILL)
        wait_until(lambda: job_id in arrivals.seen, what="the terminal event")
    finally:
        arrivals.close()
        kill_all([child.pid])
    event, gone_on_arrival = arrivals.seen[job_id]
    assert gone_on_arrival, "the agent's background child still ran when its terminal event arrived"
    if how == "exit-0":
        assert (event["event"], event["data"]["exit_code"]) == ("completed", 0)
    else:
        assert (event["event"], event["detail"]) == ("error", "agent killed by signal 9")
    verify_signed(event, record)
    log = runner.wait_log(f"job {job_id}: ")
    assert any(f"job {job_id}: " in line and "leftover process(es) of the agent stopped" in line
               and not line.split(f"job {job_id}: ", 1)[1].startswith("0 ") for line in log.splitlines()), log
    assert runner.proc.poll() is None


def test_s5_contract_timeout_sec_is_enforced_by_the_runner(nats_broker, tmp_path, hub, runners):
    """§5 `timeout_sec` (wall clock) on the runner, with no hub to cancel: after 2 s the
    agent tree is stopped like a cancel (the grandchild ignores SIGTERM: SIGKILL after the
    grace) BEFORE `error`/`timed out after 2 s` is on the wire; record `error`; the
    runner keeps serving."""
    pidfile = tmp_path / "pids"
    runner = start_runner(runners, nats_broker, tmp_path / "runner", exec_cmd=SLEEP_AGENT,
                          SLEEP_AGENT_PIDFILE=str(pidfile))
    runner.wait_serving()
    short = Contract(heartbeat_sec=1, heartbeat_misses=10, ack_timeout_sec=60, timeout_sec=2)
    record, _ = hub.dispatch("3600", contract=short)
    job_id = record["job_id"]
    pids = [int(p) for p in wait_until(lambda: pidfile.exists() and pidfile.read_text().split(),
                                       what="the sleep-agent pids")]
    arrivals = Arrivals(nats_broker, {job_id: [psutil.Process(pid) for pid in pids]})
    try:
        wait_until(lambda: job_id in arrivals.seen, what="the terminal event")
    finally:
        arrivals.close()
        kill_all(pids)
    event, gone_on_arrival = arrivals.seen[job_id]
    assert gone_on_arrival, "the agent still ran when `timed out` arrived"
    assert (event["event"], event["detail"]) == ("error", "timed out after 2 s")
    assert event["data"]["exit_code"] == 128 + signal.SIGTERM  # the stop's: the agent died of SIGTERM
    verify_signed(event, record)
    wait_until(lambda: runner.status(job_id) == "error", what="the runner record to be error")
    runner.wait_log(f"job {job_id}: agent stopped: timed out after 2 s")
    assert runner.proc.poll() is None


# ------------------------------------------------------------------ cancel tombstones (§5, §6)

def test_s6_replayed_dispatch_of_a_cancelled_attempt_never_runs(nats_broker, tmp_path, hub, wire_obs, runners):
    """The replay attack: the hub dispatches to a session with no runner online, an attacker
    captures the retained dispatch, the hub cancels (retained signed control; dispatch
    cleared), the attacker re-publishes the captured dispatch retained, then a runner starts.
    The runner keeps the verified cancel of the unknown job as a tombstone and refuses the
    dispatch (one line); the agent never runs; a valid dispatch afterwards still runs."""

    marker = tmp_path / "runs.txt"
    record, captured = hub.dispatch('echo replayed >> "$MARKER"')  # nobody online: stays retained
    job_id = record["job_id"]
    hub.registry.request_cancel(job_id)
    publish_cancel(hub.client, record, hub.keys, "operator")
    clear_dispatch(hub.client, job_id)
    attacker = MqttClient(nats_broker.config(), "attacker")
    attacker.connect()
    try:
        publish_dispatch(attacker, captured)  # the replay, retained
    finally:
        attacker.close()
    assert hub.retained_dispatch(nats_broker, job_id, PATIENCE_S) is not None
    runner = start_runner(runners, nats_broker, tmp_path / "runner", MARKER=str(marker))
    runner.wait_serving()
    log = runner.wait_log(f"refused dispatch {job_id}: cancelled: attempt 1 was cancelled by the hub")
    assert len([line for line in log.splitlines() if "refused dispatch" in line]) == 1
    valid, _ = hub.dispatch('echo valid >> "$MARKER"')
    assert wire_obs.wait_terminal(valid["job_id"])["event"] == "completed"
    assert marker.read_text() == "valid\n"  # the replayed agent never ran
    assert wire_obs.events(job_id) == []  # no `started` either
    assert runner.status(job_id) is None  # never mirrored
    assert runner.proc.poll() is None


def test_s7_presence_is_refreshed_while_idle(nats_broker, tmp_path, wire_obs, runners):
    """§7: an idle runner republishes its signed presence every MAM_PRESENCE_REFRESH_S,
    so the hub can call a presence that stopped being refreshed (a dead host, a replay) stale."""
    runner = start_runner(runners, nats_broker, tmp_path / "runner", MAM_PRESENCE_REFRESH_S="1")
    runner_id = runner.wait_serving()
    wait_until(lambda: len([p for p in wire_obs.presences() if p["runner_id"] == runner_id
                            and p["status"] == "online"]) >= 3, what="three online presences from an idle runner")
    stamps = [p["timestamp"] for p in wire_obs.presences() if p["runner_id"] == runner_id]
    assert stamps == sorted(stamps) and stamps[-1] > stamps[0]


def test_s11_agent_that_reported_its_end_but_runs_on_is_stopped(nats_broker, tmp_path, hub, wire_obs, runners):
    """§11 step 5: an agent that published its own `completed` and kept running is stopped
    after MAM_AGENT_LINGER_S, so its slot comes back; still exactly one terminal event."""
    runner = start_runner(runners, nats_broker, tmp_path / "runner", MAM_AGENT_LINGER_S="1")
    runner.wait_serving()
    nap = f"300.{os.getpid()}"  # this test's own sleep: other test runs on the machine have theirs
    lingering, _ = hub.dispatch(f'eval "$MAM_PUBLISH_CMD --event completed --detail reported"\nsleep {nap}')
    wire_obs.wait_terminal(lingering["job_id"])
    runner.wait_log(f"job {lingering['job_id']}: the agent reported its end but ran on")
    following, _ = hub.dispatch("true")  # --max-jobs 1: runs only once the slot is back
    assert wire_obs.wait_terminal(following["job_id"])["event"] == "completed"
    assert [e["event"] for e in wire_obs.terminal(lingering["job_id"])] == ["completed"]
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", nap]]
