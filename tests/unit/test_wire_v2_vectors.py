"""PROTOCOL §16 (wire v2): golden vectors of every v2 message, checked against an
independent computation with the `cryptography` primitives (and RFC 5869 HKDF
from hmac/hashlib), and the refusals: tampered or wrongly keyed signatures,
broken, foreign or hostile seals, and v1 messages offered to a v2 verifier."""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from mam.shared.protocol import crypto, wire
from mam.shared.protocol.crypto import pubkey
from mam.shared.protocol.errors import DecodeError, SignatureError

pytestmark = pytest.mark.timeout(60)

V2 = json.loads((Path(__file__).parent / "golden_vectors_v2.json").read_text(encoding="utf-8"))
KEYS = V2["keys"]
HUB = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(KEYS["hub_ed25519_seed_hex"]))
RUNNER_ED = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(KEYS["runner_ed25519_seed_hex"]))
RUNNER_X = X25519PrivateKey.from_private_bytes(bytes.fromhex(KEYS["runner_x25519_private_hex"]))
EPHEMERAL = X25519PrivateKey.from_private_bytes(bytes.fromhex(KEYS["ephemeral_x25519_private_hex"]))
SEAL = V2["seal"]
ATTEMPT = {"job_id": SEAL["job_id"], "attempt_id": SEAL["attempt_id"], "dispatch_token": SEAL["dispatch_token"]}
TOKEN = SEAL["dispatch_token"]


def canonical(obj: Any) -> bytes:
    """Independent §3.1 canonical form: json only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def rfc5869(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    """Independent HKDF-SHA256, 32 bytes (one expand block), from hmac and hashlib."""
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def signed_dispatch(**overrides: Any) -> dict[str, Any]:
    return pubkey.sign({**V2["dispatch_sig"]["payload"], **overrides}, HUB)


# ------------------------------------------------------------ golden vectors

def test_s16_golden_public_keys():
    assert b64(HUB.public_key().public_bytes_raw()) == KEYS["expected_hub_ed25519_public"]
    assert b64(RUNNER_ED.public_key().public_bytes_raw()) == KEYS["expected_runner_ed25519_public"]
    assert b64(RUNNER_X.public_key().public_bytes_raw()) == KEYS["expected_runner_x25519_public"]
    assert b64(EPHEMERAL.public_key().public_bytes_raw()) == KEYS["expected_ephemeral_x25519_public"]


def test_s16_golden_seal_reproduces_and_matches_independent_computation():
    runner_public = X25519PublicKey.from_public_bytes(unb64(KEYS["expected_runner_x25519_public"]))
    sealed = pubkey.seal(runner_public, **ATTEMPT, auth_token=SEAL["auth_token"], brief=SEAL["brief"],
                         ephemeral=EPHEMERAL, nonce=bytes.fromhex(SEAL["nonce_hex"]))
    assert sealed == SEAL["expected_sealed"]
    # Independent: ECDH from the library, HKDF from RFC 5869, AES-GCM straight from the library.
    epk = unb64(sealed["epk"])
    shared = RUNNER_X.exchange(X25519PublicKey.from_public_bytes(epk))
    assert shared == EPHEMERAL.exchange(runner_public)
    assert shared.hex() == SEAL["expected_ecdh_hex"]
    key = rfc5869(shared, epk + runner_public.public_bytes_raw(), SEAL["info"].encode())
    assert key.hex() == SEAL["expected_key_hex"]
    plaintext = AESGCM(key).decrypt(unb64(sealed["nonce"]), unb64(sealed["ciphertext"]),
                                    SEAL["associated_data"].encode())
    assert json.loads(plaintext) == {"auth_token": SEAL["auth_token"], "brief": SEAL["brief"]}
    assert plaintext == canonical({"auth_token": SEAL["auth_token"], "brief": SEAL["brief"]})
    assert pubkey.open_sealed(RUNNER_X, sealed, **ATTEMPT) == (SEAL["auth_token"], SEAL["brief"])
    # The golden dispatch carries this very seal.
    assert V2["dispatch_sig"]["payload"]["sealed"] == SEAL["expected_sealed"]


@pytest.mark.parametrize(("name", "signer"), [("dispatch_sig", HUB), ("control_sig", HUB),
                                              ("presence_sig", RUNNER_ED)])
def test_s16_golden_signatures(name, signer):
    vector = V2[name]
    payload = vector["payload"]
    assert "sig" not in payload and payload["sig_alg"] == "ed25519"
    # Independent: Ed25519 (deterministic, RFC 8032) over the canonical bytes, from the library.
    assert b64(signer.sign(canonical(payload))) == vector["expected_sig"]
    signer.public_key().verify(unb64(vector["expected_sig"]), canonical(payload))
    signed = pubkey.sign(payload, signer)
    assert signed["sig"] == vector["expected_sig"]
    decoded = wire.decode(wire.encode(signed), payload["kind"])
    assert decoded.to_dict() == signed
    pubkey.verify(decoded, [signer.public_key()])


def test_s16_golden_dispatch_opens_after_decode():
    signed = signed_dispatch()
    dispatch = wire.decode(wire.encode(signed), "dispatch")
    assert dispatch.sig_alg == "ed25519" and dispatch.sealed.epk == SEAL["expected_sealed"]["epk"]
    assert pubkey.open_sealed(RUNNER_X, dispatch.sealed, **ATTEMPT) == (SEAL["auth_token"], SEAL["brief"])


def test_s16_build_dispatch_is_signed_sealed_and_fresh_per_call():
    runner_public = RUNNER_X.public_key()
    made = [pubkey.build_dispatch(HUB, runner_public, job_id="918b0612", session="gpu-box", attempt_id=2,
                                  dispatch_token=TOKEN, auth_token="tok", brief="brief", origin="hub-1",
                                  contract=wire.Contract()) for _ in range(2)]
    assert made[0]["sealed"]["epk"] != made[1]["sealed"]["epk"]  # an ephemeral key per dispatch
    for signed in made:
        dispatch = wire.decode(wire.encode(signed), "dispatch")
        pubkey.verify(dispatch, [HUB.public_key()])
        assert pubkey.open_sealed(RUNNER_X, dispatch.sealed, job_id="918b0612", attempt_id=2,
                                  dispatch_token=TOKEN) == ("tok", "brief")


def test_s16_build_control_and_presence_verify():
    control = pubkey.build_control(HUB, job_id="918b0612", attempt_id=1, reason="operator")
    pubkey.verify(wire.decode(wire.encode(control), "control"), [HUB.public_key()])
    presence = wire.Presence.build("gpu-box", "f" * 32, "online", host="h", version="0.1.0", max_jobs=1)
    signed = pubkey.sign_presence(presence, RUNNER_ED)
    pubkey.verify(wire.decode(wire.encode(signed), "presence"), [RUNNER_ED.public_key()])


# ---------------------------------------------------------- refused signatures

@pytest.mark.parametrize("change", [
    lambda p: p.__setitem__("session", "other-box"),
    lambda p: p.__setitem__("attempt_id", 2),
    lambda p: p["contract"].__setitem__("timeout_sec", 1),
    lambda p: p["sealed"].__setitem__("epk", b64(bytes(32))),
    lambda p: p.__setitem__("sig", b64(bytes(64))),
    lambda p: p.__setitem__("sig", p["sig"][:-4] + "AAA="),
    lambda p: p.__setitem__("sig", "0" * 64),
    lambda p: p.__setitem__("sig", 5),
    lambda p: p.pop("sig"),
    lambda p: p.__setitem__("sig_alg", "rsa"),
])
def test_s16_tampered_dispatch_refused(change):
    payload = signed_dispatch()
    change(payload)
    with pytest.raises(SignatureError, match="^dispatch sig verify failed$"):
        pubkey.verify(payload, [HUB.public_key()])


def test_s16_wrong_key_refused_and_runner_keys_cannot_sign_a_dispatch():
    payload = pubkey.sign(V2["dispatch_sig"]["payload"], RUNNER_ED)  # a runner signing a dispatch
    with pytest.raises(SignatureError, match="sig verify failed"):
        pubkey.verify(payload, [HUB.public_key()])
    other_hub = Ed25519PrivateKey.generate()
    with pytest.raises(SignatureError, match="sig verify failed"):
        pubkey.verify(signed_dispatch(), [other_hub.public_key()])
    with pytest.raises(SignatureError, match="sig verify failed"):
        pubkey.verify(signed_dispatch(), [])


def test_s16_rotation_accepts_previous_hub_key_until_told():
    new_hub = Ed25519PrivateKey.generate()
    trusted = [new_hub.public_key(), HUB.public_key()]
    pubkey.verify(signed_dispatch(), trusted)
    pubkey.verify(pubkey.sign(V2["control_sig"]["payload"], new_hub), trusted)
    with pytest.raises(SignatureError):
        pubkey.verify(signed_dispatch(), trusted[:1])


def test_s16_presence_signed_by_another_runner_refused():
    presence = V2["presence_sig"]["payload"]
    forged = pubkey.sign(presence, Ed25519PrivateKey.generate())
    with pytest.raises(SignatureError, match="^presence sig verify failed$"):
        pubkey.verify(forged, [RUNNER_ED.public_key()])


@pytest.mark.parametrize("name", ["dispatch_sig", "control_sig", "presence_sig"])
def test_s16_v1_message_to_a_v2_verifier_refused(name):
    secret_keys = crypto.derive_keys("golden-dispatch-secret-0123456789-abcdefghijklmnop")
    v1 = {k: v for k, v in V2[name]["payload"].items() if k != "sig_alg"}
    if name == "dispatch_sig":
        v1["sealed"] = crypto.seal(secret_keys.seal_key, **ATTEMPT, auth_token="t", brief="b")
    signed = crypto.sign(v1, secret_keys.sign_key)
    decoded = wire.decode(wire.encode(signed), v1["kind"])
    with pytest.raises(SignatureError, match=r"is a v1 message .*MAM_ACCEPT_V1=true"):
        pubkey.verify(decoded, [HUB.public_key()])


def test_s16_v2_dispatch_to_a_v1_verifier_refused():
    keys = crypto.derive_keys("x" * 40)
    with pytest.raises(SignatureError, match="^dispatch sig verify failed$"):
        crypto.verify(signed_dispatch(), keys.sign_key)


# ------------------------------------------------------------- refused seals

def _with(sealed_change) -> dict[str, Any]:
    sealed = copy.deepcopy(SEAL["expected_sealed"])
    sealed_change(sealed)
    return sealed


HOSTILE_SEALS = {
    "truncated ciphertext": lambda s: s.__setitem__("ciphertext", b64(unb64(s["ciphertext"])[:-1])),
    "shorter than the tag": lambda s: s.__setitem__("ciphertext", b64(bytes(8))),
    "empty ciphertext": lambda s: s.__setitem__("ciphertext", ""),
    "flipped byte": lambda s: s.__setitem__("ciphertext", b64(bytes([unb64(s["ciphertext"])[0] ^ 1]) +
                                                               unb64(s["ciphertext"])[1:])),
    "oversized": lambda s: s.__setitem__("ciphertext", b64(bytes(pubkey.MAX_SEALED_CIPHERTEXT_BYTES + 1))),
    "wrong epk": lambda s: s.__setitem__("epk", b64(X25519PrivateKey.generate().public_key().public_bytes_raw())),
    "low-order epk": lambda s: s.__setitem__("epk", b64(bytes(32))),
    "short epk": lambda s: s.__setitem__("epk", b64(bytes(31))),
    "epk not base64": lambda s: s.__setitem__("epk", "not base64!"),
    "epk not a string": lambda s: s.__setitem__("epk", 7),
    "no epk": lambda s: s.pop("epk"),
    "extra field": lambda s: s.__setitem__("extra", "x"),
    "v1 alg": lambda s: s.__setitem__("alg", "A256GCM"),
    "short nonce": lambda s: s.__setitem__("nonce", b64(bytes(11))),
    "nonce null": lambda s: s.__setitem__("nonce", None),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_SEALS))
def test_s16_broken_or_hostile_seal_refused(name):
    with pytest.raises(SignatureError, match="^seal does not open$"):
        pubkey.open_sealed(RUNNER_X, _with(HOSTILE_SEALS[name]), **ATTEMPT)


@pytest.mark.parametrize("attempt", [{"attempt_id": 2}, {"job_id": "00000000"}, {"dispatch_token": "f" * 32}])
def test_s16_seal_bound_to_its_attempt(attempt):
    with pytest.raises(SignatureError, match="^seal does not open$"):
        pubkey.open_sealed(RUNNER_X, SEAL["expected_sealed"], **{**ATTEMPT, **attempt})


def test_s16_seal_for_runner_b_does_not_open_for_runner_a():
    runner_b = X25519PrivateKey.generate()
    sealed = pubkey.seal(runner_b.public_key(), **ATTEMPT, auth_token="secret-token", brief="brief for B")
    assert pubkey.open_sealed(runner_b, sealed, **ATTEMPT) == ("secret-token", "brief for B")
    with pytest.raises(SignatureError, match="^seal does not open$"):
        pubkey.open_sealed(RUNNER_X, sealed, **ATTEMPT)


def test_s16_v1_seal_refused_by_v2_open():
    keys = crypto.derive_keys("x" * 40)
    with pytest.raises(SignatureError, match="^seal does not open$"):
        pubkey.open_sealed(RUNNER_X, crypto.seal(keys.seal_key, **ATTEMPT, auth_token="t", brief="b"), **ATTEMPT)


def test_s16_seal_errors_name_no_secret():
    with pytest.raises(SignatureError) as info:
        pubkey.open_sealed(X25519PrivateKey.generate(), SEAL["expected_sealed"], **ATTEMPT)
    assert SEAL["auth_token"] not in str(info.value) and "brief" not in str(info.value)


# ----------------------------------------------------------- decode (wire)

@pytest.mark.parametrize(("change", "reason"), [
    (lambda p: p.__setitem__("sig_alg", "rsa"), "sig_alg is 'rsa'"),
    (lambda p: p.__setitem__("sig", "0" * 64), "sig decodes to"),
    (lambda p: p.pop("sig_alg"), "sig '"),
    (lambda p: p["sealed"].pop("epk"), "sealed.epk must be a string"),
    (lambda p: p["sealed"].__setitem__("epk", b64(bytes(16))), "sealed.epk decodes to 16 bytes"),
    (lambda p: p["sealed"].__setitem__("alg", "A256GCM"), "sealed.epk is only allowed"),
    (lambda p: (p["sealed"].__setitem__("alg", "A256GCM"), p["sealed"].pop("epk")), "does not go with sig_alg"),
    (lambda p: p["sealed"].__setitem__("other", "x"), "unknown field 'sealed.other'"),
])
def test_s16_decode_refuses_inconsistent_v2_dispatch(change, reason):
    payload = signed_dispatch()
    change(payload)
    with pytest.raises(DecodeError, match="^malformed: ") as info:
        wire.decode(canonical(payload), "dispatch")
    assert reason in info.value.reason


@pytest.mark.parametrize("name", ["dispatch_sig", "control_sig", "presence_sig"])
def test_s16_explicit_null_sig_alg_refused(name):
    v1 = json.loads((Path(__file__).parent / "golden_vectors.json").read_text(encoding="utf-8"))
    signed = crypto.sign(v1[name]["payload"], crypto.derive_keys(v1[name]["secret"]).sign_key)
    with pytest.raises(DecodeError, match="sig_alg must be a string, got null"):
        wire.decode(canonical({**signed, "sig_alg": None}), v1[name]["payload"]["kind"])


def test_s16_decode_refuses_epk_on_a_v1_seal():
    keys = crypto.derive_keys("x" * 40)
    sealed = {**crypto.seal(keys.seal_key, **ATTEMPT, auth_token="t", brief="b"), "epk": b64(bytes(32))}
    with pytest.raises(DecodeError, match="sealed.epk is only allowed"):
        wire.Sealed.from_dict(sealed)


def test_s16_v1_golden_messages_still_decode_without_sig_alg():
    v1 = json.loads((Path(__file__).parent / "golden_vectors.json").read_text(encoding="utf-8"))
    keys = crypto.derive_keys(v1["dispatch_sig"]["secret"])
    for name in ("dispatch_sig", "control_sig", "presence_sig"):
        signed = crypto.sign(v1[name]["payload"], keys.sign_key)
        decoded = wire.decode(wire.encode(signed), v1[name]["payload"]["kind"])
        assert decoded.sig_alg is None and decoded.to_dict() == signed
        assert not pubkey.is_v2(decoded)


def test_s16_public_key_helpers_round_trip():
    assert isinstance(Ed25519PublicKey.from_public_bytes(unb64(KEYS["expected_hub_ed25519_public"])),
                      Ed25519PublicKey)
