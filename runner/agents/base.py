"""The adapter base: the policy, the report and a plain command (PROTOCOL §18)."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mam.shared.protocol import wire
from mam.shared.protocol.errors import MamError
from mam.shared.store.fsio import atomic_write

MAX_DENIALS_SHOWN = 8
MAX_UNREADABLE_LOGGED = 3
"""Lines of a stream that are not the CLI's JSON logged at most per attempt (the rest are counted)."""

log = logging.getLogger("mam.agent")

_LIMIT_RE = re.compile(r"(?:API Error:?|HTTP|status)\s*429\b|\(429\)|usage limit|rate limit|limit reached"
                       r"|quota exceeded", re.IGNORECASE)
_EPOCH_RE = re.compile(r"\|\s*(\d{10})\b")
_ISO_RE = re.compile(r"\b(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d{1,9})?)?(?:Z|[+-]\d{2}:?\d{2})?)")
_AFTER_RE = re.compile(r"\b(?:in|after)\s+(\d{1,6})\s*(seconds?|secs?|s|minutes?|mins?|m|hours?|hrs?|h)\b",
                       re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
MAX_RESET_AHEAD_S = 7 * 86400
"""A reset further ahead than this is not believed (the hub's default pause applies)."""


def is_usage_limit(text: str) -> bool:
    """Whether an agent's error says it stopped on a usage or rate limit (§18): an HTTP 429
    (`API Error: 429`, `HTTP 429`, `Request rejected (429)`), or the words `usage limit`,
    `rate limit`, `limit reached`, `quota exceeded`."""
    return bool(_LIMIT_RE.search(text))


def reset_time(text: str, now: float) -> float | None:
    """When a usage limit resets, from the agent's error text (epoch seconds), or None.

    Understood: Claude Code's `...limit reached|<epoch seconds>`, an ISO 8601 time
    (`resets at 2026-12-04T18:00:00Z`; no zone is UTC), and `in|after N seconds|minutes|hours`.
    A time in the past is now; one more than MAX_RESET_AHEAD_S ahead, or over a day ago, is None.
    """
    found: float | None = None
    if match := _EPOCH_RE.search(text):
        found = float(match.group(1))
    elif match := _ISO_RE.search(text):
        try:
            moment = datetime.fromisoformat(match.group(1).replace(" ", "T"))
        except ValueError:
            moment = None
        if moment is not None:
            found = (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()
    elif match := _AFTER_RE.search(text):
        found = now + int(match.group(1)) * _UNIT_S[match.group(2)[0].lower()]
    if found is None or not now - 86400 <= found <= now + MAX_RESET_AHEAD_S:
        return None
    return max(found, now)


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value `argv` gives `flag` (`--flag V` or `--flag=V`; "" when it ends the line), or
    None when absent."""
    for index, arg in enumerate(argv):
        if arg == flag:
            return argv[index + 1] if index + 1 < len(argv) else ""
        if arg.startswith(flag + "="):
            return arg.partition("=")[2]
    return None


def count_of(value: object) -> int:
    """A token or turn count from a stream: a non-negative JSON integer, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53 else 0


def money_of(value: object) -> float | None:
    """A cost in US dollars from a stream: a number 0 <= x < 1e9, else None."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e9
    return float(value) if ok else None  # type: ignore[arg-type]


@dataclass(frozen=True)
class AgentPolicy:
    """What a dispatch allows its agent (§18 `work`): budgets and tools.

    Attributes:
        max_turns: model turns at most (None: no limit).
        max_cost_usd: US dollars at most (None: no limit).
        allow_tools: tool rules the CLI may use without asking, e.g. `Bash(git *)`, `Edit`.
        deny_tools: tool rules the CLI may never use (it asks nobody about them).
        permission_mode: the CLI's permission mode (e.g. `acceptEdits`), or None.
    """

    max_turns: int | None = None
    max_cost_usd: float | None = None
    allow_tools: tuple[str, ...] = ()
    deny_tools: tuple[str, ...] = ()
    permission_mode: str | None = None

    @classmethod
    def of_work(cls, work: wire.Work | None) -> AgentPolicy:
        """The policy a dispatch's `work` carries (none for a plain job)."""
        if work is None:
            return cls()
        return cls(max_turns=work.max_turns, max_cost_usd=work.max_cost_usd, allow_tools=work.allow_tools,
                   deny_tools=work.deny_tools,
                   permission_mode=work.permission_mode)


@dataclass
class AgentReport:
    """What an agent's stream said by its end (§18 `data.agent`).

    Attributes:
        kind: the adapter's kind (claude, codex, command).
        session_id: the CLI's session (Claude Code) or thread (Codex) id, or None.
        result_text: the agent's final answer, unmasked (the caller masks it).
        turns; input/output/cached_tokens; cost_usd (None: the CLI does not say).
        permission_denials: names of the tools the CLI denied, in order, distinct.
        error: the agent's own reason when its stream reports a failure (an API error).
        budget_exceeded: which budget the CLI stopped on (e.g. `max_turns 3`), or None.
        unreadable_lines: stream lines that were not the CLI's JSON (counted, never fatal).
        limit_reset_at: when the usage limit the agent stopped on resets (epoch s; `limited`).
    """

    kind: str = "command"
    session_id: str | None = None
    result_text: str | None = None
    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cost_usd: float | None = None
    permission_denials: list[str] = field(default_factory=list)
    error: str | None = None
    budget_exceeded: str | None = None
    unreadable_lines: int = 0
    limit_reset_at: float | None = None

    @property
    def limited(self) -> bool:
        """The agent's error says it stopped on a usage or rate limit (§18 `usage_limit`)."""
        return self.error is not None and is_usage_limit(self.error)

    def note_limit(self, now: float | None = None) -> None:
        """Read the reset time of a usage limit from the error text (once)."""
        if self.limited and self.limit_reset_at is None and self.error is not None:
            self.limit_reset_at = reset_time(self.error, time.time() if now is None else now)

    def data(self) -> dict[str, Any]:
        """The terminal event's `data.agent` (§18): kind, session_id, turns, tokens, cost_usd, denials,
        and `usage_limit` {"reset_at"} (empty when the reset is not known) when it stopped on one."""
        data: dict[str, Any] = {"kind": self.kind, "session_id": self.session_id, "turns": self.turns,
                "tokens": {"input": self.input_tokens, "output": self.output_tokens, "cached": self.cached_tokens},
                "cost_usd": self.cost_usd, "permission_denials": list(self.permission_denials)}
        if self.unreadable_lines:
            data["unreadable_lines"] = self.unreadable_lines
        if self.limited:
            self.note_limit()
            reset = self.limit_reset_at
            data["usage_limit"] = {"reset_at": wire.format_ts(datetime.fromtimestamp(reset, UTC))} \
                if reset is not None else {}
        return data

    def outcome(self, exit_code: int | None, decided: Collection[str] = ()) -> tuple[str, str] | None:
        """(event, detail) when the stream overrides the exit status (§18), else None.

        A permission denial is `error` `permission_denied: <tools>` even after exit 0, unless
        its tool is in `decided` (a person at the hub denied it, §19: listed, no failure);
        then a budget the CLI stopped on (`budget_exceeded: ...`); then a usage or rate limit
        (`usage_limit: ...`, the hub may pause the job); then the agent's own error
        (`agent_error: ...`). A non-zero exit with none of these is left to the exit status.
        """
        undecided = [tool for tool in self.permission_denials if tool not in decided]
        if undecided:
            shown = ", ".join(undecided[:MAX_DENIALS_SHOWN])
            more = len(undecided) - MAX_DENIALS_SHOWN
            return "error", f"permission_denied: {shown}" + (f" (+{more} more)" if more > 0 else "")
        if self.budget_exceeded:
            return "error", f"budget_exceeded: {self.budget_exceeded}"
        if self.limited:
            return "error", f"usage_limit: {self.error}"
        if self.error:
            return "error", f"agent_error: {self.error}"
        return None

    def deny(self, tool: object) -> None:
        """Note one denied tool (names kept once, in order)."""
        name = str(tool)[:80] if tool else "unknown tool"
        if name not in self.permission_denials:
            self.permission_denials.append(name)


class Adapter:
    """A plain command (`--agent command`): its argv as given, no stream, no budget."""

    kind = "command"
    ignores: tuple[str, ...] = ("max_turns", "max_cost_usd", "permission_mode")
    """The policy fields this agent cannot apply (the runner logs them when a dispatch sets them); the
    tool rules answer its `mam-runner ask` requests (§19)."""

    def __init__(self, policy: AgentPolicy | None = None) -> None:
        self.policy = policy or AgentPolicy()
        self._report = AgentReport(kind=self.kind)
        self.transcript_carried = False  # `continue_session` used the transcript the hub carried (§18)

    def argv(self, exec_argv: list[str]) -> list[str]:
        """The command line to start: `exec_argv` plus this agent's stream and policy flags."""
        return list(exec_argv)

    def feed(self, line: str) -> None:
        """Read one line of the agent's output (never raises)."""

    def continue_session(self, session_id: str, cwd: Path, environ: Mapping[str, str],
                         carried: Callable[[], bytes | None] | None = None) -> str | None:
        """Make this attempt continue an earlier attempt's agent session (§18), its agent to run
        in `cwd` with `environ`; `carried` gives the session's transcript the hub sent (opened
        only when this host has none; None when unusable). Returns None when it will, else why
        not (one line)."""
        return f"the {self.kind} agent cannot continue a session"

    def place_carried(self, target: Path, session_id: str, carried: Callable[[], bytes | None] | None,
                      missing: str) -> str | None:
        """Write the transcript the hub carried at `target`, where the CLI looks for session
        `session_id` (0600); None once written, else why not (`missing` when none was carried)."""
        data = carried() if carried is not None else None
        if data is None:
            return missing
        try:
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write(target, data, what=f"transcript of session {session_id}", durable=False)
        except (OSError, MamError) as exc:
            return f"the carried transcript of session {session_id} could not be written: {exc}"
        log.info("%s session %s: the transcript the hub carried is in %s", self.kind, session_id, target.parent)
        self.transcript_carried = True
        return None

    def over_budget(self) -> str | None:
        """The budget the stream shows spent that the CLI does not stop on itself, or None."""
        return None

    def transcript(self, cwd: Path, environ: Mapping[str, str]) -> Path | None:
        """The session transcript the agent saved on this host while working in `cwd` with
        `environ` (a regular file, never a link), to travel with the result; None when it
        keeps none (§18 "Transcripts")."""
        return None

    def env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """What the agent's environment gains for this adapter's flags, `environ` being the
        runner's (a variable it already sets is left to it)."""
        return {}

    def takes_input(self, exec_argv: list[str]) -> bool:
        """True when the agent started from `exec_argv` reads a person's further messages on
        stdin while it works (§18 "Input while it runs"); then `message` frames each one (the
        brief too) and `turn_ended` says when to close stdin. A plain command reads the brief only."""
        return False

    def message(self, text: str) -> str:
        """`text` (the brief, or a person's message) framed as this agent reads input on stdin."""
        return text

    def turn_ended(self) -> bool:
        """True once the stream shows the agent finished what it was asked: stdin is closed
        then, so that it ends (a message sent later continues its session instead, §18)."""
        return True

    def report(self) -> AgentReport:
        """What the stream said so far."""
        return self._report

    def ignored(self) -> list[str]:
        """The policy fields the dispatch set that this agent cannot apply."""
        return [name for name in self.ignores if getattr(self.policy, name) not in (None, ())]

    def note_unreadable(self, text: str = "", count: int = 1) -> None:
        """Count `count` lines that were not the stream's JSON; log the first few (cut)."""
        self._report.unreadable_lines += count
        if text and self._report.unreadable_lines <= MAX_UNREADABLE_LOGGED:
            log.warning("%s stream: a line that is not a JSON object (%d bytes): %r", self.kind, len(text),
                        text[:120])


class StreamAdapter(Adapter):
    """An agent CLI that prints one JSON object per line: `feed` parses each line and hands
    the object to `read` (a shape it does not know is counted, never raised), any other
    line to `read_text`."""

    def feed(self, line: str) -> None:
        """Read one line of the agent's output (never raises)."""
        text = line.strip()
        if not text:
            return
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            self.read_text(text)
            return
        try:
            self.read(obj)
        except (TypeError, ValueError, AttributeError) as exc:  # a shape we do not know: counted, not fatal
            self.note_unreadable(f"{type(exc).__name__}: {exc}")

    def read(self, obj: dict[str, Any]) -> None:
        """One JSON object of the stream."""

    def read_text(self, text: str) -> None:
        """A line that is not a JSON object: counted (and the first few logged)."""
        self.note_unreadable(text)
