"""PROTOCOL §16 revocation on the hub without a broker: once `runner revoke` stamps the
roster, a watcher refuses the runner's events, closes its open job `runner_lost` and
publishes a v2-signed cancel at its next tick; the presence feed forgets the runner, so
nothing is placed on it; the roster is re-read when its folder changes (no restart)."""

from __future__ import annotations

import io
import json
import os
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


def test_s16_a_roster_change_within_one_timestamp_tick_is_not_missed(tmp_path):
    """A file system stamps with a coarse clock: a revocation written within the same tick
    as the look before it leaves the folder's mtime unchanged, and must still be seen."""
    enrol(tmp_path)
    folder = names.roster_dir(tmp_path)
    revocations = roster.Revocations(tmp_path)
    before = folder.stat()
    assert revocations.revoked_at(SESSION) is None
    entry = roster.revoke(tmp_path, SESSION)
    os.utime(folder, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same tick as the look
    assert revocations.revoked_at(SESSION) == entry.revoked_at


def test_s16_a_settled_roster_is_not_read_again_until_its_folder_changes(tmp_path, monkeypatch):
    enrol(tmp_path)
    folder = names.roster_dir(tmp_path)
    hour_ago_ns = time.time_ns() - 3600 * 10**9
    os.utime(folder, ns=(hour_ago_ns, hour_ago_ns))
    reads = []
    real_entries = roster.entries
    monkeypatch.setattr(roster, "entries", lambda root: reads.append(root) or real_entries(root))
    revocations = roster.Revocations(tmp_path)
    for _ in range(3):
        assert revocations.revoked_at(SESSION) is None
    assert len(reads) == 1
    entry = roster.revoke(tmp_path, SESSION)
    assert revocations.revoked_at(SESSION) == entry.revoked_at
    assert len(reads) == 2


def test_s16_a_message_looks_at_the_roster_at_once_not_at_the_next_stat(tmp_path, monkeypatch):
    """§16.7: the roster is written before the notice goes out, so the runner's terminal,
    which the notice caused, is refused however recently the watcher last looked."""
    monkeypatch.setattr(roster, "REVOCATION_STAT_S", 3600.0)
    enrol(tmp_path)
    reg = Registry(tmp_path)
    rec = reg.register(session=SESSION)
    client = RecordingClient()
    watcher = Watcher(reg, rec["job_id"], client=client, keys=KEYS, out=io.StringIO(),
                      options=WatchOptions(remote=True, ack_only_before_first=True))
    watcher.start_clocks(time.monotonic(), rec)
    deliver(client, rec, 1, "started")
    assert watcher.handle(*_next(client))
    roster.revoke(tmp_path, SESSION)
    deliver(client, rec, 2, "error")
    assert not watcher.handle(*_next(client))
    assert watcher.refusals == ["runner revoked"] and watcher.terminal is None


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


def test_s16_a_job_for_a_revoked_session_is_refused_at_once_on_every_path(tmp_path, capsys):
    """`dispatch --session <revoked>` is exit 64 with one line and nothing registered; the
    same refusal for `mam.Hub` and the HTTP API, which queue through `register_queued`."""
    from mam.orchestrator import enqueue, submit
    from mam.shared.config import write_env_file
    from mam.shared.protocol.errors import UsageError
    from mam.shared.store.records import QueueTerms
    from mam.shared.store.registry import Contract

    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": "test-dispatch-secret-0123456789abcdef"},
                   overwrite=True)
    enrol(tmp_path)
    roster.revoke(tmp_path, SESSION)
    with pytest.raises(UsageError, match=f"session {SESSION} was revoked at .*enrol it again"):
        submit.dispatch_cli(session=SESSION, brief="x", brief_file=None, heartbeat_s=None, heartbeat_misses=None,
                            ack_timeout_s=None, idle_timeout_s=None, timeout_s=None, require_online=False,
                            detach=True, as_json=True, workspace=str(tmp_path))
    terms = QueueTerms(target_session=SESSION, target_labels=(), priority=0, queue_timeout_sec=60)
    with pytest.raises(UsageError, match="was revoked"):
        enqueue.register_queued(Registry(tmp_path), brief="x", contract=Contract(), terms=terms)
    assert not names.jobs_dir(tmp_path).exists() or not list(names.jobs_dir(tmp_path).glob("*.json"))
    enrol(tmp_path, "runner-b")  # another, active session is not refused
    enqueue.refuse_revoked(Registry(tmp_path), "runner-b")
