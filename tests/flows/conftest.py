from __future__ import annotations

import pytest
from prefect.testing.utilities import prefect_test_harness

from rlhf_pipeline.tasks import tracking


@pytest.fixture(scope="session")
def prefect():
    """One Prefect server for every flow test (starting one takes seconds)."""
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def state(tmp_path, monkeypatch):
    """Artifacts of each flow test in its own folder (MLflow stays in the session database)."""
    monkeypatch.setenv(tracking.STATE_ENV, str(tmp_path / "state"))
    return tmp_path / "state"
