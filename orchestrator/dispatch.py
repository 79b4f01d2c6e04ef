"""The hub's dispatch: seal the brief and the job's auth_token, sign, publish
retained (PROTOCOL §5), then watch (§10); `mam-orch dispatch`.

`build_dispatch` is pure (record + brief + keys -> signed wire dict) so the
runner's tests and the hub share one way of making a dispatch. A job is
registered `queued` (§14); `publish_queued` is the one step that publishes a
queued job to the runner the queue chose (the dispatch process without a
service, `queuewait`, and the service both use it); retries follow §14.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

from mam.orchestrator.control import close_remote
from mam.orchestrator.hints import detach_hint, queued_hint, reattach_hint
from mam.orchestrator.hub import Workspace, open_hub
from mam.orchestrator.identity import roster
from mam.orchestrator.queuewait import PresenceFeed, mark_published, retry_attempt, retry_reason, wait_queued
from mam.orchestrator.runners import collect_presence, read_presence
from mam.orchestrator.watch import Detached, Watcher, WatchOptions
from mam.shared import config
from mam.shared.cli.render import print_summary
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.codes import DEFAULT_RETRY_ON, TERMINAL_STATUSES, CloseReason, JobStatus, PresenceStatus
from mam.shared.protocol.crypto import MAX_BRIEF_BYTES, DispatchKeys
from mam.shared.protocol.errors import BrokerUnavailable, ExitCode, ProtocolError, UsageError
from mam.shared.store.fsio import atomic_write
from mam.shared.store.records import JobRecord, QueueTerms, describe_target
from mam.shared.store.registry import Registry
from mam.shared.transport.mqtt import MqttClient

HUB_NAME_MAX_CHARS = 255

log = logging.getLogger("mam.dispatch")


def hub_name() -> str:
    """The `origin` of a dispatch (§5): MAM_HUB_NAME, else the host name."""
    return (os.environ.get("MAM_HUB_NAME") or socket.gethostname() or "hub")[:HUB_NAME_MAX_CHARS]


def check_brief(brief: str) -> str:
    """Refuse a brief that is empty or larger than 512 KiB of UTF-8 (§5).

    Raises:
        UsageError: with the size found and the limit.
    """
    if not isinstance(brief, str) or not brief.strip():
        raise UsageError("the brief is empty: give --brief TEXT, --brief-file PATH or --brief-file -")
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


def build_dispatch(record: Mapping[str, Any], brief: str, keys: DispatchKeys, *, origin: str | None = None,
                   issued_at: datetime | None = None, root: Path | None = None) -> dict[str, Any]:
    """The signed dispatch of §5 for the record's current attempt: v2 (§16) when the hub
    registry at `root` has an active roster entry for the session, else v1.

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
        v2 = roster.build_dispatch_v2(root, record, brief, origin=origin or hub_name(), issued_at=issued_at)
        if v2 is not None:
            return v2
    sealed = crypto.seal(keys.seal_key, job_id=record["job_id"], attempt_id=record["attempt_id"],
                         dispatch_token=record["dispatch_token"], auth_token=record["auth_token"],
                         brief=brief)
    contract = wire.Contract.of_record(record)
    dispatch = wire.Dispatch.build(record["job_id"], record["session"], record["attempt_id"],
                                   record["dispatch_token"], origin=origin or hub_name(),
                                   contract=contract, sealed=sealed, issued_at=issued_at)
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


def publish_dispatch(client: MqttClient, signed: dict[str, Any]) -> None:
    """Publish the signed dispatch retained, QoS 1, and wait for the PUBACK (§2, §5).

    Raises:
        PublishTimeout, BrokerError.
    """
    client.publish(names.dispatch_topic(signed["job_id"], client.config.topic_root),
                   encode_dispatch(signed), retain=True)


# ------------------------------------------------------------------ the command

BRIEF_FILE_NAME = "brief.txt"


def read_brief(brief: str | None, brief_file: str | None, stdin: BinaryIO | None = None) -> str:
    """The brief from exactly one of `--brief TEXT` / `--brief-file PATH|-` (§5).

    The file (or stdin for "-") is read as bytes, at most 512 KiB + 1, and
    decoded as strict UTF-8.

    Returns:
        the checked brief (`check_brief`).
    Raises:
        UsageError: none or both sources; a file that is missing, unreadable,
            a directory, larger than 512 KiB, not UTF-8, empty, or holding a NUL.
    """
    if (brief is None) == (brief_file is None):
        raise UsageError("give exactly one of --brief TEXT, --brief-file PATH or --brief-file -")
    if brief is not None:
        return check_brief(brief)
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
        raise UsageError(f"--brief-file {where}: cannot read ({reason})") from None
    if len(raw) > MAX_BRIEF_BYTES:
        raise UsageError(f"--brief-file {where}: larger than the {MAX_BRIEF_BYTES}-byte limit of a brief (§5)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--brief-file {where}: not UTF-8 text (bad byte at offset {exc.start})") from None
    return check_brief(text)


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
                 timeout_s: int | None = None) -> wire.Contract:
    """The job's contract (§5): defaults, then MAM_HEARTBEAT_SEC, MAM_HEARTBEAT_MISSES,
    MAM_ACK_TIMEOUT_S (environment, then .mam.env, §13), then the CLI options.

    Raises:
        UsageError: an option that is not a positive integer (or absurdly large).
        ConfigError: a bad environment value. EnvFileError: an unreadable env file.
    """
    for name, value in (("--heartbeat", heartbeat_s), ("--heartbeat-misses", heartbeat_misses),
                        ("--ack-timeout", ack_timeout_s), ("--idle-timeout", idle_timeout_s),
                        ("--timeout", timeout_s)):
        if value is not None and value < 1:
            raise UsageError(f"{name} {value} is invalid: expected a positive integer")
    contract: wire.Contract = config.contract_from_env(
        config.load_env(workspace=workspace), heartbeat_sec=heartbeat_s, heartbeat_misses=heartbeat_misses,
        ack_timeout_sec=ack_timeout_s, idle_timeout_sec=idle_timeout_s, timeout_sec=timeout_s)
    return contract


def print_started(record: JobRecord, as_json: bool, verb: str) -> None:
    """The --detach answer on stdout: the job id (JSON unless a human reads a TTY)."""
    if as_json or not sys.stdout.isatty():
        print(json.dumps({"job_id": record["job_id"], "session": record["session"],
                          "attempt_id": record["attempt_id"], "status": record["status"], "action": verb}),
              flush=True)
    else:
        print(record["job_id"], flush=True)


def send_dispatch(registry: Registry, record: JobRecord, keys: DispatchKeys, client: MqttClient) -> JobRecord:
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


def publish_queued(registry: Registry, job_id: str, session: str, keys: DispatchKeys,
                   client: MqttClient) -> JobRecord:
    """Publish a `queued` job to the runner the queue chose (§14): `queued` → `pending`
    for `session` (source `hub_queue`; the ack and wall clocks start now), then the
    sealed, signed, retained dispatch (§5) with the stored brief.

    Returns:
        the `pending` record.
    Raises:
        Refusal(`not_allowed`): the job is no longer queued (nothing published).
        BrokerError (the record is then closed `agent_blocked`), RegistryError.
    """
    return send_dispatch(registry, mark_published(registry, job_id, session), keys, client)


def parse_retry_on(text: str | None) -> tuple[str, ...]:
    """`--retry-on a,b` as a tuple (checked by `QueueTerms.checked`); None: the §14 default."""
    if text is None:
        return tuple(DEFAULT_RETRY_ON)
    return tuple(item.strip() for item in text.split(","))


def queue_terms(session: str | None, labels: str | None, *, priority: int, queue_timeout_s: int | None,
                retries: int, retry_on: str | None) -> QueueTerms:
    """The job's §14 terms from the dispatch options (`--session remote:NAME` accepted).

    Raises:
        UsageError: both or neither of --session/--labels, or a bad value (one line).
    """
    if session is not None and labels is not None:
        raise UsageError("give either --session NAME or --labels a,b, not both (§14)")
    if session is None and labels is None:
        raise UsageError("give --session NAME (one runner) or --labels a,b (any runner with them)")
    bare = names.validate_session(names.strip_remote(session)) if session is not None else None
    terms = QueueTerms(target_session=bare, target_labels=names.parse_labels(labels) if labels is not None else (),
                       priority=priority, retries=retries, retry_on=parse_retry_on(retry_on), owner_pid=os.getpid())
    if queue_timeout_s is not None:
        terms = terms._replace(queue_timeout_sec=queue_timeout_s)
    return terms.checked()


def _leave_queue(registry: Registry, record: JobRecord, client: MqttClient, feed: PresenceFeed,
                 watcher: Watcher) -> tuple[JobRecord, bool]:
    """Wait for the job to leave the queue (§14); (record, True) when this process placed it.
    A session that never announced a presence keeps v1: the dispatch is published now and
    waits retained for its runner (the ack clock runs)."""
    job_id, session = record["job_id"], record.get("target", {}).get("session")
    if isinstance(session, str) and not feed.read_one(client, session, watcher.handle):
        log.info("session %s has announced no presence: dispatching now (v1)", session)
        return mark_published(registry, job_id, session), True
    placement = wait_queued(registry, job_id, client, feed, watcher.handle)
    return placement.record, placement.placed


def follow_queued(registry: Registry, record: JobRecord, keys: DispatchKeys, client: MqttClient, *,
                  detach: bool, as_json: bool, workspace: Workspace = None, verb: str = "dispatched",
                  show_log: bool = True) -> int:
    """Without a service (§14): wait for the queued job to be placed, publish it, watch
    it (§10), and retry a failed attempt while `retries` allow (§14 Retries).

    Args:
        record: the queued attempt (from `Registry.register` or `queuewait.requeue`).
        verb: "dispatched" or "redispatched", for the messages.
        show_log: show the agent's output under the events in the human view (§15; `--no-log`).
    Returns:
        the exit code of §9 of the last attempt (2 for `queue_timeout`; 0 with --detach
        once published; 130 when detached with Ctrl-C).
    Raises:
        BrokerError (exit 3), RegistryError, UsageError.
    """
    job_id = record["job_id"]
    feed = PresenceFeed(keys, client.config.topic_root, registry.root)
    feed.subscribe(client)
    while True:
        watcher = Watcher(registry, job_id, client=client, keys=keys, show_log=show_log,
                          options=WatchOptions(remote=True, ack_only_before_first=True))
        watcher.human = watcher.human and not as_json
        watcher.on_other = feed.handle  # presence while it runs (§14 runner_lost)
        if not watcher.subscribe():
            raise BrokerUnavailable(f"job {job_id}: cannot subscribe to its events and state")
        try:
            placed, mine = _leave_queue(registry, record, client, feed, watcher)
        except KeyboardInterrupt:
            print(queued_hint(job_id, workspace), file=sys.stderr)
            return ExitCode.DETACHED
        if placed["status"] in TERMINAL_STATUSES:
            print(f"job {job_id} left the queue {placed['status']} ({placed.get('close_reason')}); "
                  f"target {describe_target(placed)}", file=sys.stderr)
            if placed.get("close_reason") == CloseReason.QUEUE_TIMEOUT:
                return ExitCode.TIMEOUT
            return watcher.run()
        if mine:
            send_dispatch(registry, placed, keys, client)
        session, runner_id = placed["session"], feed.runner_id(placed["session"])
        watcher.runner_lost = lambda: feed.lost(session, runner_id)
        watcher.on_other = lambda topic, raw: _presence_while_running(feed, topic, raw, session, job_id)
        print(f"{verb} job {job_id} to {session} (attempt {placed['attempt_id']})", file=sys.stderr, flush=True)
        if detach:
            print_started(registry.get(job_id), as_json, verb)
            return 0
        try:
            code = watcher.run()
        except Detached:
            print(detach_hint(job_id, workspace), file=sys.stderr)
            return ExitCode.DETACHED
        ended = registry.get(job_id)
        reason = retry_reason(ended)
        retry = retry_attempt(registry, job_id, reason, client, keys) if reason is not None else None
        if retry is None:
            hint = reattach_hint(registry, job_id, workspace) if code == ExitCode.BROKER else None
            if hint is not None:
                print(hint, file=sys.stderr)
            if watcher.human:
                print_summary(registry, job_id, watcher.out)
            return code
        print(f"job {job_id}: attempt {ended['attempt_id']} ended {reason} on {session}; retry "
              f"{retry.get('retried')} of {retry.get('retries')}: attempt {retry['attempt_id']} queued",
              file=sys.stderr, flush=True)
        record = retry


def _presence_while_running(feed: PresenceFeed, topic: str, raw: bytes, session: str, job_id: str) -> None:
    """A presence while the attempt is out: the fleet (§14 runner_lost), and a refusal of
    this job's dispatch the runner tells in its presence, said once (issue 11 item 6)."""
    feed.handle(topic, raw)
    line = feed.refusal(session, job_id)
    if line is not None:
        print(f"WARNING: {line}", file=sys.stderr, flush=True)


def _labels_online(client: MqttClient, keys: DispatchKeys, labels: tuple[str, ...]) -> bool:
    """Some runner with a signed `online` presence carries every one of `labels` (§7, §14)."""
    rows, refused = collect_presence(client, keys)
    for line in refused:
        print(line, file=sys.stderr)
    return any(row["status"] == PresenceStatus.ONLINE and set(labels) <= set(row["labels"]) for row in rows)


def dispatch_cli(*, session: str | None, brief: str | None, brief_file: str | None, heartbeat_s: int | None,
                 heartbeat_misses: int | None, ack_timeout_s: int | None, idle_timeout_s: int | None,
                 timeout_s: int | None, require_online: bool, detach: bool, as_json: bool,
                 workspace: Workspace, stdin: BinaryIO | None = None, labels: str | None = None,
                 priority: int = 0, queue_timeout_s: int | None = None, retries: int = 0,
                 retry_on: str | None = None, show_log: bool = True) -> int:
    """`mam-orch dispatch` (§5, §9, §10, §14).

    Order: validate everything (the target: `--session NAME` (or `remote:NAME`) or
    `--labels a,b`; one brief source, the brief, the contract, the §14 terms,
    MAM_DISPATCH_SECRET, the broker settings) with nothing written; connect
    (unreachable: exit 3, nothing registered); with `require_online` read the
    session's retained presence (with labels: every runner's) and exit 5 unless it
    is a signed `online` presence (carrying the labels);
    register the job `queued` and store its brief; then `follow_queued`.

    Returns:
        the exit code of §9: 0 completed, 1 error/agent_blocked, 2 timeout or
        queue_timeout, 3 broker, 4 cancelled, 5 no online runner, 130 detached.
    Raises:
        UsageError / ConfigError (exit 64), EnvFileError (exit 1), BrokerError (exit 3).
    """
    terms = queue_terms(session, labels, priority=priority, queue_timeout_s=queue_timeout_s, retries=retries,
                        retry_on=retry_on)
    text = read_brief(brief, brief_file, stdin)
    hub = open_hub(workspace)
    registry = hub.registry
    contract = hub_contract(registry.root, heartbeat_s=heartbeat_s, heartbeat_misses=heartbeat_misses,
                            ack_timeout_s=ack_timeout_s, idle_timeout_s=idle_timeout_s, timeout_s=timeout_s)
    keys = hub.keys()
    client = hub.connect()
    try:
        target = terms.target_session
        if require_online and target is not None:
            presence = read_presence(client, keys, target)
            if presence is None or presence["status"] != PresenceStatus.ONLINE:
                state = "has no signed presence" if presence is None else f"is {presence['status']}"
                print(f"ERROR: session {target} {state}; nothing dispatched (start `mam-runner run "
                      f"--session {target}` there, or drop --require-online)", file=sys.stderr)
                return ExitCode.NO_RUNNER
        elif require_online and not _labels_online(client, keys, terms.target_labels):
            print(f"ERROR: no runner with labels={','.join(terms.target_labels)} is online; nothing dispatched "
                  f"(start `mam-runner run --labels ...` there, or drop --require-online)", file=sys.stderr)
            return ExitCode.NO_RUNNER
        record = registry.register(session=target, contract=contract, queue=terms)
        try:
            save_brief(registry, record["job_id"], text)
        except BaseException:
            close_remote(registry, None, None, record["job_id"], CloseReason.CANCELLED)
            raise
        try:
            return follow_queued(registry, record, keys, client, detach=detach, as_json=as_json,
                                 workspace=workspace, show_log=show_log)
        except Exception:
            if registry.get(record["job_id"])["status"] == JobStatus.QUEUED:  # nobody would publish it
                close_remote(registry, None, None, record["job_id"], CloseReason.AGENT_BLOCKED)
            raise
    finally:
        client.close()
