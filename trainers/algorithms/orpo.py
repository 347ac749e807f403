"""Odds-ratio preference optimisation with TRL's ORPOTrainer (Hong et al. 2024, arXiv:2403.07691).

ORPO reads the same preference pairs as DPO but keeps no reference model: its loss is the NLL of the chosen
sequence (SFT folded in) minus `beta` (the paper's lambda) times log sigmoid of the log odds ratio of chosen over
rejected, from per-token average log-probabilities. It trains from the SFT model, as DPO does. TRL 1.16 ships it
under `trl.experimental.orpo`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from rlhf_pipeline.trainers.algorithms.fields import TrainingConfig
from rlhf_pipeline.trainers.config import EvalDuringTraining, LogMetrics


class OrpoConfig(EvalDuringTraining, TrainingConfig):
    trl_config: ClassVar[str] = "experimental.orpo.ORPOConfig"
    learning_rate: float = Field(1e-6, gt=0, description="Peak learning rate (TRL ORPOConfig default 1e-6).")
    beta: float = Field(
        0.1,
        gt=0,
        description="Weight of the odds-ratio term against the chosen NLL (TRL ORPOConfig.beta, the paper's lambda); "
        "not a KL strength: there is no reference model.",
    )

    def held_out(self) -> tuple[str, ...]:
        return ("preference_eval",) if self.evaluates else ()


def trl_orpo():
    """TRL's `experimental.orpo` module, imported without its 'APIs here are unstable' warning (we pin TRL)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"You are importing from 'trl\.experimental'")
        from trl.experimental import orpo
    return orpo


def train(
    cfg: OrpoConfig,
    sft_model: Path,
    data_dir: Path,
    out_dir: Path,
    work_dir: Path,
    log_metrics: LogMetrics | None = None,
) -> dict[str, float]:
    from rlhf_pipeline.trainers.algorithms.loop import stage_callbacks, train_and_save
    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.models.handoff import upstream_policy

    orpo = trl_orpo()
    # The TRL config first: a combination TRL refuses fails before any weights load. Its pair collator needs the
    # prompt/chosen/rejected columns kept (TRL would turn remove_unused_columns off itself, with a warning).
    args = orpo.ORPOConfig(
        **{**cfg.trl_arguments(work_dir), "remove_unused_columns": False},
        max_length=cfg.max_length,
        beta=cfg.beta,
        **cfg.eval_arguments(),
    )
    policy, tokenizer, peft_config = upstream_policy(sft_model, cfg.lora, attn_implementation=cfg.attn_implementation)
    trainer = orpo.ORPOTrainer(
        model=policy,
        args=args,
        train_dataset=load_split(data_dir, "preference"),
        eval_dataset=load_split(data_dir, "preference_eval") if cfg.evaluates else None,
        compute_metrics=cfg.metrics_function(),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=stage_callbacks("orpo", log_metrics, cfg),
    )
    return train_and_save("orpo", trainer, tokenizer, cfg, work_dir, out_dir)
