"""Names and topics of PROTOCOL §1-§2, and the registry's file names (§8, §12).

This is the only module that formats a topic string or a registry path.
Validators raise `UsageError` with one line naming the rule (CLI exit 64).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from mam.shared.protocol.errors import ConfigError, UsageError

DEFAULT_TOPIC_ROOT = "python/mqtt"

JOB_ID_RE = re.compile(r"^[0-9a-f]{8}$")
SESSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
TOKEN_RE = re.compile(r"^[0-9a-f]{32}$")
REQUEST_ID_RE = re.compile(r"^[0-9a-f]{16}$")
RUNNER_ID_RE = TOKEN_RE
REMOTE_PREFIX = "remote:"
SESSION_MAX_LEN = 63
LABEL_RE = re.compile(r"^[a-z0-9][a-z0-9_.:-]{0,31}$")
MAX_LABELS = 16
"""At most this many labels per runner and per job (§14)."""
LABEL_SHOWN_CHARS = 40  # a refused label is shown cut to this length (it may be hostile)

# Characters singled out by §1 because NATS maps them (`/` -> `.`) or treats
# them as wildcards (`*`, `>`); MQTT treats `+` and `#` as wildcards.
_SESSION_FORBIDDEN = {".": "'.'", "/": "'/'", "+": "'+'", "#": "'#'", "*": "'*'", ">": "'>'", " ": "a space"}


def new_job_id() -> str:
    """A fresh job id, 8 hex characters (§1)."""
    import secrets  # lazy: secrets loads hmac + OpenSSL, ~5 ms of every `mam-runner publish` (fast path)

    return secrets.token_hex(4)


def new_dispatch_token() -> str:
    """A fresh dispatch token, uuid4 hex (§1)."""
    import uuid  # lazy: not on the `mam-runner publish` fast path

    return uuid.uuid4().hex


def new_runner_id() -> str:
    """A fresh runner id, uuid4 hex (§1)."""
    import uuid  # lazy: not on the `mam-runner publish` fast path

    return uuid.uuid4().hex


def new_auth_token() -> str:
    """A fresh per-job HMAC key, `secrets.token_urlsafe(32)` (§3.1)."""
    import secrets  # lazy: not on the `mam-runner publish` fast path

    return secrets.token_urlsafe(32)


def new_request_id() -> str:
    """A fresh permission request id, 16 hex characters (§19)."""
    import secrets

    return secrets.token_hex(8)


def validate_request_id(value: object) -> str:
    """Return `value` if it is a permission request id (§19), else raise `UsageError`."""
    if not isinstance(value, str) or not REQUEST_ID_RE.fullmatch(value):
        raise UsageError(f"request id {value!r} is invalid: expected 16 lowercase hex characters")
    return value


def validate_job_id(value: object) -> str:
    """Return `value` if it is a job id (§1), else raise `UsageError`."""
    if not isinstance(value, str) or not JOB_ID_RE.fullmatch(value):
        raise UsageError(f"job id {repr(value)[:LABEL_SHOWN_CHARS]} is invalid: expected 8 lowercase hex characters, "
                         "e.g. 918b0612")
    return value


def session_problem(value: object) -> str | None:
    """Why `value` is not a valid session name (§1), or None if it is."""
    if not isinstance(value, str):
        return "it must be a string"
    if value == "":
        return "it is empty"
    if len(value) > SESSION_MAX_LEN:
        return f"it has {len(value)} characters, at most {SESSION_MAX_LEN} are allowed"
    for ch, label in _SESSION_FORBIDDEN.items():
        if ch in value:
            return f"{label} is not allowed"
    if not SESSION_RE.fullmatch(value):
        bad = next((c for c in value if not (c.isascii() and (c.isalnum() or c in "_-"))), None)
        if bad is not None:
            return f"{bad!r} is not allowed"
        return "it must start with a letter or digit"
    return None


def validate_session(value: object) -> str:
    """Return `value` if it is a session (runner) name (§1), else raise `UsageError`.

    The message names the rule, e.g. ``session name 'gpu.box' is invalid: '.'
    is not allowed (letters, digits, '-' and '_' only, 1-63 characters,
    starting with a letter or digit)``.
    """
    problem = session_problem(value)  # None only for a str
    if problem is not None or not isinstance(value, str):
        raise UsageError(
            f"session name {value!r} is invalid: {problem} "
            "(letters, digits, '-' and '_' only, 1-63 characters, starting with a letter or digit)"
        )
    return value


def validate_token(value: object, what: str = "dispatch token") -> str:
    """Return `value` if it is 32 lowercase hex characters (uuid4().hex, §1), else raise `UsageError`."""
    if not isinstance(value, str) or not TOKEN_RE.fullmatch(value):
        raise UsageError(f"{what} {value!r} is invalid: expected 32 lowercase hex characters")
    return value


def validate_attempt(value: object) -> int:
    """Return `value` if it is an attempt id (integer >= 1, §1), else raise `UsageError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"attempt id {value!r} is invalid: expected an integer >= 1")
    return value


def label_problem(value: object) -> str | None:
    """Why `value` is not a label of §14 (`^[a-z0-9][a-z0-9_.:-]{0,31}$`), or None."""
    if not isinstance(value, str):
        return f"expected a string, got {type(value).__name__}"
    if not LABEL_RE.fullmatch(value):
        return ("expected 1-32 characters: lowercase letters, digits, '_', '.', ':' and '-', "
                "starting with a letter or digit")
    return None


def _name_list(values: object, what: str, *, noun: str, listing: str, counted: str, limit: int, section: str,
               check: Callable[[object], object]) -> tuple[str, ...]:
    """`values` sorted, if it is a list of at most `limit` distinct names that each pass `check`.

    Raises:
        UsageError: one line naming the bad name (from `check`), the count, or the repeat.
    """
    if not isinstance(values, (list, tuple, frozenset, set)):
        raise UsageError(f"{what} must be a list of {listing}")
    if len(values) > limit:
        raise UsageError(f"{what} is invalid: {len(values)} {counted}, at most {limit} are allowed ({section})")
    for value in values:
        check(value)
    if len(set(values)) != len(values):
        raise UsageError(f"{what} is invalid: a {noun} is listed twice")
    return tuple(sorted(values))


def _check_label(value: object) -> None:
    problem = label_problem(value)
    if problem is not None:
        raise UsageError(f"label {str(value)[:LABEL_SHOWN_CHARS]!r} is invalid: {problem} (§14)")


def validate_labels(values: object, what: str = "labels") -> tuple[str, ...]:
    """`values` (a list of labels) sorted, if each is a §14 label, at most 16 and none twice.

    Raises:
        UsageError: one line naming the bad label or the count.
    """
    return _name_list(values, what, noun="label", listing="labels", counted="labels", limit=MAX_LABELS,
                      section="§14", check=_check_label)


def parse_labels(text: str, what: str = "--labels") -> tuple[str, ...]:
    """`gpu,cuda12` as sorted labels (§14); empty items are refused.

    Raises:
        UsageError: an empty list or item, a bad label, more than 16, a label twice.
    """
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise UsageError(f"{what} {text!r} is invalid: expected labels separated by commas, e.g. gpu,cuda12")
    return validate_labels(items, what)


REPO_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
MAX_REPOS = 32
"""At most this many repositories per runner (§18)."""
MAX_REF_CHARS = 255
REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")
ARTIFACT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$")
"""An artifact's file name at the hub (§18): no '/', no leading '.' or '-'."""
TRANSCRIPT_DIR = "transcript"
"""The result archive's folder for the agent's session transcript, `<session_id>.jsonl` (§18)."""


def validate_repo(value: object, what: str = "repo") -> str:
    """`value` if it is a repository name of §18 (1-64 letters, digits, '_', '.', '-', not
    starting with '.' or '-'), else raise `UsageError` (one line, the value cut)."""
    if not isinstance(value, str) or not REPO_RE.fullmatch(value):
        raise UsageError(f"{what} {str(value)[:LABEL_SHOWN_CHARS]!r} is invalid: expected 1-64 letters, digits, "
                         "'_', '.' and '-', not starting with '.' or '-' (§18)")
    return value


def validate_repos(values: object, what: str = "repos") -> tuple[str, ...]:
    """`values` (a list of repository names) sorted, each valid, at most 32 and none twice (§18).

    Raises:
        UsageError: one line naming the bad name or the count.
    """
    return _name_list(values, what, noun="repository", listing="repository names", counted="repositories",
                      limit=MAX_REPOS, section="§18", check=validate_repo)


def validate_ref(value: object, what: str = "--ref") -> str:
    """`value` if it names a branch, tag or commit the way `git check-ref-format` allows a
    ref (§18): 1-255 characters, no leading '-', no whitespace, control characters, '..',
    '~^:?*[\\', '@{', no trailing '.lock', '/' or '.'. Raises `UsageError` (one line)."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_REF_CHARS:
        raise UsageError(f"{what} {str(value)[:LABEL_SHOWN_CHARS]!r} is invalid: expected a branch, tag or "
                         f"commit of 1-{MAX_REF_CHARS} characters")
    bad = (value.startswith(("-", "/", ".")) or REF_FORBIDDEN.search(value) is not None or ".." in value
           or "@{" in value or "//" in value or "/." in value or value.endswith((".lock", "/", ".")))
    if bad:
        raise UsageError(f"{what} {value[:LABEL_SHOWN_CHARS]!r} is invalid: not a branch, tag or commit name "
                         "git accepts (§18)")
    return value


TOOL_RULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,127}(\([^()\x00-\x1f\x7f,]{1,200}\))?$")
"""One tool rule of an agent policy (§18): a tool name, optionally with a pattern, e.g. `Bash(git *)`."""
MAX_TOOL_RULES = 32
PERMISSION_MODES = ("default", "acceptEdits", "plan", "dontAsk")
"""Permission modes a dispatch may ask for (§18); never a blanket bypass."""
MAX_TURNS_LIMIT = 1000
MAX_COST_USD_LIMIT = 10000.0


def validate_tool_rules(values: object, what: str = "allow_tools") -> tuple[str, ...]:
    """`values` (a list of tool rules, 1-32, each `TOOL_RULE_RE`, distinct) as a tuple.
    Raises `UsageError` (one line)."""
    if not isinstance(values, (list, tuple)) or not 1 <= len(values) <= MAX_TOOL_RULES:
        raise UsageError(f"{what} is invalid: expected 1-{MAX_TOOL_RULES} tool rules")
    for value in values:
        if not isinstance(value, str) or not TOOL_RULE_RE.fullmatch(value):
            raise UsageError(f"{what}: {str(value)[:LABEL_SHOWN_CHARS]!r} is not a tool rule: expected a tool "
                             "name, optionally with a pattern in parentheses, e.g. Edit or Bash(git *)")
    if len(set(values)) != len(values):
        raise UsageError(f"{what} names a tool rule twice")
    return tuple(values)


def tool_rule_matches(rule: str, tool: str, subject: str) -> bool:
    """True when `rule` (`Name` or `Name(pattern)`, §18) covers a call of `tool` whose input
    reads `subject` (a shell tool's command, else its input as JSON): the names are equal and
    the pattern, if any, matches as a shell glob (`Bash(git push *)`)."""
    import fnmatch

    name, paren, pattern = rule.partition("(")
    if name != tool:
        return False
    return not paren or fnmatch.fnmatchcase(subject, pattern[:-1])


def parse_tool_rules(text: str, what: str = "--allow-tools") -> tuple[str, ...]:
    """`Bash(git *),Edit` → ("Bash(git *)", "Edit"): split on commas outside parentheses,
    each rule stripped, then `validate_tool_rules`. Raises `UsageError` (one line)."""
    rules, depth, current = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth <= 0:
            rules.append(current.strip())
            current, depth = "", 0
        else:
            current += ch
    rules.append(current.strip())
    if not all(rules):
        raise UsageError(f"{what} has an empty item: give tool rules separated by commas, e.g. Bash(git *),Edit")
    return validate_tool_rules(rules, what)


def validate_max_turns(value: object, what: str = "max_turns") -> int:
    """`value` if it is an integer 1..1000. Raises `UsageError`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TURNS_LIMIT:
        raise UsageError(f"{what} {repr(value)[:LABEL_SHOWN_CHARS]} is invalid: expected 1..{MAX_TURNS_LIMIT}")
    return value


def validate_max_cost(value: object, what: str = "max_cost_usd") -> float:
    """`value` as a float if it is a number above 0 and at most 10000 (US dollars). Raises `UsageError`."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= MAX_COST_USD_LIMIT
    if not ok:
        raise UsageError(f"{what} {repr(value)[:LABEL_SHOWN_CHARS]} is invalid: expected US dollars above 0, "
                         f"at most {MAX_COST_USD_LIMIT:g}")
    return float(value)  # type: ignore[arg-type]


MIN_MEMORY_BYTES = 4 << 20
MAX_MEMORY_BYTES = 1 << 44
MAX_CPUS = 1024
MAX_PIDS = 1 << 22
MEMORY_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def validate_memory_bytes(value: object, what: str = "memory_bytes") -> int:
    """`value` if it is an integer of bytes, 4 MiB .. 16 TiB (a job's memory limit, §6). Raises `UsageError`."""
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_MEMORY_BYTES <= value <= MAX_MEMORY_BYTES:
        raise UsageError(f"{what} {repr(value)[:LABEL_SHOWN_CHARS]} is invalid: expected bytes, 4M..16T")
    return value


def parse_memory(text: str, what: str = "--memory") -> int:
    """`8G`, `512M`, `64m`, `1048576` as bytes (binary units, as docker's `--memory`). Raises `UsageError`."""
    raw = text.strip().lower()
    digits = raw.rstrip("bkmgt")
    unit = raw[len(digits):]
    if (not digits.isdigit() or unit not in MEMORY_UNITS or len(raw) > 24
            or not MIN_MEMORY_BYTES <= int(digits) * MEMORY_UNITS[unit] <= MAX_MEMORY_BYTES):
        raise UsageError(f"{what} {text[:LABEL_SHOWN_CHARS]!r} is invalid: expected a size 4M..16T such as "
                         "512M or 8G")
    return int(digits) * MEMORY_UNITS[unit]


def validate_cpus(value: object, what: str = "cpus") -> float:
    """`value` as a float if it is a number of CPUs, 0.01 .. 1024 (a job's CPU quota, §6). Raises `UsageError`."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.01 <= value <= MAX_CPUS
    if not ok:
        raise UsageError(f"{what} {repr(value)[:LABEL_SHOWN_CHARS]} is invalid: expected CPUs, 0.01..{MAX_CPUS}")
    return float(value)  # type: ignore[arg-type]


MAX_GPUS = 64
"""At most this many GPUs per runner and per job (§14 "GPUs")."""


def validate_gpus(value: object, what: str = "gpus") -> int:
    """`value` if it is an integer 1..64 (the GPUs a job needs, §14). Raises `UsageError`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_GPUS:
        raise UsageError(f"{what} {repr(value)[:LABEL_SHOWN_CHARS]} is invalid: expected 1..{MAX_GPUS}")
    return value


def validate_pids(value: object, what: str = "pids") -> int:
    """`value` if it is an integer 8 .. 4194304 (a job's process count limit, §6). Raises `UsageError`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 8 <= value <= MAX_PIDS:
        raise UsageError(f"{what} {repr(value)[:LABEL_SHOWN_CHARS]} is invalid: expected 8..{MAX_PIDS}")
    return value


def validate_permission_mode(value: object, what: str = "permission_mode") -> str:
    """`value` if it is one of PERMISSION_MODES. Raises `UsageError`."""
    if value not in PERMISSION_MODES:
        raise UsageError(f"{what} {repr(value)[:LABEL_SHOWN_CHARS]} is invalid: expected one of "
                         f"{', '.join(PERMISSION_MODES)}")
    return str(value)


ASK_TIMEOUT_ACTIONS = ("deny", "cancel")
"""What a runner does with a permission request nobody answered in time (§19)."""
DEFAULT_ASK_TIMEOUT_S = 1800
"""How long a permission request waits for a person by default, seconds (§19)."""
MAX_ASK_TIMEOUT_S = 7 * 86400


def validate_ask_timeout(value: object, what: str = "ask_timeout_s") -> int:
    """`value` if it is an integer number of seconds 1..7 days. Raises `UsageError`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ASK_TIMEOUT_S:
        raise UsageError(f"{what} {repr(value)[:LABEL_SHOWN_CHARS]} is invalid: expected whole seconds "
                         f"1..{MAX_ASK_TIMEOUT_S}")
    return value


def validate_ask_timeout_action(value: object, what: str = "on_ask_timeout") -> str:
    """`value` if it is one of ASK_TIMEOUT_ACTIONS. Raises `UsageError`."""
    if value not in ASK_TIMEOUT_ACTIONS:
        raise UsageError(f"{what} {repr(value)[:LABEL_SHOWN_CHARS]} is invalid: expected one of "
                         f"{', '.join(ASK_TIMEOUT_ACTIONS)}")
    return str(value)


AGENT_SESSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""An agent CLI's own session (Claude Code) or thread (Codex) id (§18): a UUID in practice."""
SHA_RE = re.compile(r"^[0-9a-f]{40}$")


def validate_agent_session_id(value: object, what: str = "resume.session_id") -> str:
    """`value` if it is an agent's session id (AGENT_SESSION_RE: safe as a file name).
    Raises `UsageError`."""
    if not isinstance(value, str) or not AGENT_SESSION_RE.fullmatch(value):
        raise UsageError(f"{what} {repr(value)[:LABEL_SHOWN_CHARS]} is invalid: expected 1-128 letters, digits, "
                         "'.', '_' or '-', starting with a letter or digit")
    return value


def validate_sha(value: object, what: str = "sha") -> str:
    """`value` if it is a full commit id (40 lowercase hex). Raises `UsageError`."""
    if not isinstance(value, str) or not SHA_RE.fullmatch(value):
        raise UsageError(f"{what} {repr(value)[:LABEL_SHOWN_CHARS]} is invalid: expected 40 lowercase hex characters")
    return value


def strip_remote(session: str) -> str:
    """The bare session of `remote:<session>` (a hub record's `agent_session`, accepted on the
    CLI, §1), else `session` as given."""
    return session[len(REMOTE_PREFIX):] if isinstance(session, str) and session.startswith(REMOTE_PREFIX) \
        else session


def agent_session_label(session: str) -> str:
    """The hub record's `agent_session` for a remote session: `remote:<session>` (§1)."""
    return REMOTE_PREFIX + validate_session(session)


def session_from_label(label: str) -> str:
    """Inverse of `agent_session_label`; raises `UsageError` on anything else."""
    if not isinstance(label, str) or not label.startswith(REMOTE_PREFIX):
        raise UsageError(f"agent session {label!r} is invalid: expected remote:<session>")
    return validate_session(label[len(REMOTE_PREFIX):])


# ---------------------------------------------------------------- topics (§2)

def topic_root(root: str | None = None) -> str:
    """The topic root: `root`, else MAM_TOPIC_ROOT, else `python/mqtt` (§2).

    Raises `UsageError` if it is empty, has wildcards, or leading/trailing '/'.
    """
    value = root if root is not None else os.environ.get("MAM_TOPIC_ROOT") or DEFAULT_TOPIC_ROOT
    if (not value or any(c in value for c in "+#*> \x00") or value.startswith("/")
            or value.endswith("/") or "//" in value):
        raise UsageError(f"topic root {value!r} is invalid: no wildcards, spaces, or empty levels")
    return value


def job_topic(job_id: str, leaf: str, root: str | None = None) -> str:
    """`ROOT/jobs/<job_id>/<leaf>` for leaf in dispatch, events, state, control, log, result (§2, §18)."""
    if leaf not in ("dispatch", "events", "state", "control", "log", "result"):
        raise ValueError(f"unknown job topic leaf {leaf!r}")
    return f"{topic_root(root)}/jobs/{validate_job_id(job_id)}/{leaf}"


def dispatch_topic(job_id: str, root: str | None = None) -> str:
    """Retained signed dispatch (§2, §5)."""
    return job_topic(job_id, "dispatch", root)


def events_topic(job_id: str, root: str | None = None) -> str:
    """Events; terminal ones retained (§2, §3)."""
    return job_topic(job_id, "events", root)


def state_topic(job_id: str, root: str | None = None) -> str:
    """Retained state snapshot (§2, §4)."""
    return job_topic(job_id, "state", root)


def control_topic(job_id: str, root: str | None = None) -> str:
    """Retained signed cancel (§2, §6)."""
    return job_topic(job_id, "control", root)


def log_topic(job_id: str, root: str | None = None) -> str:
    """Sealed chunks of the agent's output, not retained (§2, §15)."""
    return job_topic(job_id, "log", root)


def all_dispatches_filter(root: str | None = None) -> str:
    """Subscription filter for every job's dispatch: `ROOT/jobs/+/dispatch` (§11)."""
    return f"{topic_root(root)}/jobs/+/dispatch"


def answer_topic(job_id: str, request_id: str, root: str | None = None) -> str:
    """`ROOT/jobs/<job_id>/answers/<request_id>`: the hub's retained, signed answer to one
    permission request (§2, §19)."""
    return f"{topic_root(root)}/jobs/{validate_job_id(job_id)}/answers/{validate_request_id(request_id)}"


def all_answers_filter(root: str | None = None) -> str:
    """Subscription filter for every answer: `ROOT/jobs/+/answers/+` (§19)."""
    return f"{topic_root(root)}/jobs/+/answers/+"


def parse_answer_topic(topic: str, root: str | None = None) -> tuple[str, str] | None:
    """Split `ROOT/jobs/<job_id>/answers/<request_id>` into (job_id, request_id), or None."""
    prefix = f"{topic_root(root)}/jobs/"
    if not topic.startswith(prefix):
        return None
    parts = topic[len(prefix):].split("/")
    if len(parts) != 3 or parts[1] != "answers" or not JOB_ID_RE.fullmatch(parts[0]) \
            or not REQUEST_ID_RE.fullmatch(parts[2]):
        return None
    return parts[0], parts[2]


def all_controls_filter(root: str | None = None) -> str:
    """Subscription filter for every job's control: `ROOT/jobs/+/control` (§6)."""
    return f"{topic_root(root)}/jobs/+/control"


def all_results_filter(root: str | None = None) -> str:
    """Subscription filter for every job's result chunks: `ROOT/jobs/+/result` (§18)."""
    return f"{topic_root(root)}/jobs/+/result"


def all_logs_filter(root: str | None = None) -> str:
    """Subscription filter for every job's output chunks: `ROOT/jobs/+/log` (§15)."""
    return f"{topic_root(root)}/jobs/+/log"


def all_jobs_filter(root: str | None = None) -> str:
    """Subscription filter for everything about every job: `ROOT/jobs/#`."""
    return f"{topic_root(root)}/jobs/#"


def all_events_filter(root: str | None = None) -> str:
    """Subscription filter for every job's events: `ROOT/jobs/+/events` (the hub service, §14)."""
    return f"{topic_root(root)}/jobs/+/events"


def all_states_filter(root: str | None = None) -> str:
    """Subscription filter for every job's retained state: `ROOT/jobs/+/state` (the hub service, §14)."""
    return f"{topic_root(root)}/jobs/+/state"


def presence_topic(session: str, root: str | None = None) -> str:
    """Retained presence and Last Will of one runner session (§2, §7)."""
    return f"{topic_root(root)}/runners/{validate_session(session)}"


def revoked_topic(session: str, root: str | None = None) -> str:
    """The hub's retained revocation notice of one runner session (§2, §16.7)."""
    return f"{presence_topic(session, root)}/revoked"


def drain_topic(session: str, root: str | None = None) -> str:
    """The hub's retained drain order of one runner session (§2, §7 "Drain from the hub")."""
    return f"{presence_topic(session, root)}/drain"


def all_presence_filter(root: str | None = None) -> str:
    """Subscription filter for every runner's presence: `ROOT/runners/+` (§7)."""
    return f"{topic_root(root)}/runners/+"


def hub_probe_topic(root: str | None = None) -> str:
    """Where the hub proves its own link before it judges a silence: `ROOT/hub/probe`, zero-length,
    not retained, not subscribed (§2, §10 "Leases")."""
    return f"{topic_root(root)}/hub/probe"


def parse_job_topic(topic: str, root: str | None = None) -> tuple[str, str] | None:
    """Split `ROOT/jobs/<job_id>/<leaf>` (§2) into (job_id, leaf), or None if it is not one."""
    prefix = f"{topic_root(root)}/jobs/"
    if not topic.startswith(prefix):
        return None
    parts = topic[len(prefix):].split("/")
    if len(parts) != 2 or not JOB_ID_RE.fullmatch(parts[0]):
        return None
    return parts[0], parts[1]


def parse_presence_topic(topic: str, root: str | None = None) -> str | None:
    """The session of a `ROOT/runners/<session>` topic (§2, §7), or None."""
    prefix = f"{topic_root(root)}/runners/"
    if not topic.startswith(prefix):
        return None
    session = topic[len(prefix):]
    return session if session_problem(session) is None else None


# ------------------------------------------------------- registry paths (§8, §12)

def mam_dir(root: Path) -> Path:
    """`<root>/.mam`."""
    return Path(root) / ".mam"


def jobs_dir(root: Path) -> Path:
    """`<root>/.mam/jobs`."""
    return mam_dir(root) / "jobs"


def record_path(root: Path, job_id: str) -> Path:
    """`<root>/.mam/jobs/<job_id>.json` (§8)."""
    return jobs_dir(root) / f"{validate_job_id(job_id)}.json"


def runners_seen_path(root: Path) -> Path:
    """`<root>/.mam/runners-seen.json`: how many presences the last `mam-orch runners` received."""
    return mam_dir(root) / "runners-seen.json"


def lock_path(root: Path) -> Path:
    """`<root>/.mam/jobs/.lock`, the registry lock (§8)."""
    return jobs_dir(root) / ".lock"


def hub_lock_path(root: Path) -> Path:
    """`<root>/.mam/hub.lock`: held (flock) by the one `mam-orch serve` of a registry; holds its pid (§14)."""
    return mam_dir(root) / "hub.lock"


def logs_dir(root: Path) -> Path:
    """`<root>/.mam/logs`, the parent of every job's log folder (§8)."""
    return mam_dir(root) / "logs"


def job_logs_dir(root: Path, job_id: str) -> Path:
    """`<root>/.mam/logs/<job_id>` holding meta.json, status.json, events.ndjson (§8)."""
    return logs_dir(root) / validate_job_id(job_id)


def heartbeat_path(root: Path, job_id: str, kind: str) -> Path:
    """`<root>/.mam/jobs/<job_id>.heartbeat.<kind>` for kind in barrier, pid, lock (§12)."""
    if kind not in ("barrier", "pid", "lock"):
        raise ValueError(f"unknown heartbeat file kind {kind!r}")
    return jobs_dir(root) / f"{validate_job_id(job_id)}.heartbeat.{kind}"


# ---------------------------------------------------------------- outbox (§17)

OUTBOX_SUFFIX = ".json"
OUTBOX_KEPT_SUFFIX = ".kept.json"
_OUTBOX_NAME_RE = re.compile(r"^([0-9a-f]{8})\.([1-9][0-9]{0,8})\.([1-9][0-9]{0,11})(\.kept)?\.json$")


def run_dir(root: Path) -> Path:
    """`<root>/.mam/run` (mode 0700): the runner daemon's local socket lives here (§17)."""
    return mam_dir(root) / "run"


def runner_socket_path(root: Path) -> Path:
    """`<root>/.mam/run/runner.sock`: the runner daemon's local publish socket (§17)."""
    return run_dir(root) / "runner.sock"


def outbox_dir(root: Path) -> Path:
    """`<root>/.mam/outbox`: events and states not yet acknowledged by the broker (§17)."""
    return mam_dir(root) / "outbox"


def outbox_entry_path(root: Path, job_id: str, attempt_id: int, seq: int, *, kept: bool = False) -> Path:
    """`<root>/.mam/outbox/<job_id>.<attempt_id>.<seq>.json` (one event and its state, §17);
    `.kept.json` once acknowledged, for a terminal entry kept for re-publishing."""
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise UsageError(f"seq {seq!r} is invalid: expected an integer >= 1")
    suffix = OUTBOX_KEPT_SUFFIX if kept else OUTBOX_SUFFIX
    return outbox_dir(root) / f"{validate_job_id(job_id)}.{validate_attempt(attempt_id)}.{seq}{suffix}"


def parse_outbox_name(name: str) -> tuple[str, int, int, bool] | None:
    """(job_id, attempt_id, seq, kept) of an outbox entry's file name (§17), or None."""
    match = _OUTBOX_NAME_RE.fullmatch(name)
    if match is None:
        return None
    return match.group(1), int(match.group(2)), int(match.group(3)), match.group(4) is not None


# ------------------------------------------------------- keys and roster (§16)

def keys_dir(root: Path) -> Path:
    """`<root>/.mam/keys` (mode 0700): this host's v2 private keys and the hub keys it trusts (§16)."""
    return mam_dir(root) / "keys"


def hub_key_path(root: Path) -> Path:
    """`<root>/.mam/keys/hub.ed25519`: the hub's Ed25519 private key, 0600 (§16)."""
    return keys_dir(root) / "hub.ed25519"


def hub_next_key_path(root: Path) -> Path:
    """`<root>/.mam/keys/hub.next.ed25519`: a staged hub key, not used until the rotation (§16)."""
    return keys_dir(root) / "hub.next.ed25519"


def hub_previous_public_path(root: Path) -> Path:
    """`<root>/.mam/keys/hub.previous.ed25519.pub`: the hub's public key before its last rotation (§16)."""
    return keys_dir(root) / "hub.previous.ed25519.pub"


def runner_key_path(root: Path, kind: str) -> Path:
    """`<root>/.mam/keys/runner.<kind>` for kind in ed25519, x25519: a runner's private keys, 0600 (§16)."""
    if kind not in ("ed25519", "x25519"):
        raise ValueError(f"unknown runner key kind {kind!r}")
    return keys_dir(root) / f"runner.{kind}"


def runner_identity_path(root: Path) -> Path:
    """`<root>/.mam/keys/runner.json`: the session, labels and public keys `mam-runner enroll` made (§16)."""
    return keys_dir(root) / "runner.json"


def trusted_hub_keys_path(root: Path) -> Path:
    """`<root>/.mam/keys/hub-trusted.pub`: the hub public keys a runner verifies with, one a line (§16)."""
    return keys_dir(root) / "hub-trusted.pub"


def roster_dir(root: Path) -> Path:
    """`<root>/.mam/runners`: the hub's roster of enrolled runners (§16)."""
    return mam_dir(root) / "runners"


def roster_path(root: Path, session: str) -> Path:
    """`<root>/.mam/runners/<session>.json`: one enrolled runner (§16)."""
    return roster_dir(root) / f"{validate_session(session)}.json"


def broker_record_path(root: Path) -> Path:
    """`<root>/.mam/broker-config.json`: the nats config `mam-orch init` wrote, whose runner users
    `mam-orch runner add|revoke` manage (§16)."""
    return mam_dir(root) / "broker-config.json"


def runner_credentials_path(root: Path, session: str) -> Path:
    """`<root>/.mam/runner-credentials/<session>.env` (0600): a runner's own broker user and
    password, written once by `mam-orch runner add` for the operator to hand over (§16)."""
    return mam_dir(root) / "runner-credentials" / f"{validate_session(session)}.env"


def invites_dir(root: Path) -> Path:
    """`<root>/.mam/invites`: the hub's pending and used invite codes, as hashes (§16 enrolment by invite)."""
    return mam_dir(root) / "invites"


def invite_path(root: Path, invite_id: str) -> Path:
    """`<root>/.mam/invites/<invite_id>.json`: one invite's session, labels, expiry and use (§16)."""
    return invites_dir(root) / f"{validate_token(invite_id, 'invite id')}.json"


def enrol_topic(session: str, leaf: str, root: str | None = None) -> str:
    """`ROOT/enrol/<session>/<leaf>`, leaf `request` (runner to hub) or `answer` (hub to runner), not
    retained (§16 enrolment by invite)."""
    if leaf not in ("request", "answer"):
        raise ValueError(f"unknown enrol topic leaf {leaf!r}")
    return f"{topic_root(root)}/enrol/{validate_session(session)}/{leaf}"


def all_enrol_requests_filter(root: str | None = None) -> str:
    """Subscription filter for every session's enrolment request: `ROOT/enrol/+/request` (§16)."""
    return f"{topic_root(root)}/enrol/+/request"


# ------------------------------------------------------------ output stream (§15)

def log_outbox_dir(root: Path) -> Path:
    """`<root>/.mam/outbox-log`: the runner's sealed log chunks not yet acknowledged (§15, §17)."""
    return mam_dir(root) / "outbox-log"


def log_outbox_entry_path(root: Path, job_id: str, attempt_id: int, chunk: int, *, transcript: bool = False) -> Path:
    """`<root>/.mam/outbox-log/<job_id>.<attempt_id>.<chunk>.json`: one sealed chunk (§15, §17);
    with `transcript`, the same name in `transcript_outbox_dir`."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise UsageError(f"chunk {chunk!r} is invalid: expected an integer >= 0")
    folder = transcript_outbox_dir(root) if transcript else log_outbox_dir(root)
    return folder / f"{validate_job_id(job_id)}.{validate_attempt(attempt_id)}.{chunk}.json"


def transcript_outbox_dir(root: Path) -> Path:
    """`<root>/.mam/outbox-transcript`: the runner's sealed transcript chunks not yet
    acknowledged (§15 "Transcript chunks", §17); entries named as in the log outbox."""
    return mam_dir(root) / "outbox-transcript"


def result_topic(job_id: str, root: str | None = None) -> str:
    """Sealed chunks of an attempt's result (its change and artifacts), not retained (§2, §18)."""
    return job_topic(job_id, "result", root)


def result_outbox_dir(root: Path) -> Path:
    """`<root>/.mam/outbox-result`: the runner's result archives not yet all acknowledged (§18, §17)."""
    return mam_dir(root) / "outbox-result"


def hub_result_dir(root: Path, job_id: str, attempt_id: int) -> Path:
    """`<root>/.mam/results/<job_id>/<attempt_id>/`: an attempt's result at the hub (§18)."""
    return mam_dir(root) / "results" / validate_job_id(job_id) / str(validate_attempt(attempt_id))


def hub_artifacts_dir(root: Path, job_id: str, attempt_id: int) -> Path:
    """`<root>/.mam/artifacts/<job_id>/<attempt_id>/`: the files an attempt's agent left in its
    `$MAM_ARTIFACTS_DIR`, at the hub (§18)."""
    return mam_dir(root) / "artifacts" / validate_job_id(job_id) / str(validate_attempt(attempt_id))


def hub_log_path(root: Path, job_id: str, attempt_id: int) -> Path:
    """`<root>/.mam/logs/<job_id>/agent.<attempt_id>.log`: the hub's copy of an attempt's output (§15)."""
    return job_logs_dir(root, job_id) / f"agent.{validate_attempt(attempt_id)}.log"


def brief_path(root: Path, job_id: str) -> Path:
    """`<root>/.mam/logs/<job_id>/brief.txt`: the hub's 0600 copy of a job's brief (§5)."""
    return job_logs_dir(root, job_id) / "brief.txt"


def runner_agent_log_path(root: Path, job_id: str) -> Path:
    """`<root>/.mam/logs/<job_id>/agent.log`: the runner's whole output of a job (§11), under the RUNNER's root."""
    return job_logs_dir(root, job_id) / "agent.log"


def hub_transcript_path(root: Path, job_id: str, attempt_id: int) -> Path:
    """`<root>/.mam/logs/<job_id>/transcript.<attempt_id>.jsonl`: the hub's copy of an attempt's
    agent session transcript as it grew (§15 "Transcript chunks"); its state in `.jsonl.json`."""
    return job_logs_dir(root, job_id) / f"transcript.{validate_attempt(attempt_id)}.jsonl"


def hub_log_state_path(root: Path, job_id: str, attempt_id: int) -> Path:
    """`<root>/.mam/logs/<job_id>/agent.<attempt_id>.log.json`: the next chunk expected, bytes dropped (§15)."""
    return job_logs_dir(root, job_id) / f"agent.{validate_attempt(attempt_id)}.log.json"


# ------------------------------------------------------------ broker users (§1.2, §16)

# A broker password goes into a quoted nats.conf string: printable ASCII without quote, backslash or '$'.
MIN_PASSWORD_CHARS, MAX_PASSWORD_CHARS = 8, 256
MAX_USER_CHARS = 64
_SAFE_SECRET = re.compile(rf"^[!#%-\[\]-~]{{{MIN_PASSWORD_CHARS},{MAX_PASSWORD_CHARS}}}$")
_USER_NAME = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_USER_CHARS}}}")


def check_secret(name: str, value: str) -> str:
    """Refuse a password that cannot go into nats.conf safely.

    Raises:
        ConfigError: shorter than 8, longer than 256, or with spaces, quotes, '\\' or '$'.
    """
    if not _SAFE_SECRET.match(value or ""):
        raise ConfigError(f"{name} must be {MIN_PASSWORD_CHARS}-{MAX_PASSWORD_CHARS} printable characters "
                          "without spaces, quotes, "
                          "'\\' or '$' (generate one with `python -c 'import secrets; "
                          "print(secrets.token_urlsafe(32))'`)")
    return value


def is_user_name(value: object) -> bool:
    """True for a broker user name: 1-64 letters, digits, '_' or '-'."""
    return isinstance(value, str) and _USER_NAME.fullmatch(value) is not None


def check_user(name: str, value: str) -> str:
    """Refuse a user name that is not 1-64 letters, digits, '_' or '-'.

    Raises:
        ConfigError: naming the variable and the rule.
    """
    if not _USER_NAME.fullmatch(value or ""):
        raise ConfigError(f"{name} {value!r} is invalid: use 1-{MAX_USER_CHARS} letters, digits, '_' or '-'")
    return value
