"""Training stages as the flow runs them (`tasks.training.train_stage`), without Prefect: what the user's code does to the artifact and its key."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from rlhf_pipeline.tasks import tracking
from rlhf_pipeline.tasks.stage import ArtifactRef, RunContext
from rlhf_pipeline.tasks.training import train_stage
from rlhf_pipeline.trainers.base import load_base_model
from rlhf_pipeline.trainers.common import CallbackSpec, save_model
from rlhf_pipeline.trainers.dpo import DpoConfig
from rlhf_pipeline.trainers.sft import SftConfig
from tests.helpers import FAST, SMALL_MODEL, write_data_dir


@pytest.fixture
def ctx(tmp_path) -> RunContext:
    experiment = tracking.experiment_id("test-training")
    parent = tracking.start_run(experiment, "parent", {})
    return RunContext(artifact_root=str(tmp_path / "artifacts"), experiment_id=experiment, parent_run_id=parent)


@pytest.fixture
def inputs(tmp_path) -> dict[str, ArtifactRef]:
    """A data artifact and an sft artifact, as the upstream stages publish them."""
    data = write_data_dir(tmp_path / "data", rows=32)
    policy, tokenizer = load_base_model(SMALL_MODEL)
    save_model(policy, tokenizer, tmp_path / "sft" / "model")
    return {"data": ArtifactRef(stage="data", key="d", uri=str(data)), "sft": ArtifactRef(stage="sft", key="s", uri=str(tmp_path / "sft"))}


def test_a_stage_stopped_early_by_a_callback_publishes_its_model_tagged(ctx, inputs):
    config = DpoConfig(max_steps=10, callbacks=[CallbackSpec(path="tests.user_code:StopAtStep", kwargs={"step": 3})], **FAST)
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
