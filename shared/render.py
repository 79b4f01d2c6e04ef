"""Human views for a TTY: plain-text tables of registry records and an
audit trail. Callers redact secrets first (`registry.redact`); these
functions print what they are given."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

JOB_COLUMNS = (("JOB", "job_id"), ("STATUS", "status"), ("SESSION", "session"), ("ROLE", "role"),
               ("ATTEMPT", "attempt_id"), ("SEQ", "last_seq"), ("CLOSE", "close_reason"),
               ("EXIT", "exit_code"), ("UPDATED", "updated_at"))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    text = str(value)
    # a record edited by hand must not inject terminal control sequences
    return "".join(c if c.isprintable() else "?" for c in text)


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


def show_text(record: Mapping[str, Any], trail: Sequence[Mapping[str, Any]]) -> str:
    """The `show` view: the record as `key: value` lines, then the audit trail."""
    width = max(len(k) for k in record) if record else 0
    lines = [f"{k.ljust(width)}  {_cell(record[k])}" for k in sorted(record)]
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
