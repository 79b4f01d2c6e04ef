"""`mam-runner`: the worker host's command line. Each command parses, calls
one function, and lets `cli.run` map errors to the exit codes of
§9. `publish` is called often by agents: its imports stay lazy, and inside a
job it goes through the runner's socket (`fastpath`, §17) before typer is even
imported (the console script's entry is `mam.runner.__main__`)."""

from __future__ import annotations

import json
import os
import sys

import typer

from mam.shared import cli
from mam.shared.protocol.errors import BrokerError, ExitCode, MamError, ProtocolError, RegistryError, UsageError
from mam.shared.store.root import resolve_root

MAX_PUBLISH_ATTEMPTS = 10
"""Highest `--attempts` of `mam-runner publish` (§13)."""
INVITE_ANSWER_TIMEOUT_S = 30.0
"""Default `--timeout` of `mam-runner enroll --invite`: how long to wait for the hub's answer (s)."""

app = cli.new_app(
    "mam-runner",
    "The worker side of mam-fleet: take dispatched jobs for a session, run the "
    "agent under a heartbeat, and publish its events.",
    ("enroll", "trust-hub", "run", "publish", "ask", "permission-tool", "jobs", "show", "gc"),
    {"enroll": "mam-runner enroll --session gpu-box",
     "trust-hub": "mam-runner trust-hub -- HUB_PUBLIC_KEY",
     "run": "mam-runner run --session gpu-box --repo demo=git://hub:9418/demo --exec claude",
     "publish": "mam-runner publish --job \"$MAM_JOB_ID\" --event progress --detail 'tests pass'",
     "ask": "mam-runner ask --tool Bash --input '{\"command\": \"git push\"}'",
     "permission-tool": "mam-runner permission-tool   # started by the runner for claude",
     "jobs": "mam-runner jobs --status running",
     "show": "mam-runner show 918b0612",
     "gc": "mam-runner gc --ttl 3600"},
)


@app.callback()
def _root(version: bool = cli.version_option("mam-runner")) -> None:
    """The worker side of mam-fleet."""


cli.add_registry_commands(app)


@app.command("publish")
def publish_cmd(
    job: str = typer.Option(..., "--job", metavar="ID", help="The job id (8 hex characters)."),
    event: str = typer.Option(..., "--event", metavar="E",
                              help="started, progress, permission_required, completed or error."),
    detail: str = typer.Option("", "--detail", metavar="D",
                               help="Short safe text, at most 1024 characters: no paths, secrets or env values."),
    data: str = typer.Option(None, "--data", metavar="JSON", help="A JSON object of free metrics (at most 16 KiB)."),
    heartbeat: float = typer.Option(None, "--heartbeat", metavar="N",
                                    help="With --event started: start the detached timer beating every N s (§12)."),
    watch_pid: int = typer.Option(None, "--watch-pid", metavar="P",
                                  help="Heartbeats stop within one period after this process is gone "
                                       "(default: the nearest agent-CLI ancestor, else the parent)."),
    attempts: int = typer.Option(3, "--attempts", metavar="N", help="Connection/publish tries (§13 backoff)."),
    attempt_id: str = typer.Option(None, "--attempt-id", metavar="N", envvar="MAM_ATTEMPT_ID", show_envvar=True,
                                   help="The attempt this publisher holds (default: the record's current)."),
    dispatch_token: str = typer.Option(None, "--dispatch-token", metavar="TOKEN", envvar="MAM_DISPATCH_TOKEN",
                                       show_envvar=True,
                                       help="The dispatch token this publisher holds (default: the record's)."),
    workspace: str = cli.workspace_option(),
) -> int:
    """Publish one event of a job: the record and audit line first, then the
    event and the retained state on one connection (PROTOCOL §3, §4).

    Inside a job (MAM_RUNNER_SOCKET set) the runner daemon records and sends it:
    exit 0 once it is on disk and in the outbox (§17); without the socket, its
    own connection. Exit codes: 0 published; 1 refused (stale attempt, terminal
    job, unknown job); 2 transport failure (the event is on disk and in the
    outbox, §17); 64 bad arguments.
    """
    return publish_cli(job_id=job, event=event, detail=detail, data=data, attempt_id=attempt_id,
                       dispatch_token=dispatch_token, heartbeat_s=heartbeat, watch_pid=watch_pid,
                       attempts=attempts, workspace=workspace)


@app.command("ask")
def ask_cmd(
    tool: str | None = typer.Option(None, "--tool", metavar="NAME", help="The tool the agent wants to use, e.g. Bash."),
    input_json: str = typer.Option("{}", "--input", metavar="JSON",
                                   help="The tool's input, a JSON object of at most 64 KiB; the hub is shown a "
                                        "one-line summary with secrets masked."),
    hook: bool = typer.Option(False, "--hook",
                              help="Read a Claude Code or Codex hook's JSON on stdin (PreToolUse or "
                                   "PermissionRequest) instead of --tool/--input, and print that hook's decision."),
) -> int:
    """Ask a person at the hub for permission to use a tool, and wait for the answer (PROTOCOL §19).

    Inside a job only (it reads MAM_JOB_ID, MAM_ATTEMPT_ID, MAM_DISPATCH_TOKEN and
    MAM_RUNNER_SOCKET). The hub sees a `permission_required` event and answers with
    `mam-orch approve` or `deny`. Prints {"behavior": "allow"|"deny", "message", "request_id"}.
    Exit codes: 0 allowed; 1 denied, or refused by the runner; 2 no answer (the runner
    stopped); 64 bad arguments or not inside a job.

    As an agent's hook (--hook): configure `mam-runner ask --hook` as a command hook on
    PreToolUse or PermissionRequest (examples/agents/README.md). It prints the hook's decision and
    exits 0; when it cannot ask or nobody can answer it exits 2, which blocks the tool,
    with the reason on stderr.
    """
    from mam.runner.ask import ask_cli, hook_cli

    if hook:
        if tool is not None or input_json != "{}":
            print("ERROR: --hook reads the tool and its input from stdin: drop --tool and --input", file=sys.stderr)
            return ExitCode.USAGE
        return hook_cli(sys.stdin.buffer)
    if tool is None:
        print("ERROR: name the tool with --tool NAME (or read a hook's JSON with --hook)", file=sys.stderr)
        return ExitCode.USAGE
    return ask_cli(tool, input_json)


@app.command("permission-tool")
def permission_tool_cmd() -> None:
    """Serve the MCP permission tool Claude Code asks before a tool call no policy allows (§19).

    The runner starts it for the claude agent (`--permission-prompt-tool mcp__mam__permission`);
    it speaks MCP on stdin/stdout and relays each request to a person at the hub, like
    `mam-runner ask`. Inside a job only.
    """
    from mam.runner.permission_tool import serve

    serve()


ENROL_REPO_OPTION = typer.Option(None, "--repo", metavar="NAME=URL",
                                 help="A repository `run` serves by default (repeatable; MAM_RUNNER_REPOS "
                                      "in .mam.env).")
REPO_OPTION = typer.Option(None, "--repo", metavar="NAME=URL",
                           help="A repository this runner serves (repeatable; default MAM_RUNNER_REPOS): a "
                                "bare mirror under the workspace, a worktree per attempt, the change sent back "
                                "(§18). URL: anything git clone takes.")
"""`run --repo` (a list: ruff's B008 wants a list option's default built once, here)."""


@app.command("run")
def run_cmd(
    session: str = typer.Option(None, "--session", metavar="NAME",
                                help="This runner's session name: letters, digits, '-' and '_' (PROTOCOL §1). "
                                     "Default: the session this host enrolled as (mam-runner enroll)."),
    exec_cmd: str = typer.Option(..., "--exec", metavar="CMD",
                                 help="The agent command, split like a shell and run without one, "
                                      "e.g. claude or ./agent.sh (§11); the brief is its stdin."),
    workspace: str = cli.workspace_option(),
    workdir: str = typer.Option(None, "--workdir", metavar="DIR",
                                help="Agents' working directory (default: <workspace>/work/<job_id>/)."),
    max_jobs: int = typer.Option(None, "--max-jobs", metavar="N",
                                 help="Concurrent jobs, 1..64 (§11; default MAM_RUNNER_MAX_JOBS, else 1)."),
    once: bool = typer.Option(False, "--once", help="Exit after one job (once the broker has its "
                                                            "events; it waits up to 30 s for one that is down)."),
    labels: str = typer.Option(None, "--labels", metavar="A,B",
                               help="Labels this runner announces, e.g. gpu,cuda12 (§14; default "
                                    "MAM_RUNNER_LABELS, else the enrolled labels): lowercase letters, digits, "
                                    "'_.:-', at most 16."),
    replace: bool = typer.Option(False, "--replace",
                                 help="Start even if another runner is online under this session (§7), "
                                      "e.g. after a kill -9 before the broker noticed."),
    repo: list[str] = REPO_OPTION,
    max_result_bytes: int = typer.Option(50_000_000, "--max-result-bytes", metavar="N",
                                         help="A result's change sent at most, bytes; over it only the diffstat "
                                              "and a result_too_large note (§18)."),
    keep_worktrees: bool = typer.Option(False, "--keep-worktrees",
                                        help="Keep worktrees a stopped runner left instead of removing them."),
    agent: str = typer.Option(None, "--agent", metavar="KIND",
                              help="How to run and read the agent (§18): claude (Claude Code in print mode "
                                   "with a stream-json stream: session, turns, tokens, cost; a denied tool "
                                   "is an error), codex (codex exec --json: thread, turns, tokens) or "
                                   "command (any executable; its exit status is the verdict). Default: "
                                   "claude or codex when the executable has that name, else command."),
    on_revoke: str = typer.Option("stop", "--on-revoke", metavar="stop|finish",
                                  help="When the hub revokes this runner (§16.7): stop cancels its running "
                                       "jobs at once, finish lets them end; nothing new is taken, then exit 77."),
    gpus: str = typer.Option(None, "--gpus", metavar="auto|none|0,1",
                             help="GPUs this runner serves (§14): auto asks nvidia-smi, or device indices; "
                                  "a job dispatched with --gpus N gets N of them (CUDA_VISIBLE_DEVICES) and no "
                                  "other job sees those; it also announces the labels gpu and gpu:<model>. "
                                  "Default MAM_RUNNER_GPUS, else none."),
) -> int:
    """Serve a session: take signed dispatches, run the agent under a heartbeat,
    publish its events; presence and Last Will on one connection (PROTOCOL §5-§7, §11).

    SIGTERM/SIGINT drains (running jobs finish, nothing new is taken); a second
    one cancels the running jobs. Exit codes: 0 clean exit; 3 broker unreachable;
    64 bad arguments, missing MAM_DISPATCH_SECRET, or the session is held by
    another live runner; 77 the hub revoked this runner (`mam-orch runner revoke`).
    """
    cli.setup_logging()
    from mam.runner.service import run_cli  # lazy: keeps paho/psutil out of `mam-runner publish`

    return run_cli(session=session, exec_cmd=exec_cmd, workspace=workspace, workdir=workdir,
                   max_jobs=max_jobs, once=once, replace=replace, labels=labels, repos=repo or None,
                   max_result_bytes=max_result_bytes, keep_worktrees=keep_worktrees, agent=agent,
                   on_revoke=on_revoke, gpus=gpus)


@app.command("gc")
def gc_cmd(
    ttl: float = typer.Option(86400.0, "--ttl", metavar="S",
                              help="Remove finished worktrees older than this many seconds (default 24 h)."),
    workspace: str = cli.workspace_option(),
) -> int:
    """Remove finished attempt worktrees older than --ttl and prune the mirrors (§18).

    A running runner removes them itself at start; this is for a host whose runner is
    stopped or long-lived. Exit codes: 0 done; 64 bad arguments.
    """
    cli.setup_logging()
    from mam.runner.repos import Repos

    if not ttl >= 0:
        raise UsageError(f"--ttl {ttl!r} is invalid: expected seconds >= 0")
    root = resolve_root(workspace)
    mirrors = Repos(root, [])
    removed = mirrors.gc(ttl)
    print(f"removed {len(removed)} finished worktree(s) under {mirrors.worktrees_dir}")
    return 0


@app.command("enroll")
def enroll_cmd(
    session: str = typer.Option(None, "--session", metavar="NAME", help="The session this runner serves (§1)."),
    labels: str = typer.Option(None, "--labels", metavar="L1,L2", help="Its labels, comma-separated (§14)."),
    force: bool = typer.Option(False, "--force", help="Make new keys even if this host has some."),
    invite: str = typer.Option(None, "--invite", metavar="CODE",
                               help="Enrol over the broker with the code `mam-orch runner invite` printed."),
    hub: str = typer.Option(None, "--hub", metavar="HOST",
                            help="With --invite: the broker host (default: the code's, else .mam.env)."),
    port: int = typer.Option(None, "--port", metavar="P",
                             help="With --invite: the broker port (default: the code's, else .mam.env)."),
    timeout: float = typer.Option(INVITE_ANSWER_TIMEOUT_S, "--timeout", metavar="S",
                                  help="With --invite: how long to wait for the hub's answer (s)."),
    repo: list[str] = ENROL_REPO_OPTION,
    max_jobs: int = typer.Option(None, "--max-jobs", metavar="N",
                                 help="Concurrent jobs `run` takes by default, 1..64 (MAM_RUNNER_MAX_JOBS "
                                      "in .mam.env)."),
    workspace: str = cli.workspace_option(),
) -> int:
    """Make this host's Ed25519 and X25519 keys (0600, .mam/keys/) and print the one-line
    enrolment request for `mam-orch runner add` on the hub (PROTOCOL §16). The request holds
    public keys only. With --invite CODE the exchange happens over the broker instead: the hub's
    waiting `mam-orch runner invite` enrols the keys (existing ones are reused unless --force),
    this host stores the hub's public key, and the broker settings the code carries go into
    .mam.env; on failure the keys it made are removed. Exit 64: bad arguments, or keys exist (without
    --force); 1: the hub refused the invite or did not answer; 3: broker unreachable.
    --repo and --max-jobs become `run`'s defaults (in .mam.env, 0600; a flag of `run` still wins)."""
    from mam.runner.settings import run_defaults

    defaults = run_defaults(repo, max_jobs)  # refused before any key is made
    if invite is not None:
        from mam.runner.enrolinvite import enroll_by_invite  # lazy: keeps cryptography out of `mam-runner publish`

        if labels is not None:
            raise UsageError("--labels is set by the hub with an invite (mam-orch runner invite --labels)")
        enrolled = enroll_by_invite(invite, workspace=workspace, session=session, hub=hub, port=port,
                                    force=force, timeout_s=timeout, defaults=defaults)
        identity, trusted = enrolled.identity, enrolled.trusted
        typer.echo(f"enrolled as {identity.session} (labels: {','.join(identity.labels) or 'none'}); this runner "
                   f"now trusts {len(trusted)} hub key(s): {' '.join(trusted)}")
        if enrolled.env_file is not None:
            where = [name for name in enrolled.written if name not in ("MQTT_USERNAME", "MQTT_PASSWORD")]
            if where:
                typer.echo(f"{', '.join(where)} set in {enrolled.env_file} (mode 0600)")
            if enrolled.broker_user:
                typer.echo(f"broker user {enrolled.broker_user}: MQTT_USERNAME and MQTT_PASSWORD set in "
                           f"{enrolled.env_file} (mode 0600)")
            overridden = [name for name in enrolled.written if os.environ.get(name)]
            if overridden:
                typer.echo(f"warning: {' and '.join(overridden)} set in the environment override that file",
                           err=True)
        return 0
    if session is None or hub is not None or port is not None:
        raise UsageError("give --session NAME (manual enrolment), or --invite CODE [--hub HOST --port P]")
    from mam.runner.enrol import enroll  # lazy: keeps cryptography out of `mam-runner publish`

    request = enroll(session=session, labels=labels, workspace=workspace, force=force)
    typer.echo(request.line())
    if defaults:
        from mam.runner.enrol import write_env
        from mam.shared.store.root import resolve_root

        written = write_env(resolve_root(workspace), defaults)
        typer.echo(f"{', '.join(defaults)} set in {written} (mode 0600): `run`'s defaults", err=True)
    typer.echo("give the line above to the hub operator: mam-orch runner add '<line>'; then run the "
               "`mam-runner trust-hub ...` line it prints", err=True)
    return 0


_HUB_KEYS_ARGUMENT = typer.Argument(..., metavar="PUB [PUB]",
                                    help="The hub's Ed25519 public key; during a rotation, two.")


@app.command("trust-hub")
def trust_hub_cmd(
    public_keys: list[str] = _HUB_KEYS_ARGUMENT,
    workspace: str = cli.workspace_option(),
) -> int:
    """Store the hub public keys this runner accepts dispatches and cancels from (PROTOCOL §16),
    replacing the ones stored before. Put `--` before the keys: base64url may start with '-'.
    Exit 64: not a key, or more than two."""
    from mam.runner.enrol import trust_hub  # lazy: keeps cryptography out of `mam-runner publish`

    stored = trust_hub(public_keys, workspace=workspace)
    typer.echo(f"this runner now trusts {len(stored)} hub key(s): {' '.join(stored)}")
    return 0


def publish_cli(*, job_id: str, event: str, detail: str, data: str | None, attempt_id: str | None,
                dispatch_token: str | None, heartbeat_s: float | None, watch_pid: int | None,
                attempts: int, workspace: str | None) -> int:
    """`mam-runner publish`: disk first, then the wire (§3, §4, §12).

    Returns:
        the exit code of §9: 0 published, 1 refused, 2 transport failure (on disk).
    Raises:
        UsageError (exit 64) for bad arguments.
    """
    # lazy: the publish core (registry, crypto) loads only for this command (publish fast path)
    from mam.runner import publish
    from mam.shared.protocol import wire
    from mam.shared.store.registry import Registry

    request = publish.make_request(job_id, event, detail, data, attempt_id, dispatch_token)
    if heartbeat_s is not None and (event != "started" or heartbeat_s <= 0):
        raise UsageError("--heartbeat N needs --event started and N > 0 (§12)")
    if attempts < 1 or attempts > MAX_PUBLISH_ATTEMPTS:
        raise UsageError(f"--attempts {attempts} is invalid: expected 1..{MAX_PUBLISH_ATTEMPTS}")
    watch = None
    if heartbeat_s is not None:
        from mam.runner import barrier  # lazy: only `--heartbeat` starts a timer (publish fast path)

        try:
            watch = barrier.WatchedProcess.of(watch_pid if watch_pid is not None else barrier.default_watch_pid())
        except MamError as exc:
            raise UsageError(str(exc)) from None
    registry = Registry(resolve_root(workspace))
    try:
        config = publish.broker_for(registry, request.job_id)  # before any write: bad config loses nothing
        published = publish.record(registry, request)
    except (ProtocolError, RegistryError) as exc:
        print(f"ERROR: refused: {exc}", file=sys.stderr)
        return ExitCode.REFUSED
    exit_code = ExitCode.PUBLISHED
    try:
        publish.send(published, config, attempts=attempts)
    except BrokerError as exc:
        kept = "; kept in the outbox: a runner daemon on this workspace re-sends it" if published.entry else ""
        print(f"ERROR: job {request.job_id} seq {published.seq} is on disk but not published: {exc}{kept}",
              file=sys.stderr)
        exit_code = ExitCode.TRANSPORT
    if watch is not None and heartbeat_s is not None:
        from mam.runner.heartbeat import timer  # lazy: only `--heartbeat` starts a timer (publish fast path)

        rec = registry.get(request.job_id)
        timer.start_timer(registry, request.job_id, attempt_id=rec["attempt_id"],
                              dispatch_token=rec["dispatch_token"], interval_s=heartbeat_s,
                              watch=watch, timeout_s=float(rec.get("timeout_sec") or wire.Contract.timeout_sec))
    print(json.dumps({"job_id": request.job_id, "seq": published.seq, "event": request.event,
                      "published": exit_code == ExitCode.PUBLISHED}))
    return exit_code


def main() -> None:
    """Console-script entry point."""
    cli.run(app, "mam-runner")


if __name__ == "__main__":
    main()
