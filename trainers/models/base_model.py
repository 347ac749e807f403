"""The untrained starting point: the tiny model built here (seeded), or a pretrained model by hub id or path.

Only the stages that start from the base model import this module (data counts
tokens with its tokenizer, sft trains it, eval measures it), so a change to the
tiny model's code re-keys those stages and no other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhf_pipeline.trainers.config import TINY, ModelConfig
from rlhf_pipeline.trainers.models.checkpoints import local_folder
from rlhf_pipeline.trainers.models.load import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def load_base_tokenizer(model: ModelConfig) -> PreTrainedTokenizerBase:
    """The base tokenizer, with `model.chat_template` set (and its special tokens added) when one is named."""
    from rlhf_pipeline.trainers.models import templates

    if model.name_or_path == TINY:
        from rlhf_pipeline.trainers.models.tiny import build_tokenizer

        tokenizer = build_tokenizer()
    else:
        tokenizer = load_tokenizer(
            local_folder(model.name_or_path), revision=model.revision, trust_remote_code=model.trust_remote_code
        )
    templates.apply(tokenizer, model.chat_template)
    return tokenizer


def load_base_model(
    model: ModelConfig, bnb_config=None, attn_implementation: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The base weights in `model.dtype` (float32 by default: a bf16 checkpoint is upcast, so AdamW updates a
    full-precision master copy), embeddings grown to the tokenizer when the chat template added tokens.
    With `bnb_config` (QLoRA), in 4 bits on this rank's GPU, prepared for adapter training (peft).
    `attn_implementation`: the loading stage's (None: transformers' choice)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.trainers.attention import loading

    if bnb_config is not None:
        if model.name_or_path == TINY:
            raise ValueError(
                "lora.quantization (QLoRA) loads a pretrained checkpoint in 4 bits: the tiny model is built in "
                "memory, not loaded"
            )
        import peft

        from rlhf_pipeline.trainers.models.handoff import quantized_loading

        tokenizer = load_base_tokenizer(model)
        policy = AutoModelForCausalLM.from_pretrained(
            local_folder(model.name_or_path),
            revision=model.revision,
            trust_remote_code=model.trust_remote_code,
            use_safetensors=True,
            **quantized_loading(bnb_config),
            **loading(attn_implementation),
        )
        _grow_embeddings(policy, tokenizer)  # embeddings and lm_head stay unquantized under bitsandbytes
        return peft.prepare_model_for_kbit_training(policy, use_gradient_checkpointing=False), tokenizer
    tokenizer = load_base_tokenizer(model)
    dtype = getattr(torch, model.dtype)
    if model.name_or_path == TINY:
        from rlhf_pipeline.trainers.models.tiny import build_model

        policy = build_model(model.tiny, tokenizer, seed=model.seed).to(dtype)
        if attn_implementation is not None:  # built from a config, not loaded: transformers checks it here
            policy.set_attn_implementation(attn_implementation)
    else:
        policy = AutoModelForCausalLM.from_pretrained(
            local_folder(model.name_or_path),
            revision=model.revision,
            trust_remote_code=model.trust_remote_code,
            dtype=dtype,
            use_safetensors=True,
            **loading(attn_implementation),
        )
    _grow_embeddings(policy, tokenizer)
    return policy, tokenizer


def _grow_embeddings(policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    if len(tokenizer) > policy.get_input_embeddings().weight.shape[0]:
        policy.resize_token_embeddings(len(tokenizer), mean_resizing=True)


def added_token_ids(model: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids of the special tokens `model.chat_template` added to the checkpoint's own tokenizer (ChatML's on a GPT-2
    one). Their embedding rows are new, or padding rows never trained, so a frozen base under LoRA could neither read
    nor emit them."""
    from rlhf_pipeline.trainers.models import templates

    if model.chat_template is None:
        return []
    _, specials = templates.resolve(model.chat_template)
    if not specials:
        return []
    if model.name_or_path == TINY:
        from rlhf_pipeline.trainers.models.tiny import build_tokenizer

        own = build_tokenizer().get_vocab()
    else:
        own = load_tokenizer(
            local_folder(model.name_or_path), revision=model.revision, trust_remote_code=model.trust_remote_code
        ).get_vocab()
    return [tokenizer.convert_tokens_to_ids(token) for token in specials if token not in own]


def trainable_tokens(policy: PreTrainedModel, token_ids: list[int]) -> list[int] | dict[str, list[int]] | None:
    """peft's `trainable_token_indices` for `token_ids`: their rows of the input embeddings train beside the adapter,
    and of the output embeddings too when they are not tied to the input ones (an untied lm_head must learn to emit an
    added end of turn)."""
    if not token_ids:
        return None
    embeddings, head = policy.get_input_embeddings(), policy.get_output_embeddings()
    if head is None or head.weight is embeddings.weight:
        return list(token_ids)  # peft trains the tied head with the embeddings
    names = {id(module): name.rsplit(".", 1)[-1] for name, module in policy.named_modules()}
    return {names[id(embeddings)]: list(token_ids), names[id(head)]: list(token_ids)}
