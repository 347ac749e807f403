"""`sft`: supervised fine-tuning of the base model on the validated demonstrations."""

from __future__ import annotations

from rlhf_pipeline.tasks.orchestration import prefect_log, stage_task
from rlhf_pipeline.tasks.stage import ArtifactRef, RunContext, StageOutcome, run_stage
from rlhf_pipeline.trainers.common import ModelConfig
from rlhf_pipeline.trainers.sft import SftConfig


@stage_task("sft")
def train_sft(config: SftConfig, model: ModelConfig, data: ArtifactRef, ctx: RunContext) -> StageOutcome:
    def build(out_dir, work_dir, log_metrics):
        from rlhf_pipeline.trainers import sft

        return sft.train(config, model, data.path, out_dir, work_dir, log_metrics)

    # The base model is part of what the stage depends on: key it with the SFT config.
    return run_stage("sft", {"sft": config.model_dump(mode="json"), "model": model.model_dump(mode="json")}, {"data": data}, ctx, build, log=prefect_log)
