"""The job registry of PROTOCOL §8: one JSON record per job on this host,
atomic 0600 writes, one `fcntl.flock` around every read-modify-write
(`Registry.transaction`), per-attempt seq allocation (§3), compare-and-swap
transitions and the audit log. The record model and refusals are in
`mam.shared.store.records`; docs/registry.md gives the layout, guarantees and limits
(one host only; `fcntl.flock` is not safe on NFS). Every change names its
source (`records.WORKER_SOURCES`, `records.OPERATOR_SOURCES`).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mam.shared.protocol import codes, names
from mam.shared.protocol.codes import CLOSE_STATUS, OPEN_STATUSES, TERMINAL_STATUSES, CloseReason, JobStatus
from mam.shared.protocol.errors import RegistryError, UsageError
from mam.shared.protocol.wire import Work
from mam.shared.store.files import RegistryFiles
from mam.shared.store.fsio import (
    append_line,
    append_lines,
    errno_name,
    move_aside,
    read_capped,
    read_json_lines,
)
from mam.shared.store.records import (
    OPERATOR_SOURCES,
    RECORD_MAX_BYTES,
    RECORD_NAME_RE,
    RECORD_VERSION,
    SECRET_FIELDS,
    WORKER_EDGES,
    WORKER_SOURCES,
    Contract,
    JobNotFound,
    JobRecord,
    QueueTerms,
    Refusal,
    StaleTransition,
    Transaction,
    as_record,
    check_event_request,
    check_worker,
    dumps,
    moved,
    new_record,
    next_attempt,
    redact,
    require_source,
    touched,
    utc_now,
    validate_broker,
)
from mam.shared.store.root import resolve_root

# Names other modules import from here (kept for the runner and the tests).
__all__ = [
    "OPERATOR_SOURCES", "RECORD_MAX_BYTES", "RECORD_VERSION", "SECRET_FIELDS", "WORKER_EDGES",
    "WORKER_SOURCES", "Contract", "JobNotFound", "JobRecord", "Refusal", "Registry", "StaleTransition",
    "Transaction", "redact", "utc_now", "validate_broker",
]

log = logging.getLogger("mam.registry")


# ----------------------------------------------------------------- registry

class Registry(RegistryFiles):
    """The job registry of one host rooted at `root` (§8).

    No side effects in the constructor: folders are made (0700) on the first
    write. Every public method that changes something takes the registry
    lock; the lock is re-entrant within one thread, so callers may wrap
    several calls in `with registry.lock():` (the §12 barrier is written so).
    """

    @classmethod
    def at(cls, workspace: str | os.PathLike[str] | None = None) -> Registry:
        """The registry of the root that §8 picks (`resolve_root`)."""
        return cls(resolve_root(workspace))

    def __repr__(self) -> str:
        return f"Registry({str(self.root)!r})"

    # ------------------------------------------------------------ reading

    def get(self, job_id: str) -> JobRecord:
        """The record of `job_id` (a fresh dict; includes the secrets).

        Raises:
            UsageError: `job_id` is not a job id (§1).
            JobNotFound: no record.
            RegistryError: the record is unreadable, corrupt or truncated; it
                was moved aside as `<name>.corrupt-<UTC timestamp>`.
        """
        record = self.find(job_id)
        if record is not None:
            return record
        path = self.record_path(job_id)
        aside = sorted(path.parent.glob(f"{path.name}.corrupt-*"))
        hint = f" (a corrupt record was kept aside as {aside[-1].name})" if aside else ""
        raise JobNotFound(f"job {job_id}: no record at {path}{hint}; is the workspace right? "
                          f"(give --workspace DIR)")

    def find(self, job_id: str) -> JobRecord | None:
        """The record of `job_id`, or None when it has none: `get` for a caller to whom a
        missing record is an answer (a dispatch never seen), without `get`'s search for a
        record kept aside, which lists the whole folder.

        Raises:
            UsageError: `job_id` is not a job id (§1).
            RegistryError: as `get`.
        """
        path = self.record_path(job_id)
        first = self._read(path, job_id)
        if not isinstance(first, str):
            return first
        with self.lock():  # re-read under the lock: a writer may have just replaced it
            again = self._read(path, job_id)
            if not isinstance(again, str):
                return again
            aside = self._quarantine(path)
        raise RegistryError(f"job {job_id}: record {path} is corrupt ({again}); kept aside as {aside.name}")

    def _read(self, path: Path, job_id: str) -> JobRecord | str | None:
        """The record at `path`, None when there is no file, or why it is corrupt (a str)."""
        try:
            raw = self.written_in_group(path) or read_capped(path, RECORD_MAX_BYTES)
        except OverflowError as exc:
            return str(exc)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RegistryError(f"job {job_id}: cannot read {path} "
                                f"({errno_name(exc)}: {exc.strerror or exc})") from exc
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            return "not UTF-8"
        except json.JSONDecodeError as exc:
            return f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        return as_record(obj, job_id)

    def _quarantine(self, path: Path) -> Path:
        aside = move_aside(path, datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ"))
        log.error("record %s is corrupt; kept aside as %s", path, aside.name)
        return aside

    def list(self, status: str | None = None) -> tuple[builtins.list[JobRecord], builtins.list[RegistryError]]:
        """Every record on this host, oldest first, optionally only `status`.

        Corrupt records are moved aside and reported; listing goes on past them.

        Returns:
            (records, errors).
        Raises:
            UsageError: `status` is not one of §8's states.
        """
        if status is not None and status not in codes.RECORD_STATUSES:
            raise UsageError(f"status {status!r} is invalid: expected one of {', '.join(codes.RECORD_STATUSES)}")
        folder = names.jobs_dir(self.root)
        try:
            entries = sorted(os.listdir(folder))
        except FileNotFoundError:
            return [], []
        except OSError as exc:
            raise RegistryError(f"cannot list {folder} ({errno_name(exc)}: {exc.strerror or exc})") from exc
        records: builtins.list[JobRecord] = []
        errors: builtins.list[RegistryError] = []
        for entry in entries:
            if not RECORD_NAME_RE.match(entry):
                continue
            try:
                record = self.find(entry[:-5])
            except RegistryError as exc:
                errors.append(exc)
                continue
            if record is None:
                continue  # removed between listdir and read
            if status is None or record["status"] == status:
                records.append(record)
        records.sort(key=lambda r: (str(r.get("created_at", "")), r["job_id"]))
        return records, errors

    def audit(self, job_id: str) -> builtins.list[dict[str, Any]]:
        """The audit log of `job_id`, one dict per line, oldest first.

        A line that is not a JSON object (a torn write) becomes
        `{"event": "unreadable_line", "line": n}`; it never raises for content.

        Raises:
            RegistryError: the file exists but cannot be read.
        """
        return read_json_lines(self.audit_path(job_id), what=f"job {job_id}")

    # ------------------------------------------------------------ writing

    def _write(self, record: JobRecord, *, status_changed: bool = False) -> None:
        job_id = record["job_id"]
        path = self.record_path(job_id)
        data = dumps(record)
        self.put(path, data, what=f"job {job_id}")
        self.note_written(path, data)
        if status_changed:
            self._write_side(job_id, "status.json", {
                "job_id": job_id, "status": record["status"], "attempt_id": record["attempt_id"],
                "transition_seq": record["transition_seq"], "close_reason": record.get("close_reason"),
                "exit_code": record.get("exit_code"), "updated_at": record["updated_at"]})

    def _write_meta(self, record: JobRecord) -> None:
        meta: dict[str, Any] = {k: record.get(k) for k in ("job_id", "session", "agent_session", "role",
                                                            "transport", "origin", "created_at")}
        meta["contract"] = Contract.of_record(record).to_dict()
        self._write_side(record["job_id"], "meta.json", meta)

    def append_audit(self, job_id: str, obj: Mapping[str, Any], *, durable: bool = True) -> None:
        """Append `obj` (a JSON object; a `timestamp` is added if missing) as
        one fsynced line to the job's `events.ndjson` (§8), under the lock.
        Used for `seq_gap` lines and refusals; `durable=False` (no fsync) only for
        the hub service's lines that change no status (docs/registry.md "Durability").

        Raises:
            UsageError: bad job id. RegistryError: the append failed.
        """
        names.validate_job_id(job_id)
        line = dict(obj)
        line.setdefault("timestamp", utc_now())
        with self.lock():
            self._ensure_dirs(job_id)
            append_lines(self.audit_path(job_id), [line], what=f"job {job_id}", sync=durable)

    def _create(self, record: JobRecord, source: str, event: str) -> None:
        job_id = record["job_id"]
        self._ensure_dirs(job_id)
        append_line(self.audit_path(job_id), {
            "event": event, "timestamp": record["created_at"], "source": source, "status": record["status"],
            "attempt_id": record["attempt_id"], "session": record["session"], "transition_seq": 0,
        }, what=f"job {job_id}")
        self._write(record, status_changed=True)
        self._write_meta(record)

    def _commit(self, old: JobRecord, new: JobRecord, *, source: str, reason: str | None,
                extra_lines: tuple[Mapping[str, Any], ...] | builtins.list[Mapping[str, Any]] = ()) -> None:
        """Audit first, then the record: a failed record write leaves the old
        record and an audit line whose transition_seq the record never reached."""
        job_id = new["job_id"]
        self._ensure_dirs(job_id)
        lines = list(extra_lines)
        changed = old["status"] != new["status"] or old["attempt_id"] != new["attempt_id"]
        if changed:
            status_line: dict[str, Any] = {
                "event": "status_changed", "timestamp": new["updated_at"], "from": old["status"],
                "to": new["status"], "source": source, "reason": reason, "attempt_id": new["attempt_id"],
                "transition_seq": new["transition_seq"]}
            if new.get("session") and new["session"] != old.get("session"):
                status_line["session"] = new["session"]  # a follower reads the line before the record
            if new.get("close_reason") is not None:
                status_line["close_reason"] = new["close_reason"]
            if new.get("exit_code") is not None:
                status_line["exit_code"] = new["exit_code"]
            lines.append(status_line)
        if lines:  # one write, one fsync for the whole transaction (or the group's)
            audit = self.audit_path(job_id)
            append_lines(audit, lines, what=f"job {job_id}", sync=not self.deferred(audit))
        self._write(new, status_changed=changed)

    @contextlib.contextmanager
    def transaction(self, job_id: str) -> Iterator[Transaction]:
        """Hold the lock, read `job_id`'s record and yield a `Transaction` on it;
        commit what it holds when the block ends normally, nothing on an exception (§8).

        Raises:
            JobNotFound, RegistryError (unreadable record or failed write).
        """
        with self.lock():
            txn = Transaction(self.get(job_id))
            yield txn
            if txn.new is not None:
                self._commit(txn.record, txn.new, source=txn.source, reason=txn.reason, extra_lines=txn.lines)
            elif txn.lines:
                self._ensure_dirs(job_id)
                audit = self.audit_path(job_id)
                append_lines(audit, txn.lines, what=f"job {job_id}", sync=not self.deferred(audit))

    # ------------------------------------------------------------ creating

    def register(self, *, session: str | None, contract: Contract | None = None,
                 broker: Mapping[str, Any] | None = None, job_id: str | None = None,
                 source: str = "operator", queue: QueueTerms | None = None, work: Work | None = None,
                 title: str | None = None, schedule: Mapping[str, Any] | None = None,
                 prepare: Callable[[str], object] | None = None) -> JobRecord:
        """Register a new hub job: status `pending`, attempt 1, fresh
        `dispatch_token` and `auth_token`, the contract fields (§8, §1).

        Args:
            session: the bare runner name; stored as `agent_session` `remote:<session>`.
            contract: the §5 contract (default `Contract()`).
            broker: per-job broker overrides (no passwords).
            job_id: a given id (refused if it exists), else a fresh one.
            source: an operator source; queue: §14 terms: the record is `queued` (session None: labels).
            work: the job's repository and agent policy (§18), stored as `work`.
            title: a person's name for the job (`dispatch.job_title`), stored as `title`.
            schedule: the schedule tick that fired it (§14 Schedules), stored as `schedule`.
            prepare: called with the new job id, under the lock, once its folders exist and
                before its record does: what the record must never exist without (the hub's
                copy of the brief: an engine that finds the record publishes it at once).
        Returns:
            the new record (with secrets).
        Raises:
            UsageError: bad session, job id, source or broker block.
            Refusal(`not_allowed`): the given job id already exists.
            RegistryError: the write failed.
        """
        queue = queue.checked() if queue is not None else None
        if session is not None or queue is None:
            names.validate_session(session)
        require_source(source, OPERATOR_SOURCES, "register")
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
            if prepare is not None:
                self._ensure_dirs(chosen)
                prepare(chosen)
            record = new_record(job_id=chosen, session=session, role="hub", attempt_id=1,
                                dispatch_token=names.new_dispatch_token(), auth_token=names.new_auth_token(),
                                contract=contract, broker=broker_block, origin=None, queue=queue, work=work,
                                title=title, schedule=schedule)
            self._create(record, source, "registered")
        return record

    def mirror(self, *, job_id: str, session: str, attempt_id: int, dispatch_token: str, auth_token: str,
               contract: Contract, origin: str | None = None, source: str = "runner") -> JobRecord:
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
        require_source(source, WORKER_SOURCES, "mirror")
        with self.lock():
            old = self.find(job_id)
            record = new_record(job_id=job_id, session=session, role="runner", attempt_id=attempt_id,
                                dispatch_token=dispatch_token, auth_token=auth_token,
                                contract=contract, broker=None, origin=origin)
            if old is None:
                self._create(record, source, "mirrored")
                return record
            if attempt_id <= old["attempt_id"]:
                raise Refusal(job_id, "replayed",
                              f"attempt {attempt_id} refused: this host already took attempt {old['attempt_id']}")
            record["created_at"] = old.get("created_at", record["created_at"])
            record["transition_seq"] = old["transition_seq"] + 1
            self._commit(old, record, source=source, reason=f"attempt {attempt_id} mirrored")
            self._write_meta(record)
            return record

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
        require_source(source, WORKER_SOURCES, "allocate a seq")
        with self.lock():
            record = self.get(job_id)
            check_worker(record, source, attempt_id, dispatch_token)
            record["last_seq"] += 1
            record["updated_at"] = utc_now()
            self._write(record)
            return record["last_seq"]

    def record_event(self, job_id: str, *, attempt_id: int, dispatch_token: str, event: str,
                     build: Callable[[int], dict[str, Any]], source: str = "publisher",
                     status: str | None = None, exit_code: int | None = None) -> tuple[int, dict[str, Any]]:
        """`Transaction.take_seq` in one call (§3, §8, §9): take the next seq,
        call `build(seq)` for the wire payload, append it to `events.ndjson`
        (fsynced) and write the record. Publish the payload only after this returns.

        Args:
            build: seq -> the wire payload (a dict); if it raises, nothing is written.
            event, status, exit_code: as `Transaction.take_seq`.
        Returns:
            (seq, payload).
        Raises:
            UsageError, StaleTransition, Refusal(`after_terminal`), JobNotFound, RegistryError;
            TypeError: `build` did not return a dict.
        """
        check_event_request(event, status, source)  # before the lock, as every argument check
        with self.transaction(job_id) as txn:
            seq = txn.take_seq(event, attempt_id=attempt_id, dispatch_token=dispatch_token, source=source,
                               status=status, exit_code=exit_code)
            payload = build(seq)
            if not isinstance(payload, dict):
                raise TypeError("build(seq) must return a dict")
            txn.log(payload)
        return seq, payload

    # -------------------------------------------------------- transitions

    def transition(self, job_id: str, to_status: str, *, source: str, reason: str | None = None,
                   attempt_id: int | None = None, dispatch_token: str | None = None,
                   close_reason: str | None = None, exit_code: int | None = None,
                   last_seq: int | None = None) -> JobRecord:
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
        if to_status not in codes.RECORD_STATUSES:
            raise UsageError(f"status {to_status!r} is invalid: expected one of {', '.join(codes.RECORD_STATUSES)}")
        worker = source in WORKER_SOURCES
        require_source(source, WORKER_SOURCES | OPERATOR_SOURCES, "transition")
        if close_reason is not None and close_reason not in CLOSE_STATUS:
            raise UsageError(f"close reason {close_reason!r} is invalid: expected one of "
                             f"{', '.join(CLOSE_STATUS)}")
        with self.transaction(job_id) as txn:
            record = txn.record
            current = record["status"]
            if worker:
                check_worker(record, source, attempt_id, dispatch_token)
                if current == to_status == "running":
                    return record
                if (current, to_status) not in WORKER_EDGES:
                    raise Refusal(job_id, "not_allowed", f"refused {source} request: {current} -> {to_status}")
            else:
                if current in TERMINAL_STATUSES:
                    raise Refusal(job_id, "after_terminal",
                                  f"refused {source} request: the job is already {current}")
                allowed = to_status == JobStatus.CANCELLED or (
                    to_status == JobStatus.ERROR and close_reason in codes.ERROR_CLOSES)
                if not allowed:
                    raise Refusal(job_id, "not_allowed",
                                  f"refused {source} request: operators may cancel, close and redispatch, "
                                  f"not move {current} -> {to_status}")
            new = moved(record, to_status, close_reason=close_reason, exit_code=exit_code)
            if last_seq is not None and isinstance(last_seq, int) and last_seq > record["last_seq"]:
                new["last_seq"] = last_seq
            txn.update(new, source=source, reason=reason)
        return new

    def close(self, job_id: str, close_reason: str, *, source: str = "operator",
              reason: str | None = None) -> JobRecord:
        """Close an unfinished job (§8, §10): `deadline_timeout` and
        `agent_blocked` → status `error`; `cancelled` → status `cancelled`.

        Raises:
            UsageError: unknown close reason or non-operator source.
            Refusal(`after_terminal`): the job already ended. JobNotFound, RegistryError.
        """
        if close_reason not in CLOSE_STATUS:
            raise UsageError(f"close reason {close_reason!r} is invalid: expected one of "
                             f"{', '.join(CLOSE_STATUS)}")
        require_source(source, OPERATOR_SOURCES, "close")
        return self.transition(job_id, CLOSE_STATUS[CloseReason(close_reason)], source=source,
                               reason=reason or close_reason, close_reason=close_reason)

    def request_cancel(self, job_id: str, *, source: str = "operator", reason: str | None = None) -> JobRecord:
        """Note that a cancel was sent for the current attempt (§6) without
        ending the job; this allows a redispatch from pending/running (§8).

        Raises:
            Refusal(`after_terminal`): the job already ended. UsageError, JobNotFound, RegistryError.
        """
        require_source(source, OPERATOR_SOURCES, "request a cancel")
        with self.transaction(job_id) as txn:
            record = txn.record
            if record["status"] in TERMINAL_STATUSES:
                raise Refusal(job_id, "after_terminal", f"refused {source} cancel: the job is already "
                                                        f"{record['status']}")
            new = touched(record)
            new["cancel_requested_at"] = new["updated_at"]
            txn.log({"event": "cancel_requested", "timestamp": new["updated_at"], "source": source,
                     "reason": reason, "attempt_id": record["attempt_id"]})
            txn.update(new, source=source, reason=reason)
        return new

    def redispatch(self, job_id: str, *, source: str = "operator", session: str | None = None,
                   reason: str | None = None) -> JobRecord:
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
        require_source(source, OPERATOR_SOURCES, "redispatch")
        if session is not None:
            names.validate_session(session)
        with self.lock():  # re-entrant: the meta of a moved job is written before anyone sees the lock free
            with self.transaction(job_id) as txn:
                record = txn.record
                current = record["status"]
                if current == "completed":
                    raise Refusal(job_id, "not_allowed", "refused redispatch: the job completed")
                if current in OPEN_STATUSES and not record.get("cancel_requested_at"):
                    raise Refusal(job_id, "not_allowed",
                                  f"refused redispatch: the job is {current}; cancel it first")
                new = next_attempt(record)
                if session is not None:
                    new.update({"session": session, "agent_session": names.agent_session_label(session)})
                txn.update(new, source=source, reason=reason or "redispatch")
            if session is not None:
                self._write_meta(new)
        return new
