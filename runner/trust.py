"""How a runner trusts the hub (PROTOCOL §5, §6, §7, §16.1): one `HubTrust` seam with two
implementations, chosen once at start by `load`.

`V1Trust` holds the keys of the shared MAM_DISPATCH_SECRET: it verifies v1 dispatches
and controls, opens v1 seals and signs presence with them. `V2Trust` is this host's v2
identity (`mam-runner enroll`: its Ed25519 and X25519 keys) plus the hub public keys it
trusts (`mam-runner trust-hub`): it verifies dispatches and controls with the hub's
Ed25519 keys only (its own keys can never sign one), signs presence with its own key,
and refuses v1 messages unless `MAM_ACCEPT_V1=true` (a migration, with the secret).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from mam.shared import config
from mam.shared.protocol import crypto, wire
from mam.shared.protocol.crypto import DispatchKeys, pubkey
from mam.shared.protocol.crypto.keys import RunnerKeys, public_text
from mam.shared.protocol.errors import ConfigError, SignatureError
from mam.shared.protocol.wire.fields import SEAL_ALG_V2
from mam.shared.store import keyfiles

ACCEPT_V1_VAR = "MAM_ACCEPT_V1"
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no", "")

__all__ = ["ACCEPT_V1_VAR", "HubTrust", "V1Trust", "V2Trust", "load", "load_v2"]


class HubTrust(Protocol):
    """What a runner checks the hub's messages with and signs its own presence with (§16.1)."""

    def verify_from_hub(self, message: wire.Dispatch | wire.Control | wire.Drain) -> None:
        """Check the hub's signature on a dispatch, control or drain order (§5, §6, §7, §16.4).

        Raises:
            SignatureError: one line, the §5 refusal text.
        """
        ...

    def open_dispatch(self, dispatch: wire.Dispatch) -> tuple[str, str]:
        """Open a verified dispatch's seal with the key its `alg` names (§5, §16.3).

        Returns:
            (auth_token, brief).
        Raises:
            SignatureError: "seal does not open".
        """
        ...

    def sign_presence(self, presence: Mapping[str, Any]) -> dict[str, Any]:
        """The presence signed with this runner identity's key (§7, §16.2)."""
        ...

    def verify_own_presence(self, presence: wire.Presence) -> None:
        """Check a presence on this runner's own session was signed by this identity (§7).

        Raises:
            SignatureError: not signed by this runner identity.
        """
        ...

    def verify_revocation(self, notice: wire.Revocation) -> str:
        """Check a revocation notice names this identity and a trusted hub key signed it (§16.7).

        Returns:
            the signing hub key, base64url (to name the hub in the log).
        Raises:
            SignatureError: one line: not signed by a trusted hub key, or another identity's notice.
        """
        ...


@dataclass(frozen=True)
class V1Trust:
    """A v1 runner: the keys of MAM_DISPATCH_SECRET (§5) verify, open and sign everything."""

    keys: DispatchKeys = field(repr=False)

    def verify_from_hub(self, message: wire.Dispatch | wire.Control | wire.Drain) -> None:
        if message.sig_alg is not None:
            raise SignatureError(f"{message.kind} is v2 (ed25519) but this runner has no v2 keys "
                                 "(mam-runner enroll, then mam-runner trust-hub)")
        crypto.verify(message, self.keys.sign_key)

    def open_dispatch(self, dispatch: wire.Dispatch) -> tuple[str, str]:
        if dispatch.sealed.alg == SEAL_ALG_V2:
            raise SignatureError(crypto.SEAL_FAILED)
        return crypto.open_sealed(self.keys.seal_key, dispatch.sealed, job_id=dispatch.job_id,
                                  attempt_id=dispatch.attempt_id, dispatch_token=dispatch.dispatch_token)

    def sign_presence(self, presence: Mapping[str, Any]) -> dict[str, Any]:
        return crypto.sign(presence, self.keys.sign_key)

    def verify_own_presence(self, presence: wire.Presence) -> None:
        crypto.verify(presence, self.keys.sign_key)

    def verify_revocation(self, notice: wire.Revocation) -> str:
        raise SignatureError("revocation notice ignored: this runner is v1 (not enrolled), so never revoked")


@dataclass(frozen=True)
class V2Trust:
    """A v2 runner's keys (§16). The repr shows public keys only.

    Attributes:
        runner: its Ed25519 (presence) and X25519 (seals) private keys.
        hub_keys: the hub public keys it verifies dispatches and controls with (current, previous).
        accept_v1: `MAM_ACCEPT_V1=true`: also take v1 messages (a migration, §16).
        v1: the keys of MAM_DISPATCH_SECRET when it is set (v1 seals; v1 messages with `accept_v1`).
    """

    runner: RunnerKeys
    hub_keys: tuple[Ed25519PublicKey, ...] = field(repr=False)
    accept_v1: bool = False
    v1: DispatchKeys | None = field(default=None, repr=False)

    def verify_from_hub(self, message: wire.Dispatch | wire.Control | wire.Drain) -> None:
        if message.sig_alg is not None:
            pubkey.verify(message, self.hub_keys)
            return
        if not self.accept_v1:
            raise SignatureError(f"{message.kind} {pubkey.V1_REFUSED}")
        if self.v1 is None:
            raise SignatureError(f"{message.kind} is v1 but this runner has no MAM_DISPATCH_SECRET")
        crypto.verify(message, self.v1.sign_key)

    def open_dispatch(self, dispatch: wire.Dispatch) -> tuple[str, str]:
        if dispatch.sealed.alg != SEAL_ALG_V2:
            if self.v1 is None:
                raise SignatureError(crypto.SEAL_FAILED)
            return V1Trust(self.v1).open_dispatch(dispatch)
        return pubkey.open_sealed(self.runner.x25519, dispatch.sealed, job_id=dispatch.job_id,
                                  attempt_id=dispatch.attempt_id, dispatch_token=dispatch.dispatch_token)

    def sign_presence(self, presence: Mapping[str, Any]) -> dict[str, Any]:
        return pubkey.sign_presence(presence, self.runner.ed25519)

    def verify_own_presence(self, presence: wire.Presence) -> None:
        pubkey.verify(presence, [self.runner.ed25519.public_key()])

    def verify_revocation(self, notice: wire.Revocation) -> str:
        for key in self.hub_keys:
            try:
                pubkey.verify(notice, [key])
            except SignatureError:
                continue
            if notice.runner_key != self.runner.ed25519_public:
                raise SignatureError("revocation notice names another enrolment of this session (an older key): "
                                     "ignored")
            return public_text(key)
        raise SignatureError("revocation notice is not signed by a trusted hub key: ignored")


def load_v2(root: Path, values: Mapping[str, str], v1: DispatchKeys | None = None) -> V2Trust | None:
    """This runner's v2 trust, or None when it was never enrolled (a v1 runner).

    Args:
        root: the registry root; values: the resolved settings (`config.load_env`);
        v1: the keys of MAM_DISPATCH_SECRET, when set.
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
    return V2Trust(runner=runner, hub_keys=hub_keys, accept_v1=raw in _TRUE, v1=v1)


def load(root: Path) -> HubTrust:
    """The trust `mam-runner run` starts with (§16.1): v2 when this runner was enrolled
    (`.mam/keys/`), else v1 from MAM_DISPATCH_SECRET.

    Raises:
        ConfigError: a missing or short secret on a v1 runner, or as `load_v2`.
    """
    values = config.load_env(workspace=root)
    v1 = crypto.derive_keys(config.dispatch_secret(workspace=root)) if values.get("MAM_DISPATCH_SECRET") else None
    v2 = load_v2(root, values, v1)
    if v2 is not None:
        return v2
    return V1Trust(v1 if v1 is not None else crypto.derive_keys(config.dispatch_secret(workspace=root)))
