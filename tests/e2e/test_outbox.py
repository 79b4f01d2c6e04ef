"""The runner's outbox over real brokers and real processes (PROTOCOL §17):
a broker outage of any length loses nothing a runner wrote.

- Fault 1: an agent's own terminal event, published while the broker is down
  on the publisher's own connection (no runner socket, v1: `publish` exits 2),
  reaches the hub after the broker is back: the runner daemon re-sends it from
  `<root>/.mam/outbox/`.
- Without an outage: a `publish` that failed on its own (the daemon stayed
  connected) is sent by the daemon's next sweep.
- A `--once` runner whose job ended during an outage waits for the broker before it exits,
  and sends the terminal: nothing is left for a next start.
- Fault 10: mosquitto SIGKILLed before it saved its retained messages gets the
  retained state of a recently finished job back: the daemon re-publishes the
  acknowledged terminal entries it keeps after every reconnect (same seq).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from harness import runnersim
from harness.brokers import MosquittoBroker
from harness.jobkit import WatchProcess
from harness.runnersim import MAM_ORCH, hub_env, hub_workspace, orch, retained, runner_log
from harness.waiting import PATIENCE_S, wait_until

from mam.shared.protocol import names
from mam.shared.store.registry import Registry

pytestmark = [pytest.mark.broker, pytest.mark.e2e]

ACK_TIMEOUT = str(int(PATIENCE_S))  # a real runner process takes the job: as long as a busy machine needs
SESSION = "gpu-box"
# K × N far above the outage (and both reconnect backoffs): the hub's verdict must come from the event
OUTAGE_HEARTBEAT = ("--heartbeat", "10", "--heartbeat-misses", "12")
AUTOSAVE_S = 3600  # mosquitto saves retained messages this seldom: a SIGKILL loses the job's state


def start_runner(broker, workspace: Path, *extra: str, **env: str) -> subprocess.Popen:
    """`mam-runner run` for SESSION with the shell agent (harness.runnersim.start_runner)."""
    return runnersim.start_runner(broker, workspace, SESSION, *extra, **env)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(PATIENCE_S)


def outbox_files(workspace: Path) -> list[str]:
    folder = names.outbox_dir(workspace)
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def retained_state(broker, job_id: str) -> dict | None:
    payload = retained(broker, names.state_topic(job_id, broker.topic_root), 0.3)
    return json.loads(payload) if payload else None


def test_s17_fault1_an_agents_terminal_event_published_during_an_outage_reaches_the_hub(broker, tmp_path):
    """On both brokers: the agent runs `$MAM_PUBLISH_CMD --event completed`
    while the broker is down; `publish` exits 2 and leaves its outbox entry; after the broker
    is back the runner daemon re-sends it and the hub closes the job `completed` (exit 0)."""
    hub = hub_workspace(broker, tmp_path)
    runner_ws = tmp_path / "runner"
    gate, rc_file = tmp_path / "gate", tmp_path / "publish.rc"
    runner = start_runner(broker, runner_ws, GATE=str(gate), RC=str(rc_file))
    brief = ('while [ ! -e "$GATE" ]; do sleep 0.05; done; '
             '{ MAM_RUNNER_SOCKET= eval "$MAM_PUBLISH_CMD --event completed --detail by-the-agent"; '
             'echo $? > "$RC.tmp"; '
             'mv "$RC.tmp" "$RC"; } || true')
    dispatch = WatchProcess([*MAM_ORCH, "dispatch", "--session", SESSION, "--brief", brief, *OUTAGE_HEARTBEAT,
                             "--ack-timeout", ACK_TIMEOUT, "--workspace", str(hub)], hub_env())
    try:
        job_id = wait_until(lambda: (dispatch.events("started") or [None])[0], what="started at the hub")["job_id"]
        broker.kill()
        gate.touch()
        wait_until(rc_file.exists, what="the agent's publish to give up")
        assert rc_file.read_text().strip() == "2", runner_log(runner_ws)  # transport failure, on disk (§9)
        pending = [n for n in outbox_files(runner_ws) if n.startswith(job_id) and "kept" not in n]
        assert pending, outbox_files(runner_ws)
        broker.restart()
        assert dispatch.wait(PATIENCE_S) == 0, dispatch.log() + runner_log(runner_ws)
    finally:
        dispatch.kill()
        stop(runner)
    (done,) = dispatch.events("completed")
    assert done["detail"] == "by-the-agent"
    assert Registry(hub).get(job_id)["status"] == "completed"
    assert Registry(runner_ws).get(job_id)["status"] == "completed"
    assert "re-sent" in runner_log(runner_ws)
    left = [n for n in outbox_files(runner_ws) if not n.endswith(names.OUTBOX_KEPT_SUFFIX)]
    assert left == [], left  # everything acknowledged; only the kept terminal entry stays


def test_s17_a_once_runner_whose_job_ended_in_an_outage_sends_the_terminal_before_it_exits(broker, tmp_path):
    """On both brokers: the broker is killed, then the job ends; the `--once` runner, its job
    done, says it waits for the broker, and once the broker is back sends the terminal, exits 0
    and leaves nothing pending; the hub ends the job `completed`."""
    hub = hub_workspace(broker, tmp_path)
    runner_ws = tmp_path / "runner"
    gate = tmp_path / "gate"
    runner = start_runner(broker, runner_ws, "--once", GATE=str(gate))
    dispatch = WatchProcess([*MAM_ORCH, "dispatch", "--session", SESSION, "--brief",
                             'while [ ! -e "$GATE" ]; do sleep 0.05; done', *OUTAGE_HEARTBEAT,
                             "--ack-timeout", ACK_TIMEOUT, "--workspace", str(hub)], hub_env())
    try:
        job_id = wait_until(lambda: (dispatch.events("started") or [None])[0], what="started at the hub")["job_id"]
        broker.kill()
        gate.touch()
        wait_until(lambda: "unsent event(s) before exiting" in runner_log(runner_ws) or runner.poll() is not None,
                   what="the runner to wait for the broker")
        assert runner.poll() is None, runner_log(runner_ws)
        assert Registry(runner_ws).get(job_id)["status"] == "completed"
        broker.restart()
        assert runner.wait(PATIENCE_S) == 0, runner_log(runner_ws)
        assert dispatch.wait(PATIENCE_S) == 0, dispatch.log() + runner_log(runner_ws)
    finally:
        dispatch.kill()
        stop(runner)
    assert Registry(hub).get(job_id)["status"] == "completed"
    assert [n for n in outbox_files(runner_ws) if not n.endswith(names.OUTBOX_KEPT_SUFFIX)] == []
    assert "stay in" not in runner_log(runner_ws)


def test_s17_a_publish_that_failed_while_the_daemon_stayed_connected_is_sent_by_a_sweep(nats_broker, tmp_path):
    """§17 without an outage: the agent's own `publish` cannot reach the broker (a wrong port in
    its environment) and exits 2; the daemon, connected all along, sends the entry at its next
    sweep (entries older than SETTLE_S), and the hub closes the job `completed`."""
    hub = hub_workspace(nats_broker, tmp_path)
    runner_ws = tmp_path / "runner"
    runner = start_runner(nats_broker, runner_ws)
    brief = ('MAM_RUNNER_SOCKET= MQTT_PORT=1 MAM_LOG_LEVEL=ERROR eval "$MAM_PUBLISH_CMD --event completed '
             '--detail by-the-agent --attempts 1" || echo "publish exited $?" >&2')  # no socket: v1
    try:
        result = orch(hub, "dispatch", "--session", SESSION, "--brief", brief, *OUTAGE_HEARTBEAT,
                      "--ack-timeout", ACK_TIMEOUT)
    finally:
        stop(runner)
    assert result.returncode == 0, result.stderr + runner_log(runner_ws)
    assert '"by-the-agent"' in result.stdout
    agent_log = (runner_ws / ".mam" / "logs" / Registry(hub).list()[0][0]["job_id"] / "agent.log").read_text()
    assert "publish exited 2" in agent_log


@pytest.fixture
def slow_saving_mosquitto(tmp_path_factory):
    """Mosquitto with persistence that saves retained messages only every AUTOSAVE_S (a crash loses them)."""
    reason = MosquittoBroker.available()
    if reason:
        pytest.skip(reason)
    handle = MosquittoBroker(tmp_path_factory.mktemp("mosquitto"))
    text = handle.config_path.read_text()
    assert "autosave_interval 1\n" in text
    handle.config_path.write_text(text.replace("autosave_interval 1\n", f"autosave_interval {AUTOSAVE_S}\n"))
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()


def test_s17_fault10_a_mosquitto_crash_does_not_lose_a_finished_jobs_retained_state(slow_saving_mosquitto,
                                                                                      tmp_path):
    """The hub is not watching (detached), the job completes, mosquitto is
    SIGKILLed before it saved and restarted: the runner re-publishes the kept terminal event and
    state (same seq) after its reconnect, and `mam-orch watch` then resolves the job `completed`."""
    broker = slow_saving_mosquitto
    hub = hub_workspace(broker, tmp_path)
    runner_ws = tmp_path / "runner"
    runner = start_runner(broker, runner_ws)
    try:
        sent = orch(hub, "dispatch", "--session", SESSION, "--detach", "--json", "--brief", "echo done",
                    "--heartbeat", "1", "--heartbeat-misses", "30", "--ack-timeout", ACK_TIMEOUT)
        assert sent.returncode == 0, sent.stderr
        job_id = json.loads(sent.stdout)["job_id"]
        before = wait_until(lambda: (s := retained_state(broker, job_id)) and s["status"] == "completed" and s,
                            what="the retained completed state")
        broker.kill()
        broker.restart()
        after = wait_until(lambda: retained_state(broker, job_id), what="the retained state back after the crash")
        assert (after["status"], after["seq"]) == ("completed", before["seq"])
        watch = subprocess.run([*MAM_ORCH, "watch", job_id, "--workspace", str(hub)], env=hub_env(),
                               capture_output=True, text=True, timeout=PATIENCE_S)
        assert watch.returncode == 0, watch.stderr
    finally:
        stop(runner)
    assert Registry(hub).get(job_id)["status"] == "completed"
