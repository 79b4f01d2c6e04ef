"""The real Claude Code CLI as the agent (PROTOCOL §18), end to end: a real broker, the hub
service, a runner daemon in its own network namespace started as the card prints it
(`mam-runner run --session gpu-box --exec claude`), the real `claude` from npm
(tests/agents) against a scripted model server on that host's 127.0.0.1
(harness/modelserver.py), and a real `git daemon` serving the repository.

- The card's command and a job on `demo@main` whose script writes two files and commits
  (`--allow-tools 'Write,Bash(git *)'`): `result` shows the diffstat and SHAs, `apply`
  gives branch `mam/<id>`; cost, tokens, turns and session id in `show` and `/metrics`.
- A text answer: `completed`, the answer as the summary.
- `--max-turns 2` against a script of five turns: `budget_exceeded` after two; an agent
  that runs past its budget is stopped by the runner.
- A tool call no policy allows and nobody may be asked about (`--permission-mode dontAsk`):
  `error` `permission_denied: Bash`, never `completed`.
- A tool call no policy allows asks a person at the hub (§19): approved, it runs and its
  change comes back; denied with a reason, the model is told the reason and the job
  completes with the denial listed.
- The documented hook form (§19 "Hooks"): `--exec 'claude --settings FILE'` whose PreToolUse
  hook is `mam-runner ask --hook`, with `--permission-mode dontAsk`: the hook asks the hub,
  an approved call runs, a denied one is blocked and the model told why.
- The model server answers 429 (a usage limit, with `--on-limit fail`) or 529: `error` with the
  agent's own reason.
- A 429 with a reset (§14 Pauses): paused, the slot free for another job, then the session goes
  on at the reset, or at once with `mam-orch resume`.
- A retry after the model failed continues the session where attempt 1 left its worktree (§18);
  so does `mam-orch say` after the job completed.
- Cancel during a long stream: the CLI and its children are gone within the grace.
- Bad input (an agent claiming to be claude): lines that are not JSON, a 10 MB line, a
  result text with terminal escapes: reported, escaped at the hub, the runner lives on.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from harness.agentfleet import AGENT_START_S, AGENT_TEST_S, ASK_HOOK, FAST, AgentFleet, agent_fleet
from harness.gitserver import git
from harness.modelserver import Failure, Step, Text, ToolUse
from harness.waiting import PATIENCE_S, wait_until

from mam.shared.protocol import names
from mam.shared.store.registry import Registry

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(AGENT_TEST_S)]

@pytest.fixture
def claude_fleet(tmp_path: Path) -> Iterator[AgentFleet]:
    with agent_fleet(tmp_path, "claude") as cf:
        yield cf


EDIT_TWO: list[Step] = [
    ToolUse("Write", {"file_path": "NOTES.md", "content": "notes\n"}),
    ToolUse("Write", {"file_path": "src/extra.py", "content": "print('extra')\n"}),
    ToolUse("Bash", {"command": "git add -A", "description": "stage"}),
    ToolUse("Bash", {"command": "git commit -qm 'agent: two files'", "description": "commit"}),
    Text("Wrote NOTES.md and src/extra.py, committed."),
]


def test_s18_the_card_command_edits_two_files_and_the_change_comes_back_with_its_spend(
        claude_fleet: AgentFleet) -> None:
    cf = claude_fleet
    runner = cf.start(EDIT_TWO)
    code, job_id = cf.run("--ref", "main", "--allow-tools", "Write,Bash(git *)")
    assert code == 0, runner.log()[-3000:]
    terminal = cf.terminal(job_id)
    assert terminal["detail"] == "Wrote NOTES.md and src/extra.py, committed."
    main = git("rev-parse", "main", cwd=cf.origin).strip()
    shown = cf.fleet.orch("result", job_id, "--json")
    result = json.loads(shown.stdout)
    assert result["base_sha"] == main and result["head_sha"] != main and result["files_total"] == 2
    assert sorted(f["path"] for f in result["files"]) == ["NOTES.md", "src/extra.py"]
    assert result["commits_total"] == 1
    clone = cf.tmp / "clone"
    git("clone", "-q", str(cf.origin), str(clone))
    applied = cf.fleet.orch("apply", job_id, "--repo-path", str(clone))
    assert applied.returncode == 0, applied.stderr
    assert git("show", f"mam/{job_id}:NOTES.md", cwd=clone) == "notes\n"
    agent = terminal["data"]["agent"]
    assert agent["turns"] == 5 and agent["tokens"]["output"] > 0 and agent["cost_usd"] > 0
    text = cf.show_text(job_id)
    assert f"claude session {agent['session_id']}, 5 turns" in text and f"${agent['cost_usd']:.4f}" in text
    assert result["has_transcript"] and result["transcript"]["session_id"] == agent["session_id"]
    kept = names.hub_result_dir(cf.fleet.hub_ws, job_id, 1) / "transcript" / f"{agent['session_id']}.jsonl"
    said = [json.loads(line) for line in kept.read_text().splitlines()]  # the CLI's own session, at the hub
    assert any("Wrote NOTES.md and src/extra.py" in json.dumps(entry) for entry in said)
    assert cf.fleet.orch("result", job_id, "--transcript").stdout == kept.read_text()
    exposition = cf.metrics()
    assert f'mam_agent_cost_usd_total{{labels="-",session="gpu-box"}} {agent["cost_usd"]}' in exposition
    assert f'mam_agent_tokens_total{{kind="output",labels="-",session="gpu-box"}} {agent["tokens"]["output"]}' \
        in exposition


def test_s18_the_card_command_runs_claude_and_reports_its_answer_and_spend(claude_fleet: AgentFleet) -> None:
    runner = claude_fleet.start([Text("Nothing needed changing.")])
    code, job_id = claude_fleet.run()
    assert code == 0, runner.log()[-3000:]
    terminal = claude_fleet.terminal(job_id)
    assert terminal["event"] == "completed" and terminal["detail"] == "Nothing needed changing."
    agent = terminal["data"]["agent"]
    assert agent["kind"] == "claude" and len(agent["session_id"]) == 36 and agent["turns"] == 1
    assert agent["tokens"]["input"] > 0 and agent["cost_usd"] > 0
    shown = claude_fleet.show_text(job_id)
    assert f"claude session {agent['session_id']}, 1 turns" in shown, shown
    assert claude_fleet.fleet.hub_record(job_id)["agent"]["cost_usd"] == agent["cost_usd"]
    calls = claude_fleet.model.calls()  # type: ignore[union-attr]
    assert calls and all(c["path"].startswith("/v1/messages") for c in calls), calls


def test_s18_a_tool_no_policy_allows_is_permission_denied_not_completed(claude_fleet: AgentFleet) -> None:
    """With `--permission-mode dontAsk` the CLI asks nobody (§19): it denies the tool itself."""
    runner = claude_fleet.start([ToolUse("Bash", {"command": "echo hi > a.txt", "description": "write"}),
                                 Text("All done.")])
    code, job_id = claude_fleet.run("--permission-mode", "dontAsk")
    assert code == 1, runner.log()[-3000:]
    terminal = claude_fleet.terminal(job_id)
    assert (terminal["event"], terminal["detail"]) == ("error", "permission_denied: Bash")
    assert terminal["data"]["agent"]["permission_denials"] == ["Bash"]
    assert claude_fleet.fleet.hub_record(job_id)["status"] == "error"


def asked_on_hub(cf: AgentFleet, handle) -> dict:
    """The first permission request the dispatch saw (§19); fails at once, saying what the
    dispatch, the runner and the model saw, when the dispatch ended without one."""
    try:
        asked = wait_until(lambda: (handle.events("permission_required") or [None])[0] or not handle.alive(),
                           AGENT_START_S, "a permission request at the hub")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cf.story(handle)}") from None
    assert isinstance(asked, dict), f"the dispatch ended without a permission request\n{cf.story(handle)}"
    return asked


def test_s19_a_person_approves_the_tool_call_claude_asks_for_and_it_runs(claude_fleet: AgentFleet) -> None:
    cf = claude_fleet
    runner = cf.start([ToolUse("Bash", {"command": "echo hi > a.txt", "description": "write"}), Text("Wrote a.txt.")])
    handle = cf.fleet.dispatch("gpu-box", "Make the change.", "--repo", "demo", *FAST)
    asked = asked_on_hub(cf, handle)
    assert (asked["data"]["tool"], asked["data"]["input"]) == ("Bash", "echo hi > a.txt"), asked
    approved = cf.fleet.orch("approve", asked["job_id"])
    assert approved.returncode == 0, approved.stderr
    assert handle.wait() == 0, runner.log()[-3000:]
    terminal = cf.terminal(asked["job_id"])
    assert (terminal["event"], terminal["detail"]) == ("completed", "Wrote a.txt."), terminal
    assert terminal["data"]["agent"]["permission_denials"] == []
    result = json.loads(cf.fleet.orch("result", asked["job_id"], "--json").stdout)
    assert [f["path"] for f in result["files"]] == ["a.txt"]  # the tool ran for real, in the worktree


@pytest.mark.parametrize("exec_cmd", [None, "claude --input-format stream-json"], ids=["brief", "input-stream"])
def test_s19_a_permission_tool_slow_to_start_is_still_the_one_the_cli_asks(claude_fleet: AgentFleet, tmp_path: Path,
                                                                         exec_cmd: str | None) -> None:
    """The CLI in print mode waits 2 s for MCP servers by default; on a busy host the Python
    permission tool can take longer. Made to take 4 s (a `sitecustomize` the agent's Python
    processes load), it is still connected before the first turn and asks the hub (§19), also
    when the CLI reads its input as a stream (§18 "Input while it runs")."""
    slow = tmp_path / "slow-python"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text("import os, time\nif os.environ.get('MAM_JOB_ID'):\n    time.sleep(4)\n")
    cf = claude_fleet
    runner = cf.start([ToolUse("Bash", {"command": "echo hi > a.txt", "description": "write"}), Text("Wrote a.txt.")],
                      exec_cmd=exec_cmd, env={"PYTHONPATH": str(slow)})
    handle = cf.fleet.dispatch("gpu-box", "Make the change.", "--repo", "demo", *FAST)
    asked = asked_on_hub(cf, handle)
    assert cf.fleet.orch("approve", asked["job_id"]).returncode == 0
    assert handle.wait() == 0, runner.log()[-3000:]
    assert cf.terminal(asked["job_id"])["detail"] == "Wrote a.txt."


def test_s19_a_person_denies_with_a_reason_the_agent_hears_it_and_the_job_completes(
        claude_fleet: AgentFleet) -> None:
    cf = claude_fleet
    runner = cf.start([ToolUse("Bash", {"command": "echo hi > a.txt", "description": "write"}),
                       Text("I may not write files today.")])
    handle = cf.fleet.dispatch("gpu-box", "Make the change.", "--repo", "demo", *FAST)
    asked = asked_on_hub(cf, handle)
    denied = cf.fleet.orch("deny", asked["job_id"], "--reason", "no files today")
    assert denied.returncode == 0, denied.stderr
    assert handle.wait() == 0, runner.log()[-3000:]
    terminal = cf.terminal(asked["job_id"])
    assert (terminal["event"], terminal["detail"]) == ("completed", "I may not write files today.")
    assert terminal["data"]["agent"]["permission_denials"] == ["Bash"]  # listed, a person's decision
    told = [r for call in cf.model.calls() for r in call.get("tool_results", [])]  # type: ignore[union-attr]
    assert any("no files today" in text for text in told), told
    assert "permission_answered deny by " in cf.show_text(asked["job_id"])


def test_s19_claude_codes_pretooluse_hook_asks_the_hub_and_the_cli_obeys_the_answer(
        claude_fleet: AgentFleet) -> None:
    """Under `dontAsk` the CLI would deny both calls itself; its PreToolUse hook asks a person
    instead: the approved call runs, the denied one does not and the model hears the reason."""
    cf = claude_fleet
    settings = cf.tmp / "hook-settings.json"
    settings.write_text(json.dumps({"hooks": {"PreToolUse": [
        {"matcher": "Bash", "hooks": [{"type": "command", "command": ASK_HOOK}]}]}}))
    runner = cf.start([ToolUse("Bash", {"command": "echo hi > a.txt", "description": "write a"}),
                       ToolUse("Bash", {"command": "echo no > b.txt", "description": "write b"}),
                       Text("Wrote a.txt; b.txt was refused.")], exec_cmd=f"claude --settings {settings}")
    handle = cf.fleet.dispatch("gpu-box", "Make the change.", "--repo", "demo", *FAST, "--permission-mode", "dontAsk")
    first = asked_on_hub(cf, handle)
    assert (first["data"]["tool"], first["data"]["input"]) == ("Bash", "echo hi > a.txt"), first
    assert cf.fleet.orch("approve", first["job_id"]).returncode == 0
    second = wait_until(lambda: (handle.events("permission_required") + [None, None])[1], PATIENCE_S,
                        "the second request at the hub")
    assert second["data"]["input"] == "echo no > b.txt", second
    denied = cf.fleet.orch("deny", first["job_id"], "--reason", "not b.txt")
    assert denied.returncode == 0, denied.stderr
    assert handle.wait() == 0, runner.log()[-3000:]
    terminal = cf.terminal(first["job_id"])
    assert (terminal["event"], terminal["detail"]) == ("completed", "Wrote a.txt; b.txt was refused."), terminal
    result = json.loads(cf.fleet.orch("result", first["job_id"], "--json").stdout)
    assert [f["path"] for f in result["files"]] == ["a.txt"]  # the approved call ran, the denied one did not
    told = [r for call in cf.model.calls() for r in call.get("tool_results", [])]  # type: ignore[union-attr]
    assert any("not b.txt" in text for text in told), told


@pytest.mark.parametrize(("status", "kind", "message", "said"), [
    (429, "rate_limit_error", "usage limit reached; resets at 18:00", "usage_limit"),
    (529, "overloaded_error", "Overloaded", "agent_error"),
])
def test_s18_a_429_with_on_limit_fail_or_a_529_from_the_model_is_an_error_with_the_agents_reason(
        claude_fleet: AgentFleet, status: int, kind: str, message: str, said: str) -> None:
    runner = claude_fleet.start([Failure(status, kind, message, {"retry-after": "3600"})])
    code, job_id = claude_fleet.run("--on-limit", "fail")
    assert code == 1, runner.log()[-3000:]
    detail = claude_fleet.terminal(job_id)["detail"]
    assert detail.startswith(f"{said}: API Error") and str(status) in detail and message in detail, detail


WRITE_NOTES = ToolUse("Write", {"file_path": "NOTES.md", "content": "notes\n"})


def paused_on_hub(cf: AgentFleet, handle) -> dict:
    """The job's record once the hub paused it (§14 Pauses)."""
    job_id = handle.job_id()
    return wait_until(lambda: (lambda r: r if r.get("paused_until") else None)(cf.fleet.hub_record(job_id)),
                      PATIENCE_S, "the hub to pause the job")


def test_s14_a_usage_limit_pauses_until_its_reset_then_the_session_goes_on(claude_fleet: AgentFleet) -> None:
    """A 429 whose reset is 4 s ahead: attempt 1 ends paused, attempt 2 is published no sooner than
    the reset, on the same runner, and continues the session in the worktree attempt 1 left."""
    cf = claude_fleet
    runner = cf.start([WRITE_NOTES, Failure(429, "rate_limit_error", "usage limit reached; resets at {reset+4}"),
                       Text("Finished after the pause.")])
    handle = cf.fleet.dispatch("gpu-box", "Make the change.", "--repo", "demo", *FAST, "--allow-tools", "Write")
    paused = paused_on_hub(cf, handle)
    assert paused["attempt_history"][-1]["status"] == "paused" and paused["target"] == {"session": "gpu-box"}
    assert handle.wait() == 0, runner.log()[-3000:]
    job_id = handle.job_id()
    record = cf.fleet.hub_record(job_id)
    assert (record["status"], record["attempt_id"], record.get("retried", 0)) == ("completed", 2, 0)
    published = [line for line in Registry(cf.fleet.hub_ws).audit(job_id)
                 if line.get("event") == "status_changed" and line.get("to") == "pending"]
    assert published[-1]["timestamp"] >= paused["paused_until"], (published, paused["paused_until"])
    events = cf.fleet.events_on_wire(job_id)
    (started,) = [e for e in events if e["event"] == "started" and e["data"]["attempt_id"] == 2]
    assert started["detail"].startswith("continues session ") and started["detail"].endswith(" of attempt 1")
    result = json.loads(cf.fleet.orch("result", job_id, "--json").stdout)
    assert [f["path"] for f in result["files"]] == ["NOTES.md"]
    assert "paused (usage_limit)" in cf.show_text(job_id)


def test_s14_on_limit_move_continues_the_session_on_another_runner_at_once(claude_fleet: AgentFleet) -> None:
    """§14 Moves: a 429 whose reset is an hour ahead on gpu-box; with `--on-limit move` attempt 2
    goes at once to gpu-box-2 (same labels, its own agent home: no transcript there), which
    continues the session from the transcript the hub carried, in a new worktree."""
    cf = claude_fleet
    runner = cf.start([WRITE_NOTES, Failure(429, "rate_limit_error", "usage limit reached; resets at {reset+3600}"),
                       Text("Finished on the other runner.")], "--labels", "gpu")
    other = cf.fleet.start_runner("gpu-box-2", "claude", "--repo", f"demo={cf.daemon.url('demo')}", "--labels", "gpu",
                                  env=cf.agent_env(cf.tmp / "other-home"), host="gpu-box")
    handle = cf.fleet.dispatch(None, "Make the change.", "--repo", "demo", *FAST, "--allow-tools", "Write",
                               "--on-limit", "move", labels="gpu")
    assert handle.wait() == 0, runner.log()[-3000:] + other.log()[-3000:]
    job_id = handle.job_id()
    record = cf.fleet.hub_record(job_id)
    assert (record["status"], record["attempt_id"], record["session"]) == ("completed", 2, "gpu-box-2"), record
    assert record["attempt_history"][-1]["status"] == "moved"
    events = cf.fleet.events_on_wire(job_id)
    (started,) = [e for e in events if e["event"] == "started" and e["data"]["attempt_id"] == 2]
    assert started["detail"].endswith(" of attempt 1, from the hub's transcript, in a new worktree"), started
    assert "the transcript the hub carried is in" in other.log()
    resumed = [c for c in cf.model.calls() if c["tools"]][-1]  # type: ignore[union-attr]
    assert resumed["messages"] > 2 and any("NOTES.md" in text for text in resumed["tool_results"]), resumed
    assert "moved (usage_limit)" in cf.show_text(job_id)
    assert any(line.get("event") == "moved" and line["session"] == "gpu-box"
               for line in Registry(cf.fleet.hub_ws).audit(job_id))


@pytest.mark.timeout(300)
def test_s18_after_a_runner_dies_mid_run_attempt_2_resumes_the_session_elsewhere_from_the_streamed_transcript(
        claude_fleet: AgentFleet) -> None:
    """§15 "Transcript chunks": while attempt 1 streams a long answer on gpu-box, the hub holds
    the session (a `progress` event names it; its transcript streams in chunks); gpu-box dies
    (kill -9 of the runner and its agent). With `--retries 1` attempt 2 runs on gpu-box-2,
    which has neither the worktree nor the session: it continues the session from the
    transcript the hub carried, and the model sees attempt 1's turns."""
    cf = claude_fleet
    runner = cf.start([WRITE_NOTES, Text("word " * 600, chunks=600, delay_s=0.2),
                       Text("Finished on the other runner.")], "--labels", "gpu")
    handle = cf.fleet.dispatch(None, "Make the change.", "--repo", "demo", "--heartbeat", "1",
                               "--heartbeat-misses", "3", "--ack-timeout", str(int(PATIENCE_S)),
                               "--allow-tools", "Write", "--retries", "1", labels="gpu")
    job_id = handle.job_id()
    copy = names.hub_transcript_path(cf.fleet.hub_ws, job_id, 1)
    wait_until(lambda: len([c for c in cf.model.calls() if c["tools"]]) >= 2  # type: ignore[union-attr]
               and copy.exists() and b"NOTES.md" in copy.read_bytes() and "agent" in cf.fleet.hub_record(job_id),
               2 * PATIENCE_S, "attempt 1 streaming its second turn, its session and transcript at the hub")
    session_id = cf.fleet.hub_record(job_id)["agent"]["session_id"]
    other = cf.fleet.start_runner("gpu-box-2", "claude", "--repo", f"demo={cf.daemon.url('demo')}", "--labels", "gpu",
                                  env=cf.agent_env(cf.tmp / "other-home"), host="gpu-box")
    doomed = [runner.proc.pid, *(p.pid for p in psutil.Process(runner.proc.pid).children(recursive=True))]
    for pid in doomed:  # the host is gone: the daemon and every process of its agent
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    assert handle.wait(2 * PATIENCE_S) == 0, other.log()[-3000:]
    record = cf.fleet.hub_record(job_id)
    assert (record["status"], record["attempt_id"], record["session"]) == ("completed", 2, "gpu-box-2"), record
    assert record["attempt_history"][-1]["close_reason"] == "runner_lost"
    events = cf.fleet.events_on_wire(job_id)
    assert any(e["event"] == "progress" and e["detail"] == f"agent session {session_id}" for e in events)
    (started,) = [e for e in events if e["event"] == "started" and e["data"]["attempt_id"] == 2]
    assert started["data"]["continues"] == {"session_id": session_id, "attempt": 1, "transcript": "carried"}, started
    assert started["detail"].endswith(" of attempt 1, from the hub's transcript, in a new worktree"), started
    resumed = [c for c in cf.model.calls() if c["tools"]][-1]  # type: ignore[union-attr]
    assert resumed["messages"] > 2 and any("NOTES.md" in text for text in resumed["tool_results"]), resumed
    assert [e["detail"] for e in events if e["event"] == "completed"] == ["Finished on the other runner."]


def test_s14_a_paused_job_frees_its_slot_and_resume_goes_on_before_the_reset(claude_fleet: AgentFleet) -> None:
    cf = claude_fleet
    runner = cf.start([WRITE_NOTES, Failure(429, "rate_limit_error", "usage limit reached; resets at {reset+3600}"),
                       Text("Side job done."), Text("Finished after the resume.")])
    handle = cf.fleet.dispatch("gpu-box", "Make the change.", "--repo", "demo", *FAST, "--allow-tools", "Write")
    paused = paused_on_hub(cf, handle)
    assert "paused until " in cf.show_text(paused["job_id"])
    side = cf.fleet.dispatch("gpu-box", "Say something.", *FAST)  # the runner has one slot (--max-jobs 1)
    assert side.wait() == 0, runner.log()[-3000:]
    assert cf.terminal(side.job_id())["detail"] == "Side job done."
    resumed = cf.fleet.orch("resume", paused["job_id"], "--detach")
    assert resumed.returncode == 0, resumed.stderr
    assert handle.wait() == 0, runner.log()[-3000:]
    ends = [e for e in cf.fleet.events_on_wire(paused["job_id"]) if e["event"] in ("completed", "error")]
    assert [(e["data"]["attempt_id"], e["event"]) for e in ends] == [(1, "error"), (2, "completed")]
    assert ends[-1]["detail"] == "Finished after the resume."
    again = cf.fleet.orch("resume", paused["job_id"])
    assert again.returncode == 1 and "refused resume: the job is completed, not paused" in again.stderr


def test_s18_a_retry_continues_the_session_in_the_worktree_attempt_1_left(claude_fleet: AgentFleet) -> None:
    """§18 continued sessions: attempt 1 writes a file, then the model is overloaded (529);
    the retry resumes the same session (`--resume`) in a worktree that starts where attempt 1
    ended, the model sees attempt 1's turns, and the result holds both attempts' change."""
    cf = claude_fleet
    runner = cf.start([ToolUse("Write", {"file_path": "NOTES.md", "content": "notes\n"}),
                       Failure(529, "overloaded_error", "Overloaded", {"retry-after": "3600"}),
                       ToolUse("Write", {"file_path": "MORE.md", "content": "more\n"}),
                       Text("Finished the notes.")])
    code, job_id = cf.run("--ref", "main", "--allow-tools", "Write", "--retries", "1", "--retry-on", "error")
    assert code == 0, runner.log()[-3000:]
    events = cf.fleet.events_on_wire(job_id)
    ends = {e["data"]["attempt_id"]: e for e in events if e["event"] in ("completed", "error")}
    assert ends[1]["event"] == "error" and "Overloaded" in ends[1]["detail"], ends[1]
    session_id = ends[1]["data"]["agent"]["session_id"]
    assert ends[2]["event"] == "completed" and ends[2]["data"]["agent"]["session_id"] == session_id
    (started,) = [e for e in events if e["event"] == "started" and e["data"]["attempt_id"] == 2]
    assert started["detail"] == f"continues session {session_id} of attempt 1", started
    resumed = [c for c in cf.model.calls() if c["tools"]][-2]  # type: ignore[union-attr]
    assert resumed["messages"] > 3 and any("NOTES.md" in text for text in resumed["tool_results"]), resumed
    result = json.loads(cf.fleet.orch("result", job_id, "--json").stdout)
    assert result["attempt_id"] == 2 and result["base_sha"] == git("rev-parse", "main", cwd=cf.origin).strip()
    assert sorted(f["path"] for f in result["files"]) == ["MORE.md", "NOTES.md"]
    assert f"1  gpu-box  error  agent session {session_id}" in cf.show_text(job_id)


NOTES_THEN_MORE: list[Step] = [WRITE_NOTES, Text("Wrote NOTES.md."),
                               ToolUse("Write", {"file_path": "MORE.md", "content": "more\n"}),
                               Text("Added MORE.md as you asked.")]
"""Attempt 1 writes NOTES.md; the attempt a follow-up starts writes MORE.md."""


def test_s18_say_continues_a_completed_job_and_its_change_grows(claude_fleet: AgentFleet) -> None:
    """`mam-orch say`: a person's follow-up to a completed job resumes the agent's session in
    the worktree the job left; the model sees the first conversation, the result both files."""
    cf = claude_fleet
    runner = cf.start(NOTES_THEN_MORE)
    code, job_id = cf.run("--ref", "main", "--allow-tools", "Write")
    assert code == 0, runner.log()[-3000:]
    said = cf.fleet.orch("say", job_id, "Now add MORE.md too.", "--json", timeout_s=2 * PATIENCE_S)
    assert said.returncode == 0, said.stderr + runner.log()[-3000:]
    ends = [e for e in cf.fleet.events_on_wire(job_id) if e["event"] in ("completed", "error")]
    assert [(e["data"]["attempt_id"], e["event"]) for e in ends] == [(1, "completed"), (2, "completed")]
    assert ends[-1]["detail"] == "Added MORE.md as you asked."
    resumed = [c for c in cf.model.calls() if c["tools"]][2]  # type: ignore[union-attr]
    assert resumed["messages"] > 3 and any("NOTES.md" in text for text in resumed["tool_results"]), resumed
    result = json.loads(cf.fleet.orch("result", job_id, "--json").stdout)
    assert sorted(f["path"] for f in result["files"]) == ["MORE.md", "NOTES.md"]
    refused = cf.fleet.orch("say", "0badf00d", "hello")
    assert refused.returncode == 1 and "no record" in refused.stderr


def test_s18_a_runner_without_the_session_continues_it_from_the_transcript_the_hub_carried(
        claude_fleet: AgentFleet) -> None:
    """§18 "Transcripts": attempt 1's result brings the session's transcript to the hub; the
    runner then loses it (its agent home wiped, as on another host), and `say`'s attempt 2
    gets it in the dispatch: the CLI resumes, and the model sees the first conversation."""
    cf = claude_fleet
    runner = cf.start(NOTES_THEN_MORE)
    code, job_id = cf.run("--ref", "main", "--allow-tools", "Write")
    assert code == 0, runner.log()[-3000:]
    assert json.loads(cf.fleet.orch("result", job_id, "--json").stdout)["has_transcript"]
    shutil.rmtree(cf.tmp / "agent-home" / ".claude" / "projects")
    said = cf.fleet.orch("say", job_id, "Now add MORE.md too.", "--json", timeout_s=2 * PATIENCE_S)
    assert said.returncode == 0, said.stderr + runner.log()[-3000:]
    events = cf.fleet.events_on_wire(job_id)
    (started,) = [e for e in events if e["event"] == "started" and e["data"]["attempt_id"] == 2]
    assert started["data"]["continues"]["transcript"] == "carried", started
    assert started["detail"].endswith(" of attempt 1, from the hub's transcript"), started
    assert [e["detail"] for e in events if e["event"] == "completed"][-1] == "Added MORE.md as you asked."
    resumed = [c for c in cf.model.calls() if c["tools"]][2]  # type: ignore[union-attr]
    assert resumed["messages"] > 3 and any("NOTES.md" in text for text in resumed["tool_results"]), resumed
    assert "the transcript the hub carried is in" in runner.log()


def test_s18_say_to_a_running_agent_reaches_it_mid_turn_and_is_refused_once_it_ended(
        claude_fleet: AgentFleet) -> None:
    """§18 "Input while it runs": while its tool runs, `say` reaches the CLI on stdin; the model
    hears the words with the tool's result. The words are sealed on the wire and never in the
    audit log, which records who said how much."""
    cf = claude_fleet
    go = cf.tmp / "go"
    runner = cf.start([ToolUse("Bash", {"command": f"while [ ! -e {go} ]; do sleep 0.1; done", "description": "wait"}),
                       Text("Done, with the test too.")], exec_cmd="claude --input-format stream-json")
    handle = cf.fleet.dispatch("gpu-box", "Make the change.", "--repo", "demo", *FAST, "--allow-tools", "Bash")
    started = wait_until(lambda: (handle.events("started") or [None])[0], PATIENCE_S, "the agent to start")
    assert started["data"]["takes_input"] is True, started
    job_id = started["job_id"]
    said = cf.fleet.orch("say", job_id, "Also add a test for it, please.", "--json")
    assert said.returncode == 0, said.stderr + runner.log()[-3000:]
    shown = json.loads(said.stdout)
    assert shown["delivered"] is True and shown["detail"].endswith(" delivered to the agent"), shown
    assert f"job {job_id}: message " in said.stderr
    go.touch()
    assert handle.wait() == 0, runner.log()[-3000:]
    assert cf.terminal(job_id)["detail"] == "Done, with the test too."
    told = [r for call in cf.model.calls() for r in call.get("tool_results", [])]  # type: ignore[union-attr]
    assert any("Also add a test for it, please." in text for text in told), told
    audit = Registry(cf.fleet.hub_ws).audit(job_id)
    (line,) = [entry for entry in audit if entry.get("event") == "told"]
    assert line["bytes"] == len("Also add a test for it, please.") and "@" in line["by"]
    assert "add a test" not in json.dumps(audit)
    assert not [m for m in cf.fleet.tap.messages() if "add a test" in str(m["payload"])]  # sealed on the wire


def test_s18_max_turns_2_against_five_turns_ends_budget_exceeded(claude_fleet: AgentFleet) -> None:
    five = [ToolUse("Bash", {"command": f"echo {n}", "description": "count"}) for n in range(5)]
    runner = claude_fleet.start([*five, Text("done")])
    code, job_id = claude_fleet.run("--max-turns", "2", "--allow-tools", "Bash(echo *)")
    assert code == 1, runner.log()[-3000:]
    assert claude_fleet.terminal(job_id)["detail"] == "budget_exceeded: max_turns 2"
    assert sum(c["tools"] for c in claude_fleet.model.calls()) <= 3  # type: ignore[union-attr]


def test_s18_an_agent_running_past_its_turn_budget_is_stopped_by_the_runner(claude_fleet: AgentFleet,
                                                                           tmp_path: Path) -> None:
    fake = tmp_path / "claude"  # a CLI that ignores --max-turns: one new model turn every 0.2 s
    fake.write_text("#!/bin/sh\nn=0\nwhile true; do n=$((n+1))\n"
                    "  echo '{\"type\":\"assistant\",\"message\":{\"id\":\"m'$n'\",\"content\":[]}}'\n"
                    "  sleep 0.2\ndone\n")
    fake.chmod(0o755)
    runner = claude_fleet.start([], exec_cmd=str(fake))
    code, job_id = claude_fleet.run("--max-turns", "3")
    assert code == 1, runner.log()[-3000:]
    terminal = claude_fleet.terminal(job_id)
    assert terminal["detail"] == "budget_exceeded: max_turns 3"
    assert terminal["data"]["agent"]["turns"] >= 4
    assert "agent stopped: max_turns 3 spent" in runner.log()


def agent_processes(worktree: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cwd"]):
        try:
            if proc.info["cwd"] and Path(proc.info["cwd"]).is_relative_to(worktree):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def test_s18_cancel_during_a_long_stream_stops_the_cli_and_its_children(claude_fleet: AgentFleet) -> None:
    claude_fleet.start([Text("word " * 600, chunks=600, delay_s=0.2)])
    handle = claude_fleet.fleet.dispatch("gpu-box", "Write a lot.", "--repo", "demo", "--detach", *FAST)
    job_id = handle.job_id()
    worktree = claude_fleet.fleet.base / "ws" / "gpu-box" / "worktrees" / f"{job_id}-1"
    wait_until(lambda: any(c["tools"] for c in claude_fleet.model.calls()), PATIENCE_S,  # type: ignore[union-attr]
               "the CLI streaming from the model")
    assert agent_processes(worktree), "the CLI runs in the attempt's worktree"
    assert claude_fleet.fleet.orch("cancel", job_id).returncode == 0
    wait_until(lambda: any(e["event"] == "error" for e in claude_fleet.fleet.events_on_wire(job_id)), PATIENCE_S,
               "the runner's terminal event")  # published once the agent's process group is gone
    assert agent_processes(worktree) == []
    assert claude_fleet.fleet.hub_record(job_id)["status"] == "cancelled"


def test_s18_a_bad_stream_is_reported_escaped_and_the_runner_lives_on(claude_fleet: AgentFleet,
                                                                       tmp_path: Path) -> None:
    fake = tmp_path / "claude"
    fake.write_text(
        "#!/bin/sh\n"
        "echo 'this is not json'\n"
        "head -c 10485760 /dev/zero | tr '\\0' 'x'; echo\n"
        "printf '%s\\n' '{\"type\":\"result\",\"subtype\":\"success\",\"is_error\":false,\"num_turns\":1,"
        "\"result\":\"done \\u001b[2J\\u001b]0;pwned\\u0007 now\",\"session_id\":\"s-1\","
        "\"total_cost_usd\":0.5,\"permission_denials\":[]}'\n")
    fake.chmod(0o755)
    runner = claude_fleet.start([], exec_cmd=str(fake))
    code, job_id = claude_fleet.run()
    assert code == 0, runner.log()[-3000:]
    terminal = claude_fleet.terminal(job_id)
    assert terminal["detail"] == "done \\x1b[2J\\x1b]0;pwned\\x07 now"
    assert terminal["data"]["agent"]["unreadable_lines"] == 2
    shown = claude_fleet.show_text(job_id)
    assert "\x1b" not in shown and "\x07" not in shown and "pwned" in shown
    assert "not read as the agent's stream" in runner.log() and "not a JSON object" in runner.log()
    code, _ = claude_fleet.run()  # the runner takes the next job
    assert code == 0 and runner.alive()
