"""What every `mam-orch` command works with: the hub's registry, its broker
settings, its dispatch keys and MQTT connections (PROTOCOL §5, §8, §13).
`open_hub(workspace)` resolves the root only; the rest is made on demand, so
each command keeps its own order of checks (what fails first, §9).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mam.shared import config
from mam.shared.config import BrokerConfig
from mam.shared.protocol import crypto
from mam.shared.protocol.crypto import DispatchKeys
from mam.shared.store.records import JobRecord
from mam.shared.store.registry import Registry
from mam.shared.store.root import resolve_root
from mam.shared.transport import Transport, TransportFactory, mqtt

Workspace = str | os.PathLike[str] | None
DAY_S = 86400  # seconds in a day, for the commands' day-valued options


def signing_keys(workspace: Workspace = None) -> DispatchKeys:
    """The dispatch keys from MAM_DISPATCH_SECRET (§5).

    Raises:
        ConfigError: the secret is unset or shorter than 32 characters.
    """
    return crypto.derive_keys(config.dispatch_secret(workspace=workspace))


def connect(cfg: BrokerConfig, role: str = "hub", transport: TransportFactory = mqtt.new_client) -> Transport:
    """A connected client made by `transport` (§13 fail-over and deadlines); closed again
    if connecting fails.

    Raises:
        BrokerUnavailable: no broker accepted the connection (exit 3).
    """
    client = transport(cfg, role, None)
    try:
        client.connect()
    except BaseException:
        client.close()
        raise
    return client


@dataclass
class Hub:
    """The hub of one workspace root (§8). No side effects in the constructor.

    Attributes:
        registry: its `Registry`.
        transport: makes its broker connections (the runner's `TransportFactory` seam:
            paho by default, the in-memory fake in unit tests).
    """

    registry: Registry
    _keys: DispatchKeys | None = field(default=None, repr=False)
    _settings: dict[str, str] | None = field(default=None, repr=False)
    transport: TransportFactory = field(default=mqtt.new_client, repr=False)

    @property
    def root(self) -> Path:
        """The registry root (`resolve_root`)."""
        return self.registry.root

    def keys(self) -> DispatchKeys:
        """The dispatch keys, derived once (§5).

        Raises:
            ConfigError: MAM_DISPATCH_SECRET is unset or too short.
        """
        if self._keys is None:
            self._keys = signing_keys(self.root)
        return self._keys

    def settings(self) -> Mapping[str, str]:
        """The §13 settings (the environment over `.mam.env`), read once, as the keys are:
        one command's or one program's view of them (the contract's defaults, §5).

        Raises:
            EnvFileError: the env file cannot be read (not kept: the next call reads again).
        """
        if self._settings is None:
            self._settings = config.load_env(workspace=self.root)
        return self._settings

    def broker_config(self, record: JobRecord | None = None) -> BrokerConfig:
        """The broker settings (§13), with a record's per-job overrides when given.

        Raises:
            ConfigError, EnvFileError.
        """
        overrides = record.get("broker") if record is not None else None
        return config.broker_config(overrides or None, workspace=self.root)

    def connect(self, role: str = "hub", record: JobRecord | None = None) -> Transport:
        """A connected client for `role` with `broker_config(record)`.

        Raises:
            ConfigError, EnvFileError, BrokerUnavailable.
        """
        return connect(self.broker_config(record), role, self.transport)


def open_hub(workspace: Workspace = None) -> Hub:
    """The hub of the root §8 picks for `workspace` (nothing read or written yet)."""
    return Hub(Registry(resolve_root(workspace)))
