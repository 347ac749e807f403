"""Memory each stage holds at its peak, estimated with accelerate on a model built on the meta device (no weights).

`rlhf check` prints it per stage. Weights count in `model.dtype` (LoRA adapters in float32, as peft keeps
them); gradients and AdamW states of the trained parameters come from accelerate's `estimate_training_usage`.
Activations, the KV cache and batches are not included: an estimate that fits can still run out of memory.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

from rlhf_pipeline.tasks.stages import BY_NAME


@dataclass(frozen=True)
class Held:
    """One model a stage holds while it builds."""

    role: str
    classifier: bool
    """A scalar head (AutoModelForSequenceClassification, num_labels=1) instead of the LM head."""
    trained: bool
    lora: Any = None
    """The stage's LoraConfig when its adapters are what is trained."""


def held_models(params, stage: str) -> list[Held]:
    """What each stage keeps in memory at its peak, as its trainer loads it."""
    row, cfg = BY_NAME[stage], params.config(stage)
    if not row.device:
        return []
    if stage == "eval":  # one model at a time for generation; policy and sft together for the KL
        return [Held("policy", False, False), Held("sft", False, False)]
    lora = cfg.lora if cfg.lora.enabled else None
    if stage == "rm":
        return [Held("reward model", True, True, lora)]
    held = [Held("policy", False, True, lora)]
    # TRL (and our PPO) take the reference as the policy with its adapters off under LoRA; GRPO keeps none at beta=0.
    if row.algorithm and lora is None and getattr(cfg, "beta", None) != 0:
        held.append(Held("reference", False, False))
    if stage == "ppo":  # trained beside the policy, from the reward model or the sft model (trainers/ppo.py)
        held.append(Held("value model", True, True))
    if row.online and params.rewards.uses_reward_model:
        held.append(Held("reward model", True, False))
    return held


@dataclass(frozen=True)
class StageMemory:
    holds: str
    trained_params: int
    weights: int
    training: int
    """Gradients and AdamW states of the trained parameters."""

    @property
    def total(self) -> int:
        return self.weights + self.training


def stage_memory(params, stage: str, build) -> StageMemory:
    """Weights of every model the stage holds in `model.dtype` (LoRA adapters in float32, as peft keeps them), plus
    accelerate's `estimate_training_usage` gradients and optimizer states of the trained ones. No activations."""
    import peft
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import compute_module_sizes, is_bf16_available, is_cuda_available

    cfg = params.config(stage)
    bf16 = getattr(cfg, "bf16", None)
    autocast = bf16 if bf16 is not None else is_cuda_available() and is_bf16_available()  # trl_arguments' rule
    names, trained_params, weights, training = [], 0, 0, 0
    for held in held_models(params, stage):
        model = build(held.classifier)
        if held.lora is not None:
            with init_empty_weights(), warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers a deprecated question
                model = peft.get_peft_model(model, held.lora.peft_config("SEQ_CLS" if held.classifier else "CAUSAL_LM"))
        trainable = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad} if held.trained else {}
        adapters = {name: "float32" for name in trainable} if held.lora is not None else None
        sizes = compute_module_sizes(model, dtype=params.model.dtype, special_dtypes=adapters)
        weights += sizes[""]
        if trainable:
            trained_bytes = sum(sizes[name] for name in trainable)
            # accelerate's mixed-precision case adds the bf16 copies autocast makes of float32 weights.
            float32 = held.lora is not None or params.model.dtype == "float32"
            usage = estimate_training_usage(trained_bytes, "bfloat16" if autocast and float32 else "float32")
            training += usage["gradients"] + usage["optimizer"]
            trained_params += sum(trainable.values())
        names.append(held.role + (" (LoRA)" if held.lora is not None else " (trained)" if held.trained else ""))
    return StageMemory(" + ".join(names) or "no model", trained_params, weights, training)


def empty_model_builder(params, tokenizer):
    """A function building the base model on the meta device (a causal LM, or with a scalar head); None for the
    tiny model without its tokenizer. Raises when the model's config cannot be loaded."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf_pipeline.trainers.config import TINY

    model = params.model
    if model.name_or_path == TINY:
        from rlhf_pipeline.trainers.tiny import build_model

        if tokenizer is None:
            return None
        with init_empty_weights():
            config = build_model(model.tiny, tokenizer, seed=model.seed).config
    else:
        config = AutoConfig.from_pretrained(model.name_or_path, revision=model.revision, trust_remote_code=model.trust_remote_code)
    if tokenizer is not None and len(tokenizer) > config.vocab_size:  # load_base_model grows the embeddings to the template's tokens
        config.vocab_size = len(tokenizer)
    classifier_config = copy.deepcopy(config)
    classifier_config.num_labels = 1  # TRL's reward model, our value model

    def build(classifier: bool):
        # float32 on the meta device: compute_module_sizes then counts each tensor in the dtype asked for.
        with init_empty_weights():
            auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
            empty = auto.from_config(classifier_config if classifier else config, dtype="float32", trust_remote_code=model.trust_remote_code)
        empty.tie_weights()  # init_empty_weights copies the parameter that tying shares: a tied LM head would count twice
        return empty

    return build
