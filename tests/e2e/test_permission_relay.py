"""A person answers an agent's permission request from the hub (PROTOCOL §19), over real
brokers with real processes: the agent (the shell agent running `mam-runner ask`) blocks
until `mam-orch approve` / `deny` answers; the answers are signed, recorded with who gave
them, delivered once and refused when forged, unknown, repeated or late.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from harness.jobkit import WatchProcess
from harness.runnersim import (
    MAM_ORCH,
    MAM_RUNNER,
    ask_step,
    hub_env,
    hub_workspace,
    orch,
    retained,
    runner_log,
    start_runner,
)
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import TEST_SECRET

from mam.orchestrator.api import Hub
from mam.orchestrator.asks import ANSWERED
from mam.runner import localsock
from mam.shared.protocol import crypto, names, wire
from mam.shared.store.registry import Registry
from mam.shared.transport import mqtt

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(4 * PATIENCE_S)]

SESSION = "gpu-box"
PUSH = {"command": "git push origin main"}
WRITE = {"file_path": "notes.md", "content": "x"}


def dispatch(hub: Path, brief: str) -> WatchProcess:
    return WatchProcess([*MAM_ORCH, "dispatch", "--session", SESSION, "--brief", brief, "--ack-timeout",
                         str(int(PATIENCE_S)), "--workspace", str(hub)], hub_env())


def asked(watch: WatchProcess, count: int) -> list[dict]:
    """The first `count` permission requests the hub saw (their event data)."""
    def seen() -> list[dict] | None:
        events = watch.events("permission_required")
        return [event["data"] for event in events[:count]] if len(events) >= count else None
    return wait_until(seen, what=f"permission request {count} at the hub")


def answer_of(out: Path, n: int) -> tuple[dict, str]:
    path = Path(f"{out}.{n}")
    wait_until(path.exists, what=f"the agent's answer {n}")
    first, rc = path.read_text().splitlines()
    return json.loads(first), rc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    proc.wait(PATIENCE_S)


def test_approve_then_deny_with_a_reason_reach_the_waiting_agent_and_are_recorded(broker, tmp_path):
    hub = hub_workspace(broker, tmp_path)
    ws, out = tmp_path / "runner", tmp_path / "out"
    runner = start_runner(broker, ws, SESSION, OUT=str(out))
    watch = dispatch(hub, "\n".join([ask_step(1, "Bash", PUSH), ask_step(2, "Write", WRITE),
                                     ask_step(3, "Edit", {"file_path": "a.py"})]))
    try:
        first = asked(watch, 1)[0]
        job_id = watch.events("permission_required")[0]["job_id"]
        assert first["tool"] == "Bash" and first["input"] == "git push origin main", first
        assert watch.events("permission_required")[0]["detail"] == "asks to use Bash"
        approved = orch(hub, "approve", job_id, "--json")
        assert approved.returncode == 0, approved.stderr
        assert f"request {first['request_id']} (Bash): allowed by " in approved.stderr
        assert answer_of(out, 1) == ({"behavior": "allow", "message": json.loads(approved.stdout)["message"],
                                      "request_id": first["request_id"]}, "rc=0")
        second = asked(watch, 2)[1]
        denied = orch(hub, "deny", job_id, second["request_id"], "--reason", "no writes today")
        assert denied.returncode == 0, denied.stderr
        assert answer_of(out, 2) == ({"behavior": "deny", "message": "no writes today",
                                      "request_id": second["request_id"]}, "rc=1")
        third = asked(watch, 3)[2]
        with Hub(hub, embedded=False) as api:  # the Python API answers the same way
            waiting = api.job(job_id).asks(waiting=True)
            assert [(a.request_id, a.tool, a.input) for a in waiting] == [(third["request_id"], "Edit",
                                                                           '{"file_path":"a.py"}')]
            assert waiting[0].approve().behavior == "allow"
        assert answer_of(out, 3)[0]["behavior"] == "allow"
        assert watch.wait(PATIENCE_S) == 0, watch.log() + runner_log(ws)
        # the runner cleared each delivered answer
        topic = names.answer_topic(job_id, first["request_id"], broker.topic_root)
        assert wait_until(lambda: retained(broker, topic) is None, what="the delivered answer cleared")
    finally:
        watch.kill()
        stop(runner)
    lines = [line for line in Registry(hub).audit(job_id) if line.get("event") == ANSWERED]
    assert [(line["request_id"], line["behavior"]) for line in lines] == [
        (first["request_id"], "allow"), (second["request_id"], "deny"), (third["request_id"], "allow")]
    assert all("@" in line["by"] for line in lines) and lines[1]["message"] == "no writes today"
    listed = orch(hub, "asks", job_id)  # on a pipe: one JSON object per request, answers with them
    shown = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [ask["behavior"] for ask in shown] == ["allow", "deny", "allow"]
    assert json.loads(shown[1]["full_input"]) == WRITE  # the whole input, sealed to the hub
    assert orch(hub, "asks").stdout == ""  # nothing waits any more
    # late, repeated, unknown: refused with one line each, exit 1
    again = orch(hub, "approve", job_id, first["request_id"])
    assert again.returncode == 1 and "answered already (allow by " in again.stderr, again.stderr
    unknown = orch(hub, "deny", job_id, "0123456789abcdef")
    assert unknown.returncode == 1 and "never asked request 0123456789abcdef" in unknown.stderr
    none = orch(hub, "approve", job_id)
    assert none.returncode == 1 and "no permission request waiting" in none.stderr
    malformed = orch(hub, "approve", job_id, "not-a-request")
    assert malformed.returncode == 64 and malformed.stderr.count("\n") == 1, malformed.stderr
    oversized = orch(hub, "deny", job_id, "--reason", "x" * 300)
    assert oversized.returncode == 64 and "1-256 characters" in oversized.stderr


def test_a_forged_or_misplaced_answer_is_refused_and_the_agent_keeps_waiting(nats_broker, tmp_path):
    """Hostile: an allow signed with another key, an allow for this request on the control
    topic, a cancel on the answer topic, and a signed allow whose message is not sealed with
    the attempt's token are each refused in the runner's log; nothing reaches the agent, and
    the hub's real answer still does."""
    hub = hub_workspace(nats_broker, tmp_path)
    ws, out = tmp_path / "runner", tmp_path / "out"
    runner = start_runner(nats_broker, ws, SESSION, OUT=str(out))
    watch = dispatch(hub, ask_step(1, "Bash", PUSH))
    try:
        request_id = asked(watch, 1)[0]["request_id"]
        event = watch.events("permission_required")[0]
        job_id, attempt = event["job_id"], event["data"]["attempt_id"]
        root = nats_broker.topic_root
        guessed = crypto.seal_answer("a-token-the-attacker-guessed-0123456789", job_id=job_id, attempt_id=attempt,
                                     request_id=request_id, action="allow", message="forged")
        forged = wire.Control.answer(job_id, attempt, request_id, allow=True, sealed=guessed)
        wrong_key = crypto.derive_keys("another-secret-of-at-least-32-characters!")
        good = crypto.derive_keys(TEST_SECRET)
        misplaced = wire.encode(crypto.sign(forged.to_dict(), good.sign_key))
        cancel_there = wire.encode(crypto.sign(wire.Control.cancel(job_id, attempt, "x").to_dict(), good.sign_key))
        with mqtt.MqttClient(nats_broker.config(), "attacker").connect() as attacker:
            attacker.publish(names.answer_topic(job_id, request_id, root),
                             wire.encode(crypto.sign(forged.to_dict(), wrong_key.sign_key)), retain=True)
            wait_until(lambda: "refused answer" in runner_log(ws), what="the forged answer refused")
            attacker.publish(names.control_topic(job_id, root), misplaced, retain=False)
            wait_until(lambda: "allow on the control topic" in runner_log(ws), what="the misplaced allow refused")
            attacker.publish(names.answer_topic(job_id, request_id, root), cancel_there, retain=False)
            wait_until(lambda: "a cancel is no answer" in runner_log(ws), what="the cancel as an answer refused")
            # signed with the dispatch key but sealed without the attempt's token: unreadable, refused
            attacker.publish(names.answer_topic(job_id, request_id, root), misplaced, retain=False)
            wait_until(lambda: "does not open with attempt" in runner_log(ws), what="the unsealable answer refused")
        assert not Path(f"{out}.1").exists() and watch.proc.poll() is None
        approved = orch(hub, "approve", job_id)
        assert approved.returncode == 0, approved.stderr
        assert answer_of(out, 1)[0]["behavior"] == "allow"
        assert watch.wait(PATIENCE_S) == 0, watch.log() + runner_log(ws)
    finally:
        watch.kill()
        stop(runner)


def test_say_to_a_running_agent_that_takes_no_input_is_refused_and_a_forged_say_never_delivered(
        nats_broker, tmp_path):
    """§18 "Input while it runs" with the shell agent (a plain command reads only its brief):
    the hub refuses `say` while it runs; a say signed with another key, or signed but not
    sealed with the attempt's token, is refused by the runner; a well-formed one is answered
    `not delivered` in a progress event, never written anywhere."""
    hub = hub_workspace(nats_broker, tmp_path)
    ws, out = tmp_path / "runner", tmp_path / "out"
    runner = start_runner(nats_broker, ws, SESSION, OUT=str(out))
    watch = dispatch(hub, ask_step(1, "Bash", PUSH))  # it waits for an answer: the job runs meanwhile
    try:
        request_id = asked(watch, 1)[0]["request_id"]
        job_id, attempt = watch.events("started")[0]["job_id"], watch.events("started")[0]["data"]["attempt_id"]
        said = orch(hub, "say", job_id, "hello")
        assert said.returncode == 1 and "takes no input while it runs" in said.stderr, said.stderr
        big = orch(hub, "say", job_id, "x" * 9000)
        assert big.returncode == 64 and "a running agent is told at most 8192" in big.stderr, big.stderr
        root, message_id = nats_broker.topic_root, "00112233445566ff"
        token = Registry(hub).get(job_id)["auth_token"]
        good, wrong = crypto.derive_keys(TEST_SECRET), crypto.derive_keys("another-secret-of-at-least-32-characters!")

        def say(sealed_with: str, key: bytes) -> bytes:
            sealed = crypto.seal_answer(sealed_with, job_id=job_id, attempt_id=attempt, request_id=message_id,
                                        action="say", message="rm -rf everything")
            return wire.encode(crypto.sign(wire.Control.say(job_id, attempt, message_id, sealed=sealed).to_dict(),
                                           key))
        with mqtt.MqttClient(nats_broker.config(), "attacker").connect() as attacker:
            topic = names.answer_topic(job_id, message_id, root)
            attacker.publish(topic, say(token, wrong.sign_key), retain=False)
            wait_until(lambda: "refused answer" in runner_log(ws), what="the say signed with another key refused")
            attacker.publish(topic, say("a-token-the-attacker-guessed-0123456789", good.sign_key), retain=False)
            wait_until(lambda: "refused say" in runner_log(ws), what="the unsealable say refused")
            attacker.publish(topic, say(token, good.sign_key), retain=True)
            noted = wait_until(lambda: [e for e in watch.events("progress")
                                        if (e.get("data") or {}).get("message_id") == message_id] or None,
                               what="the runner's word on the message")
            assert noted[0]["detail"] == (f"message {message_id} not delivered: the agent takes no input while "
                                          "it runs"), noted
            assert wait_until(lambda: retained(nats_broker, topic) is None, what="the handled message cleared")
        assert "rm -rf everything" not in runner_log(ws)
        assert orch(hub, "approve", job_id, request_id).returncode == 0
        assert watch.wait(PATIENCE_S) == 0, watch.log() + runner_log(ws)
    finally:
        watch.kill()
        stop(runner)


def test_ask_outside_a_job_or_with_bad_input_exits_64_with_one_line(tmp_path):
    env = hub_env()
    outside = subprocess.run([*MAM_RUNNER, "ask", "--tool", "Bash"], env=env, capture_output=True, text=True,
                             timeout=PATIENCE_S)
    assert outside.returncode == 64 and "inside a job only" in outside.stderr and outside.stderr.count("\n") == 1
    inside = {**env, "MAM_JOB_ID": "918b0612", "MAM_ATTEMPT_ID": "1", "MAM_DISPATCH_TOKEN": "0" * 32,
              "MAM_RUNNER_SOCKET": str(tmp_path / "none.sock")}
    for bad, reason in (("[1]", "must be a JSON object"), ("{nope", "not valid JSON"),
                        ("{\"a\": \"" + "x" * 70_000 + "\"}", "larger than")):
        done = subprocess.run([*MAM_RUNNER, "ask", "--tool", "Bash", "--input", bad], env=inside,
                              capture_output=True, text=True, timeout=PATIENCE_S)
        assert done.returncode == 64 and reason in done.stderr, (bad[:20], done.stderr)
    absent = subprocess.run([*MAM_RUNNER, "ask", "--tool", "Bash"], env=inside, capture_output=True, text=True,
                            timeout=PATIENCE_S)
    assert absent.returncode == 2 and json.loads(absent.stdout)["behavior"] == "deny", absent


def dispatch_with(hub: Path, brief: str, *opts: str) -> WatchProcess:
    return WatchProcess([*MAM_ORCH, "dispatch", "--session", SESSION, "--brief", brief, "--ack-timeout",
                         str(int(PATIENCE_S)), *opts, "--workspace", str(hub)], hub_env())


def test_nobody_answers_the_request_is_denied_after_the_ask_timeout_and_the_job_goes_on(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    ws, out = tmp_path / "runner", tmp_path / "out"
    runner = start_runner(nats_broker, ws, SESSION, OUT=str(out))
    watch = dispatch_with(hub, ask_step(1, "Bash", PUSH), "--ask-timeout", "2")
    try:
        request_id = asked(watch, 1)[0]["request_id"]
        answer, rc = answer_of(out, 1)
        assert (answer["behavior"], answer["message"], rc) == ("deny", "no answer within 2 s", "rc=1")
        assert watch.wait(PATIENCE_S) == 0, watch.log() + runner_log(ws)  # the agent went on
    finally:
        watch.kill()
        stop(runner)
    job_id = watch.events("permission_required")[0]["job_id"]
    told = [e["detail"] for e in watch.events("progress") if e["data"].get("request_id") == request_id]
    assert told == [f"no answer to request {request_id} within 2 s: denied"]
    late = orch(hub, "approve", job_id, request_id)
    assert late.returncode == 1 and "answered already (deny by timeout" in late.stderr, late.stderr
    assert Registry(hub).get(job_id)["status"] == "completed"


def test_nobody_answers_with_on_ask_timeout_cancel_the_job_is_cancelled_never_timed_out(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    ws, out = tmp_path / "runner", tmp_path / "out"
    runner = start_runner(nats_broker, ws, SESSION, OUT=str(out))
    watch = dispatch_with(hub, ask_step(1, "Bash", PUSH) + '\ntouch "$OUT.after"', "--ask-timeout", "2",
                          "--on-ask-timeout", "cancel")
    try:
        asked(watch, 1)
        code = watch.wait(PATIENCE_S)
    finally:
        watch.kill()
        stop(runner)
    job_id = watch.events("permission_required")[0]["job_id"]
    record = Registry(hub).get(job_id)
    assert code == 1 and record["status"] == "error", (code, record, watch.log())
    assert record.get("close_reason") != "deadline_timeout"
    assert watch.events("error")[0]["detail"] == "cancelled"
    assert not Path(f"{out}.after").exists()  # the agent did not go on
    assert "no answer to a permission request within 2 s" in runner_log(ws)


def test_approve_always_answers_the_same_request_again_without_a_person(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    ws, out = tmp_path / "runner", tmp_path / "out"
    runner = start_runner(nats_broker, ws, SESSION, OUT=str(out))
    other = {"command": "git push --force"}
    watch = dispatch(hub, "\n".join([ask_step(1, "Bash", PUSH), ask_step(2, "Bash", PUSH), ask_step(3, "Bash", other)]))
    try:
        first = asked(watch, 1)[0]
        job_id = watch.events("permission_required")[0]["job_id"]
        approved = orch(hub, "approve", job_id, "--always")
        assert approved.returncode == 0 and "allowed again without asking" in approved.stderr, approved.stderr
        assert answer_of(out, 1)[0]["behavior"] == "allow"
        assert answer_of(out, 2) == ({"behavior": "allow", "message": answer_of(out, 1)[0]["message"],
                                      "request_id": first["request_id"]}, "rc=0")  # nobody was asked
        third = asked(watch, 2)[1]  # another input is another request
        assert third["input"] == "git push --force"
        assert orch(hub, "deny", job_id).returncode == 0
        assert answer_of(out, 3)[0]["behavior"] == "deny"
        assert watch.wait(PATIENCE_S) == 0, watch.log() + runner_log(ws)
    finally:
        watch.kill()
        stop(runner)
    again = [e["detail"] for e in watch.events("progress") if e["data"].get("always_of") == first["request_id"]]
    assert again == [f"allowed Bash again without asking (always, request {first['request_id']})"]
    assert len(watch.events("permission_required")) == 2
    lines = [line for line in Registry(hub).audit(job_id) if line.get("event") == ANSWERED]
    assert lines[0]["always"] is True and "always" not in lines[1]


def test_a_flood_of_1000_requests_is_capped_at_8_waiting_and_said_once(nats_broker, tmp_path):
    """Hostile: 1,000 asks over the socket with the job's own identity: 8 wait, 992 are refused
    with one line each, the runner says so once, the hub sees 8 requests, the daemon goes on."""
    hub = hub_workspace(nats_broker, tmp_path)
    ws, gate = tmp_path / "runner", tmp_path / "gate"
    runner = start_runner(nats_broker, ws, SESSION, GATE=str(gate))
    watch = dispatch(hub, 'while [ ! -e "$GATE" ]; do sleep 0.05; done')
    parked: list[socket.socket] = []
    try:
        job_id = wait_until(lambda: (watch.events("started") or [None])[0], what="started")["job_id"]
        record = Registry(ws).get(job_id)
        line = json.dumps({"job_id": job_id, "attempt_id": record["attempt_id"],
                           "dispatch_token": record["dispatch_token"],
                           "ask": {"tool": "Bash", "input": {"command": "rm -rf /"}}}).encode() + b"\n"
        address, folder_fd = localsock.unix_address(names.runner_socket_path(ws))  # a long path: via /proc
        refusals = []
        for _ in range(1000):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(PATIENCE_S)
            sock.connect(address)
            sock.sendall(line)
            if len(parked) < localsock.MAX_WAITING_ASKS:
                parked.append(sock)  # it waits for an answer: no reply now
                wait_until(lambda: len(watch.events("permission_required")) >= len(parked), what="recorded")
                continue
            with sock:
                refusals.append(json.loads(sock.makefile("rb").readline()))
        if folder_fd is not None:
            os.close(folder_fd)
        assert len(refusals) == 992 and all(r["ok"] is False and "at most 8" in r["reason"] for r in refusals)
        assert runner_log(ws).count("permission requests refused") == 1
        gate.touch()
        assert watch.wait(PATIENCE_S) == 0, watch.log() + runner_log(ws)
        for sock in parked:  # the job ended: each waiting request is denied
            assert json.loads(sock.makefile("rb").readline())["behavior"] == "deny"
    finally:
        gate.touch()
        for sock in parked:
            sock.close()
        watch.kill()
        stop(runner)
    assert len(watch.events("permission_required")) == 8


def test_the_jobs_tool_rules_answer_known_requests_and_a_person_the_rest(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    ws, out = tmp_path / "runner", tmp_path / "out"
    runner = start_runner(nats_broker, ws, SESSION, OUT=str(out))
    steps = [ask_step(1, "Bash", PUSH), ask_step(2, "Bash", {"command": "git status"}),
             ask_step(3, "Bash", {"command": "npm install"})]
    watch = dispatch_with(hub, "\n".join(steps), "--allow-tools", "Bash(git *)", "--deny-tools", "Bash(git push *)")
    try:
        assert answer_of(out, 1) == ({"behavior": "deny", "message": "denied by the job's policy (Bash(git push *))",
                                      "request_id": ""}, "rc=1")
        assert answer_of(out, 2)[0]["behavior"] == "allow"
        third = asked(watch, 1)[0]  # the only request a person sees
        assert third["input"] == "npm install"
        assert orch(hub, "approve", watch.events("permission_required")[0]["job_id"]).returncode == 0
        assert answer_of(out, 3)[0]["behavior"] == "allow"
        assert watch.wait(PATIENCE_S) == 0, watch.log() + runner_log(ws)
    finally:
        watch.kill()
        stop(runner)
    by_policy = [e["detail"] for e in watch.events("progress") if e["data"].get("by") == "policy"]
    assert by_policy == ["denied Bash by the job's policy (Bash(git push *))",
                         "allowed Bash by the job's policy (Bash(git *))"]
