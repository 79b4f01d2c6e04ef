"""Agent adapters: how the runner starts a coding agent and reads its stream (PROTOCOL §18).

An adapter knows one agent CLI: the flags that make it print a machine-readable
stream (`argv`), how to read that stream line by line (`feed`, never raises), a
budget the CLI does not enforce itself (`over_budget`), and what the stream said
when the agent ended (`report`). Today there is one: a plain command (any
executable), whose exit status is its whole verdict; the Claude Code and Codex
adapters plug in here.
"""

from __future__ import annotations

from mam.runner.agents.base import Adapter, AgentReport

__all__ = ["Adapter", "AgentReport"]
