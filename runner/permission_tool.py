"""`mam-runner permission-tool`: the MCP server Claude Code asks before a tool call that
no policy allows (`--permission-prompt-tool`), relaying the question to a person at the
hub (PROTOCOL §19).

The runner writes a per-attempt `--mcp-config` naming this command as the stdio server
`mam`; the CLI starts it with the agent's environment (MAM_JOB_ID, MAM_ATTEMPT_ID,
MAM_DISPATCH_TOKEN, MAM_RUNNER_SOCKET) and calls its tool `permission` with `tool_name`,
`input` and `tool_use_id`. The tool asks through the runner daemon's socket like `mam-runner
ask` and answers with the one text block the CLI expects: `{"behavior": "allow",
"updatedInput": <input>}` or `{"behavior": "deny", "message": ...}`. Built on the official
MCP Python SDK; the blocking wait runs in a worker thread.
"""

from __future__ import annotations

import json
import os
from typing import Any

SERVER = "mam"
TOOL = "permission"
PROMPT_TOOL = f"mcp__{SERVER}__{TOOL}"
"""The name `--permission-prompt-tool` takes: `mcp__<server>__<tool>`."""


def decide(tool_name: str, tool_input: dict[str, Any], environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """Ask a person (§19) and return the CLI's answer text; a request the runner cannot take
    is denied with its reason, so the CLI never runs a tool nobody allowed."""
    from mam.runner.ask import ask
    from mam.shared.protocol.errors import UsageError

    try:
        _, shown = ask(tool_name, json.dumps(tool_input), environ)
    except UsageError as exc:
        return json.dumps({"behavior": "deny", "message": f"not asked: {exc}"})
    if shown["behavior"] == "allow":
        return json.dumps({"behavior": "allow", "updatedInput": tool_input})
    return json.dumps({"behavior": "deny", "message": str(shown.get("message") or "denied")})


def serve() -> None:
    """Run the stdio MCP server until the CLI closes it."""
    import anyio
    from mcp.server.mcpserver import MCPServer

    server = MCPServer(SERVER, instructions="Relays tool permission requests to a person at the mam-fleet hub.")

    @server.tool(name=TOOL, description="Ask a person at the hub whether this tool call may run.",
                 structured_output=False)
    async def permission(tool_name: str, input: dict[str, Any], tool_use_id: str | None = None) -> str:  # noqa: A002
        return await anyio.to_thread.run_sync(decide, tool_name, input)

    server.run("stdio")


def mcp_config(python: str) -> dict[str, Any]:
    """The `--mcp-config` object that starts this server with `python`; `alwaysLoad` makes the
    CLI in print mode wait for it before the first turn (up to `MCP_CONNECT_TIMEOUT_MS`)."""
    return {"mcpServers": {SERVER: {"type": "stdio", "command": python, "args": ["-m", "mam.runner", "permission-tool"],
                                    "alwaysLoad": True}}}
