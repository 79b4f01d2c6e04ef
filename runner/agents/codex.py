"""The Codex CLI adapter (`--agent codex`, PROTOCOL §18).

It runs `codex exec --json --skip-git-repo-check ... -` (the brief on stdin) and reads
its JSONL events, one object per line (Codex CLI 0.169):

- `{"type": "thread.started", "thread_id": ...}` first;
- `{"type": "item.completed", "item": {"type": "agent_message" | "command_execution" |
  "file_change" | "mcp_tool_call" | "web_search" | "reasoning" | "error", ...}}` per step
  (an `error` item is a warning, e.g. unknown model metadata);
- `{"type": "turn.completed", "usage": {"input_tokens", "cached_input_tokens",
  "output_tokens"}}`, or `{"type": "turn.failed", "error": {"message"}}`;
- `{"type": "error", "message"}` when the model endpoint fails (then `turn.failed`).

Codex reports no cost. A command whose escalation it rejected shows only on its stderr
(`reject command`), which the runner's output file holds too; it counts as a denial.
The policy maps onto Codex's sandbox: `permission_mode` acceptEdits → `--sandbox
workspace-write`, plan → `--sandbox read-only`; `max_turns` (model steps) is enforced
by the runner from the stream; `allow_tools` and `max_cost_usd` do not apply.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from mam.runner.agents.base import AgentPolicy, AgentReport, StreamAdapter, count_of

log = logging.getLogger("mam.agent")

SANDBOX_OF_MODE = {"acceptEdits": "workspace-write", "plan": "read-only"}
STEP_ITEMS = frozenset({"agent_message", "command_execution", "file_change", "mcp_tool_call", "web_search"})
"""Items that each answer one model response: counted as turns."""
REJECTED_MARK = "reject command"
"""What Codex prints on stderr when it rejects a command's escalation (checked with 0.169)."""


class CodexAdapter(StreamAdapter):
    """Codex CLI's `exec --json` (§18).

    Args:
        policy: the dispatch's budgets and permission mode (None: none).
    """

    kind = "codex"
    ignores = ("max_cost_usd", "allow_tools", "deny_tools")

    def __init__(self, policy: AgentPolicy | None = None) -> None:
        super().__init__(policy)
        self._pending_error: str | None = None
        self._ended = False

    def argv(self, exec_argv: list[str]) -> list[str]:
        """`codex exec --json --skip-git-repo-check [--sandbox S] ... -`: `exec` added after
        the executable when absent, the brief read from stdin (`-`)."""
        argv = list(exec_argv)
        if "exec" not in argv[1:]:
            argv.insert(1, "exec")
        argv += [flag for flag in ("--json", "--skip-git-repo-check") if flag not in argv]
        sandbox = SANDBOX_OF_MODE.get(self.policy.permission_mode or "")
        if sandbox is not None and "--sandbox" not in argv and "-s" not in argv:
            argv += ["--sandbox", sandbox]
        if argv[-1] != "-":
            argv.append("-")
        return argv

    def read_text(self, text: str) -> None:
        """Codex's stderr log (the runner's output file holds both streams): counted, and read
        only for a rejected command."""
        if REJECTED_MARK in text:
            self._report.deny("exec_command (escalation)")
        self.note_unreadable(text)

    def read(self, obj: dict[str, Any]) -> None:
        report = self._report
        kind = obj.get("type")
        if kind == "thread.started" and isinstance(obj.get("thread_id"), str):
            report.session_id = obj["thread_id"][:128]
        elif kind == "item.completed" and isinstance(obj.get("item"), Mapping):
            self._read_item(obj["item"])
        elif kind == "turn.completed":
            self._ended, self._pending_error = True, None
            usage = obj.get("usage")
            if isinstance(usage, Mapping):
                report.input_tokens += count_of(usage.get("input_tokens"))
                report.cached_tokens += count_of(usage.get("cached_input_tokens"))
                report.output_tokens += count_of(usage.get("output_tokens"))
        elif kind == "turn.failed":
            self._ended = True
            error = obj.get("error")
            message = error.get("message") if isinstance(error, Mapping) else None
            report.error = str(message or self._pending_error or "turn failed")
        elif kind == "error":
            self._pending_error = str(obj.get("message") or "error")

    def _read_item(self, item: Mapping[str, Any]) -> None:
        report = self._report
        kind = item.get("type")
        if kind in STEP_ITEMS:
            report.turns += 1
        if kind == "agent_message" and isinstance(item.get("text"), str):
            report.result_text = item["text"]
        elif kind == "command_execution" and item.get("status") == "declined":
            report.deny("exec_command")
        elif kind == "error":
            log.info("codex: %s", str(item.get("message"))[:200])

    def report(self) -> AgentReport:
        """What the stream said; an `error` event no turn outcome followed is the error."""
        if self._report.error is None and self._pending_error is not None and not self._ended:
            return dataclasses.replace(self._report, error=self._pending_error)
        return self._report

    def over_budget(self) -> str | None:
        """`max_turns N` once the stream shows more model steps than allowed (§18)."""
        turns = self.policy.max_turns
        if not self._ended and turns is not None and self._report.turns > turns:
            return f"max_turns {turns}"
        return None


__all__ = ["CodexAdapter"]
