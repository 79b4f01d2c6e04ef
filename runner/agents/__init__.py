"""Agent adapters: how the runner starts a coding agent and reads its stream (PROTOCOL §18).

An adapter knows one agent CLI: the flags that make it print a machine-readable
stream and carry the dispatch's policy (`argv`), how to read that stream line by
line (`feed`, never raises), a budget the stream shows spent (`over_budget`), and
what the stream said when the agent ended (`report`). `command` is any executable,
whose exit status is its whole verdict; `claude` is the Claude Code CLI, `codex`
the Codex CLI.
"""

from __future__ import annotations

import os

from mam.runner.agents.base import Adapter, AgentPolicy, AgentReport
from mam.runner.agents.claude import ClaudeAdapter
from mam.runner.agents.codex import CodexAdapter

ADAPTERS: dict[str, type[Adapter]] = {"command": Adapter, "claude": ClaudeAdapter, "codex": CodexAdapter}
"""The adapters by `--agent` kind."""
KINDS = tuple(ADAPTERS)


def default_kind(argv: list[str] | tuple[str, ...]) -> str:
    """The kind for an `--exec` command when `--agent` is not given: `claude` or `codex`
    when the executable has that name, else `command`."""
    name = os.path.basename(argv[0]) if argv else ""
    return name if name in ADAPTERS and name != "command" else "command"


def new_adapter(kind: str, policy: AgentPolicy | None = None) -> Adapter:
    """A fresh adapter of `kind` (one per attempt). Raises KeyError for an unknown kind."""
    return ADAPTERS[kind](policy)


__all__ = ["ADAPTERS", "KINDS", "Adapter", "AgentPolicy", "AgentReport", "ClaudeAdapter", "CodexAdapter",
           "default_kind", "new_adapter"]
