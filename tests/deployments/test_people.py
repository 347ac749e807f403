"""People label pairs in the Prefect UI (issue 27): a deployment's run suspends with the pairs to label, a person opens
it in a real browser, sees the pairs artifact, chooses A or B in the Resume form; the run resumes and DPO trains on
those labels. While it waited its process was gone and the device slot free: another run's training stage ran.

A real Prefect server and `rlhf serve`, each with its own state folders; Debian's Chromium driven by Playwright; every
process stopped by its pid.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from tests.browser import chromium, still_alive, submit
from tests.deployments.servers import deployment, explain, running_service, wait_for
from tests.deployments.test_ui_form import field
from tests.flows.helpers import CI_PRESET, task_runs

PAIRS = 3
CHOICES = ["A", "B", "tie"]  # pair 0: A is better, pair 1: B, pair 2: neither
PEOPLE = {
    "extends": CI_PRESET,
    "algorithm": "dpo",
    "data": {"preference": None},
    "pairs": {
        "enabled": True,
        "labeller": "people",
        "people": {"max_pairs": PAIRS, "timeout_s": 1800},
        "max_prompts": 8,
        "samples_per_prompt": 4,
        "max_new_tokens": 4,
    },
    "eval": {"use_reward_model": False},
    "registry": {"enabled": False},
}


def wait_for_state(service, flow_run_id, name: str, timeout: float = 300):
    deadline = time.time() + timeout
    with service["client"]() as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state.name == name:
                return run
            assert run.state.type.value not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"), explain(service, run)
            assert time.time() < deadline, f"flow run {flow_run_id} still {run.state.name} after {timeout}s"
            time.sleep(1)


def label_in_the_browser(url: str, prompts: list[str], artifacts: Path) -> list[int]:
    """Open the suspended run's page, check the pairs artifact, resume it through the form with CHOICES; returns the
    browser's pids (closed by then)."""
    from playwright.sync_api import expect

    with chromium(artifacts / "labels_form_failed.png") as browser:
        page = browser.page
        page.goto(url)
        page.get_by_text("Artifacts", exact=True).first.click()  # the run page's tab
        expect(page.get_by_text("rlhf-pairs-to-label").first).to_be_visible()
        page.get_by_text("rlhf-pairs-to-label").first.click()  # the artifact's own page: its table
        for prompt in prompts:
            expect(page.get_by_text(prompt.strip(), exact=False).first).to_be_visible()
        page.screenshot(path=artifacts / "pairs_artifact.png", full_page=True)
        page.go_back()
        page.get_by_role("button", name="Resume").first.click()
        dialog = page.locator(".p-modal").filter(has_text="Resume Flow Run")
        expect(dialog.get_by_text("pairs to label").first).to_be_visible()  # the form's description: the pairs
        for pair, choice in enumerate(CHOICES):
            select = field(dialog, f"Pair {pair} (Optional)").get_by_role("group").get_by_role("button")
            select.press("ArrowDown")
            page.get_by_role("listbox").get_by_role("option", name=choice, exact=True).click()
            expect(select).to_have_text(choice)
        page.screenshot(path=artifacts / "labels_form.png")
        resumed = submit(browser, dialog.get_by_role("button", name="Submit", exact=True), "/resume")
        assert resumed.ok, f"resume answered {resumed.status}: {resumed.text()}"
        expect(dialog).to_be_hidden()
    return browser.pids


@pytest.mark.slow
def test_people_label_a_suspended_run_in_the_prefect_ui_and_dpo_trains_on_their_labels(tmp_path, screenshots):
    (tmp_path / "service").mkdir()
    preset = tmp_path / "people.yaml"
    preset.write_text(yaml.safe_dump(PEOPLE))

    with running_service(tmp_path / "service", ["--config", str(preset)]) as service:
        full = deployment(service, "rlhf/dpo")
        with service["client"]() as client:
            waiting = client.create_flow_run_from_deployment(full.id)
        suspended = wait_for_state(service, waiting.id, "Suspended")
        assert suspended.state.type.value == "PAUSED"
        state = service["tmp"] / "state" / "artifacts" / "pairs"
        [to_label] = (state / ".labels").glob("*.to_label.jsonl")
        shown = [json.loads(line) for line in to_label.read_text().splitlines()]
        assert len(shown) == PAIRS

        # While it waits: no process of it holds the device slot; another run's training stage takes it and finishes.
        with service["client"]() as client:
            other = client.create_flow_run_from_deployment(
                full.id,
                parameters={
                    "pairs": {"enabled": False},
                    "data": {"preference": {"path": "data/sort/preference.jsonl"}},
                    "sft": {"max_steps": 9},  # another sft than the waiting run's: it trains
                },
            )
        other = wait_for(service, other.id, timeout=600)
        assert other.state.type.value == "COMPLETED", explain(service, other)
        with service["client"]() as client:
            assert client.read_flow_run(waiting.id).state.name == "Suspended"
            assert {t.name: t.state.name for t in task_runs(other.id, client)}["sft"] == "Completed"

        base = service["env"]["PREFECT_API_URL"].removesuffix("/api")
        browser_pids = label_in_the_browser(
            f"{base}/runs/flow-run/{waiting.id}",
            [pair["prompt"] for pair in shown],
            screenshots,
        )
        assert browser_pids and still_alive(browser_pids) == []

        done = wait_for(service, waiting.id, timeout=600)
        assert done.state.type.value == "COMPLETED", explain(service, done)
        with service["client"]() as client:
            states = {t.name: t.state.name for t in task_runs(waiting.id, client)}
        assert states["pairs labelled"] == "Completed" and states["dpo"] == "Completed", states
        [labelled] = [p for p in state.glob("*/pairs.jsonl")]
        pairs = [json.loads(line) for line in labelled.read_text().splitlines()]
        # Pair 2 was a tie: dropped
        assert [(p["chosen"], p["rejected"]) for p in pairs] == [
            (shown[0]["a"], shown[0]["b"]),
            (shown[1]["b"], shown[1]["a"]),
        ]
