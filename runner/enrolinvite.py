"""`mam-runner enroll --invite CODE` (PROTOCOL §16, enrolment by invite): make (or reuse)
this host's keys, send their public parts to the hub's waiting `mam-orch runner invite`
over the broker under the code's MAC, check the hub's answer under the same MAC, then
store the hub's public keys (`hub-trusted.pub`, as `trust-hub` does) and the identity
(session, the labels the hub gave). A refusal or a wrong answer writes nothing but keys.
The code tells where the broker is (its broker part: hosts, port, TLS and its CA, topic
root), so a fresh host needs no `.mam.env` first; once enrolled, those settings are written
into the `.mam.env` the runner reads. When the answer carries this runner's own broker user
(the hub manages the broker), its password is opened with this host's X25519 key and
MQTT_USERNAME / MQTT_PASSWORD are set there too (one atomic write, 0600; the other lines
kept). A failure removes the keys and the CA file it made.
"""

from __future__ import annotations

import contextlib
import os
import queue
import time
from dataclasses import dataclass
from pathlib import Path

from mam.runner.enrol import trust_hub, write_env
from mam.shared import config
from mam.shared.protocol import names
from mam.shared.protocol.crypto import invite
from mam.shared.protocol.crypto.invite import InviteCode
from mam.shared.protocol.crypto.keys import EnrolRequest
from mam.shared.protocol.errors import ConfigError, ProtocolError, SignatureError, UsageError
from mam.shared.protocol.wire.jsoncodec import canonical_json
from mam.shared.store import keyfiles
from mam.shared.store.fsio import atomic_write, json_line
from mam.shared.store.root import resolve_root
from mam.shared.transport import mqtt

DEFAULT_ANSWER_TIMEOUT_S = 30.0
"""How long the runner waits for the hub's answer (s)."""
MAX_PORT = 65535
CA_FILE_NAME = "broker-ca.pem"
"""Where the code's CA certificates go, under `.mam/` (0600)."""

__all__ = ["DEFAULT_ANSWER_TIMEOUT_S", "Enrolled", "enroll_by_invite"]


@dataclass(frozen=True)
class Enrolled:
    """What `enroll_by_invite` stored: the identity, the hub keys now trusted, this runner's own
    broker user (None: the hub gave none; it keeps its broker user), the env file it wrote
    (None: none written) and the broker settings written there (names, no values)."""

    identity: EnrolRequest
    trusted: list[str]
    broker_user: str | None = None
    env_file: Path | None = None
    written: tuple[str, ...] = ()


def _broker(root: Path, hub: str | None, port: int | None, hint: invite.BrokerHint | None,
            created: list[Path]) -> config.BrokerConfig:
    """The broker to enrol over: `--hub`/`--port`, else the code's broker part, else `.mam.env`
    (§13). The code's CA certificates are written to `.mam/broker-ca.pem` (0600; added to
    `created`)."""
    if port is not None and not 1 <= port <= MAX_PORT:
        raise UsageError(f"--port {port} is invalid: expected 1..{MAX_PORT}")
    cfg = config.broker_config(workspace=root, warn=False)
    if hint is not None:
        ca_certs = cfg.ca_certs
        if hint.ca_pem:
            path = names.mam_dir(root) / CA_FILE_NAME
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            existed = path.exists()
            atomic_write(path, hint.ca_pem.encode("ascii"), what="the broker's CA", error=ConfigError)
            if not existed:
                created.append(path)
            ca_certs = str(path)
        cfg = cfg.with_overrides(hosts=hint.hosts, port=hint.port, tls=hint.tls, topic_root=hint.topic_root,
                                 ca_certs=ca_certs)
    return cfg.with_overrides(hosts=(hub,) if hub else cfg.hosts, port=port if port is not None else cfg.port)


def enroll_by_invite(code_text: str, *, workspace: str | os.PathLike[str] | None, session: str | None = None,
                     hub: str | None = None, port: int | None = None, force: bool = False,
                     timeout_s: float = DEFAULT_ANSWER_TIMEOUT_S, defaults: dict[str, str] | None = None) -> Enrolled:
    """Enrol this host with the hub's invite code (§16); on failure, remove what it created
    (keys it made, the CA file) and write nothing else.

    Args:
        code_text: the code `mam-orch runner invite` printed.
        session: if given, must be the code's session.
        hub, port: the broker (default: the code's broker part, else `.mam.env` / environment, §13).
        force: make new keys even if this host has some (default: reuse them).
        defaults: `run`'s defaults to write into `.mam.env` once enrolled (`enrol.run_defaults`).
    Returns:
        an `Enrolled`.
    Raises:
        UsageError: a bad code or option (nothing written); ProtocolError: the hub refused,
        or no answer within `timeout_s`; SignatureError: an answer not MAC'd with the code,
        or a broker password that does not open with this host's key (nothing written);
        BrokerUnavailable: the broker is unreachable; ConfigError: a file cannot be written.
    """
    code = InviteCode.parse(code_text)
    if session is not None and session != code.session:
        raise UsageError(f"--session {session!r} is not the invite's session {code.session!r}")
    if timeout_s <= 0:
        raise UsageError(f"--timeout {timeout_s:g} is invalid: expected more than 0 s")
    root = resolve_root(workspace)
    if not root.is_dir():
        raise UsageError(f"workspace {str(root)!r} does not exist")
    created: list[Path] = []
    try:
        return _enroll(root, code, hub, port, force, timeout_s, created, defaults or {})
    except BaseException:
        for path in reversed(created):  # nothing half-made is left: the next try starts clean
            with contextlib.suppress(OSError):
                path.unlink()
        raise


def _enroll(root: Path, code: InviteCode, hub: str | None, port: int | None, force: bool, timeout_s: float,
            created: list[Path], defaults: dict[str, str]) -> Enrolled:
    cfg = _broker(root, hub, port, code.broker, created)
    made = None if force else keyfiles.load_runner_keys(root)
    if made is None:
        fresh = [names.runner_key_path(root, kind) for kind in ("ed25519", "x25519")]
        new = [path for path in fresh if not path.exists()]
        made = keyfiles.create_runner_keys(root, force=force)
        created.extend(new)
    req = invite.request(code, made)
    login = cfg  # the code's one-time broker user where the hub made one (§16.5), else this host's own
    if code.broker is not None and code.broker.enrol_user:
        login = cfg.with_overrides(username=code.enrol_username, password=code.enrol_password)
    with mqtt.MqttClient(login, "enrol") as client:
        client.subscribe([(names.enrol_topic(code.session, "answer", cfg.topic_root), mqtt.QOS_AT_LEAST_ONCE)])
        client.publish(names.enrol_topic(code.session, "request", cfg.topic_root), canonical_json(req))
        answer = _await_answer(client, code, req, timeout_s, cfg.host)
    password = None
    if answer.broker_user is not None:  # opened before anything is written
        password = invite.open_password(made.x25519, answer.sealed_password, invite_id=code.invite_id,
                                        nonce=req["nonce"], username=answer.broker_user)
    values: dict[str, str] = dict(defaults)
    if code.broker is not None or hub or port is not None:  # where the broker is, as it answered
        values |= {"MQTT_BROKER": ",".join(cfg.hosts), "MQTT_PORT": str(cfg.port),
                   "MQTT_TLS": "true" if cfg.tls else "false", "MAM_TOPIC_ROOT": cfg.topic_root}
        if cfg.ca_certs:
            values["MQTT_CA_CERTS"] = cfg.ca_certs
    if answer.broker_user is not None and password is not None:
        values |= {"MQTT_USERNAME": answer.broker_user, "MQTT_PASSWORD": password}
    trusted = trust_hub(answer.hub_publics, workspace=root)
    identity = EnrolRequest.build(code.session, answer.labels, made.ed25519_public, made.x25519_public)
    atomic_write(names.runner_identity_path(root), json_line(identity.to_dict()), what="runner identity",
                 error=ConfigError)
    env_file = write_env(root, values) if values else None
    return Enrolled(identity, trusted, answer.broker_user if password is not None else None, env_file,
                    tuple(values))


def _await_answer(client: mqtt.MqttClient, code: InviteCode, req: dict[str, object], timeout_s: float,
                  host: str) -> invite.Answer:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            message = client.messages.get(timeout=left)
        except queue.Empty:
            break
        try:
            obj = invite.parse_message(message.payload)
        except UsageError:
            continue
        if not invite.matches(dict(req), obj):
            continue
        try:
            return invite.check_answer(code, dict(req), obj)
        except SignatureError:  # not from the hub holding the code: keep waiting for the real answer
            continue
    raise ProtocolError(f"no answer from the hub within {timeout_s:g} s on {host}: is `mam-orch runner invite` "
                        "still waiting there (an invite answers once, until its TTL)?")
