"""runner/cgroups.py without a real hierarchy (PROTOCOL §6): where the v2 hierarchy and the
runner's own group are read from, what `detect` says when it cannot use them, and the sweep
of a dead runner's empty groups. tests/e2e/test_supervisor.py runs agents in real groups."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mam.runner import cgroups

pytestmark = pytest.mark.timeout(60)

HYBRID = """\
24 31 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 24 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
42 31 0:39 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
"""
SYSTEMD = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


def test_the_v2_mount_point_is_read_from_mountinfo():
    assert cgroups.cgroup2_mount(HYBRID) == Path("/sys/fs/cgroup/unified")
    assert cgroups.cgroup2_mount(SYSTEMD) == Path("/sys/fs/cgroup")
    assert cgroups.cgroup2_mount(HYBRID.replace("cgroup2 cgroup2", "tmpfs tmpfs")) is None
    assert cgroups.cgroup2_mount("garbage\n - cgroup2\n\n") is None
    spaced = "41 31 0:38 / /mnt/my\\040cg rw - cgroup2 cgroup2 rw\n"
    assert cgroups.cgroup2_mount(spaced) == Path("/mnt/my cg")


@pytest.mark.parametrize(("text", "path"), [
    ("0::/\n", "/"), ("12:pids:/x\n0::/system.slice/mam-runner.service\n", "/system.slice/mam-runner.service"),
    ("4:memory:/a\n1:cpu:/\n", None), ("0::relative\n", None), ("", None),
])
def test_the_runners_own_group_is_the_0_line_of_proc_self_cgroup(text, path):
    assert cgroups.own_cgroup(text) == path


def fake_proc(tmp_path: Path, mountinfo: str, cgroup: str = "0::/\n") -> Path:
    proc = tmp_path / "proc"
    proc.mkdir(parents=True)
    (proc / "mountinfo").write_text(mountinfo)
    (proc / "cgroup").write_text(cgroup)
    return proc


def test_detect_says_why_cgroups_are_off_in_one_line(tmp_path):
    found, why = cgroups.detect("gpu-box", proc=tmp_path / "missing")
    assert found is None and why.startswith("cgroups off: ") and "\n" not in why
    found, why = cgroups.detect("gpu-box", proc=fake_proc(tmp_path, HYBRID.replace("cgroup2 cgroup2", "x x")))
    assert (found, why) == (None, "cgroups off: no cgroup v2 hierarchy is mounted")
    mount = tmp_path / "cg"  # a plain folder: the runner's group is made, but no cgroup.kill appears
    mount.mkdir()
    found, why = cgroups.detect("gpu-box", proc=fake_proc(tmp_path / "b", f"1 1 0:1 / {mount} rw - cgroup2 x rw\n"))
    assert found is None and why == f"cgroups off: {mount} has no cgroup.kill (a kernel before 5.14)"
    assert list(mount.iterdir()) == []  # nothing left behind
    found, why = cgroups.detect("gpu-box", proc=fake_proc(tmp_path / "c", f"1 1 0:1 / {mount / 'gone'} rw - cgroup2 "
                                                                        "x rw\n", "0::/deeper\n"))
    assert found is None and why.startswith(f"cgroups off: {mount / 'gone' / 'deeper'} cannot hold the runner's")


def test_a_dead_runners_empty_groups_are_swept_and_nothing_else(tmp_path):
    dead = 2 ** 22 + 12345  # above pid_max's default: never a running process
    stale = tmp_path / f"mam-gpu-box-{dead}"
    (stale / "918b0612-1").mkdir(parents=True)
    mine = tmp_path / f"mam-gpu-box-{os.getpid()}"
    (mine / "918b0612-2").mkdir(parents=True)
    other = tmp_path / f"system-{dead}"
    other.mkdir()
    assert cgroups.sweep(tmp_path) == 1
    assert not stale.exists() and mine.exists() and other.exists()


def test_a_group_that_is_gone_has_no_members_and_kills_nothing(tmp_path):
    group = cgroups.JobCgroup(tmp_path / "gone")
    assert group.members() == [] and group.kill() and group.stop(0.1) == 0
    group.remove()  # never raises


def test_usage_reads_cpu_seconds_and_peak_memory_where_the_host_gives_them(tmp_path):
    group = cgroups.JobCgroup(tmp_path)
    assert group.usage() == {}
    (tmp_path / "cpu.stat").write_text("usage_usec 1234567\nuser_usec 1000000\nsystem_usec 234567\n")
    assert group.usage() == {"cpu_s": 1.235}
    (tmp_path / "memory.peak").write_text("209715200\n")
    assert group.usage() == {"cpu_s": 1.235, "peak_memory_bytes": 209715200}
    (tmp_path / "cpu.stat").write_text("usage_usec -1\n")
    (tmp_path / "memory.peak").write_text("max\n")
    assert group.usage() == {}  # nothing it cannot read as a figure


@pytest.mark.parametrize(("options", "hinted"), [
    ("rw", True), ("rw,nsdelegate", True), ("rw,nsdelegate,favordynmods", False), ("rw,favordynmods", False),
])
def test_cgroups_on_says_when_each_agent_start_waits_for_a_grace_period(tmp_path, options, hinted):
    """Without favordynmods every move into a group waits for an RCU grace period (about
    10 ms on an idle VM of this kind, on every agent start): the start line says how to
    avoid it, and still names the runner's groups as its first word after "under"."""
    mount = tmp_path / "cg"
    own = mount / f"mam-gpu-box-{os.getpid()}"
    own.mkdir(parents=True)
    (own / "cgroup.kill").touch()  # a plain folder standing in for a kernel's group
    mountinfo = f"41 31 0:38 / {mount} rw,relatime - cgroup2 cgroup2 {options}\n"
    assert cgroups.favors_dynmods(mountinfo) is not hinted
    found, said = cgroups.detect("gpu-box", proc=fake_proc(tmp_path, mountinfo))
    assert found is not None and found.path == own
    assert said.startswith(f"cgroups on: each job's agent runs in a group of its own under {own}")
    assert said.split(" under ", 1)[1].split()[0] == str(own)
    assert ("favordynmods" in said) is hinted and "\n" not in said
    if hinted:
        assert f"mount {mount} with favordynmods" in said


@pytest.mark.parametrize("mountinfo", [
    "", "garbage\n", "41 31 0:38 / /cg rw - cgroup2\n", "41 31 0:38 / /cg rw - cgroup2 cgroup2\n",
    "41 31 0:38 / /cg rw - cgroup cgroup rw,favordynmods\n",  # a v1 hierarchy's options say nothing of v2
])
def test_favors_dynmods_is_false_for_lines_it_cannot_read(mountinfo):
    assert cgroups.favors_dynmods(mountinfo) is False
