"""`mam-orch gc --reclear`: which retained topics must stay cleared (issue 10 fault 7; §2)."""

from __future__ import annotations

import pytest

from mam.orchestrator import gc

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("status, collected, leaves", [
    ("completed", False, ("dispatch", "control")),
    ("error", False, ("dispatch", "control")),
    ("cancelled", False, ("dispatch", "control")),
    ("completed", True, ("dispatch", "events", "state", "control")),
    ("running", False, ("dispatch",)),
    ("pending", False, ()),
])
def test_fault7_reclear_leaves_follow_the_hub_record(status, collected, leaves):
    assert gc.reclear_leaves({"status": status}, collected) == leaves  # type: ignore[arg-type]
