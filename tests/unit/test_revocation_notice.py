"""PROTOCOL §16.7, the runner hears its revocation: the hub's signed, retained notice on
`ROOT/runners/<session>/revoked` (its wire rules), the runner's check (a trusted hub key,
its own enrolment), and the daemon over the in-memory fake broker: a verified notice
stops it with exit 77, `--on-revoke finish` lets a job end first, and a forged one
changes nothing. `runner revoke`'s side (`notice.tell_revoked`) over the same broker."""

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

from mam.orchestrator.identity import notice, roster
from mam.runner.service import Runner
from mam.runner.settings import RunnerOptions, options_from_cli
from mam.runner.trust import V1Trust, V2Trust
from mam.shared.config import BrokerConfig, write_env_file
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.crypto import keys, pubkey
from mam.shared.protocol.crypto.keys import EnrolRequest, RunnerKeys
from mam.shared.protocol.errors import DecodeError, ExitCode, SignatureError, UsageError
from mam.shared.store import keyfiles

pytestmark = pytest.mark.timeout(60)

SESSION = "gpu-box"
ROOT = "unit/mam"
CONFIG = BrokerConfig(hosts=("fake-broker",), topic_root=ROOT)
HUB = Ed25519PrivateKey.generate()
RUNNER = RunnerKeys(Ed25519PrivateKey.generate(), X25519PrivateKey.generate())
TRUST = V2Trust(runner=RUNNER, hub_keys=(HUB.public_key(),))
REVOKED_AT = "2026-12-05T03:00:00Z"
TOPIC = names.revoked_topic(SESSION, ROOT)


def notice_of(*, signer: Ed25519PrivateKey = HUB, runner_key: str | None = None, session: str = SESSION) -> bytes:
    unsigned = wire.Revocation.build(session, runner_key or RUNNER.ed25519_public, REVOKED_AT)
    return wire.encode(pubkey.sign(unsigned, signer))


# ------------------------------------------------------------ the wire (§16.7)


def test_s16_7_a_notice_round_trips_and_names_the_revoked_key():
    decoded = wire.decode(notice_of(), "revoked")
    assert (decoded.session, decoded.runner_key, decoded.revoked_at, decoded.sig_alg) == (
        SESSION, RUNNER.ed25519_public, REVOKED_AT, "ed25519")
    assert names.revoked_topic(SESSION, ROOT) == f"{ROOT}/runners/{SESSION}/revoked"


@pytest.mark.parametrize(("change", "reason"), [
    (lambda m: m.pop("sig_alg"), "missing field 'sig_alg'"),
    (lambda m: m.update(sig="ab" * 32, sig_alg="hmac"), "sig_alg"),
    (lambda m: m.update(runner_key="AAAA"), "runner_key decodes to 3 bytes"),
    (lambda m: m.update(session="../etc"), "session"),
    (lambda m: m.update(revoked_at="yesterday"), "revoked_at"),
    (lambda m: m.update(extra="x"), "unknown field 'extra'"),
    (lambda m: m.update(kind="control"), "kind"),
])
def test_s16_7_malformed_notices_are_refused(change, reason):
    message = json.loads(notice_of())
    change(message)
    with pytest.raises(DecodeError, match=reason):
        wire.decode(json.dumps(message), "revoked")


def test_s16_7_an_oversized_notice_is_refused_before_parsing():
    with pytest.raises(DecodeError, match="malformed"):
        wire.decode(b'{"pad": "' + b"x" * (2 * wire.MAX_MESSAGE_BYTES) + b'"}', "revoked")


def test_s16_7_an_unrevoked_entry_has_no_notice(tmp_path):
    made = keyfiles.create_runner_keys(tmp_path / "runner")
    entry, _ = roster.add(tmp_path, EnrolRequest.build(SESSION, "x", made.ed25519_public, made.x25519_public))
    with pytest.raises(UsageError, match="not revoked"):
        roster.revocation_notice(tmp_path, entry)


# ------------------------------------------------------------ the runner's check


def test_s16_7_the_runner_takes_only_a_trusted_hub_notice_of_its_own_key():
    assert TRUST.verify_revocation(wire.decode(notice_of(), "revoked")) == keys.public_text(HUB)
    older = RunnerKeys(Ed25519PrivateKey.generate(), X25519PrivateKey.generate()).ed25519_public
    with pytest.raises(SignatureError, match="another enrolment"):
        TRUST.verify_revocation(wire.decode(notice_of(runner_key=older), "revoked"))
    for forger in (RUNNER.ed25519, Ed25519PrivateKey.generate()):  # its own key, or a stranger's
        with pytest.raises(SignatureError, match="not signed by a trusted hub key"):
            TRUST.verify_revocation(wire.decode(notice_of(signer=forger), "revoked"))
    with pytest.raises(SignatureError, match="v1"):
        V1Trust(crypto.derive_keys("unit-test-dispatch-secret-0123456789abcdef")).verify_revocation(
            wire.decode(notice_of(), "revoked"))


def test_s16_7_on_revoke_is_stop_or_finish(tmp_path):
    common = {"session": SESSION, "exec_cmd": "true", "workspace": str(tmp_path), "workdir": None, "max_jobs": 1,
              "once": False, "replace": False, "environ": {"PATH": "/usr/bin:/bin"}}
    assert options_from_cli(**common).on_revoke == "stop"
    assert options_from_cli(**common, on_revoke="finish").on_revoke == "finish"
    with pytest.raises(UsageError, match="--on-revoke 'later' is invalid: expected stop or finish"):
        options_from_cli(**common, on_revoke="later")


# ------------------------------------------------------------ the daemon over the fake broker


def serve(broker: FakeBroker, root: Path, **options: object) -> tuple[Runner, list[int], threading.Thread]:
    return serve_runner(broker, root, config=CONFIG, trust=TRUST, session=SESSION, **options)


def presences(broker: FakeBroker) -> list[str]:
    return presence_statuses(broker, SESSION, ROOT)


def test_s16_7_a_retained_notice_at_start_exits_77(tmp_path, caplog):
    broker = FakeBroker()
    broker.retained[TOPIC] = notice_of()
    caplog.set_level(logging.ERROR, "mam.daemon")
    runner, result, thread = serve(broker, tmp_path / "ws")
    thread.join(10.0)
    assert not thread.is_alive() and result == [ExitCode.REVOKED] == [77]
    assert presences(broker)[-1] == "offline"
    assert f"runner {SESSION} revoked by the hub (key {keys.public_text(HUB)[:12]}) at {REVOKED_AT}" in caplog.text


def test_s16_7_a_live_notice_stops_the_running_job_or_lets_it_finish(tmp_path):
    for on_revoke, cancelled in (("stop", True), ("finish", False)):
        broker = FakeBroker()
        runner, result, thread = serve(broker, tmp_path / on_revoke, on_revoke=on_revoke)
        wait_until(lambda b=broker: "online" in presences(b), 5.0, "presence online")
        asked: list[str] = []
        runner._cancel_all = asked.append  # type: ignore[method-assign]  # no agent here: record the ask
        with runner._jobs_lock:
            runner._jobs["918b0612"] = object()  # type: ignore[assignment]  # one job "running"
        broker.client(CONFIG).connect().publish(TOPIC, notice_of(), retain=True)
        wait_until(lambda b=broker: "draining" in presences(b), 5.0, "draining")
        assert runner.revoked is not None and thread.is_alive()
        assert (asked[:1] == ["runner_revoked"]) is cancelled, asked
        with runner._jobs_lock:
            runner._jobs.clear()  # the job ended
        thread.join(10.0)
        assert result == [77]


def test_s16_7_a_forged_or_foreign_notice_changes_nothing(tmp_path, caplog):
    broker = FakeBroker()
    caplog.set_level(logging.WARNING, "mam.daemon")
    runner, result, thread = serve(broker, tmp_path / "ws")
    try:
        wait_until(lambda: "online" in presences(broker), 5.0, "presence online")
        hub = broker.client(CONFIG).connect()
        hub.publish(TOPIC, notice_of(signer=RUNNER.ed25519), retain=True)
        hub.publish(TOPIC, b"{not json", retain=True)
        hub.publish(TOPIC, notice_of(session="other-box"), retain=True)
        wait_until(lambda: caplog.text.count("refused revocation notice") == 3, 5.0, "three refusals")
        assert runner.revoked is None and not runner.draining and thread.is_alive()
    finally:
        runner.shutdown(timeout_s=5.0)
        thread.join(5.0)
    assert result == [0]


# ------------------------------------------------------------ `mam-orch runner revoke`'s side


def enrolled_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broker_line: bool) -> Path:
    for name in ("MQTT_BROKER", "MAM_TOPIC_ROOT"):
        monkeypatch.delenv(name, raising=False)
    hub = tmp_path / "hub"
    hub.mkdir(parents=True)
    values = {"MQTT_BROKER": "127.0.0.1", "MAM_TOPIC_ROOT": ROOT} if broker_line else {"MAM_TOPIC_ROOT": ROOT}
    write_env_file(hub / ".mam.env", values)
    keyfiles.hub_key(hub)
    roster.add(hub, EnrolRequest.build(SESSION, "x", RUNNER.ed25519_public, RUNNER.x25519_public))
    return hub


def test_s16_7_revoke_tells_a_live_runner_and_sees_it_heard(tmp_path, monkeypatch):
    hub = enrolled_hub(tmp_path, monkeypatch, broker_line=True)
    broker = FakeBroker()
    trust = V2Trust(runner=RUNNER, hub_keys=(keyfiles.hub_key(hub).public_key(),))
    opts = RunnerOptions(session=SESSION, argv=("true",), root=tmp_path / "ws", presence_wait_s=0.05)
    runner = Runner(opts, config=CONFIG, trust=trust, transport=broker.client)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(runner.serve()), daemon=True)
    thread.start()
    wait_until(lambda: "online" in presences(broker), 5.0, "presence online")
    entry = roster.revoke(hub, SESSION)
    lines = notice.tell_revoked(hub, entry, transport=broker.client)
    assert lines == [f"told runner {SESSION}: it heard and is offline"]
    thread.join(10.0)
    assert result == [77] and wire.decode(broker.retained[TOPIC], "revoked").revoked_at == entry.revoked_at
    assert notice.tell_revoked(hub, entry, transport=broker.client) == [
        f"told runner {SESSION} (it is not online: it hears it at its next start and exits)"]


def test_s16_7_revoke_without_a_broker_says_the_runner_was_not_told(tmp_path, monkeypatch):
    hub = enrolled_hub(tmp_path, monkeypatch, broker_line=False)
    entry = roster.revoke(hub, SESSION)
    (line,) = notice.tell_revoked(hub, entry, transport=FakeBroker().client)
    assert line.startswith(f"runner {SESSION} was not told: no broker is configured (MQTT_BROKER)")
    down = FakeBroker(down=True)
    enrolled = enrolled_hub(tmp_path / "2", monkeypatch, broker_line=True)
    (line,) = notice.tell_revoked(enrolled, roster.revoke(enrolled, SESSION), transport=down.client)
    assert "was not told" in line and "again sends it" in line and down.published == []
