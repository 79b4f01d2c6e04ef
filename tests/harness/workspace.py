"""Workspaces of a job for a test broker: the `.mam.env` file (PROTOCOL §13) and a clean environment."""

from __future__ import annotations

import os
from pathlib import Path

from harness.brokers import BrokerProcess
from mam.shared.config import write_env_file

TEST_SECRET = "test-dispatch-secret-0123456789abcdef"


def write_env_for(handle: BrokerProcess, workspace: Path, **extra: str) -> Path:
    """Write `<workspace>/.mam.env` (0600) pointing at a running broker handle as the agent user."""
    workspace = Path(workspace)
    workspace.mkdir(parents=True, exist_ok=True)
    cfg = handle.config()
    values = {"MQTT_BROKER": cfg.host, "MQTT_PORT": str(cfg.port), "MQTT_USERNAME": cfg.username,
              "MQTT_PASSWORD": cfg.password, "MQTT_CLIENT_ID_PREFIX": "test", "MQTT_KEEPALIVE": "5",
              "MAM_TOPIC_ROOT": cfg.topic_root, "MAM_DISPATCH_SECRET": TEST_SECRET, **extra}
    return write_env_file(workspace / ".mam.env", values, overwrite=True)


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without MQTT_/MAM_ settings (so tests never read the developer's), plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MQTT_", "MAM_", "WORKSPACE_ROOT"))}
    env.update(extra)
    return env
