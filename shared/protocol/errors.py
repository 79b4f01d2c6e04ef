"""The one error tree of mam-fleet (DESIGN.md "Errors").

Every error the code raises on purpose derives from `MamError`; the CLIs map
each class to an exit code of PROTOCOL §9 in one place (`exit_code_for`).
Messages are one line, say what was wrong, with what value, and what to do.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Every process exit code of mam-fleet (PROTOCOL §9), defined once.

    Codes with the same number are aliases: `PUBLISHED` is `COMPLETED` (0),
    `REFUSED` is `ERROR` (1) and `TRANSPORT` is `TIMEOUT` (2), because §9 gives
    `mam-runner publish` its own reading of the same numbers; `INTERRUPTED` is
    `DETACHED` (130, Ctrl-C).
    """

    COMPLETED = 0
    ERROR = 1
    TIMEOUT = 2
    BROKER = 3
    CANCELLED = 4
    NO_RUNNER = 5
    USAGE = 64
    REVOKED = 77  # `mam-runner run`: the hub revoked this runner (§16.7; sysexits' EX_NOPERM)
    DETACHED = 130
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT) or an aborted prompt
    # `mam-runner publish` and `mam-runner run` (§9, their columns).
    OK = 0
    PUBLISHED = 0
    REFUSED = 1
    TRANSPORT = 2


class MamError(Exception):
    """Root of every mam-fleet error."""


class UsageError(MamError):
    """Bad arguments or names (PROTOCOL §1, §9: exit 64)."""


class ConfigError(MamError):
    """Bad configuration: missing or short secret, bad variable value (§13)."""


class EnvFileError(ConfigError):
    """A configuration file exists but cannot be read or decoded (§13, §9).

    Args:
        path: the file.
        cause: the exception that reading or decoding raised.
    """

    def __init__(self, path: str, cause: BaseException) -> None:
        self.path = str(path)
        self.cause = cause
        super().__init__(f"{self.path}: cannot read ({type(cause).__name__})")


class ProtocolError(MamError):
    """A message broke the wire contract (§3-§7)."""


class DecodeError(ProtocolError):
    """A wire message failed `wire.decode()`.

    Args:
        reason: one line naming the offending field and rule.
        raw: the raw payload (bytes or str) as received; never printed whole.
    """

    def __init__(self, reason: str, raw: bytes | str | None = None) -> None:
        self.reason = reason
        self.raw = raw
        super().__init__(reason)


class SignatureError(ProtocolError):
    """HMAC or dispatch signature missing or wrong, or a seal that does not open."""


class StaleAttemptError(ProtocolError):
    """A message or request names an attempt or dispatch token that is not current (§3.2, §8)."""


class RegistryError(MamError):
    """A registry record cannot be read or written (§8)."""


class TransitionRefused(RegistryError):
    """A compare-and-swap transition was refused (§8): stale token, terminal record, bad edge."""


class BrokerError(MamError):
    """The broker refused or failed an operation."""


class BrokerUnavailable(BrokerError):
    """No CONNACK within the deadline on any broker of the list (§13)."""


class PublishTimeout(BrokerError):
    """No PUBACK within the deadline after every attempt (§13)."""


# PROTOCOL §9. Order matters: most specific class first.
_EXIT_CODES: tuple[tuple[type[BaseException], ExitCode], ...] = (
    (UsageError, ExitCode.USAGE),
    (EnvFileError, ExitCode.ERROR),
    (ConfigError, ExitCode.USAGE),
    (StaleAttemptError, ExitCode.ERROR),
    (ProtocolError, ExitCode.ERROR),
    (TransitionRefused, ExitCode.ERROR),
    (RegistryError, ExitCode.ERROR),
    (BrokerError, ExitCode.BROKER),
    (MamError, ExitCode.ERROR),
)


def exit_code_for(error: BaseException) -> ExitCode:
    """Map an error to the process exit code of PROTOCOL §9.

    Args:
        error: any exception.
    Returns:
        the exit code: 64 usage/configuration, 3 broker unreachable, 1 otherwise.
    """
    for cls, code in _EXIT_CODES:
        if isinstance(error, cls):
            return code
    return ExitCode.ERROR
