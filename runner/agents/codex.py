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

Codex keeps each session as `$CODEX_HOME/sessions/YYYY/MM/DD/rollout-<time>-<id>.jsonl`
(`CODEX_HOME` defaults to `~/.codex`), the day being the session's creation (the time in
its UUIDv7 id); it looks a session up in that day's folder only, by a canonical name.
An attempt that continues a session runs `codex exec resume <id> ... -` (§18), with the
sandbox as `-c sandbox_mode=...` (`exec resume` has no `--sandbox`).
"""

from __future__ import annotations

import dataclasses
import logging
import stat
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from mam.runner.agents.base import AgentPolicy, AgentReport, StreamAdapter, count_of
from mam.shared.protocol import names

log = logging.getLogger("mam.agent")

SANDBOX_OF_MODE = {"acceptEdits": "workspace-write", "plan": "read-only"}
STEP_ITEMS = frozenset({"agent_message", "command_execution", "file_change", "mcp_tool_call", "web_search"})
"""Items that each answer one model response: counted as turns."""
REJECTED_MARK = "reject command"
"""What Codex prints on stderr when it rejects a command's escalation (checked with 0.169)."""


def codex_home(environ: Mapping[str, str]) -> Path | None:
    """Where the CLI keeps its state for an agent with `environ`: `$CODEX_HOME`, else
    `$HOME/.codex`; None without either."""
    explicit, home = environ.get("CODEX_HOME"), environ.get("HOME")
    return Path(explicit) if explicit else Path(home) / ".codex" if home else None


def find_rollout(home: Path, session_id: str) -> Path | None:
    """Session `session_id`'s rollout file under `home/sessions` (a regular file in a day's
    folder, never through a link; the newest when several), or None.

    Raises:
        UsageError: a session id that is not `names.AGENT_SESSION_RE` (it is part of a file name here).
    """
    name = f"rollout-*-{names.validate_agent_session_id(session_id)}.jsonl"
    found: list[tuple[float, Path]] = []
    for candidate in (home / "sessions").glob(f"*/*/*/{name}"):
        try:
            info = candidate.lstat()
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and not any(p.is_symlink() for p in list(candidate.parents)[:4]):
            found.append((info.st_mtime, candidate))
    return max(found)[1] if found else None


def rollout_path(home: Path, session_id: str, now: float | None = None) -> Path:
    """Where Codex looks for session `session_id` on this host: the folder of the day its
    UUIDv7 id was made (local time; today for another id) and a canonical name."""
    try:
        made = uuid.UUID(session_id)
        seconds = (made.int >> 80) / 1000 if made.version == 7 else None
    except ValueError:
        seconds = None
    when = datetime.fromtimestamp(seconds if seconds is not None else time.time() if now is None else now)
    return home / "sessions" / when.strftime("%Y/%m/%d") / f"rollout-{when:%Y-%m-%dT%H-%M-%S}-{session_id}.jsonl"


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
        self.resumed: str | None = None  # the session this attempt continues (§18)

    def argv(self, exec_argv: list[str]) -> list[str]:
        """`codex exec --json --skip-git-repo-check [--sandbox S] ... -`: `exec` added after
        the executable when absent, the brief read from stdin (`-`); `codex exec resume <id>
        ... [-c sandbox_mode="S"] -` for an attempt that continues a session."""
        argv = list(exec_argv)
        if "exec" not in argv[1:]:
            argv.insert(1, "exec")
        resuming = self.resumed is not None and "resume" not in argv
        if resuming:
            at = argv.index("exec", 1) + 1
            argv[at:at] = ["resume", str(self.resumed)]
        argv += [flag for flag in ("--json", "--skip-git-repo-check") if flag not in argv]
        sandbox = SANDBOX_OF_MODE.get(self.policy.permission_mode or "")
        if sandbox is not None and "--sandbox" not in argv and "-s" not in argv:
            argv += ["-c", f'sandbox_mode="{sandbox}"'] if resuming else ["--sandbox", sandbox]
        if argv[-1] != "-":
            argv.append("-")
        return argv

    def continue_session(self, session_id: str, cwd: Path, environ: Mapping[str, str],
                         carried: Callable[[], bytes | None] | None = None) -> str | None:
        """`codex exec resume session_id` once its rollout is in this host's CODEX_HOME (§18):
        its own, else the one `carried` written where Codex looks; else why not."""
        home = codex_home(environ)
        if home is None:
            return "neither CODEX_HOME nor HOME is set"
        if find_rollout(home, session_id) is None:
            why = self.place_carried(rollout_path(home, session_id), session_id, carried,
                                     f"session {session_id} is not in {home / 'sessions'} on this runner")
            if why is not None:
                return why
        self.resumed = session_id
        return None

    def transcript(self, cwd: Path, environ: Mapping[str, str]) -> Path | None:
        """The rollout file of the session the stream named (§18 "Transcripts")."""
        session, home = self._report.session_id, codex_home(environ)
        if session is None or home is None or not names.AGENT_SESSION_RE.fullmatch(session):
            return None
        return find_rollout(home, session)

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
