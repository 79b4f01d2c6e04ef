"""runner/spawn.py with real processes: the bash stub that joins an agent's cgroups and
execs it (PROTOCOL §6), and where the agent starts the old way instead.

`cgroup.procs` is stood in for by a regular file (the stub writes "0" to it as to a
group's) and by /dev/full (a write that fails); tests/e2e/test_supervisor.py has the
real groups."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from harness.waiting import wait_until

from mam.runner import spawn
from mam.runner.agent import AgentProcess, AgentStartError, ExitStatus, resolve_executable
from mam.runner.process_tree import AGENT_TAG_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60),
              pytest.mark.skipif(spawn.find_bash() is None, reason="no bash at /bin/bash or /usr/bin/bash")]

PATH = "/usr/bin:/bin"


def run(tmp_path: Path, argv: list[str], env: dict[str, str], join: list[Path]) -> tuple[bytes, int]:
    """Start `argv` with `join` as its groups, wait; (its log, its exit code)."""
    log_path = tmp_path / "agent.log"
    log_path.unlink(missing_ok=True)
    agent = AgentProcess()
    agent.start(argv, env=env, cwd=tmp_path / "work", stdin_text="", log_path=log_path, join=join)
    try:
        status = agent.wait(timeout_s=30)
        assert status is not None, "the agent did not end"
    finally:
        if agent.poll() is None:
            agent.cancel(grace_s=0.0)
        agent.close()
    return log_path.read_bytes(), status.exit_code


def seen_env(tmp_path: Path, env: dict[str, str], join: list[Path]) -> dict[str, str]:
    """The environment `env -0` saw, without the runner's own tag (a line bash wrote
    before it would spoil the first name)."""
    out, code = run(tmp_path, ["env", "-0"], env, join)
    assert code == 0, out
    seen = dict(item.split("=", 1) for item in os.fsdecode(out).split("\0") if item)
    seen.pop(AGENT_TAG_ENV)
    return seen


@pytest.fixture
def procs(tmp_path) -> Path:
    path = tmp_path / "cgroup.procs"
    path.write_text("")
    return path


def uses_stub(env: dict[str, str], argv0: str = "env") -> bool:
    return spawn.usable(resolve_executable(argv0, PATH), env)


@pytest.mark.parametrize("extra", [
    {},
    {"PWD": "/not/the/agents/cwd", "OLDPWD": "/x", "_": "/usr/bin/something else", "IFS": ":"},
    {"SHLVL": "3", "f": "the stub's loop must not touch it", "j": "nor its function's name"},
    {"A-B": "not a shell name", "1X": "nor this", "UTF": "é ✓", "QUOTES": "it's \"$(x)\" `y`"},
    {"HOSTNAME": "box", "HOME": "/root", "TERM": "xterm", "LANG": "C.UTF-8", "UID": "0", "SECONDS": "5",
     "GROUPS": "x", "MAIL": "/var/mail/root"},
    {"LC_ALL": "xx_NO.LOCALE", "LANG": "C.UTF-8"},
], ids=["plain", "restored", "shell-names", "odd", "login-and-docker", "missing-locale"])
def test_the_stub_joins_and_the_agent_gets_exactly_its_environment(tmp_path, procs, extra):
    env = {"PATH": PATH, "SHLVL": "1", **extra}
    assert uses_stub(env)
    assert seen_env(tmp_path, env, [procs]) == env
    assert procs.read_text() == "0"  # the stub's write, as into a group's cgroup.procs


def test_an_absent_shlvl_reaches_the_agent_as_zero(tmp_path, procs):
    env = {"PATH": PATH}
    seen = seen_env(tmp_path, env, [procs])
    assert seen.pop("SHLVL") == "0" and seen == env


def test_the_agent_keeps_its_argv0_and_hostile_arguments_stay_literal(tmp_path, procs):
    marker = tmp_path / "ran"
    hostile = [f"$(touch {marker})", f"; touch {marker}", "a\nb", "*", "${@:3}", "-c"]
    out, code = run(tmp_path, ["sh", "-c", 'cat /proc/$$/cmdline', *hostile], {"PATH": PATH}, [procs])
    assert code == 0
    assert out.split(b"\0")[:-1] == [b"sh", b"-c", b"cat /proc/$$/cmdline", *(a.encode() for a in hostile)]
    assert not marker.exists()


def test_a_group_it_cannot_join_is_said_in_the_log_and_the_agent_runs_in_the_rest(tmp_path, procs):
    out, code = run(tmp_path, ["sh", "-c", "echo ran"], {"PATH": PATH}, [Path("/dev/full"), procs])
    assert code == 0
    assert out.count(b"mam-runner: the agent is not in one of its cgroups") == 1 and out.endswith(b"ran\n")
    assert procs.read_text() == "0"


@pytest.mark.parametrize("extra", [
    {"BASH_ENV": "MARKER_SCRIPT"},
    {"BASH_FUNC_f%%": "() {  touch MARKER\n}"},
    {"SHELLOPTS": "xtrace"},
    {"PPID": "1", "RANDOM": "4", "PS4": "as root, bash ignores it"},
    {"SHLVL": "abc"},
    {"SHLVL": "1000"},
    {"PWD": "/" + "p" * 100_000},
], ids=["bash-env", "function", "shellopts", "bash-sets", "shlvl-word", "shlvl-high", "pwd-oversized"])
def test_what_bash_would_run_or_change_starts_the_agent_the_old_way(tmp_path, procs, extra):
    marker = tmp_path / "marker"
    script = tmp_path / "bash_env.sh"
    script.write_text(f"touch {marker}\n")
    env = {"PATH": PATH, **{k: v.replace("MARKER_SCRIPT", str(script)).replace("MARKER", str(marker))
                            for k, v in extra.items()}}
    assert not uses_stub(env)
    assert seen_env(tmp_path, env, [procs]) == env
    assert procs.read_text() == "0" and not marker.exists()


def test_a_program_exec_would_refuse_is_still_refused_at_start(tmp_path, procs):
    bare = tmp_path / "no-shebang"
    bare.write_text("echo hi\n")
    bare.chmod(0o755)
    lost = tmp_path / "lost-interpreter"
    lost.write_text("#!/nonexistent/interpreter\necho hi\n")
    lost.chmod(0o755)
    relative = tmp_path / "relative"
    relative.write_text("#!bash\necho hi\n")
    relative.chmod(0o755)
    for program in (bare, lost, relative):
        assert not uses_stub({"PATH": PATH}, str(program))
    with pytest.raises(AgentStartError, match="exec format error"):
        run(tmp_path, [str(bare)], {"PATH": PATH}, [procs])
    with pytest.raises(AgentStartError, match="No such file"):
        run(tmp_path, [str(lost)], {"PATH": PATH}, [procs])


def held(tmp_path: Path, procs: Path, marker: Path) -> AgentProcess:
    """An agent held before its program (which would touch `marker`) once it joined `procs`."""
    agent = AgentProcess()
    assert agent.start(["sh", "-c", f"touch {marker}"], env={"PATH": PATH}, cwd=tmp_path / "work", stdin_text="",
                       log_path=tmp_path / "agent.log", join=[procs], hold=True)
    wait_until(lambda: procs.read_text() == "0", what="the held agent to join its group")
    return agent


def test_a_held_agent_joins_first_and_runs_its_program_only_when_released(tmp_path, procs):
    marker = tmp_path / "ran"
    agent = held(tmp_path, procs, marker)
    try:
        assert agent.wait(timeout_s=0.3) is None and not marker.exists()
        agent.release()
        agent.release()  # idempotent
        assert agent.wait(timeout_s=30) == ExitStatus(exit_code=0, signal=None) and marker.exists()
    finally:
        if agent.poll() is None:
            agent.cancel(grace_s=0.0)
        agent.close()


def test_a_held_agent_never_released_never_runs_its_program(tmp_path, procs):
    marker = tmp_path / "ran"
    agent = held(tmp_path, procs, marker)
    status = agent.cancel(grace_s=0.0)
    agent.release()  # after its end: nothing happens
    agent.close()
    assert status.exit_code != 0 and not marker.exists()


def test_a_held_agent_whose_runner_died_ends_without_running_its_program(tmp_path, procs):
    marker, pidfile = tmp_path / "ran", tmp_path / "pid"
    runner = textwrap.dedent(f"""
        from pathlib import Path
        import os
        from mam.runner.agent import AgentProcess
        agent = AgentProcess()
        assert agent.start(["sh", "-c", "touch {marker}"], env={{"PATH": "{PATH}"}}, cwd=Path("{tmp_path}/work"),
                           stdin_text="", log_path=Path("{tmp_path}/agent.log"), join=[Path("{procs}")], hold=True)
        Path("{pidfile}").write_text(str(agent.pid))
        os._exit(0)  # as a SIGKILL would: the gate's write end closes with the process
        """)
    subprocess.run([sys.executable, "-c", runner], check=True, timeout=60)
    pid = int(pidfile.read_text())
    wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
               what="the orphaned stub to end")
    assert not marker.exists()


def test_an_agent_that_cannot_be_held_is_not_started(tmp_path, procs):
    bare = tmp_path / "no-shebang"
    bare.write_text("echo hi\n")
    bare.chmod(0o755)
    for argv, join in ((["true"], []), ([str(bare)], [procs]), (["/definitely/not/here"], [procs])):
        agent = AgentProcess()
        with contextlib.suppress(AgentStartError):
            assert agent.start(argv, env={"PATH": PATH}, cwd=tmp_path / "work", stdin_text="",
                               log_path=tmp_path / "agent.log", join=join, hold=True) is False
        assert not agent.started
        agent.close()
    assert procs.read_text() == ""
