"""`mam-orch runners` says when its list may be incomplete (a broker that lost retained presences; §7)."""

from __future__ import annotations

import pytest

from mam.orchestrator import runners

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("count", sorted(runners.QUEUE_LIMIT_COUNTS))
def test_fault6_a_count_equal_to_a_broker_queue_limit_is_suspect(count):
    reasons = runners.incomplete_reasons(count, cut_off=False, last_count=None)
    assert len(reasons) == 1 and "broker queue limit" in reasons[0]


def test_fault6_fewer_than_the_previous_run_and_a_cut_burst_are_suspect():
    reasons = runners.incomplete_reasons(1990, cut_off=True, last_count=2000)
    assert any("still arriving" in r for r in reasons) and any("received 2000" in r for r in reasons)


@pytest.mark.parametrize("received, last", [(2000, None), (2000, 2000), (2001, 2000), (0, None)])
def test_fault6_a_plain_count_is_not_suspect(received, last):
    assert runners.incomplete_reasons(received, cut_off=False, last_count=last) == []


def test_fault6_the_count_is_kept_in_the_hubs_mam_dir_and_read_back(tmp_path):
    assert runners._last_count(tmp_path) is None
    runners._keep_count(tmp_path, 1234)
    assert runners._last_count(tmp_path) == 1234
    (tmp_path / ".mam" / "runners-seen.json").write_text('{"received": "many"}')
    assert runners._last_count(tmp_path) is None  # unreadable: no comparison, no crash
