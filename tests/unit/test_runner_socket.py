"""The local publish socket's request rules (PROTOCOL §17) without a socket: the
server's `parse_request` and `handle` (the §8 checks, disk and outbox before the
answer) and the client's argv fast path, which hands anything unusual to typer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mam.runner import fastpath, localsock, publish
from mam.shared.protocol import names
from mam.shared.protocol.errors import UsageError
from mam.shared.store.registry import Contract, Registry

JOB = "918b0612"
TOKEN = "0123456789abcdef0123456789abcdef"
OTHER_TOKEN = "fedcba9876543210fedcba9876543210"
AUTH = "auth-token-for-the-unit-tests-0123456789"
GOOD = {"job_id": JOB, "attempt_id": 1, "dispatch_token": TOKEN, "event": "progress", "detail": "d",
        "data": {"tests": 3}}


def line(**fields: object) -> bytes:
    return json.dumps({**GOOD, **fields}).encode()


def server(root: Path, held: bool = True) -> localsock.PublishServer:
    registry = Registry(root)
    registry.mirror(job_id=JOB, session="gpu-box", attempt_id=1, dispatch_token=TOKEN, auth_token=AUTH,
                    contract=Contract())
    return localsock.PublishServer(registry, held=lambda job_id: held and job_id == JOB, send=lambda p: None)


def test_s17_socket_path_builders():
    assert names.runner_socket_path(Path("/w")) == Path("/w/.mam/run/runner.sock")
    assert names.run_dir(Path("/w")) == Path("/w/.mam/run")


def test_s17_parse_request_accepts_the_six_fields():
    request = localsock.parse_request(line())
    assert request == publish.PublishRequest(JOB, "progress", "d", {"tests": 3}, 1, TOKEN)


@pytest.mark.parametrize(("raw", "reason"), [
    (b"{oops", "not one line of UTF-8 JSON"),
    (b"\xff\xfe", "not one line of UTF-8 JSON"),
    (b"[]", "must be a JSON object"),
    (line(extra=1), "unknown request field(s): extra"),
    (line(attempt_id="1"), "'attempt_id' must be an integer"),
    (line(attempt_id=True), "'attempt_id' must be an integer"),
    (line(attempt_id=0), "attempt"),
    (line(data=[1]), "'data' must be a JSON object"),
    (line(detail=5), "'detail' must be a string"),
    (line(dispatch_token=""), "needs job_id, attempt_id, dispatch_token and event"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "event"}).encode(), "needs job_id"),
    (line(event="finished"), "event 'finished' is invalid"),
    (line(job_id="../../etc"), "job"),
    (line(dispatch_token="x" * 32), "token"),
    (line(data={"hmac_sig": "x"}), "reserved key"),
    (line(data={"x": "y" * (publish.MAX_DATA_BYTES + 1)}), "larger than"),
    (line(detail="a\x00b"), "detail"),
])
def test_s17_parse_request_refuses_bad_input_with_one_clear_reason(raw, reason):
    with pytest.raises(UsageError) as caught:
        localsock.parse_request(raw)
    assert reason in str(caught.value) and "\n" not in str(caught.value)


def test_s17_handle_writes_disk_and_outbox_before_answering_and_queues_the_send(tmp_path):
    srv = server(tmp_path)
    assert srv.handle(line()) == {"ok": True, "seq": 1}
    assert srv.handle(line(event="completed", data={})) == {"ok": True, "seq": 2}
    record = srv.registry.get(JOB)
    assert record["status"] == "completed" and record["last_seq"] == 2
    assert sorted(p.name for p in names.outbox_dir(tmp_path).iterdir()) == [f"{JOB}.1.1.json", f"{JOB}.1.2.json"]
    queued = [srv._outgoing.get_nowait(), srv._outgoing.get_nowait()]
    assert [p.seq for p in queued] == [1, 2] and queued[1].terminal


def test_s17_handle_refuses_a_wrong_token_an_unknown_job_and_after_terminal(tmp_path):
    srv = server(tmp_path)
    wrong = srv.handle(line(dispatch_token=OTHER_TOKEN))
    assert wrong["ok"] is False and "usage" not in wrong and wrong["reason"]
    unknown = srv.handle(line(job_id="0badc0de"))
    assert unknown == {"ok": False, "reason": "job 0badc0de is not running under this runner"}
    assert srv.handle(line(event="completed", data={}))["ok"] is True
    late = srv.handle(line())
    assert late["ok"] is False and late["reason"]
    assert srv.registry.get(JOB)["last_seq"] == 1  # nothing refused was written
    usage = srv.handle(b"nope")
    assert usage["usage"] is True


def test_s17_handle_refuses_every_job_when_none_is_held(tmp_path):
    srv = server(tmp_path, held=False)
    assert srv.handle(line())["ok"] is False
    assert not names.outbox_dir(tmp_path).exists() or not list(names.outbox_dir(tmp_path).iterdir())


ENV = {"MAM_ATTEMPT_ID": "1", "MAM_DISPATCH_TOKEN": TOKEN, "MAM_REAL_ROOT": "/w"}


def test_s17_fast_path_argv_with_the_agents_environment():
    parsed = fastpath.parse_argv(["publish", "--job", JOB, "--event=progress", "--data", '{"a": 1}',
                                  "--attempts", "2", "--workspace", "/w"], ENV)
    assert parsed == {"job_id": JOB, "attempt_id": 1, "dispatch_token": TOKEN, "event": "progress", "detail": "",
                      "data": {"a": 1}, "_root": "/w"}


@pytest.mark.parametrize("argv", [
    ["run", "--job", JOB, "--event", "progress"],
    ["publish", "--job", JOB, "--event", "started", "--heartbeat", "5"],  # starts a timer: typer's path
    ["publish", "--help"],
    ["publish", "--job", JOB],
    ["publish", "--job", JOB, "--event"],
    ["publish", "--job", JOB, "--event", "progress", "--attempts", "0"],
    ["publish", "--job", JOB, "--event", "progress", "--attempts", "x"],
    ["publish", "--job", JOB, "--event", "progress", "--data", "{bad"],
    ["publish", "--job", JOB, "--event", "progress", "--data", "[1]"],
    ["publish", "--job", JOB, "--event", "progress", "--attempt-id", "one"],
])
def test_s17_fast_path_leaves_unusual_argv_to_typer(argv):
    assert fastpath.parse_argv(argv, ENV) is None


def test_s17_fast_path_needs_the_socket_the_identity_and_the_daemons_workspace(tmp_path):
    argv = ["publish", "--job", JOB, "--event", "progress"]
    assert fastpath.try_publish(argv, ENV) is None  # no MAM_RUNNER_SOCKET
    sock = str(names.runner_socket_path(tmp_path))
    env = {**ENV, "MAM_REAL_ROOT": str(tmp_path), fastpath.SOCKET_ENV: sock}
    assert fastpath.parse_argv(argv, {k: v for k, v in env.items() if k != "MAM_DISPATCH_TOKEN"}) is None
    assert fastpath.try_publish([*argv, "--workspace", "/elsewhere"], env) is None  # not the daemon's workspace
    assert fastpath.try_publish(argv, env) is None  # ENOENT: v1


def test_s17_long_socket_paths_go_through_proc_fd(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    address, fd = fastpath.unix_address(deep / "runner.sock")
    try:
        assert fd is not None and address == f"/proc/self/fd/{fd}/runner.sock"
    finally:
        if fd is not None:
            os.close(fd)
    assert fastpath.unix_address(Path("/w/.mam/run/runner.sock")) == ("/w/.mam/run/runner.sock", None)
