"""A whole fleet — broker, hub, runners — as real processes, in one of two
modes (DESIGN.md "Test strategy", multi-host e2e; PROTOCOL §5-§12):

- "netns": a `netns.Tailnet` with hosts `hub` (nats-server, listening on
  0.0.0.0), `orch` (the hub's workspace and every `mam-orch` command),
  `gpu-box` and `cpu-box` (runners); every process starts inside its own
  host's namespace and reaches the broker by the name `hub`. Needs root.
- "loopback": the same hosts as separate processes with separate
  workspaces, all on 127.0.0.1.

    fleet = Fleet("loopback", tmp_path)          # or the `fleet` fixture
    gpu = fleet.start_runner("gpu-box", AGENTS / "shell-agent")
    run = fleet.dispatch("gpu-box", "echo hi", "--ack-timeout", "10")
    assert run.wait() == 0
    fleet.hub_record(run.job_id()); fleet.runner_record("gpu-box", run.job_id())
    fleet.events_on_wire(run.job_id())           # what a hub-side subscriber saw
    fleet.close()                                # kills everything, also on failure

Every workspace has its own `.mam.env` (same MAM_DISPATCH_SECRET, broker
`hub` or 127.0.0.1, MQTT_KEEPALIVE 5). Every process gets FLEET_TAG=<tag> in
its environment, which agents (and `publish --heartbeat` timers) inherit: `close()` kills
process groups it started and then every process still carrying the tag
(orphaned agents of a SIGKILLed runner included).

The wire tap (harness/wiretap.py, run as a script in the hub's namespace)
is a test MQTT client on the hub side: it prints every message under the
topic root as a JSON line from the start, and publishes what it is given on
stdin (`{"topic", "payload_b64", "retain"}` lines), so tests can inject
hostile dispatches from inside the network in both modes.
"""

from __future__ import annotations

import base64
import json
import os
import pwd
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from harness.brokers import MOSQUITTO, MOSQUITTO_PASSWD, free_port
from harness.netns import Tailnet
from harness.procs import kill_all
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import TEST_SECRET, clean_env
from mam.orchestrator.broker import conf
from mam.orchestrator.broker import embedded as broker
from mam.orchestrator.hublock import service_pid
from mam.shared.config import write_env_file
from mam.shared.protocol import names
from mam.shared.store.registry import JobNotFound, Registry

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
AGENTS = REPO / "examples" / "agents"
MAM_ORCH = [sys.executable, "-m", "mam.orchestrator.cli"]
MAM_RUNNER = [sys.executable, "-m", "mam.runner"]
HOSTS = ("hub", "orch", "gpu-box", "cpu-box")
MODES = ("loopback", "netns")
BROKER_KINDS = ("nats", "mosquitto")
NETNS_MQTT_PORT = 1883
START_TIMEOUT_S = PATIENCE_S
WIRETAP = HERE / "wiretap.py"
STOP_GRACE_S = 3.0
KILL_POLL_S = 0.1


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group led by `proc`, SIGKILL after STOP_GRACE_S; reap."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass


class Proc:
    """A background process of the fleet, stdout/stderr collected by threads.

    Attributes:
        name: label for messages; proc: the Popen (its pid is the command's own,
        also in netns mode); lines: stdout lines decoded as JSON (others kept in `text_out`).
    """

    def __init__(self, name: str, proc: subprocess.Popen, *, on_line: Any = None) -> None:
        self.name = name
        self.proc = proc
        self.lines: list[dict[str, Any]] = []
        self.text_out: list[str] = []
        self.stderr: list[str] = []
        self._on_line = on_line
        self._threads = [threading.Thread(target=self._read_out, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for thread in self._threads:
            thread.start()

    def _read_out(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.text_out.append(line)
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                self.lines.append(obj)
                if self._on_line is not None:
                    self._on_line(obj)

    def _read_err(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.stderr.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        """Everything it wrote on stderr so far."""
        return "".join(self.stderr)

    def wait(self, timeout_s: float = PATIENCE_S) -> int:
        """Wait for the exit code (and for its output to be read)."""
        code = self.proc.wait(timeout_s)
        for thread in self._threads:
            thread.join(5)
        return code

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill9(self) -> None:
        """SIGKILL the process itself (not its group: a crash leaves its children)."""
        self.signal(signal.SIGKILL)
        self.proc.wait(PATIENCE_S)

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM its process group, SIGKILL after a grace period; reap."""
        stop_group(self.proc)
        for thread in self._threads:
            thread.join(2)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass

    def __repr__(self) -> str:
        return f"<{self.name} pid={self.proc.pid} rc={self.proc.poll()}>"


class Dispatch(Proc):
    """A background `mam-orch dispatch|redispatch --json`."""

    def job_id(self, timeout_s: float = PATIENCE_S) -> str:
        """The job id, from the first event line or the "dispatched|queued|blocked job <id>" log line."""
        def find() -> str | None:
            for line in self.lines:
                if "job_id" in line:
                    return line["job_id"]
            for line in self.stderr:
                words = line.split()
                if len(words) >= 3 and words[0] in ("dispatched", "redispatched", "queued", "blocked") \
                        and words[1] == "job":
                    return words[2]
            return None
        wait_until(lambda: find() or not self.alive(), timeout_s, f"{self.name} to name its job")
        found = find()
        if found is None:
            raise AssertionError(f"{self.name} exited {self.proc.returncode} without a job id: {self.log()[-2000:]}")
        return found

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        return [line for line in self.lines if "event" in line and (name is None or line["event"] == name)]


class Runner(Proc):
    """A background `mam-runner run`, with its session and workspace."""

    session: str = ""
    workspace: Path = Path()
    host: str = ""
    runner_id: str = ""


class Tap(Proc):
    """The hub-side wire tap (see the module docstring)."""

    def __init__(self, name: str, proc: subprocess.Popen) -> None:
        self._cond = threading.Condition()
        self._acks = 0
        super().__init__(name, proc, on_line=self._note)

    def _note(self, obj: dict[str, Any]) -> None:
        with self._cond:
            if "published" in obj:
                self._acks += 1
            self._cond.notify_all()

    def messages(self) -> list[dict[str, Any]]:
        """Every message seen: {"topic", "payload" (bytes), "retain"}."""
        out = []
        for line in list(self.lines):
            if "topic" in line:
                out.append({"topic": line["topic"], "payload": base64.b64decode(line["payload_b64"]),
                            "retain": line["retain"]})
        return out

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, timeout_s: float = PATIENCE_S) -> None:
        """Publish from inside the network (QoS 1) and wait for the tap's PUBACK line."""
        with self._cond:
            before = self._acks
        self.proc.stdin.write(json.dumps({"topic": topic, "retain": retain,  # type: ignore[union-attr]
                                          "payload_b64": base64.b64encode(payload).decode()}) + "\n")
        self.proc.stdin.flush()  # type: ignore[union-attr]
        with self._cond:
            if not self._cond.wait_for(lambda: self._acks > before or not self.alive(), timeout_s):
                raise AssertionError(f"the wire tap did not publish on {topic} within {timeout_s:g} s")
        errors = [line for line in self.lines if "publish_error" in line]
        if errors:
            raise AssertionError(f"the wire tap could not publish: {errors[-1]}")


class Fleet:
    """Broker, hub workspace, runner workspaces and a wire tap, in `mode`.

    Args:
        mode: "loopback" or "netns".
        base: an empty directory for workspaces and logs (tmp_path).
        topic_root: the MQTT topic root (§2).
        broker_kind: "nats" (nats-server) or "mosquitto" (configured like deploy/mosquitto);
            `kill_broker()` and `start_broker()` crash and restart it (same ports, same store).
    Raises:
        netns.NetnsUnavailable: mode "netns" where namespaces cannot be built.
    """

    hosts: tuple[str, ...] = HOSTS
    """The hosts of mode "netns" (harness/cluster.py adds the cluster's nodes)."""

    def __init__(self, mode: str, base: Path, *, topic_root: str = "python/mqtt",
                 broker_kind: str = "nats") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if broker_kind not in BROKER_KINDS:
            raise ValueError(f"broker_kind must be one of {BROKER_KINDS}, not {broker_kind!r}")
        self.mode = mode
        self.broker_kind = broker_kind
        self.base = Path(base)
        self.topic_root = topic_root
        self.tag = secrets.token_hex(6)
        self.secret = TEST_SECRET
        self.net: Any = None
        self._procs: list[Proc] = []
        self.runners: dict[str, Runner] = {}
        self._closed = False
        self.env = clean_env(FLEET_TAG=self.tag, PYTHONUNBUFFERED="1")
        self.env["PATH"] = f"{Path(sys.executable).parent}:{self.env.get('PATH', '/usr/bin:/bin')}"
        try:
            if mode == "netns":
                Tailnet.sweep_stale()
                self.net = Tailnet(self.hosts)
                self.broker_host, self.mqtt_port = "hub", NETNS_MQTT_PORT
                nats_port, ws_port = 4222, 8080
                listen = "0.0.0.0"
            else:
                self.broker_host, self.mqtt_port = "127.0.0.1", free_port()
                nats_port, ws_port = free_port(), free_port()
                listen = "127.0.0.1"
            self._start_broker(listen, nats_port, ws_port)
            self.hub_ws = self.workspace("hub-orch")
            self.tap = self._start_tap()
        except BaseException:
            self.close()
            raise

    # -------------------------------------------------------------- setup

    def _start_broker(self, listen: str, nats_port: int, ws_port: int) -> None:
        folder = self.base / "broker"
        folder.mkdir(parents=True, exist_ok=True)
        self.agent_password = "agent-" + secrets.token_hex(12)
        creds = conf.BrokerCredentials(agent_password=self.agent_password,
                                       observer_password="observer-" + secrets.token_hex(12))
        self.agent_user = creds.agent_user
        if self.broker_kind == "mosquitto":
            self._broker_argv = [MOSQUITTO, "-c", str(self._mosquitto_conf(folder, listen))]
        else:
            settings = conf.NatsSettings(store_dir=folder / "jetstream", host=listen, port=nats_port,
                                         mqtt_port=self.mqtt_port, ws_port=ws_port, server_name="mam-fleet",
                                         topic_root=self.topic_root)
            conf_file = conf.write_private(folder / "nats.conf", conf.render_nats_config(settings, creds))
            self._broker_argv = [str(broker.nats_server_binary()), "-c", str(conf_file)]
        self.broker_log = folder / f"{self.broker_kind}.log"
        self.start_broker()

    def _mosquitto_conf(self, folder: Path, listen: str) -> Path:
        """mosquitto as deploy/mosquitto ships it (password file, ACL, persistence saved every
        second), listening on `listen`:`mqtt_port`; returns the config file."""
        passwd, acl, store = folder / "passwd", folder / "acl", folder / "store"
        store.mkdir(exist_ok=True)
        fd = os.open(passwd, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:  # plain "user:password", hashed in place by -U
            handle.write(f"{self.agent_user}:{self.agent_password}\n")
        subprocess.run([MOSQUITTO_PASSWD, "-U", str(passwd)], check=True, capture_output=True,
                       timeout=START_TIMEOUT_S)
        acl.write_text(f"user {self.agent_user}\ntopic readwrite {self.topic_root}/#\n")
        os.chmod(acl, 0o600)
        conf = folder / "mosquitto.conf"
        conf.write_text("\n".join([
            f"user {pwd.getpwuid(os.getuid()).pw_name}", "per_listener_settings false",
            "allow_anonymous false", f"password_file {passwd}", f"acl_file {acl}",
            "persistence true", f"persistence_location {store}/", "autosave_on_changes false",
            "autosave_interval 1", "log_dest stderr", "log_type error", "log_type warning",
            "log_type notice", f"listener {self.mqtt_port} {listen}", ""]))
        return conf

    def start_broker(self) -> None:
        """Start the broker process (again, after `kill_broker()`: same ports, same store)."""
        self.broker = self._spawn("hub", self.broker_kind, self._broker_argv, stdout_path=self.broker_log)

    def kill_broker(self) -> None:
        """SIGKILL the broker process (a crash) and reap it."""
        self.broker.proc.kill()
        self.broker.proc.wait(PATIENCE_S)

    def broker_values(self) -> dict[str, str]:
        """The .mam.env values every host uses (§13)."""
        return {"MQTT_BROKER": self.broker_host, "MQTT_PORT": str(self.mqtt_port),
                "MQTT_USERNAME": self.agent_user, "MQTT_PASSWORD": self.agent_password,
                "MQTT_CLIENT_ID_PREFIX": "fleet", "MQTT_KEEPALIVE": "5",
                "MAM_TOPIC_ROOT": self.topic_root, "MAM_DISPATCH_SECRET": self.secret}

    def workspace(self, name: str) -> Path:
        """A fresh workspace `<base>/ws/<name>` with its own `.mam.env` (0600)."""
        ws = self.base / "ws" / name
        (ws / ".git").mkdir(parents=True, exist_ok=True)
        write_env_file(ws / ".mam.env", self.broker_values(), overwrite=True)
        return ws

    def _start_tap(self) -> Tap:
        argv = [sys.executable, str(WIRETAP), str(self.hub_ws), str(START_TIMEOUT_S)]
        proc = self._popen("hub", argv, stdin=subprocess.PIPE)
        tap = Tap("tap", proc)
        self._procs.append(tap)
        wait_until(lambda: any(line.get("ready") for line in tap.lines) or not tap.alive(), START_TIMEOUT_S,
                    "the broker to accept the wire tap")
        if not tap.alive():
            raise RuntimeError(f"wire tap failed: {tap.log()[-2000:]}\nbroker log: "
                               f"{self.broker_log.read_text(errors='replace')[-2000:]}")
        return tap

    def _popen(self, host: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
               stdin: Any = subprocess.DEVNULL, stdout: Any = subprocess.PIPE, cwd: Path | None = None
               ) -> subprocess.Popen:
        full_env = dict(self.env)
        full_env.update(env or {})
        kwargs = dict(env=full_env, stdin=stdin, stdout=stdout, stderr=subprocess.PIPE if stdout is
                      subprocess.PIPE else subprocess.STDOUT, text=True, cwd=str(cwd or self.base),
                      start_new_session=True)
        if self.net is not None:
            return self.net.spawn(host, list(argv), **kwargs)
        return subprocess.Popen(list(argv), **kwargs)

    def _spawn(self, host: str, name: str, argv: Sequence[str], *, stdout_path: Path) -> Proc:
        with open(stdout_path, "ab") as log:
            full_env = dict(self.env)
            kwargs = dict(env=full_env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                          start_new_session=True)
            proc = self.net.spawn(host, list(argv), **kwargs) if self.net else subprocess.Popen(list(argv), **kwargs)
        handle = _Quiet(name, proc)
        self._procs.append(handle)  # type: ignore[arg-type]
        return handle  # type: ignore[return-value]

    def host_of(self, session: str) -> str:
        """The host a session's runner lives on: the host of that name, else cpu-box."""
        return session if session in HOSTS else "cpu-box"

    # -------------------------------------------------------------- the API

    def start_runner(self, session: str, exec_cmd: str | Path, *extra: str, env: dict[str, str] | None = None,
                     host: str | None = None, wait_online: bool = True) -> Runner:
        """`mam-runner run --session S --exec CMD --workspace <its ws> *extra` on the session's host.

        The workspace `<base>/ws/<session>` is kept across restarts of the same session.
        With `wait_online`, returns once its new runner id is `online` on the wire (§7).
        """
        ws = self.base / "ws" / session
        if not (ws / ".mam.env").exists():
            ws = self.workspace(session)
        host = host or self.host_of(session)
        argv = [*MAM_RUNNER, "run", "--session", session, "--exec", str(exec_cmd), "--workspace", str(ws), *extra]
        before = self.presence_ids(session)
        runner_env = {"MAM_CANCEL_GRACE_S": "1"}
        runner_env.update(env or {})
        proc = self._popen(host, argv, env=runner_env)
        handle = Runner(f"runner {session}", proc)
        handle.session, handle.workspace, handle.host = session, ws, host
        self._procs.append(handle)
        self.runners[session] = handle
        if wait_online:
            self.wait_online(session, handle, before)
        return handle

    def presence_ids(self, session: str) -> set[str]:
        """Runner ids seen so far in `session`'s presence (§7)."""
        topic = f"{self.topic_root}/runners/{session}"
        return {json.loads(m["payload"])["runner_id"] for m in self.tap.messages()
                if m["topic"] == topic and m["payload"]}

    def presence(self, session: str) -> dict[str, Any] | None:
        """The latest presence of `session` on the wire, or None."""
        topic = f"{self.topic_root}/runners/{session}"
        for message in reversed(self.tap.messages()):
            if message["topic"] == topic and message["payload"]:
                return json.loads(message["payload"])
        return None

    def wait_online(self, session: str, handle: Runner, before: set[str],
                    timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait for an `online` presence of `session` from a runner id not in `before` (§1: fresh
        per process) and for that runner's "serving" log line (subscribed to dispatches)."""
        def online() -> bool:
            doc = self.presence(session)
            # the daemon announces `online` before it subscribes to dispatches; its
            # "serving session" line comes after the SUBACK
            return bool(doc) and doc["status"] == "online" and doc["runner_id"] not in before \
                and f"runner {doc['runner_id']} serving session {session}" in handle.log()

        wait_until(lambda: online() or not handle.alive(), timeout_s, f"runner {session} to be online")
        if not handle.alive():
            raise AssertionError(f"runner {session} exited with {handle.proc.returncode}: {handle.log()[-3000:]}")
        handle.runner_id = self.presence(session)["runner_id"]  # type: ignore[index]

    def dispatch(self, session: str | None, brief: str, *opts: str, verb: str = "dispatch",
                 labels: str | None = None) -> Dispatch:
        """`mam-orch dispatch --session S --brief-file <file> --json *opts` on `orch`, in the background;
        with `labels` (and no session), `--labels LABELS` instead."""
        brief_file = self.base / f"brief-{secrets.token_hex(4)}.txt"
        brief_file.write_text(brief)
        target = ["--labels", labels] if labels is not None else ["--session", str(session)]
        argv = [*MAM_ORCH, "dispatch", *target, "--brief-file", str(brief_file), "--json",
                "--workspace", str(self.hub_ws), *opts]
        handle = Dispatch(f"dispatch {session or labels}", self._popen("orch", argv))
        self._procs.append(handle)
        return handle

    def serve(self, *extra: str) -> Proc:
        """`mam-orch serve --workspace <hub ws> *extra` on `orch`, in the background; returns once it
        holds the registry's hub lock (§14 "One hub process")."""
        handle = Proc("serve", self._popen("orch", [*MAM_ORCH, "serve", "--workspace", str(self.hub_ws), *extra]))
        self._procs.append(handle)  # type: ignore[arg-type]
        wait_until(lambda: service_pid(self.hub_ws) is not None or not handle.alive(), START_TIMEOUT_S,
                   "the hub service to hold its lock")
        if not handle.alive():
            raise AssertionError(f"mam-orch serve exited {handle.proc.returncode}: {handle.log()[-3000:]}")
        return handle

    def redispatch(self, job_id: str, *opts: str) -> Dispatch:
        """`mam-orch redispatch <id> --json *opts` on `orch`, in the background."""
        argv = [*MAM_ORCH, "redispatch", job_id, "--json", "--workspace", str(self.hub_ws), *opts]
        handle = Dispatch(f"redispatch {job_id}", self._popen("orch", argv))
        self._procs.append(handle)
        return handle

    def orch(self, *argv: str, timeout_s: float = PATIENCE_S) -> subprocess.CompletedProcess:
        """`mam-orch *argv --workspace <hub ws>` on `orch`, waited for (cancel, redispatch, runners, jobs, show)."""
        return self.run_on("orch", [*MAM_ORCH, *argv, "--workspace", str(self.hub_ws)], timeout_s=timeout_s)

    def runner_cli(self, session: str, *argv: str, timeout_s: float = PATIENCE_S) -> subprocess.CompletedProcess:
        """`mam-runner *argv --workspace <session ws>` on the session's host (e.g. publish)."""
        ws = self.base / "ws" / session
        return self.run_on(self.host_of(session), [*MAM_RUNNER, *argv, "--workspace", str(ws)], timeout_s=timeout_s)

    def run_on(self, host: str, argv: Sequence[str], *, timeout_s: float = PATIENCE_S,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a command on `host` and wait (text output captured)."""
        full_env = dict(self.env)
        full_env.update(env or {})
        if self.net is not None:
            return self.net.run(host, list(argv), timeout_s=timeout_s, env=full_env, cwd=str(self.base))
        return subprocess.run(list(argv), env=full_env, capture_output=True, text=True, timeout=timeout_s,
                              cwd=str(self.base))

    def hub_record(self, job_id: str) -> dict[str, Any]:
        """The hub's record of the job (§8)."""
        return Registry(self.hub_ws).get(job_id)

    def runner_record(self, session: str, job_id: str) -> dict[str, Any]:
        """The record of the job in `session`'s runner workspace (§8)."""
        return Registry(self.base / "ws" / session).get(job_id)

    def has_runner_record(self, session: str, job_id: str) -> bool:
        """True when `session`'s workspace holds a record of the job."""
        try:
            self.runner_record(session, job_id)
        except JobNotFound:
            return False
        return True

    def runner_registry(self, session: str) -> Any:
        return Registry(self.base / "ws" / session)

    def agent_log(self, session: str, job_id: str) -> Path:
        """`<runner ws>/.mam/logs/<job_id>/agent.log` (§11 step 4)."""
        return self.runner_registry(session).logs_dir(job_id) / "agent.log"

    def events_on_wire(self, job_id: str, kind: str = "events") -> list[dict[str, Any]]:
        """Decoded non-empty messages on `ROOT/jobs/<job_id>/<kind>` the tap saw, in order."""
        topic = names.job_topic(job_id, kind, self.topic_root)
        return [json.loads(m["payload"]) for m in self.tap.messages() if m["topic"] == topic and m["payload"]]

    def tagged_pids(self) -> list[int]:
        """Live processes carrying this fleet's FLEET_TAG (agents, timers, CLIs)."""
        found = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if proc.environ().get("FLEET_TAG") == self.tag and proc.pid != os.getpid():
                    found.append(proc.pid)
            except (psutil.Error, OSError):
                continue
        return found

    # -------------------------------------------------------------- teardown

    def close(self) -> None:
        """Stop every process (runners and CLIs first, the broker last), kill what still
        carries the tag, tear the network down. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        for handle in reversed(self._procs):
            try:
                handle.stop()
            except Exception:
                pass
        def none_left() -> bool:
            # SIGKILL what still carries the tag until nothing does: on a busy machine a killed
            # process takes a while to die, and a dying parent may have just started a child
            pids = self.tagged_pids()
            kill_all(pids)
            return not pids

        try:
            wait_until(none_left, what="the fleet's tagged processes to be gone", interval_s=KILL_POLL_S)
        except AssertionError:
            pass  # never raises; the `fleet` fixture reports what outlived close()
        if self.net is not None:
            self.net.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Quiet:
    """A process whose output goes to a file (the broker)."""

    def __init__(self, name: str, proc: subprocess.Popen) -> None:
        self.name, self.proc = name, proc

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        stop_group(self.proc)
