"""The Prefect UI in a real headless browser: what a user types in the custom-run form reaches the flow run, and the
run's page opens on a graph of every stage.

A real Prefect server and `rlhf serve --config <tmp preset extending tests/ci.yaml>`, each with its own
state folders; Debian's Chromium driven by Playwright. Every process is stopped by its pid and checked dead.

The form is Prefect's Vue app (prefect-design): a label's `for` names no input, so `get_by_label` finds
nothing; a field is its property block (`.schema-form-property`) holding the label's exact text, and the
control inside it is found by role.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import yaml

from tests.browser import chromium, still_alive, submit
from tests.deployments.servers import deployment, explain, running_service, wait_for
from tests.flows.helpers import CI_PRESET, assert_a_flat_graph, task_runs

# On top of tests/ci.yaml: 8 sft steps of 16 rows instead of 64 took sft from 24-34 s to 13 s on this busy 2-core
# machine.
SMALLER_BATCHES = {"sft": {"per_device_train_batch_size": 16}, "rm": {"per_device_train_batch_size": 16}}
ALGORITHM, BETA = "grpo", 0.123  # rlhf/full runs ppo; grpo (2 steps, ~1.5 s) is the quickest choice with dpo and rloo
RUN_NAME = "beta sweep 0.123"
SCREEN = 900  # px: the window's height


def field(within, label: str):
    """The form's property block whose own label reads `label`, e.g. "algorithm (Optional)", "Beta (Optional)"."""
    return within.locator(".schema-form-property").filter(
        has=getattr(within, "page", within).get_by_text(label, exact=True)
    )


def differences(got, want, path: str = "") -> list[str]:
    """Each leaf where `got` differs from `want`, as 'grpo.beta: 0.5 != 0.123' (1 equals 1.0: the UI sends whole floats
    as integers)."""
    if isinstance(got, dict) and isinstance(want, dict):
        return [
            line
            for key in {**want, **got}
            for line in differences(got.get(key, "<missing>"), want.get(key, "<missing>"), f"{path}{key}.")
        ]
    return [] if got == want else [f"{path.rstrip('.')}: {got!r} != {want!r}"]


def submit_from_the_form(url: str, deployed: dict, artifacts: Path) -> tuple[list[int], dict]:
    """Name the run, change `algorithm` and give `grpo.beta` through `overrides` on the form, measure it (fields drawn,
    page height), screenshot it, submit; returns the browser's pids (closed by then) and the measures."""
    from playwright.sync_api import expect

    with chromium(artifacts / "ui_form_failed.png", width=1280, height=SCREEN) as browser:
        page = browser.page
        page.goto(url)
        algorithm = field(page, "algorithm (Optional)").get_by_role("group").get_by_role("button")
        expect(algorithm).to_have_text(deployed["algorithm"])  # the form opens filled in from the deployment
        overrides = field(page, "overrides (Optional)")
        lead = [
            field(page, f"{name} (Optional)").first for name in ("algorithm", "preset", "overrides", "model", "ppo")
        ]
        for block in lead:  # the form renders section by section: each is drawn before it is measured
            expect(block).to_be_visible()
        tops = [block.bounding_box()["y"] for block in lead]
        assert tops == sorted(tops) and tops[2] < SCREEN, tops  # overrides on the first screen
        measured = {
            "fields": page.locator(".schema-form-property").count(),
            "height": page.locator(".app-router-view").evaluate("view => view.scrollHeight"),
        }
        name = page.locator(".flow-run-name-input input")
        name.fill(RUN_NAME)
        # A click on prefect-design's select button leaves its list closed here (a click on its chevron, Space or
        # ArrowDown opens it).
        algorithm.press("ArrowDown")
        page.get_by_role("listbox").get_by_role("option", name=ALGORITHM, exact=True).click()
        expect(algorithm).to_have_text(ALGORITHM)
        overrides.get_by_role("button", name="Add item").click()
        item = overrides.get_by_role("textbox").last
        item.fill(f"grpo.beta={BETA}")
        expect(item).to_have_value(f"grpo.beta={BETA}")

        # The page scrolls inside `.app-router-view`, not the document: a full-page shot needs a viewport that tall.
        height = page.locator(".app-router-view").evaluate("view => view.scrollHeight")
        page.set_viewport_size({"width": 1280, "height": height})
        page.screenshot(path=artifacts / "ui_form.png", full_page=True)

        # Prefect's toasts ("You can use Prefect Cloud for free") sit over the Submit button of a short form: a person
        # closes them first.
        toasts = page.locator("#prefect-design-toast-app button")
        while toasts.count():
            toasts.first.click()
        submit(browser, page.get_by_role("button", name="Submit", exact=True), "/create_flow_run")
        # Submit leads to the deployment's page
        page.wait_for_url(lambda address: not address.rstrip("/").endswith("/run"))
    return browser.pids, measured


# The fill of a Completed node in the UI's flow-run graph (prefect-design's state colour)
COMPLETED_FILL = (
    33,
    157,
    75,
)


def node_boxes(png: bytes) -> list[tuple[int, int, int, int]]:
    """The Completed node boxes (x, y, width, height) drawn in a screenshot of the flow-run graph's canvas. The graph is
    WebGL (no DOM to query), so a node is a blob of its state's fill: as tall as a label (12-60 px; the run-state bar
    along the bottom is 4 px), at least 5 px wide (the UI's narrowest, a sub-second task, is ~9 px)."""
    import io

    import numpy as np
    from PIL import Image
    from scipy import ndimage

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    fill, _ = ndimage.label((np.abs(pixels - COMPLETED_FILL) <= 16).all(axis=2))
    blobs = [(x.start, y.start, x.stop - x.start, y.stop - y.start) for y, x in ndimage.find_objects(fill)]
    return [blob for blob in blobs if 12 <= blob[3] <= 60 and blob[2] >= 5]


def the_flow_run_graph(url: str, stages: int, artifacts: Path) -> tuple[dict, list]:
    """Open the flow run's page as a person would and wait for its graph: the graph the page itself fetched
    (`/graph-v2`) and the node boxes drawn, as soon as `stages` of them are (or what is drawn after 60 s); screenshot
    kept."""
    from playwright.sync_api import expect

    with chromium(artifacts / "flow_run_graph_failed.png", height=900) as browser:
        page = browser.page
        with page.expect_response(lambda response: "/graph-v2" in response.url) as fetched:
            page.goto(url)
        canvas = page.locator("canvas").first
        expect(canvas).to_be_visible()
        deadline = time.monotonic() + 60
        while len(boxes := node_boxes(canvas.screenshot())) < stages and time.monotonic() < deadline:
            time.sleep(0.5)  # drawn over a few frames once the page has its data
        page.screenshot(path=artifacts / "flow_run_graph.png")
        return fetched.value.json(), boxes


@pytest.mark.slow
def test_a_run_submitted_from_the_ui_form_has_the_typed_parameters_and_completes(tmp_path, screenshots):
    (tmp_path / "service").mkdir()
    preset = tmp_path / "ui.yaml"
    preset.write_text(yaml.safe_dump({"extends": CI_PRESET, **SMALLER_BATCHES}))

    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with running_service(tmp_path / "service", ["--config", str(preset)]) as service:
        full = deployment(service, "rlhf/full")
        deployed = full.parameters
        assert deployed["algorithm"] != ALGORITHM and deployed["grpo"]["beta"] != BETA  # the form has to change both
        url = f"{service['env']['PREFECT_API_URL'].removesuffix('/api')}/deployments/deployment/{full.id}/run"
        browser_pids, form = submit_from_the_form(url, deployed, screenshots)
        assert browser_pids and still_alive(browser_pids) == []
        # A form people can read (issue 44): the fields most runs change, on a few screens.
        # (460 fields on 57,542 px before issue 44; now 32 fields and the headers of the 13 blocks set through
        # overrides)
        assert form["fields"] <= 50 and form["height"] <= 7 * SCREEN, form
        print(f"the form of rlhf/full: {form['fields']} fields, {form['height']} px high")

        with service["client"]() as client:
            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[full.id])))
        assert len(runs) == 1, f"Submit created {len(runs)} runs of rlhf/full"
        run = runs[0]
        expected = copy.deepcopy(deployed)
        expected["algorithm"], expected["overrides"] = ALGORITHM, [f"grpo.beta={BETA}"]
        assert differences(run.parameters, expected) == []  # the two typed values, and every other field as deployed
        assert run.name == RUN_NAME  # the Run Name typed in the form is kept

        run = wait_for(service, run.id, timeout=300)
        assert run.state.type.value == "COMPLETED", explain(service, run)
        with service["client"]() as client:
            states = {task.name: task.state.name for task in task_runs(run.id, client)}
        stages = ["data", "sft", "rm", ALGORITHM, "eval", "registry"]
        assert states == dict.fromkeys(stages, "Completed")

        # The run's page opens on a graph of all six stages, none folded into another's group (issue 16).
        page = f"{service['env']['PREFECT_API_URL'].removesuffix('/api')}/runs/flow-run/{run.id}"
        graph, boxes = the_flow_run_graph(page, len(stages), screenshots)
        assert_a_flat_graph(graph, stages, ALGORITHM)
        assert len(boxes) == len(stages), (
            f"{len(boxes)} stage nodes drawn, not {len(stages)}: {boxes} (see flow_run_graph.png)"
        )

    from mlflow.tracking import MlflowClient

    mlflow = MlflowClient(tracking_uri=service["env"]["MLFLOW_TRACKING_URI"])
    experiment = mlflow.get_experiment_by_name(deployed["experiment_name"]).experiment_id
    [parent] = mlflow.search_runs([experiment], f"tags.`prefect.flow_run_id` = '{run.id}'")
    assert parent.data.params["grpo.beta"] == str(BETA)  # the typed value is the one the stage trained with
    assert parent.data.tags["mlflow.runName"] == RUN_NAME
