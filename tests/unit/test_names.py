"""PROTOCOL §1-§2: names and topics."""

import pytest

from mam.shared.protocol import names
from mam.shared.protocol.errors import UsageError


@pytest.mark.parametrize("bad,why", [
    ("gpu.box", "'.' is not allowed"),
    ("a/b", "'/' is not allowed"),
    ("+", "'+' is not allowed"),
    ("#", "'#' is not allowed"),
    ("gpu box", "a space is not allowed"),
    ("a*", "'*' is not allowed"),
    ("a>", "'>' is not allowed"),
    ("x" * 64, "64 characters"),
    ("", "empty"),
    ("-lead", "start with a letter or digit"),
    ("gpü", "'ü' is not allowed"),
    ("a\nb", "is not allowed"),
])
def test_s1_session_refused_naming_rule(bad, why):
    with pytest.raises(UsageError) as info:
        names.validate_session(bad)
    message = str(info.value)
    assert why in message
    assert "\n" not in message.replace(repr(bad), "")


@pytest.mark.parametrize("good", ["gpu-box", "a", "A_1", "x" * 63, "9lives"])
def test_s1_session_accepted(good):
    assert names.validate_session(good) == good


@pytest.mark.parametrize("bad", ["918B0612", "918b061", "918b06123", "zzzzzzzz", "", 12345678, None])
def test_s1_job_id_refused(bad):
    with pytest.raises(UsageError, match="job id"):
        names.validate_job_id(bad)


def test_s1_an_oversized_job_id_is_refused_in_one_short_line():
    with pytest.raises(UsageError) as refused:
        names.validate_job_id("a" * 100_000)
    assert len(str(refused.value)) < 200 and "\n" not in str(refused.value)


def test_s1_fresh_names_have_their_forms():
    assert names.JOB_ID_RE.match(names.new_job_id())
    assert names.TOKEN_RE.match(names.new_dispatch_token())
    assert names.TOKEN_RE.match(names.new_runner_id())
    assert len(names.new_auth_token()) >= 43


@pytest.mark.parametrize("bad", [0, -1, True, 1.0, "1"])
def test_s1_attempt_refused(bad):
    with pytest.raises(UsageError, match="attempt"):
        names.validate_attempt(bad)


def test_s1_remote_label_round_trip():
    assert names.agent_session_label("gpu-box") == "remote:gpu-box"
    assert names.session_from_label("remote:gpu-box") == "gpu-box"
    with pytest.raises(UsageError):
        names.session_from_label("gpu-box")


def test_s2_topics(monkeypatch):
    monkeypatch.delenv("MAM_TOPIC_ROOT", raising=False)
    assert names.dispatch_topic("918b0612") == "python/mqtt/jobs/918b0612/dispatch"
    assert names.events_topic("918b0612") == "python/mqtt/jobs/918b0612/events"
    assert names.state_topic("918b0612") == "python/mqtt/jobs/918b0612/state"
    assert names.control_topic("918b0612") == "python/mqtt/jobs/918b0612/control"
    assert names.presence_topic("gpu-box") == "python/mqtt/runners/gpu-box"
    monkeypatch.setenv("MAM_TOPIC_ROOT", "acme/mam")
    assert names.events_topic("918b0612") == "acme/mam/jobs/918b0612/events"
    assert names.parse_job_topic("acme/mam/jobs/918b0612/state") == ("918b0612", "state")
    assert names.parse_job_topic("acme/mam/jobs/nothex00/state") is None
    assert names.parse_presence_topic("acme/mam/runners/gpu-box") == "gpu-box"


@pytest.mark.parametrize("bad", ["a/+", "#", "/lead", "trail/", "a//b", ""])
def test_s2_topic_root_refused(bad):
    with pytest.raises(UsageError, match="topic root"):
        names.topic_root(bad)


def test_s2_topic_builders_validate_their_parts():
    with pytest.raises(UsageError):
        names.events_topic("../../x")
    with pytest.raises(UsageError):
        names.presence_topic("a/b")


@pytest.mark.parametrize("validator,value", [
    (names.validate_job_id, "918b0612\n"),
    (names.validate_session, "gpu\n"),
    (names.validate_token, "0" * 32 + "\n"),
])
def test_s1_trailing_newline_refused(validator, value):
    with pytest.raises(UsageError):
        validator(value)
