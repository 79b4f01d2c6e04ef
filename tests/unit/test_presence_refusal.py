"""A runner's refusal of an authentic dispatch travels in its signed
presence (`last_refusal`, an extra field hubs that do not know it ignore, §7), and the hub
says it once; malformed or hostile values are ignored, never raised (§7)."""

from __future__ import annotations

import json

import pytest

from mam.orchestrator.queuewait import PresenceFeed
from mam.orchestrator.runners import REFUSAL_SHOWN_CHARS, last_refusal, presence_view
from mam.runner.presence import REFUSAL_DETAIL_CHARS, Presence
from mam.runner.trust import V1Trust
from mam.shared.protocol import crypto, names, wire

pytestmark = pytest.mark.timeout(30)

KEYS = crypto.derive_keys("s" * 40)
ROOT = "python/mqtt"
JOB = "0123abcd"


def presence(**extra_fields: object) -> bytes:
    runner = Presence(session="gpu-box", runner_id="a" * 32, trust=V1Trust(KEYS), max_jobs=1, topic_root=ROOT)
    message = json.loads(runner.payload("online", []))
    message.pop("sig")
    message.update(extra_fields)
    return wire.encode(crypto.sign(message, KEYS.sign_key))


def test_s14_refusal_is_carried_in_the_signed_presence():
    runner = Presence(session="gpu-box", runner_id="a" * 32, trust=V1Trust(KEYS), max_jobs=1, topic_root=ROOT)
    runner.note_refusal(JOB, "expired", "x" * 1000)
    raw = runner.payload("online", [])
    decoded = wire.decode(raw, "presence")
    crypto.verify(decoded.to_dict(), KEYS.sign_key)  # the extra field is signed with the rest
    assert last_refusal(decoded) == (JOB, f"expired: {'x' * REFUSAL_DETAIL_CHARS}")


@pytest.mark.parametrize("value", [
    None, "expired", [JOB, "expired"], {"job_id": "../../etc", "reason": "x"}, {"job_id": JOB},
    {"job_id": JOB, "reason": 7}, {"job_id": JOB, "reason": "x", "detail": {"a": 1}},
])
def test_s14_malformed_last_refusal_is_ignored(value):
    assert last_refusal(wire.decode(presence(last_refusal=value), "presence")) is None


def test_s14_hostile_last_refusal_is_cut_and_printable():
    raw = presence(last_refusal={"job_id": JOB, "reason": "\x1b[2Jexpired", "detail": "\x07" + "y" * 10_000})
    job_id, text = last_refusal(wire.decode(raw, "presence"))
    assert job_id == JOB and len(text) == REFUSAL_SHOWN_CHARS and text.isprintable()


def test_s14_unverified_presence_tells_nothing_and_the_hub_says_a_refusal_once():
    topic = names.presence_topic("gpu-box", ROOT)
    forged = presence(last_refusal={"job_id": JOB, "reason": "taken", "detail": ""})
    other_keys = crypto.derive_keys("t" * 40)
    assert presence_view(topic, forged, other_keys, ROOT, 0.0).last_refusal is None
    feed = PresenceFeed(KEYS, ROOT)
    feed.handle(topic, forged)
    line = feed.refusal("gpu-box", JOB)
    assert line is not None and "runner gpu-box refused the dispatch of job 0123abcd: taken" in line
    assert feed.refusal("gpu-box", JOB) is None
    assert feed.refusal("gpu-box", "ffffffff") is None
