"""MLflow's own UI in a real headless browser: our experiment opens on its runs table, the stage runs nested under the
flow run's parent run (issue 16). A real `mlflow server` on its own SQLite store, stopped by its pid; Debian's
Chromium."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlhf_pipeline.deployments.local import wait_until_up
from rlhf_pipeline.tasks.store.resources import free_port
from rlhf_pipeline.tasks.tracking import client as tracking
from tests.browser import alive, chromium

pytestmark = pytest.mark.e2e  # a server and a browser: tens of seconds
STAGES = ("data", "sft", "rm", "dpo", "eval")


def test_our_experiment_opens_on_the_runs_table_with_the_stage_runs_nested_under_the_parent(
    tmp_path, monkeypatch, screenshots
):
    from playwright.sync_api import expect

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = tracking.experiment_id("rlhf-ui")  # as a flow run makes it: a parent run, one child per stage
    parent = tracking.start_run(experiment, "rlhf-flow-run", {"rlhf.algorithm": "dpo"})
    for stage in STAGES:
        child = tracking.start_run(experiment, stage, {"rlhf.stage": stage}, parent)
        tracking.log_metrics(child, {f"{stage}/train/loss": 0.5})
        tracking.end_run(child)
    tracking.end_run(parent)

    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            tracking.tracking_uri(),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until_up(f"http://127.0.0.1:{port}/health", server)
        with chromium(screenshots / "mlflow_runs_failed.png", height=900) as browser:
            page = browser.page
            page.goto(tracking.experiment_url(experiment, f"http://127.0.0.1:{port}"))
            # The training view's runs table, not GenAI's overview of traces.
            expect(page.get_by_role("columnheader", name="Run Name", exact=True).first).to_be_visible()
            expect(page.get_by_role("link", name="rlhf-flow-run", exact=True)).to_be_visible()
            expect(page.get_by_text("matching runs")).to_contain_text("6")
            for stage in STAGES:  # nested: hidden until the parent row is expanded
                expect(page.get_by_role("link", name=stage, exact=True)).to_have_count(0)
            page.get_by_role("gridcell").filter(has_text="rlhf-flow-run").get_by_role("button").click()  # its expander
            for stage in STAGES:
                expect(page.get_by_role("link", name=stage, exact=True)).to_be_visible()
            page.screenshot(path=screenshots / "mlflow_runs.png", full_page=True)
    finally:
        os.killpg(server.pid, 15)
        server.wait(30)
    assert not alive(server.pid)
