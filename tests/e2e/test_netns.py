"""Self-test of the multi-host harness tests/harness/netns.py (DESIGN.md, multi-host e2e)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from harness.netns import NETNS_ETC, OWNER_DIR, Tailnet, tailnet  # noqa: F401 - fixture
from harness.waiting import PATIENCE_S

pytestmark = pytest.mark.e2e

PORT = 7411
SERVER = textwrap.dedent("""\
    import socket, sys
    srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.sendall(b"hello from " + socket.gethostbyname("hub").encode())
        conn.close()
    """)
CLIENT = textwrap.dedent("""\
    import socket, sys
    try:
        with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:
            print(s.recv(100).decode())
    except OSError as exc:
        print(f"unreachable: {type(exc).__name__}")
        sys.exit(1)
    """)


def ns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def connect(net: Tailnet, src: str, dst: str, timeout_s: float = 5.0) -> subprocess.CompletedProcess:
    return net.run(src, [sys.executable, "-c", CLIENT, dst, str(PORT), str(timeout_s)], timeout_s=timeout_s + 10)


def start_server(net: Tailnet, host: str = "hub") -> subprocess.Popen:
    server = net.spawn(host, [sys.executable, "-c", SERVER, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    return server


def test_namespaces_come_up_with_addresses_and_names(tailnet):
    listed = ns_list()
    for host in ("hub", "orch", "gpu-box", "cpu-box"):
        ns = tailnet.ns(host)
        assert ns.startswith(f"mam-{tailnet.tag}-") and ns in listed
        addr = tailnet.run(host, ["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
        assert f"{tailnet.address(host)}/24" in addr
        assert "UP" in tailnet.run(host, ["ip", "-o", "link", "show", "lo"]).stdout
        hosts = (NETNS_ETC / ns / "hosts").read_text()
        assert "100.64.0.1\thub" in hosts
    assert tailnet.address("hub") == "100.64.0.1"
    assert all(a.startswith("100.64.0.") for a in map(tailnet.address, tailnet.hosts))
    # Names resolve inside a namespace through /etc/netns/<ns>/hosts.
    got = tailnet.run("orch", ["getent", "hosts", "gpu-box"]).stdout
    assert got.split()[0] == tailnet.address("gpu-box")


def test_orch_reaches_hub_by_name_until_link_down(tailnet):
    start_server(tailnet, "hub")
    ok = connect(tailnet, "orch", "hub")
    assert ok.returncode == 0 and ok.stdout.strip() == "hello from 100.64.0.1", ok.stderr

    tailnet.link_down("hub")
    down = connect(tailnet, "orch", "hub", timeout_s=1.5)
    assert down.returncode == 1 and "unreachable" in down.stdout
    assert connect(tailnet, "gpu-box", "cpu-box", timeout_s=1.5).stdout.startswith("unreachable")  # no server there

    tailnet.link_up("hub")
    deadline = time.monotonic() + PATIENCE_S
    while (again := connect(tailnet, "orch", "hub", timeout_s=2)).returncode != 0:
        assert time.monotonic() < deadline, "hub not reachable again after link_up"
    assert again.stdout.strip() == "hello from 100.64.0.1"


def test_blackhole_drops_packets_and_unblackhole_restores(tailnet):
    if not tailnet.has_iptables:
        pytest.skip("iptables is not installed")
    start_server(tailnet, "hub")
    tailnet.blackhole("hub")
    tailnet.blackhole("hub")  # idempotent
    dropped = connect(tailnet, "orch", "hub", timeout_s=1.5)
    assert dropped.returncode == 1 and "TimeoutError" in dropped.stdout  # silently dropped, not refused
    local = tailnet.run("hub", [sys.executable, "-c", CLIENT, "127.0.0.1", str(PORT), "5"])
    assert local.returncode == 0  # loopback unaffected
    tailnet.unblackhole("hub")
    tailnet.unblackhole("hub")
    assert connect(tailnet, "orch", "hub").returncode == 0


def test_close_kills_every_process_and_removes_everything():
    net = Tailnet(("hub", "orch"))
    try:
        server = start_server(net, "hub")
        # A daemon that left the spawned process group: only `ip netns pids` finds it.
        daemon = net.run("orch", ["bash", "-c", "setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $!"])
        daemon_pid = int(daemon.stdout.strip())
        pids = {server.pid: psutil.Process(server.pid).create_time(),
                daemon_pid: psutil.Process(daemon_pid).create_time()}
        names = net.namespaces()
    finally:
        net.close()
    net.close()  # idempotent
    listed = ns_list()
    for ns in names:
        assert ns not in listed
        assert not (NETNS_ETC / ns).exists()
    assert not (OWNER_DIR / f"{net.tag}.owner").exists()
    for pid, created in pids.items():
        try:
            proc = psutil.Process(pid)
            assert proc.create_time() != created or proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass
    with pytest.raises(RuntimeError, match="closed"):
        net.spawn("hub", ["true"])


def test_two_runs_do_not_collide_and_stale_runs_are_swept():
    first, second = Tailnet(("hub", "orch")), Tailnet(("hub", "orch"))
    try:
        assert first.tag != second.tag
        assert set(first.namespaces()).isdisjoint(second.namespaces())
        # Pretend `first` belongs to a dead process: sweep_stale removes it, not `second`. (A
        # test of the other pytest worker may sweep it first, so what this call deleted is a subset.)
        (OWNER_DIR / f"{first.tag}.owner").write_text("999999999 0\n")
        swept = Tailnet.sweep_stale()
        assert set(swept) <= set(first.namespaces())
        listed = ns_list()
        assert all(ns not in listed for ns in first.namespaces())
        assert all(ns in listed for ns in second.namespaces())
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("hosts", [("hub", "hub"), ("Hub",), ("gpu.box",), ("a" * 40,), ()])
def test_bad_host_names_are_refused_before_anything_is_built(hosts, monkeypatch):
    commands: list[list[str]] = []  # not `ip netns list` before and after: the other pytest worker changes it
    real_run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda argv, *a, **kw: commands.append(argv) or real_run(argv, *a, **kw))
    with pytest.raises(ValueError):
        Tailnet(hosts)
    assert commands == []


def test_unknown_host_is_refused(tailnet):
    with pytest.raises(KeyError, match="unknown host"):
        tailnet.spawn("nowhere", ["true"])
    with pytest.raises(KeyError):
        tailnet.link_down("nowhere")

