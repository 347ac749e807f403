"""`rlhf gc` after three runs: the dry run lists what nothing references (and deletes nothing); the real one removes
exactly that and keeps everything the registry and the newest run use."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_pipeline.cli import main
from rlhf_pipeline.tasks.tracking import client as tracking
from tests.flows.helpers import run, task_states

pytestmark = pytest.mark.e2e  # three pipeline runs


def listed(output: str) -> set[Path]:
    return {Path(line.split()[2]) for line in output.splitlines() if line.strip().endswith(")") and " MB  " in line}


def test_gc_keeps_what_the_registry_and_the_newest_run_use_and_removes_the_rest(
    prefect, state, tmp_path, monkeypatch, capsys
):
    # A store of its own: gc reads all of it
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'gc.db'}")
    registered = run("dpo.beta=0.1")  # becomes version 1, champion
    dropped = run("dpo.beta=0.2", "registry.enabled=false")
    newest = run("dpo.beta=0.3", "registry.enabled=false")
    first, second, third = (outcome.result() for outcome in (registered, dropped, newest))
    assert first["registry"]["version"] == "1"
    client = tracking.client()  # the store this test set, whatever mlflow's process-wide URI is
    second_copy = Path(client.get_run(second["mlflow_run_id"]).info.artifact_uri.removeprefix("file://")) / "model"
    assert not second_copy.exists()  # runs link their policy's logged model; runs made before kept their own copy:
    tracking.log_artifacts(second["mlflow_run_id"], Path(second["artifacts"]["dpo"]) / "model", "model")
    tracking.set_tags(second["mlflow_run_id"], {"rlhf.model_logged": "true"})
    assert (second_copy / "model.safetensors").is_file()

    assert main(["gc", "--dry-run", "--keep-runs", "1"]) == 0
    out = capsys.readouterr().out
    doomed = listed(out)
    # The second run's own stages (dpo and eval: data, sft and rm are shared) and its copy of the weights.
    assert {Path(second["artifacts"]["dpo"]), Path(second["artifacts"]["eval"]), second_copy} == doomed, out
    assert "would free" in out and all(path.exists() for path in doomed)  # a dry run deletes nothing
    for summary in (first, third):  # the registered version's lineage and the newest run's
        assert not {Path(path) for path in summary["artifacts"].values()} & doomed

    assert main(["gc", "--keep-runs", "1"]) == 0
    assert "freed" in capsys.readouterr().out
    assert not any(path.exists() for path in doomed)
    # No later cached run links to a copy that is gone.
    assert client.get_run(second["mlflow_run_id"]).data.tags["rlhf.model_logged"] == "removed by rlhf gc"
    for summary in (first, third):
        assert all(Path(path, "manifest.json").is_file() for path in summary["artifacts"].values())
    # What the registry references still loads, and an identical newest run is still fully cached.
    assert main(["gc", "--dry-run", "--keep-runs", "1"]) == 0 and listed(capsys.readouterr().out) == set()
    again = run("dpo.beta=0.3", "registry.enabled=false")
    assert set(task_states(again).values()) == {"Cached"}
