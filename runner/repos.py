"""The runner's git repositories (PROTOCOL §18): one bare mirror per configured
repository, fetched before each attempt; one fresh worktree and branch per
attempt; and the attempt's result (commits, numstat, a bundle, a patch).

Layout under the runner root::

    <root>/repos/<name>.git                     bare mirror; remote branches in refs/remotes/origin/*
    <root>/repos/<name>.lock                    flock: one process at a time changes a mirror
    <root>/worktrees/<job_id>-<attempt>/        the attempt's tree, on branch mam/<job_id>-<attempt>
    <root>/worktrees/<job_id>-<attempt>.finished  written by `finish()` (gc's clock), outside the tree

Lifecycle::

    repos = Repos(root, parse_repos(flags, os.environ.get("MAM_RUNNER_REPOS")))
    repos.remove_leftovers(keep=keep_worktrees, active=())   # at runner start
    repos.prepare("demo")                                    # before each attempt: fetch
    ref, sha = repos.resolve("demo", work_ref)               # None: the remote's default branch
    wt = repos.add_worktree("demo", sha, job_id, attempt_id, ref)
    ...                                                      # the agent runs in wt.path
    summary = collect_result(wt, job_id=..., attempt_id=..., session=..., out_dir=..., max_bytes=...)
    repos.finish(wt)                                         # gc() removes it ttl_s later

Everything goes through the git CLI: no shell, a timeout on every call (the
whole process group is killed on expiry), `GIT_TERMINAL_PROMPT=0`, no system
config, `LC_ALL=C`, no inherited `GIT_DIR`-like variables and none of the
fleet's secrets in git's environment.

The agent controls its worktree, and, running under the runner's uid, can write
the mirror's shared config too. Defence in depth, not a sandbox:

- hooks never run (`core.hooksPath=/dev/null`), nor fsmonitor, gpg or external
  diff/textconv, and every filter driver defined in the repository's own config
  is switched off for the runner's git calls;
- the result is collected with explicit `--git-dir`/`--work-tree`, so a `.git`
  the agent replaced or removed is ignored; paths come from git with `-z`;
- the mirror's config is rewritten from a template at every `prepare()`, and
  the remote URL is never stored in it: git gets it from the environment
  (`GIT_CONFIG_COUNT`), so `git remote -v` in a worktree shows no credential;
  URLs in messages and logs are masked (`mask_url`);
- trees are removed by git, else by `shutil.rmtree` (fd-based: it never follows
  a symlink), and markers live outside the trees.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mam.runner.agent import SECRET_ENV_NAMES
from mam.shared.protocol import names
from mam.shared.protocol.errors import MamError, UsageError

log = logging.getLogger("mam.runner.repos")

REPO_NAME_RE = names.REPO_RE
"""A repository name (§18): 1-64 letters, digits, '._-', not starting with '.' or '-'."""
MAX_REPOS = names.MAX_REPOS
"""At most this many repositories per runner (§18)."""
REPOS_ENV = "MAM_RUNNER_REPOS"
URL_MAX_CHARS = 2048
SHOWN_CHARS = 80
"""How much of a refused value an error line shows (it may be hostile)."""
DEFAULT_TIMEOUT_S = 600.0
"""Default limit of one git call, seconds."""
DEFAULT_GC_TTL_S = 86400.0
"""A finished worktree is removed this long after `finish()` (§18: 24 h)."""
MAX_COMMITS_LISTED = 200
MAX_FILES_LISTED = 1000
MAX_SUBJECT_CHARS = 500
MAX_AUTHOR_CHARS = 200
BUNDLE_NAME = "change.bundle"
PATCH_NAME = "change.patch"
FINISHED_SUFFIX = ".finished"
BRANCH_PREFIX = "mam/"
ORIGIN_FETCH = "+refs/heads/*:refs/remotes/origin/*"
"""Remote branches go to refs/remotes/origin/*, so a fetch never prunes our own mam/* branches."""
LOCK_POLL_S = 0.05

_HEX_SHA = re.compile(r"[0-9a-f]{7,40}")
_FULL_SHA = re.compile(r"[0-9a-f]{40}")
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s'\"]*)@")
_SSH_SCHEMES = frozenset({"ssh://", "git+ssh://", "ssh+git://"})
_REFUSED_TRANSPORTS = ("ext::", "fd::")
_CHUNK = 1 << 16

# GIT_* variables an operator may set for the runner's git (ssh keys, CA, proxy); every other
# GIT_* variable (GIT_DIR, GIT_WORK_TREE, GIT_INDEX_FILE, GIT_CONFIG*, author/committer...) is dropped.
_GIT_ENV_KEPT = frozenset({"GIT_SSH", "GIT_SSH_COMMAND", "GIT_SSH_VARIANT", "GIT_ASKPASS", "GIT_SSL_CAINFO",
                           "GIT_SSL_CAPATH", "GIT_PROXY_COMMAND"})

# Settings on every git call (`-c`, which wins over every config file).
_HARDENING: tuple[tuple[str, str], ...] = (
    ("core.hooksPath", "/dev/null"),
    ("core.fsmonitor", "false"),
    ("gc.auto", "0"),
    ("maintenance.auto", "false"),
    ("protocol.ext.allow", "never"),
    ("commit.gpgSign", "false"),
    ("tag.gpgSign", "false"),
    ("log.showSignature", "false"),
    ("color.ui", "false"),
    ("core.quotePath", "false"),
    ("i18n.logOutputEncoding", "UTF-8"),
    ("advice.detachedHead", "false"),
)

_MIRROR_CONFIG = """\
[core]
\trepositoryformatversion = 0
\tfilemode = {filemode}
\tbare = true
[remote "origin"]
\tfetch = {fetch}
"""


class RepoError(MamError):
    """A repository operation failed: fetch, unknown ref, worktree, result (§18).

    The message is one line naming the repository (and ref), never a credential.
    """


# ------------------------------------------------------------------ text


def mask_url(text: str) -> str:
    """`text` with the credentials of every `scheme://user[:password]@` URL in it masked.

    A password becomes `***` (`https://bob:***@host/x`); a user name alone is masked
    too (`https://***@host/x`: a token often travels as the user name), except for ssh,
    where it is only the login (`ssh://git@host/x` stays).
    """
    def mask(match: re.Match[str]) -> str:
        scheme, userinfo = match.group("scheme"), match.group("userinfo")
        if ":" in userinfo:
            return f"{scheme}{userinfo.split(':', 1)[0]}:***@"
        if scheme.lower() in _SSH_SCHEMES:
            return match.group(0)
        return f"{scheme}***@"

    return _URL_USERINFO.sub(mask, text)


def _shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """`value` masked, cut to `limit` characters and quoted: safe on one line."""
    masked = mask_url(value)
    cut = masked if len(masked) <= limit else masked[:limit] + "..."
    return repr(cut)


def _one_line(raw: bytes | str, limit: int = 300) -> str:
    """The last non-empty line of git's stderr, masked, printable, at most `limit` characters."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else "no message"
    line = "".join(ch if ch.isprintable() else "?" for ch in mask_url(line))
    return line if len(line) <= limit else line[:limit] + "..."


def _decode(raw: bytes) -> str:
    """Bytes from git (paths, names, subjects) as text; bytes that are not UTF-8 as `\\xNN`."""
    return raw.decode("utf-8", "backslashreplace")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------ specs


@dataclass(frozen=True)
class RepoSpec:
    """One repository the runner serves (`--repo NAME=URL`).

    Attributes:
        name: REPO_NAME_RE.
        url: anything `git clone` takes (path, file://, ssh://, https://, git://, scp-like);
            1-2048 characters, no leading '-', no control characters, not `ext::`/`fd::`.
    Raises:
        UsageError: on construction, one line (the URL masked).
    """

    name: str
    url: str

    def __post_init__(self) -> None:
        problem = _name_problem(self.name) or _url_problem(self.url)
        if problem:
            raise UsageError(f"repo {_shown(str(self.name))}: {problem}")

    def masked_url(self) -> str:
        """The URL with any credential replaced by `***`, for messages and logs."""
        return mask_url(self.url)


def _name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not REPO_NAME_RE.fullmatch(name):
        return (f"name {_shown(str(name))} is invalid: expected 1-64 letters, digits, '.', '_' or '-', "
                "not starting with '.' or '-'")
    return None


def _url_problem(url: object) -> str | None:
    if not isinstance(url, str) or not url:
        return "the URL is empty"
    if len(url) > URL_MAX_CHARS:
        return f"the URL has {len(url)} characters, at most {URL_MAX_CHARS} are allowed"
    if url.startswith("-"):
        return f"the URL {_shown(url)} starts with '-'"
    if any(ord(ch) < 32 or ord(ch) == 127 or not ch.isprintable() for ch in url):
        return f"the URL {_shown(url)} contains a control character"
    if url.lower().startswith(_REFUSED_TRANSPORTS):
        return f"the URL {_shown(url)} uses a command transport (ext::, fd::), which is not allowed"
    return None


def parse_repo(text: str, source: str = "--repo") -> RepoSpec:
    """Parse one `NAME=URL` item.

    Args:
        text: e.g. ``"demo=git@github.com:org/demo.git"``; split at the first '='.
        source: where it came from, for the message (`--repo`, `MAM_RUNNER_REPOS`).
    Returns:
        RepoSpec.
    Raises:
        UsageError: one line, e.g. ``--repo 'x': expected NAME=URL`` (credentials masked).
    """
    if not isinstance(text, str) or "=" not in text:
        raise UsageError(f"{source} {_shown(str(text))}: expected NAME=URL")
    name, url = text.split("=", 1)
    problem = _name_problem(name) or _url_problem(url)
    if problem:
        raise UsageError(f"{source} {_shown(text)}: {problem}")
    return RepoSpec(name, url)


def parse_repos(flags: Sequence[str], env_value: str | None, env_name: str = REPOS_ENV) -> tuple[RepoSpec, ...]:
    """The repositories of `--repo NAME=URL` flags, else of the environment value.

    Args:
        flags: each one `NAME=URL` item; when any is given, `env_value` is ignored.
        env_value: `NAME=URL` items separated by commas or whitespace (a URL in it
            cannot contain either), or None / blank.
        env_name: the variable's name, for messages.
    Returns:
        the specs sorted by name (possibly empty).
    Raises:
        UsageError: a bad item, a name twice (compared ignoring case: mirrors are
            directories), more than MAX_REPOS; one line.
    """
    if flags:
        specs = [parse_repo(flag, "--repo") for flag in flags]
        where = "--repo"
    elif env_value and env_value.strip():
        specs = [parse_repo(item, env_name) for item in re.split(r"[,\s]+", env_value.strip()) if item]
        where = env_name
    else:
        return ()
    if len(specs) > MAX_REPOS:
        raise UsageError(f"{where}: {len(specs)} repositories, at most {MAX_REPOS} are allowed")
    seen: dict[str, str] = {}
    for spec in specs:
        key = spec.name.casefold()
        if key in seen:
            raise UsageError(f"{where}: repository {spec.name!r} is given twice"
                             + ("" if seen[key] == spec.name else f" (as {seen[key]!r}; names are compared "
                                                                  "ignoring case)"))
        seen[key] = spec.name
    return tuple(sorted(specs, key=lambda spec: spec.name))


def validate_ref(ref: str) -> str:
    """`ref` if it can name a branch, tag or commit SHA (§18), else raise.

    The rules of `names.validate_ref` (what the hub accepts: 1-255 characters, no
    leading '-', '/' or '.', no whitespace or control character, no '..', '@{',
    '//', '/.', none of ``~^:?*[\\``, not ending with '.lock', '/' or '.'), plus
    what `git check-ref-format` adds: no component ending with '.lock', not '@',
    no non-printable Unicode. Hex SHAs of 7-40 characters pass these rules.

    Returns:
        `ref` unchanged.
    Raises:
        UsageError: one line naming the ref (cut, quoted).
    """
    names.validate_ref(ref, "ref")
    if ref == "@" or not ref.isprintable() or any(part.endswith(".lock") for part in ref.split("/")):
        raise UsageError(f"ref {_shown(ref, 40)} is invalid: not a branch, tag or commit name git accepts (§18)")
    return ref


# ------------------------------------------------------------------ git calls


def git_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The fixed environment of every git call the runner makes.

    The process environment without the fleet's secrets, without GIT_* variables
    that would redirect git (except ssh/CA/proxy settings), with
    `GIT_TERMINAL_PROMPT=0`, `GIT_CONFIG_NOSYSTEM=1`, `LC_ALL=C`, no pager or
    editor; HOME is kept (the operator's ~/.gitconfig: credentials, insteadOf).

    Args:
        extra: variables added last (e.g. the author of the runner's commit).
    """
    env = {key: value for key, value in os.environ.items()
           if key not in SECRET_ENV_NAMES and (not key.startswith("GIT_") or key in _GIT_ENV_KEPT)}
    env.pop("LANGUAGE", None)
    env.update(GIT_TERMINAL_PROMPT="0", GIT_CONFIG_NOSYSTEM="1", LC_ALL="C", LANG="C", GIT_PAGER="cat",
               PAGER="cat", GIT_EDITOR="true", GIT_SEQUENCE_EDITOR="true", GIT_OPTIONAL_LOCKS="0")
    if extra:
        env.update(extra)
    return env


def runner_identity(session: str) -> dict[str, str]:
    """The author and committer `mam-runner <mam-runner@SESSION>` as git's environment variables."""
    email = f"mam-runner@{session}"
    return {"GIT_AUTHOR_NAME": "mam-runner", "GIT_AUTHOR_EMAIL": email, "GIT_COMMITTER_NAME": "mam-runner",
            "GIT_COMMITTER_EMAIL": email}


def has_identity(tree: Path, env: Mapping[str, str], timeout_s: float = 30.0) -> bool:
    """Whether git, run in `tree` with `env`, knows who commits (`user.email` or GIT_AUTHOR_EMAIL and
    GIT_COMMITTER_EMAIL): False on a fresh host, where an agent's `git commit` would fail."""
    if env.get("GIT_AUTHOR_EMAIL") and env.get("GIT_COMMITTER_EMAIL"):
        return True
    try:
        done = subprocess.run(["git", "config", "--get", "user.email"], cwd=tree, env=dict(env),
                              capture_output=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and bool(done.stdout.strip())


def _with_config(env: Mapping[str, str], pairs: Sequence[tuple[str, str]]) -> dict[str, str]:
    """`env` plus config `pairs` given through GIT_CONFIG_COUNT (no quoting issue, not on argv)."""
    out = dict(env)
    for index, (key, value) in enumerate(pairs):
        out[f"GIT_CONFIG_KEY_{index}"] = key
        out[f"GIT_CONFIG_VALUE_{index}"] = value
    out["GIT_CONFIG_COUNT"] = str(len(pairs))
    return out


def _git_argv(git: str, args: Sequence[str]) -> list[str]:
    argv = [git]
    for key, value in _HARDENING:
        argv += ["-c", f"{key}={value}"]
    return argv + list(args)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL `proc`'s process group (git's helpers: ssh, remote-https, pack-objects)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _run(git: str, args: Sequence[str], *, timeout_s: float, env: Mapping[str, str], what: str,
         ok: Collection[int] = (0,)) -> subprocess.CompletedProcess[bytes]:
    """Run one git command, no shell, in its own process group, with a deadline.

    Args:
        git: the git executable; args: its arguments (after the hardening `-c`s).
        timeout_s: seconds before the whole process group is killed.
        env: the environment (`git_env()`-based).
        what: the start of the error line, e.g. "repo demo: fetch from URL".
        ok: exit codes that are not failures.
    Returns:
        the completed process (stdout and stderr as bytes).
    Raises:
        RepoError: git not found, timed out, or exited outside `ok`:
            "<what> failed: <git's last stderr line>".
    """
    argv = _git_argv(git, args)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=dict(env), start_new_session=True)
    except OSError as exc:
        raise RepoError(f"{what} failed: cannot run {git!r}: {exc.strerror or exc}") from None
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        raise RepoError(f"{what} failed: git timed out after {timeout_s:g} s") from None
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    if proc.returncode not in ok:
        raise RepoError(f"{what} failed: {_one_line(err)}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _stream(git: str, args: Sequence[str], dest: Path, budget: int, *, timeout_s: float,
            env: Mapping[str, str], what: str) -> int:
    """Run git and write its stdout into `dest`, at most `budget` bytes; count the rest.

    Output past the budget is read and dropped, not written, so a huge result never
    fills the disk, and the returned total is exact.

    Returns:
        the number of bytes git wrote to stdout (may exceed `budget`).
    Raises:
        RepoError: as `_run`.
    """
    argv = _git_argv(git, args)
    total = 0
    timed_out = threading.Event()
    with tempfile.TemporaryFile() as err, open(dest, "xb") as out:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                    env=dict(env), start_new_session=True)
        except OSError as exc:
            raise RepoError(f"{what} failed: cannot run {git!r}: {exc.strerror or exc}") from None

        def expire() -> None:
            timed_out.set()
            _kill_group(proc)

        timer = threading.Timer(timeout_s, expire)
        timer.daemon = True
        timer.start()
        try:
            assert proc.stdout is not None
            while chunk := proc.stdout.read(_CHUNK):
                if total < budget:
                    out.write(chunk[:budget - total])
                total += len(chunk)
            proc.wait()
        except BaseException:
            _kill_group(proc)
            proc.wait()
            raise
        finally:
            timer.cancel()
            if proc.stdout is not None:
                proc.stdout.close()
        if timed_out.is_set():
            raise RepoError(f"{what} failed: git timed out after {timeout_s:g} s")
        if proc.returncode != 0:
            err.seek(0)
            raise RepoError(f"{what} failed: {_one_line(err.read(65536))}")
    return total


def _local_filter_overrides(git: str, git_dir: Path, *, timeout_s: float, env: Mapping[str, str],
                            what: str) -> list[tuple[str, str]]:
    """Config pairs that switch off every filter driver the repository's own config defines.

    The agent can write the mirror's config from its worktree; a `filter.X.clean`
    there would run at the runner's `git add`. Drivers from the operator's
    ~/.gitconfig (git-lfs) stay.
    """
    done = _run(git, ["--git-dir", str(git_dir), "config", "--includes", "--show-scope", "-z", "--get-regexp",
                      r"^filter\."], timeout_s=timeout_s, env=env, what=what, ok=(0, 1))
    drivers: set[str] = set()
    fields = done.stdout.split(b"\0")
    for scope, entry in zip(fields[0::2], fields[1::2]):
        if scope in (b"local", b"worktree"):
            key = _decode(entry.split(b"\n", 1)[0])
            if key.count(".") >= 2:
                drivers.add(key[len("filter."):key.rindex(".")])
    pairs: list[tuple[str, str]] = []
    for driver in sorted(drivers):
        pairs += [(f"filter.{driver}.clean", ""), (f"filter.{driver}.smudge", ""),
                  (f"filter.{driver}.process", ""), (f"filter.{driver}.required", "false")]
    return pairs


# ------------------------------------------------------------------ worktrees


@dataclass(frozen=True)
class Worktree:
    """One attempt's worktree.

    Attributes:
        repo: the repository name; path: `<root>/worktrees/<job_id>-<attempt>`;
        branch: `mam/<job_id>-<attempt>`; base_sha: the commit it started at (40 hex);
        ref: what was asked (or the default branch's name).
    """

    repo: str
    path: Path
    branch: str
    base_sha: str
    ref: str

    @property
    def key(self) -> str:
        """`<job_id>-<attempt>`: the directory and branch suffix (what `active` holds)."""
        return self.path.name

    @property
    def root(self) -> Path:
        """The runner root it lives under."""
        return self.path.parent.parent

    @property
    def mirror(self) -> Path:
        """Its repository's bare mirror."""
        return self.root / "repos" / f"{self.repo}.git"


def worktree_key(job_id: str, attempt_id: int) -> str:
    """`<job_id>-<attempt>` for a valid job id and attempt id (§1).

    Raises:
        UsageError: a bad job id or attempt id.
    """
    return f"{names.validate_job_id(job_id)}-{names.validate_attempt(attempt_id)}"


def _registered_admin(mirror: Path, tree: Path) -> Path | None:
    """The admin dir (`<mirror>/worktrees/X`) whose `gitdir` names `<tree>/.git`, or None.

    Reads only the mirror (never the tree's own `.git`, which the agent controls).
    """
    expected = os.path.normpath(tree / ".git")
    admin_root = mirror / "worktrees"
    candidates = [admin_root / tree.name]
    with contextlib.suppress(OSError):
        candidates += sorted(p for p in admin_root.iterdir() if p.name != tree.name)
    for admin in candidates:
        try:
            named = (admin / "gitdir").read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            continue
        if os.path.normpath(named) == expected:
            return admin
    return None


def _delete_path(path: Path) -> None:
    """Remove `path` without following symlinks: a link or file is unlinked, a directory
    removed with the fd-based `shutil.rmtree` (which never follows a link inside it).

    Raises:
        OSError: it could not be removed.
    """
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - Linux and macOS have it
        raise OSError(f"refusing to remove {path}: this platform's rmtree may follow symlinks")
    shutil.rmtree(path)


class Repos:
    """The runner's repositories under `<root>/repos/`: one bare mirror per repo
    (`<root>/repos/<name>.git`), worktrees under `<root>/worktrees/<job_id>-<attempt>/`.

    Thread-safe: each repository has a lock (a threading.Lock and an flock on
    `<root>/repos/<name>.lock`, since two runner processes may share a workspace)
    held by every operation that changes its mirror.

    Args:
        root: the runner's root directory (made absolute).
        specs: the repositories it serves (names unique).
        git: the git executable.
        timeout_s: limit of each git call, and of waiting for a repository's lock, seconds.
    Raises:
        UsageError: a name twice, a timeout not > 0.
    """

    def __init__(self, root: Path, specs: Sequence[RepoSpec], *, git: str = "git",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise UsageError(f"git timeout {timeout_s!r} is invalid: expected seconds > 0")
        by_name: dict[str, RepoSpec] = {}
        for spec in specs:
            if spec.name in by_name:
                raise UsageError(f"repository {spec.name!r} is given twice")
            by_name[spec.name] = spec
        self.root = Path(os.path.realpath(Path(root).expanduser().absolute()))
        self.repos_dir = self.root / "repos"
        self.worktrees_dir = self.root / "worktrees"
        self.git = git
        self.timeout_s = float(timeout_s)
        self._specs = by_name
        self.names: tuple[str, ...] = tuple(sorted(by_name))
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._default: dict[str, str] = {}
        self._env = git_env()

    # -------------------------------------------------------------- helpers

    def mirror_path(self, name: str) -> Path:
        """`<root>/repos/<name>.git`, the bare mirror of repository `name` (made or not).

        Raises:
            RepoError: `name` is not a repository name.
        """
        if not isinstance(name, str) or not REPO_NAME_RE.fullmatch(name):
            raise RepoError(f"repo {_shown(str(name), 64)} is not a repository name")
        return self.repos_dir / f"{name}.git"

    def _mirrors(self) -> list[tuple[str, Path]]:
        """(name, path) of every mirror on disk: the served ones and any other under
        `<root>/repos/` (a repository no longer served, `mam-runner gc` with no specs)."""
        found = {name: self.repos_dir / f"{name}.git" for name in self.names}
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.repos_dir):
                name = entry.name[:-len(".git")]
                if entry.name.endswith(".git") and REPO_NAME_RE.fullmatch(name) and entry.is_dir(follow_symlinks=False):
                    found.setdefault(name, Path(entry.path))
        return [(name, path) for name, path in sorted(found.items()) if (path / "HEAD").is_file()]

    def _spec(self, name: str) -> RepoSpec:
        spec = self._specs.get(name) if isinstance(name, str) else None
        if spec is None:
            served = ", ".join(self.names) or "none"
            raise RepoError(f"repo {_shown(str(name), 64)} is not served by this runner (it serves: {served})")
        return spec

    def _remote_env(self, spec: RepoSpec) -> dict[str, str]:
        """The environment of a network call: the URL as `remote.origin.url`, never in a file."""
        return _with_config(self._env, [("remote.origin.url", spec.url)])

    def _git(self, mirror: Path, args: Sequence[str], what: str, *, env: Mapping[str, str] | None = None,
             ok: Collection[int] = (0,)) -> subprocess.CompletedProcess[bytes]:
        return _run(self.git, ["--git-dir", str(mirror), *args], timeout_s=self.timeout_s,
                    env=self._env if env is None else env, what=what, ok=ok)

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        """Hold repository `name`'s thread lock and flock (waits up to timeout_s).

        Raises:
            RepoError: the lock stayed busy (another attempt or runner process holds it).
        """
        with self._locks_guard:
            lock = self._locks.setdefault(name, threading.Lock())
        deadline = time.monotonic() + self.timeout_s
        if not lock.acquire(timeout=self.timeout_s):
            raise RepoError(f"repo {name}: busy: another attempt held its lock for over {self.timeout_s:g} s")
        try:
            self.repos_dir.mkdir(parents=True, exist_ok=True)
            lock_path = self.repos_dir / f"{name}.lock"
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except OSError as exc:
                raise RepoError(f"repo {name}: cannot open lock file {lock_path}: {exc.strerror or exc}") from None
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise RepoError(f"repo {name}: busy: another runner process held {lock_path} "
                                            f"for over {self.timeout_s:g} s") from None
                        time.sleep(LOCK_POLL_S)
                yield
            finally:
                os.close(fd)  # releases the flock
        finally:
            lock.release()

    # -------------------------------------------------------------- mirrors

    def prepare(self, name: str) -> Path:
        """Create the mirror of `name` if missing, then fetch it (before each attempt, §18).

        First time: `git init --bare`; every time: the mirror's config rewritten
        from the template (fetch refspec `+refs/heads/*:refs/remotes/origin/*`, so our
        mam/* branches are never pruned), then `git fetch --prune --prune-tags
        --force origin` (tags mirrored exactly, forced: a tag an agent moved or added
        is put back or dropped instead of failing the fetch), then `git ls-remote
        --symref origin HEAD` for the remote's default branch, kept as the symref
        refs/remotes/origin/HEAD (the remote may rename its default branch between
        fetches; a clone's HEAD would be frozen at clone time).

        Returns:
            the mirror's path.
        Raises:
            RepoError: not served, busy, or git failed, e.g.
                "repo demo: fetch from git://127.0.0.1:9418/demo failed: <git's last stderr line>".
        """
        spec = self._spec(name)
        mirror = self.mirror_path(name)
        url = spec.masked_url()
        with self._locked(name):
            if not (mirror / "HEAD").is_file():
                with contextlib.suppress(FileNotFoundError):
                    _delete_path(mirror)  # a half-made mirror of a crash
                _run(self.git, ["init", "--bare", "--quiet", str(mirror)], timeout_s=self.timeout_s, env=self._env,
                     what=f"repo {name}: creating the mirror {mirror}")
                log.info("repo %s: mirror %s created for %s", name, mirror, url)
            self._write_config(name, mirror)
            env = self._remote_env(spec)
            self._git(mirror, ["fetch", "--quiet", "--prune", "--prune-tags", "--force", "--no-write-fetch-head",
                               "origin"], f"repo {name}: fetch from {url}", env=env)
            done = self._git(mirror, ["ls-remote", "--symref", "origin", "HEAD"],
                             f"repo {name}: ls-remote of {url}", env=env)
            default = None
            for line in done.stdout.decode("utf-8", "replace").splitlines():
                if line.startswith("ref: refs/heads/") and line.endswith("\tHEAD"):
                    default = line[len("ref: refs/heads/"):-len("\tHEAD")]
            if default is not None:
                self._git(mirror, ["symbolic-ref", "refs/remotes/origin/HEAD", f"refs/remotes/origin/{default}"],
                          f"repo {name}: recording the default branch {default!r}")
                self._default[name] = default
            else:
                log.warning("repo %s: %s names no default branch (HEAD); keeping %r", name, url,
                            self._default.get(name))
        return mirror

    def _write_config(self, name: str, mirror: Path) -> None:
        """Rewrite the mirror's config from the template (atomically): nothing an agent wrote
        into the shared config from its worktree survives into the next fetch."""
        done = self._git(mirror, ["config", "--file", str(mirror / "config"), "--type=bool", "core.filemode"],
                         f"repo {name}: reading the mirror's config", ok=(0, 1, 128))
        filemode = "false" if done.stdout.strip() == b"false" else "true"
        text = _MIRROR_CONFIG.format(filemode=filemode, fetch=ORIGIN_FETCH)
        tmp = mirror / "config.mam-tmp"
        try:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(text)
            os.replace(tmp, mirror / "config")
        except OSError as exc:
            raise RepoError(f"repo {name}: cannot write {mirror / 'config'}: {exc.strerror or exc}") from None

    def default_branch(self, name: str) -> str | None:
        """The remote's default branch as last seen by `prepare` (or recorded in the mirror), or None."""
        if name in self._default:
            return self._default[name]
        mirror = self.mirror_path(name)
        if not (mirror / "HEAD").is_file():
            return None
        done = self._git(mirror, ["symbolic-ref", "--quiet", "refs/remotes/origin/HEAD"],
                         f"repo {name}: reading the default branch", ok=(0, 1, 128))
        target = done.stdout.decode("utf-8", "replace").strip()
        prefix = "refs/remotes/origin/"
        return target[len(prefix):] if done.returncode == 0 and target.startswith(prefix) else None

    def resolve(self, name: str, ref: str | None) -> tuple[str, str]:
        """The commit `ref` names in the mirror: a branch, then a tag, then a commit id (§18).

        Args:
            name: a served repository (prepared).
            ref: a branch (refs/remotes/origin/<ref>), a tag (peeled to its commit), a hex
                SHA of 7-40 characters present in the mirror; None: the remote's default branch.
        Returns:
            (the ref used, the commit's 40-hex SHA).
        Raises:
            UsageError: `ref` is malformed (`validate_ref`).
            RepoError: not served / not prepared / no default branch known, or
                "repo demo has no branch, tag or commit 'nope'".
        """
        self._spec(name)
        mirror = self.mirror_path(name)
        if not (mirror / "HEAD").is_file():
            raise RepoError(f"repo {name} is not prepared: no mirror at {mirror}")
        if ref is None:
            ref = self.default_branch(name)
            if ref is None:
                raise RepoError(f"repo {name}: the remote's default branch is unknown; name a ref")
        validate_ref(ref)
        candidates = [f"refs/remotes/origin/{ref}", f"refs/tags/{ref}"]
        if _HEX_SHA.fullmatch(ref):
            candidates.append(ref)
        for candidate in candidates:
            done = self._git(mirror, ["rev-parse", "--verify", "--quiet", "--end-of-options",
                                      f"{candidate}^{{commit}}"], f"repo {name}: resolving {ref!r}", ok=(0, 1, 128))
            sha = done.stdout.decode("ascii", "replace").strip()
            if done.returncode == 0 and _FULL_SHA.fullmatch(sha):
                if candidate == ref and not sha.startswith(ref):
                    continue  # a ref that happens to be called like a hex string, not the commit asked for
                return ref, sha
        raise RepoError(f"repo {name} has no branch, tag or commit {_shown(ref, 64)}")

    def take_change(self, name: str, bundle: bytes | None, head_sha: str, source: str) -> None:
        """Make `head_sha`, the head of another job's result (§18 "Handing a change on"), a
        commit of the mirror of a prepared repository: when the mirror lacks it, `bundle` (that
        result's git bundle, base..head) is verified against the mirror and fetched into
        `refs/mam/handed/<source>/*`, where no fetch from the remote prunes it.

        Args:
            source: `<job_id>-<attempt>` of that result (`worktree_key`).
        Raises:
            UsageError: a bad sha or source.
            RepoError: the mirror lacks the commit and no bundle came; git refused the bundle (not
                one, or its base is not in the mirror); or it does not hold `head_sha`.
        """
        names.validate_sha(head_sha, "head sha")
        if not re.fullmatch(r"[0-9a-f]{8}-[1-9][0-9]{0,5}", source):
            raise UsageError(f"source {_shown(source, 24)} is invalid: expected <job id>-<attempt>")
        mirror = self.mirror_path(name)
        what = f"repo {name}: the change of {source}"
        with self._locked(name):
            if self._has_commit(mirror, head_sha):
                return
            if bundle is None:
                raise RepoError(f"{what}: commit {head_sha[:12]} is not in the mirror and no bundle came with it")
            with tempfile.NamedTemporaryFile(dir=self.repos_dir, prefix=".handed-", suffix=".bundle") as tmp:
                tmp.write(bundle)
                tmp.flush()
                self._git(mirror, ["bundle", "verify", "--quiet", tmp.name], f"{what}: git bundle verify")
                self._git(mirror, ["fetch", "--no-tags", "--quiet", tmp.name,
                                   f"+refs/heads/*:refs/mam/handed/{source}/*"], f"{what}: git fetch")
            if not self._has_commit(mirror, head_sha):
                raise RepoError(f"{what}: its bundle does not hold commit {head_sha[:12]}")

    def _has_commit(self, mirror: Path, sha: str) -> bool:
        done = self._git(mirror, ["cat-file", "-e", f"{sha}^{{commit}}"], f"looking up commit {sha[:12]}",
                         ok=(0, 1, 128))
        return done.returncode == 0

    # -------------------------------------------------------------- worktrees

    def _marker(self, key: str) -> Path:
        return self.worktrees_dir / f"{key}{FINISHED_SUFFIX}"

    def _filters_env(self, name: str, git_dir: Path) -> dict[str, str]:
        pairs = _local_filter_overrides(self.git, git_dir, timeout_s=self.timeout_s, env=self._env,
                                        what=f"repo {name}: reading the mirror's config")
        return _with_config(self._env, pairs) if pairs else self._env

    def attempt_head(self, name: str, job_id: str, attempt_id: int, base_sha: str) -> str | None:
        """Where an earlier attempt's branch `mam/<job_id>-<attempt_id>` of a prepared repository
        ended (40 hex), when this runner still has it and `base_sha` is an ancestor of it;
        else None (§18: a continued attempt starts there).

        Raises:
            UsageError: bad job id, attempt id or sha. RepoError: git failed.
        """
        branch = f"{BRANCH_PREFIX}{worktree_key(job_id, attempt_id)}"
        names.validate_sha(base_sha, "base sha")
        mirror = self.mirror_path(name)
        with self._locked(name):
            found = self._git(mirror, ["rev-parse", "--verify", "--quiet", f"refs/heads/{branch}^{{commit}}"],
                              f"repo {name}: looking up branch {branch}", ok=(0, 1, 128))
            head = found.stdout.decode("ascii", "replace").strip()
            if found.returncode != 0 or not _FULL_SHA.fullmatch(head):
                return None
            on_top = self._git(mirror, ["merge-base", "--is-ancestor", base_sha, head],
                               f"repo {name}: checking {branch} grew from {base_sha[:12]}", ok=(0, 1, 128))
        return head if on_top.returncode == 0 else None

    def add_worktree(self, name: str, sha: str, job_id: str, attempt_id: int, ref: str,
                     base_sha: str | None = None) -> Worktree:
        """A fresh worktree for one attempt, on a new branch at `sha`.

        `git worktree add -b mam/<job_id>-<attempt> <root>/worktrees/<job_id>-<attempt> <sha>`.
        A tree, registration or branch of that name left by a crash is removed first:
        never two attempts in one tree, never a reused one.

        Args:
            name: a served, prepared repository; sha: a 40-hex commit (from `resolve`);
            job_id: the job id (§1); attempt_id: >= 1; ref: what `resolve` used (recorded);
            base_sha: the job's base when `sha` is where an earlier attempt ended (§18), else `sha`.
        Returns:
            Worktree.
        Raises:
            UsageError: bad job id, attempt id or sha.
            RepoError: git failed, the leftover could not be removed.
        """
        key = worktree_key(job_id, attempt_id)
        if not isinstance(sha, str) or not _FULL_SHA.fullmatch(sha):
            raise UsageError(f"commit {_shown(str(sha), 48)} is invalid: expected 40 lowercase hex characters")
        self._spec(name)
        mirror = self.mirror_path(name)
        path = self.worktrees_dir / key
        branch = f"{BRANCH_PREFIX}{key}"
        with self._locked(name):
            if not (mirror / "HEAD").is_file():
                raise RepoError(f"repo {name} is not prepared: no mirror at {mirror}")
            self.worktrees_dir.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(path) or _registered_admin(mirror, path) is not None:
                log.warning("repo %s: removing worktree %s left by an earlier run before attempt %s", name, path, key)
                self._remove_tree(name, mirror, path)
            self._delete_branch(name, mirror, branch)
            with contextlib.suppress(FileNotFoundError):
                self._marker(key).unlink()
            self._git(mirror, ["worktree", "add", "--quiet", "-b", branch, str(path), sha],
                      f"repo {name}: adding worktree {key} at {sha[:12]}", env=self._filters_env(name, mirror))
        return Worktree(repo=name, path=path, branch=branch, base_sha=base_sha or sha, ref=ref)

    def _delete_branch(self, name: str, mirror: Path, branch: str) -> None:
        done = self._git(mirror, ["rev-parse", "--verify", "--quiet", f"refs/heads/{branch}"],
                         f"repo {name}: looking up branch {branch}", ok=(0, 1, 128))
        if done.returncode == 0:
            log.info("repo %s: deleting branch %s", name, branch)
            self._git(mirror, ["update-ref", "-d", f"refs/heads/{branch}"], f"repo {name}: deleting branch {branch}")

    def _remove_tree(self, name: str | None, mirror: Path | None, path: Path) -> None:
        """Remove the tree at `path` (git first, else by hand) and its registration in `mirror`.

        Raises:
            RepoError: it is still there.
        """
        label = f"repo {name}" if name else "worktrees"
        have_mirror = mirror is not None and (mirror / "HEAD").is_file()
        if mirror is not None and have_mirror and os.path.lexists(path) and _registered_admin(mirror, path):
            try:
                self._git(mirror, ["worktree", "remove", "--force", "--force", str(path)],
                          f"{label}: removing worktree {path.name}")
            except RepoError as exc:
                log.info("%s (removing it by hand)", exc)
        try:
            _delete_path(path)
        except OSError as exc:
            raise RepoError(f"{label}: cannot remove worktree {path}: {exc.strerror or exc}") from None
        if mirror is not None and have_mirror:
            admin = _registered_admin(mirror, path)
            if admin is not None:  # locked (`git worktree lock`) registrations survive prune
                with contextlib.suppress(OSError):
                    _delete_path(admin)
            self._git(mirror, ["worktree", "prune"], f"{label}: pruning worktrees")

    def _owner(self, path: Path) -> str | None:
        """The served repository whose mirror has `path` registered as a worktree, or None."""
        for name, mirror in self._mirrors():
            if _registered_admin(mirror, path) is not None:
                return name
        return None

    def _remove_any(self, path: Path, *, delete_branch: bool) -> None:
        """Remove `path` under its owning repository's lock (any repository)."""
        owner = self._owner(path)
        if owner is None:
            self._remove_tree(None, None, path)
            return
        mirror = self.repos_dir / f"{owner}.git"
        with self._locked(owner):
            self._remove_tree(owner, mirror, path)
            if delete_branch:
                self._delete_branch(owner, mirror, f"{BRANCH_PREFIX}{path.name}")

    def remove_worktree(self, wt: Worktree, *, delete_branch: bool = False) -> None:
        """Remove an attempt's worktree: `git worktree remove --force --force`, by hand if git
        cannot (the agent broke its `.git`), then `git worktree prune`; and its finished marker.

        Args:
            wt: from `add_worktree`.
            delete_branch: delete `mam/<job_id>-<attempt>` too (default: kept, it holds the
                attempt's commits).
        Raises:
            RepoError: the tree exists and could not be removed (an already-gone tree is
                only logged).
        """
        mirror = self.mirror_path(wt.repo)
        with self._locked(wt.repo):
            if not os.path.lexists(wt.path):
                log.info("repo %s: worktree %s is already gone", wt.repo, wt.path)
            self._remove_tree(wt.repo, mirror, wt.path)
            if delete_branch and (mirror / "HEAD").is_file():
                self._delete_branch(wt.repo, mirror, wt.branch)
        with contextlib.suppress(FileNotFoundError):
            self._marker(wt.key).unlink()

    def finish(self, wt: Worktree) -> None:
        """Mark `wt` finished now: `gc()` removes it `ttl_s` later.

        The marker is `<root>/worktrees/<key>.finished`, beside the tree (never inside
        it: the agent cannot fake it), holding the repository and branch as JSON.

        Raises:
            RepoError: the marker cannot be written.
        """
        marker = self._marker(wt.key)
        text = json.dumps({"repo": wt.repo, "branch": wt.branch, "finished_at": time.time()})
        try:
            self.worktrees_dir.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                marker.unlink()
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(text + "\n")
        except OSError as exc:
            raise RepoError(f"repo {wt.repo}: cannot write {marker}: {exc.strerror or exc}") from None

    def leftovers(self) -> list[Path]:
        """Every worktree under `<root>/worktrees/` (any repository, finished or not), sorted.

        Entries are not followed: a symlink there is listed as is.
        """
        try:
            entries = list(os.scandir(self.worktrees_dir))
        except FileNotFoundError:
            return []
        found = [Path(entry.path) for entry in entries
                 if not entry.name.endswith(FINISHED_SUFFIX) and not entry.name.startswith(".")
                 and (entry.is_symlink() or entry.is_dir(follow_symlinks=False))]
        return sorted(found)

    def remove_leftovers(self, keep: bool = False, active: Collection[str] = ()) -> list[Path]:
        """At the runner's start: remove the worktrees a crash left (§18).

        A leftover is a tree without a finished marker whose `<job_id>-<attempt>` is not
        in `active`; finished trees are `gc()`'s. Their branches are kept (they may hold
        commits of the crashed attempt; the next `add_worktree` of that key drops it).

        Args:
            keep: list them in the log and keep them (`--keep-worktrees`).
            active: keys of attempts still running (never touched).
        Returns:
            the paths removed (empty when `keep`).
        Raises:
            RepoError: a tree could not be removed.
        """
        removed: list[Path] = []
        for path in self.leftovers():
            if path.name in active or os.path.lexists(self._marker(path.name)):
                continue
            if keep:
                log.warning("worktree %s was left by a crash; kept (--keep-worktrees)", path)
                continue
            log.warning("worktree %s was left by a crash; removing it", path)
            self._remove_any(path, delete_branch=False)
            removed.append(path)
        return removed

    def gc(self, ttl_s: float = DEFAULT_GC_TTL_S, active: Collection[str] = ()) -> list[Path]:
        """Remove finished worktrees older than `ttl_s`, with their branches; then
        `git worktree prune` and `git gc --auto` in every mirror.

        Args:
            ttl_s: seconds since `finish()` after which a tree goes (0: every finished one).
            active: keys never touched.
        Returns:
            the trees removed.
        Raises:
            RepoError: a tree could not be removed, or git failed in a mirror.
        """
        removed: list[Path] = []
        now = time.time()
        try:
            markers = sorted(p for p in self.worktrees_dir.iterdir() if p.name.endswith(FINISHED_SUFFIX))
        except FileNotFoundError:
            markers = []
        for marker in markers:
            key = marker.name[:-len(FINISHED_SUFFIX)]
            if key in active:
                continue
            try:
                age_s = now - marker.lstat().st_mtime
            except FileNotFoundError:
                continue
            if age_s < ttl_s:
                continue
            path = self.worktrees_dir / key
            if os.path.lexists(path):
                self._remove_any(path, delete_branch=True)
                removed.append(path)
                log.info("worktree %s finished %.0f s ago: removed", path, age_s)
            with contextlib.suppress(FileNotFoundError):
                marker.unlink()
        for name, mirror in self._mirrors():
            with self._locked(name):
                self._git(mirror, ["worktree", "prune"], f"repo {name}: pruning worktrees")
                self._git(mirror, ["-c", "gc.auto=6700", "-c", "gc.autoDetach=false", "gc", "--auto", "--quiet"],
                          f"repo {name}: git gc")
        return removed


# ------------------------------------------------------------------ results


@dataclass(frozen=True)
class ResultSummary:
    """What an attempt changed (§18 `result.json`).

    Attributes:
        repo, ref, base_sha, head_sha: the repository, the ref asked, start and end commits.
        commits: {"sha", "author" ("Name <email>"), "subject"} of base..head, newest first
            (topological), at most 200; commits_total: how many in all.
        files: {"path", "added", "deleted"} of `git diff --numstat` base head (None for a
            binary file), at most 1000; files_total: how many in all.
        insertions, deletions: sums over every text file.
        bundle: `<out_dir>/change.bundle` (branch ^base), None when no new commit or too large.
        patch: `<out_dir>/change.patch` (`git diff --binary`), None when no change or too large.
        note: "no_changes", "result_too_large: N bytes over the M-byte cap", or None.
    """

    repo: str
    ref: str
    base_sha: str
    head_sha: str
    commits: tuple[dict[str, Any], ...]
    commits_total: int
    files: tuple[dict[str, Any], ...]
    files_total: int
    insertions: int
    deletions: int
    bundle: Path | None
    patch: Path | None
    note: str | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; `bundle` and `patch` as file names only."""
        return {
            "repo": self.repo, "ref": self.ref, "base_sha": self.base_sha, "head_sha": self.head_sha,
            "commits": [dict(c) for c in self.commits], "commits_total": self.commits_total,
            "files": [dict(f) for f in self.files], "files_total": self.files_total,
            "insertions": self.insertions, "deletions": self.deletions,
            "bundle": self.bundle.name if self.bundle else None,
            "patch": self.patch.name if self.patch else None, "note": self.note,
        }


def _parse_log(raw: bytes, what: str) -> list[dict[str, Any]]:
    fields = raw.split(b"\0")
    if fields and fields[-1] == b"":
        fields.pop()
    if len(fields) % 3:
        raise RepoError(f"{what} failed: unexpected `git log` output")
    commits = []
    for sha, author, subject in zip(fields[0::3], fields[1::3], fields[2::3]):
        text_sha = sha.decode("ascii", "replace").strip()
        if not _FULL_SHA.fullmatch(text_sha):
            raise RepoError(f"{what} failed: unexpected `git log` output")
        commits.append({"sha": text_sha, "author": _cut(_decode(author), MAX_AUTHOR_CHARS),
                        "subject": _cut(_decode(subject), MAX_SUBJECT_CHARS)})
    return commits


def _parse_numstat(raw: bytes) -> tuple[list[dict[str, Any]], int, int]:
    """`git diff --numstat -z --no-renames` → (files, insertions, deletions)."""
    files: list[dict[str, Any]] = []
    insertions = deletions = 0
    for record in raw.split(b"\0"):
        if not record:
            continue
        added, deleted, path = record.split(b"\t", 2)
        if added == b"-" or deleted == b"-":
            files.append({"path": _decode(path), "added": None, "deleted": None})
            continue
        files.append({"path": _decode(path), "added": int(added), "deleted": int(deleted)})
        insertions += int(added)
        deletions += int(deleted)
    return files, insertions, deletions


def collect_result(wt: Worktree, *, job_id: str, attempt_id: int, session: str, out_dir: Path, max_bytes: int,
                   git: str = "git", timeout_s: float = DEFAULT_TIMEOUT_S) -> ResultSummary:
    """Commit what the agent left uncommitted, then summarise the attempt's change (§18).

    Call it after the agent's processes have exited. Uncommitted changes: `git add -A`,
    then one commit by author and committer "mam-runner <mam-runner@<session>>",
    message "mam: uncommitted changes of job <job_id> attempt <attempt_id>", hooks off
    (`--no-verify`), unsigned. The agent's own commits are kept as they are. When the
    agent left its branch, `mam/<job_id>-<attempt>` is moved to where its HEAD is.
    git runs with the mirror's registration of the tree (`--git-dir`/`--work-tree`),
    never the tree's own `.git`.

    Args:
        wt: from `Repos.add_worktree`; job_id, attempt_id: the attempt (commit message);
        session: the runner's session name (§1, the committer's e-mail domain);
        out_dir: where change.bundle and change.patch go (created; old ones replaced);
        max_bytes: cap on bundle + patch bytes; over it both are deleted and `note` says so;
        git: the git executable; timeout_s: limit of each git call, seconds.
    Returns:
        ResultSummary.
    Raises:
        UsageError: bad job id, attempt id, session or max_bytes.
        RepoError: the tree is not registered in its mirror, or git failed.
    """
    names.validate_job_id(job_id)
    names.validate_attempt(attempt_id)
    names.validate_session(session)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise UsageError(f"max result bytes {max_bytes!r} is invalid: expected an integer >= 0")
    what = f"repo {wt.repo}: collecting the result of {wt.key}"
    admin = _registered_admin(wt.mirror, wt.path)
    if admin is None or not wt.path.is_dir() or wt.path.is_symlink():
        raise RepoError(f"{what} failed: {wt.path} is not a worktree of {wt.mirror}")
    base_env = git_env(runner_identity(session))
    env = _with_config(base_env, _local_filter_overrides(git, admin, timeout_s=timeout_s, env=base_env, what=what))
    tree = ["--git-dir", str(admin), "--work-tree", str(wt.path)]

    def run(*args: str, ok: Collection[int] = (0,)) -> subprocess.CompletedProcess[bytes]:
        return _run(git, [*tree, *args], timeout_s=timeout_s, env=env, what=what, ok=ok)

    stale_lock = admin / "index.lock"
    if os.path.lexists(stale_lock):  # the agent's git died holding it; the agent is gone
        log.warning("%s: removing a stale %s", what, stale_lock)
        with contextlib.suppress(OSError):
            stale_lock.unlink()
    run("add", "--all", "--", ".")
    staged = run("diff", "--cached", "--quiet", "--no-ext-diff", "--no-textconv", ok=(0, 1))
    if staged.returncode == 1:
        run("commit", "--quiet", "--no-verify", "--no-gpg-sign", "--no-edit", "--cleanup=verbatim",
            "-m", f"mam: uncommitted changes of job {job_id} attempt {attempt_id}")
        log.info("%s: committed the uncommitted changes", what)
    head = run("rev-parse", "--verify", "--quiet", "HEAD^{commit}", ok=(0, 1, 128))
    head_sha = head.stdout.decode("ascii", "replace").strip()
    if head.returncode != 0 or not _FULL_SHA.fullmatch(head_sha):
        raise RepoError(f"{what} failed: the worktree's HEAD names no commit")
    on = run("symbolic-ref", "--quiet", "HEAD", ok=(0, 1, 128)).stdout.decode("utf-8", "replace").strip()
    branch_ref = f"refs/heads/{wt.branch}"
    if on != branch_ref:
        log.warning("%s: the agent left %s (HEAD is %s); moving it to %s", what, wt.branch, on or "detached",
                    head_sha[:12])
        run("update-ref", branch_ref, head_sha)

    base = wt.base_sha
    empty = dict(repo=wt.repo, ref=wt.ref, base_sha=base, head_sha=head_sha)
    if head_sha == base:
        return ResultSummary(**empty, commits=(), commits_total=0, files=(), files_total=0, insertions=0,
                             deletions=0, bundle=None, patch=None, note="no_changes")
    commits_total = int(run("rev-list", "--count", head_sha, f"^{base}").stdout.strip() or b"0")
    commits = _parse_log(run("log", "-z", "--topo-order", "--no-show-signature", f"--max-count={MAX_COMMITS_LISTED}",
                             "--format=%H%x00%an <%ae>%x00%s", head_sha, f"^{base}").stdout, what)
    numstat = run("diff", "--numstat", "-z", "--no-renames", "--no-ext-diff", "--no-textconv", base, head_sha)
    files, insertions, deletions = _parse_numstat(numstat.stdout)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bundle, patch = out_dir / BUNDLE_NAME, out_dir / PATCH_NAME
    for old in (bundle, patch):
        with contextlib.suppress(FileNotFoundError):
            old.unlink()
    total = 0
    made: list[Path] = []
    try:
        if commits_total:
            total += _stream(git, [*tree, "bundle", "create", "--quiet", "-", branch_ref, f"^{base}"], bundle,
                             max_bytes, timeout_s=timeout_s, env=env, what=f"{what}: git bundle")
            made.append(bundle)
        total += _stream(git, [*tree, "diff", "--binary", "--full-index", "--no-color", "--no-ext-diff",
                               "--no-textconv", "--no-renames", base, head_sha], patch, max(0, max_bytes - total),
                         timeout_s=timeout_s, env=env, what=f"{what}: git diff")
        made.append(patch)
    except BaseException:
        for path in (bundle, patch):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        raise
    note = None
    if total > max_bytes:
        for path in made:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        made = []
        note = f"result_too_large: {total} bytes over the {max_bytes}-byte cap"
        log.warning("%s: %s", what, note)
    return ResultSummary(**empty, commits=tuple(commits), commits_total=commits_total,
                         files=tuple(files[:MAX_FILES_LISTED]), files_total=len(files), insertions=insertions,
                         deletions=deletions, bundle=bundle if bundle in made else None,
                         patch=patch if patch in made else None, note=note)
