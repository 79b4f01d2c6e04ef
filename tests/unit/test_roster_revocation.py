"""PROTOCOL §16 revocation on the hub without a broker: once `runner revoke` stamps the
roster, a watcher refuses the runner's events, closes its open job `runner_lost` and
publishes a v2-signed cancel at its next tick; the presence feed forgets the runner, so
nothing is placed on it; the roster is re-read when its folder changes (no restart)."""

from __future__ import annotations

import io
import json
import time

import pytest
from test_hub_watch import KEYS, RecordingClient, deliver

from mam.orchestrator.identity import roster
from mam.orchestrator.queue import RunnerView
from mam.orchestrator.queuewait import PresenceFeed
from mam.orchestrator.watch import Watcher, WatchOptions
from mam.shared.protocol import names
from mam.shared.protocol.codes import CloseReason
from mam.shared.protocol.crypto.keys import EnrolRequest
from mam.shared.protocol.errors import ExitCode
from mam.shared.store import keyfiles
from mam.shared.store.registry import Registry

pytestmark = pytest.mark.timeout(30)

SESSION = "runner-a"


@pytest.fixture(autouse=True)
def look_every_time(monkeypatch):
    monkeypatch.setattr(roster, "REVOCATION_STAT_S", 0.0)  # no wait for the next roster look


def enrol(root, session=SESSION):
    made = keyfiles.create_runner_keys(root / f"{session}-host")
    roster.add(root, EnrolRequest.build(session, "x", made.ed25519_public, made.x25519_public))


def test_s16_revocations_reread_when_the_roster_changes(tmp_path):
    revocations = roster.Revocations(tmp_path)
    assert revocations.revoked_at(SESSION) is None  # no roster folder at all
    enrol(tmp_path)
    assert revocations.revoked_at(SESSION) is None
    entry = roster.revoke(tmp_path, SESSION)
    assert revocations.revoked_at(SESSION) == entry.revoked_at
    assert revocations.revoked_at("runner-b") is None


def test_s16_revoked_runner_events_refused_and_its_job_closed_runner_lost_with_a_v2_cancel(tmp_path):
    enrol(tmp_path)
    keyfiles.hub_key(tmp_path)
    reg = Registry(tmp_path)
    rec = reg.register(session=SESSION)
    client = RecordingClient()
    watcher = Watcher(reg, rec["job_id"], client=client, keys=KEYS, out=io.StringIO(),
                      options=WatchOptions(remote=True, ack_only_before_first=True))
    watcher.start_clocks(time.monotonic(), rec)
    deliver(client, rec, 1, "started")
    assert watcher.handle(*_next(client))  # enrolled: accepted
    assert watcher.tick(time.monotonic(), poll=False) is None
    roster.revoke(tmp_path, SESSION)
    deliver(client, rec, 2, "progress")
    assert not watcher.handle(*_next(client))
    assert watcher.refusals == ["runner revoked"]
    assert watcher.tick(time.monotonic(), poll=False) == ExitCode.TIMEOUT
    after = reg.get(rec["job_id"])
    assert (after["status"], after["close_reason"]) == ("error", CloseReason.RUNNER_LOST)
    topic, payload, _retain = client.published[-1]  # after the clear of the retained dispatch (started)
    assert topic == names.control_topic(rec["job_id"], client.config.topic_root)
    control = json.loads(payload)
    assert control["action"] == "cancel" and control["sig_alg"] == "ed25519"  # §16: signed by the hub key


def test_s16_presence_feed_forgets_a_revoked_runner(tmp_path):
    enrol(tmp_path)
    enrol(tmp_path, "runner-b")
    feed = PresenceFeed(KEYS, "mam", tmp_path)
    for session in (SESSION, "runner-b"):
        feed.fleet.update(RunnerView(session=session, runner_id="0" * 32, status="online", labels=frozenset({"x"}),
                                     max_jobs=1, running=frozenset(), verified=True, seen_at=time.monotonic()))
    feed.drop_revoked()
    assert [view.session for view in feed.fleet.views()] == [SESSION, "runner-b"]
    roster.revoke(tmp_path, SESSION)
    feed.drop_revoked()
    assert [view.session for view in feed.fleet.views()] == ["runner-b"]


def _next(client):
    message = client.messages.get_nowait()
    return message.topic, message.payload
