"""The runner daemon's local publish socket (PROTOCOL §17).

`<root>/.mam/run/runner.sock` (0600, its folder 0700). Each client sends one
JSON line `{"job_id", "attempt_id", "dispatch_token", "event", "detail",
"data"}` and gets one line back: `{"ok": true, "seq": N}` once the event is
in the registry, the audit log and the outbox (`publish.record`, the §8
checks and the §12 barrier of a terminal event), or `{"ok": false,
"reason": ...}` (`"usage": true` for input that `mam-runner publish` would
reject with exit 64). The connection is then closed and the event is sent
on the daemon's own connection by a sender thread (`send`).

A client may instead ask a person (§19): `{"job_id", "attempt_id", "dispatch_token",
"ask": {"tool": NAME, "input": {...}}}`. The daemon records a `permission_required`
event with a new request id, the tool and a masked, capped summary of the input, and
keeps the connection open until the hub's signed answer arrives (`answer`), the job
ends or the daemon stops; the one line back is `{"ok": true, "request_id", "behavior":
"allow"|"deny", "message"}` (or `{"ok": false, ...}` when nothing was asked).

One selector thread serves every client: lines are capped (MAX_LINE_BYTES),
clients are capped (MAX_CLIENTS) and idle ones dropped (CLIENT_IDLE_S); bad
input of any kind is refused with one line and never stops the daemon. A
stale socket file of a dead daemon is replaced; a live one is left alone
(this daemon then does not listen). The file is removed on `stop()`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mam.runner import publish
from mam.runner.fastpath import CONNECT_TIMEOUT_S
from mam.shared.protocol import crypto, names
from mam.shared.protocol.codes import TERMINAL_EVENTS, EventName
from mam.shared.protocol.errors import MamError, ProtocolError, RegistryError, UsageError
from mam.shared.protocol.wire import safe_line
from mam.shared.store.fsio import unix_address
from mam.shared.store.registry import Registry

log = logging.getLogger("mam.socket")

MAX_LINE_BYTES = 128 * 1024
"""Longest request line, bytes: 16 KiB of data as escaped JSON plus the other fields."""
MAX_CLIENTS = 32
"""Connections served at once; one more is refused with a line and closed."""
CLIENT_IDLE_S = 10.0
"""A client that sends no full line within this many seconds is refused and closed."""
SELECT_S = 0.2
"""Longest wait of the selector before it checks for `stop()`."""
RECV_BYTES = 64 * 1024
"""Bytes read per `recv`."""
DIR_MODE = 0o700
SOCKET_MODE = 0o600
BACKLOG = 16
FIELDS = frozenset({"job_id", "attempt_id", "dispatch_token", "event", "detail", "data"})
ASK_FIELDS = frozenset({"job_id", "attempt_id", "dispatch_token", "ask"})
MAX_TOOL_CHARS = 128
"""Longest tool name of a permission request, characters."""
MAX_INPUT_SUMMARY_CHARS = 512
"""Longest summary of a tool's input in a `permission_required` event, characters (§19)."""
MAX_SEALED_INPUT_BYTES = 8 * 1024
"""Largest tool input (canonical JSON) a `permission_required` event carries whole, sealed to
the hub; a larger one is left out and its size given (§19; event data is at most 16 KiB)."""
MAX_WAITING_ASKS = 8
"""Permission requests of one job that may wait for an answer at once; one more is refused (§19)."""


def parse_request(line: bytes) -> publish.PublishRequest:
    """One request line as a validated `PublishRequest` (the checks of `mam-runner publish`, §3).

    Raises:
        UsageError: not UTF-8 JSON, not an object, unknown/missing fields, bad types or values.
    """
    try:
        value = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise UsageError("the request is not one line of UTF-8 JSON") from None
    if not isinstance(value, dict):
        raise UsageError("the request must be a JSON object")
    unknown = sorted(str(key) for key in value.keys() - FIELDS)
    if unknown:
        raise UsageError(f"unknown request field(s): {', '.join(unknown)[:200]}")
    for key, kind in (("job_id", str), ("event", str), ("dispatch_token", str), ("detail", str), ("data", dict)):
        if key in value and not isinstance(value[key], kind):
            raise UsageError(f"request field {key!r} must be a {'JSON object' if kind is dict else 'string'}")
    attempt = value.get("attempt_id")
    if isinstance(attempt, bool) or not isinstance(attempt, int):
        raise UsageError("request field 'attempt_id' must be an integer >= 1")
    if "job_id" not in value or "event" not in value or not value.get("dispatch_token"):
        raise UsageError("the request needs job_id, attempt_id, dispatch_token and event")
    data = value.get("data") or {}
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False) if data else None
    return publish.make_request(value["job_id"], value["event"], value.get("detail", ""), text, attempt,
                                value["dispatch_token"])


@dataclass(frozen=True)
class AskRequest:
    """An agent's request for a person's permission (§19), validated."""

    job_id: str
    attempt_id: int
    dispatch_token: str
    tool: str
    input: dict[str, Any]


def parse_ask(value: dict[str, Any]) -> AskRequest:
    """A parsed request line holding `ask` as a validated `AskRequest` (§19).

    Raises:
        UsageError: unknown/missing fields, bad types or values.
    """
    unknown = sorted(str(key) for key in value.keys() - ASK_FIELDS)
    if unknown:
        raise UsageError(f"unknown request field(s): {', '.join(unknown)[:200]}")
    ask = value.get("ask")
    if not isinstance(ask, dict) or set(ask) - {"tool", "input"}:
        raise UsageError("request field 'ask' must be an object with 'tool' and 'input'")
    tool, tool_input = ask.get("tool"), ask.get("input", {})
    if not isinstance(tool, str) or not tool or len(tool) > MAX_TOOL_CHARS or safe_line(tool, MAX_TOOL_CHARS) != tool:
        raise UsageError(f"the tool name must be 1-{MAX_TOOL_CHARS} characters on one line")
    if not isinstance(tool_input, dict):
        raise UsageError("the tool input must be a JSON object")
    attempt = value.get("attempt_id")
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise UsageError("request field 'attempt_id' must be an integer >= 1")
    names.validate_job_id(value.get("job_id"))
    names.validate_token(value.get("dispatch_token"))
    return AskRequest(value["job_id"], attempt, value["dispatch_token"], tool, tool_input)


def _always_key(request: AskRequest) -> tuple[str, str]:
    """What makes two requests "the same" for an `always` allow: the tool and its whole input."""
    return request.tool, json.dumps(request.input, sort_keys=True, separators=(",", ":"), default=str)


def _subject(tool_input: Mapping[str, Any]) -> str:
    """What a request is about: the `command` of a shell tool, else the input as compact JSON."""
    command = tool_input.get("command")
    return command if isinstance(command, str) and len(tool_input) <= 2 else json.dumps(
        tool_input, ensure_ascii=False, separators=(",", ":"), default=str)


def input_summary(tool_input: Mapping[str, Any]) -> str:
    """One line for a person: the request's subject (`_subject`), capped."""
    return safe_line(_subject(tool_input), MAX_INPUT_SUMMARY_CHARS)


@dataclass
class _Client:
    sock: socket.socket
    since: float
    buffer: bytearray = field(default_factory=bytearray)


@dataclass
class _Waiting:
    """A client whose permission request waits for the hub's answer until `deadline`
    (monotonic seconds), then `on_timeout` (deny or cancel, §19)."""

    client: _Client
    request: AskRequest
    timeout_s: int
    on_timeout: str
    deadline: float


class PublishServer:
    """The listener of one runner daemon (§17)::

        server = PublishServer(registry, held=lambda job_id: ..., send=...)
        path = server.start()   # None when it does not listen (a live daemon holds the socket)
        server.stop()           # joins both threads, removes the socket file

    Args:
        registry: this host's registry.
        held: True for a job this daemon runs (other jobs are refused).
        send: sends one `Published` on the daemon's connection (called on the sender thread).
        before_terminal: called with the job id before an agent's terminal event is recorded: sends
            the job's remaining output (§15) and returns data for the event (`log_chunks`...).
        mask: (job_id, text) -> the text with the job's secrets masked (§15), for what a
            permission request shows the hub.
        ask_terms: (job_id) -> (seconds a request waits, "deny" or "cancel" then), §19.
        cancel: (job_id, reason) stops a job whose request timed out with "cancel".
        tool_rules: (job_id) -> (allow rules, deny rules) of its dispatch: a request they cover
            is answered at once, asking nobody (§19).
    """

    def __init__(self, registry: Registry, *, held: Callable[[str], bool],
                 send: Callable[[publish.Published], None],
                 before_terminal: Callable[[str], Mapping[str, int]] | None = None,
                 mask: Callable[[str, str], str] | None = None,
                 ask_terms: Callable[[str], tuple[int, str]] | None = None,
                 cancel: Callable[[str, str], None] | None = None,
                 tool_rules: Callable[[str], tuple[tuple[str, ...], tuple[str, ...]]] | None = None) -> None:
        self.registry = registry
        self.mask = mask or (lambda job_id, text: text)
        self.ask_terms = ask_terms or (lambda job_id: (names.DEFAULT_ASK_TIMEOUT_S, "deny"))
        self.cancel = cancel or (lambda job_id, reason: None)
        self.tool_rules = tool_rules or (lambda job_id: ((), ()))
        self._waiting: dict[str, _Waiting] = {}  # request id -> its client (§19)
        self._denied: dict[str, set[str]] = {}  # job id -> tools the hub denied it (§19)
        self._flooded: set[str] = set()  # jobs whose asks were refused for too many waiting (logged once)
        # job id -> (tool, input as canonical JSON) -> (request id, message) the hub allowed always (§19)
        self._always: dict[str, dict[tuple[str, str], tuple[str, str]]] = {}
        self._waiting_lock = threading.Lock()
        self.path = names.runner_socket_path(registry.root)
        self.held = held
        self.send = send
        self.before_terminal = before_terminal
        self._listener: socket.socket | None = None
        self._inode: int | None = None
        self._stop = threading.Event()
        self._outgoing: queue.Queue[publish.Published | None] = queue.Queue()
        self._threads: list[threading.Thread] = []

    def start(self) -> Path | None:
        """Bind and listen; the socket's path, or None when it does not listen."""
        run_dir = self.path.parent
        run_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        os.chmod(run_dir, DIR_MODE)
        if not self._clear_stale():
            return None
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address, fd = unix_address(self.path)
        try:
            listener.bind(address)
        except OSError as exc:
            listener.close()
            log.warning("local publish socket %s not opened (%s): agents publish on their own connection",
                        self.path, exc)
            return None
        finally:
            if fd is not None:
                os.close(fd)
        os.chmod(self.path, SOCKET_MODE)
        self._inode = self.path.stat().st_ino
        listener.listen(BACKLOG)
        listener.setblocking(False)
        self._listener = listener
        for target, name in ((self._serve, "mam-socket"), (self._send_loop, "mam-socket-send")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("local publish socket on %s", self.path)
        return self.path

    def stop(self) -> None:
        """Stop serving, send what was accepted, remove the socket file (idempotent)."""
        self._stop.set()
        self._outgoing.put(None)
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                if self.path.stat().st_ino == self._inode:
                    self.path.unlink()

    # ------------------------------------------------------------ start

    def _clear_stale(self) -> bool:
        """Remove a socket file no daemon answers on; False when another daemon answers or it is no socket."""
        try:
            mode = self.path.lstat().st_mode
        except FileNotFoundError:
            return True
        if not stat.S_ISSOCK(mode):
            log.warning("%s is not a socket: local publish socket not opened", self.path)
            return False
        address, fd = unix_address(self.path)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(CONNECT_TIMEOUT_S)
                probe.connect(address)
        except OSError:  # ECONNREFUSED: its daemon is gone
            log.info("replacing the stale socket %s", self.path)
            self.path.unlink(missing_ok=True)
            return True
        finally:
            if fd is not None:
                os.close(fd)
        log.warning("another runner daemon listens on %s: local publish socket not opened", self.path)
        return False

    # ------------------------------------------------------------ serving

    def _serve(self) -> None:
        assert self._listener is not None
        clients: dict[int, _Client] = {}
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in selector.select(SELECT_S):
                    try:
                        if key.fileobj is self._listener:
                            self._accept(selector, clients)
                        else:
                            self._read(selector, clients, clients[key.fd])
                    except Exception as exc:  # a daemon never dies on a bad client
                        log.error("local socket: %s: %s", type(exc).__name__, exc)
                now = time.monotonic()
                for client in [c for c in clients.values() if now - c.since > CLIENT_IDLE_S]:
                    self._finish(selector, clients, client, {"ok": False, "reason": "no request line in time"})
                self._expire_asks(now)
            for client in list(clients.values()):
                self._finish(selector, clients, client, {"ok": False, "reason": "the runner is stopping"})
        with self._waiting_lock:
            waiting, self._waiting = list(self._waiting.values()), {}
        for parked in waiting:
            self._close(parked.client, {"ok": False, "reason": "the runner is stopping; no answer came",
                                        "no_answer": True})

    def _accept(self, selector: selectors.BaseSelector, clients: dict[int, _Client]) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        client = _Client(sock, time.monotonic())
        if len(clients) >= MAX_CLIENTS:
            self._reply(sock, {"ok": False, "reason": f"too many clients (at most {MAX_CLIENTS})"})
            sock.close()
            return
        sock.setblocking(False)
        clients[sock.fileno()] = client
        selector.register(sock, selectors.EVENT_READ)

    def _read(self, selector: selectors.BaseSelector, clients: dict[int, _Client], client: _Client) -> None:
        try:
            chunk = client.sock.recv(RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._finish(selector, clients, client, None)
            return
        client.buffer += chunk
        line, newline, _ = bytes(client.buffer).partition(b"\n")
        if len(line) > MAX_LINE_BYTES:
            answer: dict[str, Any] = {"ok": False, "reason": f"request line longer than {MAX_LINE_BYTES} bytes"}
        elif not newline:
            return
        else:
            ask = self._ask_of(line)
            if isinstance(ask, AskRequest):
                # the selector lets it go first: once parked, the hub's answer closes it (any thread)
                with contextlib.suppress(KeyError, ValueError):
                    selector.unregister(client.sock)
                clients.pop(client.sock.fileno(), None)
                refusal = self.ask(ask, client)
                if refusal is None:
                    return
                answer = refusal
            else:
                answer = ask if ask is not None else self.handle(line)
        self._finish(selector, clients, client, answer)

    def _finish(self, selector: selectors.BaseSelector, clients: dict[int, _Client], client: _Client,
                answer: dict[str, Any] | None) -> None:
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(client.sock)
        clients.pop(client.sock.fileno(), None)
        if answer is not None:
            self._reply(client.sock, answer)
        client.sock.close()

    def _close(self, client: _Client, answer: dict[str, Any]) -> None:
        self._reply(client.sock, answer)
        with contextlib.suppress(OSError):
            client.sock.close()

    @staticmethod
    def _reply(sock: socket.socket, answer: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # a client that left does not get its answer
            sock.setblocking(True)
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.sendall(json.dumps(answer).encode("utf-8") + b"\n")

    def handle(self, line: bytes) -> dict[str, Any]:
        """One request line: its answer; an accepted event is queued for sending (§17)."""
        try:
            request = parse_request(line)
        except UsageError as exc:
            return {"ok": False, "reason": str(exc), "usage": True}
        if not self.held(request.job_id):
            return {"ok": False, "reason": f"job {request.job_id} is not running under this runner"}
        try:
            if request.event in TERMINAL_EVENTS and self.before_terminal is not None:
                # §15: the agent's output goes before its own terminal event, as before ours
                request = replace(request, data={**request.data, **self.before_terminal(request.job_id)})
            published = publish.record(self.registry, request, handed_on=True)
        except (ProtocolError, RegistryError, MamError, OSError) as exc:
            return {"ok": False, "reason": str(exc)}
        except Exception as exc:  # a daemon never dies on a bad request; the client learns it failed
            log.error("local socket: job %s: %s: %s", request.job_id, type(exc).__name__, exc)
            return {"ok": False, "reason": f"the runner could not record the event ({type(exc).__name__})"}
        self._outgoing.put(published)
        log.debug("job %s seq %d (%s) from the local socket", request.job_id, published.seq, request.event)
        return {"ok": True, "seq": published.seq}

    # ------------------------------------------------------------ permission requests (§19)

    @staticmethod
    def _ask_of(line: bytes) -> AskRequest | dict[str, Any] | None:
        """The line's `AskRequest`, a refusal for a bad one, or None when it asks nothing."""
        try:
            value = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return None
        if not isinstance(value, dict) or "ask" not in value:
            return None
        try:
            return parse_ask(value)
        except UsageError as exc:
            return {"ok": False, "reason": str(exc), "usage": True}

    def ask(self, request: AskRequest, client: _Client) -> dict[str, Any] | None:
        """Record the `permission_required` event of `request` and park `client` until `answer`;
        None once parked, else the refusal to send back (nothing was asked)."""
        if not self.held(request.job_id):
            return {"ok": False, "reason": f"job {request.job_id} is not running under this runner"}
        with self._waiting_lock:
            allowed = self._always.get(request.job_id, {}).get(_always_key(request))
        if allowed is not None:
            return self._allow_again(request, client, *allowed)
        allow_rules, deny_rules = self.tool_rules(request.job_id)
        subject = _subject(request.input)
        for rules, allow in ((deny_rules, False), (allow_rules, True)):  # a deny rule wins
            rule = next((r for r in rules if names.tool_rule_matches(r, request.tool, subject)), None)
            if rule is not None:
                return self._by_policy(request, client, rule, allow)
        with self._waiting_lock:
            count = sum(1 for parked in self._waiting.values() if parked.request.job_id == request.job_id)
            if count >= MAX_WAITING_ASKS:
                first = request.job_id not in self._flooded
                self._flooded.add(request.job_id)
                if first:  # said once per job: a flood of asks is not a flood of log lines
                    log.warning("job %s: permission requests refused while %d wait for an answer (this is "
                                "said once)", request.job_id, count)
                return {"ok": False, "reason": f"too many permission requests of job {request.job_id} "
                                               f"wait for an answer (at most {MAX_WAITING_ASKS})"}
            request_id = names.new_request_id()
            timeout_s, on_timeout = self.ask_terms(request.job_id)
            self._waiting[request_id] = _Waiting(client, request, timeout_s, on_timeout,
                                                 time.monotonic() + timeout_s)
        data = {"request_id": request_id, "tool": request.tool,
                "input": self.mask(request.job_id, input_summary(request.input)),
                **self._sealed_input(request, request_id)}
        try:
            event = publish.make_request(request.job_id, EventName.PERMISSION_REQUIRED,
                                         f"asks to use {request.tool}",
                                         json.dumps(data, ensure_ascii=False), request.attempt_id,
                                         request.dispatch_token)
            published = publish.record(self.registry, event, handed_on=True)
        except Exception as exc:  # stale attempt, ended job, bad detail: nothing was asked
            with self._waiting_lock:
                self._waiting.pop(request_id, None)
            reason = str(exc) if isinstance(exc, MamError | ProtocolError) else type(exc).__name__
            return {"ok": False, "reason": f"the permission request was not recorded: {reason}"}
        self._outgoing.put(published)
        log.info("job %s asks to use %s (request %s)", request.job_id, request.tool, request_id)
        return None

    def _sealed_input(self, request: AskRequest, request_id: str) -> dict[str, Any]:
        """The whole input for the hub alone (§19): `input_sealed` (AES-256-GCM with the job's
        ask key, bound to job, attempt and request), or `input_bytes` when it is too large."""
        whole = json.dumps(request.input, ensure_ascii=False, sort_keys=True, separators=(",", ":"),
                           default=str).encode("utf-8", "replace")
        if len(whole) > MAX_SEALED_INPUT_BYTES:
            return {"input_bytes": len(whole)}
        try:
            key = crypto.ask_key(self.registry.get(request.job_id)["auth_token"])
        except (MamError, KeyError):
            return {}
        return {"input_sealed": crypto.seal_bytes(key, whole, crypto.ask_associated(
            request.job_id, request.attempt_id, request_id))}

    def waiting(self, job_id: str) -> dict[str, int]:
        """The job's requests that wait for an answer: request id -> attempt."""
        with self._waiting_lock:
            return {rid: p.request.attempt_id for rid, p in self._waiting.items() if p.request.job_id == job_id}

    def _allow_again(self, request: AskRequest, client: _Client, request_id: str, message: str
                     ) -> dict[str, Any] | None:
        """The same request as one the hub allowed `always` (§19): allowed without a person, and
        a `progress` event says so; None once answered, else the refusal (nothing recorded)."""
        return self._answer_now(request, client, f"allowed {request.tool} again without asking (always, request "
                                f"{request_id})", {"always_of": request_id}, request_id, True, message)

    def _by_policy(self, request: AskRequest, client: _Client, rule: str, allow: bool) -> dict[str, Any] | None:
        """A request the dispatch's tool rules cover (§19): answered at once, asking nobody."""
        verb = "allowed" if allow else "denied"
        if not allow:
            with self._waiting_lock:
                self._denied.setdefault(request.job_id, set()).add(request.tool)
        return self._answer_now(request, client, f"{verb} {request.tool} by the job's policy ({rule})",
                                {"rule": rule, "by": "policy", "behavior": "allow" if allow else "deny"}, "", allow,
                                f"{verb} by the job's policy ({rule})")

    def _answer_now(self, request: AskRequest, client: _Client, detail: str, extra: dict[str, Any],
                    request_id: str, allow: bool, message: str) -> dict[str, Any] | None:
        """Answer without a person and record a `progress` event saying why; None once answered,
        else the refusal (a stale attempt or an ended job: nothing recorded)."""
        data = {"tool": request.tool, "input": self.mask(request.job_id, input_summary(request.input)), **extra}
        try:
            event = publish.make_request(request.job_id, EventName.PROGRESS, safe_line(detail, 1024),
                                         json.dumps(data, ensure_ascii=False), request.attempt_id,
                                         request.dispatch_token)
            published = publish.record(self.registry, event, handed_on=True)
        except Exception as exc:
            reason = str(exc) if isinstance(exc, MamError | ProtocolError) else type(exc).__name__
            return {"ok": False, "reason": f"the permission request was not recorded: {reason}"}
        self._outgoing.put(published)
        self._close(client, {"ok": True, "request_id": request_id, "behavior": "allow" if allow else "deny",
                             "message": message})
        return None

    def answer(self, job_id: str, attempt_id: int, request_id: str, *, allow: bool, message: str,
               always: bool = False) -> str | None:
        """Hand the hub's verified answer to the waiting agent (§19); None when delivered, else
        why it was refused: no such request waits (never asked, answered already, the job
        ended), or it is another job's or attempt's. `always` (an allow): the same tool with
        the same input is allowed without asking for the rest of the job's attempt."""
        with self._waiting_lock:
            parked = self._waiting.get(request_id)
            if parked is None:
                return f"request {request_id} is not waiting for an answer (unknown or answered)"
            if parked.request.job_id != job_id or parked.request.attempt_id != attempt_id:
                return (f"request {request_id} belongs to job {parked.request.job_id} attempt "
                        f"{parked.request.attempt_id}, not {job_id} attempt {attempt_id}")
            del self._waiting[request_id]
            if not allow:
                self._denied.setdefault(job_id, set()).add(parked.request.tool)
            elif always:
                self._always.setdefault(job_id, {})[_always_key(parked.request)] = (request_id, message)
        self._close(parked.client, {"ok": True, "request_id": request_id,
                                    "behavior": "allow" if allow else "deny", "message": message})
        return None

    def _expire_asks(self, now: float) -> None:
        """Requests nobody answered in time (§19): denied (the agent goes on) or, with
        `cancel`, denied and the job cancelled; a `progress` event tells the hub."""
        with self._waiting_lock:
            expired = [(rid, parked) for rid, parked in self._waiting.items() if now >= parked.deadline]
            for rid, parked in expired:
                self._denied.setdefault(parked.request.job_id, set()).add(parked.request.tool)
                if parked.on_timeout == "cancel":  # the agent gets no answer: it is stopped first
                    parked.deadline = float("inf")
                else:
                    del self._waiting[rid]
        for rid, parked in expired:
            request, then = parked.request, "denied" if parked.on_timeout == "deny" else "cancelling the job"
            message = f"no answer within {parked.timeout_s} s"
            log.warning("job %s request %s (%s): %s: %s", request.job_id, rid, request.tool, message, then)
            try:
                event = publish.make_request(request.job_id, EventName.PROGRESS,
                                             f"no answer to request {rid} within {parked.timeout_s} s: {then}",
                                             json.dumps({"request_id": rid, "behavior": "deny", "by": "timeout"}),
                                             request.attempt_id, request.dispatch_token)
                self._outgoing.put(publish.record(self.registry, event, handed_on=True))
            except Exception as exc:  # the job ended meanwhile: nothing to tell the hub
                log.info("job %s: the timeout of request %s not recorded: %s", request.job_id, rid, exc)
            if parked.on_timeout == "cancel":  # still parked: the job's end answers it (`drop_asks`)
                self.cancel(request.job_id, f"no answer to a permission request within {parked.timeout_s} s")
            else:
                self._close(parked.client, {"ok": True, "request_id": rid, "behavior": "deny", "message": message})

    def denied_tools(self, job_id: str) -> set[str]:
        """The tools a person at the hub denied the job so far (a decision, not a failure)."""
        with self._waiting_lock:
            return set(self._denied.get(job_id, ()))

    def drop_asks(self, job_id: str, reason: str) -> None:
        """Answer every request of a job that ended: `deny` with `reason` (the agent is gone or
        going); forget the job's denied tools."""
        with self._waiting_lock:
            self._denied.pop(job_id, None)
            self._always.pop(job_id, None)
            self._flooded.discard(job_id)
            dropped = [rid for rid, p in self._waiting.items() if p.request.job_id == job_id]
            parked = [self._waiting.pop(rid) for rid in dropped]
        for rid, item in zip(dropped, parked, strict=True):
            self._close(item.client, {"ok": True, "request_id": rid, "behavior": "deny", "message": reason})

    def _send_loop(self) -> None:
        while (published := self._outgoing.get()) is not None:
            try:
                self.send(published)
            except Exception as exc:  # on disk and in the outbox: the Resender sends it later
                log.warning("job %s seq %d kept in the outbox: %s", published.event["job_id"], published.seq, exc)
