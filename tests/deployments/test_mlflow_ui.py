"""MLflow's own UI in a real headless browser: our experiment opens on its runs table, the stage runs nested under the
flow run's parent run (issue 16). A real `mlflow server` on its own SQLite store, stopped by its pid; Debian's
Chromium."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from rlhf_pipeline.deployments.local import MLFLOW_NO_JOBS, mlflow_server, wait_until_up
from rlhf_pipeline.tasks.store.resources import free_port
from rlhf_pipeline.tasks.tracking import client as tracking
from tests.browser import alive, chromium

pytestmark = pytest.mark.slow  # a server and a browser: tens of seconds
STAGES = ("data", "sft", "rm", "dpo", "eval")


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """One `rlhf up` MLflow server for the module, on the module's state folder and store (each test its own
    experiment): its URL, port and log."""
    home = tmp_path_factory.mktemp("mlflow-ui")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(tracking.STATE_ENV, str(home / "state"))
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'state' / 'mlflow.db'}")
        port = free_port()
        with served(port, home / "mlflow.log") as url:
            yield {"url": url, "port": port, "log": home / "mlflow.log"}


def test_our_experiment_opens_on_the_runs_table_with_the_stage_runs_nested_under_the_parent(ui, screenshots):
    from playwright.sync_api import expect

    experiment = tracking.experiment_id("rlhf-ui")  # as a flow run makes it: a parent run, one child per stage
    parent = tracking.start_run(experiment, "rlhf-flow-run", {"rlhf.algorithm": "dpo"})
    for stage in STAGES:
        child = tracking.start_run(experiment, stage, {"rlhf.stage": stage}, parent)
        tracking.log_metrics(child, {f"{stage}/train/loss": 0.5})
        tracking.end_run(child)
    tracking.end_run(parent)

    with chromium(screenshots / "mlflow_runs_failed.png", height=900) as browser:
        page = browser.page
        page.goto(tracking.experiment_url(experiment, ui["url"]))
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


@contextlib.contextmanager
def served(port: int, log: Path):
    """`rlhf up`'s MLflow server (`deployments.local.mlflow_server`) on the test's store, its output in `log`, stopped
    by its pid."""
    with open(log, "w") as out:
        server = subprocess.Popen(
            mlflow_server(port),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**MLFLOW_NO_JOBS, **os.environ},  # as `rlhf up` starts it: no job runner
        )
    try:
        wait_until_up(f"http://127.0.0.1:{port}/health", server)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, 15)
        server.wait(30)
    assert not alive(server.pid)


def test_a_registered_policy_page_says_registered_and_its_version_shows_the_card_with_few_tags(
    ui, tmp_path, screenshots
):
    from mlflow.tracking import MlflowClient
    from playwright.sync_api import expect

    from rlhf_pipeline.tasks.gate import RegistryConfig
    from rlhf_pipeline.tasks.registry import register_policy
    from rlhf_pipeline.tasks.store.artifacts import RunContext
    from rlhf_pipeline.tasks.tracking.lineage import card_text
    from tests.tasks.test_registry import MEASURED, publish

    experiment = tracking.experiment_id("rlhf-registry")
    ctx = RunContext(artifact_root=str(tmp_path / "artifacts"), experiment_id=experiment, parent_run_id="")
    cfg = RegistryConfig(model_name="ui-policy")
    metrics = {"eval/heldout/win_rate_vs_champion": 0.71, "eval/heldout/win_rate_vs_champion_low": 0.64, **MEASURED}
    policy, report, run_ctx = publish(ctx, "dpo", 1, metrics, cfg)
    version = register_policy(cfg, policy, report, [policy, report], run_ctx)["version"]
    registered = MlflowClient(tracking.tracking_uri()).get_model_version("ui-policy", version)
    model_id = json.loads(registered.tags["rlhf.lineage"])["models"]["dpo"]  # a database store keeps no model_id
    listed = MlflowClient(tracking.tracking_uri()).get_logged_model(model_id).tags["mlflow.modelVersions"]
    assert json.loads(listed) == [{"name": "ui-policy", "version": int(version)}]  # as mlflow.register_model lists it
    assert len(registered.tags) <= 10, sorted(registered.tags)
    card = card_text(policy.path / "model")
    heading = next(line.lstrip("# ") for line in card.splitlines() if line.startswith("#"))

    failed = screenshots / "mlflow_registered_failed.png"
    with chromium(failed) as browser:
        page = browser.page
        page.goto(f"{ui['url']}/#/experiments/{experiment}/models/{model_id}")
        expect(page.get_by_text("Not registered")).to_have_count(0)
        versions = page.get_by_text("Model versions").locator("xpath=..")  # its section lists the version
        expect(versions.get_by_role("link", name="ui-policy")).to_be_visible()
        expect(versions.get_by_text(f"v{version}", exact=True)).to_be_visible()
        expect(page.get_by_text(heading).first).to_be_visible()  # the card as the logged model's description
        page.screenshot(path=screenshots / "mlflow_logged_model.png", full_page=True)
        page.goto(f"{ui['url']}/#/models/ui-policy/versions/{version}")
        expect(page.get_by_text(heading).first).to_be_visible()  # the card as the version's description
        page.screenshot(path=screenshots / "mlflow_version.png", full_page=True)


def test_data_docs_link_is_http_on_rlhf_ups_mlflow_server_and_serves_the_page(ui, tmp_path, monkeypatch):
    """The page's URL on the server `rlhf up` starts, for the report's copy among the data stage run's artifacts; the
    server writes no access-log line per request; without a server the link stays the file:// one."""
    import urllib.request
    from urllib.parse import urljoin

    from playwright.sync_api import expect

    from rlhf_pipeline.tasks.data import docs_artifact
    from rlhf_pipeline.tasks.store.artifacts import ArtifactRef, StageOutcome

    run_id = tracking.start_run(tracking.experiment_id("rlhf-docs"), "data", {"rlhf.stage": "data"})
    docs = tmp_path / "data" / "report" / "sft" / "data_docs"
    (docs / "validations" / "sft").mkdir(parents=True)
    (docs / "validations" / "sft" / "run.html").write_text("<html><link href='../../static/s.css'>checked</html>")
    (docs / "static").mkdir()
    (docs / "static" / "s.css").write_text("body {}")
    tracking.log_artifacts(run_id, tmp_path / "data" / "report", "report")
    report = {"data_docs": str(docs / "validations" / "sft" / "run.html")}
    data = ArtifactRef(stage="data", key="k", uri=str(tmp_path / "data"), digest="d")
    outcome = StageOutcome(data, "built", {}, mlflow_run_id=run_id)
    found = docs_artifact(outcome, "sft", report)
    assert found == (run_id, "report/sft/data_docs/validations/sft/run.html"), found
    # no server: the file:// link
    assert tracking.artifact_page(*found) is None and tracking.artifact_url(*found) is None

    port = ui["port"]
    monkeypatch.setenv(tracking.UI_ENV, ui["url"])
    page, url = tracking.artifact_page(*found) or "", tracking.artifact_url(*found) or ""
    assert url.startswith(f"http://127.0.0.1:{port}/"), url
    # The link a person follows from the Prefect UI shows the page in MLflow's UI (its own URL makes a browser
    # save the file: MLflow serves every artifact as an attachment).
    assert page.startswith(f"http://127.0.0.1:{port}/#/experiments/") and page.endswith("run.html"), page
    with chromium(tmp_path / "data_docs_failed.png") as browser:
        browser.page.goto(page)
        shown = browser.page.frame_locator("iframe").first.get_by_text("checked")
        expect(shown).to_be_visible()
        browser.page.screenshot(path=tmp_path / "data_docs.png")
    with urllib.request.urlopen(url, timeout=30) as response:
        assert (response.status, response.headers.get_content_type()) == (200, "text/html")
        assert b"checked" in response.read()
    with urllib.request.urlopen(urljoin(url, "../../static/s.css"), timeout=30) as response:
        assert response.status == 200  # the page's relative links resolve on the same server
    log = ui["log"].read_text()
    assert "GET /health" not in log and "GET /api/" not in log, log[-2000:]
