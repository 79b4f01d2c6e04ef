"""PROTOCOL §16.6: the per-runner broker users in a nats config
(`mam.orchestrator.broker.users`) and `mam-orch runner add|revoke` on a managed config
(`mam.orchestrator.identity.runneruser`). The brokers themselves: tests/e2e/test_broker_users.py."""

from __future__ import annotations

import json
import os
import re

import bcrypt
import pytest

from mam.orchestrator import init as mam_init
from mam.orchestrator.broker import conf, users
from mam.orchestrator.identity import runneruser
from mam.shared.protocol import names
from mam.shared.protocol.crypto.invite import InviteCode
from mam.shared.protocol.errors import ConfigError, UsageError

pytestmark = pytest.mark.timeout(30)

PASSWORD = "Runner-password-0123456789"


def test_s16_runner_user_entry_grants_only_the_runner_subjects():
    line = users.nats_user_entry("gpu-box", PASSWORD, "python/mqtt")
    assert line.endswith("  # runner gpu-box\n") and line.count("\n") == 1
    assert '"python.mqtt.jobs.*.events", "python.mqtt.jobs.*.state", "python.mqtt.jobs.*.log", ' \
           '"python.mqtt.jobs.*.result", "python.mqtt.jobs.*.answers.*", "python.mqtt.runners.gpu-box", ' \
           '"python.mqtt.enrol.gpu-box.request"] }, subscribe: { allow: ' \
           '["python.mqtt.jobs.*.dispatch", "python.mqtt.jobs.*.control", "python.mqtt.jobs.*.state", ' \
           '"python.mqtt.jobs.*.answers.*", "python.mqtt.runners.gpu-box", "python.mqtt.runners.gpu-box.revoked", ' \
           '"python.mqtt.runners.gpu-box.drain", "python.mqtt.enrol.gpu-box.answer"]' \
           in line
    assert "dispatch\", \"python.mqtt.runners" not in line.split("subscribe")[0]  # never publishes a dispatch


@pytest.mark.parametrize("session", ["mam_agent", "mam_observer", "sys", "a.b", "", "mam_enrol_0123456789abcdef"])
def test_s16_session_that_cannot_be_a_broker_user_is_refused(session):
    with pytest.raises(UsageError):
        users.runner_user(session)


def test_s16_add_replace_and_remove_runner_users_in_the_shipped_template():
    text = mam_init.render_nats_conf()
    one = users.with_runner_user(text, "a-box", PASSWORD)
    two = users.with_runner_user(one, "b-box", PASSWORD)
    again = users.with_runner_user(two, "a-box", "Other-password-0123456789")
    assert users.runner_users(again) == ["b-box", "a-box"] and PASSWORD not in again
    assert users.without_runner_user(users.without_runner_user(again, "a-box"), "b-box") == text
    assert again.replace(users.users_block(again), "") == text


def test_s16_5_an_invites_one_time_user_may_only_request_and_read_its_answer():
    code = InviteCode.new("gpu-box")
    text = users.with_runner_user(mam_init.render_nats_conf(), "a-box", PASSWORD)
    with_enrol = users.with_enrol_user(text, code, "python/mqtt")
    (line,) = [entry for entry in users.users_block(with_enrol).splitlines() if code.enrol_username in entry]
    assert 'publish: { allow: ["python.mqtt.enrol.gpu-box.request"] }' in line
    assert 'subscribe: { allow: ["python.mqtt.enrol.gpu-box.answer"] }' in line
    assert code.enrol_password not in with_enrol
    hashed = re.search(r'password: "([^"]+)"', line)
    assert hashed is not None and bcrypt.checkpw(code.enrol_password.encode(), hashed.group(1).encode())
    assert users.enrol_users(with_enrol) == [code.enrol_username] and users.runner_users(with_enrol) == ["a-box"]
    assert users.without_enrol_users(with_enrol, {code.enrol_username}) == text


def test_s16_5_no_one_time_user_without_a_managed_broker_to_reload(tmp_path):
    assert runneruser.add_enrol_user(tmp_path, InviteCode.new("gpu-box"), set()) is False
    runneruser.remove_enrol_user(tmp_path, InviteCode.new("gpu-box"))  # nothing to remove: no error


@pytest.mark.parametrize("password", ["short", 'with"quote-0123456789', "x" * 73, "$2b$11$" + "a" * 53])
def test_s16_a_runner_password_the_config_cannot_hold_is_refused_with_one_line(password):
    """Too short, a quote (config injection), over bcrypt's 72 bytes, a `$` (never read as a hash)."""
    with pytest.raises(ConfigError) as refused:
        users.nats_user_entry("gpu-box", password)
    assert "\n" not in str(refused.value) and password not in str(refused.value)


def test_s16_config_without_markers_is_refused_with_one_line():
    with pytest.raises(ConfigError, match="BEGIN runner users"):
        users.with_runner_user("accounts {}\n", "a-box", PASSWORD)


def test_s16_embedded_broker_keeps_runner_users_across_up(tmp_path):
    """`broker up` regenerates nats.conf: the users `runner add` put there stay."""
    settings = conf.NatsSettings(store_dir=tmp_path / "js")
    text = conf.render_nats_config(settings, conf.BrokerCredentials.fresh())
    kept = users.with_runner_user(text, "a-box", PASSWORD)
    fresh = conf.render_nats_config(settings, conf.BrokerCredentials.fresh())
    assert users.runner_users(users.with_users_block(fresh, users.users_block(kept))) == ["a-box"]


def test_s16_grant_and_withdraw_edit_the_config_init_recorded(tmp_path):
    root = tmp_path / "hub"
    root.mkdir()
    conf = tmp_path / "nats.conf"
    mam_init.init_workspace(root, broker_config=conf, environ={})
    assert json.loads(names.broker_record_path(root).read_text())["config"] == str(conf)
    granted = runneruser.grant(root, "a-box")
    password = granted.credentials.read_text().split("MQTT_PASSWORD=")[1].split()[0]
    assert os.stat(granted.credentials).st_mode & 0o777 == 0o600
    assert password not in conf.read_text() and not any(password in line for line in granted.lines)
    hashed = re.search(r'user: "a-box", password: "(\$2b\$[^"]+)"', conf.read_text())
    assert hashed and bcrypt.checkpw(password.encode(), hashed[1].encode())  # what nats-server checks
    assert users.runner_users(conf.read_text()) == ["a-box"]
    lines = runneruser.withdraw(root, "a-box")
    assert lines[0] == "removed broker user a-box" and "reload=<pid>" in lines[1]
    assert users.runner_users(conf.read_text()) == [] and not granted.credentials.exists()


def test_s16_grant_with_an_unreadable_managed_config_is_one_line(tmp_path):
    root = tmp_path / "hub"
    root.mkdir()
    conf = tmp_path / "nats.conf"
    mam_init.init_workspace(root, broker_config=conf, environ={})
    conf.unlink()  # the recorded config is gone
    with pytest.raises(ConfigError, match="cannot read the broker config") as refused:
        runneruser.add_user(root, "a-box")
    assert "\n" not in str(refused.value)


def test_s16_grant_without_a_managed_config_says_what_to_add(tmp_path):
    root = tmp_path / "hub"
    root.mkdir()
    mam_init.init_workspace(root, environ={})
    granted = runneruser.grant(root, "a-box")
    assert granted.credentials.exists() and "docs/security.md" in granted.lines[-1]
    assert "remove the broker user a-box" in runneruser.withdraw(root, "a-box")[0]


def test_s16_config_from_before_runner_users_is_not_edited_and_says_so(tmp_path):
    root = tmp_path / "hub"
    root.mkdir()
    conf = tmp_path / "nats.conf"
    mam_init.init_workspace(root, broker_config=conf, environ={})
    old = conf.read_text().replace(users.BEGIN_MARK, "").replace(users.END_MARK, "")
    conf.write_text(old)
    granted = runneruser.grant(root, "a-box")
    assert "predates per-runner users" in granted.lines[-1] and conf.read_text() == old
    assert runneruser.withdraw(root, "a-box") == [f"broker user a-box is not in {conf}"]
