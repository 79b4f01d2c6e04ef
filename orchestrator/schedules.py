"""Schedules (PROTOCOL §14 "Schedules"): a job the hub engine dispatches on a cron expression.

    mam-orch schedule add nightly --cron '0 3 * * *' --tz Europe/Berlin -- --labels gpu --brief '...'

A schedule is `.mam/schedules/<name>.json` (0600: it holds the brief): its cron expression
(5 fields, or 6 with seconds last; croniter), time zone, overlap policy, catch-up count, the
dispatch it makes (brief, title, contract, §14 terms, §18 work) and `last_tick`, the last
tick handled (fired or skipped). The engine (`fire_due`) looks every second: under the
registry lock it records the new `last_tick` first and only then registers the jobs, so two
engines never fire one tick twice, and a crash between the two loses that run rather than
running it twice. A tick found more than `LATE_S` late was missed (the hub was down): of the
missed ticks the engine fires the last `catch_up` ones, each marked `catch_up`. Overlap, when
the schedule's previous job is still open: `skip` the tick (said in the engine's log and the
schedule's `last_skipped`), `queue` it anyway, or `cancel` the previous job first. Every job
fired carries `schedule: {"name", "tick", "catch_up"}` in its record (and `trigger` when a
person or a trigger fired it out of its ticks).

Triggers from outside (`POST /api/schedules/<name>/run`): `issue_token` writes a trigger
token to `<name>.token` (0600) beside the schedule, which keeps only its SHA-256
(`trigger_sha256`), so CI or a Git hook can fire the schedule's job without the hub's admin
token; `TriggerLimiter` allows a few such runs a minute per schedule.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from mam.orchestrator.dispatch import hub_contract, job_title, queue_terms, read_brief, work_terms
from mam.shared.protocol import names, wire
from mam.shared.protocol.codes import TERMINAL_STATUSES
from mam.shared.protocol.errors import RegistryError, UsageError
from mam.shared.store.fsio import atomic_write
from mam.shared.store.records import JobRecord, QueueTerms
from mam.shared.store.registry import Contract, JobNotFound, Registry

log = logging.getLogger("mam.hub")

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
OVERLAPS = ("skip", "queue", "cancel")
MAX_CATCH_UP = 100
LATE_S = 15.0
"""A tick found this much later than its time was missed (the engine was not running), seconds."""
MAX_TICKS = 10_000
"""Ticks looked at per schedule and look at most (a schedule every second, down for a long time)."""
MAX_FILE_BYTES = 2 << 20
"""Largest schedule file read (the brief is at most 1 MiB)."""
TOKEN_BYTES = 32
"""A trigger token's random bytes (43 base64url characters)."""
MAX_TOKEN_CHARS = 256
"""A presented trigger token longer than this is refused unread."""
TRIGGERS_PER_MINUTE = 6
"""Runs a schedule's trigger may fire in any 60 s (`TriggerLimiter`); more are refused (HTTP 429)."""
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def schedules_dir(root: Path) -> Path:
    """`<root>/.mam/schedules`."""
    return names.mam_dir(root) / "schedules"


def check_name(name: str) -> str:
    """A schedule name: 1-64 of `a-z 0-9 _ . -`, starting with a letter or digit. Raises `UsageError`."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise UsageError(f"schedule name {str(name)[:40]!r} is invalid: expected 1-64 lowercase letters, digits, "
                         "'_', '.' or '-', starting with a letter or digit")
    return name


def check_cron(expr: str) -> str:
    """A cron expression of 5 fields (minute hour day month weekday), or 6 with seconds last.
    Raises `UsageError` naming it."""
    fields = expr.split() if isinstance(expr, str) else []
    if len(fields) not in (5, 6) or len(expr) > 200 or not croniter.is_valid(" ".join(fields)):
        raise UsageError(f"--cron {str(expr)[:60]!r} is invalid: expected 5 fields (minute hour day month "
                         "weekday, e.g. '0 3 * * *'), or 6 with seconds last")
    return " ".join(fields)


def check_tz(name: str) -> str:
    """An IANA time zone name (`Europe/Berlin`, `UTC`). Raises `UsageError`."""
    try:
        if not isinstance(name, str) or len(name) > 64 or name.startswith(("/", ".")) or ".." in name:
            raise ValueError(name)
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise UsageError(f"--tz {str(name)[:60]!r} is not a known time zone (e.g. UTC, Europe/Berlin)") from None
    return name


@dataclass(frozen=True)
class Schedule:
    """One schedule as stored (see the module docstring); times are §3 UTC timestamps."""

    name: str
    cron: str
    tz: str
    overlap: str
    catch_up: int
    job: dict[str, Any]
    created_at: str
    last_tick: str
    paused: bool = False
    last_job: str | None = None
    last_fired_at: str | None = None
    last_skipped: str | None = None
    trigger_sha256: str | None = None

    def checked(self) -> Schedule:
        """Itself if every field keeps the rules. Raises `UsageError`."""
        check_name(self.name)
        check_cron(self.cron)
        check_tz(self.tz)
        if self.overlap not in OVERLAPS:
            raise UsageError(f"--overlap {self.overlap!r} is invalid: expected {', '.join(OVERLAPS)}")
        if isinstance(self.catch_up, bool) or not isinstance(self.catch_up, int) \
                or not 0 <= self.catch_up <= MAX_CATCH_UP:
            raise UsageError(f"--catch-up {self.catch_up!r} is invalid: expected 0..{MAX_CATCH_UP}")
        wire.parse_ts(self.last_tick)
        if self.trigger_sha256 is not None and not SHA256_RE.fullmatch(str(self.trigger_sha256)):
            raise UsageError("trigger_sha256 is invalid: expected 64 hex characters")
        return self

    def ticks(self, after: datetime, until: datetime) -> list[datetime]:
        """The schedule's ticks in (after, until], UTC, at most MAX_TICKS (the latest ones)."""
        it = croniter(self.cron, after.astimezone(ZoneInfo(self.tz)))
        found: list[datetime] = []
        while True:
            tick = it.get_next(datetime).astimezone(UTC)
            if tick > until:
                return found
            found.append(tick)
            if len(found) > MAX_TICKS:
                del found[0]

    def next_tick(self, now: datetime) -> datetime:
        """The next tick after `now` (UTC)."""
        tick: datetime = croniter(self.cron, now.astimezone(ZoneInfo(self.tz))).get_next(datetime)
        return tick.astimezone(UTC)


def due(schedule: Schedule, now: datetime) -> tuple[list[tuple[datetime, bool]], datetime | None]:
    """What to fire at `now`: [(tick, catch_up)] oldest first, and the new `last_tick` (None:
    nothing is due). The latest tick fires as itself when it is at most LATE_S old; earlier
    (missed) ticks fire as catch-up runs, the last `catch_up` of them."""
    ticks = schedule.ticks(wire.parse_ts(schedule.last_tick), now)
    if not ticks:
        return [], None
    on_time = ticks[-1] if (now - ticks[-1]).total_seconds() <= LATE_S else None
    missed = ticks[:-1] if on_time is not None else ticks
    fire = [(tick, True) for tick in missed[len(missed) - schedule.catch_up:]] if schedule.catch_up else []
    if on_time is not None:
        fire.append((on_time, False))
    return fire, ticks[-1]


class Store:
    """The schedules of one hub registry."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.folder = schedules_dir(root)

    def path(self, name: str) -> Path:
        return self.folder / f"{check_name(name)}.json"

    def save(self, schedule: Schedule) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(self.path(schedule.name), json.dumps(asdict(schedule), sort_keys=True).encode() + b"\n",
                     what=f"schedule {schedule.name}")

    def load(self, name: str) -> Schedule:
        """Raises: JobNotFound (no such schedule); RegistryError (unreadable or not a schedule)."""
        path = self.path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise JobNotFound(f"no schedule named {name}") from None
        except OSError as exc:
            raise RegistryError(f"schedule {name}: cannot read {path} ({exc.strerror})") from None
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
        try:
            if len(data) > MAX_FILE_BYTES:
                raise ValueError("too large")
            return Schedule(**json.loads(data)).checked()
        except (ValueError, TypeError, UsageError) as exc:
            raise RegistryError(f"schedule {name}: {path} is not a schedule ({str(exc)[:80]})") from None

    def names(self) -> list[str]:
        try:
            return sorted(p.stem for p in self.folder.glob("*.json") if NAME_RE.fullmatch(p.stem))
        except OSError:
            return []

    def all(self) -> Iterator[Schedule]:
        """Every readable schedule; an unreadable one is logged and left out."""
        for name in self.names():
            try:
                yield self.load(name)
            except (JobNotFound, RegistryError) as exc:
                log.warning("%s", exc)

    def remove(self, name: str) -> None:
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            raise JobNotFound(f"no schedule named {name}") from None
        self.token_path(name).unlink(missing_ok=True)

    def token_path(self, name: str) -> Path:
        """Where `issue_token` writes the schedule's trigger token (0600)."""
        return self.folder / f"{check_name(name)}.token"


def new_schedule(name: str, *, cron: str, tz: str, overlap: str, catch_up: int, brief: str, title: str | None,
                 contract: Contract, terms: QueueTerms, work: wire.Work | None, now: datetime) -> Schedule:
    """A checked schedule whose first tick is the first after `now`. Raises `UsageError`."""
    job = {"brief": brief, "title": title, "contract": asdict(contract), "terms": terms._asdict(),
           "work": work.to_dict() if work else None}
    return Schedule(name=name, cron=check_cron(cron), tz=tz, overlap=overlap, catch_up=catch_up, job=job,
                    created_at=wire.format_ts(now), last_tick=wire.format_ts(now)).checked()


Register = Callable[..., JobRecord]


def fire(registry: Registry, store: Store, schedule: Schedule, now: datetime, register: Register,
         cancel: Callable[[str, str], object], *, forced: bool = False,
         trigger: dict[str, str] | None = None) -> list[str]:
    """Fire what of `schedule` is due at `now` (every tick with `forced`: `run-now` or a
    trigger, one job for `now`), holding the registry lock; returns the job ids registered.

    Args:
        register: `register_queued` (brief, contract, terms, work, title, schedule=...).
        cancel: cancels an open job (job id, reason), for `--overlap cancel`.
        trigger: who fired it out of its ticks (`{"by": "run-now"}`, `{"by": "token", "from":
            host}`), kept in the job's `schedule` field.
    """
    with registry.lock():
        schedule = store.load(schedule.name)  # again, under the lock: another engine may have fired it
        if forced:
            todo, last = [(now.replace(microsecond=0), False)], None
        else:
            todo, last = due(schedule, now)
            if last is None:
                return []
            if schedule.paused:  # a paused schedule skips its ticks; none is caught up on resume
                store.save(replace(schedule, last_tick=wire.format_ts(last)))
                return []
        previous = _open_job(registry, schedule.last_job)
        if previous is not None and schedule.overlap == "skip":
            skipped = ", ".join(wire.format_ts(tick) for tick, _ in todo)
            log.warning("schedule %s: tick %s skipped: its job %s is still %s (--overlap skip)", schedule.name,
                        skipped, previous["job_id"], previous["status"])
            store.save(replace(schedule, last_tick=wire.format_ts(last) if last else schedule.last_tick,
                               last_skipped=f"{skipped}: job {previous['job_id']} still {previous['status']}"))
            return []
        if last is not None:
            schedule = replace(schedule, last_tick=wire.format_ts(last))
        store.save(schedule)  # the tick is recorded before its job exists: never fired twice
        if previous is not None and schedule.overlap == "cancel":
            cancel(previous["job_id"], f"schedule {schedule.name}: a new tick came (--overlap cancel)")
        fired: list[str] = []
        for tick, catch_up in todo:
            record = _register(registry, register, schedule, tick, catch_up, trigger)
            fired.append(record["job_id"])
            log.info("schedule %s: tick %s fired job %s%s", schedule.name, wire.format_ts(tick), record["job_id"],
                     " (catch-up)" if catch_up else "")
        if fired:
            store.save(replace(schedule, last_job=fired[-1], last_fired_at=wire.format_ts(now)))
        return fired


def _register(registry: Registry, register: Register, schedule: Schedule, tick: datetime, catch_up: bool,
              trigger: dict[str, str] | None) -> JobRecord:
    job = schedule.job
    fired: dict[str, Any] = {"name": schedule.name, "tick": wire.format_ts(tick), "catch_up": catch_up}
    if trigger:
        fired["trigger"] = dict(trigger)
    fields: dict[str, Any] = {key: tuple(value) if isinstance(value, list) else value
                              for key, value in job["terms"].items()}
    terms = QueueTerms(**fields)
    work = wire.Work.from_dict(job["work"]) if job.get("work") else None
    return register(registry, brief=job["brief"], contract=Contract(**job["contract"]), terms=terms, work=work,
                    title=job.get("title"), schedule=fired)


def _open_job(registry: Registry, job_id: str | None) -> JobRecord | None:
    if job_id is None:
        return None
    try:
        record = registry.get(job_id)
    except (JobNotFound, RegistryError):
        return None
    return record if record["status"] not in TERMINAL_STATUSES else None


@dataclass
class Firing:
    """The engine's side: look at the schedules at most every `every_s` seconds."""

    registry: Registry
    register: Register
    cancel: Callable[[str, str], object]
    every_s: float = 1.0
    _next: float = field(default=0.0)

    def look(self, monotonic_now: float, now: datetime | None = None) -> list[str]:
        """Fire every due schedule; never raises (a bad schedule is logged)."""
        if monotonic_now < self._next:
            return []
        self._next = monotonic_now + self.every_s
        store = Store(self.registry.root)
        fired: list[str] = []
        for schedule in store.all():
            try:
                fired += fire(self.registry, store, schedule, now or datetime.now(UTC), self.register, self.cancel)
            except Exception as exc:  # an engine never dies on one schedule
                log.error("schedule %s not fired: %s: %s", schedule.name, type(exc).__name__, exc)
        return fired


def issue_token(root: Path, name: str) -> Path:
    """`schedule token NAME`: a new trigger token (replacing any earlier one) written to
    `Store.token_path` (0600); the schedule keeps only its SHA-256. Returns the file's path
    (the token itself is never printed).

    Raises:
        JobNotFound: no such schedule. RegistryError: a write failed.
    """
    store = Store(root)
    token = secrets.token_urlsafe(TOKEN_BYTES)
    path = store.token_path(name)
    with Registry(root).lock():  # as `fire` does: no tick recorded meanwhile is lost
        schedule = store.load(name)
        atomic_write(path, token.encode("ascii") + b"\n", what=f"schedule {name}'s trigger token")
        store.save(replace(schedule, trigger_sha256=_digest(token)))
    return path


def revoke_token(root: Path, name: str) -> bool:
    """`schedule token NAME --revoke`: no token fires it any more. Returns whether one was set."""
    store = Store(root)
    with Registry(root).lock():
        schedule = store.load(name)
        store.save(replace(schedule, trigger_sha256=None))
        store.token_path(name).unlink(missing_ok=True)
    return schedule.trigger_sha256 is not None


def token_fires(schedule: Schedule, given: str) -> bool:
    """Whether `given` is the schedule's trigger token (compared in constant time)."""
    if schedule.trigger_sha256 is None or not isinstance(given, str) or not 0 < len(given) <= MAX_TOKEN_CHARS:
        return False
    return hmac.compare_digest(_digest(given), schedule.trigger_sha256)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()


class TriggerLimiter:
    """At most `per_minute` triggered runs per schedule in any 60 s (monotonic seconds)."""

    def __init__(self, per_minute: int = TRIGGERS_PER_MINUTE) -> None:
        self.per_minute = per_minute
        self._runs: dict[str, deque[float]] = {}

    def allow(self, name: str, now: float) -> float | None:
        """None and the run counted when allowed; else the seconds until one is."""
        runs = self._runs.setdefault(name, deque())
        while runs and now - runs[0] >= 60.0:
            runs.popleft()
        if len(runs) >= self.per_minute:
            return max(0.0, 60.0 - (now - runs[0]))
        runs.append(now)
        return None


def next_fire(schedule: Schedule, now: datetime | None = None) -> str | None:
    """When it fires next (§3 timestamp), None while paused."""
    if schedule.paused:
        return None
    return wire.format_ts(schedule.next_tick(now or datetime.now(UTC)))


def describe(schedule: Schedule, now: datetime | None = None) -> dict[str, Any]:
    """A schedule as `schedule list|show` print it (no brief: it may be secret)."""
    job = schedule.job
    terms = job.get("terms", {})
    target = (f"session={terms['target_session']}" if terms.get("target_session")
              else "labels=" + ",".join(terms.get("target_labels") or []) if terms.get("target_labels")
              else "any runner")
    return {"name": schedule.name, "cron": schedule.cron, "tz": schedule.tz, "overlap": schedule.overlap,
            "catch_up": schedule.catch_up, "paused": schedule.paused, "target": target,
            "title": job.get("title") or (job.get("brief") or "").splitlines()[0][:80] if job.get("brief") else "",
            "next_fire": next_fire(schedule, now), "last_tick": schedule.last_tick, "last_job": schedule.last_job,
            "last_fired_at": schedule.last_fired_at, "last_skipped": schedule.last_skipped,
            "trigger_token": schedule.trigger_sha256 is not None}


def describe_all(root: Path) -> list[dict[str, Any]]:
    """Every schedule of the hub at `root`, `describe`d: what `schedule list`, `GET
    /api/schedules`, `/metrics` and `mam.Hub.schedules()` show."""
    return [describe(schedule) for schedule in Store(root).all()]





IGNORED_DISPATCH_OPTIONS = ("detach", "as_json", "no_log", "require_online")
"""`dispatch` options a schedule refuses: they say how a person follows one job, not what it is."""


def add(root: Path, name: str, *, cron: str, tz: str, overlap: str, catch_up: int, params: dict[str, Any],
        force: bool = False, now: datetime | None = None) -> Schedule:
    """`mam-orch schedule add`: a schedule from `dispatch`'s parsed options (`params`, as its
    command's parameters are named), checked as `dispatch` checks them, and saved.

    Raises:
        UsageError: a bad name, cron, time zone, overlap, catch-up or dispatch option; the
            name is taken (without `force`).
    """
    check_name(name)
    check_tz(tz)
    for key in IGNORED_DISPATCH_OPTIONS:
        if params.get(key):
            raise UsageError(f"--{key.replace('_', '-').replace('as-json', 'json')} has no meaning for a schedule")
    if params.get("after") or params.get("after_if") or params.get("from_result"):
        raise UsageError("--after, --if and --from-result have no meaning for a schedule: every tick's job "
                         "would wait on the same jobs")
    terms = queue_terms(params.get("session"), params.get("labels"), priority=params.get("priority") or 0,
                        queue_timeout_s=params.get("queue_timeout"), retries=params.get("retries") or 0,
                        retry_on=params.get("retry_on"), fresh=bool(params.get("fresh")),
                        on_limit=params.get("on_limit") or "pause", group=params.get("group"),
                        group_limit=params.get("group_limit"),
                        cancel_in_progress=bool(params.get("cancel_in_progress")))
    text = read_brief(params.get("brief"), params.get("brief_file"), None)
    title = params.get("title")
    job_title(text, title)
    contract = hub_contract(root, heartbeat_s=params.get("heartbeat"), heartbeat_misses=params.get("heartbeat_misses"),
                            ack_timeout_s=params.get("ack_timeout"), idle_timeout_s=params.get("idle_timeout"),
                            timeout_s=params.get("timeout"))
    work = work_terms(repo=params.get("repo"), ref=params.get("ref"), max_turns=params.get("max_turns"),
                      max_cost_usd=params.get("max_cost_usd"), allow_tools=params.get("allow_tools"),
                      deny_tools=params.get("deny_tools"), permission_mode=params.get("permission_mode"),
                      ask_timeout_s=params.get("ask_timeout"), on_ask_timeout=params.get("on_ask_timeout"),
                      memory=params.get("memory"), cpus=params.get("cpus"), pids=params.get("pids"),
                      gpus=params.get("gpus"))
    schedule = new_schedule(name, cron=cron, tz=tz, overlap=overlap, catch_up=catch_up, brief=text, title=title,
                            contract=contract, terms=terms, work=work, now=now or datetime.now(UTC))
    store = Store(root)
    if store.path(name).exists() and not force:
        raise UsageError(f"schedule {name} exists (remove it first, or add it again with --force)")
    store.save(schedule)
    return schedule


def set_paused(root: Path, name: str, paused: bool) -> Schedule:
    """`schedule pause|resume`: a resumed schedule goes on from now (no ticks of the pause are caught up)."""
    store = Store(root)
    with Registry(root).lock():  # as `fire` does: no tick recorded meanwhile is lost
        schedule = store.load(name)
        now = wire.format_ts()
        schedule = replace(schedule, paused=paused,
                           last_tick=now if not paused and schedule.paused else schedule.last_tick)
        store.save(schedule)
    return schedule


__all__ = ["LATE_S", "OVERLAPS", "Firing", "Schedule", "Store", "TriggerLimiter", "add", "check_cron", "check_name",
           "check_tz", "describe", "due", "fire", "issue_token", "new_schedule", "next_fire", "revoke_token",
           "schedules_dir", "set_paused", "token_fires"]
