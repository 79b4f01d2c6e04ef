"""`make demo` (examples/demo.py): the whole fleet on one machine, without root
or an installed broker (PROTOCOL §5-§12)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from harness.procs import processes_under
from harness.waiting import PATIENCE_S
from harness.workspace import clean_env

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "demo.py"
DEMO_TIMEOUT_S = 3 * PATIENCE_S  # a broker, a runner, a job and their shutdown, on a busy machine

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(DEMO_TIMEOUT_S + PATIENCE_S)
def test_demo_completes_and_leaves_no_process(tmp_path):
    done = subprocess.run([sys.executable, str(DEMO), "--dir", str(tmp_path)], env=clean_env(),
                          capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "completed" in out
    for header in ("=== 1. broker", "=== 2. runner", "=== 4. events", "=== 5. result", "=== 6. stopping"):
        assert header in out
    assert "started" in out and "sha256 " in out and "agent log:" in out
    base = next(tmp_path.glob("mam-demo-*"))
    job_logs = list((base / "runner" / ".mam" / "logs").glob("*/agent.log"))
    assert len(job_logs) == 1 and "add hello.txt" in job_logs[0].read_text()
    assert str(job_logs[0]) in out
    assert processes_under(base) == []
    # the nats-server and mam-runner the demo started are gone (by their recorded pids too)
    leftovers = [p for p in psutil.process_iter(["name", "cmdline"])
                 if p.info["name"] in ("nats-server",) and any(str(base) in a for a in p.info["cmdline"] or [])]
    assert leftovers == []
    # no secret reached the output
    env_text = (base / "hub" / ".mam.env").read_text()
    secret = next(line.split("=", 1)[1].strip().strip("'\"") for line in env_text.splitlines()
                  if line.startswith("MAM_DISPATCH_SECRET="))
    assert secret not in out and secret not in done.stderr


@pytest.mark.timeout(DEMO_TIMEOUT_S + PATIENCE_S)
def test_demo_interrupted_after_the_runner_is_up_stops_everything(tmp_path):
    proc = subprocess.Popen([sys.executable, str(DEMO), "--dir", str(tmp_path)], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path))
    lines = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "is online" in line:
                proc.send_signal(signal.SIGINT)  # Ctrl-C
                break
        lines.extend(proc.stdout)  # type: ignore[union-attr]
        code = proc.wait(DEMO_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()  # type: ignore[union-attr]
    out = "".join(lines)
    assert code == 130, out
    assert "interrupted" in out and "=== 6. stopping" in out and "broker down (exit 0)" in out
    base = next(tmp_path.glob("mam-demo-*"))
    assert processes_under(base) == []
