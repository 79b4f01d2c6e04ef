"""PROTOCOL §16 enrolment by invite, without a broker: the code's format, its stored
file (a hash, never the code), the request and answer MACs keyed by HKDF(code), expiry,
single use, and the hub's handling of one request (`orchestrator.invites._handle`)."""

from __future__ import annotations

import io
import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

from mam.orchestrator import init as mam_init
from mam.orchestrator.broker import users
from mam.orchestrator.identity import invites, roster
from mam.runner import enrol, enrolinvite
from mam.shared.config import BrokerConfig, read_env_file
from mam.shared.protocol import names
from mam.shared.protocol.crypto import invite, keys
from mam.shared.protocol.crypto.invite import InviteCode
from mam.shared.protocol.errors import ConfigError, MamError, ProtocolError, SignatureError, UsageError
from mam.shared.protocol.wire.jsoncodec import canonical_json
from mam.shared.store import keyfiles

pytestmark = pytest.mark.timeout(60)

ROOT = "t/root"


class Published:
    """Stands in for the hub's MQTT client: `_handle` only publishes answers."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, object]]] = []

    def publish(self, topic: str, payload: bytes) -> None:
        self.sent.append((topic, json.loads(payload)))


def test_s16_invite_code_format_128_random_bits_and_round_trip():
    code = InviteCode.new("gpu-box")
    assert re.fullmatch(r"mam1\.gpu-box\.[A-Za-z0-9_-]{22}", code.code)
    assert InviteCode.parse(f"  {code.code}\n") == code
    assert InviteCode.new("gpu-box").code != code.code
    assert re.fullmatch(r"[0-9a-f]{32}", code.invite_id) and len(code.key) == 32
    assert code.code not in repr(code)
    other = InviteCode.new("gpu-box")
    assert other.key != code.key and other.invite_id != code.invite_id


@pytest.mark.parametrize("bad", ["", "mam1.gpu-box", "mam2.gpu-box.AAAAAAAAAAAAAAAAAAAAAA",
                                 "mam1.gpu.box.AAAAAAAAAAAAAAAAAAAAAA", "mam1.gpu-box.AAAA", None])
def test_s16_bad_invite_code_is_one_line_without_echo(bad):
    with pytest.raises(UsageError) as info:
        InviteCode.parse(bad)
    message = str(info.value)
    assert "\n" not in message and "invite code is invalid" in message
    assert not bad or bad not in message


def self_signed_pem() -> str:
    """A CA certificate as a hub's MQTT_CA_CERTS would hold one."""
    key = Ed25519PrivateKey.generate()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mam test CA")])
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + timedelta(days=1))
            .sign(key, None))
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")


CA_PEM = self_signed_pem()


def test_s16_a_code_carries_where_the_broker_is_under_its_mac():
    hint = invite.BrokerHint(("100.64.0.7", "100.64.0.8"), 8883, True, "fleet/a", CA_PEM)
    code = InviteCode.new("gpu-box").with_broker(hint)
    assert code.text.startswith(code.code + ".") and code.code in code.text
    parsed = InviteCode.parse(code.text)
    assert parsed == code and parsed.broker == hint and parsed.invite_id == code.invite_id
    assert InviteCode.parse(code.code).broker is None  # a core alone still works
    other = InviteCode.new("gpu-box")  # the broker part of another code: its MAC does not match
    with pytest.raises(UsageError, match="does not match the code"):
        InviteCode.parse(f"{other.code}.{code.text.rsplit('.', 1)[1]}")
    forged = invite.b64url_encode(canonical_json({**hint._body(), "hosts": ["evil.example"], "mac": "0" * 64}))
    with pytest.raises(UsageError, match="does not match the code"):
        InviteCode.parse(f"{code.code}.{forged.rstrip('=')}")


@pytest.mark.parametrize(("part", "said"), [
    ("!!!", "invite code is invalid"),
    ("A" * (invite.MAX_BROKER_PART_CHARS + 1), "invite code is invalid"),
    ("bm90IGpzb24", "not readable"),
    (invite.b64url_encode(canonical_json({"hosts": ["h"]})).rstrip("="), "other fields"),
])
def test_s16_a_malformed_or_oversized_broker_part_is_one_line_without_echo(part, said):
    core = InviteCode.new("gpu-box").code
    with pytest.raises(UsageError, match=said) as info:
        InviteCode.parse(f"{core}.{part}")
    assert "\n" not in str(info.value) and core not in str(info.value)


@pytest.mark.parametrize(("change", "said"), [
    ({"hosts": ()}, "broker hosts"), ({"hosts": ("a b",)}, "broker hosts"), ({"hosts": ("h",) * 9}, "broker hosts"),
    ({"port": 0}, "broker port"), ({"port": True}, "broker port"), ({"tls": "yes"}, "broker tls"),
    ({"topic_root": "a/+/b"}, "topic root"), ({"ca_pem": "not a pem"}, "broker CA"),
    ({"ca_pem": "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"}, "broker CA"),
    ({"ca_pem": CA_PEM * 500}, "broker CA"),
])
def test_s16_a_bad_broker_hint_is_refused(change, said):
    base = {"hosts": ("h",), "port": 1883, "tls": False, "topic_root": "python/mqtt"}
    with pytest.raises(UsageError, match=said):
        invite.BrokerHint(**{**base, **change})


def test_s16_the_hub_puts_its_broker_or_broker_host_and_its_ca_in_the_code(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text(CA_PEM)
    cfg = BrokerConfig(hosts=("127.0.0.1",), port=8883, tls=True, ca_certs=str(ca), topic_root="fleet/a")
    hint = invites.broker_hint(cfg)
    assert (hint.hosts, hint.port, hint.tls, hint.topic_root, hint.ca_pem) == (("127.0.0.1",), 8883, True,
                                                                             "fleet/a", CA_PEM)
    assert invites.is_loopback("127.0.0.1") and invites.is_loopback("localhost") and invites.is_loopback("[::1]")
    assert not invites.is_loopback("100.64.0.7")
    assert invites.broker_hint(cfg, "100.64.0.7, 100.64.0.8").hosts == ("100.64.0.7", "100.64.0.8")
    with pytest.raises(UsageError, match="--broker-host"):
        invites.broker_hint(cfg, "a host")
    ca.write_text(CA_PEM * 500)
    with pytest.raises(ConfigError, match="too big"):
        invites.broker_hint(cfg)
    with pytest.raises(ConfigError, match="no broker configured"):
        invites.broker_hint(BrokerConfig(hosts=()))


@pytest.mark.parametrize(("text", "seconds"), [("15m", 900.0), ("90s", 90.0), ("2h", 7200.0), ("1d", 86400.0),
                                               ("30", 30.0)])
def test_s16_invite_ttl(text, seconds):
    assert invite.parse_ttl(text) == seconds


@pytest.mark.parametrize("bad", ["", "15x", "-1m", "0", "8d"])
def test_s16_bad_invite_ttl_refused(bad):
    with pytest.raises(UsageError, match="--ttl"):
        invite.parse_ttl(bad)


def test_s16_invite_file_holds_a_hash_not_the_code_0600(tmp_path):
    code, stored = invites.create(tmp_path, "gpu-box", ("gpu",), 60.0)
    path = names.invite_path(tmp_path, code.invite_id)
    text = path.read_text()
    assert code.code not in text and code.code.rsplit(".", 1)[1] not in text
    assert path.stat().st_mode & 0o777 == 0o600 and names.invites_dir(tmp_path).stat().st_mode & 0o777 == 0o700
    assert invites.load(tmp_path, code.invite_id) == stored
    assert invites.why_refused(stored) is None


def test_s16_invite_expired_used_unknown_refused(tmp_path):
    code, stored = invites.create(tmp_path, "gpu-box", (), 1.0)
    later = datetime.now(UTC) + timedelta(seconds=2)
    assert "expired at" in (invites.why_refused(stored, later) or "")
    used = invites.consume(tmp_path, stored)
    assert "already used" in (invites.why_refused(invites.load(tmp_path, code.invite_id)) or "")
    assert used.used_at is not None
    assert "unknown invite code" in (invites.why_refused(invites.load(tmp_path, InviteCode.new("x").invite_id)) or "")


def test_s16_request_mac_keyed_by_the_code(tmp_path):
    code = InviteCode.new("gpu-box")
    runner = keyfiles.create_runner_keys(tmp_path)
    req = invite.parse_message(canonical_json(invite.request(code, runner)))
    asked = invite.check_request(code, req)
    assert (asked.session, asked.ed25519_public, asked.x25519_public) == \
        ("gpu-box", runner.ed25519_public, runner.x25519_public)
    assert code.code not in json.dumps(req)
    wrong = InviteCode(code.session, code.code[:-1] + ("A" if code.code[-1] != "A" else "B"))
    with pytest.raises(UsageError, match="not a request for this invite"):  # another id
        invite.check_request(wrong, req)
    swapped = {**req, "ed25519_public": keys.public_text(keyfiles.create_runner_keys(tmp_path / "a").ed25519)}
    with pytest.raises(SignatureError, match="MAC does not verify"):  # keys swapped in flight
        invite.check_request(code, swapped)


def test_s16_answer_mac_and_refusal(tmp_path):
    code = InviteCode.new("gpu-box")
    req = invite.request(code, keyfiles.create_runner_keys(tmp_path))
    hub = keys.public_text(keyfiles.hub_key(tmp_path / "hub"))
    got = invite.check_answer(code, req, invite.answer(code, req, ("gpu",), [hub]))
    assert (got.labels, got.hub_publics, got.broker_user) == (("gpu",), [hub], None)
    forged = invite.answer(InviteCode.new(code.session), req, (), [hub])
    with pytest.raises(SignatureError, match="MAC does not verify"):
        invite.check_answer(code, req, {**forged, "invite_id": code.invite_id})
    with pytest.raises(ProtocolError, match="the hub refused the invite: nope"):
        invite.check_answer(code, req, invite.refusal(req, "nope"))
    assert invite.matches(req, invite.refusal(req, "nope"))
    assert not invite.matches(req, {**invite.refusal(req, "nope"), "nonce": "0" * 32})


def _handle(root, code, req):
    client, err = Published(), io.StringIO()
    outcome = invites._handle(root, code, canonical_json(req), invites.hub_publics(root), False, client, ROOT, err)
    return outcome, client.sent, err.getvalue()


def test_s16_hub_enrols_once_then_refuses_reuse_and_wrong_codes(tmp_path):
    hub_root = tmp_path / "hub"
    code, _ = invites.create(hub_root, "gpu-box", ("gpu",), 60.0)
    runner = keyfiles.create_runner_keys(tmp_path / "runner")
    req = invite.request(code, runner)
    outcome, sent, err = _handle(hub_root, code, req)
    assert outcome == 0 and "enrolled runner gpu-box (labels: gpu) by invite" in err
    [(topic, answer)] = sent
    assert topic == names.enrol_topic("gpu-box", "answer", ROOT)
    assert invite.check_answer(code, req, answer).labels == ("gpu",)
    entry = roster.get(hub_root, "gpu-box")
    assert entry is not None and entry.ed25519_public == runner.ed25519_public and entry.labels == ("gpu",)
    # the same code again (a replayed or second request): refused, one line, roster unchanged
    outcome, sent, err = _handle(hub_root, code, invite.request(code, keyfiles.create_runner_keys(tmp_path / "r2")))
    assert outcome is None and err.count("\n") == 1 and "already used" in err
    assert sent[0][1]["kind"] == invite.REFUSED_KIND and "already used" in sent[0][1]["reason"]
    assert roster.get(hub_root, "gpu-box") == entry
    # a code this hub never made
    outcome, sent, err = _handle(hub_root, code, invite.request(InviteCode.new("gpu-box"), runner))
    assert outcome is None and "unknown invite code" in err and sent[0][1]["kind"] == invite.REFUSED_KIND
    assert code.code not in err


def test_s16_hub_refuses_a_request_with_our_id_but_a_wrong_mac(tmp_path):
    hub_root = tmp_path / "hub"
    code, _ = invites.create(hub_root, "gpu-box", (), 60.0)
    runner = keyfiles.create_runner_keys(tmp_path / "runner")
    forged = {**invite.request(InviteCode.new("gpu-box"), runner), "invite_id": code.invite_id}
    outcome, sent, err = _handle(hub_root, code, forged)
    assert outcome is None and "wrong invite code" in err and roster.get(hub_root, "gpu-box") is None
    assert invites.why_refused(invites.load(hub_root, code.invite_id)) is None  # still usable by the real runner
    outcome, _, _ = _handle(hub_root, code, invite.request(code, runner))
    assert outcome == 0


def test_s16_hub_leaves_another_pending_invite_alone_and_ignores_junk(tmp_path):
    hub_root = tmp_path / "hub"
    mine, _ = invites.create(hub_root, "a", (), 60.0)
    theirs, _ = invites.create(hub_root, "b", (), 60.0)
    outcome, sent, _ = _handle(hub_root, mine, invite.request(theirs, keyfiles.create_runner_keys(tmp_path / "r")))
    assert outcome is None and sent == []
    client, err = Published(), io.StringIO()
    for junk in (b"not json", b"{}", b"x" * (invite.MAX_MESSAGE_BYTES + 1)):
        assert invites._handle(hub_root, mine, junk, [], False, client, ROOT, err) is None
    assert client.sent == [] and err.getvalue().count("\n") == 3


# ------------------------------------------------------------ the runner's own broker user (§16)

PASSWORD = "Runner-password-0123456789abcdef"


def test_s16_answer_carries_the_broker_password_sealed_to_the_runner_only(tmp_path):
    code = InviteCode.new("gpu-box")
    runner = keyfiles.create_runner_keys(tmp_path / "runner")
    req = invite.request(code, runner)
    hub = keys.public_text(keyfiles.hub_key(tmp_path / "hub"))
    answer = invite.answer(code, req, ("gpu",), [hub], ("gpu-box", PASSWORD))
    assert PASSWORD not in json.dumps(answer)
    got = invite.check_answer(code, req, invite.parse_message(canonical_json(answer)))
    assert got.broker_user == "gpu-box" and PASSWORD not in repr(got)
    opened = invite.open_password(runner.x25519, got.sealed_password, invite_id=code.invite_id, nonce=req["nonce"],
                                  username="gpu-box")
    assert opened == PASSWORD
    other = keyfiles.create_runner_keys(tmp_path / "other").x25519
    for private, nonce, user in ((other, req["nonce"], "gpu-box"), (runner.x25519, "0" * 32, "gpu-box"),
                                 (runner.x25519, req["nonce"], "cpu-box")):  # another runner, answer, user
        with pytest.raises(SignatureError, match="does not open with this host's X25519 key"):
            invite.open_password(private, got.sealed_password, invite_id=code.invite_id, nonce=nonce, username=user)
    swapped = {**answer, "broker": {**answer["broker"], "username": "cpu-box"}}  # the MAC covers the user
    with pytest.raises(SignatureError, match="MAC does not verify"):
        invite.check_answer(code, req, swapped)


@pytest.mark.parametrize("sealed", [
    None, "text", {}, {"alg": "X25519-A256GCM", "epk": "AA==", "nonce": "AA==", "ciphertext": "AA=="},
    {"alg": "none", "epk": "", "nonce": "", "ciphertext": ""},
    {"alg": "X25519-A256GCM", "epk": keys.b64(b"\x00" * 32), "nonce": keys.b64(b"\x00" * 12),
     "ciphertext": keys.b64(b"\x00" * 32)},  # a low-order epk
    {"alg": "X25519-A256GCM", "epk": keys.b64(b"\x09" + b"\x00" * 31), "nonce": keys.b64(b"\x00" * 12),
     "ciphertext": keys.b64(b"\x00" * 100_000)},  # oversized
])
def test_s16_a_malformed_or_hostile_sealed_password_is_one_line(tmp_path, sealed):
    private = keyfiles.create_runner_keys(tmp_path).x25519
    with pytest.raises(SignatureError) as refused:
        invite.open_password(private, sealed, invite_id="0" * 32, nonce="0" * 32, username="gpu-box")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("broker", ["gpu-box", {"username": "gpu-box"}, {"username": "../x", "password": {}},
                                    {"username": "a" * 65, "password": {}}, {"username": 7, "password": {}},
                                    {"username": "gpu-box", "password": "clear-text"}])
def test_s16_an_answer_with_a_bad_broker_field_is_refused_in_one_line(tmp_path, broker):
    code = InviteCode.new("gpu-box")
    req = invite.request(code, keyfiles.create_runner_keys(tmp_path))
    answer = invite.answer(code, req, (), [keys.public_text(keyfiles.hub_key(tmp_path / "hub"))])
    answer = {**answer, "broker": broker}
    answer["mac"] = invite._mac(code.key, answer)  # even from the hub holding the code
    with pytest.raises(UsageError) as refused:
        invite.check_answer(code, req, answer)
    assert "\n" not in str(refused.value) and "../x" not in str(refused.value)


def test_s16_hub_with_a_managed_broker_config_gives_the_invited_runner_its_own_broker_user(tmp_path):
    hub_root = tmp_path / "hub"
    hub_root.mkdir()
    conf = tmp_path / "nats.conf"
    mam_init.init_workspace(hub_root, broker_config=conf, environ={})
    code, _ = invites.create(hub_root, "gpu-box", (), 60.0)
    runner = keyfiles.create_runner_keys(tmp_path / "runner")
    req = invite.request(code, runner)
    outcome, [(_, answer)], err = _handle(hub_root, code, req)
    assert outcome == 0 and "connects as broker user gpu-box" in err and "reload" in err
    got = invite.check_answer(code, req, answer)
    password = invite.open_password(runner.x25519, got.sealed_password, invite_id=code.invite_id,
                                    nonce=req["nonce"], username="gpu-box")
    assert users.runner_users(conf.read_text()) == ["gpu-box"]
    assert password not in conf.read_text() and password not in err
    assert not names.runner_credentials_path(hub_root, "gpu-box").exists()  # nothing left to hand over


def test_s16_hub_without_a_managed_broker_config_answers_without_a_broker_user(tmp_path):
    hub_root = tmp_path / "hub"
    code, _ = invites.create(hub_root, "gpu-box", (), 60.0)
    req = invite.request(code, keyfiles.create_runner_keys(tmp_path / "runner"))
    outcome, [(_, answer)], err = _handle(hub_root, code, req)
    assert outcome == 0 and "broker" not in answer and "no broker config managed here" in err


def test_s16_enroll_sets_the_broker_user_in_the_env_file_it_reads_keeping_the_rest_0600(tmp_path, monkeypatch):
    monkeypatch.delenv("MAM_ENV_FILE", raising=False)
    env_file = tmp_path / ".mam.env"
    env_file.write_text("# the hub's broker\nMQTT_BROKER=hub.example\nMQTT_USERNAME=mam_agent\n"
                        "export MQTT_PASSWORD='Shared-password-0123'\nMQTT_PORT=1883")
    env_file.chmod(0o644)
    user = {"MQTT_USERNAME": "gpu-box", "MQTT_PASSWORD": PASSWORD}
    assert enrol.write_env(tmp_path, user) == env_file
    assert read_env_file(env_file) == {"MQTT_BROKER": "hub.example", "MQTT_PORT": "1883",
                                       "MQTT_USERNAME": "gpu-box", "MQTT_PASSWORD": PASSWORD}
    assert env_file.read_text().startswith("# the hub's broker\n")
    assert env_file.stat().st_mode & 0o777 == 0o600
    elsewhere = tmp_path / "conf" / "runner.env"  # MAM_ENV_FILE names the file the runner reads (§13),
    elsewhere.parent.mkdir()  # even one that does not exist yet
    monkeypatch.setenv("MAM_ENV_FILE", str(elsewhere))
    assert enrol.write_env(tmp_path, user) == elsewhere
    assert read_env_file(elsewhere)["MQTT_USERNAME"] == "gpu-box" and elsewhere.stat().st_mode & 0o777 == 0o600


def test_s16_a_request_with_a_low_order_x25519_key_is_refused_before_anything_is_written(tmp_path):
    """No shared secret can be made with it: neither a seal nor a dispatch could reach the runner."""
    hub_root = tmp_path / "hub"
    code, _ = invites.create(hub_root, "gpu-box", (), 60.0)
    runner = keyfiles.create_runner_keys(tmp_path / "runner")
    req = {**invite.request(code, runner), "x25519_public": keys.b64(bytes(32))}
    req["mac"] = invite._mac(code.key, req)  # from a holder of the code
    outcome, [(_, refused)], err = _handle(hub_root, code, req)
    assert outcome is None and refused["kind"] == invite.REFUSED_KIND and "low-order" in err
    assert roster.get(hub_root, "gpu-box") is None
    assert invites.why_refused(invites.load(hub_root, code.invite_id)) is None


def test_s16_a_sealed_password_that_opens_but_a_config_cannot_hold_is_refused(tmp_path):
    runner = keyfiles.create_runner_keys(tmp_path)
    sealed = invite.seal_password(runner.x25519.public_key().public_bytes_raw(), "new\nMAM_EVIL=1",
                                  invite_id="0" * 32, nonce="1" * 32, username="gpu-box")
    with pytest.raises(ConfigError) as refused:
        invite.open_password(runner.x25519, sealed, invite_id="0" * 32, nonce="1" * 32, username="gpu-box")
    assert "MAM_EVIL" not in str(refused.value)


def test_s16_a_failed_enrolment_removes_the_keys_and_ca_it_made_and_writes_no_env(tmp_path, monkeypatch):
    """A fresh host, a code naming a broker nothing listens on: refused as unreachable, and the
    host is as before (the next try starts clean)."""
    for name in ("MAM_ENV_FILE", "MQTT_BROKER", "MQTT_PORT", "MQTT_USERNAME", "MQTT_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MAM_CONNECT_TIMEOUT_S", "1")
    host = tmp_path / "fresh"
    (host / ".git").mkdir(parents=True)
    hint = invite.BrokerHint(("127.0.0.1",), 1, True, "python/mqtt", CA_PEM)
    code = InviteCode.new("gpu-box").with_broker(hint)
    with pytest.raises(MamError):
        enrolinvite.enroll_by_invite(code.text, workspace=host, timeout_s=1.0)
    assert keyfiles.load_runner_keys(host) is None
    assert not (names.mam_dir(host) / enrolinvite.CA_FILE_NAME).exists()
    assert not (host / ".mam.env").exists() and not names.runner_identity_path(host).exists()
