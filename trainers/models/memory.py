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


@dataclass(frozen=True)
class Held:
    """One model a stage holds while it builds (the table's `holds`)."""

    role: str
    classifier: bool
    """A scalar head (AutoModelForSequenceClassification, num_labels=1) instead of the LM head."""
    trained: bool
    adapted: bool = False
    """Under the stage's LoRA its adapters are what trains (`lora` is then set for an estimate)."""
    lora: Any = None
    """The stage's LoraConfig when its adapters are what is trained."""


POLICY = Held("policy", classifier=False, trained=True, adapted=True)
REFERENCE = Held("reference", classifier=False, trained=False)
"""Frozen; none under LoRA (the policy with its adapters off is the reference) and none at beta=0 (GRPO)."""
REWARD_MODEL = Held("reward model", classifier=True, trained=False)
"""An online stage's scorer: held only when `rewards` uses the reward model."""
TRAINED_REWARD_MODEL = Held("reward model", classifier=True, trained=True, adapted=True)
VALUE_MODEL = Held("value model", classifier=True, trained=True)
"""PPO's, trained whole beside the policy, from the reward model or the sft model (trainers/ppo/train.py)."""
SAMPLING = Held("policy, sampling", classifier=False, trained=False)
"""The `pairs` stage: the starting policy generating, frozen (a reward model or LM judge that labels is loaded after
it is freed)."""
EVALUATED = (Held("policy", False, False), Held("sft", False, False))
"""Eval: one model at a time for generation; the policy and sft together for the KL."""


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


def stage_memory(held: list[Held], dtype: str, bf16: bool | None, build) -> StageMemory:
    """Weights of every model the stage holds (`held`) in `dtype` (LoRA adapters in float32, as peft keeps them), plus
    accelerate's `estimate_training_usage` gradients and optimizer states of the trained ones (mixed precision: `bf16`,
    the stage's; None where the device has it). No activations."""
    import peft
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import compute_module_sizes, is_bf16_available, is_cuda_available

    autocast = bf16 if bf16 is not None else is_cuda_available() and is_bf16_available()  # trl_arguments' rule
    names, trained_params, weights, training = [], 0, 0, 0
    for one in held:
        model = build(one.classifier)
        if one.lora is not None:
            with init_empty_weights(), warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers a deprecated question
                model = peft.get_peft_model(model, one.lora.peft_config("SEQ_CLS" if one.classifier else "CAUSAL_LM"))
        trainable = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad} if one.trained else {}
        adapters = {name: "float32" for name in trainable} if one.lora is not None else None
        sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=adapters)
        weights += sizes[""]
        if trainable:
            trained_bytes = sum(sizes[name] for name in trainable)
            # accelerate's mixed-precision case adds the bf16 copies autocast makes of float32 weights.
            float32 = one.lora is not None or dtype == "float32"
            usage = estimate_training_usage(trained_bytes, "bfloat16" if autocast and float32 else "float32")
            training += usage["gradients"] + usage["optimizer"]
            trained_params += sum(trainable.values())
        names.append(one.role + (" (LoRA)" if one.lora is not None else " (trained)" if one.trained else ""))
    return StageMemory(" + ".join(names) or "no model", trained_params, weights, training)


def empty_model_builder(params, tokenizer):
    """A function building the base model on the meta device (a causal LM, or with a scalar head); None for the
    tiny model without its tokenizer. Raises when the model's config cannot be loaded."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf_pipeline.trainers.config import TINY

    model = params.model
    if model.name_or_path == TINY:
        from rlhf_pipeline.trainers.models.tiny import build_model

        if tokenizer is None:
            return None
        with init_empty_weights():
            config = build_model(model.tiny, tokenizer, seed=model.seed).config
    else:
        from rlhf_pipeline.trainers.models.checkpoints import local_folder

        config = AutoConfig.from_pretrained(
            local_folder(model.name_or_path), revision=model.revision, trust_remote_code=model.trust_remote_code
        )
    # load_base_model grows the embeddings to the template's tokens
    if tokenizer is not None and len(tokenizer) > config.vocab_size:
        config.vocab_size = len(tokenizer)
    classifier_config = copy.deepcopy(config)
    classifier_config.num_labels = 1  # TRL's reward model, our value model

    def build(classifier: bool):
        # float32 on the meta device: compute_module_sizes then counts each tensor in the dtype asked for.
        with init_empty_weights():
            auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
            empty = auto.from_config(
                classifier_config if classifier else config, dtype="float32", trust_remote_code=model.trust_remote_code
            )
        # init_empty_weights copies the parameter that tying shares: a tied LM head would count twice
        empty.tie_weights()
        return empty

    return build
