"""How a stage continues from an upstream model: a kept LoRA adapter merged or stacked, QLoRA's 4-bit base, and a whole
copy of a model whose weights are sharded over the ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_pipeline.trainers.config import LoraConfig
from rlhf_pipeline.trainers.models.load import has_adapter, load_adapter_model, load_causal_lm, load_tokenizer


def upstream_policy(
    sft_model: Path, lora: LoraConfig, task_type: str = "CAUSAL_LM", attn_implementation: str | None = None
):
    """The policy a stage starts from, and the peft config to hand its TRL trainer: an upstream adapter merged (then
    this stage's own LoRA, if any) or stacked (trained on; TRL keeps a frozen 'ref' copy as the reference, and takes no
    new peft config). `attn_implementation`: the stage's (TRL loads a reference with the policy's)."""
    from rlhf_pipeline.trainers.attention import loading

    if has_adapter(sft_model) and lora.handoff is None:
        raise ValueError(
            f"{sft_model} holds sft's LoRA adapter (sft.lora.keep_adapter): choose lora.handoff=merge or stack for "
            "this stage"
        )
    stacked = has_adapter(sft_model) and lora.handoff == "stack"
    if stacked and lora.quantization != "none":  # QLoRA: the stacked adapter on a 4-bit base
        from transformers import AutoModelForCausalLM

        quantized = load_adapter_model(
            sft_model,
            AutoModelForCausalLM,
            "stack",
            **quantized_loading(lora.bnb_config()),
            **loading(attn_implementation),
        )
        return quantized, load_tokenizer(sft_model), None
    # QLoRA on a whole upstream model: new adapters on its 4-bit copy
    if lora.quantization != "none" and not has_adapter(sft_model):
        import peft
        from transformers import AutoModelForCausalLM

        quantized = AutoModelForCausalLM.from_pretrained(
            str(sft_model),
            use_safetensors=True,
            **quantized_loading(lora.bnb_config()),
            **loading(attn_implementation),
        )
        return (
            peft.prepare_model_for_kbit_training(quantized, use_gradient_checkpointing=False),
            load_tokenizer(sft_model),
            lora.peft_config(task_type),
        )
    policy, tokenizer = load_causal_lm(sft_model, lora.handoff or "merge", attn_implementation)
    return policy, tokenizer, None if stacked else lora.peft_config(task_type)


def quantized_loading(bnb_config) -> dict[str, Any]:
    """`from_pretrained` arguments that load a base in 4 bits on this rank's GPU."""
    import os

    import torch

    return {
        "quantization_config": bnb_config,
        "device_map": {"": int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))},
    }


def unsharded_copy(model, state_dict: dict):
    """A CPU copy of a peft model whose weights are sharded over the ranks (ZeRO-3 leaves each rank's parameters empty,
    FSDP2 makes them DTensors), built from its gathered full `state_dict`: every adapter, score head and base weight,
    loaded strictly."""
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
