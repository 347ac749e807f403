"""The registry's events: what `tasks.orchestration.events.announce` sends for each outcome of the promotion gate, read
back from a Prefect server (tests/deployments/test_events.py: from the registry task of served retrain runs)."""

from __future__ import annotations

import time

import pytest

from rlhf_pipeline.tasks.orchestration.events import announce

GATE = "eval/heldout/win_rate_vs_champion"
METRICS = {GATE: 0.62, f"{GATE}_low": 0.55, f"{GATE}_high": 0.69, "eval/heldout/policy_exact_match": 0.9}


def outcome(version: str, promoted: bool, reason: str, previous: str | None) -> dict:
    return {
        "model_name": "rlhf-policy",
        "version": version,
        "promoted": promoted,
        "reason": reason,
        "previous_champion": previous,
    }


@pytest.fixture(scope="module")
def prefect_api():
    """A test server of this module's own. Prefect's events worker is one per process and keeps the API it started
    with (an earlier test's server, under xdist): it is drained before and after, so these events reach this server
    and later ones reach theirs."""
    from prefect.events.worker import EventsWorker
    from prefect.testing.utilities import prefect_test_harness

    EventsWorker.drain_all()
    with prefect_test_harness(server_startup_timeout=120):
        yield
        EventsWorker.drain_all()


def read_back(count: int, timeout: float = 60) -> list:
    """The `rlhf.model.*` events the server holds, oldest first, once there are `count`."""
    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    deadline = time.time() + timeout
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_events(EventFilter(event=EventNameFilter(prefix=["rlhf.model."])), limit=50)
            if len(page.events) >= count or time.time() > deadline:
                return sorted(page.events, key=lambda event: event.occurred)
            time.sleep(0.5)


def test_a_candidate_is_announced_always_a_promotion_only_when_champion_moved(prefect_api):
    moved = outcome("4", True, f"{GATE}=0.6200 >= 0.5, lower bound 0.5500 >= 0.48", "3")
    assert announce(moved, GATE, METRICS, "run-4") == ["rlhf.model.candidate", "rlhf.model.promoted"]
    assert announce(outcome("4", True, "already champion", "4"), GATE, METRICS, "run-5") == ["rlhf.model.candidate"]
    refused = outcome("5", False, f"{GATE}=0.4000 is below 0.5", "4")
    assert announce(refused, GATE, {**METRICS, GATE: 0.4}, "run-6") == ["rlhf.model.candidate"]
    events = read_back(4)
    assert [(e.event, e.resource["version"], e.resource["alias"]) for e in events] == [
        ("rlhf.model.candidate", "4", "candidate"),
        ("rlhf.model.promoted", "4", "champion"),
        ("rlhf.model.candidate", "4", "candidate"),
        ("rlhf.model.candidate", "5", "candidate"),
    ]
    assert {e.resource.id for e in events} == {"mlflow.model.rlhf-policy"}
    promoted = events[1].payload
    assert promoted == {
        "version": "4",
        "promoted": True,
        "reason": moved["reason"],
        "previous_champion": "3",
        "gate_metric": GATE,
        "metrics": {GATE: 0.62, f"{GATE}_low": 0.55, f"{GATE}_high": 0.69},  # the gate's metric and its bounds only
        "mlflow_run_id": "run-4",
    }
    assert events[3].payload["metrics"][GATE] == 0.4 and events[3].payload["promoted"] is False
