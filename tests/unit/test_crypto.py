"""PROTOCOL §3.1, §4, §5-§7: HMAC of events and states, HKDF keys, dispatch signature, AES-GCM seal."""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

from mam.shared.protocol import crypto, wire
from mam.shared.protocol.errors import ConfigError, DecodeError, SignatureError

GOLDEN = json.loads((Path(__file__).parent / "golden_vectors.json").read_text(encoding="utf-8"))
TOKEN = "0123456789abcdef0123456789abcdef"
OTHER_TOKEN = "f" * 32
SECRET = "s3cr3t-" + "x" * 40
KEYS = crypto.derive_keys(SECRET)
AUTH = "per-job-auth-token_abcdefghijklmnopqrstuvwxyz012"


def plain_hmac(key: bytes, obj: Any) -> str:
    """Independent §3.1 computation: only hmac, hashlib and json."""
    msg = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def plain_hkdf(secret: bytes, info: bytes) -> bytes:
    """Independent RFC 5869 HKDF-SHA256 with no salt (zero salt), 32 bytes: one expand block."""
    prk = hmac.new(bytes(32), secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def event(**extra: Any) -> dict[str, Any]:
    return wire.Event.build("918b0612", 3, "progress", "halfway", attempt_id=2, dispatch_token=TOKEN,
                            session="gpu-box", data=extra or None, timestamp="2026-06-20T14:48:58Z").to_dict()


def sealed_for(job_id: str = "918b0612", attempt_id: int = 1, token: str = TOKEN, brief: str = "do the thing",
               nonce: bytes | None = None) -> dict[str, str]:
    return crypto.seal(KEYS.seal_key, job_id=job_id, attempt_id=attempt_id, dispatch_token=token,
                       auth_token=AUTH, brief=brief, nonce=nonce)


def dispatch(**overrides: Any) -> dict[str, Any]:
    built = wire.Dispatch.build("918b0612", "gpu-box", 1, TOKEN, origin="hub-1", contract=wire.Contract(),
                                sealed=sealed_for())
    return {**built.to_dict(), **overrides}


# ------------------------------------------------------------ golden vectors

def test_s3_1_golden_event_hmac_matches_file_and_independent_computation():
    vector = GOLDEN["event_hmac"]
    payload, token = vector["payload"], vector["auth_token"]
    assert wire.canonical(payload).decode("utf-8") == vector["expected_canonical"]
    assert plain_hmac(token.encode(), payload) == vector["expected_hmac_sig"]
    assert crypto.event_hmac(payload, token) == vector["expected_hmac_sig"]
    signed = crypto.sign_event(payload, token)
    assert signed["data"]["hmac_sig"] == vector["expected_hmac_sig"]
    crypto.verify_event(wire.decode(wire.encode(signed), "event"), token)


def test_s4_golden_state_hmac():
    vector = GOLDEN["state_hmac"]
    assert plain_hmac(vector["auth_token"].encode(), vector["payload"]) == vector["expected_hmac_sig"]
    assert crypto.event_hmac(vector["payload"], vector["auth_token"]) == vector["expected_hmac_sig"]


def test_s5_golden_keys_match_file_and_rfc5869():
    vector = GOLDEN["keys"]
    keys = crypto.derive_keys(vector["secret"])
    assert keys.seal_key.hex() == vector["expected_seal_key_hex"]
    assert keys.sign_key.hex() == vector["expected_sign_key_hex"]
    assert plain_hkdf(vector["secret"].encode(), b"mam-fleet/v1/seal") == keys.seal_key
    assert plain_hkdf(vector["secret"].encode(), b"mam-fleet/v1/sign") == keys.sign_key


@pytest.mark.parametrize("name", ["dispatch_sig", "control_sig", "presence_sig"])
def test_s5_s7_golden_signatures(name):
    vector = GOLDEN[name]
    keys = crypto.derive_keys(vector["secret"])
    assert "sig" not in vector["payload"]
    assert plain_hmac(keys.sign_key, vector["payload"]) == vector["expected_sig"]
    signed = crypto.sign(vector["payload"], keys.sign_key)
    assert signed["sig"] == vector["expected_sig"]
    kind = vector["payload"]["kind"]
    crypto.verify(wire.decode(wire.encode(signed), kind), keys.sign_key)


def test_s5_golden_seal_reproduces_and_opens():
    vector = GOLDEN["seal"]
    keys = crypto.derive_keys(vector["secret"])
    nonce = bytes.fromhex(vector["nonce_hex"])
    sealed = crypto.seal(keys.seal_key, job_id=vector["job_id"], attempt_id=vector["attempt_id"],
                         dispatch_token=vector["dispatch_token"], auth_token=vector["auth_token"],
                         brief=vector["brief"], nonce=nonce)
    assert sealed == vector["expected_sealed"]
    # Independent open: AES-GCM straight from the library with the documented associated data.
    plaintext = AESGCM(keys.seal_key).decrypt(
        base64.urlsafe_b64decode(sealed["nonce"]), base64.urlsafe_b64decode(sealed["ciphertext"]),
        vector["associated_data"].encode())
    assert json.loads(plaintext) == {"auth_token": vector["auth_token"], "brief": vector["brief"]}
    assert crypto.open_sealed(keys.seal_key, vector["expected_sealed"], job_id=vector["job_id"],
                              attempt_id=vector["attempt_id"], dispatch_token=vector["dispatch_token"]) == \
        (vector["auth_token"], vector["brief"])
    # The golden dispatch carries this very seal.
    assert GOLDEN["dispatch_sig"]["payload"]["sealed"] == vector["expected_sealed"]


# ------------------------------------------------------------ events (§3.1)

def test_s3_1_sign_event_round_trip_and_ignores_old_sig():
    signed = crypto.sign_event(event(tokens=5), AUTH)
    assert len(signed["data"]["hmac_sig"]) == 64
    assert crypto.sign_event(signed, AUTH) == signed
    crypto.verify_event(signed, AUTH)
    crypto.verify_event(wire.Event.from_dict(signed), AUTH)


def test_s3_1_sign_event_does_not_mutate_input():
    payload = event()
    before = copy.deepcopy(payload)
    crypto.sign_event(payload, AUTH)
    assert payload == before


@pytest.mark.parametrize("change", [
    lambda p: p["data"].pop("hmac_sig"),
    lambda p: p["data"].__setitem__("hmac_sig", "0" * 64),
    lambda p: p["data"].__setitem__("hmac_sig", 5),
    lambda p: p["data"].__setitem__("hmac_sig", "é" * 64),
    lambda p: p.__setitem__("seq", 4),
    lambda p: p.__setitem__("detail", "halfway!"),
    lambda p: p["data"].__setitem__("attempt_id", 3),
    lambda p: p["data"].__setitem__("extra", 1),
    lambda p: p.pop("data"),
])
def test_s3_2_hmac_missing_or_wrong_refused(change):
    payload = crypto.sign_event(event(), AUTH)
    change(payload)
    with pytest.raises(SignatureError) as info:
        crypto.verify_event(payload, AUTH)
    assert str(info.value) == "HMAC verify failed"


@pytest.mark.parametrize("token", ["wrong-token", "", None])
def test_s3_2_hmac_with_other_token_refused(token):
    payload = crypto.sign_event(event(), AUTH)
    with pytest.raises(SignatureError, match="^HMAC verify failed$"):
        crypto.verify_event(payload, token)  # type: ignore[arg-type]


def test_s3_1_signing_with_no_auth_token_is_a_config_error():
    with pytest.raises(ConfigError, match="auth_token is empty"):
        crypto.sign_event(event(), "")


def test_s4_state_signed_like_an_event():
    state = wire.State.build("918b0612", 3, "completed", "completed", attempt_id=2, dispatch_token=TOKEN)
    signed = crypto.sign_event(state, AUTH)
    crypto.verify_event(wire.decode(wire.encode(signed), "state"), AUTH)
    signed["status"] = "error"
    with pytest.raises(SignatureError):
        crypto.verify_event(signed, AUTH)


# --------------------------------------------------------------- keys (§5)

@pytest.mark.parametrize("secret", ["", "abc123xyz", "x" * 31, None, 12345])
def test_s5_short_or_missing_secret_is_config_error_without_the_secret(secret):
    with pytest.raises(ConfigError) as info:
        crypto.derive_keys(secret)  # type: ignore[arg-type]
    message = str(info.value)
    assert "MAM_DISPATCH_SECRET" in message and "\n" not in message
    if isinstance(secret, str) and secret:
        assert secret not in message


def test_s5_keys_are_distinct_deterministic_and_hidden():
    assert crypto.derive_keys("y" * 32) == crypto.derive_keys("y" * 32)
    assert KEYS.seal_key != KEYS.sign_key
    assert len(KEYS.seal_key) == len(KEYS.sign_key) == 32
    assert crypto.derive_keys("y" * 32).sign_key != crypto.derive_keys("z" * 32).sign_key
    for text in (repr(KEYS), str(KEYS), f"{KEYS!r}"):
        assert KEYS.seal_key.hex() not in text and KEYS.sign_key.hex() not in text
        assert repr(KEYS.seal_key) not in text and "hidden" in text


def test_s5_wrong_key_type_refused():
    with pytest.raises(TypeError):
        crypto.sign(dispatch(), b"short")


# ---------------------------------------- dispatch, control, presence (§5-§7)

def test_s5_dispatch_sign_verify_round_trip():
    signed = crypto.sign(dispatch(), KEYS.sign_key)
    decoded = wire.decode(wire.encode(signed), "dispatch")
    crypto.verify(decoded, KEYS.sign_key)
    crypto.verify(signed, KEYS.sign_key)
    assert crypto.sign(signed, KEYS.sign_key) == signed


@pytest.mark.parametrize("message", [
    lambda: wire.Control.cancel("918b0612", 1, "operator"),
    lambda: wire.Presence.build("gpu-box", "a" * 32, "online", host="h", version="0.1.0", max_jobs=2,
                                running=["918b0612"]),
])
def test_s6_s7_control_and_presence_signed_like_dispatch(message):
    msg = message()
    signed = crypto.sign(msg, KEYS.sign_key)
    crypto.verify(wire.decode(wire.encode(signed), msg.kind), KEYS.sign_key)
    with pytest.raises(SignatureError, match=f"^{msg.kind} sig verify failed$"):
        crypto.verify(signed, crypto.derive_keys("another-secret-" + "q" * 30).sign_key)


@pytest.mark.parametrize("change", [
    lambda p: p.pop("sig"),
    lambda p: p.__setitem__("sig", "0" * 64),
    lambda p: p.__setitem__("sig", None),
    lambda p: p.__setitem__("session", "other-box"),
    lambda p: p.__setitem__("attempt_id", 2),
    lambda p: p["contract"].__setitem__("timeout_sec", 1),
    lambda p: p["sealed"].__setitem__("nonce", wire.b64url_encode(bytes(12))),
])
def test_s5_bad_dispatch_sig_refused(change):
    payload = crypto.sign(dispatch(), KEYS.sign_key)
    change(payload)
    with pytest.raises(SignatureError, match="^dispatch sig verify failed$"):
        crypto.verify(payload, KEYS.sign_key)


def test_s5_seal_key_does_not_sign():
    payload = crypto.sign(dispatch(), KEYS.seal_key)
    with pytest.raises(SignatureError):
        crypto.verify(payload, KEYS.sign_key)


# ---------------------------------------------------------------- seal (§5)

def test_s5_seal_round_trip_and_no_clear_text():
    brief = "refactor the parser — ✓ " * 10
    sealed = sealed_for(brief=brief)
    assert sealed["alg"] == "A256GCM"
    assert len(base64.urlsafe_b64decode(sealed["nonce"])) == 12
    # ciphertext = canonical plaintext + 16-byte tag
    plaintext = wire.canonical({"auth_token": AUTH, "brief": brief})
    assert len(base64.urlsafe_b64decode(sealed["ciphertext"])) == len(plaintext) + 16
    assert crypto.open_sealed(KEYS.seal_key, sealed, job_id="918b0612", attempt_id=1,
                              dispatch_token=TOKEN) == (AUTH, brief)
    signed = crypto.sign(dispatch(sealed=sealed), KEYS.sign_key)
    on_wire = wire.encode(signed)
    assert AUTH.encode() not in on_wire and b"refactor" not in on_wire


def test_s5_seal_nonce_is_fresh():
    assert sealed_for()["nonce"] != sealed_for()["nonce"]


def test_s5_seal_accepts_unpadded_base64_and_wire_sealed():
    # A 12-byte nonce never pads; pick a brief length whose ciphertext does.
    sealed = next(s for s in (sealed_for(brief="x" * n) for n in range(3)) if s["ciphertext"].endswith("="))
    brief = crypto.open_sealed(KEYS.seal_key, sealed, job_id="918b0612", attempt_id=1, dispatch_token=TOKEN)[1]
    stripped = {**sealed, "nonce": sealed["nonce"].rstrip("="), "ciphertext": sealed["ciphertext"].rstrip("=")}
    assert crypto.open_sealed(KEYS.seal_key, stripped, job_id="918b0612", attempt_id=1,
                              dispatch_token=TOKEN)[1] == brief
    assert crypto.open_sealed(KEYS.seal_key, wire.Sealed.from_dict(stripped), job_id="918b0612",
                              attempt_id=1, dispatch_token=TOKEN)[1] == brief


def _raw_seal(plaintext: bytes, nonce: bytes = bytes(12)) -> dict[str, str]:
    ad = f"918b0612:1:{TOKEN}".encode()
    return {"alg": "A256GCM", "nonce": wire.b64url_encode(nonce),
            "ciphertext": wire.b64url_encode(AESGCM(KEYS.seal_key).encrypt(nonce, plaintext, ad))}


def _flip_b64(text: str) -> str:
    raw = bytearray(base64.urlsafe_b64decode(text))
    raw[0] ^= 1
    return wire.b64url_encode(bytes(raw))


@pytest.mark.parametrize("case", [
    "wrong_key", "wrong_job", "wrong_attempt", "wrong_token", "tampered_ciphertext", "tampered_nonce",
    "bad_base64", "short_nonce", "alg", "missing_nonce", "not_mapping", "truncated_tag",
    "inner_array", "inner_extra_field", "inner_not_json", "inner_not_utf8", "inner_empty_token",
])
def test_s5_seal_that_does_not_open_refused(case):
    good = sealed_for()
    key, job_id, attempt, token, sealed = KEYS.seal_key, "918b0612", 1, TOKEN, dict(good)
    if case == "wrong_key":
        key = crypto.derive_keys("another-secret-" + "q" * 30).seal_key
    elif case == "wrong_job":
        job_id = "918b0613"
    elif case == "wrong_attempt":
        attempt = 2
    elif case == "wrong_token":
        token = OTHER_TOKEN
    elif case == "tampered_ciphertext":
        sealed["ciphertext"] = _flip_b64(good["ciphertext"])
    elif case == "tampered_nonce":
        sealed["nonce"] = _flip_b64(good["nonce"])
    elif case == "bad_base64":
        sealed["ciphertext"] = "!!" + good["ciphertext"]
    elif case == "short_nonce":
        sealed["nonce"] = wire.b64url_encode(bytes(8))
    elif case == "alg":
        sealed["alg"] = "A128GCM"
    elif case == "missing_nonce":
        del sealed["nonce"]
    elif case == "not_mapping":
        sealed = ["A256GCM"]  # type: ignore[assignment]
    elif case == "truncated_tag":
        sealed["ciphertext"] = wire.b64url_encode(base64.urlsafe_b64decode(good["ciphertext"])[:-1])
    elif case == "inner_array":
        sealed = _raw_seal(b"[]")
    elif case == "inner_extra_field":
        sealed = _raw_seal(wire.canonical({"auth_token": "a", "brief": "b", "x": 1}))
    elif case == "inner_not_json":
        sealed = _raw_seal(b"{not json")
    elif case == "inner_not_utf8":
        sealed = _raw_seal(b'{"auth_token":"\xff","brief":""}')
    elif case == "inner_empty_token":
        sealed = _raw_seal(wire.canonical({"auth_token": "", "brief": "b"}))
    with pytest.raises(SignatureError) as info:
        crypto.open_sealed(key, sealed, job_id=job_id, attempt_id=attempt, dispatch_token=token)
    assert str(info.value) == "seal does not open"


def test_s5_raw_seal_helper_opens_when_well_formed():
    """Guards the refusal cases above: the same helper with a good plaintext opens."""
    sealed = _raw_seal(wire.canonical({"auth_token": "a", "brief": "b"}))
    assert crypto.open_sealed(KEYS.seal_key, sealed, job_id="918b0612", attempt_id=1,
                              dispatch_token=TOKEN) == ("a", "b")


def test_s5_seal_refuses_bad_identity_and_nonce():
    with pytest.raises(Exception, match="job id"):
        sealed_for(job_id="bad")
    with pytest.raises(ValueError, match="12 bytes"):
        sealed_for(nonce=bytes(8))


def test_s5_max_brief_bytes():
    assert crypto.MAX_BRIEF_BYTES == 512 * 1024
    # A brief at the cap still fits the dispatch payload cap once sealed and signed.
    signed = crypto.sign(dispatch(sealed=sealed_for(brief="b" * crypto.MAX_BRIEF_BYTES)), KEYS.sign_key)
    raw = wire.encode(signed)
    assert len(raw) <= wire.MAX_DISPATCH_BYTES
    crypto.verify(wire.decode(raw, "dispatch"), KEYS.sign_key)


# ------------------------------------------------------------- properties

_TEXT = st.text(st.characters(exclude_categories=("Cc", "Cs", "Zl", "Zp")), max_size=30)
_METRICS = st.dictionaries(_TEXT.filter(lambda k: k not in {"attempt_id", "dispatch_token", "session",
                                                            "hmac_sig", "exit_code", "heartbeat"}),
                           st.one_of(st.integers(-(10**6), 10**6), _TEXT, st.booleans(), st.none()),
                           max_size=3)


def _still_accepted(raw: bytes, expect: str, check: Any) -> bool:
    try:
        check(wire.decode(raw, expect))
    except (DecodeError, SignatureError):
        return False
    return True


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None)
@given(detail=_TEXT, metrics=_METRICS, seq=st.integers(1, 10**9), data=st.data())
def test_s3_1_any_single_byte_flip_of_signed_event_is_refused(detail, metrics, seq, data):
    """No floats or control characters here: `1.0`/`1e0` and `\\u001f`/`\\u001F` parse to the same value."""
    payload = wire.Event.build("918b0612", seq, "progress", detail, attempt_id=1, dispatch_token=TOKEN,
                               session="gpu-box", data=metrics, timestamp="2026-06-20T14:48:58Z")
    raw = wire.encode(crypto.sign_event(payload, AUTH))
    assert _still_accepted(raw, "event", lambda m: crypto.verify_event(m, AUTH))
    index = data.draw(st.integers(0, len(raw) - 1), label="index")
    mask = data.draw(st.integers(1, 255), label="mask")
    flipped = bytearray(raw)
    flipped[index] ^= mask
    assert not _still_accepted(bytes(flipped), "event", lambda m: crypto.verify_event(m, AUTH))


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None)
@given(brief=_TEXT, data=st.data())
def test_s5_any_single_byte_flip_of_signed_dispatch_is_refused(brief, data):
    raw = wire.encode(crypto.sign(dispatch(sealed=sealed_for(brief=brief)), KEYS.sign_key))
    assert _still_accepted(raw, "dispatch", lambda m: crypto.verify(m, KEYS.sign_key))
    index = data.draw(st.integers(0, len(raw) - 1), label="index")
    mask = data.draw(st.integers(1, 255), label="mask")
    flipped = bytearray(raw)
    flipped[index] ^= mask
    assert not _still_accepted(bytes(flipped), "dispatch", lambda m: crypto.verify(m, KEYS.sign_key))


_JOB = st.from_regex(r"[0-9a-f]{8}", fullmatch=True)
_TOK = st.from_regex(r"[0-9a-f]{32}", fullmatch=True)


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None)
@given(job_id=_JOB, attempt=st.integers(1, 10**6), token=_TOK, brief=st.text(max_size=200),
       other_job=_JOB, other_attempt=st.integers(1, 10**6), other_token=_TOK, which=st.sampled_from("jat"))
def test_s5_seal_opens_only_for_its_own_attempt(job_id, attempt, token, brief, other_job, other_attempt,
                                                other_token, which):
    brief = brief.encode("utf-8", "replace").decode("utf-8")  # UTF-8 text, as §5 requires
    sealed = sealed_for(job_id, attempt, token, brief)
    assert crypto.open_sealed(KEYS.seal_key, sealed, job_id=job_id, attempt_id=attempt,
                              dispatch_token=token) == (AUTH, brief)
    ident = {"job_id": job_id, "attempt_id": attempt, "dispatch_token": token}
    if which == "j" and other_job != job_id:
        ident["job_id"] = other_job
    elif which == "a" and other_attempt != attempt:
        ident["attempt_id"] = other_attempt
    elif which == "t" and other_token != token:
        ident["dispatch_token"] = other_token
    else:
        ident["attempt_id"] = attempt + 1
    with pytest.raises(SignatureError, match="^seal does not open$"):
        crypto.open_sealed(KEYS.seal_key, sealed, **ident)
