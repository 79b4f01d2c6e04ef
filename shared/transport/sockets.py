"""Socket-level helpers of the MQTT client (shared/mqtt.py): TLS contexts that close
what paho drops, TCP_NODELAY, endpoint text and connect-failure reasons (§13).
No paho import here."""

from __future__ import annotations

import contextlib
import socket
import ssl
from typing import Any

from mam.shared.config import BrokerConfig


def endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class TlsContext(ssl.SSLContext):
    """An SSLContext that remembers the sockets it wraps: paho drops the socket of a
    failed TLS handshake without closing it, so we close it ourselves."""

    wrapped: list[ssl.SSLSocket]

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        sock = super().wrap_socket(*args, **kwargs)
        self.wrapped.append(sock)
        return sock

    def close_wrapped(self) -> None:
        for sock in self.wrapped:
            try:
                sock.close()
            except OSError:
                pass
        self.wrapped.clear()


def tls_context(config: BrokerConfig) -> TlsContext:
    """A client TLS context: system or given CA, optional client cert (mTLS), TLS 1.2 minimum,
    host name checked."""
    context = TlsContext(ssl.PROTOCOL_TLS_CLIENT)
    context.wrapped = []
    if config.ca_certs:
        context.load_verify_locations(cafile=config.ca_certs)
    else:
        context.load_default_certs()
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if config.certfile:
        context.load_cert_chain(config.certfile, config.keyfile or None)
    return context


def no_delay(client: Any, userdata: Any, sock: Any) -> None:
    """TCP_NODELAY on each new socket (paho leaves Nagle on): else a packet sent while the previous one
    awaits its TCP ACK (a SUBSCRIBE after a PUBACK) waits for the broker's delayed ACK, ~40 ms."""
    with contextlib.suppress(OSError, AttributeError):  # a websocket wraps the TCP socket
        getattr(sock, "_socket", sock).setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def reason_of(exc: BaseException) -> str:
    """A short reason for a failed connect, never including credentials."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (TimeoutError, ssl.SSLError, OSError)) and getattr(exc, "strerror", None):
        return str(exc.strerror).lower()
    if isinstance(exc, TimeoutError):
        return "timed out"
    return type(exc).__name__
