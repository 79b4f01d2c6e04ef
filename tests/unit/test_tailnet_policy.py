"""The iptables rules of the docker e2e come from deploy/tailscale/policy.hujson.

The generator (tests/harness/tailnet_policy.py) must read the shipped policy, agree with the
policy's own `tests` block, and turn it into rules that open exactly the granted ports.
"""

from __future__ import annotations

import pytest
from harness.docker_fleet import HOSTS, POLICY_FILE
from harness.tailnet_policy import Host, iptables_rules, load_policy, parse_ports, strip_hujson

SUBNET = "100.96.10.0/24"
CHAIN = "MAM-E2E-TEST"


@pytest.fixture(scope="module")
def policy():
    return load_policy(POLICY_FILE)


@pytest.fixture(scope="module")
def hosts() -> list[Host]:
    return [Host(name, f"100.96.10.{octet}", ids, node) for name, (octet, ids, node) in HOSTS.items()]


def _target(spec: str) -> tuple[frozenset[str], int]:
    identity, _, port = spec.rpartition(":")
    return frozenset({identity}), int(port)


def test_hujson_comments_and_trailing_commas_are_stripped():
    assert strip_hujson('{"a": "x//y", // note\n "b": [1, 2,], /* c */}') == '{"a": "x//y", \n "b": [1, 2] }'


@pytest.mark.parametrize("spec,expected", [("tcp:1883", ("tcp", 1883, 1883)), ("udp:53", ("udp", 53, 53)),
                                           ("tcp:8000-8010", ("tcp", 8000, 8010)), ("*", ("*", 1, 65535)),
                                           ("443", ("*", 443, 443))])
def test_port_specs(spec, expected):
    assert parse_ports(spec) == expected


def test_unknown_protocol_is_refused():
    with pytest.raises(ValueError, match="unsupported protocol"):
        parse_ports("sctp:1")


def test_the_policy_passes_its_own_tests_block(policy):
    """Every accept/deny of policy.hujson's `tests` (what Tailscale checks on save) holds here."""
    assert policy.tests
    for case in policy.tests:
        src = frozenset({case["src"]})
        for spec in case.get("accept", []):
            dst, port = _target(spec)
            assert policy.allows(src, dst, "tcp", port), (case["src"], spec)
        for spec in case.get("deny", []):
            dst, port = _target(spec)
            assert not policy.allows(src, dst, "tcp", port), (case["src"], spec)


def test_rules_open_only_the_granted_ports(policy, hosts):
    """Runners → broker node tcp/1883 and tcp/9418 (git), observers → broker node tcp/8080, the hub,
    broker and git server among themselves (one node),
    replies; every other connection inside the subnet is rejected last."""
    rules = iptables_rules(policy, hosts, SUBNET, CHAIN)
    ip = {h.name: h.ip for h in hosts}
    assert rules[0] == ["-N", CHAIN]
    assert rules[-1] == ["-A", CHAIN, "-s", SUBNET, "-d", SUBNET, "-j", "REJECT", "--reject-with",
                         "icmp-admin-prohibited"]
    opened = {(r[r.index("-s") + 1], r[r.index("-d") + 1], r[r.index("--dport") + 1] if "--dport" in r else "all")
              for r in rules[2:-1]}
    hub_node = ("broker", "hub", "git")
    expected = {(ip[a] + "/32", ip[b] + "/32", "all") for a in hub_node for b in hub_node if a != b}
    for runner in ("runner-a", "runner-b", "runner-c"):
        expected |= {(ip[runner] + "/32", ip[dst] + "/32", port) for dst in hub_node for port in ("1883", "9418")}
    expected |= {(ip["observer"] + "/32", ip[dst] + "/32", "8080") for dst in hub_node}
    assert opened == expected
    assert all(r[r.index("-p") + 1] == "tcp" for r in rules[2:-1] if "-p" in r)


def test_a_group_member_gets_the_group_grants(policy):
    """alice@example.com is in group:mam-observers and group:mam-admins: 8080 and SSH, never 1883."""
    alice, broker = frozenset({"alice@example.com"}), frozenset({"tag:mam-broker"})
    assert policy.allows(alice, broker, "tcp", 8080) and policy.allows(alice, broker, "tcp", 22)
    assert not policy.allows(alice, broker, "tcp", 1883)
