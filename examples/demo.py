"""`make demo`: mam-fleet end to end on one machine, without root and without
any broker installed (PROTOCOL §5-§12).

In a fresh temporary folder it:

1. starts the embedded broker (`mam-orch broker up`, nats-server from the
   wheel, on free ports), which writes the hub's `.mam.env` with fresh
   credentials and a fresh MAM_DISPATCH_SECRET;
2. gives the runner its own workspace (a copy of that `.mam.env`: a runner
   host and the hub keep separate registries, §8) and starts one runner,
   `mam-runner run --session demo-box --exec examples/agents/shell-agent`;
3. dispatches a brief that does real work, one shell-agent step a line:
   create a git repository, commit a file, run a command, report a checksum;
4. streams the job's events as the hub accepts them, prints the final
   status, the checksum and where the agent's log is;
5. stops everything it started (runner, broker), also on failure or Ctrl-C.

Usage: python examples/demo.py [--dir PARENT]  (the folder is kept for inspection).
Exit status: 0 when the job completed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHELL_AGENT = REPO / "examples" / "agents" / "shell-agent"
SESSION = "demo-box"
MAM_ORCH = [sys.executable, "-m", "mam.orchestrator.cli"]
MAM_RUNNER = [sys.executable, "-m", "mam.runner"]
JOB_TIMEOUT_S = 45
STOP_TIMEOUT_S = 10.0

# Each line is one shell-agent step, run in order in one shell in the job's work folder.
BRIEF = """\
# make a repository, commit a file, run a command, report a checksum
git init -q demo-repo && cd demo-repo && git config user.email demo@mam-fleet.invalid && git config user.name "mam demo"
printf 'hello from a mam-fleet agent\\n' > hello.txt
git add hello.txt && git commit -q -m "add hello.txt" && git log --oneline
wc -c hello.txt
eval "$MAM_PUBLISH_CMD --event progress --detail \\"sha256 $(sha256sum hello.txt | cut -c1-64)\\""
"""


def section(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free right now (all held open while chosen, so none repeats)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def child_env() -> dict[str, str]:
    """The environment without the developer's MQTT_/MAM_ settings: the workspaces' .mam.env decide."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("MQTT_", "MAM_", "WORKSPACE_ROOT"))}


def describe(event: dict) -> str:
    """One human line for an accepted event."""
    data = event.get("data", {})
    if data.get("heartbeat"):
        return f"  #{event['seq']:<3} heartbeat"
    extra = f" (exit code {data['exit_code']})" if "exit_code" in data else ""
    return f"  #{event['seq']:<3} {event['event']:<10} {event.get('detail', '')}{extra}"


class Demo:
    """What the demo started, so that `stop()` can undo all of it."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.hub_ws = base / "hub"
        self.runner_ws = base / "runner"
        self.env = child_env()
        self.runner: subprocess.Popen | None = None
        self.dispatch: subprocess.Popen | None = None
        self.broker_started = False

    def orch(self, *argv: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run([*MAM_ORCH, *argv, "--workspace", str(self.hub_ws)], env=self.env,
                              capture_output=True, text=True, timeout=timeout_s)

    def start_broker(self) -> None:
        section("1. broker: mam-orch broker up (embedded nats-server, free ports)")
        self.hub_ws.mkdir(parents=True)
        self.broker_started = True  # even a failed `up` may leave state for `down` to clean
        mqtt_port, nats_port = free_ports(2)
        done = self.orch("broker", "up", "--mqtt-port", str(mqtt_port), "--port", str(nats_port),
                         "--ws-port", "0")
        if done.returncode != 0:
            raise RuntimeError(f"mam-orch broker up failed ({done.returncode}): {done.stderr.strip()}")
        info = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  nats-server pid {info.get('pid')}, MQTT on 127.0.0.1:{info.get('mqtt_port')}")
        print(f"  hub workspace {self.hub_ws} (its .mam.env holds the credentials, mode 0600)")

    def start_runner(self) -> None:
        section(f"2. runner: mam-runner run --session {SESSION} --exec examples/agents/shell-agent")
        self.runner_ws.mkdir(parents=True)
        env_file = self.runner_ws / ".mam.env"
        shutil.copyfile(self.hub_ws / ".mam.env", env_file)
        os.chmod(env_file, 0o600)
        log = open(self.base / "runner.log", "wb")
        self.runner = subprocess.Popen([*MAM_RUNNER, "run", "--session", SESSION, "--exec", str(SHELL_AGENT),
                                        "--workspace", str(self.runner_ws)], env=self.env,
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)  # Ctrl-C goes to the demo, which stops it
        log.close()
        deadline = time.monotonic() + 20
        while True:  # online once `mam-orch runners` shows its signed presence (§7)
            if self.runner.poll() is not None:
                raise RuntimeError(f"the runner exited with {self.runner.returncode}: "
                                   f"{(self.base / 'runner.log').read_text(errors='replace')[-1500:]}")
            listed = self.orch("runners", "--json")
            rows = [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]
            if any(r["session"] == SESSION and r["status"] == "online" for r in rows):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the runner did not come online within 20 s")
        print(f"  runner pid {self.runner.pid} is online; its workspace is {self.runner_ws}")

    def run_job(self) -> tuple[int, str | None, list[dict]]:
        section("3. dispatch: the brief (one shell-agent step per line)")
        for line in BRIEF.splitlines():
            print(f"  | {line}")
        section("4. events, as the hub accepts them")
        brief_file = self.base / "brief.txt"
        brief_file.write_text(BRIEF)
        self.dispatch = subprocess.Popen(
            [*MAM_ORCH, "dispatch", "--session", SESSION, "--brief-file", str(brief_file), "--json",
             "--heartbeat", "2", "--ack-timeout", "20", "--timeout", str(JOB_TIMEOUT_S),
             "--workspace", str(self.hub_ws)],
            env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        errors: list[str] = []
        reader = threading.Thread(target=lambda: errors.extend(self.dispatch.stderr), daemon=True)  # type: ignore
        reader.start()
        events: list[dict] = []
        job_id = None
        for line in self.dispatch.stdout:  # type: ignore[union-attr]
            try:
                event = json.loads(line)
            except ValueError:
                continue
            job_id = job_id or event.get("job_id")
            events.append(event)
            print(describe(event), flush=True)
        code = self.dispatch.wait(JOB_TIMEOUT_S + 15)
        reader.join(5)
        if code != 0:
            print("  hub said:\n" + "".join(f"    {e}" for e in errors[-10:]), end="")
        return code, job_id, events

    def report(self, code: int, job_id: str | None, events: list[dict]) -> None:
        section("5. result")
        if job_id is None:
            print(f"  no job id (dispatch exited {code})")
            return
        shown = self.orch("show", job_id, "--json")
        record = json.loads(shown.stdout) if shown.returncode == 0 else {}
        record = record.get("record", record)
        status = record.get("status", "unknown")
        print(f"  job {job_id}: {status} (attempt {record.get('attempt_id')}, dispatch exit code {code})")
        checksums = [e["detail"] for e in events if str(e.get("detail", "")).startswith("sha256 ")]
        if checksums:
            print(f"  hello.txt {checksums[-1]}")
        agent_log = self.runner_ws / ".mam" / "logs" / job_id / "agent.log"
        if agent_log.exists():
            print("  the agent's output:")
            for line in agent_log.read_text(errors="replace").splitlines()[-12:]:
                print(f"    {line}")
        print(f"  agent log:   {agent_log}")
        print(f"  work folder: {self.runner_ws / 'work' / job_id / 'demo-repo'}")
        print(f"  hub record:  mam-orch show {job_id} --workspace {self.hub_ws}")

    def stop(self) -> None:
        """Stop the dispatch, the runner and the broker; safe to call at any point."""
        section("6. stopping what the demo started")
        for name, proc in (("dispatch", self.dispatch), ("runner", self.runner)):
            if proc is None or proc.poll() is not None:
                continue
            # the runner drains on the first SIGTERM and cancels its jobs (agent trees) on the second
            for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            print(f"  {name} stopped (exit {proc.poll()})")
        if self.broker_started:
            try:
                done = self.orch("broker", "down")
                print(f"  broker down (exit {done.returncode})"
                      + (f": {done.stderr.strip()[-300:]}" if done.returncode else ""))
            except (OSError, subprocess.TimeoutExpired) as exc:
                print(f"  mam-orch broker down failed: {exc}")
            self._kill_broker_leftover()
        print(f"  files kept in {self.base} (rm -rf it when done)")


    def _kill_broker_leftover(self) -> None:
        """If `broker down` could not stop it, stop the nats-server recorded in state.json ourselves."""
        import psutil

        try:
            state = json.loads((self.hub_ws / ".mam" / "broker" / "state.json").read_text())
            proc = psutil.Process(int(state["pid"]))
            if abs(proc.create_time() - float(state["create_time"])) > 0.01:
                return  # the pid was reused: not ours
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            return
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except psutil.TimeoutExpired:
            proc.kill()
        print(f"  nats-server pid {proc.pid} stopped directly")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="mam-fleet end to end on this machine.")
    parser.add_argument("--dir", help="parent folder for the demo's files (default: the system temp folder)")
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="mam-demo-", dir=args.dir))
    # Ctrl-C (even when started with SIGINT ignored) and SIGTERM: the finally block stops everything
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    demo = Demo(base)
    print(f"mam-fleet demo in {base}")
    code = 1
    try:
        demo.start_broker()
        demo.start_runner()
        code, job_id, events = demo.run_job()
        demo.report(code, job_id, events)
    except KeyboardInterrupt:
        print("\ninterrupted", flush=True)
        code = 130
    except Exception as exc:
        print(f"\nERROR: {exc}", file=sys.stderr)
        code = 1
    finally:
        demo.stop()
    print("\ndemo " + ("completed" if code == 0 else f"failed (exit {code})"))
    return 0 if code == 0 else (code if code == 130 else 1)


if __name__ == "__main__":
    sys.exit(main())
