"""Permission requests and their answers (PROTOCOL §19) without a broker: the answer's wire
rules, its topic, the runner socket's side (park, answer, cap, drop) and the hub's reading of
a job's requests from its audit log."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mam.orchestrator import asks
from mam.runner import ask, localsock
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import DecodeError, SignatureError, UsageError
from mam.shared.store.registry import Contract, Registry

pytestmark = pytest.mark.timeout(60)

JOB = "918b0612"
TOKEN = "0123456789abcdef0123456789abcdef"
AUTH = "auth-token-for-the-unit-tests-0123456789"
RID = "0123456789abcdef"
KEYS = crypto.derive_keys("test-dispatch-secret-0123456789abcdef")


# ---------------------------------------------------------------- wire and topics


def sealed_answer(allow: bool, message: str, attempt: int = 2, token: str = AUTH) -> wire.Control:
    action = "allow" if allow else "deny"
    return wire.Control.answer(JOB, attempt, RID, allow=allow, sealed=crypto.seal_answer(
        token, job_id=JOB, attempt_id=attempt, request_id=RID, action=action, message=message))


def test_an_answer_is_a_signed_control_with_a_request_id_and_a_sealed_message_that_round_trips():
    control = sealed_answer(False, "no writes today")
    raw = wire.encode(crypto.sign(control.to_dict(), KEYS.sign_key))
    assert b"no writes today" not in raw  # another runner reading the answer topic learns nothing
    decoded = wire.decode(raw, "control")
    crypto.verify(decoded, KEYS.sign_key)
    assert (decoded.action, decoded.request_id, decoded.attempt_id, decoded.reason) == ("deny", RID, 2, "sealed")
    assert crypto.open_answer(AUTH, decoded) == "no writes today"
    assert json.loads(raw)["action"] == "deny"


def test_an_answer_opens_only_with_its_attempts_token_and_fields():
    control = sealed_answer(True, "approved by ann@hub")
    with pytest.raises(SignatureError):
        crypto.open_answer("another-attempts-auth-token-0123456789", control)
    body = control.to_dict()
    for change in ({"action": "deny"}, {"attempt_id": 3}, {"request_id": "f" * 16}):
        moved = wire.Control.from_dict({**body, **change, "sig": "0" * 64})
        with pytest.raises(SignatureError):
            crypto.open_answer(AUTH, moved)  # the seal is bound to the job, attempt, request and action


@pytest.mark.parametrize(("change", "reason"), [
    ({"action": "cancel"}, "request_id and sealed are only for an allow, deny or say"),
    ({"request_id": None}, "request_id"),
    ({"request_id": "XYZ"}, "request_id 'XYZ' is invalid"),
    ({"request_id": "0" * 64}, "16 lowercase hex"),
    ({"action": "approve"}, "action"),
    ({"always": False}, "always is only true"),
    ({"always": True, "action": "deny"}, "only on an allow"),
    ({"always": "yes"}, "always is only true"),
    ({"sealed": None}, "sealed must be an object"),
    ({"sealed": "plain text"}, "sealed must be an object"),
    ({"sealed": {"alg": "A256GCM", "nonce": "AAAA"}}, "sealed must be an object"),
    ({"sealed": {"alg": "none", "nonce": "AAAA", "ciphertext": "AAAA"}}, "sealed.alg"),
    ({"sealed": {"alg": "A256GCM", "nonce": "AAAA", "ciphertext": "A" * 5000}}, "sealed.ciphertext"),
    ({"sealed": {"alg": "A256GCM", "nonce": "../\n", "ciphertext": "AAAA"}}, "sealed.nonce"),
])
def test_an_answer_that_breaks_the_rules_is_malformed(change, reason):
    body = {**sealed_answer(True, "ok", attempt=1).to_dict(), **change, "sig": "0" * 64}
    if "sealed" in change and change["sealed"] is None:
        body.pop("sealed")
    if body.get("request_id") is None:
        body.pop("request_id")
    with pytest.raises(DecodeError) as caught:
        wire.decode(json.dumps(body), "control")
    assert reason in str(caught.value)


def test_answer_topics_are_built_and_parsed_strictly():
    topic = names.answer_topic(JOB, RID, "python/mqtt")
    assert topic == f"python/mqtt/jobs/{JOB}/answers/{RID}"
    assert names.parse_answer_topic(topic, "python/mqtt") == (JOB, RID)
    assert names.all_answers_filter("python/mqtt") == "python/mqtt/jobs/+/answers/+"
    for bad in (f"python/mqtt/jobs/{JOB}/answers", f"python/mqtt/jobs/{JOB}/answers/{RID}/x",
                f"python/mqtt/jobs/{JOB}/control", f"python/mqtt/jobs/{JOB}/answers/../etc",
                f"other/jobs/{JOB}/answers/{RID}"):
        assert names.parse_answer_topic(bad, "python/mqtt") is None
    assert names.parse_job_topic(topic, "python/mqtt") is None  # never taken for a dispatch or control
    with pytest.raises(UsageError):
        names.answer_topic(JOB, "nope")


# ---------------------------------------------------------------- the runner's socket


def server(root: Path) -> localsock.PublishServer:
    registry = Registry(root)
    registry.mirror(job_id=JOB, session="gpu-box", attempt_id=1, dispatch_token=TOKEN, auth_token=AUTH,
                    contract=Contract())
    return localsock.PublishServer(registry, held=lambda job_id: job_id == JOB, send=lambda p: None,
                                   mask=lambda job_id, text: text.replace("s3cret", "***"))


def request(tool: str = "Bash", tool_input: dict | None = None, **fields: object) -> localsock.AskRequest:
    value = {"job_id": JOB, "attempt_id": 1, "dispatch_token": TOKEN,
             "ask": {"tool": tool, "input": tool_input if tool_input is not None else {"command": "git push"}},
             **fields}
    return localsock.parse_ask(value)


@pytest.fixture
def client():
    """Makes (the daemon's side as a parked client, the agent's side) socket pairs; all closed after."""
    made: list[socket.socket] = []

    def make() -> tuple[localsock._Client, socket.socket]:
        ours, theirs = socket.socketpair()
        theirs.settimeout(5)
        made.extend((ours, theirs))
        return localsock._Client(ours, 0.0), theirs
    yield make
    for sock in made:
        sock.close()


def reply(theirs: socket.socket) -> dict:
    return json.loads(theirs.makefile("rb").readline())


def test_a_request_is_recorded_as_a_masked_event_and_waits_for_its_answer(tmp_path, client):
    srv = server(tmp_path)
    parked, theirs = client()
    assert srv.ask(request(tool_input={"command": "curl -H 'token: s3cret' x"}), parked) is None
    event = srv._outgoing.get_nowait().event
    assert event["event"] == "permission_required" and event["detail"] == "asks to use Bash"
    request_id = event["data"]["request_id"]
    assert event["data"]["tool"] == "Bash" and event["data"]["input"] == "curl -H 'token: ***' x"
    assert srv.waiting(JOB) == {request_id: 1}
    refused = srv.answer(JOB, 2, request_id, allow=True, message="m")
    assert refused is not None and "attempt 1, not" in refused  # another attempt's answer is not this one's
    assert srv.answer(JOB, 1, "f" * 16, allow=True, message="m") == (
        f"request {'f' * 16} is not waiting for an answer (unknown or answered)")
    assert srv.answer(JOB, 1, request_id, allow=False, message="no writes") is None
    assert reply(theirs) == {"ok": True, "request_id": request_id, "behavior": "deny", "message": "no writes"}
    assert srv.answer(JOB, 1, request_id, allow=True, message="again") is not None  # delivered once
    assert srv.waiting(JOB) == {}


def test_a_flood_of_requests_is_capped_and_an_ended_job_denies_what_waits(tmp_path, client):
    srv = server(tmp_path)
    theirs = []
    for _ in range(localsock.MAX_WAITING_ASKS):
        parked, other = client()
        assert srv.ask(request(), parked) is None
        theirs.append(other)
    refused = srv.ask(request(), client()[0])
    assert refused is not None and f"at most {localsock.MAX_WAITING_ASKS}" in refused["reason"]
    assert len(srv.waiting(JOB)) == localsock.MAX_WAITING_ASKS
    srv.drop_asks(JOB, "the job ended before an answer came")
    answers = [reply(other) for other in theirs]
    assert {a["behavior"] for a in answers} == {"deny"} and srv.waiting(JOB) == {}


def test_a_request_for_a_job_not_held_or_with_a_stale_token_asks_nothing(tmp_path, client):
    srv = server(tmp_path)
    assert srv.ask(request(job_id="0badc0de"), client()[0]) == {
        "ok": False, "reason": "job 0badc0de is not running under this runner"}
    stale = srv.ask(request(dispatch_token="f" * 32), client()[0])
    assert stale is not None and stale["reason"].startswith("the permission request was not recorded")
    assert srv.waiting(JOB) == {} and srv._outgoing.empty()


@pytest.mark.parametrize(("value", "reason"), [
    ({"ask": {"tool": "Bash"}, "extra": 1}, "unknown request field"),
    ({"ask": "Bash"}, "'ask' must be an object"),
    ({"ask": {"tool": ""}}, "tool name"),
    ({"ask": {"tool": "a\nb"}}, "tool name"),
    ({"ask": {"tool": "x" * 200}}, "tool name"),
    ({"ask": {"tool": "Bash", "input": [1]}}, "must be a JSON object"),
    ({"ask": {"tool": "Bash", "why": 1}}, "'ask' must be an object"),
    ({"ask": {"tool": "Bash"}, "attempt_id": "1"}, "attempt_id"),
    ({"ask": {"tool": "Bash"}, "job_id": "../x"}, "job id"),
])
def test_bad_requests_are_refused_with_one_reason(value, reason):
    base = {"job_id": JOB, "attempt_id": 1, "dispatch_token": TOKEN}
    with pytest.raises(UsageError) as caught:
        localsock.parse_ask({**base, **value})
    assert reason in str(caught.value)


def test_the_summary_shows_a_command_or_compact_json_on_one_capped_line():
    assert localsock.input_summary({"command": "git push\norigin"}) == "git push origin"
    assert localsock.input_summary({"file_path": "a", "content": "b"}) == '{"file_path":"a","content":"b"}'
    assert len(localsock.input_summary({"content": "x" * 5000})) == localsock.MAX_INPUT_SUMMARY_CHARS


# ---------------------------------------------------------------- the hub's view


def hub_job(root: Path, *lines: dict) -> Registry:
    registry = Registry(root)
    registry.register(session="gpu-box", job_id=JOB)
    for line in lines:
        registry.append_audit(JOB, line)
    return registry


def asked(request_id: str, attempt: int = 1, tool: str = "Bash") -> dict:
    return {"event": "permission_required", "job_id": JOB, "timestamp": "2026-12-04T10:00:00Z",
            "data": {"request_id": request_id, "attempt_id": attempt, "tool": tool, "input": "git push"}}


def test_the_hub_reads_requests_and_answers_from_the_audit_log(tmp_path):
    other = "f" * 16
    registry = hub_job(tmp_path, asked(RID), asked(other, tool="Write"),
                       {"event": asks.ANSWERED, "request_id": RID, "behavior": "allow", "by": "ann@hub",
                        "message": "approved by ann@hub"})
    found = asks.asks_of(registry, JOB)
    assert [(a.request_id, a.behavior, a.answered_by) for a in found] == [(RID, "allow", "ann@hub"),
                                                                           (other, None, None)]
    assert [a.request_id for a in asks.pending(registry, JOB)] == [other]
    assert asks.choose(registry, JOB, None).request_id == other
    with pytest.raises(asks.AnswerRefused, match="answered already"):
        asks.choose(registry, JOB, RID)
    with pytest.raises(asks.AnswerRefused, match="never asked"):
        asks.choose(registry, JOB, "a" * 16)


def test_the_hub_refuses_a_stale_attempt_an_ended_job_and_an_unnamed_choice_of_several(tmp_path):
    registry = hub_job(tmp_path, asked(RID, attempt=0), asked("a" * 16), asked("b" * 16))
    with pytest.raises(asks.AnswerRefused, match="of attempt 0; job 918b0612 is on attempt 1"):
        asks.choose(registry, JOB, RID)
    with pytest.raises(UsageError, match="has 2 requests waiting: aaaaaaaaaaaaaaaa"):
        asks.choose(registry, JOB, None)
    registry.close(JOB, "cancelled")
    assert asks.pending(registry, JOB) == []
    with pytest.raises(asks.AnswerRefused, match="is cancelled; nothing waits"):
        asks.choose(registry, JOB, "a" * 16)
    with pytest.raises(UsageError):
        asks.choose(registry, JOB, "not-hex")


def test_the_views_show_the_request_its_input_and_how_to_answer_with_controls_escaped(tmp_path):
    from mam.orchestrator.watch import render_event
    from mam.shared.cli.render import show_text

    event = {"job_id": JOB, "seq": 3, "event": "permission_required", "timestamp": "2026-12-04T18:17:45Z",
             "detail": "asks to use Bash", "data": {"request_id": RID, "input": "git push\x1b[31m"}}
    line = render_event(event, True)
    assert line.endswith(f"asks to use Bash: git push?[31m (request {RID}; answer with mam-orch "
                         f"approve|deny {JOB})\n"), line
    registry = hub_job(tmp_path, {**asked(RID), "seq": 3, "detail": "asks to use Bash"},
                       {"event": asks.ANSWERED, "request_id": RID, "behavior": "deny", "by": "ann@hub",
                        "message": "not today"})
    text = show_text(registry.get(JOB), registry.audit(JOB), tmp_path)
    assert f"seq 3 asks to use Bash: git push (request {RID})" in text
    assert f"deny by ann@hub (request {RID}): not today" in text


# ---------------------------------------------------------------- Claude Code's permission tool


def test_the_claude_cli_gets_the_permission_tool_and_only_undecided_denials_fail_the_job(tmp_path):
    from mam.runner.agents import AgentPolicy, ClaudeAdapter
    from mam.runner.permission_tool import PROMPT_TOOL

    adapter = ClaudeAdapter(AgentPolicy())
    assert "--permission-prompt-tool" not in adapter.argv(["claude"])
    adapter.ask_person(tmp_path / "mcp.json")
    argv = adapter.argv(["claude"])
    assert argv[-4:] == ["--mcp-config", str(tmp_path / "mcp.json"), "--permission-prompt-tool", PROMPT_TOOL]
    assert PROMPT_TOOL == "mcp__mam__permission"
    report = adapter.report()
    report.deny("Bash")
    report.deny("Write")
    assert report.outcome(0, decided={"Bash", "Write"}) is None  # a person decided both: no failure
    assert report.outcome(0, decided={"Bash"}) == ("error", "permission_denied: Write")
    assert report.outcome(0) == ("error", "permission_denied: Bash, Write")


def test_the_claude_cli_waits_for_the_permission_tool_unless_the_runner_sets_its_own_wait(tmp_path):
    from mam.runner.agents import AgentPolicy, ClaudeAdapter

    adapter = ClaudeAdapter(AgentPolicy())
    assert adapter.env({}) == {}  # no permission tool: nothing to wait for
    adapter.ask_person(tmp_path / "mcp.json")
    assert adapter.env({"HOME": "/root"}) == {"MCP_CONNECT_TIMEOUT_MS": "30000"}
    assert adapter.env({"MCP_CONNECT_TIMEOUT_MS": "90000"}) == {}  # the runner's own setting goes through


def test_the_permission_tool_denies_what_it_cannot_ask_and_starts_itself_from_this_python():
    from mam.runner import permission_tool

    answer = json.loads(permission_tool.decide("Bash", {"command": "ls"}, environ={}))
    assert answer["behavior"] == "deny" and "inside a job only" in answer["message"]
    inside = {"MAM_JOB_ID": JOB, "MAM_ATTEMPT_ID": "1", "MAM_DISPATCH_TOKEN": TOKEN,
              "MAM_RUNNER_SOCKET": "/nonexistent/runner.sock"}
    answer = json.loads(permission_tool.decide("Bash", {"command": "ls"}, environ=inside))
    assert answer == {"behavior": "deny", "message": "the runner daemon gave no answer"}
    config = permission_tool.mcp_config("/usr/bin/python3")
    assert config == {"mcpServers": {"mam": {"type": "stdio", "command": "/usr/bin/python3",
                                             "args": ["-m", "mam.runner", "permission-tool"], "alwaysLoad": True}}}


def test_a_denied_tool_is_remembered_for_the_job_until_it_ends(tmp_path, client):
    srv = server(tmp_path)
    parked, theirs = client()
    assert srv.ask(request(tool="Write"), parked) is None
    request_id = srv._outgoing.get_nowait().event["data"]["request_id"]
    assert srv.answer(JOB, 1, request_id, allow=False, message="no") is None
    assert srv.denied_tools(JOB) == {"Write"}
    srv.drop_asks(JOB, "ended")
    assert srv.denied_tools(JOB) == set()


# ---------------------------------------------------------------- nobody answers (§19)


def test_a_request_nobody_answers_is_denied_at_its_deadline_and_the_hub_is_told(tmp_path, client):
    import time

    cancelled: list[tuple[str, str]] = []
    srv = server(tmp_path)
    srv.ask_terms = lambda job_id: (1, "cancel")
    srv.cancel = lambda job_id, reason: cancelled.append((job_id, reason))
    parked, theirs = client()
    assert srv.ask(request(tool="Write"), parked) is None
    request_id = srv._outgoing.get_nowait().event["data"]["request_id"]
    srv._expire_asks(time.monotonic())  # not yet
    assert srv.waiting(JOB) == {request_id: 1} and not cancelled
    srv._expire_asks(time.monotonic() + 1.5)
    told = srv._outgoing.get_nowait().event
    assert told["event"] == "progress" and told["data"]["by"] == "timeout"
    assert told["detail"] == f"no answer to request {request_id} within 1 s: cancelling the job"
    assert cancelled == [(JOB, "no answer to a permission request within 1 s")]
    assert srv.denied_tools(JOB) == {"Write"}
    srv._expire_asks(time.monotonic() + 10)  # cancelled once; the agent gets no go-ahead meanwhile
    assert len(cancelled) == 1 and srv._outgoing.empty()
    srv.drop_asks(JOB, "the job ended before an answer came")  # its end answers it
    assert reply(theirs)["behavior"] == "deny" and srv.waiting(JOB) == {}


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"ask_timeout_s": 0}, "--ask-timeout 0 is invalid: expected whole seconds 1..604800"),
    ({"ask_timeout_s": 10**9}, "--ask-timeout"),
    ({"ask_timeout_s": True}, "--ask-timeout"),
    ({"on_ask_timeout": "retry"}, "--on-ask-timeout 'retry' is invalid: expected one of deny, cancel"),
])
def test_ask_timeout_terms_are_checked_at_dispatch(kwargs, reason):
    from mam.orchestrator.dispatch import work_terms

    with pytest.raises(UsageError) as caught:
        work_terms(**kwargs)
    assert reason in str(caught.value)


def test_ask_timeout_terms_travel_in_work_and_default_to_deny_after_30_minutes():
    from mam.orchestrator.dispatch import work_terms

    work = work_terms(ask_timeout_s=600, on_ask_timeout="cancel")
    assert work is not None and work.to_dict() == {"ask_timeout_s": 600, "on_ask_timeout": "cancel"}
    assert wire.Work.from_dict(work.to_dict()).ask_terms() == (600, "cancel")
    assert wire.Work(repo="demo").ask_terms() == (1800, "deny")
    with pytest.raises(DecodeError):
        wire.Work.from_dict({"ask_timeout_s": "600"})


def test_jobs_says_a_running_job_waits_for_approval_until_it_is_answered(tmp_path):
    from mam.shared.cli.render import with_why_waiting

    registry = hub_job(tmp_path, asked(RID, tool="Bash"))
    with registry.transaction(JOB) as txn:  # the runner's `started` moved it (§4)
        txn.update({**txn.record, "status": "running"}, source="remote_mirror", reason="event started")
    assert with_why_waiting(registry, registry.get(JOB))["why_waiting"] == "waiting for approval: Bash"
    registry.append_audit(JOB, {"event": asks.ANSWERED, "request_id": RID, "behavior": "allow", "by": "ann@hub"})
    assert "why_waiting" not in with_why_waiting(registry, registry.get(JOB))


def test_an_allow_always_answers_the_same_tool_and_input_again_and_nothing_else(tmp_path, client):
    srv = server(tmp_path)
    parked, theirs = client()
    assert srv.ask(request(tool_input={"command": "git push", "timeout": 5}), parked) is None
    request_id = srv._outgoing.get_nowait().event["data"]["request_id"]
    assert srv.answer(JOB, 1, request_id, allow=True, message="ok by ann", always=True) is None
    reply(theirs)
    again, theirs = client()
    assert srv.ask(request(tool_input={"timeout": 5, "command": "git push"}), again) is None  # same, keys reordered
    assert reply(theirs) == {"ok": True, "request_id": request_id, "behavior": "allow", "message": "ok by ann"}
    told = srv._outgoing.get_nowait().event
    assert told["event"] == "progress" and told["data"]["always_of"] == request_id
    other, _ = client()
    assert srv.ask(request(tool_input={"command": "git push --force"}), other) is None  # asks a person
    assert len(srv.waiting(JOB)) == 1
    srv.drop_asks(JOB, "ended")
    last, _ = client()
    assert srv.ask(request(tool_input={"command": "git push", "timeout": 5}), last) is None
    assert len(srv.waiting(JOB)) == 1  # the job's always ended with it


# ---------------------------------------------------------------- the dispatch's tool rules (§19)


@pytest.mark.parametrize(("rule", "tool", "subject", "matches"), [
    ("Bash", "Bash", "anything", True),
    ("Bash(git push *)", "Bash", "git push origin main", True),
    ("Bash(git push *)", "Bash", "git pull", False),
    ("Bash(git *)", "Edit", "git x", False),
    ("Edit", "Editor", "", False),
])
def test_a_tool_rule_covers_its_tool_and_a_glob_of_its_subject(rule, tool, subject, matches):
    assert names.tool_rule_matches(rule, tool, subject) is matches


def test_the_dispatch_rules_answer_known_requests_at_once_and_a_deny_rule_wins(tmp_path, client):
    srv = server(tmp_path)
    srv.tool_rules = lambda job_id: (("Bash(git *)",), ("Bash(git push *)",))
    denied, theirs = client()
    assert srv.ask(request(tool_input={"command": "git push origin main"}), denied) is None
    assert reply(theirs)["behavior"] == "deny"
    told = srv._outgoing.get_nowait().event
    assert told["detail"] == "denied Bash by the job's policy (Bash(git push *))" and told["data"]["by"] == "policy"
    allowed, theirs = client()
    assert srv.ask(request(tool_input={"command": "git status"}), allowed) is None
    assert reply(theirs) == {"ok": True, "request_id": "", "behavior": "allow",
                             "message": "allowed by the job's policy (Bash(git *))"}
    srv._outgoing.get_nowait()
    other, _ = client()
    assert srv.ask(request(tool_input={"command": "npm install"}), other) is None
    assert len(srv.waiting(JOB)) == 1  # no rule covers it: a person is asked
    assert srv.denied_tools(JOB) == {"Bash"}  # the policy's deny is a decision, not a failure


def test_deny_tools_travel_in_work_and_reach_claude_as_disallowed_tools():
    from mam.orchestrator.dispatch import work_terms
    from mam.runner.agents import AgentPolicy, ClaudeAdapter

    work = work_terms(deny_tools="Bash(git push *), WebFetch")
    assert work is not None and work.to_dict() == {"deny_tools": ["Bash(git push *)", "WebFetch"]}
    assert wire.Work.from_dict(work.to_dict()) == work
    argv = ClaudeAdapter(AgentPolicy.of_work(work)).argv(["claude"])
    assert argv[argv.index("--disallowedTools") + 1] == "Bash(git push *),WebFetch"
    with pytest.raises(UsageError, match="--deny-tools"):
        work_terms(deny_tools="Bash(")
    with pytest.raises(DecodeError):
        wire.Work.from_dict({"deny_tools": []})


def test_the_whole_input_is_sealed_to_the_hub_and_opens_only_with_the_jobs_token(tmp_path, client):
    from mam.shared.store.asklog import asks_in

    srv = server(tmp_path)
    secret = {"command": "curl -H 'token: s3cret' https://x", "why": "deploy"}
    assert srv.ask(request(tool_input=secret), client()[0]) is None
    event = srv._outgoing.get_nowait().event
    assert "s3cret" not in json.dumps(event)  # neither the summary nor the seal shows it in clear
    line = {**event, "timestamp": "2026-12-04T10:00:00Z"}
    [ask] = asks_in(JOB, [line], AUTH)
    assert json.loads(ask.full_input) == secret
    assert asks_in(JOB, [line], "another-token-0123456789")[0].full_input is None
    assert asks_in(JOB, [line])[0].full_input is None  # no key: the summary only
    moved = {**line, "data": {**line["data"], "attempt_id": 2}}  # bound to its attempt
    assert asks_in(JOB, [moved], AUTH)[0].full_input is None
    assert srv.ask(request(tool_input={"content": "x" * (localsock.MAX_SEALED_INPUT_BYTES + 1)}),
                   client()[0]) is None
    data = srv._outgoing.get_nowait().event["data"]
    assert "input_sealed" not in data and data["input_bytes"] > localsock.MAX_SEALED_INPUT_BYTES


# ---------------------------------------------------------------- the hook form (`ask --hook`)


def fake_daemon(path: Path, answer: dict) -> tuple[threading.Thread, list[dict]]:
    """A runner socket at `path` that answers one request line with `answer`; the lines it read."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    listener.settimeout(30)
    seen: list[dict] = []

    def serve() -> None:
        with listener, listener.accept()[0] as conn:
            seen.append(json.loads(conn.makefile("rb").readline()))
            conn.sendall(json.dumps(answer).encode() + b"\n")
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread, seen


def job_env(sock: Path) -> dict[str, str]:
    return {"MAM_JOB_ID": JOB, "MAM_ATTEMPT_ID": "1", "MAM_DISPATCH_TOKEN": TOKEN, "MAM_RUNNER_SOCKET": str(sock)}


def hook_input(event: str = "PreToolUse", **fields: object) -> bytes:
    return json.dumps({"session_id": "s", "cwd": "/w", "hook_event_name": event, "tool_name": "Bash",
                       "tool_input": {"command": "git push"}, "tool_use_id": "toolu_1", **fields}).encode()


@pytest.mark.parametrize(("event", "allow", "output"), [
    ("PreToolUse", True, {"hookEventName": "PreToolUse", "permissionDecision": "allow",
                          "permissionDecisionReason": "approved by ann@hub",
                          "updatedInput": {"command": "git push"}}),
    ("PreToolUse", False, {"hookEventName": "PreToolUse", "permissionDecision": "deny",
                           "permissionDecisionReason": "no pushes"}),
    ("PermissionRequest", True, {"hookEventName": "PermissionRequest", "decision": {"behavior": "allow"}}),
    ("PermissionRequest", False, {"hookEventName": "PermissionRequest",
                                  "decision": {"behavior": "deny", "message": "no pushes"}}),
])
def test_the_hook_asks_the_runner_and_prints_the_answer_in_the_hooks_own_shape(tmp_path, capsys, event, allow,
                                                                               output):
    message = "approved by ann@hub" if allow else "no pushes"
    thread, seen = fake_daemon(tmp_path / "runner.sock", {"ok": True, "request_id": RID, "message": message,
                                                          "behavior": "allow" if allow else "deny"})
    code = ask.hook_cli(io.BytesIO(hook_input(event)), job_env(tmp_path / "runner.sock"))
    thread.join(30)
    assert code == 0
    assert json.loads(capsys.readouterr().out) == {"hookSpecificOutput": output}
    assert seen == [{"job_id": JOB, "attempt_id": 1, "dispatch_token": TOKEN,
                     "ask": {"tool": "Bash", "input": {"command": "git push"}}}]


@pytest.mark.parametrize(("raw", "reason"), [
    (b"not json", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"{" + b" " * ask.MAX_HOOK_BYTES + b"}", f"larger than {ask.MAX_HOOK_BYTES} bytes"),
    (hook_input("PostToolUse"), 'hook_event_name "PostToolUse" is not one --hook answers'),
    (hook_input("\x1b[2J" + "x" * 5000), "is not one --hook answers"),
    (hook_input(tool_name=""), "no tool_name"),
    (hook_input(tool_name=["Bash"]), "no tool_name"),
    (hook_input(tool_input="git push"), "tool_input is not a JSON object"),
    (hook_input(tool_input={"content": "x" * (ask.MAX_INPUT_BYTES + 1)}),
     f"tool_input is larger than {ask.MAX_INPUT_BYTES}"),
])
def test_a_hook_input_it_cannot_ask_about_blocks_the_tool_with_one_line(tmp_path, capsys, raw, reason):
    code = ask.hook_cli(io.BytesIO(raw), job_env(tmp_path / "runner.sock"))
    out, err = capsys.readouterr()
    assert code == ask.HOOK_BLOCK == 2 and out == ""  # exit 2: both CLIs block the call and show stderr
    assert err.startswith("not asked: ") and reason in err and err.count("\n") == 1, err
    assert len(err) < 300


def test_the_hook_blocks_the_tool_outside_a_job_and_when_no_daemon_answers(tmp_path, capsys):
    assert ask.hook_cli(io.BytesIO(hook_input()), {}) == 2
    assert "not asked: mam-runner ask works inside a job only" in capsys.readouterr().err
    assert ask.hook_cli(io.BytesIO(hook_input()), job_env(tmp_path / "gone.sock")) == 2
    assert capsys.readouterr().err == "no answer: the runner daemon gave no answer\n"


@pytest.mark.parametrize(("args", "said"), [
    (["--hook", "--tool", "Bash"], "--hook reads the tool and its input from stdin"),
    (["--hook", "--input", '{"a": 1}'], "--hook reads the tool and its input from stdin"),
    ([], "name the tool with --tool NAME"),
])
def test_ask_takes_either_a_tool_or_a_hook(args, said):
    done = subprocess.run([sys.executable, "-m", "mam.runner", "ask", *args], capture_output=True, text=True,
                          timeout=60, input="", env={k: v for k, v in os.environ.items() if not k.startswith("MAM_")})
    assert done.returncode == 64 and done.stdout == ""
    assert done.stderr.startswith("ERROR: ") and said in done.stderr, done.stderr


# ---------------------------------------------------------------- a person's message to a running agent (§18)


def test_a_say_is_a_signed_control_whose_words_are_sealed_to_the_attempt_and_may_be_longer():
    words = "Also add a test. " * 400  # 6.8 KB: more than an answer's message may hold
    sealed = crypto.seal_answer(AUTH, job_id=JOB, attempt_id=2, request_id=RID, action="say", message=words)
    control = wire.Control.say(JOB, 2, RID, sealed=sealed)
    raw = wire.encode(crypto.sign(control.to_dict(), KEYS.sign_key))
    assert b"Also add" not in raw
    decoded = wire.decode(raw, "control")
    assert (decoded.action, decoded.request_id, decoded.reason) == ("say", RID, "sealed")
    assert crypto.open_answer(AUTH, decoded) == words
    short = crypto.seal_answer(AUTH, job_id=JOB, attempt_id=2, request_id=RID, action="say", message="hi")
    as_allow = wire.Control.answer(JOB, 2, RID, allow=True, sealed=short)
    with pytest.raises(SignatureError):
        crypto.open_answer(AUTH, as_allow)  # the seal is bound to the action too
    with pytest.raises(UsageError, match="at most 2048"):
        wire.Control.answer(JOB, 2, RID, allow=True, sealed=sealed)  # too long for an answer
    too_long = crypto.seal_answer(AUTH, job_id=JOB, attempt_id=2, request_id=RID, action="say",
                                  message="x" * (wire.MAX_SAID_BYTES + 1))
    with pytest.raises(UsageError, match="sealed.ciphertext is invalid"):
        wire.Control.say(JOB, 2, RID, sealed=too_long)
    with pytest.raises(DecodeError, match="always is only true, and only on an allow"):
        wire.Control.from_dict({**decoded.to_dict(), "always": True})


def started(attempt: int, **data: object) -> dict:
    return {"event": "started", "job_id": JOB, "timestamp": "2026-12-04T10:00:00Z",
            "data": {"attempt_id": attempt, "agent": "claude", **data}}


def test_the_hub_says_to_a_running_agent_only_when_its_attempt_takes_input(tmp_path):
    from mam.orchestrator import say

    registry = hub_job(tmp_path, started(1))
    with pytest.raises(say.Refusal, match="the job is pending, not running"):
        say.check_running(registry, JOB, "hi")
    record = registry.get(JOB)
    registry.transition(JOB, "running", source="runner", attempt_id=1, dispatch_token=record["dispatch_token"])
    with pytest.raises(say.Refusal, match="takes no input while it runs"):
        say.check_running(registry, JOB, "hi")
    registry.append_audit(JOB, started(2, takes_input=True))  # another attempt's start says nothing of this one
    assert not say.takes_input(registry, JOB, 1)
    registry.append_audit(JOB, started(1, takes_input="yes"))
    assert not say.takes_input(registry, JOB, 1)
    registry.append_audit(JOB, started(1, takes_input=True))
    assert say.check_running(registry, JOB, "hi")["job_id"] == JOB
    with pytest.raises(UsageError, match=f"a running agent is told at most {wire.MAX_SAID_BYTES}"):
        say.check_running(registry, JOB, "é" * (wire.MAX_SAID_BYTES // 2 + 1))
