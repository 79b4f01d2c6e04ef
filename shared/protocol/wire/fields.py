"""The field rules every wire message applies (PROTOCOL §1, §3-§7): the parts of
`mam.shared.protocol.wire` below the message types.

Each `check_*` returns its value or raises `Invalid` (one broken rule, its text
without the `malformed:` word); `run_check` turns that into the public
`DecodeError` of §3.2 and `build` into the `UsageError` a publisher sees.
Also here: §3 timestamps, base64url (§5), the deep freeze of `data`, and the
limits of §3-§7 (`MAX_*`). Import these through `mam.shared.protocol.wire`.
"""

from __future__ import annotations

import base64
import binascii
import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, TypeVar

from mam.shared.protocol import names
from mam.shared.protocol.errors import DecodeError, UsageError

SCHEMA_VERSION = 1

SEAL_ALG = "A256GCM"
SEAL_NONCE_BYTES = 12
GCM_TAG_BYTES = 16
# §16 (v2): Ed25519 signatures (64 bytes, base64url) and seals to a runner's X25519 key.
SIG_ALG_ED25519 = "ed25519"
SEAL_ALG_V2 = "X25519-A256GCM"
ED25519_SIG_BYTES = 64
X25519_KEY_BYTES = 32
# The optional fields v2 adds (§16): absent on v1 messages.
V2_SIGNED_FIELDS = frozenset({"sig_alg"})
V2_SEALED_FIELDS = frozenset({"epk"})

MAX_DETAIL_CHARS = 1024
# Dispatch carries the sealed brief (<= 512 KiB, §5) and must fit NATS's default 1 MiB cap.
MAX_DISPATCH_BYTES = 1024 * 1024
# Events, states, controls and presence are small; 64 KiB leaves room for free metrics.
MAX_MESSAGE_BYTES = 64 * 1024
# §15 log chunks: 64 KiB of output, sealed (+16-byte tag) and base64url (4/3), plus the envelope.
MAX_LOG_MESSAGE_BYTES = 96 * 1024
MAX_RESULT_MESSAGE_BYTES = 384 * 1024  # §18: a result chunk of 256 KiB, sealed, base64url
# Nesting bound of a whole payload (top object = 1, data = 2): free metrics may nest a little.
MAX_DEPTH = 10
# Integers a JSON peer in any language reads exactly (2**53 - 1).
MAX_SAFE_INT = 2**53 - 1
# data.exit_code is a signed 32-bit process status.
MIN_EXIT_CODE, MAX_EXIT_CODE = -(2**31), 2**31 - 1
# Contract durations beyond a year are mistakes, and huge ones overflow monotonic-clock arithmetic.
MAX_CONTRACT_SEC = 366 * 24 * 3600
MAX_HEARTBEAT_MISSES = 10_000
MAX_RUNNING = 1024
MAX_NAME_CHARS = 255  # origin, host
MAX_VERSION_CHARS = 64
MAX_REASON_CHARS = 256
# How much of a wire value, a field path, an unknown-field list an error message shows.
SHOW_CHARS = 40
SHOW_PATH_CHARS = 60
_UNKNOWN_SHOWN = 3

_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_B64URL_RE = re.compile(r"[A-Za-z0-9_-]*={0,2}")
_TS_RE = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,9}))?Z")
_TS_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
_MICROSECOND_DIGITS = 6
_SURROGATE_RE = re.compile("[\ud800-\udfff]")

T = TypeVar("T")

class Invalid(Exception):
    """One rule broken; the text is the reason without its `malformed:` word (§3.2)."""


class SchemaMismatch(Invalid):
    """`schema_version` is not SCHEMA_VERSION (§3.2 rule 2)."""


# ------------------------------------------------------------------ helpers

def show(value: object, limit: int = SHOW_CHARS) -> str:
    """A short one-line repr of a wire value (never the whole of a big payload), at most `limit` chars."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def type_name(value: object) -> str:
    """The JSON type of a value in an error message ("an integer", "null")."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def check_int(value: object, where: str, low: int = 1, high: int = MAX_SAFE_INT) -> int:
    """`value` if it is an integer in low..high (never a boolean); `where` names the field. Raises `Invalid`."""
    # bool is an int subclass in Python but never an integer on the wire.
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(f"{where} must be an integer, got {type_name(value)} {show(value)}")
    if value < low or value > high:
        bound = f">= {low}" if high == MAX_SAFE_INT else f"between {low} and {high}"
        raise Invalid(f"{where} must be an integer {bound}, got {value}")
    return value


def bad_char(text: str) -> str | None:
    """The first control character (Unicode Cc, lone surrogate, line or paragraph separator) of `text`."""
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp"):
            return ch
    return None


def safe_line(text: str, max_chars: int) -> str:
    """`text` as a `detail` may carry it: whitespace runs (newlines too) as one space, other
    control characters escaped (`\\x1b`), stripped and cut to `max_chars`."""
    out: list[str] = []
    for ch in " ".join(text.split()):
        out.append(ch.encode("unicode_escape").decode("ascii") if bad_char(ch) else ch)
    return "".join(out)[:max_chars]


def check_text(value: object, where: str, max_chars: int, *, empty_ok: bool = False) -> str:
    """`value` if it is a string of at most `max_chars` without control characters. Raises `Invalid`."""
    if not isinstance(value, str):
        raise Invalid(f"{where} must be a string, got {type_name(value)} {show(value)}")
    if not value and not empty_ok:
        raise Invalid(f"{where} must not be empty")
    if len(value) > max_chars:
        raise Invalid(f"{where} is {len(value)} characters, at most {max_chars} are allowed")
    bad = bad_char(value)
    if bad is not None:
        raise Invalid(f"{where} holds control character {bad!r}, which is not allowed")
    return value


def check_choice(value: object, where: str, allowed: Iterable[str]) -> str:
    """`value` if it is one of `allowed`. Raises `Invalid` listing them."""
    allowed = tuple(allowed)
    if not isinstance(value, str) or value not in allowed:
        raise Invalid(f"{where} is {show(value)}, expected one of {', '.join(allowed)}")
    return value


def check_job_id(value: object, where: str = "job_id") -> str:
    """`value` if it is a job id of §1 (8 lowercase hex). Raises `Invalid`."""
    if not isinstance(value, str) or not names.JOB_ID_RE.fullmatch(value):
        raise Invalid(f"{where} {show(value)} is invalid: expected 8 lowercase hex characters")
    return value


def check_hex32(value: object, where: str) -> str:
    """`value` if it is 32 lowercase hex (dispatch token, runner id, §1). Raises `Invalid`."""
    if not isinstance(value, str) or not names.TOKEN_RE.fullmatch(value):
        raise Invalid(f"{where} {show(value)} is invalid: expected 32 lowercase hex characters")
    return value


def check_hex64(value: object, where: str) -> str:
    """`value` if it is 64 lowercase hex (an HMAC-SHA256, §3.1, §5). Raises `Invalid`."""
    if not isinstance(value, str) or not _HEX64_RE.fullmatch(value):
        raise Invalid(f"{where} {show(value)} is invalid: expected 64 lowercase hex characters")
    return value


def check_session(value: object, where: str = "session") -> str:
    """`value` if it is a session name of §1. Raises `Invalid` naming the rule."""
    problem = names.session_problem(value)  # None only for a str
    # fullmatch as well: a `$` anchor alone lets a trailing newline through.
    if problem is None and isinstance(value, str) and not names.SESSION_RE.fullmatch(value):
        problem = "a line break is not allowed"
    if problem is not None or not isinstance(value, str):
        raise Invalid(f"{where} {show(value)} is invalid: {problem}")
    return value


def check_timestamp(value: object, where: str) -> str:
    """`value` if it is a §3 timestamp (see `parse_ts`). Raises `Invalid`."""
    if not isinstance(value, str):
        raise Invalid(f"{where} must be a string, got {type_name(value)} {show(value)}")
    try:
        parse_ts(value)
    except ValueError:
        raise Invalid(f"{where} {show(value)} is invalid: expected UTC YYYY-MM-DDTHH:MM:SSZ") from None
    return value


def b64url_decode(value: str) -> bytes:
    """Decode base64url text with or without `=` padding (§5).

    Args:
        value: base64url text (alphabet `A-Z a-z 0-9 - _`, optional padding).
    Returns:
        the decoded bytes.
    Raises:
        ValueError: not base64url.
    """
    if not isinstance(value, str) or not _B64URL_RE.fullmatch(value):
        raise ValueError("not base64url text")
    bare = value.rstrip("=")
    if len(bare) % 4 == 1:
        raise ValueError("base64url text has an impossible length")
    try:
        return base64.urlsafe_b64decode(bare + "=" * (-len(bare) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("not base64url text") from None


def b64url_encode(data: bytes) -> str:
    """`base64.urlsafe_b64encode` with padding kept, as text (§5)."""
    return base64.urlsafe_b64encode(data).decode("ascii")


def check_b64(value: object, where: str, *, exact: int | None = None, minimum: int = 0) -> str:
    """`value` if it is base64url decoding to `exact` (or at least `minimum`) bytes (§5). Raises `Invalid`."""
    if not isinstance(value, str):
        raise Invalid(f"{where} must be a string, got {type_name(value)} {show(value)}")
    try:
        data = b64url_decode(value)
    except ValueError as exc:
        raise Invalid(f"{where} is invalid: {exc}") from None
    if exact is not None and len(data) != exact:
        raise Invalid(f"{where} decodes to {len(data)} bytes, expected {exact}")
    if len(data) < minimum:
        raise Invalid(f"{where} decodes to {len(data)} bytes, expected at least {minimum}")
    return value


def check_sig(sig: object, sig_alg: object) -> None:
    """A v1 `sig` (64 hex, HMAC, §5-§7) when `sig_alg` is None, else an Ed25519 one (§16). Raises `Invalid`."""
    if sig_alg is None:
        check_hex64(sig, "sig")
        return
    check_choice(sig_alg, "sig_alg", (SIG_ALG_ED25519,))
    check_b64(sig, "sig", exact=ED25519_SIG_BYTES)


def check_fields(obj: Mapping[str, Any], expected: frozenset[str], prefix: str = "",
                 optional: frozenset[str] = frozenset()) -> None:
    """Refuse a missing or unknown field (§3-§7: exact field sets, plus the `optional` ones of §16);
    `prefix` is e.g. "contract.". Raises `Invalid`."""
    missing = sorted(expected - obj.keys())
    if missing:
        raise Invalid(f"missing field {', '.join(repr(prefix + m) for m in missing)}")
    unknown = sorted(str(u) for u in obj.keys() - expected - optional)
    if unknown:
        more = f" and {len(unknown) - _UNKNOWN_SHOWN} more" if len(unknown) > _UNKNOWN_SHOWN else ""
        raise Invalid(f"unknown field {', '.join(show(prefix + u) for u in unknown[:_UNKNOWN_SHOWN])}{more}")
    for key in sorted(optional & obj.keys()):
        if obj[key] is None:  # absent means v1; an explicit null would be a second spelling of it
            raise Invalid(f"{prefix}{key} must be a string, got null")


def freeze(value: Any) -> Any:
    """Deep read-only copy: dicts become mappingproxies, lists become tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Deep mutable copy of a frozen value: mappings become dicts, tuples become lists."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


def depth_problem(obj: Any, limit: int = MAX_DEPTH, path: str = "") -> str | None:
    """Iteratively check nesting depth (no recursion on hostile input); names the deepest field."""
    stack: list[tuple[Any, int, str]] = [(obj, 1, path)]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, Mapping):
            children: Iterable[tuple[str, Any]] = (
                (f"{where}.{key}" if where else str(key), child) for key, child in value.items())
        elif isinstance(value, (list, tuple)):
            children = ((f"{where}[{index}]", child) for index, child in enumerate(value))
        else:
            continue
        if depth > limit:
            return f"{show(where or 'payload', SHOW_PATH_CHARS)} nests deeper than {limit} levels"
        stack.extend((child, depth + 1, child_path) for child_path, child in children)
    return None


def surrogate_path(value: Any, path: str = "") -> str | None:
    """Where a lone surrogate (not encodable as UTF-8) sits, as a field path."""
    if isinstance(value, str):
        return (path or "payload") if _SURROGATE_RE.search(value) else None
    if isinstance(value, Mapping):
        for key, child in value.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SURROGATE_RE.search(key):
                return f"a key of {path or 'the payload'}"
            found = surrogate_path(child, where)
            if found:
                return found
    if isinstance(value, (list, tuple)):
        for index, child in enumerate(value):
            found = surrogate_path(child, f"{path}[{index}]")
            if found:
                return found
    return None


def check_data(value: object, *, require: Iterable[str]) -> Mapping[str, Any]:
    """Check an event's or state's `data` object and its reserved keys (§3, §4)."""
    if not isinstance(value, Mapping):
        raise Invalid(f"data must be an object, got {type_name(value)} {show(value)}")
    for key in require:
        if key not in value:
            raise Invalid(f"missing field 'data.{key}'")
    for key in value:
        if not isinstance(key, str):
            raise Invalid(f"data keys must be strings, got {show(key)}")
    if "attempt_id" in value:
        check_int(value["attempt_id"], "data.attempt_id")
    if "dispatch_token" in value:
        check_hex32(value["dispatch_token"], "data.dispatch_token")
    if "session" in value:
        check_session(value["session"], "data.session")
    if "hmac_sig" in value:
        check_hex64(value["hmac_sig"], "data.hmac_sig")
    if "exit_code" in value:
        check_int(value["exit_code"], "data.exit_code", MIN_EXIT_CODE, MAX_EXIT_CODE)
    if "heartbeat" in value and not isinstance(value["heartbeat"], bool):
        raise Invalid(f"data.heartbeat must be a boolean, got {type_name(value['heartbeat'])} "
                      f"{show(value['heartbeat'])}")
    problem = depth_problem(value, MAX_DEPTH - 1, "data")
    if problem:
        raise Invalid(problem)
    where = surrogate_path(value, "data")
    if where:
        raise Invalid(f"{where} holds a lone surrogate, which is not UTF-8")
    return value


def to_utc(dt: datetime) -> datetime:
    """`dt` in UTC. Raises ValueError when it is naive (its zone would be a guess)."""
    if dt.tzinfo is None or dt.utcoffset() is None:
        raise ValueError("naive datetime: pass an aware one, e.g. datetime.now(timezone.utc)")
    return dt.astimezone(UTC)


# --------------------------------------------------------------- timestamps

def format_ts(dt: datetime | None = None) -> str:
    """A §3 timestamp: UTC, `YYYY-MM-DDTHH:MM:SSZ`, fraction dropped.

    Args:
        dt: an aware datetime; None means now.
    Returns:
        e.g. "2026-06-20T14:48:58Z".
    Raises:
        ValueError: `dt` is naive (its zone would be a guess).
    """
    moment = datetime.now(UTC) if dt is None else to_utc(dt)
    return moment.strftime(_TS_FORMAT)


def parse_ts(text: str) -> datetime:
    """Parse a §3 timestamp (`YYYY-MM-DDTHH:MM:SS[.fraction]Z`) into an aware UTC datetime.

    Args:
        text: the timestamp; a fraction of 1-9 digits is accepted (truncated to microseconds).
    Returns:
        an aware datetime in UTC.
    Raises:
        ValueError: any other form, or an impossible date or time.
    """
    match = _TS_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"timestamp {show(text)} is not YYYY-MM-DDTHH:MM:SS[.fraction]Z")
    year, month, day, hour, minute, second, fraction = match.groups()
    micro = int((fraction or "0")[:_MICROSECOND_DIGITS].ljust(_MICROSECOND_DIGITS, "0"))
    return datetime(int(year), int(month), int(day), int(hour), int(minute), int(second), micro,
                    tzinfo=UTC)


# ------------------------------------------------------- construction glue

def is_int(value: object) -> bool:
    """True for an integer that is not a boolean."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_schema(value: object) -> None:
    """Refuse a `schema_version` other than SCHEMA_VERSION (§3.2 rule 2). Raises `SchemaMismatch`, `Invalid`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(f"schema_version must be an integer, got {type_name(value)} {show(value)}")
    if value != SCHEMA_VERSION:
        raise SchemaMismatch(f"schema_version is {value}, expected {SCHEMA_VERSION}")


def run_check(check: Callable[[], T]) -> T:
    """Run a rule check and return its result; `Invalid` becomes the public `DecodeError`
    (`malformed: ...` or `schema_mismatch: ...`, §3.2; the raw payload is attached by `decode`)."""
    try:
        return check()
    except SchemaMismatch as exc:
        raise DecodeError(f"schema_mismatch: {exc}") from None
    except Invalid as exc:
        raise DecodeError(f"malformed: {exc}") from None


def strip_word(reason: str) -> str:
    """A `DecodeError` reason without its leading `malformed:` word."""
    return reason.split(": ", 1)[1] if ": " in reason else reason


def build(cls: type[T], **kwargs: object) -> T:
    """`cls(**kwargs)` for a publisher: a rule failure becomes one `UsageError` line naming the field."""
    try:
        return cls(**kwargs)
    except DecodeError as exc:
        raise UsageError(f"{cls.__name__.lower()} not built: {strip_word(exc.reason)}") from None


def ts_arg(value: datetime | str | None) -> str:
    """A timestamp argument of a builder as §3 text: text as is, a datetime formatted, None now."""
    if isinstance(value, str):
        return value
    return format_ts(value)


def run_inner(make: Callable[[], T]) -> T:
    """Construct a nested part inside an outer check: keep one error path (`Invalid`)."""
    try:
        return make()
    except DecodeError as exc:
        raise Invalid(strip_word(exc.reason)) from None


# ----------------------------------------------------- parsed payloads (§3.2)

def _check_decoded(obj: dict[str, Any], make: Callable[[dict[str, Any]], T]) -> T:
    # §3.2: the schema version is judged before any other field.
    if "schema_version" not in obj:
        raise Invalid("missing field 'schema_version'")
    check_schema(obj["schema_version"])
    problem = depth_problem(obj)
    if problem:
        raise Invalid(problem)
    where = surrogate_path(obj)
    if where:
        raise Invalid(f"{where} holds a lone surrogate, which is not UTF-8")
    return run_inner(lambda: make(obj))


def decode_object(obj: object, make: Callable[[dict[str, Any]], T]) -> T:
    """Apply §3.2 rule 2 (`schema_version` first) and then `make` (a message's field rules) to a parsed payload.

    Args:
        obj: the parsed JSON object; make: builds the message from it.
    Returns:
        what `make` returns.
    Raises:
        DecodeError: `malformed: ...` or `schema_mismatch: ...` (no raw attached).
    """
    if not isinstance(obj, Mapping):
        raise DecodeError(f"malformed: payload is {type_name(obj)}, expected a JSON object", None)
    return run_check(lambda: _check_decoded(dict(obj), make))


def check_sealed(sealed: object, max_chars: int, why: str, name: str = "sealed") -> None:
    """`sealed` = {"alg": "A256GCM", "nonce", "ciphertext"} (base64url, each at most
    `max_chars`), as `crypto.seal_bytes` makes it; `why` says in the message why it must be.
    Raises `Invalid`."""
    if not isinstance(sealed, Mapping) or set(sealed) != {"alg", "nonce", "ciphertext"}:
        raise Invalid(f"{name} must be an object of alg, nonce and ciphertext ({why})")
    if sealed["alg"] != SEAL_ALG:
        raise Invalid(f"{name}.alg {show(sealed['alg'])} is invalid: expected {SEAL_ALG}")
    for key in ("nonce", "ciphertext"):
        value = sealed[key]
        if not isinstance(value, str) or not 1 <= len(value) <= max_chars \
                or not all(c.isascii() and (c.isalnum() or c in "-_=") for c in value):
            raise Invalid(f"{name}.{key} is invalid: expected base64url of at most {max_chars} characters")
