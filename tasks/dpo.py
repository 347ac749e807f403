"""`dpo`: direct preference optimisation of the SFT model."""

from __future__ import annotations

from rlhf_pipeline.tasks.orchestration import prefect_log, stage_task
from rlhf_pipeline.tasks.stage import ArtifactRef, RunContext, StageOutcome, run_stage
from rlhf_pipeline.trainers.dpo import DpoConfig


@stage_task("dpo")
def train_dpo(config: DpoConfig, sft_model: ArtifactRef, data: ArtifactRef, ctx: RunContext) -> StageOutcome:
    def build(out_dir, work_dir, log_metrics):
        from rlhf_pipeline.trainers import dpo

        return dpo.train(config, sft_model.path / "model", data.path, out_dir, work_dir, log_metrics)

    return run_stage("dpo", config, {"sft": sft_model, "data": data}, ctx, build, log=prefect_log)
