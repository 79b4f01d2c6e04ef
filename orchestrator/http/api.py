"""The writing side of the HTTP API (`POST /api/jobs`, `POST /api/jobs/{id}/cancel`,
`POST /api/jobs/{id}/retry`, `POST /api/schedules/{name}/run`) as plain functions of a running
`HubService`, so they are tested without HTTP.

A dispatch checks what `mam-orch dispatch` checks (brief, target, §14 terms,
the contract, MAM_DISPATCH_SECRET) and queues the job through
`enqueue.register_queued`, the path a dispatch over the service takes; the
service publishes it. A cancel is `mam-orch cancel` on the service's own
broker connection (§6): a queued job is cancelled on the hub only, a
published one closed `cancelled` and its runner told. A retry is `mam-orch
redispatch --detach`: attempt + 1 queued, the old attempt cancelled again first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from mam.orchestrator import schedules
from mam.orchestrator.control import cancel_open, publish_cancel
from mam.orchestrator.dispatch import check_brief, hub_contract, parse_retry_on, work_terms
from mam.orchestrator.enqueue import register_queued
from mam.orchestrator.identity.drain import order_drain
from mam.orchestrator.queuewait import refuse_redispatch, requeue
from mam.orchestrator.service import HubService
from mam.shared.protocol import names, wire
from mam.shared.protocol.codes import JobStatus
from mam.shared.protocol.errors import BrokerError, UsageError
from mam.shared.store.records import AFTER_IF_CHOICES, QueueTerms, describe_target

log = logging.getLogger("mam.http")

CANCEL_REASON = "operator (HTTP API)"
INT_FIELDS = ("priority", "retries", "queue_timeout_sec", "heartbeat_sec", "heartbeat_misses", "ack_timeout_sec",
              "idle_timeout_sec", "timeout_sec", "group_limit")
WORK_FIELDS = ("repo", "ref", "permission_mode", "on_ask_timeout")
POLICY_FIELDS = ("max_turns", "max_cost_usd", "allow_tools", "deny_tools", "ask_timeout_s")
LIMIT_FIELDS = ("memory", "cpus", "pids", "gpus")
DISPATCH_FIELDS = frozenset({"brief", "labels", "session", "retry_on", "fresh", "on_limit", "title", "group",
                             "cancel_in_progress", "after", "if", "from_result", *WORK_FIELDS, *POLICY_FIELDS,
                             *LIMIT_FIELDS, *INT_FIELDS})


def _int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"field {name!r} is invalid: expected an integer, got {type(value).__name__}")
    return value


def dispatch_request(service: HubService, body: object) -> dict[str, Any]:
    """`POST /api/jobs`: queue a job from a JSON object (see README "HTTP API").

    Returns:
        {"job_id", "status", "attempt_id", "target"}.
    Raises:
        UsageError: a bad body, brief, target or term (one line); ConfigError: no usable MAM_DISPATCH_SECRET.
    """
    if not isinstance(body, dict):
        raise UsageError("the body is invalid: expected a JSON object")
    unknown = sorted(set(body) - DISPATCH_FIELDS)
    if unknown:
        raise UsageError(f"unknown field {unknown[0]!r}; expected some of {', '.join(sorted(DISPATCH_FIELDS))}")
    brief, session, labels, retry_on = body.get("brief"), body.get("session"), body.get("labels"), body.get("retry_on")
    if not isinstance(brief, str):
        raise UsageError("field 'brief' is required: the job's brief as a string")
    check_brief(brief)
    if (session is None) == (labels is None):
        raise UsageError("give either 'session' (one runner) or 'labels' (any runner with them), not both")
    if session is not None and not isinstance(session, str):
        raise UsageError("field 'session' is invalid: expected a string")
    if labels is not None and not (isinstance(labels, list) and all(isinstance(x, str) for x in labels)):
        raise UsageError("field 'labels' is invalid: expected a list of strings")
    if retry_on is not None and not (isinstance(retry_on, list) and all(isinstance(x, str) for x in retry_on)):
        raise UsageError("field 'retry_on' is invalid: expected a list of strings")
    fresh, on_limit = body.get("fresh", False), body.get("on_limit", "pause")
    if not isinstance(fresh, bool):
        raise UsageError("field 'fresh' is invalid: expected true or false")
    if not isinstance(on_limit, str):
        raise UsageError("field 'on_limit' is invalid: expected \"pause\", \"fail\" or \"move\"")
    group, cancel_in_progress = body.get("group"), body.get("cancel_in_progress", False)
    if group is not None and not isinstance(group, str):
        raise UsageError("field 'group' is invalid: expected a string")
    if not isinstance(cancel_in_progress, bool):
        raise UsageError("field 'cancel_in_progress' is invalid: expected true or false")
    after, after_if = body.get("after", []), body.get("if", AFTER_IF_CHOICES[0])
    if not (isinstance(after, list) and all(isinstance(x, str) for x in after)):
        raise UsageError("field 'after' is invalid: expected a list of job ids")
    if not isinstance(after_if, str):
        raise UsageError(f"field 'if' is invalid: expected one of {', '.join(AFTER_IF_CHOICES)}")
    from_result = body.get("from_result")
    if from_result is not None and not isinstance(from_result, str):
        raise UsageError("field 'from_result' is invalid: expected a job id")
    ints = {name: _int(body, name) for name in INT_FIELDS}
    target = names.validate_session(names.strip_remote(session)) if session is not None else None
    terms = QueueTerms(target_session=target,
                       target_labels=names.validate_labels(labels) if labels is not None else (),
                       priority=ints["priority"] or 0, retries=ints["retries"] or 0,
                       retry_on=parse_retry_on(",".join(retry_on) if retry_on is not None else None),
                       fresh=fresh, on_limit=on_limit, group=group, cancel_in_progress=cancel_in_progress,
                       after=tuple(after), after_if=after_if, from_result=from_result)
    if ints["queue_timeout_sec"] is not None:
        terms = terms._replace(queue_timeout_sec=ints["queue_timeout_sec"])
    if ints["group_limit"] is not None:
        terms = terms._replace(group_limit=ints["group_limit"])
    terms = terms.checked()
    contract = hub_contract(service.registry.root, heartbeat_s=ints["heartbeat_sec"],
                            heartbeat_misses=ints["heartbeat_misses"], ack_timeout_s=ints["ack_timeout_sec"],
                            idle_timeout_s=ints["idle_timeout_sec"], timeout_s=ints["timeout_sec"])
    title = body.get("title")
    if title is not None and not isinstance(title, str):
        raise UsageError("field 'title' is invalid: expected a string")
    record = register_queued(service.registry, brief=brief, contract=contract, terms=terms, work=_work(body),
                             title=title)
    return {"job_id": record["job_id"], "status": record["status"], "attempt_id": record["attempt_id"],
            "target": describe_target(record)}


def _work(body: Mapping[str, Any]) -> wire.Work | None:
    """The §18 fields of a `POST /api/jobs` body: repo, ref, the agent's budgets
    (`max_turns`, `max_cost_usd`), `allow_tools` (a list of rules), `permission_mode`; and
    the §6 limits `memory` ("8G" or bytes), `cpus`, `pids`. Raises UsageError (one line)."""
    for name in WORK_FIELDS:
        if body.get(name) is not None and not isinstance(body[name], str):
            raise UsageError(f"field {name!r} is invalid: expected a string")
    timeout = body.get("ask_timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int)):
        raise UsageError("field 'ask_timeout_s' is invalid: expected whole seconds")
    memory = body.get("memory")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (str, int))):
        raise UsageError("field 'memory' is invalid: expected a size such as \"8G\" or bytes")
    for name in ("allow_tools", "deny_tools"):
        tools = body.get(name)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(x, str) for x in tools)):
            raise UsageError(f"field {name!r} is invalid: expected a list of strings")
    return work_terms(repo=body.get("repo"), ref=body.get("ref"), max_turns=body.get("max_turns"),
                      max_cost_usd=body.get("max_cost_usd"), allow_tools=body.get("allow_tools"),
                      deny_tools=body.get("deny_tools"),
                      permission_mode=body.get("permission_mode"), ask_timeout_s=timeout,
                      on_ask_timeout=body.get("on_ask_timeout"), memory=memory, cpus=body.get("cpus"),
                      pids=body.get("pids"), gpus=body.get("gpus"), cli=False)


def cancel_request(service: HubService, job_id: str) -> dict[str, Any]:
    """`POST /api/jobs/{id}/cancel`: `mam-orch cancel` on the service's connection (§6, §14).

    Returns:
        {"job_id", "status", "attempt_id", "changed"}; a job that already ended is left alone.
    Raises:
        UsageError: not a job id. JobNotFound. BrokerError: the record changed, the runner was not told.
    """
    names.validate_job_id(job_id)
    record, changed = cancel_open(service.registry, service.client, service.keys, job_id, CANCEL_REASON)
    return {"job_id": job_id, "status": record["status"], "attempt_id": record["attempt_id"], "changed": changed}


def retry_request(service: HubService, job_id: str, body: object) -> dict[str, Any]:
    """`POST /api/jobs/{id}/retry` (body `{}` or `{"fresh": true}`): `mam-orch redispatch
    --detach` on the service's connection (§8, §14): the old attempt is cancelled again (its
    runner may have missed the close), then attempt + 1 is queued with the stored brief and
    continues the agent's session unless `fresh`; the service publishes it.

    Returns:
        {"job_id", "status", "attempt_id", "target"}.
    Raises:
        UsageError: not a job id, a bad body. JobNotFound. Refusal: completed, or open without a
        cancel (nothing changed). BrokerError: no connection or no PUBACK for the cancel (nothing changed).
    """
    names.validate_job_id(job_id)
    if not isinstance(body, dict) or set(body) - {"fresh"}:
        raise UsageError("the body is an object with 'fresh' (true: start a new agent session) only")
    fresh = body.get("fresh", False)
    if not isinstance(fresh, bool):
        raise UsageError("field 'fresh' is invalid: expected true or false")
    record = service.registry.get(job_id)
    refuse_redispatch(record)
    if record["status"] != JobStatus.QUEUED:  # a queued attempt was never published
        if service.client is None:
            raise BrokerError("the hub service has no broker connection now; try again")
        publish_cancel(service.client, record, service.keys, "redispatch")
    record = requeue(service.registry, job_id, reason="operator redispatch (HTTP API)", fresh=fresh)
    return {"job_id": job_id, "status": record["status"], "attempt_id": record["attempt_id"],
            "target": describe_target(record)}


def drain_request(service: HubService, session: str, body: object, *, draining: bool) -> dict[str, Any]:
    """`POST /api/runners/{session}/drain` and `/undrain` (body `{}` or `{"reason": TEXT}`):
    `mam-orch runner drain|undrain` on the service's connection (§7 "Drain from the hub").

    Returns:
        {"session", "draining", "line"}.
    Raises:
        UsageError: a bad session, body or reason; a revoked runner. BrokerError: no connection.
    """
    if not isinstance(body, dict) or set(body) - {"reason"}:
        raise UsageError("the body is an object with 'reason' (text) only")
    reason = body.get("reason", "")
    if not isinstance(reason, str):
        raise UsageError("field 'reason' is invalid: expected text")
    if service.client is None:
        raise BrokerError("the hub service has no broker connection now; try again")
    line = order_drain(service.hub, session, draining=draining, reason=reason, client=service.client)
    return {"session": session, "draining": draining, "line": line}


def trigger_request(service: HubService, name: str, *, by: str, client: str) -> dict[str, Any] | None:
    """`POST /api/schedules/{name}/run`: fire one job of the schedule now, as `schedule run-now`
    does (its overlap rule applies), on the service's connection; the job's `schedule.trigger`
    says `{"by", "from"}` and the service's log says so too (§14 Schedules).

    Returns:
        {"schedule", "job_id"}, or None when its overlap rule skipped the run (`last_skipped`).
    Raises:
        UsageError: a bad name. JobNotFound: no such schedule. RegistryError.
    """
    store = schedules.Store(service.registry.root)
    fired = schedules.fire(service.registry, store, store.load(name), datetime.now(UTC), register_queued,
                           service.cancel_for_schedule, forced=True, trigger={"by": by, "from": client})
    if not fired:
        log.warning("schedule %s: a trigger (%s from %s) fired nothing: %s", name, by, client,
                    store.load(name).last_skipped)
        return None
    log.info("schedule %s: job %s fired by a trigger (%s from %s)", name, fired[0], by, client)
    return {"schedule": name, "job_id": fired[0]}
