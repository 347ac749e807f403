"""Kahneman-Tversky optimisation with TRL's KTOTrainer (Ethayarajh et al. 2024, arXiv:2402.01306).

KTO learns from unpaired binary feedback: each row is one completion labelled
desirable or not. It reads the same `preference` dataset as DPO: paired rows
(prompt/chosen/rejected) are split into one desirable and one undesirable row
each, unpaired rows (prompt/completion/label) are used as they are. The
reference model is the SFT model itself (TRL copies it when none is given).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rlhf_pipeline.trainers.algorithms.fields import TrainingConfig
from rlhf_pipeline.trainers.config import LogMetrics

KtoLoss = Literal["kto", "apo_zero_unpaired"]  # TRL 1.16 KTOConfig.loss_type choices


class KtoConfig(TrainingConfig):
    trl_config: ClassVar[str] = "KTOConfig"
    learning_rate: float = Field(1e-6, gt=0, description="Peak learning rate (TRL KTOConfig default 1e-6).")
    beta: float = Field(
        0.1, gt=0, description="KL strength to the reference model (TRL KTOConfig.beta); higher stays closer."
    )
    desirable_weight: float = Field(
        1.0, gt=0, description="Weight of the loss on desirable rows (lambda_D of the KTO paper, Eq. 7)."
    )
    undesirable_weight: float = Field(
        1.0, gt=0, description="Weight of the loss on undesirable rows (lambda_U of the KTO paper, Eq. 7)."
    )
    loss_type: KtoLoss = Field(
        "kto",
        description=(
            "'kto': the KTO loss (Eq. 7, with the batch KL reference point); 'apo_zero_unpaired': unpaired APO-zero "
            "(no KL term)."
        ),
    )

    @model_validator(mode="after")
    def _kl_estimate_needs_a_batch(self):
        if self.loss_type == "apo_zero_unpaired":
            return self
        # TRL estimates KTO's reference point z0 from mismatched pairs: each prompt with the completion of
        # its neighbour in the same per-device batch. One row per batch would pair a prompt with its own
        # completion, and the KL term would equal the implied reward.
        if self.per_device_train_batch_size < 2:
            raise ValueError(
                f"per_device_train_batch_size={self.per_device_train_batch_size} with loss_type='kto': the KL "
                "estimate pairs each prompt with another row's completion of the same per-device batch, so it needs "
                "at least 2 rows (or use loss_type='apo_zero_unpaired', which has no KL term)"
            )
        # The mismatched completions are fixed per batch of the dataset order; only sequential sampling keeps them.
        sampling = self.trl_overrides.get("train_sampling_strategy", "sequential")
        if sampling != "sequential":
            raise ValueError(
                f"trl_overrides.train_sampling_strategy={sampling!r} with loss_type='kto': TRL precomputes each row's "
                "KL completion from its neighbours in dataset order, which needs 'sequential' (the rows are shuffled "
                "once, with `seed`, instead)"
            )
        return self


def train(
    cfg: KtoConfig,
    sft_model: Path,
    data_dir: Path,
    out_dir: Path,
    work_dir: Path,
    log_metrics: LogMetrics | None = None,
) -> dict[str, float]:
    import trl
    from trl.data_utils import maybe_extract_prompt, unpair_preference_dataset

    from rlhf_pipeline.trainers.algorithms.loop import stage_callbacks, train_and_save
    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.models.handoff import upstream_policy

    rows = load_split(data_dir, "preference")
    if "chosen" in rows.column_names and "rejected" in rows.column_names:
        # TRL would unpair them itself, but into blocks (1,000 desirable rows, then their 1,000 undesirable twins) ...
        # An implicit prompt (the turns chosen and rejected share) must come out before the pair is split.
        rows = unpair_preference_dataset(rows.map(maybe_extract_prompt))
    # ... and KTO samples sequentially (see KtoConfig), so batches keep the file's order: shuffle once, seeded,
    # so that every batch mixes both labels and a resumed run sees the same order.
    rows = rows.shuffle(seed=cfg.seed)
    # The TRL config first: a combination TRL refuses fails before any weights load.
    args = trl.KTOConfig(
        **cfg.trl_arguments(work_dir),
        max_length=cfg.max_length,
        beta=cfg.beta,
        desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight,
        loss_type=cfg.loss_type,
    )
    policy, tokenizer, peft_config = upstream_policy(sft_model, cfg.lora, attn_implementation=cfg.attn_implementation)
    trainer = trl.KTOTrainer(
        model=policy,
        args=args,
        train_dataset=rows,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=stage_callbacks("kto", log_metrics, cfg),
    )
    return train_and_save("kto", trainer, tokenizer, cfg, work_dir, out_dir)
