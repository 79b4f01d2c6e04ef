"""A runner's agents die with its daemon (PROTOCOL §6 "The daemon's death") or with their
lease (§10 "Leases"): a dead man's switch.

A daemon killed with SIGKILL (or by the OOM killer, or crashing past every handler) runs no
code, so it cannot stop its agents; left alone they run to the end while the hub retries their
jobs elsewhere, and the work runs twice. So the daemon starts one small helper,
`python -m mam.runner.deadman`, in a session of its own, and holds the only write end of a pipe
that is the helper's stdin. The daemon writes one JSON line per agent it starts (`arm`: the
attempt's key, its `AgentIdentity`, its cgroup, the moment its lease lapses) and per agent that
ended (`disarm`), and one per lease renewed (`renew`, `lease.py`). When the daemon dies for any
reason the kernel closes the pipe; the helper reads end-of-file and stops every agent still
armed at once: `cgroup.kill` of each attempt's cgroup (everything in it,
double-forked or not), and SIGKILL of each agent's process group and of every process carrying
its `MAM_AGENT_TAG` (the process-group mode's walk, `stop_orphan`). Then it exits. A clean
stop cancels every job first, so nothing is armed and the helper exits without a signal.
An armed agent whose lease lapses unrenewed (`until`, CLOCK_BOOTTIME) is stopped the same way
while the daemon lives on: a daemon frozen (SIGSTOP), stalled or cut off from the broker
renews nothing, and its agents must stop before the hub runs the job elsewhere.

No grace: an agent whose daemon is gone has nobody to report to, and its attempt is about to
be retried elsewhere (§10). The restarted runner still publishes the attempt's end (§6 orphans).

    switch = DeadmanSwitch()
    switch.arm("918b0612-1", agent.identity, cgroup.path, until)  # the helper starts on first use
    switch.renew("918b0612-1", later)                               # its lease was renewed
    switch.disarm("918b0612-1")                                     # the agent ended
    switch.close()                                           # the daemon stops: the helper exits

Limits: an agent started in the instant before `arm` is written is not armed; in process-group
mode a descendant that leaves the group AND scrubs `MAM_AGENT_TAG` is not found (README "Known
limits"); if the helper itself is killed, the daemon starts a new one and arms it again.
PR_SET_PDEATHSIG is not used: it fires when the forking *thread* ends and reaches only the agent.
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from mam.runner import lease
from mam.runner.cgroups import JobCgroup
from mam.runner.process_tree import AgentIdentity, stop_orphan

log = logging.getLogger("mam.daemon")

MODULE = "mam.runner.deadman"
MAX_LINE_BYTES = 4096
"""Longest line the helper takes (an identity and a cgroup path are far shorter)."""
READ_BYTES = 65536
Armed = dict[str, tuple[AgentIdentity, Path | None, float | None]]
"""Armed agents, in the switch and in the helper: key -> (identity, cgroup, lease end on CLOCK_BOOTTIME or None)."""
CLOSE_WAIT_S = 10.0
"""How long `close` waits for the helper to exit once the pipe is closed, seconds."""


class DeadmanSwitch:
    """The daemon's side: arm and disarm agents; the helper process starts on the first `arm`.

    Never raises: a switch that cannot start or write says so once (`log.warning`) and the
    runner goes on as before (a restarted runner still stops its orphans, §6).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: Armed = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._warned = False

    def arm(self, key: str, identity: AgentIdentity, cgroup: Path | None, until: float | None = None) -> None:
        """Stop this agent if the daemon dies, or at `until` (CLOCK_BOOTTIME, its lease's end;
        None: never) unless renewed. `key`: `<job_id>-<attempt>`."""
        with self._lock:
            self._armed[key] = (identity, cgroup, until)
            self._write(encode_arm(key, identity, cgroup, until))

    def renew(self, key: str, until: float) -> None:
        """The lease of the armed agent `key` now ends at `until` (§10 "Leases")."""
        with self._lock:
            armed = self._armed.get(key)
            if armed is None:
                return
            self._armed[key] = (armed[0], armed[1], until)
            self._write(json.dumps({"renew": key, "until": until}).encode() + b"\n")

    def disarm(self, key: str) -> None:
        """The agent of `key` ended (or was stopped): the daemon's death no longer concerns it."""
        with self._lock:
            if self._armed.pop(key, None) is not None:
                self._write(json.dumps({"disarm": key}).encode() + b"\n")

    @property
    def helper_pid(self) -> int | None:
        """The helper's pid while it runs, else None."""
        with self._lock:
            return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def close(self) -> None:
        """Close the pipe and reap the helper (it stops whatever is still armed, then exits)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("deadman helper %d did not exit: left running", proc.pid)

    def _write(self, line: bytes) -> None:
        """Write `line` (a new helper gets every armed agent instead); holds `_lock`."""
        fresh = self._proc is None or self._proc.poll() is not None
        if fresh and not self._start():
            return
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(b"".join(encode_arm(key, *armed) for key, armed in self._armed.items())
                                   if fresh else line)
            self._proc.stdin.flush()
        except OSError as exc:  # the helper died: the next write starts another one
            self._say_once(f"deadman helper {self._proc.pid} is gone ({exc.strerror or exc}); restarting it")

    def _start(self) -> bool:
        if self._proc is not None:
            self._say_once(f"deadman helper {self._proc.pid} ended (code {self._proc.returncode}); restarting it")
            if self._proc.stdin is not None:
                try:
                    self._proc.stdin.close()
                except OSError:
                    pass  # the broken pipe of a helper that died
            self._proc = None
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", MODULE, str(os.getpid())], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, close_fds=True,
                start_new_session=True)  # no terminal's Ctrl-C, no kill of the runner's group reaches it
        except OSError as exc:
            self._say_once(f"deadman helper not started ({exc.strerror or exc}): a runner killed with SIGKILL "
                           "leaves its agents running until it restarts")
            return False
        return True

    def _say_once(self, text: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s", text)


def encode_arm(key: str, identity: AgentIdentity, cgroup: Path | None, until: float | None = None) -> bytes:
    """One `arm` line of the pipe."""
    return json.dumps({"arm": key, "identity": identity.to_dict(),
                       "cgroup": str(cgroup) if cgroup is not None else None, "until": until}).encode() + b"\n"


def _until(value: object) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError("until is not a finite, non-negative number of seconds")
    return float(value)


def apply_line(armed: Armed, line: bytes) -> None:
    """Apply one line of the pipe to `armed`: `arm` (key, identity, cgroup, until), `renew`
    (key, until: a later lease end of an armed agent) or `disarm` (key).

    Raises:
        ValueError: not a JSON object of a known form, or over MAX_LINE_BYTES.
    """
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(f"line of {len(line)} bytes (at most {MAX_LINE_BYTES})")
    obj = json.loads(line)
    if not isinstance(obj, Mapping):
        raise ValueError("not a JSON object")
    key = obj.get("arm", obj.get("renew", obj.get("disarm")))
    if not isinstance(key, str) or not key:
        raise ValueError("no arm, renew or disarm key")
    if "disarm" in obj:
        armed.pop(key, None)
        return
    until = _until(obj.get("until"))
    if "renew" in obj and "arm" not in obj:
        if key in armed and until is not None:
            armed[key] = (armed[key][0], armed[key][1], until)
        return
    cgroup = obj.get("cgroup")
    if cgroup is not None and (not isinstance(cgroup, str) or not cgroup.startswith("/")):
        raise ValueError("cgroup is not an absolute path")
    armed[key] = (AgentIdentity.from_dict(obj.get("identity")), Path(cgroup) if cgroup else None, until)


def lapsed(armed: Armed, at: float) -> list[str]:
    """The keys of `armed` whose lease ended at or before `at` (CLOCK_BOOTTIME), sorted."""
    return sorted(key for key, (_, _, until) in armed.items() if until is not None and until <= at)


def next_lapse(armed: Armed) -> float | None:
    """The earliest lease end of `armed`, or None."""
    return min((until for _, _, until in armed.values() if until is not None), default=None)


def stop_all(armed: Iterable[tuple[AgentIdentity, Path | None]]) -> None:
    """Stop every armed agent now: each cgroup killed first (one write each, no waiting),
    then each process tree by group and tag, then wait for the cgroups to empty."""
    armed = list(armed)
    groups = [JobCgroup(path) for _, path in armed if path is not None]
    for group in groups:
        try:
            (group.path / "cgroup.kill").write_text("1")
        except OSError:
            pass  # gone already, or no cgroup.kill: `kill` below signals the members
    for identity, _ in armed:
        stop_orphan(identity, grace_s=0.0)
    for group in groups:
        group.kill()


def main(argv: list[str] | None = None) -> int:
    """`python -m mam.runner.deadman RUNNER_PID`: read the pipe until end-of-file, then stop
    whatever is still armed. Returns 0."""
    args = sys.argv[1:] if argv is None else argv
    runner = args[0] if args else "?"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s deadman[%(process)d] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    armed: Armed = {}
    for line in read_lines(sys.stdin.fileno(), armed, runner):
        try:
            apply_line(armed, line)
        except ValueError as exc:
            log.warning("line from runner %s ignored: %s", runner, exc)
    if armed:
        log.warning("runner %s is gone: stopping the agents of %s", runner, ", ".join(sorted(armed)))
        stop_all((identity, cgroup) for identity, cgroup, _ in armed.values())
    return 0


def read_lines(fd: int, armed: Armed, runner: str) -> Iterable[bytes]:
    """The pipe's lines until end-of-file; between them, each armed agent whose lease lapsed
    is stopped and dropped (§10 "Leases"). A line over MAX_LINE_BYTES is skipped whole."""
    pending = b""
    skipping = False
    while True:
        end = next_lapse(armed)
        timeout = None if end is None else max(0.0, end - lease.now())
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            fence(armed, runner)
            continue
        chunk = os.read(fd, READ_BYTES)
        if not chunk:
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if skipping:
                skipping = False
            else:
                yield line + b"\n"
        if len(pending) > MAX_LINE_BYTES:
            log.warning("line from runner %s ignored: over %d bytes", runner, MAX_LINE_BYTES)
            pending, skipping = b"", True
        fence(armed, runner)


def fence(armed: Armed, runner: str) -> None:
    """Stop and drop each armed agent whose lease lapsed (§10 "Leases")."""
    keys = lapsed(armed, lease.now())
    if keys:
        log.warning("runner %s renewed no lease of %s: stopping their agents", runner, ", ".join(keys))
        stop_all((armed[key][0], armed[key][1]) for key in keys)
        for key in keys:
            armed.pop(key, None)


if __name__ == "__main__":
    raise SystemExit(main())
