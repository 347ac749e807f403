"""Direct preference optimisation with TRL's DPOTrainer (every TRL loss type).

The reference model is the SFT model itself (TRL copies it when none is given).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rlhf_pipeline.trainers.algorithms.fields import TrainingConfig
from rlhf_pipeline.trainers.config import EvalDuringTraining, LogMetrics

DpoLoss = Literal[
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]


class DpoConfig(EvalDuringTraining, TrainingConfig):
    trl_config: ClassVar[str] = "DPOConfig"
    learning_rate: float = Field(1e-6, gt=0, description="Peak learning rate (TRL DPOConfig default 1e-6).")
    beta: float = Field(0.1, gt=0, description="KL strength to the reference model (TRL DPOConfig.beta).")
    loss_type: list[DpoLoss] = Field(
        default_factory=lambda: ["sigmoid"],
        min_length=1,
        description="TRL DPO loss types; several are summed with `loss_weights` (e.g. ['sigmoid', 'sft'] for RPO).",
    )
    loss_weights: list[float] | None = Field(None, description="One weight per loss type; None: all 1.0.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Assumed label noise (cDPO / robust loss).")
    ref_model_quantization: Literal["none", "8bit", "4bit"] = Field(
        "none",
        description=(
            "Load the frozen reference model in 8 or 4 bits (bitsandbytes, CUDA GPU only), as TRL's guide does to "
            "save memory; not with lora, whose reference is the policy with its adapters off."
        ),
    )

    def held_out(self) -> tuple[str, ...]:
        return ("preference_eval",) if self.evaluates else ()

    @model_validator(mode="after")
    def _quantization_possible(self):
        if self.ref_model_quantization != "none":
            import importlib.util

            if self.lora.enabled:
                raise ValueError(
                    f"ref_model_quantization={self.ref_model_quantization!r} with lora: the reference is the policy "
                    "with its adapters off, so there is no separate reference to quantize"
                )
            if importlib.util.find_spec("bitsandbytes") is None:
                raise ValueError(
                    f"ref_model_quantization={self.ref_model_quantization!r} needs bitsandbytes (and a CUDA GPU), "
                    "which is not installed"
                )
        return self

    @model_validator(mode="after")
    def _weights_match_losses(self):
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(
                f"loss_weights has {len(self.loss_weights)} entries but loss_type has {len(self.loss_type)} "
                f"({self.loss_type}): give one weight per loss type"
            )
        return self


def train(
    cfg: DpoConfig,
    sft_model: Path,
    data_dir: Path,
    out_dir: Path,
    work_dir: Path,
    log_metrics: LogMetrics | None = None,
) -> dict[str, float]:
    import trl

    from rlhf_pipeline.trainers.algorithms.loop import stage_callbacks, train_and_save
    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.models.handoff import upstream_policy

    # The TRL config first: a combination TRL refuses fails before any weights load.
    args = trl.DPOConfig(
        **cfg.trl_arguments(work_dir),
        max_length=cfg.max_length,
        beta=cfg.beta,
        loss_type=list(cfg.loss_type),
        loss_weights=cfg.loss_weights,
        label_smoothing=cfg.label_smoothing,
        **cfg.eval_arguments(),
    )
    ref_model = None
    if cfg.ref_model_quantization != "none":
        # Checks the device before loading anything
        ref_model = quantized_reference(sft_model, cfg.ref_model_quantization, cfg.attn_implementation)
    policy, tokenizer, peft_config = upstream_policy(sft_model, cfg.lora, attn_implementation=cfg.attn_implementation)
    trainer = trl.DPOTrainer(
        model=policy,
        ref_model=ref_model,
        args=args,
        train_dataset=load_split(data_dir, "preference"),
        eval_dataset=load_split(data_dir, "preference_eval") if cfg.evaluates else None,
        compute_metrics=cfg.metrics_function(),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=stage_callbacks("dpo", log_metrics, cfg),
    )
    return train_and_save("dpo", trainer, tokenizer, cfg, work_dir, out_dir)


def quantized_reference(sft_model: Path, bits: str, attn_implementation: str | None = None):
    """The SFT model in 8 or 4 bits (bitsandbytes) on the GPU, frozen: DPO's reference (TRL's "training customization"
    guide)."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"ref_model_quantization={bits!r}: bitsandbytes quantizes on a CUDA GPU, and this machine trains on cpu"
        )
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from rlhf_pipeline.trainers.attention import loading

    quantization = (
        BitsAndBytesConfig(load_in_8bit=True)
        if bits == "8bit"
        else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(sft_model),
        quantization_config=quantization,
        device_map={"": torch.cuda.current_device()},
        **loading(attn_implementation),
    )
    return model.eval().requires_grad_(False)
