"""A tailnet-like multi-host network on one machine, from Linux network
namespaces (DESIGN.md "Test strategy", multi-host e2e).

    with Tailnet() as net:                       # or the `tailnet` fixture
        broker = net.spawn("hub", ["nats-server", "-a", "0.0.0.0", ...])
        runner = net.spawn("gpu-box", ["mam-runner", "run", "--session", "gpu-box"],
                           env={"MQTT_BROKER": "hub", ...})
        net.link_down("gpu-box")                 # pull its cable
        net.blackhole("hub")                     # or drop all its packets

Layout: one namespace per host, `mam-<tag>-<host>`, plus `mam-<tag>-br`
holding the bridge `br0`. Each host gets `eth0` (a veth whose peer `v<i>`
sits on the bridge) with an address in 100.64.0.0/24 (the first host, by
default `hub`, is 100.64.0.1, the next .2, ...) and its loopback up. Host
names resolve through `/etc/netns/<ns>/hosts`, which `ip netns exec`
bind-mounts over /etc/hosts for the processes it starts, so `spawn()` is the
only way to start a process that sees those names.

Nothing is created in the root namespace (no interface, route or iptables
rule): veths are created directly inside the namespaces. `<tag>` is random
per run, so concurrent or leftover runs never collide; `close()` removes
everything (idempotent, also at interpreter exit), and `sweep_stale()`
removes what a killed run left behind.

Needs root and iproute2 (`ip`); `blackhole()` also needs iptables. When they
are missing, `Tailnet()` raises `NetnsUnavailable` with the reason and the
`tailnet` fixture skips with it.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import psutil
import pytest

SUBNET = ipaddress.ip_network("100.64.0.0/24")
PREFIX = "mam-"
NETNS_ETC = Path("/etc/netns")
OWNER_DIR = Path("/run/mam-netns")  # who owns a tag, for sweep_stale(); not in /etc/netns (ip would bind-mount it)
DEFAULT_HOSTS = ("hub", "orch", "gpu-box", "cpu-box")
_HOST_RE = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
_TAG_RE = re.compile(r"^mam-([0-9a-f]{8})-")
_CMD_TIMEOUT_S = 20.0


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be built here (not root, no `ip`, or creation refused)."""


def unavailable_reason() -> str | None:
    """Why this machine cannot build a `Tailnet`, or None if it can.

    Checks: Linux, root, `ip` on PATH, and that a probe namespace can really
    be created and deleted (containers without CAP_SYS_ADMIN refuse it).
    """
    if not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run the e2e tests as root)"
    ip = shutil.which("ip")
    if ip is None:
        return "iproute2 is not installed: `ip` not found on PATH"
    probe = f"{PREFIX}{secrets.token_hex(4)}-probe"
    added = subprocess.run([ip, "netns", "add", probe], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if added.returncode != 0:
        first = (added.stderr.strip().splitlines() or ["no message"])[0]
        return f"cannot create a network namespace: {first}"
    subprocess.run([ip, "netns", "del", probe], capture_output=True, timeout=_CMD_TIMEOUT_S)
    return None


class Tailnet:
    """Hosts in network namespaces joined by one bridge (see the module docstring).

    Args:
        hosts: host names, lowercase letters, digits and '-'; the first gets
            100.64.0.1. At most 250.
        tag: the per-run tag (8 hex characters); random by default.
    Raises:
        NetnsUnavailable: see `unavailable_reason()`; nothing is left behind.
        ValueError: a bad or duplicate host name.
    """

    def __init__(self, hosts: Sequence[str] = DEFAULT_HOSTS, *, tag: str | None = None) -> None:
        hosts = list(hosts)
        for host in hosts:
            if not _HOST_RE.match(host):
                raise ValueError(f"host name {host!r} is invalid: lowercase letters, digits and '-', at most 31")
        if len(set(hosts)) != len(hosts) or not hosts or len(hosts) > 250:
            raise ValueError(f"host names must be 1-250 distinct names, got {hosts!r}")
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        self.tag = tag or secrets.token_hex(4)
        if not re.fullmatch(r"[0-9a-f]{8}", self.tag):
            raise ValueError(f"tag {self.tag!r} is invalid: 8 lowercase hex characters")
        self.hosts = hosts
        self._ip = shutil.which("ip") or "ip"
        self._iptables = shutil.which("iptables")
        self._addresses = {host: str(SUBNET.network_address + i + 1) for i, host in enumerate(hosts)}
        self._ports = {host: f"v{i}" for i, host in enumerate(hosts)}
        self._blackholed: set[str] = set()
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self.bridge_ns = f"{PREFIX}{self.tag}-br"
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- names

    def ns(self, host: str) -> str:
        """The namespace name of `host`: `mam-<tag>-<host>`."""
        self._check_host(host)
        return f"{PREFIX}{self.tag}-{host}"

    def address(self, host: str) -> str:
        """The IPv4 address of `host` in 100.64.0.0/24."""
        self._check_host(host)
        return self._addresses[host]

    def namespaces(self) -> list[str]:
        """Every namespace this tailnet creates (hosts and bridge)."""
        return [self.ns(h) for h in self.hosts] + [self.bridge_ns]

    @property
    def has_iptables(self) -> bool:
        """True if `blackhole()` can work (iptables is installed)."""
        return self._iptables is not None

    def _check_host(self, host: str) -> None:
        if host not in self._addresses:
            raise KeyError(f"unknown host {host!r}; this tailnet has {self.hosts}")

    # -- build

    def _cmd(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([self._ip, *args], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
        if check and result.returncode != 0:
            raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
        return result

    def _build(self) -> None:
        OWNER_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        me = psutil.Process()
        (OWNER_DIR / f"{self.tag}.owner").write_text(f"{me.pid} {me.create_time()}\n")
        self._cmd("netns", "add", self.bridge_ns)
        self._cmd("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        self._cmd("-n", self.bridge_ns, "link", "set", "br0", "up")
        hosts_text = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" + "".join(
            f"{addr}\t{host}\n" for host, addr in self._addresses.items())
        for host in self.hosts:
            ns, port = self.ns(host), self._ports[host]
            etc = NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_text)
            self._cmd("netns", "add", ns)
            self._cmd("-n", ns, "link", "set", "lo", "up")
            # Created inside the bridge namespace, peer moved straight into the host: never in the root ns.
            self._cmd("-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._cmd("-n", self.bridge_ns, "link", "set", port, "master", "br0")
            self._cmd("-n", self.bridge_ns, "link", "set", port, "up")
            self._cmd("-n", ns, "addr", "add", f"{self._addresses[host]}/{SUBNET.prefixlen}", "dev", "eth0")
            self._cmd("-n", ns, "link", "set", "eth0", "up")

    # -- processes

    def spawn(self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **popen_kwargs) -> subprocess.Popen:
        """Start `argv` inside `host`'s namespace (via `ip netns exec`, so /etc/hosts
        is that host's) in its own process group; `close()` kills that group.

        Args:
            host: a host of this tailnet.
            argv: the command; `ip netns exec` runs it with execvp (PATH lookup).
            env: its environment (default: inherited).
            popen_kwargs: passed to `subprocess.Popen` (stdout, stderr, cwd, text, ...).
        Returns:
            the Popen; its pid is the command's own pid (`ip` execs it).
        """
        if self._closed:
            raise RuntimeError("tailnet is closed")
        popen_kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen([self._ip, "netns", "exec", self.ns(host), *argv],
                                env=dict(env) if env is not None else None, **popen_kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], *, timeout_s: float = _CMD_TIMEOUT_S,
            **run_kwargs) -> subprocess.CompletedProcess:
        """Run a short command inside `host` and wait for it (output captured as text)."""
        run_kwargs.setdefault("capture_output", True)
        run_kwargs.setdefault("text", True)
        return subprocess.run([self._ip, "netns", "exec", self.ns(host), *argv], timeout=timeout_s, **run_kwargs)

    # -- faults

    def link_down(self, host: str) -> None:
        """Pull `host`'s cable: its bridge port goes down, its own config stays (`ip link set … down`)."""
        self._cmd("-n", self.bridge_ns, "link", "set", self._port(host), "down")

    def link_up(self, host: str) -> None:
        """Plug `host`'s cable back in."""
        self._cmd("-n", self.bridge_ns, "link", "set", self._port(host), "up")

    def _port(self, host: str) -> str:
        self._check_host(host)
        return self._ports[host]

    def blackhole(self, host: str) -> None:
        """Silently drop every packet in and out of `host`'s eth0 (iptables DROP inside its
        namespace; loopback keeps working). Idempotent."""
        if host in self._blackholed:
            return
        for rule in self._blackhole_rules():
            self._iptables_in(host, "-I", *rule)
        self._blackholed.add(host)

    def unblackhole(self, host: str) -> None:
        """Undo `blackhole(host)`. Idempotent."""
        if host not in self._blackholed:
            return
        for rule in self._blackhole_rules():
            self._iptables_in(host, "-D", *rule)
        self._blackholed.discard(host)

    @staticmethod
    def _blackhole_rules() -> list[tuple[str, ...]]:
        return [("INPUT", "-i", "eth0", "-j", "DROP"), ("OUTPUT", "-o", "eth0", "-j", "DROP")]

    def _iptables_in(self, host: str, *args: str) -> None:
        if self._iptables is None:
            raise NetnsUnavailable("iptables is not installed: blackhole() needs it")
        result = self.run(host, [self._iptables, "-w", *args])
        if result.returncode != 0:
            raise NetnsUnavailable(f"iptables {' '.join(args)} in {host} failed: {result.stderr.strip()}")

    # -- teardown

    def close(self) -> None:
        """Kill every process started here (process groups) or still inside the
        namespaces, then delete the namespaces (with their veths and bridge),
        /etc/netns/<ns> folders and the owner file. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        _stop_groups(self._procs)
        _teardown(self._ip, getattr(self, "tag", ""), self.namespaces() if hasattr(self, "bridge_ns") else [])

    def __enter__(self) -> Tailnet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- leftovers

    @staticmethod
    def sweep_stale() -> list[str]:
        """Delete namespaces of earlier runs whose owning process is gone.

        Only namespaces named `mam-<8 hex>-…` whose tag has an owner file in
        /run/mam-netns naming a dead process (pid + create time) are touched.
        Returns:
            the namespaces deleted.
        """
        ip = shutil.which("ip")
        if ip is None or os.geteuid() != 0:
            return []
        listed = subprocess.run([ip, "netns", "list"], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
        by_tag: dict[str, list[str]] = {}
        for line in listed.stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            match = _TAG_RE.match(name)
            if match:
                by_tag.setdefault(match.group(1), []).append(name)
        deleted: list[str] = []
        for tag, names in by_tag.items():
            owner = OWNER_DIR / f"{tag}.owner"
            try:
                pid_text, created_text = owner.read_text().split()
                alive = psutil.Process(int(pid_text)).create_time() == float(created_text)
            except psutil.NoSuchProcess:
                alive = False
            except (OSError, ValueError):
                continue  # no owner file: not provably ours, leave it
            if not alive:
                _teardown(ip, tag, names)
                deleted.extend(names)
        return deleted


def _stop_groups(procs: list[subprocess.Popen], grace_s: float = 1.0) -> None:
    """SIGTERM each process group, SIGKILL what is left after `grace_s`, reap all."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.02)
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _ns_pids(ip: str, ns: str) -> list[int]:
    result = subprocess.run([ip, "netns", "pids", ns], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    return [int(p) for p in result.stdout.split() if p.isdigit()]


def _teardown(ip: str, tag: str, namespaces: list[str]) -> None:
    """Kill whatever still lives in `namespaces`, delete them and their /etc/netns folders."""
    for ns in namespaces:
        deadline = time.monotonic() + 5.0
        while (pids := _ns_pids(ip, ns)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
    for ns in namespaces:
        subprocess.run([ip, "netns", "del", ns], capture_output=True, timeout=_CMD_TIMEOUT_S)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    if tag:
        try:
            (OWNER_DIR / f"{tag}.owner").unlink()
        except FileNotFoundError:
            pass
    # /etc/netns itself stays (empty, `ip netns` uses it too): removing it could race another
    # run's mkdir of its own folder there (make test runs two pytest workers).


@pytest.fixture
def tailnet() -> Iterator[Tailnet]:
    """A fresh `Tailnet` with the default hosts, closed after the test even when it
    fails; skips with the reason when namespaces are unavailable. Import it into
    a test module (`from harness.netns import tailnet`) to use it."""
    Tailnet.sweep_stale()
    try:
        net = Tailnet()
    except NetnsUnavailable as exc:
        pytest.skip(f"multi-host e2e needs network namespaces: {exc}")
    try:
        yield net
    finally:
        net.close()
