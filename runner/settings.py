"""What `mam-runner run` was asked to do: `RunnerOptions`, validated once from
the command line and every runner `MAM_*` setting (PROTOCOL §5, §6, §7, §11, §13).

The settings are read from ONE resolution of the environment and `.mam.env`
(`config.load_env`), not once per setting.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mam.runner import agents, barrier, enrol, logstream
from mam.runner.agent import resolve_executable, split_exec
from mam.runner.gpus import GPUS_ENV
from mam.runner.gpus import parse_spec as parse_gpus
from mam.runner.repos import REPOS_ENV, RepoSpec, parse_repos
from mam.shared import config
from mam.shared.protocol import names
from mam.shared.protocol.crypto.keys import EnrolRequest
from mam.shared.protocol.errors import ConfigError, UsageError
from mam.shared.store.root import resolve_root

MAX_JOBS_ENV = "MAM_RUNNER_MAX_JOBS"
MAX_JOBS_LIMIT = 64
"""Highest `--max-jobs` (§11)."""
DEFAULT_CANCEL_GRACE_S = 10.0
DEFAULT_CLOCK_SKEW_S = 30.0
DEFAULT_PRESENCE_WAIT_S = 1.0
DEFAULT_PRESENCE_REFRESH_S = 60.0
"""Presence is republished at least this often, so the hub can tell a live runner from a
replayed or long-dead `online` (§7); the hub calls presence older than 3 periods stale."""
DEFAULT_AGENT_LINGER_S = 30.0
"""An agent that published its own terminal event (§11 step 5) may take this long to exit
before the runner stops it: the job is over, and its slot must come back."""


@dataclass(frozen=True)
class Seconds:
    """One `MAM_*` duration setting: its name, default and accepted range, in seconds."""

    name: str
    default_s: float
    low_s: float
    high_s: float


CANCEL_GRACE = Seconds("MAM_CANCEL_GRACE_S", DEFAULT_CANCEL_GRACE_S, 0.0, 3600.0)
CLOCK_SKEW = Seconds("MAM_CLOCK_SKEW_S", DEFAULT_CLOCK_SKEW_S, 0.0, 86400.0)
PRESENCE_WAIT = Seconds("MAM_PRESENCE_WAIT_S", DEFAULT_PRESENCE_WAIT_S, 0.0, 60.0)
PRESENCE_REFRESH = Seconds("MAM_PRESENCE_REFRESH_S", DEFAULT_PRESENCE_REFRESH_S, 1.0, 60.0)
AGENT_LINGER = Seconds("MAM_AGENT_LINGER_S", DEFAULT_AGENT_LINGER_S, 0.0, 86400.0)
LABELS_ENV = "MAM_RUNNER_LABELS"
ON_REVOKE = ("stop", "finish")
"""`run --on-revoke`: a revoked runner cancels its running jobs, or lets them end (§16.7)."""
DEFAULT_MAX_RESULT_BYTES = 50 * 1000 * 1000
"""A result's change (bundle + patch) sent at most, bytes (§18); `--max-result-bytes`."""
MAX_RESULT_BYTES_LIMIT = 1 << 30
MIN_RESULT_BYTES = 1024
HEARTBEAT_DRAIN = Seconds("MAM_HEARTBEAT_DRAIN_S", barrier.DEFAULT_DRAIN_S, 0.0, barrier.DRAIN_HIGH_S)
LEASE_MARGIN = Seconds("MAM_LEASE_MARGIN_S", 0.0, 0.1, 3600.0)
"""§10 "Leases": unset (the default) is `lease.margin_for`'s share of each lease."""


def read_seconds(values: Mapping[str, str], setting: Seconds) -> float:
    """The value of `setting` in the resolved settings `values`, in seconds.

    Raises:
        ConfigError: not a number, or outside `low_s..high_s` (same text as `config.env_float`).
    """
    value = values.get(setting.name)
    if value in (None, ""):
        return setting.default_s
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{setting.name}={value!r} is invalid: expected a number of seconds") from None
    if not setting.low_s <= number <= setting.high_s:
        raise ConfigError(f"{setting.name}={number} is out of range {setting.low_s}..{setting.high_s}")
    return number


@dataclass(frozen=True)
class RunnerOptions:
    """What `mam-runner run` was asked to do (validated by `options_from_cli`).

    Attributes:
        session: the runner's session name (§1).
        argv: the agent command (`split_exec` output).
        root: the registry root (§8).
        workdir: the agents' working directory; None = `<root>/work/<job_id>/`.
        max_jobs: concurrent jobs, 1..64 (§11).
        once: exit after one job.
        replace: start even if another runner is live under the session (§7).
        cancel_grace_s: seconds between SIGTERM and SIGKILL on cancel (§6).
        clock_skew_s: tolerance on `expires_at`, seconds (§5).
        presence_wait_s: how long to wait for the session's retained presence at start.
        presence_refresh_s: republish presence at least this often (§7; hub: stale after 3 periods).
        agent_linger_s: how long an agent may run on after publishing its own terminal event.
        heartbeat_drain_s: how long a heartbeat timer may take to exit before a terminal event (§12).
        lease_margin_s: MAM_LEASE_MARGIN_S, how long before its lease ends an attempt fences itself
            (§10 "Leases"); None = a quarter of the lease, 0.5-10 s.
        labels: the labels its presence announces, sorted (§14; `--labels`, else MAM_RUNNER_LABELS).
        log_rate_bps: MAM_LOG_RATE_BPS, the agent's output sent to the hub per second at most (§15).
        repos: the repositories it serves (§18; `--repo NAME=URL`, else MAM_RUNNER_REPOS).
        max_result_bytes: a result's change sent at most, bytes (§18).
        keep_worktrees: keep the worktrees a stopped runner left (§18), for a look at them.
        agent: the agent adapter's kind (`agents.KINDS`: claude, command; §18).
        on_revoke: what a revocation notice does to running jobs (§16.7): `stop` cancels
            them now, `finish` lets them end; either way nothing new is taken, then exit 77.
        gpus: `--gpus` parsed (§14 "GPUs"): "auto" (ask nvidia-smi at start), or device indices
            (none: no GPUs).
    """

    session: str
    argv: tuple[str, ...]
    root: Path
    workdir: Path | None = None
    max_jobs: int = 1
    once: bool = False
    replace: bool = False
    cancel_grace_s: float = DEFAULT_CANCEL_GRACE_S
    clock_skew_s: float = DEFAULT_CLOCK_SKEW_S
    presence_wait_s: float = DEFAULT_PRESENCE_WAIT_S
    presence_refresh_s: float = DEFAULT_PRESENCE_REFRESH_S
    agent_linger_s: float = DEFAULT_AGENT_LINGER_S
    heartbeat_drain_s: float = barrier.DEFAULT_DRAIN_S
    lease_margin_s: float | None = None
    labels: tuple[str, ...] = ()
    log_rate_bps: int = logstream.DEFAULT_RATE_BPS
    repos: tuple[RepoSpec, ...] = ()
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    keep_worktrees: bool = False
    agent: str = "command"
    on_revoke: str = "stop"
    gpus: str | tuple[str, ...] = ()


def check_max_jobs(value: object, where: str) -> int:
    """A slot count 1..MAX_JOBS_LIMIT (§11), from `--max-jobs` (an int) or MAM_RUNNER_MAX_JOBS
    (text). Raises `UsageError` naming `where`."""
    number = value
    if isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= MAX_JOBS_LIMIT:
        shown = value if isinstance(value, int) else repr(str(value)[:40])
        raise UsageError(f"{where} {shown} is invalid: expected 1..{MAX_JOBS_LIMIT}")
    return number


def run_defaults(repos: list[str] | None, max_jobs: int | None) -> dict[str, str]:
    """`enroll --repo ... --max-jobs N` as the `.mam.env` lines that make them `run`'s defaults
    (MAM_RUNNER_REPOS, MAM_RUNNER_MAX_JOBS; a flag of `run` still overrides).

    Raises:
        UsageError: a bad repository or slot count (one line, before anything is written).
    """
    values = {}
    if repos:
        specs = parse_repos(repos, None)
        values[REPOS_ENV] = " ".join(f"{spec.name}={spec.url}" for spec in specs)
    if max_jobs is not None:
        values[MAX_JOBS_ENV] = str(check_max_jobs(max_jobs, "--max-jobs"))
    return values


def read_labels(labels: str | None, values: Mapping[str, str], default: tuple[str, ...] = ()) -> tuple[str, ...]:
    """`--labels a,b`, else MAM_RUNNER_LABELS, else `default` (the enrolled labels), validated
    and sorted (§14).

    Raises:
        UsageError: a bad label, an empty item, more than 16, a label twice (one line).
    """
    if labels is not None:
        return names.parse_labels(labels, "--labels")
    from_env = values.get(LABELS_ENV, "")
    return names.parse_labels(from_env, LABELS_ENV) if from_env.strip() else tuple(sorted(default))


def _workdir(workdir: str | None) -> Path | None:
    """`--workdir` as an absolute, existing directory (created if missing), or None."""
    if workdir is None:
        return None
    if not workdir.strip():
        raise UsageError("--workdir is empty: give a directory")
    work = Path(workdir).expanduser().absolute()
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--workdir {workdir!r} cannot be created: {exc.strerror or exc}") from None
    if not work.is_dir():
        raise UsageError(f"--workdir {workdir!r} is not a directory")
    return work


def options_from_cli(*, session: str | None, exec_cmd: str, workspace: str | None, workdir: str | None,
                     max_jobs: int | None, once: bool, replace: bool, labels: str | None = None,
                     environ: Mapping[str, str] | None = None, repos: list[str] | None = None,
                     max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
                     keep_worktrees: bool = False, agent: str | None = None,
                     on_revoke: str = "stop", gpus: str | None = None) -> RunnerOptions:
    """Validate `mam-runner run` arguments before any network or registry write.

    Args:
        session: session name, or None: the one `mam-runner enroll` recorded (§16);
        exec_cmd: the `--exec` string; workspace: `--workspace`;
        workdir: `--workdir` (created if missing); max_jobs: 1..64 (None: MAM_RUNNER_MAX_JOBS, which
            `enroll --max-jobs` writes, else 1); labels: `--labels a,b` (§14),
            else MAM_RUNNER_LABELS, else the labels enrolment recorded.
        repos: `--repo NAME=URL` flags; max_result_bytes: `--max-result-bytes`;
        keep_worktrees: `--keep-worktrees` (§18).
        agent: `--agent` (None: `agents.default_kind` of the command).
        on_revoke: `--on-revoke` (ON_REVOKE: stop or finish, §16.7).
        gpus: `--gpus auto|none|0,1` (§14), else MAM_RUNNER_GPUS, else none.
        environ: the process environment (default os.environ).
    Returns:
        RunnerOptions.
    Raises:
        UsageError: one line naming the bad argument (exit 64).
        ConfigError: a MAM_*_S setting out of range (exit 64).
        EnvFileError: the chosen `.mam.env` cannot be read (exit 1).
    """
    env = os.environ if environ is None else environ
    if session is not None:
        names.validate_session(session)
    argv = split_exec(exec_cmd)
    resolve_executable(argv[0], env.get("PATH"))
    kind = agent_kind(agent, argv)
    if max_jobs is not None:
        check_max_jobs(max_jobs, "--max-jobs")
    if labels is not None:
        names.parse_labels(labels, "--labels")  # a bad flag is refused before anything is read
    if isinstance(max_result_bytes, bool) or not MIN_RESULT_BYTES <= max_result_bytes <= MAX_RESULT_BYTES_LIMIT:
        raise UsageError(f"--max-result-bytes {max_result_bytes!r} is invalid: expected "
                         f"{MIN_RESULT_BYTES}..{MAX_RESULT_BYTES_LIMIT}")
    if on_revoke not in ON_REVOKE:
        raise UsageError(f"--on-revoke {on_revoke!r} is invalid: expected {' or '.join(ON_REVOKE)}")
    if repos:
        parse_repos(repos, None)
    if gpus is not None:
        parse_gpus(gpus)
    root = resolve_root(workspace, env)
    enrolled = enrol.identity(root)
    session = enrolled_session(session, enrolled)
    work = _workdir(workdir)
    values = config.load_env(env, workspace=root)  # the workspace's .mam.env, as for the broker (§13)
    if max_jobs is None:
        max_jobs = check_max_jobs(values.get(MAX_JOBS_ENV) or "1", MAX_JOBS_ENV)
    return RunnerOptions(session=session, argv=tuple(argv), root=root, workdir=work, max_jobs=max_jobs,
                         once=once, replace=replace, cancel_grace_s=read_seconds(values, CANCEL_GRACE),
                         clock_skew_s=read_seconds(values, CLOCK_SKEW),
                         presence_wait_s=read_seconds(values, PRESENCE_WAIT),
                         presence_refresh_s=read_seconds(values, PRESENCE_REFRESH),
                         agent_linger_s=read_seconds(values, AGENT_LINGER),
                         heartbeat_drain_s=read_seconds(values, HEARTBEAT_DRAIN),
                         lease_margin_s=read_seconds(values, LEASE_MARGIN) if values.get(LEASE_MARGIN.name) else None,
                         labels=read_labels(labels, values, enrolled.labels if enrolled else ()),
                         log_rate_bps=logstream.rate_from_env(values),
                         repos=parse_repos(repos or [], values.get(REPOS_ENV)),
                         max_result_bytes=max_result_bytes, keep_worktrees=keep_worktrees, agent=kind,
                         on_revoke=on_revoke,
                         gpus=parse_gpus(gpus) if gpus is not None else parse_gpus(values.get(GPUS_ENV, ""), GPUS_ENV))


def enrolled_session(session: str | None, enrolled: EnrolRequest | None) -> str:
    """`--session`, else the session enrolment recorded (§16); an enrolled host serves only that one.

    Raises:
        UsageError: no --session on a host never enrolled, or another session than the enrolled one.
    """
    if enrolled is None:
        if session is None:
            raise UsageError("--session is missing: give --session NAME, or enrol this host first "
                             "(mam-runner enroll --invite CODE)")
        return session
    if session is not None and session != enrolled.session:
        raise UsageError(f"--session {session} is not this host's enrolled session {enrolled.session} "
                         "(.mam/keys/runner.json): the hub verifies its presence only under that name; "
                         "drop --session, or enrol again with mam-runner enroll --force")
    return enrolled.session


def agent_kind(agent: str | None, argv: list[str]) -> str:
    """`--agent`, else the command's default (§18), checked against the command line.

    Raises:
        UsageError: an unknown kind, or a command line the adapter cannot read (one line).
    """
    kind = agents.default_kind(argv) if agent is None else agent.strip().lower()
    if kind not in agents.KINDS:
        raise UsageError(f"--agent {agent!r} is invalid: expected one of {', '.join(agents.KINDS)}")
    try:
        agents.new_adapter(kind).argv(list(argv))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return kind


__all__ = ["MAX_JOBS_LIMIT", "ON_REVOKE", "RunnerOptions", "Seconds", "agent_kind", "enrolled_session",
           "options_from_cli", "read_labels", "read_seconds"]
