"""`mam-orch gc --reclear`: which retained topics must stay cleared (a broker restart may bring them back; §2)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from harness.workspace import TEST_SECRET

from mam.orchestrator import gc
from mam.shared.config import BrokerConfig, write_env_file
from mam.shared.protocol.errors import BrokerError, BrokerUnavailable, PublishTimeout
from mam.shared.store.registry import Registry
from mam.shared.transport.mqtt import UNREACHABLE

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("status, collected, leaves", [
    ("completed", False, ("dispatch", "control")),
    ("error", False, ("dispatch", "control")),
    ("cancelled", False, ("dispatch", "control")),
    ("completed", True, ("dispatch", "events", "state", "control")),
    ("running", False, ("dispatch",)),
    ("pending", False, ()),
])
def test_fault7_reclear_leaves_follow_the_hub_record(status, collected, leaves):
    assert gc.reclear_leaves({"status": status}, collected) == leaves  # type: ignore[arg-type]


class Node:
    """A connection `gc.connect` hands out: records each clear; `fails` raises PublishTimeout."""

    def __init__(self, config: BrokerConfig, fails: bool) -> None:
        self.config, self.fails, self.cleared, self.closed = config, fails, [], False
        self.queued, self.most_queued = 0, 0  # clears published whose PUBACK nobody awaited yet
        self.endpoint = f"{config.hosts[0]}:{config.port}"

    def publish_async(self, topic: str, payload: bytes, retain: bool = False) -> Callable[[], None]:
        self.queued += 1
        self.most_queued = max(self.most_queued, self.queued)

        def wait() -> None:
            self.queued -= 1
            if self.fails:
                raise PublishTimeout(f"no PUBACK for {topic} from {self.endpoint} within 5 s")
            self.cleared.append((topic, payload, retain))
        return wait

    def close(self) -> None:
        self.closed = True


def test_fault7_s13_reclear_walks_every_host_a_silent_node_is_a_warning(monkeypatch, capsys):
    """Each host of the list gets every clear on its own connection (the rest of the config
    unchanged); one that refuses the connection or acknowledges no clear is one WARNING line
    naming it, with the workspace in the hint, and the hosts after it are still cleared."""
    cfg = BrokerConfig(hosts=("nats-1", "nats-2", "nats-3", "nats-4"), port=1883, password="pw", topic_root="t")
    nodes: list[Node] = []

    def connect(config: BrokerConfig, role: str) -> Node:
        if config.hosts == ("nats-1",):
            raise BrokerUnavailable(f"{UNREACHABLE}nats-1:1883 (connection refused)")
        nodes.append(Node(config, fails=config.hosts == ("nats-2",)))
        return nodes[-1]

    monkeypatch.setattr(gc, "connect", connect)
    due = [({"job_id": "a1b2c3d4"}, ("dispatch", "control"))]
    gc._clear_on_every_node(cfg, due, "/srv/hub")  # type: ignore[arg-type]
    assert [n.config for n in nodes] == [cfg.with_overrides(hosts=(h,)) for h in ("nats-2", "nats-3", "nats-4")]
    assert all(n.closed for n in nodes)
    expected = [("t/jobs/a1b2c3d4/dispatch", b"", True), ("t/jobs/a1b2c3d4/control", b"", True)]
    assert [n.cleared for n in nodes] == [[], expected, expected]
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2 and all(w.startswith("WARNING: re-clearing through nats-") for w in warnings)
    assert "nats-1:1883 (connection refused)" in warnings[0] and "nats-2:1883 (no PUBACK" in warnings[1]
    assert all("mam-orch gc --reclear --workspace /srv/hub" in w and "pw" not in w for w in warnings)


def test_fault7_reclear_through_no_host_is_a_broker_error(monkeypatch):
    def connect(config: BrokerConfig, role: str) -> Node:
        raise BrokerUnavailable(f"{UNREACHABLE}{config.hosts[0]}:1883 (connection refused)")

    monkeypatch.setattr(gc, "connect", connect)
    with pytest.raises(BrokerError, match="every host: a:1883 .connection refused.; b:1883"):
        gc._clear_on_every_node(BrokerConfig(hosts=("a", "b")), [({"job_id": "a1b2c3d4"}, ("dispatch",))], None)  # type: ignore[list-item]


@pytest.fixture
def registry(tmp_path) -> Registry:
    """A hub workspace whose `.mam.env` names broker `hub-a` and topic root `t`."""
    write_env_file(tmp_path / ".mam.env", {"MQTT_BROKER": "hub-a", "MQTT_PASSWORD": "pw", "MAM_TOPIC_ROOT": "t",
                                           "MAM_DISPATCH_SECRET": TEST_SECRET})
    return Registry(tmp_path)


@pytest.fixture
def nodes(monkeypatch) -> list[Node]:
    """Every connection `gc` opens, in order (stand-ins; host `down` refuses the connection)."""
    opened: list[Node] = []

    def connect(config: BrokerConfig, role: str) -> Node:
        if "down" in config.hosts:
            raise BrokerUnavailable(f"{UNREACHABLE}down:1883 (connection refused)")
        opened.append(Node(config, fails=False))
        return opened[-1]

    monkeypatch.setattr(gc, "connect", connect)
    return opened


def ended_jobs(registry: Registry, *brokers: dict | None) -> list[str]:
    """One cancelled hub job per entry of `brokers` (its per-job overrides, or None)."""
    ids = [registry.register(session="gpu-box", broker=broker)["job_id"] for broker in brokers]
    for job_id in ids:
        registry.close(job_id, "cancelled")
    return ids


def topics(root: str, job_id: str, leaves: tuple[str, ...]) -> list[str]:
    return sorted(f"{root}/jobs/{job_id}/{leaf}" for leaf in leaves)


def test_s13_gc_and_reclear_clear_each_job_on_its_own_broker(registry, nodes, capsys):
    """§13 per-job overrides: a job dispatched to another host and topic root has its retained
    topics there, so `gc` and `gc --reclear` clear them there (one connection per broker, the
    workspace's first), and the other jobs through the workspace's broker."""
    plain, moved = ended_jobs(registry, None, {"host": "hub-b", "topic_root": "other"})
    assert gc.reclear_cli(workspace=registry.root) == 0
    assert gc.gc_cli(older_than_days=0, workspace=registry.root, as_json=True) == 0
    capsys.readouterr()
    seen = [(n.config.hosts, n.config.topic_root, sorted(topic for topic, _, _ in n.cleared)) for n in nodes]
    assert seen == [(("hub-a",), "t", topics("t", plain, gc.ENDED_LEAVES)),
                    (("hub-b",), "other", topics("other", moved, gc.ENDED_LEAVES)),
                    (("hub-a",), "t", topics("t", plain, gc.RETAINED_LEAVES)),
                    (("hub-b",), "other", topics("other", moved, gc.RETAINED_LEAVES))]
    assert all(n.closed for n in nodes)


def test_s13_a_broker_that_is_down_does_not_stop_the_others(registry, nodes, capsys):
    """The job of an unreachable broker is left (exit 3 naming it, with the command to run again);
    the jobs before and after it, on other brokers, are cleared and printed; `gc` clears it
    once it is back."""
    first, lost, last = ended_jobs(registry, None, {"host": "down"}, {"host": "hub-c"})
    with pytest.raises(BrokerError, match=r"down:1883 \(connection refused\)"):
        gc.reclear_cli(workspace=registry.root)
    printed = [json.loads(line)["job_id"] for line in capsys.readouterr().out.splitlines()]
    assert sorted(printed) == sorted([first, last])
    with pytest.raises(BrokerError, match=f"down:1883.*mam-orch gc --workspace {registry.root}"):
        gc.gc_cli(older_than_days=0, workspace=registry.root, as_json=True)
    assert sorted(json.loads(line)["job_id"] for line in capsys.readouterr().out.splitlines()) == sorted([first, last])
    cleared = {topic.split("/")[2] for n in nodes for topic, _, _ in n.cleared}
    assert cleared == {first, last}
    path = registry.record_path(lost)  # back on a broker that answers: the next gc clears it, the others stay done
    path.write_text(json.dumps({**json.loads(path.read_text()), "broker": {"host": "hub-b"}}))
    assert gc.gc_cli(older_than_days=0, workspace=registry.root, as_json=True) == 0
    assert [json.loads(line)["job_id"] for line in capsys.readouterr().out.splitlines()] == [lost]


def test_fault7_broker_up_re_clears_only_the_jobs_of_its_own_broker(registry, nodes):
    """`broker up` after an unclean stop (local_only): the jobs on the workspace's hosts and port,
    whatever their topic root, not those dispatched to another broker (maybe unreachable)."""
    plain, other_root, elsewhere = ended_jobs(registry, None, {"topic_root": "other"}, {"host": "down"})
    done, errors, failed = gc.reclear(registry.root, local_only=True)
    assert sorted(line["job_id"] for line in done) == sorted([plain, other_root])
    assert errors == 0 and failed == []
    assert [n.config.hosts for n in nodes] == [("hub-a",), ("hub-a",)]


def test_s2_clears_are_queued_in_batches_before_their_pubacks_are_awaited():
    """250 clears: every one published and acknowledged, at most CLEAR_BATCH awaited at a time."""
    node = Node(BrokerConfig(hosts=("nats-1",), topic_root="t"), fails=False)
    due = [({"job_id": f"{n:08x}"}, ("dispatch", "control")) for n in range(125)]
    gc._clear_leaves(node, due)  # type: ignore[arg-type]
    assert len(node.cleared) == 250 and node.queued == 0
    assert node.most_queued == gc.CLEAR_BATCH


@pytest.mark.parametrize("overrides", [{"password": "hunter2"}, {"host": "x" * 300}, {"port": "eighty"},
                                       "hub-b", ["hub-b"], {"hosts": [1, None]}, {"ca_certs": "/nonexistent/ca.pem"}],
                         ids=["hostile-password", "oversized-host", "malformed-port", "a-string", "a-list",
                              "hosts-not-names", "missing-ca-file"])
@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_s13_a_record_with_refused_overrides_is_one_error_and_the_rest_is_cleared(registry, nodes, capsys,
                                                                                  overrides, dry_run):
    """A record edited by hand so its broker block is refused: `gc` (also `--dry-run`) and
    `gc --reclear` name the job on one ERROR line (never the password, a long value cut short),
    exit 1, and still clear every other job."""
    good, edited = ended_jobs(registry, None, None)
    path = registry.record_path(edited)
    path.write_text(json.dumps({**json.loads(path.read_text()), "broker": overrides}))
    runs = [lambda: gc.gc_cli(older_than_days=0, workspace=registry.root, dry_run=dry_run)]
    if not dry_run:
        runs.insert(0, lambda: gc.reclear_cli(workspace=registry.root))
    for run in runs:
        assert run() == 1
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and err.startswith(f"ERROR: job {edited} left alone: ") and len(err) < 200
        assert "hunter2" not in err + out and edited not in out and good in out
    assert {topic.split("/")[2] for n in nodes for topic, _, _ in n.cleared} == (set() if dry_run else {good})
