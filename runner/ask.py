"""`mam-runner ask`: an agent asks a person at the hub for permission to use a tool, and
waits for the answer (PROTOCOL §19).

Inside a job only: the request goes to the runner daemon's local socket (`MAM_RUNNER_SOCKET`,
§17) with the attempt identity of the job's environment; the daemon records and sends the
`permission_required` event and holds the connection until the hub's signed answer comes
(`mam-orch approve` / `deny`), the job ends or the daemon stops. The answer is printed as one
JSON line, `{"behavior": "allow"|"deny", "message", "request_id"}`: the shape Claude Code's
permission prompt tool and hooks take.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping

from mam.runner import fastpath
from mam.shared.protocol import names
from mam.shared.protocol.errors import ExitCode, UsageError

MAX_INPUT_BYTES = 64 * 1024
"""Largest `--input`, bytes (the socket takes 128 KiB lines)."""


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
