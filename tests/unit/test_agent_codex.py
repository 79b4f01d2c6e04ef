"""The Codex CLI adapter reading `codex exec --json` (PROTOCOL §18), on lines the real CLI
0.169 printed here (tests/e2e/test_codex_agent.py runs the CLI itself)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from mam.runner.agents import AgentPolicy, CodexAdapter
from mam.runner.agents.codex import find_rollout, rollout_path
from mam.runner.settings import agent_kind
from mam.shared.protocol.errors import UsageError

THREAD = "01a241b9-afd2-7ae2-a50a-2c296204af7e"
STARTED = json.dumps({"type": "thread.started", "thread_id": THREAD})
WARNING = json.dumps({"type": "item.completed", "item": {"id": "item_0", "type": "error",
                                                          "message": "Model metadata for `o4-mini` not found."}})
COMMAND = json.dumps({"type": "item.completed", "item": {
    "id": "item_1", "type": "command_execution", "command": "/bin/bash -lc 'echo hi > a.txt'",
    "aggregated_output": "hi\n", "exit_code": 0, "status": "completed"}})
ANSWER = json.dumps({"type": "item.completed", "item": {"id": "item_2", "type": "agent_message", "text": "Done."}})
TURN_DONE = json.dumps({"type": "turn.completed", "usage": {
    "input_tokens": 200, "cached_input_tokens": 40, "cache_write_input_tokens": 0, "output_tokens": 100,
    "reasoning_output_tokens": 0}})
HIGH_DEMAND = "We’re currently experiencing high demand, which may cause temporary errors."


def fed(*lines: str, policy: AgentPolicy | None = None) -> CodexAdapter:
    adapter = CodexAdapter(policy)
    for line in lines:
        adapter.feed(line)
    return adapter


def test_a_run_reports_thread_steps_tokens_and_the_answer_and_a_warning_item_is_no_failure() -> None:
    report = fed(STARTED, WARNING, '{"type":"turn.started"}', COMMAND, ANSWER, TURN_DONE).report()
    assert report.outcome(0) is None
    assert report.data() == {"kind": "codex", "session_id": THREAD, "turns": 2,
                             "tokens": {"input": 200, "output": 100, "cached": 40}, "cost_usd": None,
                             "permission_denials": []}
    assert report.result_text == "Done."


def test_a_failed_turn_is_an_error_with_codexs_own_reason() -> None:
    failed = json.dumps({"type": "turn.failed", "error": {"message": HIGH_DEMAND}})
    report = fed(STARTED, json.dumps({"type": "error", "message": HIGH_DEMAND}), failed).report()
    assert report.outcome(1) == ("error", f"agent_error: {HIGH_DEMAND}")


def test_an_error_event_a_completed_turn_followed_was_a_retry_not_a_failure() -> None:
    retry = json.dumps({"type": "error", "message": "Reconnecting... 1/5"})
    assert fed(STARTED, retry).report().error == "Reconnecting... 1/5"  # the stream ended there
    assert fed(STARTED, retry, ANSWER, TURN_DONE).report().outcome(0) is None


def test_a_rejected_escalation_on_stderr_or_a_declined_command_is_permission_denied() -> None:
    stderr = ("2026-12-04T15:43:43Z ERROR codex_core::tools::router: error=approval policy is Never; reject "
              "command — you cannot ask for escalated permissions if the approval policy is Never")
    assert fed(STARTED, stderr, ANSWER, TURN_DONE).report().outcome(0) == (
        "error", "permission_denied: exec_command (escalation)")
    declined = json.dumps({"type": "item.completed", "item": {"type": "command_execution", "status": "declined"}})
    assert fed(STARTED, declined, ANSWER, TURN_DONE).report().outcome(0) == ("error", "permission_denied: exec_command")


def test_steps_past_max_turns_are_over_budget() -> None:
    adapter = fed(STARTED, COMMAND, COMMAND, policy=AgentPolicy(max_turns=2))
    assert adapter.over_budget() is None
    adapter.feed(COMMAND)
    assert adapter.over_budget() == "max_turns 2"


@pytest.mark.parametrize("line", ["WARNING: proceeding", "[]", '{"type": "item.completed", "item": 5}',
                                  '{"type": "turn.completed", "usage": {"input_tokens": -4}}', "\x1b[2J"])
def test_stderr_and_odd_shapes_are_counted_never_raised(line: str) -> None:
    report = fed(STARTED, line, ANSWER, TURN_DONE).report()
    assert report.session_id == THREAD and report.result_text == "Done." and report.outcome(0) is None


def test_argv_runs_exec_json_on_stdin_with_the_sandbox_of_the_permission_mode() -> None:
    assert CodexAdapter().argv(["codex"]) == ["codex", "exec", "--json", "--skip-git-repo-check", "-"]
    assert CodexAdapter(AgentPolicy(permission_mode="acceptEdits")).argv(["/usr/bin/codex", "exec", "-m", "o3"]) == [
        "/usr/bin/codex", "exec", "-m", "o3", "--json", "--skip-git-repo-check", "--sandbox", "workspace-write", "-"]
    assert CodexAdapter(AgentPolicy(permission_mode="plan")).argv(["codex", "-s", "danger-full-access"]) == [
        "codex", "exec", "-s", "danger-full-access", "--json", "--skip-git-repo-check", "-"]


def test_codex_is_the_default_for_an_executable_named_codex_and_says_what_it_ignores() -> None:
    assert agent_kind(None, ["/opt/codex"]) == "codex"
    adapter = CodexAdapter(AgentPolicy(max_turns=3, max_cost_usd=1.0, allow_tools=("Edit",)))
    assert adapter.ignored() == ["max_cost_usd", "allow_tools"]


# ------------------------------------------------------------------ continued sessions (§18)

MADE = "01a246ff-9291-7672-885b-8875c08e6478"  # a UUIDv7 made 2026-12-05 16:18:04 UTC


def rollout(home: Path, text: str = '{"type":"session_meta"}\n') -> Path:
    """Attempt 1's rollout file where Codex saved it."""
    path = rollout_path(home, MADE)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_a_session_of_this_host_resumes_with_exec_resume_and_the_sandbox_as_config(tmp_path: Path) -> None:
    env = {"CODEX_HOME": str(tmp_path / "codex")}
    adapter = CodexAdapter(AgentPolicy(permission_mode="acceptEdits"))
    why = adapter.continue_session(MADE, Path("/w/t"), env)
    assert why is not None and "is not in" in why and "resume" not in adapter.argv(["codex"])
    saved = rollout(tmp_path / "codex")
    assert saved.parent.relative_to(tmp_path / "codex").parts[:1] == ("sessions",)
    assert adapter.continue_session(MADE, Path("/w/t"), env) is None and not adapter.transcript_carried
    assert adapter.argv(["codex", "-m", "o3"]) == ["codex", "exec", "resume", MADE, "-m", "o3", "--json",
                                                   "--skip-git-repo-check", "-c", 'sandbox_mode="workspace-write"', "-"]
    adapter.read({"type": "thread.started", "thread_id": MADE})
    assert adapter.transcript(Path("/w/t"), env) == saved
    assert CodexAdapter().continue_session(MADE, Path("/w"), {}) == "neither CODEX_HOME nor HOME is set"


def test_a_carried_transcript_is_written_where_codex_looks_and_links_are_never_followed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    adapter = CodexAdapter()
    assert adapter.continue_session(MADE, Path("/w/t"), {"HOME": str(home)}, lambda: b'{"carried":1}\n') is None
    (placed,) = (home / ".codex" / "sessions").glob(f"*/*/*/rollout-*-{MADE}.jsonl")
    assert placed.read_bytes() == b'{"carried":1}\n' and oct(placed.stat().st_mode & 0o777) == "0o600"
    assert adapter.transcript_carried and adapter.argv(["codex"])[1:4] == ["exec", "resume", MADE]
    other = tmp_path / "other"
    elsewhere = rollout(other / "real")
    linked = other / ".codex" / "sessions" / "2026" / "12"
    linked.parent.mkdir(parents=True)
    linked.symlink_to(elsewhere.parent.parent)  # a linked month folder
    assert find_rollout(other / ".codex", MADE) is None
    with pytest.raises(UsageError):
        find_rollout(other / ".codex", "../x")
    made = datetime.fromtimestamp(0)
    assert rollout_path(home, "not-a-uuid", now=0).name == f"rollout-{made:%Y-%m-%dT%H-%M-%S}-not-a-uuid.jsonl"
