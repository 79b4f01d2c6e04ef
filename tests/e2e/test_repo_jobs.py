"""Repository jobs end to end (PROTOCOL §18): a real broker, the hub service, a runner
daemon in its own network namespace cloning over the network from a real `git daemon` on
the hub's address, and a command agent (`bash -s`: the brief is the script) that edits and
commits in its worktree.

- A job on `demo@main` that edits two files and commits: the hub's `result` shows the
  diffstat and SHAs, `--patch` the diff, `apply` makes branch `mam/<id>` in a fresh clone
  whose tree equals the runner's; `show` names the repo at its commit.
- Two jobs on one runner at once: two worktrees and branches, neither sees the other's file.
- Bad input: a repo no runner serves (queued, the reason said), a ref that does not exist
  (error naming it, no worktree), a change over `--max-result-bytes` (`result_too_large`),
  an artifact that is a link to /etc/passwd (left out), a forged result chunk (refused,
  logged).
- A broker outage while the result is in flight: it arrives after the broker returns,
  byte for byte.
- A runner killed (-9) mid-attempt: the retry starts a fresh worktree from the base commit;
  the crashed attempt's tree is removed when the runner starts again.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from harness.fleet import MAM_ORCH, Fleet, Proc
from harness.gitserver import GitDaemon, git, make_origin
from harness.netns import unavailable_reason
from harness.waiting import PATIENCE_S, wait_until

from mam.shared.protocol import names

pytestmark = [pytest.mark.broker, pytest.mark.e2e]

FAST = ("--heartbeat", "1", "--heartbeat-misses", "20", "--ack-timeout", str(int(PATIENCE_S)))
EDIT_TWO = """set -e
printf 'print("bye")\\n' > src/app.py
printf 'notes\\n' > NOTES.md
git add -A
git commit -qm "agent: two files"
"""


@pytest.fixture
def repo_fleet(tmp_path: Path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"the multi-host repository e2e needs network namespaces: {reason}")
    fleet = Fleet("netns", tmp_path)
    origin = make_origin(tmp_path / "served")
    daemon = GitDaemon(origin.parent, host=fleet.net.address("hub"), netns=fleet.net.ns("hub"))
    try:
        with daemon:
            fleet.serve()
            yield fleet, origin, daemon
    finally:
        fleet.close()


def start_runner(fleet: Fleet, daemon: GitDaemon, *extra: str, sync: Path | None = None):
    env = {"SYNC": str(sync)} if sync is not None else None
    return fleet.start_runner("gpu-box", "bash -s", "--repo", f"demo={daemon.url('demo')}", "--max-jobs", "2",
                              *extra, env=env)


def run_job(fleet: Fleet, brief: str, *opts: str) -> tuple[int, str]:
    handle = fleet.dispatch("gpu-box", brief, "--repo", "demo", *FAST, *opts)
    code = handle.wait()
    return code, handle.job_id()


def result_of(fleet: Fleet, job_id: str) -> dict:
    shown = fleet.orch("result", job_id, "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def test_s18_a_repository_job_comes_back_as_a_change_that_applies(repo_fleet, tmp_path: Path) -> None:
    fleet, origin, daemon = repo_fleet
    runner = start_runner(fleet, daemon)
    code, job_id = run_job(fleet, EDIT_TWO, "--ref", "main")
    assert code == 0, runner.log()[-3000:]
    main = git("rev-parse", "main", cwd=origin).strip()
    result = result_of(fleet, job_id)
    assert result["base_sha"] == main and result["ready"] and result["files_total"] == 2
    assert sorted(f["path"] for f in result["files"]) == ["NOTES.md", "src/app.py"]
    assert fleet.hub_record(job_id)["repo_sha"] == main
    patch = fleet.orch("result", job_id, "--patch")
    assert patch.returncode == 0 and "+notes" in patch.stdout and "NOTES.md" in patch.stdout
    clone = tmp_path / "clone"
    git("clone", "-q", str(origin), str(clone))
    applied = fleet.orch("apply", job_id, "--repo-path", str(clone))
    assert applied.returncode == 0, applied.stderr
    worktree = fleet.base / "ws" / "gpu-box" / "worktrees" / f"{job_id}-1"
    assert git("rev-parse", f"mam/{job_id}^{{tree}}", cwd=clone) == git("rev-parse", "HEAD^{tree}", cwd=worktree)
    shown = fleet.orch("show", job_id, "--json")
    started = [e for e in json.loads(shown.stdout)["audit"] if e.get("event") == "started"]
    assert started[0]["data"]["sha"] == main and started[0]["data"]["branch"] == f"mam/{job_id}-1"
    (clone / "README.md").write_text("dirty\n")
    refused = fleet.orch("apply", job_id, "--repo-path", str(clone))
    assert refused.returncode == 64 and "uncommitted changes" in refused.stderr


def test_s18_two_jobs_on_one_runner_work_in_two_trees(repo_fleet, tmp_path: Path) -> None:
    fleet, _origin, daemon = repo_fleet
    sync = tmp_path / "sync"
    sync.mkdir()
    start_runner(fleet, daemon, sync=sync)
    brief = """set -e
echo "$MAM_JOB_ID" > "mine-$MAM_JOB_ID"
touch "$SYNC/$MAM_JOB_ID"
for i in $(seq 600); do [ "$(ls "$SYNC" | wc -l)" -ge 2 ] && break; sleep 0.1; done
[ "$(ls mine-* | wc -l)" -eq 1 ]
[ "$(git rev-parse --abbrev-ref HEAD)" = "mam/$MAM_JOB_ID-1" ]
"""
    handles = [fleet.dispatch("gpu-box", brief, "--repo", "demo", *FAST) for _ in range(2)]
    assert [h.wait() for h in handles] == [0, 0]
    ids = [h.job_id() for h in handles]
    for job_id in ids:
        files = [f["path"] for f in result_of(fleet, job_id)["files"]]
        assert files == [f"mine-{job_id}"]


def test_s18_bad_input_is_said_and_loses_nothing(repo_fleet, tmp_path: Path) -> None:
    fleet, _origin, daemon = repo_fleet
    runner = start_runner(fleet, daemon, "--max-result-bytes", "20000")
    # a repo nobody serves: queued, and the reason says so
    queued = fleet.dispatch("gpu-box", "true\n", "--repo", "nope", "--detach", *FAST)
    job_id = queued.job_id()
    wait_until(lambda: "no runner serves repo nope" in queued.log(), PATIENCE_S,
               "the reason a job waits")
    assert fleet.hub_record(job_id)["status"] == "queued"
    listed = fleet.orch("jobs", "--status", "queued", "--json")  # `jobs` says why it waits too
    [row] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert row["job_id"] == job_id and "no runner serves repo nope" in row["why_waiting"], row
    assert fleet.orch("cancel", job_id).returncode == 0
    # a ref that does not exist: error naming it, no worktree
    code, job_id = run_job(fleet, "true\n", "--ref", "no-such-branch")
    assert code == 1
    assert any("no-such-branch" in str(e.get("detail")) for e in fleet.events_on_wire(job_id))
    assert not (fleet.base / "ws" / "gpu-box" / "worktrees" / f"{job_id}-1").exists()
    # a change over the cap: the diffstat and a note, no bundle
    code, job_id = run_job(fleet, "head -c 300000 /dev/urandom > big.bin\n")
    assert code == 0
    result = result_of(fleet, job_id)
    assert result["note"].startswith("result_too_large") and not result["has_bundle"]
    assert result["files"] == [{"path": "big.bin", "added": None, "deleted": None}]
    # an artifact that is a link out: left out; a real one arrives
    code, job_id = run_job(fleet, 'ln -s /etc/passwd "$MAM_ARTIFACTS_DIR/passwd"\n'
                                  'echo x > "$MAM_ARTIFACTS_DIR/-rf"; echo x > "$MAM_ARTIFACTS_DIR/.profile"\n'
                                  'echo report > "$MAM_ARTIFACTS_DIR/report.txt"\n'
                                  'head -c 15000000 /dev/zero > "$MAM_ARTIFACTS_DIR/a-15mb.bin"\n'
                                  'head -c 6000000 /dev/zero > "$MAM_ARTIFACTS_DIR/b-6mb.bin"\n')
    assert code == 0
    result = result_of(fleet, job_id)
    assert result["artifacts"] == ["a-15mb.bin"]  # in name order, until the 20 MB cap
    notes = result["artifact_notes"]
    assert any("passwd" in note and "not a regular file" in note for note in notes), notes
    assert any("'-rf'" in note and "not allowed" in note for note in notes), notes
    assert any("'.profile'" in note and "not allowed" in note for note in notes), notes
    assert [n for n in notes if n.startswith("artifacts_too_large")] == [
        "artifacts_too_large: 'b-6mb.bin' left out, over 20971520 bytes in all",
        "artifacts_too_large: 'report.txt' left out, over 20971520 bytes in all"]
    hub_files = list((fleet.hub_ws / ".mam" / "artifacts").rglob("*"))
    assert not any(p.name in ("passwd", "-rf", ".profile") for p in hub_files)
    # a forged result chunk: refused and logged by the service
    chunk = {"schema_version": 1, "kind": "result", "job_id": job_id, "attempt_id": 1, "chunk": 0, "chunks": 1,
             "size": 5, "sha256": "0" * 64, "sealed": {"alg": "A256GCM", "nonce": "A" * 16,
                                                      "ciphertext": "A" * 30}, "sig": "0" * 64}
    fleet.tap.publish(names.result_topic(job_id, fleet.topic_root), json.dumps(chunk).encode())
    serve = next(p for p in fleet._procs if p.name == "serve")
    wait_until(lambda: "signature or seal does not verify" in serve.log(), PATIENCE_S, "the forged chunk refused")
    assert runner.alive()


def test_s18_a_result_in_flight_survives_a_broker_outage_byte_for_byte(repo_fleet, tmp_path: Path) -> None:
    fleet, _origin, daemon = repo_fleet
    go = tmp_path / "go"
    start_runner(fleet, daemon, sync=go)
    brief = """set -e
head -c 2000000 /dev/urandom | base64 > data.txt
head -c 5242880 /dev/urandom > "$MAM_ARTIFACTS_DIR/big.bin"
echo "all green" > "$MAM_ARTIFACTS_DIR/report.txt"
cp "$MAM_ARTIFACTS_DIR/big.bin" "$SYNC.big"
for i in $(seq 1200); do [ -e "$SYNC" ] && break; sleep 0.1; done
"""
    handle = fleet.dispatch("gpu-box", brief, "--repo", "demo", "--detach", "--heartbeat", "1",
                            "--heartbeat-misses", "120", "--ack-timeout", str(int(PATIENCE_S)))
    assert handle.wait() == 0
    job_id = handle.job_id()
    worktree = fleet.base / "ws" / "gpu-box" / "worktrees" / f"{job_id}-1"
    wait_until(lambda: (worktree / "data.txt").exists(), PATIENCE_S, "the agent to write its change")
    fleet.kill_broker()
    go.write_text("go")  # the agent ends while the broker is down: the result waits in the outbox
    outbox = fleet.base / "ws" / "gpu-box" / ".mam" / "outbox-result"
    wait_until(lambda: any(outbox.glob("*.tar")), PATIENCE_S, "the result in the runner's outbox")
    fleet.start_broker()
    ready = fleet.hub_ws / ".mam" / "results" / job_id / "1" / "change.patch"
    whole = ready.with_name("result.json")  # unpacked last: the patch and the artifacts are in (§18)
    wait_until(whole.exists, PATIENCE_S * 2, "the result at the hub after the outage")
    runner_patch = subprocess.run(["git", "diff", "--binary", "--full-index", "--no-renames",
                                   fleet.hub_record(job_id)["repo_sha"], "HEAD"],
                                  cwd=worktree, capture_output=True, check=True).stdout
    assert ready.read_bytes() == runner_patch
    artifacts = fleet.hub_ws / ".mam" / "artifacts" / job_id / "1"  # §18: both, byte for byte
    assert sorted(p.name for p in artifacts.iterdir()) == ["big.bin", "report.txt"]
    assert (artifacts / "big.bin").read_bytes() == Path(f"{go}.big").read_bytes()
    assert (artifacts / "report.txt").read_text() == "all green\n"
    wait_until(lambda: fleet.hub_record(job_id)["status"] == "completed", PATIENCE_S * 2, "the job to complete")


def test_s18_a_retry_after_a_runner_crash_starts_a_fresh_worktree(repo_fleet, tmp_path: Path) -> None:
    fleet, _origin, daemon = repo_fleet
    sync = tmp_path / "sync"
    sync.mkdir()
    runner = start_runner(fleet, daemon, sync=sync)
    brief = """set -e
echo "attempt $MAM_ATTEMPT_ID" > "attempt-$MAM_ATTEMPT_ID.txt"
if [ "$MAM_ATTEMPT_ID" = 1 ]; then touch "$SYNC/started"; sleep 600; fi
"""
    handle = fleet.dispatch("gpu-box", brief, "--repo", "demo", "--retries", "1", "--heartbeat", "1",
                            "--heartbeat-misses", "3", "--ack-timeout", str(int(PATIENCE_S)))
    wait_until((sync / "started").exists, PATIENCE_S, "attempt 1's agent to start in its worktree")
    job_id = handle.job_id()
    trees = fleet.base / "ws" / "gpu-box" / "worktrees"
    assert (trees / f"{job_id}-1" / "attempt-1.txt").exists()
    runner.kill9()  # the runner dies mid-attempt: its worktree is left behind
    wait_until(lambda: fleet.hub_record(job_id)["attempt_id"] == 2, PATIENCE_S, "the hub to retry the job")
    start_runner(fleet, daemon, "--replace", sync=sync)
    assert handle.wait(PATIENCE_S * 2) == 0, handle.log()
    assert fleet.hub_record(job_id)["status"] == "completed"
    # attempt 2 ran in a tree of its own, from the base commit: attempt 1's file is not in its change
    assert [f["path"] for f in result_of(fleet, job_id)["files"]] == ["attempt-2.txt"]
    assert result_of(fleet, job_id)["attempt_id"] == 2
    assert not (trees / f"{job_id}-1").exists()  # the crashed attempt's tree is removed at the runner's start
    assert (trees / f"{job_id}-2" / "attempt-2.txt").exists()


def test_s18_detach_then_watch_with_no_service_takes_the_result_in(tmp_path: Path) -> None:
    """With no `mam-orch serve`, the `watch` that follows a detached job is the only hub
    process: it takes the result chunks in, and waits for them after the end."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"the multi-host repository e2e needs network namespaces: {reason}")
    fleet = Fleet("netns", tmp_path)
    try:
        origin = make_origin(tmp_path / "served")
        with GitDaemon(origin.parent, host=fleet.net.address("hub"), netns=fleet.net.ns("hub")) as daemon:
            go = tmp_path / "go"
            start_runner(fleet, daemon, sync=go)
            brief = EDIT_TWO + 'for i in $(seq 1200); do [ -e "$SYNC" ] && break; sleep 0.1; done\n'
            handle = fleet.dispatch("gpu-box", brief, "--repo", "demo", "--detach", *FAST)
            assert handle.wait() == 0, handle.log()
            job_id = handle.job_id()
            watch = Proc("watch", fleet._popen("orch", [*MAM_ORCH, "watch", job_id, "--workspace",
                                                        str(fleet.hub_ws)]))
            fleet._procs.append(watch)
            wait_until(lambda: "subscribed to its events" in watch.log(), PATIENCE_S, "the watch to subscribe")
            go.write_text("go")  # the agent ends only now: its result goes to the subscribed watch
            assert watch.wait() == 0, watch.log()
            result = result_of(fleet, job_id)
            assert result["ready"] and sorted(f["path"] for f in result["files"]) == ["NOTES.md", "src/app.py"]
    finally:
        fleet.close()


IMPLEMENT = """set -e
printf 'def parse():\\n    return 1\\n' > src/parser.py
git add -A
git commit -qm "implement: parser"
"""
REVIEW = """set -e
test -f src/parser.py
git log --format=%s | grep -qx "implement: parser"
printf 'reviewed\\n' > REVIEW.md
git add -A
git commit -qm "review: notes"
"""


def test_s18_a_review_job_starts_from_the_implement_jobs_result_on_another_runner(repo_fleet, tmp_path: Path) -> None:
    """§18 "Handing a change on": B `--from-result A` runs after A, on a runner that never saw
    A's commits, in a worktree at A's head (the bundle the hub carried); B's result is the
    pipeline's change since A's base. A failed A fails B `dependency_failed`; a change too
    large to carry, or a job of no repository, is refused naming it."""
    fleet, origin, daemon = repo_fleet
    start_runner(fleet, daemon)
    fleet.start_runner("cpu-box", "bash -s", "--repo", f"demo={daemon.url('demo')}")
    implement = fleet.dispatch("gpu-box", IMPLEMENT, "--repo", "demo", *FAST)
    implement_id = implement.job_id()
    review = fleet.dispatch("cpu-box", REVIEW, "--repo", "demo", "--from-result", implement_id, *FAST)
    assert implement.wait() == 0
    assert review.wait() == 0, review.log()[-3000:]
    review_id = review.job_id()
    main = git("rev-parse", "main", cwd=origin).strip()
    head = result_of(fleet, implement_id)["head_sha"]
    started = [e for e in json.loads(fleet.orch("show", review_id, "--json").stdout)["audit"]
               if e.get("event") == "started"]
    assert started[0]["data"]["from_result"] == {"job_id": implement_id, "attempt": 1, "head_sha": head}
    result = result_of(fleet, review_id)
    assert result["base_sha"] == main and sorted(f["path"] for f in result["files"]) == ["REVIEW.md", "src/parser.py"]
    clone = tmp_path / "clone"
    git("clone", "-q", str(origin), str(clone))
    applied = fleet.orch("apply", review_id, "--repo-path", str(clone))
    assert applied.returncode == 0, applied.stderr
    assert git("log", "--format=%s", f"mam/{review_id}", cwd=clone).splitlines()[:2] == [
        "review: notes", "implement: parser"]

    failing = fleet.dispatch("gpu-box", "exit 3\n", "--repo", "demo", *FAST)
    failing_id = failing.job_id()
    after_failure = fleet.dispatch("cpu-box", REVIEW, "--repo", "demo", "--from-result", failing_id, *FAST)
    assert failing.wait() == 1 and after_failure.wait() == 1
    assert fleet.hub_record(after_failure.job_id())["close_reason"] == "dependency_failed"

    big = fleet.dispatch("gpu-box", "head -c 300000 /dev/urandom > big.bin\n", "--repo", "demo", *FAST)
    big_id = big.job_id()
    too_big = fleet.dispatch("cpu-box", REVIEW, "--repo", "demo", "--from-result", big_id, *FAST)
    assert big.wait() == 0 and too_big.wait() == 1
    assert f"job {big_id}'s change is" in too_big.log() and "a dispatch carries" in too_big.log(), too_big.log()

    plain = fleet.orch("dispatch", "--session", "cpu-box", "--brief", "true", "--repo", "demo",
                       "--from-result", "0badf00d")
    assert plain.returncode == 64 and "no job 0badf00d" in plain.stderr, plain.stderr
    no_repo = fleet.orch("dispatch", "--session", "cpu-box", "--brief", "true", "--from-result", implement_id)
    assert no_repo.returncode == 64 and "--from-result goes with --repo" in no_repo.stderr, no_repo.stderr
