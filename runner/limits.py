"""Per-job resource limits and usage (PROTOCOL §6 "Limits"): `dispatch --memory 8G --cpus 2
--pids 512` applied to every process of the attempt where the host gives the controllers.

Detect, do not assume (`detect`). For each of `memory`, `pids` and `cpu` (and `cpuacct`, CPU
seconds on v1) the runner uses:
- the cgroup v2 controller, where its group of job groups (`cgroups.RunnerCgroups`, which also
  kills) lists it in `cgroup.controllers` and takes `+<name>` in `cgroup.subtree_control`
  (the delegating parent must have enabled it there: `Delegate=yes` with the controllers);
- else the cgroup v1 hierarchy of that controller (a `cgroup` mount with it among its options;
  the runner's place in it from /proc/self/cgroup, `N:memory:/path`), under which it makes
  `mam-<session>-<pid>` and per attempt `<job_id>-<attempt>`; the agent joins each v1 group
  between fork and exec, as it joins its v2 group, so its descendants are members too.
Every attempt gets its groups, limits or not, so its terminal event can report its peak memory.

    found, why = detect("gpu-box", v2=runner_cgroups.path)   # `why`: one line, logged at start
    job = found.job("918b0612-1", v2=job_cgroup.path)
    applied, missing = job.apply(memory_bytes=64 << 20, cpus=None, pids=512)
    job.procs_files()        # what the agent joins (v1)
    job.oom_kills()          # processes the kernel's OOM killer took in the group
    job.usage()              # {"peak_memory_bytes", "cpu_s"} where the host gives them
    job.remove()             # once the group is empty
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mam.runner.cgroups import denied, runner_group

log = logging.getLogger("mam.cgroups")

LIMIT_CONTROLLERS = ("memory", "pids", "cpu")
"""The controllers a limit needs, in the order they are said."""
USAGE_CONTROLLERS = ("cpuacct",)
"""v1 controllers joined for usage only (CPU seconds)."""
CPU_PERIOD_US = 100_000
"""The CFS period a `--cpus` quota is written against, microseconds (docker's too)."""
LIMIT_OF = {"memory": "memory_bytes", "pids": "pids", "cpu": "cpus"}
"""Which limit each controller enforces (the `work` field, §18)."""


def v1_mounts(mountinfo: str) -> dict[str, Path]:
    """Controller name -> mount point of each cgroup v1 hierarchy in a /proc/self/mountinfo text."""
    found: dict[str, Path] = {}
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts, rest = fields.split(), tail.split()
        if len(parts) < 5 or len(rest) < 3 or rest[0] != "cgroup":
            continue
        for option in rest[2].split(","):
            if option in LIMIT_CONTROLLERS + USAGE_CONTROLLERS:
                found.setdefault(option, Path(parts[4].replace("\\040", " ")))
    return found


def v1_paths(proc_cgroup: str) -> dict[str, str]:
    """Controller name -> this process's path in its v1 hierarchy (/proc/self/cgroup lines
    `N:cpu,cpuacct:/path`)."""
    found: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[1] and parts[2].startswith("/"):
            for name in parts[1].split(","):
                found[name] = parts[2]
    return found


@dataclass
class JobLimits:
    """One attempt's limit groups: its v2 group where the controllers are there, and one v1
    group per v1 controller."""

    v2: Path | None
    v2_controllers: frozenset[str]
    v1: dict[str, Path] = field(default_factory=dict)

    def apply(self, *, memory_bytes: int | None, cpus: float | None,
              pids: int | None) -> tuple[dict[str, float | int], list[str]]:
        """Write the limits asked for; returns (what is enforced, keyed as in `work`; the
        limits asked for that this host cannot enforce, each as `name (why)`)."""
        asked: dict[str, float | int | None] = {"memory_bytes": memory_bytes, "cpus": cpus, "pids": pids}
        applied: dict[str, float | int] = {}
        missing: list[str] = []
        for controller in LIMIT_CONTROLLERS:
            key = LIMIT_OF[controller]
            value = asked[key]
            if value is None:
                continue
            try:
                if controller in self.v2_controllers and self.v2 is not None:
                    _write_v2(self.v2, controller, value)
                elif controller in self.v1:
                    _write_v1(self.v1[controller], controller, value)
                else:
                    missing.append(f"{key} (no {controller} controller here)")
                    continue
            except OSError as exc:
                missing.append(f"{key} ({exc.strerror or exc})")
                continue
            applied[key] = value
        return applied, missing

    def procs_files(self) -> list[Path]:
        """The v1 groups' `cgroup.procs`, for the agent to join before it execs."""
        return [path / "cgroup.procs" for path in self.v1.values()]

    def oom_kills(self) -> int:
        """How many processes of the group the kernel's OOM killer took (v2 `memory.events`,
        v1 `memory.oom_control`), 0 when the host does not say."""
        if "memory" in self.v2_controllers and self.v2 is not None:
            return _counter(self.v2 / "memory.events", "oom_kill")
        if "memory" in self.v1:
            return _counter(self.v1["memory"] / "memory.oom_control", "oom_kill")
        return 0

    def usage(self) -> dict[str, float | int]:
        """What the v1 groups say the attempt used: `peak_memory_bytes` (memory.max_usage_in_bytes)
        and `cpu_s` (cpuacct.usage, nanoseconds); left out where there is no such group."""
        found: dict[str, float | int] = {}
        peak = _read_int(self.v1["memory"] / "memory.max_usage_in_bytes") if "memory" in self.v1 else None
        if peak is not None:
            found["peak_memory_bytes"] = peak
        used_ns = _read_int(self.v1["cpuacct"] / "cpuacct.usage") if "cpuacct" in self.v1 else None
        if used_ns is not None:
            found["cpu_s"] = round(used_ns / 1e9, 3)
        return found

    def remove(self) -> None:
        """Remove the v1 groups (empty once the agent's tree is stopped); never raises."""
        for path in self.v1.values():
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cgroup %s not removed: %s", path, exc.strerror or exc)


@dataclass(frozen=True)
class RunnerLimits:
    """Where this runner can limit its jobs: v2 controllers enabled for its job groups, and
    its v1 groups (`<hierarchy>/<own path>/mam-<session>-<pid>`) by controller."""

    v2: Path | None
    v2_controllers: frozenset[str]
    v1: Mapping[str, Path]

    def controllers(self) -> list[str]:
        """The limit controllers in force, as said at start."""
        return [c for c in LIMIT_CONTROLLERS if c in self.v2_controllers or c in self.v1]

    def job(self, name: str, *, v2: Path | None) -> JobLimits:
        """Make the attempt's v1 groups (`name`: `<job_id>-<attempt>`); `v2`: its v2 group, or
        None. A v1 group that cannot be made is left out (its limit is then said missing)."""
        groups: dict[str, Path] = {}
        for controller, parent in self.v1.items():
            path = parent / name
            try:
                path.mkdir(exist_ok=True)
            except OSError as exc:
                log.warning("cgroup %s not made: %s", path, exc.strerror or exc)
                continue
            groups[controller] = path
        return JobLimits(v2=v2, v2_controllers=self.v2_controllers if v2 is not None else frozenset(), v1=groups)

    def close(self) -> None:
        """Remove this runner's (empty) v1 groups; never raises."""
        for parent in self.v1.values():
            for child in _dirs(parent):
                try:
                    child.rmdir()
                except OSError:
                    pass
            try:
                parent.rmdir()
            except OSError:
                pass


def detect(session: str, *, v2: Path | None, proc: Path = Path("/proc/self")) -> tuple[RunnerLimits, str]:
    """Where this runner can limit its jobs, and one line saying so (logged once at start).

    Args:
        session: the runner's session (in its v1 groups' names).
        v2: the runner's v2 group of job groups (`RunnerCgroups.path`), or None (cgroups off).
        proc: where mountinfo and cgroup are read (tests give a folder of their own).
    """
    enabled = _enable_v2(v2) if v2 is not None else frozenset()
    try:
        mounts = v1_mounts((proc / "mountinfo").read_text())
        own = v1_paths((proc / "cgroup").read_text())
    except OSError:
        mounts, own = {}, {}
    v1: dict[str, Path] = {}
    why: list[str] = []
    for controller in (*LIMIT_CONTROLLERS, *USAGE_CONTROLLERS):
        if controller in enabled or controller not in mounts or controller not in own:
            continue
        parent = mounts[controller] / own[controller].lstrip("/")
        try:
            v1[controller] = runner_group(parent, session)
        except OSError as exc:
            why.append(f"{controller}: {'no write access to ' + str(parent) if denied(exc) else exc.strerror or exc}")
    found = RunnerLimits(v2=v2, v2_controllers=enabled, v1=v1)
    said = [f"{c} (cgroup {'v2' if c in enabled else 'v1'})" for c in found.controllers()]
    off = [c for c in LIMIT_CONTROLLERS if c not in found.controllers()]
    line = f"limits: {', '.join(said) or 'none'}"
    if off:
        line += f"; not here: {', '.join(off)}" + (f" ({'; '.join(why)})" if why else "")
    return found, line


def _enable_v2(group: Path) -> frozenset[str]:
    """Enable each limit controller the runner's v2 group offers for its job groups; which took."""
    try:
        offered = set((group / "cgroup.controllers").read_text().split())
    except OSError:
        return frozenset()
    enabled = set()
    for controller in LIMIT_CONTROLLERS:
        if controller not in offered:
            continue
        try:
            (group / "cgroup.subtree_control").write_text(f"+{controller}")
        except OSError:
            continue
        enabled.add(controller)
    return frozenset(enabled)


def _write_v2(group: Path, controller: str, value: float) -> None:
    if controller == "memory":
        (group / "memory.max").write_text(str(int(value)))
        swap = group / "memory.swap.max"
        if swap.exists():
            swap.write_text("0")  # over the limit is an OOM, not swapping
    elif controller == "pids":
        (group / "pids.max").write_text(str(int(value)))
    else:
        (group / "cpu.max").write_text(f"{max(1000, round(value * CPU_PERIOD_US))} {CPU_PERIOD_US}")


def _write_v1(group: Path, controller: str, value: float) -> None:
    if controller == "memory":
        (group / "memory.limit_in_bytes").write_text(str(int(value)))
        swap = group / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(int(value)))  # memory + swap: over the limit is an OOM, not swapping
    elif controller == "pids":
        (group / "pids.max").write_text(str(int(value)))
    else:
        (group / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, round(value * CPU_PERIOD_US))))


def _counter(path: Path, key: str) -> int:
    """The value of `key` in a flat-keyed cgroup file (`oom_kill 1`), 0 when absent."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _dirs(path: Path) -> list[Path]:
    try:
        return [child for child in path.iterdir() if child.is_dir()]
    except OSError:
        return []


__all__ = ["JobLimits", "RunnerLimits", "detect", "v1_mounts", "v1_paths"]
