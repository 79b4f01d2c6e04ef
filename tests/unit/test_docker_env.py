"""The docker harness's pure parts (no engine needed)."""

from __future__ import annotations

import ipaddress

from harness import docker_env, netns

TAILNET = ipaddress.ip_network("100.64.0.0/10")


def test_engine_addresses_stay_inside_the_tailnet_range_and_clear_of_netns():
    bridge = ipaddress.ip_interface(docker_env.DOCKERD_BIP).network
    pool = ipaddress.ip_network(docker_env.DOCKERD_POOL.split(",")[0].removeprefix("base="))
    for net in (bridge, pool):
        assert net.subnet_of(TAILNET) and not net.overlaps(netns.SUBNET), net


def test_not_root_skips_with_the_reason(monkeypatch):
    monkeypatch.setattr(docker_env.os, "geteuid", lambda: 1000)
    assert "needs root" in docker_env.unavailable_reason()


def test_mirror_from_deb822_sources(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\nTypes: deb\nURIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n")
    assert docker_env.debian_mirror(tmp_path) == "http://mirror.example/debian"


def test_mirror_from_one_line_sources(tmp_path):
    (tmp_path / "sources.list").write_text(
        "deb [arch=amd64] http://security.example/d bookworm-security main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://one.example/debian bookworm main\n")
    assert docker_env.debian_mirror(tmp_path) == "http://one.example/debian"


def test_mirror_falls_back_to_debian(tmp_path):
    assert docker_env.debian_mirror(tmp_path) == docker_env.FALLBACK_MIRROR
