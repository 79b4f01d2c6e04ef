"""`mam-runner publish` through the runner daemon's local socket (PROTOCOL §17).

An agent's publish sends one JSON line `{"job_id", "attempt_id",
"dispatch_token", "event", "detail", "data"}` to `MAM_RUNNER_SOCKET`; the
daemon checks it (§8), writes it to disk and its outbox, answers
`{"ok": true, "seq": N}` and sends it on its own connection. This module runs
BEFORE typer is imported and loads only the standard library and
`mam.shared.protocol.names`/`errors`: no typer, paho or cryptography.

`try_publish(argv)` returns None whenever the fast path does not apply, and
the typer command then runs (v1: its own connection, the same messages and
exit 64 for bad input): no variable, a socket that is absent, refuses or
does not answer (ENOENT, ECONNREFUSED, timeout), an option it does not
handle (`--heartbeat`, `--help`, ...), argv typer would reject, or a
`--workspace` that is not the daemon's.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from mam.shared.protocol import names
from mam.shared.protocol.errors import ExitCode
from mam.shared.store.fsio import unix_address

SOCKET_ENV = "MAM_RUNNER_SOCKET"
CONNECT_TIMEOUT_S = 2.0
"""Longest wait, seconds, for the daemon to accept the connection and read the line."""
REPLY_TIMEOUT_S = 60.0
"""Longest wait, seconds, for the daemon's answer (a terminal event waits for the §12 barrier)."""
MAX_REPLY_BYTES = 8 * 1024
"""Cap on the daemon's one-line answer, bytes."""
MAX_ATTEMPTS = 10
"""Highest `--attempts` (the same bound as `mam.runner.cli.MAX_PUBLISH_ATTEMPTS`)."""

OPTIONS = {"--job": "job_id", "--event": "event", "--detail": "detail", "--data": "data",
           "--attempts": "attempts", "--attempt-id": "attempt_id", "--dispatch-token": "dispatch_token",
           "--workspace": "workspace"}
ENV_DEFAULTS = {"attempt_id": "MAM_ATTEMPT_ID", "dispatch_token": "MAM_DISPATCH_TOKEN"}


def parse_argv(argv: list[str], environ: dict[str, str] | os._Environ[str]) -> dict[str, Any] | None:
    """The request of `publish ...` argv, or None when typer must handle it."""
    if not argv or argv[0] != "publish":
        return None
    opts: dict[str, str] = {}
    rest = iter(argv[1:])
    for arg in rest:
        name, eq, value = arg.partition("=")
        if name not in OPTIONS:
            return None
        if not eq:
            value = next(rest, None)  # type: ignore[assignment]
            if value is None:
                return None
        opts[OPTIONS[name]] = value
    for key, env in ENV_DEFAULTS.items():
        opts.setdefault(key, environ.get(env, ""))
    if "job_id" not in opts or "event" not in opts or not opts["attempt_id"] or not opts["dispatch_token"]:
        return None
    try:
        attempts = int(opts.pop("attempts", "3"))
        attempt_id = int(opts["attempt_id"])
        data = json.loads(opts["data"]) if opts.get("data") else {}
    except ValueError:
        return None  # typer says why
    if not 1 <= attempts <= MAX_ATTEMPTS or not isinstance(data, dict):
        return None
    workspace = opts.pop("workspace", None) or environ.get("MAM_REAL_ROOT")
    if not workspace:
        return None
    return {"job_id": opts["job_id"], "attempt_id": attempt_id, "dispatch_token": opts["dispatch_token"],
            "event": opts["event"], "detail": opts.get("detail", ""), "data": data, "_root": workspace}


def exchange(path: str, line: bytes, reply_timeout_s: float | None = REPLY_TIMEOUT_S) -> dict[str, Any] | None:
    """Send `line`, read the one-line answer (waiting at most `reply_timeout_s`; None: until
    the daemon answers or closes); None when the daemon cannot be reached or gave no answer."""
    address, fd = unix_address(Path(path))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect(address)
            sock.sendall(line)
            sock.settimeout(reply_timeout_s)
            reply = b""
            while b"\n" not in reply and len(reply) < MAX_REPLY_BYTES:
                chunk = sock.recv(MAX_REPLY_BYTES)
                if not chunk:
                    break
                reply += chunk
    except OSError:  # ENOENT, ECONNREFUSED, a timeout, a path that is not a socket
        return None
    finally:
        if fd is not None:
            os.close(fd)
    try:
        answer = json.loads(reply.split(b"\n", 1)[0])
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def try_publish(argv: list[str], environ: dict[str, str] | os._Environ[str] = os.environ) -> int | None:
    """Publish through the daemon's socket; the exit code (§9), or None to run the typer command."""
    path = environ.get(SOCKET_ENV)
    if not path:
        return None
    request = parse_argv(argv, environ)
    if request is None:
        return None
    root = request.pop("_root")
    if os.path.realpath(names.runner_socket_path(Path(root))) != os.path.realpath(path):
        return None  # another workspace than the daemon's: its own connection (v1)
    line = json.dumps(request, separators=(",", ":")).encode("ascii")
    answer = exchange(path, line + b"\n")
    if answer is None:
        return None
    if answer.get("ok") is True and isinstance(answer.get("seq"), int):
        print(json.dumps({"job_id": request["job_id"], "seq": answer["seq"], "event": request["event"],
                          "published": True, "via": "runner"}))
        return ExitCode.PUBLISHED
    reason = " ".join(str(answer.get("reason") or "the runner daemon refused the event").split())
    if answer.get("usage") is True:
        print(f"ERROR: {reason}", file=sys.stderr)
        return ExitCode.USAGE
    print(f"ERROR: refused: {reason}", file=sys.stderr)
    return ExitCode.REFUSED
