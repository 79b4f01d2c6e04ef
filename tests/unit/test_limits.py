"""runner/limits.py without a real hierarchy (PROTOCOL §6 "Limits"): where the v1 hierarchies
and the runner's place in them are read from, what `detect` says, which files a limit writes
on v1 and v2, how an OOM kill and the usage are read, and that nothing is left behind.
tests/e2e/test_supervisor.py runs agents under real limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from mam.runner import limits

pytestmark = pytest.mark.timeout(60)

HYBRID = """\
31 24 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
42 31 0:39 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
43 31 0:40 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
44 31 0:41 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
45 31 0:42 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
"""
PROC_CGROUP = "5:pids:/\n4:memory:/process_api/e5bb\n2:cpu,cpuacct:/\n0::/\n"


def test_v1_hierarchies_and_the_runners_place_in_them_are_read_from_proc():
    assert limits.v1_mounts(HYBRID) == {"memory": Path("/sys/fs/cgroup/memory"),
                                        "cpu": Path("/sys/fs/cgroup/cpu,cpuacct"),
                                        "cpuacct": Path("/sys/fs/cgroup/cpu,cpuacct"),
                                        "pids": Path("/sys/fs/cgroup/pids")}
    assert limits.v1_mounts("garbage\n - cgroup\n1 2 - cgroup x\n") == {}
    assert limits.v1_paths(PROC_CGROUP) == {"pids": "/", "memory": "/process_api/e5bb", "cpu": "/", "cpuacct": "/"}
    assert limits.v1_paths("0::/\nnonsense\n4:memory:relative\n") == {}


def fake_host(tmp_path: Path) -> Path:
    """A /proc/self whose mountinfo points the v1 hierarchies at plain folders under tmp_path."""
    proc = tmp_path / "proc"
    proc.mkdir()
    text = HYBRID.replace("/sys/fs/cgroup/", f"{tmp_path}/cg/")
    for folder in ("memory/process_api/e5bb", "cpu,cpuacct", "pids"):
        (tmp_path / "cg" / folder).mkdir(parents=True)
    (proc / "mountinfo").write_text(text)
    (proc / "cgroup").write_text(PROC_CGROUP)
    return proc


def test_detect_makes_the_runners_v1_groups_and_says_which_limits_are_in_force(tmp_path):
    found, said = limits.detect("gpu-box", v2=None, proc=fake_host(tmp_path))
    assert said == "limits: memory (cgroup v1), pids (cgroup v1), cpu (cgroup v1)"
    assert set(found.v1) == {"memory", "pids", "cpu", "cpuacct"}
    memory = found.v1["memory"]
    assert memory.parent == tmp_path / "cg" / "memory" / "process_api" / "e5bb"
    assert memory.name.startswith("mam-gpu-box-")
    found.close()
    assert not any(path.exists() for path in found.v1.values())


def test_detect_says_what_it_cannot_use_in_one_line(tmp_path):
    found, said = limits.detect("gpu-box", v2=None, proc=tmp_path / "missing")
    assert (found.controllers(), said) == ([], "limits: none; not here: memory, pids, cpu")
    proc = fake_host(tmp_path)
    (tmp_path / "cg" / "pids").rmdir()
    (tmp_path / "cg" / "pids").write_text("")  # not a folder: its group cannot be made
    found, said = limits.detect("gpu-box", v2=None, proc=proc)
    assert said.startswith("limits: memory (cgroup v1), cpu (cgroup v1); not here: pids (pids: ") and "\n" not in said
    found.close()


def test_limits_are_written_to_the_v1_groups_and_said_missing_where_there_is_none(tmp_path):
    found, _ = limits.detect("gpu-box", v2=None, proc=fake_host(tmp_path))
    job = found.job("918b0612-1", v2=None)
    (job.v1["memory"] / "memory.memsw.limit_in_bytes").write_text("")  # the host has swap accounting
    applied, missing = job.apply(memory_bytes=64 << 20, cpus=1.5, pids=64)
    assert (applied, missing) == ({"memory_bytes": 64 << 20, "cpus": 1.5, "pids": 64}, [])
    assert (job.v1["memory"] / "memory.limit_in_bytes").read_text() == str(64 << 20)
    assert (job.v1["memory"] / "memory.memsw.limit_in_bytes").read_text() == str(64 << 20)  # no swapping past it
    assert (job.v1["pids"] / "pids.max").read_text() == "64"
    assert (job.v1["cpu"] / "cpu.cfs_quota_us").read_text() == "150000"
    assert (job.v1["cpu"] / "cpu.cfs_period_us").read_text() == "100000"
    assert job.procs_files() == [path / "cgroup.procs" for path in job.v1.values()]
    no_pids = limits.JobLimits(v2=None, v2_controllers=frozenset(), v1={"memory": job.v1["memory"]})
    assert no_pids.apply(memory_bytes=None, cpus=None, pids=64) == ({}, ["pids (no pids controller here)"])


def test_oom_kills_and_usage_are_read_from_the_groups_and_absent_figures_left_out(tmp_path):
    found, _ = limits.detect("gpu-box", v2=None, proc=fake_host(tmp_path))
    job = found.job("918b0612-1", v2=None)
    assert (job.oom_kills(), job.usage()) == (0, {})
    (job.v1["memory"] / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (job.v1["memory"] / "memory.max_usage_in_bytes").write_text("67108864\n")
    (job.v1["cpuacct"] / "cpuacct.usage").write_text("1500000000\n")
    assert job.oom_kills() == 2
    assert job.usage() == {"peak_memory_bytes": 67108864, "cpu_s": 1.5}
    (job.v1["memory"] / "memory.oom_control").write_text("oom_kill garbage\n")
    assert job.oom_kills() == 0


def test_v2_controllers_are_enabled_for_the_job_groups_and_take_the_limits(tmp_path):
    group = tmp_path / "mam-gpu-box-1"
    group.mkdir()
    (group / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    found, said = limits.detect("gpu-box", v2=group, proc=tmp_path / "missing")
    assert said == "limits: memory (cgroup v2), pids (cgroup v2), cpu (cgroup v2)"
    assert (group / "cgroup.subtree_control").read_text() == "+cpu"  # one write per controller
    job_group = group / "918b0612-1"
    job_group.mkdir()
    (job_group / "memory.swap.max").write_text("max")
    job = found.job("918b0612-1", v2=job_group)
    applied, missing = job.apply(memory_bytes=8 << 30, cpus=0.5, pids=512)
    assert missing == [] and applied == {"memory_bytes": 8 << 30, "cpus": 0.5, "pids": 512}
    assert (job_group / "memory.max").read_text() == str(8 << 30)
    assert (job_group / "memory.swap.max").read_text() == "0"
    assert (job_group / "cpu.max").read_text() == "50000 100000"
    assert (job_group / "pids.max").read_text() == "512"
    (job_group / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert job.oom_kills() == 1 and job.procs_files() == []


def test_a_v2_group_without_controllers_leaves_limits_to_v1(tmp_path):
    group = tmp_path / "mam-gpu-box-1"
    group.mkdir()
    (group / "cgroup.controllers").write_text("\n")  # this machine kind: cgroup.kill, no controllers
    found, said = limits.detect("gpu-box", v2=group, proc=fake_host(tmp_path))
    assert said == "limits: memory (cgroup v1), pids (cgroup v1), cpu (cgroup v1)"
    assert found.v2_controllers == frozenset() and not (group / "cgroup.subtree_control").exists()
    found.close()
