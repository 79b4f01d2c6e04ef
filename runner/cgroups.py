"""Each attempt's agent in a cgroup of its own, where the host allows it (PROTOCOL §6
"Cancel"): every process the agent starts stays a member, double-forked, `setsid` or
with its environment cleared, so a cancel reaches all of them (cgroup v2 `cgroup.kill`).

Detect, do not assume (`detect`): the cgroup v2 hierarchy is found in
/proc/self/mountinfo (`/sys/fs/cgroup` on a systemd host with cgroup v2 everywhere,
`/sys/fs/cgroup/unified` in the hybrid layout), the runner's own group in
/proc/self/cgroup (`0::<path>`), and the runner makes `mam-<session>-<pid>` under it,
which needs write access there (root, or a subtree delegated to the runner's unit:
`Delegate=yes`). Every job gets `<that>/<job_id>-<attempt>`. Where any step fails the
runner says why once and cancels by process group and environment tag as before.

    found, why = detect("gpu-box")
    group = found.job("918b0612-1")      # made; an agent joins it at its start (`join_fd`)
    group.kill()                          # every member, SIGKILL, at once
    group.remove()                        # once empty
"""

from __future__ import annotations

import errno
import logging
import os
import signal as _signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("mam.cgroups")

POLL_S = 0.05
KILL_WAIT_S = 5.0
"""How long `kill` waits for the group to empty after `cgroup.kill`, seconds."""
PREFIX = "mam-"


def cgroup2_mount(mountinfo: str) -> Path | None:
    """The mount point of the cgroup v2 hierarchy in a /proc/self/mountinfo text, or None."""
    found = _cgroup2_line(mountinfo)
    return None if found is None else Path(found[0][4].replace("\\040", " "))


def favors_dynmods(mountinfo: str) -> bool:
    """Whether the cgroup v2 hierarchy is mounted with `favordynmods` (Linux 6.0+): moving a
    process into a group then takes ~0.1 ms instead of waiting for an RCU grace period
    (8-13 ms measured on an idle 2-core VM), which every agent start pays (its spawn joins
    the job's groups)."""
    found = _cgroup2_line(mountinfo)
    if found is None or len(found[1]) < 3:
        return False
    return "favordynmods" in found[1][2].split(",")  # the super options: "cgroup2 <source> rw,..."


def _cgroup2_line(mountinfo: str) -> tuple[list[str], list[str]] | None:
    """The first cgroup2 line of a mountinfo text: (the fields before " - ", those after)."""
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts, after = fields.split(), tail.split()
        if after[:1] == ["cgroup2"] and len(parts) >= 5:
            return parts, after
    return None


def own_cgroup(proc_cgroup: str) -> str | None:
    """This process's path in the v2 hierarchy (the `0::` line of /proc/self/cgroup), or None."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            path = line[3:].strip()
            return path if path.startswith("/") else None
    return None


@dataclass(frozen=True)
class JobCgroup:
    """One attempt's cgroup (a directory of the v2 hierarchy)."""

    path: Path

    def join_fd(self) -> int:
        """An fd open for writing on its `cgroup.procs`: a child writes "0" there to join
        (`AgentProcess` does between fork and exec). The caller closes it."""
        return os.open(self.path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)

    def members(self) -> list[int]:
        """The pids in the group now (empty when it is gone)."""
        try:
            text = (self.path / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(pid) for pid in text.split() if pid.isdigit()]

    def signal(self, signum: int) -> int:
        """Send `signum` to every member; how many there were."""
        pids = self.members()
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        return len(pids)

    def wait_empty(self, deadline: float) -> bool:
        """Poll until the group has no member or `deadline` (monotonic) passed; True when empty."""
        while self.members():
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def kill(self) -> bool:
        """SIGKILL every member at once (`cgroup.kill`) and wait for the group to empty (up
        to KILL_WAIT_S); True when it did. Nothing to do for a group already gone."""
        try:
            (self.path / "cgroup.kill").write_text("1")
        except FileNotFoundError:
            return True
        except OSError as exc:
            log.warning("cgroup %s: cgroup.kill failed: %s; signalling its members", self.path, exc)
            self.signal(_signal.SIGKILL)
        if self.wait_empty(time.monotonic() + KILL_WAIT_S):
            return True
        log.warning("cgroup %s: %d process(es) survive SIGKILL", self.path, len(self.members()))
        return False

    def stop(self, grace_s: float) -> int:
        """SIGTERM every member, SIGKILL what is left after `grace_s`; how many there were."""
        found = self.signal(_signal.SIGTERM)
        if found and not self.wait_empty(time.monotonic() + max(0.0, grace_s)):
            self.kill()
        return found

    def usage(self) -> dict[str, float | int]:
        """What the group's processes used so far, those that exited included: `cpu_s` (CPU
        seconds, `cpu.stat` usage_usec) and `peak_memory_bytes` (`memory.peak`, where the
        memory controller is on); a figure the host does not give is left out."""
        found: dict[str, float | int] = {}
        try:
            for line in (self.path / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec" and value.strip().isdigit():
                    found["cpu_s"] = round(int(value) / 1e6, 3)
        except OSError:
            pass
        try:
            peak = (self.path / "memory.peak").read_text().strip()
            if peak.isdigit():
                found["peak_memory_bytes"] = int(peak)
        except OSError:
            pass
        return found

    def remove(self) -> None:
        """Remove the group once it is empty (a member left is killed first); never raises."""
        if self.members():
            self.kill()
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cgroup %s not removed: %s", self.path, exc)


@dataclass(frozen=True)
class RunnerCgroups:
    """The runner's own group of job groups, `<own cgroup>/mam-<session>-<pid>`."""

    path: Path

    def job(self, name: str) -> JobCgroup:
        """Make (or take) the group `name` (`<job_id>-<attempt>`).

        Raises:
            OSError: it cannot be made.
        """
        path = self.path / name
        path.mkdir(exist_ok=True)
        return JobCgroup(path)

    def close(self) -> None:
        """Remove every (empty) job group and this one; never raises."""
        for child in _children(self.path):
            JobCgroup(child).remove()
        try:
            self.path.rmdir()
        except OSError:
            pass


def _children(path: Path) -> Iterable[Path]:
    try:
        return [child for child in path.iterdir() if child.is_dir()]
    except OSError:
        return []


def sweep(parent: Path) -> int:
    """Remove the empty groups of runners that are gone (`mam-*-<pid>` whose pid does not
    run); a group with members is left to the orphan handling. Returns how many went."""
    removed = 0
    for stale in _children(parent):
        pid = stale.name.rpartition("-")[2]
        if not stale.name.startswith(PREFIX) or not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            for child in _children(stale):
                child.rmdir()
            stale.rmdir()
            removed += 1
        except OSError:
            continue
    return removed


def runner_group(parent: Path, session: str) -> Path:
    """Sweep `parent` (`sweep`), then make, or find, this runner's group in it:
    `<parent>/mam-<session>-<pid>`. Raises OSError (`denied` tells a permission refusal)."""
    sweep(parent)
    path = parent / f"{PREFIX}{session}-{os.getpid()}"
    path.mkdir(exist_ok=True)
    return path


def denied(exc: OSError) -> bool:
    """True when `exc` is the host refusing us the folder (no write access, read-only)."""
    return exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def detect(session: str, *, proc: Path = Path("/proc/self")) -> tuple[RunnerCgroups | None, str]:
    """The runner's job groups where the host allows them, else None; and one line saying
    which mode is in force (logged once at start).

    Args:
        session: the runner's session name (in the group's name).
        proc: where mountinfo and cgroup are read (tests give a folder of their own).
    """
    try:
        mountinfo = (proc / "mountinfo").read_text()
        mount = cgroup2_mount(mountinfo)
        own = own_cgroup((proc / "cgroup").read_text())
    except OSError as exc:
        return None, f"cgroups off: {exc.strerror or exc}"
    if mount is None or own is None:
        return None, "cgroups off: no cgroup v2 hierarchy is mounted"
    parent = mount / own.lstrip("/")
    try:
        path = runner_group(parent, session)
    except OSError as exc:
        why = "no write access (delegate a subtree: Delegate=yes)" if denied(exc) else (exc.strerror or str(exc))
        return None, f"cgroups off: {parent} cannot hold the runner's groups: {why}"
    if not (path / "cgroup.kill").exists():
        RunnerCgroups(path).close()
        return None, f"cgroups off: {parent} has no cgroup.kill (a kernel before 5.14)"
    said = f"cgroups on: each job's agent runs in a group of its own under {path}"
    if not favors_dynmods(mountinfo):
        said += (f" (each agent start waits for the kernel to move it into its groups, an RCU grace period of "
                 f"about 10 ms on an idle 2-core VM: mount {mount} with favordynmods, Linux 6.0+, to make that "
                 f"~0.1 ms)")
    return RunnerCgroups(path), said


__all__ = ["JobCgroup", "RunnerCgroups", "cgroup2_mount", "denied", "detect", "favors_dynmods", "own_cgroup",
           "runner_group", "sweep"]
