"""The `work` object of a dispatch (PROTOCOL §18): the repository the job works on.
Optional: a dispatch without it is a plain command job, as before.

    {"repo": "demo", "ref": "main"}

Every key is optional and absent when unset (never null). The dispatch signature covers
it (§5); it is not sealed: the brief is the secret, and the repository names are in the
runners' presence anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mam.shared.protocol import names
from mam.shared.protocol.errors import DecodeError, UsageError
from mam.shared.protocol.wire.fields import Invalid, run_check, show, type_name

WORK_FIELDS = frozenset({"repo", "ref"})


@dataclass(frozen=True)
class Work:
    """A job's repository (§18).

    Attributes:
        repo: the repository name a runner must serve (`names.validate_repo`), or None.
        ref: the branch, tag or commit to start from (None: the remote's default branch); only with `repo`.
    """

    repo: str | None = None
    ref: str | None = None

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

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> Work | None:
        """The work stored in a registry record (`work`), or None for a plain job."""
        value = record.get("work")
        return cls.from_dict(value) if value else None

    def __bool__(self) -> bool:
        return bool(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """The wire object: set keys only."""
        return {key: value for key in ("repo", "ref") if (value := getattr(self, key)) is not None}


def _work_from(obj: object) -> Work:
    if not isinstance(obj, Mapping):
        raise Invalid(f"work must be an object, got {type_name(obj)} {show(obj)}")
    unknown = sorted(str(key) for key in obj.keys() - WORK_FIELDS)
    if unknown:
        raise Invalid(f"unknown field {', '.join(show('work.' + key) for key in unknown[:4])}")
    if any(value is None for value in obj.values()):
        raise Invalid("work fields are left out when unset, never null")
    return Work(**obj)


__all__ = ["WORK_FIELDS", "Work"]
