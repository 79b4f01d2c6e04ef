"""The agent's output stream over real brokers and real processes (PROTOCOL §15).

- 5 MB of output (lines of every size, binary bytes, a secret in clear, base64
  and JSON-escaped): the hub's copy equals the runner's agent.log byte for byte,
  except each secret form is `***`.
- A broker outage in the middle loses nothing: chunks wait in the runner's log
  outbox and go out after the reconnect (§17).
- An agent that publishes its own `completed` (through the runner's socket):
  its output still goes before that terminal event.
- A 50 MB burst hits MAM_LOG_RATE_BPS: `data.log_dropped` of the terminal event
  says how much, and the hub's copy plus the dropped bytes is the whole output.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import runnersim
from harness.jobkit import WatchProcess
from harness.runnersim import MAM_ORCH, hub_env, hub_workspace, runner_log
from harness.waiting import PATIENCE_S, wait_until

from mam.shared.protocol import names
from mam.shared.store.registry import Registry

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(180)]

SESSION = "gpu-box"
# the dispatch secret of these tests: JSON escapes a quote, a backslash and a non-ASCII letter
SECRET = 'log-test"secret\\with-é-0123456789abcdef0123'
FAST = str(100 * 1024 * 1024)  # MAM_LOG_RATE_BPS far above what the fidelity test writes
OUTAGE_S = 2.0
GENERATOR = """
import base64, json, random, sys, time
out = sys.stdout.buffer
mode, secret = sys.argv[1], {secret!r}
forms = [secret.encode(), base64.b64encode(secret.encode()), json.dumps(secret)[1:-1].encode(),
         json.dumps(secret, ensure_ascii=False)[1:-1].encode()]
rng = random.Random(15)
if mode == "fidelity":
    total, size = 0, 0
    while total < 5_000_000:
        pick = rng.random()
        if pick < 0.1:
            line = rng.randbytes(rng.randrange(0, 3000))
        elif pick < 0.25:
            line = b"token " + rng.choice(forms) + b" done"
        elif pick < 0.27:
            line = b"L" * rng.randrange(60_000, 200_000)
        else:
            line, size = b"s" * size, (size + 1) % 4097
        out.write(line + b"\\n")
        total += len(line) + 1
        if rng.random() < 0.02:
            out.flush()
elif mode == "slow":
    for i in range(int(sys.argv[2])):
        out.write(b"slow line %d " % i + b"." * (i % 300) + b"\\n")
        out.flush()
        time.sleep(0.02)
elif mode == "burst":
    block = b"burst " * 10_000 + b"\\n"
    for _ in range(50 * 1024 * 1024 // len(block)):
        out.write(block)
out.flush()
"""


def masked(data: bytes) -> bytes:
    forms = {SECRET.encode(), base64.b64encode(SECRET.encode()), base64.urlsafe_b64encode(SECRET.encode()),
             json.dumps(SECRET)[1:-1].encode(), json.dumps(SECRET, ensure_ascii=False)[1:-1].encode()}
    forms |= {f.rstrip(b"=") for f in forms}
    pattern = re.compile(b"|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True)))
    return pattern.sub(b"***", data)


def run_job(broker, tmp_path: Path, mode: str, *args: str, rate: str | None = FAST,
            during=None, then: str = "") -> tuple[dict, bytes, bytes, Path]:
    """Dispatch the generator to a real runner; (terminal event, hub copy, runner agent.log, hub)."""
    gen = tmp_path / "gen.py"
    gen.write_text(GENERATOR.format(secret=SECRET))
    hub = hub_workspace(broker, tmp_path, MAM_DISPATCH_SECRET=SECRET)
    runner_ws = tmp_path / "runner"
    extra = {"MAM_DISPATCH_SECRET": SECRET, **({"MAM_LOG_RATE_BPS": rate} if rate else {})}
    runner = runnersim.start_runner(broker, runner_ws, SESSION, **extra)
    brief = f"{sys.executable} {gen} {mode} {' '.join(args)}" + (f"\n{then}" if then else "")
    dispatch = WatchProcess([*MAM_ORCH, "dispatch", "--session", SESSION, "--brief", brief, "--json",
                             "--ack-timeout", str(int(PATIENCE_S)), "--workspace", str(hub)], hub_env())
    try:
        job_id = dispatch.job_id()
        if during is not None:
            during(hub, job_id)
        code = dispatch.wait(PATIENCE_S * 3)
    finally:
        dispatch.kill()
        runner.kill()
        runner.wait(PATIENCE_S)
    assert code == 0, dispatch.log()[-3000:] + runner_log(runner_ws)[-3000:]
    terminal = dispatch.events("completed")[-1]
    copy = names.hub_log_path(hub, job_id, 1)
    return terminal, copy.read_bytes(), (names.job_logs_dir(runner_ws, job_id) / "agent.log").read_bytes(), hub


def gaps(hub: Path, job_id: str) -> list[dict]:
    return [a for a in Registry(hub).audit(job_id) if a.get("event") == "log_gap"]


def test_s15_five_mb_arrive_byte_for_byte_with_every_secret_form_masked(broker, tmp_path):
    terminal, copy, original, hub = run_job(broker, tmp_path, "fidelity")
    assert len(original) >= 5_000_000
    assert copy == masked(original)
    assert SECRET.encode() not in copy and base64.b64encode(SECRET.encode()) not in copy
    assert json.dumps(SECRET)[1:-1].encode() not in copy and copy.count(b"***") > 100
    assert terminal["data"]["log_dropped"] == 0 and terminal["data"]["log_chunks"] >= len(copy) // 65536
    assert gaps(hub, terminal["job_id"]) == []


def test_s15_a_broker_outage_in_the_middle_loses_no_output(broker, tmp_path):
    def outage(hub: Path, job_id: str) -> None:
        copy = names.hub_log_path(hub, job_id, 1)
        wait_until(lambda: copy.exists() and copy.stat().st_size > 0, what="the first output at the hub")
        broker.kill()
        back_at = time.monotonic() + OUTAGE_S
        wait_until(lambda: time.monotonic() >= back_at, what=f"the {OUTAGE_S:g} s outage")
        broker.restart()

    terminal, copy, original, hub = run_job(broker, tmp_path, "slow", "300", rate=None, during=outage)
    assert copy == original and copy.count(b"slow line") == 300
    assert gaps(hub, terminal["job_id"]) == []
    for follow in ([], ["--follow"]):  # `mam-orch logs` prints the copy; --follow ends with the job (exit 0)
        shown = subprocess.run([*MAM_ORCH, "logs", terminal["job_id"], *follow, "--workspace", str(hub)],
                               env=hub_env(), capture_output=True, timeout=PATIENCE_S)
        assert (shown.returncode, shown.stdout) == (0, copy), shown.stderr


def test_s15_a_50_mb_burst_hits_the_rate_cap_and_dropped_says_how_much(broker, tmp_path):
    terminal, copy, original, _hub = run_job(broker, tmp_path, "burst", rate=None)
    dropped = terminal["data"]["log_dropped"]
    assert len(original) >= 50 * 1000 * 1000
    assert dropped > 40 * 1000 * 1000 and len(copy) + dropped == len(original)
    assert original.startswith(copy[:1024])


def test_s15_an_agents_own_terminal_event_waits_for_its_output(broker, tmp_path):
    """§15 "the terminal event follows the last chunk", also when the agent publishes it:
    the runner's socket sends the job's remaining output first (§17)."""
    terminal, copy, original, hub = run_job(
        broker, tmp_path, "slow", "100", rate=None,
        then='eval "$MAM_PUBLISH_CMD --event completed --detail by-the-agent"')
    assert terminal["detail"] == "by-the-agent" and "log_chunks" in terminal["data"], terminal
    # everything written before the terminal event is at the hub; after it comes only what the
    # publish command itself prints (its JSON result line), which no terminal can wait for
    assert original.startswith(copy) and copy.count(b"slow line") == 100
    assert b"slow line" not in original[len(copy):]
    assert gaps(hub, terminal["job_id"]) == []
