"""Which folder is a host's workspace root, the parent of its `.mam/` registry (§8, §13)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from mam.shared.protocol.errors import ConfigError, UsageError

ROOT_MARKERS = (".agents", ".git")


def _marker_parent(start: Path) -> Path | None:
    """The nearest directory at or above `start` holding `.agents` or `.git`."""
    start = start.resolve()
    for candidate in (start, *start.parents):
        if any((candidate / marker).exists() for marker in ROOT_MARKERS):
            return candidate
    return None


def root_candidates(workspace: str | os.PathLike[str] | None = None,
                    environ: Mapping[str, str] | None = None,
                    cwd: Path | None = None) -> list[Path]:
    """The workspace root candidates of §8/§13, in order, without duplicates.

    Args:
        workspace: an explicit `--workspace` directory (first when given).
        environ: variables to read MAM_REAL_ROOT and WORKSPACE_ROOT from (default os.environ).
        cwd: the directory to start the `.agents`/`.git` walk from (default os.getcwd()).
    Returns:
        candidate directories: workspace, MAM_REAL_ROOT, WORKSPACE_ROOT, the
        nearest marker parent, the current directory.
    """
    env = os.environ if environ is None else environ
    here = Path(cwd) if cwd is not None else Path.cwd()
    found: list[Path] = []
    for value in (workspace, env.get("MAM_REAL_ROOT"), env.get("WORKSPACE_ROOT")):
        if value:
            found.append(Path(value).expanduser())
    marker = _marker_parent(here)
    if marker is not None:
        found.append(marker)
    found.append(here)
    unique: list[Path] = []
    for path in found:
        if path not in unique:
            unique.append(path)
    return unique


def resolve_root(workspace: str | os.PathLike[str] | None = None,
                 environ: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> Path:
    """The registry root of §8: `--workspace`, else MAM_REAL_ROOT, else
    WORKSPACE_ROOT, else the nearest parent holding `.agents` or `.git`,
    else the current directory.

    Raises:
        ConfigError: an explicitly named root that exists but is not a directory.
    """
    root = root_candidates(workspace, environ, cwd)[0]
    if root.exists() and not root.is_dir():
        raise ConfigError(f"workspace {str(root)!r} is not a directory")
    return root.resolve()


def existing_root(workspace: str | os.PathLike[str] | None = None) -> Path:
    """`resolve_root` for commands that only read a registry: a `--workspace` that is not
    a directory is a usage error (exit 64), not an empty registry.

    Raises:
        UsageError: `workspace` was given and is not an existing directory.
    """
    if workspace is not None and not Path(workspace).is_dir():
        raise UsageError(f"--workspace {os.fspath(workspace)!r} is not an existing directory")
    return resolve_root(workspace)
