"""mam-fleet's Python API: `from mam import Hub` (README "Python API").

This folder is the top-level package `mam` (pyproject `package-dir`); the
code lives in `mam.orchestrator.api`. Every `mam.*` import runs this file
first, `mam-runner publish`'s stdlib-only fast path (`mam.runner.fastpath`)
included, so the API is imported lazily, on first use of a name below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mam.orchestrator.api import Hub, Job, Outcome

__all__ = ["Hub", "Job", "Outcome"]


def __getattr__(name: str) -> Any:
    """`mam.Hub`, `mam.Job`, `mam.Outcome`, imported on first use (PEP 562)."""
    if name in __all__:
        return getattr(importlib.import_module("mam.orchestrator.api"), name)
    raise AttributeError(f"module 'mam' has no attribute {name!r}")
