"""The hub's dispatch: seal the brief and the job's auth_token, sign, publish
retained (PROTOCOL §5).

`build_dispatch` is pure (record + brief + keys -> signed wire dict) so the
runner's tests and the hub share one way of making a dispatch.
"""

from __future__ import annotations

import logging
import socket
from datetime import datetime
from typing import Any

from mam.shared import names
from mam.shared.errors import UsageError

log = logging.getLogger("mam.dispatch")


def hub_name() -> str:
    """The `origin` of a dispatch (§5): MAM_HUB_NAME, else the host name."""
    import os

    return (os.environ.get("MAM_HUB_NAME") or socket.gethostname() or "hub")[:255]


def check_brief(brief: str) -> str:
    """Refuse a brief that is empty or larger than 512 KiB of UTF-8 (§5).

    Raises:
        UsageError: with the size found and the limit.
    """
    from mam.shared.crypto import MAX_BRIEF_BYTES

    if not isinstance(brief, str) or not brief.strip():
        raise UsageError("the brief is empty: give --brief TEXT, --brief-file PATH or --brief-file -")
    size = len(brief.encode("utf-8", "surrogatepass"))
    if size > MAX_BRIEF_BYTES:
        raise UsageError(f"the brief is {size} bytes, larger than the {MAX_BRIEF_BYTES}-byte limit (§5)")
    return brief


def build_dispatch(record: dict[str, Any], brief: str, keys: Any, *, origin: str | None = None,
                   issued_at: datetime | None = None) -> dict[str, Any]:
    """The signed dispatch of §5 for the record's current attempt.

    Args:
        record: the hub record (job_id, session, attempt_id, dispatch_token,
            auth_token and the contract fields).
        brief: UTF-8 text, at most 512 KiB.
        keys: `DispatchKeys` from MAM_DISPATCH_SECRET.
        origin: the hub's name (default `hub_name()`).
        issued_at: aware datetime (default now); `expires_at` = issued_at + ack_timeout_sec.
    Returns:
        the wire dict, `sig` included.
    Raises:
        UsageError: a bad brief or record field.
    """
    from mam.shared import crypto, wire

    check_brief(brief)
    sealed = crypto.seal(keys.seal_key, job_id=record["job_id"], attempt_id=record["attempt_id"],
                         dispatch_token=record["dispatch_token"], auth_token=record["auth_token"],
                         brief=brief)
    contract = wire.Contract(**{key: record[key] for key in ("heartbeat_sec", "heartbeat_misses",
                                                                "ack_timeout_sec", "idle_timeout_sec",
                                                                "timeout_sec")})
    dispatch = wire.Dispatch.build(record["job_id"], record["session"], record["attempt_id"],
                                   record["dispatch_token"], origin=origin or hub_name(),
                                   contract=contract, sealed=sealed, issued_at=issued_at)
    return crypto.sign(dispatch.to_dict(), keys.sign_key)


def encode_dispatch(signed: dict[str, Any]) -> bytes:
    """Canonical bytes of a signed dispatch; refuses one over the 1 MiB wire cap.

    Raises:
        UsageError: the encoded dispatch is too large (a brief full of escapes).
    """
    from mam.shared import wire
    from mam.shared.errors import ProtocolError

    try:
        return wire.encode(signed)
    except ProtocolError as exc:
        raise UsageError(f"the dispatch is too large to publish: {exc}") from None


def publish_dispatch(client: Any, signed: dict[str, Any]) -> None:
    """Publish the signed dispatch retained, QoS 1, and wait for the PUBACK (§2, §5).

    Raises:
        PublishTimeout, BrokerError.
    """
    client.publish(names.dispatch_topic(signed["job_id"], client.config.topic_root),
                   encode_dispatch(signed), retain=True)
