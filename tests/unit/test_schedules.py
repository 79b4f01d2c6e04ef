"""orchestrator/schedules.py (PROTOCOL §14 Schedules) on a real registry, with the clock given:
which ticks fire, catch-up after an outage, the overlap rules, a tick never fired twice, and
bad input (names, cron, time zones, hostile files) refused in one line, nothing saved."""

from __future__ import annotations

import json
import os
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mam.orchestrator import schedules
from mam.orchestrator.enqueue import register_queued
from mam.shared.cli import render
from mam.shared.protocol.errors import RegistryError, UsageError
from mam.shared.store.registry import JobNotFound, Registry

pytestmark = pytest.mark.timeout(60)

T0 = datetime(2026, 12, 5, 2, 59, 30, tzinfo=UTC)
PARAMS = {"labels": "gpu", "brief": "Update the dependencies", "retries": 1, "memory": "1G"}


def add(root: Path, name: str = "nightly", cron: str = "0 3 * * *", **kw) -> schedules.Schedule:
    terms = {"tz": "UTC", "overlap": "skip", "catch_up": 1, **kw}
    return schedules.add(root, name, cron=cron, params=dict(PARAMS), now=T0, **terms)


class Cancels:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.calls: list[tuple[str, str]] = []

    def __call__(self, job_id: str, reason: str) -> None:
        self.calls.append((job_id, reason))
        self.registry.close(job_id, "cancelled", source="operator", reason=reason)


def fire(registry: Registry, name: str, now: datetime, cancel: Cancels | None = None, **kw) -> list[str]:
    store = schedules.Store(registry.root)
    return schedules.fire(registry, store, store.load(name), now, register_queued, cancel or Cancels(registry), **kw)


def test_a_schedule_keeps_the_dispatch_it_makes_and_fires_its_tick_once(tmp_path):
    registry = Registry(tmp_path)
    schedule = add(tmp_path)
    assert schedules.describe(schedule, T0)["next_fire"] == "2026-12-05T03:00:00Z"
    assert (schedules.schedules_dir(tmp_path) / "nightly.json").stat().st_mode & 0o777 == 0o600
    assert fire(registry, "nightly", T0 + timedelta(seconds=20)) == []  # 02:59:50: not yet
    (job_id,) = fire(registry, "nightly", T0 + timedelta(seconds=31))
    assert fire(registry, "nightly", T0 + timedelta(seconds=31)) == []  # the same tick: never twice
    record = registry.get(job_id)
    assert record["schedule"] == {"name": "nightly", "tick": "2026-12-05T03:00:00Z", "catch_up": False}
    assert (record["status"], record["target"], record["retries"]) == ("queued", {"labels": ["gpu"]}, 1)
    assert record["work"] == {"memory_bytes": 1 << 30} and record["title"] == "Update the dependencies"
    assert "schedule:   nightly (tick 2026-12-05T03:00:00Z)" in render.show_head(record, tmp_path)
    shown = schedules.describe(schedules.Store(tmp_path).load("nightly"), T0 + timedelta(seconds=31))
    assert (shown["last_job"], shown["next_fire"]) == (job_id, "2026-12-06T03:00:00Z")


def test_after_an_outage_only_the_latest_missed_ticks_run_marked_catch_up(tmp_path):
    registry = Registry(tmp_path)
    add(tmp_path, "every-minute", "* * * * *", catch_up=2, overlap="queue")
    later = T0 + timedelta(minutes=6, seconds=10)  # 03:05:40: ticks 03:00 .. 03:05 were missed (> 15 s late)
    fired = fire(registry, "every-minute", later)
    assert [registry.get(j)["schedule"]["tick"] for j in fired] == ["2026-12-05T03:04:00Z", "2026-12-05T03:05:00Z"]
    assert all(registry.get(j)["schedule"]["catch_up"] for j in fired)
    (on_time,) = fire(registry, "every-minute", later + timedelta(seconds=21))  # 03:06:01
    assert registry.get(on_time)["schedule"] == {"name": "every-minute", "tick": "2026-12-05T03:06:00Z",
                                                 "catch_up": False}
    add(tmp_path, "none-missed", "* * * * *", catch_up=0)
    assert fire(registry, "none-missed", later) == []
    assert schedules.Store(tmp_path).load("none-missed").last_tick == "2026-12-05T03:05:00Z"


def test_overlap_skip_says_so_queue_runs_beside_and_cancel_stops_the_last_job(tmp_path):
    registry = Registry(tmp_path)
    cancels = Cancels(registry)
    for policy in ("skip", "queue", "cancel"):
        add(tmp_path, policy, "* * * * *", overlap=policy)
        (first,) = fire(registry, policy, T0 + timedelta(seconds=31), cancels)
        second = fire(registry, policy, T0 + timedelta(seconds=91), cancels)
        if policy == "skip":
            assert second == []
            assert schedules.Store(tmp_path).load("skip").last_skipped == (
                f"2026-12-05T03:01:00Z: job {first} still queued")
            assert fire(registry, "skip", T0 + timedelta(seconds=92), cancels) == []  # that tick is done
        elif policy == "queue":
            assert len(second) == 1 and registry.get(first)["status"] == "queued"
        else:
            assert len(second) == 1 and registry.get(first)["status"] == "cancelled"
            assert cancels.calls == [(first, "schedule cancel: a new tick came (--overlap cancel)")]


def test_a_paused_schedule_passes_its_ticks_and_run_now_fires_one_job(tmp_path):
    registry = Registry(tmp_path)
    add(tmp_path, "m", "* * * * *")
    schedules.set_paused(tmp_path, "m", True)
    assert fire(registry, "m", T0 + timedelta(minutes=3)) == []
    assert schedules.describe(schedules.Store(tmp_path).load("m"))["next_fire"] is None
    (job_id,) = fire(registry, "m", T0 + timedelta(minutes=3), forced=True)
    assert registry.get(job_id)["schedule"]["catch_up"] is False


@pytest.mark.parametrize(("kw", "words"), [
    ({"name": "a/b"}, "schedule name 'a/b' is invalid"),
    ({"name": "Big Name"}, "schedule name 'Big Name' is invalid"),
    ({"cron": "* * * * * * *"}, "--cron '* * * * * * *' is invalid: expected 5 fields"),
    ({"cron": "61 * * * *"}, "--cron '61 * * * *' is invalid"),
    ({"cron": "x" * 5000}, "is invalid"),
    ({"tz": "Mars/Olympus"}, "--tz 'Mars/Olympus' is not a known time zone"),
    ({"tz": "../../etc/passwd"}, "is not a known time zone"),
    ({"overlap": "never"}, "--overlap 'never' is invalid"),
    ({"catch_up": 101}, "--catch-up 101 is invalid"),
])
def test_bad_schedule_terms_are_refused_in_one_line_and_nothing_is_saved(tmp_path, kw, words):
    terms = {"name": "nightly", "cron": "0 3 * * *", "tz": "UTC", "overlap": "skip", "catch_up": 1, **kw}
    name = terms.pop("name")
    with pytest.raises(UsageError, match=re.escape(words)) as caught:
        schedules.add(tmp_path, name, params=dict(PARAMS), now=T0, **terms)
    assert "\n" not in str(caught.value)
    assert not schedules.schedules_dir(tmp_path).exists() or not list(schedules.schedules_dir(tmp_path).iterdir())


def test_bad_dispatch_options_are_refused_as_dispatch_refuses_them(tmp_path):
    for params, words in [({"brief": "x"}, "give --session NAME"), ({"labels": "gpu"}, "brief"),
                          ({**PARAMS, "memory": "lots"}, "--memory 'lots' is invalid"),
                          ({**PARAMS, "detach": True}, "--detach has no meaning for a schedule"),
                          ({**PARAMS, "after": "0badf00d"}, "--after, --if and --from-result have no meaning")]:
        with pytest.raises(UsageError, match=words):
            schedules.add(tmp_path, "n", cron="0 3 * * *", tz="UTC", overlap="skip", catch_up=1, params=params)
    add(tmp_path)
    with pytest.raises(UsageError, match="schedule nightly exists"):
        add(tmp_path)


def test_a_hostile_or_broken_schedule_file_is_refused_and_the_others_still_fire(tmp_path):
    registry = Registry(tmp_path)
    add(tmp_path, "good", "* * * * *")
    folder = schedules.schedules_dir(tmp_path)
    (folder / "garbage.json").write_text("{not json")
    (folder / "huge.json").write_bytes(b" " * (schedules.MAX_FILE_BYTES + 10))
    (folder / "forged.json").write_text(json.dumps({**json.loads((folder / "good.json").read_text()),
                                                    "name": "forged", "cron": "* * * * * * *"}))
    os.symlink("/etc/passwd", folder / "linked.json")
    store = schedules.Store(tmp_path)
    for name in ("garbage", "huge", "forged", "linked"):
        with pytest.raises(RegistryError) as caught:
            store.load(name)
        assert "\n" not in str(caught.value)
    with pytest.raises(JobNotFound, match="no schedule named gone"):
        store.load("gone")
    firing = schedules.Firing(registry, register=register_queued, cancel=Cancels(registry))
    fired = firing.look(0.0, T0 + timedelta(seconds=31))
    assert len(fired) == 1 and registry.get(fired[0])["schedule"]["name"] == "good"
    assert firing.look(0.5, T0 + timedelta(seconds=95)) == []  # at most once a second
