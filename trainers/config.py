"""The configuration every stage shares: the base model, LoRA, the user's code, evaluation while training, and the
precision and optimizer checks (docs/ARCHITECTURE.md, "The trainer contract"); the TRL-backed stages' arguments are
`trainers.algorithms.fields`.

Heavy libraries (torch, transformers, trl) are imported inside the functions that need them, so that config classes
stay cheap to import for the flow and the CLI.
"""

from __future__ import annotations

import difflib
import inspect
import re
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

LogMetrics = Callable[[dict[str, float], int], None]
"""Receives `{"<stage>/<split>/<name>": value}` and the global step."""


TINY = "tiny"


BOUNDS = (
    (re.compile(r"(^|_)(steps|episodes)$"), 10**9, "steps"),
    (re.compile(r"(^|_)(length|tokens)$"), 1 << 20, "tokens"),
    (re.compile(r"^learning_rate$"), 10.0, ""),
)
"""Upper bounds of the fields named so: a value above them is a typo (an exponent too many), never a setting."""


class StrictModel(BaseModel):
    """Frozen; unknown keys, infinite or NaN numbers and values past `BOUNDS` are errors (a typo in a preset must not
    pass silently, nor train an all-NaN model or run for ever)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="after")
    def _within_bounds(self):
        for name, value in self:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            for pattern, limit, unit in BOUNDS:
                if pattern.search(name) and value > limit:
                    over = f"{limit:,} {unit}".strip() if isinstance(limit, int) else f"{limit:g}"
                    raise ValueError(f"{name}={value:g} is over {over}: a typo? (an exponent too many)")
        return self


class Block(StrictModel):
    """A block of the run's parameters whose user code keys the stages that read it."""

    def code_paths(self) -> list[str]:
        """Import paths of the user's code it runs (their source is part of the key)."""
        return []


class StageConfig(Block):
    """What every stage's config answers (docs/ARCHITECTURE.md, "The trainer contract"); a stage overrides what
    applies."""

    @property
    def evaluates(self) -> bool:
        """Whether it evaluates on a held-out dataset while it trains."""
        return False

    def held_out(self) -> tuple[str, ...]:
        """Datasets of the `data` stage it reads only to evaluate."""
        return ()

    def switched_off(self) -> bool:
        """A stage that builds nothing of its own: its artifact holds its input unchanged (sft's `enabled`)."""
        return False

    def adapters(self) -> LoraConfig | None:
        """Its LoRA block, where it trains a model that can take adapters (None: it trains none)."""
        return None

    def longest_sequence(self) -> int | None:
        """The longest sequence it feeds a model (its `max_length`), where it sets one."""
        return None

    def data_hint(self, dataset: str) -> str:
        """What the error adds when `dataset`, which it reads, is not named in the data block."""
        return ""

    def row_token_limit(self) -> int | None:
        """The most tokens one row of the datasets it reads may take (the data stage's `fits_max_length`); None: no
        limit."""
        return None


class AttentionField(StageConfig):
    """A stage that loads models: which attention they compute with."""

    attn_implementation: str | None = Field(
        None,
        description=(
            "Attention of the models this stage loads (transformers' attn_implementation): 'eager', 'sdpa', "
            "'flex_attention' (trains on CUDA only), 'flash_attention_2'/'_3'/'_4' (CUDA GPU, the flash-attn package; "
            "computes in bf16/fp16, so keep bf16 on or model.dtype=bfloat16) or a Hub kernel 'org/repo' (the kernels "
            "package). None: transformers' choice (sdpa where the architecture has it). What is not installed is "
            "refused with the parameters; what this machine's device cannot run, before any weights load."
        ),
    )

    @field_validator("attn_implementation")
    @classmethod
    def _attention_installed(cls, name: str | None) -> str | None:
        from rlhf_pipeline.trainers.attention import check_installed

        return check_installed(name)


class TinyModelConfig(StrictModel):
    """The embedded default: a small Llama built from a config, no download."""

    hidden_size: int = Field(128, ge=8, description="Width of the residual stream.")
    intermediate_size: int = Field(512, ge=8, description="Width of the MLP.")
    num_hidden_layers: int = Field(4, ge=1, description="Number of transformer blocks.")
    num_attention_heads: int = Field(4, ge=1, description="Attention heads per block.")
    max_position_embeddings: int = Field(
        2048, ge=16, description="Longest sequence the model accepts (RoPE: costs no parameters)."
    )


class ModelConfig(Block):
    name_or_path: str = Field(
        TINY,
        description=(
            "Base model: 'tiny' (built locally from `tiny`), a hub id such as 'Qwen/Qwen2.5-0.5B', or a local folder."
        ),
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the base model.")
    trust_remote_code: bool = Field(
        False,
        description=(
            "Run model code shipped with a hub repository. Refused unless the worker's operator allows the repository "
            "(RLHF_ALLOWED_REMOTE_CODE)."
        ),
    )
    seed: int = Field(0, description="Seed of the tiny model's initial weights (same seed, same base model).")
    chat_template: str | None = Field(
        None,
        description=(
            "Chat template for conversational data: 'chatml' or a Jinja file; None: the tokenizer's own. Its special "
            "tokens are added (embeddings resized) and it is saved with every stage's tokenizer. A base model without "
            "a template needs one."
        ),
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description=(
            "Dtype the base weights are loaded, trained and saved in. float32 (default): master weights in full "
            "precision, so a bf16/fp16 checkpoint is upcast and mixed precision comes from each stage's `bf16`; "
            "bfloat16/float16: pure low-precision training (half the memory; AdamW updates smaller than the weights' "
            "precision are lost)."
        ),
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Architecture of the tiny model.")

    @model_validator(mode="after")
    def _remote_code_allowed_by_the_operator(self):
        if self.trust_remote_code:
            from rlhf_pipeline.trainers.runtime.trust import check_remote_code

            check_remote_code(self.name_or_path, "model")
        return self


class LoraConfig(StrictModel):
    """LoRA through peft. The stage's output is a merged, loadable model unless `keep_adapter`."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of all weights.")
    r: int = Field(16, ge=1, description="Adapter rank (peft LoraConfig.r).")
    lora_alpha: int = Field(32, ge=1, description="Adapter scaling numerator (peft LoraConfig.lora_alpha).")
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: str | list[str] = Field(
        "all-linear", description="Modules that get adapters ('all-linear' or names)."
    )
    keep_adapter: bool = Field(
        False,
        description=(
            "Save the adapter alone (adapter_model.safetensors) instead of merging it; the base model is found by its "
            "hub id or path, or saved beside the adapter (model/base) when it has neither (the tiny model). Later "
            "stages then choose `handoff`."
        ),
    )
    handoff: Literal["merge", "stack"] | None = Field(
        None,
        description=(
            "How this stage continues from an upstream stage that kept its LoRA adapter (sft.lora.keep_adapter): "
            "'merge' folds it into the weights (then this block's own LoRA, if enabled, trains on top); 'stack' "
            "trains that adapter on, with a frozen copy of it as the reference (TRL's 'ref' adapter; this block's "
            "r/alpha do not apply). Must be chosen when the upstream kept one."
        ),
    )

    quantization: Literal["none", "4bit"] = Field(
        "none",
        description=(
            "QLoRA: the frozen base in 4 bits (bitsandbytes NF4 with double quantization, bf16 compute), the adapters "
            "trained on top; CUDA GPU and bitsandbytes only. In the stages after sft it applies to a stacked "
            "adapter's base."
        ),
    )

    @model_validator(mode="after")
    def _quantization_possible(self):
        if self.quantization != "none":
            import importlib.util

            if self.handoff == "merge":
                raise ValueError(
                    f"lora.quantization={self.quantization!r} with handoff=merge: an adapter cannot be merged into "
                    "4-bit weights; stack it"
                )
            if not (self.enabled or self.handoff == "stack"):
                raise ValueError(
                    f"lora.quantization={self.quantization!r} quantizes the frozen base under adapters: set "
                    "lora.enabled=true"
                )
            if importlib.util.find_spec("bitsandbytes") is None:
                raise ValueError(
                    f"lora.quantization={self.quantization!r} (QLoRA) needs bitsandbytes and a CUDA GPU; bitsandbytes "
                    "is not installed"
                )
        return self

    def bnb_config(self):
        """transformers' BitsAndBytesConfig for QLoRA (None without quantization); the device is checked before any
        weights load."""
        if self.quantization == "none":
            return None
        import torch
        from transformers import BitsAndBytesConfig

        if not torch.cuda.is_available():
            raise ValueError(
                f"lora.quantization={self.quantization!r} (QLoRA): bitsandbytes quantizes on a CUDA GPU, and this "
                "machine trains on cpu"
            )
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )

    def peft_config(
        self, task_type: str = "CAUSAL_LM", trainable_tokens: list[int] | dict[str, list[int]] | None = None
    ):
        """A peft.LoraConfig, or None when LoRA is off; `trainable_tokens` (`base.trainable_tokens`): embedding rows
        that train too."""
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

        from rlhf_pipeline.trainers.runtime.custom import import_object

        cls = import_object(self.path, "callback")
        if not (isinstance(cls, type) and issubclass(cls, TrainerCallback)):
            raise ValueError(f"callback {self.path!r} is not a subclass of transformers.TrainerCallback")
        try:
            inspect.signature(cls).bind(**self.kwargs)
        except TypeError as exc:
            raise ValueError(f"callback {self.path!r} cannot be built with kwargs {self.kwargs}: {exc}") from exc
        return self

    def build(self):
        from rlhf_pipeline.trainers.runtime.custom import import_object

        return import_object(self.path, "callback")(**self.kwargs)


class Customisation(StageConfig):
    """Code of the user's that a stage runs beside ours: its own optimizer and callbacks."""

    optimizer_factory: str | None = Field(
        None,
        description=(
            "'package.module:function' of fn(model, args) -> (optimizer, lr_scheduler or None), passed to the trainer "
            "as its optimizers (args: the stage's transformers TrainingArguments; scheduler None: the stage's "
            "lr_scheduler_type drives the optimizer). Its state is checkpointed and restored on resume. For ppo, "
            "model holds .policy and .value_model."
        ),
    )
    callbacks: list[CallbackSpec] = Field(
        default_factory=list,
        description=(
            "transformers TrainerCallbacks run beside the pipeline's own (ppo calls on_train_begin, on_step_end, "
            "on_log, on_save and on_train_end at the matching points). One that sets control.should_training_stop "
            "ends the stage early: it publishes what it has, tagged stopped early."
        ),
    )

    @field_validator("optimizer_factory")
    @classmethod
    def _factory_importable(cls, path: str | None) -> str | None:
        if path is not None:
            from rlhf_pipeline.trainers.runtime.custom import import_callable

            import_callable(path, "optimizer_factory", positional=2)
        return path

    def code_paths(self) -> list[str]:
        """Import paths whose source keys the stage."""
        return [*([self.optimizer_factory] if self.optimizer_factory else []), *(spec.path for spec in self.callbacks)]

    def user_callbacks(self) -> list:
        return [spec.build() for spec in self.callbacks]


class EvalDuringTraining(StageConfig):
    """Evaluation on the stage's held-out split while it trains (sft, rm, dpo), as transformers' Trainer does it."""

    eval_strategy: Literal["no", "steps", "epoch"] = Field(
        "no",
        description=(
            "Evaluate on the stage's held-out split every eval_steps ('steps') or epoch; logged as "
            "<stage>/eval/<name> curves."
        ),
    )
    eval_steps: int | None = Field(
        None, ge=1, description="Steps between evaluations (eval_strategy='steps'). None: logging_steps."
    )
    per_device_eval_batch_size: int = Field(8, ge=1, description="Examples per device per evaluation forward pass.")
    compute_metrics: str | None = Field(
        None,
        description=(
            "'package.module:function' of fn(eval_prediction) -> {name: value} (transformers' compute_metrics), "
            "logged as <stage>/eval/<name> beside the trainer's own eval metrics."
        ),
    )
    load_best_model_at_end: bool = Field(
        False,
        description=(
            "Publish the checkpoint with the best metric_for_best_model instead of the last (needs save_steps a "
            "multiple of eval_steps)."
        ),
    )
    metric_for_best_model: str | None = Field(
        None,
        description=(
            "Eval metric that picks the best checkpoint, without the eval_ prefix (e.g. 'loss', 'accuracy'). None: "
            "'loss'."
        ),
    )
    greater_is_better: bool | None = Field(
        None, description="Whether a larger metric_for_best_model is better. None: False for a loss, True otherwise."
    )

    @field_validator("compute_metrics")
    @classmethod
    def _metrics_importable(cls, path: str | None) -> str | None:
        if path is not None:
            from rlhf_pipeline.trainers.runtime.custom import import_callable

            import_callable(path, "compute_metrics", positional=1)
        return path

    @model_validator(mode="after")
    def _evaluation_agrees(self):
        if self.eval_strategy == "no":
            given = [
                name
                for name in ("eval_steps", "compute_metrics", "load_best_model_at_end", "metric_for_best_model")
                if getattr(self, name)
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)} only apply while evaluating: set eval_strategy='steps' (or 'epoch')"
                )
        elif self.load_best_model_at_end and self.eval_strategy == "steps":
            every, saves = self.eval_steps or getattr(self, "logging_steps", 1), getattr(self, "save_steps", 1)
            if saves % every:
                raise ValueError(
                    f"load_best_model_at_end picks among the checkpoints, which are saved every save_steps={saves}: "
                    f"it must be a multiple of eval_steps={every}, so each checkpoint has an evaluation"
                )
        return self

    @property
    def evaluates(self) -> bool:
        return self.eval_strategy != "no"

    def keeps_best_checkpoint(self) -> bool:
        return self.load_best_model_at_end

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
            **(
                {"metric_for_best_model": metric, "greater_is_better": self.greater_is_better}
                if self.load_best_model_at_end
                else {}
            ),
        }

    def metrics_function(self) -> Callable | None:
        if self.compute_metrics is None:
            return None
        from rlhf_pipeline.trainers.runtime.custom import import_callable

        return import_callable(self.compute_metrics, "compute_metrics", positional=1)

    def code_paths(self) -> list[str]:
        return [*super().code_paths(), *([self.compute_metrics] if self.compute_metrics else [])]


def check_precision_fields(bf16: bool | None, fp16: bool) -> None:
    if bf16 and fp16:
        raise ValueError("bf16 and fp16 are both on: choose one mixed precision (bf16 where the GPU has it)")


def check_optimizer_name(optim: str, default: str) -> None:
    """A transformers optimizer name (`OptimizerNames`), with a did-you-mean; a bitsandbytes one needs bitsandbytes
    installed."""
    if optim == default:
        return
    from transformers.training_args import OptimizerNames

    known = [name.value for name in OptimizerNames]
    if optim not in known:
        close = difflib.get_close_matches(optim, known, n=1)
        raise ValueError(
            f"optim={optim!r} is not an optimizer of transformers" + (f" (did you mean {close[0]!r}?)" if close else "")
        )
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
