"""Jobs that run after jobs (PROTOCOL §14 "Dependencies"): the pure rule, the dispatch
checks (unknown ids, the job itself, cycles, malformed and oversized `--after`), the
record's `blocked` status and the engine releasing or failing a blocked job, also after
a restart."""

from __future__ import annotations

import json
import time

import pytest
from harness.hubclient import RecordingClient
from harness.workspace import TEST_SECRET

from mam.orchestrator import dependencies
from mam.orchestrator.control import cancel_queued
from mam.orchestrator.dependencies import GONE, Decision, check_after, decide, find_cycle, outcome
from mam.orchestrator.dispatch import parse_after, queue_terms
from mam.orchestrator.hub import open_hub
from mam.orchestrator.queuewait import close_queue_timeout, mark_published, requeue
from mam.orchestrator.service import HubService
from mam.shared.config import write_env_file
from mam.shared.protocol import names
from mam.shared.protocol.codes import JOB_STATUSES
from mam.shared.protocol.errors import UsageError
from mam.shared.store.records import MAX_AFTER, QueueTerms
from mam.shared.store.registry import Registry

pytestmark = pytest.mark.timeout(60)

A, B, C = "aaaaaaa1", "bbbbbbb2", "ccccccc3"


def test_s14_a_job_is_released_when_every_job_it_runs_after_completed():
    assert decide([A, B], "completed", {A: "completed", B: "completed"}).release
    waiting = decide([A, B], "completed", {A: "completed", B: None}, {B: "running"})
    assert not waiting.release and waiting.waiting == ((B, "running"),)


def test_s14_one_failed_dependency_fails_the_job_at_once_naming_it():
    decision = decide([A, B], "completed", {A: None, B: "error (exit 1)"})
    assert decision.failed == f"job {B} ended error (exit 1); --if completed needs it completed"
    assert not decision.release  # even though A still runs
    assert decide([A], "completed", {A: GONE}).failed == f"job {A} it runs after is gone from the registry"


def test_s14_if_ended_releases_whatever_the_outcome():
    assert decide([A, B], "ended", {A: "cancelled", B: "error (queue_timeout)"}).release
    assert decide([A], "ended", {A: GONE}).failed is not None  # a job that is gone never ended here


def test_s14_outcome_waits_for_a_retry_and_names_how_a_job_ended():
    assert outcome(None) == GONE
    assert outcome({"status": "running"}) is None
    retried = {"status": "error", "close_reason": "runner_lost", "retries": 1, "retried": 0,
               "retry_on": ["runner_lost"]}
    assert outcome(retried) is None  # its retry is queued next: not ended yet
    assert outcome({**retried, "retried": 1}) == "error (runner_lost)"
    assert outcome({"status": "error", "close_reason": None, "exit_code": 3}) == "error (exit 3)"
    assert outcome({"status": "completed", "exit_code": 0}) == "completed"
    assert outcome({"status": "cancelled", "close_reason": "cancelled"}) == "cancelled (cancelled)"


def test_s14_find_cycle_finds_loops_and_passes_diamonds():
    graph = {A: [B], B: [A], C: []}
    assert find_cycle(None, [A], lambda j: graph.get(j, [])) == [A, B, A]
    assert find_cycle(C, [C], lambda j: []) == [C, C]
    diamond = {A: [C], B: [C], C: []}
    assert find_cycle(None, [A, B], lambda j: diamond.get(j, [])) is None
    chain = {f"{i:08x}": [f"{i + 1:08x}"] for i in range(dependencies.MAX_WALK + 5)}
    assert find_cycle(None, ["00000000"], lambda j: chain.get(j, [])) is not None  # too long: refused


@pytest.mark.parametrize(("after", "after_if", "message"), [
    ("xyz", None, "'xyz' is invalid: expected job ids"),
    (f"{A},,{B}", None, "expected job ids separated by commas"),
    (f"{A},{A}", None, "names a job twice"),
    (",".join(f"{i:08x}" for i in range(MAX_AFTER + 1)), None, f"expected at most {MAX_AFTER}"),
    (f"{A}/../x", None, "is invalid"),
    (A, "maybe", "--if 'maybe' is invalid: expected one of completed, ended"),
    (None, "ended", "--if goes with --after ID"),
    ("a" * 100_000, None, "is invalid"),
])
def test_s14_bad_after_and_if_are_one_line_usage_errors(after, after_if, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        queue_terms("gpu-box", None, priority=0, queue_timeout_s=None, retries=0, retry_on=None, after=after,
                    after_if=after_if)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 200


def test_s14_parse_after_takes_spaces_around_ids():
    assert parse_after(f" {A} , {B}") == (A, B)


def test_s14_unknown_ids_the_job_itself_and_cycles_are_refused_at_dispatch(tmp_path):
    reg = Registry(tmp_path)
    first = reg.register(session=None, queue=QueueTerms(target_session="gpu-box"))["job_id"]
    second = reg.register(session=None, queue=QueueTerms(target_session="gpu-box", after=(first,)))["job_id"]
    check_after(reg, [first, second])  # both exist, no loop
    with pytest.raises(UsageError, match=f"--after {A}: no job {A} in this registry"):
        check_after(reg, [first, A])
    with pytest.raises(UsageError, match="is the job itself"):
        check_after(reg, [first], job_id=first)
    path = names.jobs_dir(tmp_path) / f"{first}.json"  # a hostile hand edit: first now waits on second
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "after": [second]}))
    with pytest.raises(UsageError, match=f"--after makes a cycle: {second} -> {first} -> {second}; nothing"):
        check_after(reg, [second])


def test_s14_a_job_with_after_is_registered_blocked_and_never_on_the_wire(tmp_path):
    reg = Registry(tmp_path)
    record = reg.register(session=None, queue=QueueTerms(target_session="gpu-box", after=(A,), after_if="ended"))
    assert (record["status"], record["after"], record["after_if"]) == ("blocked", [A], "ended")
    assert "queued_at" not in record  # its queue time starts when it is released
    assert "blocked" not in JOB_STATUSES and "queued" not in JOB_STATUSES
    cancelled, changed = cancel_queued(reg, record["job_id"], "operator")  # cancellable like a queued job
    assert changed and cancelled["status"] == "cancelled"


def _service(tmp_path) -> HubService:
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    service = HubService(open_hub(tmp_path))
    service.client = RecordingClient()  # type: ignore[assignment]
    return service


def _notes(reg: Registry, job_id: str) -> list[str]:
    return [line["line"] for line in reg.audit(job_id) if line["event"] == "hub_note"]


def _complete(reg: Registry, job_id: str) -> None:
    record = mark_published(reg, job_id, "gpu-box")
    for status in ("running", "completed"):
        reg.transition(job_id, status, source="publisher", attempt_id=1, dispatch_token=record["dispatch_token"],
                       exit_code=0 if status == "completed" else None)


def _look(service: HubService) -> None:
    service.scan(time.monotonic())
    service.release_blocked()


def test_s14_the_engine_fails_a_blocked_job_when_its_dependency_failed(tmp_path):
    reg = Registry(tmp_path)
    first = reg.register(session=None, queue=QueueTerms(target_session="gpu-box"))["job_id"]
    strict = reg.register(session=None, queue=QueueTerms(target_session="gpu-box", after=(first,)))["job_id"]
    lenient = reg.register(session=None, queue=QueueTerms(target_session="gpu-box", after=(first,),
                                                          after_if="ended"))["job_id"]
    service = _service(tmp_path)
    _look(service)
    assert set(service.blocked) == {strict, lenient} and strict not in service.queued
    assert _notes(reg, strict) == [f"job {strict}: blocked until job {first} (queued) ends"]
    close_queue_timeout(reg, first)
    _look(service)
    failed = reg.get(strict)
    assert (failed["status"], failed["close_reason"]) == ("error", "dependency_failed")
    assert _notes(reg, strict)[-1] == (f"WARNING: job {strict} closed: dependency_failed (job {first} ended "
                                       "error (queue_timeout); --if completed needs it completed)")
    assert reg.get(lenient)["status"] == "queued" and lenient in service.queued
    assert not service.blocked and not service.dependents


def test_s14_a_restarted_engine_releases_a_job_whose_dependency_completed_meanwhile(tmp_path):
    reg = Registry(tmp_path)
    first = reg.register(session=None, queue=QueueTerms(target_session="gpu-box"))["job_id"]
    second = reg.register(session=None, queue=QueueTerms(target_session="gpu-box", after=(first,)))["job_id"]
    _look(_service(tmp_path))  # the first engine saw it blocked, then stopped
    _complete(reg, first)
    service = _service(tmp_path)
    _look(service)
    released = reg.get(second)
    assert released["status"] == "queued" and released["queued_at"] == released["unblocked_at"]
    assert second in service.queued
    assert _notes(reg, second)[-1] == f"job {second}: every job it runs after ended ({first}); queued for " \
                                      "session=gpu-box"
    assert [(line["from"], line["to"]) for line in reg.audit(second) if line["event"] == "status_changed"] == [
        ("blocked", "queued")]


def test_s14_a_hand_edited_cycle_fails_the_blocked_job_rather_than_wait_forever(tmp_path):
    reg = Registry(tmp_path)
    first = reg.register(session=None, queue=QueueTerms(target_session="gpu-box"))["job_id"]
    second = reg.register(session=None, queue=QueueTerms(target_session="gpu-box", after=(first,)))["job_id"]
    path = names.jobs_dir(tmp_path) / f"{first}.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "status": "blocked", "after": [second]}))
    service = _service(tmp_path)
    _look(service)
    for job_id in (first, second):
        assert reg.get(job_id)["close_reason"] == "dependency_failed", job_id
    looped = [note for job_id in (first, second) for note in _notes(reg, job_id) if "wait on each other" in note]
    assert len(looped) == 1, looped
    assert f"{first} -> {second} -> {first}" in looped[0] or f"{second} -> {first} -> {second}" in looped[0]


def test_s14_decision_release_property():
    assert Decision().release and not Decision(failed="x").release and not Decision(waiting=((A, "queued"),)).release


def test_s14_the_brief_is_on_disk_before_the_record_exists_and_a_failed_write_registers_nothing(tmp_path):
    """A hub process killed between the two writes of `register_queued` must not leave a queued
    record without its brief (the next engine could only close it): the brief comes first."""
    from mam.orchestrator.dispatch import brief_path
    from mam.orchestrator.enqueue import register_queued
    from mam.shared.protocol.errors import RegistryError
    from mam.shared.store.registry import Contract

    reg = Registry(tmp_path)
    seen: list[tuple[bool, bool]] = []

    def prepare(job_id: str) -> None:
        seen.append((reg.record_path(job_id).exists(), reg.logs_dir(job_id).is_dir()))

    reg.register(session=None, queue=QueueTerms(target_session="gpu-box"), prepare=prepare)
    assert seen == [(False, True)]  # called before the record, once its folder exists

    def failing(job_id: str) -> None:
        raise RegistryError("disk full")

    with pytest.raises(RegistryError):
        reg.register(session=None, queue=QueueTerms(target_session="gpu-box"), prepare=failing)
    assert len(reg.list()[0]) == 1  # nothing registered
    record = register_queued(reg, brief="echo hi", contract=Contract(), terms=QueueTerms(target_session="gpu-box"))
    assert brief_path(reg, record["job_id"]).read_text() == "echo hi"


def test_s14_a_redispatched_job_that_failed_on_its_dependency_waits_for_it_again(tmp_path):
    """The dependent failed `dependency_failed`; the operator redispatches its dependency, then
    it: attempt 2 is `blocked` (not queued at once), waits while the dependency runs again, and
    is queued once it completed. Redispatched alone, with its dependency still failed, it fails
    again at once, naming it."""
    reg = Registry(tmp_path)
    first = reg.register(session=None, queue=QueueTerms(target_session="gpu-box"))["job_id"]
    second = reg.register(session=None, queue=QueueTerms(target_session="gpu-box", after=(first,)))["job_id"]
    service = _service(tmp_path)
    _look(service)
    close_queue_timeout(reg, first)
    _look(service)
    assert reg.get(second)["close_reason"] == "dependency_failed"
    again = requeue(reg, second)
    assert (again["status"], again["attempt_id"]) == ("blocked", 2) and "queued_at" not in again
    _look(service)
    assert (reg.get(second)["status"], reg.get(second)["close_reason"]) == ("error", "dependency_failed")
    requeue(reg, first)
    assert requeue(reg, second)["status"] == "blocked"
    _look(service)
    assert reg.get(second)["status"] == "blocked" and second in service.blocked
    record = mark_published(reg, first, "gpu-box")
    for status in ("running", "completed"):
        reg.transition(first, status, source="publisher", attempt_id=record["attempt_id"],
                       dispatch_token=record["dispatch_token"], exit_code=0 if status == "completed" else None)
    _look(service)
    released = reg.get(second)
    assert (released["status"], released["attempt_id"]) == ("queued", 3) and second in service.queued
