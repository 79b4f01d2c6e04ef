"""The Claude Code adapter reading the CLI's stream-json (PROTOCOL §18), on lines shaped like
the ones the real CLI printed here (tests/e2e/test_claude_agent.py runs the CLI itself)."""

from __future__ import annotations

import json
import logging

import pytest

from mam.runner import agents
from mam.runner.agents import AgentPolicy, ClaudeAdapter
from mam.runner.settings import agent_kind
from mam.shared.protocol import wire
from mam.shared.protocol.errors import UsageError

SESSION = "3e36370c-8c85-4574-9568-4898181420f8"


def init() -> str:
    return json.dumps({"type": "system", "subtype": "init", "cwd": "/w", "session_id": SESSION, "tools": ["Bash"]})


def assistant(msg_id: str, *content: dict[str, object]) -> str:
    return json.dumps({"type": "assistant", "session_id": SESSION, "message": {
        "id": msg_id, "role": "assistant", "content": list(content),
        "usage": {"input_tokens": 100, "output_tokens": 1, "cache_read_input_tokens": 20}}})


def result(**fields: object) -> str:
    base: dict[str, object] = {
        "type": "result", "subtype": "success", "is_error": False, "api_error_status": None, "num_turns": 2,
        "result": "All done.", "session_id": SESSION, "total_cost_usd": 0.002112,
        "usage": {"input_tokens": 200, "cache_read_input_tokens": 40, "output_tokens": 100},
        "permission_denials": []}
    return json.dumps({**base, **fields})


def fed(*lines: str, policy: AgentPolicy | None = None) -> ClaudeAdapter:
    adapter = ClaudeAdapter(policy)
    for line in lines:
        adapter.feed(line)
    return adapter


def test_a_successful_run_reports_session_turns_tokens_cost_and_the_answer() -> None:
    adapter = fed(init(), assistant("msg_1", {"type": "text", "text": "All done."}), result())
    report = adapter.report()
    assert report.outcome(0) is None
    assert report.data() == {"kind": "claude", "session_id": SESSION, "turns": 2,
                             "tokens": {"input": 200, "output": 100, "cached": 40}, "cost_usd": 0.002112,
                             "permission_denials": []}
    assert report.result_text == "All done."


def test_a_denied_tool_is_an_error_even_though_the_cli_said_success() -> None:
    denial = {"tool_name": "Bash", "tool_use_id": "toolu_1", "tool_input": {"command": "echo hi > a.txt"}}
    adapter = fed(init(), result(permission_denials=[denial, denial, {**denial, "tool_name": "Write"}]))
    assert adapter.report().outcome(0) == ("error", "permission_denied: Bash, Write")


def test_an_api_error_is_an_error_with_the_agents_own_reason() -> None:
    adapter = fed(init(), result(is_error=True, api_error_status=500, num_turns=1, total_cost_usd=0,
                                 result="API Error: 500 internal server error"))
    assert adapter.report().outcome(1) == ("error", "agent_error: API Error: 500 internal server error")


def test_a_usage_limit_is_its_own_error_for_the_hub_to_pause_on() -> None:
    adapter = fed(init(), result(is_error=True, api_error_status=429, num_turns=1, total_cost_usd=0,
                                 result="API Error: Request rejected (429) · usage limit reached"))
    assert adapter.report().outcome(1) == ("error", "usage_limit: API Error: Request rejected (429) · usage limit "
                                                    "reached")


def test_the_cli_stopping_on_its_turn_budget_is_budget_exceeded() -> None:
    adapter = fed(init(), result(subtype="error_max_turns", is_error=True, num_turns=3),
                  policy=AgentPolicy(max_turns=2))
    assert adapter.report().outcome(1) == ("error", "budget_exceeded: max_turns 2")


def test_turns_past_the_budget_in_the_stream_are_over_budget_before_any_result() -> None:
    adapter = fed(init(), assistant("m1", {"type": "tool_use"}), assistant("m1", {"type": "text"}),
                  assistant("m2", {"type": "tool_use"}), policy=AgentPolicy(max_turns=2))
    assert adapter.over_budget() is None  # two messages, one of them on two lines
    adapter.feed(assistant("m3", {"type": "tool_use"}))
    assert adapter.over_budget() == "max_turns 2"
    assert adapter.report().turns == 3


@pytest.mark.parametrize("line", [
    "not json at all", "[1, 2, 3]", '{"type": "result", "num_turns": "many", "permission_denials": 7}',
    "\x1b[31mred\x1b[0m", "{" * 5000, '"' + "x" * (10 << 20) + '"',
])
def test_malformed_oversized_and_hostile_lines_are_counted_never_raised(line: str,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mam.agent"):
        adapter = fed(init(), line, result())
    report = adapter.report()
    assert report.session_id == SESSION and report.turns == 2
    assert report.unreadable_lines in (0, 1)
    assert all(len(record.getMessage()) < 400 for record in caplog.records)


def test_unreadable_lines_are_said_in_the_data() -> None:
    adapter = fed("garbage", "more garbage", result())
    assert adapter.report().data()["unreadable_lines"] == 2


def test_argv_adds_print_mode_stream_and_the_policy() -> None:
    policy = AgentPolicy(max_turns=5, max_cost_usd=0.5, allow_tools=("Bash(git *)", "Edit"),
                         permission_mode="acceptEdits")
    assert ClaudeAdapter(policy).argv(["claude"]) == [
        "claude", "-p", "--output-format", "stream-json", "--verbose",
        "--max-turns", "5", "--max-budget-usd", "0.5", "--allowedTools", "Bash(git *),Edit", "--permission-mode",
        "acceptEdits"]
    assert ClaudeAdapter().argv(["claude", "-p", "--verbose", "--output-format=stream-json"]) == [
        "claude", "-p", "--verbose", "--output-format", "stream-json"]


@pytest.mark.parametrize(("exec_argv", "takes"), [
    (["claude"], False), (["claude", "--input-format", "stream-json"], True),
    (["claude", "--input-format=text"], False), (["claude", "--input-format=stream-json"], True),
    (["claude", "--input-format", "text"], False), (["claude", "--input-format"], False),
])
def test_claude_reads_a_persons_messages_on_stdin_when_exec_asks_for_stream_json_input(exec_argv: list[str],
                                                                                 takes: bool) -> None:
    adapter = ClaudeAdapter()
    assert adapter.takes_input(exec_argv) is takes
    argv = adapter.argv(exec_argv)
    assert argv.count("--input-format") + sum(a.startswith("--input-format=") for a in argv) == \
        exec_argv.count("--input-format") + sum(a.startswith("--input-format=") for a in exec_argv)  # never added
    assert not agents.new_adapter("command").takes_input(["claude"])


def test_a_message_is_one_stream_json_user_line_and_the_turn_ends_at_the_result() -> None:
    adapter = ClaudeAdapter()
    line = adapter.message("Now add a test.\nAnd \u00e9 \x1b[2J too.")
    assert line.endswith("\n") and line.count("\n") == 1
    assert json.loads(line) == {"type": "user", "message": {"role": "user", "content": [
        {"type": "text", "text": "Now add a test.\nAnd \u00e9 \x1b[2J too."}]}}
    assert not adapter.turn_ended()
    adapter.feed(json.dumps({"type": "assistant", "message": {"id": "m1", "content": []}}))
    assert not adapter.turn_ended()
    adapter.feed(result())
    assert adapter.turn_ended()


@pytest.mark.parametrize(("exec_argv", "agent", "expected"), [
    (["claude"], None, "claude"), (["/opt/bin/claude", "-p"], None, "claude"), (["./agent.sh"], None, "command"),
    (["claude"], "command", "command"), (["./wrapper"], "Claude", "claude"),
])
def test_the_agent_kind_defaults_from_the_executables_name(exec_argv: list[str], agent: str | None,
                                                          expected: str) -> None:
    assert agent_kind(agent, exec_argv) == expected
    assert agents.new_adapter(expected).kind == expected


@pytest.mark.parametrize(("exec_argv", "agent", "message"), [
    (["claude"], "gemini", "--agent 'gemini' is invalid: expected one of command, claude"),
    (["claude", "--output-format", "text"], None, "--output-format text in --exec: the claude agent reads "
                                                  "stream-json"),
])
def test_a_bad_agent_or_a_stream_it_cannot_read_is_refused_in_one_line(exec_argv: list[str], agent: str | None,
                                                                       message: str) -> None:
    with pytest.raises(UsageError) as caught:
        agent_kind(agent, exec_argv)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_safe_line_makes_any_text_a_valid_detail() -> None:
    hostile = "done\n\x1b[2J\x1b]0;pwned\x07 \u2028ok" + "x" * 3000
    line = wire.safe_line(hostile, wire.MAX_DETAIL_CHARS)
    assert wire.fields.check_text(line, "detail", wire.MAX_DETAIL_CHARS) == line
    assert line.startswith("done \\x1b[2J\\x1b]0;pwned\\x07 ok")


def test_an_over_long_output_line_is_left_out_and_counted(tmp_path: pytest.TempPathFactory) -> None:
    from mam.runner.work import MAX_LINE_BYTES, LineFollower

    log_file = tmp_path / "agent.log"  # type: ignore[operator]
    log_file.write_bytes(b"a\n" + b"x" * (MAX_LINE_BYTES + 10) + b"\nb\n" + b"y" * (MAX_LINE_BYTES + 1))
    follower = LineFollower(log_file, 0)
    assert follower.read() == ["a", "b"]
    assert follower.skipped == 2
