"""Group relative policy optimisation with TRL's GRPOTrainer (Shao et al. 2024, DeepSeekMath)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from rlhf_pipeline.trainers.algorithms import online
from rlhf_pipeline.trainers.config import LogMetrics
from rlhf_pipeline.trainers.rewards.mix import GoldMetric, RewardsConfig


class GrpoConfig(online.OnlineConfig):
    trl_config: ClassVar[str] = "GRPOConfig"
    beta: float = Field(
        0.04,
        ge=0,
        description=(
            "KL coefficient to the reference model (SFT): the penalty on the KL, which is then reported. TRL's "
            "default is 0 (no reference model in memory)."
        ),
    )
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = Field(
        "dapo", description="TRL GRPO loss normalisation."
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide advantages by the reward std of the group, the batch, or not at all."
    )

    def trl_kwargs(self) -> dict[str, Any]:
        return {"beta": self.beta, "loss_type": self.loss_type, "scale_rewards": self.scale_rewards}


def train(
    cfg: GrpoConfig,
    rewards: RewardsConfig,
    sft_model: Path,
    reward_model: Path | None,
    data_dir: Path,
    out_dir: Path,
    work_dir: Path,
    log_metrics: LogMetrics | None = None,
    gold: GoldMetric | None = None,
) -> dict[str, float]:
    return online.train("grpo", cfg, rewards, sft_model, reward_model, data_dir, out_dir, work_dir, log_metrics, gold)
