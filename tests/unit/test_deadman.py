"""runner/deadman.py (PROTOCOL §6 "The daemon's death", §10 "Leases"): the lines of the pipe,
refused when malformed, oversized or hostile; and a real helper process that stops every armed
agent tree (an escaped descendant carrying the tag included) when the pipe closes, and nothing
disarmed; and one whose lease lapses unrenewed while the pipe stays open.
tests/e2e/test_daemon.py kills a real runner with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mam.runner import deadman, lease
from mam.runner.agent import AGENT_TAG_ENV
from mam.runner.process_tree import AgentIdentity

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 30.0


def wait_for(check, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return found


def identity(pid: int = 4242, tag: str = "ab" * 16) -> AgentIdentity:
    return AgentIdentity(pid=pid, create_time=1.5e9, pgid=pid, tag=tag)


def test_arm_and_disarm_lines_round_trip():
    armed: dict = {}
    deadman.apply_line(armed, deadman.encode_arm("job-1", identity(), Path("/sys/fs/cgroup/x/job-1")))
    deadman.apply_line(armed, deadman.encode_arm("job-2", identity(4343), None))
    assert armed == {"job-1": (identity(), Path("/sys/fs/cgroup/x/job-1"), None), "job-2": (identity(4343), None, None)}
    deadman.apply_line(armed, json.dumps({"disarm": "job-1"}).encode())
    deadman.apply_line(armed, json.dumps({"disarm": "never-armed"}).encode())
    assert list(armed) == ["job-2"]


def test_renew_lines_move_an_armed_lease_and_lapsed_names_the_ended_ones():
    armed: dict = {}
    deadman.apply_line(armed, deadman.encode_arm("job-1", identity(), None, 100.0))
    deadman.apply_line(armed, deadman.encode_arm("job-2", identity(4343), None, 50.0))
    deadman.apply_line(armed, deadman.encode_arm("job-3", identity(4444), None))
    deadman.apply_line(armed, json.dumps({"renew": "job-2", "until": 150.0}).encode())
    deadman.apply_line(armed, json.dumps({"renew": "never-armed", "until": 1.0}).encode())
    assert [until for _, _, until in armed.values()] == [100.0, 150.0, None] and "never-armed" not in armed
    assert deadman.next_lapse(armed) == 100.0
    assert deadman.lapsed(armed, 99.0) == [] and deadman.lapsed(armed, 150.0) == ["job-1", "job-2"]


@pytest.mark.parametrize(("line", "why"), [
    (b"{not json\n", "Expecting"),
    (b"\xff\xfe\n", "codec"),
    (b"[1, 2]\n", "not a JSON object"),
    (b'{"arm": ""}\n', "no arm, renew or disarm key"),
    (b'{"renew": "job-2", "until": "soon"}\n', "until is not a finite"),
    (b'{"renew": "job-2", "until": NaN}\n', "until is not a finite"),
    (b'{"renew": "job-2", "until": -1}\n', "until is not a finite"),
    (b'{"renew": "job-2", "until": 1e999}\n', "until is not a finite"),
    (b"x" * (deadman.MAX_LINE_BYTES + 1), "at most 4096"),
    (json.dumps({"arm": "k", "identity": {**identity().to_dict(), "pid": 1, "pgid": 1}, "cgroup": None}).encode(),
     "pid 1 is invalid"),
    (json.dumps({"arm": "k", "identity": identity().to_dict(), "cgroup": "../../etc"}).encode(), "absolute path"),
])
def test_bad_lines_are_refused_and_change_nothing(line, why):
    armed = {"job-2": (identity(), None, 5.0)}
    with pytest.raises(ValueError, match=why):
        deadman.apply_line(armed, line)
    assert armed == {"job-2": (identity(), None, 5.0)}


def start_agent(tmp_path: Path, name: str) -> tuple[AgentIdentity, list[int], subprocess.Popen[bytes]]:
    """An agent in its own session whose child double-forks out of the group (`setsid`) and
    ignores SIGTERM, as `AgentProcess` starts one; returns its identity and every pid."""
    tag = os.urandom(16).hex()
    pidfile = tmp_path / f"{name}.pids"
    script = (f"( trap '' TERM; exec setsid sleep 300 ) & echo $! > {pidfile}.tmp; "
              f"mv {pidfile}.tmp {pidfile}; exec sleep 300")
    proc = subprocess.Popen(["bash", "-c", script], env={**os.environ, AGENT_TAG_ENV: tag},
                            start_new_session=True)
    escaped = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), "the escaped child"))
    created = psutil.Process(proc.pid).create_time()
    return AgentIdentity(pid=proc.pid, create_time=created, pgid=proc.pid, tag=tag), [proc.pid, escaped], proc


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_all(pids: list[int], proc: subprocess.Popen[bytes]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=DEADLINE_S)


def test_when_the_pipe_closes_armed_agent_trees_are_killed_and_disarmed_ones_left(tmp_path):
    doomed_id, doomed, doomed_proc = start_agent(tmp_path, "doomed")
    kept_id, kept, kept_proc = start_agent(tmp_path, "kept")
    switch = deadman.DeadmanSwitch()
    try:
        switch.arm("doomed-1", doomed_id, None)
        switch.arm("kept-1", kept_id, None)
        switch.disarm("kept-1")
        helper = switch.helper_pid
        assert helper is not None and psutil.Process(helper).ppid() == os.getpid()
        assert os.getsid(helper) == helper  # its own session: a terminal's Ctrl-C does not reach it
        switch.close()  # as the kernel does when the daemon dies
        assert not psutil.pid_exists(helper) or not alive(helper)
        doomed_proc.wait(timeout=DEADLINE_S)
        wait_for(lambda: not any(alive(pid) for pid in doomed), "the armed tree to be gone")
        assert all(alive(pid) for pid in kept)
    finally:
        kill_all(doomed, doomed_proc)
        kill_all(kept, kept_proc)


def test_a_killed_helper_is_started_again_with_every_armed_agent(tmp_path):
    agent_id, pids, proc = start_agent(tmp_path, "agent")
    switch = deadman.DeadmanSwitch()
    try:
        switch.arm("agent-1", agent_id, None)
        first = switch.helper_pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: switch.helper_pid is None, "the helper to be gone")
        switch.arm("other-1", identity(), None)  # any later write starts a new helper with both armed
        assert switch.helper_pid not in (None, first)
        switch.close()
        proc.wait(timeout=DEADLINE_S)
        wait_for(lambda: not any(alive(pid) for pid in pids), "the tree armed before the restart to be gone")
    finally:
        kill_all(pids, proc)


def test_an_agent_whose_lease_lapses_is_stopped_while_the_daemon_lives_and_a_renewed_one_runs(tmp_path):
    """§10 "Leases": the helper fences by itself, as for a frozen daemon that writes nothing."""
    lapsing_id, lapsing, lapsing_proc = start_agent(tmp_path, "lapsing")
    renewed_id, renewed, renewed_proc = start_agent(tmp_path, "renewed")
    switch = deadman.DeadmanSwitch()
    try:
        soon = lease.now() + 1.0
        switch.arm("lapsing-1", lapsing_id, None, soon)
        switch.arm("renewed-1", renewed_id, None, soon)
        switch.renew("renewed-1", soon + 3600)
        switch.renew("never-armed-1", soon)  # nothing to renew: ignored
        lapsing_proc.wait(timeout=DEADLINE_S)
        wait_for(lambda: not any(alive(pid) for pid in lapsing), "the lapsed tree to be gone")
        assert lease.now() >= soon
        assert all(alive(pid) for pid in renewed) and switch.helper_pid is not None
        switch.disarm("renewed-1")
        switch.close()
        assert all(alive(pid) for pid in renewed)
    finally:
        switch.close()
        kill_all(lapsing, lapsing_proc)
        kill_all(renewed, renewed_proc)


def test_the_helper_skips_an_oversized_line_and_keeps_reading(tmp_path):
    agent_id, pids, proc = start_agent(tmp_path, "agent")
    helper = subprocess.Popen([sys.executable, "-m", deadman.MODULE, "test"], stdin=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        long_line = b"y" * (deadman.READ_BYTES * 3) + b"\n"  # more than one read: skipped in pieces
        _, err = helper.communicate(long_line + deadman.encode_arm("agent-1", agent_id, None), timeout=DEADLINE_S)
        assert helper.returncode == 0
        proc.wait(timeout=DEADLINE_S)
        wait_for(lambda: not any(alive(pid) for pid in pids), "the tree armed after the long line to be gone")
        assert b"ignored: over 4096 bytes" in err and b"stopping the agents of agent-1" in err
    finally:
        kill_all(pids, proc)


def test_a_switch_never_armed_starts_no_helper():
    switch = deadman.DeadmanSwitch()
    switch.disarm("nothing-1")
    assert switch.helper_pid is None
    switch.close()
