"""The real Codex CLI as the agent (PROTOCOL §18), end to end: a real broker, the hub
service, a runner daemon in its own network namespace started as `mam-runner run --session
gpu-box --exec codex`, the real `codex` from npm (tests/agents) against the scripted model
server's Responses API on that host's 127.0.0.1, and a real `git daemon`.

- A job on `demo@main` whose script writes two files (`--permission-mode acceptEdits`: the
  workspace-write sandbox): `result` and `apply` as for any repository job; the thread id and
  tokens in `show` and `/metrics`.
- The model server fails the request, or cuts the stream: `error` with Codex's own reason,
  not `completed`.
- A command asking to escape the sandbox, which Codex rejects: `error` `permission_denied`.
- The documented hook form (§19 "Hooks"): a PreToolUse hook `mam-runner ask --hook` in
  Codex's config.toml asks the hub before each command; an approved one runs, a denied one
  is blocked and the model told why.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.agentfleet import AGENT_START_S, AGENT_TEST_S, ASK_HOOK, AgentFleet, agent_fleet
from harness.gitserver import git
from harness.modelserver import Cut, Failure, Step, Text, ToolUse
from harness.waiting import PATIENCE_S, wait_until

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(AGENT_TEST_S)]

HIGH_DEMAND = "We’re currently experiencing high demand, which may cause temporary errors."


@pytest.fixture
def codex_fleet(tmp_path: Path) -> Iterator[AgentFleet]:
    with agent_fleet(tmp_path, "codex") as cf:
        yield cf


def test_s18_a_codex_job_edits_two_files_and_the_change_comes_back(codex_fleet: AgentFleet) -> None:
    cf = codex_fleet
    runner = cf.start([ToolUse("exec_command", {"cmd": "printf 'notes\\n' > NOTES.md && "
                                                       "printf 'print(1)\\n' > src/extra.py"}),
                       Text("Wrote NOTES.md and src/extra.py.")])
    code, job_id = cf.run("--ref", "main", "--permission-mode", "acceptEdits")
    assert code == 0, runner.log()[-3000:]
    terminal = cf.terminal(job_id)
    assert terminal["detail"] == "Wrote NOTES.md and src/extra.py."
    agent = terminal["data"]["agent"]
    assert agent["kind"] == "codex" and agent["turns"] == 2 and agent["cost_usd"] is None
    assert agent["tokens"] == {"input": 200, "output": 100, "cached": 40}
    result = json.loads(cf.fleet.orch("result", job_id, "--json").stdout)
    main = git("rev-parse", "main", cwd=cf.origin).strip()
    assert result["base_sha"] == main and result["files_total"] == 2
    assert sorted(f["path"] for f in result["files"]) == ["NOTES.md", "src/extra.py"]
    clone = cf.tmp / "clone"
    git("clone", "-q", str(cf.origin), str(clone))
    applied = cf.fleet.orch("apply", job_id, "--repo-path", str(clone))
    assert applied.returncode == 0, applied.stderr
    assert git("show", f"mam/{job_id}:src/extra.py", cwd=clone) == "print(1)\n"
    assert f"codex session {agent['session_id']}, 2 turns, 200 in / 100 out / 40 cached" in cf.show_text(job_id)
    assert 'mam_agent_tokens_total{kind="input",labels="-",session="gpu-box"} 200.0' in cf.metrics()
    assert cf.model is not None and all(c["path"].startswith("/v1/responses") for c in cf.model.calls())


@pytest.mark.parametrize(("step", "reason"), [
    (Failure(500, "server_error", "boom"), HIGH_DEMAND),
    (Cut(), "stream disconnected before completion"),
])
def test_s18_a_failed_model_request_or_stream_is_an_error_with_codexs_reason(codex_fleet: AgentFleet, step: Step,
                                                                            reason: str) -> None:
    runner = codex_fleet.start([step])
    code, job_id = codex_fleet.run()
    assert code == 1, runner.log()[-3000:]
    detail = codex_fleet.terminal(job_id)["detail"]
    assert detail.startswith("agent_error: ") and reason in detail, detail


def test_s18_a_command_codex_rejects_is_permission_denied_not_completed(codex_fleet: AgentFleet) -> None:
    escape = {"cmd": "touch /etc/mam-escaped", "sandbox_permissions": "require_escalated", "justification": "x"}
    runner = codex_fleet.start([ToolUse("exec_command", escape), Text("Done.")])
    code, job_id = codex_fleet.run("--permission-mode", "acceptEdits")
    assert code == 1, runner.log()[-3000:]
    assert codex_fleet.terminal(job_id)["detail"] == "permission_denied: exec_command (escalation)"
    assert not Path("/etc/mam-escaped").exists()


def test_s19_codexs_pretooluse_hook_asks_the_hub_and_codex_obeys_the_answer(codex_fleet: AgentFleet) -> None:
    cf = codex_fleet
    runner = cf.start([ToolUse("exec_command", {"cmd": "printf 'hi\\n' > a.txt"}),
                       ToolUse("exec_command", {"cmd": "printf 'no\\n' > b.txt"}),
                       Text("Wrote a.txt; b.txt was refused.")],
                      exec_cmd="codex exec --dangerously-bypass-hook-trust")  # the runner's host vets its hooks
    with (cf.tmp / "agent-home" / ".codex" / "config.toml").open("a") as config:
        config.write('\n[[hooks.PreToolUse]]\nmatcher = "Bash"\n[[hooks.PreToolUse.hooks]]\ntype = "command"\n'
                     f"command = {json.dumps(ASK_HOOK)}\n")
    handle = cf.fleet.dispatch("gpu-box", "Make the change.", "--repo", "demo", "--permission-mode", "acceptEdits")

    def request(n: int) -> dict:
        return wait_until(lambda: (handle.events("permission_required") + [None, None])[n], AGENT_START_S,
                          f"request {n + 1} at the hub")

    first = request(0)
    assert (first["data"]["tool"], first["data"]["input"]) == ("Bash", "printf 'hi\\n' > a.txt"), first
    assert cf.fleet.orch("approve", first["job_id"]).returncode == 0
    assert request(1)["data"]["input"] == "printf 'no\\n' > b.txt"
    denied = cf.fleet.orch("deny", first["job_id"], "--reason", "not b.txt")
    assert denied.returncode == 0, denied.stderr
    assert handle.wait() == 0, runner.log()[-3000:]
    assert cf.terminal(first["job_id"])["detail"] == "Wrote a.txt; b.txt was refused."
    result = json.loads(cf.fleet.orch("result", first["job_id"], "--json").stdout)
    assert [f["path"] for f in result["files"]] == ["a.txt"]  # the approved command ran, the denied one did not
    told = [r for call in cf.model.calls() for r in call["tool_results"]]  # type: ignore[union-attr]
    assert any("not b.txt" in text for text in told), told


WRITE_NOTES = ToolUse("exec_command", {"cmd": "printf 'notes\\n' > NOTES.md && echo notes-written"})


def test_s18_a_codex_retry_resumes_the_thread_in_the_worktree_attempt_1_left(codex_fleet: AgentFleet) -> None:
    """§18 continued sessions with Codex: attempt 1 writes NOTES.md, then the model fails; the
    retry runs `codex exec resume <thread>` in a worktree that starts where attempt 1 ended:
    the model sees attempt 1's command output, and the result holds both attempts' files."""
    cf = codex_fleet
    runner = cf.start([WRITE_NOTES, Failure(500, "server_error", "boom"),
                       ToolUse("exec_command", {"cmd": "printf 'more\\n' > MORE.md"}), Text("Finished the notes.")])
    code, job_id = cf.run("--ref", "main", "--permission-mode", "acceptEdits", "--retries", "1",
                          "--retry-on", "error")
    assert code == 0, runner.log()[-3000:]
    events = cf.fleet.events_on_wire(job_id)
    ends = {e["data"]["attempt_id"]: e for e in events if e["event"] in ("completed", "error")}
    session_id = ends[1]["data"]["agent"]["session_id"]
    assert ends[2]["event"] == "completed" and ends[2]["data"]["agent"]["session_id"] == session_id
    (started,) = [e for e in events if e["event"] == "started" and e["data"]["attempt_id"] == 2]
    assert started["detail"] == f"continues session {session_id} of attempt 1", started
    resumed = cf.model.calls()[-2]  # type: ignore[union-attr]
    assert any("notes-written" in text for text in resumed["tool_results"]), resumed
    result = json.loads(cf.fleet.orch("result", job_id, "--json").stdout)
    assert sorted(f["path"] for f in result["files"]) == ["MORE.md", "NOTES.md"] and result["has_transcript"]


def test_s18_a_runner_without_the_codex_thread_resumes_it_from_the_transcript_the_hub_carried(
        codex_fleet: AgentFleet) -> None:
    """§18 "Transcripts" with Codex: attempt 1's rollout comes back with its result; the runner
    then loses its sessions (as on another host) and `say`'s attempt 2 gets the rollout in the
    dispatch, written where Codex looks: the thread resumes and the model sees attempt 1."""
    cf = codex_fleet
    runner = cf.start([WRITE_NOTES, Text("Wrote NOTES.md."), Text("Still here.")])
    code, job_id = cf.run("--ref", "main", "--permission-mode", "acceptEdits")
    assert code == 0, runner.log()[-3000:]
    sessions = cf.tmp / "agent-home" / ".codex" / "sessions"
    assert list(sessions.glob("*/*/*/rollout-*.jsonl"))
    shutil.rmtree(sessions)
    said = cf.fleet.orch("say", job_id, "Are you still there?", "--json", timeout_s=2 * PATIENCE_S)
    assert said.returncode == 0, said.stderr + runner.log()[-3000:]
    events = cf.fleet.events_on_wire(job_id)
    (started,) = [e for e in events if e["event"] == "started" and e["data"]["attempt_id"] == 2]
    assert started["data"]["continues"]["transcript"] == "carried", started
    assert [e["detail"] for e in events if e["event"] == "completed"][-1] == "Still here."
    assert any("notes-written" in text for text in cf.model.calls()[-1]["tool_results"])  # type: ignore[union-attr]
    assert "the transcript the hub carried is in" in runner.log()
