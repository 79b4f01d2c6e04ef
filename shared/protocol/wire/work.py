"""The `work` object of a dispatch (PROTOCOL §18): the repository the job works on and
what its agent may do. Optional: a dispatch without it is a plain command job, as before.

    {"repo": "demo", "ref": "main", "max_turns": 20, "max_cost_usd": 2.5,
     "allow_tools": ["Bash(git *)", "Edit"], "permission_mode": "acceptEdits",
     "ask_timeout_s": 600, "on_ask_timeout": "cancel",
     "resume": {"session_id": "8d99b0b5-...", "attempt": 1, "base_sha": "<40 hex>",
                "transcript": {"alg": "A256GCM", "nonce": "...", "ciphertext": "..."}},
     "base": {"job_id": "a1b2c3d4", "attempt": 1, "base_sha": "<40 hex>", "head_sha": "<40 hex>",
              "bundle": {"alg": "A256GCM", "nonce": "...", "ciphertext": "..."}}}

Every key is optional and absent when unset (never null). The dispatch signature covers
it (§5); it is not sealed (the brief is the secret, and the repository names are in the
runners' presence anyway) except a carried transcript and a carried bundle, each sealed to
the attempt on its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mam.shared.protocol import names
from mam.shared.protocol.errors import DecodeError, UsageError
from mam.shared.protocol.wire.fields import Invalid, check_sealed, run_check, show, type_name

WORK_FIELDS = frozenset({"repo", "ref", "max_turns", "max_cost_usd", "allow_tools", "deny_tools",
                         "permission_mode", "ask_timeout_s", "on_ask_timeout", "resume",
                         "memory_bytes", "cpus", "pids", "gpus", "base"})
RESUME_FIELDS = frozenset({"session_id", "attempt", "base_sha", "transcript"})
BASE_FIELDS = frozenset({"job_id", "attempt", "base_sha", "head_sha", "bundle"})
MAX_BUNDLE_SEALED_CHARS = 256 * 1024
"""A carried bundle's ciphertext at most, base64url characters (§18 "Handing a change on"):
with the largest brief and a carried transcript the dispatch stays under its 1 MiB cap."""
MAX_CARRIED_BUNDLE_BYTES = 192 * 1024
"""The largest `change.bundle` a dispatch carries, bytes (sealed, it stays under MAX_BUNDLE_SEALED_CHARS)."""
MAX_TRANSCRIPT_SEALED_CHARS = 384 * 1024
"""A carried transcript's ciphertext at most, base64url characters (§18 "Transcripts"): with the
largest brief the dispatch stays under its 1 MiB cap."""


@dataclass(frozen=True)
class Resume:
    """Continue an earlier attempt's agent session (§18 "Continued sessions").

    Attributes:
        session_id: the agent CLI's session id that attempt reported (`names.AGENT_SESSION_RE`).
        attempt: the attempt whose worktree (`mam/<job_id>-<attempt>`) and session to go on from.
        base_sha: the job's base commit (its result is the change since it); only with a repo.
        transcript: the session's transcript as the hub holds it, zlib-compressed and sealed
            to this attempt (`crypto.seal_transcript`), for a runner that lacks it; or None.
    """

    session_id: str
    attempt: int
    base_sha: str | None = None
    transcript: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        run_check(self._check)

    def _check(self) -> None:
        try:
            names.validate_agent_session_id(self.session_id)
            names.validate_attempt(self.attempt)
            if self.base_sha is not None:
                names.validate_sha(self.base_sha, "resume.base_sha")
        except UsageError as exc:
            raise Invalid(str(exc)) from None
        if self.transcript is not None:
            check_sealed(self.transcript, MAX_TRANSCRIPT_SEALED_CHARS, "§18: a carried transcript is sealed",
                         "resume.transcript")

    def to_dict(self) -> dict[str, Any]:
        """The wire object (`base_sha` only when set)."""
        out: dict[str, Any] = {"session_id": self.session_id, "attempt": self.attempt}
        if self.base_sha is not None:
            out["base_sha"] = self.base_sha
        if self.transcript is not None:
            out["transcript"] = dict(self.transcript)
        return out


@dataclass(frozen=True)
class Base:
    """Start from another job's result (§18 "Handing a change on", `dispatch --from-result`).

    Attributes:
        job_id: the job whose result it starts from; attempt: that job's attempt with the result.
        base_sha: that result's base (this job's change is counted from it too).
        head_sha: that result's head: the worktree starts there.
        bundle: that result's `change.bundle` (git bundle of base..head), sealed to this attempt
            (`crypto.seal_bundle`); None when head_sha is base_sha (no commit to carry). A
            record holds the base without it: the hub seals it into each attempt's dispatch.
    """

    job_id: str
    attempt: int
    base_sha: str
    head_sha: str
    bundle: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        run_check(self._check)

    def _check(self) -> None:
        try:
            names.validate_job_id(self.job_id)
            names.validate_attempt(self.attempt)
            names.validate_sha(self.base_sha, "base.base_sha")
            names.validate_sha(self.head_sha, "base.head_sha")
        except UsageError as exc:
            raise Invalid(str(exc)) from None
        if self.bundle is not None:
            check_sealed(self.bundle, MAX_BUNDLE_SEALED_CHARS, "§18: a carried bundle is sealed", "base.bundle")

    def to_dict(self) -> dict[str, Any]:
        """The wire object (`bundle` only when set)."""
        out: dict[str, Any] = {"job_id": self.job_id, "attempt": self.attempt, "base_sha": self.base_sha,
                               "head_sha": self.head_sha}
        if self.bundle is not None:
            out["bundle"] = dict(self.bundle)
        return out


def _check_object(obj: object, name: str, fields: frozenset[str]) -> Mapping[str, Any]:
    """`obj` when it is an object of `fields` only; `name` (e.g. `work.resume`) in the message."""
    if not isinstance(obj, Mapping):
        raise Invalid(f"{name} must be an object, got {type_name(obj)} {show(obj)}")
    unknown = sorted(str(key) for key in obj.keys() - fields)
    if unknown:
        raise Invalid(f"unknown field {', '.join(show(f'{name}.{key}') for key in unknown[:4])}")
    return obj


def _resume_from(obj: object) -> Resume:
    obj = _check_object(obj, "work.resume", RESUME_FIELDS)
    if "session_id" not in obj or "attempt" not in obj:
        raise Invalid("work.resume needs session_id and attempt")
    return Resume(**dict(obj))


def _base_from(obj: object) -> Base:
    obj = _check_object(obj, "work.base", BASE_FIELDS)
    missing = sorted(BASE_FIELDS - {"bundle"} - set(obj))
    if missing:
        raise Invalid(f"work.base needs {', '.join(missing)}")
    return Base(**dict(obj))


POLICY_FIELDS = ("max_turns", "max_cost_usd", "allow_tools", "deny_tools", "permission_mode")


@dataclass(frozen=True)
class Work:
    """A job's repository and its agent's policy (§18).

    Attributes:
        repo: the repository name a runner must serve (`names.validate_repo`), or None.
        ref: the branch, tag or commit to start from (None: the remote's default branch); only with `repo`.
        max_turns: the agent's model turns at most (1..1000), or None.
        max_cost_usd: what the agent may spend at most, US dollars (0 < x <= 10000), or None.
        allow_tools: tool rules the agent may use without asking (`Bash(git *)`, `Edit`); () = none.
        deny_tools: tool rules it may never use, asking nobody (they win over `allow_tools`); () = none.
        permission_mode: the agent CLI's permission mode (`names.PERMISSION_MODES`), or None.
        ask_timeout_s: how long a permission request waits for a person, seconds (§19; None:
            `names.DEFAULT_ASK_TIMEOUT_S`).
        on_ask_timeout: `deny` the request (None: the default) or `cancel` the job then (§19).
        resume: the earlier attempt whose agent session this one continues (§18), or None.
        memory_bytes, cpus, pids: the job's resource limits where the runner's host gives the
            cgroup controllers (§6 "Limits"): bytes (4 MiB..16 TiB), CPUs (0.01..1024),
            processes (8..4194304); None: no limit.
        gpus: how many of a runner's GPUs the job needs (1..64, §14 "GPUs"), or None.
        base: the other job's result the worktree starts from (§18 "Handing a change on"),
            or None: it starts at `ref`. Only with `repo`.
    """

    repo: str | None = None
    ref: str | None = None
    max_turns: int | None = None
    max_cost_usd: float | None = None
    allow_tools: tuple[str, ...] = ()
    deny_tools: tuple[str, ...] = ()
    permission_mode: str | None = None
    ask_timeout_s: int | None = None
    on_ask_timeout: str | None = None
    resume: Resume | None = None
    memory_bytes: int | None = None
    cpus: float | None = None
    pids: int | None = None
    gpus: int | None = None
    base: Base | None = None

    def __post_init__(self) -> None:
        run_check(self._check)

    def _check(self) -> None:
        try:
            if self.repo is not None:
                names.validate_repo(self.repo)
            if self.ref is not None:
                if self.repo is None:
                    raise Invalid("ref is only allowed with repo")
                names.validate_ref(self.ref, "ref")
            if self.max_turns is not None:
                names.validate_max_turns(self.max_turns)
            if self.max_cost_usd is not None:
                names.validate_max_cost(self.max_cost_usd)
            if self.allow_tools:
                names.validate_tool_rules(self.allow_tools)
            if self.deny_tools:
                names.validate_tool_rules(self.deny_tools, "deny_tools")
            if self.permission_mode is not None:
                names.validate_permission_mode(self.permission_mode)
            if self.ask_timeout_s is not None:
                names.validate_ask_timeout(self.ask_timeout_s)
            if self.on_ask_timeout is not None:
                names.validate_ask_timeout_action(self.on_ask_timeout)
            if self.memory_bytes is not None:
                names.validate_memory_bytes(self.memory_bytes)
            if self.cpus is not None:
                names.validate_cpus(self.cpus)
            if self.pids is not None:
                names.validate_pids(self.pids)
            if self.gpus is not None:
                names.validate_gpus(self.gpus)
            if self.resume is not None:
                if not isinstance(self.resume, Resume):
                    raise Invalid(f"resume must be an object, got {type_name(self.resume)}")
                if self.resume.base_sha is not None and self.repo is None:
                    raise Invalid("resume.base_sha is only allowed with repo")
            if self.base is not None:
                if not isinstance(self.base, Base):
                    raise Invalid(f"base must be an object, got {type_name(self.base)}")
                if self.repo is None:
                    raise Invalid("base is only allowed with repo")
        except UsageError as exc:
            raise Invalid(str(exc)) from None

    @classmethod
    def build(cls, **values: Any) -> Work:
        """A work object from local input (CLI options, API arguments); None values are unset.

        Raises:
            UsageError: one line naming the bad value.
        """
        try:
            return cls(**{key: value for key, value in values.items() if value is not None})
        except DecodeError as exc:
            raise UsageError(exc.reason.removeprefix("malformed: ")) from None

    @classmethod
    def from_dict(cls, obj: object) -> Work:
        """Apply the §18 rules to a wire or record object (only WORK_FIELDS, no nulls).

        Raises:
            DecodeError: `malformed: work.<field> ...`.
        """
        return run_check(lambda: _work_from(obj))

    def ask_terms(self) -> tuple[int, str]:
        """(seconds a permission request waits, what then: deny or cancel), defaults filled (§19)."""
        return (self.ask_timeout_s or names.DEFAULT_ASK_TIMEOUT_S, self.on_ask_timeout or "deny")

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> Work | None:
        """The work stored in a registry record (`work`), or None for a plain job."""
        value = record.get("work")
        return cls.from_dict(value) if value else None

    def __bool__(self) -> bool:
        return bool(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """The wire object: set keys only (`allow_tools` as a list)."""
        out: dict[str, Any] = {key: value for key in ("repo", "ref", "max_turns", "max_cost_usd", "permission_mode",
                                                      "ask_timeout_s", "on_ask_timeout", "memory_bytes", "cpus",
                                                      "pids", "gpus")
                               if (value := getattr(self, key)) is not None}
        if self.allow_tools:
            out["allow_tools"] = list(self.allow_tools)
        if self.deny_tools:
            out["deny_tools"] = list(self.deny_tools)
        if self.resume is not None:
            out["resume"] = self.resume.to_dict()
        if self.base is not None:
            out["base"] = self.base.to_dict()
        return out


def _work_from(obj: object) -> Work:
    obj = _check_object(obj, "work", WORK_FIELDS)
    if any(value is None for value in obj.values()):
        raise Invalid("work fields are left out when unset, never null")
    fields = dict(obj)
    for key in ("allow_tools", "deny_tools"):
        if key in fields:
            if not isinstance(fields[key], list) or not fields[key]:
                raise Invalid(f"work.{key} must be a non-empty list, got {type_name(fields[key])}")
            fields[key] = tuple(fields[key])
    if "resume" in fields:
        fields["resume"] = _resume_from(fields["resume"])
    if "base" in fields:
        fields["base"] = _base_from(fields["base"])
    for key in ("max_cost_usd", "cpus"):
        if isinstance(fields.get(key), int) and not isinstance(fields[key], bool):
            fields[key] = float(fields[key])
    return Work(**fields)


__all__ = ["BASE_FIELDS", "MAX_BUNDLE_SEALED_CHARS", "MAX_CARRIED_BUNDLE_BYTES", "POLICY_FIELDS", "RESUME_FIELDS",
           "WORK_FIELDS", "Base", "Resume", "Work"]
