"""A change handed on (PROTOCOL §18 "Handing a change on", `dispatch --from-result`): the
wire's `work.base` (malformed, oversized and hostile ones refused), the bundle's seal bound
to one attempt, the hub choosing the base from a result (or saying why it cannot), and the
runner's mirror taking a carried bundle with real git (garbage and foreign bundles refused)."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.gitserver import git, make_origin

from mam.orchestrator.dependencies import check, result_base
from mam.runner import repos
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import DecodeError, SignatureError, UsageError
from mam.shared.store.records import QueueTerms
from mam.shared.store.registry import Registry

pytestmark = pytest.mark.timeout(60)

A, B = "aaaaaaa1", "bbbbbbb2"
BASE, HEAD = "1" * 40, "2" * 40
SEALED = {"alg": "A256GCM", "nonce": "A" * 16, "ciphertext": "A" * 40}


def test_s18_a_base_travels_in_the_work_and_comes_back_equal() -> None:
    work = wire.Work.from_dict({"repo": "demo", "base": {"job_id": A, "attempt": 2, "base_sha": BASE,
                                                         "head_sha": HEAD, "bundle": SEALED}})
    assert work.base == wire.Base(A, 2, BASE, HEAD, SEALED)
    assert wire.Work.from_dict(work.to_dict()) == work


@pytest.mark.parametrize(("bad", "words"), [
    ({"repo": "demo", "base": "x"}, "must be an object"),
    ({"base": {"job_id": A, "attempt": 1, "base_sha": BASE, "head_sha": HEAD}}, "base is only allowed with repo"),
    ({"repo": "demo", "base": {"job_id": "../x", "attempt": 1, "base_sha": BASE, "head_sha": HEAD}}, "job id"),
    ({"repo": "demo", "base": {"job_id": A, "attempt": 0, "base_sha": BASE, "head_sha": HEAD}}, "attempt id 0"),
    ({"repo": "demo", "base": {"job_id": A, "attempt": 1, "base_sha": BASE, "head_sha": "HEAD~1"}}, "head_sha"),
    ({"repo": "demo", "base": {"job_id": A, "attempt": 1, "base_sha": BASE}}, "needs head_sha"),
    ({"repo": "demo", "base": {"job_id": A, "attempt": 1, "base_sha": BASE, "head_sha": HEAD, "url": "x"}},
     "unknown field"),
    ({"repo": "demo", "base": {"job_id": A, "attempt": 1, "base_sha": BASE, "head_sha": HEAD,
                               "bundle": {**SEALED, "ciphertext": "A" * (wire.MAX_BUNDLE_SEALED_CHARS + 4)}}},
     "base.bundle"),
    ({"repo": "demo", "base": {"job_id": A, "attempt": 1, "base_sha": BASE, "head_sha": HEAD, "bundle": "plain"}},
     "base.bundle"),
])
def test_s18_a_bad_base_is_refused_in_one_line(bad: dict[str, object], words: str) -> None:
    with pytest.raises(DecodeError) as caught:
        wire.Work.from_dict(bad)
    assert words in caught.value.reason and "\n" not in caught.value.reason


def test_s18_a_carried_bundle_opens_only_for_its_attempt_job_and_head() -> None:
    sealed = crypto.seal_bundle("token-1", b"bundle", job_id=B, attempt_id=1, from_job=A, head_sha=HEAD)
    assert crypto.open_bundle("token-1", sealed, job_id=B, attempt_id=1, from_job=A, head_sha=HEAD) == b"bundle"
    for token, attempt, source, head in (("token-2", 1, A, HEAD), ("token-1", 2, A, HEAD), ("token-1", 1, B, HEAD),
                                         ("token-1", 1, A, BASE)):
        with pytest.raises(SignatureError):
            crypto.open_bundle(token, sealed, job_id=B, attempt_id=attempt, from_job=source, head_sha=head)


def _result(reg: Registry, job_id: str, summary: str | None, bundle: bytes | None = None) -> None:
    folder = names.hub_result_dir(reg.root, job_id, 1)
    folder.mkdir(parents=True)
    if bundle is not None:
        (folder / "change.bundle").write_bytes(bundle)
    if summary is not None:
        (folder / "result.json").write_text(summary)


def _repo_job(reg: Registry, repo: str | None = "demo") -> str:
    return reg.register(session=None, queue=QueueTerms(target_session="gpu-box"),
                        work=wire.Work(repo=repo) if repo else None)["job_id"]


def test_s18_the_base_is_the_results_head_or_the_reason_it_cannot_be_handed_on(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    good, same, none, big, linked, broken = (_repo_job(reg) for _ in range(6))
    _result(reg, good, f'{{"base_sha": "{BASE}", "head_sha": "{HEAD}"}}', b"small")
    assert result_base(reg, good) == ({"job_id": good, "attempt": 1, "base_sha": BASE, "head_sha": HEAD}, None)
    _result(reg, same, f'{{"base_sha": "{BASE}", "head_sha": "{BASE}", "note": "no_changes"}}')
    assert result_base(reg, same)[0] == {"job_id": same, "attempt": 1, "base_sha": BASE, "head_sha": BASE}
    assert result_base(reg, none) == (None, f"job {none} sent no result to start from")
    _result(reg, big, f'{{"base_sha": "{BASE}", "head_sha": "{HEAD}"}}', b"x" * (wire.MAX_CARRIED_BUNDLE_BYTES + 1))
    assert "a dispatch carries" in str(result_base(reg, big)[1])
    _result(reg, linked, f'{{"base_sha": "{BASE}", "head_sha": "{HEAD}", "note": "result_too_large"}}')
    assert result_base(reg, linked) == (None, f"job {linked}'s result has no bundle to start from (result_too_large)")
    _result(reg, broken, '{"base_sha": "HEAD", "head_sha": "../../etc"}')
    assert result_base(reg, broken) == (None, f"job {broken}'s result names no commit to start from")


def test_s18_from_result_needs_the_same_repository_and_is_added_to_after(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    demo, other, plain = _repo_job(reg), _repo_job(reg, "other"), _repo_job(reg, None)
    terms = QueueTerms(target_session="gpu-box", from_result=demo).checked()
    assert terms.after == (demo,)
    check(reg, terms, wire.Work(repo="demo"))
    with pytest.raises(UsageError, match="--from-result goes with --repo"):
        check(reg, terms, None)
    for source, words in ((other, "that job worked on repo other, this one on repo demo"),
                          (plain, "that job worked on no repository")):
        with pytest.raises(UsageError, match=words):
            check(reg, QueueTerms(target_session="gpu-box", from_result=source).checked(), wire.Work(repo="demo"))
    with pytest.raises(UsageError, match="--from-result '../etc' is invalid"):
        QueueTerms(target_session="gpu-box", from_result="../etc").checked()


@pytest.fixture
def mirrors(tmp_path: Path) -> tuple[repos.Repos, Path]:
    origin = make_origin(tmp_path / "served")
    mirror = repos.Repos(tmp_path / "runner", repos.parse_repos([f"demo={origin}"], None))
    mirror.prepare("demo")
    return mirror, origin


def _bundle_of_a_new_commit(tmp_path: Path, origin: Path) -> tuple[bytes, str, str]:
    """A commit made in a clone and never pushed, as a result's bundle (base..head)."""
    clone = tmp_path / "elsewhere"
    git("clone", "-q", str(origin), str(clone))
    base = git("rev-parse", "HEAD", cwd=clone).strip()
    (clone / "parser.py").write_text("x = 1\n")
    git("add", "-A", cwd=clone)
    git("-c", "user.name=a", "-c", "user.email=a@b", "commit", "-qm", "implement", cwd=clone)
    git("branch", "mam/aaaaaaa1-1", cwd=clone)
    head = git("rev-parse", "HEAD", cwd=clone).strip()
    out = tmp_path / "change.bundle"
    git("bundle", "create", "-q", str(out), "refs/heads/mam/aaaaaaa1-1", f"^{base}", cwd=clone)
    return out.read_bytes(), base, head


def test_s18_the_mirror_takes_a_carried_bundle_and_a_worktree_starts_at_its_head(mirrors, tmp_path: Path) -> None:
    mirror, origin = mirrors
    data, base, head = _bundle_of_a_new_commit(tmp_path, origin)
    with pytest.raises(repos.RepoError, match="is not in the mirror and no bundle came with it"):
        mirror.take_change("demo", None, head, "aaaaaaa1-1")
    mirror.take_change("demo", data, head, "aaaaaaa1-1")
    mirror.take_change("demo", None, head, "aaaaaaa1-1")  # now it has it: nothing to carry
    tree = mirror.add_worktree("demo", head, B, 1, "main", base_sha=base)
    assert (tree.path / "parser.py").read_text() == "x = 1\n" and tree.base_sha == base
    mirror.prepare("demo")  # a fetch from the remote prunes nothing handed on
    assert git("--git-dir", str(mirror.mirror_path("demo")), "cat-file", "-t", head).strip() == "commit"


def test_s18_a_garbage_or_foreign_bundle_is_refused_in_one_line(mirrors, tmp_path: Path) -> None:
    mirror, origin = mirrors
    data, _base, head = _bundle_of_a_new_commit(tmp_path, origin)
    for bad, words in ((b"not a bundle\n" * 10, "git bundle verify"), (data, "does not hold commit")):
        wanted = head if bad is not data else "3" * 40
        with pytest.raises(repos.RepoError) as caught:
            mirror.take_change("demo", bad, wanted, "aaaaaaa1-1")
        assert words in str(caught.value) and "\n" not in str(caught.value)
    foreign_work = tmp_path / "foreign"  # a bundle whose base this mirror never saw
    git("init", "-q", "-b", "main", str(foreign_work))
    for text in ("unrelated history\n", "more of it\n"):
        (foreign_work / "OTHER.md").write_text(text)
        git("add", "-A", cwd=foreign_work)
        git("-c", "user.name=a", "-c", "user.email=a@b", "commit", "-qm", text.strip(), cwd=foreign_work)
    git("branch", "mam/aaaaaaa1-1", cwd=foreign_work)
    foreign_head = git("rev-parse", "HEAD", cwd=foreign_work).strip()
    git("bundle", "create", "-q", str(tmp_path / "foreign.bundle"), "refs/heads/mam/aaaaaaa1-1", "^HEAD~1",
        cwd=foreign_work)
    foreign = (tmp_path / "foreign.bundle").read_bytes()
    with pytest.raises(repos.RepoError, match="git bundle verify"):
        mirror.take_change("demo", foreign, foreign_head, "aaaaaaa1-1")
    with pytest.raises(UsageError, match="source"):
        mirror.take_change("demo", data, head, "../../x")
