"""A fleet for the real agent CLIs end to end (PROTOCOL §18): a real broker, the hub service
with its HTTP API in the hub's namespace, a `git daemon` serving `demo` on the hub, and on
gpu-box a scripted model server (its 127.0.0.1) and the runner, started as the card
prints it (`mam-runner run --session gpu-box --exec claude|codex`)."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness.fleet import Dispatch, Fleet, Runner
from harness.gitserver import GitDaemon, make_origin
from harness.modelserver import AGENTS_DIR, ModelProcess, Step, agent_bin, claude_env, codex_env
from harness.netns import unavailable_reason
from harness.waiting import PATIENCE_S
from mam.shared.cli import render

HTTP_PORT = 8090  # inside the hub's own namespace
FAST = ("--heartbeat", "1", "--heartbeat-misses", "20", "--ack-timeout", str(int(PATIENCE_S)))
AGENT_START_S = 2 * PATIENCE_S
"""Deadline for what comes only after a whole agent start (the worktree, the CLI, its permission
tool's server, a model turn): each of them may take long on a busy machine, seconds."""
AGENT_TEST_S = 300
"""pytest's timeout for a test that starts a real agent CLI, seconds."""
ASK_HOOK = shlex.join([sys.executable, "-m", "mam.runner", "ask", "--hook"])
"""`mam-runner ask --hook` as an agent's hook command runs it (§19 "Hooks")."""


class AgentFleet:
    """The fleet, its git daemon and (once `start`ed) the model server and the runner.

    Args:
        tmp_path: the test's folder; agent: `claude` or `codex` (the CLI and its environment).
    """

    def __init__(self, tmp_path: Path, agent: str) -> None:
        self.tmp, self.agent = tmp_path, agent
        self.fleet = Fleet("netns", tmp_path)
        self.origin = make_origin(tmp_path / "served")
        self.daemon = GitDaemon(self.origin.parent, host=self.fleet.net.address("hub"),
                                netns=self.fleet.net.ns("hub"))
        self.model: ModelProcess | None = None

    def start(self, script: list[Step], *runner_args: str, exec_cmd: str | None = None,
              env: dict[str, str] | None = None) -> Runner:
        """The model server playing `script` on gpu-box, then the runner with `--exec` the
        agent (or `exec_cmd`) and `--repo demo=git://hub/demo.git`; `env` adds to its environment."""
        self.model = ModelProcess(lambda argv: self.fleet._popen("gpu-box", argv), self.tmp / "model", script)
        return self.fleet.start_runner("gpu-box", exec_cmd or self.agent, "--repo",
                                       f"demo={self.daemon.url('demo')}", *runner_args,
                                       env={**self.agent_env(self.tmp / "agent-home"), **(env or {})})

    def agent_env(self, home: Path) -> dict[str, str]:
        """A runner's environment for the agent CLI against the model server, its HOME at `home`."""
        assert self.model is not None, "start() first: the model server"
        make_env = claude_env if self.agent == "claude" else codex_env
        return {**make_env(self.model.url, home),
                "PATH": f"{AGENTS_DIR / 'node_modules' / '.bin'}:{self.fleet.env['PATH']}"}

    def run(self, *opts: str) -> tuple[int, str]:
        """Dispatch "Make the change." on repo demo and wait; (exit code, job id)."""
        handle = self.fleet.dispatch("gpu-box", "Make the change.", "--repo", "demo", *FAST, *opts)
        return handle.wait(), handle.job_id()

    def story(self, handle: Dispatch) -> str:
        """What a failed wait needs told: the dispatch's and the runner's output, the model's calls."""
        runner = self.fleet.runners.get("gpu-box")
        calls = self.model.calls() if self.model is not None else []
        job_id = next((line["job_id"] for line in handle.lines if "job_id" in line), None)
        wire = [(e["event"], e["seq"]) for e in self.fleet.events_on_wire(job_id)] if job_id else []
        return (f"dispatch (alive={handle.alive()}), events {[(e['event'], e.get('seq')) for e in handle.events()]}:"
                f"\n{handle.log()[-2000:]}\nevents on the wire: {wire}\nrunner:\n"
                f"{runner.log()[-3000:] if runner is not None else '-'}\nmodel calls: "
                f"{[(c.get('path'), c.get('tools'), c.get('messages')) for c in calls]}")

    def show_text(self, job_id: str) -> str:
        """`mam-orch show` as a person sees it on a terminal."""
        shown = self.fleet.orch("show", job_id, "--json")
        assert shown.returncode == 0, shown.stderr
        obj = json.loads(shown.stdout)
        return render.show_text(obj["record"], obj["audit"])

    def terminal(self, job_id: str) -> dict:
        """The job's terminal event as the wire carried it."""
        return next(e for e in self.fleet.events_on_wire(job_id) if e["event"] in ("completed", "error"))

    def metrics(self) -> str:
        """`GET /metrics` of the hub's HTTP API, from inside the hub's namespace."""
        fetched = self.fleet.run_on("orch", [sys.executable, "-c", "import urllib.request; print(urllib.request."
                                             f"urlopen('http://127.0.0.1:{HTTP_PORT}/metrics').read().decode())"])
        assert fetched.returncode == 0, fetched.stderr
        return fetched.stdout

    def close(self) -> None:
        if self.model is not None:
            self.model.stop()
        self.fleet.close()


@contextmanager
def agent_fleet(tmp_path: Path, agent: str) -> Iterator[AgentFleet]:
    """An `AgentFleet` with the hub serving; skips where namespaces or the CLI are missing."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"the {agent} e2e needs network namespaces: {reason}")
    if agent_bin(agent) is None:
        pytest.skip(f"the {agent} CLI is not installed: `make test` installs it (npm, tests/agents)")
    cf = AgentFleet(tmp_path, agent)
    try:
        with cf.daemon:
            cf.fleet.serve("--http", f"127.0.0.1:{HTTP_PORT}")
            yield cf
    finally:
        cf.close()
