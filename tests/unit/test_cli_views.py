"""The CLI views people read, without a broker — no logger lines in a
human view, the summary line (§15 log places), `show`/`jobs` columns, tokens masked in
JSON lines, a `--workspace` that does not exist (exit 64), human views of `gc`,
`cancel` and `broker` on a terminal, and `--help` (workflow order, whole summaries,
an example each, no PROTOCOL references)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import typer

from mam.orchestrator.cli import app
from mam.orchestrator.hints import detach_hint
from mam.orchestrator.watch import render_event
from mam.runner.cli import app as runner_app
from mam.shared import cli
from mam.shared.cli.render import jobs_table, show_text, summary_lines
from mam.shared.protocol import names
from mam.shared.protocol.errors import ExitCode
from mam.shared.store.records import JobNotFound, QueueTerms, redact
from mam.shared.store.registry import Registry

pytestmark = pytest.mark.timeout(60)
TS = "2026-06-20T14:49:30Z"
LATER = "2026-06-20T14:51:35Z"  # two minutes and five seconds after TS


@pytest.fixture
def reg(tmp_path):
    return Registry(tmp_path)


def ended(reg, status="completed", close_reason=None):
    record = reg.register(session="gpu-box")
    names.job_logs_dir(reg.root, record["job_id"]).mkdir(parents=True, exist_ok=True)
    names.brief_path(reg.root, record["job_id"]).write_text("Fix the flaky test\nthen run it 3 times\n")
    return {**redact(record), "status": status, "close_reason": close_reason, "created_at": TS,
            "updated_at": LATER, "exit_code": 0}


def run_cli(*argv: str) -> int:
    with pytest.raises(SystemExit) as info:
        cli.run(app, "mam-orch", list(argv))
    return int(info.value.code)


def test_human_view_logs_only_warnings_unless_asked():
    code = ("import logging, sys; from mam.shared import cli; cli.setup_logging({}); "
            "print(logging.getLevelName(logging.getLogger().level))")
    env = {"PATH": "/usr/bin:/bin"}
    human = subprocess.run([sys.executable, "-c", code.format("True")], capture_output=True, text=True, env=env)
    piped = subprocess.run([sys.executable, "-c", code.format("False")], capture_output=True, text=True, env=env)
    asked = subprocess.run([sys.executable, "-c", code.format("True")], capture_output=True, text=True,
                           env={**env, "MAM_LOG_LEVEL": "DEBUG"})
    assert (human.stdout.strip(), piped.stdout.strip(), asked.stdout.strip()) == ("WARNING", "INFO", "DEBUG")


def test_s15_summary_line_outcome_duration_runner_and_both_log_places(reg):
    record = {**ended(reg), "last_seq": 3}  # its runner reported the attempt
    text = summary_lines(record, reg.root)
    assert text.count("\n") == 1
    assert f"job {record['job_id']} completed (exit 0) after 2m05s on runner gpu-box" in text
    assert str(names.hub_log_path(reg.root, record["job_id"], 1)) in text
    assert f".mam/logs/{record['job_id']}/agent.log in runner gpu-box's workspace" in text


def test_the_summary_of_a_job_that_never_ran_names_no_runner(reg):
    record = ended(reg, "error", "queue_timeout")  # a session target, never started (last_seq 0)
    text = summary_lines(record, reg.root)
    assert text == f"job {record['job_id']} error (queue_timeout) (exit 0) after 2m05s without starting on any " \
                   "runner (no output)\n"  # no runner, no log files that do not exist


def test_cancelled_while_watching_is_said_in_words(reg):
    record = ended(reg, "cancelled", "cancelled")
    first = summary_lines(record, reg.root).splitlines()[0]
    assert first == f"job {record['job_id']} was cancelled while it was watched (mam-orch cancel or the API)"


def test_show_puts_status_runner_attempts_duration_logs_and_brief_first(reg):
    record = ended(reg, "error", "agent_blocked")
    lines = show_text(record, [], reg.root).splitlines()
    assert [line.split(":")[0] for line in lines[:8]] == ["job", "status", "runner", "attempts", "duration",
                                                         "hub log", "runner log", "brief"]
    assert lines[1].endswith("error (agent_blocked)") and lines[4].endswith("2m05s")
    assert lines[7].endswith("Fix the flaky test") and lines[8].strip() == "then run it 3 times"


def test_jobs_has_duration_runner_and_brief_columns(reg):
    record = ended(reg)
    header, row = jobs_table([record], reg.root).splitlines()
    assert header.split()[:5] == ["JOB", "STATUS", "RUNNER", "ATTEMPT", "DURATION"] and "BRIEF" in header
    assert "gpu-box" in row and "2m05s" in row and row.endswith("Fix the flaky test  -")


def test_jobs_says_why_a_queued_job_waits(reg, tmp_path):
    from mam.shared.cli.render import with_why_waiting

    record = reg.register(session="gpu-box")
    for line in ("a stale reason", "no runner serves repo nope; runners serving it: none"):
        reg.append_audit(record["job_id"], {"event": "hub_note", "line": f"job {record['job_id']}: {line}"})
    shown = with_why_waiting(reg, dict(record, status="queued"))
    reason = "no runner serves repo nope; runners serving it: none"
    assert shown["why_waiting"] == reason
    assert jobs_table([shown], reg.root).splitlines()[1].endswith(reason)


def test_jobs_and_show_say_what_the_agent_spent(reg):
    record = dict(ended(reg), agent={"kind": "claude", "session_id": "s-1", "turns": 5, "cost_usd": 0.00528,
                                     "tokens": {"input": 500, "output": 250, "cached": 100}})
    header, row = jobs_table([record], reg.root).splitlines()
    assert "AGENT" in header and "claude 5 turns $0.0053" in row
    trail = [{"seq": 2, "event": "completed", "detail": "done",
              "data": {"attempt_id": record["attempt_id"], "agent": record["agent"]}}]
    assert "agent:      claude session s-1, 5 turns, 500 in / 250 out / 100 cached tokens, $0.0053" in \
        show_text(record, trail, reg.root)


def test_show_says_what_the_jobs_processes_used_when_its_cgroup_told(reg):
    record = ended(reg)
    trail = [{"seq": 2, "event": "completed", "detail": "done",
              "data": {"attempt_id": record["attempt_id"], "usage": {"cpu_s": 12.345, "peak_memory_bytes": 3 << 20}}}]
    assert "usage:      12.345 s CPU, peak memory 3.0 MiB (the job's processes)" in show_text(record, trail, reg.root)
    trail[0]["data"]["usage"] = {"cpu_s": 0.5, "peak_memory_bytes": "lots"}  # a figure of the wrong type: left out
    assert "usage:      0.5 s CPU (the job's processes)" in show_text(record, trail, reg.root)
    trail[0]["data"]["usage"] = "x"
    assert "usage:" not in show_text(record, trail, reg.root)


def test_json_event_lines_mask_the_dispatch_token(reg):
    record = reg.register(session="gpu-box")
    payload = {"schema_version": 1, "seq": 1, "job_id": record["job_id"], "event": "started", "timestamp": TS,
               "detail": "", "data": {"attempt_id": 1, "dispatch_token": record["dispatch_token"]}}
    line = render_event(payload, human=False)
    assert record["dispatch_token"] not in line and json.loads(line)["data"]["dispatch_token"] == "<set>"


@pytest.mark.parametrize("command", [["jobs"], ["show", "0badc0de"], ["gc", "--dry-run"]])
def test_a_workspace_that_does_not_exist_is_a_usage_error(tmp_path, capsys, command):
    missing = tmp_path / "nonexistent"
    assert run_cli(*command, "--workspace", str(missing)) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not an existing directory" in err and not missing.exists()


def test_no_record_suggests_the_workspace(reg):
    with pytest.raises(JobNotFound, match="is the workspace right"):
        reg.get("0badc0de")


def test_hints_name_the_workspace_when_given(tmp_path):
    assert f"mam-orch watch 0badc0de --workspace {tmp_path}" in detach_hint("0badc0de", str(tmp_path))
    assert "--workspace" not in detach_hint("0badc0de")


class Tty:
    """capsys with stdout made a terminal (the human views)."""

    def __init__(self, capsys, monkeypatch) -> None:
        self.capsys, self.monkeypatch = capsys, monkeypatch

    def readouterr(self):
        return self.capsys.readouterr()

    def on(self) -> None:  # sys.stdout is capsys's own only once the test runs
        self.monkeypatch.setattr(sys.stdout, "isatty", lambda: True)


@pytest.fixture
def tty(capsys, monkeypatch):
    return Tty(capsys, monkeypatch)


def test_gc_dry_run_human_view_lists_or_says_nothing_to_clear(reg, tty):
    tty.on()
    assert run_cli("gc", "--dry-run", "--workspace", str(reg.root)) == 0
    assert tty.readouterr().out.startswith("nothing to clear: no job of this hub ended more than 7 days ago")
    job_id = reg.register(session="gpu-box")["job_id"]
    reg.close(job_id, "cancelled", source="operator", reason="test")
    assert run_cli("gc", "--dry-run", "--older-than-days", "0", "--workspace", str(reg.root)) == 0
    out = tty.readouterr().out.splitlines()
    assert out[0] == "would clear the retained topics of 1 job:" and out[2].startswith(f"{job_id}  cancelled")
    assert run_cli("gc", "--dry-run", "--older-than-days", "0", "--json", "--workspace", str(reg.root)) == 0
    assert json.loads(tty.readouterr().out) == {"job_id": job_id, "status": "cancelled", "cleared": False,
                                                "updated_at": reg.get(job_id)["updated_at"]}


def test_cancel_on_a_terminal_prints_its_line_not_json_unless_asked(reg, tty):
    tty.on()
    queued = reg.register(session="gpu-box", queue=QueueTerms(target_session="gpu-box"))["job_id"]
    assert run_cli("cancel", queued, "--workspace", str(reg.root)) == 0
    human = tty.readouterr()
    assert human.out == "" and human.err == f"job {queued} (attempt 1): cancelled while queued\n"
    other = reg.register(session="gpu-box", queue=QueueTerms(target_session="gpu-box"))["job_id"]
    assert run_cli("cancel", other, "--json", "--workspace", str(reg.root)) == 0
    assert json.loads(tty.readouterr().out)["status"] == "cancelled"


def test_broker_down_human_view_is_key_value_lines(tmp_path, tty):
    tty.on()
    assert run_cli("broker", "down", "--workspace", str(tmp_path)) == 0
    assert tty.readouterr().out.splitlines()[0].split() == ["status:", "not", "running"]


def _help(capsys, *path: str) -> str:
    assert run_cli(*path, "--help") == 0
    return capsys.readouterr().out


def _leaves(group, prefix=()):
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield (*prefix, name), cmd
            yield from _leaves(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def test_help_has_no_protocol_refs_an_example_each_and_whole_summaries(capsys):
    root = typer.main.get_command(app)
    top = _help(capsys)
    listed = [line.split()[0] for line in top.split("Commands:\n")[1].splitlines() if line[:3].strip()]
    assert listed[:9] == ["init", "config", "broker", "serve", "runner", "runners", "dispatch", "schedule", "watch"]
    assert "..." not in top.split("Commands:")[1] and "§" not in top and "PROTOCOL" not in top
    for path, cmd in _leaves(root):
        text = _help(capsys, *path)
        assert "§" not in text and "PROTOCOL" not in text, path
        assert "..." not in text.split("Commands:")[-1] or not hasattr(cmd, "commands"), path
        assert "Example: mam-orch " in text, path


def test_mam_runner_help_is_the_same_kind(capsys):
    with pytest.raises(SystemExit):
        cli.run(runner_app, "mam-runner", ["--help"])
    top = capsys.readouterr().out
    assert "§" not in top and "..." not in top.split("Commands:")[1]
    for name in ("run", "publish", "enroll", "trust-hub", "jobs", "show"):
        with pytest.raises(SystemExit):
            cli.run(runner_app, "mam-runner", [name, "--help"])
        text = capsys.readouterr().out
        assert "§" not in text and "PROTOCOL" not in text and "Example: mam-runner " in text, name


def test_runner_show_names_its_own_agent_log(reg):
    record = {**ended(reg), "role": "runner"}
    assert f"runner log: {names.runner_agent_log_path(reg.root, record['job_id'])}" in " ".join(
        show_text(record, [], reg.root).splitlines()[6].split())
