"""docs/protocol.md is the protocol's source of truth: every `§N` the code, the tests and
the docs cite is a section of it, nothing points at a spec outside the repository, and
code and tests give their reasons, not issue numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
PROTOCOL = REPO / "docs" / "protocol.md"
CODE = ("orchestrator", "runner", "shared", "api", "tests", "bench", "examples", "deploy")
SUFFIXES = {".py", ".md", ".sh", ".toml", ".js", ".html", ".conf", ".yaml", ".yml"}
CITED = re.compile(r"§(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#+ (\d+(?:\.\d+)*)\.? ", re.M)
ISSUE_REF = re.compile(r"\bissues? #?\d+", re.I)


def files(*folders: str) -> list[Path]:
    found = []
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts \
                    and ".venv" not in path.parts and "node_modules" not in path.parts:
                found.append(path)
    return found


def where(path: Path, text: str, at: int) -> str:
    return f"{path.relative_to(REPO)}:{text.count(chr(10), 0, at) + 1}"


def test_every_cited_section_exists_in_docs_protocol():
    sections = set(HEADING.findall(PROTOCOL.read_text()))
    assert {"3.2", "14", "16.7", "17"} <= sections
    missing = []
    for path in [*files(*CODE, "docs"), REPO / "README.md"]:
        text = path.read_text(errors="replace")
        missing += [f"§{m.group(1)} at {where(path, text, m.start())}" for m in CITED.finditer(text)
                    if m.group(1) not in sections]
    assert missing == []


def test_nothing_points_outside_the_repository_or_at_an_issue_number():
    found = []
    for path in files(*CODE, "docs"):
        if path == Path(__file__):
            continue
        text = path.read_text(errors="replace")
        found += [f"../shared at {where(path, text, m.start())}" for m in re.finditer(r"\.\./shared", text)]
        if path.relative_to(REPO).parts[0] in CODE:
            found += [f"{m.group(0)!r} at {where(path, text, m.start())}" for m in ISSUE_REF.finditer(text)
                      if not re.search(r"[\w-]+/[\w.-]+#\d+$|paho $", text[max(0, m.start() - 40):m.start()])]
    assert found == []
