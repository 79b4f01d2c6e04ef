"""The dispatch of PROTOCOL §5 as frozen dataclasses: Dispatch with its liveness
Contract and its Sealed part (AES-256-GCM, opened by `mam.shared.protocol.crypto`).
Import them through `mam.shared.protocol.wire`.

Constructing one applies the §5 field rules and raises `DecodeError`;
`Dispatch.build` and `Contract.build` raise `UsageError` instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from mam.shared.protocol.errors import DecodeError, UsageError
from mam.shared.protocol.wire.fields import (
    GCM_TAG_BYTES,
    MAX_CONTRACT_SEC,
    MAX_HEARTBEAT_MISSES,
    MAX_NAME_CHARS,
    SCHEMA_VERSION,
    SEAL_ALG,
    SEAL_ALG_V2,
    SEAL_NONCE_BYTES,
    V2_SEALED_FIELDS,
    V2_SIGNED_FIELDS,
    X25519_KEY_BYTES,
    Invalid,
    build,
    check_b64,
    check_choice,
    check_fields,
    check_hex32,
    check_int,
    check_job_id,
    check_schema,
    check_session,
    check_sig,
    check_text,
    check_timestamp,
    decode_object,
    format_ts,
    is_int,
    parse_ts,
    run_check,
    run_inner,
    show,
    strip_word,
    to_utc,
    type_name,
)
from mam.shared.protocol.wire.work import Work

# Contract defaults of §5 (the hub's MAM_* settings override them).
DEFAULT_HEARTBEAT_SEC = 30
DEFAULT_HEARTBEAT_MISSES = 4
DEFAULT_ACK_TIMEOUT_SEC = 180
DEFAULT_TIMEOUT_SEC = 7200
# Tolerance on a dispatch's expires_at (§5, MAM_CLOCK_SKEW_S).
DEFAULT_CLOCK_SKEW_S = 30.0

DISPATCH_FIELDS = frozenset({"schema_version", "kind", "job_id", "session", "attempt_id", "dispatch_token",
                             "origin", "issued_at", "expires_at", "contract", "sealed", "sig"})
CONTRACT_FIELDS = frozenset({"heartbeat_sec", "heartbeat_misses", "ack_timeout_sec", "idle_timeout_sec",
                             "timeout_sec"})
SEALED_FIELDS = frozenset({"alg", "nonce", "ciphertext"})
OPTIONAL_FIELDS = V2_SIGNED_FIELDS | {"work"}
"""Fields a dispatch may carry: `sig_alg` (§16) and `work` (§18, absent for a plain job)."""


@dataclass(frozen=True)
class Contract:
    """The liveness contract of a dispatch (§5); all values are positive integers.

    `idle_timeout_sec` defaults to `heartbeat_misses * heartbeat_sec`.
    """

    heartbeat_sec: int = DEFAULT_HEARTBEAT_SEC
    heartbeat_misses: int = DEFAULT_HEARTBEAT_MISSES
    ack_timeout_sec: int = DEFAULT_ACK_TIMEOUT_SEC
    idle_timeout_sec: int | None = None
    timeout_sec: int = DEFAULT_TIMEOUT_SEC

    def __post_init__(self) -> None:
        if self.idle_timeout_sec is None and is_int(self.heartbeat_sec) and is_int(self.heartbeat_misses):
            object.__setattr__(self, "idle_timeout_sec", self.heartbeat_sec * self.heartbeat_misses)
        run_check(self._check)

    def _check(self) -> None:
        check_int(self.heartbeat_sec, "contract.heartbeat_sec", 1, MAX_CONTRACT_SEC)
        check_int(self.heartbeat_misses, "contract.heartbeat_misses", 1, MAX_HEARTBEAT_MISSES)
        check_int(self.ack_timeout_sec, "contract.ack_timeout_sec", 1, MAX_CONTRACT_SEC)
        check_int(self.idle_timeout_sec, "contract.idle_timeout_sec", 1, MAX_CONTRACT_SEC)
        check_int(self.timeout_sec, "contract.timeout_sec", 1, MAX_CONTRACT_SEC)

    @classmethod
    def build(cls, **values: Any) -> Contract:
        """A contract from local input (CLI options, environment, a record's fields);
        None values take the defaults. Raises `UsageError` naming the field."""
        return build(cls, **{key: value for key, value in values.items() if value is not None})

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> Contract:
        """The contract stored in a registry record (its five §8 fields; other keys ignored).

        Raises:
            UsageError: a field breaks §5.
        """
        return cls.build(**{key: record.get(key) for key in CONTRACT_FIELDS})

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Contract:
        """Apply the §5 contract rules (exactly the five fields); raises `DecodeError`."""
        return run_check(lambda: _contract_from(obj))

    @property
    def idle_timeout_s(self) -> int:
        """The idle timeout in seconds: explicit, else K × N (§5)."""
        return self.idle_timeout_sec  # type: ignore[return-value]  # resolved in __post_init__

    def to_dict(self) -> dict[str, int]:
        """The wire object."""
        return {"heartbeat_sec": self.heartbeat_sec, "heartbeat_misses": self.heartbeat_misses,
                "ack_timeout_sec": self.ack_timeout_sec, "idle_timeout_sec": self.idle_timeout_s,
                "timeout_sec": self.timeout_sec}


@dataclass(frozen=True)
class Sealed:
    """The sealed part of a dispatch (§5): AES-256-GCM, base64url nonce and ciphertext+tag;
    v2 (§16, alg X25519-A256GCM) adds `epk`, the ephemeral X25519 public key."""

    nonce: str
    ciphertext: str
    alg: str = SEAL_ALG
    epk: str | None = None

    def __post_init__(self) -> None:
        run_check(self._check)

    def _check(self) -> None:
        check_choice(self.alg, "sealed.alg", (SEAL_ALG, SEAL_ALG_V2))
        check_b64(self.nonce, "sealed.nonce", exact=SEAL_NONCE_BYTES)
        check_b64(self.ciphertext, "sealed.ciphertext", minimum=GCM_TAG_BYTES)
        if self.alg == SEAL_ALG_V2:
            check_b64(self.epk, "sealed.epk", exact=X25519_KEY_BYTES)
        elif self.epk is not None:
            raise Invalid(f"sealed.epk is only allowed with sealed.alg {SEAL_ALG_V2}")

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Sealed:
        """Apply the §5 sealed rules (exactly alg, nonce, ciphertext); raises `DecodeError`."""
        return run_check(lambda: _sealed_from(obj))

    def to_dict(self) -> dict[str, str]:
        """The wire object."""
        out = {"alg": self.alg, "nonce": self.nonce, "ciphertext": self.ciphertext}
        if self.epk is not None:
            out["epk"] = self.epk
        return out


@dataclass(frozen=True)
class Dispatch:
    """A dispatch of §5. `sig` is None until signed by `crypto.sign` (v1) or `wirev2.sign`
    (v2, §16: `sig_alg` "ed25519" and a v2 seal); `decode` requires it."""

    job_id: str
    session: str
    attempt_id: int
    dispatch_token: str
    origin: str
    issued_at: str
    expires_at: str
    contract: Contract
    sealed: Sealed
    sig: str | None = None
    kind: str = "dispatch"
    sig_alg: str | None = None
    schema_version: int = SCHEMA_VERSION
    work: Work | None = None

    def __post_init__(self) -> None:
        run_check(self._check)

    def _check(self) -> None:
        check_schema(self.schema_version)
        check_choice(self.kind, "kind", ("dispatch",))
        if self.work is not None and not isinstance(self.work, Work):
            raise Invalid(f"work must be an object, got {type_name(self.work)}")
        check_job_id(self.job_id)
        check_session(self.session)
        check_int(self.attempt_id, "attempt_id")
        check_hex32(self.dispatch_token, "dispatch_token")
        check_text(self.origin, "origin", MAX_NAME_CHARS)
        check_timestamp(self.issued_at, "issued_at")
        check_timestamp(self.expires_at, "expires_at")
        if parse_ts(self.expires_at) < parse_ts(self.issued_at):
            raise Invalid(f"expires_at {self.expires_at} is before issued_at {self.issued_at}")
        if not isinstance(self.contract, Contract):
            raise Invalid(f"contract must be an object, got {type_name(self.contract)}")
        if not isinstance(self.sealed, Sealed):
            raise Invalid(f"sealed must be an object, got {type_name(self.sealed)}")
        if self.sig is not None:
            check_sig(self.sig, self.sig_alg)
        if (self.sig_alg is None) != (self.sealed.alg == SEAL_ALG):
            raise Invalid(f"sealed.alg {self.sealed.alg} does not go with sig_alg {self.sig_alg} "
                          "(v1: HMAC and A256GCM; v2: ed25519 and X25519-A256GCM, §16)")

    @classmethod
    def build(cls, job_id: str, session: str, attempt_id: int, dispatch_token: str, *, origin: str,
              contract: Contract, sealed: Sealed | Mapping[str, Any],
              issued_at: datetime | None = None, sig_alg: str | None = None,
              work: Work | None = None) -> Dispatch:
        """An unsigned dispatch (sign with `crypto.sign`), §5.

        Args:
            session: the bare runner name (no `remote:`); origin: the hub's name;
            contract: the liveness contract; sealed: `crypto.seal(...)` output;
            issued_at: aware datetime, None means now. `expires_at` is
            `issued_at + contract.ack_timeout_sec`; sig_alg: "ed25519" for v2 (§16);
            work: the job's repository and agent policy (§18), None (or empty) for a plain job.
        Raises:
            UsageError: a field breaks §5.
        """
        issued = datetime.now(UTC) if issued_at is None else to_utc(issued_at)
        issued = issued.replace(microsecond=0)
        try:
            expires = issued + timedelta(seconds=contract.ack_timeout_sec) if isinstance(contract, Contract) \
                else issued
            seal_obj = sealed if isinstance(sealed, Sealed) else Sealed.from_dict(sealed)
        except DecodeError as exc:
            raise UsageError(f"dispatch not built: {strip_word(exc.reason)}") from None
        return build(cls, job_id=job_id, session=session, attempt_id=attempt_id,
                     dispatch_token=dispatch_token, origin=origin, issued_at=format_ts(issued),
                     expires_at=format_ts(expires), contract=contract, sealed=seal_obj, sig_alg=sig_alg,
                     work=work or None)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Dispatch:
        """Apply the §5 rules to a parsed payload (sig required); raises `DecodeError`."""
        return decode_object(obj, _dispatch_from)

    def to_dict(self) -> dict[str, Any]:
        """The wire object; without `sig` while unsigned."""
        out: dict[str, Any] = {
            "schema_version": self.schema_version, "kind": self.kind, "job_id": self.job_id,
            "session": self.session, "attempt_id": self.attempt_id, "dispatch_token": self.dispatch_token,
            "origin": self.origin, "issued_at": self.issued_at, "expires_at": self.expires_at,
            "contract": self.contract.to_dict(), "sealed": self.sealed.to_dict()}
        if self.sig_alg is not None:
            out["sig_alg"] = self.sig_alg
        if self.work is not None:
            out["work"] = self.work.to_dict()
        if self.sig is not None:
            out["sig"] = self.sig
        return out

    def expired(self, now: datetime | None = None, skew_s: float = DEFAULT_CLOCK_SKEW_S) -> bool:
        """True if `expires_at` is more than `skew_s` seconds before `now` (§5: refuse it).

        Args:
            now: aware datetime, None means now; skew_s: MAM_CLOCK_SKEW_S, seconds.
        """
        moment = datetime.now(UTC) if now is None else to_utc(now)
        return parse_ts(self.expires_at) + timedelta(seconds=skew_s) < moment


def _contract_from(obj: object) -> Contract:
    if not isinstance(obj, Mapping):
        raise Invalid(f"contract must be an object, got {type_name(obj)} {show(obj)}")
    check_fields(obj, CONTRACT_FIELDS, "contract.")
    if obj["idle_timeout_sec"] is None:  # the default applies to builders, never to the wire
        raise Invalid("contract.idle_timeout_sec must be an integer, got null")
    return run_inner(lambda: Contract(**obj))


def _sealed_from(obj: object) -> Sealed:
    if not isinstance(obj, Mapping):
        raise Invalid(f"sealed must be an object, got {type_name(obj)} {show(obj)}")
    check_fields(obj, SEALED_FIELDS, "sealed.", optional=V2_SEALED_FIELDS)
    return run_inner(lambda: Sealed(**obj))


def _dispatch_from(obj: dict[str, Any]) -> Dispatch:
    if "work" in obj and not isinstance(obj["work"], Mapping):
        raise Invalid(f"work must be an object, got {type_name(obj['work'])} {show(obj['work'])}")
    check_fields(obj, DISPATCH_FIELDS, optional=OPTIONAL_FIELDS)
    if obj["sig"] is None:
        raise Invalid("sig must be a string, got null")
    values = dict(obj)
    if "work" in obj:
        values["work"] = run_inner(lambda: Work.from_dict(obj["work"]))
    values["contract"] = _contract_from(obj["contract"])
    values["sealed"] = _sealed_from(obj["sealed"])
    return run_inner(lambda: Dispatch(**values))
