"""PROTOCOL §16: key files (hub, runner, trusted hub keys), the enrolment request,
the hub's roster, and the `mam-orch runner ...` / `mam-runner enroll|trust-hub` commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from mam.orchestrator import control, runners
from mam.orchestrator.identity import roster
from mam.runner import enrol
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.crypto import keys, pubkey
from mam.shared.protocol.crypto.keys import EnrolRequest
from mam.shared.protocol.errors import ConfigError, RegistryError, SignatureError, UsageError
from mam.shared.store import keyfiles

pytestmark = pytest.mark.timeout(120)


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def request(session: str = "gpu-box", labels: str = "gpu") -> EnrolRequest:
    return EnrolRequest.build(session, labels, keys.public_text(Ed25519PrivateKey.generate()),
                              keys.public_text(X25519PrivateKey.generate()))


# ------------------------------------------------------------------ key files

def test_s16_hub_key_made_once_0600_in_0700_folder(tmp_path):
    first = keyfiles.hub_key(tmp_path)
    path = names.hub_key_path(tmp_path)
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert keys.public_text(keyfiles.hub_key(tmp_path)) == keys.public_text(first)
    assert len(keys.b64url_decode(path.read_text().strip())) == 32  # raw 32 bytes, base64url, one line


def test_s16_missing_hub_key_without_create_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no such key file"):
        keyfiles.hub_key(tmp_path, create=False)


def test_s16_private_key_open_to_others_refused(tmp_path):
    keyfiles.hub_key(tmp_path)
    path = names.hub_key_path(tmp_path)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600") as info:
        keyfiles.hub_key(tmp_path)
    assert path.read_text().strip() not in str(info.value)


@pytest.mark.parametrize("content", ["", "not base64!", "AAAA", "A" * 5000, "\xff"])
def test_s16_broken_key_file_refused_without_echo(tmp_path, content):
    path = names.hub_key_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(content, encoding="latin-1")
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError) as info:
        keyfiles.hub_key(tmp_path)
    message = str(info.value)
    assert "\n" not in message and (not content.strip() or content[:40] not in message)


def test_s16_staged_rotation_keeps_previous(tmp_path):
    old = keys.public_text(keyfiles.hub_key(tmp_path))
    staged = keyfiles.stage_hub_key(tmp_path)
    assert keyfiles.stage_hub_key(tmp_path) == staged == keyfiles.staged_hub_public(tmp_path)
    assert keys.public_text(keyfiles.hub_key(tmp_path)) == old  # staging does not switch
    new, previous = keyfiles.rotate_hub_key(tmp_path)
    assert keys.public_text(new) == staged and previous == old
    assert keyfiles.hub_previous_public(tmp_path) == old and keyfiles.staged_hub_public(tmp_path) is None
    assert keys.public_text(keyfiles.hub_key(tmp_path)) == staged
    fresh, previous = keyfiles.rotate_hub_key(tmp_path)  # unstaged: a fresh key
    assert previous == staged and keys.public_text(fresh) not in (old, staged)


def test_s16_rotate_without_hub_key_refused(tmp_path):
    with pytest.raises(ConfigError, match="no such key file"):
        keyfiles.rotate_hub_key(tmp_path)


def test_s16_runner_keys_made_once_and_hidden(tmp_path):
    assert keyfiles.load_runner_keys(tmp_path) is None
    made = keyfiles.create_runner_keys(tmp_path)
    for kind in ("ed25519", "x25519"):
        assert mode(names.runner_key_path(tmp_path, kind)) == 0o600
    loaded = keyfiles.load_runner_keys(tmp_path)
    assert loaded is not None and repr(loaded) == repr(made)
    private = names.runner_key_path(tmp_path, "ed25519").read_text().strip()
    assert private not in repr(made) and made.ed25519_public in repr(made)
    with pytest.raises(ConfigError, match="already exists; use --force"):
        keyfiles.create_runner_keys(tmp_path)
    assert keyfiles.create_runner_keys(tmp_path, force=True).ed25519_public != made.ed25519_public


def test_s16_one_runner_key_missing_refused(tmp_path):
    keyfiles.create_runner_keys(tmp_path)
    names.runner_key_path(tmp_path, "x25519").unlink()
    with pytest.raises(ConfigError, match="no such key file"):
        keyfiles.load_runner_keys(tmp_path)


def test_s16_trusted_hub_keys(tmp_path):
    assert keyfiles.trusted_hub_keys(tmp_path) == ()
    one, two = (keys.public_text(Ed25519PrivateKey.generate()) for _ in range(2))
    assert keyfiles.write_trusted_hub_keys(tmp_path, [one, two, one]) == [one, two]
    assert keys.texts(keyfiles.trusted_hub_keys(tmp_path)) == [one, two]
    for bad in ([], [one, two, keys.public_text(Ed25519PrivateKey.generate())], ["nope"], [one[:-4]]):
        with pytest.raises(UsageError):
            keyfiles.write_trusted_hub_keys(tmp_path, bad)
    assert keys.texts(keyfiles.trusted_hub_keys(tmp_path)) == [one, two]  # unchanged by the refusals


# ------------------------------------------------------------ enrol request

def test_s16_enrol_request_round_trip_one_line():
    made = request(labels="linux,gpu")
    line = made.line()
    assert "\n" not in line and EnrolRequest.parse(line) == made and made.labels == ("gpu", "linux")
    with pytest.raises(UsageError, match="listed twice"):  # one label rule for run, dispatch and enroll (§14)
        request(labels="linux,gpu,gpu")


@pytest.mark.parametrize("text", [
    "", "not json", "[]", json.dumps({"kind": "enrol_request"}),
    json.dumps({**request().to_dict(), "extra": 1}),
    json.dumps({**request().to_dict(), "kind": "other"}),
    json.dumps({**request().to_dict(), "session": "gpu.box"}),
    json.dumps({**request().to_dict(), "labels": ["GPU"]}),
    json.dumps({**request().to_dict(), "labels": "gpu"}),
    json.dumps({**request().to_dict(), "ed25519_public": "AAAA"}),
    json.dumps({**request().to_dict(), "x25519_public": None}),
    "x" * 5000,
])
def test_s16_bad_enrol_request_refused_with_one_line(text):
    with pytest.raises(UsageError) as info:
        EnrolRequest.parse(text)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------- roster

def test_s16_roster_add_get_list_revoke(tmp_path):
    made = request()
    entry, what = roster.add(tmp_path, made)
    assert what == "enrolled" and entry.active and entry.labels == ("gpu",)
    path = names.roster_path(tmp_path, "gpu-box")
    assert mode(path) == 0o600
    assert set(json.loads(path.read_text())) == {"session", "labels", "ed25519_public", "x25519_public",
                                                 "enrolled_at", "revoked_at"}
    assert roster.add(tmp_path, made) == (entry, "unchanged")
    relabelled = EnrolRequest.build("gpu-box", "gpu,big", made.ed25519_public, made.x25519_public)
    assert roster.add(tmp_path, relabelled)[1] == "updated"
    assert roster.get(tmp_path, "gpu-box").labels == ("big", "gpu")
    assert [e.session for e in roster.entries(tmp_path)] == ["gpu-box"]
    revoked = roster.revoke(tmp_path, "gpu-box")
    assert not revoked.active and roster.revoke(tmp_path, "gpu-box") == revoked
    assert not roster.get(tmp_path, "gpu-box").active
    with pytest.raises(UsageError, match="was revoked with these keys"):
        roster.add(tmp_path, relabelled)
    assert roster.add(tmp_path, request())[1] == "re-enrolled"


def test_s16_roster_other_keys_need_replace(tmp_path):
    roster.add(tmp_path, request())
    other = request()
    with pytest.raises(UsageError, match="--replace"):
        roster.add(tmp_path, other)
    entry, what = roster.add(tmp_path, other, replace_keys=True)
    assert what == "replaced" and entry.ed25519_public == other.ed25519_public


def test_s16_roster_unknown_and_corrupt(tmp_path):
    assert roster.get(tmp_path, "nobody") is None and roster.entries(tmp_path) == []
    with pytest.raises(RegistryError, match="not enrolled"):
        roster.revoke(tmp_path, "nobody")
    roster.add(tmp_path, request())
    names.roster_path(tmp_path, "gpu-box").write_text('{"session": "gpu-box"}')
    with pytest.raises(RegistryError, match="not a roster entry"):
        roster.get(tmp_path, "gpu-box")
    names.roster_path(tmp_path, "gpu-box").write_text("{")
    with pytest.raises(RegistryError, match="cannot read"):
        roster.entries(tmp_path)


# ------------------------------------------------------------------ commands

def cli(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MQTT_", "MAM_"))}
    return subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def test_s16_enrol_add_trust_commands_end_to_end(tmp_path):
    hub, runner = tmp_path / "hub", tmp_path / "runner"
    hub.mkdir()
    runner.mkdir()
    made = cli("mam.runner", "enroll", "--session", "gpu-box", "--labels", "gpu", "--workspace", str(runner),
               cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    line = made.stdout.strip()
    assert "\n" not in line and EnrolRequest.parse(line).session == "gpu-box"
    for kind in ("ed25519", "x25519"):  # no private key in any output
        private = names.runner_key_path(runner, kind).read_text().strip()
        assert private not in made.stdout + made.stderr
    again = cli("mam.runner", "enroll", "--session", "gpu-box", "--workspace", str(runner), cwd=tmp_path)
    assert again.returncode == 64 and "--force" in again.stderr and again.stdout == ""

    added = cli("mam.orchestrator.cli", "runner", "add", line, "--json", "--workspace", str(hub), cwd=tmp_path)
    assert added.returncode == 0, added.stderr
    shown = json.loads(added.stdout)
    hub_public = keys.public_text(keyfiles.hub_key(hub, create=False))
    assert shown["hub_ed25519_public"] == [hub_public] and shown["result"] == "enrolled"
    assert names.hub_key_path(hub).read_text().strip() not in added.stdout + added.stderr

    # `--`: a base64url key may start with '-' (1 in 64), as the printed command says
    assert f"mam-runner trust-hub -- {hub_public}" in cli("mam.orchestrator.cli", "runner", "add", line,
                                                          "--workspace", str(hub), cwd=tmp_path).stdout
    trusted = cli("mam.runner", "trust-hub", "--workspace", str(runner), "--", hub_public, cwd=tmp_path)
    assert trusted.returncode == 0, trusted.stderr
    assert keys.texts(keyfiles.trusted_hub_keys(runner)) == [hub_public]

    listed = cli("mam.orchestrator.cli", "runner", "list", "--json", "--workspace", str(hub), cwd=tmp_path)
    assert json.loads(listed.stdout)["status"] == "enrolled"
    revoked = cli("mam.orchestrator.cli", "runner", "revoke", "gpu-box", "--json", "--workspace", str(hub),
                  cwd=tmp_path)
    assert revoked.returncode == 0, revoked.stderr
    said = json.loads(revoked.stdout)
    assert (said["session"], said["result"]) == ("gpu-box", "revoked") and said["revoked_at"]
    again = cli("mam.orchestrator.cli", "runner", "revoke", "gpu-box", "--workspace", str(hub), cwd=tmp_path)
    assert again.returncode == 0 and "revoked runner gpu-box" in again.stdout
    unknown = cli("mam.orchestrator.cli", "runner", "revoke", "nobody", "--workspace", str(hub), cwd=tmp_path)
    assert unknown.returncode == 1 and len(unknown.stderr.strip().splitlines()) == 1


def test_s16_runner_add_bad_request_exit_64(tmp_path):
    result = cli("mam.orchestrator.cli", "runner", "add", "{not json", "--workspace", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 64 and "enrolment request is invalid" in result.stderr
    assert not names.roster_dir(tmp_path).exists()


def test_s16_rotate_hub_key_command_stage_then_switch(tmp_path):
    old = keys.public_text(keyfiles.hub_key(tmp_path))
    staged = cli("mam.orchestrator.cli", "runner", "rotate-hub-key", "--stage", "--workspace", str(tmp_path),
                 cwd=tmp_path)
    assert staged.returncode == 0, staged.stderr
    new = keyfiles.staged_hub_public(tmp_path)
    assert f"mam-runner trust-hub -- {old} {new}" in staged.stdout
    switched = cli("mam.orchestrator.cli", "runner", "rotate-hub-key", "--json", "--workspace", str(tmp_path),
                   cwd=tmp_path)
    assert switched.returncode == 0 and keys.public_text(keyfiles.hub_key(tmp_path)) == new
    assert keyfiles.hub_previous_public(tmp_path) == old
    assert json.loads(switched.stdout) == {"result": "rotated", "current": new, "previous": old}
    staged_json = cli("mam.orchestrator.cli", "runner", "rotate-hub-key", "--stage", "--json", "--workspace",
                      str(tmp_path), cwd=tmp_path)
    assert json.loads(staged_json.stdout) == {"result": "staged", "current": new,
                                              "next": keyfiles.staged_hub_public(tmp_path)}


def test_s16_enrol_identity_recorded(tmp_path):
    made = enrol.enroll(session="gpu-box", labels="gpu", workspace=tmp_path)
    assert enrol.identity(tmp_path) == made
    with pytest.raises(UsageError):
        enrol.enroll(session="bad.name", labels=None, workspace=tmp_path / "other")


# ------------------------------------------------------------- hub hooks

def _presence(session: str = "gpu-box") -> dict:
    return wire.Presence.build(session, "f" * 32, "online", host="h", version="0.1.0", max_jobs=1).to_dict()


def test_s16_hub_checks_presence_against_the_roster(tmp_path):
    v1 = crypto.derive_keys("x" * 40)
    runner_key = Ed25519PrivateKey.generate()
    made = EnrolRequest.build("gpu-box", "", keys.public_text(runner_key),
                              keys.public_text(X25519PrivateKey.generate()))
    topic_root = "python/mqtt"
    topic = names.presence_topic("gpu-box", topic_root)

    def check(signed: dict) -> dict:
        return runners.verify_presence(topic, wire.encode(signed), v1, topic_root, roster_root=tmp_path)

    assert check(crypto.sign(_presence(), v1.sign_key))["status"] == "online"  # not enrolled: v1 as before
    with pytest.raises(SignatureError, match="not enrolled"):
        check(pubkey.sign_presence(_presence(), runner_key))
    roster.add(tmp_path, made)
    assert check(pubkey.sign_presence(_presence(), runner_key))["session"] == "gpu-box"
    with pytest.raises(SignatureError, match="v2 only"):
        check(crypto.sign(_presence(), v1.sign_key))  # the v1 secret no longer speaks for an enrolled runner
    with pytest.raises(SignatureError, match="enrolled key"):
        check(pubkey.sign_presence(_presence(), Ed25519PrivateKey.generate()))  # runner A posing as B
    roster.revoke(tmp_path, "gpu-box")
    with pytest.raises(SignatureError, match="revoked"):
        check(pubkey.sign_presence(_presence(), runner_key))


def test_s16_hub_builds_v2_for_enrolled_sessions_only(tmp_path, caplog):
    hub = keyfiles.hub_key(tmp_path)
    runner_x = X25519PrivateKey.generate()
    record = {"job_id": "918b0612", "session": "gpu-box", "attempt_id": 1, "dispatch_token": "a" * 32,
              "auth_token": "tok", **wire.Contract().to_dict()}
    with caplog.at_level("WARNING", logger="mam.roster"):
        assert roster.build_dispatch_v2(tmp_path, {**record, "session": "v1-box"}, "b", origin="h") is None
        assert roster.build_dispatch_v2(tmp_path, {**record, "session": "v1-box"}, "b", origin="h") is None
    assert len([r for r in caplog.records if "v1-box" in r.getMessage()]) == 1  # warned once per session
    roster.add(tmp_path, EnrolRequest.build("gpu-box", "", keys.public_text(Ed25519PrivateKey.generate()),
                                            keys.public_text(runner_x)))
    signed = roster.build_dispatch_v2(tmp_path, record, "brief", origin="h")
    assert signed is not None
    dispatch = wire.decode(wire.encode(signed), "dispatch")
    pubkey.verify(dispatch, [hub.public_key()])
    assert pubkey.open_sealed(runner_x, dispatch.sealed, job_id="918b0612", attempt_id=1,
                              dispatch_token="a" * 32) == ("tok", "brief")
    control = wire.Control.cancel("918b0612", 1, "operator")
    assert roster.sign_control_v2(tmp_path, "v1-box", control) is None
    pubkey.verify(roster.sign_control_v2(tmp_path, "gpu-box", control), [hub.public_key()])
    roster.revoke(tmp_path, "gpu-box")
    with pytest.raises(UsageError, match="revoked"):
        roster.build_dispatch_v2(tmp_path, record, "brief", origin="h", hub_key=hub)
    assert roster.sign_control_v2(tmp_path, "gpu-box", control) is not None  # its jobs are still cancelled


class _Recorder:
    """The two things `publish_cancel` uses of a client: its topic root and `publish`."""

    def __init__(self) -> None:
        self.config = type("Config", (), {"topic_root": "python/mqtt"})()
        self.published: list[tuple[str, bytes, bool]] = []

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.published.append((topic, payload, retain))


def test_s16_hub_cancel_is_v2_for_enrolled_sessions(tmp_path):
    v1 = crypto.derive_keys("x" * 40)
    hub = keyfiles.hub_key(tmp_path)
    roster.add(tmp_path, request())
    client = _Recorder()
    for session in ("gpu-box", "v1-box"):
        record = {"job_id": "918b0612", "attempt_id": 2, "session": session}
        control.publish_cancel(client, record, v1, "operator", tmp_path)  # type: ignore[arg-type]
    (topic, enrolled, retain), (_, other, _) = client.published
    assert retain and topic == names.control_topic("918b0612", "python/mqtt")
    pubkey.verify(wire.decode(enrolled, "control"), [hub.public_key()])
    decoded = wire.decode(other, "control")
    assert decoded.sig_alg is None
    crypto.verify(decoded, v1.sign_key)
