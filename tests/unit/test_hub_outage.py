"""On the hub, without a broker: a running state mirrored into a pending
record (fault 3, PROTOCOL §4/§3.2 rule 6), earlier attempts' stragglers told from
forgeries (fault 11, §3.2 rule 4), late terminals (§14), the dispatch cleared on
`started` (§17), and the clocks that stand still while the hub's own broker
connection is down (§14 "Broker outages are nobody's silence")."""

from __future__ import annotations

import io
import json
import logging
import queue
import threading
import time

import pytest
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import TEST_SECRET

from mam.orchestrator.acceptance import Refused, Seen, accept
from mam.orchestrator.hints import reattach_hint
from mam.orchestrator.watch import Watcher, WatchOptions
from mam.shared.cli.render import cli_jobs, cli_show, jobs_table
from mam.shared.config import BrokerConfig
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import ExitCode
from mam.shared.store.records import redact
from mam.shared.store.registry import Contract, Registry
from mam.shared.transport.mqtt import Message

TS = "2026-06-20T14:49:30Z"
KEYS = crypto.derive_keys(TEST_SECRET)
IDLE_S = 0.5  # K × N of these tests' watches
OUTAGE_S = 4 * IDLE_S  # a hub-side broker outage well past the idle window
BLINK_IDLE_S = 3.0  # the idle window of the test whose outage falls between two looks...
BLINK_AFTER_S = 1.0  # ...a third into it


class FlakyClient:
    """The slice of `MqttClient` the watcher uses, with a connection the test can drop."""

    def __init__(self) -> None:
        self.config = BrokerConfig()
        self.messages: queue.Queue[Message] = queue.Queue()
        self.connected = threading.Event()
        self.connected.set()
        self.disconnect_count = 0
        self.published: list[tuple[str, bytes, bool]] = []

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.published.append((topic, payload, retain))

    def subscribe(self, topics) -> None:
        pass

    def close(self) -> None:
        self.connected.clear()

    def drop(self) -> None:
        self.connected.clear()
        self.disconnect_count += 1

    def back(self) -> None:
        self.connected.set()


def signed(record, seq, name="progress", *, kind="event", status="running", token=None, attempt=None,
           dispatch_token=None, **data):
    ident = {"attempt_id": attempt or record["attempt_id"],
             "dispatch_token": dispatch_token or record["dispatch_token"], **data}
    body = {"schema_version": 1, "seq": seq, "job_id": record["job_id"], "event": name, "timestamp": TS,
            "detail": "", "data": ident}
    if kind == "state":
        body.update(event="state", status=status, last_event=name)
    return wire.encode(crypto.sign_event(body, token or record["auth_token"]))


def put(client, record, raw, leaf="events"):
    client.messages.put(Message(names.job_topic(record["job_id"], leaf, client.config.topic_root), raw, False))


def gaps(reg, job_id):
    return [(g["expected"], g["got"]) for g in reg.audit(job_id) if g["event"] == "seq_gap"]


@pytest.fixture
def reg(tmp_path):
    return Registry(tmp_path)


def remote_watcher(reg, record, client=None, **options):
    kwargs = {"client": client} if client is not None else {"config": BrokerConfig()}
    return Watcher(reg, record["job_id"], keys=KEYS, out=io.StringIO(),
                   options=WatchOptions(remote=True, **options), **kwargs)


def topic(record, leaf):
    return names.job_topic(record["job_id"], leaf, BrokerConfig().topic_root)


# ------------------------------------------------------------ fault 3

def test_fault3_s4_running_state_moves_a_pending_record_to_running_and_clears_the_dispatch(reg):
    rec = reg.register(session="gpu-box")
    client = FlakyClient()
    w = remote_watcher(reg, rec, client)
    assert w.handle(topic(rec, "state"), signed(rec, 3, kind="state")) is True
    after = reg.get(rec["job_id"])
    assert after["status"] == "running" and after["last_seq"] == 0  # events 1-3 were never seen
    changes = [line for line in reg.audit(rec["job_id"]) if line["event"] == "status_changed"]
    assert [(c["from"], c["to"], c["source"]) for c in changes][-1] == ("pending", "running", "remote_mirror")
    assert client.published == [(names.dispatch_topic(rec["job_id"], client.config.topic_root), b"", True)]


def test_fault3_s3_2_rule6_one_gap_is_logged_once_across_watches(reg):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    first = remote_watcher(reg, rec)
    assert first.handle(topic(rec, "state"), signed(rec, 3, kind="state"))
    assert first.handle(topic(rec, "events"), signed(rec, 3))  # the event behind that state: accepted
    assert first.handle(topic(rec, "events"), signed(rec, 4))
    again = remote_watcher(reg, reg.get(jid))  # `mam-orch watch` run again reads the same retained state
    again.handle(topic(rec, "state"), signed(rec, 4, kind="state"))
    again.handle(topic(rec, "state"), signed(rec, 3, kind="state"))
    assert again.handle(topic(rec, "events"), signed(rec, 5))
    assert gaps(reg, jid) == [(1, 3)]
    assert reg.get(jid)["last_seq"] == 5 and reg.get(jid)["status"] == "running"


# ------------------------------------------------------------ fault 11

def test_fault11_s3_2_rule4_an_earlier_attempts_message_is_stale_not_a_forgery(reg, caplog):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    reg.close(jid, "deadline_timeout")
    second = reg.redispatch(jid, source="operator")
    third = reg.close(jid, "deadline_timeout") and reg.redispatch(jid, source="operator")
    assert second["auth_token"] not in (rec["auth_token"], third["auth_token"])
    for old in (rec, second):
        straggler = signed(old, 7, "completed", exit_code=0)
        verdict = accept(straggler, kind="event", job_id=jid, record=third, seen=Seen())
        assert isinstance(verdict, Refused) and verdict.reason == "stale_attempt", verdict
    forged = signed(rec, 7, "completed", token="f" * 43, exit_code=0)
    verdict = accept(forged, kind="event", job_id=jid, record=third, seen=Seen())
    assert isinstance(verdict, Refused) and verdict.reason == "HMAC verify failed"

    caplog.set_level(logging.DEBUG, "mam.watch")
    w = remote_watcher(reg, third)
    for raw in (signed(rec, 8), signed(second, 2, kind="state"), forged):
        assert w.handle(topic(rec, "events" if b'"state"' not in raw else "state"), raw) is False
    levels = [(r.levelno, r.getMessage().split("refused message: ")[1].split(" (")[0]) for r in caplog.records]
    assert levels == [(logging.DEBUG, "stale_attempt"), (logging.DEBUG, "stale_attempt"),
                      (logging.WARNING, "HMAC verify failed")]


def test_fault11_s8_earlier_tokens_are_kept_but_never_shown(reg, capsys):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    reg.close(jid, "cancelled")
    new = reg.redispatch(jid, source="operator")
    assert new["earlier_auth_tokens"] == [rec["auth_token"]]
    assert redact(new)["earlier_auth_tokens"] == "<set>"
    out = io.StringIO()
    assert cli_jobs(workspace=reg.root, status=None, as_json=True, stream=out) == 0
    assert cli_show(workspace=reg.root, job_id=jid, as_json=True, stream=out) == 0
    assert rec["auth_token"] not in out.getvalue() and new["auth_token"] not in out.getvalue()
    assert '"earlier_auth_tokens": "<set>"' in out.getvalue()


# ------------------------------------------------------------ §14 late terminals

@pytest.mark.parametrize("kind", ["event", "state"])
def test_s14_a_terminal_after_the_hubs_close_is_a_late_outcome(reg, kind):
    rec = reg.register(session="gpu-box")
    jid = rec["job_id"]
    w = remote_watcher(reg, rec)
    assert w.handle(topic(rec, "events"), signed(rec, 1, "started"))
    closed = reg.close(jid, "deadline_timeout")
    raw = signed(rec, 5, "completed", kind=kind, status="completed", exit_code=0)
    w.handle(topic(rec, "events" if kind == "event" else "state"), raw)
    w.handle(topic(rec, "events" if kind == "event" else "state"), raw)  # re-delivered: one line only
    after = reg.get(jid)
    assert after["late_outcome"] == "completed"
    assert {k: after[k] for k in ("status", "close_reason", "transition_seq")} == \
        {k: closed[k] for k in ("status", "close_reason", "transition_seq")}  # §8: the status stays
    late = [line for line in reg.audit(jid) if line["event"] == "late_terminal"]
    assert len(late) == 1 and late[0]["terminal"] == "completed" and late[0]["seq"] == 5
    assert "LATE" in jobs_table([redact(after)]) and "completed" in jobs_table([redact(after)])


def test_s14_an_operators_cancel_confirmation_is_no_late_outcome(reg):
    rec = reg.register(session="gpu-box")
    w = remote_watcher(reg, rec)
    assert w.handle(topic(rec, "events"), signed(rec, 1, "started"))
    reg.close(rec["job_id"], "cancelled")
    w.handle(topic(rec, "events"), signed(rec, 2, "error", exit_code=143))
    assert "late_outcome" not in reg.get(rec["job_id"])


# ------------------------------------------------------------ §14 broker outages

def test_fault2_s14_idle_clock_stands_still_while_the_hubs_connection_is_down(reg):
    rec = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=5))
    client = FlakyClient()
    put(client, rec, signed(rec, 1, "started"))
    client.drop()  # the hub's own connection is down from the start, for 4 idle windows
    w = remote_watcher(reg, rec, client, idle_timeout_s=IDLE_S)
    came_back = threading.Event()

    def outage() -> None:
        wait_until(lambda: w.accepted_any, PATIENCE_S, "started to be accepted")
        until = time.monotonic() + OUTAGE_S
        wait_until(lambda: time.monotonic() >= until, PATIENCE_S, "the outage to last")
        client.back()
        came_back.set()
        put(client, rec, signed(rec, 2, "completed", exit_code=0))

    thread = threading.Thread(target=outage, daemon=True)
    thread.start()
    assert w.run() == ExitCode.COMPLETED
    thread.join(PATIENCE_S)
    assert came_back.is_set() and reg.get(rec["job_id"])["status"] == "completed"


def test_s14_an_outage_between_two_looks_still_restarts_the_idle_window(reg):
    rec = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=5))
    client = FlakyClient()
    put(client, rec, signed(rec, 1, "started"))
    w = remote_watcher(reg, rec, client, idle_timeout_s=BLINK_IDLE_S)
    dropped_at: list[float] = []

    def blink() -> None:
        wait_until(lambda: w.accepted_any, PATIENCE_S, "started to be accepted")
        until = time.monotonic() + BLINK_AFTER_S
        wait_until(lambda: time.monotonic() >= until, PATIENCE_S, "a third of the idle window")
        client.disconnect_count += 1  # lost and regained before the watcher looked
        dropped_at.append(time.monotonic())

    threading.Thread(target=blink, daemon=True).start()
    assert w.run() == ExitCode.TIMEOUT  # then real silence: closed, but only a full window after the blink
    assert dropped_at and time.monotonic() >= dropped_at[0] + BLINK_IDLE_S
    assert reg.get(rec["job_id"])["close_reason"] == "deadline_timeout"


def test_s14_a_watch_that_gives_up_on_the_broker_leaves_the_record_open(reg, monkeypatch):
    monkeypatch.setenv("MAM_HUB_OUTAGE_GIVE_UP_S", str(IDLE_S))
    rec = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=5))
    client = FlakyClient()
    put(client, rec, signed(rec, 1, "started"))
    client.drop()
    w = remote_watcher(reg, rec, client, idle_timeout_s=IDLE_S)
    assert w.run() == ExitCode.BROKER
    after = reg.get(rec["job_id"])
    assert after["status"] == "running" and after["close_reason"] is None
    hint = reattach_hint(reg, rec["job_id"], "/srv/hub dir")
    assert hint is not None and f"mam-orch watch {rec['job_id']} --workspace '/srv/hub dir'" in hint
    assert "still running" in hint


def test_s14_the_wall_clock_runs_on_during_an_outage(reg):
    rec = reg.register(session="gpu-box", contract=Contract(heartbeat_sec=5))
    client = FlakyClient()
    put(client, rec, signed(rec, 1, "started"))
    client.drop()
    w = remote_watcher(reg, rec, client, idle_timeout_s=IDLE_S, timeout_s=IDLE_S)
    assert w.run() == ExitCode.BROKER  # closed while unreachable: exit 3, record terminal (v1)
    assert reg.get(rec["job_id"])["close_reason"] == "deadline_timeout"
    assert reattach_hint(reg, rec["job_id"]) is None
    assert json.loads(json.dumps(reg.get(rec["job_id"])))["status"] == "error"


def test_s14_watch_of_a_job_the_hub_closed_reads_the_retained_state_for_a_late_outcome(reg, capsys):
    rec = reg.register(session="gpu-box")
    reg.close(rec["job_id"], "deadline_timeout")
    client = FlakyClient()
    put(client, rec, signed(rec, 9, "completed", kind="state", status="completed"), "state")
    assert remote_watcher(reg, rec, client).run() == ExitCode.TIMEOUT  # the record's own verdict (§8, §9)
    after = reg.get(rec["job_id"])
    assert after["status"] == "error" and after["late_outcome"] == "completed"
    assert "its runner later reported completed" in capsys.readouterr().err
