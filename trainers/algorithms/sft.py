"""Supervised fine-tuning with TRL's SFTTrainer.

from rlhf_pipeline.trainers.algorithms.sft import SftConfig, train
metrics = train(SftConfig(), ModelConfig(), data_dir, out_dir, work_dir)
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator

from rlhf_pipeline.trainers.algorithms.fields import TrainingConfig
from rlhf_pipeline.trainers.config import EvalDuringTraining, LogMetrics, ModelConfig


class SftConfig(EvalDuringTraining, TrainingConfig):
    trl_config: ClassVar[str] = "SFTConfig"
    enabled: bool = Field(
        True,
        description=(
            "False: no supervised fine-tuning; the base model (a chat model, with its tokenizer and template) is the "
            "run's starting policy: DPO's reference, the online stages' initial policy and reference, eval's "
            "starting point. Needs no demonstrations (data.sft may be null)."
        ),
    )
    learning_rate: float = Field(2e-5, gt=0, description="Peak learning rate (TRL SFTConfig default 2e-5).")
    completion_only_loss: bool | None = Field(
        None,
        description="Train on completion tokens only (prompt-completion rows). None: TRL decides (on for such rows).",
    )
    assistant_only_loss: bool = Field(
        False,
        description=(
            "Train on assistant turns only (conversational rows): the tokens inside the chat template's "
            "{% generation %} marks. A template without marks trains with TRL's training version of it where TRL has "
            "one (Qwen2.5/3, Llama 3, Gemma, Phi-3, DeepSeek-V3, ...; the saved tokenizer keeps its own); the data "
            "stage checks on a sample conversation that the marks cover exactly the assistant turns."
        ),
    )
    packing: bool = Field(False, description="Pack several examples into one sequence of max_length.")
    padding_free: bool = Field(
        False,
        description=(
            "Concatenate each batch's rows into one, position_ids restarting per row (TRL SFTConfig.padding_free): no "
            "pad tokens, the same batches and losses. Faster when row lengths vary widely (bench.throughput: 2.3x on "
            "16..512-token rows, CPU); slower on short, even rows under sdpa/eager, whose mask then spans the whole "
            "flattened batch (the tiny preset: 0.5x). Best with flash attention."
        ),
    )
    eval_split: float | None = Field(
        None,
        gt=0,
        lt=1,
        description=(
            "Share of the demonstrations held out (seeded) for evaluation during training. None: the data block's "
            "`sft_eval` dataset."
        ),
    )

    @model_validator(mode="after")
    def _split_only_to_evaluate(self):
        if self.eval_split is not None and not self.evaluates:
            raise ValueError(
                f"eval_split={self.eval_split} holds out demonstrations for evaluation during training: set "
                "eval_strategy='steps' too"
            )
        return self

    def held_out(self) -> tuple[str, ...]:
        return ("sft_eval",) if self.enabled and self.evaluates and self.eval_split is None else ()

    def switched_off(self) -> bool:
        return not self.enabled

    def data_hint(self, dataset: str) -> str:
        if dataset == "sft_eval":
            return " or sft.eval_split (e.g. 0.05) to hold out a share of the demonstrations"
        return " (or sft.enabled=false to start from the base model, a chat model)"


def train(
    cfg: SftConfig,
    model: ModelConfig,
    data_dir: Path,
    out_dir: Path,
    work_dir: Path,
    log_metrics: LogMetrics | None = None,
) -> dict[str, float]:
    """Fine-tune the base model on `<data_dir>/datasets/sft.parquet`; write the model to `out_dir`. Evaluating during
    training, the held-out split is `eval_split` of it (seeded) or `sft_eval.parquet`. With `enabled: false`, write
    the base model as it loads (its tokenizer and template) and train nothing."""
    if not cfg.enabled:
        return start_from_base(model, out_dir)
    import trl

    from rlhf_pipeline.trainers.algorithms.loop import stage_callbacks, train_and_save
    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.models.base_model import added_token_ids, load_base_model, trainable_tokens
    from rlhf_pipeline.trainers.models.load import head_bias_through_trainable_tokens

    # The TRL config first: a combination TRL refuses fails before any weights load.
    args = trl.SFTConfig(
        **cfg.trl_arguments(work_dir),
        # TRL does not truncate padding-free rows and refuses a max_length it cannot enforce; the data stage's
        # fits_max_length rule already holds every row to max_length.
        max_length=None if cfg.padding_free and not cfg.packing else cfg.max_length,
        completion_only_loss=cfg.completion_only_loss,
        assistant_only_loss=cfg.assistant_only_loss,
        packing=cfg.packing,
        padding_free=cfg.padding_free,
        **cfg.eval_arguments(),
    )
    train_dataset, eval_dataset = load_split(data_dir, "sft"), None
    if cfg.evaluates:
        if cfg.eval_split is not None:
            split = train_dataset.train_test_split(test_size=cfg.eval_split, seed=cfg.seed)
            train_dataset, eval_dataset = split["train"], split["test"]
        else:
            eval_dataset = load_split(data_dir, "sft_eval")
    # QLoRA: the device is checked before any weights load
    policy, tokenizer = load_base_model(model, cfg.lora.bnb_config(), cfg.attn_implementation)
    trainer = trl.SFTTrainer(
        model=policy,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        compute_metrics=cfg.metrics_function(),
        processing_class=tokenizer,
        peft_config=cfg.lora.peft_config(trainable_tokens=trainable_tokens(policy, added_token_ids(model, tokenizer))),
        callbacks=stage_callbacks("sft", log_metrics, cfg),
    )
    head_bias_through_trainable_tokens(trainer.model)
    return train_and_save("sft", trainer, tokenizer, cfg, work_dir, out_dir)


SKIPPED = "sft/skipped"
"""Metric of an sft artifact that holds the base model untrained (`sft.enabled: false`)."""


def start_from_base(model: ModelConfig, out_dir: Path) -> dict[str, float]:
    """The base model as every stage after sft loads it (dtype, chat template, grown embeddings), saved as sft's
    model: the run starts from it."""
    from rlhf_pipeline.trainers.models.base_model import load_base_model
    from rlhf_pipeline.trainers.models.load import save_model

    policy, tokenizer = load_base_model(model)
    save_model(policy, tokenizer, out_dir / "model")
    return {SKIPPED: 1.0}
