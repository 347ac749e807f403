from __future__ import annotations

import pytest

from rlhf_pipeline.tasks.tracking import client as tracking


@pytest.fixture
def state(tmp_path, monkeypatch):
    """Artifacts of each flow test in its own folder (MLflow stays in the session database)."""
    monkeypatch.setenv(tracking.STATE_ENV, str(tmp_path / "state"))
    return tmp_path / "state"
