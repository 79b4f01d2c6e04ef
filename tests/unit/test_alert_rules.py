"""deploy/prometheus/alerts.yml: the rules load (`promtool check rules`), fire and stay quiet
as alerts_test.yml says (`promtool test rules`); they and deploy/grafana/mam-fleet.json name
only metrics a hub's /metrics exports. promtool comes with Debian's `prometheus` package
(`make system-deps`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from harness.hubclient import RecordingClient
from harness.workspace import TEST_SECRET
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from mam.orchestrator.http import app as hubhttp
from mam.orchestrator.hub import open_hub
from mam.orchestrator.service import HubService
from mam.shared.config import write_env_file

pytestmark = pytest.mark.timeout(120)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is missing (Debian: apt-get install prometheus; `make system-deps` does it as root)")
    return subprocess.run([found, *args], cwd=RULES, capture_output=True, text=True, timeout=60)


def test_alert_rules_load_and_pass_their_unit_tests():
    checked = promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0 and "SUCCESS: 6 rules found" in checked.stdout, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "alerts_test.yml")
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_alert_rules_and_the_grafana_dashboard_name_only_metrics_the_hub_exports(tmp_path):
    write_env_file(tmp_path / ".mam.env", {"MAM_DISPATCH_SECRET": TEST_SECRET}, overwrite=True)
    service = HubService(open_hub(tmp_path))
    service.client = RecordingClient()  # type: ignore[assignment]
    text = TestClient(hubhttp.create_app(service)).get("/metrics").text
    exported = {name for family in text_string_to_metric_families(text)  # a counter's samples are <name>_total
                for name in (family.name, f"{family.name}_total" if family.type == "counter" else family.name)}
    used = set(re.findall(r"\bmam_[a-z_]+", (RULES / "alerts.yml").read_text()))
    assert used and used <= exported, sorted(used - exported)
    dashboard = json.loads((DEPLOY / "grafana" / "mam-fleet.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\bmam_[a-z_]+", expr)}
    assert len(exprs) >= 10 and used <= exported, sorted(used - exported)
