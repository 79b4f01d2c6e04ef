"""Run one agent process for one job (PROTOCOL §6, §11): argv, environment,
stdin brief, log file, process group, cancel of the whole process tree
(`mam.runner.process_tree`), and the mapping of its exit to the terminal event.

No MQTT here: `mam.runner.job` publishes `started`, heartbeats and the
terminal event; this module only owns the agent's processes.

Lifecycle::

    agent = AgentProcess()
    agent.start(split_exec("claude -p"), env=agent_env(os.environ, ...),
                cwd=workdir, stdin_text=brief, log_path=logs / "agent.log")
    status = agent.wait()                 # or agent.cancel(grace_s=10.0)
    event, detail, exit_code = status.terminal()

A runner killed with `kill -9` leaves its agent running (own session,
reparented to init). The runner records `agent.identity` (`AgentIdentity`:
pid, create time, process group, `MAM_AGENT_TAG`) durably; the next runner
reads it back and calls `stop_orphan(identity, grace_s)`, which stops that
tree exactly like `cancel()` (`ProcessTree.terminate`), touching only
processes it can prove are the agent's.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import queue
import select
import shlex
import shutil
import signal as signal_
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from mam.runner import spawn
from mam.runner.cgroups import JobCgroup
from mam.runner.process_tree import AGENT_TAG_ENV, TAG_BYTES, AgentIdentity, ProcessTree
from mam.shared.protocol.errors import MamError, RegistryError, UsageError

log = logging.getLogger("mam.runner.supervisor")  # the log name operators know

EXEC_MAX_CHARS = 4096
"""Longest accepted `--exec` string; a longer one is refused as a usage error."""

# Linux caps ONE "NAME=value" environment string at MAX_ARG_STRLEN = 32 pages
# (131,072 bytes, NUL included); execve fails with E2BIG above it.
MAX_ENV_STRING_BYTES = 32 * 4096

BRIEF_ENV = "MAM_JOB_BRIEF"
BRIEF_OMITTED_ENV = "MAM_JOB_BRIEF_OMITTED"

# The fleet's own secrets. An agent is untrusted code with respect to them:
# LLM agents echo their environment into transcripts, logs and model prompts,
# and MAM_DISPATCH_SECRET would let it forge dispatches and cancels for the
# whole fleet. This is defence in depth, not a sandbox: an agent running
# under the runner's uid can still read the runner's 0600 files.
SECRET_ENV_NAMES: frozenset[str] = frozenset({
    "MAM_DISPATCH_SECRET",
    "MQTT_PASSWORD",
    "MAM_AUTH_TOKEN",
    "NATS_PASSWORD",
    "NATS_TOKEN",
    "NATS_CREDS",
    "NATS_NKEY",
})

# Per-job variables of §11: inherited values (a runner started inside another
# job) are dropped so a stale one can never leak into this job.
JOB_ENV_NAMES: frozenset[str] = frozenset({
    "JOB_ID", "MAM_JOB_ID", "MAM_ATTEMPT_ID", "MAM_DISPATCH_TOKEN", "MAM_SESSION",
    "MAM_HEARTBEAT_SEC", "MAM_PUBLISH_CMD", BRIEF_ENV, BRIEF_OMITTED_ENV, AGENT_TAG_ENV,
})


SHOWN_EXEC_CHARS = 80
"""How much of a bad `--exec` string an error line shows."""
TRACK_INTERVAL_S = 0.5
"""How often a running agent's process tree is sampled (escaped descendants stay known)."""
THREAD_JOIN_S = 1.0
"""How long `close()` waits for each helper thread."""


class AgentStartError(UsageError):
    """The agent command cannot be started: not found, not executable, bad format.

    A usage error (exit 64): the operator's `--exec` is wrong, not the job.
    """


# ------------------------------------------------------------------ argv


def split_exec(cmd: str) -> list[str]:
    """Split an `--exec` string into argv like a POSIX shell would, without a shell (§11).

    Quotes and backslashes follow `shlex.split` (POSIX mode); there is no
    expansion of variables, globs, pipes or `#` comments.

    Args:
        cmd: the command line, e.g. ``"claude --model sonnet"``.
    Returns:
        the argv list, at least one element.
    Raises:
        UsageError: empty or blank, unbalanced quotes, a trailing escape, a NUL
            character, or longer than `EXEC_MAX_CHARS`; one line naming the
            problem.
    """
    if not isinstance(cmd, str):
        raise UsageError(f"--exec must be a string, got {type(cmd).__name__}")
    if len(cmd) > EXEC_MAX_CHARS:
        raise UsageError(f"--exec is too long: {len(cmd)} characters, at most {EXEC_MAX_CHARS} are allowed")
    if "\x00" in cmd:
        raise UsageError("--exec contains a NUL character")
    shown = _shorten(cmd)
    try:
        argv = shlex.split(cmd, posix=True)
    except ValueError as exc:
        # shlex says "No closing quotation" / "No escaped character".
        raise UsageError(f"--exec {shown} cannot be split: {str(exc).lower()}") from None
    if not argv or argv[0] == "":
        raise UsageError(f"--exec {shown} is empty: give the agent command, e.g. --exec \"claude -p\"")
    return argv


def _shorten(text: str, limit: int = SHOWN_EXEC_CHARS) -> str:
    """`repr(text)`, cut to about `limit` characters for one-line errors."""
    return repr(text if len(text) <= limit else text[:limit] + "…")


def resolve_executable(argv0: str, path_env: str | None) -> str:
    """Absolute path of the program `argv0` names, checked before any fork.

    A bare name is looked up in `path_env` (the agent's PATH); a name with a
    `/` is taken relative to the runner's current directory.

    Raises:
        AgentStartError: not found, a directory, or not executable.
    """
    if "/" in argv0:
        candidate = os.path.abspath(argv0)
        if not os.path.exists(candidate):
            raise AgentStartError(f"agent command {argv0!r} not found")
    else:
        found = shutil.which(argv0, path=path_env if path_env is not None else os.defpath)
        if found is None:
            raise AgentStartError(f"agent command {argv0!r} not found on PATH")
        candidate = os.path.abspath(found)
    if os.path.isdir(candidate):
        raise AgentStartError(f"agent command {argv0!r} is a directory")
    if not os.access(candidate, os.X_OK):
        raise AgentStartError(f"agent command {argv0!r} is not executable ({candidate})")
    return candidate


# ------------------------------------------------------------ environment


def agent_env(
    base: Mapping[str, str],
    *,
    job_id: str,
    attempt_id: int,
    dispatch_token: str,
    session: str,
    heartbeat_s: int | float,
    publish_cmd: str,
    brief: str,
) -> dict[str, str]:
    """The agent's environment of §11, built from the runner's.

    Starts from `base`, removes `SECRET_ENV_NAMES` (the agent must not see
    the fleet's secrets, see the module comment) and any inherited per-job
    variable, then sets `JOB_ID`, `MAM_JOB_ID`, `MAM_ATTEMPT_ID`,
    `MAM_DISPATCH_TOKEN`, `MAM_SESSION`, `MAM_HEARTBEAT_SEC`,
    `MAM_PUBLISH_CMD` and `MAM_JOB_BRIEF`.

    The brief may be up to 512 KiB (§5) but Linux refuses a single
    environment string over 128 KiB (MAX_ARG_STRLEN) and any NUL byte. In
    those cases `MAM_JOB_BRIEF` is left out (never cut: a truncated brief
    would be a different instruction) and `MAM_JOB_BRIEF_OMITTED` says why
    (`too_large` or `nul_byte`); the brief is always complete on stdin.

    Args:
        base: the runner's environment (e.g. `os.environ`); not modified.
        job_id, attempt_id, dispatch_token, session: the job's identity (§1).
        heartbeat_s: heartbeat period in seconds (the contract's `heartbeat_sec`).
        publish_cmd: a shell-quoted command line (`shlex.join`) the agent
            runs with `--event … --detail …` appended.
        brief: the job's brief, UTF-8 text.
    Returns:
        a new dict for `AgentProcess.start(env=...)`.
    """
    env = {k: v for k, v in base.items() if k not in SECRET_ENV_NAMES and k not in JOB_ENV_NAMES}
    heartbeat = str(int(heartbeat_s)) if float(heartbeat_s).is_integer() else str(heartbeat_s)
    env.update({
        "JOB_ID": job_id,
        "MAM_JOB_ID": job_id,
        "MAM_ATTEMPT_ID": str(attempt_id),
        "MAM_DISPATCH_TOKEN": dispatch_token,
        "MAM_SESSION": session,
        "MAM_HEARTBEAT_SEC": heartbeat,
        "MAM_PUBLISH_CMD": publish_cmd,
    })
    if "\x00" in brief:
        env[BRIEF_OMITTED_ENV] = "nul_byte"
    elif len(BRIEF_ENV) + 1 + len(brief.encode("utf-8")) + 1 > MAX_ENV_STRING_BYTES:
        env[BRIEF_OMITTED_ENV] = "too_large"
    else:
        env[BRIEF_ENV] = brief
    return env


# ------------------------------------------------------------ exit status


@dataclass(frozen=True)
class ExitStatus:
    """How an agent ended: exactly one of `exit_code` and `signal` is set.

    Attributes:
        exit_code: the process's exit code (0-255), or None if a signal killed it.
        signal: the number of the signal that killed it, or None.
    """

    exit_code: int | None
    signal: int | None

    @classmethod
    def from_returncode(cls, returncode: int) -> ExitStatus:
        """From `Popen.returncode` (negative = killed by that signal)."""
        if returncode < 0:
            return cls(exit_code=None, signal=-returncode)
        return cls(exit_code=returncode, signal=None)

    def terminal(self) -> tuple[str, str, int]:
        """The terminal event of §11 step 5 as `(event, detail, data.exit_code)`.

        - exit 0 → ``("completed", "", 0)``;
        - exit N → ``("error", "agent exited with code N", N)``;
        - signal S → ``("error", "agent killed by signal S", 128 + S)``:
          `data.exit_code` follows the shell convention (`$?` after a
          signal death) so it is always an integer and never 0.
        """
        if self.signal is not None:
            return ("error", f"agent killed by signal {self.signal}", 128 + self.signal)
        code = self.exit_code if self.exit_code is not None else 1
        if code == 0:
            return ("completed", "", 0)
        return ("error", f"agent exited with code {code}", code)


# ---------------------------------------------------------------- process


class AgentProcess:
    """One agent process in its own session and process group (§6, §11).

    The constructor has no side effects; `start()` runs the agent once.
    Outside a cgroup, while the agent runs, a tracker thread samples its
    process tree every `track_interval_s` so that a descendant that later
    escapes the tree (double fork, `setsid`, reparenting to init) is still
    remembered, and killed, by `cancel()`; `cancel()` also finds escaped
    descendants by the random `MAM_AGENT_TAG` they inherit in their
    environment (an agent that scrubs its environment *and* escapes before a
    sample is not found). In its cgroup (§6) every descendant is a member, so
    there is no tracker and no walk of the host's processes at its end.
    """

    def __init__(self, *, track_interval_s: float = TRACK_INTERVAL_S) -> None:
        self.track_interval_s = track_interval_s
        self._popen: subprocess.Popen[bytes] | None = None
        self._proc: psutil.Process | None = None
        self._tree: ProcessTree | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._status: ExitStatus | None = None
        self._tag = ""
        self._start_time = 0.0
        self._input: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # stdin after the brief; None closes
        self._input_lock = threading.Lock()
        self._input_open = False
        self._cgroup: JobCgroup | None = None
        self._exit_fd = -1  # a pidfd of the agent: readable once it exited (`wait`)
        self._gate = -1  # a held agent's gate (`start(hold=True)`): a line lets it run, closing it ends it
        self._exit_poll: select.poll | None = None

    # -- start

    def start(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        stdin_text: str,
        log_path: Path,
        keep_stdin: bool = False,
        cgroup: JobCgroup | None = None,
        join: Sequence[Path] = (),
        hold: bool = False,
    ) -> bool:
        """Start the agent (§11 step 4).

        Args:
            argv: the command (`split_exec` output), run without a shell.
            env: its full environment (`agent_env` output).
            cwd: its working directory, created (0700) if missing.
            stdin_text: the brief, written to stdin and then closed (what the pipe
                does not take at once, by a thread); an agent that never reads stdin is fine.
            keep_stdin: leave stdin open after the brief: `send_input` writes more
                (a person's messages, §18) until `close_input`.
            cgroup: the attempt's cgroup (`cgroups`): the agent joins it before its
                program runs (`mam.runner.spawn`: a stub that joins and execs it, so the
                group may not list it yet when this returns), so every process it starts
                is a member; cancel then kills the group. None: the process group and
                tag walk only.
            join: more `cgroup.procs` files it joins the same way (cgroup v1 limit groups, §6);
                one that cannot be opened is said and left out.
            log_path: stdout and stderr are appended here (created 0600,
                parent folders 0700).
            hold: start its process and let it join its groups, but run its program
                only at `release()` (the join's wait then overlaps the caller's work).
                Where it cannot be held (no groups to join, or the stub cannot start
                it: `mam.runner.spawn`) nothing is started and this returns False.
        Returns:
            True: started (held, with `hold`); False: not started (only with `hold`).
        Raises:
            AgentStartError: the program is not found, not executable, or
                exec fails (one line naming the command).
            RegistryError: the log file cannot be opened (e.g. it is a symlink).
            MamError: `start()` was already called.
        """
        if self._popen is not None:
            raise MamError("agent already started: an AgentProcess runs one agent once")
        argv = list(argv)
        if not argv:
            raise UsageError("agent command is empty")
        executable = resolve_executable(argv[0], env.get("PATH"))
        self._tag = os.urandom(TAG_BYTES).hex()
        child_env = dict(env)
        child_env[AGENT_TAG_ENV] = self._tag
        stubbable = bool(cgroup is not None or join) and spawn.usable(executable, child_env)
        if hold and not stubbable:
            return False
        cwd = Path(cwd)
        cwd.mkdir(mode=0o700, parents=True, exist_ok=True)
        log_path = Path(log_path)
        log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            # O_NOFOLLOW: an earlier agent could have planted a symlink to a file we must not touch.
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            why = "it is a symlink" if exc.errno == errno.ELOOP else os.strerror(exc.errno or 0)
            raise RegistryError(f"agent log {log_path} cannot be opened: {why}") from None
        join_fd = -1
        fds: list[int] = []
        try:
            os.fchmod(log_fd, 0o600)  # an existing file keeps no wider mode
            if cgroup is not None:
                try:
                    join_fd = cgroup.join_fd()
                    fds.append(join_fd)
                except OSError as exc:
                    log.warning("agent %s: not in its cgroup %s (%s): cancel stops its process group",
                                argv[0], cgroup.path, exc.strerror)
            for procs in join:
                try:
                    fds.append(os.open(procs, os.O_WRONLY | os.O_CLOEXEC))
                except OSError as exc:
                    log.warning("agent %s: not in the limit group %s (%s)", argv[0], procs.parent, exc.strerror)
            if hold and not fds:
                return False  # no group could be opened: nothing to wait for
            gate = os.pipe() if hold else None  # both ends close-on-exec; the stub gets the read end
            stub = stubbable and bool(fds)
            if stub:  # vfork of a stub that joins (and waits at the gate), then execs the program
                run_argv, run_env = spawn.stub_argv(executable, argv, child_env, fds, gate[0] if gate else None)
                run_exe, passed, joiner = run_argv[0], (*fds, *(gate[:1] if gate else ())), None
            else:  # fork; the child joins between fork and exec
                run_argv, run_env, run_exe, passed = argv, child_env, executable, ()
                joiner = spawn.joiner(fds) if fds else None
            try:
                self._popen = subprocess.Popen(
                    run_argv,
                    executable=run_exe,
                    stdin=subprocess.PIPE,
                    stdout=log_fd,
                    stderr=log_fd,
                    cwd=cwd,
                    env=run_env,
                    start_new_session=True,  # own session + process group: cancel hits the group
                    close_fds=True,
                    pass_fds=passed,
                    preexec_fn=joiner,
                )
            except OSError as exc:
                reason = os.strerror(exc.errno) if exc.errno else type(exc).__name__
                if exc.errno == errno.ENOEXEC:
                    reason = "exec format error (a script needs a #! line)"
                raise AgentStartError(f"agent command {argv[0]!r} cannot be started: {reason}") from None
            finally:
                if gate is not None:
                    os.close(gate[0])
                    if self._popen is None:
                        os.close(gate[1])
                    else:
                        self._gate = gate[1]
        finally:
            os.close(log_fd)
            for fd in fds:
                os.close(fd)
        self._watch_exit(self._popen.pid)  # before anything reaps it: the pid is still ours
        if join_fd >= 0 and cgroup is not None:
            self._cgroup = cgroup
            if not stub and self._popen.poll() is None and self._popen.pid not in cgroup.members():
                log.warning("agent %d: not in its cgroup %s: cancel stops its process group", self._popen.pid,
                            cgroup.path)
        try:
            self._proc = psutil.Process(self._popen.pid)
            self._start_time = self._proc.create_time()
        except psutil.NoSuchProcess:
            self._proc = None  # exited already; wait() reports it
            self._start_time = time.time()
        # owned: the agent is our unreaped child, so its group id cannot be reused under us
        self._tree = ProcessTree(self.identity, owned=True)
        if self._proc is not None:
            self._tree.remember([self._proc])
        brief = stdin_text.encode("utf-8", errors="surrogateescape")
        written = 0 if keep_stdin else self._write_now(brief)
        if written < len(brief) or keep_stdin:  # what the pipe did not take now waits on a thread
            self._input.put(brief[written:])
            with self._input_lock:
                self._input_open = keep_stdin
                if not keep_stdin:
                    self._input.put(None)
            self._spawn_thread(self._write_stdin, name=f"agent-stdin-{self.pid}")
        if self._cgroup is None:  # in a group every descendant stays a member: nothing to sample
            self._spawn_thread(self._track, name=f"agent-track-{self.pid}")
        return True

    def release(self) -> None:
        """Let a held agent (`start(hold=True)`) run its program; nothing for one not held.
        Idempotent. An agent that already ended (cancelled, or its stub killed) is left to
        `wait`."""
        gate, self._gate = self._gate, -1
        if gate < 0:
            return
        try:
            os.write(gate, b"\n")
        except OSError:
            pass  # BrokenPipeError: it ended; wait() reports how
        finally:
            os.close(gate)

    def _watch_exit(self, pid: int) -> None:
        """Open a pidfd of the agent, so that a timed `wait` sleeps in the kernel until its
        exit rather than in `Popen.wait`'s loop of growing sleeps (up to 50 ms late). Without
        pidfds (Linux < 5.3, not Linux) `wait` uses that loop."""
        try:
            self._exit_fd = os.pidfd_open(pid)  # close-on-exec, as every pidfd
        except (AttributeError, OSError) as exc:
            log.debug("agent %d: its exit is polled (no pidfd: %s)", pid, exc)
            return
        self._exit_poll = select.poll()
        self._exit_poll.register(self._exit_fd, select.POLLIN)

    def _spawn_thread(self, target: Callable[..., object], *args: Any, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _write_now(self, data: bytes) -> int:
        """Write what of `data` the agent's stdin pipe takes without blocking; close stdin when
        that is all of it (a brief shorter than the pipe's buffer, the common case: no writer
        thread then). How many bytes were written; all of them when the agent already closed
        its stdin or exited (nothing more can be written, as `_write_stdin` decides)."""
        assert self._popen is not None and self._popen.stdin is not None
        stdin = self._popen.stdin
        fd = stdin.fileno()
        written = 0
        os.set_blocking(fd, False)
        try:
            while written < len(data):
                written += os.write(fd, data[written:])
        except BlockingIOError:
            pass  # the pipe is full: the rest goes on the writer thread
        except OSError:  # BrokenPipeError: the agent exited or closed its stdin
            written = len(data)
        finally:
            os.set_blocking(fd, True)
        if written == len(data):
            try:
                stdin.close()
            except OSError:
                pass  # nothing is buffered: the reader may be gone
        return written

    def _write_stdin(self) -> None:
        """Write the brief, then each `send_input`, and close stdin at `close_input` (or at once
        without `keep_stdin`); runs on its own thread so a full pipe never blocks the runner."""
        assert self._popen is not None and self._popen.stdin is not None
        stdin = self._popen.stdin
        try:
            while (data := self._input.get()) is not None:
                stdin.write(data)
                stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            self.close_input()  # the agent exited or closed stdin without reading all of it
        finally:
            try:
                stdin.close()
            except OSError:
                pass  # close flushes; the reader may be gone

    def send_input(self, data: bytes) -> bool:
        """Queue `data` for the agent's stdin (started with `keep_stdin`); False once stdin
        is closed or closing: then nothing is written."""
        with self._input_lock:
            if not self._input_open:
                return False
            self._input.put(data)
            return True

    def close_input(self) -> None:
        """Close the agent's stdin after what was queued (an agent reading it then ends its
        input); idempotent."""
        with self._input_lock:
            if self._input_open:
                self._input_open = False
                self._input.put(None)

    @property
    def pid(self) -> int:
        """The agent's pid, which is also its process group and session id."""
        if self._popen is None:
            raise MamError("agent not started")
        return self._popen.pid

    @property
    def started(self) -> bool:
        """True once `start()` has started the agent process."""
        return self._popen is not None

    @property
    def identity(self) -> AgentIdentity:
        """What identifies this agent after the runner is gone (§6): record it
        durably (`AgentIdentity.to_dict`) so a restarted runner can stop it."""
        return AgentIdentity(pid=self.pid, create_time=self._start_time, pgid=self.pid, tag=self._tag)

    # -- wait

    def poll(self) -> ExitStatus | None:
        """The exit status if the agent has exited, else None (never blocks)."""
        if self._popen is None:
            raise MamError("agent not started")
        rc = self._popen.poll()
        return None if rc is None else self._finish(rc)

    def wait(self, timeout_s: float | None = None) -> ExitStatus | None:
        """Wait for the agent itself to exit.

        Args:
            timeout_s: seconds to wait; None waits forever.
        Returns:
            its `ExitStatus`, or None if it still runs after `timeout_s`.
        """
        if self._popen is None:
            raise MamError("agent not started")
        exit_poll = self._exit_poll
        if timeout_s is not None and exit_poll is not None and self._popen.returncode is None:
            if not exit_poll.poll(math.ceil(max(0.0, timeout_s) * 1000)):
                return None  # it exited otherwise: `Popen.wait` reaps it with its first waitpid
        try:
            rc = self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        return self._finish(rc)

    def _finish(self, returncode: int) -> ExitStatus:
        if self._status is None:
            self._status = ExitStatus.from_returncode(returncode)
            self._stop.set()
            self.close_input()  # nobody reads it any more
        return self._status

    # -- process tree

    def _collect(self, *, deep: bool = False) -> list[psutil.Process]:
        """Every live process of the agent's tree (`ProcessTree.collect`)."""
        assert self._tree is not None
        return self._tree.collect(deep=deep)

    def _track(self) -> None:
        """Sample the tree until the agent ends, so escaped descendants stay known."""
        while not self._stop.wait(self.track_interval_s):
            if self._popen is None or self._popen.poll() is not None:
                break
            try:
                self._collect()
            except Exception:  # noqa: BLE001 - tracking is best effort, never fatal
                log.debug("process-tree sample failed", exc_info=True)

    def cancel(self, grace_s: float) -> ExitStatus:
        """Stop the agent and its whole process tree (§6), see `ProcessTree.terminate`.

        Args:
            grace_s: seconds between SIGTERM and SIGKILL (`MAM_CANCEL_GRACE_S`).
        Returns:
            the agent's `ExitStatus` (a signal, unless it exited by itself).
        """
        if self._popen is None or self._tree is None:
            raise MamError("agent not started")
        popen = self._popen
        deadline = time.monotonic() + max(0.0, grace_s)
        if self._cgroup is not None:
            self._cgroup.signal(signal_.SIGTERM)  # members the tree walk cannot see get the grace too
        self._tree.terminate(grace_s, reap=popen.poll)  # reap the agent so it does not linger as a zombie
        if self._cgroup is not None and not self._cgroup.wait_empty(deadline):
            self._cgroup.kill()  # double-forked, setsid, environment cleared: still a member
        self._stop.set()
        return self._finish(popen.wait())

    def stop_leftovers(self, grace_s: float) -> int:
        """Stop what remains of the agent's tree after its leader exited (§11 step 5,
        like CI runners killing a job's leftover processes): a background child
        (`sleep 62 &`), or the children of a leader killed by a signal.

        In its cgroup, the leftovers are the group's members. Otherwise the leader
        is reaped by then, so its group id is no proof of ownership: only processes
        seen in the tree earlier (pid + create time) and processes carrying the
        agent's `MAM_AGENT_TAG` (created after it) count, and the group is signalled
        only while such a process is in it, as for an orphan (`stop_orphan`).
        Stops them with SIGTERM, then SIGKILL after `grace_s`.

        Args:
            grace_s: seconds between SIGTERM and SIGKILL (`MAM_CANCEL_GRACE_S`).
        Returns:
            how many processes were found running (and stopped); 0 if none.
        Raises:
            MamError: the agent was not started, or its leader still runs (use `cancel()`).
        """
        if self._popen is None or self._tree is None:
            raise MamError("agent not started")
        if self._popen.poll() is None:
            raise MamError("agent still runs: stop it with cancel()")
        self._stop.set()
        if self._cgroup is not None:  # every process of the tree is a member: no walk of the host's
            return self._cgroup.stop(grace_s)
        tree = ProcessTree(self.identity, owned=False)
        tree.remember(self._tree.known())
        found = tree.collect(deep=True)
        if found:
            tree.terminate(grace_s)
        return len(found)

    def close(self) -> None:
        """Stop the tracker and join helper threads; safe to call twice.

        Call after the agent ended (`wait()` or `cancel()`); its cgroup is removed (a member
        still in it is killed first)."""
        self._stop.set()
        self.close_input()
        if self._gate >= 0:  # never released: its stub ends without running the program
            gate, self._gate = self._gate, -1
            os.close(gate)
        for thread in self._threads:
            thread.join(timeout=THREAD_JOIN_S)
        if self._exit_fd >= 0:
            self._exit_poll, fd, self._exit_fd = None, self._exit_fd, -1
            os.close(fd)
        if self._cgroup is not None:
            self._cgroup.remove()
            self._cgroup = None

    @property
    def cgroup(self) -> JobCgroup | None:
        """The cgroup the agent runs in, or None (process-group mode)."""
        return self._cgroup


__all__ = ["AGENT_TAG_ENV", "AgentIdentity", "AgentProcess", "AgentStartError", "ExitStatus", "ProcessTree",
           "agent_env", "resolve_executable", "split_exec"]
