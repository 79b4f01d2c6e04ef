"""The process tree of one agent, found again and stopped as a whole (PROTOCOL §6).

`AgentIdentity` names an agent so that a restarted runner can find it again
(pid, create time, process group, `MAM_AGENT_TAG`); `ProcessTree` collects
its members (group, session, descendants, tagged escapees) and terminates
them (SIGTERM, grace, SIGKILL); `stop_orphan` does this for the agent of a
runner that died (`kill -9`), touching only processes proven the agent's.
"""

from __future__ import annotations

import logging
import os
import signal as _signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import psutil

log = logging.getLogger("mam.runner.supervisor")  # the log name operators know

AGENT_TAG_ENV = "MAM_AGENT_TAG"
"""Set by `AgentProcess.start()` to a fresh random value: every descendant inherits it, so
a cancel can find one that escaped the tree (double fork + `setsid`)."""
POLL_S = 0.02
"""How often a terminating tree is collected again."""
TAG_BYTES = 16
"""Random bytes of a `MAM_AGENT_TAG` (32 lowercase hex characters)."""
MAX_PROCESS_ID = 1 << 22
"""Linux's highest pid (PID_MAX_LIMIT); a larger one in an identity file is forged."""
KILL_WAIT_S = 5.0
"""How long SIGKILL is repeated before survivors (uninterruptible sleep) are logged and left."""

CREATE_TIME_TOLERANCE_S = 0.001  # psutil derives it from clock ticks (10 ms): equal values round-trip


@dataclass(frozen=True)
class AgentIdentity:
    """An agent process as a restarted runner can find it again (§6).

    Attributes:
        pid: the agent's pid.
        create_time: its psutil create time (seconds since the epoch): with
            `pid`, tells the agent from a later process that reused the pid.
        pgid: its process group id (= `pid`: the agent leads its own session).
        tag: the random `MAM_AGENT_TAG` value every descendant inherits.
    """

    pid: int
    create_time: float
    pgid: int
    tag: str

    def to_dict(self) -> dict[str, object]:
        """The JSON object of the identity file."""
        return {"pid": self.pid, "create_time": self.create_time, "pgid": self.pgid, "tag": self.tag}

    @classmethod
    def from_dict(cls, obj: object) -> AgentIdentity:
        """Parse `to_dict()` output, read back from a file an agent could have written.

        Raises:
            ValueError: not an object, a missing or mistyped field, a pid or
                pgid outside 2..MAX_PROCESS_ID, a tag that is not 32 lowercase hex.
        """
        if not isinstance(obj, Mapping):
            raise ValueError("agent identity is not a JSON object")
        pid, pgid = _process_id(obj, "pid"), _process_id(obj, "pgid")
        created, tag = obj.get("create_time"), obj.get("tag")
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not 0 < created < 1e11:
            raise ValueError(f"agent identity: create_time {created!r} is invalid")
        if not isinstance(tag, str) or len(tag) != 2 * TAG_BYTES or tag.strip("0123456789abcdef"):
            raise ValueError("agent identity: tag is invalid")
        return cls(pid=pid, create_time=float(created), pgid=pgid, tag=tag)

    def leader(self) -> psutil.Process | None:
        """The agent process itself if it still runs: same pid, same create time,
        not a zombie, and `MAM_AGENT_TAG` in its environment equal to `tag`
        (a forged identity file cannot point at a process outside the agent's tree).

        Returns:
            the process, or None (gone, reused pid, or not readable as ours).
        """
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > CREATE_TIME_TOLERANCE_S:
                return None
            if not _alive(proc) or proc.environ().get(AGENT_TAG_ENV) != self.tag:
                return None
            return proc
        except (psutil.Error, OSError):
            return None


def _process_id(obj: Mapping[str, object], name: str) -> int:
    """A pid or pgid field of an identity file, 2..MAX_PROCESS_ID.

    Raises:
        ValueError: missing, not an integer, or out of range.
    """
    value = obj.get(name)
    # pid 1 (init) and 0 (our own group for killpg) are never an agent's
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= MAX_PROCESS_ID:
        raise ValueError(f"agent identity: {name} {value!r} is invalid")
    return value


class ProcessTree:
    """The processes of one agent, found again and again while it runs and
    stopped as a whole (§6).

    Membership: every process seen before that still runs, their descendants
    (`children(recursive=True)`, which catches reparented ones that fork
    again), members of the agent's process group or session, and, on a deep
    scan, every process started after the agent whose environment carries the
    agent's `MAM_AGENT_TAG` (an escaped, never-seen descendant).

    Args:
        identity: the agent's `AgentIdentity`.
        owned: True when the caller holds the agent as its own unreaped child
            (`AgentProcess`): the group id cannot be reused, so every member
            of the group or session is the agent's. False for an orphan left
            by a dead runner (reparented to init, which reaps it): a group or
            session member counts only if its environment carries the tag, and
            the group is signalled only while a process proven ours is in it
            (a group id, unlike a pid, is not reused while a member lives).
    """

    def __init__(self, identity: AgentIdentity, *, owned: bool) -> None:
        self.identity = identity
        self.owned = owned
        self._seen: dict[tuple[int, float], psutil.Process] = {}
        self._lock = threading.Lock()

    @classmethod
    def of_orphan(cls, identity: AgentIdentity) -> ProcessTree:
        """The tree of an agent whose runner died, seeded with the agent if it still runs."""
        tree = cls(identity, owned=False)
        leader = identity.leader()
        if leader is not None:
            tree.remember([leader])
        return tree

    def remember(self, procs: Iterable[psutil.Process]) -> None:
        """Add `procs` (psutil.Process) to the processes known to be the agent's."""
        with self._lock:
            for proc in procs:
                try:
                    self._seen.setdefault((proc.pid, proc.create_time()), proc)
                except psutil.Error:
                    pass  # gone between listing and reading

    def known(self) -> list[psutil.Process]:
        """The processes remembered so far that still run (no new scan)."""
        with self._lock:
            return [p for p in self._seen.values() if _alive(p)]

    def _tagged(self, proc: psutil.Process) -> bool:
        try:
            return (proc.create_time() >= self.identity.create_time - CREATE_TIME_TOLERANCE_S
                    and proc.environ().get(AGENT_TAG_ENV) == self.identity.tag)
        except (psutil.Error, OSError):
            return False  # gone, or not ours to read

    def collect(self, *, deep: bool = False) -> list[psutil.Process]:
        """Every process of the tree seen now or earlier that is still alive (zombies excluded).

        Args:
            deep: also read the environment of every process started after the
                agent, looking for the tag (slower: one /proc read per process).
        """
        found: list[psutil.Process] = []
        with self._lock:
            roots = list(self._seen.values())
        for proc in roots:
            try:
                if _alive(proc):
                    found.append(proc)
                    found.extend(proc.children(recursive=True))
            except psutil.Error:
                pass
        pgid = self.identity.pgid
        for proc in psutil.process_iter():
            try:
                in_group = os.getpgid(proc.pid) == pgid or os.getsid(proc.pid) == pgid
                if in_group and (self.owned or self._tagged(proc)):
                    found.append(proc)
                elif deep and not in_group and self._tagged(proc):
                    found.append(proc)
            except (OSError, psutil.Error):
                pass  # gone, or not ours to read
        self.remember(found)
        with self._lock:
            return [p for p in self._seen.values() if _alive(p)]

    def signal_all(self, procs: list[psutil.Process], sig: int) -> None:
        """Send `sig` to the agent's process group and to every process of `procs`."""
        if self.owned or any(_in_group(p, self.identity.pgid) for p in procs):
            try:
                os.killpg(self.identity.pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # group already empty
        for proc in procs:
            try:
                proc.send_signal(sig)  # psutil refuses a reused pid (create-time check)
            except psutil.Error:
                pass

    def terminate(self, grace_s: float, *, reap: Callable[[], object] = lambda: None) -> list[int]:
        """Stop the whole tree (§6): SIGTERM to the process group and to every
        known process of the tree, wait up to `grace_s` for all of them to
        exit, collect the tree again, then SIGKILL every survivor and the
        group, repeating until nothing of the tree is left (a process stuck in
        uninterruptible sleep is logged after 5 s and left).

        Args:
            grace_s: seconds between SIGTERM and SIGKILL (`MAM_CANCEL_GRACE_S`).
            reap: called on every poll (e.g. `Popen.poll`, so our own child does
                not linger as a zombie).
        Returns:
            the pids that survived SIGKILL (normally empty).
        """
        procs = self.collect(deep=True)
        self.signal_all(procs, _signal.SIGTERM)
        deadline = time.monotonic() + max(0.0, grace_s)
        while time.monotonic() < deadline:
            reap()
            if not self.collect():
                break
            time.sleep(POLL_S)
        kill_deadline = time.monotonic() + KILL_WAIT_S
        deep = True  # one full re-scan before the first SIGKILL, then the cheap one
        while True:
            reap()
            procs = self.collect(deep=deep)
            deep = False
            if not procs:
                return []
            if time.monotonic() > kill_deadline:
                log.warning("agent %d: %d process(es) survive SIGKILL: %s", self.identity.pid, len(procs),
                            [p.pid for p in procs])
                return [p.pid for p in procs]
            self.signal_all(procs, _signal.SIGKILL)
            time.sleep(POLL_S)


def stop_orphan(identity: AgentIdentity, grace_s: float) -> bool:
    """Stop the process tree of an agent whose runner died (§6), as a cancel does,
    without a `Popen` (the agent was reparented to init).

    Args:
        identity: read back from the identity file the runner wrote at start.
        grace_s: seconds between SIGTERM and SIGKILL (`MAM_CANCEL_GRACE_S`).
    Returns:
        True if anything of the tree was found running (and was stopped),
        False if the agent and every tagged descendant were already gone.
    """
    tree = ProcessTree.of_orphan(identity)
    if not tree.collect(deep=True):
        return False
    tree.terminate(grace_s)
    return True


def _in_group(proc: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(proc.pid) == pgid
    except OSError:
        return False


def _alive(proc: psutil.Process) -> bool:
    """True if `proc` still runs: zombies count as gone (they can no longer act)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
