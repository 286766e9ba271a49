"""`eagle3 serve` against a real Prefect API: a deployment per flow and for the pipeline, the
nightly cron and stage crons from the config, typed parameter forms; headless Chromium sees them
listed in the Prefect UI; a run triggered through the API is executed by the served runner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from flows.prefect_api import check_ui, deployment_ids
from storage.lineage import LineageStore

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`

ROOT = Path(__file__).resolve().parent.parent


def create_flow_run(api: str, deployment_id: str, tries: int = 5) -> dict:
    """What the UI's Run button asks. The local API server answers 5xx now and then when the machine
    is loaded (CI once got an error body with no `id` here, right after Chromium had loaded the UI), so
    a server error is asked again; any other error, or five server errors, fails with the answer."""
    for attempt in range(tries):
        r = httpx.post(f"{api}/deployments/{deployment_id}/create_flow_run", json={}, timeout=60)
        if r.status_code < 500:
            break
        time.sleep(2 * (attempt + 1))
    assert r.status_code == 201 and "id" in r.json(), f"create_flow_run answered {r.status_code}: {r.text[:2000]}"
    return r.json()


def test_serve_registers_schedules_shows_in_the_ui_and_runs_a_triggered_flow(prefect_api, tmp_path):
    records = tmp_path / "prompts.jsonl"
    records.write_text("".join(json.dumps({"prompt": f"Question {i}: how do rivers form deltas, case {i}?",
                                           "response": "They deposit sediment."}) + "\n" for i in range(6)))
    ws = tmp_path / "ws"
    config = tmp_path / "nightly.yaml"
    config.write_text(yaml.safe_dump({
        "workspace": str(ws),
        "discover": {"sources": [{"name": "local", "kind": "file", "path": str(records),
                                  "format": "prompt_response"}],
                     "decontaminate": {"humaneval": False}},
        "schedule": {"cron": "30 1 * * *", "timezone": "Europe/Paris", "stage_crons": {"discover": "0 */6 * * *"}},
    }))
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    serve = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "-c", str(config), "--name", "nightly"],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    api = prefect_api.rstrip("/")
    try:
        deadline = time.monotonic() + 120
        ids: dict[str, str] = {}
        while time.monotonic() < deadline:
            assert serve.poll() is None, serve.stdout.read()
            ids = deployment_ids(api, "nightly")
            if len(ids) == 3 and all(httpx.get(f"{api}/deployments/{i}", timeout=60).json().get("status") == "READY"
                                     for i in ids.values()):
                break
            time.sleep(0.5)
        # discover has a section; benchmark always has defaults; and the pipeline
        assert sorted(ids) == ["benchmark", "discover", "pipeline"]
        pipeline = httpx.get(f"{api}/deployments/{ids['pipeline']}").json()
        [sched] = pipeline["schedules"]
        assert sched["schedule"]["cron"] == "30 1 * * *" and sched["schedule"]["timezone"] == "Europe/Paris"
        assert sched["active"]
        discover = httpx.get(f"{api}/deployments/{ids['discover']}").json()
        assert discover["schedules"][0]["schedule"]["cron"] == "0 */6 * * *"
        assert httpx.get(f"{api}/deployments/{ids['benchmark']}").json()["schedules"] == []
        # the UI's run form is built from the typed parameters: the config model with its fields
        schema = pipeline["parameter_openapi_schema"]
        assert "config" in schema["properties"] and "PipelineConfig" in json.dumps(schema)
        assert pipeline["parameters"]["config"]["discover"]["sources"][0]["path"] == str(records)

        seen = check_ui(api, "nightly", tmp_path / "ui")
        assert seen["listed"] == seen["registered"] == ["benchmark", "discover", "pipeline"]
        assert {"Workspace", "Discover", "Sources"} <= set(seen["form_fields"])
        assert all(Path(p).stat().st_size > 10_000 for p in seen["screenshots"])

        # a run started from outside (as the UI's Run button does) is picked up by the served runner
        run = create_flow_run(api, ids["discover"])
        state = None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            r = httpx.get(f"{api}/flow_runs/{run['id']}", timeout=60)
            if r.status_code >= 500:  # the loaded local server again: ask on the next turn
                time.sleep(1)
                continue
            assert r.status_code == 200, f"reading the flow run answered {r.status_code}: {r.text[:2000]}"
            state = r.json()["state"]["type"]
            if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            time.sleep(1)
        assert state == "COMPLETED"
        counts = LineageStore(ws / "lineage.duckdb").discover.outcome_counts()
        assert sum(counts.values()) == 6 and counts["kept"] >= 1
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(timeout=30)
