"""The hub queue, routing by labels and retries (PROTOCOL §14)
over a real broker, real runners and real `mam-orch dispatch` processes (each runs
the hub engine, or follows the one another dispatch runs).

- More jobs than slots with `--labels x --ack-timeout 5`: all complete, none
  `agent_blocked`, never more than `--max-jobs` agents at once on a runner,
  each job run exactly once.
- A runner killed with kill -9 (daemon, timer and agent: the host is gone)
  mid-job with `--retries 1`: `runner_lost`, attempt 2 on the other matching
  runner completes; attempt 1's late terminal is refused.
- Refusals: bad and oversized label lists on both CLIs (exit 64, one line,
  nothing registered); hostile presences on the wire (a waiting dispatch never
  dies); a label no runner has (a warning, then `queue_timeout`, exit 2).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness import runnersim
from harness.closes import idle_close_reason
from harness.runnersim import MAM_ORCH, MAM_RUNNER, hub_env, hub_workspace, orch, runner_log
from harness.waiting import PATIENCE_S, wait_until
from harness.workspace import clean_env

from mam.shared.config import dispatch_secret
from mam.shared.protocol import crypto, names, wire
from mam.shared.store.registry import Registry
from mam.shared.transport.mqtt import MqttClient

pytestmark = [pytest.mark.broker, pytest.mark.e2e]

JOBS = 30  # more than the 6 slots: the queue, not the runners, holds the rest
RUNNERS = ("qa", "qb", "qc")
SLOTS = 2
AGENT_S = 3
MARK = 'echo "{0} $MAM_JOB_ID $(date +%s%N)" >> "$MARKS"'
BRIEF = "\n".join([MARK.format("start"), f"sleep {AGENT_S}", MARK.format("end")]) + "\n"


def dispatch(hub: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*MAM_ORCH, "dispatch", *args, "--json", "--workspace", str(hub)], env=hub_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen[str], timeout_s: float = PATIENCE_S) -> tuple[int, str]:
    try:
        _out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _out, err = proc.communicate()
        raise AssertionError(f"dispatch did not end:\n{err}") from None
    return proc.returncode, err


def kill_tagged(tag: str) -> None:
    """SIGKILL every process carrying TEST_TAG=tag (a runner, its timers and agents)."""
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("TEST_TAG") == tag and proc.pid != os.getpid():
                proc.kill()
        except (psutil.Error, OSError):
            continue


def hub_records(hub: Path) -> list[dict]:
    registry = Registry(hub)
    return [registry.get(path.stem) for path in runnersim.job_records(hub)]


def overlap(intervals: list[tuple[int, int]]) -> int:
    """The most intervals open at one instant."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


class Runners:
    """Runners started by one test, each tagged TEST_TAG=<unique per test>-<session> (other runs
    of this file on the same machine use other tags: a teardown never kills their runners)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.run_id = secrets.token_hex(4)
        self.broker: Any = None
        self.started: list[subprocess.Popen[bytes]] = []

    def tag(self, session: str) -> str:
        return f"queue-{self.run_id}-{session}"

    def start(self, session: str, *args: str, **env: str) -> subprocess.Popen[bytes]:
        proc = runnersim.start_runner(self.broker, self.tmp_path / session, session, *args,
                                      TEST_TAG=self.tag(session), **env)
        self.started.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.started:
            try:
                proc.wait(PATIENCE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
        for session in RUNNERS:
            kill_tagged(self.tag(session))


@pytest.fixture
def runners(tmp_path):
    group = Runners(tmp_path)
    yield group
    group.close()


@pytest.mark.timeout(240)
def test_s14_more_jobs_than_slots_all_complete_once_never_over_max_jobs(nats_broker, runners, tmp_path):
    runners.broker = nats_broker
    start = runners.start
    hub = hub_workspace(nats_broker, tmp_path)
    marks = {session: tmp_path / f"{session}.marks" for session in RUNNERS}
    procs = [dispatch(hub, "--labels", "x", "--ack-timeout", "5", "--brief", BRIEF) for _ in range(JOBS)]
    # the runners come once every job waits: the ack clock of the first ones must not run while
    # 30 interpreters start on 2 cores (it starts at the publish, §14, but the runner needs CPU)
    wait_until(lambda: len([r for r in hub_records(hub) if r["status"] == "queued"]) == JOBS, 2 * PATIENCE_S,
               "every job queued")
    for session in RUNNERS:
        start(session, "--labels", "x,extra", "--max-jobs", str(SLOTS), MARKS=str(marks[session]))
    results = [finish(proc, 4 * PATIENCE_S) for proc in procs]
    assert [code for code, _ in results] == [0] * JOBS, "\n".join(err for code, err in results if code)
    records = hub_records(hub)
    assert len(records) == JOBS
    assert {(r["status"], r["attempt_id"], r["close_reason"]) for r in records} == {("completed", 1, None)}
    ran: dict[str, list[str]] = {}
    for session in RUNNERS:
        lines = [line.split() for line in marks[session].read_text().splitlines()] if marks[session].exists() else []
        starts = {job: int(stamp) for what, job, stamp in lines if what == "start"}
        ends = {job: int(stamp) for what, job, stamp in lines if what == "end"}
        assert len(starts) == len([1 for what, *_ in lines if what == "start"]), "a job started twice"
        assert overlap([(starts[job], ends[job]) for job in starts]) <= SLOTS, lines
        for job in starts:
            ran.setdefault(job, []).append(session)
            assert Registry(tmp_path / session).get(job)["status"] == "completed"
    assert sorted(ran) == sorted(r["job_id"] for r in records)
    assert all(len(where) == 1 for where in ran.values()), ran
    assert {r["session"] for r in records} <= set(RUNNERS)
    assert len({r["session"] for r in records}) == len(RUNNERS)  # spread over every matching runner
    for record in records:
        trail = Registry(hub).audit(record["job_id"])
        assert [(line["from"], line["to"], line["source"]) for line in trail if line["event"] == "status_changed"][:1] \
            == [("queued", "pending", "hub_queue")]


@pytest.mark.timeout(180)
def test_s14_kill9_runner_mid_job_retries_on_another_runner_late_attempt_refused(broker, runners, tmp_path):
    runners.broker = broker
    start = runners.start
    hub = hub_workspace(broker, tmp_path)
    for session in RUNNERS[:2]:
        start(session, "--labels", "x")
    job = dispatch(hub, "--labels", "x", "--retries", "1", "--heartbeat", "1", "--heartbeat-misses", "3",
                   "--ack-timeout", str(int(PATIENCE_S)), "--brief", "sleep 4\n")
    registry = Registry(hub)
    wait_until(lambda: [r for r in hub_records(hub) if r["status"] == "running"], PATIENCE_S, "attempt 1 running")
    (first,) = hub_records(hub)
    job_id, lost = first["job_id"], first["session"]
    other = next(session for session in RUNNERS[:2] if session != lost)
    kill_tagged(runners.tag(lost))  # the host is gone: daemon, heartbeat timer and agent
    wait_until(lambda: registry.get(job_id)["attempt_id"] == 2 and registry.get(job_id)["status"] == "running",
               PATIENCE_S, "attempt 2 running")
    # attempt 1's late terminal, from the dead runner's own registry: refused by the hub
    late = subprocess.run([*MAM_RUNNER, "publish", "--job", job_id, "--event", "completed", "--detail", "late",
                           "--workspace", str(tmp_path / lost)], env=clean_env(), capture_output=True, text=True,
                          timeout=PATIENCE_S)
    assert late.returncode == 0, late.stderr  # the dead runner's record knows nothing of attempt 2
    code, err = finish(job, 2 * PATIENCE_S)
    assert code == 0, err
    record = registry.get(job_id)
    assert (record["status"], record["attempt_id"], record["session"]) == ("completed", 2, other)
    reason = idle_close_reason(err, lost, job_id)  # runner_lost, unless its Will came late
    (history,) = record["attempt_history"]
    assert (history["attempt_id"], history["session"], history["close_reason"]) == (1, lost, reason), err
    trail = registry.audit(job_id)
    assert [(line["attempt_id"], line["reason"]) for line in trail if line["event"] == "retry"] == [(1, reason)]
    late_lines = [line for line in trail if line.get("event") == "completed" and line["data"]["attempt_id"] == 1]
    assert late_lines == []
    assert "retry 1 of 1: attempt 2 queued" in err
    shown = orch(hub, "show", job_id)
    attempts = json.loads(shown.stdout)["attempts"]
    assert [(a["attempt_id"], a["session"], a["outcome"]) for a in attempts] == [
        (1, lost, f"error ({reason})"), (2, other, "completed")]
    assert "took job" in runner_log(tmp_path / other)


def test_s14_bad_labels_refused_by_both_clis_one_line_nothing_registered(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    too_many = ",".join(f"l{n}" for n in range(17))
    for labels in ("GPU", "a,,b", too_many, "x" * 33):
        result = orch(hub, "dispatch", "--labels", labels, "--brief", "x")
        assert result.returncode == 64, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "is invalid" in result.stderr
        runner = subprocess.run([*MAM_RUNNER, "run", "--session", "r1", "--exec", "true", "--labels", labels,
                                 "--workspace", str(tmp_path / "r1")], env=clean_env(), capture_output=True,
                                text=True, timeout=PATIENCE_S)
        assert runner.returncode == 64, runner.stderr
        assert len(runner.stderr.strip().splitlines()) == 1 and "is invalid" in runner.stderr
    both = orch(hub, "dispatch", "--labels", "x", "--session", "s", "--brief", "x")
    assert both.returncode == 64 and "not both" in both.stderr
    assert orch(hub, "dispatch", "--labels", "x", "--retries", "11", "--brief", "x").returncode == 64
    assert orch(hub, "dispatch", "--labels", "x", "--retry-on", "sometimes", "--brief", "x").returncode == 64
    assert runnersim.job_records(hub) == []


@pytest.mark.timeout(120)
def test_s14_hostile_presence_never_kills_a_waiting_dispatch(broker, runners, tmp_path):
    runners.broker = broker
    start = runners.start
    hub = hub_workspace(broker, tmp_path)
    job = dispatch(hub, "--labels", "x", "--brief", "true\n")
    registry = Registry(hub)
    wait_until(lambda: [r for r in hub_records(hub) if r["status"] == "queued"], PATIENCE_S, "the job queued")
    keys = crypto.derive_keys(dispatch_secret(environ={}, workspace=hub))
    root = broker.topic_root
    hostile: list[bytes] = []  # retained, one topic each: the dispatch reads them whenever it subscribes
    for n, labels in enumerate((["X"], ["x"] * 17, ["x\n"], "x", [7], ["x" * 40])):
        doc = wire.Presence.build(f"evil{n}", "b" * 32, "online", host="h", version="1", max_jobs=1).to_dict()
        hostile.append(json.dumps(crypto.sign(dict(doc, labels=labels), keys.sign_key)).encode())
    hostile.append(b"\xff not json")
    doc = wire.Presence.build(f"evil{len(hostile)}", "b" * 32, "online", host="h", version="1", max_jobs=1,
                              labels=["x"]).to_dict()
    hostile.append(json.dumps(dict(doc, sig="0" * 64)).encode())  # matches, but does not verify: no candidate
    topics = [names.presence_topic(f"evil{n}", root) for n in range(len(hostile))]
    with MqttClient(broker.config(), "evil") as client:
        try:
            for topic, payload in zip(topics, hostile):
                client.publish(topic, payload, retain=True)
            assert job.poll() is None
            start("qa", "--labels", "x")
            code, err = finish(job)
        finally:
            for topic in topics:
                client.publish(topic, b"", retain=True)
    assert code == 0, err
    (record,) = hub_records(hub)
    assert (record["status"], record["session"]) == ("completed", "qa")
    assert err.count("refused presence") >= len(hostile) - 1  # the unsigned one is kept, unverified
    assert registry.get(record["job_id"])["attempt_id"] == 1


def test_s14_no_runner_has_the_labels_warning_then_queue_timeout_exit_2(broker, tmp_path):
    hub = hub_workspace(broker, tmp_path)
    required = orch(hub, "dispatch", "--labels", "nowhere", "--require-online", "--brief", "x")
    assert required.returncode == 5 and "no runner with labels=nowhere is online" in required.stderr
    assert hub_records(hub) == []
    result = orch(hub, "dispatch", "--labels", "nowhere", "--queue-timeout", "2", "--brief", "x")
    assert result.returncode == 2, result.stderr
    assert "WARNING: job" in result.stderr and "no runner has ever announced labels=nowhere" in result.stderr
    (record,) = hub_records(hub)
    assert (record["status"], record["close_reason"]) == ("error", "queue_timeout")
    trail = Registry(hub).audit(record["job_id"])
    assert [(line["from"], line["to"], line["source"]) for line in trail if line["event"] == "status_changed"] == [
        ("queued", "error", "hub_queue")]


@pytest.mark.timeout(180)
def test_s14_item6_a_runner_refusal_is_said_on_the_hub(nats_broker, tmp_path):
    """A runner that refuses an authentic dispatch says so in its signed
    presence (`last_refusal`), and the waiting `dispatch` prints it in one line. Here the
    runner was started in the hub's own workspace, so it refuses as `hub_record` (§5)."""
    hub = hub_workspace(nats_broker, tmp_path)
    runner = runnersim.start_runner(nats_broker, hub, "same-ws")
    try:
        code, err = finish(dispatch(hub, "--session", "same-ws", "--brief", "true", "--ack-timeout", "3"))
    finally:
        runner.terminate()
        runner.wait(timeout=PATIENCE_S)
    said = [line for line in err.splitlines() if "refused the dispatch" in line]
    assert len(said) == 1 and "runner same-ws" in said[0] and "hub_record" in said[0], err
    assert code == 1, err  # then the ack clock closes it agent_blocked, as before


def test_detach_on_a_job_that_stays_queued_returns_and_says_it_waits(nats_broker, tmp_path):
    """`dispatch --detach` to a label nobody serves does not block: the job id with
    `"action": "queued"`, why it waits, and (no `mam-orch serve` running) that nothing
    publishes it until one runs; the record stays `queued`."""
    hub = hub_workspace(nats_broker, tmp_path)
    done = orch(hub, "dispatch", "--labels", "nobody-has-it", "--brief", "x", "--detach", "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert (answer["status"], answer["action"]) == ("queued", "queued"), answer
    assert "stays queued; nothing publishes it until `mam-orch serve" in done.stderr, done.stderr
    assert f"mam-orch cancel {answer['job_id']} --workspace {hub}" in done.stderr
    assert Registry(hub).get(answer["job_id"])["status"] == "queued"


@pytest.mark.timeout(240)
def test_s14_a_group_of_limit_1_runs_its_jobs_one_after_another_in_submit_order(nats_broker, runners, tmp_path):
    """§14 Groups: three jobs of group `rel` on a runner with three free slots run one at a
    time, in the order they were submitted; one of another group runs beside them; the hub
    says why each waits."""
    runners.broker = nats_broker
    hub = hub_workspace(nats_broker, tmp_path)
    marks = tmp_path / "qa.marks"
    runners.start("qa", "--labels", "x", "--max-jobs", "4", MARKS=str(marks))
    gate = tmp_path / "gate"
    first = "\n".join([MARK.format("start"), f'while [ ! -e "{gate}" ]; do sleep 0.1; done', MARK.format("end")])
    brief = "\n".join([MARK.format("start"), "sleep 1", MARK.format("end")]) + "\n"
    opener = "\n".join([MARK.format("start"), f'touch "{gate}"', MARK.format("end")])  # only beside the first
    procs = []
    for n, text in enumerate([first, brief, brief]):
        procs.append(dispatch(hub, "--labels", "x", "--group", "rel", "--brief", text))
        wait_until(lambda: len(hub_records(hub)) == n + 1, PATIENCE_S, f"job {n + 1} registered")
    procs.append(dispatch(hub, "--labels", "x", "--group", "other", "--brief", opener))
    results = [finish(proc, 4 * PATIENCE_S) for proc in procs]
    assert [code for code, _ in results] == [0] * 4, "\n".join(err for code, err in results if code)
    records = sorted(hub_records(hub), key=lambda r: r["queued_at"])  # µs: the order they were submitted in
    rel = [r["job_id"] for r in records if r["group"] == "rel"]
    lines = [line.split() for line in marks.read_text().splitlines()]
    starts = {job: int(stamp) for what, job, stamp in lines if what == "start"}
    ends = {job: int(stamp) for what, job, stamp in lines if what == "end"}
    assert overlap([(starts[job], ends[job]) for job in rel]) == 1, lines  # never two of the group at once
    assert sorted(rel, key=starts.__getitem__) == rel  # in submit order
    other = next(r["job_id"] for r in records if r["group"] == "other")
    assert starts[rel[0]] < starts[other] < ends[rel[0]] <= starts[rel[1]]  # another group's job is not held up
    notes = [line.get("line", "") for line in Registry(hub).audit(rel[1]) if line.get("event") == "hub_note"]
    assert any(f"waiting for group rel (1 running: {rel[0]})" in note for note in notes), notes


@pytest.mark.timeout(240)
def test_s14_cancel_in_progress_cancels_the_groups_running_and_queued_jobs_and_runs(nats_broker, runners, tmp_path):
    """§14 Groups: job 1 of `rel` runs (until a file that never comes), job 2 waits for the
    group; job 3 `--cancel-in-progress` cancels both (exit 4, the agent stopped), then runs."""
    runners.broker = nats_broker
    hub = hub_workspace(nats_broker, tmp_path)
    marks = tmp_path / "qa.marks"
    runners.start("qa", "--labels", "x", "--max-jobs", "4", MARKS=str(marks))
    never = tmp_path / "never"
    stuck = "\n".join([MARK.format("start"), f'while [ ! -e "{never}" ]; do sleep 0.1; done'])
    first = dispatch(hub, "--labels", "x", "--group", "rel", "--brief", stuck)
    wait_until(lambda: marks.exists() and "start" in marks.read_text(), PATIENCE_S, "job 1 running")
    second = dispatch(hub, "--labels", "x", "--group", "rel", "--brief", "echo two")
    wait_until(lambda: len(hub_records(hub)) == 2, PATIENCE_S, "job 2 registered")
    third = dispatch(hub, "--labels", "x", "--group", "rel", "--cancel-in-progress", "--brief", "echo three")
    assert [finish(proc, 4 * PATIENCE_S)[0] for proc in (first, second, third)] == [4, 4, 0]
    records = sorted(hub_records(hub), key=lambda r: r["queued_at"])
    assert [r["status"] for r in records] == ["cancelled", "cancelled", "completed"]
    newest = records[2]["job_id"]
    for record in records[:2]:
        notes = [line.get("line", "") for line in Registry(hub).audit(record["job_id"])
                 if line.get("event") == "hub_note"]
        assert f"job {record['job_id']}: cancelled: job {newest} of group rel came with --cancel-in-progress" in notes
    assert Registry(tmp_path / "qa").get(records[0]["job_id"])["status"] == "cancelled"  # its runner stopped it


def test_s14_bad_group_terms_are_refused_in_one_line_and_nothing_is_registered(nats_broker, tmp_path):
    hub = hub_workspace(nats_broker, tmp_path)
    for args, said in ((["--group", "../x"], "--group '../x' is invalid"),
                       (["--group-limit", "2"], "goes with --group"),
                       (["--group", "rel", "--group-limit", "0"], "--group-limit 0")):
        done = orch(hub, "dispatch", "--labels", "x", "--brief", "x", *args)
        assert done.returncode == 64 and said in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert hub_records(hub) == []


@pytest.mark.timeout(240)
def test_s14_gpu_jobs_get_their_own_gpus_and_a_third_waits_for_a_free_one(nats_broker, runners, tmp_path):
    """§14 "GPUs": a stub `nvidia-smi` lists 2 GPUs; `--gpus auto` announces them (labels gpu,
    gpu:<model>); of 3 jobs `--gpus 1` two run at once with different CUDA_VISIBLE_DEVICES, the
    third waits "0 free GPUs" and runs once one ends; a job without --gpus sees none."""
    runners.broker = nats_broker
    hub = hub_workspace(nats_broker, tmp_path)
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "nvidia-smi").write_text("#!/bin/sh\nprintf '0, NVIDIA A100-SXM4-80GB, 81920 MiB\\n"
                                     "1, NVIDIA A100-SXM4-80GB, 81920 MiB\\n'\n")
    (stub / "nvidia-smi").chmod(0o755)
    marks = tmp_path / "qa.marks"
    runners.start("qa", "--gpus", "auto", "--max-jobs", "4", MARKS=str(marks),
                  PATH=f"{stub}:{os.environ.get('PATH', '')}")
    gate = tmp_path / "gate"
    brief = "\n".join(['echo "start $MAM_JOB_ID $(date +%s%N) [$CUDA_VISIBLE_DEVICES]" >> "$MARKS"',
                       f'while [ ! -e "{gate}" ]; do sleep 0.1; done',
                       'echo "end $MAM_JOB_ID $(date +%s%N) [$CUDA_VISIBLE_DEVICES]" >> "$MARKS"'])
    procs = []
    for n in range(3):
        procs.append(dispatch(hub, "--labels", "gpu:nvidia-a100-sxm4-80gb", "--gpus", "1", "--brief", brief))
        wait_until(lambda: len(hub_records(hub)) == n + 1, PATIENCE_S, f"job {n + 1} registered")
    wait_until(lambda: marks.exists() and marks.read_text().count("start") == 2, PATIENCE_S, "two GPU jobs running")
    records = sorted(hub_records(hub), key=lambda r: r["queued_at"])
    third = records[2]["job_id"]

    def notes() -> list[str]:
        return [line.get("line", "") for line in Registry(hub).audit(third) if line.get("event") == "hub_note"]

    wait_until(lambda: any("0 free GPUs; it needs 1" in note for note in notes()), PATIENCE_S, "why the third waits")
    plain = dispatch(hub, "--labels", "gpu", "--brief",
                     'echo "plain $MAM_JOB_ID 0 [$CUDA_VISIBLE_DEVICES]" >> "$MARKS"')
    assert finish(plain)[0] == 0  # a slot is free: it runs beside them, with no GPU
    gate.touch()
    results = [finish(proc) for proc in procs]
    assert [code for code, _ in results] == [0, 0, 0], "\n".join(err for code, err in results if code)
    lines = [line.split() for line in marks.read_text().splitlines()]
    devices = {job: dev for what, job, _, dev in lines if what == "start"}
    first_two = [r["job_id"] for r in records[:2]]
    assert sorted(devices[job] for job in first_two) == ["[0]", "[1]"], lines
    assert devices[third] in ("[0]", "[1]")
    assert next(dev for what, _, _, dev in lines if what == "plain") == "[]"
    ends = {job: int(stamp) for what, job, stamp, _ in lines if what == "end"}
    starts = {job: int(stamp) for what, job, stamp, _ in lines if what == "start"}
    assert starts[third] >= min(ends[job] for job in first_two)  # it waited for a GPU
    log = runnersim.runner_log(tmp_path / "qa")
    assert "gpus: 0, 1 (nvidia-a100-sxm4-80gb, from nvidia-smi)" in log


@pytest.mark.timeout(300)
def test_s14_a_hub_killed_while_a_group_runs_never_lets_the_group_over_its_limit(nats_broker, runners, tmp_path):
    """§14 Groups across a hub crash: three `rel` jobs (limit 1) on a 4-slot runner; `serve`
    is SIGKILLed while each one runs and started again. The restarted hub derives the group
    from the records: the next job waits, naming the running one, until it ended; they run
    one at a time, in submit order, and each once."""
    runners.broker = nats_broker
    hub = hub_workspace(nats_broker, tmp_path)
    marks = tmp_path / "qa.marks"
    runners.start("qa", "--labels", "x", "--max-jobs", "4", MARKS=str(marks))
    serve = runnersim.start_serve(hub)
    registry = Registry(hub)
    ids = []
    try:
        for n in range(3):
            brief = "\n".join([MARK.format("start"), f'while [ ! -e "{tmp_path}/gate{n}" ]; do sleep 0.1; done',
                               MARK.format("end")])
            done = orch(hub, "dispatch", "--labels", "x", "--group", "rel", "--heartbeat", "1", "--detach",
                        "--json", "--brief", brief)
            assert done.returncode == 0, done.stderr
            ids.append(json.loads(done.stdout)["job_id"])
        for n, job_id in enumerate(ids):
            wait_until(lambda: registry.get(job_id)["status"] == "running", PATIENCE_S, f"job {n + 1} running")
            serve.kill()  # SIGKILL: no clean stop, the lock goes with the process
            serve.wait(PATIENCE_S)
            seen = len(registry.audit(ids[-1]))
            serve = runnersim.start_serve(hub)
            if n + 1 < len(ids):
                waits = f"waiting for group rel (1 running: {job_id})"
                wait_until(lambda: any(waits in line.get("line", "") for line in registry.audit(ids[-1])[seen:]),
                           PATIENCE_S, "the restarted hub to say why the last job waits")
                assert [registry.get(j)["status"] for j in ids[n + 1:]] == ["queued"] * (len(ids) - n - 1)
            (tmp_path / f"gate{n}").touch()
        wait_until(lambda: all(registry.get(j)["status"] == "completed" for j in ids), PATIENCE_S, "all three")
    finally:
        serve.kill()
        serve.wait(PATIENCE_S)
    lines = [line.split() for line in marks.read_text().splitlines()]
    starts = {job: int(stamp) for what, job, stamp in lines if what == "start"}
    ends = {job: int(stamp) for what, job, stamp in lines if what == "end"}
    assert sorted(starts) == sorted(ids) and len(lines) == 2 * len(ids), lines  # each ran once
    assert overlap([(starts[job], ends[job]) for job in ids]) == 1, lines
    assert sorted(ids, key=starts.__getitem__) == ids
