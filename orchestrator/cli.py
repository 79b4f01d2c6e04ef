"""`mam-orch`: the hub's command line. Each command parses, calls one
function, and lets `cli.run` map errors to the exit codes of PROTOCOL §9."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import Any

import typer

from mam.orchestrator import asks, schedules
from mam.orchestrator.broker import embedded as broker
from mam.orchestrator.broker import probe
from mam.orchestrator.cancel import cancel
from mam.orchestrator.dispatch import work_terms
from mam.orchestrator.enqueue import register_queued
from mam.orchestrator.follow import watch_cli
from mam.orchestrator.gc import RETENTION_DAYS, gc_cli, reclear, reclear_cli
from mam.orchestrator.hints import command
from mam.orchestrator.hub import open_hub
from mam.orchestrator.hublock import service_pid
from mam.orchestrator.identity.cli import runner_app
from mam.orchestrator.init import init_workspace
from mam.orchestrator.logs import logs_cli
from mam.orchestrator.redispatch import redispatch_cli, resume_cli, say_cli
from mam.orchestrator.results import apply_cli, result_cli
from mam.orchestrator.runners import OFFLINE_HIDDEN_DAYS, prune_cli, runners_cli
from mam.orchestrator.service import serve_cli
from mam.orchestrator.submit import dispatch_cli
from mam.shared import cli
from mam.shared.cli import render
from mam.shared.config import describe
from mam.shared.protocol import names
from mam.shared.protocol.errors import BrokerUnavailable, ExitCode, MamError, UsageError

# `--help` lists the commands in the order a new operator uses them, one example each
WORKFLOW = ("init", "config", "broker", "serve", "runner", "runners", "dispatch", "schedule", "watch", "logs", "result",
            "apply", "jobs", "show", "asks", "approve", "deny", "cancel", "say", "resume",
            "redispatch", "gc")
EXAMPLES = {
    "init": "mam-orch init --broker hub.example.net",
    "config": "mam-orch config --check",
    "broker": "mam-orch broker up --listen 0.0.0.0",
    "serve": "mam-orch serve --workspace ~/fleet",
    "runner": "mam-orch runner list",
    "runners": "mam-orch runners --all",
    "dispatch": "mam-orch dispatch --labels gpu --brief 'Fix the flaky test in tests/test_io.py'",
    "schedule": "mam-orch schedule list",
    "watch": "mam-orch watch 918b0612",
    "logs": "mam-orch logs 918b0612 --follow",
    "result": "mam-orch result 918b0612 --patch",
    "apply": "mam-orch apply 918b0612 --repo-path ~/src/demo",
    "jobs": "mam-orch jobs --status running",
    "show": "mam-orch show 918b0612",
    "asks": "mam-orch asks",
    "approve": "mam-orch approve 918b0612",
    "deny": "mam-orch deny 918b0612 --reason 'no pushes to main'",
    "cancel": "mam-orch cancel 918b0612",
    "say": "mam-orch say 918b0612 'Now add a test for it.'",
    "resume": "mam-orch resume 918b0612",
    "redispatch": "mam-orch redispatch 918b0612 --session gpu-box-2",
    "gc": "mam-orch gc --dry-run",
}
BROKER_EXAMPLES = {"up": "mam-orch broker up --listen 0.0.0.0", "down": "mam-orch broker down",
                   "status": "mam-orch broker status"}

app = cli.new_app(
    "mam-orch",
    "The hub of mam-fleet: dispatch jobs to runners over MQTT, watch them, "
    "cancel and redispatch them, run an embedded broker.",
    WORKFLOW, EXAMPLES,
)


@app.callback()
def _root(version: bool = cli.version_option("mam-orch")) -> None:
    """The hub of mam-fleet: dispatch jobs to runners over MQTT and watch them."""


@app.command("config")
def config_cmd(
    workspace: str = cli.workspace_option(),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (default on a pipe)."),
    check: bool = typer.Option(False, "--check", help="Also connect to the broker and say what answered "
                                                      "(reachable, auth ok, MQTT version, JetStream); exit 3 "
                                                      "when no broker host accepted the connection."),
) -> int:
    """Show the resolved broker settings and where they came from (PROTOCOL §13).

    Passwords and MAM_DISPATCH_SECRET are shown only as set or unset.
    """
    info = describe(workspace)
    if check:
        cli.setup_logging(False if as_json else None)
        found = probe.check(workspace)
        if cli.human_view(as_json):
            typer.echo("\n".join(probe.check_lines(found)))
        else:
            typer.echo(json.dumps({**info, "check": found}, sort_keys=True))
        return 0 if found["healthy"] else ExitCode.BROKER
    if as_json or not sys.stdout.isatty():
        typer.echo(json.dumps(info))
    else:
        settings = info["broker"]
        typer.echo(f"env file:        {info['env_file'] or '(none found)'}")
        typer.echo(f"registry root:   {info['registry_root']}")
        typer.echo(f"broker:          {','.join(settings['hosts'])}:{settings['port']} tls={settings['tls']}")
        typer.echo(f"username:        {settings['username'] or '(none)'}  password: "
                   f"{'set' if settings['password_set'] else 'unset'}")
        typer.echo(f"topic root:      {settings['topic_root']}")
        typer.echo(f"dispatch secret: {'set' if info['dispatch_secret_set'] else 'unset'}")
    return 0


@app.command("init")
def init_cmd(
    workspace: str = cli.workspace_option(),
    broker_config: str = typer.Option(None, "--broker-config", metavar="PATH",
                                      help="Also write a filled nats.conf here, plus nats.env "
                                           "(broker passwords, mode 0600) next to it."),
    broker: str = typer.Option("localhost", "--broker", metavar="HOST",
                               help="MQTT_BROKER for hub and runners (comma-separated fail-over list)."),
    port: int = typer.Option(None, "--port", metavar="P", help="MQTT port (default 1883, 8883 with --tls)."),
    tls: bool = typer.Option(False, "--tls", help="Clients use TLS; render the TLS variant of nats.conf."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files."),
    store_dir: str = typer.Option(None, "--store-dir", metavar="DIR",
                                  help="JetStream store of the broker (default /data, the container volume)."),
    cluster: bool = typer.Option(False, "--cluster", help="Three-node NATS cluster: --broker h1,h2,h3 and "
                                                          "--broker-config DIR (node-1..3.conf)."),
) -> int:
    """Write .mam.env with fresh credentials and MAM_DISPATCH_SECRET (mode 0600).

    Refuses to overwrite an existing file without --force (exit 64). Secrets
    are never printed: only the paths written and the next steps.
    """
    result = init_workspace(workspace, broker_config=broker_config, force=force,
                            broker_host=broker, port=port, tls=tls, store_dir=store_dir, cluster=cluster)
    for note in result.notes:
        typer.echo(note)
    return 0


cli.add_registry_commands(app)


broker_app = cli.new_app("broker", "Run the hub's embedded nats-server (MQTT, JetStream, websocket).",
                            ("up", "status", "down"), BROKER_EXAMPLES)
app.add_typer(broker_app, name="broker")
app.add_typer(runner_app, name="runner")  # §16 roster; `runners` (plural, below) lists presence


def _print_json(info: dict[str, Any], as_json: bool = True) -> None:
    """One JSON line, or `key: value` lines for a person at a terminal."""
    cli.print_view(info, as_json)


@broker_app.command("up")
def broker_up_cmd(
    workspace: str = cli.workspace_option(),
    mqtt_port: int = typer.Option(None, "--mqtt-port", metavar="P",
                                  help="MQTT port 1-65535 (default: MQTT_PORT of .mam.env, else 1883)."),
    port: int = typer.Option(None, "--port", metavar="P", help="Native NATS port 1-65535 (default 4222)."),
    ws_port: int = typer.Option(None, "--ws-port", metavar="P",
                                help="MQTT-over-WebSocket port, path /mqtt (default 8080; 0 = off)."),
    monitor_port: int = typer.Option(None, "--monitor-port", metavar="P",
                                     help="HTTP monitoring port 1-65535 (default off)."),
    listen: str = typer.Option("127.0.0.1", "--listen", metavar="HOST",
                               help="Listen address of every listener: an IP address or host name of this "
                                    "machine (0.0.0.0 for runners on other hosts)."),
    as_json: bool = cli.json_option(),
) -> int:
    """Start nats-server detached and wait until it accepts MQTT; write .mam.env if missing
    (an existing one is kept: a WARNING says when its MQTT_PORT is not the broker's).
    After an unclean stop (a stale pid file), re-clear the retained topics of ended and
    started jobs as `gc --reclear` does (the count is `recleared_jobs`).

    Prints what it started (one JSON line on a pipe or with --json; no secrets).
    Already running: says so, exit 0. Exit 64: a port out of range, two listeners on one
    port, or a bad --listen (nothing started or written); exit 1: a port in use or the
    server did not start (nothing left running).
    """
    info = broker.up(workspace, mqtt_port=mqtt_port, port=port, ws_port=ws_port,
                     monitor_port=monitor_port, host=listen)
    if info.get("warning"):  # .mam.env points clients at another port
        typer.echo(f"WARNING: {info['warning']}", err=True)
    if info.get("unclean_stop"):  # nats-server may have brought cleared retained messages back (§1.3)
        try:
            done, _, failed = reclear(workspace, local_only=True)
            info["recleared_jobs"] = len(done)
        except MamError as exc:
            failed = [str(exc)]
        if failed:  # the broker runs: say what is left to do, exit 0
            info["reclear_error"] = "; ".join(failed)
            typer.echo(f"WARNING: re-clearing retained topics failed ({info['reclear_error']}); "
                       f"run `{command('gc --reclear', workspace)}`", err=True)
    _print_json(info, as_json)
    return 0


@broker_app.command("down")
def broker_down_cmd(
    workspace: str = cli.workspace_option(),
    as_json: bool = cli.json_option(),
) -> int:
    """Stop the broker: SIGTERM, then SIGKILL after 10 s. Not running: exit 0."""
    _print_json(broker.down(workspace), as_json)
    return 0


@broker_app.command("status")
def broker_status_cmd(
    workspace: str = cli.workspace_option(),
    as_json: bool = cli.json_option(),
) -> int:
    """Check the broker: this workspace's own nats-server natively (version, JetStream,
    MQTT streams), else the configured broker over MQTT (reachable, auth ok).

    Exit 3 when no broker answers, 1 when it answers but is unhealthy.
    """
    if broker.running(workspace):
        info = broker.status(workspace)
        _print_json(info, as_json)
        return 0 if info["healthy"] else 1
    found = probe.check(workspace)  # a broker this hub did not start: ask the configured one
    if cli.human_view(as_json):
        typer.echo("\n".join(["this workspace's embedded broker is not running; the configured broker:",
                               *probe.check_lines(found)]))
    else:
        typer.echo(json.dumps({"running": False, **found}, sort_keys=True))
    if not found["healthy"]:
        raise BrokerUnavailable("broker is not running in this workspace and the configured broker does not "
                                f"accept us (start one: `{command('broker up', workspace)}`)")
    return 0


@app.command("watch")
def watch_cmd(
    job_id: str = typer.Argument(..., metavar="JOB_ID", help="The job id (8 hex characters)."),
    remote: bool = typer.Option(False, "--remote",
                                help="Mirror accepted started/terminal events into the hub registry "
                                     "(automatic for jobs this hub dispatched)."),
    idle_timeout: float = typer.Option(None, "--idle-timeout", metavar="S",
                                       help="Seconds without a newer event before the job is closed "
                                            "deadline_timeout (default: the record's K x N)."),
    ack_timeout: float = typer.Option(None, "--ack-timeout", metavar="S",
                                      help="Seconds to wait for `started` (default: the record's)."),
    timeout: float = typer.Option(None, "--timeout", metavar="S",
                                  help="Wall-clock budget from the job's creation (default: the record's)."),
    workspace: str = cli.workspace_option(),
    as_json: bool = typer.Option(False, "--json", help="JSON lines on stdout even on a TTY."),
) -> int:
    """Watch a job until it ends: accepted events on stdout as JSON lines
    (a human view on a TTY), refusals and logs on stderr (PROTOCOL §3.2, §10).
    A job that ended already: its recorded events as JSON lines (a summary on a
    TTY), and its exit code.

    Exit codes: 0 completed, 1 error (incl. agent_blocked), 2 idle or wall
    timeout, 3 broker unreachable after the disk fallback, 4 cancelled,
    130 detached with Ctrl-C (the job keeps running), 64 bad arguments.
    """
    cli.setup_logging()
    return watch_cli(job_id, workspace=workspace, remote=remote, idle_timeout_s=idle_timeout,
                     ack_timeout_s=ack_timeout, timeout_s=timeout, as_json=as_json)


@app.command("dispatch")
def dispatch_cmd(
    session: str = typer.Option(None, "--session", metavar="NAME",
                                help="The one runner session to run the job (letters, digits, '-', '_'; "
                                     "remote:NAME accepted)."),
    labels: str = typer.Option(None, "--labels", metavar="A,B",
                               help="Instead of --session: any online runner whose labels include all of "
                                    "these (§14)."),
    brief: str = typer.Option(None, "--brief", metavar="TEXT", help="The brief (UTF-8, at most 512 KiB)."),
    brief_file: str = typer.Option(None, "--brief-file", metavar="PATH",
                                   help="Read the brief from PATH ('-' = stdin)."),
    heartbeat: int = typer.Option(None, "--heartbeat", metavar="N",
                                  help="Heartbeat period in seconds (default MAM_HEARTBEAT_SEC, else 30)."),
    heartbeat_misses: int = typer.Option(None, "--heartbeat-misses", metavar="K",
                                         help="Missed beats before idle (default MAM_HEARTBEAT_MISSES, else 4)."),
    ack_timeout: int = typer.Option(None, "--ack-timeout", metavar="T",
                                    help="Seconds for `started` to arrive (default MAM_ACK_TIMEOUT_S, else 180)."),
    idle_timeout: int = typer.Option(None, "--idle-timeout", metavar="S",
                                     help="Seconds without a newer event before closing (default K x N)."),
    timeout: int = typer.Option(None, "--timeout", metavar="W", help="Wall-clock budget in seconds (default 7200)."),
    require_online: bool = typer.Option(False, "--require-online",
                                        help="Exit 5 (nothing dispatched) unless the session has a signed "
                                             "online presence."),
    priority: int = typer.Option(0, "--priority", metavar="N", help="Higher leaves the queue first (§14)."),
    queue_timeout: int = typer.Option(None, "--queue-timeout", metavar="S",
                                      help="Seconds queued before closing queue_timeout, exit 2 (default 86400)."),
    retries: int = typer.Option(0, "--retries", metavar="N", help="Retry a failed attempt up to N times, 0..10."),
    retry_on: str = typer.Option(None, "--retry-on", metavar="LIST",
                                 help="Which ends retry: agent_blocked,deadline_timeout,runner_lost,lease_lost,"
                                      "error (default all but error)."),
    fresh: bool = typer.Option(False, "--fresh", help="A retry starts a new agent session (default: it "
                                                      "continues the last one, §18)."),
    on_limit: str = typer.Option("pause", "--on-limit", metavar="pause|fail|move",
                                 help="When the agent stops on a usage limit: pause the job until the limit "
                                      "resets, then continue its session on the same runner (default); move "
                                      "it at once to another runner of its --labels, which continues the "
                                      "session from its transcript; or fail (error)."),
    group: str = typer.Option(None, "--group", metavar="NAME",
                              help="A concurrency group: at most --group-limit of its jobs run at once, "
                                   "fleet-wide; the others wait queued, in order (§14)."),
    group_limit: int = typer.Option(None, "--group-limit", metavar="N",
                                    help="With --group: how many of the group's jobs may run at once, "
                                         "1..1000 (default 1)."),
    cancel_in_progress: bool = typer.Option(False, "--cancel-in-progress",
                                            help="With --group: cancel the group's jobs queued or running "
                                                 "before this one (each says why)."),
    after: str = typer.Option(None, "--after", metavar="ID[,ID...]",
                              help="Run after these jobs: the job stays blocked until each one ended, "
                                   "then it is queued; if one ended otherwise than --if allows, it ends "
                                   "error, dependency_failed, naming it (§14)."),
    after_if: str = typer.Option(None, "--if", metavar="completed|ended",
                                 help="With --after: each job must have completed (default), or only "
                                      "ended, whatever its outcome."),
    from_result: str = typer.Option(None, "--from-result", metavar="ID",
                                    help="With --repo: start the worktree from the change job ID (of the same "
                                         "repo) brought back, not from --ref; runs after ID (§18)."),
    repo: str = typer.Option(None, "--repo", metavar="NAME",
                             help="Run on a worktree of this repository: only runners started with "
                                  "--repo NAME=URL take the job; its change comes back (§18)."),
    ref: str = typer.Option(None, "--ref", metavar="REF",
                            help="With --repo: the branch, tag or commit to start from (default: the "
                                 "remote's default branch)."),
    max_turns: int = typer.Option(None, "--max-turns", metavar="N",
                                  help="The agent's model turns at most, 1..1000: passed to the CLI and "
                                       "enforced by the runner; over it the job ends budget_exceeded (§18)."),
    max_cost_usd: float = typer.Option(None, "--max-cost-usd", metavar="X",
                                       help="What the agent may spend at most, US dollars (the CLI's "
                                            "--max-budget-usd); over it the job ends budget_exceeded."),
    allow_tools: str = typer.Option(None, "--allow-tools", metavar="RULES",
                                    help="Tools the agent may use without asking, e.g. 'Bash(git *),Edit' "
                                         "(Claude Code's --allowedTools); for any other tool it asks you "
                                         "(mam-orch approve|deny)."),
    deny_tools: str = typer.Option(None, "--deny-tools", metavar="RULES",
                                   help="Tools the agent may never use, same form, e.g. 'Bash(git push *)': "
                                        "denied without asking anyone (Claude Code's --disallowedTools)."),
    permission_mode: str = typer.Option(None, "--permission-mode", metavar="MODE",
                                        help="The agent CLI's permission mode: default, acceptEdits (file "
                                             "edits in the worktree allowed), plan or dontAsk (deny what "
                                             "--allow-tools does not allow, asking nobody)."),
    ask_timeout: int = typer.Option(None, "--ask-timeout", metavar="S",
                                    help="How long the agent's permission request waits for an answer, "
                                         "seconds (default 1800); then --on-ask-timeout."),
    on_ask_timeout: str = typer.Option(None, "--on-ask-timeout", metavar="deny|cancel",
                                       help="After --ask-timeout: deny the request and let the agent go on "
                                            "(default), or cancel the job."),
    memory: str = typer.Option(None, "--memory", metavar="SIZE",
                               help="The job's memory limit, e.g. 512M or 8G, where the runner's host gives "
                                    "the memory cgroup controller; over it the job ends error, oom (§6)."),
    cpus: float = typer.Option(None, "--cpus", metavar="N",
                               help="The job's CPU quota in CPUs, e.g. 2 or 0.5, where the host gives the "
                                    "cpu controller."),
    pids: int = typer.Option(None, "--pids", metavar="N",
                             help="How many processes the job may have at once, 8..4194304, where the "
                                  "host gives the pids controller."),
    gpus: int = typer.Option(None, "--gpus", metavar="N",
                             help="How many GPUs the job needs, 1..64: only a runner started with --gpus "
                                  "that has N free takes it, and the job sees only those (§14)."),
    title: str = typer.Option(None, "--title", metavar="TEXT",
                              help="A name for the job in lists and the dashboard, one line, at most 120 "
                                   "characters (default: the brief's first line, cut to 80)."),
    detach: bool = typer.Option(False, "--detach",
                                help="Print the job id and return once it is published, or once the hub "
                                     "says why it stays queued or blocked (\"action\": \"queued\" or \"blocked\")."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines on stdout even on a TTY."),
    no_log: bool = typer.Option(False, "--no-log", help="Do not show the agent's output under the events."),
    workspace: str = cli.workspace_option(),
) -> int:
    """Queue a job for a runner session or any runner with some labels, publish it
    when one has a free slot, and watch it until it ends (PROTOCOL §5, §10, §14).

    The brief travels sealed (AES-256-GCM) in a signed retained dispatch; the
    hub keeps a 0600 copy in .mam/logs/<job>/brief.txt for redispatch and retries.
    Exit codes: 0 completed, 1 error (incl. agent_blocked), 2 idle or wall
    timeout or queue_timeout, 3 broker unreachable, 4 cancelled, 5 no online
    runner (--require-online), 64 bad arguments, 130 detached with Ctrl-C.
    """
    cli.setup_logging(False if as_json else None)
    return dispatch_cli(session=session, brief=brief, brief_file=brief_file, heartbeat_s=heartbeat,
                        heartbeat_misses=heartbeat_misses, ack_timeout_s=ack_timeout, idle_timeout_s=idle_timeout,
                        timeout_s=timeout, require_online=require_online, detach=detach, as_json=as_json,
                        workspace=workspace, labels=labels, priority=priority, queue_timeout_s=queue_timeout,
                        retries=retries, retry_on=retry_on, fresh=fresh, on_limit=on_limit, show_log=not no_log,
                        title=title, group=group, group_limit=group_limit, cancel_in_progress=cancel_in_progress,
                        after=after, after_if=after_if, from_result=from_result,
                        work=work_terms(repo=repo, ref=ref, max_turns=max_turns, max_cost_usd=max_cost_usd,
                                        allow_tools=allow_tools, deny_tools=deny_tools,
                                        permission_mode=permission_mode, ask_timeout_s=ask_timeout,
                                        on_ask_timeout=on_ask_timeout, memory=memory, cpus=cpus, pids=pids,
                                        gpus=gpus))


@app.command("logs")
def logs_cmd(
    job_id: str = typer.Argument(..., metavar="JOB_ID", help="The job id (8 hex characters)."),
    follow: bool = typer.Option(False, "--follow", "-f",
                                help="Keep printing until the job ends; exit as `watch` does."),
    attempt: int = typer.Option(None, "--attempt", metavar="N", help="Which attempt (default: the current one)."),
    workspace: str = cli.workspace_option(),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per output line: job_id, attempt_id, line."),
) -> int:
    """Print the agent's output as the hub received it (.mam/logs/<job>/agent.<attempt>.log).

    The hub's copy is written by `dispatch`, `watch` or the hub service while
    they run; the runner keeps the whole output in its own agent.log.
    """
    cli.setup_logging()
    return logs_cli(job_id, workspace=workspace, follow=follow, attempt=attempt, as_json=as_json)


@app.command("result")
def result_cmd(
    job_id: str = typer.Argument(..., metavar="JOB_ID", help="The job id (8 hex characters)."),
    patch: bool = typer.Option(False, "--patch", help="Print the change as a patch (git diff --binary)."),
    transcript: bool = typer.Option(False, "--transcript",
                                    help="Print the agent's session transcript (JSON lines, secrets masked)."),
    attempt: int = typer.Option(None, "--attempt", metavar="N",
                                help="Which attempt (default: the latest one that sent a result)."),
    workspace: str = cli.workspace_option(),
    as_json: bool = typer.Option(False, "--json", help="The result as one JSON object even on a TTY."),
) -> int:
    """Show what a repository job changed: base and head commits, the commits, the
    diffstat and the agent's summary, or with --patch the diff, with --transcript the
    agent's conversation (PROTOCOL §18).

    The runner sends the result sealed and signed when the agent ends; the hub keeps
    it in .mam/results/<job>/<attempt>/. Exit codes: 0 shown; 1 no result (yet), or
    no patch or transcript in it; 64 --patch with --transcript.
    """
    cli.setup_logging()
    return result_cli(job_id, workspace=workspace, patch=patch, transcript=transcript, attempt=attempt,
                      as_json=as_json)


@app.command("apply")
def apply_cmd(
    job_id: str = typer.Argument(..., metavar="JOB_ID", help="The job id (8 hex characters)."),
    repo_path: str = typer.Option(None, "--repo-path", metavar="DIR",
                                  help="A clean clone of the repository (default: the current directory)."),
    attempt: int = typer.Option(None, "--attempt", metavar="N",
                                help="Which attempt (default: the latest one that sent a result)."),
    workspace: str = cli.workspace_option(),
) -> int:
    """Fetch a repository job's change into a local clone as branch mam/<job> (PROTOCOL §18).

    Nothing in the clone's working tree changes; a clone with uncommitted changes, one
    without the job's base commit, or an existing mam/<job> at another commit is refused.
    Exit codes: 0 applied; 64 refused (the reason in one line).
    """
    cli.setup_logging()
    return apply_cli(job_id, workspace=workspace, repo_path=repo_path, attempt=attempt)


INPUT_CELL_CHARS = 60
"""Characters of a request's input shown in the `asks` table (the JSON view has it whole)."""


@app.command("asks")
def asks_cmd(
    job_id: str = typer.Argument(None, metavar="[JOB_ID]",
                                 help="One job's requests, answered ones too (default: every waiting one)."),
    workspace: str = cli.workspace_option(),
    as_json: bool = cli.json_option(),
) -> int:
    """List the agents' permission requests that wait for a person, oldest first (§19).

    With JOB_ID: every request of that job with its answer (who, when). On a pipe, or
    with --json, one JSON object per request.
    """
    from mam.shared.cli.render import table

    registry = open_hub(workspace).registry
    found = asks.asks_of(registry, names.validate_job_id(job_id)) if job_id else asks.pending_everywhere(registry)
    if not cli.human_view(as_json):
        for ask in found:
            print(json.dumps(ask.to_dict()))
        return 0
    if not found:
        print("no permission request waits for an answer" if job_id is None else f"job {job_id} asked nothing")
        return 0
    rows = [[ask.job_id, ask.request_id, ask.tool, ask.asked_at, _cut(ask.input, INPUT_CELL_CHARS),
             f"{ask.behavior} by {ask.answered_by}" if ask.behavior else "waiting"] for ask in found]
    print(table(["JOB", "REQUEST", "TOOL", "ASKED", "INPUT", "ANSWER"], rows), end="")
    if job_id is None:
        print(f"answer with: {command('approve|deny <job> [<request>]', workspace)}")
    return 0


def _cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars - 1] + "…"


_REQUEST_ARGUMENT = typer.Argument(None, metavar="REQUEST_ID",
                                   help="The request (16 hex characters; default: the job's only waiting one).")


def _answer(job_id: str, request_id: str | None, *, allow: bool, reason: str | None, workspace: str,
            as_json: bool, always: bool = False) -> int:
    cli.setup_logging(False if as_json else None)
    names.validate_job_id(job_id)
    done = asks.answer_from(open_hub(workspace), job_id, request_id, allow=allow, message=reason, always=always)
    print(f"job {job_id} request {done.request_id} ({done.tool}): {'allowed' if allow else 'denied'} "
          f"by {done.answered_by}{'; the same request is allowed again without asking' if always else ''}",
          file=sys.stderr)
    if not cli.human_view(as_json):
        print(json.dumps(done.to_dict()), flush=True)
    return 0


@app.command("approve")
def approve_cmd(
    job_id: str = typer.Argument(..., metavar="JOB_ID", help="The job id (8 hex characters)."),
    request_id: str = _REQUEST_ARGUMENT,
    always: bool = typer.Option(False, "--always", help="Also allow the same tool with the same input again, "
                                                         "without asking, for the rest of this attempt."),
    workspace: str = cli.workspace_option(),
    as_json: bool = cli.json_option(),
) -> int:
    """Allow an agent's waiting permission request: the runner hands the answer to the agent (§19).

    The answer is signed (v2 for an enrolled runner) and recorded with who gave it.
    Exit 1 when the request is unknown, answered already, of an older attempt, or the
    job ended; 3 when the broker is unreachable (nothing recorded); 64 when several
    requests wait and none is named.
    """
    return _answer(job_id, request_id, allow=True, reason=None, workspace=workspace, as_json=as_json, always=always)


@app.command("deny")
def deny_cmd(
    job_id: str = typer.Argument(..., metavar="JOB_ID", help="The job id (8 hex characters)."),
    request_id: str = _REQUEST_ARGUMENT,
    reason: str = typer.Option(None, "--reason", metavar="TEXT",
                               help="What the agent is told, 1-256 characters (default: denied by user@host)."),
    workspace: str = cli.workspace_option(),
    as_json: bool = cli.json_option(),
) -> int:
    """Deny an agent's waiting permission request; the agent gets the reason and goes on (§19).

    Exit codes as for approve.
    """
    return _answer(job_id, request_id, allow=False, reason=reason, workspace=workspace, as_json=as_json)


@app.command("cancel")
def cancel_cmd(
    job_id: str = typer.Argument(..., metavar="JOB_ID", help="The job id (8 hex characters)."),
    workspace: str = cli.workspace_option(),
    as_json: bool = cli.json_option(),
) -> int:
    """Cancel a job: record cancelled, retained dispatch cleared, signed retained cancel published (§6).

    A job already terminal is reported and left alone (exit 0). Exit 1 for
    an unknown job, 3 when the broker is unreachable (the record is unchanged).
    """
    cli.setup_logging(False if as_json else None)
    return cancel(job_id, workspace=workspace, as_json=as_json)


@app.command("say")
def say_cmd(
    job_id: str = typer.Argument(..., metavar="JOB_ID", help="The job id (8 hex characters)."),
    text: str = typer.Argument(None, metavar="TEXT", help="What to tell the agent (UTF-8, at most 512 KiB; "
                                                          "8 KiB to a running agent)."),
    text_file: str = typer.Option(None, "--file", metavar="PATH", help="Read the words from PATH ('-' = stdin)."),
    detach: bool = typer.Option(False, "--detach", help="Print the job id and return once it is published."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines on stdout even on a TTY."),
    workspace: str = cli.workspace_option(),
) -> int:
    """Tell a job's agent more: now while it runs, or by continuing its session (PROTOCOL §18).

    A running job whose agent reads input while it works (Claude Code with
    --input-format stream-json in the runner's --exec): the
    words go to the agent now, at most 8 KiB; exit 0 once the runner delivered
    them, 1 when it could not (the agent finished its turn), 2 with no word from
    the runner within 30 s. An ended job (completed too) whose agent reported a
    session: the words are the brief of a new attempt that resumes that session
    in the worktree the last attempt left, on the same runner, so its change
    grows from there, and it is watched as dispatch does. Exit 1 when refused.
    """
    cli.setup_logging()
    return say_cli(job_id, text, text_file=text_file, detach=detach, as_json=as_json, workspace=workspace)


@app.command("resume")
def resume_cmd(
    job_id: str = typer.Argument(..., metavar="JOB_ID", help="The job id (8 hex characters)."),
    detach: bool = typer.Option(False, "--detach", help="Print the job id and return once it is published."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines on stdout even on a TTY."),
    workspace: str = cli.workspace_option(),
) -> int:
    """Go on now with a job paused on a usage limit, and watch it (PROTOCOL §14).

    A job whose agent stopped on a usage limit waits queued until the limit
    resets (dispatch --on-limit pause, the default); this queues it at once.
    Its next attempt continues the agent's session on the same runner. Exit
    codes as for dispatch; 1 when the job is not paused.
    """
    cli.setup_logging()
    return resume_cli(job_id, detach=detach, as_json=as_json, workspace=workspace)


@app.command("redispatch")
def redispatch_cmd(
    job_id: str = typer.Argument(..., metavar="JOB_ID", help="The job id (8 hex characters)."),
    session: str = typer.Option(None, "--session", metavar="NAME", help="Move the job to another session."),
    brief: str = typer.Option(None, "--brief", metavar="TEXT", help="A new brief (default: the stored one)."),
    brief_file: str = typer.Option(None, "--brief-file", metavar="PATH",
                                   help="Read a new brief from PATH ('-' = stdin)."),
    detach: bool = typer.Option(False, "--detach", help="Print the job id and return once it is published."),
    fresh: bool = typer.Option(False, "--fresh", help="Start a new agent session instead of continuing the "
                                                      "last one (§18)."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines on stdout even on a TTY."),
    workspace: str = cli.workspace_option(),
) -> int:
    """Start a new attempt of an ended job and watch it (PROTOCOL §8).

    Allowed from error or cancelled (never completed): attempt + 1, new
    tokens, a new sealed dispatch. An agent that reported a session (Claude
    Code) continues it in the last attempt's worktree where that runner still
    has them (§18), unless --fresh. Exit codes as for dispatch; 1 when refused.
    """
    cli.setup_logging()
    return redispatch_cli(job_id, session=session, brief=brief, brief_file=brief_file, detach=detach,
                          as_json=as_json, workspace=workspace, fresh=fresh)


schedule_app = cli.new_app(
    "schedule", "Dispatch a job on a cron expression; the hub service fires it.",
    ("add", "list", "show", "pause", "resume", "run-now", "token", "remove"),
    {"add": "mam-orch schedule add nightly --cron '0 3 * * *' --tz Europe/Berlin -- --labels gpu --brief 'Update "
            "the dependencies'", "list": "mam-orch schedule list", "show": "mam-orch schedule show nightly",
     "pause": "mam-orch schedule pause nightly", "resume": "mam-orch schedule resume nightly",
     "run-now": "mam-orch schedule run-now nightly", "token": "mam-orch schedule token nightly",
     "remove": "mam-orch schedule remove nightly"})
app.add_typer(schedule_app, name="schedule")
SCHEDULE_NAME = typer.Argument(..., metavar="NAME", help="The schedule's name (1-64 of a-z 0-9 _ . -).")


def _print_schedule(info: dict[str, Any], as_json: bool) -> None:
    if as_json or not sys.stdout.isatty():
        print(json.dumps(info, sort_keys=True))
    else:
        for line in cli.key_value_lines(info):
            print(line)


@schedule_app.command("add", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def schedule_add_cmd(
    ctx: typer.Context,
    name: str = SCHEDULE_NAME,
    cron: str = typer.Option(..., "--cron", metavar="EXPR",
                             help="When: 5 fields (minute hour day month weekday, e.g. '0 3 * * *'), or 6 with "
                                  "seconds last."),
    tz: str = typer.Option("UTC", "--tz", metavar="ZONE", help="The time zone of the expression, e.g. Europe/Berlin."),
    overlap: str = typer.Option("skip", "--overlap", metavar="skip|queue|cancel",
                                help="When a tick comes while the last job still runs: skip the tick (default), "
                                     "queue another job, or cancel the running one first."),
    catch_up: int = typer.Option(1, "--catch-up", metavar="N",
                                 help="Ticks missed while the hub was down that run at its start, 0..100 (the "
                                      "latest N, each marked catch_up)."),
    force: bool = typer.Option(False, "--force", help="Replace a schedule of that name."),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout even on a TTY."),
    workspace: str = cli.workspace_option(),
) -> int:
    """Add a schedule: after `--` come `mam-orch dispatch` options (the target, the brief, the
    contract, the agent's policy), checked now as dispatch checks them.

    The hub service (`mam-orch serve`) fires it: each tick is recorded before its job is
    registered, so a tick never runs twice. Exit 64 on a bad option, nothing saved.
    """
    root = open_hub(workspace).root
    extra = list(ctx.args)
    if "--workspace" in extra:
        raise UsageError("give --workspace before --, not among the dispatch options")
    command = typer.main.get_command(app).commands["dispatch"]  # type: ignore[attr-defined]
    try:
        params = command.make_context("dispatch", extra, resilient_parsing=False).params
    except cli.ClickException as exc:  # typer's own click, or click
        raise UsageError(f"dispatch options: {' '.join(exc.format_message().split())}") from None
    schedule = schedules.add(root, name, cron=cron, tz=tz, overlap=overlap, catch_up=catch_up, params=params,
                             force=force)
    _print_schedule(schedules.describe(schedule), as_json)
    if service_pid(root) is None:
        print(f"no hub service runs for {root}: nothing fires it until `mam-orch serve` runs", file=sys.stderr)
    return 0


@schedule_app.command("list")
def schedule_list_cmd(
    as_json: bool = typer.Option(False, "--json", help="JSON lines (default on a pipe)."),
    workspace: str = cli.workspace_option(),
) -> int:
    """List the schedules with their next and last fire times."""
    rows = schedules.describe_all(open_hub(workspace).root)
    if as_json or not sys.stdout.isatty():
        for row in rows:
            print(json.dumps(row, sort_keys=True))
    elif not rows:
        print("(no schedules)")
    else:
        print(render.table(["NAME", "CRON", "TZ", "TARGET", "NEXT", "LAST JOB", "STATE"],
                           [[r["name"], r["cron"], r["tz"], r["target"], r["next_fire"] or "-", r["last_job"] or "-",
                             "paused" if r["paused"] else "active"] for r in rows]), end="")
    return 0


@schedule_app.command("show")
def schedule_show_cmd(name: str = SCHEDULE_NAME,
                      as_json: bool = typer.Option(False, "--json", help="JSON on stdout even on a TTY."),
                      workspace: str = cli.workspace_option()) -> int:
    """One schedule: its terms, next fire time, last tick, last job, last skipped tick."""
    _print_schedule(schedules.describe(schedules.Store(open_hub(workspace).root).load(name)), as_json)
    return 0


@schedule_app.command("pause")
def schedule_pause_cmd(name: str = SCHEDULE_NAME, workspace: str = cli.workspace_option()) -> int:
    """Stop firing it; its ticks pass unrun until resume."""
    schedules.set_paused(open_hub(workspace).root, name, True)
    print(f"schedule {name} paused", file=sys.stderr)
    return 0


@schedule_app.command("resume")
def schedule_resume_cmd(name: str = SCHEDULE_NAME, workspace: str = cli.workspace_option()) -> int:
    """Fire it again from its next tick (the paused ticks are not caught up)."""
    schedule = schedules.set_paused(open_hub(workspace).root, name, False)
    print(f"schedule {name} resumed; next fire {schedules.next_fire(schedule)}", file=sys.stderr)
    return 0


@schedule_app.command("run-now")
def schedule_run_now_cmd(name: str = SCHEDULE_NAME, workspace: str = cli.workspace_option()) -> int:
    """Fire one job of it now (its overlap rule applies); prints the job id."""
    hub = open_hub(workspace)
    store = schedules.Store(hub.root)
    fired = schedules.fire(hub.registry, store, store.load(name), datetime.now(UTC), register_queued,
                           lambda job_id, reason: cancel(job_id, workspace=workspace, reason=reason), forced=True,
                           trigger={"by": "run-now"})
    if not fired:
        print(f"schedule {name}: not fired: {store.load(name).last_skipped}", file=sys.stderr)
        return 1
    print(json.dumps({"schedule": name, "job_id": fired[0]}))
    return 0


@schedule_app.command("token")
def schedule_token_cmd(name: str = SCHEDULE_NAME,
                       revoke: bool = typer.Option(False, "--revoke", help="Remove its token: no token fires it."),
                       workspace: str = cli.workspace_option()) -> int:
    """Make a trigger token for it (replacing the last one): with it, CI or a Git hook fires one
    job by `POST /api/schedules/NAME/run` (header `Authorization: Bearer <token>`) without the
    hub's MAM_API_TOKEN; at most 6 such runs a minute. The token goes to a 0600 file whose path
    is printed, never to the terminal."""
    root = open_hub(workspace).root
    if revoke:
        had = schedules.revoke_token(root, name)
        print(f"schedule {name}: {'trigger token revoked' if had else 'had no trigger token'}", file=sys.stderr)
        return 0
    path = schedules.issue_token(root, name)
    print(f"schedule {name}: a new trigger token is in {path} (0600; any earlier one no longer works). Fire it "
          f"with: curl -X POST -H \"Authorization: Bearer $(cat {path})\" http://HUB/api/schedules/{name}/run",
          file=sys.stderr)
    return 0


@schedule_app.command("remove")
def schedule_remove_cmd(name: str = SCHEDULE_NAME, workspace: str = cli.workspace_option()) -> int:
    """Remove it; jobs it fired go on."""
    schedules.Store(open_hub(workspace).root).remove(name)
    print(f"schedule {name} removed", file=sys.stderr)
    return 0


runners_app = cli.new_app("runners", "List runners from their signed retained presence; prune long-gone ones.",
                             ("prune",), {"prune": "mam-orch runners prune"}, no_args_is_help=False)
app.add_typer(runners_app, name="runners")


@runners_app.callback(invoke_without_command=True)
def runners_cmd(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="JSON lines (default on a pipe)."),
    show_all: bool = typer.Option(False, "--all", help="Also offline runners last seen more than 7 days "
                                                          "ago, and revoked runners (status revoked, with when)."),
    workspace: str = cli.workspace_option(),
) -> int:
    """List runners from their signed retained presence: online, draining, offline or lost
    (its Last Will came, or it stopped renewing its presence), running jobs, last seen
    (PROTOCOL §7). Unsigned or forged presence is refused on stderr."""
    if ctx.invoked_subcommand is not None:
        return 0
    cli.setup_logging(False if as_json else None)
    return runners_cli(workspace=workspace, as_json=as_json, show_all=show_all)


_PRUNE_SESSIONS = typer.Argument(None, metavar="NAME", help="Only these sessions (each must be offline).")


@runners_app.command("prune")
def runners_prune_cmd(
    sessions: list[str] = _PRUNE_SESSIONS,
    older_than_days: float = typer.Option(float(OFFLINE_HIDDEN_DAYS), "--older-than-days", metavar="D",
                                          help="Without NAME: offline runners last seen over D days ago."),
    as_json: bool = cli.json_option(),
    workspace: str = cli.workspace_option(),
) -> int:
    """Clear the retained presence of offline runners last seen more than 7 days ago (or of the
    named ones); one whose last presence is online or draining (lost or not) is refused (exit 1)."""
    cli.setup_logging(False if as_json else None)
    return prune_cli(list(sessions or []), workspace=workspace, older_than_days=older_than_days, as_json=as_json)


@app.command("gc")
def gc_cmd(
    older_than_days: float = typer.Option(float(RETENTION_DAYS), "--older-than-days", metavar="D",
                                          help="Retention: clear jobs terminal for longer than D days."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list the jobs that would be cleared."),
    reclear_: bool = typer.Option(False, "--reclear",
                                  help="Instead: clear again the dispatch and control of every ended job and "
                                       "the dispatch of every started one (after a broker crash), through "
                                       "each host of MQTT_BROKER in turn."),
    workspace: str = cli.workspace_option(),
    as_json: bool = cli.json_option(),
) -> int:
    """Clear the retained dispatch, events, state and control of jobs terminal
    for longer than the retention period (PROTOCOL §2), each on the broker it was dispatched
    through (its own broker settings, if it had any). Records stay on disk.
    With --reclear: clear again what a broker crash brought back (docs/deployment.md)."""
    cli.setup_logging()
    if reclear_:
        return reclear_cli(workspace=workspace)
    return gc_cli(older_than_days=older_than_days, workspace=workspace, dry_run=dry_run, as_json=as_json)


ALERT_WEBHOOK_OPTION = typer.Option(
    None, "--alert-webhook", metavar="URL", envvar="MAM_ALERT_WEBHOOK", show_default=False,
    help="POST alerts here as JSON with a Slack-compatible `text` (repeatable; the variable takes "
         "URLs separated by blanks, and keeps them out of `ps`): a runner offline or lost holding jobs, "
         "a job queued too long, labels or a repository nobody serves, a permission request unanswered "
         "too long, a job failed after its last retry; each once, then once resolved.")


@app.command("serve")
def serve_cmd(
    workspace: str = cli.workspace_option(),
    http: str = typer.Option(None, "--http", metavar="HOST:PORT",
                             help="Also serve the dashboard, the HTTP API and /metrics here, e.g. 127.0.0.1:8765 "
                                  "(an address other than loopback needs MAM_API_TOKEN)."),
    alert_webhook: list[str] = ALERT_WEBHOOK_OPTION,
    alert_queue_s: float = typer.Option(600.0, "--alert-queue-s", metavar="S",
                                        help="Alert on a job queued longer than this (s)."),
    alert_ask_s: float = typer.Option(600.0, "--alert-ask-s", metavar="S",
                                      help="Alert on a permission request unanswered longer than this (s)."),
) -> int:
    """Run the hub service: one process and one broker connection for every job of this
    registry (PROTOCOL §14). It tracks every queued, pending and running job, whichever
    command registered it, publishes queued jobs when a runner has a free slot, applies the
    clocks of §10 and mirrors events. SIGTERM/SIGINT stop it; the jobs go on, and the
    next start picks them up. Exit 64: another service runs for this registry (its pid is named),
    --http cannot listen (or needs MAM_API_TOKEN), or a bad --alert-* option.

    Example: mam-orch serve --http 127.0.0.1:8765, then open http://127.0.0.1:8765/
    """
    cli.setup_logging()
    companions = []
    if alert_webhook:
        from mam.orchestrator.http.alerts import Alerter, AlertOptions

        options = AlertOptions.parse(alert_webhook, alert_queue_s, alert_ask_s)
        companions.append(lambda service: Alerter(service, options))
    if http:
        # lazy: starlette, uvicorn and prometheus-client cost every other command 150 ms at start
        from mam.orchestrator.http.app import serve_http_cli

        return serve_http_cli(workspace=workspace, bind=http, companions=companions)
    return serve_cli(workspace=workspace, companions=companions)


def main() -> None:
    """Console-script entry point."""
    cli.run(app, "mam-orch")


if __name__ == "__main__":
    main()
