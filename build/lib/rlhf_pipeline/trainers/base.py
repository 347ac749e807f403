"""The untrained starting point: the tiny model built here (seeded), or a pretrained model by hub id or path.

Only the stages that start from the base model import this module (data counts
tokens with its tokenizer, sft trains it, eval measures it), so a change to the
tiny model's code re-keys those stages and no other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhf_pipeline.trainers.common import TINY, ModelConfig, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def load_base_tokenizer(model: ModelConfig) -> PreTrainedTokenizerBase:
    if model.name_or_path == TINY:
        from rlhf_pipeline.trainers.tiny import build_tokenizer

        return build_tokenizer()
    return load_tokenizer(model.name_or_path, revision=model.revision, trust_remote_code=model.trust_remote_code)


def load_base_model(model: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM

    tokenizer = load_base_tokenizer(model)
    if model.name_or_path == TINY:
        from rlhf_pipeline.trainers.tiny import build_model

        return build_model(model.tiny, tokenizer, seed=model.seed), tokenizer
    policy = AutoModelForCausalLM.from_pretrained(
        model.name_or_path,
        revision=model.revision,
        trust_remote_code=model.trust_remote_code,
        dtype="auto",
        use_safetensors=True,
    )
    return policy, tokenizer
