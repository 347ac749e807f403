"""Every run-state folder points at a temporary directory before anything imports Prefect or MLflow."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest


def _own_cores() -> None:
    """Under pytest-xdist, each worker keeps its own share of the cores (worker i takes cores i, i+n, ...), and its
    torch threads and its subprocesses' (stages, servers) match that share: two workers' torch threads on the same
    cores wait on each other many times over (docs/ARCHITECTURE.md, This machine). Set before anything imports torch."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    index = int(worker.removeprefix("gw"))
    share = cores[index::count] or [cores[index % len(cores)]]
    os.sched_setaffinity(0, share)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(len(share))


_own_cores()
_STATE = Path(tempfile.mkdtemp(prefix="rlhf-tests-"))
os.environ.update(
    {
        "RLHF_STATE_DIR": str(_STATE / "state"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{_STATE / 'mlflow.db'}",
        "PREFECT_HOME": str(_STATE / "prefect"),
        "PREFECT_LOCAL_STORAGE_PATH": str(_STATE / "prefect" / "storage"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_DATASETS_CACHE": str(_STATE / "hf-datasets"),
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # The suite is this worker's operator: its own modules (tests.user_code, my_rewards, ...) may be imported by
        # the runs it starts; tests/scenarios/test_trust.py unsets it to see the refusal.
        "RLHF_ALLOWED_IMPORTS": "*",
        # ... and of files and clusters: the runs read tmp_path's files and join the tests' Ray clusters
        # (tests/flows/test_ownership.py unsets them to see the refusals).
        "RLHF_ALLOWED_PATHS": "*",
        "RLHF_ALLOWED_RAY_ADDRESSES": "*",
    }
)
os.environ.pop("PREFECT_API_URL", None)


def _seed_prefect_home() -> None:
    from tests.prefect_db import seeded

    seeded(_STATE / "prefect")


_seed_prefect_home()


@pytest.fixture(scope="session")
def prefect():
    """One Prefect test server for every test of the session that runs flows (starting one takes seconds). One, not
    one per folder: Prefect's events worker, which carries task runs' states to the server, is one per process and
    keeps the API it started with, so a second server nested in the session would receive the first's task runs.
    (tests/tasks/orchestration/test_events.py keeps its own, and drains that worker before and after.)"""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def state_dir() -> Path:
    return _STATE


@pytest.fixture
def state(tmp_path, monkeypatch):
    """Artifacts of each run-level test (flows, scenarios, the application) in its own folder (MLflow stays in the
    session database)."""
    from rlhf_pipeline.tasks.tracking import client as tracking

    monkeypatch.setenv(tracking.STATE_ENV, str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture(scope="session")
def screenshots() -> Path:
    """Where the browser tests keep their screenshots: `RLHF_TEST_ARTIFACTS`, else test-artifacts/ of the checkout
    (gitignored), so a CI run leaves them beside the code it tested."""
    folder = Path(os.environ.get("RLHF_TEST_ARTIFACTS") or Path(__file__).resolve().parents[1] / "test-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def pytest_collection_modifyitems(config, items: list) -> None:
    """Each module's tests stay together and in their order (its module fixtures are built once). In one process the
    modules without a slow test come first, so a run that breaks something basic fails in minutes; split over xdist
    workers (whole modules each, `--dist loadfile`, in this order: `--no-loadscope-reorder`) the longest modules go
    first (tests/durations.json), so that no worker starts a long one when the other is nearly done."""
    from tests import durations

    slow = {item.module for item in items if item.get_closest_marker("slow")}
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.module in slow)
        return
    known = durations.read()

    def seconds(item) -> float:
        default = durations.DEFAULT_SLOW if item.module in slow else durations.DEFAULT
        return known.get(item.nodeid.split("::", 1)[0], default)

    items.sort(key=lambda item: -seconds(item))


@pytest.fixture(scope="session")
def untrained_sft(tmp_path_factory) -> Path:
    """The tests' small tiny model, untrained, saved as the `sft` stage saves its model (weights, tokenizer, chat
    template): the folder a trainer under test starts from. Shared by the session: read it, never write into it."""
    from rlhf_pipeline.trainers.models.base_model import load_base_model
    from rlhf_pipeline.trainers.models.load import save_model
    from tests.helpers import SMALL_MODEL

    return save_model(*load_base_model(SMALL_MODEL), tmp_path_factory.mktemp("untrained-sft") / "model")
