"""The dashboard of `mam-orch serve --http` in a real browser: Debian's
chromium driven by Playwright. Broker, service and two runners are real processes; the page
shows both runners, a job dispatched through the API goes queued → running → completed on
the page without a reload, and its output tail grows live; a result that lands after its end
shows on its page as a diffstat with the patch to download (§18). Screenshots are saved under the
test's tmp dir (MAM_DASHBOARD_SCREENSHOTS=DIR also writes the main page as dashboard.png and a
job page as dashboard-job.png there: `MAM_DASHBOARD_SCREENSHOTS=docs make test` refreshes docs/).

The hub's copy of the agent output (§15, `.mam/logs/<id>/agent.<attempt>.log`) is written
here by the test while the job runs, standing in for the hub's log writer."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from harness.httpserve import Serve, gated
from harness.results import PATCH, deliver_result
from harness.runnersim import ask_step, hub_workspace, runner_log, start_runner
from harness.waiting import PATIENCE_S, wait_until

from mam.orchestrator import schedules
from mam.orchestrator.identity import roster
from mam.orchestrator.queuewait import close_queue_timeout
from mam.shared.protocol import names
from mam.shared.protocol.crypto.keys import EnrolRequest
from mam.shared.store import keyfiles
from mam.shared.store.records import QueueTerms
from mam.shared.store.registry import Registry

pytestmark = [pytest.mark.broker, pytest.mark.e2e, pytest.mark.timeout(180)]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1280, "height": 860}
WAIT_MS = int(PATIENCE_S * 1000)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed (test extra)")


def browser_missing() -> str | None:
    if not os.access(CHROMIUM, os.X_OK):
        return f"no browser: {CHROMIUM} is missing (`make system-deps` as root installs Debian's chromium)"
    return None


@contextmanager
def dashboard(tmp_path: Path, url: str) -> Iterator[tuple[Any, list[str]]]:
    """The dashboard at `url` in headless Chromium: (its page, the script errors it raised)."""
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport=VIEWPORT)
        try:
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.set_default_timeout(WAIT_MS)
            page.goto(url + "/")
            yield page, errors
        finally:
            context.close()


def row_of(page, table: str, job_id: str):
    return page.locator(f"#{table} tbody tr", has_text=job_id)


def test_dashboard_shows_runners_and_a_job_queued_running_completed_live(nats_broker, tmp_path):
    if (why := browser_missing()) is not None:
        pytest.skip(why)
    hub = hub_workspace(nats_broker, tmp_path)
    runners = [start_runner(nats_broker, tmp_path / "gpu", "gpu-box", "--labels", "gpu,linux"),
               start_runner(nats_broker, tmp_path / "cpu", "cpu-box", "--labels", "linux")]
    serve = Serve(hub)
    with dashboard(tmp_path, serve.url) as (page, errors):
        try:
            page.evaluate("window.__sameDocument = true")  # gone if the page ever reloads
            for session in ("gpu-box", "cpu-box"):
                sync_api.expect(page.locator("#runners tbody tr", has_text=session)).to_contain_text("online")
            made = keyfiles.create_runner_keys(tmp_path / "old")  # §16.7: a revoked runner is shown, and when
            roster.add(hub, EnrolRequest.build("old-box", "gpu", made.ed25519_public, made.x25519_public))
            revoked_at = roster.revoke(hub, "old-box").revoked_at
            sync_api.expect(page.locator("#runners tbody tr", has_text="old-box")).to_contain_text(
                f"revoked {revoked_at}")
            sync_api.expect(page.locator("#runners tbody tr", has_text="gpu-box")).to_contain_text("0 / 1")
            schedules.add(hub, "nightly", cron="0 3 * * *", tz="Europe/Berlin", overlap="skip", catch_up=1,
                          params={"labels": "gpu", "brief": "Update the dependencies"})  # §14 Schedules, live
            nightly = page.locator("#schedules tbody tr", has_text="nightly")
            sync_api.expect(nightly).to_contain_text("0 3 * * * (Europe/Berlin)")
            sync_api.expect(nightly).to_contain_text("Update the dependencies")

            busy = serve.dispatch(gated(tmp_path, "go-1"), session="gpu-box")
            sync_api.expect(row_of(page, "running", busy)).to_contain_text("running")
            spent = json.dumps({"agent": {"kind": "claude", "session_id": "s-1", "turns": 3, "cost_usd": 0.25,
                                          "tokens": {"input": 10, "output": 20, "cached": 5}}})
            job_id = serve.dispatch("echo dashboard-output\n" + gated(tmp_path, "go-2") + f"\nSPENT='{spent}'\n"
                                    'eval "$MAM_PUBLISH_CMD --event completed --data \\"\\$SPENT\\""\n',
                                    labels=["gpu"], group="nightly")
            queued = row_of(page, "queue", job_id)
            sync_api.expect(queued).to_contain_text("0 free slots")  # queued behind the busy job, and why
            sync_api.expect(queued).to_contain_text("labels=gpu · group nightly")  # §14 Groups
            page.screenshot(path=str(tmp_path / "dashboard-queued.png"), full_page=True)
            (tmp_path / "go-1").touch()
            sync_api.expect(row_of(page, "running", job_id)).to_contain_text("running")
            sync_api.expect(queued).to_have_count(0)

            page.locator(f"#running a:text('{job_id}')").click()  # the job page: a hash change, no reload
            sync_api.expect(page.locator("#job-status")).to_have_text("running")
            log_path = names.hub_log_path(hub, job_id, 1)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as log:
                log.write(b"dashboard-output\nstep two of the agent\n")
            sync_api.expect(page.locator("#log")).to_contain_text("step two of the agent")
            (tmp_path / "go-2").touch()
            sync_api.expect(page.locator("#job-status")).to_have_text("completed")
            sync_api.expect(page.locator("#events tbody")).to_contain_text("completed")
            sync_api.expect(page.locator("#job-facts")).to_contain_text(  # what the agent spent (§18)
                "claude: 3 turns · 10 in / 20 out / 5 cached tokens · $0.2500 · session s-1")

            # §18: a result lands after the end; the job page asks for it and offers the patch
            sync_api.expect(page.locator("#change-section")).to_be_hidden()
            deliver_result(Registry(hub), job_id, tmp_path / "result", artifacts={"report.txt": b"all green\n"},
                           transcript=("s-1", b'{"type":"user"}\n'))
            page.evaluate("location.hash = ''")
            page.evaluate(f"location.hash = '#job/{job_id}'")
            sync_api.expect(page.locator("#change-facts")).to_contain_text("1 files +1 −0")
            sync_api.expect(page.locator("#change tbody")).to_contain_text("NOTES.md")
            href = page.locator("#patch-link").get_attribute("href")
            assert page.evaluate(f"fetch({href!r}).then((r) => r.text())") == PATCH.decode()
            href = page.locator("#transcript-link").get_attribute("href")  # the agent's conversation (§18)
            assert page.evaluate(f"fetch({href!r}).then((r) => r.text())") == '{"type":"user"}\n'
            artifact = page.locator("#artifacts a", has_text="report.txt")  # the agent's file, downloadable
            href = artifact.get_attribute("href")
            assert page.evaluate(f"fetch({href!r}).then((r) => r.text())") == "all green\n"
            page.screenshot(path=str(tmp_path / "dashboard-job.png"), full_page=True)

            page.evaluate("location.hash = ''")
            sync_api.expect(row_of(page, "recent", job_id)).to_contain_text("completed")
            assert page.evaluate("window.__sameDocument") is True
            assert errors == []  # no script error on the page
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            target = os.environ.get("MAM_DASHBOARD_SCREENSHOTS")
            if target:
                shutil.copyfile(tmp_path / "dashboard-queued.png", Path(target) / "dashboard.png")
                shutil.copyfile(tmp_path / "dashboard-job.png", Path(target) / "dashboard-job.png")
        finally:
            assert serve.stop() == 0, serve.log()
            for proc in runners:
                proc.terminate()
                proc.wait(PATIENCE_S)


def test_dashboard_approve_and_deny_answer_the_waiting_agent_without_a_reload(nats_broker, tmp_path):
    """§19 in the browser: the agent's request appears under "Waiting for you" without a
    reload; Approve reaches the agent; a typed reason and Deny reach it too; the panel empties."""
    if (why := browser_missing()) is not None:
        pytest.skip(why)
    hub = hub_workspace(nats_broker, tmp_path)
    out = tmp_path / "out"
    runner = start_runner(nats_broker, tmp_path / "gpu", "gpu-box", OUT=str(out))
    steps = [ask_step(1, "Bash", {"command": "git push origin main"}),
             ask_step(2, "Write", {"file_path": "notes.md", "content": "x"})]
    serve = Serve(hub)
    with dashboard(tmp_path, serve.url) as (page, errors):
        try:
            page.evaluate("window.__sameDocument = true")
            sync_api.expect(page.locator("#asks-section")).to_be_hidden()
            job_id = serve.dispatch("\n".join(steps), session="gpu-box")
            first = page.locator("#asks tbody tr", has_text="git push origin main")
            sync_api.expect(first).to_contain_text(job_id)
            sync_api.expect(row_of(page, "running", job_id)).to_contain_text("waiting for approval")
            page.screenshot(path=str(tmp_path / "dashboard-asks.png"), full_page=True)
            first.locator("button[data-verb=approve]").click()
            second = page.locator("#asks tbody tr", has_text="notes.md")
            sync_api.expect(second).to_contain_text("Write")
            second.locator("input").fill("not in this repository")
            second.locator("button[data-verb=deny]").click()
            sync_api.expect(page.locator("#asks-section")).to_be_hidden()
            sync_api.expect(row_of(page, "recent", job_id)).to_contain_text("completed")  # both were answered
            answers = []
            for n in (1, 2):
                given, rc = Path(f"{out}.{n}").read_text().splitlines()
                answers.append((json.loads(given)["behavior"], json.loads(given)["message"], rc))
            assert answers[0][0] == "allow" and answers[0][2] == "rc=0"
            assert answers[1] == ("deny", "not in this repository", "rc=1")
            assert page.evaluate("window.__sameDocument") is True
            assert errors == []
        finally:
            assert serve.stop() == 0, serve.log()
            runner.terminate()
            runner.wait(PATIENCE_S)


def test_dashboard_cancel_and_retry_a_job_from_its_page(nats_broker, tmp_path):
    """The job's title in the running list and on its page; the page's Cancel stops the running
    job (`mam-orch cancel` on the service) and its Retry queues attempt 2 (`redispatch`), which
    runs and completes; no reload, no script error."""
    if (why := browser_missing()) is not None:
        pytest.skip(why)
    hub = hub_workspace(nats_broker, tmp_path)
    runner = start_runner(nats_broker, tmp_path / "gpu", "gpu-box")
    serve = Serve(hub)
    with dashboard(tmp_path, serve.url) as (page, errors):
        try:
            page.on("dialog", lambda dialog: dialog.accept())  # "Cancel job …?" / "Retry job …?"
            page.evaluate("window.__sameDocument = true")
            job_id = serve.dispatch(gated(tmp_path, "go"), session="gpu-box", title="nightly build")
            sync_api.expect(row_of(page, "running", job_id)).to_contain_text("nightly build")
            page.evaluate(f"location.hash = '#job/{job_id}'")
            sync_api.expect(page.locator("#job-title")).to_have_text("nightly build")
            sync_api.expect(page.locator("#job-status")).to_have_text("running")
            sync_api.expect(page.locator("#job-retry")).to_be_hidden()
            page.locator("#job-cancel").click()
            sync_api.expect(page.locator("#job-status")).to_have_text("cancelled")
            sync_api.expect(page.locator("#job-cancel")).to_be_hidden()
            page.locator("#job-retry").click()
            sync_api.expect(page.locator("#job-facts")).to_contain_text("attempt 2")
            sync_api.expect(page.locator("#job-status")).to_have_text("running")
            (tmp_path / "go").touch()
            sync_api.expect(page.locator("#job-status")).to_have_text("completed")
            sync_api.expect(page.locator("#job-retry")).to_be_hidden()  # a completed job is never retried
            sync_api.expect(page.locator("#attempts tbody tr")).to_have_count(2)
            heads = page.locator("#events tbody tr.attempt-head")  # the events grouped by attempt
            sync_api.expect(heads).to_have_count(2)
            sync_api.expect(heads.nth(0)).to_contain_text("attempt 1 · runner gpu-box")
            sync_api.expect(heads.nth(1)).to_contain_text("attempt 2 · runner gpu-box")
            record = Registry(hub).get(job_id)
            assert (record["status"], record["attempt_id"]) == ("completed", 2)
            assert page.evaluate("window.__sameDocument") is True and errors == []
        finally:
            assert serve.stop() == 0, serve.log()
            runner.terminate()
            runner.wait(PATIENCE_S)


def test_dashboard_filters_and_pages_the_ended_jobs(nats_broker, tmp_path):
    """120 ended jobs (error or completed, two runners, a few for label `arm` that nobody
    served): "Recent" pages them 50 at a time, newest first, and filters them by status,
    runner, label and a search in titles, without a reload or a script error."""
    if (why := browser_missing()) is not None:
        pytest.skip(why)
    hub = hub_workspace(nats_broker, tmp_path)
    registry = Registry(hub)
    for i in range(117):
        record = registry.register(session="gpu-box" if i % 2 else "cpu-box",
                                   title=("nightly " if i % 10 == 0 else "build ") + str(i))
        if i % 3 == 0:
            registry.close(record["job_id"], "agent_blocked")
        else:
            ident = {"attempt_id": 1, "dispatch_token": record["dispatch_token"]}
            registry.transition(record["job_id"], "running", source="runner", **ident)
            registry.transition(record["job_id"], "completed", source="runner", exit_code=0, **ident)
    for _ in range(3):
        unserved = registry.register(session=None, queue=QueueTerms(target_labels=["arm"]))
        close_queue_timeout(registry, unserved["job_id"])
    serve = Serve(hub)
    with dashboard(tmp_path, serve.url) as (page, errors):
        try:
            recent = page.locator("#recent tbody tr")
            note = page.locator("#page-note")
            sync_api.expect(note).to_have_text("1–50 of 120")
            sync_api.expect(recent).to_have_count(50)
            page.locator("#page-next").click()
            page.locator("#page-next").click()
            sync_api.expect(note).to_have_text("101–120 of 120")
            sync_api.expect(page.locator("#page-next")).to_be_disabled()
            page.locator("#f-status").select_option("error")  # 39 agent_blocked + 3 queue_timeout
            sync_api.expect(note).to_have_text("1–42 of 42")
            page.locator("#f-runner").select_option("cpu-box")  # the even ones of the 39
            sync_api.expect(note).to_have_text("1–20 of 20")
            page.locator("#f-runner").select_option("")
            page.locator("#f-label").fill("arm")
            sync_api.expect(recent).to_have_count(3)
            page.locator("#f-label").fill("")
            page.locator("#f-status").select_option("")
            page.locator("#f-text").fill("NIGHTLY")
            sync_api.expect(recent).to_have_count(12)
            assert all("nightly " in text for text in recent.all_inner_texts())
            page.locator("#f-text").fill("no such title")
            sync_api.expect(recent).to_have_text(["no ended job matches"])
            assert errors == []
        finally:
            assert serve.stop() == 0, serve.log()


def test_dashboard_drain_and_undrain_a_runner_from_the_page(nats_broker, tmp_path):
    """Drain on a runner's row: the hub's signed order reaches the real runner, which shows
    `draining` and takes no new job (a job for it stays queued, saying why); Undrain takes it
    back and the job runs (§7 "Drain from the hub")."""
    if (why := browser_missing()) is not None:
        pytest.skip(why)
    hub = hub_workspace(nats_broker, tmp_path)
    runner = start_runner(nats_broker, tmp_path / "gpu", "gpu-box")
    serve = Serve(hub)
    with dashboard(tmp_path, serve.url) as (page, errors):
        try:
            page.on("dialog", lambda dialog: dialog.accept())  # "Drain runner gpu-box?"
            runner_row = page.locator("#runners tbody tr", has_text="gpu-box")
            sync_api.expect(runner_row).to_contain_text("online")
            runner_row.locator("button[data-verb=drain]").click()
            sync_api.expect(runner_row).to_contain_text("draining")  # at once: the order's answer line
            wait_until(lambda: [r["status"] for r in serve.http.get("/api/runners").json()["runners"]] == ["draining"],
                       PATIENCE_S, "the runner's draining presence at the hub")  # then a job is not placed on it
            sync_api.expect(runner_row.locator(".draining")).to_have_count(1)  # its status badge
            job_id = serve.dispatch("true\n", session="gpu-box")
            sync_api.expect(row_of(page, "queue", job_id)).to_contain_text("draining")
            assert serve.status(job_id) == "queued"
            runner_row.locator("button[data-verb=undrain]").click()
            sync_api.expect(runner_row).to_contain_text("online")
            sync_api.expect(row_of(page, "recent", job_id)).to_contain_text("completed")
            assert "drained by the hub" in runner_log(tmp_path / "gpu")
            assert errors == []
        finally:
            assert serve.stop() == 0, serve.log()
            runner.terminate()
            runner.wait(PATIENCE_S)


def test_dashboard_shows_each_output_line_exactly_once_across_reloads_of_the_page_and_the_stream(
        nats_broker, tmp_path):
    """The job page's output while lines keep coming (§15): the first read and the live chunks
    overlap, the page leaves and comes back, the browser goes offline and the event stream
    reconnects (missing chunks meanwhile); the page shows the hub's copy exactly, each line once."""
    if (why := browser_missing()) is not None:
        pytest.skip(why)
    hub = hub_workspace(nats_broker, tmp_path)
    runner = start_runner(nats_broker, tmp_path / "gpu", "gpu-box")
    serve = Serve(hub)
    with dashboard(tmp_path, serve.url) as (page, errors):
        try:
            job_id = serve.dispatch(gated(tmp_path, "go"), session="gpu-box")
            page.evaluate(f"location.hash = '#job/{job_id}'")
            sync_api.expect(page.locator("#job-status")).to_have_text("running")
            log_path = names.hub_log_path(hub, job_id, 1)
            log_path.parent.mkdir(parents=True, exist_ok=True)

            def shown() -> str:
                return str(page.evaluate("document.getElementById('log').textContent"))

            def write(start: int) -> None:
                for n in range(start, start + 5):
                    with open(log_path, "ab") as log:
                        log.write(f"line-{n:03d}\n".encode())

            for round_ in range(6):
                write(round_ * 10)
                if round_ % 2 == 0:  # away and back: the page reads the copy again while chunks arrive
                    page.evaluate("location.hash = ''")
                    write(round_ * 10 + 5)
                    page.evaluate(f"location.hash = '#job/{job_id}'")
                else:  # the stream drops and reconnects: chunks sent meanwhile never reach the page
                    page.context.set_offline(True)
                    write(round_ * 10 + 5)
                    page.context.set_offline(False)
                wait_until(lambda: shown() == log_path.read_text(), what="the page to show the hub's copy")
            lines = shown().splitlines()
            assert len(lines) == len(set(lines)) and sum(line.startswith("line-") for line in lines) == 60, lines
            assert errors == []
        finally:
            (tmp_path / "go").touch()
            assert serve.stop() == 0, serve.log()
            runner.terminate()
            runner.wait(PATIENCE_S)
