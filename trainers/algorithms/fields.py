"""The fields every TRL-backed stage shares (sft, rm, dpo, kto, orpo, grpo, rloo): TrainingArguments' names, the TRL
overrides a block may pass (checked against the TRL config class), and the user's own optimizer and callbacks."""

from __future__ import annotations

import difflib
import warnings
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from rlhf_pipeline.trainers.config import (
    AttentionField,
    Customisation,
    LoraConfig,
    check_optimizer_name,
    check_precision_fields,
    device_precision,
)

MANAGED_ARGUMENTS = frozenset({"output_dir", "report_to", "use_cpu", "save_only_model"})
"""TRL arguments the pipeline sets itself: overriding them would break resume, the device choice or tracking."""
ALIASES = {
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing",
    "gradient_checkpointing_kwargs": "gradient_checkpointing",
}
"""TRL/transformers arguments a block field sets under another name (transformers 5 renamed gradient checkpointing)."""


def trl_config_fields(name: str) -> set[str]:
    """The fields of a TRL config class, named by its path under `trl` ("DPOConfig", "experimental.orpo.ORPOConfig");
    imported only when a stage has overrides to check."""
    import dataclasses
    import importlib

    module, _, cls = f"trl.{name}".rpartition(".")
    with warnings.catch_warnings():  # TRL's experimental trainers warn on import that their API may change: we pin TRL
        warnings.filterwarnings("ignore", message=r"You are importing from 'trl\.experimental'")
        return {field.name for field in dataclasses.fields(getattr(importlib.import_module(module), cls))}


class TrainingFields(AttentionField):
    """Fields shared by the TRL-backed stages; names follow transformers' TrainingArguments."""

    learning_rate: float = Field(2e-5, gt=0, description="Peak learning rate (AdamW).")
    max_steps: int = Field(500, ge=1, description="Optimizer steps to train for.")
    per_device_train_batch_size: int = Field(8, ge=1, description="Examples per device per forward pass.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Forward passes per optimizer step.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    lr_scheduler_type: Literal[
        "linear",
        "cosine",
        "cosine_with_restarts",
        "cosine_with_min_lr",
        "polynomial",
        "constant",
        "constant_with_warmup",
        "inverse_sqrt",
        "warmup_stable_decay",
    ] = Field("linear", description="Learning-rate schedule after warm-up (transformers' names).")
    lr_scheduler_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Arguments of the schedule, e.g. {min_lr_rate: 0.1} for cosine_with_min_lr, {num_cycles: 2} for restarts."
        ),
    )
    optim: str = Field(
        "adamw_torch_fused",
        description=(
            "Optimizer by transformers' name (default: transformers' own): adamw_torch_fused, adamw_torch, adafactor, "
            "sgd, adagrad, rmsprop, adamw_8bit / paged_adamw_8bit (bitsandbytes, GPU), ..."
        ),
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    max_length: int = Field(
        1024,
        ge=8,
        description="Longest tokenized sequence; longer ones are truncated or dropped (TRL's rule per trainer).",
    )
    logging_steps: int = Field(10, ge=1, description="Log metrics every this many steps.")
    save_steps: int = Field(
        200, ge=1, description="Checkpoint every this many steps; a retried stage resumes from the newest."
    )
    seed: int = Field(42, description="Seed for data order and dropout.")
    gradient_checkpointing: bool = Field(
        False,
        description=(
            "Recompute each layer's activations in the backward pass instead of keeping them (torch's non-reentrant "
            "checkpointing): activation memory for ~20-50% more compute. Off by default (TRL's default is on; it made "
            "the tiny model's sft ~47% slower)."
        ),
    )
    bf16: bool | None = Field(None, description="bfloat16 mixed precision. None: on when a CUDA device supports it.")
    fp16: bool = Field(
        False, description="float16 mixed precision with loss scaling (GPUs without bfloat16); not with bf16."
    )
    tf32: bool | None = Field(
        None, description="TensorFloat-32 matmuls on Ampere and newer GPUs. None: torch's default."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters (peft).")
    trl_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Any other argument of the TRL config of this stage, passed through unchanged (not one this block "
            "declares)."
        ),
    )

    trl_config: ClassVar[str] = ""
    """The TRL config class the stage builds, by its path under `trl` (`SFTConfig`, `experimental.orpo.ORPOConfig`):
    `trl_overrides` may only name its fields."""

    @model_validator(mode="after")
    def _known_optimizer_and_one_precision(self):
        """A misspelt optimizer, a bitsandbytes one without bitsandbytes, or two precisions at once fail here, not once
        the weights are loaded."""
        check_precision_fields(self.bf16, self.fp16)
        check_optimizer_name(self.optim, "adamw_torch_fused")
        return self

    @model_validator(mode="after")
    def _honest_overrides(self):
        """A key that shadows a declared field would be silently overwritten or overwrite it; a key TRL does not
        have would fail only when the weights are loaded. Both fail here, with the field to use."""
        if not self.trl_overrides:
            return self
        aliased = sorted(set(self.trl_overrides) & set(ALIASES))
        if aliased:
            raise ValueError(
                "trl_overrides sets "
                + "; ".join(f"{key!r}: set this block's field `{ALIASES[key]}` instead" for key in aliased)
            )
        shadowed = sorted(set(self.trl_overrides) & (set(type(self).model_fields) | MANAGED_ARGUMENTS))
        if shadowed:
            managed = [key for key in shadowed if key in MANAGED_ARGUMENTS]
            raise ValueError(
                f"trl_overrides sets {shadowed}: "
                + "; ".join(
                    f"{key!r} is this block's field `{key}`: set it there" for key in shadowed if key not in managed
                )
                + "".join(
                    f"{'; ' if len(shadowed) > len(managed) else ''}{key!r} is managed by the pipeline (checkpoints, "
                    "device, tracking)"
                    for key in managed
                )
            )
        if self.trl_config:
            known = trl_config_fields(self.trl_config)
            unknown = sorted(set(self.trl_overrides) - known)
            if unknown:
                close = {key: difflib.get_close_matches(key, known, n=1) for key in unknown}
                hints = ", ".join(
                    f"{key!r}" + (f" (did you mean {match[0]!r}?)" if match else "") for key, match in close.items()
                )
                raise ValueError(f"trl_overrides names {hints}, which trl.{self.trl_config} does not have")
        return self

    def row_token_limit(self) -> int:
        """The most tokens one row of the datasets this stage reads may take (the data stage checks it)."""
        return self.max_length

    def longest_sequence(self) -> int:
        return self.max_length

    def adapters(self) -> LoraConfig:
        return self.lora

    def keeps_best_checkpoint(self) -> bool:
        """Whether the Trainer publishes its best checkpoint (`load_best_model_at_end`, with evaluation while
        training), not its last."""
        return False

    def trl_arguments(self, work_dir: Path) -> dict[str, Any]:
        """Keyword arguments shared by every TRL config (SFTConfig, RewardConfig, DPOConfig...)."""
        import torch

        from rlhf_pipeline.trainers.attention import check_device

        cuda = torch.cuda.is_available()
        bf16 = device_precision(self.bf16, self.fp16, self.tf32)
        check_device(self.attn_implementation)  # the models load after this, with `attention.loading`
        return {
            "output_dir": str(work_dir),
            "learning_rate": self.learning_rate,
            "max_steps": self.max_steps,
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "warmup_steps": self.warmup_steps,
            "lr_scheduler_type": self.lr_scheduler_type,
            "lr_scheduler_kwargs": dict(self.lr_scheduler_kwargs),
            "optim": self.optim,
            "fp16": self.fp16,
            "tf32": self.tf32,
            "weight_decay": self.weight_decay,
            "max_grad_norm": self.max_grad_norm,
            "logging_steps": self.logging_steps,
            "save_steps": self.save_steps,
            "save_total_limit": 2,
            "seed": self.seed,
            "bf16": bf16,
            "use_cpu": not cuda,
            # TRL turns checkpointing on by default; it made tiny SFT ~47% slower, so it is the block's choice
            # (docs/LIBRARY-FACTS.md, TRL and transformers).
            # `activation_checkpointing` is transformers 5's name for `gradient_checkpointing`; non-reentrant
            # checkpointing needs no input that requires grad (LoRA's frozen embeddings) and works under DDP.
            "activation_checkpointing": self.gradient_checkpointing,
            **({"activation_checkpointing_kwargs": {"use_reentrant": False}} if self.gradient_checkpointing else {}),
            "report_to": "none",
            "save_only_model": False,
            # Under accelerate: every trained parameter takes part in each step (frozen ones have no grad), so DDP need
            # not search.
            "ddp_find_unused_parameters": False,
            **self.trl_overrides,
        }


class TrainingConfig(Customisation, TrainingFields):
    """A TRL-backed stage: TrainingArguments' fields (`TrainingFields`), then the user's own optimizer and callbacks."""
