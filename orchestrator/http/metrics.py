"""`GET /metrics` of `mam-orch serve --http`: the hub in Prometheus text format
(prometheus-client), every name `mam_`-prefixed, counters `_total`, times `_seconds`.

Counted from the registry at each scrape (so they survive a restart of the
service and equal what the records say happened): jobs by status, jobs
finished by outcome and close reason, retries. From the running service:
queue depth, the oldest queued job's age and the queued jobs no runner
serves, each concurrency group's jobs out and queued, each schedule's next and last fire
time, runners by status, each runner's status, slots and jobs held, the
oldest permission request's age (deploy/prometheus/alerts.yml), messages
accepted by kind and refused by §3.2 reason, events accepted by name
(heartbeats included). From the hub's copies of the agent output (§15): bytes
received. Job durations are a histogram fed by the live feed.
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mam.orchestrator import asks, schedules
from mam.orchestrator import queue as hubqueue
from mam.orchestrator.http.views import Row, iso_epoch, runner_rows
from mam.orchestrator.service import HubService
from mam.shared.protocol import names
from mam.shared.protocol.codes import TERMINAL_STATUSES, UNPUBLISHED_STATUSES, JobStatus, PresenceStatus
from mam.shared.store.fsio import read_json_object
from mam.shared.store.records import RECORD_NAME_RE, JobRecord, target_of

NO_REASON = "none"  # the close_reason label of a job its runner ended (no hub close)
RUNNER_STATUSES = (PresenceStatus.ONLINE, PresenceStatus.DRAINING, PresenceStatus.OFFLINE, "lost", "unverified",
                   "revoked")
DURATION_BUCKETS_S = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)
WAIT_BUCKETS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0, 6 * 3600.0)
AGENT_LOG_PREFIX = "agent."  # the hub's copies: agent.<attempt>.log and its state agent.<attempt>.log.json (§15)
LOG_SUFFIX, LOG_STATE_SUFFIX = ".log", ".log.json"
LOG_STATE_MAX_BYTES = 4096


class HubCollector(Collector):
    """The scrape-time metrics of one hub service (see the module docstring)."""

    def __init__(self, service: HubService, events: Counter[str]) -> None:
        self.service = service
        self.events = events  # accepted events by name, counted by the live feed

    def collect(self) -> Iterator[Metric]:
        records, _ = self.service.registry.list()
        records = [record for record in records if record.get("role") == "hub"]
        by_status = Counter(record["status"] for record in records)
        jobs = GaugeMetricFamily("mam_jobs", "Hub jobs by status", labels=["status"])
        for status in JobStatus:
            jobs.add_metric([str(status)], by_status.get(status, 0))
        yield jobs
        finished = CounterMetricFamily("mam_jobs_finished", "Jobs that ended, by outcome and close reason",
                                       labels=["outcome", "close_reason"])
        ends = Counter((record["status"], record.get("close_reason") or NO_REASON) for record in records
                       if record["status"] in (JobStatus.COMPLETED, JobStatus.ERROR, JobStatus.CANCELLED))
        for (outcome, reason), count in sorted(ends.items()):
            finished.add_metric([outcome, reason], count)
        yield finished
        yield CounterMetricFamily("mam_retries", "Retries made (§14)",
                                  value=sum(int(record.get("retried", 0)) for record in records))
        yield from agent_spend(records)
        pending = GaugeMetricFamily("mam_permission_pending", "Agents' permission requests waiting for a person "
                                    "(§19), by runner", labels=["session"])
        open_jobs = [record for record in records
                     if record["status"] not in TERMINAL_STATUSES and record["status"] not in UNPUBLISHED_STATUSES]
        waiting = [(record.get("session") or "-", ask) for record in open_jobs
                   for ask in asks.pending(self.service.registry, record["job_id"])]
        for session, count in sorted(Counter(session for session, _ in waiting).items()):
            pending.add_metric([session], count)
        yield pending
        asked = [epoch for _, ask in waiting if (epoch := iso_epoch(ask.asked_at)) is not None]
        yield GaugeMetricFamily("mam_permission_oldest_age_seconds", "Age of the oldest permission request "
                                "waiting for a person (§19; 0: none)",
                                value=max(0.0, time.time() - min(asked)) if asked else 0.0)
        held = GaugeMetricFamily("mam_runner_jobs", "Hub jobs pending or running on each runner (§10)",
                                 labels=["session"])
        for session, count in sorted(Counter(record.get("session") or "-" for record in open_jobs).items()):
            held.add_metric([session], count)
        yield held
        yield from self._queue()
        yield from self._schedules()
        yield from self._runners()
        yield from self._messages()
        received, dropped = agent_log_bytes(self.service.registry.root)
        yield CounterMetricFamily("mam_log_received_bytes", "Agent output bytes in the hub's copies (§15)",
                                  value=received)
        yield CounterMetricFamily("mam_log_dropped_bytes", "Agent output bytes runners dropped at the rate cap (§15)",
                                  value=dropped)

    def _queue(self) -> Iterator[Metric]:
        queued = list(self.service.queued.values())
        yield GaugeMetricFamily("mam_queue_depth", "Jobs waiting in the hub queue", value=len(queued))
        oldest = min((job.queued_at for job in queued), default=None)
        yield GaugeMetricFamily("mam_queue_oldest_age_seconds", "Age of the oldest queued job (0: none)",
                                value=max(0.0, time.time() - oldest) if oldest is not None else 0.0)
        yield GaugeMetricFamily("mam_queue_unserved", "Queued jobs for labels or a repository no runner has "
                                "announced (§14, §18)",
                                value=sum(hubqueue.unserved(job, self.service.fleet) for job in queued))
        out = self.service.groups_out()
        waiting = Counter(job.group for job in queued if job.group is not None)
        groups = GaugeMetricFamily("mam_group_jobs", "Each concurrency group's jobs out (published or running) "
                                   "and queued (§14 Groups)", labels=["group", "state"])
        for group in sorted(set(out) | set(waiting)):
            groups.add_metric([group, "out"], len(out.get(group, ())))
            groups.add_metric([group, "queued"], waiting.get(group, 0))
        yield groups

    def _schedules(self) -> Iterator[Metric]:
        """§14 Schedules: each one's next and last fire time, and whether it is paused."""
        rows = schedules.describe_all(self.service.registry.root)
        upcoming = GaugeMetricFamily("mam_schedule_next_fire_timestamp_seconds", "When each schedule fires next, "
                                     "Unix seconds (0: paused)", labels=["schedule"])
        fired = GaugeMetricFamily("mam_schedule_last_fire_timestamp_seconds", "When each schedule last fired a job, "
                                  "Unix seconds (0: never)", labels=["schedule"])
        paused = GaugeMetricFamily("mam_schedule_paused", "1 for a paused schedule", labels=["schedule"])
        for row in rows:
            upcoming.add_metric([row["name"]], iso_epoch(row["next_fire"]) or 0.0)
            fired.add_metric([row["name"]], iso_epoch(row["last_fired_at"]) or 0.0)
            paused.add_metric([row["name"]], 1.0 if row["paused"] else 0.0)
        yield from (upcoming, fired, paused)

    def _runners(self) -> Iterator[Metric]:
        rows = runner_rows(self.service)
        counts = Counter(row["status"] for row in rows)
        runners = GaugeMetricFamily("mam_runners", "Runners by presence status", labels=["status"])
        for status in RUNNER_STATUSES:
            runners.add_metric([str(status)], counts.get(status, 0))
        yield runners
        current = GaugeMetricFamily("mam_runner_status", "1 for each runner's current status (online, draining, "
                                    "offline, lost, unverified, revoked)", labels=["session", "status"])
        for row in rows:
            current.add_metric([row["session"], str(row["status"])], 1)
        yield current
        slots = GaugeMetricFamily("mam_runner_slots", "Slots per runner", labels=["session", "state"])
        for row in rows:
            slots.add_metric([row["session"], "used"], row["slots_used"])
            slots.add_metric([row["session"], "free"], row["slots_free"])
        yield slots

    def _messages(self) -> Iterator[Metric]:
        stats = self.service.stats
        accepted = CounterMetricFamily("mam_messages_accepted", "Job messages accepted (§3.2), by kind",
                                       labels=["kind"])
        for kind, count in sorted(dict(stats.accepted).items()):
            accepted.add_metric([kind], count)
        yield accepted
        refused = CounterMetricFamily("mam_messages_refused", "Job messages refused (§3.2), by reason",
                                      labels=["reason"])
        for reason, count in sorted(dict(stats.refused).items()):
            refused.add_metric([reason], count)
        yield refused
        events = CounterMetricFamily("mam_events_accepted", "Accepted events by name (heartbeat, ...)",
                                     labels=["event"])
        for event, count in sorted(dict(self.events).items()):
            events.add_metric([event], count)
        yield events
        yield CounterMetricFamily("mam_heartbeats_accepted", "Accepted heartbeat events",
                                  value=self.events.get("heartbeat", 0))


def agent_spend(records: list[JobRecord]) -> Iterator[Metric]:
    """What the agents spent (§18), from the terminal events' figures kept in the records:
    cost in USD and tokens by runner and the job's labels (`-` for a session target)."""
    cost = CounterMetricFamily("mam_agent_cost_usd", "Agents' reported cost in US dollars (§18)",
                               labels=["session", "labels"])
    tokens = CounterMetricFamily("mam_agent_tokens", "Agents' tokens (§18), by kind",
                                 labels=["session", "labels", "kind"])
    spent: dict[tuple[str, str], float] = defaultdict(float)
    used: Counter[tuple[str, str, str]] = Counter()
    for record in records:
        figures = record.get("agent")
        if not isinstance(figures, dict):
            continue
        _, labels = target_of(record)
        key = (record.get("session") or "-", ",".join(labels) or "-")
        spent[key] += figures.get("cost_usd") or 0.0
        for kind, count in (figures.get("tokens") or {}).items():
            used[(*key, kind)] += count
    for key, value in sorted(spent.items()):
        cost.add_metric(list(key), value)
    for token_key, count in sorted(used.items()):
        tokens.add_metric(list(token_key), count)
    yield cost
    yield tokens


def agent_log_bytes(root: Path) -> tuple[int, int]:
    """Bytes in every hub copy of agent output (`.mam/logs/*/agent.*.log`, §15), and the bytes
    the runners said they dropped (`dropped` of each copy's `agent.*.log.json` state)."""
    received = dropped = 0
    try:
        folders = [entry for entry in os.scandir(names.logs_dir(root)) if RECORD_NAME_RE.match(entry.name + ".json")]
    except OSError:
        return 0, 0
    for folder in folders:
        try:
            entries = [entry for entry in os.scandir(folder.path) if entry.name.startswith(AGENT_LOG_PREFIX)]
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.name.endswith(LOG_SUFFIX):
                    received += entry.stat().st_size
                elif entry.name.endswith(LOG_STATE_SUFFIX):
                    value = read_json_object(entry.path, LOG_STATE_MAX_BYTES).get("dropped", 0)
                    dropped += value if isinstance(value, int) and not isinstance(value, bool) else 0
            except (OSError, ValueError):
                continue
    return received, dropped


class HubMetrics:
    """The metrics registry of one `serve --http`: the collector plus the job duration histogram."""

    def __init__(self, service: HubService) -> None:
        self.registry = CollectorRegistry()
        self.events: Counter[str] = Counter()
        self.registry.register(HubCollector(service, self.events))
        self.duration = Histogram("mam_job_duration_seconds", "Job duration, creation to end",
                                  labelnames=["outcome"], buckets=DURATION_BUCKETS_S, registry=self.registry)
        self.queue_wait = Histogram("mam_queue_wait_seconds", "Queued to dispatch published (1 s resolution)",
                                    buckets=WAIT_BUCKETS_S, registry=self.registry)
        self.start_latency = Histogram("mam_dispatch_started_seconds",
                                       "Dispatch published to the runner's started (1 s resolution, two clocks)",
                                       buckets=WAIT_BUCKETS_S, registry=self.registry)

    def finished(self, row: Row) -> None:
        """A job went terminal while the service watched (the live feed's `on_finish`)."""
        if row.get("duration_s") is not None:
            self.duration.labels(outcome=row["status"]).observe(float(row["duration_s"]))

    def event(self, line: Row, record: JobRecord) -> None:
        """An accepted event line of the audit log (the live feed)."""
        self.events[str(line.get("event"))] += 1
        published, started = iso_epoch(record.get("attempt_created_at")), iso_epoch(line.get("timestamp"))
        if line.get("event") == "started" and published is not None and started is not None:
            self.start_latency.observe(max(0.0, started - published))

    def unqueued(self, record: JobRecord) -> None:
        """An attempt left the queue (the live feed): observe how long it waited."""
        queued, published = iso_epoch(record.get("queued_at")), iso_epoch(record.get("attempt_created_at"))
        if queued is not None and published is not None:
            self.queue_wait.observe(max(0.0, published - queued))

