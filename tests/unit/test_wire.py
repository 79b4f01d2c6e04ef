"""PROTOCOL §1, §3-§7: wire message types, canonical form and the one decoder."""

from __future__ import annotations

import copy
import dataclasses
import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mam.shared.protocol import wire
from mam.shared.protocol.errors import DecodeError, ProtocolError, UsageError
from mam.shared.protocol.wire import jsoncodec

TOKEN = "0123456789abcdef0123456789abcdef"
RUNNER = "fedcba9876543210fedcba9876543210"
SIG = "ab" * 32
NONCE = wire.b64url_encode(bytes(12))
CIPHERTEXT = wire.b64url_encode(bytes(40))

EVENT: dict[str, Any] = {
    "schema_version": 1, "seq": 2, "job_id": "918b0612", "event": "progress",
    "timestamp": "2026-06-20T14:48:58Z", "detail": "tests pass",
    "data": {"attempt_id": 1, "dispatch_token": TOKEN, "session": "gpu-box", "hmac_sig": SIG},
}
STATE: dict[str, Any] = {
    "schema_version": 1, "seq": 7, "job_id": "918b0612", "event": "state",
    "status": "running", "last_event": "progress", "timestamp": "2026-06-20T14:49:30Z", "detail": "",
    "data": {"attempt_id": 1, "dispatch_token": TOKEN, "hmac_sig": SIG},
}
DISPATCH: dict[str, Any] = {
    "schema_version": 1, "kind": "dispatch", "job_id": "918b0612", "session": "gpu-box", "attempt_id": 1,
    "dispatch_token": TOKEN, "origin": "hub-1", "issued_at": "2026-06-20T14:48:00Z",
    "expires_at": "2026-06-20T14:51:00Z",
    "contract": {"heartbeat_sec": 30, "heartbeat_misses": 4, "ack_timeout_sec": 180,
                 "idle_timeout_sec": 120, "timeout_sec": 7200},
    "sealed": {"alg": "A256GCM", "nonce": NONCE, "ciphertext": CIPHERTEXT},
    "sig": SIG,
}
CONTROL: dict[str, Any] = {
    "schema_version": 1, "kind": "control", "action": "cancel", "job_id": "918b0612", "attempt_id": 1,
    "reason": "operator", "issued_at": "2026-06-20T14:50:00Z", "sig": SIG,
}
PRESENCE: dict[str, Any] = {
    "schema_version": 1, "kind": "presence", "session": "gpu-box", "runner_id": RUNNER, "status": "online",
    "host": "gpu-box.lan", "version": "0.1.0", "max_jobs": 1, "running": ["918b0612"],
    "timestamp": "2026-06-20T14:50:00Z", "sig": SIG,
}
REVOKED: dict[str, Any] = {
    "schema_version": 1, "kind": "revoked", "session": "gpu-box", "runner_key": wire.b64url_encode(bytes(32)),
    "revoked_at": "2026-06-20T14:50:00Z", "sig_alg": "ed25519", "sig": wire.b64url_encode(bytes(64)),
}
DRAIN: dict[str, Any] = {
    "schema_version": 1, "kind": "drain", "session": "gpu-box", "draining": True, "reason": "disk full",
    "issued_at": "2026-06-20T14:50:00Z", "sig": SIG,
}
VALID = {"event": EVENT, "state": STATE, "dispatch": DISPATCH, "control": CONTROL, "presence": PRESENCE,
         "revoked": REVOKED, "drain": DRAIN}
DELETE = object()


def mutated(kind: str, path: str, value: Any) -> dict[str, Any]:
    """A deep copy of the valid `kind` message with `path` (dotted) set to `value` or deleted."""
    obj = copy.deepcopy(VALID[kind])
    *parents, leaf = path.split(".")
    target = obj
    for key in parents:
        target = target[key]
    if value is DELETE:
        del target[leaf]
    else:
        target[leaf] = value
    return obj


def refused(raw: bytes | str, expect: str) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        wire.decode(raw, expect)
    error = info.value
    assert error.raw == raw
    assert "\n" not in error.reason
    return error


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


# ------------------------------------------------------------- valid input

@pytest.mark.parametrize("kind", wire.EXPECTS)
def test_s3_s7_protocol_examples_decode(kind):
    message = wire.decode(dumps(VALID[kind]), kind)
    assert message.to_dict() == VALID[kind]
    assert type(message).__name__.lower() == {"revoked": "revocation"}.get(kind, kind)


def test_s3_event_accessors():
    event = wire.decode(dumps(EVENT), "event")
    assert (event.attempt_id, event.dispatch_token, event.session, event.hmac_sig) == (1, TOKEN, "gpu-box", SIG)
    assert event.terminal is False and event.heartbeat is False and event.exit_code is None


def test_s3_free_metrics_and_reserved_keys_accepted():
    obj = mutated("event", "data", {**EVENT["data"], "exit_code": -9, "heartbeat": True,
                                    "tokens": 1234, "cost": 0.25, "files": ["a", "b"], "nested": {"x": None}})
    event = wire.decode(dumps(obj), "event")
    assert event.exit_code == -9 and event.heartbeat is True
    assert event.to_dict() == obj


def test_s3_2_missing_hmac_sig_is_left_to_verification():
    """§3.2 rule 4: a missing HMAC is `HMAC verify failed`, not `malformed`."""
    obj = mutated("event", "data.hmac_sig", DELETE)
    assert wire.decode(dumps(obj), "event").hmac_sig is None


def test_s3_timestamp_fraction_accepted_on_input():
    obj = mutated("event", "timestamp", "2026-06-20T14:48:58.123456789Z")
    event = wire.decode(dumps(obj), "event")
    assert event.timestamp == "2026-06-20T14:48:58.123456789Z"
    assert wire.parse_ts(event.timestamp) == datetime(2026, 6, 20, 14, 48, 58, 123456, tzinfo=UTC)


def test_s3_format_ts_is_utc_seconds():
    moment = datetime(2026, 6, 20, 16, 48, 58, 999999, tzinfo=timezone(timedelta(hours=2)))
    assert wire.format_ts(moment) == "2026-06-20T14:48:58Z"
    assert wire.parse_ts(wire.format_ts()) <= datetime.now(UTC)
    with pytest.raises(ValueError, match="naive"):
        wire.format_ts(datetime(2026, 6, 20))


@pytest.mark.parametrize("bad", ["2026-06-20T14:48:58", "2026-06-20 14:48:58Z", "2026-06-20T14:48:58+00:00",
                                 "2026-13-01T00:00:00Z", "2026-02-30T00:00:00Z", "2026-06-20T24:00:00Z",
                                 "2026-06-20T14:48:58.Z", "2026-06-20T14:48:58z", "٢٠٢٦-06-20T14:48:58Z",
                                 "2026-06-20T14:48:58Z\n", ""])
def test_s3_parse_ts_refuses(bad):
    with pytest.raises(ValueError):
        wire.parse_ts(bad)


def test_s3_1_canonical_is_the_exact_formula():
    obj = {"b": [1, {"z": "é✓", "a": None}], "a": True, "c": "line\nbreak"}
    expected = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    assert wire.canonical(obj) == expected
    assert "é✓".encode() in wire.canonical(obj)
    event = wire.Event.from_dict(EVENT)
    assert wire.canonical(event) == wire.canonical(EVENT) == wire.encode(event)


def test_s5_contract_defaults():
    contract = wire.Contract()
    assert contract.to_dict() == {"heartbeat_sec": 30, "heartbeat_misses": 4, "ack_timeout_sec": 180,
                                  "idle_timeout_sec": 120, "timeout_sec": 7200}
    assert wire.Contract(heartbeat_sec=10, heartbeat_misses=3).idle_timeout_sec == 30
    assert wire.Contract(idle_timeout_sec=77).idle_timeout_sec == 77


def test_s5_dispatch_build_sets_expiry_and_is_unsigned():
    issued = datetime(2026, 6, 20, 14, 48, 0, 500, tzinfo=UTC)
    dispatch = wire.Dispatch.build("918b0612", "gpu-box", 1, TOKEN, origin="hub-1",
                                   contract=wire.Contract(), sealed=DISPATCH["sealed"], issued_at=issued)
    assert dispatch.issued_at == "2026-06-20T14:48:00Z"
    assert dispatch.expires_at == "2026-06-20T14:51:00Z"
    assert "sig" not in dispatch.to_dict()
    unsigned = wire.encode(dispatch)
    assert refused(unsigned, "dispatch").reason == "malformed: missing field 'sig'"
    whole = issued.replace(microsecond=0)
    assert not dispatch.expired(now=whole + timedelta(seconds=180 + 30))
    assert dispatch.expired(now=whole + timedelta(seconds=180 + 31))
    assert not dispatch.expired(now=whole + timedelta(seconds=180), skew_s=0)
    assert dispatch.expired(now=whole + timedelta(seconds=181), skew_s=0)


@pytest.mark.parametrize("builder,match", [
    (lambda: wire.Event.build("918b0612", 0, "started", attempt_id=1, dispatch_token=TOKEN), "seq"),
    (lambda: wire.Event.build("918b0612", 1, "done", attempt_id=1, dispatch_token=TOKEN), "event"),
    (lambda: wire.Event.build("918b0612", 1, "progress", "x" * 1025, attempt_id=1, dispatch_token=TOKEN),
     "detail is 1025 characters"),
    (lambda: wire.Event.build("918b0612", 1, "progress", attempt_id=True, dispatch_token=TOKEN),
     "data.attempt_id"),
    (lambda: wire.Event.build("918b0612", 1, "progress", attempt_id=1, dispatch_token=TOKEN, session="a.b"),
     "data.session"),
    (lambda: wire.State.build("918b0612", 1, "done", "progress", attempt_id=1, dispatch_token=TOKEN), "status"),
    (lambda: wire.Control.cancel("918b0612", 0, "operator"), "attempt_id"),
    (lambda: wire.Presence.build("gpu-box", RUNNER, "away", host="h", version="1", max_jobs=1), "status"),
    (lambda: wire.Dispatch.build("918b0612", "remote:gpu-box", 1, TOKEN, origin="hub",
                                 contract=wire.Contract(), sealed=DISPATCH["sealed"]), "session"),
    (lambda: wire.Dispatch.build("918b0612", "gpu-box", 1, TOKEN, origin="hub", contract=wire.Contract(),
                                 sealed={"alg": "A256GCM", "nonce": "x", "ciphertext": CIPHERTEXT}),
     "sealed.nonce"),
])
def test_s3_s7_builders_refuse_what_decode_refuses(builder, match):
    with pytest.raises(UsageError, match=match) as info:
        builder()
    assert "\n" not in str(info.value)


def test_s3_messages_are_frozen_deeply():
    event = wire.Event.build("918b0612", 1, "progress", attempt_id=1, dispatch_token=TOKEN,
                             data={"files": ["a"], "nested": {"k": 1}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.seq = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        event.data["x"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        event.data["nested"]["k"] = 2  # type: ignore[index]
    assert isinstance(event.data["files"], tuple)
    out = event.to_dict()
    out["data"]["files"].append("b")
    out["data"]["nested"]["k"] = 2
    assert event.to_dict()["data"] == {"files": ["a"], "nested": {"k": 1}, "attempt_id": 1,
                                       "dispatch_token": TOKEN}


def test_s3_encode_refuses_what_decode_would_refuse_for_size():
    event = wire.Event.build("918b0612", 1, "progress", attempt_id=1, dispatch_token=TOKEN,
                             data={"blob": "x" * wire.MAX_MESSAGE_BYTES})
    with pytest.raises(ProtocolError, match="over the cap"):
        wire.encode(event)


def test_s3_decode_accepts_str_bytearray_memoryview():
    raw = dumps(EVENT)
    for form in (raw.decode(), bytearray(raw), memoryview(raw)):
        assert wire.decode(form, "event").to_dict() == EVENT


def test_s3_decode_unknown_expect_is_a_programming_error():
    with pytest.raises(ValueError, match="expect"):
        wire.decode(dumps(EVENT), "events")


# --------------------------------------------------- payload-level refusals

@pytest.mark.parametrize("raw", [b"", ""])
def test_s2_zero_length_payload_is_its_own_reason(raw):
    assert refused(raw, "event").reason == "empty: zero-length payload"


@pytest.mark.parametrize("kind", wire.EXPECTS)
def test_s3_2_two_megabyte_payload_refused_before_parsing(kind, monkeypatch):
    def no_parse(*args, **kwargs):
        raise AssertionError("json.loads called on an oversized payload")
    monkeypatch.setattr(jsoncodec.json, "loads", no_parse)
    raw = b'{"detail":"' + b"x" * (2 * 1024 * 1024) + b'"}'
    reason = refused(raw, kind).reason
    assert reason.startswith("malformed: payload is ") and "at most" in reason
    assert refused(raw.decode(), kind).reason.startswith("malformed: payload is ")


def test_s3_2_payload_caps():
    assert wire.MAX_PAYLOAD_BYTES["dispatch"] == 1024 * 1024
    just_over = b"{" + b" " * wire.MAX_MESSAGE_BYTES + b"}"
    assert "65538 bytes" in refused(just_over, "event").reason
    # The same size is fine for a dispatch as far as the cap goes (then fails on fields).
    assert "payload is" not in refused(just_over, "dispatch").reason


def test_s3_2_multibyte_str_measured_in_bytes():
    text = json.dumps({"detail": "é" * 40000}, ensure_ascii=False)
    assert len(text) < wire.MAX_MESSAGE_BYTES < len(text.encode())
    assert "bytes, at most" in refused(text, "event").reason


@pytest.mark.parametrize("raw,why", [
    (b"\xff\xfe{}", "not UTF-8"),
    (b'{"detail":"\xc3"}', "not UTF-8"),
    ('{"detail":"\ud800"}', "not UTF-8"),
    (b"{", "not JSON"),
    (b"hello", "not JSON"),
    (b"{'schema_version': 1}", "not JSON"),
    (b"\xef\xbb\xbf{}", "not JSON"),
    (b"[]", "an array, expected a JSON object"),
    (b"1", "an integer, expected a JSON object"),
    (b'"x"', "a string, expected a JSON object"),
    (b"null", "null, expected a JSON object"),
    (b"true", "a boolean, expected a JSON object"),
    (b'{"schema_version":1,"seq":1,"seq":2}', "duplicate key 'seq'"),
    (b'{"schema_version":1,"seq":NaN}', "NaN"),
    (b'{"schema_version":1,"seq":Infinity}', "Infinity"),
    (b'{"schema_version":1,"seq":-Infinity}', "-Infinity"),
    (b'{"schema_version":1,"seq":1e999}', "too large"),
    (b'{"schema_version":1,"seq":' + b"9" * 5000 + b"}", "not JSON"),
    (b"[" * 30000 + b"]" * 30000, "nests deeper"),
    (b'{"schema_version":1,"x":' + b"[" * 20 + b"]" * 20 + b"}", "nests deeper"),
    (b'{"schema_version":1,"detail":"\\ud800"}', "detail holds a lone surrogate"),
    (b'{"schema_version":1,"data":{"\\udc00":1}}', "a key of data holds a lone surrogate"),
])
def test_s3_2_not_a_utf8_json_object_is_malformed(raw, why):
    reason = refused(raw, "event").reason
    assert reason.startswith("malformed: ")
    assert why in reason


@pytest.mark.parametrize("kind", wire.EXPECTS)
@pytest.mark.parametrize("version", [2, 0, -1, 99])
def test_s3_2_schema_version_mismatch(kind, version):
    obj = mutated(kind, "schema_version", version)
    assert refused(dumps(obj), kind).reason == f"schema_mismatch: schema_version is {version}, expected 1"


def test_s3_2_schema_version_judged_before_other_fields():
    """§3.2: rule 2's schema version comes before any field rule, even when everything else is wrong."""
    raw = b'{"schema_version":2,"seq":"x","unknown":1,"detail":"\\u0000"}'
    assert refused(raw, "event").reason == "schema_mismatch: schema_version is 2, expected 1"


@pytest.mark.parametrize("kind", wire.EXPECTS)
@pytest.mark.parametrize("value", ["1", 1.0, True, None, [1]])
def test_s3_2_schema_version_wrong_type_is_malformed(kind, value):
    reason = refused(dumps(mutated(kind, "schema_version", value)), kind).reason
    assert reason.startswith("malformed: schema_version must be an integer")


@pytest.mark.parametrize("kind", wire.EXPECTS)
def test_s3_2_schema_version_missing_is_malformed(kind):
    assert refused(dumps(mutated(kind, "schema_version", DELETE)), kind).reason == \
        "malformed: missing field 'schema_version'"


# -------------------------------------------------------- field set rules

FIELD_SETS = {"event": wire.EVENT_FIELDS, "state": wire.STATE_FIELDS, "dispatch": wire.DISPATCH_FIELDS,
              "control": wire.CONTROL_FIELDS, "presence": wire.PRESENCE_FIELDS}
MISSING = [(kind, name) for kind, fields in FIELD_SETS.items() for name in sorted(fields)
           if name != "schema_version"]
MISSING += [("event", "data.attempt_id"), ("event", "data.dispatch_token"),
            ("state", "data.attempt_id"), ("state", "data.dispatch_token")]
MISSING += [("dispatch", f"contract.{name}") for name in sorted(wire.CONTRACT_FIELDS)]
MISSING += [("dispatch", f"sealed.{name}") for name in sorted(wire.SEALED_FIELDS)]


@pytest.mark.parametrize("kind,path", MISSING)
def test_s3_s7_missing_field_refused(kind, path):
    reason = refused(dumps(mutated(kind, path, DELETE)), kind).reason
    assert reason == f"malformed: missing field '{path}'"


@pytest.mark.parametrize("kind,path", [
    ("event", "status"), ("event", "extra"), ("event", "hmac_sig"),
    ("state", "extra"), ("state", "session"),
    ("dispatch", "brief"), ("dispatch", "auth_token"), ("dispatch", "contract.extra"), ("dispatch", "sealed.tag"),
    ("control", "extra"), ("control", "session"),
])
def test_s3_s7_unknown_field_refused(kind, path):
    reason = refused(dumps(mutated(kind, path, 1)), kind).reason
    assert reason == f"malformed: unknown field '{path}'"


@pytest.mark.parametrize("path", ["extra", "attempt_id", "last_refusal"])
def test_s14_unknown_presence_field_ignored_but_kept_for_the_signature(path):
    presence = wire.decode(dumps(mutated("presence", path, {"job_id": "918b0612"})), "presence")
    assert presence.to_dict()[path] == {"job_id": "918b0612"}  # re-encoded as signed
    assert presence == wire.decode(dumps(PRESENCE), "presence")  # otherwise the same presence


def test_s3_event_is_not_a_state_and_back():
    assert "unknown field" in refused(dumps(STATE), "event").reason
    assert "missing field" in refused(dumps(EVENT), "state").reason


# ------------------------------------------------------- per-field rules

FIELD_CASES: list[tuple[str, str, Any, str]] = []


def _cases(kind: str, path: str, values: list[Any], why: str = "") -> None:
    FIELD_CASES.extend((kind, path, value, why) for value in values)


# §3 events
_cases("event", "seq", [0, -1, "2", True, False, 2.0, None, 2**53, [2]])
_cases("event", "job_id", ["918B0612", "918b061", "918b06123", "zzzzzzzz", 12345678, None, "918b0612\n", ""])
_cases("event", "event", ["state", "done", "", None, "Started", 1, "completed "])
_cases("event", "timestamp", ["2026-06-20 14:48:58Z", "2026-06-20T14:48:58", "2026-02-30T00:00:00Z",
                              1718894938, None, "2026-06-20T14:48:58+00:00"])
_cases("event", "detail", ["x" * 1025], "1025 characters, at most 1024")
_cases("event", "detail", ["a\nb", "nul\x00", "\x1b[31mred", "del\x7f", "c1\x85", "ls\u2028", "tab\t"],
       "control character")
_cases("event", "detail", [None, 5, ["x"]], "must be a string")
_cases("event", "data", [[], "x", None, 1], "data must be an object")
_cases("event", "data.attempt_id", [0, -1, True, "1", 1.0, None, 2**53])
_cases("event", "data.dispatch_token", ["A" * 32, "a" * 31, "a" * 33, "g" * 32, 5, None])
_cases("event", "data.session", ["gpu.box", "", "a/b", "a b", "a+b", "a#", "a*", "a>", "-x", "x" * 64, 5,
                                 "gpu\n"])
_cases("event", "data.hmac_sig", ["0" * 63, "0" * 65, "A" * 64, "g" * 64, 5, None])
_cases("event", "data.exit_code", ["1", True, 1.5, None, 2**40])
_cases("event", "data.heartbeat", [1, 0, "true", None], "data.heartbeat must be a boolean")
_cases("event", "data.nested", [{"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": 1}}}}}}}}}],
       "nests deeper than")
# §4 states
_cases("state", "event", ["progress", "completed", "State"])
_cases("state", "status", ["done", "online", "Running", "", None, 1])
_cases("state", "last_event", ["state", "", None, "heartbeat"])
_cases("state", "seq", [0, True, "7"])
_cases("state", "detail", ["y" * 1025, "\x00"])
_cases("state", "data.dispatch_token", ["x"])
_cases("state", "data.attempt_id", [0, False])
# §5 dispatch
_cases("dispatch", "kind", ["control", "Dispatch", None])
_cases("dispatch", "job_id", ["918B0612", 1])
_cases("dispatch", "session", ["remote:gpu-box", "gpu.box", "", None, 3])
_cases("dispatch", "attempt_id", [0, -1, True, "1", 1.5, None])
_cases("dispatch", "dispatch_token", ["A" * 32, "a" * 31, 1, None])
_cases("dispatch", "origin", ["", "x" * 256, "a\nb", 5, None])
_cases("dispatch", "issued_at", ["yesterday", None, 0])
_cases("dispatch", "expires_at", ["2026-06-20T14:47:59Z"], "expires_at 2026-06-20T14:47:59Z is before issued_at")
_cases("dispatch", "expires_at", ["2026-06-20T14:51:00", 1])
_cases("dispatch", "contract", [[], "x", None], "contract must be an object")
for _name in sorted(wire.CONTRACT_FIELDS):
    _cases("dispatch", f"contract.{_name}", [0, -30, True, "30", 1.5, None, 10**12])
_cases("dispatch", "sealed", [[], "x", None], "sealed must be an object")
_cases("dispatch", "sealed.alg", ["A128GCM", "a256gcm", None, ""])
_cases("dispatch", "sealed.nonce", ["!!!!", "AAAA AAAA", wire.b64url_encode(bytes(11)), wire.b64url_encode(bytes(13)),
                                    "AAAAA", 12, None, "AAAAAAAAAAAAAAAA==="])
_cases("dispatch", "sealed.ciphertext", [wire.b64url_encode(bytes(15)), "", "a+b/", None, 5])
_cases("dispatch", "sig", ["0" * 63, "A" * 64, None, 5, ""])
# §6 control
_cases("control", "kind", ["dispatch", None])
_cases("control", "action", ["kill", "Cancel", None, ""])
_cases("control", "job_id", ["x", None])
_cases("control", "attempt_id", [0, True, "1", None])
_cases("control", "reason", ["", "r" * 257, "a\x00b", None, 1])
_cases("control", "issued_at", ["2026-06-20", None])
_cases("control", "sig", ["0" * 63, None, "G" * 64])
# §7 presence
_cases("presence", "kind", ["control", None])
_cases("presence", "session", ["gpu.box", "", None, "x" * 64])
_cases("presence", "runner_id", ["A" * 32, "a" * 31, None, 1])
_cases("presence", "status", ["away", "Online", None, ""])
_cases("presence", "host", ["", "h" * 256, "h\x00", None])
_cases("presence", "version", ["", "v" * 65, "1\n", None])
_cases("presence", "max_jobs", [0, -1, True, "1", 1.0, None, 1025])
_cases("presence", "running", ["918b0612", None, {"918b0612": 1}], "running must be an array")
_cases("presence", "running", [["zz"], [1], [None], ["918B0612"]], "running[0]")
_cases("presence", "running", [["918b0612", "918b0612"]], "twice")
_cases("presence", "running", [["918b0612"] * 1025], "1025 entries")
_cases("presence", "timestamp", ["now", None])
_cases("presence", "sig", ["0" * 63, None])


@pytest.mark.parametrize("kind,path,value,why", FIELD_CASES)
def test_s3_s7_bad_field_refused_naming_it(kind, path, value, why):
    reason = refused(dumps(mutated(kind, path, value)), kind).reason
    assert reason.startswith("malformed: ")
    name = path
    assert name in reason
    assert why in reason


def test_s3_reason_shows_value_short_and_on_one_line():
    reason = refused(dumps(mutated("event", "job_id", "x" * 5000)), "event").reason
    assert len(reason) < 200
    assert "job_id" in reason


def test_s3_2_decode_error_keeps_raw_payload():
    raw = dumps(mutated("event", "seq", 0))
    error = refused(raw, "event")
    assert error.raw is raw
    assert str(error) == error.reason


# ------------------------------------------------------------- properties

_HEX32 = st.from_regex(r"[0-9a-f]{32}", fullmatch=True)
_JOB_ID = st.from_regex(r"[0-9a-f]{8}", fullmatch=True)
_SESSION = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}", fullmatch=True)
_SAFE_TEXT = st.text(st.characters(exclude_categories=("Cc", "Cs", "Zl", "Zp")), max_size=40)
_TIMES = st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(9999, 12, 30),
                      timezones=st.just(UTC))
_TIMESTAMP = st.one_of(_TIMES.map(wire.format_ts),
                       _TIMES.map(lambda t: t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")))
_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63),
                    st.floats(allow_nan=False, allow_infinity=False), _SAFE_TEXT)
_METRIC = st.recursive(_SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(_SAFE_TEXT, inner, max_size=3)),
                       max_leaves=6)
_FREE_KEYS = _SAFE_TEXT.filter(lambda k: k not in {"attempt_id", "dispatch_token", "session", "hmac_sig",
                                                    "exit_code", "heartbeat"})


@st.composite
def _event_data(draw: Any) -> dict[str, Any]:
    data = draw(st.dictionaries(_FREE_KEYS, _METRIC, max_size=4))
    if draw(st.booleans()):
        data["exit_code"] = draw(st.integers(-(2**31), 2**31 - 1))
    if draw(st.booleans()):
        data["heartbeat"] = draw(st.booleans())
    if draw(st.booleans()):
        data["hmac_sig"] = draw(st.from_regex(r"[0-9a-f]{64}", fullmatch=True))
    return data


EVENTS = st.builds(
    lambda job_id, seq, event, detail, attempt, token, session, data, ts: wire.Event.build(
        job_id, seq, event, detail, attempt_id=attempt, dispatch_token=token, session=session, data=data,
        timestamp=ts),
    _JOB_ID, st.integers(1, 2**53 - 1), st.sampled_from(wire.EVENT_NAMES),
    st.text(st.characters(exclude_categories=("Cc", "Cs", "Zl", "Zp")), max_size=1024),
    st.integers(1, 2**53 - 1), _HEX32, st.none() | _SESSION, _event_data(), _TIMESTAMP)
STATES = st.builds(
    lambda job_id, seq, status, last, attempt, token, detail, ts: wire.State.build(
        job_id, seq, status, last, attempt_id=attempt, dispatch_token=token, detail=detail, timestamp=ts),
    _JOB_ID, st.integers(1, 2**53 - 1), st.sampled_from(wire.JOB_STATUSES), st.sampled_from(wire.EVENT_NAMES),
    st.integers(1, 1000), _HEX32, _SAFE_TEXT, _TIMESTAMP)
CONTRACTS = st.builds(wire.Contract, st.integers(1, 3600), st.integers(1, 100), st.integers(1, 86400),
                      st.none() | st.integers(1, 86400), st.integers(1, wire.MAX_CONTRACT_SEC))
SEALS = st.builds(lambda nonce, ct, pad: wire.Sealed(
    nonce=wire.b64url_encode(nonce) if pad else wire.b64url_encode(nonce).rstrip("="),
    ciphertext=wire.b64url_encode(ct) if pad else wire.b64url_encode(ct).rstrip("=")),
    st.binary(min_size=12, max_size=12), st.binary(min_size=16, max_size=200), st.booleans())
_SIG = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)
DISPATCHES = st.builds(
    lambda job_id, session, attempt, token, origin, contract, sealed, when, sig: dataclasses.replace(
        wire.Dispatch.build(job_id, session, attempt, token, origin=origin, contract=contract, sealed=sealed,
                            issued_at=when), sig=sig),
    _JOB_ID, _SESSION, st.integers(1, 10**6), _HEX32, _SAFE_TEXT.filter(bool), CONTRACTS, SEALS,
    st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(9000, 1, 1), timezones=st.just(UTC)),
    _SIG)
CONTROLS = st.builds(
    lambda job_id, attempt, reason, ts, sig: dataclasses.replace(
        wire.Control.cancel(job_id, attempt, reason, issued_at=ts), sig=sig),
    _JOB_ID, st.integers(1, 10**6), _SAFE_TEXT.filter(bool), _TIMESTAMP, _SIG)
PRESENCES = st.builds(
    lambda session, runner, status, host, version, max_jobs, running, ts, sig: dataclasses.replace(
        wire.Presence.build(session, runner, status, host=host, version=version, max_jobs=max_jobs,
                            running=running, timestamp=ts), sig=sig),
    _SESSION, _HEX32, st.sampled_from(wire.PRESENCE_STATUSES), _SAFE_TEXT.filter(bool),
    _SAFE_TEXT.filter(bool).map(lambda v: v[:64]), st.integers(1, 64), st.sets(_JOB_ID, max_size=5),
    _TIMESTAMP, _SIG)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,strategy", [("event", EVENTS), ("state", STATES), ("dispatch", DISPATCHES),
                                           ("control", CONTROLS), ("presence", PRESENCES)])
def test_s3_s7_encode_decode_round_trip(kind, strategy):
    @settings(max_examples=120, deadline=None)
    @given(strategy)
    def round_trip(message: Any) -> None:
        raw = wire.encode(message)
        back = wire.decode(raw, kind)
        assert back == message
        assert wire.encode(back) == raw
        assert wire.from_dict(json.loads(raw), kind) == message

    round_trip()


def test_s3_many_unknown_fields_reason_stays_short():
    obj = {**EVENT, **{f"extra{i:03d}": i for i in range(500)}}
    reason = refused(dumps(obj), "event").reason
    assert reason == "malformed: unknown field 'extra000', 'extra001', 'extra002' and 497 more"


@pytest.mark.parametrize("kind", wire.EXPECTS)
def test_s3_2_class_from_dict_applies_the_same_order(kind):
    cls = {"event": wire.Event, "state": wire.State, "dispatch": wire.Dispatch, "control": wire.Control,
           "presence": wire.Presence, "revoked": wire.Revocation, "drain": wire.Drain}[kind]
    assert cls.from_dict(VALID[kind]).to_dict() == VALID[kind]
    bad = {**mutated(kind, "schema_version", 2), "unknown": 1}
    with pytest.raises(DecodeError) as info:
        cls.from_dict(bad)
    assert info.value.reason == "schema_mismatch: schema_version is 2, expected 1"
    assert info.value.raw is None


_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
                     lambda inner: st.one_of(st.lists(inner, max_size=3),
                                             st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                     max_leaves=8)
_PATHS = [(kind, path) for kind, obj in VALID.items() for path in obj] + \
    [("event", f"data.{key}") for key in EVENT["data"]] + \
    [("dispatch", f"contract.{key}") for key in DISPATCH["contract"]] + \
    [("dispatch", f"sealed.{key}") for key in DISPATCH["sealed"]]


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(raw=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(lambda t: t.encode("utf-8", "replace"))),
       kind=st.sampled_from(wire.EXPECTS))
def test_s3_2_arbitrary_bytes_only_ever_raise_decode_error(raw, kind):
    """A daemon never dies on a bad message: whatever arrives, decode refuses it with DecodeError."""
    try:
        wire.decode(raw, kind)
    except DecodeError as error:
        assert error.reason.split(":", 1)[0] in ("empty", "malformed", "schema_mismatch")


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(where=st.sampled_from(_PATHS), value=_JSON)
def test_s3_s7_any_field_replaced_by_any_json_is_accepted_or_decode_error(where, value):
    kind, path = where
    raw = json.dumps(mutated(kind, path, value)).encode()
    try:
        message = wire.decode(raw, kind)
    except DecodeError as error:
        assert error.reason.startswith(("malformed: ", "schema_mismatch: "))
        assert "\n" not in error.reason
    else:
        assert wire.decode(wire.encode(message), kind) == message
