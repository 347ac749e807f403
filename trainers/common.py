"""What every trainer shares: the model config, loading and saving, TRL arguments, metric logging.

Heavy libraries (torch, transformers, trl) are imported inside the functions that
need them, so that config classes stay cheap to import for the flow and the CLI.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
import os
import re
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

LogMetrics = Callable[[dict[str, float], int], None]
"""Receives `{"<stage>/<split>/<name>": value}` and the global step."""

TINY = "tiny"


class StrictModel(BaseModel):
    """Frozen, and unknown keys are an error (a typo in a preset must not pass silently)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class TinyModelConfig(StrictModel):
    """The embedded default: a small Llama built from a config, no download."""

    hidden_size: int = Field(128, ge=8, description="Width of the residual stream.")
    intermediate_size: int = Field(512, ge=8, description="Width of the MLP.")
    num_hidden_layers: int = Field(4, ge=1, description="Number of transformer blocks.")
    num_attention_heads: int = Field(4, ge=1, description="Attention heads per block.")
    max_position_embeddings: int = Field(2048, ge=16, description="Longest sequence the model accepts (RoPE: costs no parameters).")


class ModelConfig(StrictModel):
    name_or_path: str = Field(
        TINY,
        description="Base model: 'tiny' (built locally from `tiny`), a hub id such as 'Qwen/Qwen2.5-0.5B', or a local folder.",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the base model.")
    trust_remote_code: bool = Field(False, description="Run model code shipped with a hub repository. Off unless you trust it.")
    seed: int = Field(0, description="Seed of the tiny model's initial weights (same seed, same base model).")
    chat_template: str | None = Field(
        None,
        description="Chat template for conversational data: 'chatml' or a Jinja file; None: the tokenizer's own. Its special tokens are "
        "added (embeddings resized) and it is saved with every stage's tokenizer. A base model without a template needs one.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Dtype the base weights are loaded, trained and saved in. float32 (default): master weights in full precision, so a "
        "bf16/fp16 checkpoint is upcast and mixed precision comes from each stage's `bf16`; bfloat16/float16: pure low-precision "
        "training (half the memory; AdamW updates smaller than the weights' precision are lost).",
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Architecture of the tiny model.")


class LoraConfig(StrictModel):
    """LoRA through peft. The stage's output is a merged, loadable model unless `keep_adapter`."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of all weights.")
    r: int = Field(16, ge=1, description="Adapter rank (peft LoraConfig.r).")
    lora_alpha: int = Field(32, ge=1, description="Adapter scaling numerator (peft LoraConfig.lora_alpha).")
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: str | list[str] = Field("all-linear", description="Modules that get adapters ('all-linear' or names).")
    keep_adapter: bool = Field(
        False,
        description="Save the adapter alone (adapter_model.safetensors) instead of merging it; the base model is found by its hub id or "
        "path, or saved beside the adapter (model/base) when it has neither (the tiny model). Later stages then choose `handoff`.",
    )
    handoff: Literal["merge", "stack"] | None = Field(
        None,
        description="How this stage continues from an upstream stage that kept its LoRA adapter (sft.lora.keep_adapter): 'merge' folds it "
        "into the weights (then this block's own LoRA, if enabled, trains on top); 'stack' trains that adapter on, with a frozen copy "
        "of it as the reference (TRL's 'ref' adapter; this block's r/alpha do not apply). Must be chosen when the upstream kept one.",
    )

    quantization: Literal["none", "4bit"] = Field(
        "none",
        description="QLoRA: the frozen base in 4 bits (bitsandbytes NF4 with double quantization, bf16 compute), the adapters trained "
        "on top; CUDA GPU and bitsandbytes only. In the stages after sft it applies to a stacked adapter's base.",
    )

    @model_validator(mode="after")
    def _quantization_possible(self):
        if self.quantization != "none":
            import importlib.util

            if self.handoff == "merge":
                raise ValueError(f"lora.quantization={self.quantization!r} with handoff=merge: an adapter cannot be merged into 4-bit weights; stack it")
            if not (self.enabled or self.handoff == "stack"):
                raise ValueError(f"lora.quantization={self.quantization!r} quantizes the frozen base under adapters: set lora.enabled=true")
            if importlib.util.find_spec("bitsandbytes") is None:
                raise ValueError(f"lora.quantization={self.quantization!r} (QLoRA) needs bitsandbytes and a CUDA GPU; bitsandbytes is not installed")
        return self

    def bnb_config(self):
        """transformers' BitsAndBytesConfig for QLoRA (None without quantization); the device is checked before any weights load."""
        if self.quantization == "none":
            return None
        import torch
        from transformers import BitsAndBytesConfig

        if not torch.cuda.is_available():
            raise ValueError(f"lora.quantization={self.quantization!r} (QLoRA): bitsandbytes quantizes on a CUDA GPU, and this machine trains on cpu")
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)

    def peft_config(self, task_type: str = "CAUSAL_LM", trainable_tokens: list[int] | dict[str, list[int]] | None = None):
        """A peft.LoraConfig, or None when LoRA is off; `trainable_tokens` (`base.trainable_tokens`): embedding rows that train too."""
        if not self.enabled:
            return None
        import peft

        return peft.LoraConfig(
            r=self.r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=self.target_modules,
            task_type=task_type,
            trainable_token_indices=trainable_tokens,
        )


class CallbackSpec(StrictModel):
    """A transformers `TrainerCallback` class and the keyword arguments it is built with."""

    path: str = Field(description="'package.module:Class' of a transformers TrainerCallback subclass.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the class (JSON values).")

    @model_validator(mode="after")
    def _a_trainer_callback(self):
        from transformers import TrainerCallback

        from rlhf_pipeline.trainers.custom import import_object

        cls = import_object(self.path, "callback")
        if not (isinstance(cls, type) and issubclass(cls, TrainerCallback)):
            raise ValueError(f"callback {self.path!r} is not a subclass of transformers.TrainerCallback")
        try:
            inspect.signature(cls).bind(**self.kwargs)
        except TypeError as exc:
            raise ValueError(f"callback {self.path!r} cannot be built with kwargs {self.kwargs}: {exc}") from exc
        return self

    def build(self):
        from rlhf_pipeline.trainers.custom import import_object

        return import_object(self.path, "callback")(**self.kwargs)


class Customisation(StrictModel):
    """Code of the user's that a stage runs beside ours: its own optimizer and callbacks."""

    optimizer_factory: str | None = Field(
        None,
        description="'package.module:function' of fn(model, args) -> (optimizer, lr_scheduler or None), passed to the trainer as its "
        "optimizers (args: the stage's transformers TrainingArguments; scheduler None: the stage's lr_scheduler_type drives the "
        "optimizer). Its state is checkpointed and restored on resume. For ppo, model holds .policy and .value_model.",
    )
    callbacks: list[CallbackSpec] = Field(
        default_factory=list,
        description="transformers TrainerCallbacks run beside the pipeline's own (ppo calls on_train_begin, on_step_end, on_log, on_save and "
        "on_train_end at the matching points). One that sets control.should_training_stop ends the stage early: it publishes what it has, "
        "tagged stopped early.",
    )

    @field_validator("optimizer_factory")
    @classmethod
    def _factory_importable(cls, path: str | None) -> str | None:
        if path is not None:
            from rlhf_pipeline.trainers.custom import import_callable

            import_callable(path, "optimizer_factory", positional=2)
        return path

    def code_paths(self) -> list[str]:
        """Import paths whose source keys the stage."""
        return [*([self.optimizer_factory] if self.optimizer_factory else []), *(spec.path for spec in self.callbacks)]

    def user_callbacks(self) -> list:
        return [spec.build() for spec in self.callbacks]


class EvalDuringTraining(StrictModel):
    """Evaluation on the stage's held-out split while it trains (sft, rm, dpo), as transformers' Trainer does it."""

    eval_strategy: Literal["no", "steps", "epoch"] = Field(
        "no", description="Evaluate on the stage's held-out split every eval_steps ('steps') or epoch; logged as <stage>/eval/<name> curves."
    )
    eval_steps: int | None = Field(None, ge=1, description="Steps between evaluations (eval_strategy='steps'). None: logging_steps.")
    per_device_eval_batch_size: int = Field(8, ge=1, description="Examples per device per evaluation forward pass.")
    compute_metrics: str | None = Field(
        None,
        description="'package.module:function' of fn(eval_prediction) -> {name: value} (transformers' compute_metrics), logged as "
        "<stage>/eval/<name> beside the trainer's own eval metrics.",
    )
    load_best_model_at_end: bool = Field(
        False, description="Publish the checkpoint with the best metric_for_best_model instead of the last (needs save_steps a multiple of eval_steps)."
    )
    metric_for_best_model: str | None = Field(
        None, description="Eval metric that picks the best checkpoint, without the eval_ prefix (e.g. 'loss', 'accuracy'). None: 'loss'."
    )
    greater_is_better: bool | None = Field(None, description="Whether a larger metric_for_best_model is better. None: False for a loss, True otherwise.")

    @field_validator("compute_metrics")
    @classmethod
    def _metrics_importable(cls, path: str | None) -> str | None:
        if path is not None:
            from rlhf_pipeline.trainers.custom import import_callable

            import_callable(path, "compute_metrics", positional=1)
        return path

    @model_validator(mode="after")
    def _evaluation_agrees(self):
        if self.eval_strategy == "no":
            given = [name for name in ("eval_steps", "compute_metrics", "load_best_model_at_end", "metric_for_best_model") if getattr(self, name)]
            if given:
                raise ValueError(f"{', '.join(given)} only apply while evaluating: set eval_strategy='steps' (or 'epoch')")
        elif self.load_best_model_at_end and self.eval_strategy == "steps":
            every, saves = self.eval_steps or getattr(self, "logging_steps", 1), getattr(self, "save_steps", 1)
            if saves % every:
                raise ValueError(
                    f"load_best_model_at_end picks among the checkpoints, which are saved every save_steps={saves}: it must be a multiple of "
                    f"eval_steps={every}, so each checkpoint has an evaluation"
                )
        return self

    @property
    def evaluates(self) -> bool:
        return self.eval_strategy != "no"

    def held_out(self) -> tuple[str, ...]:
        """Datasets of the `data` stage it reads only to evaluate (each stage names its own)."""
        return ()

    def eval_arguments(self) -> dict[str, Any]:
        """The TrainingArguments of evaluation during training."""
        if not self.evaluates:
            return {"eval_strategy": "no"}
        metric = self.metric_for_best_model or "loss"
        return {
            "eval_strategy": self.eval_strategy,
            "eval_steps": self.eval_steps or getattr(self, "logging_steps", None),
            "per_device_eval_batch_size": self.per_device_eval_batch_size,
            "load_best_model_at_end": self.load_best_model_at_end,
            **({"metric_for_best_model": metric, "greater_is_better": self.greater_is_better} if self.load_best_model_at_end else {}),
        }

    def metrics_function(self) -> Callable | None:
        if self.compute_metrics is None:
            return None
        from rlhf_pipeline.trainers.custom import import_callable

        return import_callable(self.compute_metrics, "compute_metrics", positional=1)

    def code_paths(self) -> list[str]:
        return [*super().code_paths(), *([self.compute_metrics] if self.compute_metrics else [])]  # type: ignore[misc]


MANAGED_ARGUMENTS = frozenset({"output_dir", "report_to", "use_cpu", "save_only_model", "activation_checkpointing"})
"""TRL arguments the pipeline sets itself: overriding them would break resume, the device choice or tracking."""


def check_precision_fields(bf16: bool | None, fp16: bool) -> None:
    if bf16 and fp16:
        raise ValueError("bf16 and fp16 are both on: choose one mixed precision (bf16 where the GPU has it)")


def check_optimizer_name(optim: str, default: str) -> None:
    """A transformers optimizer name (`OptimizerNames`), with a did-you-mean; a bitsandbytes one needs bitsandbytes installed."""
    if optim == default:
        return
    from transformers.training_args import OptimizerNames

    known = [name.value for name in OptimizerNames]
    if optim not in known:
        close = difflib.get_close_matches(optim, known, n=1)
        raise ValueError(f"optim={optim!r} is not an optimizer of transformers" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if any(part in optim for part in ("8bit", "bnb", "paged", "32bit")):
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(f"optim={optim!r} needs bitsandbytes (and a CUDA GPU), which is not installed")


def device_precision(bf16: bool | None, fp16: bool, tf32: bool | None) -> bool:
    """Whether bf16 is on (None: where the CUDA device has it). A precision this machine's device lacks is refused
    before any weights load, naming the device (transformers would fail later, or on a CPU silently not at all)."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    if fp16 and not cuda:
        raise ValueError(f"fp16=true needs a CUDA GPU; this machine trains on {device} (bf16 works on CPU)")
    if bf16 and cuda and not torch.cuda.is_bf16_supported():
        raise ValueError(f"bf16=true: {device} has no bfloat16; use fp16=true")
    if tf32 and not (cuda and torch.cuda.get_device_capability()[0] >= 8):
        raise ValueError(f"tf32=true needs an Ampere or newer GPU; this machine trains on {device}")
    return bool(bf16 if bf16 is not None else (cuda and torch.cuda.is_bf16_supported()))


def trl_config_fields(name: str) -> set[str]:
    """The fields of a TRL config class (imported only when a stage has overrides to check)."""
    import dataclasses

    import trl

    return {field.name for field in dataclasses.fields(getattr(trl, name))}


class TrainingFields(StrictModel):
    """Fields shared by the TRL-backed stages; names follow transformers' TrainingArguments."""

    learning_rate: float = Field(2e-5, gt=0, description="Peak learning rate (AdamW).")
    max_steps: int = Field(500, ge=1, description="Optimizer steps to train for.")
    per_device_train_batch_size: int = Field(8, ge=1, description="Examples per device per forward pass.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Forward passes per optimizer step.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    lr_scheduler_type: Literal[
        "linear", "cosine", "cosine_with_restarts", "cosine_with_min_lr", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt",
        "warmup_stable_decay",
    ] = Field("linear", description="Learning-rate schedule after warm-up (transformers' names).")  # fmt: skip
    lr_scheduler_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Arguments of the schedule, e.g. {min_lr_rate: 0.1} for cosine_with_min_lr, {num_cycles: 2} for restarts."
    )
    optim: str = Field(
        "adamw_torch_fused",
        description="Optimizer by transformers' name (default: transformers' own): adamw_torch_fused, adamw_torch, adafactor, sgd, adagrad, rmsprop, "
        "adamw_8bit / paged_adamw_8bit (bitsandbytes, GPU), ...",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    max_length: int = Field(1024, ge=8, description="Longest tokenized sequence; longer ones are truncated or dropped (TRL's rule per trainer).")
    logging_steps: int = Field(10, ge=1, description="Log metrics every this many steps.")
    save_steps: int = Field(200, ge=1, description="Checkpoint every this many steps; a retried stage resumes from the newest.")
    seed: int = Field(42, description="Seed for data order and dropout.")
    bf16: bool | None = Field(None, description="bfloat16 mixed precision. None: on when a CUDA device supports it.")
    fp16: bool = Field(False, description="float16 mixed precision with loss scaling (GPUs without bfloat16); not with bf16.")
    tf32: bool | None = Field(None, description="TensorFloat-32 matmuls on Ampere and newer GPUs. None: torch's default.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters (peft).")
    trl_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other argument of the TRL config of this stage, passed through unchanged (not one this block declares).",
    )

    trl_config: ClassVar[str] = ""
    """The TRL config class the stage builds (`SFTConfig`...): `trl_overrides` may only name its fields."""

    @model_validator(mode="after")
    def _known_optimizer_and_one_precision(self):
        """A misspelt optimizer, a bitsandbytes one without bitsandbytes, or two precisions at once fail here, not once the weights are loaded."""
        check_precision_fields(self.bf16, self.fp16)
        check_optimizer_name(self.optim, "adamw_torch_fused")
        return self

    @model_validator(mode="after")
    def _honest_overrides(self):
        """A key that shadows a declared field would be silently overwritten or overwrite it; a key TRL does not
        have would fail only when the weights are loaded. Both fail here, with the field to use."""
        if not self.trl_overrides:
            return self
        shadowed = sorted(set(self.trl_overrides) & (set(type(self).model_fields) | MANAGED_ARGUMENTS))
        if shadowed:
            managed = [key for key in shadowed if key in MANAGED_ARGUMENTS]
            raise ValueError(
                f"trl_overrides sets {shadowed}: "
                + "; ".join(f"{key!r} is this block's field `{key}`: set it there" for key in shadowed if key not in managed)
                + "".join(
                    f"{'; ' if len(shadowed) > len(managed) else ''}{key!r} is managed by the pipeline (checkpoints, device, tracking)" for key in managed
                )
            )
        if self.trl_config:
            known = trl_config_fields(self.trl_config)
            unknown = sorted(set(self.trl_overrides) - known)
            if unknown:
                close = {key: difflib.get_close_matches(key, known, n=1) for key in unknown}
                hints = ", ".join(f"{key!r}" + (f" (did you mean {match[0]!r}?)" if match else "") for key, match in close.items())
                raise ValueError(f"trl_overrides names {hints}, which trl.{self.trl_config} does not have")
        return self

    def row_token_limit(self) -> int:
        """The most tokens one row of the datasets this stage reads may take (the data stage checks it)."""
        return self.max_length

    def trl_arguments(self, work_dir: Path) -> dict[str, Any]:
        """Keyword arguments shared by every TRL config (SFTConfig, RewardConfig, DPOConfig...)."""
        import torch

        cuda = torch.cuda.is_available()
        bf16 = device_precision(self.bf16, self.fp16, self.tf32)
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
            # TRL turns checkpointing on by default; it made tiny SFT ~47% slower (DESIGN.md).
            # `activation_checkpointing` is transformers 5's name for `gradient_checkpointing`.
            "activation_checkpointing": False,
            "report_to": "none",
            "save_only_model": False,
            # Under accelerate: every trained parameter takes part in each step (frozen ones have no grad), so DDP need not search.
            "ddp_find_unused_parameters": False,
            **self.trl_overrides,
        }


class TrainingConfig(Customisation, TrainingFields):
    """A TRL-backed stage: TrainingArguments' fields (`TrainingFields`), then the user's own optimizer and callbacks."""


# --- loading and saving -----------------------------------------------------------


def load_tokenizer(source: str | Path, revision: str | None = None, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of a model folder or hub id (the base model's: `trainers.base.load_base_tokenizer`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source), revision=revision, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model")  # fmt: skip


LOADING_KEYS = frozenset({"is_local", "local_files_only", "name_or_path", "_commit_hash", "revision", "trust_remote_code", "cache_dir", "token",
                          "use_auth_token", "force_download", "proxies", "subfolder", "_from_auto", "model_max_length"})  # fmt: skip
"""Keys `from_pretrained` writes back into tokenizer_config.json on a re-save: how it was loaded, not how it tokenizes."""


def tokenizer_digest(folder: str | Path) -> str:
    """sha256 of a model folder's tokenizer files (vocabulary, merges, special tokens, chat template): two folders
    with the same digest turn text into the same ids. JSON files are compared by content, without the loading
    options a re-save adds (a stage that loads and saves its upstream's tokenizer keeps its digest).
    '' for a folder without tokenizer files (a hub id)."""
    import hashlib
    import json

    digest, found = hashlib.sha256(), False
    for name in TOKENIZER_FILES:
        path = Path(folder) / name
        if not path.is_file():
            continue
        found = True
        data = path.read_bytes()
        if name.endswith(".json"):
            content = json.loads(data)
            if isinstance(content, dict):
                content = {key: value for key, value in content.items() if key not in LOADING_KEYS}
            data = json.dumps(content, sort_keys=True, ensure_ascii=False).encode()
        digest.update(name.encode() + b"\0" + data)
    return digest.hexdigest()[:32] if found else ""


ADAPTER_CONFIG = "adapter_config.json"


def has_adapter(folder: str | Path) -> bool:
    """The folder holds a LoRA adapter (a stage with lora.keep_adapter), not a whole model."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def load_causal_lm(path: str | Path, handoff: str | None = "merge") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model written by an earlier stage (`<artifact>/model`). An adapter folder is loaded onto its base and merged
    (`handoff="merge"`, what evaluation and references read), or kept as a trainable peft adapter (`"stack"`)."""
    from transformers import AutoModelForCausalLM

    if has_adapter(path):
        return load_adapter_model(path, AutoModelForCausalLM, handoff), load_tokenizer(path)
    return AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True), load_tokenizer(path)


def upstream_policy(sft_model: Path, lora: LoraConfig, task_type: str = "CAUSAL_LM"):
    """The policy a stage starts from, and the peft config to hand its TRL trainer: an upstream adapter merged (then this stage's
    own LoRA, if any) or stacked (trained on; TRL keeps a frozen 'ref' copy as the reference, and takes no new peft config)."""
    if has_adapter(sft_model) and lora.handoff is None:
        raise ValueError(f"{sft_model} holds sft's LoRA adapter (sft.lora.keep_adapter): choose lora.handoff=merge or stack for this stage")
    stacked = has_adapter(sft_model) and lora.handoff == "stack"
    if stacked and lora.quantization != "none":  # QLoRA: the stacked adapter on a 4-bit base
        from transformers import AutoModelForCausalLM

        quantized = load_adapter_model(sft_model, AutoModelForCausalLM, "stack", **quantized_loading(lora.bnb_config()))
        return quantized, load_tokenizer(sft_model), None
    if lora.quantization != "none" and not has_adapter(sft_model):  # QLoRA on a whole upstream model: new adapters on its 4-bit copy
        import peft
        from transformers import AutoModelForCausalLM

        quantized = AutoModelForCausalLM.from_pretrained(str(sft_model), use_safetensors=True, **quantized_loading(lora.bnb_config()))
        return peft.prepare_model_for_kbit_training(quantized, use_gradient_checkpointing=False), load_tokenizer(sft_model), lora.peft_config(task_type)
    policy, tokenizer = load_causal_lm(sft_model, lora.handoff or "merge")
    return policy, tokenizer, None if stacked else lora.peft_config(task_type)


def quantized_loading(bnb_config) -> dict[str, Any]:
    """`from_pretrained` arguments that load a base in 4 bits on this rank's GPU."""
    import os

    import torch

    return {"quantization_config": bnb_config, "device_map": {"": int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))}}


def load_sequence_classifier(path: str | Path, num_labels: int = 1):
    """A reward or value model from an earlier stage's folder: a whole model, or an adapter merged onto its base (a reward
    model's adapter carries its score head; a causal LM's adapter gets a fresh one)."""
    from transformers import AutoModelForSequenceClassification

    if has_adapter(path):
        return load_adapter_model(path, AutoModelForSequenceClassification, "merge", num_labels=num_labels)
    return AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=num_labels, use_safetensors=True)


def load_adapter_model(folder: str | Path, auto_class, handoff: str | None, **kwargs):
    """The base model (`<folder>/base`, else the adapter's `base_model_name_or_path`) with the folder's adapter on it."""
    import json

    from peft import PeftConfig, PeftModel

    folder = Path(folder)
    if handoff not in ("merge", "stack"):
        raise ValueError(f"{folder} holds a LoRA adapter: choose how to continue from it (lora.handoff: merge or stack)")
    base = folder / "base" if (folder / "base").is_dir() else json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{folder} holds a LoRA adapter whose base model is neither saved beside it (base/) nor named in {ADAPTER_CONFIG}")
    config = PeftConfig.from_pretrained(str(folder))
    if config.task_type == "CAUSAL_LM" and not auto_class.__name__.endswith("CausalLM"):
        config.task_type = None  # a causal LM's adapter on a reward/value model's backbone: the same layers, no generation wrapper
    model = auto_class.from_pretrained(str(base), use_safetensors=True, **kwargs)
    rows = len(load_tokenizer(folder))
    if rows > model.get_input_embeddings().weight.shape[0]:  # a named base, without the tokens its chat template added
        model.resize_token_embeddings(rows, mean_resizing=False)  # those rows come from the adapter (trainable tokens)
    model = PeftModel.from_pretrained(model, str(folder), config=config, is_trainable=handoff == "stack")
    if handoff == "stack":
        return head_bias_through_trainable_tokens(model)
    merged = model.merge_and_unload()
    merged.name_or_path = merged.config._name_or_path = ""  # no longer the named base: an adapter kept on it saves it (`_save_base`)
    return merged


def head_bias_through_trainable_tokens(model):
    """TRL's fused LM head (sft, dpo, kto, grpo, rloo) reads `lm_head.weight` and `lm_head.bias`. peft's trainable-tokens wrapper
    serves `weight` (the base rows with the trained ones copied in) but not `bias`: give it the wrapped head's, unregistered, so
    the state dict keeps its keys."""
    from peft.utils.other import TrainableTokensWrapper

    for module in model.modules():
        if isinstance(module, TrainableTokensWrapper) and "bias" not in module.__dict__:
            module.__dict__["bias"] = getattr(module.original_module, "bias", None)
    return model


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path, keep_adapter: bool = False, state_dict=None) -> Path:
    """Save weights (safetensors) and tokenizer (with its chat template); a peft model is merged first unless
    `keep_adapter`. A causal LM's generation config stops at EOS and the template's end of turn (TRL's
    GRPO/RLOO read their stop tokens from it)."""
    from rlhf_pipeline.trainers.templates import stop_token_ids

    out_dir.mkdir(parents=True, exist_ok=True)
    if "ref" in getattr(model, "peft_config", {}):  # TRL's frozen copy of a stacked adapter: the reference, not the result
        model.delete_adapter("ref")
    if hasattr(model, "merge_and_unload") and not keep_adapter:
        model = model.merge_and_unload()
    elif hasattr(model, "peft_config") and keep_adapter:
        _save_base(model, out_dir)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        stops = stop_token_ids(tokenizer)
        generation.eos_token_id = stops if len(stops) > 1 else stops[0]
        generation.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True, **({"state_dict": state_dict} if state_dict is not None else {}))
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _save_base(model, out_dir: Path) -> None:
    """Beside a kept adapter, the base it applies to when nothing else names it (a model built in memory, or a stacked adapter's base
    read from an upstream `base/`): later stages load the base from `<model>/base`."""
    import copy

    name = model.peft_config[model.active_adapter].base_model_name_or_path
    if name and Path(name).name != "base":
        return  # a hub id or a model folder of the user's: named in adapter_config.json
    base = copy.deepcopy(model).unload()  # the base weights, adapters taken out
    base.save_pretrained(out_dir / "base", safe_serialization=True)
    for adapter in model.peft_config.values():
        adapter.base_model_name_or_path = None  # found as base/ by `load_adapter_model`, wherever the artifact is


def load_split(data_dir: Path, name: str):
    """One dataset written by the `data` stage (`<data artifact>/datasets/<name>.parquet`)."""
    from datasets import Dataset

    return Dataset.from_parquet(str(data_dir / "datasets" / f"{name}.parquet"))


COMPLETE = "checkpoint.complete"
"""Written into a checkpoint folder once the trainer has saved all of it (weights, optimizer,
scheduler, RNG, trainer state): a folder without it was being written when the process died."""


def last_checkpoint(work_dir: Path) -> str | None:
    """Newest complete `checkpoint-N` folder, or None; half-written ones (no COMPLETE marker) are never used."""
    if not work_dir.is_dir():
        return None
    done = [p for p in work_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit() and (p / COMPLETE).is_file()]
    return str(max(done, key=lambda p: int(p.name.split("-")[-1]))) if done else None


# --- metrics ----------------------------------------------------------------------


def metric_name(stage: str, key: str) -> str:
    """TRL's `loss`, `eval_loss`, `rewards/chosen`, `train_runtime` -> `<stage>/<split>/<name>`."""
    if key == "train_loss":  # the end-of-training average; `loss` is the per-step value
        return f"{stage}/train/loss_average"
    split = "train"
    for prefix in ("eval_", "train_"):
        if key.startswith(prefix):
            split, key = prefix[:-1], key[len(prefix) :]
    return f"{stage}/{split}/{re.sub(r'[^A-Za-z0-9_.-]+', '_', key)}"


PROGRESS = logging.getLogger("rlhf_pipeline.trainers.progress")
"""Progress lines ("sft: step 40/300 (13%) ... eta 1m20s"); `trainers` is one of Prefect's extra loggers, so they reach the UI."""
PROGRESS.setLevel(logging.INFO)
CONSOLE_ENV = "RLHF_CONSOLE"
"""Set by `rlhf run` (unless --verbose): each stage draws one progress bar on the terminal, from `Progress`; the libraries'
bars and printed log dicts are off, and the progress lines go to the Prefect UI's logs only."""
KEY_METRICS = ("loss", "reward", "accuracy", "kl", "exact_match", "margin")
"""What a stage's bar shows, the first three of these it logs."""

# TRL 1.16's disable_gradient_checkpointing (trl/models/utils.py) reads transformers 5.24's deprecated property on every
# checkpoint and generation: a FutureWarning we cannot fix at its cause.
warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)


class Progress:
    """Step counter with rate and ETA, logged every time a stage logs metrics; under `rlhf run` (CONSOLE_ENV) also the
    stage's one bar on the terminal (rank 0's: `main`), advanced every step (`step`) and closed at the end (`close`)."""

    def __init__(self, stage: str, total: int, start_step: int = 0, main: bool = True):
        self.stage, self.total, self.start_step, self.started = stage, total, start_step, time.monotonic()
        self.bar = _console_bar(stage, total, start_step) if main and os.environ.get(CONSOLE_ENV) else None

    def step(self, step: int) -> None:
        if self.bar is not None and step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def log(self, step: int, values: dict[str, float]) -> None:
        elapsed = time.monotonic() - self.started
        done = step - self.start_step
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        shown = " ".join(f"{k.rsplit('/', 1)[-1]}={v:.4g}" for k, v in list(values.items())[:4])
        PROGRESS.info(f"{self.stage}: step {step}/{self.total} ({step / max(self.total, 1):.0%}) {shown} elapsed {_duration(elapsed)} eta {_duration(eta)}")
        if self.bar is not None:
            key = [(k.rsplit("/", 1)[-1], v) for k, v in values.items() if k.rsplit("/", 1)[-1] in KEY_METRICS][:3]
            self.bar.set_postfix_str(" ".join(f"{name}={value:.4g}" for name, value in key), refresh=False)
            self.step(step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _console_bar(stage: str, total: int, start_step: int):
    """One tqdm bar (step, rate, ETA, key metrics), drawn even where TQDM_DISABLE turns the libraries' bars off; the
    progress lines stop reaching the terminal (a second display of the same), and still reach the Prefect UI."""
    import sys

    from tqdm.auto import tqdm

    for handler in logging.getLogger("rlhf_pipeline").handlers + logging.getLogger().handlers:
        if type(handler).__name__ == "PrefectConsoleHandler" and not any(isinstance(f, _NotProgress) for f in handler.filters):
            handler.addFilter(_NotProgress())
    # Not a terminal (a pipe, a log file): tqdm writes each refresh as a line of its own, so refresh every 30 s there.
    every = 0.1 if sys.stderr.isatty() else 30.0
    return tqdm(total=total, initial=start_step, desc=stage, unit="step", file=sys.stderr, disable=False, dynamic_ncols=True, mininterval=every)


class _NotProgress(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != PROGRESS.name


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def stage_callbacks(stage: str, log_metrics: LogMetrics | None, cfg: Customisation | None = None) -> list:
    """The TrainerCallbacks of every TRL stage: metrics and progress, complete-checkpoint markers, then the user's (`cfg.callbacks`)."""
    from transformers import TrainerCallback

    class MarkComplete(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            # Called after the trainer wrote the whole checkpoint (and rotated old ones).
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir() and state.is_world_process_zero:
                (folder / COMPLETE).write_text(f"{state.global_step}\n")

    return [metrics_callback(stage, log_metrics), MarkComplete(), *(cfg.user_callbacks() if cfg is not None else [])]


def metrics_callback(stage: str, log_metrics: LogMetrics | None):
    """A transformers TrainerCallback that forwards every log line as namespaced metrics and logs progress."""
    from transformers import TrainerCallback

    class ForwardMetrics(TrainerCallback):
        progress: Progress | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.progress = Progress(stage, state.max_steps, state.global_step, main=state.is_world_process_zero)
            if args.world_size > 1 and state.is_world_process_zero:
                import torch.distributed as dist

                backend = dist.get_backend() if dist.is_initialized() else "?"
                PROGRESS.info(f"{stage}: world size {args.world_size} ({args.parallel_mode.name.lower()}, {backend})")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or not state.is_world_process_zero:
                return
            values = {metric_name(stage, k): float(v) for k, v in logs.items() if isinstance(v, (int, float)) and math.isfinite(v)}
            if self.progress is not None and "train_runtime" not in logs:  # not the closing summary
                self.progress.log(state.global_step, values)
            if values and log_metrics is not None:
                log_metrics(values, state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            if self.progress is not None:
                self.progress.step(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            if self.progress is not None:
                self.progress.close()

    return ForwardMetrics()


def fit(trainer, cfg: TrainingConfig, work_dir: Path, out_dir: Path) -> dict:
    """Train a TRL trainer with the user's optimizer if any (`cfg.optimizer_factory`), resuming from the newest complete
    checkpoint, and write how it ended (`training.json`: stopped early by a callback, the best checkpoint loaded)."""
    from rlhf_pipeline.trainers.custom import install, write_outcome

    install(trainer, cfg)
    if os.environ.get(CONSOLE_ENV):  # our bar instead of transformers' (or, with tqdm off, its printed log dicts)
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        trainer.remove_callback(ProgressCallback)
        trainer.remove_callback(PrinterCallback)
    trainer.train(resume_from_checkpoint=last_checkpoint(work_dir))
    state = trainer.state
    best = state.best_model_checkpoint if getattr(cfg, "load_best_model_at_end", False) else None
    outcome = {"global_step": state.global_step, "max_steps": state.max_steps}
    if is_main_process(trainer):
        outcome = write_outcome(out_dir, state.global_step, state.max_steps, best, state.best_metric)
    return outcome


def is_main_process(trainer) -> bool:
    """Rank 0 under accelerate (the only one that writes the artifact); always true in one process."""
    return trainer.args.process_index == 0


def save_on_main(trainer, tokenizer, out_dir: Path, keep_adapter: bool = False) -> None:
    """Rank 0 saves the model (`save_model`); every rank waits for it, so none exits before the artifact is whole. Under DeepSpeed
    or FSDP the weights are sharded: every rank takes part in gathering the full state dict first (ZeRO-3's 16-bit gather)."""
    model, state_dict = trainer.model, None
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        state_dict = trainer.accelerator.get_state_dict(trainer.deepspeed if trainer.is_deepspeed_enabled else trainer.model_wrapped)
        if hasattr(model, "peft_config") and is_main_process(trainer):  # merging (or saving the base) needs whole weights
            model, state_dict = unsharded_copy(model, state_dict), None
    if is_main_process(trainer):
        save_model(model, tokenizer, out_dir, keep_adapter=keep_adapter, state_dict=state_dict)
    trainer.accelerator.wait_for_everyone()


def unsharded_copy(model, state_dict: dict):
    """A CPU copy of a peft model whose weights are sharded over the ranks (ZeRO-3 leaves each rank's parameters empty, FSDP2
    makes them DTensors), built from its gathered full `state_dict`: every adapter, score head and base weight, loaded strictly."""
    import copy

    import torch
    from peft import get_peft_model

    base = model.get_base_model()
    with torch.device("cpu"):
        fresh = type(base)(copy.deepcopy(base.config))  # the class itself, not from_pretrained: no ZeRO-3 init context
    names = list(model.peft_config)
    copied = get_peft_model(fresh, copy.deepcopy(model.peft_config[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        copied.add_adapter(name, copy.deepcopy(model.peft_config[name]))
    copied.load_state_dict({key: value.to("cpu") for key, value in state_dict.items()}, strict=True)
    copied.set_adapter(model.active_adapter)
    for name in names:  # the stacked reference stays frozen, as in the trainer
        if name != model.active_adapter:
            for key, parameter in copied.named_parameters():
                if f".{name}." in key:
                    parameter.requires_grad_(False)
    return copied.to(next(iter(state_dict.values())).dtype)


def train_and_save(stage: str, trainer, tokenizer, cfg: TrainingConfig, work_dir: Path, out_dir: Path, generation_config=None) -> dict[str, float]:
    """What every TRL stage ends with: train (`fit`), save the model (merged under LoRA unless `keep_adapter`, with
    `generation_config` put back if given) and return the last logged values."""
    fit(trainer, cfg, work_dir, out_dir)
    if generation_config is not None:
        trainer.model.generation_config = generation_config
    save_on_main(trainer, tokenizer, out_dir / "model", keep_adapter=cfg.lora.keep_adapter)
    return final_train_metrics(stage, trainer)


def final_train_metrics(stage: str, trainer) -> dict[str, float]:
    """The last logged training values (loss etc.) from the trainer's history."""
    merged: dict[str, float] = {}
    for entry in trainer.state.log_history:
        for k, v in entry.items():
            if isinstance(v, (int, float)) and k not in ("step", "epoch") and math.isfinite(v):
                merged[metric_name(stage, k)] = float(v)
    return merged
