"""The hub's dispatch message: seal the brief and the job's auth_token, sign, publish
retained (PROTOCOL §5); the brief, contract and queue terms a dispatch is made of.

`build_dispatch` is pure (record + brief + keys -> signed wire dict) so the
runner's tests and the hub share one way of making a dispatch. A job is
registered `queued` (§14, `submit`); `publish_queued` is the one step that
publishes a queued job to the runner the hub engine chose (`service.HubService`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

from mam.orchestrator.control import close_remote
from mam.orchestrator.hub import Workspace
from mam.orchestrator.identity import roster
from mam.orchestrator.queuewait import mark_published
from mam.orchestrator.results import with_bundle, with_transcript
from mam.shared import config
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.codes import DEFAULT_RETRY_ON, CloseReason
from mam.shared.protocol.crypto import MAX_BRIEF_BYTES, DispatchKeys
from mam.shared.protocol.errors import ProtocolError, UsageError
from mam.shared.store.fsio import atomic_write
from mam.shared.store.records import JobRecord, QueueTerms
from mam.shared.store.registry import Registry
from mam.shared.transport import Transport

HUB_NAME_MAX_CHARS = 255

log = logging.getLogger("mam.dispatch")


def hub_name() -> str:
    """The `origin` of a dispatch (§5): MAM_HUB_NAME, else the host name."""
    return (os.environ.get("MAM_HUB_NAME") or socket.gethostname() or "hub")[:HUB_NAME_MAX_CHARS]


def check_brief(brief: str, flags: tuple[str, str] = ("--brief TEXT", "--brief-file")) -> str:
    """Refuse a brief that is empty or larger than 512 KiB of UTF-8 (§5); `flags` as for `read_brief`.

    Raises:
        UsageError: with the size found and the limit.
    """
    if not isinstance(brief, str) or not brief.strip():
        raise UsageError(f"the brief is empty: give {flags[0]}, {flags[1]} PATH or {flags[1]} -")
    size = len(brief.encode("utf-8", "surrogatepass"))
    if size > MAX_BRIEF_BYTES:
        raise UsageError(f"the brief is {size} bytes, larger than the {MAX_BRIEF_BYTES}-byte limit (§5)")
    if "\x00" in brief:  # the runner passes it in MAM_JOB_BRIEF, and no environment value holds a NUL (§11)
        raise UsageError("the brief contains a NUL character: give UTF-8 text")
    try:
        brief.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("the brief is not valid UTF-8 text (lone surrogate)") from None
    return brief


MAX_TITLE_CHARS = 120
"""`dispatch --title`: at most this many characters, one line."""
DEFAULT_TITLE_CHARS = 80
"""A title taken from the brief's first line is cut to this many characters."""
_CREDENTIAL_RE = re.compile(r"(?i)\b([\w.-]*(?:password|passwd|secret|token|api[_-]?key)[\w.-]*\s*[=:]\s*)(\S+)")
_URL_USER_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]+:)[^/\s@]+@")


def job_title(brief: str, title: str | None = None) -> str:
    """A person's name for a job: `title` (`--title`, checked), else the brief's first non-blank
    line with runs of whitespace as one space, cut to DEFAULT_TITLE_CHARS. Either way credentials
    are masked first: `NAME_TOKEN=value`-like assignments and a URL's password become `***`.

    Raises:
        UsageError: a title that is blank, longer than MAX_TITLE_CHARS, or not one printable line.
    """
    if title is not None:
        if not title.strip() or len(title) > MAX_TITLE_CHARS or not title.isprintable():
            raise UsageError(f"the title is invalid: expected one printable line of 1..{MAX_TITLE_CHARS} characters")
        return _masked(" ".join(title.split()))
    first = next((line for line in brief.splitlines() if line.strip()), "")
    text = _masked(" ".join("".join(c if c.isprintable() else " " for c in first).split()))  # masked, then cut
    return text if len(text) <= DEFAULT_TITLE_CHARS else text[:DEFAULT_TITLE_CHARS - 1].rstrip() + "…"


def _masked(text: str) -> str:
    return _URL_USER_RE.sub(r"\1***@", _CREDENTIAL_RE.sub(r"\1***", text))


def build_dispatch(record: Mapping[str, Any], brief: str, keys: DispatchKeys, *, origin: str | None = None,
                   issued_at: datetime | None = None, root: Path | None = None) -> dict[str, Any]:
    """The signed dispatch of §5 for the record's current attempt: v2 (§16) when the hub
    registry at `root` has an active roster entry for the session, else v1; its
    `work.resume` carries the session's transcript when the hub has it and it fits, and
    `work.base` the change it starts from (§18).

    Args:
        record: the hub record (job_id, session, attempt_id, dispatch_token,
            auth_token and the contract fields).
        brief: UTF-8 text, at most 512 KiB.
        keys: `DispatchKeys` from MAM_DISPATCH_SECRET.
        origin: the hub's name (default `hub_name()`).
        issued_at: aware datetime (default now); `expires_at` = issued_at + ack_timeout_sec.
        root: the hub registry's root, whose roster decides v1 or v2 (None: v1).
    Returns:
        the wire dict, `sig` included.
    Raises:
        UsageError: a bad brief or record field, or a revoked session (§16).
    """
    check_brief(brief)
    if root is not None:
        record = with_bundle(root, record)  # §18: the change it starts from travels with it, or it cannot start
    if root is not None and (carried := with_transcript(root, record)) is not record:
        signed = _build_dispatch(carried, brief, keys, origin=origin, issued_at=issued_at, root=root)
        try:
            wire.encode(signed)
            return signed
        except ProtocolError:  # §18: the brief and the transcript together are over the 1 MiB cap
            log.warning("job %s: its brief and transcript are too large together to carry the transcript; a "
                        "runner without it starts a new session", record["job_id"])
    return _build_dispatch(record, brief, keys, origin=origin, issued_at=issued_at, root=root)


def _build_dispatch(record: Mapping[str, Any], brief: str, keys: DispatchKeys, *, origin: str | None,
                    issued_at: datetime | None, root: Path | None) -> dict[str, Any]:
    if root is not None:
        v2 = roster.build_dispatch_v2(root, record, brief, origin=origin or hub_name(), issued_at=issued_at)
        if v2 is not None:
            return v2
    sealed = crypto.seal(keys.seal_key, job_id=record["job_id"], attempt_id=record["attempt_id"],
                         dispatch_token=record["dispatch_token"], auth_token=record["auth_token"],
                         brief=brief)
    contract = wire.Contract.of_record(record)
    dispatch = wire.Dispatch.build(record["job_id"], record["session"], record["attempt_id"],
                                   record["dispatch_token"], origin=origin or hub_name(),
                                   contract=contract, sealed=sealed, issued_at=issued_at,
                                   work=wire.Work.of_record(record))
    return crypto.sign(dispatch.to_dict(), keys.sign_key)


def encode_dispatch(signed: dict[str, Any]) -> bytes:
    """Canonical bytes of a signed dispatch (§3.1, §5); refuses one over the 1 MiB wire cap.

    Raises:
        UsageError: the encoded dispatch is too large (a brief full of escapes).
    """
    try:
        return wire.encode(signed)
    except ProtocolError as exc:
        raise UsageError(f"the dispatch is too large to publish: {exc}") from None


def publish_dispatch(client: Transport, signed: dict[str, Any]) -> None:
    """Publish the signed dispatch retained, QoS 1, and wait for the PUBACK (§2, §5).

    Raises:
        PublishTimeout, BrokerError.
    """
    client.publish(names.dispatch_topic(signed["job_id"], client.config.topic_root),
                   encode_dispatch(signed), retain=True)


# ------------------------------------------------------------------ the command

BRIEF_FILE_NAME = "brief.txt"


def read_brief(brief: str | None, brief_file: str | None, stdin: BinaryIO | None = None, *,
               flags: tuple[str, str] = ("--brief TEXT", "--brief-file")) -> str:
    """The brief from exactly one of `--brief TEXT` / `--brief-file PATH|-` (§5); `flags` names
    the two sources in messages (e.g. `mam-orch say`'s `TEXT` and `--file`).

    The file (or stdin for "-") is read as bytes, at most 512 KiB + 1, and
    decoded as strict UTF-8.

    Returns:
        the checked brief (`check_brief`).
    Raises:
        UsageError: none or both sources; a file that is missing, unreadable,
            a directory, larger than 512 KiB, not UTF-8, empty, or holding a NUL.
    """
    if (brief is None) == (brief_file is None):
        raise UsageError(f"give exactly one of {flags[0]}, {flags[1]} PATH or {flags[1]} -")
    if brief is not None:
        return check_brief(brief, flags)
    where = "stdin" if brief_file == "-" else str(brief_file)
    try:
        if brief_file == "-":
            handle = stdin if stdin is not None else sys.stdin.buffer
            raw = handle.read(MAX_BRIEF_BYTES + 1)
        else:
            with open(str(brief_file), "rb") as file:
                raw = file.read(MAX_BRIEF_BYTES + 1)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"{flags[1]} {where}: cannot read ({reason})") from None
    if len(raw) > MAX_BRIEF_BYTES:
        raise UsageError(f"{flags[1]} {where}: larger than the {MAX_BRIEF_BYTES}-byte limit of a brief (§5)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{flags[1]} {where}: not UTF-8 text (bad byte at offset {exc.start})") from None
    return check_brief(text, flags)


def brief_path(registry: Registry, job_id: str) -> Path:
    """`<root>/.mam/logs/<job_id>/brief.txt`: the hub's copy of the brief.

    The brief crosses the broker only sealed (§5), so the hub keeps the
    operator's own text on its own disk (0600, next to the audit log) to
    re-seal it for a redispatch (§8).
    """
    return Path(registry.logs_dir(job_id)) / BRIEF_FILE_NAME


def save_brief(registry: Registry, job_id: str, brief: str) -> Path:
    """Write the brief to `brief_path` (atomic, 0600).

    Raises:
        RegistryError: the write failed.
    """
    path = brief_path(registry, job_id)
    atomic_write(path, brief.encode("utf-8"), what=f"job {job_id} brief")
    return path


def load_brief(registry: Registry, job_id: str) -> str:
    """The stored brief of a job (for a redispatch).

    Raises:
        UsageError: no stored brief (give --brief-file), or it is not a valid brief.
    """
    path = brief_path(registry, job_id)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"job {job_id}: no stored brief at {path}; give --brief TEXT or --brief-file PATH") from None
    except OSError as exc:
        raise UsageError(f"job {job_id}: cannot read the stored brief {path} "
                         f"({exc.strerror or type(exc).__name__})") from None
    try:
        return check_brief(raw.decode("utf-8"))
    except (UnicodeDecodeError, UsageError):
        raise UsageError(f"job {job_id}: the stored brief {path} is unusable; give --brief-file PATH") from None


def hub_contract(workspace: Workspace, *, heartbeat_s: int | None = None, heartbeat_misses: int | None = None,
                 ack_timeout_s: int | None = None, idle_timeout_s: int | None = None,
                 timeout_s: int | None = None, settings: Mapping[str, str] | None = None) -> wire.Contract:
    """The job's contract (§5): defaults, then MAM_HEARTBEAT_SEC, MAM_HEARTBEAT_MISSES,
    MAM_ACK_TIMEOUT_S (environment, then .mam.env, §13; `settings`: those already read,
    `Hub.settings`), then the CLI options.

    Raises:
        UsageError: an option that is not a positive integer (or absurdly large).
        ConfigError: a bad environment value. EnvFileError: an unreadable env file.
    """
    for name, value in (("--heartbeat", heartbeat_s), ("--heartbeat-misses", heartbeat_misses),
                        ("--ack-timeout", ack_timeout_s), ("--idle-timeout", idle_timeout_s),
                        ("--timeout", timeout_s)):
        if value is not None and value < 1:
            raise UsageError(f"{name} {value} is invalid: expected a positive integer")
    values = config.load_env(workspace=workspace) if settings is None else settings
    contract: wire.Contract = config.contract_from_env(
        values, heartbeat_sec=heartbeat_s, heartbeat_misses=heartbeat_misses, ack_timeout_sec=ack_timeout_s,
        idle_timeout_sec=idle_timeout_s, timeout_sec=timeout_s)
    return contract


def print_started(record: JobRecord, as_json: bool, verb: str) -> None:
    """The --detach answer on stdout: the job id (JSON unless a human reads a TTY)."""
    if as_json or not sys.stdout.isatty():
        print(json.dumps({"job_id": record["job_id"], "session": record["session"],
                          "attempt_id": record["attempt_id"], "status": record["status"], "action": verb}),
              flush=True)
    else:
        print(record["job_id"], flush=True)


def send_dispatch(registry: Registry, record: JobRecord, keys: DispatchKeys, client: Transport) -> JobRecord:
    """Seal, sign and publish retained the dispatch of a `pending` attempt with its
    stored brief (§5). If it does not reach the broker the record is closed
    `agent_blocked` (no job stays pending) and the error propagates.

    Raises:
        BrokerError, UsageError (no usable stored brief), RegistryError.
    """
    job_id = record["job_id"]
    sent = False
    try:
        publish_dispatch(client, build_dispatch(record, load_brief(registry, job_id), keys, root=registry.root))
        sent = True
    finally:
        if not sent:
            closed = close_remote(registry, client if client.connected.is_set() else None, keys,
                                  job_id, CloseReason.AGENT_BLOCKED)
            print(f"job {job_id} was not dispatched; its record is closed {closed.get('close_reason')}",
                  file=sys.stderr)
    return record


def republish_dispatch(registry: Registry, record: JobRecord, keys: DispatchKeys, client: Transport) -> None:
    """Publish the dispatch of a `pending` attempt again, record unchanged (§14 "One hub
    process"): a hub engine killed between `mark_published` and the publish left the attempt
    pending with no dispatch on the broker. A runner that took it already refuses the copy
    (`replayed`), so the attempt still runs at most once.

    Raises:
        BrokerError, UsageError (no usable stored brief), RegistryError.
    """
    publish_dispatch(client, build_dispatch(record, load_brief(registry, record["job_id"]), keys,
                                            root=registry.root))


def publish_queued(registry: Registry, job_id: str, session: str, keys: DispatchKeys,
                   client: Transport) -> JobRecord:
    """Publish a `queued` job to the runner the queue chose (§14): `queued` → `pending`
    for `session` (source `hub_queue`; the ack and wall clocks start now), then the
    sealed, signed, retained dispatch (§5) with the stored brief.

    Returns:
        the `pending` record.
    Raises:
        Refusal(`not_allowed`): the job is no longer queued (nothing published).
        BrokerError, UsageError (the record is then closed `agent_blocked`), RegistryError.
    """
    return send_dispatch(registry, mark_published(registry, job_id, session), keys, client)


def parse_retry_on(text: str | None) -> tuple[str, ...]:
    """`--retry-on a,b` as a tuple (checked by `QueueTerms.checked`); None: the §14 default."""
    if text is None:
        return tuple(DEFAULT_RETRY_ON)
    return tuple(item.strip() for item in text.split(","))


def parse_after(text: str) -> tuple[str, ...]:
    """`--after ID[,ID...]` as job ids (§14 Dependencies); `QueueTerms.checked` checks them.

    Raises:
        UsageError: an empty item (one line).
    """
    items = tuple(item.strip() for item in str(text)[:4096].split(","))
    if not all(items):
        raise UsageError(f"--after {str(text)[:40]!r} is invalid: expected job ids separated by commas")
    return items


def queue_terms(session: str | None, labels: str | None, *, priority: int, queue_timeout_s: int | None,
                retries: int, retry_on: str | None, fresh: bool = False, on_limit: str = "pause",
                group: str | None = None, group_limit: int | None = None,
                cancel_in_progress: bool = False, after: str | None = None,
                after_if: str | None = None, from_result: str | None = None) -> QueueTerms:
    """The job's §14 terms from the dispatch options (`--session remote:NAME` accepted;
    `after`: `ID[,ID...]`, §14 Dependencies).

    Raises:
        UsageError: both or neither of --session/--labels, or a bad value (one line).
    """
    if session is not None and labels is not None:
        raise UsageError("give either --session NAME or --labels a,b, not both (§14)")
    if session is None and labels is None:
        raise UsageError("give --session NAME (one runner) or --labels a,b (any runner with them)")
    bare = names.validate_session(names.strip_remote(session)) if session is not None else None
    terms = QueueTerms(target_session=bare, target_labels=names.parse_labels(labels) if labels is not None else (),
                       priority=priority, retries=retries, retry_on=parse_retry_on(retry_on), fresh=fresh,
                       on_limit=on_limit, group=group, cancel_in_progress=cancel_in_progress)
    if group_limit is not None:
        terms = terms._replace(group_limit=group_limit)
    if after is not None:
        terms = terms._replace(after=parse_after(after))
    if after_if is not None:
        terms = terms._replace(after_if=after_if)
    if from_result is not None:
        terms = terms._replace(from_result=from_result.strip())
    if queue_timeout_s is not None:
        terms = terms._replace(queue_timeout_sec=queue_timeout_s)
    return terms.checked()


def work_terms(*, repo: str | None = None, ref: str | None = None, max_turns: int | None = None,
               max_cost_usd: float | None = None, allow_tools: str | Sequence[str] | None = None,
               deny_tools: str | Sequence[str] | None = None, permission_mode: str | None = None,
               ask_timeout_s: int | None = None, on_ask_timeout: str | None = None,
               memory: str | int | None = None, cpus: float | None = None, pids: int | None = None,
               gpus: int | None = None, cli: bool = True) -> wire.Work | None:
    """The job's repository and its agent's policy (§18) from the dispatch options, or None
    for a plain job.

    Args:
        repo: `--repo NAME`; ref: `--ref REF` (only with a repo).
        max_turns, max_cost_usd: the agent's budgets; allow_tools: `Bash(git *),Edit` (a string
        is split on commas outside parentheses) or a list of rules; deny_tools: the same form,
        rules never allowed (§19); permission_mode: the CLI's mode.
        ask_timeout_s, on_ask_timeout: how long a permission request waits for a person and
        what then, deny or cancel (§19).
        memory, cpus, pids: the job's resource limits (§6 "Limits"): memory as `512M`/`8G` or
        bytes, CPUs as a number, processes at most. gpus: how many of a runner's GPUs the job
        needs (§14 "GPUs").
        cli: name the options as flags (`--max-turns`) in errors, else as API fields (`max_turns`).
    Raises:
        UsageError: one line naming the bad option.
    """
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-") if cli else name

    if ref is not None and repo is None:
        raise UsageError(f"{flag('ref')} needs {flag('repo')} NAME (the repository the ref is in)")
    if repo is not None:
        names.validate_repo(repo, flag("repo"))
    if ref is not None:
        names.validate_ref(ref, flag("ref"))
    if max_turns is not None:
        names.validate_max_turns(max_turns, flag("max_turns"))
    if max_cost_usd is not None:
        max_cost_usd = names.validate_max_cost(max_cost_usd, flag("max_cost_usd"))
    if permission_mode is not None:
        names.validate_permission_mode(permission_mode, flag("permission_mode"))
    if ask_timeout_s is not None:
        names.validate_ask_timeout(ask_timeout_s, "--ask-timeout" if cli else "ask_timeout_s")
    if on_ask_timeout is not None:
        names.validate_ask_timeout_action(on_ask_timeout, flag("on_ask_timeout"))
    memory_bytes = None
    if isinstance(memory, str):
        memory_bytes = names.parse_memory(memory, flag("memory"))
    elif memory is not None:
        memory_bytes = names.validate_memory_bytes(memory, flag("memory"))
    if cpus is not None:
        cpus = names.validate_cpus(cpus, flag("cpus"))
    if pids is not None:
        names.validate_pids(pids, flag("pids"))
    if gpus is not None:
        names.validate_gpus(gpus, flag("gpus"))
    rules = _tool_rules(allow_tools, flag("allow_tools"))
    denied = _tool_rules(deny_tools, flag("deny_tools"))
    return wire.Work.build(repo=repo, ref=ref, max_turns=max_turns, max_cost_usd=max_cost_usd,
                           allow_tools=rules or None, deny_tools=denied or None, permission_mode=permission_mode,
                           ask_timeout_s=ask_timeout_s, on_ask_timeout=on_ask_timeout, memory_bytes=memory_bytes,
                           cpus=cpus, pids=pids, gpus=gpus) or None


def _tool_rules(value: str | Sequence[str] | None, what: str) -> tuple[str, ...]:
    """`Bash(git *),Edit` (a string, split on commas outside parentheses) or a list of rules."""
    if isinstance(value, str):
        return names.parse_tool_rules(value, what)
    return names.validate_tool_rules(list(value), what) if value is not None else ()
