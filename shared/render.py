"""The `jobs` and `show` commands of both CLIs (PROTOCOL §8) and their human
views for a TTY: plain-text tables of registry records and an audit trail.
The views print what they are given; the commands redact secrets first
(`records.redact`)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

from mam.shared import names
from mam.shared.records import redact
from mam.shared.registry import Registry

JOB_COLUMNS = (("JOB", "job_id"), ("STATUS", "status"), ("SESSION", "session"), ("ROLE", "role"),
               ("ATTEMPT", "attempt_id"), ("SEQ", "last_seq"), ("CLOSE", "close_reason"),
               ("EXIT", "exit_code"), ("LATE", "late_outcome"), ("UPDATED", "updated_at"))


def printable(text: str) -> str:
    """`text` with every non-printable character as `?`: what a record edited by hand or a
    remote peer sent must not inject terminal control sequences."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _cell(value: Any) -> str:
    return "-" if value is None else printable(str(value))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces, one line per row."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=False)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in cells]
    return "\n".join(lines) + "\n"


def jobs_table(records: Sequence[Mapping[str, Any]]) -> str:
    """The `jobs` table; `(no jobs)` when empty."""
    if not records:
        return "(no jobs)\n"
    return table([h for h, _ in JOB_COLUMNS], [[r.get(k) for _, k in JOB_COLUMNS] for r in records])


def _outcome(status: Any, close_reason: Any) -> str:
    return f"{status} ({close_reason})" if close_reason else str(status)


def attempts(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every attempt of a job, oldest first (§8 redispatch, §14 retries): attempt_id,
    the runner session ("-" while a label target is queued) and its outcome."""
    rows = [{"attempt_id": old.get("attempt_id"), "session": old.get("session") or "-",
             "outcome": _outcome(old.get("status"), old.get("close_reason"))}
            for old in record.get("attempt_history", []) if isinstance(old, Mapping)]
    rows.append({"attempt_id": record.get("attempt_id"), "session": record.get("session") or "-",
                 "outcome": _outcome(record.get("status"), record.get("close_reason"))})
    return rows


def show_text(record: Mapping[str, Any], trail: Sequence[Mapping[str, Any]]) -> str:
    """The `show` view: the record as `key: value` lines, its attempts, then the audit trail."""
    width = max(len(k) for k in record) if record else 0
    lines = [f"{k.ljust(width)}  {_cell(record[k])}" for k in sorted(record)]
    lines.append("")
    lines.append("attempts:")
    lines += [f"  {_cell(row['attempt_id'])}  {_cell(row['session'])}  {_cell(row['outcome'])}"
              for row in attempts(record)]
    lines.append("")
    lines.append(f"audit trail ({len(trail)} lines):")
    for entry in trail:
        stamp = _cell(entry.get("timestamp"))
        event = _cell(entry.get("event"))
        rest = {k: v for k, v in entry.items() if k not in ("timestamp", "event")}
        if event == "status_changed":
            detail = (f"{_cell(rest.get('from'))} -> {_cell(rest.get('to'))} by {_cell(rest.get('source'))}"
                      f" ({_cell(rest.get('reason'))})")
        elif "seq" in rest:
            detail = f"seq {_cell(rest.get('seq'))} {_cell(rest.get('detail'))}"
        else:
            detail = " ".join(f"{k}={_cell(v)}" for k, v in sorted(rest.items()))
        lines.append(f"  {stamp}  {event:<16} {detail}")
    return "\n".join(lines) + "\n"


def cli_jobs(*, workspace: str | os.PathLike[str] | None, status: str | None, as_json: bool,
             stream: TextIO | None = None) -> int:
    """`mam-orch jobs` / `mam-runner jobs`: list this host's records (§8), secrets
    redacted; a table on a TTY, JSON lines otherwise or with `as_json`.

    Returns:
        0, or 1 when some record was corrupt (reported on stderr, listing goes on).
    Raises:
        UsageError: a bad status. RegistryError: the jobs folder cannot be listed.
    """
    out = stream or sys.stdout
    registry = Registry.at(workspace)
    records, errors = registry.list(status)
    safe = [redact(r) for r in records]
    if as_json or not out.isatty():
        for record in safe:
            out.write(json.dumps(record, sort_keys=True) + "\n")
    else:
        out.write(jobs_table(safe))
    for exc in errors:
        print(f"ERROR: {exc}", file=sys.stderr)
    return 1 if errors else 0


def cli_show(*, workspace: str | os.PathLike[str] | None, job_id: str, as_json: bool,
             stream: TextIO | None = None) -> int:
    """`mam-orch show` / `mam-runner show`: one record, its attempts (each with its
    runner and outcome, §14) and its audit trail (§8), secrets redacted; human view
    on a TTY, one JSON object {"record", "audit", "attempts"} otherwise.

    Returns:
        0.
    Raises:
        UsageError: bad job id. JobNotFound / RegistryError: no or corrupt record.
    """
    names.validate_job_id(job_id)
    out = stream or sys.stdout
    registry = Registry.at(workspace)
    record = redact(registry.get(job_id))
    trail = redact(registry.audit(job_id))
    if as_json or not out.isatty():
        out.write(json.dumps({"record": record, "audit": trail, "attempts": attempts(record)}, sort_keys=True) + "\n")
    else:
        out.write(show_text(record, trail))
    return 0
