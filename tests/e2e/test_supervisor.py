"""runner/agent.py and runner/process_tree.py with real processes and real signals (PROTOCOL §6, §11),
and the example agents of examples/agents/."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from harness.procs import gone
from harness.waiting import PATIENCE_S, wait_until

from mam.runner import cgroups
from mam.runner.agent import (
    BRIEF_OMITTED_ENV,
    EXEC_MAX_CHARS,
    SECRET_ENV_NAMES,
    AgentProcess,
    AgentStartError,
    ExitStatus,
    agent_env,
    split_exec,
)
from mam.runner.process_tree import AGENT_TAG_ENV, AgentIdentity, stop_orphan
from mam.shared.protocol.errors import RegistryError, UsageError

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
AGENTS = REPO / "examples" / "agents"
JOB_ID = "918b0612"
TOKEN = "0123456789abcdef0123456789abcdef"


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/usr/bin/env bash\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


@pytest.fixture
def run_agent(tmp_path):
    """Start agents; whatever a test leaves running is cancelled at teardown."""
    started: list[AgentProcess] = []

    def _run(argv, *, stdin_text="", env=None, cwd=None, log_path=None, keep_stdin=False, cgroup=None):
        agent = AgentProcess(track_interval_s=0.1)
        agent.start(
            [str(a) for a in argv],
            env=env if env is not None else dict(os.environ),
            cwd=cwd or tmp_path / "work",
            stdin_text=stdin_text,
            log_path=log_path or tmp_path / "logs" / "agent.log",
            keep_stdin=keep_stdin,
            cgroup=cgroup,
        )
        started.append(agent)
        return agent

    yield _run
    for agent in started:
        if agent.poll() is None:
            agent.cancel(grace_s=0.0)
        agent.close()


# ------------------------------------------------------------ split_exec (§11)


def test_split_exec_splits_like_a_shell_without_a_shell():
    assert split_exec("claude -p --dangerously-skip-permissions") == [
        "claude", "-p", "--dangerously-skip-permissions"]
    assert split_exec("""agent 'a b' "c d" e\\ f $HOME;rm""") == ["agent", "a b", "c d", "e f", "$HOME;rm"]


@pytest.mark.parametrize("cmd, needle", [
    ("", "is empty"),
    ("   \t ", "is empty"),
    ("''", "is empty"),
    ("claude 'unbalanced", "no closing quotation"),
    ('claude "unbalanced', "no closing quotation"),
    ("claude \\", "no escaped character"),
    ("claude\x00-p", "NUL"),
    ("x" * (EXEC_MAX_CHARS + 1), "too long"),
])
def test_split_exec_refuses_bad_strings_with_one_line(cmd, needle):
    with pytest.raises(UsageError) as info:
        split_exec(cmd)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message and len(message) < 200


def test_start_refuses_missing_and_non_executable_commands(tmp_path, run_agent):
    with pytest.raises(AgentStartError, match="'no-such-agent-xyz' not found on PATH"):
        run_agent(["no-such-agent-xyz"])
    with pytest.raises(AgentStartError, match="not found"):
        run_agent([tmp_path / "missing" / "agent"])
    plain = tmp_path / "plain.sh"
    plain.write_text("echo hi\n")
    plain.chmod(0o644)
    with pytest.raises(AgentStartError, match="is not executable"):
        run_agent([plain])
    with pytest.raises(AgentStartError, match="is a directory"):
        run_agent([tmp_path])
    no_shebang = tmp_path / "noshebang"
    no_shebang.write_bytes(b"\x00\x01garbage")
    no_shebang.chmod(0o755)
    with pytest.raises(AgentStartError, match="exec format error"):
        run_agent([no_shebang])
    assert isinstance(AgentStartError("x"), UsageError)  # exit 64 through clikit


# ------------------------------------------------------- exit mapping (§11.5)


def test_exit_0_maps_to_completed(run_agent):
    agent = run_agent([AGENTS / "exit-agent", "0"])
    status = agent.wait(timeout_s=PATIENCE_S)
    assert status == ExitStatus(exit_code=0, signal=None)
    assert status.terminal() == ("completed", "", 0)


def test_exit_3_maps_to_error_with_code(run_agent):
    agent = run_agent([AGENTS / "exit-agent"], stdin_text="3\n")
    status = agent.wait(timeout_s=PATIENCE_S)
    assert status == ExitStatus(exit_code=3, signal=None)
    assert status.terminal() == ("error", "agent exited with code 3", 3)


def test_killed_by_signal_maps_to_error_with_128_plus_signal(tmp_path, run_agent):
    agent = run_agent([script(tmp_path, "suicide", "kill -KILL $$\n")])
    status = agent.wait(timeout_s=PATIENCE_S)
    assert status == ExitStatus(exit_code=None, signal=signal.SIGKILL)
    assert status.terminal() == ("error", "agent killed by signal 9", 128 + 9)


def test_wait_with_timeout_returns_none_while_running(tmp_path, run_agent):
    agent = run_agent([AGENTS / "sleep-agent", "60"])
    assert agent.wait(timeout_s=0.05) is None
    assert agent.poll() is None


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "no-pidfd"])
def test_a_timed_wait_sleeps_in_the_kernel_until_the_exit(tmp_path, run_agent, monkeypatch, pidfd):
    """With a pidfd, `wait` blocks in poll(2) until the agent exits, not in `Popen.wait`'s
    loop of growing sleeps; without one (older kernels) that loop still gives the status."""
    if not pidfd:
        def no_pidfd(pid, flags=0):
            raise OSError(38, "Function not implemented")
        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    agent = run_agent([script(tmp_path, "nap", "sleep 0.3\nexit 4\n")])
    main, real_sleep, sleeps = threading.current_thread(), time.sleep, []

    def counted_sleep(seconds):
        if threading.current_thread() is main:
            sleeps.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", counted_sleep)
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(exit_code=4, signal=None)
    assert agent.wait(timeout_s=0) == ExitStatus(exit_code=4, signal=None)  # reaped: the status again
    assert (sleeps == []) is pidfd


def test_start_twice_is_refused(run_agent, tmp_path):
    agent = run_agent([AGENTS / "exit-agent", "0"])
    with pytest.raises(Exception, match="already started"):
        agent.start(["true"], env=dict(os.environ), cwd=tmp_path, stdin_text="", log_path=tmp_path / "l")
    agent.wait(timeout_s=PATIENCE_S)


# ------------------------------------------------------------ stdin and log


@pytest.mark.parametrize("size", [20, 300 * 1024], ids=["small", "300KiB"])
def test_brief_is_delivered_on_stdin(tmp_path, run_agent, size):
    brief = ("répète " * (size // 8 + 1))[:size]
    out = tmp_path / "got.txt"
    agent = run_agent([script(tmp_path, "reader", f'cat > "{out}"\n')], stdin_text=brief)
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(0, None)
    assert out.read_text(encoding="utf-8") == brief


def test_a_brief_the_pipe_takes_at_once_needs_no_writer_thread(tmp_path, run_agent, monkeypatch):
    """The common brief fits in the pipe's buffer: it is written and stdin closed before
    start() returns, with no thread per agent to wait on it; a larger one gets the thread."""
    started: list[str] = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self.name) or real_start(self))
    out = tmp_path / "got.txt"
    reader = script(tmp_path, "reader", f'sleep 0.3; cat > "{out}"\n')  # reads only after start() returned
    agent = run_agent([reader], stdin_text="short brief")
    assert f"agent-stdin-{agent.pid}" not in started
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(0, None)
    assert out.read_text(encoding="utf-8") == "short brief"
    big = "y" * (1024 * 1024)
    agent = run_agent([reader], stdin_text=big)
    assert f"agent-stdin-{agent.pid}" in started
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(0, None)
    assert out.read_text(encoding="utf-8") == big


def test_agent_that_never_reads_stdin_does_not_block(tmp_path, run_agent):
    brief = "x" * (1024 * 1024)  # far beyond a pipe buffer
    agent = run_agent([AGENTS / "exit-agent", "0"], stdin_text=brief)
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(0, None)


def test_kept_stdin_takes_more_input_until_it_is_closed(tmp_path, run_agent):
    """§18 "Input while it runs": after the brief, messages reach the running agent in order;
    closing stdin ends an agent that reads to its end, and nothing is taken after that."""
    out = tmp_path / "got.txt"
    agent = run_agent([script(tmp_path, "reader", f'cat > "{out}"\n')], stdin_text="brief\n", keep_stdin=True)
    assert agent.send_input(b"one\n") and agent.send_input("twö\n".encode())
    wait_until(lambda: out.exists() and out.read_text(encoding="utf-8") == "brief\none\ntwö\n", PATIENCE_S,
               "the messages read by the agent")
    assert agent.poll() is None  # it still waits for more
    agent.close_input()
    agent.close_input()  # idempotent
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(0, None)
    assert not agent.send_input(b"late\n")
    assert out.read_text(encoding="utf-8") == "brief\none\ntwö\n"


def test_input_to_an_agent_that_exited_is_refused_and_never_blocks(tmp_path, run_agent):
    agent = run_agent([AGENTS / "exit-agent", "0"], stdin_text="x" * (1024 * 1024), keep_stdin=True)
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(0, None)
    assert not agent.send_input(b"anyone there?\n")


def test_log_gets_stdout_and_stderr_with_mode_0600(tmp_path, run_agent):
    log_path = tmp_path / "logs" / JOB_ID / "agent.log"
    agent = run_agent([AGENTS / "exit-agent", "5"], log_path=log_path)
    assert agent.wait(timeout_s=PATIENCE_S).exit_code == 5
    text = log_path.read_text()
    assert "exit-agent: stdout, exiting with 5" in text
    assert "exit-agent: stderr, exiting with 5" in text
    assert stat.S_IMODE(log_path.stat().st_mode) == 0o600
    # Appends: a second agent keeps the first one's lines.
    again = run_agent([AGENTS / "exit-agent", "0"], log_path=log_path)
    again.wait(timeout_s=PATIENCE_S)
    assert "exiting with 5" in log_path.read_text() and "exiting with 0" in log_path.read_text()


def test_existing_log_is_tightened_to_0600(tmp_path, run_agent):
    log_path = tmp_path / "agent.log"
    log_path.write_text("old\n")
    log_path.chmod(0o644)
    run_agent([AGENTS / "exit-agent", "0"], log_path=log_path).wait(timeout_s=PATIENCE_S)
    assert stat.S_IMODE(log_path.stat().st_mode) == 0o600
    assert log_path.read_text().startswith("old\n")


def test_log_path_that_is_a_symlink_is_refused(tmp_path, run_agent):
    target = tmp_path / "victim.txt"
    target.write_text("keep\n")
    target.chmod(0o644)
    log_path = tmp_path / "agent.log"
    log_path.symlink_to(target)
    with pytest.raises(RegistryError, match="is a symlink"):
        run_agent([AGENTS / "exit-agent", "0"], log_path=log_path)
    assert target.read_text() == "keep\n" and stat.S_IMODE(target.stat().st_mode) == 0o644


def test_cwd_is_created_and_used(tmp_path, run_agent):
    cwd = tmp_path / "ws" / "work" / JOB_ID
    out = tmp_path / "pwd.txt"
    agent = run_agent([script(tmp_path, "pwd-agent", f'pwd > "{out}"\n')], cwd=cwd)
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(0, None)
    assert out.read_text().strip() == str(cwd)


def test_agent_runs_in_its_own_session_and_process_group(run_agent):
    agent = run_agent([AGENTS / "sleep-agent", "60"])
    assert os.getpgid(agent.pid) == agent.pid
    assert os.getsid(agent.pid) == agent.pid
    assert os.getpgid(agent.pid) != os.getpgid(0)


# ------------------------------------------------------------- cancel (§6)


def _tree_script(tmp_path: Path, pidfile: Path) -> Path:
    """An agent with three hard-to-kill descendants: one ignoring SIGTERM, one in its
    own session (setsid), and one double-forked into its own session and reparented."""
    return script(tmp_path, "tree-agent", f"""\
        trap '' TERM
        (trap '' TERM; exec sleep 1000) </dev/null &
        stubborn=$!
        setsid sleep 1000 </dev/null &
        own_session=$!
        ( setsid sleep 1000 </dev/null & echo $! > "{pidfile}.orphan" ) &
        wait $!
        echo "$stubborn $own_session $(cat "{pidfile}.orphan")" > "{pidfile}.tmp"
        mv "{pidfile}.tmp" "{pidfile}"
        while :; do sleep 1; done
        """)


def test_cancel_kills_agent_and_every_grandchild_within_grace(tmp_path, run_agent):
    """§6: SIGTERM to the group, SIGKILL to the remaining tree after the grace,
    including a TERM-ignoring child, a setsid child and a double-forked orphan."""
    pidfile = tmp_path / "pids"
    agent = run_agent([_tree_script(tmp_path, pidfile)])
    wait_until(pidfile.exists, what="the agent's pid file")
    pids = [agent.pid] + [int(p) for p in pidfile.read_text().split()]
    procs = {pid: psutil.Process(pid).create_time() for pid in pids}
    orphan = psutil.Process(pids[3])
    assert orphan.ppid() != agent.pid and os.getsid(orphan.pid) != agent.pid  # escaped the tree
    assert os.getsid(pids[2]) != agent.pid

    grace_s = 1.0
    started = time.monotonic()
    status = agent.cancel(grace_s=grace_s)
    elapsed = time.monotonic() - started
    # the SIGKILL waited for the grace, and cancel did not wait for the agent (it sleeps 1000 s);
    # how far past the grace it returns depends on the machine's load, so that bound is PATIENCE_S
    assert grace_s <= elapsed < grace_s + PATIENCE_S, elapsed
    assert status.signal == signal.SIGKILL  # it ignored SIGTERM
    assert status.terminal()[0] == "error"
    for pid, created in procs.items():
        assert gone(pid, created), f"pid {pid} survived cancel"


def _escaper_script(tmp_path: Path, pidfile: Path, tail: str = "while :; do sleep 1; done") -> Path:
    """An agent whose child double-forks into its own session with its environment cleared
    (no MAM_AGENT_TAG) and ignores SIGTERM: the tree walk cannot find it (§6)."""
    return script(tmp_path, "escaper-agent", f"""\
        ( env -i /bin/sh -c 'trap "" TERM; exec setsid sleep 1000' </dev/null >/dev/null 2>&1 &
          echo $! > "{pidfile}.tmp" )
        mv "{pidfile}.tmp" "{pidfile}"
        {tail}
        """)


@pytest.fixture
def job_cgroup():
    """A cgroup of this test's own (§6), or a skip where the host gives none."""
    found, why = cgroups.detect(f"test{os.getpid()}")
    if found is None:
        pytest.skip(why)
    yield found.job(f"{JOB_ID}-1")
    found.close()


def escaped(pidfile: Path) -> psutil.Process:
    wait_until(pidfile.exists, what="the escaped child's pid")
    pid = int(pidfile.read_text())
    proc = wait_until(lambda: (lambda p: p if p.name() == "sleep" else None)(psutil.Process(pid)),
                      what="the escaped child to exec sleep")
    assert AGENT_TAG_ENV not in proc.environ()
    return proc


def test_in_its_cgroup_cancel_kills_a_child_that_double_forked_and_cleared_its_environment(
        tmp_path, run_agent, job_cgroup):
    pidfile = tmp_path / "pid"
    agent = run_agent([_escaper_script(tmp_path, pidfile)], cgroup=job_cgroup)
    child = escaped(pidfile)  # the agent's program ran: it joined its group first
    assert agent.cgroup == job_cgroup and agent.pid in job_cgroup.members()
    assert child.pid in job_cgroup.members() and os.getsid(child.pid) != agent.pid
    created = child.create_time()
    agent.cancel(grace_s=0.5)
    assert gone(child.pid, created) and job_cgroup.members() == []
    agent.close()
    assert not job_cgroup.path.exists()  # the attempt's group is removed with it


def test_in_its_cgroup_the_agents_program_runs_only_once_it_is_a_member(tmp_path, run_agent, job_cgroup):
    log_path = tmp_path / "first.log"
    agent = run_agent(["cat", "/proc/self/cgroup"], cgroup=job_cgroup, log_path=log_path)
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(exit_code=0, signal=None)
    lines = log_path.read_text().splitlines()
    own = [line[len("0::"):] for line in lines if line.startswith("0::")]
    assert own and job_cgroup.path.as_posix().endswith(own[0]), lines


def test_in_its_cgroup_a_leftover_that_cleared_its_environment_is_stopped_after_exit_0(
        tmp_path, run_agent, job_cgroup, monkeypatch):
    """The leftovers are the group's members: neither a sample while the agent runs nor
    their stop walks the host's process table (a runner beside hundreds of other
    processes would pay for that walk on every agent, twice a second)."""
    walks: list[int] = []
    real = psutil.process_iter
    monkeypatch.setattr(psutil, "process_iter", lambda *args, **kwargs: walks.append(1) or real(*args, **kwargs))
    pidfile = tmp_path / "pid"
    agent = run_agent([_escaper_script(tmp_path, pidfile, tail="sleep 0.5; exit 0")], cgroup=job_cgroup)
    child = escaped(pidfile)
    created = child.create_time()
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(0, None)
    assert agent.stop_leftovers(grace_s=0.5) == 1
    assert gone(child.pid, created) and job_cgroup.members() == []
    assert walks == []


def test_without_a_cgroup_such_a_child_escapes_cancel_as_the_known_limits_say(tmp_path, run_agent):
    """docs/usage.md "Known limits", process-group mode: documented, and so tested."""
    pidfile = tmp_path / "pid"
    agent = AgentProcess(track_interval_s=3600)  # no sample of the tree catches the child before it escapes
    agent.start([str(_escaper_script(tmp_path, pidfile))], env=dict(os.environ), cwd=tmp_path, stdin_text="",
                log_path=tmp_path / "agent.log")
    child = escaped(pidfile)
    try:
        agent.cancel(grace_s=0.2)
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    finally:
        child.kill()
        agent.close()


def test_cancel_of_cooperative_agent_uses_sigterm(tmp_path, run_agent):
    agent = run_agent([AGENTS / "exit-agent"], stdin_text="")  # may already be done
    agent.wait(timeout_s=PATIENCE_S)
    status = agent.cancel(grace_s=1.0)  # cancel after exit is harmless
    assert status == ExitStatus(0, None)

    sleeper = run_agent([script(tmp_path, "plain-sleep", "exec sleep 1000\n")])
    status = sleeper.cancel(grace_s=5.0)
    assert status == ExitStatus(None, signal.SIGTERM)
    assert status.terminal() == ("error", "agent killed by signal 15", 128 + 15)


def test_cancel_kills_sleep_agent_grandchild_that_ignores_sigterm(tmp_path, run_agent):
    pidfile = tmp_path / "sleep.pids"
    env = dict(os.environ, SLEEP_AGENT_PIDFILE=str(pidfile))
    agent = run_agent([AGENTS / "sleep-agent", "1000"], env=env)
    wait_until(pidfile.exists, what="sleep-agent's pid file")
    child = int(pidfile.read_text().split()[1])
    created = psutil.Process(child).create_time()
    agent.cancel(grace_s=0.5)
    assert gone(child, created)


def _leftover_script(tmp_path: Path, pidfile: Path, tail: str) -> Path:
    """An agent that leaves a background child (one ignoring SIGTERM) and records its pid."""
    return script(tmp_path, "leftover-agent", f"""\
        (trap '' TERM; exec sleep 62) </dev/null >/dev/null 2>&1 &
        echo $! > "{pidfile}.tmp"
        mv "{pidfile}.tmp" "{pidfile}"
        {tail}
        """)


@pytest.mark.parametrize("tail, expected", [
    ("exit 0", ExitStatus(0, None)),
    ("while :; do sleep 1; done", ExitStatus(None, signal.SIGKILL)),
], ids=["background-child-after-exit-0", "child-after-sigkill-of-leader"])
def test_s11_stop_leftovers_stops_what_remains_after_the_leader_exits(tmp_path, run_agent, tail, expected):
    """§11 step 5: the leader's end does not end its tree; stop_leftovers does (SIGTERM, then SIGKILL)."""
    pidfile = tmp_path / "child.pid"
    agent = run_agent([_leftover_script(tmp_path, pidfile, tail)])
    wait_until(pidfile.exists, what="the agent's pid file")
    child = int(pidfile.read_text())
    created = psutil.Process(child).create_time()
    if expected.signal is not None:
        os.kill(agent.pid, signal.SIGKILL)
    status = agent.wait(timeout_s=PATIENCE_S)
    assert status == expected
    assert not gone(child, created)  # the leader's exit left it running
    with pytest.raises(Exception, match="agent not started"):
        AgentProcess().stop_leftovers(grace_s=0.1)
    assert agent.stop_leftovers(grace_s=0.5) >= 1  # the child (and the killed loop's `sleep 1`)
    assert gone(child, created)
    assert agent.stop_leftovers(grace_s=0.5) == 0  # nothing left: harmless


def test_stop_leftovers_refuses_while_the_leader_runs(tmp_path, run_agent):
    agent = run_agent([script(tmp_path, "plain-sleep", "exec sleep 1000\n")])
    with pytest.raises(Exception, match="still runs"):
        agent.stop_leftovers(grace_s=0.1)
    assert agent.poll() is None


def test_stop_leftovers_never_touches_an_untagged_process_in_no_group_of_the_agent(tmp_path, run_agent):
    """Ownership is proven (seen in the tree, or tagged): an unrelated process survives."""
    bystander = subprocess.Popen(["sleep", "60"], env={k: v for k, v in os.environ.items()
                                                      if k != AGENT_TAG_ENV})
    try:
        agent = run_agent([AGENTS / "exit-agent"])
        agent.wait(timeout_s=PATIENCE_S)
        agent.stop_leftovers(grace_s=0.1)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


# ------------------------------------------------------------ environment (§11)


def _env(base, brief="do it"):
    return agent_env(base, job_id=JOB_ID, attempt_id=2, dispatch_token=TOKEN, session="gpu-box",
                     heartbeat_s=30, publish_cmd="mam-runner publish --job 918b0612", brief=brief)


def test_agent_env_sets_the_mam_variables_and_drops_secrets():
    base = {"PATH": "/usr/bin:/bin", "HOME": "/root", "ANTHROPIC_API_KEY": "agent-needs-this",
            "MAM_DISPATCH_SECRET": "s" * 40, "MQTT_PASSWORD": "hunter2", "MAM_JOB_ID": "deadbeef",
            "MAM_JOB_BRIEF_OMITTED": "too_large"}
    env = _env(base)
    assert env["JOB_ID"] == env["MAM_JOB_ID"] == JOB_ID
    assert env["MAM_ATTEMPT_ID"] == "2"
    assert env["MAM_DISPATCH_TOKEN"] == TOKEN
    assert env["MAM_SESSION"] == "gpu-box"
    assert env["MAM_HEARTBEAT_SEC"] == "30"
    assert env["MAM_PUBLISH_CMD"] == "mam-runner publish --job 918b0612"
    assert env["MAM_JOB_BRIEF"] == "do it"
    assert BRIEF_OMITTED_ENV not in env  # a stale inherited one is dropped
    assert env["ANTHROPIC_API_KEY"] == "agent-needs-this"  # the agent's own credentials stay
    for name in SECRET_ENV_NAMES:
        assert name not in env
    assert "s" * 40 not in env.values() and "hunter2" not in env.values()
    assert base["MAM_JOB_ID"] == "deadbeef"  # base untouched


def test_agent_process_sees_env_without_secrets(tmp_path, run_agent):
    base = dict(os.environ, MAM_DISPATCH_SECRET="x" * 40, MQTT_PASSWORD="hunter2")
    out = tmp_path / "env.txt"
    agent = run_agent([script(tmp_path, "env-agent", f'env > "{out}"\n')], env=_env(base))
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(0, None)
    seen = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    for name in ("JOB_ID", "MAM_JOB_ID", "MAM_ATTEMPT_ID", "MAM_DISPATCH_TOKEN", "MAM_SESSION",
                 "MAM_HEARTBEAT_SEC", "MAM_PUBLISH_CMD", "MAM_JOB_BRIEF", AGENT_TAG_ENV):
        assert name in seen, name
    assert "MAM_DISPATCH_SECRET" not in seen and "MQTT_PASSWORD" not in seen
    assert "hunter2" not in out.read_text()


def test_brief_over_the_env_string_limit_is_omitted_from_env_but_on_stdin(tmp_path, run_agent):
    """Linux caps one env string at 128 KiB (MAX_ARG_STRLEN): the brief goes on stdin only."""
    brief = "b" * (300 * 1024)
    env = _env(dict(os.environ), brief=brief)
    assert "MAM_JOB_BRIEF" not in env and env[BRIEF_OMITTED_ENV] == "too_large"
    limit_ok = _env({}, brief="c" * (128 * 1024 - len("MAM_JOB_BRIEF=") - 1))
    assert "MAM_JOB_BRIEF" in limit_ok
    too_big = _env({}, brief="c" * (128 * 1024 - len("MAM_JOB_BRIEF=")))
    assert too_big[BRIEF_OMITTED_ENV] == "too_large"
    out = tmp_path / "stdin.txt"
    flag = tmp_path / "flag.txt"
    agent = run_agent([script(tmp_path, "big", f'echo "${{MAM_JOB_BRIEF_OMITTED}}" > "{flag}"; cat > "{out}"\n')],
                      env=env, stdin_text=brief)
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(0, None)  # execve did not fail with E2BIG
    assert out.read_text() == brief
    assert flag.read_text().strip() == "too_large"
    # The largest brief that fits really does pass execve.
    fits = run_agent([script(tmp_path, "fits", 'test "${#MAM_JOB_BRIEF}" -gt 100000\n')],
                     env=dict(os.environ, **{k: v for k, v in limit_ok.items() if k.startswith("MAM_")}))
    assert fits.wait(timeout_s=PATIENCE_S) == ExitStatus(0, None)


def test_brief_with_nul_byte_is_omitted_from_env():
    env = _env({}, brief="a\x00b")
    assert "MAM_JOB_BRIEF" not in env and env[BRIEF_OMITTED_ENV] == "nul_byte"


# --------------------------------------------------------------- shell-agent


def _recorder(tmp_path: Path) -> tuple[str, Path]:
    """A MAM_PUBLISH_CMD that appends its argv (one JSON list per line) to a file."""
    record = tmp_path / "published.ndjson"
    rec = tmp_path / "recorder dir" / "publish"  # a space: the command line must stay quoted
    rec.parent.mkdir()
    rec.write_text(f"#!{sys.executable}\nimport json, sys\n"
                   f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    rec.chmod(0o755)
    return shlex.join([str(rec), "--job", JOB_ID]), record


def _published(record: Path) -> list[list[str]]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def test_shell_agent_runs_steps_in_workdir_and_publishes_progress(tmp_path, run_agent):
    publish_cmd, record = _recorder(tmp_path)
    workdir = tmp_path / "work" / JOB_ID
    brief = textwrap.dedent("""\
        # a comment, not a step
        echo one > first.txt

          mkdir sub
        cd sub
        echo "$SECRET_PATH" > second.txt
        """)
    env = dict(os.environ, MAM_PUBLISH_CMD=publish_cmd, SECRET_PATH="/very/secret/path")
    agent = run_agent([AGENTS / "shell-agent"], env=env, cwd=workdir, stdin_text=brief)
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(0, None)
    assert (workdir / "first.txt").read_text() == "one\n"
    assert (workdir / "sub" / "second.txt").read_text() == "/very/secret/path\n"  # cd carried over
    calls = _published(record)
    assert calls == [["--job", JOB_ID, "--event", "progress", "--detail", f"step {i}/4"] for i in range(1, 5)]
    assert "secret" not in record.read_text()


def test_shell_agent_stops_at_first_failing_step_with_its_code(tmp_path, run_agent):
    publish_cmd, record = _recorder(tmp_path)
    workdir = tmp_path / "w"
    brief = "echo a > a.txt\n(exit 7)\necho never > b.txt\n"
    agent = run_agent([AGENTS / "shell-agent"], env=dict(os.environ, MAM_PUBLISH_CMD=publish_cmd),
                      cwd=workdir, stdin_text=brief)
    status = agent.wait(timeout_s=PATIENCE_S)
    assert status == ExitStatus(7, None)
    assert status.terminal() == ("error", "agent exited with code 7", 7)
    assert not (workdir / "b.txt").exists()
    assert [c[-1] for c in _published(record)] == ["step 1/3", "step 2/3"]
    assert "step 2/3 failed with exit code 7" in (tmp_path / "logs" / "agent.log").read_text()


def test_shell_agent_runs_without_publish_cmd_and_from_env_brief(tmp_path, run_agent):
    env = {k: v for k, v in os.environ.items() if k != "MAM_PUBLISH_CMD"}
    env["MAM_JOB_BRIEF"] = "echo from-env > env.txt\n"
    workdir = tmp_path / "w"
    agent = run_agent([AGENTS / "shell-agent"], env=env, cwd=workdir, stdin_text="")
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(0, None)
    assert (workdir / "env.txt").read_text() == "from-env\n"


def test_shell_agent_keeps_going_when_progress_publish_fails(tmp_path, run_agent):
    env = dict(os.environ, MAM_PUBLISH_CMD="false")
    agent = run_agent([AGENTS / "shell-agent"], env=env, cwd=tmp_path / "w", stdin_text="true\ntrue\n")
    assert agent.wait(timeout_s=PATIENCE_S) == ExitStatus(0, None)
    assert "progress publish for step 2/2 failed" in (tmp_path / "logs" / "agent.log").read_text()


# ------------------------------------------------------------ orphans (§6, a runner killed with -9)

_ORPHAN_PARENT = textwrap.dedent("""
    import json, os, sys, time
    from mam.runner.agent import AgentProcess
    agent = AgentProcess()
    agent.start([sys.argv[1], "1000"], env=dict(os.environ), cwd=sys.argv[2], stdin_text="",
                log_path=os.path.join(sys.argv[2], "agent.log"))
    with open(sys.argv[3] + ".tmp", "w") as out:
        json.dump(agent.identity.to_dict(), out)
    os.replace(sys.argv[3] + ".tmp", sys.argv[3])
    time.sleep(1000)
""")


def orphan_agent(tmp_path: Path) -> tuple[dict, list[psutil.Process]]:
    """A sleep-agent whose supervising process was killed with SIGKILL: (identity dict, [agent, grandchild])."""
    pidfile, identity_file = tmp_path / "sleep.pids", tmp_path / "agent.pid"
    env = dict(os.environ, SLEEP_AGENT_PIDFILE=str(pidfile))
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_PARENT, str(AGENTS / "sleep-agent"), str(tmp_path),
                               str(identity_file)], env=env)
    try:
        wait_until(lambda: pidfile.exists() and identity_file.exists(), what="the agent to start")
    finally:
        parent.kill()
        parent.wait()
    procs = [psutil.Process(int(p)) for p in pidfile.read_text().split()]
    wait_until(lambda: procs[0].ppid() != parent.pid, what="the agent to be reparented")
    return json.loads(identity_file.read_text()), procs


def test_stop_orphan_kills_the_tree_of_an_agent_whose_supervisor_died(tmp_path):
    """§6 without a Popen: SIGTERM to the group, SIGKILL of the grandchild that ignores it."""
    raw, procs = orphan_agent(tmp_path)
    try:
        identity = AgentIdentity.from_dict(raw)
        assert identity.pgid == identity.pid == procs[0].pid
        assert identity.leader() is not None
        assert stop_orphan(identity, grace_s=0.3) is True
        assert all(gone(p.pid, p.create_time()) for p in procs)
        assert identity.leader() is None
        assert stop_orphan(identity, grace_s=0.3) is False  # nothing left: nothing to do
    finally:
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()


def test_stop_orphan_finds_the_grandchild_by_tag_when_the_agent_is_gone(tmp_path):
    """The agent died but its grandchild (same group, tagged) still runs: it is stopped."""
    raw, (agent, grandchild) = orphan_agent(tmp_path)
    try:
        agent.kill()
        wait_until(lambda: gone(agent.pid, agent.create_time()), what="the agent to die")
        identity = AgentIdentity.from_dict(raw)
        assert identity.leader() is None
        assert stop_orphan(identity, grace_s=0.3) is True
        assert gone(grandchild.pid, grandchild.create_time())
    finally:
        with contextlib.suppress(psutil.Error):
            grandchild.kill()


def test_stop_orphan_never_touches_a_process_the_identity_does_not_prove_ours(tmp_path):
    """A forged identity (right pid and create time, wrong tag) names an unrelated
    process leading its own group: nothing is signalled."""
    victim = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    try:
        proc = psutil.Process(victim.pid)
        forged = AgentIdentity(pid=victim.pid, create_time=proc.create_time(), pgid=victim.pid, tag="0" * 32)
        assert forged.leader() is None
        assert stop_orphan(forged, grace_s=0.1) is False
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("raw", [
    None, [], "x", {},
    {"pid": 1, "create_time": 1.0, "pgid": 1, "tag": "a" * 32},
    {"pid": 0, "create_time": 1.0, "pgid": 5, "tag": "a" * 32},
    {"pid": True, "create_time": 1.0, "pgid": 5, "tag": "a" * 32},
    {"pid": 5, "create_time": 1.0, "pgid": -5, "tag": "a" * 32},
    {"pid": 5, "create_time": "1", "pgid": 5, "tag": "a" * 32},
    {"pid": 5, "create_time": float("nan"), "pgid": 5, "tag": "a" * 32},
    {"pid": 5, "create_time": 1.0, "pgid": 5, "tag": "A" * 32},
    {"pid": 5, "create_time": 1.0, "pgid": 5, "tag": "a" * 31},
    {"pid": 5, "create_time": 1.0, "pgid": 5, "tag": None},
    {"pid": 1 << 40, "create_time": 1.0, "pgid": 5, "tag": "a" * 32},
])
def test_agent_identity_refuses_malformed_files(raw):
    with pytest.raises(ValueError, match="agent identity"):
        AgentIdentity.from_dict(raw)


def test_agent_identity_round_trips():
    identity = AgentIdentity(pid=1234, create_time=1718900000.25, pgid=1234, tag="ab" * 16)
    assert AgentIdentity.from_dict(json.loads(json.dumps(identity.to_dict()))) == identity
