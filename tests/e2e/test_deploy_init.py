"""`mam-orch init` (orchestrator/init.py) and the templates it ships (§13).

Runs the installed console script as a real process; no broker needed.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from dotenv import dotenv_values

from mam.orchestrator import init as mam_init
from mam.shared.errors import ConfigError, UsageError

REPO = Path(__file__).resolve().parents[2]
MAM_ORCH = REPO / ".venv" / "bin" / "mam-orch"

pytestmark = pytest.mark.timeout(60)


def run_init(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MAM_", "MQTT_", "WORKSPACE_ROOT"))}
    environ.update(env or {})
    return subprocess.run([str(MAM_ORCH), "init", *args], capture_output=True, text=True, timeout=30,
                          env=environ)


@pytest.mark.parametrize("name, constant", [("nats.conf", "NATS_CONF"), ("nats-tls.conf", "NATS_TLS_CONF")])
def test_embedded_templates_are_the_shipped_files(name: str, constant: str):
    """An installed wheel has no deploy/ folder: init.py embeds the files byte for byte."""
    assert getattr(mam_init, constant) == (REPO / "deploy" / "nats" / name).read_text()


def test_init_writes_env_and_broker_files_0600_and_prints_no_secret(tmp_path: Path):
    conf = tmp_path / "nats.conf"
    result = run_init("--workspace", str(tmp_path), "--broker-config", str(conf), "--broker", "mam-broker")
    assert result.returncode == 0, result.stderr
    env_file, broker_env = tmp_path / ".mam.env", tmp_path / "nats.env"
    for path in (env_file, broker_env, conf):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    values, secrets_ = dotenv_values(env_file), dotenv_values(broker_env)
    assert values["MQTT_BROKER"] == "mam-broker" and values["MQTT_PORT"] == "1883"
    assert values["MQTT_USERNAME"] == "mam_agent" and values["MQTT_TLS"] == "false"
    assert values["MQTT_PASSWORD"] == secrets_["MAM_BROKER_PASS"]
    assert len(values["MAM_DISPATCH_SECRET"]) >= 32
    assert len({secrets_[k] for k in mam_init.BROKER_SECRET_VARS}) == 4
    shown = result.stdout + result.stderr
    for secret in [values["MQTT_PASSWORD"], values["MAM_DISPATCH_SECRET"], *secrets_.values()]:
        assert secret not in shown
        assert secret not in conf.read_text()  # nats.conf reads them from the environment
    assert str(env_file) in result.stdout and "docker compose" in result.stdout
    # The rendered config is the shipped one with the chosen port and subjects.
    assert mam_init.conf_variables(conf.read_text())["MAM_MQTT_PORT"] == "1883"


def test_init_without_broker_config_writes_only_env(tmp_path: Path):
    result = run_init("--workspace", str(tmp_path), "--tls", "--port", "8884")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".mam", ".mam.env"]
    # §16: and the hub's Ed25519 key, 0600, in a 0700 folder
    hub_key = tmp_path / ".mam" / "keys" / "hub.ed25519"
    assert hub_key.stat().st_mode & 0o777 == 0o600 and hub_key.parent.stat().st_mode & 0o777 == 0o700
    assert hub_key.read_text(encoding="ascii").strip() not in result.stdout + result.stderr
    values = dotenv_values(tmp_path / ".mam.env")
    assert values["MQTT_TLS"] == "true" and values["MQTT_PORT"] == "8884"


def test_init_refuses_to_overwrite_and_loses_nothing(tmp_path: Path):
    (tmp_path / ".mam.env").write_text("MQTT_BROKER=keep-me\n")
    conf = tmp_path / "nats.conf"
    result = run_init("--workspace", str(tmp_path), "--broker-config", str(conf))
    assert result.returncode == 64
    assert result.stderr.count("\n") == 1 and "--force" in result.stderr
    assert (tmp_path / ".mam.env").read_text() == "MQTT_BROKER=keep-me\n"
    assert not conf.exists() and not (tmp_path / "nats.env").exists()  # nothing half-written


def test_init_refuses_when_only_the_broker_config_exists(tmp_path: Path):
    conf = tmp_path / "nats.conf"
    conf.write_text("mine")
    result = run_init("--workspace", str(tmp_path), "--broker-config", str(conf))
    assert result.returncode == 64 and conf.read_text() == "mine"
    assert not (tmp_path / ".mam.env").exists()


def test_init_force_replaces_every_secret(tmp_path: Path):
    assert run_init("--workspace", str(tmp_path)).returncode == 0
    before = dotenv_values(tmp_path / ".mam.env")
    result = run_init("--workspace", str(tmp_path), "--force")
    assert result.returncode == 0, result.stderr
    after = dotenv_values(tmp_path / ".mam.env")
    assert after["MQTT_PASSWORD"] != before["MQTT_PASSWORD"]
    assert after["MAM_DISPATCH_SECRET"] != before["MAM_DISPATCH_SECRET"]


@pytest.mark.parametrize("args, needle", [
    (["--port", "0"], "--port"),
    (["--port", "70000"], "--port"),
    (["--port", "abc"], "--port"),
    (["--broker", "a b"], "--broker"),
    (["--broker", "host/../x"], "--broker"),
    (["--broker", ""], "--broker"),
    (["--broker", "x" * 300], "--broker"),
])
def test_init_refuses_bad_arguments_with_one_line(tmp_path: Path, args: list[str], needle: str):
    result = run_init("--workspace", str(tmp_path), *args)
    assert result.returncode == 64
    assert needle in result.stderr
    assert not (tmp_path / ".mam.env").exists()


def test_init_refuses_a_topic_root_nats_cannot_map(tmp_path: Path):
    result = run_init("--workspace", str(tmp_path), env={"MAM_TOPIC_ROOT": "python.mqtt"})
    assert result.returncode == 64 and "'.'" in result.stderr
    assert not (tmp_path / ".mam.env").exists()


def test_init_refuses_a_missing_broker_config_folder(tmp_path: Path):
    result = run_init("--workspace", str(tmp_path), "--broker-config", str(tmp_path / "no" / "nats.conf"))
    assert result.returncode == 64 and "no such directory" in result.stderr
    assert not (tmp_path / ".mam.env").exists()


def test_init_help_shows_no_secret_values():
    result = subprocess.run([str(MAM_ORCH), "init", "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "--broker-config" in result.stdout and "--force" in result.stdout


def test_set_conf_variables_refuses_template_drift():
    with pytest.raises(ConfigError, match="MAM_NOPE"):
        mam_init.set_conf_variables(mam_init.NATS_CONF, {"MAM_NOPE": 1})


def test_render_puts_the_topic_root_into_the_permissions():
    text = mam_init.render_nats_conf(topic_root="acme/fleet", mqtt_port=1884)
    variables = mam_init.conf_variables(text)
    assert variables["MAM_SUBJECTS"] == '["acme.fleet", "acme.fleet.>"]'
    assert variables["MAM_MQTT_PORT"] == "1884"
    assert "$MAM_BROKER_PASS" in text  # passwords stay environment references


@pytest.mark.parametrize("root", ["a/+/b", "#", "a.b", "/a", "a b"])
def test_render_refuses_bad_topic_roots(root: str):
    with pytest.raises(UsageError):
        mam_init.render_nats_conf(topic_root=root)


def test_render_tls_only_options_need_tls():
    with pytest.raises(UsageError):
        mam_init.render_nats_conf(verify_clients=True)


def test_broker_password_starts_with_a_letter():
    """nats-server parses env values like config values: '12k…' could become a size."""
    assert all(mam_init.broker_password()[0].isalpha() for _ in range(200))
