"""runner/repos.py with real git (PROTOCOL §18): `--repo` parsing and ref rules, the
runner's bare mirrors (fetch, default branch, locks), one worktree per attempt, leftovers
and gc, and the result collected from a hostile worktree (commits, numstat, bundle, patch)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness.gitserver import GitDaemon, git, make_origin

from mam.runner import repos
from mam.shared.protocol.errors import UsageError

pytestmark = pytest.mark.timeout(60)

JOB, JOB2 = "0123abcd", "0123abce"


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    """A bare origin `demo.git`: `main` with two commits, a lightweight tag `v1` (see gitserver)."""
    return make_origin(tmp_path / "served")


@pytest.fixture
def mirrors(tmp_path: Path, origin: Path) -> repos.Repos:
    return repos.Repos(tmp_path / "runner", repos.parse_repos([f"demo={origin}"], None))


@pytest.fixture
def prepared(mirrors: repos.Repos) -> repos.Repos:
    mirrors.prepare("demo")
    return mirrors


def work_of(origin: Path) -> Path:
    """The developer clone `make_origin` pushed from."""
    return origin.parent / f"{origin.name[:-len('.git')]}-work"


def push_commit(origin: Path, name: str, text: str = "x\n", branch: str = "main") -> str:
    work = work_of(origin)
    (work / name).write_text(text)
    git("add", "-A", cwd=work)
    git("commit", "-qm", f"add {name}", cwd=work)
    git("push", "-q", str(origin), f"HEAD:refs/heads/{branch}", cwd=work)
    return git("rev-parse", "HEAD", cwd=work).strip()


def new_tree(mirrors: repos.Repos, job: str = JOB, attempt: int = 1, ref: str | None = None) -> repos.Worktree:
    used, sha = mirrors.resolve("demo", ref)
    return mirrors.add_worktree("demo", sha, job, attempt, used)


def collect(wt: repos.Worktree, out: Path, max_bytes: int = 10**7) -> repos.ResultSummary:
    return repos.collect_result(wt, job_id=wt.key.split("-")[0], attempt_id=int(wt.key.split("-")[1]),
                                session="gpu-box", out_dir=out, max_bytes=max_bytes)


# ------------------------------------------------------------------ parsing


@pytest.mark.parametrize("text, words", [
    ("demo", "expected NAME=URL"),
    ("=x", "name '' is invalid"),
    ("-x=/tmp/r", "name '-x' is invalid"),
    (".x=/tmp/r", "name '.x' is invalid"),
    ("../etc=/r", "name '../etc' is invalid"),
    ("a b=/r", "name 'a b' is invalid"),
    ("x" * 65 + "=/r", "is invalid"),
    ("demo=", "the URL is empty"),
    ("demo=--upload-pack=touch /tmp/pwned", "starts with '-'"),
    ("demo=-x", "starts with '-'"),
    ("demo=/tmp/a\nb", "control character"),
    ("demo=/tmp/a\x00b", "control character"),
    ("demo=/tmp/a\x1bb", "control character"),
    ("demo=" + "x" * 3000, "3000 characters, at most 2048"),
    ("demo=ext::sh -c touch% /tmp/pwned", "command transport"),
    ("demo=fd::3", "command transport"),
])
def test_a_bad_repo_item_is_refused_in_one_line(text: str, words: str) -> None:
    with pytest.raises(UsageError, match=words) as caught:
        repos.parse_repo(text)
    message = str(caught.value)
    assert message.startswith("--repo ") and "\n" not in message and len(message) < 400


def test_a_repo_item_is_split_at_the_first_equals_sign_and_its_password_never_shown() -> None:
    assert repos.parse_repo("demo=https://h.example/x?a=b") == repos.RepoSpec("demo", "https://h.example/x?a=b")
    assert repos.parse_repo("w.e_b-1=git@github.com:org/web.git").url == "git@github.com:org/web.git"
    with pytest.raises(UsageError) as caught:
        repos.parse_repo("bad name=https://bob:hunter22@h.example/x", "MAM_RUNNER_REPOS")
    assert "hunter22" not in str(caught.value) and str(caught.value).startswith("MAM_RUNNER_REPOS ")
    with pytest.raises(UsageError, match="starts with '-'"):
        repos.RepoSpec("demo", "-oProxyCommand=evil")  # constructing one checks it too


def test_flags_win_over_the_env_items_are_sorted_and_a_name_twice_or_too_many_is_refused() -> None:
    assert [s.name for s in repos.parse_repos(["web=/w", "demo=/d"], "other=/o")] == ["demo", "web"]
    assert [s.name for s in repos.parse_repos([], " b=/b, a=/a\n\tc=/c ,")] == ["a", "b", "c"]
    assert repos.parse_repos([], None) == () and repos.parse_repos([], "  ") == ()
    with pytest.raises(UsageError, match="'a' is given twice"):
        repos.parse_repos(["a=/x", "a=/y"], None)
    with pytest.raises(UsageError, match="ignoring case"):
        repos.parse_repos([], "Demo=/x demo=/y")
    with pytest.raises(UsageError, match="^MAM_RUNNER_REPOS: 33 repositories, at most 32"):
        repos.parse_repos([], ",".join(f"r{i}=/r{i}" for i in range(33)))
    with pytest.raises(UsageError, match="^MAM_RUNNER_REPOS 'nope': expected NAME=URL"):
        repos.parse_repos([], "a=/a nope")


@pytest.mark.parametrize("ref", ["main", "feature/x-1", "v1.2.3", "release_2", "abc1234", "a" * 40, "ü-branch"])
def test_good_refs_pass(ref: str) -> None:
    assert repos.validate_ref(ref) == ref


@pytest.mark.parametrize("ref", [
    "", "-x", "--upload-pack=evil", "a..b", "a\nb", "a b", "a\tb", "x" * 256, "a~1", "a^", "a:b", "a?", "a*",
    "a[1", "a\\b", "x.lock", "a/b.lock/c", "x/", "/x", ".hidden", "a/.b", "a//b", "a@{1}", "@", "a.", "a\x7fb",
    "a\u2028b", "a\u00a0b",
])
def test_hostile_or_malformed_refs_are_refused_in_one_line(ref: str) -> None:
    with pytest.raises(UsageError, match="^ref ") as caught:
        repos.validate_ref(ref)
    assert "\n" not in str(caught.value) and "\u2028" not in str(caught.value) and len(str(caught.value)) < 200


def test_mask_url_hides_passwords_and_tokens_but_keeps_ssh_logins() -> None:
    assert repos.mask_url("https://bob:hunter22@git.example/x") == "https://bob:***@git.example/x"
    assert repos.mask_url("https://ghp_TOKEN@github.com/o/r.git") == "https://***@github.com/o/r.git"
    assert repos.mask_url("ssh://git@host/x.git") == "ssh://git@host/x.git"
    assert repos.mask_url("fatal: unable to access 'https://u:p@h/x/': refused") == \
        "fatal: unable to access 'https://u:***@h/x/': refused"
    assert repos.mask_url("/srv/git/x.git") == "/srv/git/x.git"


# ------------------------------------------------------------------ mirrors


def test_prepare_creates_the_mirror_and_the_next_prepare_fetches_a_new_commit(
        mirrors: repos.Repos, origin: Path) -> None:
    mirror = mirrors.prepare("demo")
    assert mirror == mirrors.root / "repos" / "demo.git" and (mirror / "HEAD").is_file()
    main = git("rev-parse", "main", cwd=origin).strip()
    assert mirrors.resolve("demo", "main") == ("main", main)
    assert git("for-each-ref", "--format=%(refname)", "refs/heads", cwd=mirror) == ""  # remote branches: origin/*
    newer = push_commit(origin, "NEW")
    assert mirrors.resolve("demo", "main")[1] == main  # not fetched yet
    assert mirrors.prepare("demo") == mirror
    assert mirrors.resolve("demo", "main") == ("main", newer) != ("main", main)


def test_the_mirror_config_holds_no_url_and_nothing_an_agent_wrote_survives_a_prepare(
        tmp_path: Path, origin: Path) -> None:
    served = repos.Repos(tmp_path / "r", [repos.RepoSpec("demo", str(origin))])
    mirror = served.prepare("demo")
    assert str(origin) not in (mirror / "config").read_text()
    # from its worktree an agent writes the shared config and moves / plants tags
    git("config", "core.sshCommand", "touch /tmp/pwned;", cwd=mirror)
    git("config", "remote.origin.url", str(tmp_path / "evil.git"), cwd=mirror)
    first = git("rev-parse", "refs/remotes/origin/main~1", cwd=mirror).strip()
    git("update-ref", "refs/tags/v1", first, cwd=mirror)
    git("update-ref", "refs/tags/planted", first, cwd=mirror)
    served.prepare("demo")
    config = (mirror / "config").read_text()
    assert "sshCommand" not in config and "evil" not in config and "+refs/heads/*:refs/remotes/origin/*" in config
    assert served.resolve("demo", "v1")[1] == git("rev-parse", "v1^{commit}", cwd=origin).strip()
    with pytest.raises(repos.RepoError, match="no branch, tag or commit 'planted'"):
        served.resolve("demo", "planted")


def test_resolve_a_default_branch_a_branch_a_tag_a_sha_and_a_missing_ref(prepared: repos.Repos, origin: Path) -> None:
    work = work_of(origin)
    git("tag", "-a", "v2", "-m", "annotated", "main~1", cwd=work)
    git("push", "-q", str(origin), "v2", cwd=work)
    side = push_commit(origin, "SIDE", branch="feature/side")
    prepared.prepare("demo")
    main = git("rev-parse", "main", cwd=origin).strip()
    first = git("rev-parse", "main~1", cwd=origin).strip()
    assert prepared.resolve("demo", None) == ("main", main)
    assert prepared.default_branch("demo") == "main"
    assert prepared.resolve("demo", "main") == ("main", main)
    assert prepared.resolve("demo", "feature/side") == ("feature/side", side)
    assert prepared.resolve("demo", "v1") == ("v1", main)
    assert prepared.resolve("demo", "v2") == ("v2", first)  # annotated: peeled to its commit
    assert prepared.resolve("demo", first[:10]) == (first[:10], first)
    assert prepared.resolve("demo", first) == (first, first)
    with pytest.raises(repos.RepoError, match="^repo demo has no branch, tag or commit 'nope'$"):
        prepared.resolve("demo", "nope")
    with pytest.raises(repos.RepoError, match="no branch, tag or commit 'deadbeef'"):
        prepared.resolve("demo", "deadbeef")
    with pytest.raises(UsageError, match="^ref '--upload-pack=x'"):
        prepared.resolve("demo", "--upload-pack=x")
    with pytest.raises(repos.RepoError, match="^repo 'web' is not served by this runner \\(it serves: demo\\)"):
        prepared.resolve("web", "main")


def test_the_default_branch_is_what_the_remote_names_now(tmp_path: Path, origin: Path) -> None:
    trunk = push_commit(origin, "TRUNK", branch="trunk")
    git("symbolic-ref", "HEAD", "refs/heads/trunk", cwd=origin)
    served = repos.Repos(tmp_path / "r", [repos.RepoSpec("demo", str(origin))])
    with pytest.raises(repos.RepoError, match="repo demo is not prepared"):
        served.resolve("demo", None)
    served.prepare("demo")
    assert served.resolve("demo", None) == ("trunk", trunk)
    git("symbolic-ref", "HEAD", "refs/heads/main", cwd=origin)  # the remote renames its default branch
    served.prepare("demo")
    assert served.resolve("demo", None)[0] == "main"
    # a new process knows it from the mirror without fetching
    again = repos.Repos(tmp_path / "r", [repos.RepoSpec("demo", str(origin))])
    assert again.resolve("demo", None)[0] == "main"


def test_two_attempts_preparing_one_repo_at_once_both_succeed(mirrors: repos.Repos) -> None:
    errors: list[BaseException] = []

    def prepare() -> None:
        try:
            mirrors.prepare("demo")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=prepare) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == [] and mirrors.resolve("demo", "main")[1]


def test_another_process_holding_the_repo_lock_makes_prepare_wait_then_fail_busy(
        tmp_path: Path, origin: Path) -> None:
    served = repos.Repos(tmp_path / "r", [repos.RepoSpec("demo", str(origin))], timeout_s=0.3)
    (tmp_path / "r" / "repos").mkdir(parents=True)
    lock = tmp_path / "r" / "repos" / "demo.lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\nsys.stdin.read()\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        started = time.monotonic()
        with pytest.raises(repos.RepoError, match="^repo demo: busy: another runner process held"):
            served.prepare("demo")
        assert time.monotonic() - started >= 0.3
    finally:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.wait(30)
        holder.stdout.close()
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after prepare failed
    finally:
        os.close(fd)
    served.prepare("demo")


def test_a_fetch_that_hangs_is_killed_at_the_timeout(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"git://127.0.0.1:{silent.getsockname()[1]}/demo.git"
        served = repos.Repos(tmp_path / "r", [repos.RepoSpec("demo", url)], timeout_s=1.0)
        started = time.monotonic()
        with pytest.raises(repos.RepoError, match=f"^repo demo: fetch from {url} failed: git timed out after 1 s$"):
            served.prepare("demo")
        assert time.monotonic() - started < 30


def test_a_failed_fetch_names_the_repo_and_url_without_the_password(tmp_path: Path) -> None:
    served = repos.Repos(tmp_path / "r", [repos.RepoSpec("x", "https://bob:hunter22@127.0.0.1:9/x.git")])
    with pytest.raises(repos.RepoError) as caught:
        served.prepare("x")
    message = str(caught.value)
    assert message.startswith("repo x: fetch from https://bob:***@127.0.0.1:9/x.git failed: ")
    assert "hunter22" not in message and "\n" not in message
    assert "hunter22" not in (tmp_path / "r" / "repos" / "x.git" / "config").read_text()


def test_a_repo_served_over_a_real_git_daemon(tmp_path: Path, origin: Path) -> None:
    with GitDaemon(origin.parent) as daemon:
        served = repos.Repos(tmp_path / "r", [repos.RepoSpec("demo", daemon.url("demo"))])
        served.prepare("demo")
        assert served.resolve("demo", None) == ("main", git("rev-parse", "main", cwd=origin).strip())
        newer = push_commit(origin, "OVER-THE-WIRE")
        served.prepare("demo")
        assert served.resolve("demo", "main")[1] == newer
        url = daemon.url("demo")
    with pytest.raises(repos.RepoError, match=f"^repo demo: fetch from {url} failed: "):
        served.prepare("demo")  # the daemon is gone: one line naming the URL


# ------------------------------------------------------------------ worktrees


def test_two_jobs_get_two_trees_on_their_own_branches_that_never_see_each_other(prepared: repos.Repos) -> None:
    one = new_tree(prepared, JOB)
    two = new_tree(prepared, JOB2)
    assert one.path == prepared.root / "worktrees" / f"{JOB}-1" and one.branch == f"mam/{JOB}-1"
    assert one.ref == "main" and one.base_sha == two.base_sha
    (one.path / "mine.txt").write_text("one\n")
    (two.path / "README.md").write_text("two's edit\n")
    assert not (two.path / "mine.txt").exists()
    assert (one.path / "README.md").read_text() == "# demo\n"
    assert git("rev-parse", "--abbrev-ref", "HEAD", cwd=one.path).strip() == f"mam/{JOB}-1"
    assert git("rev-parse", "--abbrev-ref", "HEAD", cwd=two.path).strip() == f"mam/{JOB2}-1"
    assert prepared.leftovers() == sorted([one.path, two.path])
    with pytest.raises(UsageError, match="job id"):
        prepared.add_worktree("demo", one.base_sha, "../../etc", 1, "main")
    with pytest.raises(UsageError, match="attempt id"):
        prepared.add_worktree("demo", one.base_sha, JOB, 0, "main")
    with pytest.raises(UsageError, match="commit"):
        prepared.add_worktree("demo", "--orphan", JOB, 3, "main")


def test_a_crash_leftover_of_the_same_attempt_is_replaced_by_a_fresh_tree(prepared: repos.Repos) -> None:
    crashed = new_tree(prepared)
    (crashed.path / "half-done.txt").write_text("x\n")
    git("add", "-A", cwd=crashed.path)
    git("commit", "-qm", "half", cwd=crashed.path)
    git("worktree", "lock", str(crashed.path), cwd=crashed.path)  # even a locked one
    again = new_tree(prepared)
    assert again.path == crashed.path and not (again.path / "half-done.txt").exists()
    assert git("rev-parse", again.branch, cwd=again.path).strip() == again.base_sha  # the branch starts anew
    # a plain folder of that name (no registration), and a registration without its folder
    prepared.remove_worktree(again)
    again.path.mkdir(parents=True)
    (again.path / "junk").write_text("x")
    assert new_tree(prepared).path == again.path and not (again.path / "junk").exists()
    os.rename(again.path, again.path.with_name("moved-away"))
    fresh = new_tree(prepared)
    assert (fresh.path / "README.md").is_file()
    listing = git("worktree", "list", "--porcelain", cwd=prepared.mirror_path("demo"))
    assert listing.count(f"{JOB}-1") == 2  # one registration: its path and its branch


def test_remove_worktree_survives_a_replaced_git_file_and_never_follows_a_link(
        prepared: repos.Repos, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious\n")
    wt = new_tree(prepared)
    (wt.path / "escape").symlink_to(outside)
    (wt.path / ".git").unlink()
    git("init", "-q", str(wt.path))  # the agent replaced .git with a repository of its own
    prepared.remove_worktree(wt)
    assert not os.path.lexists(wt.path) and (outside / "keep.txt").read_text() == "precious\n"
    assert f"{JOB}-1" not in git("worktree", "list", cwd=prepared.mirror_path("demo"))
    assert git("rev-parse", "--verify", "--quiet", f"refs/heads/{wt.branch}", cwd=prepared.mirror_path("demo"))
    prepared.remove_worktree(wt, delete_branch=True)  # already gone: no error, the branch goes
    assert git("for-each-ref", "refs/heads", cwd=prepared.mirror_path("demo")) == ""


def test_leftovers_are_removed_at_start_unless_kept_and_active_or_finished_ones_stay(prepared: repos.Repos) -> None:
    crashed = new_tree(prepared, JOB)
    running = new_tree(prepared, JOB, 2)
    done = new_tree(prepared, JOB2)
    prepared.finish(done)
    assert prepared.leftovers() == sorted([crashed.path, running.path, done.path])  # markers are not trees
    assert prepared.remove_leftovers(keep=True, active=[running.key]) == [] and crashed.path.exists()
    assert prepared.remove_leftovers(active=[running.key]) == [crashed.path]
    assert not crashed.path.exists() and running.path.exists() and done.path.exists()
    assert f"{JOB}-1" not in git("worktree", "list", cwd=prepared.mirror_path("demo"))


def test_gc_removes_finished_trees_after_the_ttl_with_their_branches(prepared: repos.Repos, tmp_path: Path) -> None:
    old = new_tree(prepared, JOB)
    young = new_tree(prepared, JOB2)
    kept = new_tree(prepared, JOB, 2)
    for wt in (old, young, kept):
        prepared.finish(wt)
    marker = prepared.worktrees_dir / f"{old.key}.finished"
    assert json.loads(marker.read_text())["repo"] == "demo" and not (old.path / ".mam-finished").exists()
    long_ago = time.time() - 7200
    for wt in (old, kept):
        os.utime(prepared.worktrees_dir / f"{wt.key}.finished", (long_ago, long_ago))
    assert prepared.gc(ttl_s=3600, active=[kept.key]) == [old.path]
    assert not old.path.exists() and not marker.exists() and young.path.exists() and kept.path.exists()
    mirror = prepared.mirror_path("demo")
    assert f"refs/heads/{old.branch}" not in git("for-each-ref", "--format=%(refname)", cwd=mirror)
    # `mam-runner gc`: a Repos serving nothing still cleans every mirror's finished trees
    assert repos.Repos(prepared.root, []).gc(ttl_s=0) == sorted([young.path, kept.path])
    assert prepared.leftovers() == [] and "worktrees/" not in git("worktree", "list", cwd=mirror)


# ------------------------------------------------------------------ results


def test_the_result_keeps_the_agents_commits_and_commits_the_rest_as_mam_runner(
        prepared: repos.Repos, origin: Path, tmp_path: Path) -> None:
    wt = new_tree(prepared)
    (wt.path / "src" / "app.py").write_text("print('bye')\nprint('again')\n")
    subprocess.run(["git", "-c", "user.name=Agent Smith", "-c", "user.email=smith@matrix.invalid", "commit", "-qam",
                    "agent: say bye"], cwd=wt.path, check=True, timeout=60)
    (wt.path / "README.md").unlink()  # uncommitted: a deletion, a new file, a binary file
    (wt.path / "notes.txt").write_text("a\nb\nc\n")
    (wt.path / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    summary = collect(wt, tmp_path / "out")
    assert summary.commits_total == 2 and summary.note is None and summary.ref == "main"
    ours, agents = summary.commits
    assert ours["author"] == "mam-runner <mam-runner@gpu-box>"
    assert ours["subject"] == f"mam: uncommitted changes of job {JOB} attempt 1"
    assert agents == {"sha": git("rev-parse", "HEAD~1", cwd=wt.path).strip(), "author":
                      "Agent Smith <smith@matrix.invalid>", "subject": "agent: say bye"}
    assert git("log", "-1", "--format=%cn <%ce>", cwd=wt.path).strip() == "mam-runner <mam-runner@gpu-box>"
    assert summary.head_sha == git("rev-parse", wt.branch, cwd=wt.path).strip() == ours["sha"]
    assert sorted(summary.files, key=lambda f: f["path"]) == [
        {"path": "README.md", "added": 0, "deleted": 1}, {"path": "blob.bin", "added": None, "deleted": None},
        {"path": "notes.txt", "added": 3, "deleted": 0}, {"path": "src/app.py", "added": 2, "deleted": 1}]
    assert (summary.files_total, summary.insertions, summary.deletions) == (4, 5, 2)
    assert summary.bundle == tmp_path / "out" / "change.bundle" and summary.patch == tmp_path / "out" / "change.patch"
    assert json.loads(json.dumps(summary.to_dict()))["bundle"] == "change.bundle"
    assert summary.to_dict()["patch"] == "change.patch" and summary.to_dict()["commits_total"] == 2

    clone = tmp_path / "clone"  # a developer's clone that has the base commit
    git("clone", "-q", str(origin), str(clone))
    assert "is okay" in subprocess.run(["git", "bundle", "verify", str(summary.bundle)], cwd=clone, check=True,
                                       capture_output=True, text=True, timeout=60).stderr
    git("fetch", "-q", str(summary.bundle), f"{wt.branch}:refs/heads/result", cwd=clone)
    assert git("rev-parse", "result", cwd=clone).strip() == summary.head_sha
    git("checkout", "-q", "--detach", summary.base_sha, cwd=clone)
    git("apply", "--index", str(summary.patch), cwd=clone)
    assert git("write-tree", cwd=clone).strip() == git("rev-parse", f"{summary.head_sha}^{{tree}}", cwd=clone).strip()


def test_no_change_says_no_changes_and_writes_no_files(prepared: repos.Repos, tmp_path: Path) -> None:
    wt = new_tree(prepared)
    summary = collect(wt, tmp_path / "out")
    assert (summary.note, summary.head_sha, summary.commits_total, summary.files_total) == \
        ("no_changes", wt.base_sha, 0, 0)
    assert summary.bundle is None and summary.patch is None and list((tmp_path / "out").glob("*")) == []
    assert summary.to_dict()["bundle"] is None


def test_a_change_over_the_cap_is_left_out_and_the_summary_says_by_how_much(
        prepared: repos.Repos, tmp_path: Path) -> None:
    wt = new_tree(prepared)
    (wt.path / "big.bin").write_bytes(os.urandom(200_000))
    summary = collect(wt, tmp_path / "out", max_bytes=10_000)
    assert summary.note is not None
    total = int(summary.note.split()[1])
    assert summary.note == f"result_too_large: {total} bytes over the 10000-byte cap" and total > 400_000
    assert summary.bundle is None and summary.patch is None and list((tmp_path / "out").iterdir()) == []
    assert summary.files == ({"path": "big.bin", "added": None, "deleted": None},) and summary.commits_total == 1
    # the same change under a cap that holds it: both files, their sizes add up to that total
    again = collect(wt, tmp_path / "out2", max_bytes=total)
    assert again.note is None and again.bundle and again.patch
    assert again.bundle.stat().st_size + again.patch.stat().st_size == total


def test_hostile_file_names_come_back_exactly(prepared: repos.Repos, tmp_path: Path) -> None:
    wt = new_tree(prepared)
    names = ["new\nline.txt", 'quo"te\'s.txt', "tab\there.txt", " lead space", "ünï.txt", "-rf"]
    for name in names:
        (wt.path / name).write_text("x\n")
    (wt.path / os.fsdecode(b"bad\xffbyte")).write_text("x\n")
    summary = collect(wt, tmp_path / "out")
    assert sorted(f["path"] for f in summary.files) == sorted([*names, "bad\\xffbyte"])
    assert all(f["added"] == 1 for f in summary.files)
    json.dumps(summary.to_dict(), ensure_ascii=False).encode("utf-8")  # JSON- and UTF-8-safe


def test_the_agent_cannot_run_code_through_hooks_filters_or_fsmonitor_at_collection(
        prepared: repos.Repos, tmp_path: Path) -> None:
    wt = new_tree(prepared)
    pwned = tmp_path / "pwned"
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for hook in ("pre-commit", "commit-msg", "post-commit", "reference-transaction"):
        (hooks / hook).write_text(f"#!/bin/sh\necho {hook} >> {pwned}\n")
        (hooks / hook).chmod(0o755)
    (tmp_path / "fsmon").write_text(f"#!/bin/sh\necho fsmonitor >> {pwned}\n")
    (tmp_path / "fsmon").chmod(0o755)
    for key, value in (("core.hooksPath", str(hooks)), ("filter.evil.clean", f"sh -c 'echo clean >> {pwned}; cat'"),
                       ("filter.evil.required", "true"), ("core.fsmonitor", str(tmp_path / "fsmon"))):
        git("config", key, value, cwd=wt.path)  # the shared config of the mirror, from the worktree
    (wt.path / ".gitattributes").write_text("* filter=evil\n")
    (wt.path / "f.txt").write_text("data\n")
    summary = collect(wt, tmp_path / "out")
    assert not pwned.exists() and summary.commits_total == 1 and summary.files_total == 2


def test_a_removed_or_replaced_git_file_does_not_hide_the_change(prepared: repos.Repos, tmp_path: Path) -> None:
    wt = new_tree(prepared)
    (wt.path / "work.txt").write_text("done\n")
    (wt.path / ".git").unlink()
    git("init", "-q", str(wt.path))  # `rm .git && git init`: a confused agent
    git("add", "-A", cwd=wt.path)
    git("commit", "-qm", "in the agent's own repository", cwd=wt.path)
    summary = collect(wt, tmp_path / "out")
    assert summary.commits_total == 1 and [f["path"] for f in summary.files] == ["work.txt"]
    assert summary.commits[0]["author"] == "mam-runner <mam-runner@gpu-box>"


def test_an_agent_that_moved_to_another_branch_still_brings_its_commits(prepared: repos.Repos, tmp_path: Path) -> None:
    wt = new_tree(prepared)
    git("checkout", "-q", "-b", "feature", cwd=wt.path)
    (wt.path / "feature.txt").write_text("f\n")
    git("add", "-A", cwd=wt.path)
    git("commit", "-qm", "feature", cwd=wt.path)
    summary = collect(wt, tmp_path / "out")
    mirror = prepared.mirror_path("demo")
    assert summary.commits_total == 1 and summary.head_sha == git("rev-parse", wt.branch, cwd=mirror).strip()
    assert summary.bundle is not None and wt.branch in git("bundle", "list-heads", str(summary.bundle), cwd=mirror)


def test_collect_result_refuses_a_tree_that_is_not_registered(prepared: repos.Repos, tmp_path: Path) -> None:
    wt = new_tree(prepared)
    prepared.remove_worktree(wt)
    with pytest.raises(repos.RepoError, match=f"^repo demo: collecting the result of {JOB}-1 failed: .* is not a "
                                              "worktree of"):
        collect(wt, tmp_path / "out")
    with pytest.raises(UsageError, match="session name"):
        repos.collect_result(wt, job_id=JOB, attempt_id=1, session="a b", out_dir=tmp_path, max_bytes=1)


# ------------------------------------------------------------------ with the modules around it


def test_the_bundle_applies_at_the_hub_into_a_clean_clone(prepared: repos.Repos, origin: Path, tmp_path: Path) -> None:
    from mam.orchestrator.results import apply_result
    from mam.shared.store.registry import Registry

    wt = new_tree(prepared)
    (wt.path / "src" / "app.py").write_text("print('bye')\n")
    git("commit", "-qam", "agent: say bye", cwd=wt.path)
    (wt.path / "left.txt").write_text("uncommitted\n")
    summary = collect(wt, tmp_path / "out")
    assert summary.bundle is not None
    hub = Registry(tmp_path / "hub")
    job_id = hub.register(session="gpu-box")["job_id"]
    folder = tmp_path / "hub" / ".mam" / "results" / job_id / "1"
    folder.mkdir(parents=True)
    (folder / "change.bundle").write_bytes(summary.bundle.read_bytes())
    (folder / "result.json").write_text(json.dumps({**summary.to_dict(), "branch": wt.branch}))
    clone = tmp_path / "clone"
    git("clone", "-q", str(origin), str(clone))
    (clone / "README.md").write_text("dirty\n")
    with pytest.raises(UsageError, match="uncommitted changes"):
        apply_result(hub, job_id, clone)
    git("checkout", "-q", "README.md", cwd=clone)
    assert apply_result(hub, job_id, clone) == summary.head_sha
    assert git("rev-parse", f"mam/{job_id}^{{tree}}", cwd=clone) == git("rev-parse", "HEAD^{tree}", cwd=wt.path)
    assert apply_result(hub, job_id, clone) == summary.head_sha  # again: the same branch, fine


def test_artifacts_travel_only_as_regular_files_with_safe_names(tmp_path: Path) -> None:
    work = pytest.importorskip("mam.runner.work", exc_type=ImportError)
    folder = tmp_path / "artifacts"
    folder.mkdir()
    (folder / "report.txt").write_text("ok\n")
    (folder / ".hidden").write_text("x")
    (folder / "passwd").symlink_to("/etc/passwd")
    (folder / "sub").mkdir()
    found, notes = work.collect_artifacts(folder)
    assert list(found) == ["report.txt"]
    assert len(notes) == 3 and any("passwd" in note and "not a regular file" in note for note in notes)
    link = tmp_path / "link"
    link.symlink_to(folder)
    assert work.collect_artifacts(link) == ({}, ["artifacts folder left out: not a folder"])


def test_artifacts_over_the_cap_keep_the_first_ones_and_say_artifacts_too_large(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mam.runner import work

    monkeypatch.setattr(work, "MAX_ARTIFACTS_BYTES", 1000)
    folder = tmp_path / "artifacts"
    folder.mkdir()
    for name, size in (("a.log", 400), ("b.log", 500), ("c.log", 200), ("d.log", 50)):
        (folder / name).write_bytes(b"x" * size)
    found, notes = work.collect_artifacts(folder)
    assert list(found) == ["a.log", "b.log"]
    assert notes == [f"artifacts_too_large: '{name}' left out, over 1000 bytes in all" for name in ("c.log", "d.log")]


def test_s18_an_agent_on_a_host_without_a_git_identity_commits_as_the_runner(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    git("init", "-q", str(tree))
    bare = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_CONFIG_NOSYSTEM": "1"}
    assert not repos.has_identity(tree, bare)  # a fresh worker host: `git commit` would fail
    configured = {**bare, "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "user.email", "GIT_CONFIG_VALUE_0": "me@x"}
    assert repos.has_identity(tree, configured)  # the operator's identity is kept
    ident = repos.runner_identity("gpu-box")
    assert repos.has_identity(tree, {**bare, **ident})
    (tree / "f").write_text("x\n")
    subprocess.run(["git", "add", "f"], cwd=tree, env=bare, check=True)
    done = subprocess.run(["git", "commit", "-qm", "agent"], cwd=tree, env={**bare, **ident}, capture_output=True)
    assert done.returncode == 0, done.stderr
    assert git("log", "-1", "--format=%an <%ae>", cwd=tree).strip() == "mam-runner <mam-runner@gpu-box>"
