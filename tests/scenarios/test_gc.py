"""`rlhf gc` after three runs: the dry run lists what nothing references (and deletes nothing); the real one removes
exactly that and keeps everything the registry and the newest run use, and whatever a live run reused since gc made
its list; every registered model counts, not the first page of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_pipeline.cli import main
from rlhf_pipeline.tasks.store.artifacts import MANIFEST
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.tasks.tracking import gc
from tests import user_code
from tests.flows.helpers import run, task_states

pytestmark = pytest.mark.slow  # three pipeline runs


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


def test_gc_never_removes_what_a_live_run_reused_after_gc_listed_it(prefect, state, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'gc.db'}")
    first = run("registry.enabled=false").result()
    doomed = gc.collect(keep_runs=0)  # nothing registered, no run live: all of it
    reused = {stage: Path(first["artifacts"][stage]) for stage in ("data", "sft", "rm")}
    assert set(reused.values()) <= {item.path for item in doomed}

    # A run starts and reuses data, sft and rm; gc removes its list as dpo begins; eval then reads sft and rm.
    monkeypatch.setattr(user_code.GcMidRun, "doomed", doomed)
    second = run("registry.enabled=false", "dpo.beta=0.2", "dpo.callbacks=[{path: tests.user_code:GcMidRun}]")
    assert second.is_completed(), second.message
    states = task_states(second)
    assert [states[stage] for stage in reused] == ["Cached"] * 3
    assert all((path / MANIFEST).is_file() for path in reused.values())
    assert not Path(first["artifacts"]["dpo"]).exists()  # what no live run used went

    # The run ended, and its leases with it: now gc removes them.
    gc.remove(gc.collect(keep_runs=0))
    assert not any(path.exists() for path in reused.values())


def test_gc_keeps_the_artifacts_of_every_registered_model_past_the_first_page(state, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'gc.db'}")
    client = tracking.client()
    for i in range(101):  # MLflow returns 100 registered models a page
        key = f"{i:064x}"
        (state / "artifacts" / "sft" / key).mkdir(parents=True)
        (state / "artifacts" / "sft" / key / MANIFEST).write_text("{}")
        client.create_registered_model(f"policy-{i:03d}")
        client.create_model_version(f"policy-{i:03d}", str(tmp_path), tags={"rlhf.key.sft": key})
    (state / "artifacts" / "sft" / "unreferenced").mkdir()
    assert [item.path.name for item in gc.collect(keep_runs=0)] == ["unreferenced"]


@pytest.mark.parametrize("tag", ["{not json", '{"keys": 5}', '{"keys": {"sft": ["a", "b"]}}', "[1, 2]"])
def test_a_malformed_lineage_tag_stops_gc_with_a_message_and_removes_nothing(state, tmp_path, monkeypatch, tag, capsys):
    """gc cannot tell what such a version keeps, so it removes nothing and says which version and tag to fix."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'gc.db'}")
    client = tracking.client()
    doomed = state / "artifacts" / "sft" / "unreferenced"
    doomed.mkdir(parents=True)
    client.create_registered_model("policy")
    client.create_model_version("policy", str(tmp_path), tags={"rlhf.lineage": tag})
    assert main(["gc"]) == 2
    err = capsys.readouterr().err
    assert (
        "version 1 of registered model 'policy'" in err and "rlhf.lineage tag" in err and "Nothing was removed" in err
    )
    assert "Traceback" not in err and doomed.is_dir()


def test_a_stage_artifact_rlhf_eval_reads_is_leased_until_its_run_ends(state, tmp_path, monkeypatch):
    """`rlhf eval <folder>` reads models it did not build: where one is a stage artifact of this state, the run pins it
    (flows/evaluate.py), so gc leaves it while the eval runs and may remove it after."""
    from rlhf_pipeline.tasks.store.leases import lease_input, release

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'gc.db'}")
    root = state / "artifacts"
    policy = root / "dpo" / ("ab" * 32)
    (policy / "model").mkdir(parents=True)
    (policy / MANIFEST).write_text("{}")
    outside = tmp_path / "elsewhere" / "model"
    outside.mkdir(parents=True)
    assert lease_input(policy, root, "eval-run") and not lease_input(outside.parent, root, "eval-run")
    assert [item.path for item in gc.collect(keep_runs=0)] == []  # leased by a live run (this process)
    release(root, "eval-run")
    assert [item.path for item in gc.collect(keep_runs=0)] == [policy]
    gc.remove(gc.collect(keep_runs=0))
    with pytest.raises(ValueError, match="was removed .rlhf gc. before this run could pin it"):
        lease_input(policy, root, "eval-run")
