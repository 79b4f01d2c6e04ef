"""An attempt's result to the hub (PROTOCOL §18): one archive, sealed and signed in chunks.

The archive (`build_archive`: an uncompressed tar of `result.json`, the change as
`change.bundle` and `change.patch`, and the agent's artifacts under `artifacts/`) is
written to the result outbox `.mam/outbox-result/<job_id>.<attempt_id>.tar` with its
manifest beside it (`.json`: size, sha256, the next chunk to send). `ResultSender` cuts it
into 256 KiB chunks, seals and signs each (`crypto.build_result_chunk`) and publishes
them in order on `ROOT/jobs/<id>/result` (QoS 1, not retained, a few PUBACKs in flight),
retrying from the first unacknowledged chunk through broker outages (§17). The files are
removed once every chunk is acknowledged; a runner that stops first sends them at its next
start (`resend_leftovers`). The terminal event waits for the last PUBACK at most
`wait_s` while the broker is up, then carries the manifest (`data.result`, §18).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mam.shared.protocol import crypto, names
from mam.shared.protocol.errors import BrokerError, MamError
from mam.shared.protocol.wire import resultchunk
from mam.shared.store.fsio import atomic_write
from mam.shared.store.registry import Registry
from mam.shared.transport import Transport

log = logging.getLogger("mam.results")

WINDOW = 8
"""Chunks published before the first PUBACK is awaited."""
RETRY_S = 0.5
"""Pause while the connection is down, seconds."""
RECONNECT_SETTLE_S = 2.0
"""After the connection comes back, wait this long before re-sending (the hub subscribes again), seconds."""
KEEP_SENDING_S = 3600.0
"""An archive not acknowledged this long after it was written is given up (kept on disk), seconds."""
FINISH_WAIT_S = 30.0
"""How long the terminal event waits for the result's PUBACKs while the broker is up, seconds."""
FINISHED_SUFFIX = ".sent"


@dataclass(frozen=True)
class Manifest:
    """The archive as every chunk names it (§18): `size` bytes with hex SHA-256 `sha256`."""

    size: int
    sha256: str

    @property
    def chunks(self) -> int:
        return resultchunk.chunk_count(self.size)

    def data(self) -> dict[str, Any]:
        """The terminal event's `data.result` part (§18)."""
        return {"bytes": self.size, "sha256": self.sha256, "chunks": self.chunks}


def build_archive(path: Path, summary: Mapping[str, Any], files: Mapping[str, Path]) -> Manifest:
    """Write the result archive to `path` (0600) and return its manifest.

    Args:
        summary: the JSON-able `result.json` (§18 fields: repo, base/head SHA, commits, files, note, agent).
        files: archive name (`change.bundle`, `change.patch`, `artifacts/<name>`) → local file.
    Raises:
        OSError: the archive cannot be written.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    digest = hashlib.sha256()
    body = json.dumps(summary, sort_keys=True, indent=1).encode()
    with open(path, "wb", opener=lambda name, flags: os.open(name, flags, 0o600)) as out:
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo("result.json")
            info.size, info.mode, info.mtime = len(body), 0o600, int(time.time())
            tar.addfile(info, io.BytesIO(body))
            for name, source in files.items():  # never through a link the agent may have put there
                with os.fdopen(os.open(source, os.O_RDONLY | os.O_NOFOLLOW), "rb") as handle:
                    member = tarfile.TarInfo(name)
                    member.size, member.mode, member.mtime = os.fstat(handle.fileno()).st_size, 0o600, int(time.time())
                    tar.addfile(member, handle)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return Manifest(size=path.stat().st_size, sha256=digest.hexdigest())


def outbox_paths(root: Path, job_id: str, attempt_id: int) -> tuple[Path, Path]:
    """(archive, manifest) in the result outbox for one attempt (§18, §17)."""
    base = names.result_outbox_dir(root) / f"{names.validate_job_id(job_id)}.{names.validate_attempt(attempt_id)}"
    return base.with_name(base.name + ".tar"), base.with_name(base.name + ".json")


class ResultSender:
    """Sends result archives from the outbox, one thread per archive (§18).

    Args:
        root: the runner's root; client: the daemon's connection.
    """

    def __init__(self, *, root: Path, client: Transport) -> None:
        self.root, self.client = Path(root), client
        self._stop = threading.Event()

    def send(self, *, job_id: str, attempt_id: int, auth_token: str, archive: Path, manifest: Manifest,
             wait_s: float = FINISH_WAIT_S) -> bool:
        """Send one attempt's archive (already at `outbox_paths(...)[0]`); wait until every chunk
        is acknowledged, at most `wait_s` while connected. Returns True when all were; the
        rest goes on in the background."""
        _, state = outbox_paths(self.root, job_id, attempt_id)
        _write_state(state, manifest, next_chunk=0)
        done = threading.Event()
        thread = threading.Thread(target=self._send, name=f"result-send-{job_id}",
                                  args=(job_id, attempt_id, auth_token, archive, manifest, 0, done.set), daemon=True)
        thread.start()
        deadline = time.monotonic() + wait_s
        while not done.is_set() and time.monotonic() < deadline:
            if not self.client.connected.is_set() and not self.client.connected.wait(RETRY_S):
                break  # broker down: the terminal event is not held up; the thread goes on
            done.wait(RETRY_S)
        if not done.is_set():
            log.warning("job %s: result of attempt %d not acknowledged yet; sent after the terminal event",
                        job_id, attempt_id)
        return done.is_set()

    def stop(self) -> None:
        """Stop sending (the runner stops); what is unsent stays in the outbox for the next start."""
        self._stop.set()

    def resend_leftovers(self, registry: Registry) -> None:
        """Archives a stopped runner left in the outbox: sent from their next chunk once the
        connection is up, on daemon threads (§17)."""
        folder = names.result_outbox_dir(self.root)
        try:
            states = sorted(folder.glob("*.json"))
        except OSError:
            return
        for state in states:
            try:
                job_id, attempt = state.stem.split(".")
                attempt_id = int(attempt)
                saved = json.loads(state.read_text())
                manifest, next_chunk = Manifest(int(saved["size"]), str(saved["sha256"])), int(saved["next_chunk"])
                token = registry.get(job_id)["auth_token"]
            except (OSError, ValueError, KeyError, TypeError, MamError) as exc:
                log.warning("result outbox: %s skipped: %s", state.name, exc)
                continue
            archive = state.with_suffix(".tar")
            threading.Thread(target=self._send, name=f"result-resend-{job_id}", daemon=True,
                             args=(job_id, attempt_id, token, archive, manifest, next_chunk, lambda: None)).start()

    # ------------------------------------------------------------ the sending thread

    def _send(self, job_id: str, attempt_id: int, token: str, archive: Path, manifest: Manifest, first: int,
              done: Callable[[], None]) -> None:
        try:
            if self._send_all(job_id, attempt_id, token, archive, manifest, first):
                for path in outbox_paths(self.root, job_id, attempt_id):
                    path.unlink(missing_ok=True)
                log.info("job %s: result of attempt %d sent (%d bytes, %d chunks)", job_id, attempt_id,
                         manifest.size, manifest.chunks)
                done()
        except Exception as exc:  # the job never fails because of its result stream
            log.error("job %s: result stream stopped: %s: %s", job_id, type(exc).__name__, exc)

    def _send_all(self, job_id: str, attempt_id: int, token: str, archive: Path, manifest: Manifest,
                  first: int) -> bool:
        key = crypto.result_key(token)
        topic = names.result_topic(job_id, self.client.config.topic_root)
        _, state = outbox_paths(self.root, job_id, attempt_id)
        give_up_at = time.monotonic() + KEEP_SENDING_S
        chunk, was_down = first, False
        with open(archive, "rb") as handle:
            while chunk < manifest.chunks:
                if self._stop.is_set():
                    return False
                if time.monotonic() > give_up_at:
                    log.error("job %s: result not acknowledged in %g s; it stays in %s", job_id, KEEP_SENDING_S,
                              archive)
                    return False
                if not self.client.connected.is_set():
                    was_down = True
                    self._stop.wait(RETRY_S)
                    continue
                if was_down:  # back after an outage: let the hub subscribe again first
                    was_down = False
                    self._stop.wait(RECONNECT_SETTLE_S)
                try:
                    chunk = self._send_window(handle, job_id, attempt_id, token, key, topic, manifest, chunk)
                except BrokerError as exc:
                    log.debug("job %s: result chunk %d not acknowledged yet: %s", job_id, chunk, exc)
                    was_down = True
                    self._stop.wait(RETRY_S)
                    continue
                _write_state(state, manifest, next_chunk=chunk)
        return True

    def _send_window(self, handle: Any, job_id: str, attempt_id: int, token: str, key: bytes, topic: str,
                     manifest: Manifest, first: int) -> int:
        """Publish up to WINDOW chunks from `first`, wait for their PUBACKs; the next chunk to send.

        Raises:
            BrokerError: a publish failed (resend from `first`).
        """
        waits = []
        last = min(manifest.chunks, first + WINDOW)
        for chunk in range(first, last):
            handle.seek(chunk * resultchunk.MAX_CHUNK_BYTES)
            plaintext = handle.read(resultchunk.MAX_CHUNK_BYTES)
            raw = crypto.build_result_chunk(token, key, job_id=job_id, attempt_id=attempt_id, chunk=chunk,
                                            size=manifest.size, sha256=manifest.sha256, plaintext=plaintext)
            waits.append(self.client.publish_async(topic, raw, retain=False))
        for wait in waits:
            wait()
        return last


def _write_state(path: Path, manifest: Manifest, *, next_chunk: int) -> None:
    """The outbox manifest: what a restarted runner needs to go on (never raises)."""
    try:
        atomic_write(path, json.dumps({"size": manifest.size, "sha256": manifest.sha256,
                                       "next_chunk": next_chunk}).encode(), what="result outbox state")
    except (OSError, MamError) as exc:
        log.warning("result outbox state %s not written: %s", path.name, exc)


__all__ = ["FINISH_WAIT_S", "Manifest", "ResultSender", "build_archive", "outbox_paths"]
