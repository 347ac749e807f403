"""REINFORCE leave-one-out with TRL's RLOOTrainer (Ahmadian et al. 2024, "Back to Basics")."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from rlhf_pipeline.trainers.algorithms import online
from rlhf_pipeline.trainers.config import LogMetrics
from rlhf_pipeline.trainers.rewards.mix import GoldMetric, RewardsConfig


class RlooConfig(online.OnlineConfig):
    trl_config: ClassVar[str] = "RLOOConfig"
    beta: float = Field(0.05, ge=0, description="KL coefficient to the reference model (TRL RLOOConfig default 0.05).")
    normalize_advantages: bool = Field(False, description="Whiten the leave-one-out advantages of each batch.")

    def trl_kwargs(self) -> dict[str, Any]:
        return {"beta": self.beta, "normalize_advantages": self.normalize_advantages}


def train(
    cfg: RlooConfig,
    rewards: RewardsConfig,
    sft_model: Path,
    reward_model: Path | None,
    data_dir: Path,
    out_dir: Path,
    work_dir: Path,
    log_metrics: LogMetrics | None = None,
    gold: GoldMetric | None = None,
) -> dict[str, float]:
    return online.train("rloo", cfg, rewards, sft_model, reward_model, data_dir, out_dir, work_dir, log_metrics, gold)
