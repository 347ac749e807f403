"""Supervised fine-tuning with TRL's SFTTrainer.

from rlhf_pipeline.trainers.sft import SftConfig, train
metrics = train(SftConfig(), ModelConfig(), data_dir, out_dir, work_dir)
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from rlhf_pipeline.trainers.common import LogMetrics, ModelConfig, TrainingConfig


class SftConfig(TrainingConfig):
    trl_config: ClassVar[str] = "SFTConfig"
    learning_rate: float = Field(2e-5, gt=0, description="Peak learning rate (TRL SFTConfig default 2e-5).")
    completion_only_loss: bool | None = Field(
        None, description="Train on completion tokens only (prompt-completion rows). None: TRL decides (on for such rows)."
    )
    assistant_only_loss: bool = Field(False, description="Train on assistant turns only (conversational rows); needs {% generation %} in the chat template.")
    packing: bool = Field(False, description="Pack several examples into one sequence of max_length.")


def train(
    cfg: SftConfig,
    model: ModelConfig,
    data_dir: Path,
    out_dir: Path,
    work_dir: Path,
    log_metrics: LogMetrics | None = None,
) -> dict[str, float]:
    """Fine-tune the base model on `<data_dir>/datasets/sft.parquet`; write the model to `out_dir`."""
    import trl

    from rlhf_pipeline.trainers.base import load_base_model
    from rlhf_pipeline.trainers.common import load_split, stage_callbacks, train_and_save

    # The TRL config first: a combination TRL refuses fails before any weights load.
    args = trl.SFTConfig(
        **cfg.trl_arguments(work_dir),
        max_length=cfg.max_length,
        completion_only_loss=cfg.completion_only_loss,
        assistant_only_loss=cfg.assistant_only_loss,
        packing=cfg.packing,
    )
    policy, tokenizer = load_base_model(model)
    trainer = trl.SFTTrainer(
        model=policy,
        args=args,
        train_dataset=load_split(data_dir, "sft"),
        processing_class=tokenizer,
        peft_config=cfg.lora.peft_config(),
        callbacks=stage_callbacks("sft", log_metrics),
    )
    return train_and_save("sft", trainer, tokenizer, cfg.lora, work_dir, out_dir)
