"""PROTOCOL §13 configuration resolution, one test per rule, and §8 root search."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mam.shared import config
from mam.shared.config import BrokerConfig
from mam.shared.protocol.errors import ConfigError, EnvFileError
from mam.shared.store.root import resolve_root
from mam.shared.transport import mqtt

SECRET = "s" * 40


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, str):
        text = text.encode()
    path.write_bytes(text)
    return path


@pytest.fixture
def empty_cwd(tmp_path: Path) -> Path:
    """A directory with a `.git` marker so the walk stops inside tmp_path."""
    here = tmp_path / "ws"
    (here / ".git").mkdir(parents=True)
    return here


def test_s13_environment_wins_over_file(empty_cwd):
    write(empty_cwd / ".mam.env", "MQTT_BROKER=from-file\nMQTT_PORT=1884\n")
    cfg = config.broker_config(environ={"MQTT_BROKER": "from-env"}, cwd=empty_cwd, warn=False)
    assert cfg.hosts == ("from-env",)
    assert cfg.port == 1884


def test_s13_no_broker_without_mqtt_broker_and_connecting_says_how_to_get_one(empty_cwd, capsys):
    """An empty `.mam.env` never means the public broker: connecting refuses with one line."""
    cfg = config.broker_config(environ={}, cwd=empty_cwd)
    assert cfg.hosts == () and not cfg.configured and cfg.host == config.NO_BROKER_HOST
    assert cfg.port == 1883 and cfg.tls is False and cfg.client_id_prefix == "hermes" and cfg.keepalive_s == 60
    assert cfg.topic_root == "python/mqtt" and not cfg.is_public
    assert capsys.readouterr().err == ""  # nothing public to warn about
    with pytest.raises(ConfigError) as refused:
        mqtt.MqttClient(cfg, "hub").connect()
    assert str(refused.value) == config.NO_BROKER and "\n" not in config.NO_BROKER
    assert "MQTT_BROKER" in config.NO_BROKER and "mam-orch broker up" in config.NO_BROKER


def test_s13_the_public_broker_only_when_named_and_with_its_warning(empty_cwd, capsys):
    cfg = config.broker_config(environ={"MQTT_BROKER": "broker.hivemq.com"}, cwd=empty_cwd)
    captured = capsys.readouterr()
    assert cfg.hosts == ("broker.hivemq.com",) and cfg.is_public
    assert captured.out == "" and "WARNING: using the PUBLIC broker broker.hivemq.com" in captured.err
    out = io.StringIO()
    assert config.warn_if_public(cfg, out) is True and "PUBLIC" in out.getvalue()


def test_s13_private_broker_no_warning(empty_cwd, capsys):
    config.broker_config(environ={"MQTT_BROKER": "hub"}, cwd=empty_cwd)
    assert capsys.readouterr().err == ""


def test_s13_mam_env_file_alone(empty_cwd, tmp_path):
    write(empty_cwd / ".mam.env", "MQTT_BROKER=ambient\n")
    chosen = write(tmp_path / "other.env", "MQTT_BROKER=chosen\n")
    cfg = config.broker_config(environ={"MAM_ENV_FILE": str(chosen)}, cwd=empty_cwd, warn=False)
    assert cfg.hosts == ("chosen",)


def test_s13_mam_env_file_missing_skips_every_other_file(empty_cwd, tmp_path):
    write(empty_cwd / ".mam.env", "MQTT_BROKER=ambient\n")
    env = {"MAM_ENV_FILE": str(tmp_path / "nope.env")}
    assert config.find_env_file(env, empty_cwd) is None
    assert config.broker_config(environ=env, cwd=empty_cwd, warn=False).hosts == ()


def test_s13_mam_env_file_directory_is_env_file_error(empty_cwd, tmp_path):
    folder = tmp_path / "adir"
    folder.mkdir()
    with pytest.raises(EnvFileError) as info:
        config.load_env({"MAM_ENV_FILE": str(folder)}, empty_cwd)
    assert str(info.value) == f"{folder}: cannot read (IsADirectoryError)"


def test_s13_mam_env_file_bad_encoding_is_env_file_error(empty_cwd, tmp_path):
    bad = write(tmp_path / "bad.env", b"MQTT_BROKER=\xff\xfe\n")
    with pytest.raises(EnvFileError) as info:
        config.load_env({"MAM_ENV_FILE": str(bad)}, empty_cwd)
    assert str(info.value) == f"{bad}: cannot read (UnicodeDecodeError)"


def test_s13_oversized_env_file_refused(empty_cwd, tmp_path):
    big = write(tmp_path / "big.env", "A=" + "x" * (70 * 1024) + "\n")
    with pytest.raises(EnvFileError, match="cannot read"):
        config.load_env({"MAM_ENV_FILE": str(big)}, empty_cwd)


def test_s13_search_order_real_root_first(tmp_path, empty_cwd):
    real = write(tmp_path / "real" / ".mam.env", "MQTT_BROKER=real\n").parent
    ws = write(tmp_path / "wsroot" / ".mam.env", "MQTT_BROKER=wsroot\n").parent
    write(empty_cwd / ".mam.env", "MQTT_BROKER=walk\n")
    env = {"MAM_REAL_ROOT": str(real), "WORKSPACE_ROOT": str(ws)}
    assert config.broker_config(environ=env, cwd=empty_cwd, warn=False).hosts == ("real",)
    env = {"MAM_REAL_ROOT": str(tmp_path / "no-file-here"), "WORKSPACE_ROOT": str(ws)}
    assert config.broker_config(environ=env, cwd=empty_cwd, warn=False).hosts == ("wsroot",)


@pytest.mark.parametrize("marker", [".git", ".agents"])
def test_s13_walk_up_to_marker(tmp_path, marker):
    top = tmp_path / "proj"
    (top / marker).mkdir(parents=True)
    deep = top / "a" / "b"
    deep.mkdir(parents=True)
    write(top / ".mam.env", "MQTT_BROKER=walked\n")
    assert config.broker_config(environ={}, cwd=deep, warn=False).hosts == ("walked",)
    assert resolve_root(environ={}, cwd=deep) == top.resolve()


def test_s13_cwd_last(tmp_path):
    here = tmp_path / "plain"
    here.mkdir()
    write(here / ".mam.env", "MQTT_BROKER=cwd\n")
    # tmp_path has no marker above it inside /tmp, so the cwd is the last candidate.
    assert config.find_env_file({}, here) == here / ".mam.env"


def test_s13_workspace_option_searched_first(tmp_path, empty_cwd):
    ws = write(tmp_path / "cli-ws" / ".mam.env", "MQTT_BROKER=cli\n").parent
    write(empty_cwd / ".mam.env", "MQTT_BROKER=walk\n")
    cfg = config.broker_config(environ={}, cwd=empty_cwd, workspace=ws, warn=False)
    assert cfg.hosts == ("cli",)


def test_s13_dotenv_syntax(empty_cwd):
    write(empty_cwd / ".mam.env",
          "# a comment\r\nexport MQTT_BROKER=hub.tail  # trailing\r\n"
          "MQTT_PASSWORD='p$ss word'\r\nMQTT_USERNAME=\"mam_agent\"\r\n")
    cfg = config.broker_config(environ={}, cwd=empty_cwd, warn=False)
    assert cfg.hosts == ("hub.tail",)
    assert cfg.password == "p$ss word"
    assert cfg.username == "mam_agent"


def test_s13_broker_list_is_failover_order(empty_cwd):
    cfg = config.broker_config(environ={"MQTT_BROKER": "a, b ,c"}, cwd=empty_cwd, warn=False)
    assert cfg.hosts == ("a", "b", "c") and cfg.host == "a"


def test_s13_public_broker_anywhere_in_list_warns(empty_cwd):
    cfg = config.broker_config(environ={"MQTT_BROKER": "hub,broker.hivemq.com"}, cwd=empty_cwd, warn=False)
    assert cfg.is_public


@pytest.mark.parametrize("name,value,why", [
    ("MQTT_PORT", "abc", "expected an integer"),
    ("MQTT_PORT", "70000", "out of range"),
    ("MQTT_TLS", "yes", "expected true, false, 1 or 0"),
    ("MQTT_KEEPALIVE", "-1", "out of range"),
    ("MQTT_BROKER", " , ", "no host"),
    ("MQTT_BROKER", "a b", "invalid"),
    ("MQTT_BROKER", ",".join(f"node-{n}" for n in range(17)), "lists 17 hosts; at most 16"),
    ("MQTT_CA_CERTS", "/nonexistent/ca.pem", "no such file"),
    ("MAM_TOPIC_ROOT", "a/#", "topic root"),
])
def test_s13_bad_values_refused(empty_cwd, name, value, why):
    with pytest.raises(ConfigError, match=why):
        config.broker_config(environ={name: value, "MQTT_BROKER": "hub", **{name: value}},
                             cwd=empty_cwd, warn=False)


@pytest.mark.parametrize("value,expected", [("true", True), ("1", True), ("FALSE", False), ("0", False)])
def test_s13_tls_values(empty_cwd, value, expected):
    assert config.broker_config(environ={"MQTT_BROKER": "h", "MQTT_TLS": value},
                                cwd=empty_cwd, warn=False).tls is expected


def test_s13_per_job_overrides(empty_cwd):
    cfg = config.broker_config({"host": "job-broker", "port": 8883, "tls": True},
                               environ={"MQTT_BROKER": "hub", "MQTT_PASSWORD": "pw"}, cwd=empty_cwd)
    assert cfg.hosts == ("job-broker",) and cfg.port == 8883 and cfg.tls is True
    assert cfg.password == "pw"


@pytest.mark.parametrize("block,why", [
    ({"password": "x"}, "password"),
    ({"bogus": 1}, "unknown"),
    ({"port": "http"}, "integer"),
    ({"client_id_prefix": "a b"}, "MQTT_CLIENT_ID_PREFIX"),
])
def test_s13_per_job_overrides_refused(empty_cwd, block, why):
    with pytest.raises(ConfigError, match=why):
        config.broker_config(block, environ={"MQTT_BROKER": "hub"}, cwd=empty_cwd)


def test_s13_password_never_in_repr():
    cfg = BrokerConfig(hosts=("h",), password="hunter2-very-secret")
    assert "hunter2" not in repr(cfg) and "hunter2" not in str(cfg) and "hunter2" not in f"{cfg}"
    assert "password='***'" in repr(cfg)


@pytest.mark.parametrize("value,why", [("", "not set"), ("x7Qz9", "too short")])
def test_s5_dispatch_secret_required_and_long(empty_cwd, value, why):
    with pytest.raises(ConfigError, match=why) as info:
        config.dispatch_secret({"MAM_DISPATCH_SECRET": value} if value else {}, empty_cwd)
    assert value == "" or value not in str(info.value)


def test_s5_dispatch_secret_from_file(empty_cwd):
    write(empty_cwd / ".mam.env", f"MAM_DISPATCH_SECRET={SECRET}\n")
    assert config.dispatch_secret({}, empty_cwd) == SECRET


def test_env_file_writer_is_0600_atomic_and_refuses_overwrite(tmp_path):
    target = tmp_path / ".mam.env"
    config.write_env_file(target, {"MQTT_PASSWORD": "a b$c\"d", "MQTT_BROKER": "hub"}, header="made by test")
    assert (target.stat().st_mode & 0o777) == 0o600
    assert config.read_env_file(target) == {"MQTT_PASSWORD": "a b$c\"d", "MQTT_BROKER": "hub"}
    with pytest.raises(ConfigError, match="already exists"):
        config.write_env_file(target, {"A": "1"})
    with pytest.raises(ConfigError, match="line break"):
        config.write_env_file(tmp_path / "x.env", {"A": "1\nB=2"})
    assert not (tmp_path / "x.env").exists()


def test_env_file_writer_flushes_only_when_durable(tmp_path, counted_fsyncs):
    """A runner writes each agent's broker.env just before the spawn: no flush to wait for."""
    target = tmp_path / "broker.env"
    config.write_env_file(target, {"MQTT_PASSWORD": "s3cret"}, durable=False)
    assert counted_fsyncs == []
    assert (target.stat().st_mode & 0o777) == 0o600 and config.read_env_file(target) == {"MQTT_PASSWORD": "s3cret"}
    config.write_env_file(target, {"MQTT_PASSWORD": "other"}, overwrite=True)
    assert len(counted_fsyncs) == 2  # the file, then its folder


def test_s8_resolve_root_order(tmp_path, empty_cwd):
    assert resolve_root(tmp_path / "w", {"MAM_REAL_ROOT": "/r"}, empty_cwd) == (tmp_path / "w").resolve()
    assert resolve_root(None, {"MAM_REAL_ROOT": str(tmp_path)}, empty_cwd) == tmp_path.resolve()
    assert resolve_root(None, {"WORKSPACE_ROOT": str(tmp_path)}, empty_cwd) == tmp_path.resolve()
    assert resolve_root(None, {}, empty_cwd / "sub") == empty_cwd.resolve()


def test_s8_resolve_root_file_refused(tmp_path):
    afile = write(tmp_path / "f", "x")
    with pytest.raises(ConfigError, match="not a directory"):
        resolve_root(afile, {}, tmp_path)


def _cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mam.orchestrator.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_s9_cli_unreadable_env_file_one_line_exit_1(tmp_path, empty_cwd):
    folder = tmp_path / "adir"
    folder.mkdir()
    env = {**os.environ, "MAM_ENV_FILE": str(folder)}
    result = _cli("config", env=env, cwd=empty_cwd)
    assert result.returncode == 1
    assert result.stderr.strip() == f"ERROR: {folder}: cannot read (IsADirectoryError)"
    assert result.stdout == ""


def test_s13_cli_config_never_shows_password(empty_cwd):
    write(empty_cwd / ".mam.env", "MQTT_BROKER=hub\nMQTT_PASSWORD=topsecretvalue\n"
          f"MAM_DISPATCH_SECRET={SECRET}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MQTT_", "MAM_"))}
    result = _cli("config", "--json", env=env, cwd=empty_cwd)
    assert result.returncode == 0, result.stderr
    assert "topsecretvalue" not in result.stdout + result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert '"hosts": ["hub"]' in result.stdout


@pytest.mark.parametrize("value", [
    "has.dot", "has space", "hash#", "sl/ash", "plus+", "tab\there", "bell\x07", "nul\x00x",
    "é-accent", "x" * 33, "$SYS",
])
def test_s13_client_id_prefix_refused(empty_cwd, value):
    """§13 MQTT_CLIENT_ID_PREFIX: only 1-32 letters, digits, '-' and '_'; refused when read,
    not at connect time; the error names the variable."""
    with pytest.raises(ConfigError, match="MQTT_CLIENT_ID_PREFIX.*1-32 letters, digits") as info:
        config.broker_config(environ={"MQTT_BROKER": "hub", "MQTT_CLIENT_ID_PREFIX": value},
                             cwd=empty_cwd, warn=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["a", "mam-orch_2", "x" * 32])
def test_s13_client_id_prefix_accepted(empty_cwd, value):
    cfg = config.broker_config(environ={"MQTT_BROKER": "hub", "MQTT_CLIENT_ID_PREFIX": value},
                               cwd=empty_cwd, warn=False)
    assert cfg.client_id_prefix == value


def test_s13_cli_bad_client_id_prefix_exit_64_one_line(empty_cwd):
    write(empty_cwd / ".mam.env", "MQTT_BROKER=hub\nMQTT_CLIENT_ID_PREFIX=fleet.hub\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MQTT_", "MAM_"))}
    result = _cli("config", env=env, cwd=empty_cwd)
    assert result.returncode == 64
    assert len(result.stderr.strip().splitlines()) == 1 and "MQTT_CLIENT_ID_PREFIX" in result.stderr
