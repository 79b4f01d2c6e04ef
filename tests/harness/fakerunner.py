"""A real `Runner` daemon over the in-memory fake broker (`harness.fake_mqtt`), in a thread:
for unit tests of what the daemon does with the hub's retained messages (§7, §16.7)."""

from __future__ import annotations

import threading
from pathlib import Path

from harness.fake_mqtt import FakeBroker
from mam.runner.service import Runner
from mam.runner.settings import RunnerOptions
from mam.runner.trust import HubTrust
from mam.shared.config import BrokerConfig
from mam.shared.protocol import names, wire


def serve_runner(broker: FakeBroker, root: Path, *, config: BrokerConfig, trust: HubTrust, session: str,
                 **options: object) -> tuple[Runner, list[int], threading.Thread]:
    """Start `Runner.serve()` in a thread: (the runner, a list that gets its exit code, the thread)."""
    opts = RunnerOptions(session=session, argv=("true",), root=root, presence_wait_s=0.05,
                         **options)  # type: ignore[arg-type]
    runner = Runner(opts, config=config, trust=trust, transport=broker.client)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(runner.serve()), daemon=True)
    thread.start()
    return runner, result, thread


def presence_statuses(broker: FakeBroker, session: str, root: str) -> list[str]:
    """The statuses of every presence `session` published, in order (cleared ones skipped)."""
    topic = names.presence_topic(session, root)
    return [wire.decode(p.payload, "presence").status for p in broker.on_topic(topic) if p.payload]
