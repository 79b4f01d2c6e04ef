"""What a runner verifies the hub with and opens its seals with, v1 and v2
(PROTOCOL §5, §6, §16), as pure functions over the keys it holds.

`V2Trust` is this host's v2 identity (`mam-runner enroll`: its Ed25519 and
X25519 keys) plus the hub public keys it trusts (`mam-runner trust-hub`) and
`MAM_ACCEPT_V1`. A runner with v2 keys verifies dispatches and controls with
the hub's Ed25519 keys only (its own keys can never sign one) and refuses v1
messages unless `MAM_ACCEPT_V1=true`; without v2 keys it is a v1 runner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from mam.shared import config
from mam.shared.protocol import crypto, wire
from mam.shared.protocol.crypto import DispatchKeys, pubkey
from mam.shared.protocol.crypto.keys import RunnerKeys
from mam.shared.protocol.errors import ConfigError, SignatureError
from mam.shared.protocol.wire.fields import SEAL_ALG_V2
from mam.shared.store import keyfiles

ACCEPT_V1_VAR = "MAM_ACCEPT_V1"
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no", "")

__all__ = ["ACCEPT_V1_VAR", "V2Trust", "load", "load_v2", "open_dispatch", "sign_presence", "verify_from_hub",
           "verify_own_presence"]


@dataclass(frozen=True)
class V2Trust:
    """A v2 runner's keys (§16). The repr shows public keys only.

    Attributes:
        runner: its Ed25519 (presence) and X25519 (seals) private keys.
        hub_keys: the hub public keys it verifies dispatches and controls with (current, previous).
        accept_v1: `MAM_ACCEPT_V1=true`: also take v1 messages (a migration, §16).
    """

    runner: RunnerKeys
    hub_keys: tuple[Ed25519PublicKey, ...] = field(repr=False)
    accept_v1: bool = False


def load_v2(root: Path, values: Mapping[str, str]) -> V2Trust | None:
    """This runner's v2 trust, or None when it was never enrolled (a v1 runner).

    Args:
        root: the registry root; values: the resolved settings (`config.load_env`).
    Raises:
        ConfigError: keys unreadable, no trusted hub key yet, or a bad MAM_ACCEPT_V1.
    """
    runner = keyfiles.load_runner_keys(root)
    if runner is None:
        return None
    hub_keys = keyfiles.trusted_hub_keys(root)
    if not hub_keys:
        raise ConfigError("this runner has v2 keys but trusts no hub key yet: run the `mam-runner trust-hub "
                          "PUB` line that `mam-orch runner add` printed")
    raw = values.get(ACCEPT_V1_VAR, "").strip().lower()
    if raw not in _TRUE + _FALSE:
        raise ConfigError(f"{ACCEPT_V1_VAR}={raw!r} is invalid: expected true or false")
    return V2Trust(runner=runner, hub_keys=hub_keys, accept_v1=raw in _TRUE)


def load(root: Path) -> tuple[DispatchKeys | None, V2Trust | None]:
    """The keys `mam-runner run` verifies with: v1 from MAM_DISPATCH_SECRET (required unless this
    runner has v2 keys and no secret is set), v2 from `.mam/keys/` (§5, §16).

    Raises:
        ConfigError: a missing or short secret on a v1 runner, or as `load_v2`.
    """
    values = config.load_env(workspace=root)
    v2 = load_v2(root, values)
    if v2 is not None and not values.get("MAM_DISPATCH_SECRET"):
        return None, v2
    return crypto.derive_keys(config.dispatch_secret(workspace=root)), v2


def verify_from_hub(message: wire.Dispatch | wire.Control, v1: DispatchKeys | None, v2: V2Trust | None) -> None:
    """Check the hub's signature on a dispatch or control (§5, §6, §16).

    v2 messages (`sig_alg`) verify with the trusted hub keys; v1 ones with the v1 sign key,
    and only when this runner has no v2 keys or accepts v1.

    Raises:
        SignatureError: one line, the §5 refusal text.
    """
    kind = message.kind
    if message.sig_alg is not None:
        if v2 is None:
            raise SignatureError(f"{kind} is v2 (ed25519) but this runner has no v2 keys "
                                 "(mam-runner enroll, then mam-runner trust-hub)")
        pubkey.verify(message, v2.hub_keys)
        return
    if v2 is not None and not v2.accept_v1:
        raise SignatureError(f"{kind} {pubkey.V1_REFUSED}")
    if v1 is None:
        raise SignatureError(f"{kind} is v1 but this runner has no MAM_DISPATCH_SECRET")
    crypto.verify(message, v1.sign_key)


def open_dispatch(dispatch: wire.Dispatch, v1: DispatchKeys | None, v2: V2Trust | None) -> tuple[str, str]:
    """Open a verified dispatch's seal with the key its `alg` names (§5, §16).

    Returns:
        (auth_token, brief).
    Raises:
        SignatureError: "seal does not open".
    """
    job_id, attempt_id, token = dispatch.job_id, dispatch.attempt_id, dispatch.dispatch_token
    if dispatch.sealed.alg == SEAL_ALG_V2:
        if v2 is None:
            raise SignatureError(crypto.SEAL_FAILED)
        return pubkey.open_sealed(v2.runner.x25519, dispatch.sealed, job_id=job_id, attempt_id=attempt_id,
                                  dispatch_token=token)
    if v1 is None:
        raise SignatureError(crypto.SEAL_FAILED)
    return crypto.open_sealed(v1.seal_key, dispatch.sealed, job_id=job_id, attempt_id=attempt_id,
                              dispatch_token=token)


def sign_presence(presence: Mapping[str, Any], v1: DispatchKeys | None, v2: V2Trust | None) -> dict[str, Any]:
    """A presence signed with the runner's own Ed25519 key (v2), else with the v1 sign key (§7, §16).

    Raises:
        ConfigError: neither key is held.
    """
    if v2 is not None:
        return pubkey.sign_presence(presence, v2.runner.ed25519)
    if v1 is None:
        raise ConfigError("no key to sign presence with: set MAM_DISPATCH_SECRET or enrol (mam-runner enroll)")
    return crypto.sign(presence, v1.sign_key)


def verify_own_presence(presence: wire.Presence, v1: DispatchKeys | None, v2: V2Trust | None) -> None:
    """Check a presence on this runner's own session (§7): signed with this identity's key.

    Raises:
        SignatureError: not signed by this runner identity.
    """
    if v2 is not None:
        pubkey.verify(presence, [v2.runner.ed25519.public_key()])
        return
    if v1 is None:
        raise SignatureError("presence sig verify failed")
    crypto.verify(presence, v1.sign_key)
