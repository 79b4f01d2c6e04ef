"""What one attempt works in and reports beyond its exit status (PROTOCOL §18).

`AttemptWork` is made by the supervisor for each attempt it runs:

1. `prepare()` (before `started`): for a repository job, fetch the runner's mirror,
   resolve the dispatch's ref to a commit and add a worktree for this attempt on branch
   `mam/<job_id>-<attempt>`; returns `started`'s data (repo, ref, sha, branch). A dispatch
   with `work.resume` continues an earlier attempt (§18 "Continued sessions"): the
   worktree starts where that attempt's branch ended and the agent resumes its session,
   where this runner has them; otherwise the attempt starts fresh and `started` says why.
2. `argv()`, `cwd()`, `env()`: the agent's command line through its adapter (`agents`:
   Claude Code, Codex, or a plain command), its working directory (the worktree) and
   `MAM_ARTIFACTS_DIR`; `stdin()` the brief as the agent reads it.
3. `poll()` while it runs: the adapter reads the agent's new output lines; a budget the
   CLI cannot enforce itself is enforced here.
4. `outcome()` and `finish()` when it ended: the adapter's verdict (a permission denial
   is `error`, never `completed`), the agent's figures for the terminal event, and the
   result archive (the change and the artifacts, `results.build_archive`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import stat
import sys
import zlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mam.runner import agents, permission_tool, repos
from mam.runner.logstream import Masker
from mam.runner.results import Manifest, build_archive, outbox_paths
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import SignatureError

log = logging.getLogger("mam.work")

ARTIFACTS_ENV = "MAM_ARTIFACTS_DIR"
MAX_ARTIFACT_FILES = 64
MAX_ARTIFACTS_BYTES = 20 << 20
"""Artifacts of one attempt sent at most, bytes in all (§18); beyond, the rest is left out and said."""
READ_BYTES = 1 << 20
MAX_LINE_BYTES = 1 << 20
"""An output line longer than this is not given to the adapter (no stream message is that long)."""
RESULT_TEXT_CHARS = 4000
MAX_TRANSCRIPT_BYTES = 32 << 20
"""An agent's session transcript sent with the result at most, bytes (§18); a longer one is left out and said."""


class LineFollower:
    """The complete new lines of a growing file from `offset` (the agent's log, §11).
    A line over MAX_LINE_BYTES is left out and counted in `skipped`."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path, self.offset = path, offset
        self.skipped = 0
        self._partial = b""
        self._skipping = False

    def read(self, *, final: bool = False) -> list[str]:
        """The new complete lines up to the file's end (with `final`, the unterminated tail
        too), read READ_BYTES at a time; never raises."""
        lines: list[str] = []
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                while data := handle.read(READ_BYTES):
                    self.offset += len(data)
                    self._split(self._partial + data, lines)
        except OSError:
            pass
        if final and self._partial:
            if not self._skipping:
                lines.append(self._partial.decode("utf-8", "replace"))
            self._partial, self._skipping = b"", False
        return lines

    def _split(self, buf: bytes, lines: list[str]) -> None:
        parts = buf.split(b"\n")
        self._partial = parts.pop()
        for part in parts:
            if self._skipping:  # the end of an over-long line
                self._skipping = False
            elif len(part) <= MAX_LINE_BYTES:
                lines.append(part.decode("utf-8", "replace"))
            else:
                self.skipped += 1
        if len(self._partial) > MAX_LINE_BYTES:
            if not self._skipping:
                self.skipped += 1
            self._partial, self._skipping = b"", True


@dataclass(frozen=True)
class Collected:
    """An attempt's result archive in the outbox and what the terminal event says of it (§18)."""

    archive: Path
    manifest: Manifest
    data: dict[str, Any]


class AttemptWork:
    """One attempt's worktree, agent adapter and result (§18).

    Args:
        job_id, attempt_id: the attempt; work: the dispatch's `work` (None: a plain job).
        root: the runner's root; mirrors: the runner's repositories (`repos.Repos`).
        exec_argv: the agent's command; log_path/log_offset: the agent's output file and
        where this attempt's output starts; session: the runner's session (the fallback
        committer `mam-runner@<session>`).
        secrets: values masked in the result text (as in the log stream, §15).
        agent: the adapter's kind (`agents.KINDS`).
        ask_socket: the daemon's socket listens, so the agent can ask a person (§19): the
            claude agent gets the MCP permission tool (`permission_tool`).
        workdir: where the agent of a job without a repository runs.
        environ: the environment the agent inherits (where its CLI keeps its sessions).
        auth_token: this attempt's token, which opens a transcript or a bundle the hub carried (§18).
    """

    def __init__(self, *, job_id: str, attempt_id: int, work: wire.Work | None, root: Path,
                 mirrors: repos.Repos, exec_argv: Iterable[str], log_path: Path,
                 log_offset: int, secrets: Iterable[str] = (), session: str = "runner",
                 agent: str = "command", ask_socket: bool = False, workdir: Path | None = None,
                 environ: Mapping[str, str] | None = None, auth_token: str = "") -> None:
        self.job_id, self.attempt_id, self.work, self.root = job_id, attempt_id, work, root
        self.session = session
        self.mirrors = mirrors
        self.exec_argv = list(exec_argv)
        self.adapter = agents.new_adapter(agent, agents.AgentPolicy.of_work(work))
        self.log_path, self.log_offset = log_path, log_offset
        self.follower = LineFollower(log_path, log_offset)
        self._skipped_seen = 0
        self.secrets = list(secrets)
        self.worktree: repos.Worktree | None = None
        self.started_from: wire.Base | None = None  # §18: the other job's result the worktree started at
        self.artifacts_dir = root / "artifacts" / f"{job_id}-{attempt_id}"
        self.ask_socket = ask_socket
        self.mcp_config = names.run_dir(root) / f"mcp-{job_id}-{attempt_id}.json"
        self.workdir = workdir or root / "work" / job_id
        self.environ = os.environ if environ is None else environ
        self.auth_token = auth_token
        self.takes_input = self.adapter.takes_input(self.exec_argv)  # §18 "Input while it runs"

    # ------------------------------------------------------------ before the agent

    def prepare(self) -> dict[str, Any]:
        """Fetch, resolve and add this attempt's worktree (a repository job); `started`'s data.

        Returns:
            {"agent": kind}; for a repository job {"repo", "ref", "sha", "branch"}, and
            `from_result` {"job_id", "attempt", "head_sha"} when it starts at another job's result;
            with `work.resume`, `continues` {"session_id", "attempt"} or `fresh` (why not, one line).
        Raises:
            RepoError: the fetch failed, the ref does not exist, or git refused the worktree (one line).
        """
        data: dict[str, Any] = {"agent": self.adapter.kind}
        if self.takes_input:
            data["takes_input"] = True
        if ignored := self.adapter.ignored():
            log.warning("job %s: %s of the dispatch not applied: this runner's agent is %s (--agent)", self.job_id,
                        ", ".join(ignored), self.adapter.kind)
        shutil.rmtree(self.artifacts_dir, ignore_errors=True)
        self.artifacts_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.ask_socket and isinstance(self.adapter, agents.ClaudeAdapter) \
                and "--permission-prompt-tool" not in self.exec_argv:
            self.mcp_config.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with os.fdopen(os.open(self.mcp_config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
                json.dump(permission_tool.mcp_config(sys.executable), out)
            self.adapter.ask_person(self.mcp_config)  # §19: a person answers what no policy allows
        resume = self.work.resume if self.work is not None else None
        new_worktree: str | None = None  # why the worktree does not continue the resumed attempt's
        if self.work is not None and self.work.repo is not None:
            new_worktree = self._add_worktree(self.work.repo, resume)
            wt = self.worktree
            assert wt is not None
            data.update({"repo": wt.repo, "ref": wt.ref, "sha": wt.base_sha, "branch": wt.branch})
            if self.started_from is not None:
                base = self.started_from
                data["from_result"] = {"job_id": base.job_id, "attempt": base.attempt, "head_sha": base.head_sha}
        if resume is not None:
            # the session continues where its transcript is: here, or carried by the hub (then even
            # in a new worktree, as after a move to another runner)
            why_fresh = new_worktree if new_worktree is not None and resume.transcript is None else \
                self.adapter.continue_session(resume.session_id, self.cwd(), self.environ,
                                              functools.partial(self._carried, resume))
            if why_fresh is None:
                log.info("job %s: attempt %d continues session %s of attempt %d%s", self.job_id, self.attempt_id,
                         resume.session_id, resume.attempt, f" in a new worktree ({new_worktree})" if new_worktree
                         else "")
                data["continues"] = {"session_id": resume.session_id, "attempt": resume.attempt}
                if self.adapter.transcript_carried:
                    data["continues"]["transcript"] = "carried"
                if new_worktree is not None:
                    data["new_worktree"] = new_worktree
            else:
                log.warning("job %s: attempt %d starts a new session: %s", self.job_id, self.attempt_id, why_fresh)
                data["fresh"] = why_fresh
        return data

    def _carried(self, resume: wire.Resume) -> bytes | None:
        """The session transcript the hub carried in `resume` (§18 "Transcripts"), opened with
        this attempt's token and decompressed; None when there is none or it is unusable (logged)."""
        if resume.transcript is None:
            return None
        try:
            packed = crypto.open_transcript(self.auth_token, resume.transcript, job_id=self.job_id,
                                            attempt_id=self.attempt_id, session_id=resume.session_id)
            inflater = zlib.decompressobj()
            data = inflater.decompress(packed, MAX_TRANSCRIPT_BYTES + 1)
        except (SignatureError, zlib.error) as exc:
            log.warning("job %s: the transcript carried for session %s is refused: %s", self.job_id,
                        resume.session_id, exc)
            return None
        if len(data) > MAX_TRANSCRIPT_BYTES or inflater.unconsumed_tail:
            log.warning("job %s: the transcript carried for session %s is refused: over %d MiB unpacked",
                        self.job_id, resume.session_id, MAX_TRANSCRIPT_BYTES >> 20)
            return None
        return data

    def _carried_bundle(self, base: wire.Base) -> bytes | None:
        """The bundle the hub carried in `base` (§18), opened with this attempt's token; None
        when it carried none (no commit to hand on, or this runner has them).

        Raises:
            RepoError: it does not open (another attempt's, tampered).
        """
        if base.bundle is None:
            return None
        try:
            return crypto.open_bundle(self.auth_token, base.bundle, job_id=self.job_id, attempt_id=self.attempt_id,
                                      from_job=base.job_id, head_sha=base.head_sha)
        except SignatureError:
            raise repos.RepoError(f"job {self.job_id}: the change of job {base.job_id} it starts from does not "
                                  "open with this attempt's key") from None

    def _add_worktree(self, name: str, resume: wire.Resume | None) -> str | None:
        """Fetch and add this attempt's worktree: where `resume`'s attempt ended when this runner
        still has its branch, else at the head of the result `work.base` names (§18 "Handing a
        change on"), else at the dispatch's ref. Returns why it did not continue, or None.

        Raises:
            RepoError: one line (the fetch, the ref, the carried change, the worktree).
        """
        self.mirrors.prepare(name)
        ref, sha = self.mirrors.resolve(name, self.work.ref if self.work is not None else None)
        why_fresh: str | None = None
        if resume is not None:
            head = self.mirrors.attempt_head(name, self.job_id, resume.attempt, resume.base_sha) \
                if resume.base_sha is not None else None
            if head is not None and resume.base_sha is not None:
                self.worktree = self.mirrors.add_worktree(name, head, self.job_id, self.attempt_id, ref,
                                                          base_sha=resume.base_sha)
                log.info("job %s: worktree %s continues attempt %d at %s (base %s)", self.job_id,
                         self.worktree.path, resume.attempt, head[:12], resume.base_sha[:12])
                return None
            why_fresh = f"attempt {resume.attempt}'s worktree is not on this runner"
        base = self.work.base if self.work is not None else None
        if base is not None:
            source = repos.worktree_key(base.job_id, base.attempt)
            self.mirrors.take_change(name, self._carried_bundle(base), base.head_sha, source)
            self.worktree = self.mirrors.add_worktree(name, base.head_sha, self.job_id, self.attempt_id, ref,
                                                      base_sha=base.base_sha)
            self.started_from = base
            log.info("job %s: worktree %s starts from the result of job %s attempt %d at %s (base %s)", self.job_id,
                     self.worktree.path, base.job_id, base.attempt, base.head_sha[:12], base.base_sha[:12])
            return why_fresh
        self.worktree = self.mirrors.add_worktree(name, sha, self.job_id, self.attempt_id, ref)
        log.info("job %s: worktree %s at %s (%s of repo %s)", self.job_id, self.worktree.path, sha[:12], ref, name)
        return why_fresh

    def argv(self) -> list[str]:
        """The agent's command line (the adapter adds its machine-readable output flags)."""
        return self.adapter.argv(self.exec_argv)

    def stdin(self, text: str) -> str:
        """The brief, or a person's message, as the agent reads it on stdin."""
        return self.adapter.message(text) if self.takes_input else text

    def turn_over(self) -> bool:
        """True once the agent's stream shows it finished what it was asked (or a line of it
        could not be read): its stdin is closed then, and further messages are refused."""
        return self.adapter.turn_ended() or self.follower.skipped > 0

    def cwd(self) -> Path:
        """The worktree of a repository job, else `workdir`."""
        return self.worktree.path if self.worktree is not None else self.workdir

    def env(self) -> dict[str, str]:
        """What the agent's environment gains: MAM_ARTIFACTS_DIR and, for a repository job,
        MAM_REPO, MAM_BASE_SHA and, on a host where git knows no committer, the runner's
        own (`mam-runner`), so that the agent's `git commit` works there too; and what the
        adapter's flags need (`Adapter.env`)."""
        env = {ARTIFACTS_ENV: str(self.artifacts_dir), **self.adapter.env(self.environ)}
        if self.worktree is not None:
            env.update({"MAM_REPO": self.worktree.repo, "MAM_BASE_SHA": self.worktree.base_sha})
            if not repos.has_identity(self.worktree.path, os.environ):
                env.update(repos.runner_identity(self.session))
        return env

    # ------------------------------------------------------------ while and after

    def poll(self) -> str | None:
        """Give the adapter the agent's new output; the budget it found spent, or None."""
        self._feed(self.follower.read())
        return self.adapter.over_budget()

    def _feed(self, lines: list[str]) -> None:
        for line in lines:
            self.adapter.feed(line)
        if self.adapter.kind != "command" and self.follower.skipped > self._skipped_seen:
            log.warning("job %s: %d output line(s) over %d bytes not read as the agent's stream", self.job_id,
                        self.follower.skipped - self._skipped_seen, MAX_LINE_BYTES)
            self.adapter.note_unreadable(count=self.follower.skipped - self._skipped_seen)
            self._skipped_seen = self.follower.skipped

    def session_id(self) -> str | None:
        """The agent session the stream named so far (`names.AGENT_SESSION_RE`), or None."""
        session = self.adapter.report().session_id
        return session if session is not None and names.AGENT_SESSION_RE.fullmatch(session) else None

    def transcript_path(self) -> Path | None:
        """Where the agent keeps its session's transcript on this host, once it exists (§18)."""
        return self.adapter.transcript(self.cwd(), self.environ)

    def outcome(self, exit_code: int | None, decided: Collection[str] = ()) -> tuple[str, str] | None:
        """After the agent exited: (event, detail) when its own stream says otherwise than its
        exit status (a permission denial no person decided, `decided` (§19); an API error),
        else None."""
        self._feed(self.follower.read(final=True))
        self.mcp_config.unlink(missing_ok=True)  # the CLI and its permission tool are gone
        verdict = self.adapter.report().outcome(exit_code, decided)
        if verdict is None:
            return None
        event, detail = verdict
        return event, wire.safe_line(self._mask(detail), wire.MAX_DETAIL_CHARS)

    def summary(self) -> str | None:
        """The agent's final answer as a `completed` event's detail: masked, one line, capped (§18)."""
        text = self.result_text()
        return wire.safe_line(text, wire.MAX_DETAIL_CHARS) or None if text else None

    def agent_data(self) -> dict[str, Any]:
        """The agent's figures for the terminal event (session id, turns, tokens, cost; §18)."""
        if self.adapter.kind == "command":
            return {}
        return {"agent": self.adapter.report().data()}

    def result_text(self) -> str | None:
        """The agent's final answer, masked and capped (the result's summary)."""
        text = self.adapter.report().result_text
        return self._mask(text)[:RESULT_TEXT_CHARS] if text else None

    def finish(self, *, session: str, max_result_bytes: int) -> Collected | None:
        """Commit what the agent left, build the result archive in the outbox (§18).

        Returns:
            the archive and the terminal event's `data.result`, or None when there is
            nothing to send (no repository and no artifacts).
        Raises:
            RepoError: git failed on the worktree; OSError: the archive cannot be written.
        """
        staging = self.root / "results" / f"{self.job_id}-{self.attempt_id}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            summary: dict[str, Any] = {"job_id": self.job_id, "attempt_id": self.attempt_id}
            files: dict[str, Path] = {}
            notes: list[str] = []
            transcript = self._transcript(staging, notes)
            if transcript is not None:
                files[f"{names.TRANSCRIPT_DIR}/{transcript.name}"] = transcript
                summary["transcript"] = {"session_id": transcript.stem, "bytes": transcript.stat().st_size}
            if self.worktree is not None:
                change = repos.collect_result(self.worktree, job_id=self.job_id, attempt_id=self.attempt_id,
                                              session=session, out_dir=staging, max_bytes=max_result_bytes)
                summary.update(change.to_dict())
                summary["branch"] = self.worktree.branch
                if change.bundle is not None:
                    files["change.bundle"] = change.bundle
                if change.patch is not None:
                    files["change.patch"] = change.patch
                self.mirrors.finish(self.worktree)
            artifacts, skipped = collect_artifacts(self.artifacts_dir)
            files.update({f"artifacts/{name}": path for name, path in artifacts.items()})
            notes += skipped
            if self.worktree is None and not artifacts and transcript is None:
                return None
            agent = self.adapter.report().data() if self.adapter.kind != "command" else {}
            text = self.result_text()
            if text:
                agent["result_text"] = text
            summary.update({"agent": agent, "artifacts": sorted(artifacts), "artifact_notes": notes})
            archive, _ = outbox_paths(self.root, self.job_id, self.attempt_id)
            manifest = build_archive(archive, summary, files)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(self.artifacts_dir, ignore_errors=True)
        data: dict[str, Any] = manifest.data()
        for key in ("base_sha", "head_sha", "files_total", "insertions", "deletions", "commits_total", "note"):
            if summary.get(key) is not None:
                data[key] = summary[key]
        return Collected(archive=archive, manifest=manifest, data=data)

    def _transcript(self, staging: Path, notes: list[str]) -> Path | None:
        """A masked copy in `staging` of the agent's session transcript (§18 "Transcripts"), or
        None: the agent kept none, or it is over MAX_TRANSCRIPT_BYTES or unreadable (noted)."""
        source, session = self.transcript_path(), self.session_id()
        if source is None or session is None:
            return None
        target = staging / f"{session}.jsonl"  # the hub's name for it, whatever the agent's
        try:
            copied = masked_copy(source, target, self.secrets, MAX_TRANSCRIPT_BYTES)
        except OSError as exc:
            notes.append(f"transcript left out: {exc.strerror or exc}")
            return None
        if copied is None:
            notes.append(f"transcript left out: over {MAX_TRANSCRIPT_BYTES >> 20} MiB")
            target.unlink(missing_ok=True)
            return None
        return target

    def _mask(self, text: str) -> str:
        return Masker(self.secrets).feed(text.encode("utf-8", "replace"), final=True).decode("utf-8", "replace")


def masked_copy(source: Path, target: Path, secrets: Iterable[str], max_bytes: int) -> int | None:
    """Copy `source` (never through a link) to `target` (0600) with every form of `secrets`
    masked as in the log stream (§15). Returns the bytes written, or None when `source` is
    over `max_bytes` (`target` then partial). Raises OSError."""
    masker, read, written = Masker(secrets), 0, 0
    with open(source, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NOFOLLOW)) as src, \
            open(target, "wb", opener=lambda name, flags: os.open(name, flags, 0o600)) as out:
        for block in iter(lambda: src.read(1 << 20), b""):
            read += len(block)
            if read > max_bytes:
                return None
            written += out.write(masker.feed(block))
        written += out.write(masker.feed(b"", final=True))
    return written


def collect_artifacts(folder: Path) -> tuple[dict[str, Path], list[str]]:
    """The regular files directly in `folder` that may travel (§18): names matching
    `names.ARTIFACT_RE`, at most MAX_ARTIFACT_FILES and MAX_ARTIFACTS_BYTES in all (in name
    order: the first ones are kept, the rest noted `artifacts_too_large`); links, folders,
    devices and bad names are left out. Returns (name → path, notes on what was left out)."""
    found: dict[str, Path] = {}
    notes: list[str] = []
    total, full = 0, False
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):  # the agent replaced the folder with a link
            return found, ["artifacts folder left out: not a folder"]
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return found, notes
    for entry in entries:
        try:
            mode = entry.stat(follow_symlinks=False).st_mode
        except OSError:
            continue
        shown = entry.name[:60].encode("unicode_escape").decode()
        if not stat.S_ISREG(mode):
            notes.append(f"artifact {shown!r} left out: not a regular file")
        elif not names.ARTIFACT_RE.fullmatch(entry.name):
            notes.append(f"artifact {shown!r} left out: its name is not allowed")
        elif len(found) >= MAX_ARTIFACT_FILES:
            notes.append(f"artifact {shown!r} left out: more than {MAX_ARTIFACT_FILES} files")
        elif full or total + entry.stat(follow_symlinks=False).st_size > MAX_ARTIFACTS_BYTES:
            full = True  # the first ones are kept, in name order
            notes.append(f"artifacts_too_large: {shown!r} left out, over {MAX_ARTIFACTS_BYTES} bytes in all")
        else:
            total += entry.stat(follow_symlinks=False).st_size
            found[entry.name] = Path(entry.path)
    return found, notes


__all__ = ["ARTIFACTS_ENV", "AttemptWork", "Collected", "LineFollower", "collect_artifacts"]
