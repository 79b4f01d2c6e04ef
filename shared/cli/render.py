"""The `jobs` and `show` commands of both CLIs (PROTOCOL §8) and their human
views for a TTY: plain-text tables of registry records and an audit trail.
The views print what they are given; the commands redact secrets first
(`records.redact`)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from mam.shared.protocol import names, wire
from mam.shared.protocol.codes import TERMINAL_STATUSES, UNPUBLISHED_STATUSES, JobStatus
from mam.shared.protocol.errors import MamError
from mam.shared.store.asklog import waiting_in
from mam.shared.store.records import redact
from mam.shared.store.registry import Registry
from mam.shared.store.root import existing_root

# the `jobs` table: (header, record key); DURATION and BRIEF are computed (`_job_row`)
JOB_COLUMNS = (("JOB", "job_id"), ("STATUS", "status"), ("RUNNER", "session"), ("ATTEMPT", "attempt_id"),
               ("DURATION", "duration"), ("CLOSE", "close_reason"), ("EXIT", "exit_code"),
               ("LATE", "late_outcome"), ("AGENT", "agent"), ("BRIEF", "brief"), ("WAITING", "why_waiting"))
BRIEF_READ_MAX_BYTES = 4096  # the views show the brief's first lines only
BRIEF_CELL_CHARS = 40  # the BRIEF column of `jobs`
BRIEF_SHOW_LINES = 3  # the brief lines at the top of `show`
SECONDS_PER_MINUTE = 60
SECONDS_PER_HOUR = 3600


def duration_s(record: Mapping[str, Any], now: float | None = None) -> float | None:
    """Seconds from the attempt's creation to its end (its last update when terminal, else now)."""
    try:
        start = wire.parse_ts(record.get("attempt_created_at") or record["created_at"]).timestamp()
        end = (wire.parse_ts(record["updated_at"]).timestamp() if record.get("status") in TERMINAL_STATUSES
               else (time.time() if now is None else now))
    except (KeyError, ValueError, TypeError):
        return None
    return max(0.0, end - start)


def format_duration(seconds: float | None) -> str:
    """`42s`, `3m05s`, `2h01m`; `-` when unknown."""
    if seconds is None:
        return "-"
    whole = int(seconds)
    if whole < SECONDS_PER_MINUTE:
        return f"{whole}s"
    if whole < SECONDS_PER_HOUR:
        return f"{whole // SECONDS_PER_MINUTE}m{whole % SECONDS_PER_MINUTE:02d}s"
    return f"{whole // SECONDS_PER_HOUR}h{whole % SECONDS_PER_HOUR // SECONDS_PER_MINUTE:02d}m"


def brief_lines(root: Path | None, job_id: str) -> list[str]:
    """The first lines of the hub's copy of a job's brief (§5); [] when there is none."""
    if root is None:
        return []
    try:
        with open(names.brief_path(root, job_id), "rb") as handle:
            raw = handle.read(BRIEF_READ_MAX_BYTES)
    except (OSError, ValueError):
        return []
    return [line for line in raw.decode("utf-8", "replace").splitlines() if line.strip()]


def log_places(record: Mapping[str, Any], root: Path | None) -> tuple[str, str]:
    """Where the full output is on both sides (§15): the hub's copy, the runner's agent.log."""
    job_id = str(record.get("job_id"))
    session = record.get("session") or "-"
    runner_side = f"{names.runner_agent_log_path(Path('.'), job_id)} in runner {session}'s workspace"
    if root is not None and record.get("role") not in (None, "hub"):  # `mam-runner show`: this host is the runner
        return "-", str(names.runner_agent_log_path(root, job_id))
    if root is None:
        return "-", runner_side
    try:
        hub_side = str(names.hub_log_path(root, job_id, int(record.get("attempt_id") or 1)))
    except (ValueError, TypeError):
        hub_side = "-"
    return hub_side, runner_side


def summary_lines(record: Mapping[str, Any], root: Path | None) -> str:
    """The last lines of a human `dispatch`/`watch` view: a cancel said in words, then
    outcome, duration, the runner (only when one reported this attempt: a job that never
    ran names none) and where the full output is (§15)."""
    job_id, status = record.get("job_id"), record.get("status")
    lines = []
    if status == JobStatus.CANCELLED:
        lines.append(f"job {job_id} was cancelled while it was watched (mam-orch cancel or the API)")
    hub_side, runner_side = log_places(record, root)
    outcome = _outcome(status, record.get("close_reason") if record.get("close_reason") != status else None)
    exit_code = record.get("exit_code")
    ended = f"job {job_id} {outcome}{'' if exit_code is None else f' (exit {exit_code})'} after " \
            f"{format_duration(duration_s(record))}"
    if record.get("last_seq") or record.get("seen_seq"):  # its runner reported this attempt
        lines.append(f"{ended} on runner {record.get('session') or '-'}; full output: hub {hub_side}, "
                     f"runner {runner_side}")
    else:
        lines.append(f"{ended} without starting on any runner (no output)")
    return "\n".join(_cell(line) for line in lines) + "\n"


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


def _job_row(record: Mapping[str, Any], root: Path | None) -> list[Any]:
    brief = brief_lines(root, str(record.get("job_id"))) if record.get("role") in (None, "hub") else []
    first = brief[0] if brief else None
    if first is not None and len(first) > BRIEF_CELL_CHARS:
        first = first[:BRIEF_CELL_CHARS - 1] + "…"
    computed = {"duration": format_duration(duration_s(record)), "brief": first, "agent": agent_cell(record)}
    return [computed[k] if k in computed else record.get(k) for _, k in JOB_COLUMNS]


def with_why_waiting(registry: Registry, record: dict[str, Any]) -> dict[str, Any]:
    """A hub record with `why_waiting`: for a blocked or queued job the hub engine's latest line
    on why it waits (§14, a `hub_note` of its audit log), for a running one the permission
    requests it waits on (§19); other records as they are."""
    waits = record.get("status") in (JobStatus.PENDING, JobStatus.RUNNING)
    if (record.get("status") not in UNPUBLISHED_STATUSES and not waits) or record.get("role") not in (None, "hub"):
        return record
    try:
        trail = registry.audit(str(record["job_id"]))
    except MamError:
        return record
    if waits:
        asked = waiting_in(record, trail)
        if asked:
            record["why_waiting"] = f"waiting for approval: {', '.join(ask.tool for ask in asked)}"
        return record
    notes = [str(line.get("line", "")) for line in trail if line.get("event") == "hub_note"]
    if notes:
        record["why_waiting"] = notes[-1].removeprefix(f"job {record['job_id']}: ")
    return record


def agent_cell(record: Mapping[str, Any]) -> str | None:
    """What the job's agent spent (§18), e.g. `claude 5 turns $0.0053`, or None."""
    agent = record.get("agent")
    if not isinstance(agent, Mapping):
        return None
    cost = agent.get("cost_usd")
    spent = f" ${cost:.4f}" if isinstance(cost, (int, float)) and not isinstance(cost, bool) else ""
    return f"{agent.get('kind')} {agent.get('turns')} turns{spent}"


def print_summary(registry: Registry, job_id: str, out: TextIO | None = None) -> None:
    """`summary_lines` of a job that ended (nothing while it is still open)."""
    record = registry.get(job_id)
    if record["status"] in TERMINAL_STATUSES:
        stream = out or sys.stdout
        stream.write(summary_lines(redact(record), registry.root))
        stream.flush()


def jobs_table(records: Sequence[Mapping[str, Any]], root: Path | None = None) -> str:
    """The `jobs` table (duration, runner and the brief's first line from `root`); `(no jobs)` when empty."""
    if not records:
        return "(no jobs)\n"
    return table([h for h, _ in JOB_COLUMNS], [_job_row(r, root) for r in records])


def _outcome(status: Any, close_reason: Any) -> str:
    return f"{status} ({close_reason})" if close_reason else str(status)


def end_reason(attempt: Mapping[str, Any]) -> str | None:
    """Why an attempt ended, when not by the agent alone: the hub's close reason, or
    `lease_lost` when its runner fenced it (§10 "Leases")."""
    return attempt.get("close_reason") or ("lease_lost" if attempt.get("lease_lost") else None)


def attempts(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every attempt of a job, oldest first (§8 redispatch, §14 retries): attempt_id,
    the runner session ("-" while a label target is queued), its outcome and the agent's
    session id it reported (§18), or None."""
    rows = [{"attempt_id": old.get("attempt_id"), "session": old.get("session") or "-",
             "outcome": _outcome(old.get("status"), end_reason(old)),
             "agent_session_id": old.get("agent_session_id")}
            for old in record.get("attempt_history", []) if isinstance(old, Mapping)]
    agent = record.get("agent")
    current = agent.get("session_id") if isinstance(agent, Mapping) and \
        agent.get("attempt_id") == record.get("attempt_id") else None
    rows.append({"attempt_id": record.get("attempt_id"), "session": record.get("session") or "-",
                 "outcome": _outcome(record.get("status"), end_reason(record)),
                 "agent_session_id": current})
    return rows


def show_head(record: Mapping[str, Any], root: Path | None) -> list[str]:
    """The top of `show`: what a person asks first (status, runner, attempts, duration, brief, logs)."""
    hub_side, runner_side = log_places(record, root)
    close = end_reason(record)
    head = [("job", record.get("job_id")),
            ("status", _outcome(record.get("status"), close if close != record.get("status") else None)),
            ("runner", record.get("session") or "-"),
            ("attempts", len(attempts(record))),
            ("duration", format_duration(duration_s(record))),
            ("hub log", hub_side),
            ("runner log", runner_side)]
    if record.get("group"):  # §14 Groups
        head.insert(3, ("group", f"{record['group']} (at most {record.get('group_limit', 1)} at once"
                                 f"{'; cancels earlier ones' if record.get('cancel_in_progress') else ''})"))
    fired = record.get("schedule")
    if isinstance(fired, Mapping):  # §14 Schedules
        head.insert(3, ("schedule", f"{fired.get('name')} (tick {fired.get('tick')}"
                                    f"{', a catch-up run' if fired.get('catch_up') else ''})"))
    lines = [f"{k + ':':<12}{_cell(v)}" for k, v in head]
    brief = brief_lines(root, str(record.get("job_id")))
    for n, text in enumerate(brief[:BRIEF_SHOW_LINES]):
        lines.append(f"{'brief:' if n == 0 else '':<12}{_cell(text)}")
    if len(brief) > BRIEF_SHOW_LINES:
        lines.append(f"{'':<12}… ({len(brief) - BRIEF_SHOW_LINES} more lines)")
    return lines


def work_lines(record: Mapping[str, Any], trail: Sequence[Mapping[str, Any]], root: Path | None = None) -> list[str]:
    """`show`'s lines for a repository or agent job (§18): the repository at its commit, the
    agent's figures and the result, from the record and the attempt's last events, and (with
    the hub's `root`) the artifacts that arrived."""
    raw_work = record.get("work")
    work: Mapping[str, Any] = raw_work if isinstance(raw_work, Mapping) else {}
    attempt = record.get("attempt_id")
    data: dict[str, Any] = {}
    for entry in trail:  # the current attempt's events (their data names the attempt), later ones win
        event_data = entry.get("data")
        if "seq" in entry and isinstance(event_data, Mapping) and \
                entry.get("attempt_id", event_data.get("attempt_id")) == attempt:
            data.update(event_data)
    lines = []
    if work.get("repo"):
        lines.append(f"{'repo:':<12}{_cell(work['repo'])} @ {_cell(data.get('ref') or work.get('ref') or 'HEAD')} "
                     f"{_cell(record.get('repo_sha') or '(not resolved yet)')}")
    agent = data.get("agent")
    if isinstance(agent, Mapping):
        raw_tokens = agent.get("tokens")
        tokens: Mapping[str, Any] = raw_tokens if isinstance(raw_tokens, Mapping) else {}
        cost = agent.get("cost_usd")
        lines.append(f"{'agent:':<12}{_cell(agent.get('kind'))} session {_cell(agent.get('session_id'))}, "
                     f"{_cell(agent.get('turns'))} turns, {_cell(tokens.get('input'))} in / "
                     f"{_cell(tokens.get('output'))} out / {_cell(tokens.get('cached'))} cached tokens, "
                     f"${_cell(cost if cost is None else f'{cost:.4f}')}")
    usage = data.get("usage")
    if isinstance(usage, Mapping) and usage:
        peak = usage.get("peak_memory_bytes")
        memory = f", peak memory {peak / 2**20:.1f} MiB" if isinstance(peak, int) and not isinstance(peak, bool) else ""
        lines.append(f"{'usage:':<12}{_cell(usage.get('cpu_s'))} s CPU{memory} (the job's processes)")
    result = data.get("result")
    if isinstance(result, Mapping):
        summary = (f"{_cell(result.get('files_total'))} files, +{_cell(result.get('insertions'))} "
                   f"-{_cell(result.get('deletions'))}, head {_cell(result.get('head_sha'))}"
                   if result.get("head_sha") else "artifacts only")
        note = f" ({_cell(result['note'])})" if result.get("note") else ""
        lines.append(f"{'result:':<12}{summary}{note}; `mam-orch result {_cell(record.get('job_id'))}`")
    if root is not None and isinstance(attempt, int) and record.get("role") in (None, "hub"):
        folder = names.hub_artifacts_dir(root, str(record.get("job_id")), attempt)
        found = sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
        if found:
            lines.append(f"{'artifacts:':<12}{_cell(', '.join(found))} (in {_cell(folder)})")
    return lines


def show_text(record: Mapping[str, Any], trail: Sequence[Mapping[str, Any]], root: Path | None = None) -> str:
    """The `show` view: the summary (`show_head`), the record as `key: value` lines, its
    attempts, then the audit trail."""
    width = max(len(k) for k in record) if record else 0
    lines = show_head(record, root) + work_lines(record, trail, root)
    lines += ["", "record:"]
    lines += [f"  {k.ljust(width)}  {_cell(record[k])}" for k in sorted(record)]
    lines.append("")
    lines.append("attempts:")
    lines += [f"  {_cell(row['attempt_id'])}  {_cell(row['session'])}  {_cell(row['outcome'])}"
              + (f"  agent session {_cell(row['agent_session_id'])}" if row["agent_session_id"] else "")
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
        elif event == "permission_required" and isinstance(rest.get("data"), dict):  # §19
            data = rest["data"]
            detail = (f"seq {_cell(rest.get('seq'))} {_cell(rest.get('detail'))}: {_cell(data.get('input'))} "
                      f"(request {_cell(data.get('request_id'))})")
        elif event == "permission_answered":
            detail = (f"{_cell(rest.get('behavior'))} by {_cell(rest.get('by'))} (request "
                      f"{_cell(rest.get('request_id'))}): {_cell(rest.get('message'))}")
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
    registry = Registry(existing_root(workspace))
    records, errors = registry.list(status)
    safe = [with_why_waiting(registry, redact(r)) for r in records]
    if as_json or not out.isatty():
        for record in safe:
            out.write(json.dumps(record, sort_keys=True) + "\n")
    else:
        out.write(jobs_table(safe, registry.root))
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
    registry = Registry(existing_root(workspace))
    record = redact(registry.get(job_id))
    trail = redact(registry.audit(job_id))
    if as_json or not out.isatty():
        out.write(json.dumps({"record": record, "audit": trail, "attempts": attempts(record)}, sort_keys=True) + "\n")
    else:
        out.write(show_text(record, trail, registry.root))
    return 0
