"""JSON of the wire (PROTOCOL §3.1, §3.2 rule 1): the one payload parser and the
canonical form every signature covers. Import these through `mam.shared.protocol.wire`.

`parse_object` refuses, before any field rule runs, what is not one UTF-8
JSON object within the size cap of its kind: duplicate keys (two readers
would see two messages), NaN and infinities, nesting past MAX_DEPTH.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NoReturn

from mam.shared.protocol.errors import DecodeError
from mam.shared.protocol.wire.fields import (
    MAX_DEPTH,
    MAX_DISPATCH_BYTES,
    MAX_LOG_MESSAGE_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_RESULT_MESSAGE_BYTES,
    Invalid,
    show,
    type_name,
)

MAX_PAYLOAD_BYTES: Mapping[str, int] = MappingProxyType({
    "event": MAX_MESSAGE_BYTES,
    "state": MAX_MESSAGE_BYTES,
    "dispatch": MAX_DISPATCH_BYTES,
    "control": MAX_MESSAGE_BYTES,
    "presence": MAX_MESSAGE_BYTES,
    "revoked": MAX_MESSAGE_BYTES,
    "drain": MAX_MESSAGE_BYTES,
    "log": MAX_LOG_MESSAGE_BYTES,
    "result": MAX_RESULT_MESSAGE_BYTES,
})
# How much of a json error text a refusal shows.
_SHOW_ERROR_CHARS = 80
_INFINITIES = (float("inf"), float("-inf"))


# ----------------------------------------------------------- canonical form

def _json_default(value: object) -> dict[Any, Any]:
    # Frozen message parts (mappingproxy) serialize as the dicts they wrap.
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def canonical_json(obj: object) -> bytes:
    """The canonical bytes of §3.1 of a JSON-able value (read-only mappings allowed).

    `json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")`.

    Raises:
        ValueError: NaN or infinity inside (not JSON); UnicodeEncodeError: a lone surrogate;
        TypeError: a value JSON cannot hold.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False, default=_json_default).encode("utf-8")


# ----------------------------------------------------------------- parsing

class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A duplicated key would let two implementations read two different signed messages.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _reject_constant(name: str) -> NoReturn:
    raise Invalid(f"payload holds {name}, which is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in _INFINITIES:
        raise Invalid(f"payload holds number {show(text)}, too large for a float")
    return value


def parse_object(raw: object, expect: str) -> dict[str, Any]:
    """Parse a payload of kind `expect` into a JSON object (§3.2 rule 1), size cap first.

    Args:
        raw: bytes, bytearray, memoryview or str, as received.
        expect: a key of MAX_PAYLOAD_BYTES.
    Returns:
        the object (plain dicts and lists).
    Raises:
        DecodeError: `empty: zero-length payload` (raw attached).
        Invalid: over the cap, not UTF-8, not JSON, or not an object.
        TypeError: `raw` is neither bytes nor str.
    """
    if isinstance(raw, (bytearray, memoryview)):
        raw = bytes(raw)
    if not isinstance(raw, (bytes, str)):
        raise TypeError(f"decode() takes bytes or str, not {type(raw).__name__}")
    if len(raw) == 0:
        raise DecodeError("empty: zero-length payload", raw)
    cap = MAX_PAYLOAD_BYTES[expect]
    if len(raw) > cap:  # chars <= bytes, so this is safe for str before encoding
        raise Invalid(f"payload is {len(raw)} {'bytes' if isinstance(raw, bytes) else 'characters'}, "
                      f"at most {cap} bytes are allowed for {expect}")
    if isinstance(raw, str):
        try:
            raw_bytes = raw.encode("utf-8")
        except UnicodeEncodeError:
            raise Invalid("payload is not UTF-8 (lone surrogate)") from None
        if len(raw_bytes) > cap:
            raise Invalid(f"payload is {len(raw_bytes)} bytes, at most {cap} bytes are allowed for {expect}")
        text = raw
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Invalid(f"payload is not UTF-8 (bad byte at offset {exc.start})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant,
                         parse_float=_finite_float)
    except _DuplicateKey as exc:
        raise Invalid(f"duplicate key {show(exc.args[0])} in a JSON object") from None
    except json.JSONDecodeError as exc:
        raise Invalid(f"payload is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise Invalid(f"payload nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise Invalid(f"payload is not JSON ({show(str(exc), _SHOW_ERROR_CHARS)})") from None
    if not isinstance(obj, dict):
        raise Invalid(f"payload is {type_name(obj)}, expected a JSON object")
    return obj
