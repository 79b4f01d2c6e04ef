"""PROTOCOL §18 above the transport: the dispatch's `work`, presence `repos`, matching and
"why it waits", the result chunks and the hub's result inbox (forged, hostile, oversized),
and the dispatch options that build the work."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import tarfile
from pathlib import Path

import pytest

from mam.orchestrator import queue
from mam.orchestrator.dispatch import work_terms
from mam.orchestrator.results import ResultInbox, format_result, read_result
from mam.runner.results import build_archive
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import DecodeError, SignatureError, UsageError
from mam.shared.protocol.wire import resultchunk
from mam.shared.store.registry import Registry

KEYS = crypto.derive_keys("s" * 40)


def dispatch(work: wire.Work | None) -> dict[str, object]:
    sealed = crypto.seal(KEYS.seal_key, job_id="0123abcd", attempt_id=1, dispatch_token="a" * 32,
                         auth_token="b" * 32, brief="fix it")
    built = wire.Dispatch.build("0123abcd", "gpu-box", 1, "a" * 32, origin="hub", contract=wire.Contract(),
                                sealed=sealed, work=work)
    return crypto.sign(built.to_dict(), KEYS.sign_key)


# ------------------------------------------------------------------ work on the wire

def test_s18_work_travels_signed_in_the_dispatch_and_a_plain_job_has_none() -> None:
    work = wire.Work.build(repo="demo", ref="main")
    signed = dispatch(work)
    decoded = wire.decode(wire.encode(signed), "dispatch")
    assert decoded.work == work
    crypto.verify(decoded.to_dict(), KEYS.sign_key)
    tampered = dict(signed, work={"repo": "other"})
    with pytest.raises(SignatureError):
        crypto.verify(tampered, KEYS.sign_key)
    plain = dispatch(None)
    assert "work" not in plain and wire.decode(wire.encode(plain), "dispatch").work is None


@pytest.mark.parametrize("bad, words", [
    ({"repo": "-upload-pack=evil"}, "repo"),
    ({"repo": "demo", "ref": "--upload-pack=x"}, "ref"),
    ({"repo": "demo", "ref": "a..b"}, "ref"),
    ({"repo": "demo", "ref": "x" * 300}, "ref"),
    ({"repo": "demo", "ref": "main\nevil"}, "ref"),
    ({"ref": "main"}, "only allowed with repo"),
    ({"repo": 7}, "repo"),
    ({"repo": "demo", "ref": ["main"]}, "ref"),
    ({"repo": None}, "never null"),
    ({"repo": "demo", "surprise": 1}, "unknown field"),
    ([], "must be an object"),
    ({"max_turns": 0}, "max_turns"),
    ({"max_turns": True}, "max_turns"),
    ({"max_turns": 10**30}, "max_turns"),
    ({"max_cost_usd": -1}, "max_cost_usd"),
    ({"max_cost_usd": "1"}, "max_cost_usd"),
    ({"allow_tools": "Edit"}, "non-empty list"),
    ({"allow_tools": []}, "non-empty list"),
    ({"allow_tools": ["Bash(rm -rf /) \x1b[2J"]}, "not a tool rule"),
    ({"allow_tools": ["Edit"] * 33}, "1-32 tool rules"),
    ({"allow_tools": ["Bash(a,b)"]}, "not a tool rule"),
    ({"permission_mode": "bypassPermissions"}, "permission_mode"),
    ({"memory_bytes": "8G"}, "memory_bytes"),
    ({"memory_bytes": 1024}, "memory_bytes"),
    ({"memory_bytes": 2 ** 80}, "memory_bytes"),
    ({"cpus": 0}, "cpus"),
    ({"cpus": True}, "cpus"),
    ({"pids": 4.5}, "pids"),
    ({"pids": -1}, "pids"),
])
def test_s18_a_bad_work_object_is_refused_in_one_line(bad: object, words: str) -> None:
    signed = dict(dispatch(None), work=bad)
    with pytest.raises(DecodeError) as caught:
        wire.decode(json.dumps(signed).encode(), "dispatch")
    assert words in caught.value.reason and "\n" not in caught.value.reason


def test_s18_the_agent_policy_travels_signed_in_the_work() -> None:
    work = work_terms(max_turns=5, max_cost_usd=2, allow_tools="Bash(git *), Edit ,mcp__mam__ask",
                      permission_mode="acceptEdits")
    assert work is not None and work.to_dict() == {
        "max_turns": 5, "max_cost_usd": 2.0, "allow_tools": ["Bash(git *)", "Edit", "mcp__mam__ask"],
        "permission_mode": "acceptEdits"}
    decoded = wire.decode(wire.encode(dispatch(work)), "dispatch")
    assert decoded.work == work and decoded.work.allow_tools == ("Bash(git *)", "Edit", "mcp__mam__ask")
    assert wire.Work.from_dict(work.to_dict()) == work


@pytest.mark.parametrize("kwargs, words", [
    ({"max_turns": 0}, "--max-turns 0 is invalid: expected 1..1000"),
    ({"max_cost_usd": float("nan")}, "--max-cost-usd nan is invalid"),
    ({"max_cost_usd": float("inf")}, "--max-cost-usd inf is invalid"),
    ({"allow_tools": "Bash(git *"}, "--allow-tools: 'Bash(git *' is not a tool rule"),
    ({"allow_tools": "Edit,Edit"}, "--allow-tools names a tool rule twice"),
    ({"allow_tools": "Edit,,Bash"}, "--allow-tools has an empty item"),
    ({"allow_tools": "Bash(" + "x" * 300 + ")"}, "is not a tool rule"),
    ({"permission_mode": "bypassPermissions"}, "--permission-mode 'bypassPermissions' is invalid: expected one of"),
    ({"max_turns": 0, "cli": False}, "max_turns 0 is invalid"),
    ({"memory": "8X"}, "--memory '8X' is invalid: expected a size 4M..16T such as 512M or 8G"),
    ({"memory": "1K"}, "--memory '1K' is invalid"),
    ({"memory": "9" * 40 + "G"}, "--memory '999"),
    ({"memory": "-1G"}, "--memory '-1G' is invalid"),
    ({"cpus": 0.001}, "--cpus 0.001 is invalid: expected CPUs, 0.01..1024"),
    ({"cpus": float("nan")}, "--cpus nan is invalid"),
    ({"pids": 7}, "--pids 7 is invalid: expected 8..4194304"),
])
def test_s18_a_bad_agent_policy_is_refused_in_one_line(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(UsageError) as caught:
        work_terms(**kwargs)  # type: ignore[arg-type]
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_s6_limits_travel_signed_in_the_work() -> None:
    work = work_terms(memory="64m", cpus=2, pids=512)
    assert work is not None and work.to_dict() == {"memory_bytes": 64 << 20, "cpus": 2.0, "pids": 512}
    assert wire.decode(wire.encode(dispatch(work)), "dispatch").work == work
    assert work_terms(memory=8 << 30, cli=False).to_dict() == {"memory_bytes": 8 << 30}  # type: ignore[union-attr]
    assert [work_terms(memory=m).memory_bytes for m in ("1G", " 2g", "4096k", "4194304")] == [  # type: ignore[union-attr]
        1 << 30, 2 << 30, 4 << 20, 4 << 20]


def test_s18_dispatch_options_build_the_work_or_refuse_in_one_line() -> None:
    assert work_terms() is None
    work = work_terms(repo="demo", ref="v1.2")
    assert work is not None and work.to_dict() == {"repo": "demo", "ref": "v1.2"}
    for kwargs, words in [({"ref": "main"}, "--ref needs --repo"), ({"repo": "../x"}, "--repo"),
                          ({"repo": "d" * 65}, "--repo"), ({"repo": "d", "ref": "-x"}, "--ref")]:
        with pytest.raises(UsageError, match=words):
            work_terms(**kwargs)


# ------------------------------------------------------------------ presence and matching

def test_s18_presence_announces_repos_signed_and_refuses_hostile_names() -> None:
    built = wire.Presence.build("gpu-box", "a" * 32, "online", host="h", version="1", max_jobs=1,
                                repos=["web", "demo"])
    signed = crypto.sign(built.to_dict(), KEYS.sign_key)
    assert signed["repos"] == ["demo", "web"]
    assert wire.decode(wire.encode(signed), "presence").repos == ("demo", "web")
    assert "repos" not in wire.Presence.build("gpu-box", "a" * 32, "online", host="h", version="1",
                                              max_jobs=1).to_dict()
    for hostile in (["../etc"], "demo", ["x"] * 40, ["a", "a"]):
        with pytest.raises(DecodeError):
            wire.decode(json.dumps(dict(signed, repos=hostile)).encode(), "presence")


def view(session: str, repos: frozenset[str]) -> queue.RunnerView:
    return queue.RunnerView(session=session, runner_id="a" * 32, status="online", labels=frozenset(), max_jobs=2,
                            running=frozenset(), verified=True, seen_at=0.0, repos=repos)


def test_s18_a_repository_job_goes_only_to_a_runner_serving_it_and_says_why_it_waits() -> None:
    fleet = queue.Fleet()
    fleet.update(view("plain", frozenset()))
    job = queue.QueuedJob("0123abcd", None, frozenset(), 0, 0.0, repo="demo")
    assert queue.plan([job], fleet, 0.0, 60.0) == []
    why = queue.why_waiting(job, fleet, [job], 0.0, 60.0)
    assert "no runner serves repo demo" in why and "--repo demo=URL" in why
    fleet.update(view("box", frozenset({"demo"})))
    assert queue.plan([job], fleet, 0.0, 60.0) == [("0123abcd", "box")]
    pinned = queue.QueuedJob("0123abce", "plain", frozenset(), 0, 0.0, repo="demo")
    assert "served by box" in queue.why_waiting(pinned, fleet, [pinned], 0.0, 60.0)


# ------------------------------------------------------------------ result chunks

TOKEN = "c" * 32


def chunks_of(archive: bytes, token: str = TOKEN, job_id: str = "0123abcd", attempt_id: int = 1) -> list[bytes]:
    digest = hashlib.sha256(archive).hexdigest()
    key = crypto.result_key(token)
    count = resultchunk.chunk_count(len(archive))
    step = resultchunk.MAX_CHUNK_BYTES
    return [crypto.build_result_chunk(token, key, job_id=job_id, attempt_id=attempt_id, chunk=n, size=len(archive),
                                      sha256=digest, plaintext=archive[n * step:(n + 1) * step])
            for n in range(count)]


def test_s18_a_result_chunk_opens_only_with_its_token_and_place() -> None:
    raw = chunks_of(b"x" * 1000)[0]
    chunk = resultchunk.decode_chunk(raw)
    assert crypto.open_result_chunk(chunk, TOKEN) == b"x" * 1000
    with pytest.raises(SignatureError):
        crypto.open_result_chunk(chunk, "d" * 32)
    moved = json.loads(raw)
    moved["attempt_id"] = 2
    moved["sig"] = crypto.log_sig(moved, TOKEN)  # re-signed by the token holder, but the seal is bound
    with pytest.raises(SignatureError):
        crypto.open_result_chunk(resultchunk.decode_chunk(json.dumps(moved).encode()), TOKEN)


@pytest.mark.parametrize("change, words", [
    ({"chunks": 7}, "does not fit size"), ({"chunk": 5}, "chunk"), ({"size": -1}, "size"),
    ({"sha256": "zz"}, "sha256"), ({"extra": 1}, "unknown field"), ({"kind": "log"}, "kind"),
])
def test_s18_a_malformed_result_chunk_is_refused(change: dict[str, object], words: str) -> None:
    obj = dict(json.loads(chunks_of(b"y" * 10)[0]), **change)
    with pytest.raises(DecodeError, match=words):
        resultchunk.decode_chunk(json.dumps(obj).encode())


def test_s18_an_oversized_result_message_is_refused_before_parsing() -> None:
    with pytest.raises(DecodeError):
        resultchunk.decode_chunk(b"{" + b" " * (400 * 1024) + b"}")


# ------------------------------------------------------------------ the hub's inbox

@pytest.fixture
def hub(tmp_path: Path) -> tuple[Registry, str]:
    registry = Registry(tmp_path)
    record = registry.register(session="gpu-box")
    return registry, record["job_id"]


def archive_bytes(tmp_path: Path, extra: dict[str, bytes] | None = None) -> bytes:
    patch = tmp_path / "p.patch"
    patch.write_bytes(b"diff --git a/x b/x\n" + bytes(range(256)) * 2500)  # ~640 KB: three chunks
    path = tmp_path / "a.tar"
    build_archive(path, {"repo": "demo", "head_sha": "1" * 40, "note": None}, {"change.patch": patch})
    data = path.read_bytes()
    if extra:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, body in extra.items():
                info = tarfile.TarInfo(name)
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
            info = tarfile.TarInfo("result.json")
            body = b'{"repo": "demo"}'
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
        data = buf.getvalue()
    return data


def test_s18_the_hub_assembles_a_result_in_any_order_once(hub: tuple[Registry, str], tmp_path: Path) -> None:
    registry, job_id = hub
    token = registry.get(job_id)["auth_token"]
    data = archive_bytes(tmp_path)
    raws = chunks_of(data, token, job_id)
    assert len(raws) == 3
    inbox = ResultInbox(registry)
    assert [inbox.handle(raw) for raw in (raws[2], raws[0], raws[0])] == [None, None, None]
    assert inbox.handle(raws[1]) == job_id
    assert inbox.handle(raws[1]) is None  # a resend after completion
    result = read_result(registry, job_id)
    assert result is not None and result.summary is not None and result.summary["repo"] == "demo"
    assert result.patch_path is not None and result.patch_path.read_bytes() == (tmp_path / "p.patch").read_bytes()
    assert any(line.get("event") == "result_ready" for line in registry.audit(job_id))


def test_s18_a_forged_or_foreign_result_is_refused_and_logged(hub: tuple[Registry, str], tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    registry, job_id = hub
    inbox = ResultInbox(registry)
    caplog.set_level(logging.WARNING)
    for raw in chunks_of(b"forged", "e" * 32, job_id):
        assert inbox.handle(raw) is None
    assert "does not verify" in caplog.text
    assert inbox.handle(b"\xff not json") is None
    assert inbox.handle(chunks_of(b"x", registry.get(job_id)["auth_token"], job_id, attempt_id=9)[0]) is None
    assert inbox.refused == 3 and read_result(registry, job_id) is None


def test_s18_a_hostile_archive_unpacks_nothing_outside_its_folder(hub: tuple[Registry, str],
                                                                   tmp_path: Path) -> None:
    registry, job_id = hub
    token = registry.get(job_id)["auth_token"]
    data = archive_bytes(tmp_path, {"../../etc/passwd": b"root::0:0", "artifacts/../../x": b"x",
                                    "/abs": b"a", "artifacts/ok.txt": b"fine"})
    inbox = ResultInbox(registry)
    for raw in chunks_of(data, token, job_id):
        inbox.handle(raw)
    result = read_result(registry, job_id)
    assert result is not None and result.artifacts() == ["ok.txt"]
    assert not (tmp_path / "etc").exists() and not Path("/abs").exists()
    assert sorted(p.name for p in result.folder.iterdir()) == ["result.json"]
    assert result.artifacts_dir == names.hub_artifacts_dir(registry.root, job_id, 1)
    assert (result.artifacts_dir / "ok.txt").read_bytes() == b"fine"
    assert result.artifacts_dir.stat().st_mode & 0o777 == 0o700
    assert result.artifact_path("ok.txt").read_bytes() == b"fine"
    for bad in ("../result.json", ".hidden", "nope.txt"):
        with pytest.raises((UsageError, FileNotFoundError)):
            result.artifact_path(bad)


def test_s18_a_result_over_the_hub_cap_is_refused(hub: tuple[Registry, str], tmp_path: Path) -> None:
    registry, job_id = hub
    inbox = ResultInbox(registry, max_bytes=1000)
    raw = chunks_of(b"z" * 5000, registry.get(job_id)["auth_token"], job_id)[0]
    assert inbox.handle(raw) is None and inbox.refused == 1
    assert not names.hub_result_dir(registry.root, job_id, 1).exists()


def test_s18_a_transcript_arrives_with_the_result_and_hostile_names_for_it_do_not(
        hub: tuple[Registry, str], tmp_path: Path) -> None:
    """The agent's session transcript lands as `transcript/<session_id>.jsonl` (§18
    "Transcripts"); any other name under `transcript/` is left out."""
    registry, job_id = hub
    token = registry.get(job_id)["auth_token"]
    session = "8d99b0b5-6eb4-42d6-86de-f6ab1a4fe0ee"
    data = archive_bytes(tmp_path, {f"transcript/{session}.jsonl": b'{"type":"user"}\n',
                                    "transcript/../x.jsonl": b"x", "transcript/a/b.jsonl": b"x",
                                    "transcript/notes.txt": b"x", "transcript/.hidden.jsonl": b"x",
                                    "transcript/" + "a" * 129 + ".jsonl": b"x"})
    inbox = ResultInbox(registry)
    for raw in chunks_of(data, token, job_id):
        inbox.handle(raw)
    result = read_result(registry, job_id)
    assert result is not None and result.transcript_path is not None
    assert result.transcript_path.read_bytes() == b'{"type":"user"}\n'
    assert result.transcript_path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in (result.folder / "transcript").iterdir()] == [f"{session}.jsonl"]
    assert not (result.folder / "x.jsonl").exists()
    assert result.to_dict()["has_transcript"] is True
    shown = format_result(result)
    assert "no repository" not in shown and f"transcript: session {session}, 16 bytes" in shown


def test_s18_result_prints_the_transcript_or_says_why_not(hub: tuple[Registry, str], tmp_path: Path,
                                                          capfdbinary: pytest.CaptureFixture[bytes]) -> None:
    from mam.orchestrator.results import result_cli

    registry, job_id = hub
    token = registry.get(job_id)["auth_token"]
    session = "8d99b0b5-6eb4-42d6-86de-f6ab1a4fe0ee"
    for raw in chunks_of(archive_bytes(tmp_path, {f"transcript/{session}.jsonl": b'{"type":"user"}\n'}), token,
                         job_id):
        ResultInbox(registry).handle(raw)
    assert result_cli(job_id, workspace=str(registry.root), patch=False, transcript=True, attempt=None,
                      as_json=False) == 0
    assert capfdbinary.readouterr().out == b'{"type":"user"}\n'
    with pytest.raises(UsageError, match="give --patch or --transcript, not both"):
        result_cli(job_id, workspace=str(registry.root), patch=True, transcript=True, attempt=None, as_json=False)
    other = registry.register(session="gpu-box")["job_id"]
    for raw in chunks_of(archive_bytes(tmp_path), registry.get(other)["auth_token"], other):
        ResultInbox(registry).handle(raw)
    assert result_cli(other, workspace=str(registry.root), patch=False, transcript=True, attempt=None,
                      as_json=False) == 1
    assert b"no transcript (its agent kept none" in capfdbinary.readouterr().err
