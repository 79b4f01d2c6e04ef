"""Continued sessions (PROTOCOL §18): a retried or redispatched attempt of a job whose agent
reported a session continues it, in a worktree that starts where the last attempt ended,
unless the job or the redispatch says `--fresh`. The wire's `work.resume`, the hub's
record, the runner's worktree (real git) and the Claude Code transcript placement; the
real CLI resuming is in tests/e2e/test_claude_agent.py."""

from __future__ import annotations

import json
import os
import tarfile
import time
import zlib
from pathlib import Path

import pytest
from harness.gitserver import git, make_origin

from mam.orchestrator.dispatch import build_dispatch
from mam.orchestrator.logs import LogRouter
from mam.orchestrator.queue import Fleet, RunnerView, plan
from mam.orchestrator.queuewait import mark_published, queued_job, requeue, retry_attempt, say_requeue
from mam.orchestrator.redispatch import say_cli
from mam.orchestrator.results import with_transcript
from mam.runner import repos
from mam.runner.agents import ClaudeAdapter, new_adapter
from mam.runner.agents.claude import place_transcript, project_folder
from mam.runner.work import AttemptWork
from mam.shared.cli import render
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import DecodeError, SignatureError, UsageError
from mam.shared.store.records import QueueTerms, Refusal
from mam.shared.store.registry import Registry

pytestmark = pytest.mark.timeout(60)

SESSION = "8d99b0b5-6eb4-42d6-86de-f6ab1a4fe0ee"
BASE = "a" * 40
JOB = "0123abcd"


# ------------------------------------------------------------------ the wire

def test_s18_resume_travels_in_the_work_and_comes_back_equal() -> None:
    work = wire.Work.from_dict({"repo": "demo", "resume": {"session_id": SESSION, "attempt": 2, "base_sha": BASE}})
    assert work.resume == wire.Resume(SESSION, 2, BASE)
    assert wire.Work.from_dict(work.to_dict()) == work
    plain = wire.Work.from_dict({"resume": {"session_id": SESSION, "attempt": 1}})
    assert plain.to_dict() == {"resume": {"session_id": SESSION, "attempt": 1}} and plain


@pytest.mark.parametrize(("bad", "words"), [
    ({"resume": "x"}, "must be an object"),
    ({"resume": {"session_id": "../../etc/passwd", "attempt": 1}}, "resume.session_id"),
    ({"resume": {"session_id": "*", "attempt": 1}}, "resume.session_id"),
    ({"resume": {"session_id": "a" * 129, "attempt": 1}}, "resume.session_id"),
    ({"resume": {"session_id": SESSION, "attempt": 0}}, "attempt id 0"),
    ({"resume": {"session_id": SESSION, "attempt": True}}, "attempt id True"),
    ({"resume": {"session_id": SESSION}}, "needs session_id and attempt"),
    ({"resume": {"session_id": SESSION, "attempt": 1, "base_sha": BASE}}, "only allowed with repo"),
    ({"repo": "demo", "resume": {"session_id": SESSION, "attempt": 1, "base_sha": "HEAD~1"}}, "resume.base_sha"),
    ({"resume": {"session_id": SESSION, "attempt": 1, "prompt": "rm -rf /"}}, "unknown field"),
])
def test_s18_a_bad_resume_is_refused_in_one_line(bad: dict[str, object], words: str) -> None:
    with pytest.raises(DecodeError) as caught:
        wire.Work.from_dict(bad)
    assert words in caught.value.reason and "\n" not in caught.value.reason


# ------------------------------------------------------------------ the hub's record

def ended_attempt(reg: Registry, *, fresh: bool = False, session_id: str | None = SESSION) -> str:
    """A repository job whose attempt 1 ran on r1 (base BASE) and ended `error` with the agent's figures."""
    work = wire.Work(repo="demo", ref="main", max_turns=5)
    record = reg.register(session=None, queue=QueueTerms(target_labels=("x",), retries=1, retry_on=("error",),
                                                        fresh=fresh), work=work)
    job_id = record["job_id"]
    mark_published(reg, job_id, "r1")
    agent = {"kind": "claude", "session_id": session_id, "turns": 3, "tokens": {}, "cost_usd": 0.01}
    with reg.transaction(job_id) as txn:
        txn.store_event({"event": "started", "seq": 1, "data": {"sha": BASE}})
    with reg.transaction(job_id) as txn:
        txn.store_event({"event": "error", "seq": 2, "data": {"exit_code": 1, "agent": agent}})
    return job_id


def test_s18_a_retry_continues_the_last_session_from_the_attempt_that_reported_it(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    job_id = ended_attempt(reg)
    new = retry_attempt(reg, job_id, "error", None, None)
    assert new is not None and new["attempt_id"] == 2
    assert new["work"] == {"repo": "demo", "ref": "main", "max_turns": 5,
                           "resume": {"session_id": SESSION, "attempt": 1, "base_sha": BASE}}
    wire.Work.of_record(new)  # what the hub signs into attempt 2's dispatch is valid work
    rows = render.attempts(new)
    assert [(r["attempt_id"], r["agent_session_id"]) for r in rows] == [(1, SESSION), (2, None)]
    assert f"agent session {SESSION}" in render.show_text(new, [])


def test_s18_fresh_at_dispatch_or_at_redispatch_starts_a_new_session(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    retried = retry_attempt(reg, ended_attempt(reg, fresh=True), "error", None, None)
    assert retried is not None and "resume" not in retried["work"] and retried["work"]["repo"] == "demo"
    job_id = ended_attempt(reg)
    assert "resume" not in requeue(reg, job_id, fresh=True)["work"]
    other = ended_attempt(reg)
    assert requeue(reg, other)["work"]["resume"]["attempt"] == 1


@pytest.mark.parametrize("reported", [None, "", "../../etc/passwd", "a b", "x" * 200])
def test_s18_no_usable_session_reported_no_resume(tmp_path: Path, reported: str | None) -> None:
    """A runner's event names the session: one that is missing or hostile is never signed into a dispatch."""
    reg = Registry(tmp_path)
    new = retry_attempt(reg, ended_attempt(reg, session_id=reported), "error", None, None)
    assert new is not None and "resume" not in new["work"]


def fleet_of(*sessions: str) -> Fleet:
    """Runners of label x serving repo demo, one free slot each."""
    fleet = Fleet()
    for session in sessions:
        fleet.update(RunnerView(session=session, runner_id="a" * 32, status="online", labels=frozenset({"x"}),
                                max_jobs=1, running=frozenset(), verified=True, seen_at=time.monotonic(),
                                repos=frozenset({"demo"})))
    return fleet


# ------------------------------------------------------------------ the Claude Code transcript

def transcript(config: Path, cwd: Path, text: str = '{"type":"user"}\n') -> Path:
    path = config / "projects" / project_folder(cwd) / f"{SESSION}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_s18_the_project_folder_is_the_cwd_with_every_other_character_a_dash() -> None:
    assert project_folder(Path("/tmp/rx/.x_y/c-1")) == "-tmp-rx--x-y-c-1"  # what the real CLI 2.1 wrote


def test_s18_the_transcript_is_copied_to_the_new_worktrees_project_folder(tmp_path: Path) -> None:
    config = tmp_path / ".claude"
    transcript(config, Path("/w/worktrees/0123abcd-1"), "old\n")
    newest = transcript(config, Path("/w/worktrees/0123abcd-2"), "newer\n")
    os.utime(newest, (newest.stat().st_atime, newest.stat().st_mtime + 10))
    cwd = Path("/w/worktrees/0123abcd-3")
    assert place_transcript(config, SESSION, cwd)
    placed = config / "projects" / project_folder(cwd) / f"{SESSION}.jsonl"
    assert placed.read_text() == "newer\n" and placed.stat().st_mode & 0o777 == 0o600
    assert place_transcript(config, SESSION, cwd)  # already there: kept
    assert not place_transcript(config, "0000-missing", cwd)
    with pytest.raises(UsageError):
        place_transcript(config, "../../x", cwd)


def test_s18_a_linked_transcript_is_never_followed(tmp_path: Path) -> None:
    config = tmp_path / ".claude"
    secret = tmp_path / "secret"
    secret.write_text("key=1\n")
    link = config / "projects" / "-elsewhere" / f"{SESSION}.jsonl"
    link.parent.mkdir(parents=True)
    link.symlink_to(secret)
    assert not place_transcript(config, SESSION, Path("/w/t"))


def test_s18_claude_resumes_only_where_its_transcript_is_and_the_command_agent_never(tmp_path: Path) -> None:
    home = tmp_path / "home"
    adapter = ClaudeAdapter()
    why = adapter.continue_session(SESSION, Path("/w/t"), {"HOME": str(home)})
    assert why is not None and "not in" in why and "--resume" not in adapter.argv(["claude"])
    transcript(home / ".claude", Path("/w/old"))
    assert adapter.continue_session(SESSION, Path("/w/t"), {"HOME": str(home)}) is None
    assert adapter.argv(["claude"])[-2:] == ["--resume", SESSION]
    assert "--resume" not in adapter.argv(["claude", "--session-id", "x"])[2:][-2:]  # --exec chose a session
    config = tmp_path / "cfg"
    transcript(config, Path("/w/old"))
    assert ClaudeAdapter().continue_session(SESSION, Path("/w/u"), {"CLAUDE_CONFIG_DIR": str(config)}) is None
    assert ClaudeAdapter().continue_session(SESSION, Path("/w/u"), {}) == "neither CLAUDE_CONFIG_DIR nor HOME is set"
    def never() -> bytes:
        raise AssertionError("the carried transcript is opened only when this host has none")
    assert ClaudeAdapter().continue_session(SESSION, Path("/w/v"), {"CLAUDE_CONFIG_DIR": str(config)}, never) is None
    assert new_adapter("command").continue_session(SESSION, Path("/w"), {}) == \
        "the command agent cannot continue a session"


# ------------------------------------------------------------------ the runner's worktree (real git)

def attempt(root: Path, mirrors: repos.Repos, attempt_id: int, resume: wire.Resume | None, home: Path,
            agent: str = "claude") -> AttemptWork:
    log = root / "agent.log"
    root.mkdir(parents=True, exist_ok=True)
    log.touch()
    return AttemptWork(job_id=JOB, attempt_id=attempt_id, work=wire.Work(repo="demo", ref="main", resume=resume),
                       root=root, mirrors=mirrors, exec_argv=["claude"], log_path=log, log_offset=0,
                       agent=agent, environ={"HOME": str(home)})


def test_s18_attempt_2_starts_where_attempt_1_ended_and_its_result_counts_from_the_base(tmp_path: Path) -> None:
    origin = make_origin(tmp_path / "served")
    root, home = tmp_path / "runner", tmp_path / "home"
    mirrors = repos.Repos(root, repos.parse_repos([f"demo={origin}"], None))
    first = attempt(root, mirrors, 1, None, home)
    started = first.prepare()
    assert "continues" not in started and "fresh" not in started
    base = started["sha"]
    (first.cwd() / "NOTES.md").write_text("from attempt 1\n")  # left uncommitted: the runner commits it
    first.finish(session="gpu-box", max_result_bytes=10**7)
    transcript(home / ".claude", first.cwd())

    second = attempt(root, mirrors, 2, wire.Resume(SESSION, 1, base), home)
    started = second.prepare()
    assert started["continues"] == {"session_id": SESSION, "attempt": 1} and started["sha"] == base
    assert (second.cwd() / "NOTES.md").read_text() == "from attempt 1\n"
    assert second.argv()[-2:] == ["--resume", SESSION]
    assert (home / ".claude" / "projects" / project_folder(second.cwd()) / f"{SESSION}.jsonl").is_file()
    (second.cwd() / "MORE.md").write_text("from attempt 2\n")
    collected = second.finish(session="gpu-box", max_result_bytes=10**7)
    assert collected is not None and collected.data["base_sha"] == base and collected.data["files_total"] == 2

    # a third attempt naming an attempt this runner never ran starts fresh, from the ref, and says why
    third = attempt(root, mirrors, 3, wire.Resume(SESSION, 7, base), home)
    started = third.prepare()
    assert started["fresh"] == "attempt 7's worktree is not on this runner" and "continues" not in started
    assert not (third.cwd() / "NOTES.md").exists() and "--resume" not in third.argv()
    # a base that attempt 1 did not grow from is not continued either
    assert mirrors.attempt_head("demo", JOB, 1, git("rev-parse", "main~1", cwd=origin).strip()) is not None
    assert mirrors.attempt_head("demo", JOB, 1, "b" * 40) is None


def test_s18_a_command_agent_continues_the_worktree_but_says_its_session_is_new(tmp_path: Path) -> None:
    origin = make_origin(tmp_path / "served")
    root = tmp_path / "runner"
    mirrors = repos.Repos(root, repos.parse_repos([f"demo={origin}"], None))
    first = attempt(root, mirrors, 1, None, tmp_path, agent="command")
    base = first.prepare()["sha"]
    (first.cwd() / "a.txt").write_text("1\n")
    first.finish(session="gpu-box", max_result_bytes=10**7)
    second = attempt(root, mirrors, 2, wire.Resume(SESSION, 1, base), tmp_path, agent="command")
    started = second.prepare()
    assert started["fresh"] == "the command agent cannot continue a session"
    assert (second.cwd() / "a.txt").read_text() == "1\n"
    assert json.dumps(started)  # `started`'s data stays JSON


# ------------------------------------------------------------------ the transcript in the result

def plain_claude_attempt(tmp_path: Path, secret: str = "") -> AttemptWork:
    """A claude attempt of a job without a repository whose stream named SESSION."""
    root = tmp_path / "runner"
    (root / "agent.log").parent.mkdir(parents=True, exist_ok=True)
    (root / "agent.log").touch()
    work = AttemptWork(job_id=JOB, attempt_id=1, work=None, root=root,
                       mirrors=repos.Repos(root, repos.parse_repos([], None)), exec_argv=["claude"],
                       log_path=root / "agent.log", log_offset=0, agent="claude", secrets=[secret] if secret else [],
                       environ={"HOME": str(tmp_path / "home")})
    work.prepare()
    work.adapter.feed(json.dumps({"type": "system", "subtype": "init", "session_id": SESSION}))
    return work


def archived(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


def test_s18_the_transcript_travels_masked_with_the_result_even_of_a_plain_job(tmp_path: Path) -> None:
    secret = "s3cret-auth-token-0123456789"
    work = plain_claude_attempt(tmp_path, secret)
    transcript(tmp_path / "home" / ".claude", work.cwd(), f'{{"type":"user","text":"the key is {secret}"}}\n')
    collected = work.finish(session="gpu-box", max_result_bytes=10**7)
    assert collected is not None  # no repository, no artifacts: the transcript alone is a result
    files = archived(collected.archive)
    body = files[f"transcript/{SESSION}.jsonl"]
    assert body == b'{"type":"user","text":"the key is ***"}\n'
    assert json.loads(files["result.json"])["transcript"] == {"session_id": SESSION, "bytes": len(body)}


def test_s18_a_transcript_over_the_cap_or_linked_is_left_out_and_said(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mam.runner.work.MAX_TRANSCRIPT_BYTES", 1 << 20)
    work = plain_claude_attempt(tmp_path / "big")
    transcript(tmp_path / "big" / "home" / ".claude", work.cwd(), "x" * ((1 << 20) + 1))
    collected = work.finish(session="gpu-box", max_result_bytes=10**7)
    assert collected is None  # nothing else to send
    work = plain_claude_attempt(tmp_path / "linked")
    secret = tmp_path / "secret"
    secret.write_text("key=1\n")
    path = transcript(tmp_path / "linked" / "home" / ".claude", work.cwd())
    path.unlink()
    path.symlink_to(secret)
    assert work.adapter.transcript(work.cwd(), work.environ) is None
    assert work.finish(session="gpu-box", max_result_bytes=10**7) is None
    work = plain_claude_attempt(tmp_path / "noted")
    transcript(tmp_path / "noted" / "home" / ".claude", work.cwd(), "x" * ((1 << 20) + 1))
    (work.artifacts_dir / "report.txt").write_text("done\n")  # a result goes: it says what it left out
    collected = work.finish(session="gpu-box", max_result_bytes=10**7)
    assert collected is not None
    summary = json.loads(archived(collected.archive)["result.json"])
    assert "transcript" not in summary and summary["artifact_notes"] == ["transcript left out: over 1 MiB"]


# ------------------------------------------------------------------ the transcript the hub carries

def hub_transcript(reg: Registry, job_id: str, text: str) -> None:
    """Attempt 1's result brought SESSION's transcript `text` to the hub."""
    folder = names.hub_result_dir(reg.root, job_id, 1) / names.TRANSCRIPT_DIR
    folder.mkdir(parents=True)
    (folder / f"{SESSION}.jsonl").write_text(text)


def test_s18_the_hub_carries_the_resumed_transcript_sealed_to_the_new_attempt_only(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    job_id = ended_attempt(reg)
    new = retry_attempt(reg, job_id, "error", None, None)
    assert new is not None and with_transcript(reg.root, new) is new  # the hub has none: nothing carried
    hub_transcript(reg, job_id, '{"type":"user"}\n' * 1000)
    sealed = with_transcript(reg.root, new)["work"]["resume"]["transcript"]
    packed = crypto.open_transcript(new["auth_token"], sealed, job_id=job_id, attempt_id=2, session_id=SESSION)
    assert zlib.decompress(packed) == b'{"type":"user"}\n' * 1000 and len(packed) < 1000
    for attempt_id, session_id in ((1, SESSION), (2, "other-session")):  # bound to its attempt and session
        with pytest.raises(SignatureError):
            crypto.open_transcript(new["auth_token"], sealed, job_id=job_id, attempt_id=attempt_id,
                                   session_id=session_id)
    signed = build_dispatch({**new, "session": "gpu-box"}, "Go on.", crypto.derive_keys("s" * 32), root=reg.root)
    resume = wire.decode(wire.encode(signed), "dispatch").work.resume  # type: ignore[union-attr]
    assert resume is not None and resume.transcript is not None and resume.session_id == SESSION
    assert "transcript" not in reg.get(job_id)["work"]["resume"]  # carried in the dispatch, never stored


def test_s18_an_attempt_lost_mid_run_is_continued_from_its_progress_and_streamed_transcript(tmp_path: Path) -> None:
    """A runner lost before its terminal event (§15 "Transcript chunks"): its `progress` event
    named the session, its chunks brought the transcript; the retry resumes that session and
    the dispatch carries the streamed copy up to its last whole line."""
    reg = Registry(tmp_path)
    record = reg.register(session=None, queue=QueueTerms(target_labels=("x",), retries=1, retry_on=("error",)))
    job_id = record["job_id"]
    mark_published(reg, job_id, "r1")
    agent = {"kind": "claude", "session_id": SESSION, "turns": 0, "tokens": {}, "cost_usd": None}
    for seq, event, data in ((1, "started", {}), (2, "progress", {"agent": agent}), (3, "error", {"exit_code": 1})):
        with reg.transaction(job_id) as txn:
            txn.store_event({"event": event, "seq": seq, "data": data})
    token = record["auth_token"]
    LogRouter(reg).handle(crypto.build_log_chunk(token, crypto.log_key(token), job_id=job_id, attempt_id=1, chunk=0,
                                                 dropped=0, plaintext=b'{"type":"user"}\n{"type":"assis',
                                                 session_id=SESSION))
    new = retry_attempt(reg, job_id, "error", None, None)
    assert new is not None and new["work"]["resume"] == {"session_id": SESSION, "attempt": 1}
    sealed = with_transcript(reg.root, new)["work"]["resume"]["transcript"]
    packed = crypto.open_transcript(new["auth_token"], sealed, job_id=job_id, attempt_id=2, session_id=SESSION)
    assert zlib.decompress(packed) == b'{"type":"user"}\n'


def test_s18_a_transcript_too_large_to_carry_is_left_out_and_the_dispatch_still_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    reg = Registry(tmp_path)
    job_id = ended_attempt(reg)
    new = retry_attempt(reg, job_id, "error", None, None)
    assert new is not None
    hub_transcript(reg, job_id, os.urandom(600 * 1024).hex())  # does not compress under 1 MiB with the brief
    signed = build_dispatch({**new, "session": "gpu-box"}, "b" * (500 * 1024), crypto.derive_keys("s" * 32),
                            root=reg.root)
    assert "transcript" not in signed["work"]["resume"] and "too large" in caplog.text
    monkeypatch.setattr(wire, "MAX_TRANSCRIPT_SEALED_CHARS", 100)
    assert with_transcript(reg.root, new) is new


@pytest.mark.parametrize(("bad", "words"), [
    ("x", "resume.transcript must be an object of alg, nonce and ciphertext"),
    ({"alg": "none", "nonce": "AAAA", "ciphertext": "AAAA"}, "resume.transcript.alg"),
    ({"alg": "A256GCM", "nonce": "AAAA", "ciphertext": "A" * (384 * 1024 + 1)}, "resume.transcript.ciphertext"),
    ({"alg": "A256GCM", "nonce": "AAAA", "ciphertext": "\u00e9\n"}, "resume.transcript.ciphertext"),
])
def test_s18_a_bad_carried_transcript_is_refused_in_one_line(bad: object, words: str) -> None:
    with pytest.raises(DecodeError) as caught:
        wire.Work.from_dict({"resume": {"session_id": SESSION, "attempt": 1, "transcript": bad}})
    assert words in caught.value.reason and "\n" not in caught.value.reason


def carried_attempt(tmp_path: Path, packed: bytes, *, token: str = "t" * 32, sealed_with: str = "t" * 32,
                    ) -> AttemptWork:
    """Attempt 2 of a plain claude job resuming SESSION on a runner that never ran attempt 1."""
    root = tmp_path / "runner"
    root.mkdir(parents=True)
    (root / "agent.log").touch()
    sealed = crypto.seal_transcript(sealed_with, packed, job_id=JOB, attempt_id=2, session_id=SESSION)
    return AttemptWork(job_id=JOB, attempt_id=2, work=wire.Work(resume=wire.Resume(SESSION, 1, transcript=sealed)),
                       root=root, mirrors=repos.Repos(root, repos.parse_repos([], None)), exec_argv=["claude"],
                       log_path=root / "agent.log", log_offset=0, agent="claude",
                       environ={"HOME": str(tmp_path / "home")}, auth_token=token)


def test_s18_a_runner_without_the_session_continues_it_from_the_carried_transcript(tmp_path: Path) -> None:
    work = carried_attempt(tmp_path, zlib.compress(b'{"type":"user","n":1}\n'))
    started = work.prepare()
    assert started["continues"] == {"session_id": SESSION, "attempt": 1, "transcript": "carried"}
    assert work.argv()[-2:] == ["--resume", SESSION]
    placed = tmp_path / "home" / ".claude" / "projects" / project_folder(work.cwd()) / f"{SESSION}.jsonl"
    assert placed.read_bytes() == b'{"type":"user","n":1}\n' and placed.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("case", ["forged", "not zlib", "a zip bomb"])
def test_s18_a_carried_transcript_that_is_forged_broken_or_a_bomb_starts_a_new_session(
        tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mam.runner.work.MAX_TRANSCRIPT_BYTES", 1 << 20)
    packed = {"forged": zlib.compress(b"{}\n"), "not zlib": b"plain text",
              "a zip bomb": zlib.compress(b"\0" * (2 << 20))}[case]
    work = carried_attempt(tmp_path, packed, sealed_with="f" * 32 if case == "forged" else "t" * 32)
    started = work.prepare()
    assert started["fresh"].startswith(f"session {SESSION} is not in ") and "--resume" not in work.argv()


# ------------------------------------------------------------------ mam-orch say

def test_s18_say_continues_an_ended_job_even_a_fresh_one_on_its_runner(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    job_id = ended_attempt(reg, fresh=True)
    new = say_requeue(reg, job_id)
    assert (new["status"], new["attempt_id"], new["target"]) == ("queued", 2, {"session": "r1"})
    assert new["work"]["resume"] == {"session_id": SESSION, "attempt": 1, "base_sha": BASE}
    (said,) = [line for line in reg.audit(job_id) if line["event"] == "said"]
    assert (said["attempt_id"], said["next_attempt"], said["session_id"]) == (1, 2, SESSION)
    with pytest.raises(Refusal, match="refused say: the job is queued; `say` continues a job after it ended"):
        say_requeue(reg, job_id)


def test_s18_say_is_refused_when_the_agent_reported_no_session(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    job_id = ended_attempt(reg, session_id=None)
    with pytest.raises(Refusal, match="reported no session to continue"):
        say_requeue(reg, job_id)
    assert reg.get(job_id)["attempt_id"] == 1  # nothing changed


def test_s18_a_retry_after_the_runners_own_error_prefers_the_runner_that_has_the_session(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    new = retry_attempt(reg, ended_attempt(reg), "error", None, None)
    assert new is not None and new["prefer_session"] == "r1" and "avoid_session" not in new
    fleet = fleet_of("r0", "r1", "r2")
    job = queued_job(new)
    assert plan([job], fleet, time.monotonic(), 60) == [(new["job_id"], "r1")]
    # a fresh job, or a runner the hub lost, is avoided as before
    fresh = retry_attempt(reg, ended_attempt(reg, fresh=True), "error", None, None)
    assert fresh is not None and fresh["avoid_session"] == "r1" and "prefer_session" not in fresh
    lost = retry_attempt(reg, ended_attempt(reg), "runner_lost", None, None)
    assert lost is not None and lost["avoid_session"] == "r1"
    assert plan([queued_job(lost)], fleet, time.monotonic(), 60)[0][1] != "r1"


@pytest.mark.parametrize(("text", "text_file", "words"), [
    (None, None, "give exactly one of TEXT, --file PATH or --file -"),
    ("a", "/x", "give exactly one of TEXT, --file PATH"),
    ("   ", None, "the brief is empty: give TEXT, --file PATH"),
    (None, "/nonexistent/words.txt", "--file /nonexistent/words.txt: cannot read"),
    ("x" * (512 * 1024 + 1), None, "larger than the 524288-byte limit"),
])
def test_s18_say_refuses_bad_words_in_one_line_before_anything(tmp_path: Path, text: str | None,
                                                               text_file: str | None, words: str) -> None:
    with pytest.raises(UsageError) as caught:
        say_cli("0123abcd", text, text_file=text_file, workspace=tmp_path)
    assert words in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(UsageError, match="job id 'zz' is invalid"):
        say_cli("zz", "hello", workspace=tmp_path)
