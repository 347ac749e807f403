"""Training stages as the flow runs them (`tasks.training.train_stage`), without Prefect: what the user's code does to
the artifact and its key."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from rlhf_pipeline.tasks.store.artifacts import ArtifactRef, RunContext
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.tasks.training import train_stage
from rlhf_pipeline.trainers.algorithms.dpo import DpoConfig
from rlhf_pipeline.trainers.algorithms.sft import SftConfig
from rlhf_pipeline.trainers.config import CallbackSpec
from tests.helpers import FAST, SMALL_MODEL, write_data_dir


@pytest.fixture
def ctx(tmp_path) -> RunContext:
    experiment = tracking.experiment_id("test-training")
    parent = tracking.start_run(experiment, "parent", {})
    return RunContext(artifact_root=str(tmp_path / "artifacts"), experiment_id=experiment, parent_run_id=parent)


@pytest.fixture
def inputs(tmp_path, untrained_sft) -> dict[str, ArtifactRef]:
    """A data artifact and an sft artifact, as the upstream stages publish them."""
    data = write_data_dir(tmp_path / "data", rows=32)
    sft = ArtifactRef(stage="sft", key="s", uri=str(untrained_sft.parent))
    return {"data": ArtifactRef(stage="data", key="d", uri=str(data)), "sft": sft}


def test_a_stage_stopped_early_by_a_callback_publishes_its_model_tagged(ctx, inputs):
    config = DpoConfig(
        max_steps=10, callbacks=[CallbackSpec(path="tests.user_code:StopAtStep", kwargs={"step": 3})], **FAST
    )
    outcome = train_stage("dpo", config, {}, inputs, ctx)
    assert not outcome.cached and (outcome.ref.path / "model" / "model.safetensors").is_file()
    assert outcome.ref.manifest()["training"] == {"global_step": 3, "max_steps": 10, "stopped_early": True}
    assert MlflowClient().get_run(outcome.mlflow_run_id).data.tags["rlhf.stopped_early"] == "step 3 of 10"


def test_editing_a_callback_re_runs_the_stage_that_uses_it_and_nothing_else(ctx, inputs, tmp_path, monkeypatch):
    module = tmp_path / "lab_callbacks.py"
    module.write_text("from transformers import TrainerCallback\n\nclass Quiet(TrainerCallback):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with_callback = SftConfig(max_steps=2, callbacks=[CallbackSpec(path="lab_callbacks:Quiet")], **FAST)
    without = DpoConfig(max_steps=2, **FAST)

    def build() -> tuple[bool, bool]:
        sft = train_stage("sft", with_callback, {"model": SMALL_MODEL}, {"data": inputs["data"]}, ctx)
        dpo = train_stage("dpo", without, {}, inputs, ctx)
        return sft.cached, dpo.cached

    assert build() == (False, False)
    assert build() == (True, True)
    module.write_text(module.read_text() + "\n# tuned the quiet period\n")
    assert build() == (False, True)  # sft re-trains; dpo, which runs no user code, is reused


@pytest.mark.slow  # three sft builds: ~15 s
def test_sft_evaluates_on_the_data_stages_sft_eval_and_keys_on_it_only_then(ctx, tmp_path):
    from rlhf_pipeline.tasks.data import validate_data
    from rlhf_pipeline.tasks.store.artifacts import read_history
    from rlhf_pipeline.trainers.data import DataConfig, DatasetSpec
    from tests.helpers import write_jsonl

    demos = [{"prompt": f"sort {n} -> ", "completion": "".join(sorted(str(n)))} for n in (4213, 9071, 5532, 8064)]
    held_out = write_jsonl(tmp_path / "sft_eval.jsonl", demos)
    data = validate_data.fn(DataConfig(sft_eval=DatasetSpec(path=str(held_out))), ctx)
    assert (data.path / "datasets" / "sft_eval.parquet").is_file() and "sft_eval" in data.parts
    evaluating = SftConfig(max_steps=2, eval_strategy="steps", eval_steps=1, **FAST)
    outcome = train_stage("sft", evaluating, {"model": SMALL_MODEL}, {"data": data}, ctx)
    curve = [step for step, values in read_history(outcome.ref.path) if "sft/eval/loss" in values]
    assert curve == [1, 2]
    # A curve in MLflow too
    assert [m.step for m in MlflowClient().get_metric_history(outcome.mlflow_run_id, "sft/eval/loss")][:2] == [
        1,
        2,
    ]
    # A new held-out file re-keys the sft that evaluates on it, not one that does not evaluate.
    plain = SftConfig(max_steps=2, **FAST)
    train_stage("sft", plain, {"model": SMALL_MODEL}, {"data": data}, ctx)
    write_jsonl(held_out, demos[:3])
    changed = validate_data.fn(DataConfig(sft_eval=DatasetSpec(path=str(held_out))), ctx)
    assert train_stage("sft", plain, {"model": SMALL_MODEL}, {"data": changed}, ctx).cached
    assert not train_stage("sft", evaluating, {"model": SMALL_MODEL}, {"data": changed}, ctx).cached
