"""Attempts' results at the hub (PROTOCOL §18): receiving them, `mam-orch result` and `apply`.

`ResultInbox.handle(raw)` takes one message of `ROOT/jobs/<id>/result`: a chunk that
verifies with one of the job's auth tokens (any of its attempts: a result may come after
a retry began) is written at its place in `.mam/results/<id>/<attempt>/archive.part`; when
every chunk is in and the SHA-256 matches, the archive is unpacked there (`result.json`,
`change.bundle`, `change.patch`, `artifacts/<name>`: the bytes of regular files at those
names only, no absolute paths, links or escapes; the artifacts then move to
`.mam/artifacts/<id>/<attempt>/`) and `result_ready` is logged in the job's audit. Forged, malformed or
oversized chunks are refused with one warning line; nothing raises on bad input.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mam.orchestrator.hub import Workspace, open_hub
from mam.orchestrator.logs import streamed_transcript
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import DecodeError, MamError, RegistryError, SignatureError, UsageError
from mam.shared.protocol.wire import resultchunk
from mam.shared.store.fsio import atomic_write, read_json_object
from mam.shared.store.records import utc_now
from mam.shared.store.registry import Registry

log = logging.getLogger("mam.results")

MAX_RESULT_BYTES_ENV = "MAM_HUB_MAX_RESULT_BYTES"
DEFAULT_MAX_RESULT_BYTES = 256 << 20
"""Largest archive the hub takes, bytes (a runner's own cap, --max-result-bytes, is lower)."""
STATE_MAX_BYTES = 1 << 20
SUMMARY_MAX_BYTES = 4 << 20
ARCHIVE_PART = "archive.part"
STATE_FILE = "archive.json"
SUMMARY_FILE = "result.json"
PATCH_FILE = "change.patch"
BUNDLE_FILE = "change.bundle"
GIT_TIMEOUT_S = 300.0


class ResultInbox:
    """Writes §18 chunks of every job into the hub registry's results folder.

    Args:
        registry: the hub registry (records hold the auth tokens).
        max_bytes: the largest archive taken, bytes.
    """

    def __init__(self, registry: Registry, max_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> None:
        self.registry, self.max_bytes = registry, max_bytes
        self.refused = 0

    def handle(self, raw: bytes) -> str | None:
        """One message of a result topic. Returns the job id when it completed a result, else None.

        Raises:
            RegistryError: the hub's own disk fails.
        """
        if len(raw) == 0:
            return None
        try:
            chunk = resultchunk.decode_chunk(raw)
        except DecodeError as exc:
            return self._refuse(f"refused result chunk: {exc.reason}")
        if chunk.size > self.max_bytes:
            return self._refuse(f"job {chunk.job_id}: refused result of {chunk.size} bytes "
                                f"(over {MAX_RESULT_BYTES_ENV}={self.max_bytes})")
        try:
            record = self.registry.get(chunk.job_id)
        except RegistryError:
            return self._refuse(f"refused result chunk: no record of job {chunk.job_id}", quiet=True)
        if not 1 <= chunk.attempt_id <= int(record.get("attempt_id", 0)):
            return self._refuse(f"job {chunk.job_id}: refused result chunk of unknown attempt {chunk.attempt_id}")
        plaintext = self._open(chunk, record)
        if plaintext is None:
            return self._refuse(f"job {chunk.job_id}: refused result chunk {chunk.chunk} of attempt "
                                f"{chunk.attempt_id}: its signature or seal does not verify")
        try:
            return chunk.job_id if self._place(chunk, plaintext) else None
        except OSError as exc:
            raise RegistryError(f"job {chunk.job_id}: result not written: {exc.strerror or exc}") from None

    def _refuse(self, line: str, *, quiet: bool = False) -> str | None:
        """Count and log a refused chunk; None (what `handle` returns for it)."""
        self.refused += 1
        (log.debug if quiet else log.warning)("%s", line)
        return None

    @staticmethod
    def _open(chunk: resultchunk.ResultChunk, record: Mapping[str, Any]) -> bytes | None:
        tokens = [record.get("auth_token"), *reversed(record.get("earlier_auth_tokens") or [])]
        for token in tokens:
            if isinstance(token, str) and token:
                try:
                    return crypto.open_result_chunk(chunk, token)
                except SignatureError:
                    continue
        return None

    def _place(self, chunk: resultchunk.ResultChunk, plaintext: bytes) -> bool:
        folder = names.hub_result_dir(self.registry.root, chunk.job_id, chunk.attempt_id)
        if (folder / SUMMARY_FILE).exists():
            return False  # complete already: a resend
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        state = _read_state(folder)
        if state.get("sha256") != chunk.sha256 or state.get("size") != chunk.size:
            state = {"size": chunk.size, "sha256": chunk.sha256, "chunks": chunk.chunks, "got": []}
            (folder / ARCHIVE_PART).unlink(missing_ok=True)
        if chunk.chunk in state["got"]:
            return False
        expected = min(resultchunk.MAX_CHUNK_BYTES, chunk.size - chunk.chunk * resultchunk.MAX_CHUNK_BYTES)
        if len(plaintext) != max(0, expected):
            log.warning("job %s: refused result chunk %d: %d bytes where %d belong", chunk.job_id, chunk.chunk,
                        len(plaintext), expected)
            return False
        fd = os.open(folder / ARCHIVE_PART, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, plaintext, chunk.chunk * resultchunk.MAX_CHUNK_BYTES)
        finally:
            os.close(fd)
        state["got"].append(chunk.chunk)
        if len(state["got"]) < chunk.chunks:
            atomic_write(folder / STATE_FILE, json.dumps(state).encode(), what="result state", durable=False)
            return False
        return self._complete(chunk, folder)

    def _complete(self, chunk: resultchunk.ResultChunk, folder: Path) -> bool:
        part = folder / ARCHIVE_PART
        digest = hashlib.sha256()
        with open(part, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != chunk.sha256:
            log.warning("job %s: result of attempt %d refused: its SHA-256 does not match the manifest",
                        chunk.job_id, chunk.attempt_id)
            part.unlink(missing_ok=True)
            (folder / STATE_FILE).unlink(missing_ok=True)
            return False
        try:
            with tarfile.open(part, mode="r:") as tar:
                members = [m for m in tar.getmembers() if _allowed_member(m)]
                _extract(tar, [m for m in members if m.name != SUMMARY_FILE], folder)
                self._move_artifacts(folder, chunk.job_id, chunk.attempt_id)
                # last: its presence means the result (and its artifacts) is whole
                _extract(tar, [m for m in members if m.name == SUMMARY_FILE], folder)
        except (tarfile.TarError, OSError, ValueError) as exc:
            log.warning("job %s: result of attempt %d refused: not a result archive (%s)", chunk.job_id,
                        chunk.attempt_id, exc)
            return False
        finally:
            part.unlink(missing_ok=True)
            (folder / STATE_FILE).unlink(missing_ok=True)
        self.registry.append_audit(chunk.job_id, {"event": "result_ready", "timestamp": utc_now(),
                                                  "attempt_id": chunk.attempt_id, "bytes": chunk.size,
                                                  "source": "hub"})
        log.info("job %s: result of attempt %d received (%d bytes)", chunk.job_id, chunk.attempt_id, chunk.size)
        return True


    def _move_artifacts(self, folder: Path, job_id: str, attempt_id: int) -> None:
        """`artifacts/` of an unpacked archive to `.mam/artifacts/<id>/<attempt>/` (0700), replacing
        what an earlier copy of the same attempt left there."""
        unpacked = folder / "artifacts"
        if not unpacked.is_dir():
            return
        target = names.hub_artifacts_dir(self.registry.root, job_id, attempt_id)
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(unpacked, target)
        os.chmod(target, 0o700)


def _extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], folder: Path) -> None:
    """Write `members` (regular files `_allowed_member` passed) under `folder`, 0600, copying
    their bytes only: no owner, mode, link or device of the archive is taken (the same on every
    Python 3.11; `extractall(filter=...)` needs 3.11.4, and Debian 12 ships 3.11.2)."""
    for member in members:
        source = tar.extractfile(member)
        if source is None:
            continue
        target = folder / member.name
        target.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out, source:
            shutil.copyfileobj(source, out, 1 << 20)


def _allowed_member(member: tarfile.TarInfo) -> bool:
    """Only regular files at known places: result.json, change.*, artifacts/<name>,
    transcript/<session_id>.jsonl (§18)."""
    name = member.name
    top = name in (SUMMARY_FILE, PATCH_FILE, BUNDLE_FILE)
    folder, _, leaf = name.partition("/")
    artifact = folder == "artifacts" and bool(names.ARTIFACT_RE.fullmatch(leaf))
    transcript = folder == names.TRANSCRIPT_DIR and leaf.endswith(".jsonl") \
        and bool(names.AGENT_SESSION_RE.fullmatch(leaf[:-6]))
    return member.isfile() and (top or artifact or transcript)


def _read_state(folder: Path) -> dict[str, Any]:
    try:
        state = read_json_object(folder / STATE_FILE, STATE_MAX_BYTES)
    except (OSError, MamError, ValueError):
        return {}
    return state if isinstance(state.get("got"), list) else {}


# ------------------------------------------------------------------ reading results

@dataclass(frozen=True)
class Result:
    """One attempt's result as the hub holds it (§18).

    Attributes:
        job_id, attempt_id: whose; root: the hub's workspace; folder: `.mam/results/<id>/<attempt>/`;
        summary: `result.json` (repo, ref, base_sha, head_sha, commits, files, insertions,
        deletions, note, agent); None while it has not arrived.
    """

    job_id: str
    attempt_id: int
    root: Path
    folder: Path
    summary: dict[str, Any] | None

    @property
    def patch_path(self) -> Path | None:
        path = self.folder / PATCH_FILE
        return path if path.is_file() else None

    @property
    def bundle_path(self) -> Path | None:
        path = self.folder / BUNDLE_FILE
        return path if path.is_file() else None

    @property
    def artifacts_dir(self) -> Path:
        """`.mam/artifacts/<id>/<attempt>/`, where this attempt's artifacts land (§18)."""
        return names.hub_artifacts_dir(self.root, self.job_id, self.attempt_id)

    @property
    def transcript_path(self) -> Path | None:
        """The agent's session transcript this attempt sent, masked (§18 "Transcripts"), or None."""
        found = sorted((self.folder / names.TRANSCRIPT_DIR).glob("*.jsonl"))
        return found[0] if found and self.summary is not None else None

    def artifacts(self) -> list[str]:
        """The artifact names received, sorted."""
        folder = self.artifacts_dir
        return sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []

    def artifact_path(self, name: str) -> Path:
        """The file of artifact `name`.

        Raises:
            UsageError: not an artifact name (§18). FileNotFoundError: no such artifact.
        """
        if not isinstance(name, str) or not names.ARTIFACT_RE.fullmatch(name):
            raise UsageError(f"artifact {name[:60]!r} is invalid: not an artifact name")
        path = self.artifacts_dir / name
        if not path.is_file() or path.is_symlink():
            raise FileNotFoundError(f"job {self.job_id} attempt {self.attempt_id} has no artifact {name!r}")
        return path

    def to_dict(self) -> dict[str, Any]:
        """JSON for `result --json`, `job.result()` and the HTTP API."""
        return {"job_id": self.job_id, "attempt_id": self.attempt_id, "ready": self.summary is not None,
                **(self.summary or {}), "artifacts": self.artifacts(), "has_patch": self.patch_path is not None,
                "has_bundle": self.bundle_path is not None, "has_transcript": self.transcript_path is not None}


MAX_CARRIED_TRANSCRIPT_BYTES = 32 << 20
"""A transcript at the hub read for carrying at most, bytes (the runner sends no larger one)."""


def with_transcript(root: Path, record: Mapping[str, Any]) -> Mapping[str, Any]:
    """`record` with `work.resume.transcript` (§18 "Transcripts"): the transcript of the
    session it resumes, as the resumed attempt's result brought it or, without a result (its
    runner was lost), as that attempt streamed it (`logs.streamed_transcript`, §15),
    zlib-compressed and sealed to the record's attempt (`crypto.seal_transcript`), for a
    runner that lacks it.
    `record` itself when it resumes nothing, the hub has no such transcript, or the sealed
    one is over `wire.MAX_TRANSCRIPT_SEALED_CHARS` (logged: a runner without it starts fresh)."""
    work = record.get("work") or {}
    resume = work.get("resume")
    if not isinstance(resume, Mapping) or not names.AGENT_SESSION_RE.fullmatch(str(resume.get("session_id"))):
        return record
    session_id, resumed = resume["session_id"], resume.get("attempt")
    if not isinstance(resumed, int):
        return record
    path = names.hub_result_dir(root, record["job_id"], resumed) / names.TRANSCRIPT_DIR / f"{session_id}.jsonl"
    data: bytes | None
    try:
        with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NOFOLLOW)) as handle:
            data = handle.read(MAX_CARRIED_TRANSCRIPT_BYTES + 1)
    except FileNotFoundError:
        data = streamed_transcript(root, record["job_id"], resumed, session_id, MAX_CARRIED_TRANSCRIPT_BYTES)
    except OSError:
        return record
    if data is None or len(data) > MAX_CARRIED_TRANSCRIPT_BYTES:
        return record
    sealed = crypto.seal_transcript(record["auth_token"], zlib.compress(data, 6), job_id=record["job_id"],
                                    attempt_id=record["attempt_id"], session_id=session_id)
    if len(sealed["ciphertext"]) > wire.MAX_TRANSCRIPT_SEALED_CHARS:
        log.warning("job %s: the transcript of session %s is too large to carry (%d bytes); a runner without it "
                    "starts a new session", record["job_id"], session_id, len(data))
        return record
    return {**record, "work": {**work, "resume": {**resume, "transcript": sealed}}}


def with_bundle(root: Path, record: Mapping[str, Any]) -> Mapping[str, Any]:
    """`record` with `work.base.bundle` (§18 "Handing a change on"): the `change.bundle` of
    the result it starts from, sealed to the record's attempt (`crypto.seal_bundle`);
    `record` itself when it starts from no result, or that result has no commit to carry.

    Raises:
        UsageError: the bundle is no longer at the hub, or is over `wire.MAX_CARRIED_BUNDLE_BYTES`
            (one line: this attempt cannot start where it should).
    """
    work = record.get("work") or {}
    base = work.get("base")
    if not isinstance(base, Mapping) or base.get("head_sha") == base.get("base_sha"):
        return record
    source = f"job {base.get('job_id')} attempt {base.get('attempt')}"
    try:
        path = names.hub_result_dir(root, str(base["job_id"]), int(base["attempt"])) / BUNDLE_FILE
        with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NOFOLLOW)) as handle:
            data = handle.read(wire.MAX_CARRIED_BUNDLE_BYTES + 1)
    except (OSError, KeyError, TypeError, ValueError, UsageError) as exc:
        raise UsageError(f"job {record['job_id']}: the change of {source} it starts from is not at the hub: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    if len(data) > wire.MAX_CARRIED_BUNDLE_BYTES:
        raise UsageError(f"job {record['job_id']}: the change of {source} is over the "
                         f"{wire.MAX_CARRIED_BUNDLE_BYTES} bytes a dispatch carries")
    sealed = crypto.seal_bundle(record["auth_token"], data, job_id=record["job_id"], attempt_id=record["attempt_id"],
                                from_job=str(base["job_id"]), head_sha=str(base["head_sha"]))
    return {**record, "work": {**work, "base": {**base, "bundle": sealed}}}


def attempts_with_results(root: Path, job_id: str) -> Iterator[int]:
    folder = names.mam_dir(root) / "results" / names.validate_job_id(job_id)
    if folder.is_dir():
        yield from sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def read_result(registry: Registry, job_id: str, attempt_id: int | None = None) -> Result | None:
    """The result of `attempt_id` (default: the latest attempt with one), or None when no
    attempt sent one.

    Raises:
        UsageError: a bad job id. JobNotFound.
    """
    registry.get(job_id)
    attempts = list(attempts_with_results(registry.root, job_id))
    if attempt_id is None:
        ready = [a for a in attempts if (names.hub_result_dir(registry.root, job_id, a) / SUMMARY_FILE).exists()]
        candidates = ready or attempts
        if not candidates:
            return None
        attempt_id = candidates[-1]
    folder = names.hub_result_dir(registry.root, job_id, attempt_id)
    if not folder.is_dir():
        return None
    try:
        summary: dict[str, Any] | None = read_json_object(folder / SUMMARY_FILE, SUMMARY_MAX_BYTES)
    except (OSError, MamError, ValueError):
        summary = None
    return Result(job_id=job_id, attempt_id=attempt_id, root=registry.root, folder=folder, summary=summary)


def format_result(result: Result) -> str:
    """The human view of `mam-orch result`: the change's commits and diffstat (§18)."""
    summary = result.summary
    if summary is None:
        return f"job {result.job_id} attempt {result.attempt_id}: the result is still arriving\n"
    if summary.get("repo") is None:  # no repository: artifacts or a transcript only
        lines = [f"job {result.job_id} attempt {result.attempt_id}: no repository"]
    else:
        lines = _change_lines(result.job_id, result.attempt_id, summary)
    agent = summary.get("agent") or {}
    if agent.get("result_text"):
        lines.append(f"  summary: {agent['result_text']}")
    artifacts = result.artifacts()
    if artifacts:
        lines.append(f"  artifacts: {', '.join(artifacts)} (in {result.artifacts_dir})")
    if (transcript := result.transcript_path) is not None:
        lines.append(f"  transcript: session {transcript.stem}, {transcript.stat().st_size} bytes ({transcript})")
    notes = summary.get("artifact_notes")
    for note in notes[:MAX_NOTES_SHOWN] if isinstance(notes, list) else []:  # what the runner left out, and why
        lines.append(f"  left out: {wire.safe_line(str(note), wire.MAX_DETAIL_CHARS)}")
    if isinstance(notes, list) and len(notes) > MAX_NOTES_SHOWN:
        lines.append(f"  left out: {len(notes) - MAX_NOTES_SHOWN} more (see result.json)")
    return "\n".join(lines) + "\n"


def _change_lines(job_id: str, attempt_id: int, summary: Mapping[str, Any]) -> list[str]:
    """The repository, commits and diffstat of a result's summary, for `format_result`."""
    lines = [f"job {job_id} attempt {attempt_id}: repo {summary.get('repo')} @ {summary.get('ref')}",
             f"  base {summary.get('base_sha')}  head {summary.get('head_sha')}"]
    if summary.get("note"):
        lines.append(f"  note: {summary['note']}")
    commits = summary.get("commits") or []
    lines.append(f"  {summary.get('commits_total', len(commits))} commit(s):")
    lines += [f"    {str(c.get('sha', ''))[:12]} {c.get('subject', '')}  ({c.get('author', '')})" for c in commits]
    files = summary.get("files") or []
    for entry in files:
        added, deleted = entry.get("added"), entry.get("deleted")
        counts = "binary" if added is None else f"+{added} -{deleted}"
        lines.append(f"    {counts:>14}  {entry.get('path')}")
    lines.append(f"  {summary.get('files_total', len(files))} file(s) changed, {summary.get('insertions', 0)} "
                 f"insertion(s), {summary.get('deletions', 0)} deletion(s)")
    return lines


MAX_NOTES_SHOWN = 10
"""`artifact_notes` lines `mam-orch result` prints at most."""


RESULT_SETTLE_S = 30.0
"""After the terminal event, how long `dispatch` (whose engine stops with it) waits for the
result the terminal announced, seconds (brokers do not order messages across topics)."""


def announced(registry: Registry, job_id: str) -> dict[str, Any] | None:
    """`data.result` of the current attempt's terminal event (§18), or None."""
    record = registry.get(job_id)
    for line in reversed(registry.audit(job_id)):
        if line.get("attempt_id") == record.get("attempt_id") and line.get("event") in ("completed", "error") \
                and isinstance(line.get("data"), Mapping):
            result = line["data"].get("result")
            return dict(result) if isinstance(result, Mapping) and result.get("sha256") else None
    return None


def result_arrived(registry: Registry, job_id: str) -> bool:
    """True when the result the current attempt's terminal event announced is whole at the
    hub (§18), or when none was announced."""
    if announced(registry, job_id) is None:
        return True
    attempt = int(registry.get(job_id)["attempt_id"])
    return (names.hub_result_dir(registry.root, job_id, attempt) / SUMMARY_FILE).exists()


def await_result(registry: Registry, job_id: str, timeout_s: float = RESULT_SETTLE_S) -> bool:
    """Wait until the result the terminal event announced is in (at most `timeout_s`); True
    when it is, or when none was announced."""
    deadline = time.monotonic() + timeout_s
    while not result_arrived(registry, job_id):
        if time.monotonic() >= deadline:
            log.warning("job %s: its result has not arrived in %g s; `mam-orch serve` receives it later",
                        job_id, timeout_s)
            return False
        time.sleep(0.1)
    return True


def result_cli(job_id: str, *, workspace: Workspace, patch: bool, attempt: int | None, as_json: bool,
               transcript: bool = False) -> int:
    """`mam-orch result <id> [--patch | --transcript] [--attempt N] [--json]` (§18).

    Returns:
        0 shown; 1 no result (yet, or ever) for the job, or no patch or transcript in it.
    Raises:
        UsageError (64): --patch with --transcript, a bad id or attempt. JobNotFound.
    """
    if patch and transcript:
        raise UsageError("give --patch or --transcript, not both")
    hub = open_hub(workspace)
    result = read_result(hub.registry, job_id, attempt)
    if result is None:
        print(f"job {job_id}: no result (a repository job sends one when its agent ends)", file=sys.stderr)
        return 1
    if patch or transcript:
        path = result.patch_path if patch else result.transcript_path
        if path is None:
            if result.summary is None:
                why = "the result is still arriving"
            elif patch:
                why = result.summary.get("note") or "no change"
            else:
                why = "its agent kept none, or it was left out: see the result's notes"
            print(f"job {job_id}: no {'patch' if patch else 'transcript'} ({why})", file=sys.stderr)
            return 1
        with open(path, "rb") as handle:
            shutil.copyfileobj(handle, sys.stdout.buffer)
        return 0
    if as_json or not sys.stdout.isatty():
        print(json.dumps(result.to_dict(), sort_keys=True))
    else:
        print(format_result(result), end="")
    return 0


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
    return subprocess.run(["git", "-C", str(repo), "-c", "core.hooksPath=/dev/null", *args], capture_output=True,
                          text=True, timeout=GIT_TIMEOUT_S, env=env, check=False)


def apply_result(registry: Registry, job_id: str, repo_path: Path, attempt: int | None = None) -> str:
    """Fetch the result's bundle into the clone at `repo_path` as branch `mam/<job_id>` (§18).

    Returns:
        the branch's head SHA.
    Raises:
        UsageError: no result or no bundle, not a git clone, a dirty clone, the base commit
        missing there, the branch exists at another commit, or git refuses the bundle (one line).
    """
    result = read_result(registry, job_id, attempt)
    if result is None or result.summary is None:
        raise UsageError(f"job {job_id} has no result to apply (yet): see `mam-orch result {job_id}`")
    summary = result.summary
    if result.bundle_path is None:
        raise UsageError(f"job {job_id}: its result holds no bundle ({summary.get('note') or 'no changes'})")
    if _git(repo_path, "rev-parse", "--git-dir").returncode != 0:
        raise UsageError(f"--repo-path {str(repo_path)!r} is not a git clone")
    dirty = _git(repo_path, "status", "--porcelain", "--untracked-files=no")
    if dirty.returncode != 0 or dirty.stdout.strip():
        raise UsageError(f"{repo_path} has uncommitted changes: commit or stash them first")
    base, head = str(summary.get("base_sha", "")), str(summary.get("head_sha", ""))
    if _git(repo_path, "cat-file", "-e", f"{base}^{{commit}}").returncode != 0:
        raise UsageError(f"{repo_path} does not have the base commit {base[:12]}: fetch "
                         f"{summary.get('ref') or 'the branch'} from the repository first")
    branch = f"mam/{job_id}"
    current = _git(repo_path, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}")
    if current.returncode == 0 and current.stdout.strip() not in (head, ""):
        raise UsageError(f"branch {branch} already exists in {repo_path} at another commit; delete it first")
    verify = _git(repo_path, "bundle", "verify", str(result.bundle_path))
    if verify.returncode != 0:
        raise UsageError(f"the bundle of job {job_id} does not verify: {_last_line(verify.stderr)}")
    source = f"refs/heads/{summary.get('branch')}"
    fetched = _git(repo_path, "fetch", "--no-tags", "--quiet", str(result.bundle_path), f"{source}:refs/heads/{branch}")
    if fetched.returncode != 0:
        raise UsageError(f"git did not take the bundle of job {job_id}: {_last_line(fetched.stderr)}")
    got = _git(repo_path, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}").stdout.strip()
    if got != head:
        raise UsageError(f"branch {branch} is at {got[:12] or 'nothing'}, not the result's head {head[:12]}")
    return head


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no reason given"


def apply_cli(job_id: str, *, workspace: Workspace, repo_path: str | None, attempt: int | None) -> int:
    """`mam-orch apply <id> [--repo-path DIR]`: the result as branch `mam/<id>` (§18). Returns 0."""
    hub = open_hub(workspace)
    path = Path(repo_path or ".").expanduser().absolute()
    head = apply_result(hub.registry, job_id, path, attempt)
    print(f"branch mam/{job_id} in {path} is at {head} (git switch mam/{job_id} to see it)")
    return 0


__all__ = ["Result", "ResultInbox", "apply_cli", "apply_result", "format_result", "read_result", "result_cli"]
