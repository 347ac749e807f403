"""What a person sees of a served run in the Prefect UI (issue 28, item 3): while sft trains, the flow run's page shows
its progress artifact advancing; after the run, the eval summary artifact shows its plots as images.

A real Prefect server and `rlhf serve`, each with its own state folders; Debian's Chromium driven by Playwright; every
process stopped by its pid.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml
from transformers import TrainerCallback

from tests.browser import chromium, still_alive
from tests.deployments.servers import deployment, explain, running_service, wait_for
from tests.deployments.test_ui_form import SMALLER_BATCHES
from tests.flows.helpers import CI_PRESET, task_runs


class PacedSteps(TrainerCallback):
    """Each step takes `seconds` more until the file `until` exists (the test writes it once it has read the page
    twice): sft lasts long enough for two readings on any machine, however long the browser takes to open the page
    (a step of the tiny model takes 0.1 s on a quiet machine, 1-2 s on a busy 2-core one), and no longer."""

    def __init__(self, seconds: float, until: str):
        self.seconds, self.until = seconds, Path(until)

    def on_step_end(self, args, state, control, **kwargs):
        if not self.until.exists():
            time.sleep(self.seconds)


def paced_sft(until: Path) -> dict:
    return {
        "max_steps": 20,
        "callbacks": [{"path": f"{__name__}:PacedSteps", "kwargs": {"seconds": 3.0, "until": str(until)}}],
    }


PRESET = {"extends": CI_PRESET, **SMALLER_BATCHES, "registry": {"enabled": False}}


def progress_artifact(service, flow_run_id, timeout: float = 300):
    """The flow run's `rlhf-sft-progress` artifact once it shows more than 0% (read through the API)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    wanted = ArtifactFilter(
        key=ArtifactFilterKey(any_=["rlhf-sft-progress"]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
    )
    deadline = time.time() + timeout
    with service["client"]() as client:
        while True:
            found = client.read_artifacts(artifact_filter=wanted)
            if found and found[0].data:
                return found[0]
            run = client.read_flow_run(flow_run_id)
            assert run.state.type.value not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"), explain(service, run)
            assert time.time() < deadline, f"no rlhf-sft-progress artifact after {timeout}s"
            time.sleep(0.5)


def sft_state(service, flow_run_id) -> str:
    with service["client"]() as client:
        return {task.name: task.state.name for task in task_runs(flow_run_id, client)}.get("sft", "not started")


def shown_progress(page) -> float:
    """The percentage the artifact's page shows ("Progress: 42%")."""
    from playwright.sync_api import expect

    shown = page.locator(".artifact-data-progress")
    expect(shown).to_contain_text("Progress:")
    return float(re.search(r"Progress:\s*([\d.]+)%", shown.inner_text()).group(1))


def open_artifact(page, run_page: str, key: str) -> None:
    """From the flow run's page, as a person: its Artifacts tab, then the artifact's card."""
    from playwright.sync_api import expect

    page.goto(run_page)
    page.get_by_text("Artifacts", exact=True).first.click()  # the run page's tab
    card = page.get_by_text(key, exact=True).first
    expect(card).to_be_visible()
    card.click()


@pytest.mark.slow
def test_while_sft_trains_its_progress_artifact_advances_and_after_the_run_the_eval_summary_shows_its_plots(
    tmp_path, screenshots
):
    from playwright.sync_api import expect

    (tmp_path / "service").mkdir()
    preset = tmp_path / "progress.yaml"
    preset.write_text(yaml.safe_dump(PRESET))

    with running_service(tmp_path / "service", ["--config", str(preset)]) as service:
        grpo = deployment(service, "rlhf/grpo")
        with service["client"]() as client:
            run = client.create_flow_run_from_deployment(grpo.id, parameters={"sft": paced_sft(tmp_path / "seen")})
        run_page = f"{service['env']['PREFECT_API_URL'].removesuffix('/api')}/runs/flow-run/{run.id}"
        with chromium(screenshots / "progress_failed.png") as browser:
            page = browser.page
            progress_artifact(service, run.id)  # sft has started and sent its first reading
            open_artifact(page, run_page, "rlhf-sft-progress")
            readings = [(shown_progress(page), sft_state(service, run.id))]
            page.screenshot(path=screenshots / "progress_artifact.png")
            deadline = time.time() + 90
            while readings[-1][0] == readings[0][0] and time.time() < deadline:
                time.sleep(2)
                page.reload()
                readings.append((shown_progress(page), sft_state(service, run.id)))
            (tmp_path / "seen").touch()  # sft may run at full speed now
            first, last = readings[0], readings[-1]
            # Both read while sft trained (its state read after the page), and it advanced on the page.
            assert first[1] == last[1] == "Running" and first[0] < last[0] < 100, readings

            done = wait_for(service, run.id, timeout=600)
            assert done.state.type.value == "COMPLETED", explain(service, done)
            page.reload()
            assert shown_progress(page) == 100  # the build's last reading

            open_artifact(page, run_page, "rlhf-eval-summary")
            images = page.locator(".artifact-data-markdown img")
            expect(images.first).to_be_visible()
            page.wait_for_function(
                "() => [...document.querySelectorAll('.artifact-data-markdown img')]"
                ".every(image => image.complete && image.naturalWidth > 0)"
            )
            loaded = images.evaluate_all(
                "images => images.map(image => ({alt: image.alt, width: image.naturalWidth, "
                "src: image.src.slice(0, 22)}))"
            )
            # The page scrolls inside `.app-router-view`: a shot of the whole artifact needs a viewport that tall.
            height = page.locator(".app-router-view").evaluate("view => view.scrollHeight")
            page.set_viewport_size({"width": 1400, "height": height})
            page.screenshot(path=screenshots / "eval_summary_artifact.png")
        assert browser.pids and still_alive(browser.pids) == []

    [report] = (service["tmp"] / "state" / "artifacts" / "eval").glob("*/plots")
    published = sorted(plot.stem.replace("_", " ").capitalize() for plot in report.glob("*.png"))
    assert len(published) >= 3, published  # win rates, reward distributions, exact match
    assert sorted(image["alt"] for image in loaded) == sorted([*published, "Training curves"]), loaded
    assert all(image["width"] > 100 and image["src"] == "data:image/png;base64," for image in loaded), loaded
