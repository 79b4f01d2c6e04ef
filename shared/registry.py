"""The job registry of PROTOCOL §8: one JSON record per job on this host,
atomic writes, one `fcntl.flock` around every read-modify-write, per-attempt
seq allocation (§3), compare-and-swap transitions and the audit log.

Layout (paths from `mam.shared.names`, root from `config.resolve_root`):

    <root>/.mam/jobs/<job_id>.json          record, 0600 (holds auth_token)
    <root>/.mam/jobs/.lock                  the registry lock (§8, §12)
    <root>/.mam/logs/<job_id>/meta.json     identity and contract, no secrets
    <root>/.mam/logs/<job_id>/status.json   status, attempt, updated_at
    <root>/.mam/logs/<job_id>/events.ndjson audit log, one JSON object a line

Sources (§8). Worker sources hold an attempt and must name its
`attempt_id` and `dispatch_token`: `publisher` (the runner's publish path),
`runner` (the runner daemon), `remote_mirror` (the hub mirroring a verified
remote event, carrying that event's identity). Operator sources may cancel,
close and redispatch, and carry no token: `operator`, `registry_cli`,
`delegate_wrapper`.

Every refusal is a `TransitionRefused` subclass (`Refusal`) with a `reason`
of §3.2's vocabulary: `stale_attempt`, `duplicate`, `after_terminal`, or
`not_allowed` / `replayed` for bad edges and replayed dispatches. Messages
are one line naming the job and never carry a token.

Guarantees and limits are in docs/registry.md: one host only; `fcntl.flock`
is not safe on NFS.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

from mam.shared import names, wire
from mam.shared.codes import CLOSE_STATUS, EVENT_NAMES, EVENT_STATUS, JOB_STATUSES, TERMINAL_STATUSES
from mam.shared.errors import (
    ConfigError,
    RegistryError,
    StaleAttemptError,
    TransitionRefused,
    UsageError,
)
from mam.shared.fsio import append_line, atomic_write, errno_name, read_capped

log = logging.getLogger("mam.registry")

RECORD_VERSION = 1
WORKER_SOURCES = frozenset({"publisher", "runner", "remote_mirror"})
OPERATOR_SOURCES = frozenset({"operator", "registry_cli", "delegate_wrapper"})
# close reason -> terminal status (§8, §10)
# the status an event moves a record to; other events leave it alone (§3, §8)
# worker edges of the state machine; redispatch is its own operation
WORKER_EDGES = frozenset({
    ("pending", "running"), ("pending", "completed"), ("pending", "error"), ("pending", "cancelled"),
    ("running", "completed"), ("running", "error"), ("running", "cancelled"),
})
SECRET_FIELDS = ("auth_token", "dispatch_token")
RECORD_MAX_BYTES = 1 << 20  # a record is a few hundred bytes; anything this big is hostile
_RECORD_NAME_RE = re.compile(r"^[0-9a-f]{8}\.json$")


def utc_now() -> str:
    """UTC time as `YYYY-MM-DDTHH:MM:SSZ` (the §3 form)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------ errors

class Refusal(TransitionRefused):
    """A refused request (§8), with `job_id` and a §3.2-style `reason`:
    `stale_attempt`, `duplicate`, `after_terminal`, `not_allowed`, `replayed`."""

    def __init__(self, job_id: str, reason: str, message: str) -> None:
        self.job_id = job_id
        self.reason = reason
        super().__init__(f"job {job_id}: {message}")


class StaleTransition(Refusal, StaleAttemptError):
    """A worker request naming an attempt or dispatch token that is not current.
    Catchable as both `TransitionRefused` and `StaleAttemptError`."""

    def __init__(self, job_id: str, message: str) -> None:
        super().__init__(job_id, "stale_attempt", message)


class JobNotFound(RegistryError):
    """No record for that job id on this host."""


# ---------------------------------------------------------------- contract

# The §5 contract is one type, the wire's; records store its five fields.
Contract = wire.Contract


class Acceptance(NamedTuple):
    """What `Registry.accept_event` did: the record after it, and the
    (expected, got) seqs when a gap was logged (§3.2 step 6), else None."""

    record: dict[str, Any]
    gap: tuple[int, int] | None


# ------------------------------------------------------------ file helpers

def _dumps(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _check_record(obj: Any, job_id: str) -> str | None:
    """Why `obj` is not a usable record of `job_id`, or None."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    if obj.get("job_id") != job_id:
        return "job_id does not match the file name"
    if obj.get("status") not in JOB_STATUSES:
        return f"unknown status {obj.get('status')!r}"
    for key in ("attempt_id", "last_seq", "transition_seq"):
        value = obj.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "attempt_id" else 0):
            return f"bad {key} {value!r}"
    for key in SECRET_FIELDS:
        if not isinstance(obj.get(key), str) or not obj.get(key):
            return f"missing {key}"
    return None


def validate_broker(broker: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Check a record's per-job broker overrides (§8, §13) with the same rules
    `config.apply_job_overrides` applies when they are used.

    Raises:
        UsageError: not an object, an unknown key, a password/secret key, or a bad value.
    """
    from mam.shared.config import BrokerConfig, apply_job_overrides

    if broker is None:
        return None
    if not isinstance(broker, Mapping):
        raise UsageError("broker overrides must be a JSON object")
    try:
        apply_job_overrides(BrokerConfig(), broker)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    out = dict(broker)
    if isinstance(out.get("hosts"), tuple):
        out["hosts"] = list(out["hosts"])
    return out


# ----------------------------------------------------------------- registry

class Registry:
    """The job registry of one host rooted at `root` (§8).

    No side effects in the constructor: folders are made (0700) on the first
    write. Every public method that changes something takes the registry
    lock; the lock is re-entrant within one thread, so callers may wrap
    several calls in `with registry.lock():` (the §12 barrier is written so).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._local = threading.local()

    @classmethod
    def at(cls, workspace: str | os.PathLike[str] | None = None) -> Registry:
        """The registry of the root that §8 picks (`config.resolve_root`)."""
        from mam.shared.config import resolve_root

        return cls(resolve_root(workspace))

    def __repr__(self) -> str:
        return f"Registry({str(self.root)!r})"

    # -------------------------------------------------------------- paths

    def record_path(self, job_id: str) -> Path:
        """`<root>/.mam/jobs/<job_id>.json`."""
        return names.record_path(self.root, job_id)

    def logs_dir(self, job_id: str) -> Path:
        """`<root>/.mam/logs/<job_id>`."""
        return names.job_logs_dir(self.root, job_id)

    def audit_path(self, job_id: str) -> Path:
        """`<root>/.mam/logs/<job_id>/events.ndjson`."""
        return self.logs_dir(job_id) / "events.ndjson"

    def _ensure_dirs(self, job_id: str | None = None) -> None:
        try:
            folders = [names.mam_dir(self.root), names.jobs_dir(self.root)]
            if job_id is not None:
                folders += [self.logs_dir(job_id).parent, self.logs_dir(job_id)]
            for folder in folders:  # one by one, so every level gets 0700, not just the last
                folder.mkdir(mode=0o700, parents=folder == folders[0], exist_ok=True)
        except OSError as exc:
            raise RegistryError(f"cannot create the registry folders under {names.mam_dir(self.root)} "
                                f"({errno_name(exc)}: {exc.strerror or exc})") from exc

    # --------------------------------------------------------------- lock

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the registry lock (`fcntl.flock` on `.mam/jobs/.lock`, §8).

        Re-entrant within one thread of one process. Blocks until the lock
        is free; the kernel drops it when the holder dies.

        Raises:
            RegistryError: the lock file cannot be opened or locked.
        """
        local = self._local
        if getattr(local, "depth", 0) and getattr(local, "pid", None) == os.getpid():
            local.depth += 1
            try:
                yield
            finally:
                local.depth -= 1
            return
        self._ensure_dirs()
        path = names.lock_path(self.root)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise RegistryError(f"cannot open the registry lock {path} "
                                f"({errno_name(exc)}: {exc.strerror or exc})") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            os.close(fd)
            raise RegistryError(f"cannot lock {path} ({errno_name(exc)}: {exc.strerror or exc})") from exc
        local.depth, local.pid = 1, os.getpid()
        try:
            yield
        finally:
            local.depth = 0
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    # ------------------------------------------------------------ reading

    def get(self, job_id: str) -> dict[str, Any]:
        """The record of `job_id` (a fresh dict; includes the secrets).

        Raises:
            UsageError: `job_id` is not a job id (§1).
            JobNotFound: no record.
            RegistryError: the record is unreadable, corrupt or truncated; it
                was moved aside as `<name>.corrupt-<UTC timestamp>`.
        """
        path = self.record_path(job_id)
        problem = self._read(path, job_id)
        if isinstance(problem, dict):
            return problem
        with self.lock():  # re-read under the lock: a writer may have just replaced it
            again = self._read(path, job_id)
            if isinstance(again, dict):
                return again
            aside = self._quarantine(path)
        raise RegistryError(f"job {job_id}: record {path} is corrupt ({again}); kept aside as {aside.name}")

    def _read(self, path: Path, job_id: str) -> dict[str, Any] | str:
        try:
            raw = read_capped(path, RECORD_MAX_BYTES)
        except OverflowError as exc:
            return str(exc)
        except FileNotFoundError:
            aside = sorted(path.parent.glob(f"{path.name}.corrupt-*"))
            hint = f" (a corrupt record was kept aside as {aside[-1].name})" if aside else ""
            raise JobNotFound(f"job {job_id}: no record at {path}{hint}") from None
        except OSError as exc:
            raise RegistryError(f"job {job_id}: cannot read {path} "
                                f"({errno_name(exc)}: {exc.strerror or exc})") from exc
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            return "not UTF-8"
        except json.JSONDecodeError as exc:
            return f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        why = _check_record(obj, job_id)
        return why if why is not None else obj

    def _quarantine(self, path: Path) -> Path:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        aside = path.with_name(f"{path.name}.corrupt-{stamp}")
        n = 1
        while aside.exists():  # never overwrite an earlier corrupt copy
            aside = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
            n += 1
        try:
            os.rename(path, aside)
        except OSError as exc:
            raise RegistryError(f"record {path} is corrupt and cannot be moved aside "
                                f"({errno_name(exc)}: {exc.strerror or exc})") from exc
        log.error("record %s is corrupt; kept aside as %s", path, aside.name)
        return aside

    def list(self, status: str | None = None) -> tuple[list[dict[str, Any]], list[RegistryError]]:
        """Every record on this host, oldest first, optionally only `status`.

        Corrupt records are moved aside and reported; listing goes on past them.

        Returns:
            (records, errors).
        Raises:
            UsageError: `status` is not one of §8's states.
        """
        if status is not None and status not in JOB_STATUSES:
            raise UsageError(f"status {status!r} is invalid: expected one of {', '.join(JOB_STATUSES)}")
        folder = names.jobs_dir(self.root)
        try:
            entries = sorted(os.listdir(folder))
        except FileNotFoundError:
            return [], []
        except OSError as exc:
            raise RegistryError(f"cannot list {folder} ({errno_name(exc)}: {exc.strerror or exc})") from exc
        records: list[dict[str, Any]] = []
        errors: list[RegistryError] = []
        for entry in entries:
            if not _RECORD_NAME_RE.match(entry):
                continue
            try:
                record = self.get(entry[:-5])
            except JobNotFound:
                continue  # removed between listdir and read
            except RegistryError as exc:
                errors.append(exc)
                continue
            if status is None or record["status"] == status:
                records.append(record)
        records.sort(key=lambda r: (str(r.get("created_at", "")), r["job_id"]))
        return records, errors

    def audit(self, job_id: str) -> list[dict[str, Any]]:
        """The audit log of `job_id`, one dict per line, oldest first.

        A line that is not a JSON object (a torn write) becomes
        `{"event": "unreadable_line", "line": n}`; it never raises for content.

        Raises:
            RegistryError: the file exists but cannot be read.
        """
        path = self.audit_path(job_id)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise RegistryError(f"job {job_id}: cannot read {path} "
                                f"({errno_name(exc)}: {exc.strerror or exc})") from exc
        out: list[dict[str, Any]] = []
        for n, line in enumerate(raw.split(b"\n"), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                obj = None
            out.append(obj if isinstance(obj, dict) else {"event": "unreadable_line", "line": n})
        return out

    # ------------------------------------------------------------ writing

    def _write(self, record: dict[str, Any], *, status_changed: bool = False) -> None:
        job_id = record["job_id"]
        atomic_write(self.record_path(job_id), _dumps(record), what=f"job {job_id}")
        if status_changed:
            self._write_side(job_id, "status.json", {
                "job_id": job_id, "status": record["status"], "attempt_id": record["attempt_id"],
                "transition_seq": record["transition_seq"], "close_reason": record.get("close_reason"),
                "exit_code": record.get("exit_code"), "updated_at": record["updated_at"]})

    def _write_side(self, job_id: str, name: str, obj: dict[str, Any]) -> None:
        # meta/status are views of the record; the record is the truth, so a failure here only warns
        try:
            atomic_write(self.logs_dir(job_id) / name, _dumps(obj), what=f"job {job_id}")
        except RegistryError as exc:
            log.warning("%s", exc)

    def _write_meta(self, record: dict[str, Any]) -> None:
        meta = {k: record.get(k) for k in ("job_id", "session", "agent_session", "role", "transport",
                                            "origin", "created_at")}
        meta["contract"] = Contract.of_record(record).to_dict()
        self._write_side(record["job_id"], "meta.json", meta)

    def append_audit(self, job_id: str, obj: Mapping[str, Any]) -> None:
        """Append `obj` (a JSON object; a `timestamp` is added if missing) as
        one fsynced line to the job's `events.ndjson` (§8), under the lock.
        Used for `seq_gap` lines and refusals.

        Raises:
            UsageError: bad job id. RegistryError: the append failed.
        """
        names.validate_job_id(job_id)
        line = dict(obj)
        line.setdefault("timestamp", utc_now())
        with self.lock():
            self._ensure_dirs(job_id)
            append_line(self.audit_path(job_id), line, what=f"job {job_id}")

    def _new_record(self, *, job_id: str, session: str, role: str, attempt_id: int, dispatch_token: str,
                    auth_token: str, contract: Contract, broker: dict[str, Any] | None,
                    origin: str | None) -> dict[str, Any]:
        now = utc_now()
        record: dict[str, Any] = {
            "record_version": RECORD_VERSION, "job_id": job_id, "status": "pending", "role": role,
            "session": session, "agent_session": names.agent_session_label(session), "transport": "remote",
            "attempt_id": attempt_id, "dispatch_token": dispatch_token, "auth_token": auth_token,
            "last_seq": 0, "transition_seq": 0, "created_at": now, "updated_at": now,
            "close_reason": None, "exit_code": None, "broker": broker, "origin": origin,
            "cancel_requested_at": None,
        }
        record.update(contract.to_dict())
        return record

    def _create(self, record: dict[str, Any], source: str, event: str) -> None:
        job_id = record["job_id"]
        self._ensure_dirs(job_id)
        append_line(self.audit_path(job_id), {
            "event": event, "timestamp": record["created_at"], "source": source, "status": "pending",
            "attempt_id": record["attempt_id"], "session": record["session"], "transition_seq": 0,
        }, what=f"job {job_id}")
        self._write(record, status_changed=True)
        self._write_meta(record)

    def register(self, *, session: str, contract: Contract | None = None, broker: Mapping[str, Any] | None = None,
                 job_id: str | None = None, source: str = "operator") -> dict[str, Any]:
        """Register a new hub job: status `pending`, attempt 1, fresh
        `dispatch_token` and `auth_token`, the contract fields (§8, §1).

        Args:
            session: the bare runner name; stored as `agent_session` `remote:<session>`.
            contract: the §5 contract (default `Contract()`).
            broker: per-job broker overrides (no passwords).
            job_id: a given id (refused if it exists), else a fresh one.
            source: an operator source.
        Returns:
            the new record (with secrets).
        Raises:
            UsageError: bad session, job id, source or broker block.
            Refusal(`not_allowed`): the given job id already exists.
            RegistryError: the write failed.
        """
        names.validate_session(session)
        _require_source(source, OPERATOR_SOURCES, "register")
        contract = contract or Contract()
        broker_block = validate_broker(broker)
        if job_id is not None:
            names.validate_job_id(job_id)
        with self.lock():
            chosen = job_id
            while chosen is None or self.record_path(chosen).exists():
                if job_id is not None:
                    raise Refusal(job_id, "not_allowed", "a record with this id already exists")
                chosen = names.new_job_id()
            record = self._new_record(job_id=chosen, session=session, role="hub", attempt_id=1,
                                      dispatch_token=names.new_dispatch_token(),
                                      auth_token=names.new_auth_token(), contract=contract,
                                      broker=broker_block, origin=None)
            self._create(record, source, "registered")
        return record

    def mirror(self, *, job_id: str, session: str, attempt_id: int, dispatch_token: str, auth_token: str,
               contract: Contract, origin: str | None = None, source: str = "runner") -> dict[str, Any]:
        """Mirror a dispatched job into this runner's registry, status
        `pending`, with the hub's identity (§11 step 1).

        A newer attempt of a job already held replaces the older identity
        (a redispatch reached this runner); the older attempt's worker
        requests become stale.

        Returns:
            the record.
        Raises:
            UsageError: a malformed id, session, attempt or token.
            Refusal(`replayed`): this runner already holds this attempt or a
                newer one (§5: a `(job_id, attempt_id)` is taken once).
            RegistryError: the write failed.
        """
        names.validate_job_id(job_id)
        names.validate_session(session)
        names.validate_attempt(attempt_id)
        names.validate_token(dispatch_token)
        if not isinstance(auth_token, str) or not 16 <= len(auth_token) <= 256:
            raise UsageError("auth token is invalid: expected a string of 16 to 256 characters")
        _require_source(source, WORKER_SOURCES, "mirror")
        with self.lock():
            try:
                old = self.get(job_id)
            except JobNotFound:
                old = None
            if old is None:
                record = self._new_record(job_id=job_id, session=session, role="runner", attempt_id=attempt_id,
                                          dispatch_token=dispatch_token, auth_token=auth_token,
                                          contract=contract, broker=None, origin=origin)
                self._create(record, source, "mirrored")
                return record
            if attempt_id <= old["attempt_id"]:
                raise Refusal(job_id, "replayed",
                              f"attempt {attempt_id} refused: this host already took attempt {old['attempt_id']}")
            record = self._new_record(job_id=job_id, session=session, role="runner", attempt_id=attempt_id,
                                      dispatch_token=dispatch_token, auth_token=auth_token,
                                      contract=contract, broker=None, origin=origin)
            record["created_at"] = old.get("created_at", record["created_at"])
            record["transition_seq"] = old["transition_seq"] + 1
            self._commit(old, record, source=source, reason=f"attempt {attempt_id} mirrored")
            self._write_meta(record)
            return record

    # ------------------------------------------------------- CAS internals

    def _check_worker(self, record: dict[str, Any], source: str, attempt_id: object,
                      dispatch_token: object) -> None:
        job_id = record["job_id"]
        if attempt_id != record["attempt_id"] or not isinstance(dispatch_token, str) \
                or dispatch_token != record["dispatch_token"]:
            what = (f"attempt {attempt_id!r} is not the current attempt {record['attempt_id']}"
                    if attempt_id != record["attempt_id"] else "the dispatch token is not the current one")
            raise StaleTransition(job_id, f"refused {source} request: {what}")
        if record["status"] in TERMINAL_STATUSES:
            raise Refusal(job_id, "after_terminal",
                          f"refused {source} request: the job is already {record['status']}")

    def _commit(self, old: dict[str, Any], new: dict[str, Any], *, source: str, reason: str | None,
                extra_lines: tuple[Mapping[str, Any], ...] = ()) -> None:
        """Audit first, then the record: a failed record write leaves the old
        record and an audit line whose transition_seq the record never reached."""
        job_id = new["job_id"]
        self._ensure_dirs(job_id)
        for line in extra_lines:
            append_line(self.audit_path(job_id), line, what=f"job {job_id}")
        changed = old["status"] != new["status"] or old["attempt_id"] != new["attempt_id"]
        if changed:
            line = {"event": "status_changed", "timestamp": new["updated_at"], "from": old["status"],
                    "to": new["status"], "source": source, "reason": reason, "attempt_id": new["attempt_id"],
                    "transition_seq": new["transition_seq"]}
            for key in ("close_reason", "exit_code"):
                if new.get(key) is not None:
                    line[key] = new[key]
            append_line(self.audit_path(job_id), line, what=f"job {job_id}")
        self._write(new, status_changed=changed)

    def _apply(self, record: dict[str, Any], to_status: str, *, close_reason: str | None = None,
               exit_code: int | None = None) -> dict[str, Any]:
        new = dict(record)
        new["status"] = to_status
        new["updated_at"] = utc_now()
        new["transition_seq"] = record["transition_seq"] + 1
        if close_reason is not None:
            new["close_reason"] = close_reason
        if exit_code is not None:
            new["exit_code"] = exit_code
        return new

    # ---------------------------------------------------------- worker path

    def allocate_seq(self, job_id: str, *, attempt_id: int, dispatch_token: str,
                     source: str = "publisher") -> int:
        """Take the next seq of the current attempt (§3: started is 1).

        Returns:
            the seq, durably stored as `last_seq`.
        Raises:
            StaleTransition: not the current attempt/token.
            Refusal(`after_terminal`): the record is terminal.
            JobNotFound, RegistryError.
        """
        _require_source(source, WORKER_SOURCES, "allocate a seq")
        with self.lock():
            record = self.get(job_id)
            self._check_worker(record, source, attempt_id, dispatch_token)
            record["last_seq"] += 1
            record["updated_at"] = utc_now()
            self._write(record)
            return record["last_seq"]

    def record_event(self, job_id: str, *, attempt_id: int, dispatch_token: str, event: str,
                     build: Callable[[int], dict[str, Any]], source: str = "publisher",
                     status: str | None = None, exit_code: int | None = None) -> tuple[int, dict[str, Any]]:
        """The publish path's disk side in one critical section (§3, §8, §9):
        check the worker identity, refuse a terminal record, take the next seq,
        apply the transition the event implies (`started`: pending → running;
        `completed`/`error`: → terminal), call `build(seq)` for the wire
        payload, append it to `events.ndjson` (fsynced) and write the record.
        Publish the returned payload only after this returns.

        Args:
            event: one of §3's events.
            build: seq -> the wire payload (a dict); if it raises, nothing is written.
            status: `"cancelled"` with `event="error"` marks the record
                cancelled (§6: the runner's answer to a cancel).
            exit_code: stored on a terminal record (`data.exit_code`).
        Returns:
            (seq, payload).
        Raises:
            UsageError: unknown event or bad `status`.
            StaleTransition, Refusal(`after_terminal`), JobNotFound, RegistryError.
        """
        if event not in EVENT_NAMES:
            raise UsageError(f"event {event!r} is invalid: expected one of {', '.join(EVENT_NAMES)}")
        if status is not None and not (status == "cancelled" and event == "error"):
            raise UsageError("status override is only 'cancelled' with event 'error'")
        _require_source(source, WORKER_SOURCES, "record an event")
        with self.lock():
            record = self.get(job_id)
            self._check_worker(record, source, attempt_id, dispatch_token)
            seq = record["last_seq"] + 1
            payload = build(seq)
            if not isinstance(payload, dict):
                raise TypeError("build(seq) must return a dict")
            target = status or EVENT_STATUS.get(event, record["status"])
            if target != record["status"]:
                new = self._apply(record, target, exit_code=exit_code if target in TERMINAL_STATUSES else None)
            else:
                new = dict(record, updated_at=utc_now())
            new["last_seq"] = seq
            self._commit(record, new, source=source, reason=f"event {event}", extra_lines=(payload,))
            return seq, payload

    def accept_event(self, job_id: str, payload: Mapping[str, Any], *,
                     source: str = "remote_mirror") -> Acceptance:
        """The hub's §3.2 steps 5-7 for a verified event, in one critical section:
        identity, duplicate, terminal; then log a `seq_gap` line if seq jumped,
        append the event, and mirror `started`/terminal events into the record (§10).

        Args:
            payload: a decoded, HMAC-verified §3 event (`seq`, `event`, `data`).
        Returns:
            Acceptance(record, gap).
        Raises:
            StaleTransition (`stale_attempt`), Refusal (`duplicate`, `after_terminal`),
            UsageError (unknown event or bad seq), JobNotFound, RegistryError.
        """
        _require_source(source, WORKER_SOURCES, "accept an event")
        event, seq = payload.get("event"), payload.get("seq")
        data = payload.get("data") if isinstance(payload.get("data"), Mapping) else {}
        if event not in EVENT_NAMES:
            raise UsageError(f"event {event!r} is invalid: expected one of {', '.join(EVENT_NAMES)}")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
            raise UsageError(f"seq {seq!r} is invalid: expected an integer >= 1")
        with self.lock():
            record = self.get(job_id)
            try:
                self._check_worker(record, source, data.get("attempt_id"), data.get("dispatch_token"))
            except Refusal as exc:
                if exc.reason != "after_terminal" or seq > record["last_seq"]:
                    raise
                raise Refusal(job_id, "duplicate", f"seq {seq} already accepted") from None
            if seq <= record["last_seq"]:
                raise Refusal(job_id, "duplicate", f"seq {seq} already accepted (highest {record['last_seq']})")
            lines: list[Mapping[str, Any]] = []
            gap = None
            if seq > record["last_seq"] + 1:
                gap = (record["last_seq"] + 1, seq)
                lines.append({"event": "seq_gap", "timestamp": utc_now(), "expected": gap[0], "got": seq,
                              "attempt_id": record["attempt_id"]})
            lines.append(dict(payload))
            target = EVENT_STATUS.get(event, record["status"])
            if target != record["status"]:
                code = data.get("exit_code")
                code = code if isinstance(code, int) and not isinstance(code, bool) else None
                new = self._apply(record, target, exit_code=code if target in TERMINAL_STATUSES else None)
            else:
                new = dict(record, updated_at=utc_now())
            new["last_seq"] = seq
            self._commit(record, new, source=source, reason=f"event {event}", extra_lines=tuple(lines))
            return Acceptance(new, gap)

    # -------------------------------------------------------- transitions

    def transition(self, job_id: str, to_status: str, *, source: str, reason: str | None = None,
                   attempt_id: int | None = None, dispatch_token: str | None = None,
                   close_reason: str | None = None, exit_code: int | None = None,
                   last_seq: int | None = None) -> dict[str, Any]:
        """Compare-and-swap `job_id` to `to_status` (§8).

        Worker sources must hold the current attempt and token; the edges
        they may take are pending → running, and pending/running → a
        terminal status. Operator sources may only cancel (→ cancelled) and
        close (→ error with a `close_reason` of deadline_timeout or
        agent_blocked). A terminal record refuses everything. running →
        running is a no-op (no transition committed). `last_seq` only ever
        raises the stored value (the hub mirroring a §4 terminal state).

        Returns:
            the record after the transition.
        Raises:
            UsageError: unknown status, source or close reason.
            StaleTransition, Refusal(`after_terminal` / `not_allowed`), JobNotFound, RegistryError.
        """
        if to_status not in JOB_STATUSES:
            raise UsageError(f"status {to_status!r} is invalid: expected one of {', '.join(JOB_STATUSES)}")
        worker = source in WORKER_SOURCES
        _require_source(source, WORKER_SOURCES | OPERATOR_SOURCES, "transition")
        if close_reason is not None and close_reason not in CLOSE_STATUS:
            raise UsageError(f"close reason {close_reason!r} is invalid: expected one of "
                             f"{', '.join(CLOSE_STATUS)}")
        with self.lock():
            record = self.get(job_id)
            current = record["status"]
            if worker:
                self._check_worker(record, source, attempt_id, dispatch_token)
                if current == to_status == "running":
                    return record
                if (current, to_status) not in WORKER_EDGES:
                    raise Refusal(job_id, "not_allowed", f"refused {source} request: {current} -> {to_status}")
            else:
                if current in TERMINAL_STATUSES:
                    raise Refusal(job_id, "after_terminal",
                                  f"refused {source} request: the job is already {current}")
                allowed = to_status == "cancelled" or (to_status == "error" and close_reason in
                                                       ("deadline_timeout", "agent_blocked"))
                if not allowed:
                    raise Refusal(job_id, "not_allowed",
                                  f"refused {source} request: operators may cancel, close and redispatch, "
                                  f"not move {current} -> {to_status}")
            new = self._apply(record, to_status, close_reason=close_reason, exit_code=exit_code)
            if last_seq is not None and isinstance(last_seq, int) and last_seq > record["last_seq"]:
                new["last_seq"] = last_seq
            self._commit(record, new, source=source, reason=reason)
            return new

    def close(self, job_id: str, close_reason: str, *, source: str = "operator",
              reason: str | None = None) -> dict[str, Any]:
        """Close an unfinished job (§8, §10): `deadline_timeout` and
        `agent_blocked` → status `error`; `cancelled` → status `cancelled`.

        Raises:
            UsageError: unknown close reason or non-operator source.
            Refusal(`after_terminal`): the job already ended. JobNotFound, RegistryError.
        """
        if close_reason not in CLOSE_STATUS:
            raise UsageError(f"close reason {close_reason!r} is invalid: expected one of "
                             f"{', '.join(CLOSE_STATUS)}")
        _require_source(source, OPERATOR_SOURCES, "close")
        return self.transition(job_id, CLOSE_STATUS[close_reason], source=source,
                               reason=reason or close_reason, close_reason=close_reason)

    def request_cancel(self, job_id: str, *, source: str = "operator", reason: str | None = None) -> dict[str, Any]:
        """Note that a cancel was sent for the current attempt (§6) without
        ending the job; this allows a redispatch from pending/running (§8).

        Raises:
            Refusal(`after_terminal`): the job already ended. UsageError, JobNotFound, RegistryError.
        """
        _require_source(source, OPERATOR_SOURCES, "request a cancel")
        with self.lock():
            record = self.get(job_id)
            if record["status"] in TERMINAL_STATUSES:
                raise Refusal(job_id, "after_terminal", f"refused {source} cancel: the job is already "
                                                        f"{record['status']}")
            new = dict(record, cancel_requested_at=utc_now(), updated_at=utc_now())
            line = {"event": "cancel_requested", "timestamp": new["updated_at"], "source": source,
                    "reason": reason, "attempt_id": record["attempt_id"]}
            self._commit(record, new, source=source, reason=reason, extra_lines=(line,))
            return new

    def redispatch(self, job_id: str, *, source: str = "operator", session: str | None = None,
                   reason: str | None = None) -> dict[str, Any]:
        """Start a new attempt (§8): from `error` or `cancelled`, or from
        `pending`/`running` after `request_cancel`; never from `completed`.
        attempt + 1, fresh `dispatch_token` and `auth_token` (an older
        attempt's holder can then neither pass the CAS nor sign), status
        `pending`, `last_seq` 0, close reason and exit code cleared.

        Args:
            session: move the job to another runner session.
        Returns:
            the record of the new attempt.
        Raises:
            UsageError: bad source or session.
            Refusal(`not_allowed`): completed, or unfinished without a cancel.
            JobNotFound, RegistryError.
        """
        _require_source(source, OPERATOR_SOURCES, "redispatch")
        if session is not None:
            names.validate_session(session)
        with self.lock():
            record = self.get(job_id)
            current = record["status"]
            if current == "completed":
                raise Refusal(job_id, "not_allowed", "refused redispatch: the job completed")
            if current in ("pending", "running") and not record.get("cancel_requested_at"):
                raise Refusal(job_id, "not_allowed",
                              f"refused redispatch: the job is {current}; cancel it first")
            new = self._apply(record, "pending")
            new.update(attempt_id=record["attempt_id"] + 1, dispatch_token=names.new_dispatch_token(),
                       auth_token=names.new_auth_token(), last_seq=0, close_reason=None, exit_code=None,
                       cancel_requested_at=None, attempt_created_at=new["updated_at"])
            if session is not None:
                new.update(session=session, agent_session=names.agent_session_label(session))
            self._commit(record, new, source=source, reason=reason or "redispatch")
            if session is not None:
                self._write_meta(new)
            return new


def _require_source(source: str, allowed: frozenset[str], what: str) -> None:
    if source not in allowed:
        raise UsageError(f"source {source!r} may not {what}: expected one of {', '.join(sorted(allowed))}")


# ------------------------------------------------------------------- CLI

def redact(obj: Any) -> Any:
    """A copy of `obj` with every `auth_token`/`dispatch_token` value replaced
    by `"<set>"` (or `"<unset>"`), at any depth."""
    if isinstance(obj, Mapping):
        return {k: (("<set>" if v else "<unset>") if k in SECRET_FIELDS else redact(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v) for v in obj]
    return obj


def cli_jobs(*, workspace: str | os.PathLike[str] | None, status: str | None, as_json: bool,
             stream: Any = None) -> int:
    """`mam-orch jobs` / `mam-runner jobs`: list this host's records (§8), secrets
    redacted; a table on a TTY, JSON lines otherwise or with `as_json`.

    Returns:
        0, or 1 when some record was corrupt (reported on stderr, listing goes on).
    """
    import sys

    from mam.shared import render

    out = stream or sys.stdout
    registry = Registry.at(workspace)
    records, errors = registry.list(status)
    safe = [redact(r) for r in records]
    if as_json or not out.isatty():
        for record in safe:
            out.write(json.dumps(record, sort_keys=True) + "\n")
    else:
        out.write(render.jobs_table(safe))
    for exc in errors:
        print(f"ERROR: {exc}", file=sys.stderr)
    return 1 if errors else 0


def cli_show(*, workspace: str | os.PathLike[str] | None, job_id: str, as_json: bool, stream: Any = None) -> int:
    """`mam-orch show` / `mam-runner show`: one record and its audit trail (§8),
    secrets redacted; human view on a TTY, one JSON object otherwise.

    Raises:
        UsageError: bad job id. JobNotFound / RegistryError: no or corrupt record.
    """
    import sys

    from mam.shared import render

    names.validate_job_id(job_id)
    out = stream or sys.stdout
    registry = Registry.at(workspace)
    record = redact(registry.get(job_id))
    trail = redact(registry.audit(job_id))
    if as_json or not out.isatty():
        out.write(json.dumps({"record": record, "audit": trail}, sort_keys=True) + "\n")
    else:
        out.write(render.show_text(record, trail))
    return 0
