"""The MQTT client of mam-fleet: the ONLY module that imports paho-mqtt.

Everything above this module speaks in our own terms (`Message`,
`BrokerUnavailable`, `PublishTimeout`); paho's return codes are turned into
our exceptions here, once (STYLE.md "Errors").

Threading rules (eclipse/paho.mqtt.python#354, #226, #177): paho runs callbacks on its
network thread while holding its own locks. So our callbacks only record
state (events, sets, a `queue.Queue`) and never publish, and no lock of ours
is held while calling into paho. The one paho call made from a callback is
the re-subscribe in `on_connect` after a reconnect, which paho documents as
the way to keep subscriptions (it only queues a packet; its callback lock is
re-entrant).

PROTOCOL §13 timing: CONNACK within 10 s, PUBACK within 5 s, up to 3
attempts with a delay of `min(0.5 × 2^(attempt-1), 8.0)` s; §10 "Broker
loss": reconnect with backoff and re-subscribe, to the next host of a
fail-over list (a NATS cluster, docs/deployment.md).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode

from mam.shared.config import NO_BROKER, BrokerConfig
from mam.shared.protocol.errors import BrokerError, BrokerUnavailable, ConfigError, PublishTimeout
from mam.shared.transport import sockets

log = logging.getLogger("mam.mqtt")

QOS_AT_MOST_ONCE = 0
QOS_AT_LEAST_ONCE = 1
QOS_EXACTLY_ONCE = 2

CONNACK_TIMEOUT_S = 10.0  # §13
PUBACK_TIMEOUT_S = 5.0  # §13
SUBACK_TIMEOUT_S = 5.0
DEFAULT_ATTEMPTS = 3  # §13
RETRY_BASE_DELAY_S = 0.5  # §13: min(0.5 × 2^(attempt-1), 8.0)
RETRY_MAX_DELAY_S = 8.0
RECONNECT_MIN_DELAY_S = 1
RECONNECT_MAX_DELAY_S = 8
# With a fail-over list each reconnect goes to the next host: a cluster node still electing
# leaders holds a CONNECT for up to 5 s, so the pause between two nodes stays short.
RECONNECT_MAX_DELAY_FAILOVER_S = 2
CLOSE_TIMEOUT_S = 5.0
# The start of the one-line BrokerUnavailable message; host:port (reason) pairs follow.
UNREACHABLE = "cannot connect to the MQTT broker: "
# paho's socket connect timeout never goes below this, whatever is left of a deadline.
MIN_CONNECT_TIMEOUT_S = 0.1
# A SUBACK return code of 0x80 or more refuses that filter (MQTT 3.1.1 section 3.9.3).
SUBACK_FAILURE = 0x80
# Pause before a refused re-subscribe after a reconnect is sent again (a cluster electing leaders).
RESUBSCRIBE_DELAY_S = 1.0
# After a reconnect every remembered filter is subscribed again at once and these many seconds later:
# a NATS cluster electing leaders may answer a SUBSCRIBE late or never, or store a retained message
# (a dispatch) only after the new subscription looked for it; a SUBSCRIBE of the same filter gets the
# retained messages again (MQTT 3.1.1 section 3.8.4), and receivers drop what they already had.
RESUBSCRIBE_AGAIN_S = (5.0, 15.0, 45.0)

Will = tuple[str, bytes, int, bool]


@dataclass(frozen=True)
class Message:
    """One received MQTT message: its topic (NATS subjects appear with '/' again), raw payload
    (zero-length: a cleared retained topic, §2) and whether it was delivered as retained."""

    topic: str
    payload: bytes
    retain: bool

    def __repr__(self) -> str:  # payloads may carry tokens: show only the size
        return f"Message(topic={self.topic!r}, payload=<{len(self.payload)} bytes>, retain={self.retain})"


def new_client_id(prefix: str, role: str) -> str:
    """A fresh MQTT client id `<prefix>-<role>-<random>` (§13): prefix MQTT_CLIENT_ID_PREFIX,
    role "hub", "runner", "publish" or "observer"; 8 random hex characters, so ids never collide."""
    return f"{prefix}-{role}-{secrets.token_hex(4)}"


def retry_delay_s(attempt: int) -> float:
    """Delay before the attempt after `attempt` (1-based): `min(0.5 × 2^(attempt-1), 8.0)` s (§13)."""
    return min(RETRY_BASE_DELAY_S * 2.0 ** (attempt - 1), RETRY_MAX_DELAY_S)


def reconnect_max_delay_s(hosts: tuple[str, ...]) -> int:
    """The cap of paho's reconnect backoff, in seconds, for the fail-over list `hosts` (§13).

    One host: `RECONNECT_MAX_DELAY_S` (8). Several: `RECONNECT_MAX_DELAY_FAILOVER_S` (2), since
    each attempt goes to the next host and a node of a cluster that lost a peer may hold a
    CONNECT for 5 s before it fails it (docs/deployment.md "NATS cluster").
    """
    return RECONNECT_MAX_DELAY_FAILOVER_S if len(hosts) > 1 else RECONNECT_MAX_DELAY_S


class MqttClient:
    """A connected MQTT client for one role (hub, runner, publisher, observer).

    Args:
        config: where and how to connect (§13); `hosts` is tried in order.
        role: a word put into the client id (`<prefix>-<role>-<random>`).
        will: the Last Will as (topic, payload bytes, qos, retain), or None (§7).
        clean_session: MQTT clean session flag.
        client_id: an explicit client id (default `new_client_id`).
        resubscribe_again_s: delays after each reconnect of the further re-subscribes
            (RESUBSCRIBE_AGAIN_S), seconds.

    Attributes:
        messages: a `queue.Queue[Message]` of incoming messages, filled by paho's thread.
        connected: a `threading.Event`, set while a connection is up.
        reconnected: a `threading.Event` set after every reconnect (never after the
            first connect); clear it once you re-read retained state (§10).
        client_id: the MQTT client id in use.

    Nothing touches the network before `connect()`; use as a context manager
    or call `close()` (idempotent).
    """

    def __init__(self, config: BrokerConfig, role: str, *, will: Will | None = None,
                 clean_session: bool = True, client_id: str | None = None,
                 resubscribe_again_s: tuple[float, ...] = RESUBSCRIBE_AGAIN_S) -> None:
        self.config = config
        self.resubscribe_again_s = resubscribe_again_s
        self.role = role
        self.will = will
        self.clean_session = clean_session
        self.client_id = client_id or new_client_id(config.client_id_prefix, role)
        self.messages: queue.Queue[Message] = queue.Queue()
        self.connected = threading.Event()
        self.reconnected = threading.Event()
        self._state_lock = threading.Lock()  # guards the fields below; never held across paho calls
        self._cond = threading.Condition(self._state_lock)
        self._filters: dict[str, int] = {}
        self._resubscribing: dict[int, list[tuple[str, int]]] = {}  # mid -> filters re-sent after a reconnect
        # mid -> the number of the last PUBACK of that mid (PUBACKs counted in `_puback_count`): a
        # publish takes only a PUBACK counted after it was queued, so the PUBACK of an earlier
        # message that had the same mid (paho reuses them), whether its waiter gave up or was
        # never called, acknowledges nothing else. At most one entry per mid (65,535).
        self._acked: dict[int, int] = {}
        self._puback_count = 0
        self._subacked: dict[int, list[int]] = {}
        self._unsubacked: set[int] = set()
        self._connack: str | None = None  # None = waiting, "" = accepted, else the refusal reason
        self._connect_count = 0
        self._reconnect_count = 0
        self._disconnects = 0
        self._client: paho.Client | None = None
        self._host = ""
        self._closed = False
        self._tls: sockets.TlsContext | None = None

    # ------------------------------------------------------------ state

    @property
    def host(self) -> str:
        """The broker host of the current (or last) connection."""
        return self._host

    @property
    def endpoint(self) -> str:
        """`host:port` of the current (or last) connection, for messages."""
        return sockets.endpoint(self._host, self.config.port)

    @property
    def reconnect_count(self) -> int:
        """How many times the client reconnected after its first connection."""
        return self._reconnect_count

    @property
    def disconnect_count(self) -> int:
        """How many times an established connection was lost or closed."""
        return self._disconnects

    def __repr__(self) -> str:
        return (f"MqttClient(client_id={self.client_id!r}, host={self._host!r}, "
                f"port={self.config.port}, connected={self.connected.is_set()})")

    # ------------------------------------------------------------ paho callbacks (record only)

    def _on_connect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any,
                    properties: Any = None) -> None:
        try:
            if reason.is_failure:
                with self._cond:
                    self._connack = str(reason).lower()
                    self._cond.notify_all()
                return
            with self._cond:
                self._connack = ""
                first = self._connect_count == 0
                self._connect_count += 1
                if not first:
                    self._reconnect_count += 1
                filters = list(self._filters.items())
                self._cond.notify_all()
            if not first:
                log.info("reconnected to %s as %s", self.endpoint,
                         self.client_id)
                if filters:  # §10: re-subscribe; a queued SUBSCRIBE packet, no waiting here
                    self._resubscribe(client, filters)
                    self._resubscribe_later(client, filters)
            self.connected.set()
            if not first:
                self.reconnected.set()
        except Exception:  # a callback must never kill paho's network thread
            log.exception("on_connect failed")

    def _next_host(self, client: paho.Client, userdata: Any = None) -> None:
        """Fail-over (§13): after a lost connection or failed attempt (`on_connect_fail`) paho
        retries the next host of `config.hosts`; its `host` setter refuses then, hence `_host`."""
        hosts = self.config.hosts
        if len(hosts) > 1 and not self._closed:
            self._host = hosts[(hosts.index(self._host) + 1) % len(hosts)] if self._host in hosts else hosts[0]
            client._host = self._host

    def _on_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any,
                       properties: Any = None) -> None:
        try:
            was_connected = self.connected.is_set()
            self.connected.clear()
            with self._cond:
                if was_connected:
                    self._disconnects += 1
                elif self._connack is None:  # closed during the handshake (TLS refusal, broker gone)
                    self._connack = f"connection closed before CONNACK ({str(reason).lower()})"
                self._cond.notify_all()
            if was_connected and not self._closed:
                log.warning("connection to %s lost (%s); reconnecting",
                            self.endpoint, reason)
            if self._connect_count:
                self._next_host(client)
        except Exception:
            log.exception("on_disconnect failed")

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        try:
            topic = msg.topic  # decodes UTF-8; a hostile topic raises here
            self.messages.put(Message(topic=topic, payload=bytes(msg.payload), retain=bool(msg.retain)))
        except Exception as exc:
            log.warning("dropped a message with an undecodable topic (%s)", type(exc).__name__)

    def _on_publish(self, client: paho.Client, userdata: Any, mid: int, reason: Any = None,
                    properties: Any = None) -> None:
        with self._cond:
            self._puback_count += 1
            self._acked[mid] = self._puback_count
            self._cond.notify_all()

    def _on_subscribe(self, client: paho.Client, userdata: Any, mid: int, reasons: Any,
                      properties: Any = None) -> None:
        codes = [int(getattr(r, "value", r)) for r in reasons]
        with self._cond:
            again = self._resubscribing.pop(mid, None)
            if again is None:
                self._subacked[mid] = codes
                self._cond.notify_all()
        refused = [item for item, code in zip(again or [], codes, strict=False) if code >= SUBACK_FAILURE]
        if refused:  # e.g. a NATS node whose JetStream has no leader yet: try again, paced
            log.warning("re-subscribe to %s refused; again in %g s", refused[0][0], RESUBSCRIBE_DELAY_S)
            timer = threading.Timer(RESUBSCRIBE_DELAY_S, self._resubscribe, (client, refused))
            timer.daemon = True
            timer.start()

    def _resubscribe_later(self, client: paho.Client, filters: list[tuple[str, int]]) -> None:
        """Subscribe `filters` again RESUBSCRIBE_AGAIN_S after this reconnect, unless the client
        reconnected again or closed meanwhile (that connection has its own)."""
        epoch = self._connect_count

        def again() -> None:
            if self._connect_count == epoch and self.connected.is_set():
                self._resubscribe(client, filters)

        for delay_s in self.resubscribe_again_s:
            timer = threading.Timer(delay_s, again)
            timer.daemon = True
            timer.start()

    def _resubscribe(self, client: paho.Client, filters: list[tuple[str, int]]) -> None:
        """Send remembered `filters` again (§10) unless closed; `_on_subscribe` checks the SUBACK."""
        with self._cond:
            filters = [item for item in filters if item[0] in self._filters]
        if filters and not self._closed and client is self._client:
            _, mid = client.subscribe(filters)
            with self._cond:
                self._resubscribing[mid or 0] = filters

    def _on_unsubscribe(self, client: paho.Client, userdata: Any, mid: int, reasons: Any = None,
                        properties: Any = None) -> None:
        with self._cond:
            self._unsubacked.add(mid)
            self._cond.notify_all()

    # ------------------------------------------------------------ lifecycle

    def _new_paho(self) -> paho.Client:
        cfg = self.config
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id,
                             clean_session=self.clean_session,
                             transport="websockets" if cfg.transport == "websockets" else "tcp",
                             reconnect_on_failure=True)
        if cfg.transport == "websockets":
            client.ws_set_options(path=cfg.ws_path)
        if cfg.username:
            client.username_pw_set(cfg.username, cfg.password or None)
        self._tls = None
        if cfg.tls:
            self._tls = sockets.tls_context(cfg)
            client.tls_set_context(self._tls)
        if self.will is not None:
            topic, payload, qos, retain = self.will
            client.will_set(topic, payload, qos=qos, retain=retain)
        client.reconnect_delay_set(RECONNECT_MIN_DELAY_S, reconnect_max_delay_s(cfg.hosts))
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_connect_fail = self._next_host
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        client.on_unsubscribe = self._on_unsubscribe
        client.on_socket_open = sockets.no_delay
        return client

    def connect(self, timeout_s: float = CONNACK_TIMEOUT_S) -> MqttClient:
        """Connect to the first broker of `config.hosts` that accepts us (§13 fail-over).

        Args:
            timeout_s: the CONNACK deadline per host, in seconds (§13: 10).
        Returns:
            self, connected; paho then reconnects by itself with backoff (1-8 s; at most
            2 s with a fail-over list, `reconnect_max_delay_s`),
            each attempt to the next host of `hosts` (`_next_host`).
        Raises:
            BrokerUnavailable: no host accepted; the one-line message names every
                host:port tried and why (never the password).
            BrokerError: the client was closed.
            ConfigError: no broker is configured (MQTT_BROKER unset, §13).
        """
        if self._closed:
            raise BrokerError("MQTT client is closed")
        if self.connected.is_set():
            return self
        if not self.config.configured:
            raise ConfigError(NO_BROKER)
        failures: list[str] = []
        for host in self.config.hosts:
            reason = self._try_host(host, timeout_s)
            if reason is None:
                return self
            failures.append(f"{sockets.endpoint(host, self.config.port)} ({reason})")
        raise BrokerUnavailable(UNREACHABLE + "; ".join(failures))

    def _try_host(self, host: str, timeout_s: float) -> str | None:
        """One connection attempt; None on success, else a short reason."""
        deadline = time.monotonic() + timeout_s
        client = self._new_paho()
        client.connect_timeout = max(MIN_CONNECT_TIMEOUT_S, timeout_s)
        with self._cond:
            self._connack = None
        self._host = host
        try:
            client.connect(host, self.config.port, keepalive=self.config.keepalive_s)
        except Exception as exc:  # OSError, ssl.SSLError, WebsocketConnectionError, gaierror
            _close_socket(client)
            if self._tls is not None:
                self._tls.close_wrapped()
            return sockets.reason_of(exc)
        if self._tls is not None:
            self._tls.wrapped.clear()  # the connected socket now belongs to paho
        self._client = client
        client.loop_start()
        with self._cond:
            while self._connack is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            outcome = self._connack
        if outcome == "":
            self.connected.wait(max(0.0, deadline - time.monotonic()))
            return None
        self._stop_paho(client)
        self._client = None
        if outcome is None:
            return f"no CONNACK within {timeout_s:g} s"
        return outcome if outcome.startswith("connection closed") else f"refused: {outcome}"

    def _stop_paho(self, client: paho.Client) -> None:
        """Stop paho's thread and drop its socket and queued messages (never reconnected)."""
        client.disconnect()
        # loop_stop joins the network thread; after disconnect() it exits within one loop tick
        stopper = threading.Thread(target=client.loop_stop, daemon=True)
        stopper.start()
        stopper.join(CLOSE_TIMEOUT_S)
        _close_socket(client)

    def close(self) -> None:
        """Disconnect and stop the network thread. Idempotent; queued unsent
        messages are discarded (a new client never resends them)."""
        if self._closed:
            return
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            self._stop_paho(client)
        self.connected.clear()

    def __enter__(self) -> MqttClient:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ operations

    def _paho(self) -> paho.Client:
        if self._client is None or self._closed:
            raise BrokerError("MQTT client is not connected; call connect() first")
        return self._client

    def subscribe(self, filters: Sequence[tuple[str, int]], *,
                  timeout_s: float = SUBACK_TIMEOUT_S) -> None:
        """Subscribe to (topic filter, QoS) pairs and wait `timeout_s` for the SUBACK; they are
        remembered and re-subscribed after every reconnect, until a SUBACK accepts them (§10).

        Raises:
            BrokerError: the broker refused a filter (e.g. no permission).
            BrokerUnavailable: no SUBACK within the deadline (the filters stay
                remembered and are subscribed on the next reconnect). A reconnect before
                the SUBACK ends the wait without error: that connection re-sends them.
        """
        items = [(str(topic), int(qos)) for topic, qos in filters]
        if not items:
            return
        client = self._paho()
        with self._cond:
            self._filters.update(items)
        with self._cond:
            epoch = self._connect_count
        rc, mid = client.subscribe(items)
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
            raise BrokerUnavailable(f"cannot subscribe on {self.endpoint}: "
                                    f"{paho.error_string(rc)}")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while mid not in self._subacked:
                if self._connect_count != epoch:
                    # reconnected meanwhile: this SUBACK never comes; `_on_connect` re-sent the
                    # remembered filters and retries a refusal, as for every reconnect (§10)
                    self._subacked.pop(mid, None)
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BrokerUnavailable(
                        f"no SUBACK from {self.endpoint} within {timeout_s:g} s")
                self._cond.wait(remaining)
            codes = self._subacked.pop(mid)
        refused = [topic for (topic, _), code in zip(items, codes, strict=False) if code >= SUBACK_FAILURE]
        if refused:
            with self._cond:
                for topic in refused:
                    self._filters.pop(topic, None)
            raise BrokerError(f"broker refused the subscription to {', '.join(refused)}")

    def unsubscribe(self, filters: Sequence[str], *, timeout_s: float = SUBACK_TIMEOUT_S) -> None:
        """Unsubscribe from topic filters (no longer re-subscribed after a reconnect) and
        wait for the UNSUBACK. A broker answers packets in order and sends a filter's
        retained messages right after its SUBACK, so they are in `messages` once this returns.

        Raises:
            BrokerUnavailable: not sent, or no UNSUBACK within `timeout_s` seconds.
        """
        items = [str(topic) for topic in filters]
        if not items:
            return
        client = self._paho()
        with self._cond:
            for topic in items:
                self._filters.pop(topic, None)
        rc, mid = client.unsubscribe(items)
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
            raise BrokerUnavailable(f"cannot unsubscribe on {self.endpoint}: "
                                    f"{paho.error_string(rc)}")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while mid not in self._unsubacked:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BrokerUnavailable(
                        f"no UNSUBACK from {self.endpoint} within {timeout_s:g} s")
                self._cond.wait(remaining)
            self._unsubacked.discard(mid)

    def publish(self, topic: str, payload: bytes, *, qos: int = QOS_AT_LEAST_ONCE,
                retain: bool = False, timeout_s: float = PUBACK_TIMEOUT_S) -> None:
        """Publish one message to `topic` (built by `mam.shared.protocol.names`) and wait `timeout_s`
        (§13: 5) until the broker acknowledged it (PUBACK for QoS 1). b"" with `retain` clears
        a retained topic (§2). While the connection is down, paho keeps the message and sends
        it after the reconnect; this call waits for that.

        Raises:
            PublishTimeout: no acknowledgement within `timeout_s`.
            BrokerError: paho refused to queue the message.
        """
        self._publish(topic, payload, qos, retain, timeout_s, fail_on_disconnect=False)()

    def publish_async(self, topic: str, payload: bytes, *, qos: int = QOS_AT_LEAST_ONCE,
                      retain: bool = False, timeout_s: float = PUBACK_TIMEOUT_S) -> Callable[[], None]:
        """Queue one message like `publish` and return at once; the returned call waits for
        its PUBACK (the deadline counts from now) and raises like `publish`. Lets a caller do
        other work (disk) while the broker acknowledges; the wire order is the call order.
        Raises BrokerError when paho refused to queue the message (the waiter raises the rest).
        """
        return self._publish(topic, payload, qos, retain, timeout_s, fail_on_disconnect=False)

    def _publish(self, topic: str, payload: bytes, qos: int, retain: bool, timeout_s: float, *,
                 fail_on_disconnect: bool) -> Callable[[], None]:
        client = self._paho()
        start_disconnects = self._disconnects
        with self._cond:
            queued_after = self._puback_count  # this message's PUBACK is counted after it
        info = client.publish(topic, bytes(payload), qos=qos, retain=retain)
        if info.rc not in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
            raise BrokerError(f"cannot publish to {topic}: {paho.error_string(info.rc)}")
        if info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN and fail_on_disconnect:
            raise BrokerUnavailable(f"connection to {self.endpoint} lost "
                                    f"before publishing to {topic}")
        deadline = time.monotonic() + timeout_s

        def wait_acked() -> None:
            with self._cond:
                while self._acked.get(info.mid, 0) <= queued_after:
                    if fail_on_disconnect and self._disconnects != start_disconnects:
                        raise BrokerUnavailable(f"connection to {self.endpoint} "
                                                f"lost while publishing to {topic}")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise PublishTimeout(f"no PUBACK for {topic} from "
                                             f"{self.endpoint} within {timeout_s:g} s")
                    self._cond.wait(remaining)
                del self._acked[info.mid]
        return wait_acked


def _close_socket(client: paho.Client) -> None:
    """Release a paho client's socket and self-pipe so no ResourceWarning is left behind."""
    for name in ("_sock", "_sockpairR", "_sockpairW"):
        sock = getattr(client, name, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
            setattr(client, name, None)


def publish_with_retry(config: BrokerConfig, role: str,
                       messages: Iterable[tuple[str, bytes, bool]], *,
                       attempts: int = DEFAULT_ATTEMPTS, qos: int = QOS_AT_LEAST_ONCE,
                       connect_timeout_s: float = CONNACK_TIMEOUT_S,
                       puback_timeout_s: float = PUBACK_TIMEOUT_S,
                       sleep: Callable[[float], None] = time.sleep) -> None:
    """Publish `messages` in order over one connection, retrying the unacknowledged rest (§13).

    Each attempt uses a fresh client and connection; the previous client is
    closed without ever reconnecting, so paho's queue of the failed attempt is
    discarded and a retry puts each message on the wire once more at most (a
    message whose PUBACK was lost may arrive twice: QoS 1 is at-least-once).

    Args:
        config: broker configuration (§13).
        role: client-id role word (e.g. "publish").
        messages: (topic, payload bytes, retain) in publish order.
        attempts: tries (≥ 1); delay between them `min(0.5 × 2^(attempt-1), 8.0)` s.
        qos: QoS for every message (default 1).
        connect_timeout_s: CONNACK deadline per host (§13: 10 s).
        puback_timeout_s: PUBACK deadline per message (§13: 5 s).
        sleep: the delay function (tests may pass a recorder).
    Raises:
        BrokerUnavailable: the last attempt could not connect or lost the connection.
        PublishTimeout: the last attempt connected but a PUBACK did not come.
        BrokerError: the broker refused an operation.
    """
    pending = list(messages)
    attempts = max(1, int(attempts))
    last: BrokerError | None = None
    for attempt in range(1, attempts + 1):
        client = MqttClient(config, role)
        try:
            client.connect(connect_timeout_s)
            while pending:
                topic, payload, retain = pending[0]
                client._publish(topic, payload, qos, retain, puback_timeout_s, fail_on_disconnect=True)()
                pending.pop(0)
            return
        except (BrokerUnavailable, PublishTimeout) as exc:
            last = exc
            log.warning("publish attempt %d/%d failed: %s", attempt, attempts, exc)
        finally:
            client.close()
        if attempt < attempts:
            sleep(retry_delay_s(attempt))
    assert last is not None
    raise last


def new_client(config: BrokerConfig, role: str, will: Will | None = None) -> MqttClient:
    """The real connection, unconnected: `MqttClient(config, role, will=will)` (§13). The
    default `TransportFactory` of the runner daemon and of the hub; tests pass a fake."""
    return MqttClient(config, role, will=will)
