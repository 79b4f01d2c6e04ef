"""A scripted model server on 127.0.0.1 speaking the Anthropic Messages API and the OpenAI
Responses API with streaming (Server-Sent Events), for the real Claude Code CLI
(`ANTHROPIC_BASE_URL`) and Codex CLI (a `model_providers` entry) in tests.

Each `POST /v1/messages` that carries tools (the agent's main loop), and each `POST
/v1/responses`, answers with the next step of the script; other requests (a title or a
quota probe, should the CLI send one) get a short text. Every request is recorded. It
listens on loopback only and contacts nothing.

    with ModelServer([ToolUse("Bash", {"command": "git commit ..."}), Text("done")]) as model:
        env = model.env()   # ANTHROPIC_BASE_URL, a dummy key, nonessential traffic off
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any

MODEL = "claude-sonnet-4-5"
CLAUDE_ENV_PINS = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1", "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_MAX_RETRIES": "0",
    "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
}
"""What the CLI's environment pins in tests: no traffic but the model's, no retries of a 429."""


@dataclass(frozen=True)
class Text:
    """A final answer (`end_turn`), sent in `chunks` deltas `delay_s` apart (a long stream)."""

    text: str
    chunks: int = 1
    delay_s: float = 0.0

    def pieces(self) -> Iterator[str]:
        """The text in `chunks` pieces, waiting `delay_s` after each one."""
        size = max(1, -(-len(self.text) // max(1, self.chunks)))
        for start in range(0, max(1, len(self.text)), size):
            yield self.text[start:start + size]
            if self.delay_s:
                time.sleep(self.delay_s)


@dataclass(frozen=True)
class ToolUse:
    """One tool call (`stop_reason: tool_use`): the CLI runs it, or denies it, and asks again."""

    name: str
    input: dict[str, Any]


@dataclass(frozen=True)
class Failure:
    """An HTTP error with the API's JSON error body, e.g. 429 `rate_limit_error` with a reset time."""

    status: int
    kind: str
    message: str
    headers: dict[str, str] = field(default_factory=dict)

    def text(self) -> str:
        """The message with each `{reset+N}` as the UTC time N seconds after now (ISO 8601)."""
        return re.sub(r"\{reset\+(\d+)\}", lambda m: (datetime.now(UTC) + timedelta(seconds=int(m.group(1))))
                      .strftime("%Y-%m-%dT%H:%M:%SZ"), self.message)


@dataclass(frozen=True)
class Cut:
    """A stream that starts and then breaks off: the connection closes before the response ends."""


Step = Text | ToolUse | Failure | Cut


def claude_env(url: str, home: Path) -> dict[str, str]:
    """Environment for the real Claude Code CLI against the server at `url`, HOME at `home` (made)."""
    home.mkdir(parents=True, exist_ok=True)
    return {**CLAUDE_ENV_PINS, "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "sk-test-not-a-real-key",
            "HOME": str(home)}


CODEX_CONFIG = """model = "o4-mini"
model_provider = "local"

[model_providers.local]
name = "local"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "OPENAI_API_KEY"
request_max_retries = 0
stream_max_retries = 0
"""
"""The Codex CLI's config.toml in tests: our server only, no retries of a failed request."""


def codex_env(url: str, home: Path) -> dict[str, str]:
    """Environment for the real Codex CLI against the server at `url`: CODEX_HOME at
    `home/.codex` holding CODEX_CONFIG, a dummy key, HOME at `home`."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(url=url))
    return {"CODEX_HOME": str(codex_home), "OPENAI_API_KEY": "sk-test-not-a-real-key", "HOME": str(home),
            "RUST_LOG": "error"}


def tool_results(body: dict[str, Any]) -> list[str]:
    """What the CLI told the model its tools answered, as JSON text: every `tool_result` block
    of a Messages API request (Claude Code) and every `function_call_output` item's output of
    a Responses API request (Codex)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return [json.dumps(block.get("content")) for message in messages if isinstance(message, dict)
                and isinstance(message.get("content"), list) for block in message["content"]
                if isinstance(block, dict) and block.get("type") == "tool_result"]
    items = body.get("input")
    if isinstance(items, list):
        return [json.dumps(item.get("output")) for item in items
                if isinstance(item, dict) and item.get("type") == "function_call_output"]
    return []


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class ModelServer:
    """The scripted server. `requests` holds every request body received, in order, and
    `request_log` (when given) a JSON line per request (path, main loop or not, Host).

    Args:
        script: the steps played in order to the agent's main-loop requests; once spent,
            each further request gets `Text("done")`.
    """

    def __init__(self, script: list[Step], *, request_log: Path | None = None) -> None:
        self.script = list(script)
        self.request_log = request_log
        self.requests: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        self._calls = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802
                with server._lock:
                    server.paths.append(f"GET {self.path}")
                self._json(404, {"type": "error", "error": {"type": "not_found_error", "message": "not here"}})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    body = {}
                with server._lock:
                    server.paths.append(f"POST {self.path}")
                    server.requests.append(body)
                    if server.request_log is not None:
                        with open(server.request_log, "a") as out:
                            out.write(json.dumps({"path": self.path, "tools": bool(body.get("tools")),
                                                  "host": self.headers.get("Host"),
                                                  "messages": len(body.get("messages") or []),
                                                  "tool_results": tool_results(body)}) + "\n")
                if self.path.startswith("/v1/responses"):
                    step = Text("done")
                    with server._lock:
                        if server._calls < len(server.script):
                            step = server.script[server._calls]
                        server._calls += 1
                    if isinstance(step, Failure):
                        self._json(step.status, {"error": {"type": step.kind, "message": step.text()}},
                                   step.headers)
                    else:
                        self._responses(step)
                    return
                if self.path.startswith("/v1/messages/count_tokens"):
                    self._json(200, {"input_tokens": 10})
                    return
                if not self.path.startswith("/v1/messages"):
                    self._json(404, {"type": "error", "error": {"type": "not_found_error", "message": "not here"}})
                    return
                step: Step = Text("done")
                if body.get("tools"):
                    with server._lock:
                        if server._calls < len(server.script):
                            step = server.script[server._calls]
                        server._calls += 1
                if isinstance(step, Failure):
                    self._json(step.status, {"type": "error", "error": {"type": step.kind,
                                                                        "message": step.text()}}, step.headers)
                    return
                self._stream(step, streaming=bool(body.get("stream")))

            def _json(self, status: int, obj: dict[str, Any], headers: dict[str, str] | None = None) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def _open_stream(self) -> Any:
                """Send a 200 with SSE headers; the connection closes after the stream."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                return self.wfile

            def _responses(self, step: Text | ToolUse | Cut) -> None:
                """The OpenAI Responses API's stream (`wire_api = "responses"`, Codex CLI)."""
                with server._lock:
                    n = len(server.requests)
                out = self._open_stream()
                out.write(_sse("response.created", {"type": "response.created", "response": {"id": f"resp_{n}"}}))
                if isinstance(step, Cut):
                    out.flush()
                    return  # Connection: close, and no response.completed
                if isinstance(step, ToolUse):
                    item: dict[str, Any] = {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}",
                                            "name": step.name, "arguments": json.dumps(step.input)}
                else:
                    out.write(_sse("response.output_item.added", {
                        "type": "response.output_item.added", "output_index": 0, "item": {
                            "type": "message", "id": f"msg_{n}", "role": "assistant", "status": "in_progress",
                            "content": []}}))
                    for piece in step.pieces():
                        out.write(_sse("response.output_text.delta", {
                            "type": "response.output_text.delta", "item_id": f"msg_{n}", "output_index": 0,
                            "content_index": 0, "delta": piece}))
                        out.flush()
                    item = {"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": step.text, "annotations": []}]}
                out.write(_sse("response.output_item.done", {"type": "response.output_item.done", "output_index": 0,
                                                             "item": item}))
                out.write(_sse("response.completed", {"type": "response.completed", "response": {
                    "id": f"resp_{n}", "usage": {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 20},
                                                 "output_tokens": 50, "output_tokens_details": {"reasoning_tokens": 0},
                                                 "total_tokens": 150}}}))
                out.flush()

            def _stream(self, step: Text | ToolUse | Cut, *, streaming: bool) -> None:
                with server._lock:
                    n = len(server.requests)
                if isinstance(step, Cut):  # the headers of a stream, then the connection closes
                    self._open_stream()
                    return
                usage = {"input_tokens": 100, "output_tokens": 1, "cache_read_input_tokens": 20,
                         "cache_creation_input_tokens": 0}
                if isinstance(step, ToolUse):
                    block: dict[str, Any] = {"type": "tool_use", "id": f"toolu_{n:04d}", "name": step.name, "input": {}}
                    stop = "tool_use"
                else:
                    block, stop = {"type": "text", "text": ""}, "end_turn"
                if not streaming:
                    full = {**block, "input": step.input} if isinstance(step, ToolUse) else {**block, "text": step.text}
                    self._json(200, {"id": f"msg_{n}", "type": "message", "role": "assistant", "model": MODEL,
                                     "content": [full], "stop_reason": stop, "stop_sequence": None,
                                     "usage": {**usage, "output_tokens": 50}})
                    return
                out = self._open_stream()
                out.write(_sse("message_start", {"type": "message_start", "message": {
                    "id": f"msg_{n}", "type": "message", "role": "assistant", "model": MODEL, "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": usage}}))
                out.write(_sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                       "content_block": block}))
                if isinstance(step, ToolUse):
                    out.write(_sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(step.input)}}))
                else:
                    for piece in step.pieces():
                        out.write(_sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                               "delta": {"type": "text_delta", "text": piece}}))
                        out.flush()
                out.write(_sse("content_block_stop", {"type": "content_block_stop", "index": 0}))
                out.write(_sse("message_delta", {"type": "message_delta",
                                                 "delta": {"stop_reason": stop, "stop_sequence": None},
                                                 "usage": {"output_tokens": 50}}))
                out.write(_sse("message_stop", {"type": "message_stop"}))
                out.flush()

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="model-server", daemon=True)

    def __enter__(self) -> ModelServer:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()

    def env(self, home: Path) -> dict[str, str]:
        """The CLI's environment: this server, a dummy key, no other traffic, HOME at `home`."""
        return claude_env(self.url, home)


def step_to_json(step: Step) -> dict[str, Any]:
    """A step as JSON, for a server in another process (another host's namespace)."""
    return {"step": type(step).__name__, **asdict(step)}


def step_from_json(obj: dict[str, Any]) -> Step:
    kinds: dict[str, type[Any]] = {"Text": Text, "ToolUse": ToolUse, "Failure": Failure, "Cut": Cut}
    fields = dict(obj)
    return kinds[fields.pop("step")](**fields)  # type: ignore[no-any-return]


class ModelProcess:
    """The scripted server as its own process on `host`'s loopback (a runner in a namespace
    reaches only its own 127.0.0.1). `env(home)` and `calls()` as `ModelServer`.

    Args:
        spawn: starts an argv on the host (`Fleet._popen`-like: argv, env → Popen).
        folder: where the script, the port file and the request log go.
    """

    def __init__(self, spawn: Any, folder: Path, script: list[Step]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        script_path = folder / "script.json"
        self.port_file, self.request_log = folder / "port", folder / "requests.jsonl"
        script_path.write_text(json.dumps([step_to_json(step) for step in script]))
        self.port_file.unlink(missing_ok=True)
        self.proc = spawn([sys.executable, str(Path(__file__).resolve()), str(script_path), str(self.port_file),
                           str(self.request_log)])
        deadline = time.monotonic() + 60
        while not self.port_file.exists() or not self.port_file.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the model server did not start (exit {self.proc.poll()})")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(self.port_file.read_text())}"

    def env(self, home: Path) -> dict[str, str]:
        """The CLI's environment: this server, a dummy key, no other traffic, HOME at `home`."""
        return claude_env(self.url, home)

    def calls(self) -> list[dict[str, Any]]:
        """Every request received so far: path, whether it was a main-loop call, Host header,
        how many messages and the tool results it carried."""
        if not self.request_log.exists():
            return []
        return [json.loads(line) for line in self.request_log.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def main(argv: list[str]) -> None:
    """`modelserver.py SCRIPT.json PORT_FILE REQUEST_LOG`: serve the script until killed."""
    script = [step_from_json(obj) for obj in json.loads(Path(argv[0]).read_text())]
    server = ModelServer(script, request_log=Path(argv[2]))
    tmp = Path(argv[1] + ".tmp")
    tmp.write_text(str(server.port))
    tmp.rename(argv[1])
    server._server.serve_forever()


AGENTS_DIR = Path(__file__).resolve().parents[1] / "agents"
"""tests/agents: the npm project that installs the real agent CLIs (`make test` runs npm ci there)."""


def agent_bin(name: str) -> str | None:
    """The real agent CLI `name` (claude, codex) installed for the tests, else one on PATH, else None."""
    local = AGENTS_DIR / "node_modules" / ".bin" / name
    if local.exists() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def claude_bin() -> str | None:
    """The real Claude Code CLI for the tests, or None."""
    return agent_bin("claude")


__all__ = ["AGENTS_DIR", "CLAUDE_ENV_PINS", "CODEX_CONFIG", "Cut", "Failure", "ModelProcess", "ModelServer", "Text",
           "ToolUse", "agent_bin", "claude_bin", "claude_env", "codex_env"]

if __name__ == "__main__":
    main(sys.argv[1:])
