"""A §18 result at a hub without a runner: an archive built as a runner builds it
(`build_archive`), cut into signed, sealed chunks with the job's auth token and handed to
the hub's `ResultInbox`, as the service does with chunks off the wire."""

from __future__ import annotations

import hashlib
from pathlib import Path

from mam.orchestrator.results import ResultInbox
from mam.runner.results import build_archive
from mam.shared.protocol import crypto
from mam.shared.protocol.wire import resultchunk
from mam.shared.store.registry import Registry

PATCH = b"diff --git a/NOTES.md b/NOTES.md\n+notes\n"
SUMMARY = {"repo": "demo", "ref": "main", "base_sha": "a" * 40, "head_sha": "b" * 40, "commits": [],
           "commits_total": 1, "files": [{"path": "NOTES.md", "added": 1, "deleted": 0}], "files_total": 1,
           "insertions": 1, "deletions": 0, "note": None}


def deliver_result(registry: Registry, job_id: str, scratch: Path, *, patch: bytes | None = PATCH,
                   attempt_id: int = 1, artifacts: dict[str, bytes] | None = None,
                   transcript: tuple[str, bytes] | None = None) -> None:
    """Land a result for `job_id` at the hub of `registry`: SUMMARY with `patch` as its
    change.patch, or with no patch and the note `no_changes`; `artifacts` by name;
    `transcript` as (session id, its JSON lines)."""
    scratch.mkdir(parents=True, exist_ok=True)
    files = {}
    if transcript is not None:
        (scratch / "transcript.jsonl").write_bytes(transcript[1])
        files[f"transcript/{transcript[0]}.jsonl"] = scratch / "transcript.jsonl"
    for name, data in (artifacts or {}).items():
        (scratch / f"artifact-{name}").write_bytes(data)
        files[f"artifacts/{name}"] = scratch / f"artifact-{name}"
    if patch is not None:
        (scratch / "change.patch").write_bytes(patch)
        files["change.patch"] = scratch / "change.patch"
    build_archive(scratch / "a.tar", dict(SUMMARY, note=None if patch is not None else "no_changes"), files)
    archive = (scratch / "a.tar").read_bytes()
    token = registry.get(job_id)["auth_token"]
    digest, step = hashlib.sha256(archive).hexdigest(), resultchunk.MAX_CHUNK_BYTES
    inbox = ResultInbox(registry)
    for n in range(resultchunk.chunk_count(len(archive))):
        inbox.handle(crypto.build_result_chunk(token, crypto.result_key(token), job_id=job_id,
                                               attempt_id=attempt_id, chunk=n, size=len(archive), sha256=digest,
                                               plaintext=archive[n * step:(n + 1) * step]))
