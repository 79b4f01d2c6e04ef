"""`mam-orch serve --alert-webhook URL`: the hub tells a person before anyone asks (PROTOCOL §14
"Alerts").

Every `CHECK_S` the `Alerter` looks at the running service for conditions, each with a key:

    runner_offline  a runner offline (its Last Will) or stale while it holds jobs
    queue_wait      a job queued longer than `queue_s`, with why it waits
    unserved        labels or a repository no runner has announced, with jobs waiting for them
    ask_wait        a permission request (§19) unanswered longer than `ask_s`

A key fires once when its condition appears and resolves once when it clears. A job that
ended `error` with no retry left (`HubService.on_failed`) fires `job_failed` once; it never
resolves. Each notification is POSTed as JSON, with a Slack-compatible `text`, to every
webhook by one sender thread per webhook, in order, retried with backoff: the engine never
waits on a webhook. Active alerts live in memory: after a restart the ones still true fire
again. Webhook addresses may hold secrets (a Slack URL does): only their host is logged.

    alerter = Alerter(service, AlertOptions.parse(["https://hooks.example/T0"]))
    alerter.start(); ...; alerter.stop()
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from mam.orchestrator import asks
from mam.orchestrator import queue as hubqueue
from mam.orchestrator.http.views import iso_epoch, queue_rows, runner_rows
from mam.orchestrator.runners import LOST
from mam.orchestrator.service import HubService
from mam.shared.protocol.codes import PresenceStatus
from mam.shared.protocol.errors import MamError, UsageError
from mam.shared.protocol.wire import format_ts
from mam.shared.store.records import JobRecord, describe_target

log = logging.getLogger("mam.alerts")

CHECK_S = 2.0
"""The service's state is looked at this often (s)."""
QUEUE_S_DEFAULT = 600.0
ASK_S_DEFAULT = 600.0
MAX_WEBHOOKS = 8
MAX_URL_CHARS = 2048
MAX_HOST_SHOWN = 64
POST_TIMEOUT_S = 5.0
RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)
"""Waits between the tries of one notification; after the last it is dropped (logged)."""
MAX_OUTSTANDING = 1000
"""Notifications waiting per webhook; beyond it the newest is dropped (logged), the engine never waits."""
MAX_IDS_SHOWN = 5
MAX_SUMMARY_CHARS = 120
FIRING, RESOLVED = "firing", "resolved"


@dataclass(frozen=True)
class AlertOptions:
    """What `serve --alert-webhook` was given.

    Attributes:
        webhooks: http(s) URLs, each checked by `parse`.
        queue_s: a job queued longer than this (s) fires `queue_wait`.
        ask_s: a permission request unanswered longer than this (s) fires `ask_wait`.
    """

    webhooks: tuple[str, ...]
    queue_s: float = QUEUE_S_DEFAULT
    ask_s: float = ASK_S_DEFAULT

    @classmethod
    def parse(cls, webhooks: list[str], queue_s: float = QUEUE_S_DEFAULT, ask_s: float = ASK_S_DEFAULT) -> AlertOptions:
        """Check the options.

        Raises:
            UsageError: a URL that is not http(s) with a host, too long or holding blanks or control
                characters (named by its host only), more than MAX_WEBHOOKS, or a duration not > 0.
        """
        if len(webhooks) > MAX_WEBHOOKS:
            raise UsageError(f"--alert-webhook: at most {MAX_WEBHOOKS} webhooks, got {len(webhooks)}")
        for url in webhooks:
            problem = url_problem(url)
            if problem is not None:
                raise UsageError(f"--alert-webhook {shown(url)}: {problem}")
        for flag, value in (("--alert-queue-s", queue_s), ("--alert-ask-s", ask_s)):
            if not value > 0 or value == float("inf"):
                raise UsageError(f"{flag}: must be a number of seconds > 0, got {value}")
        return cls(tuple(webhooks), float(queue_s), float(ask_s))


def url_problem(url: str) -> str | None:
    """Why `url` cannot be a webhook, or None."""
    if len(url) > MAX_URL_CHARS:
        return f"longer than {MAX_URL_CHARS} characters"
    if any(char.isspace() or ord(char) < 32 or ord(char) == 127 for char in url):
        return "holds blanks or control characters"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "not an http:// or https:// URL with a host"
    return None


def shown(url: str) -> str:
    """`url` as logs show it: scheme and host, never its path or credentials (a Slack webhook's
    path is its secret)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        host = host if len(host) <= MAX_HOST_SHOWN else host[:MAX_HOST_SHOWN] + "…"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<not a URL>"
    return f"{parts.scheme}://{host}{port}/…"


@dataclass(frozen=True)
class Alert:
    """One condition: `key` (kind and subject) names it across checks; `summary` is one line."""

    key: str
    kind: str
    summary: str
    details: dict[str, Any] = field(default_factory=dict)


def _ids(job_ids: list[str]) -> str:
    more = len(job_ids) - MAX_IDS_SHOWN
    return ", ".join(job_ids[:MAX_IDS_SHOWN]) + (f" and {more} more" if more > 0 else "")


def _cap(text: str) -> str:
    return text if len(text) <= MAX_SUMMARY_CHARS else text[: MAX_SUMMARY_CHARS - 1] + "…"


def conditions(service: HubService, options: AlertOptions, now: float, now_wall: float) -> dict[str, Alert]:
    """Every condition true of `service` now (monotonic `now`, epoch `now_wall`), by key.

    Reads copies of the service's tables (it runs beside the engine's thread) and the audit
    logs of the jobs it watches (for permission requests).
    """
    found: dict[str, Alert] = {}
    held: dict[str, list[str]] = defaultdict(list)
    for job_id, session in sorted(list(service.sessions.items())):
        held[session].append(job_id)
    for row in runner_rows(service, now):
        session, status = str(row["session"]), str(row["status"])
        jobs = held.get(session)
        if jobs and status in (PresenceStatus.OFFLINE, LOST):
            how = ("went offline (Last Will)" if row.get("will") else "went offline" if status == PresenceStatus.OFFLINE
                   else "stopped renewing its presence")
            found[f"runner_offline {session}"] = Alert(
                f"runner_offline {session}", "runner_offline",
                f"runner {session} {how} holding {len(jobs)} job(s): {_ids(jobs)}",
                {"session": session, "runner_status": status, "job_ids": jobs})
    settled = now >= service.settle_max  # the retained presence burst is in: "nobody serves" means it
    unserved: dict[str, list[str]] = defaultdict(list)
    waiting = list(service.queued.values())
    why = {str(row["job_id"]): str(row["why_waiting"]) for row in queue_rows(service, now)}
    for job in waiting:
        if settled and hubqueue.unserved(job, service.fleet):
            unserved[hubqueue.describe_target(job)].append(job.job_id)
        age_s = now_wall - job.queued_at
        if job.paused_until is None and age_s > options.queue_s:
            found[f"queue_wait {job.job_id}"] = Alert(
                f"queue_wait {job.job_id}", "queue_wait",
                f"job {job.job_id} has waited {age_s / 60:.0f} min in the queue: {why.get(job.job_id, '')}",
                {"job_id": job.job_id, "waited_s": round(age_s), "why": why.get(job.job_id, "")})
    for target, jobs in sorted(unserved.items()):
        found[f"unserved {target}"] = Alert(
            f"unserved {target}", "unserved",
            f"no runner serves {target}: {len(jobs)} job(s) wait: {_ids(sorted(jobs))}",
            {"target": target, "job_ids": sorted(jobs)})
    for job_id in sorted(list(service.watchers)):
        try:
            waiting_asks = asks.pending(service.registry, job_id)
        except MamError:
            continue
        for ask in waiting_asks:
            asked = iso_epoch(ask.asked_at)
            if asked is None or now_wall - asked <= options.ask_s:
                continue
            key = f"ask_wait {job_id} {ask.request_id}"
            found[key] = Alert(key, "ask_wait", _cap(
                f"job {job_id}: the agent has asked for {(now_wall - asked) / 60:.0f} min to use {ask.tool} "
                f"({ask.input}); mam-orch approve|deny {job_id} {ask.request_id}"),
                {"job_id": job_id, "request_id": ask.request_id, "tool": ask.tool, "asked_at": ask.asked_at})
    return found


def failed_alert(record: JobRecord) -> Alert:
    """`job_failed` for a job that ended `error` with no retry left."""
    job_id = record["job_id"]
    reason = record.get("close_reason") or f"exit {record.get('exit_code')}"
    tries = f"attempt {record['attempt_id']}" + (f", after {record.get('retried', 0)} retries"
                                                 if record.get("retries") else "")
    return Alert(f"job_failed {job_id}", "job_failed",
                 f"job {job_id} failed ({reason}) on {record.get('session') or '-'}, {tries}; "
                 f"target {describe_target(record)}",
                 {"job_id": job_id, "close_reason": record.get("close_reason"), "exit_code": record.get("exit_code"),
                  "attempt_id": record["attempt_id"], "session": record.get("session")})


def notification(alert: Alert, status: str, since: float, at: float, hub: str) -> dict[str, Any]:
    """The JSON body of one notification; `text` is what Slack shows."""
    word = "RESOLVED" if status == RESOLVED else "ALERT"
    return {**alert.details, "status": status, "kind": alert.kind, "key": alert.key, "summary": alert.summary,
            "text": f"[mam-fleet {hub}] {word}: {alert.summary}", "since": _iso(since), "at": _iso(at), "hub": hub}


def _iso(epoch: float) -> str:
    return format_ts(datetime.fromtimestamp(epoch, tz=UTC))


Post = Callable[[str, bytes], None]


def post_json(url: str, body: bytes) -> None:
    """POST `body` as JSON; raises OSError (urllib's errors) on failure or a status other than 2xx."""
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "mam-fleet"})
    try:
        with urllib.request.urlopen(request, timeout=POST_TIMEOUT_S) as response:  # noqa: S310 - http(s) checked
            response.read()
    except urllib.error.HTTPError as exc:
        exc.close()  # its connection, now, not when it is collected
        raise


class Sender:
    """One webhook's thread: notifications in order, each tried with `delays_s` between tries."""

    def __init__(self, url: str, post: Post = post_json, delays_s: tuple[float, ...] = RETRY_DELAYS_S) -> None:
        self.url = url
        self.post = post
        self.delays_s = delays_s
        self.outbox: queue.Queue[dict[str, Any] | None] = queue.Queue(MAX_OUTSTANDING)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mam-alerts-send", daemon=True)

    def send(self, body: dict[str, Any]) -> None:
        try:
            self.outbox.put_nowait(body)
        except queue.Full:
            log.warning("alert webhook %s: %d notifications waiting; dropped: %s", shown(self.url),
                        MAX_OUTSTANDING, body.get("summary"))

    def _run(self) -> None:
        while True:
            body = self.outbox.get()
            if body is None:
                return
            raw = json.dumps(body).encode()
            for delay_s in (*self.delays_s, None):
                try:
                    self.post(self.url, raw)
                    break
                except (OSError, ValueError) as exc:  # urllib's URLError and HTTPError are OSErrors
                    what = f"HTTP {exc.code}" if isinstance(exc, urllib.error.HTTPError) else type(exc).__name__
                    if delay_s is None or self.stopping.is_set():
                        log.warning("alert webhook %s: %s; not delivered: %s", shown(self.url), what, body["summary"])
                        break
                    log.info("alert webhook %s: %s; again in %g s", shown(self.url), what, delay_s)
                    if self.stopping.wait(delay_s):
                        log.warning("alert webhook %s: stopping; not delivered: %s", shown(self.url), body["summary"])
                        break


class Alerter:
    """`serve --alert-webhook`: looks at `service` every `check_s`, sends what fired or resolved
    (see the module docstring). A `Companion` of `run_service`.

    Args:
        service: the running hub service; its `on_failed` is taken over.
        options: the webhooks and thresholds.
        post: how one body is POSTed (tests pass their own); delays_s: between tries.
    """

    def __init__(self, service: HubService, options: AlertOptions, *, post: Post = post_json,
                 delays_s: tuple[float, ...] = RETRY_DELAYS_S, check_s: float = CHECK_S) -> None:
        self.service = service
        self.options = options
        self.check_s = check_s
        self.hub = socket.gethostname()
        self.active: dict[str, tuple[Alert, float]] = {}  # key -> the alert, when it fired (epoch)
        self.senders = [Sender(url, post, delays_s) for url in options.webhooks]
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mam-alerts", daemon=True)
        service.on_failed = self.failed

    def start(self) -> None:
        for sender in self.senders:
            sender.thread.start()
        self.thread.start()
        log.info("alerts: %d webhook(s) (%s); queue wait > %g s, permission wait > %g s",
                 len(self.senders), ", ".join(shown(url) for url in self.options.webhooks),
                 self.options.queue_s, self.options.ask_s)

    def stop(self) -> None:
        """Stop looking; notifications already queued get one try each, then the threads end."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(self.check_s + POST_TIMEOUT_S)
        for sender in self.senders:
            sender.stopping.set()
            sender.outbox.put(None)
        for sender in self.senders:
            if sender.thread.is_alive():
                sender.thread.join(POST_TIMEOUT_S * 2)

    def failed(self, record: JobRecord) -> None:
        """`HubService.on_failed`: one `job_failed`, never resolved."""
        now_wall = time.time()
        self._send(failed_alert(record), FIRING, now_wall, now_wall)

    def check(self, now: float, now_wall: float) -> None:
        """Compare the conditions true now with the active ones: send what fired and what resolved."""
        current = conditions(self.service, self.options, now, now_wall)
        for key, alert in current.items():
            if key not in self.active:
                self.active[key] = (alert, now_wall)
                self._send(alert, FIRING, now_wall, now_wall)
        for key in [key for key in self.active if key not in current]:
            alert, since = self.active.pop(key)
            self._send(alert, RESOLVED, since, now_wall)

    def _send(self, alert: Alert, status: str, since: float, at: float) -> None:
        (log.warning if status == FIRING else log.info)("alert %s: %s", status, alert.summary)
        body = notification(alert, status, since, at, self.hub)
        for sender in self.senders:
            sender.send(body)

    def _run(self) -> None:
        while not self.stopping.wait(self.check_s):
            try:
                self.check(time.monotonic(), time.time())
            except Exception as exc:  # noqa: BLE001 - one bad look never ends alerting
                log.warning("alerts: conditions not checked: %s", exc)
