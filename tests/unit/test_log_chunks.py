"""PROTOCOL §15 without a broker: the runner's chunker, masking and rate cap, the
chunk message (sealed, signed, numbered), and the hub's copy (order, duplicates,
gaps, refusals), with `FakeBroker` standing in for the broker."""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import threading
from pathlib import Path

import pytest
from harness.fake_mqtt import FakeBroker
from harness.waiting import PATIENCE_S, wait_until
from test_hub_watch import RecordingClient, deliver

from mam.orchestrator.logs import MAX_AHEAD_CHUNKS, MAX_BUFFERED_CHUNKS, LogRouter, OutputView, streamed_transcript
from mam.orchestrator.watch import Watcher, WatchOptions
from mam.runner.logstream import (
    FLUSH_AFTER_S,
    MAX_RATE_BPS,
    Chunker,
    LogStream,
    LogStreams,
    Masker,
    Pump,
    RateLimit,
    rate_from_env,
    secret_forms,
)
from mam.shared.config import BrokerConfig
from mam.shared.protocol import crypto, names
from mam.shared.protocol.errors import ConfigError, DecodeError, SignatureError
from mam.shared.protocol.wire import logchunk
from mam.shared.store.registry import Registry
from mam.shared.transport.mqtt import Message

pytestmark = pytest.mark.timeout(60)

SECRET = 'pa"ss\\word/é-0123456789'
KIB = 1024
CHUNK = logchunk.MAX_CHUNK_BYTES


# ------------------------------------------------------------------ chunker


def test_s15_chunker_cuts_64_kib_at_once_and_the_rest_after_half_a_second():
    chunker = Chunker()
    chunker.add(b"a" * (CHUNK + 1), now=0.0)
    assert chunker.ready(0.0) == [(b"a" * CHUNK, 0)]
    assert chunker.ready(FLUSH_AFTER_S - 0.01) == []
    assert chunker.ready(FLUSH_AFTER_S) == [(b"a", 0)]
    assert chunker.ready(10.0) == []


def test_s15_chunker_exact_64_kib_leaves_nothing_and_final_flushes_the_rest():
    chunker = Chunker()
    chunker.add(b"b" * CHUNK, now=0.0)
    assert chunker.ready(0.0) == [(b"b" * CHUNK, 0)]
    assert chunker.ready(5.0) == []
    chunker.add(b"tail", now=5.0)
    assert chunker.ready(5.0) == []
    assert chunker.ready(5.0, final=True) == [(b"tail", 0)]


def test_s15_chunker_sends_a_rise_of_dropped_alone_as_an_empty_chunk():
    chunker = Chunker()
    chunker.drop(100, now=0.0)
    assert chunker.ready(0.1) == []
    assert chunker.ready(FLUSH_AFTER_S) == [(b"", 100)]
    assert chunker.ready(5.0, final=True) == []


# ------------------------------------------------------------------ masking


def forms_of(value: str) -> dict[str, bytes]:
    raw = value.encode()
    return {"clear": raw, "base64": base64.b64encode(raw), "json": json.dumps(value)[1:-1].encode()}


@pytest.mark.parametrize("form", ["clear", "base64", "json"])
def test_s15_masks_each_form_split_at_every_chunk_border(form):
    secret = forms_of(SECRET)[form]
    text = b"before " + secret + b" after\n"
    for cut in range(len(text) + 1):
        masker = Masker([SECRET])
        out = masker.feed(text[:cut]) + masker.feed(text[cut:]) + masker.feed(b"", final=True)
        assert out == b"before *** after\n", (form, cut)


def test_s15_masks_byte_by_byte_and_holds_back_only_a_possible_secret_start():
    masker = Masker([SECRET, "another-secret-value"])
    text = b"x" + SECRET.encode() + b"y" + base64.b64encode(b"another-secret-value") + b"z"
    out = b"".join(masker.feed(bytes([byte])) for byte in text) + masker.feed(b"", final=True)
    assert out == b"x***y***z"
    assert Masker([SECRET]).feed(b"plain line\n") == b"plain line\n"  # nothing held: no secret starts here
    held = Masker([SECRET])
    assert held.feed(b"ok pa") == b"ok "  # "pa" may start the secret
    assert held.feed(b"", final=True) == b"pa"


def test_s15_secret_forms_skip_short_values_and_cover_urlsafe_base64():
    assert secret_forms("abc") == set()
    value = "\xff\xfe>>>???"
    assert base64.urlsafe_b64encode(value.encode()) in secret_forms(value)


# ------------------------------------------------------------------ rate cap


def test_s15_rate_cap_allows_the_rate_and_counts_the_rest():
    now = [0.0]
    limit = RateLimit(1000, clock=lambda: now[0])
    assert limit.take(5000) == 1000
    now[0] = 0.5
    assert limit.take(5000) == 500
    now[0] = 100.0
    assert limit.take(10) == 10
    assert rate_from_env({}) == 262_144
    assert rate_from_env({"MAM_LOG_RATE_BPS": "4096"}) == 4096
    for bad in ("fast", "0", "-5", str(1 << 40)):
        with pytest.raises(ConfigError, match="MAM_LOG_RATE_BPS"):
            rate_from_env({"MAM_LOG_RATE_BPS": bad})


# ------------------------------------------------------------------ the stream, runner to hub


@pytest.fixture
def hub(tmp_path):
    reg = Registry(tmp_path / "hub")
    return reg, reg.register(session="gpu-box")


def stream_for(tmp_path, record, data: bytes, *, rate_bps: int = 1 << 30, broker: FakeBroker | None = None):
    broker = broker or FakeBroker()
    client = broker.client(BrokerConfig())
    client.connect()
    path = tmp_path / "agent.log"
    path.write_bytes(b"earlier attempt\n")
    stream = LogStream(root=tmp_path / "runner", client=client, job_id=record["job_id"],
                       attempt_id=record["attempt_id"], auth_token=record["auth_token"], log_path=path,
                       secrets=[SECRET, record["auth_token"]], rate_bps=rate_bps, offset=path.stat().st_size)
    with open(path, "ab") as handle:
        handle.write(data)
    return broker, stream


def test_s15_stream_sends_sealed_numbered_chunks_and_the_hub_copy_matches(tmp_path, hub):
    reg, rec = hub
    data = os.urandom(3 * CHUNK + 123) + b"token " + rec["auth_token"].encode() + b" end\n"
    broker, stream = stream_for(tmp_path, rec, data)
    stream.start()
    done = stream.finish()
    sent = broker.on_topic(names.log_topic(rec["job_id"], BrokerConfig().topic_root))
    assert done == {"log_chunks": len(sent), "log_dropped": 0} and len(sent) >= 4
    assert all(not p.retain for p in sent)
    assert [json.loads(p.payload)["chunk"] for p in sent] == list(range(len(sent)))
    assert rec["auth_token"].encode() not in b"".join(p.payload for p in sent)  # sealed (§15)
    router = LogRouter(reg)
    out = b"".join(b"".join(router.handle(p.payload)) for p in sent)
    assert out == data.replace(rec["auth_token"].encode(), b"***")
    assert names.hub_log_path(reg.root, rec["job_id"], 1).read_bytes() == out
    assert not list(names.log_outbox_dir(tmp_path / "runner").iterdir())  # all acknowledged (§17)


def test_s15_rate_cap_drops_and_says_how_much(tmp_path, hub):
    reg, rec = hub
    data = b"z" * (200 * KIB)
    broker, stream = stream_for(tmp_path, rec, data, rate_bps=4096)
    stream.start()
    done = stream.finish()
    router = LogRouter(reg)
    got = b"".join(b"".join(router.handle(p.payload)) for p in broker.published)
    assert done["log_dropped"] > 0 and len(got) + done["log_dropped"] == len(data)
    assert router.dropped(rec["job_id"]) == done["log_dropped"]


def test_s15_outage_keeps_chunks_in_the_outbox_until_the_broker_is_back(tmp_path, hub, monkeypatch):
    reg, rec = hub
    broker, stream = stream_for(tmp_path, rec, b"during the outage\n")
    broker.down = True
    real_fsync, flushed = os.fsync, []

    def recorded_fsync(fd: int) -> None:
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    stream.start()
    folder = names.log_outbox_dir(tmp_path / "runner")
    wait_until(lambda: folder.exists() and any(folder.iterdir()), PATIENCE_S, "a chunk kept in the outbox")
    assert not [path for path in flushed if "outbox-log" in path]  # written, not fsynced (§15)
    assert broker.published == []
    broker.down = False
    done = stream.finish()
    assert done["log_chunks"] == 1 and not any(folder.iterdir())
    assert LogRouter(reg).handle(broker.published[0].payload) == [b"during the outage\n"]


def silent_stream(tmp_path, client, rec, path: Path) -> LogStream:
    return LogStream(root=tmp_path / "runner", client=client, job_id=rec["job_id"], attempt_id=rec["attempt_id"],
                     auth_token=rec["auth_token"], log_path=path, secrets=[rec["auth_token"]],
                     rate_bps=MAX_RATE_BPS)


def threads_of(job_id: str) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.endswith(job_id))


def test_s15_one_pump_thread_reads_every_job_and_a_silent_job_starts_no_thread(tmp_path, hub):
    reg, _ = hub
    broker = FakeBroker()
    client = broker.client(BrokerConfig())
    client.connect()
    pump = Pump("log-pump-under-test")
    recs = [reg.register(session="gpu-box") for _ in range(3)]
    streams = []
    for n, rec in enumerate(recs):
        path = tmp_path / f"agent-{n}.log"
        path.write_bytes(b"")
        streams.append(silent_stream(tmp_path, client, rec, path))
        streams[-1].start(pump)
    with open(tmp_path / "agent-0.log", "ab") as handle:
        handle.write(b"only the first job prints\n")
    topic = names.log_topic(recs[0]["job_id"], BrokerConfig().topic_root)
    wait_until(lambda: broker.on_topic(topic), PATIENCE_S, "the first job's chunk sent while it runs")
    assert [t.name for t in threading.enumerate()].count("log-pump-under-test") == 1
    assert threads_of(recs[0]["job_id"]) == [f"log-send-{recs[0]['job_id']}"]  # its sender, from its first chunk
    assert threads_of(recs[1]["job_id"]) == threads_of(recs[2]["job_id"]) == []
    assert [stream.finish() for stream in streams] == [{"log_chunks": 1, "log_dropped": 0},
                                                         {"log_chunks": 0, "log_dropped": 0},
                                                         {"log_chunks": 0, "log_dropped": 0}]
    assert LogRouter(reg).handle(broker.on_topic(topic)[0].payload) == [b"only the first job prints\n"]


def test_s15_a_fifo_in_place_of_agent_log_ends_its_stream_not_the_pump(tmp_path, hub, caplog):
    reg, _ = hub
    broker = FakeBroker()
    client = broker.client(BrokerConfig())
    client.connect()
    pump = Pump("log-pump-fifo")
    hostile, plain = reg.register(session="gpu-box"), reg.register(session="gpu-box")
    os.mkfifo(tmp_path / "hostile.log")  # no writer: an open that waits for one never returns
    (tmp_path / "plain.log").write_bytes(b"")
    blocked = silent_stream(tmp_path, client, hostile, tmp_path / "hostile.log")
    other = silent_stream(tmp_path, client, plain, tmp_path / "plain.log")
    with caplog.at_level(logging.ERROR, logger="mam.logstream"):
        blocked.start(pump)
        other.start(pump)
        wait_until(lambda: blocked.read_ended, PATIENCE_S, "the stream of the FIFO ended")
    assert f"job {hostile['job_id']}: output stream stopped" in caplog.text and "not a regular file" in caplog.text
    (tmp_path / "plain.log").write_bytes(b"still read\n")
    topic = names.log_topic(plain["job_id"], BrokerConfig().topic_root)
    wait_until(lambda: broker.on_topic(topic), PATIENCE_S, "the other job's output sent by the same pump")
    assert blocked.finish() == {"log_chunks": 0, "log_dropped": 0}
    assert other.finish()["log_chunks"] == 1


# ------------------------------------------------------------------ the hub's copy


def chunk(rec, number, data=b"", *, dropped=0, token=None, attempt=None):
    return crypto.build_log_chunk(token or rec["auth_token"], crypto.log_key(token or rec["auth_token"]),
                               job_id=rec["job_id"], attempt_id=attempt or rec["attempt_id"], chunk=number,
                               dropped=dropped, plaintext=data)


def test_s15_hub_writes_in_chunk_order_and_ignores_duplicates(hub):
    reg, rec = hub
    router = LogRouter(reg)
    assert router.handle(chunk(rec, 2, b"c")) == []
    assert router.handle(chunk(rec, 0, b"a")) == [b"a"]
    assert router.handle(chunk(rec, 0, b"a")) == []
    assert router.handle(chunk(rec, 2, b"c")) == []
    assert router.handle(chunk(rec, 1, b"b")) == [b"b", b"c"]
    assert names.hub_log_path(reg.root, rec["job_id"], 1).read_bytes() == b"abc"
    again = LogRouter(reg)  # a re-attached watch goes on where the copy stands
    assert again.handle(chunk(rec, 1, b"b")) == [] and again.handle(chunk(rec, 3, b"d")) == [b"d"]
    assert [a for a in reg.audit(rec["job_id"]) if a.get("event") == "log_gap"] == []


def test_s15_hub_records_a_missing_chunk_as_log_gap(hub):
    reg, rec = hub
    router = LogRouter(reg)
    router.handle(chunk(rec, 0, b"a"))
    router.handle(chunk(rec, 2, b"c"))
    assert router.close(rec["job_id"]) == [b"c"]
    gaps = [a for a in reg.audit(rec["job_id"]) if a.get("event") == "log_gap"]
    assert [(g["expected"], g["got"], g["attempt_id"]) for g in gaps] == [(1, 2, 1)]
    assert names.hub_log_path(reg.root, rec["job_id"], 1).read_bytes() == b"ac"


def test_s15_hub_skips_a_gap_when_too_many_chunks_wait(hub):
    reg, rec = hub
    router = LogRouter(reg)
    out = [router.handle(chunk(rec, n, b"%d," % n)) for n in range(1, MAX_BUFFERED_CHUNKS + 2)]
    assert b"".join(out[-1]) == b"".join(b"%d," % n for n in range(1, MAX_BUFFERED_CHUNKS + 2))
    assert router.received(rec["job_id"]) == MAX_BUFFERED_CHUNKS + 2


def test_s15_hub_refuses_bad_chunks_quietly_and_writes_nothing(hub, caplog):
    reg, rec = hub
    router = LogRouter(reg)
    good = json.loads(chunk(rec, 0, b"secret output"))
    forged = dict(good, dropped=5)  # sig no longer matches
    resigned = dict(good, chunk=1)  # signed again, but the seal is bound to chunk 0
    resigned["sig"] = crypto.log_sig(resigned, rec["auth_token"])
    hostile = chunk(rec, MAX_AHEAD_CHUNKS + 1, b"far")
    big = base64.urlsafe_b64encode(bytes(70 * KIB)).decode()  # more than a chunk holds, under the message cap
    oversized = dict(good, sealed=dict(good["sealed"], ciphertext=big))
    oversized["sig"] = crypto.log_sig(oversized, rec["auth_token"])
    bad = [b"not json", b"{}", json.dumps(dict(good, schema_version=2)).encode(), b"x" * (200 * KIB),
           json.dumps(dict(good, chunk=-1)).encode(), json.dumps(dict(good, chunk=2**60)).encode(),
           json.dumps(dict(good, extra=1)).encode(), json.dumps(forged).encode(), json.dumps(resigned).encode(),
           chunk(rec, 0, b"x", token="another-token-of-someone-else"), hostile, json.dumps(oversized).encode(),
           chunk(rec, 0, b"old attempt", attempt=2), b""]
    for raw in bad:
        assert router.handle(raw) == []
    assert not names.hub_log_path(reg.root, rec["job_id"], 1).exists()
    other = dict(good, job_id="0badc0de")
    assert LogRouter(reg, job_id=rec["job_id"]).handle(json.dumps(other).encode()) == []
    assert router.handle(json.dumps(good).encode()) == [b"secret output"]


def test_s15_chunk_message_rules():
    token = "t" * 43
    raw = crypto.build_log_chunk(token, crypto.log_key(token), job_id="918b0612", attempt_id=1, chunk=0, dropped=0,
                              plaintext=b"hello")
    parsed = logchunk.decode_chunk(raw)
    assert set(json.loads(raw)) == logchunk.LOG_FIELDS and json.loads(raw)["kind"] == "log"
    assert crypto.open_log_chunk(parsed, token) == b"hello"
    with pytest.raises(SignatureError):
        crypto.open_log_chunk(parsed, "u" * 43)
    with pytest.raises(ValueError, match="at most"):
        crypto.build_log_chunk(token, crypto.log_key(token), job_id="918b0612", attempt_id=1, chunk=0, dropped=0,
                            plaintext=b"x" * (CHUNK + 1))
    with pytest.raises(DecodeError, match="malformed: kind"):
        logchunk.decode_chunk(json.dumps(dict(json.loads(raw), kind="event")).encode())
    body = json.loads(raw)
    with pytest.raises(DecodeError, match="sealed.ciphertext holds more than 65536 bytes"):
        logchunk.decode_chunk(json.dumps(dict(body, sealed=dict(
            body["sealed"], ciphertext=base64.urlsafe_b64encode(bytes(70 * KIB)).decode()))))
    with pytest.raises(DecodeError, match="malformed: chunk"):
        logchunk.decode_chunk(json.dumps(dict(body, chunk=2**60)))
    assert names.log_topic("918b0612", "r") == "r/jobs/918b0612/log"


def test_s15_output_view_prints_whole_lines_with_control_characters_escaped():
    out = io.StringIO()
    view = OutputView(out)
    view.show([b"one\ntw", b"o\x1b[2J\n"])
    view.show([b"partial"])
    assert out.getvalue() == "  | one\n  | two\\x1b[2J\n"
    view.flush()
    assert out.getvalue().endswith("  | partial\n")


# ------------------------------------------------------------------ dispatch/watch view


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("human", [True, False])
def test_s15_watch_shows_output_under_the_events_on_a_terminal_and_json_stays_events(hub, human):
    reg, rec = hub
    client = RecordingClient()
    out = Tty() if human else io.StringIO()
    watcher = Watcher(reg, rec["job_id"], client=client, options=WatchOptions(remote=True), out=out)
    deliver(client, rec, 1, "started")
    client.messages.put(Message(names.log_topic(rec["job_id"], client.config.topic_root),
                                chunk(rec, 1, b"second\nlast, no newline"), False))
    deliver(client, rec, 2, "completed", log_chunks=2)
    client.messages.put(Message(names.log_topic(rec["job_id"], client.config.topic_root),
                                chunk(rec, 0, b"hello \x1b[31mred\n"), False))
    assert watcher.run() == 0
    assert names.hub_log_path(reg.root, rec["job_id"], 1).read_bytes() == b"hello \x1b[31mred\nsecond\nlast, no newline"
    if human:
        assert out.getvalue().splitlines()[-3:] == ["  | hello \\x1b[31mred", "  | second", "  | last, no newline"]
    else:
        assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == ["started", "completed"]


def test_s17_chunks_a_stopped_runner_left_are_sent_at_start(tmp_path, hub):
    reg, rec = hub
    root = tmp_path / "runner"
    left = names.log_outbox_entry_path(root, rec["job_id"], 1, 0)
    left.parent.mkdir(parents=True)
    left.write_bytes(chunk(rec, 0, b"left behind\n"))
    (left.parent / "junk.txt").write_text("not a chunk")
    empty = names.log_outbox_entry_path(root, rec["job_id"], 1, 1)
    empty.write_bytes(b"")  # what a power loss can leave of an unflushed entry
    broker = FakeBroker()
    client = broker.client(BrokerConfig())
    client.connect()
    LogStreams(root=root, client=client, config=BrokerConfig(), environ={}).resend_leftovers()
    wait_until(lambda: not left.exists() and not empty.exists(), PATIENCE_S, "the leftover chunks handled")
    assert len(broker.published) == 1
    assert LogRouter(reg).handle(broker.published[0].payload) == [b"left behind\n"]


# ------------------------------------------------------------------ transcript chunks

SESSION = "8d99b0b5-2c1e-4f0a-9d3b-7f1e2a3b4c5d"


def transcript_chunk(rec, number, data=b"", *, session=SESSION, dropped=0):
    return crypto.build_log_chunk(rec["auth_token"], crypto.log_key(rec["auth_token"]), job_id=rec["job_id"],
                                  attempt_id=rec["attempt_id"], chunk=number, dropped=dropped, plaintext=data,
                                  session_id=session)


def test_s15_the_transcript_streams_once_saved_and_the_hub_keeps_it_apart_from_the_output(tmp_path, hub):
    """§15 "Transcript chunks": the stream waits for the file the agent saves, sends it from
    its first byte, masked; the hub's copy is not output, and a resumed attempt gets whole lines."""
    reg, rec = hub
    saved = tmp_path / "session.jsonl"
    named: list[Path | None] = [None]
    broker = FakeBroker()
    client = broker.client(BrokerConfig())
    client.connect()
    stream = LogStream(root=tmp_path / "runner", client=client, job_id=rec["job_id"], attempt_id=1,
                       auth_token=rec["auth_token"], log_path=lambda: named[0], secrets=[rec["auth_token"]],
                       rate_bps=MAX_RATE_BPS, session_id=SESSION)
    stream.start()
    lines = b'{"type":"user","token":"' + rec["auth_token"].encode() + b'"}\n' + b'{"type":"assistant"}\n' * 5000
    saved.write_bytes(lines + b'{"type":"partial')
    named[0] = saved
    stream.finish()
    sent = broker.on_topic(names.log_topic(rec["job_id"], BrokerConfig().topic_root))
    assert len(sent) >= 2 and {json.loads(p.payload)["kind"] for p in sent} == {"transcript"}
    assert not list(names.transcript_outbox_dir(tmp_path / "runner").iterdir())
    router = LogRouter(reg)
    assert [router.handle(p.payload) for p in sent] == [[]] * len(sent)  # never shown as output
    assert not names.hub_log_path(reg.root, rec["job_id"], 1).exists()
    masked = lines.replace(rec["auth_token"].encode(), b"***")
    copy = names.hub_transcript_path(reg.root, rec["job_id"], 1)
    assert copy.read_bytes() == masked + b'{"type":"partial' and oct(copy.stat().st_mode & 0o777) == "0o600"
    assert streamed_transcript(reg.root, rec["job_id"], 1, SESSION, 1 << 20) == masked
    assert streamed_transcript(reg.root, rec["job_id"], 1, "another-session", 1 << 20) is None
    assert streamed_transcript(reg.root, rec["job_id"], 1, SESSION, 1000) is None  # over the cap


def test_s15_a_transcript_copy_with_a_gap_or_a_drop_resumes_nothing_and_other_sessions_are_refused(hub, caplog):
    reg, rec = hub
    router = LogRouter(reg)
    router.handle(transcript_chunk(rec, 0, b'{"a":1}\n'))
    assert streamed_transcript(reg.root, rec["job_id"], 1, SESSION, 1 << 20) == b'{"a":1}\n'
    router.handle(transcript_chunk(rec, 1, b'{"b":2}\n', session="another-session"))
    assert "refused transcript chunk 1" in caplog.text
    router.handle(transcript_chunk(rec, 2, b'{"c":3}\n'))
    router.close(rec["job_id"])
    assert [a.get("stream") for a in reg.audit(rec["job_id"]) if a.get("event") == "log_gap"] == ["transcript"]
    assert streamed_transcript(reg.root, rec["job_id"], 1, SESSION, 1 << 20) is None
    other = reg.register(session="gpu-box")
    LogRouter(reg).handle(transcript_chunk(other, 0, b'{"a":1}\n', dropped=5))
    assert streamed_transcript(reg.root, other["job_id"], 1, SESSION, 1 << 20) is None


def test_s15_transcript_chunk_message_rules(hub):
    reg, rec = hub
    raw = transcript_chunk(rec, 0, b"{}\n")
    body = json.loads(raw)
    assert set(body) == logchunk.TRANSCRIPT_FIELDS and body["kind"] == "transcript"
    parsed = logchunk.decode_chunk(raw)
    assert (parsed.session_id, crypto.open_log_chunk(parsed, rec["auth_token"])) == (SESSION, b"{}\n")
    as_log = {k: v for k, v in body.items() if k != "session_id"} | {"kind": "log"}
    as_log["sig"] = crypto.log_sig(as_log, rec["auth_token"])  # signed again: the seal still says transcript
    with pytest.raises(SignatureError):
        crypto.open_log_chunk(logchunk.decode_chunk(json.dumps(as_log)), rec["auth_token"])
    for bad, words in ((dict(body, session_id="../x"), "malformed: session_id"),
                       (dict(body, session_id="s" * 129), "malformed: session_id"),
                       ({k: v for k, v in body.items() if k != "session_id"}, "malformed"),
                       (dict(json.loads(chunk(rec, 0, b"x")), session_id=SESSION), "malformed")):
        with pytest.raises(DecodeError, match=words):
            logchunk.decode_chunk(json.dumps(bad))
        assert LogRouter(reg).handle(json.dumps(bad).encode()) == []


def test_s15_a_linked_transcript_is_never_followed(tmp_path, hub, caplog):
    reg, rec = hub
    secret = tmp_path / "secret.txt"
    secret.write_text("not the agent's\n")
    link = tmp_path / "session.jsonl"
    link.symlink_to(secret)
    broker = FakeBroker()
    client = broker.client(BrokerConfig())
    client.connect()
    stream = LogStream(root=tmp_path / "runner", client=client, job_id=rec["job_id"], attempt_id=1,
                       auth_token=rec["auth_token"], log_path=lambda: link, secrets=[], rate_bps=MAX_RATE_BPS,
                       session_id=SESSION)
    stream.start()
    stream.finish()
    assert broker.published == [] and "output stream stopped" in caplog.text


def test_s17_transcript_chunks_a_stopped_runner_left_are_sent_at_start(tmp_path, hub):
    reg, rec = hub
    root = tmp_path / "runner"
    left = names.log_outbox_entry_path(root, rec["job_id"], 1, 0, transcript=True)
    left.parent.mkdir(parents=True)
    left.write_bytes(transcript_chunk(rec, 0, b'{"left":1}\n'))
    broker = FakeBroker()
    client = broker.client(BrokerConfig())
    client.connect()
    LogStreams(root=root, client=client, config=BrokerConfig(), environ={}).resend_leftovers()
    wait_until(lambda: not left.exists(), PATIENCE_S, "the leftover transcript chunk sent")
    LogRouter(reg).handle(broker.published[0].payload)
    assert streamed_transcript(reg.root, rec["job_id"], 1, SESSION, 1 << 20) == b'{"left":1}\n'
