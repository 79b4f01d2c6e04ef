"""The Claude Code adapter (`--agent claude`, PROTOCOL §18).

It runs the real CLI in print mode with a machine-readable stream
(`claude -p --output-format stream-json --verbose`, the brief on stdin) and reads
that stream, one JSON object per line:

- `{"type": "system", "subtype": "init", "session_id": ...}` first;
- `{"type": "assistant", "message": {"id", "usage", "content": [...]}}` per model
  message (a turn may span several lines with the same message id);
- `{"type": "result", "subtype": "success" | "error_max_turns" | ..., "is_error",
  "num_turns", "total_cost_usd", "usage", "result", "permission_denials": [{"tool_name"}],
  "api_error_status"}` last.

A later attempt continues an earlier one's session (§18 "Continued sessions") with
`--resume <session_id>`. The CLI looks a session up under the project folder of its
working directory (`<config>/projects/<cwd with every other character than a letter or
digit as '-'>/<session_id>.jsonl`, config being `$CLAUDE_CONFIG_DIR` or `~/.claude`), so
`place_transcript` copies the transcript there from the earlier attempt's folder first.

The CLI exits 0 even when it denied a tool (`subtype: success`); the report makes that
an `error` (`permission_denied`). Budgets go to the CLI (`--max-turns`,
`--max-budget-usd`) and are watched in the stream as well: a CLI that runs past them
is stopped by the runner (`over_budget`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mam.runner.agents.base import AgentPolicy, StreamAdapter, count_of, flag_value, money_of
from mam.runner.permission_tool import PROMPT_TOOL
from mam.shared.protocol import names

log = logging.getLogger("mam.agent")

SESSION_FLAGS = ("--resume", "-r", "--continue", "-c", "--session-id")
"""Flags of the CLI that choose the session themselves: an `--exec` that has one is left as it is."""


def config_dir(environ: Mapping[str, str]) -> Path | None:
    """Where the CLI keeps its state for an agent with `environ`: `$CLAUDE_CONFIG_DIR`, else
    `$HOME/.claude`; None without either."""
    explicit, home = environ.get("CLAUDE_CONFIG_DIR"), environ.get("HOME")
    return Path(explicit) if explicit else Path(home) / ".claude" if home else None


def project_folder(cwd: Path) -> str:
    """The CLI's project folder name of a working directory: every character that is not an
    ASCII letter or digit becomes '-' (`/tmp/rx/.x_y` → `-tmp-rx--x-y`)."""
    return re.sub(r"[^A-Za-z0-9]", "-", str(cwd))


def place_transcript(config: Path, session_id: str, cwd: Path) -> bool:
    """Make session `session_id` resumable from `cwd` (§18): True when its transcript is in
    `cwd`'s project folder, or was copied there (0600) from another project folder (the newest
    copy; links are never followed); False when the CLI never saved it here.

    Raises:
        UsageError: a session id that is not `names.AGENT_SESSION_RE` (it is a file name here).
    """
    name = f"{names.validate_agent_session_id(session_id)}.jsonl"
    projects = config / "projects"
    target = projects / project_folder(cwd) / name
    if target.is_file() and not target.is_symlink():
        return True
    found: list[tuple[float, Path]] = []
    for candidate in projects.glob(f"*/{name}"):
        try:
            info = candidate.lstat()
        except OSError:
            continue
        if candidate.is_file() and not candidate.is_symlink() and not candidate.parent.is_symlink():
            found.append((info.st_mtime, candidate))
    if not found:
        return False
    source = max(found)[1]
    try:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.path.lexists(target):
            target.unlink()
        shutil.copyfile(source, target, follow_symlinks=False)
        target.chmod(0o600)
    except OSError as exc:
        log.warning("claude session %s: its transcript could not be copied to %s: %s", session_id, target.parent,
                    exc.strerror or exc)
        return False
    return True


MCP_CONNECT_ENV = "MCP_CONNECT_TIMEOUT_MS"
MCP_CONNECT_MS = 30_000
"""How long the CLI waits for the permission tool's server before its first turn: the CLI's own
limit on one MCP server's connection (`MCP_TIMEOUT`, 30 s by default)."""


class ClaudeAdapter(StreamAdapter):
    """Claude Code in print mode with a stream-json stream (§18).

    Args:
        policy: the dispatch's budgets and tool policy (None: none).
    """

    kind = "claude"
    ignores = ()

    def __init__(self, policy: AgentPolicy | None = None) -> None:
        super().__init__(policy)
        self._messages: set[str] = set()
        self._result_seen = False
        self.permission_config: Path | None = None  # an --mcp-config with the permission tool (§19)
        self.resumed: str | None = None  # the session this attempt continues (§18)

    def continue_session(self, session_id: str, cwd: Path, environ: Mapping[str, str],
                         carried: Callable[[], bytes | None] | None = None) -> str | None:
        """`--resume session_id` once its transcript is in `cwd`'s project folder (§18): this
        host's own copy, else the one `carried`; else why not."""
        config = config_dir(environ)
        if config is None:
            return "neither CLAUDE_CONFIG_DIR nor HOME is set"
        if not place_transcript(config, session_id, cwd):
            target = config / "projects" / project_folder(cwd) / f"{names.validate_agent_session_id(session_id)}.jsonl"
            why = self.place_carried(target, session_id, carried,
                                     f"session {session_id} is not in {config / 'projects'} on this runner")
            if why is not None:
                return why
        self.resumed = session_id
        return None

    def transcript(self, cwd: Path, environ: Mapping[str, str]) -> Path | None:
        """`<config>/projects/<cwd's folder>/<session_id>.jsonl` of the session the stream named."""
        session, config = self._report.session_id, config_dir(environ)
        if session is None or config is None or not names.AGENT_SESSION_RE.fullmatch(session):
            return None
        path = config / "projects" / project_folder(cwd) / f"{session}.jsonl"
        try:
            info = path.lstat()
        except OSError:
            return None
        return path if stat.S_ISREG(info.st_mode) and not path.parent.is_symlink() else None

    def ask_person(self, mcp_config: Path) -> None:
        """Give the CLI the permission tool of `mcp_config`: what no policy allows is asked of a
        person at the hub (§19)."""
        self.permission_config = mcp_config

    def env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """With the permission tool, `MCP_CONNECT_TIMEOUT_MS` (unless `environ` sets it): the CLI
        in print mode waits only 2 s for MCP servers by default, a Python server on a busy host
        can take longer, and the CLI without its `--permission-prompt-tool` exits 1 (§19)."""
        if self.permission_config is None or MCP_CONNECT_ENV in environ:
            return {}
        return {MCP_CONNECT_ENV: str(MCP_CONNECT_MS)}

    def takes_input(self, exec_argv: list[str]) -> bool:
        """True when `exec_argv` asks for `--input-format stream-json`: the CLI then reads user
        messages as JSON lines on stdin until it closes (§18); the runner never adds that flag."""
        return flag_value(exec_argv, "--input-format") == "stream-json"

    def message(self, text: str) -> str:
        """One stream-json user message holding `text`, a line."""
        return json.dumps({"type": "user", "message": {"role": "user", "content": [{"type": "text", "text": text}]}},
                          ensure_ascii=False) + "\n"

    def turn_ended(self) -> bool:
        """True once a `result` was read: a message written before it was taken into that
        turn (the CLI tells the model mid-turn) or is already in the pipe for the next one."""
        return self._result_seen

    def argv(self, exec_argv: list[str]) -> list[str]:
        """`exec_argv` plus `-p` and the stream flags where absent, then the policy's flags.

        Raises:
            ValueError: `exec_argv` asks for another output format (one line).
        """
        argv = list(exec_argv)
        chosen: str | None = None
        for index, arg in enumerate(argv):
            if arg == "--output-format" or arg.startswith("--output-format="):
                chosen = arg.partition("=")[2] if "=" in arg else (argv[index + 1:index + 2] or [""])[0]
                del argv[index:index + (1 if "=" in arg else 2)]
                break
        if chosen not in (None, "stream-json"):
            raise ValueError(f"--output-format {chosen} in --exec: the claude agent reads stream-json; drop it "
                             "from --exec, or run with --agent command")
        if "-p" not in argv and "--print" not in argv:
            argv.append("-p")
        argv += ["--output-format", "stream-json"] + ([] if "--verbose" in argv else ["--verbose"])
        policy = self.policy
        if policy.max_turns is not None:
            argv += ["--max-turns", str(policy.max_turns)]
        if policy.max_cost_usd is not None:
            argv += ["--max-budget-usd", f"{policy.max_cost_usd:g}"]
        if policy.allow_tools:
            argv += ["--allowedTools", ",".join(policy.allow_tools)]
        if policy.deny_tools:
            argv += ["--disallowedTools", ",".join(policy.deny_tools)]
        if policy.permission_mode is not None:
            argv += ["--permission-mode", policy.permission_mode]
        if self.permission_config is not None:  # §19: what no policy allows is asked of a person
            argv += ["--mcp-config", str(self.permission_config), "--permission-prompt-tool", PROMPT_TOOL]
        if self.resumed is not None and not any(arg.split("=")[0] in SESSION_FLAGS for arg in exec_argv):
            argv += ["--resume", self.resumed]
        return argv

    def read(self, obj: dict[str, Any]) -> None:
        report = self._report
        kind = obj.get("type")
        session = obj.get("session_id")
        if isinstance(session, str) and session and report.session_id is None:
            report.session_id = session[:128]
        if kind == "assistant" and not self._result_seen:
            message = obj.get("message")
            if isinstance(message, Mapping):
                ident = str(message.get("id") or len(self._messages))
                if ident not in self._messages:  # one turn may print several lines
                    self._messages.add(ident)
                    report.turns = len(self._messages)
                    usage = message.get("usage")
                    if isinstance(usage, Mapping):
                        self._add_usage(usage)
        elif kind == "result":
            self._read_result(obj)

    def _add_usage(self, usage: Mapping[str, Any]) -> None:
        report = self._report
        report.input_tokens += count_of(usage.get("input_tokens"))
        report.output_tokens += count_of(usage.get("output_tokens"))
        report.cached_tokens += count_of(usage.get("cache_read_input_tokens"))

    def _read_result(self, obj: Mapping[str, Any]) -> None:
        report = self._report
        self._result_seen = True
        report.turns = count_of(obj.get("num_turns")) or report.turns
        usage = obj.get("usage")
        if isinstance(usage, Mapping):  # the totals replace the running sums
            report.input_tokens = report.output_tokens = report.cached_tokens = 0
            self._add_usage(usage)
        report.cost_usd = money_of(obj.get("total_cost_usd"))
        text = obj.get("result")
        report.result_text = text if isinstance(text, str) else None
        for denial in obj.get("permission_denials") or []:
            if isinstance(denial, Mapping):
                report.deny(denial.get("tool_name"))
        subtype = str(obj.get("subtype") or "")
        if subtype == "error_max_turns":
            report.budget_exceeded = f"max_turns {self.policy.max_turns or report.turns}"
        elif subtype.startswith("error_max_budget"):
            report.budget_exceeded = f"max_cost_usd {self.policy.max_cost_usd or report.cost_usd}"
        elif obj.get("is_error") is True:
            status = obj.get("api_error_status")
            reason = report.result_text or subtype or "the CLI reported an error"
            report.error = f"{reason} (HTTP {status})" if isinstance(status, int) and str(status) not in reason \
                else reason

    def over_budget(self) -> str | None:
        """`max_turns N` once the stream shows more model turns than allowed, `max_cost_usd X`
        once its reported cost passes the budget; None otherwise (§18)."""
        report, policy = self._report, self.policy
        if self._result_seen:
            return None  # the CLI ended by itself: its verdict is in the report
        if policy.max_turns is not None and report.turns > policy.max_turns:
            return f"max_turns {policy.max_turns}"
        if policy.max_cost_usd is not None and report.cost_usd is not None and report.cost_usd > policy.max_cost_usd:
            return f"max_cost_usd {policy.max_cost_usd:g}"
        return None


__all__ = ["ClaudeAdapter", "config_dir", "place_transcript", "project_folder"]
