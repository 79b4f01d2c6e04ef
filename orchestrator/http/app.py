"""`mam-orch serve --http HOST:PORT`: the HTTP API, the live dashboard and
`/metrics` of the hub service, in the service's process (§14, §15).

Starlette on uvicorn, in a thread of `mam-orch serve` started once the service
holds its lock and subscribed (HubService's `on_ready`); the service loop keeps
the main thread, its one broker connection and its SIGTERM/SIGINT handling,
and stops uvicorn on its way out. Nothing here talks to the broker except a
cancel, on the service's own connection.

Bound to loopback by default; any other address needs `MAM_API_TOKEN`
(`Authorization: Bearer TOKEN`, or `?token=` for the event stream and the
page) and refuses to start without it. The token is never logged (uvicorn's
access log is off). Errors are JSON `{"error": reason}` with a 4xx for bad
input, never a traceback. `GET /api/events` is a server-sent event stream fed
by one `httpview.LiveFeed` for every client, told which jobs were written (`JobsWatch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from mam.orchestrator import asks, schedules
from mam.orchestrator.http.api import (
    cancel_request,
    dispatch_request,
    drain_request,
    retry_request,
    trigger_request,
)
from mam.orchestrator.http.metrics import HubMetrics
from mam.orchestrator.http.views import (
    LiveFeed,
    job_detail,
    job_result,
    job_row,
    queue_rows,
    read_log,
    runner_rows,
    schedule_rows,
)
from mam.orchestrator.hub import Workspace, open_hub
from mam.orchestrator.service import Companion, HubService, run_service
from mam.shared.protocol import names
from mam.shared.protocol.codes import JobStatus
from mam.shared.protocol.errors import BrokerError, ConfigError, MamError, UsageError
from mam.shared.store.changes import JobsWatch
from mam.shared.store.records import JobNotFound, Refusal

log = logging.getLogger("mam.http")

TOKEN_ENV = "MAM_API_TOKEN"
BEARER = "Bearer "
DEFAULT_BIND = "127.0.0.1:8765"
QUERY_INT_DIGITS = 15  # a query integer (attempt, offset) longer than this is refused, never parsed
MAX_BODY_BYTES = 1024 * 1024  # a request body larger than this is refused 413 (a brief is at most 512 KiB)
FEED_POLL_S = 0.25  # the live feed looks at runners and the queue this often; jobs as they are written
FEED_SCAN_S = 10.0  # and at every job this often (what a watch may not tell: a folder it could not watch)
SSE_KEEPALIVE_S = 15.0  # an idle event stream gets a comment line this often
SSE_RETRY_MS = 1000  # how soon a browser reconnects a dropped event stream
SSE_QUEUE_MAX = 1000  # messages buffered per stream client; a client this far behind is dropped
START_TIMEOUT_S = 10.0  # how long uvicorn may take to bind
STOP_GRACE_S = 1  # open streams get this long (s) to end at shutdown
START_POLL_S = 0.02  # how often start() looks whether uvicorn listens
MAX_PORT = 65535
STATIC = Path(__file__).resolve().parent / "static"
Handler = Callable[[Request], Awaitable[Response]]


def parse_bind(text: str) -> tuple[str, int]:
    """`HOST:PORT` (`[v6]:PORT` for IPv6) as (host, port).

    Raises:
        UsageError: not HOST:PORT with a port 1-65535.
    """
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= MAX_PORT:
        raise UsageError(f"--http {text!r} is invalid: expected HOST:PORT, e.g. {DEFAULT_BIND}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """True when every address `host` binds to is loopback (127.0.0.0/8, ::1): an address as
    it is, a name as it resolves here (a hosts file may map `localhost` elsewhere); a name
    that does not resolve is not loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return False
    try:
        return bool(found) and all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in found)
    except ValueError:
        return False


def api_token(host: str, environ: dict[str, str] | None = None) -> str | None:
    """The bearer token the API requires: MAM_API_TOKEN, or None on loopback without one.

    Raises:
        ConfigError: a non-loopback address and no MAM_API_TOKEN.
    """
    token = (os.environ if environ is None else environ).get(TOKEN_ENV, "").strip() or None
    if token is None and not is_loopback(host):
        raise ConfigError(f"--http on {host} (not loopback) needs {TOKEN_ENV} set: every request must then "
                          f"carry 'Authorization: Bearer <token>'")
    return token


def _error(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"error": reason}, status_code=status)


def _status_of(exc: MamError) -> int:
    if isinstance(exc, JobNotFound):
        return 404
    if isinstance(exc, Refusal):
        return 409
    if isinstance(exc, UsageError | ConfigError):
        return 400
    if isinstance(exc, BrokerError):
        return 503
    return 500


class Api:
    """The routes of one app over one `HubService`."""

    def __init__(self, service: HubService, token: str | None) -> None:
        self.service = service
        self.token = token
        self.metrics = HubMetrics(service)
        self.feed = LiveFeed(service, on_finish=self.metrics.finished, on_event=self.metrics.event,
                             on_unqueued=self.metrics.unqueued)
        self.clients: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self.closing = threading.Event()
        self.triggers = schedules.TriggerLimiter()

    # ------------------------------------------------------------ plumbing

    def authorized(self, request: Request, *, query: bool = False) -> bool:
        if self.token is None:
            return True
        given = request.headers.get("authorization", "")
        given = given.removeprefix(BEARER) if given.startswith(BEARER) else ""
        if not given and query:
            given = request.query_params.get("token", "")
        return hmac.compare_digest(given.encode(), self.token.encode())

    def guarded(self, handler: Handler, *, query_token: bool = False) -> Handler:
        """`handler` behind the token, with every error as JSON (never a traceback)."""

        async def endpoint(request: Request) -> Response:
            if not self.authorized(request, query=query_token):
                return _error(401, f"missing or wrong bearer token ({TOKEN_ENV})")
            try:
                return await handler(request)
            except MamError as exc:
                return _error(_status_of(exc), str(exc))
            except Exception as exc:  # noqa: BLE001 - a daemon never dies on a request; one line in its log
                log.warning("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
                return _error(500, f"internal error: {type(exc).__name__}")

        return endpoint

    async def body_json(self, request: Request) -> object:
        """The request body as JSON, at most MAX_BODY_BYTES.

        Raises:
            UsageError: malformed JSON (400). _TooLarge: over the cap (413).
        """
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise _TooLarge()
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY_BYTES:
                raise _TooLarge()
        try:
            return json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UsageError(f"the body is not valid JSON: {exc}") from None

    # ------------------------------------------------------------ routes

    async def runners(self, request: Request) -> Response:
        return JSONResponse({"runners": runner_rows(self.service)})

    async def queue(self, request: Request) -> Response:
        return JSONResponse({"queue": queue_rows(self.service)})

    async def jobs(self, request: Request) -> Response:
        status = request.query_params.get("status")
        if status is not None and status not in set(JobStatus):
            raise UsageError(f"status {status!r} is invalid: expected one of {', '.join(JobStatus)}")
        records, _ = await run_in_threadpool(self.service.registry.list, status)
        rows = [job_row(record) for record in records if record.get("role") == "hub"]
        return JSONResponse({"jobs": rows})

    async def job(self, request: Request) -> Response:
        job_id = names.validate_job_id(request.path_params["job_id"])
        return JSONResponse(await run_in_threadpool(job_detail, self.service, job_id))

    async def job_log(self, request: Request) -> Response:
        job_id = names.validate_job_id(request.path_params["job_id"])
        record = await run_in_threadpool(self.service.registry.get, job_id)
        attempt = _query_int(request, "attempt", record["attempt_id"])
        offset = _query_int(request, "offset", None)
        if attempt < 1 or attempt > record["attempt_id"] or (offset is not None and offset < 0):
            raise UsageError(f"attempt must be 1..{record['attempt_id']} and offset >= 0")
        return JSONResponse(await run_in_threadpool(read_log, self.service.registry.root, job_id, attempt, offset))

    async def job_result(self, request: Request) -> Response:
        """`GET /api/jobs/{id}/result[?attempt=N]`: the change as `mam-orch result --json` (§18)."""
        job_id = names.validate_job_id(request.path_params["job_id"])
        attempt = _query_int(request, "attempt", None)
        result = await run_in_threadpool(job_result, self.service, job_id, attempt)
        return JSONResponse(result.to_dict())

    async def job_patch(self, request: Request) -> Response:
        """`GET /api/jobs/{id}/result/patch[?attempt=N]`: the change as a patch file to download (§18)."""
        job_id = names.validate_job_id(request.path_params["job_id"])
        attempt = _query_int(request, "attempt", None)
        result = await run_in_threadpool(job_result, self.service, job_id, attempt)
        if result.patch_path is None:
            raise JobNotFound(f"job {job_id} attempt {result.attempt_id} has no patch: "
                              f"{(result.summary or {}).get('note') or 'the result is still arriving'}")
        return FileResponse(result.patch_path, media_type="text/x-diff",
                            filename=f"mam-{job_id}-{result.attempt_id}.patch")

    async def job_transcript(self, request: Request) -> Response:
        """`GET /api/jobs/{id}/result/transcript[?attempt=N]`: the agent's session transcript
        the result brought, masked, to download (JSON lines, §18 "Transcripts")."""
        job_id = names.validate_job_id(request.path_params["job_id"])
        attempt = _query_int(request, "attempt", None)
        result = await run_in_threadpool(job_result, self.service, job_id, attempt)
        path = result.transcript_path
        if path is None:
            raise JobNotFound(f"job {job_id} attempt {result.attempt_id} has no transcript: its agent kept none, "
                              "or it was left out (see the result's artifact_notes)")
        return FileResponse(path, media_type="application/x-ndjson",
                            filename=f"mam-{job_id}-{result.attempt_id}-{path.stem}.jsonl")

    async def job_artifact(self, request: Request) -> Response:
        """`GET /api/jobs/{id}/artifacts/{name}[?attempt=N]`: one artifact the agent left, to
        download (§18)."""
        job_id = names.validate_job_id(request.path_params["job_id"])
        attempt = _query_int(request, "attempt", None)
        result = await run_in_threadpool(job_result, self.service, job_id, attempt)
        try:
            path = result.artifact_path(request.path_params["name"])
        except FileNotFoundError as exc:
            raise JobNotFound(str(exc)) from None
        return FileResponse(path, media_type="application/octet-stream", filename=path.name)

    async def dispatch(self, request: Request) -> Response:
        try:
            body = await self.body_json(request)
        except _TooLarge:
            return _error(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        return JSONResponse(await run_in_threadpool(dispatch_request, self.service, body), status_code=201)

    async def asks(self, request: Request) -> Response:
        """`GET /api/asks`: every permission request waiting for a person (§19), oldest first."""
        found = await run_in_threadpool(asks.pending_everywhere, self.service.registry)
        return JSONResponse({"asks": [ask.to_dict() for ask in found]})

    async def job_asks(self, request: Request) -> Response:
        """`GET /api/jobs/{id}/asks`: the job's requests, answered ones too (§19)."""
        job_id = names.validate_job_id(request.path_params["job_id"])
        found = await run_in_threadpool(asks.asks_of, self.service.registry, job_id)
        return JSONResponse({"asks": [ask.to_dict() for ask in found]})

    async def answer(self, request: Request) -> Response:
        """`POST /api/jobs/{id}/asks/{request}/approve|deny` (optional body `{"reason": TEXT}` for a
        deny, `{"always": true}` for an approve): `mam-orch approve|deny` on the service's
        connection (§19); 409 when refused."""
        job_id = names.validate_job_id(request.path_params["job_id"])
        request_id = names.validate_request_id(request.path_params["request_id"])
        if request.path_params["verb"] not in ("approve", "deny"):
            return _error(404, "not found: the action is approve or deny")
        allow = request.path_params["verb"] == "approve"
        body = await self.body_json(request) if int(request.headers.get("content-length") or 0) else {}
        if not isinstance(body, dict) or set(body) - {"reason", "always"}:
            raise UsageError("the body is an object with 'reason' (deny) or 'always' (approve) only")
        reason, always = body.get("reason"), body.get("always", False)
        if reason is not None and not isinstance(reason, str):
            raise UsageError("field 'reason' is invalid: expected a string")
        if not isinstance(always, bool):
            raise UsageError("field 'always' is invalid: expected true or false")
        client = self.service.client
        if client is None:
            raise BrokerError("the hub service has no broker connection now; try again")
        try:
            done = await run_in_threadpool(partial(asks.answer, self.service.registry, client, self.service.keys,
                                                   job_id, request_id, allow=allow, message=reason,
                                                   by=f"api@{asks.operator().split('@')[-1]}", always=always))
        except asks.AnswerRefused as exc:
            return _error(409, str(exc))
        return JSONResponse(done.to_dict())

    async def cancel(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        return JSONResponse(await run_in_threadpool(cancel_request, self.service, job_id))

    async def retry(self, request: Request) -> Response:
        """`POST /api/jobs/{id}/retry`: a new attempt of an ended job (`retry_request`); 409 when refused."""
        job_id = request.path_params["job_id"]
        body = await self.body_json(request) if int(request.headers.get("content-length") or 0) else {}
        return JSONResponse(await run_in_threadpool(retry_request, self.service, job_id, body), status_code=201)

    async def schedules(self, request: Request) -> Response:
        """`GET /api/schedules`: each schedule with its next and last fire times (§14 Schedules)."""
        return JSONResponse({"schedules": await run_in_threadpool(schedule_rows, self.service)})

    async def schedule_run(self, request: Request) -> Response:
        """`POST /api/schedules/{name}/run`: fire one job of the schedule now (`trigger_request`),
        authorized by MAM_API_TOKEN or by the schedule's own trigger token (`schedule token`),
        at most `schedules.TRIGGERS_PER_MINUTE` a minute (429 with Retry-After beyond); 201
        with the job id, 409 when its overlap rule skipped the run. Every refusal is logged."""
        name = str(request.path_params["name"])
        client = request.client.host if request.client is not None else "-"
        try:
            schedules.check_name(name)
            by = "api" if self.authorized(request) else "token" if await run_in_threadpool(
                self._token_fires, name, request.headers.get("authorization", "")) else None
        except MamError as exc:
            return _error(_status_of(exc), str(exc))
        if by is None:  # the same answer for an unknown schedule: names are not probed this way
            log.warning("schedule %s: a trigger from %s was refused: missing or wrong token", name[:64], client)
            return _error(401, f"missing or wrong bearer token (the schedule's trigger token, or {TOKEN_ENV})")
        wait_s = self.triggers.allow(name, time.monotonic())
        if wait_s is not None:
            log.warning("schedule %s: a trigger from %s was refused: over %d a minute", name, client,
                        self.triggers.per_minute)
            return JSONResponse({"error": f"schedule {name} was triggered {self.triggers.per_minute} times in the "
                                          f"last minute; try again in {math.ceil(wait_s)} s"},
                                status_code=429, headers={"Retry-After": str(math.ceil(wait_s))})
        try:
            done = await run_in_threadpool(trigger_request, self.service, name, by=by, client=client)
        except MamError as exc:
            return _error(_status_of(exc), str(exc))
        except Exception as exc:  # noqa: BLE001 - a daemon never dies on a request; one line in its log
            log.warning("POST %s failed: %s: %s", request.url.path, type(exc).__name__, exc)
            return _error(500, f"internal error: {type(exc).__name__}")
        if done is None:
            return _error(409, f"schedule {name}: not fired: its last job is still open (--overlap skip)")
        return JSONResponse(done, status_code=201)

    def _token_fires(self, name: str, header: str) -> bool:
        given = header.removeprefix(BEARER) if header.startswith(BEARER) else ""
        try:
            schedule = schedules.Store(self.service.registry.root).load(name)
        except MamError:
            return False
        return schedules.token_fires(schedule, given)

    async def drain(self, request: Request) -> Response:
        """`POST /api/runners/{session}/drain|undrain`: the hub's drain order (`drain_request`)."""
        session, verb = request.path_params["session"], request.path_params["verb"]
        if verb not in ("drain", "undrain"):
            raise JobNotFound(f"no such action: {verb!r} (drain or undrain)")
        body = await self.body_json(request) if int(request.headers.get("content-length") or 0) else {}
        return JSONResponse(await run_in_threadpool(drain_request, self.service, session, body,
                                                    draining=verb == "drain"))

    async def events(self, request: Request) -> Response:
        """`GET /api/events`: server-sent events `runners`, `queue`, `job`, `event`, `log` (JSON data)."""
        client: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(SSE_QUEUE_MAX)
        self.clients.add(client)

        async def stream() -> AsyncIterator[str]:
            try:
                yield f"retry: {SSE_RETRY_MS}\n\n"
                while not self.closing.is_set():
                    try:
                        item = await asyncio.wait_for(client.get(), SSE_KEEPALIVE_S)
                    except TimeoutError:
                        yield ": keepalive\n\n"
                        continue
                    if item is None:
                        return
                    yield f"event: {item['type']}\ndata: {json.dumps(item, separators=(',', ':'))}\n\n"
            finally:
                self.clients.discard(client)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def metrics_text(self, request: Request) -> Response:
        data = await run_in_threadpool(generate_latest, self.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    async def page(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------ the feed

    async def run_feed(self) -> None:
        """Hand what changed to every stream client: the jobs the watch names as soon as they
        are written (every job at the start, every FEED_SCAN_S and when the watch cannot
        tell), the runners and the queue at least every FEED_POLL_S."""
        scanned = -FEED_SCAN_S
        with JobsWatch(self.service.registry.root) as watch:
            self.feed.watch = watch
            while not self.closing.is_set():
                try:
                    changed = await run_in_threadpool(watch.changed, FEED_POLL_S)
                    if time.monotonic() - scanned >= FEED_SCAN_S:
                        changed, scanned = None, time.monotonic()
                    items = await run_in_threadpool(self.feed.poll, changed)
                except Exception as exc:  # noqa: BLE001 - the feed goes on; one line
                    log.warning("live feed: %s: %s", type(exc).__name__, exc)
                    items = []
                for client in list(self.clients):
                    for item in items:
                        try:
                            client.put_nowait(item)
                        except asyncio.QueueFull:
                            self.clients.discard(client)  # far behind: it reconnects and reloads
                            break
            self.feed.watch = None
        for client in list(self.clients):
            with contextlib.suppress(asyncio.QueueFull):
                client.put_nowait(None)


class _TooLarge(Exception):
    """A request body over MAX_BODY_BYTES."""


def _query_int(request: Request, name: str, default: int | None) -> Any:
    text = request.query_params.get(name)
    if text is None:
        return default
    if not text.isdigit() or len(text) > QUERY_INT_DIGITS:
        raise UsageError(f"query parameter {name}={text[:QUERY_INT_DIGITS]!r} is invalid: expected a "
                         f"non-negative integer of at most {QUERY_INT_DIGITS} digits")
    return int(text)


def create_app(service: HubService, token: str | None = None) -> Starlette:
    """The Starlette app of `serve --http` over a (running or test) `HubService`."""
    api = Api(service, token)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(api.run_feed())
        try:
            yield
        finally:
            api.closing.set()
            task.cancel()

    g = api.guarded
    routes = [
        Route("/", api.page),
        Route("/api/runners", g(api.runners)),
        Route("/api/runners/{session}/{verb:str}", g(api.drain), methods=["POST"]),
        Route("/api/schedules", g(api.schedules)),
        Route("/api/schedules/{name}/run", api.schedule_run, methods=["POST"]),
        Route("/api/queue", g(api.queue)),
        Route("/api/jobs", g(api.jobs), methods=["GET"]),
        Route("/api/jobs", g(api.dispatch), methods=["POST"]),
        Route("/api/jobs/{job_id}", g(api.job)),
        Route("/api/jobs/{job_id}/log", g(api.job_log)),
        Route("/api/jobs/{job_id}/result", g(api.job_result)),
        Route("/api/jobs/{job_id}/result/patch", g(api.job_patch, query_token=True)),
        Route("/api/jobs/{job_id}/result/transcript", g(api.job_transcript, query_token=True)),
        Route("/api/jobs/{job_id}/artifacts/{name}", g(api.job_artifact, query_token=True)),
        Route("/api/jobs/{job_id}/cancel", g(api.cancel), methods=["POST"]),
        Route("/api/jobs/{job_id}/retry", g(api.retry), methods=["POST"]),
        Route("/api/asks", g(api.asks)),
        Route("/api/jobs/{job_id}/asks", g(api.job_asks)),
        Route("/api/jobs/{job_id}/asks/{request_id}/{verb:str}", g(api.answer), methods=["POST"]),
        Route("/api/events", g(api.events, query_token=True)),
        Route("/metrics", g(api.metrics_text)),
        Mount("/static", StaticFiles(directory=STATIC)),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(404, f"no such path: {request.url.path}")

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return _error(405, f"{request.method} is not allowed on {request.url.path}")

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_allowed})
    app.state.api = api
    return app


class HttpServer:
    """uvicorn serving `create_app(service)` in a thread of `mam-orch serve`.

    Args:
        service: the hub service; bind: HOST:PORT.
    Raises:
        UsageError: a bad bind. ConfigError: a non-loopback bind without MAM_API_TOKEN.
    """

    def __init__(self, service: HubService, bind: str) -> None:
        self.host, self.port = parse_bind(bind)
        self.token = api_token(self.host)
        self.app = create_app(service, self.token)
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_config=None, access_log=False,
                                lifespan="on", timeout_graceful_shutdown=STOP_GRACE_S,
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Start serving in a thread; return once it listens.

        Raises:
            UsageError: it could not listen there (address in use, not this machine's).
        """
        self.thread = threading.Thread(target=self._run, name="mam-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(START_POLL_S)
        if not self.server.started:
            self.server.should_exit = True
            raise UsageError(f"--http {self.host}:{self.port}: cannot listen there (in use, or not an address "
                             f"of this machine)")
        auth = f"bearer token {TOKEN_ENV} required" if self.token else "loopback only, no token"
        print(f"mam-orch serve: dashboard and API on {self.url}/ ({auth})", file=sys.stderr, flush=True)

    def _run(self) -> None:
        try:
            self.server.run()
        except (SystemExit, OSError) as exc:  # uvicorn exits when it cannot bind: start() reports it
            log.debug("http server ended: %r", exc)

    def stop(self) -> None:
        """End the streams, stop uvicorn, wait for its thread."""
        api: Api = self.app.state.api
        api.closing.set()
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(START_TIMEOUT_S)


def serve_http_cli(*, workspace: Workspace, bind: str,
                   companions: Sequence[Callable[[HubService], Companion]] = ()) -> int:
    """`mam-orch serve --http HOST:PORT`: the hub service plus this server (and `companions`),
    stopped with it.

    Raises:
        UsageError (exit 64: another service runs, a bad or busy address), ConfigError (no token
        for a non-loopback address), BrokerUnavailable (exit 3).
    """
    service = HubService(open_hub(workspace))
    server = HttpServer(service, bind)  # the address and the token are checked before anything starts
    return run_service(service, [server, *(make(service) for make in companions)])
