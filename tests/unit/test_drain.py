"""PROTOCOL §7 "Drain from the hub": the signed, retained order on `ROOT/runners/<session>/drain`
(its wire rules, v2 for an enrolled session and v1 otherwise), and the runner over the in-memory
fake broker: a drained runner shows `draining`, a dispatch waits, running jobs go on; an undrain
takes it back, the waiting dispatch first; a retained order holds at start (never `online`
first); forged, foreign, older and malformed orders change nothing."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from harness.fake_mqtt import FakeBroker
from harness.fakerunner import presence_statuses, serve_runner
from harness.waiting import wait_until
from harness.workspace import TEST_SECRET

from mam.orchestrator.hub import open_hub
from mam.orchestrator.identity import roster
from mam.orchestrator.identity.drain import drain_order, order_drain
from mam.runner.service import Runner
from mam.runner.trust import V1Trust, V2Trust
from mam.shared.config import BrokerConfig, write_env_file
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.crypto import pubkey
from mam.shared.protocol.crypto.keys import EnrolRequest, RunnerKeys
from mam.shared.protocol.errors import DecodeError, SignatureError, UsageError
from mam.shared.store import keyfiles

pytestmark = pytest.mark.timeout(60)

SESSION = "gpu-box"
ROOT = "unit/mam"
CONFIG = BrokerConfig(hosts=("fake-broker",), topic_root=ROOT)
HUB = Ed25519PrivateKey.generate()
RUNNER = RunnerKeys(Ed25519PrivateKey.generate(), X25519PrivateKey.generate())
TRUST = V2Trust(runner=RUNNER, hub_keys=(HUB.public_key(),))
TOPIC = names.drain_topic(SESSION, ROOT)


def order_of(draining: bool, *, at: str = "2026-12-05T06:00:00Z", signer: Ed25519PrivateKey = HUB,
             session: str = SESSION, reason: str = "disk full") -> bytes:
    return wire.encode(pubkey.sign(wire.Drain.build(session, draining, reason, issued_at=at), signer))


# ------------------------------------------------------------ the wire


def test_s7_an_order_round_trips_v2_and_v1():
    decoded = wire.decode(order_of(True), "drain")
    assert (decoded.session, decoded.draining, decoded.reason, decoded.sig_alg) == (SESSION, True, "disk full",
                                                                                    "ed25519")
    TRUST.verify_from_hub(decoded)
    v1 = crypto.derive_keys(TEST_SECRET)
    signed = crypto.sign(wire.Drain.build(SESSION, False).to_dict(), v1.sign_key)
    V1Trust(v1).verify_from_hub(wire.decode(wire.encode(signed), "drain"))
    assert names.drain_topic(SESSION, ROOT) == f"{ROOT}/runners/{SESSION}/drain"


@pytest.mark.parametrize(("change", "reason"), [
    (lambda m: m.update(draining="yes"), "draining must be true or false"),
    (lambda m: m.update(draining=1), "draining must be true or false"),
    (lambda m: m.pop("issued_at"), "missing field 'issued_at'"),
    (lambda m: m.update(session="../etc"), "session"),
    (lambda m: m.update(reason="x" * 300), "reason"),
    (lambda m: m.update(reason="a\x1b[31mb"), "control character"),
    (lambda m: m.update(extra="x"), "unknown field 'extra'"),
    (lambda m: m.update(kind="revoked"), "kind"),
    (lambda m: m.update(sig=None), "sig must be a string"),
])
def test_s7_malformed_orders_are_refused(change, reason):
    message = json.loads(order_of(True))
    change(message)
    with pytest.raises(DecodeError, match=reason):
        wire.decode(json.dumps(message), "drain")


def test_s7_an_oversized_order_is_refused_before_parsing():
    with pytest.raises(DecodeError, match="malformed"):
        wire.decode(b'{"pad": "' + b"x" * (2 * wire.MAX_MESSAGE_BYTES) + b'"}', "drain")


def test_s7_only_a_trusted_hub_key_signs_an_order():
    for forger in (RUNNER.ed25519, Ed25519PrivateKey.generate()):
        with pytest.raises(SignatureError):
            TRUST.verify_from_hub(wire.decode(order_of(True, signer=forger), "drain"))


# ------------------------------------------------------------ the hub's side


def test_s7_the_hub_signs_v2_for_an_enrolled_runner_v1_otherwise_and_refuses_a_revoked_one(tmp_path):
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET, "MAM_TOPIC_ROOT": ROOT})
    hub = open_hub(tmp_path)
    v1 = wire.decode(drain_order(hub, "cpu-box", draining=True), "drain")
    assert v1.sig_alg is None
    crypto.verify(v1, hub.keys().sign_key)
    roster.add(tmp_path, EnrolRequest.build(SESSION, "x", RUNNER.ed25519_public, RUNNER.x25519_public))
    v2 = wire.decode(drain_order(hub, SESSION, draining=False, reason="back"), "drain")
    pubkey.verify(v2, [keyfiles.hub_key(tmp_path).public_key()])
    assert (v2.draining, v2.reason) == (False, "back")
    roster.revoke(tmp_path, SESSION)
    with pytest.raises(UsageError, match="was revoked at"):
        drain_order(hub, SESSION, draining=True)
    for bad, said in (("../x", "session name"), ("gpu-box\n", "session name")):
        with pytest.raises(UsageError, match=said):
            drain_order(hub, bad, draining=True)
    with pytest.raises(UsageError, match="at most 256 characters"):
        drain_order(hub, "cpu-box", draining=True, reason="r" * 300)


def test_s7_order_drain_publishes_retained_on_the_given_connection(tmp_path):
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET, "MAM_TOPIC_ROOT": ROOT})
    broker = FakeBroker()
    line = order_drain(open_hub(tmp_path), "cpu-box", draining=True, client=broker.client(CONFIG).connect())
    assert "runner cpu-box drained" in line and "mam-orch runner undrain cpu-box" in line
    assert wire.decode(broker.retained[names.drain_topic("cpu-box", ROOT)], "drain").draining is True


# ------------------------------------------------------------ the runner


def serve(broker: FakeBroker, root: Path) -> tuple[Runner, list[int], threading.Thread]:
    return serve_runner(broker, root, config=CONFIG, trust=TRUST, session=SESSION)


def presences(broker: FakeBroker) -> list[str]:
    return presence_statuses(broker, SESSION, ROOT)


def test_s7_drain_then_undrain_a_live_runner(tmp_path, caplog):
    broker = FakeBroker()
    caplog.set_level(logging.INFO, "mam.daemon")
    runner, result, thread = serve(broker, tmp_path / "ws")
    try:
        wait_until(lambda: "online" in presences(broker), 5.0, "presence online")
        hub = broker.client(CONFIG).connect()
        hub.publish(TOPIC, order_of(True), retain=True)
        wait_until(lambda: presences(broker)[-1] == "draining", 5.0, "draining")
        assert runner.held and not runner.draining and thread.is_alive()
        assert f"runner {SESSION} drained by the hub at 2026-12-05T06:00:00Z (disk full)" in caplog.text
        assert runner.admission_state().held
        hub.publish(TOPIC, order_of(True, at="2026-12-05T05:00:00Z"), retain=True)  # older: ignored
        hub.publish(TOPIC, order_of(False, at="2026-12-05T05:30:00Z"), retain=True)  # older: ignored
        wait_until(lambda: caplog.text.count("ignored drain order") == 2, 5.0, "two older orders ignored")
        assert runner.held
        hub.publish(TOPIC, order_of(False, at="2026-12-05T06:01:00Z", reason=""), retain=True)
        wait_until(lambda: presences(broker)[-1] == "online", 5.0, "online again")
        assert not runner.held and "undrained by the hub at 2026-12-05T06:01:00Z" in caplog.text
    finally:
        runner.shutdown(timeout_s=5.0)
        thread.join(5.0)
    assert result == [0]


def test_s7_a_retained_order_holds_at_start_and_online_is_never_announced(tmp_path):
    broker = FakeBroker()
    broker.retained[TOPIC] = order_of(True)
    runner, result, thread = serve(broker, tmp_path / "ws")
    try:
        wait_until(lambda: presences(broker), 5.0, "a presence")
        assert presences(broker)[0] == "draining" and runner.held
    finally:
        runner.shutdown(timeout_s=5.0)
        thread.join(5.0)
    assert "online" not in presences(broker)


def test_s7_forged_foreign_and_malformed_orders_change_nothing(tmp_path, caplog):
    broker = FakeBroker()
    caplog.set_level(logging.WARNING, "mam.daemon")
    runner, result, thread = serve(broker, tmp_path / "ws")
    try:
        wait_until(lambda: "online" in presences(broker), 5.0, "presence online")
        hub = broker.client(CONFIG).connect()
        hub.publish(TOPIC, order_of(True, signer=RUNNER.ed25519), retain=True)
        hub.publish(TOPIC, b"{not json", retain=True)
        hub.publish(TOPIC, b"x" * (2 * wire.MAX_MESSAGE_BYTES), retain=True)
        hub.publish(TOPIC, order_of(True, session="other-box"), retain=True)
        wait_until(lambda: caplog.text.count("refused drain order") == 4, 5.0, "four refusals")
        assert not runner.held and presences(broker)[-1] == "online" and thread.is_alive()
    finally:
        runner.shutdown(timeout_s=5.0)
        thread.join(5.0)
    assert result == [0]
