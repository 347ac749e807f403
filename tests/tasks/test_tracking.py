"""The tracking store as several processes see it at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.deployments.servers import ROOT

OPEN_AT_ONCE = """
import os, sys, time
from pathlib import Path
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.005)
from rlhf_pipeline.tasks import tracking
mlflow = tracking.client()
mlflow.search_experiments(max_results=1)
mlflow.search_registered_models(max_results=1)
tracking.experiment_id(f"opened-by-{os.getpid()}")
"""


def test_processes_that_open_a_new_sqlite_store_at_once_all_get_its_tables(tmp_path):
    """A served deployment's runs, their hooks and `rlhf eval` may open a new store together: without one process at
    a time creating the tables, MLflow's migrations run twice and one process fails ('duplicate column name')."""
    from mlflow.tracking import MlflowClient

    (tmp_path / "opener.py").write_text(OPEN_AT_ONCE)
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "RLHF_STATE_DIR": str(tmp_path / "state"), "OMP_NUM_THREADS": "1"}
    go = tmp_path / "go"
    openers = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "opener.py"), str(go)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    time.sleep(5)  # every opener has started Python and waits for the word
    go.touch()
    outputs = [opener.communicate(timeout=300) for opener in openers]
    for opener, (_out, err) in zip(openers, outputs, strict=True):
        assert opener.returncode == 0, err[-3000:]
    made = {experiment.name for experiment in MlflowClient(tracking_uri=uri).search_experiments()}
    assert made >= {f"opened-by-{opener.pid}" for opener in openers}
    assert (tmp_path / "store" / "mlflow.db.lock").exists()
