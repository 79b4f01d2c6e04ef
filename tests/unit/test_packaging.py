"""The wheel holds every package of the tree: pyproject's `packages` lists each folder
with an `__init__.py` under the four package dirs (a missing one installs fine in
editable mode and fails only in the docker images, which install the wheel)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *parts)))
    missing = sorted(found - set(setuptools["packages"]))
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_no_two_test_modules_share_a_name() -> None:
    """pytest imports test modules by their basename (no `__init__.py` in tests/): two
    `test_x.py` in tests/unit and tests/e2e fail collection when one run holds both."""
    seen: dict[str, Path] = {}
    twice = []
    for path in sorted([*(ROOT / "tests").rglob("test_*.py"), *(ROOT / "bench").rglob("test_*.py")]):
        if path.name in seen:
            twice.append(f"{seen[path.name].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen.setdefault(path.name, path)
    assert not twice, f"rename one of each: {twice}"
