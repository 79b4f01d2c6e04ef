"""`mam-runner ask`: an agent asks a person at the hub for permission to use a tool, and
waits for the answer (PROTOCOL §19).

Inside a job only: the request goes to the runner daemon's local socket (`MAM_RUNNER_SOCKET`,
§17) with the attempt identity of the job's environment; the daemon records and sends the
`permission_required` event and holds the connection until the hub's signed answer comes
(`mam-orch approve` / `deny`), the job ends or the daemon stops. The answer is printed as one
JSON line, `{"behavior": "allow"|"deny", "message", "request_id"}`: the shape Claude Code's
permission prompt tool takes.

`mam-runner ask --hook` is the same question in the shape of an agent's own hooks: it reads
a Claude Code or Codex hook's JSON on stdin (`PreToolUse` or `PermissionRequest`, with
`tool_name` and `tool_input`) and prints that hook's decision (`hook_answer`), so an agent
configured with the hook asks a person at the hub before a tool runs (§19 "Hooks").
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import BinaryIO

from mam.runner import fastpath
from mam.shared.protocol import names
from mam.shared.protocol.errors import ExitCode, UsageError

MAX_INPUT_BYTES = 64 * 1024
"""Largest `--input`, bytes (the socket takes 128 KiB lines)."""

MAX_HOOK_BYTES = 256 * 1024
"""Largest hook JSON read from stdin, bytes: its `tool_input` still has to fit MAX_INPUT_BYTES."""

HOOK_EVENTS = ("PreToolUse", "PermissionRequest")
"""The hook events `--hook` answers (Claude Code and Codex name them alike)."""

HOOK_BLOCK = 2
"""The exit code both CLIs read as "block this tool call", stderr being the reason."""


def ask_request(tool: str, input_text: str, environ: Mapping[str, str]) -> dict[str, object]:
    """The socket request line's object for `tool` and `input_text` in this job's environment.

    Raises:
        UsageError: not inside a job, or `--input` is not a JSON object of at most 64 KiB.
    """
    missing = [name for name in ("MAM_JOB_ID", "MAM_ATTEMPT_ID", "MAM_DISPATCH_TOKEN", fastpath.SOCKET_ENV)
               if not environ.get(name)]
    if missing:
        raise UsageError(f"mam-runner ask works inside a job only: {', '.join(missing)} not set")
    if len(input_text.encode("utf-8", "surrogatepass")) > MAX_INPUT_BYTES:
        raise UsageError(f"--input is larger than {MAX_INPUT_BYTES} bytes")
    try:
        tool_input = json.loads(input_text)
    except ValueError:
        raise UsageError("--input is not valid JSON") from None
    if not isinstance(tool_input, dict):
        raise UsageError("--input must be a JSON object, e.g. '{\"command\": \"git push\"}'")
    try:
        attempt = int(environ["MAM_ATTEMPT_ID"])
    except ValueError:
        raise UsageError("MAM_ATTEMPT_ID is not an integer") from None
    return {"job_id": names.validate_job_id(environ["MAM_JOB_ID"]), "attempt_id": attempt,
            "dispatch_token": names.validate_token(environ["MAM_DISPATCH_TOKEN"]),
            "ask": {"tool": tool, "input": tool_input}}


def ask(tool: str, input_text: str, environ: Mapping[str, str] = os.environ) -> tuple[int, dict[str, object]]:
    """Ask and wait. Returns (exit code, the answer to print): 0 allowed, 1 denied or refused,
    2 no answer (the daemon cannot be reached or stopped first).

    Raises:
        UsageError: bad arguments or not inside a job (exit 64).
    """
    request = ask_request(tool, input_text, environ)
    line = json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"
    answer = fastpath.exchange(environ[fastpath.SOCKET_ENV], line, reply_timeout_s=None)
    if answer is None:
        return ExitCode.TIMEOUT, {"behavior": "deny", "message": "the runner daemon gave no answer"}
    if answer.get("usage") is True:
        raise UsageError(" ".join(str(answer.get("reason")).split()))
    if answer.get("ok") is not True:
        reason = " ".join(str(answer.get("reason") or "the runner refused the request").split())
        code = ExitCode.TIMEOUT if answer.get("no_answer") is True else ExitCode.REFUSED
        return code, {"behavior": "deny", "message": reason}
    allowed = answer.get("behavior") == "allow"
    shown: dict[str, object] = {"behavior": "allow" if allowed else "deny",
                                "message": str(answer.get("message") or ""),
                                "request_id": str(answer.get("request_id") or "")}
    return (ExitCode.COMPLETED if allowed else ExitCode.REFUSED), shown


def hook_question(raw: bytes) -> tuple[str, str, dict[str, object]]:
    """(event, tool, tool input) of a hook's stdin JSON `raw`.

    Raises:
        UsageError: not a UTF-8 JSON object of at most MAX_HOOK_BYTES, an event other
            than HOOK_EVENTS, no `tool_name` string, or no `tool_input` object of at most
            MAX_INPUT_BYTES.
    """
    if len(raw) > MAX_HOOK_BYTES:
        raise UsageError(f"the hook's input is larger than {MAX_HOOK_BYTES} bytes")
    try:
        hook = json.loads(raw.decode("utf-8"))
    except ValueError:
        raise UsageError("the hook's input on stdin is not valid JSON") from None
    if not isinstance(hook, dict):
        raise UsageError("the hook's input on stdin must be a JSON object")
    event = hook.get("hook_event_name")
    if event not in HOOK_EVENTS:
        shown = json.dumps(event)[:40] if event is not None else "none"
        raise UsageError(f"hook_event_name {shown} is not one --hook answers: {' or '.join(HOOK_EVENTS)}")
    tool, tool_input = hook.get("tool_name"), hook.get("tool_input", {})
    if not isinstance(tool, str) or not tool:
        raise UsageError("the hook's input has no tool_name")
    if not isinstance(tool_input, dict):
        raise UsageError("the hook's tool_input is not a JSON object")
    if len(json.dumps(tool_input).encode()) > MAX_INPUT_BYTES:
        raise UsageError(f"the hook's tool_input is larger than {MAX_INPUT_BYTES} bytes")
    return event, tool, tool_input


def hook_answer(event: str, shown: Mapping[str, object], tool_input: dict[str, object]) -> dict[str, object]:
    """The hook output that carries a person's answer `shown` for `event` (§19 "Hooks").

    `PreToolUse` (Claude Code, Codex): `permissionDecision` allow|deny with the message as
    `permissionDecisionReason`; an allow repeats the input as `updatedInput`, which both
    CLIs take as "run it as asked". `PermissionRequest`: `decision` `{"behavior", "message"}`
    (no `updatedInput`: Codex refuses one there).
    """
    allowed = shown.get("behavior") == "allow"
    message = str(shown.get("message") or ("allowed at the hub" if allowed else "denied at the hub"))
    if event == "PreToolUse":
        specific: dict[str, object] = {"hookEventName": event, "permissionDecision": "allow" if allowed else "deny",
                                       "permissionDecisionReason": message}
        if allowed:
            specific["updatedInput"] = tool_input
    else:
        specific = {"hookEventName": event,
                    "decision": {"behavior": "allow"} if allowed else {"behavior": "deny", "message": message}}
    return {"hookSpecificOutput": specific}


def hook_cli(stdin: BinaryIO, environ: Mapping[str, str] = os.environ) -> int:
    """`mam-runner ask --hook`: answer the hook JSON read from `stdin`; the exit code.

    Exits 0 with the decision on stdout once a person (or the job's rules, or the timeout)
    answered. A question it cannot ask (bad hook input, not inside a job) or one nobody can
    answer (the daemon is gone) exits 2 with the reason on stderr: both CLIs then block the
    tool and tell the model why, so nothing runs that nobody allowed.
    """
    try:
        event, tool, tool_input = hook_question(stdin.read(MAX_HOOK_BYTES + 1))
        code, shown = ask(tool, json.dumps(tool_input, ensure_ascii=False), environ)
    except UsageError as exc:
        print(f"not asked: {exc}", file=sys.stderr)
        return HOOK_BLOCK
    if code == ExitCode.TIMEOUT:
        print(f"no answer: {shown['message']}", file=sys.stderr)
        return HOOK_BLOCK
    print(json.dumps(hook_answer(event, shown, tool_input), ensure_ascii=False))
    return 0


def ask_cli(tool: str, input_text: str) -> int:
    """`mam-runner ask`: print the answer as one JSON line; the exit code."""
    try:
        code, shown = ask(tool, input_text)
    except UsageError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    print(json.dumps(shown, ensure_ascii=False))
    if code == ExitCode.TIMEOUT:
        print(f"ERROR: no answer: {shown['message']}", file=sys.stderr)
    return int(code)
