"""deploy/tailscale/policy.hujson as iptables rules, for the docker e2e's tailnet-like network.

`load_policy(path)` reads HuJSON (comments, trailing commas). `Policy.allows(src, dst, proto,
port)` answers a policy's `grants` for identities ("tag:mam-runner", "alice@example.com",
"group:..."), which is what the policy's own `tests` block asserts. `iptables_rules(policy,
hosts, subnet, chain)` turns the grants into the argv lists of one iptables chain that the
docker harness hooks into DOCKER-USER: deny by default between the hosts, one RETURN rule per
granted (source host, destination host, protocol, port), replies of accepted connections, and
everything between hosts that share one tailnet node (the hub and its broker share the hub
node's sidecar in deploy/tailscale/docker-compose.hub.yaml). A refused connection is rejected
with an ICMP "administratively prohibited" (EHOSTUNREACH at the caller), so a test tells the
firewall's refusal apart from a closed port (ECONNREFUSED).
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

PROTOCOLS = ("tcp", "udp")
ANY = "*"
MAX_PORT = 65535


@dataclass(frozen=True)
class Host:
    """One container of the tailnet: its address, the identities it holds, and its tailnet node."""

    name: str
    ip: str
    identities: frozenset[str]
    node: str = ""

    @property
    def node_name(self) -> str:
        return self.node or self.name


@dataclass(frozen=True)
class Grant:
    src: tuple[str, ...]
    dst: tuple[str, ...]
    ports: tuple[tuple[str, int, int], ...]  # (protocol, first port, last port)


@dataclass
class Policy:
    groups: dict[str, list[str]] = field(default_factory=dict)
    grants: list[Grant] = field(default_factory=list)
    tests: list[dict] = field(default_factory=list)

    def matches(self, selector: str, identities: frozenset[str]) -> bool:
        """True when a grant's `selector` (tag, group, user or "*") names one of `identities`."""
        if selector == ANY:
            return True
        if selector in identities:
            return True
        if selector.startswith("group:"):
            return any(member in identities for member in self.groups.get(selector, []))
        return False

    def allows(self, src: frozenset[str], dst: frozenset[str], proto: str, port: int) -> bool:
        """True when some grant lets identities `src` open `proto`/`port` on identities `dst`."""
        for grant in self.grants:
            if not any(self.matches(s, src) for s in grant.src):
                continue
            if not any(self.matches(d, dst) for d in grant.dst):
                continue
            if any(p in (proto, ANY) and lo <= port <= hi for p, lo, hi in grant.ports):
                return True
        return False


def strip_hujson(text: str) -> str:
    """HuJSON to JSON: drop // and /* */ comments outside strings, then trailing commas."""
    out: list[str] = []
    i, in_string = 0, False
    while i < len(text):
        ch = text[i]
        if in_string:
            out.append(ch)
            if ch == "\\":
                out.append(text[i + 1])
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            out.append(ch)
        elif text.startswith("//", i):
            i = text.find("\n", i)
            if i < 0:
                break
            continue
        elif text.startswith("/*", i):
            i = text.index("*/", i) + 2
            continue
        else:
            out.append(ch)
        i += 1
    return re.sub(r",(\s*[}\]])", r"\1", "".join(out))


def parse_ports(spec: str) -> tuple[str, int, int]:
    """'tcp:1883' | 'tcp:8000-8010' | '1883' | 'tcp:*' | '*' -> (protocol or '*', first, last)."""
    proto, _, ports = spec.rpartition(":")
    proto = proto or ANY
    if proto not in (*PROTOCOLS, ANY):
        raise ValueError(f"policy: unsupported protocol in {spec!r} (tcp, udp or none)")
    if ports == ANY:
        return proto, 1, MAX_PORT
    first, _, last = ports.partition("-")
    return proto, int(first), int(last or first)


def load_policy(path: Path) -> Policy:
    """Read a tailnet policy file; only `groups`, `grants` and `tests` are used (no `acls`)."""
    data = json.loads(strip_hujson(Path(path).read_text()))
    if "acls" in data:
        raise ValueError(f"{path}: legacy `acls` are not supported here; write `grants`")
    grants = [Grant(tuple(g["src"]), tuple(g["dst"]), tuple(parse_ports(p) for p in g["ip"]))
              for g in data.get("grants", [])]
    return Policy(groups=data.get("groups", {}), grants=grants, tests=data.get("tests", []))


def iptables_rules(policy: Policy, hosts: list[Host], subnet: str, chain: str) -> list[list[str]]:
    """The iptables argv lists (without the `iptables` word) that build `chain` for `hosts`.

    The chain RETURNs what the policy grants and REJECTs every other new connection between
    addresses of `subnet`; the caller creates the chain and jumps to it from DOCKER-USER.
    """
    net = str(ipaddress.ip_network(subnet))
    rules = [["-N", chain], ["-A", chain, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN"]]
    for src in hosts:
        for dst in hosts:
            if src is dst:
                continue
            base = ["-A", chain, "-s", src.ip + "/32", "-d", dst.ip + "/32"]
            if src.node_name == dst.node_name:
                rules.append([*base, "-j", "RETURN"])
                continue
            for grant in policy.grants:
                if not (any(policy.matches(s, src.identities) for s in grant.src)
                        and any(policy.matches(d, dst.identities) for d in grant.dst)):
                    continue
                for proto, lo, hi in grant.ports:
                    for p in PROTOCOLS if proto == ANY else (proto,):
                        ports = str(lo) if lo == hi else f"{lo}:{hi}"
                        rule = [*base, "-p", p, "--dport", ports, "-j", "RETURN"]
                        if rule not in rules:
                            rules.append(rule)
    rules.append(["-A", chain, "-s", net, "-d", net, "-j", "REJECT", "--reject-with", "icmp-admin-prohibited"])
    return rules
