"""Reward modelling with TRL's RewardTrainer (Bradley-Terry on preference pairs).

The reward model starts from the SFT model with a scalar head, as in InstructGPT,
so it reads answers the way the policy writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from rlhf_pipeline.trainers.common import EvalDuringTraining, LogMetrics, TrainingConfig


class RewardModelConfig(EvalDuringTraining, TrainingConfig):
    trl_config: ClassVar[str] = "RewardConfig"
    learning_rate: float = Field(1e-4, gt=0, description="Peak learning rate (TRL RewardConfig default 1e-4).")
    center_rewards_coefficient: float | None = Field(None, ge=0, description="Pull mean reward towards 0 (TRL RewardConfig.center_rewards_coefficient).")

    def held_out(self) -> tuple[str, ...]:
        return ("preference_eval",) if self.evaluates else ()


def train(
    cfg: RewardModelConfig,
    sft_model: Path,
    data_dir: Path,
    out_dir: Path,
    work_dir: Path,
    log_metrics: LogMetrics | None = None,
) -> dict[str, float]:
    """Train a scalar reward head on `preference`; report pairwise accuracy on `preference_eval` if present."""
    import trl

    from rlhf_pipeline.trainers.common import (
        final_train_metrics,
        fit,
        has_adapter,
        load_sequence_classifier,
        load_split,
        load_tokenizer,
        save_on_main,
        stage_callbacks,
    )

    # The TRL config first: a combination TRL refuses fails before any weights load.
    args = trl.RewardConfig(
        **cfg.trl_arguments(work_dir),
        max_length=cfg.max_length,
        center_rewards_coefficient=cfg.center_rewards_coefficient,
        **cfg.eval_arguments(),
    )
    tokenizer = load_tokenizer(sft_model)
    if has_adapter(sft_model) and cfg.lora.handoff != "merge":
        raise ValueError(f"{sft_model} holds sft's LoRA adapter: the reward model starts from it merged (rm.lora.handoff=merge; a score head is added)")
    model = load_sequence_classifier(sft_model)
    model.config.pad_token_id = tokenizer.pad_token_id
    eval_path = data_dir / "datasets" / "preference_eval.parquet"
    eval_dataset = load_split(data_dir, "preference_eval") if eval_path.is_file() else None
    if cfg.evaluates and eval_dataset is None:
        raise ValueError(f"rm.eval_strategy={cfg.eval_strategy!r} evaluates on preference_eval, which the data stage did not write ({eval_path})")
    trainer = trl.RewardTrainer(
        model=model,
        args=args,
        train_dataset=load_split(data_dir, "preference"),
        eval_dataset=eval_dataset,
        compute_metrics=cfg.metrics_function(),
        processing_class=tokenizer,
        peft_config=cfg.lora.peft_config("SEQ_CLS"),
        callbacks=stage_callbacks("rm", log_metrics, cfg),
    )
    fit(trainer, cfg, work_dir, out_dir)
    metrics = final_train_metrics("rm", trainer)
    if eval_dataset is not None:
        trainer.evaluate()  # logs rm/eval/accuracy through the callback and into log_history
        metrics = final_train_metrics("rm", trainer)
    # GRPO/RLOO load a reward model by path together with its tokenizer (DESIGN.md).
    save_on_main(trainer, tokenizer, out_dir / "model", keep_adapter=cfg.lora.keep_adapter)
    return metrics
