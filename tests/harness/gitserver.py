"""A real `git daemon` serving bare repositories on a loopback (or namespace) address, and
helpers that make a small origin repository for repository jobs (PROTOCOL §18)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from types import TracebackType

from harness.brokers import free_port
from harness.waiting import PATIENCE_S, wait_until

GIT_ENV = {"GIT_AUTHOR_NAME": "dev", "GIT_AUTHOR_EMAIL": "dev@example.invalid", "GIT_COMMITTER_NAME": "dev",
           "GIT_COMMITTER_EMAIL": "dev@example.invalid", "GIT_CONFIG_NOSYSTEM": "1"}


def git(*args: str, cwd: Path | None = None) -> str:
    """Run git in `cwd` as a developer would; its stdout. Raises CalledProcessError."""
    done = subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **GIT_ENV})
    return done.stdout


def make_origin(base: Path, name: str = "demo") -> Path:
    """A bare repository `<base>/<name>.git` whose `main` has two commits (README, src/app.py)
    and a tag `v1`; returns its path."""
    work = base / f"{name}-work"
    git("init", "-q", "-b", "main", str(work))
    (work / "README.md").write_text("# demo\n")
    git("add", "-A", cwd=work)
    git("commit", "-qm", "first", cwd=work)
    (work / "src").mkdir()
    (work / "src" / "app.py").write_text("print('hello')\n")
    git("add", "-A", cwd=work)
    git("commit", "-qm", "second", cwd=work)
    git("tag", "v1", cwd=work)
    bare = base / f"{name}.git"
    git("clone", "-q", "--bare", str(work), str(bare))
    return bare


class GitDaemon:
    """`git daemon` exporting every repository under `base_dir` at `git://HOST:PORT/<name>.git`.

    Args:
        base_dir: the folder of bare repositories; host: the address to listen on (127.0.0.1).
        netns: run it inside this network namespace (`ip netns exec`), or None.
        port: the port (default: a free loopback port; 9418 inside a namespace).
    """

    def __init__(self, base_dir: Path, host: str = "127.0.0.1", netns: str | None = None,
                 port: int | None = None) -> None:
        self.base_dir, self.host, self.netns = base_dir, host, netns
        self.port = port or (9418 if netns is not None else free_port())
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, name: str = "demo") -> str:
        """The clone URL of `<base_dir>/<name>.git`."""
        return f"git://{self.host}:{self.port}/{name}.git"

    def __enter__(self) -> GitDaemon:
        argv = ["git", "daemon", "--reuseaddr", "--export-all", f"--base-path={self.base_dir}",
                f"--listen={self.host}", f"--port={self.port}", str(self.base_dir)]
        if self.netns is not None:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(self._accepts, timeout_s=PATIENCE_S, what=f"git daemon on {self.host}:{self.port}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _accepts(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"git daemon exited {self.proc.returncode}")
        if self.netns is not None:  # its address is inside the namespace
            probe = ["ip", "netns", "exec", self.netns, "bash", "-c", f"exec 3<>/dev/tcp/{self.host}/{self.port}"]
            return subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode == 0
        try:
            with socket.create_connection((self.host, self.port), timeout=1):
                return True
        except OSError:
            return False

    def __exit__(self, *exc: object | TracebackType) -> None:
        """Stop the daemon (SIGTERM, then SIGKILL after 10 s); safe twice."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
