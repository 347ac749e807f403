"""Loading and saving the models stages hand each other (`<artifact>/model`): tokenizers and their digest, causal LMs,
reward and value models, adapter folders on their base.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def load_tokenizer(
    source: str | Path, revision: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer of a model folder or hub id (the base model's:
    `trainers.models.base_model.load_base_tokenizer`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source), revision=revision, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
)


LOADING_KEYS = frozenset(
    {
        "is_local",
        "local_files_only",
        "name_or_path",
        "_commit_hash",
        "revision",
        "trust_remote_code",
        "cache_dir",
        "token",
        "use_auth_token",
        "force_download",
        "proxies",
        "subfolder",
        "_from_auto",
        "model_max_length",
    }
)
"""Keys `from_pretrained` writes back into tokenizer_config.json on a re-save: how it was loaded, not how it
tokenizes."""


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


def load_causal_lm(
    path: str | Path, handoff: str | None = "merge", attn_implementation: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model written by an earlier stage (`<artifact>/model`). An adapter folder is loaded onto its base and merged
    (`handoff="merge"`, what evaluation and references read), or kept as a trainable peft adapter (`"stack"`).
    `attn_implementation`: the loading stage's (None: transformers' choice; a saved model does not keep it)."""
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.trainers.attention import loading

    if has_adapter(path):
        return load_adapter_model(path, AutoModelForCausalLM, handoff, **loading(attn_implementation)), load_tokenizer(
            path
        )
    model = AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True, **loading(attn_implementation))
    return model, load_tokenizer(path)


def load_sequence_classifier(path: str | Path, num_labels: int = 1, attn_implementation: str | None = None):
    """A reward or value model from an earlier stage's folder: a whole model, or an adapter merged onto its base (a
    reward model's adapter carries its score head; a causal LM's adapter gets a fresh one)."""
    from transformers import AutoModelForSequenceClassification

    from rlhf_pipeline.trainers.attention import loading

    if has_adapter(path):
        return load_adapter_model(
            path, AutoModelForSequenceClassification, "merge", num_labels=num_labels, **loading(attn_implementation)
        )
    return AutoModelForSequenceClassification.from_pretrained(
        str(path), num_labels=num_labels, use_safetensors=True, **loading(attn_implementation)
    )


def load_adapter_model(folder: str | Path, auto_class, handoff: str | None, **kwargs):
    """The base model (`<folder>/base`, else the adapter's `base_model_name_or_path`) with the folder's adapter on
    it."""
    import json

    from peft import PeftConfig, PeftModel

    folder = Path(folder)
    if handoff not in ("merge", "stack"):
        raise ValueError(
            f"{folder} holds a LoRA adapter: choose how to continue from it (lora.handoff: merge or stack)"
        )
    base = (
        folder / "base"
        if (folder / "base").is_dir()
        else json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    )
    if not base:
        raise ValueError(
            f"{folder} holds a LoRA adapter whose base model is neither saved beside it (base/) nor named in "
            f"{ADAPTER_CONFIG}"
        )
    config = PeftConfig.from_pretrained(str(folder))
    if config.task_type == "CAUSAL_LM" and not auto_class.__name__.endswith("CausalLM"):
        config.task_type = (
            None  # a causal LM's adapter on a reward/value model's backbone: the same layers, no generation wrapper
        )
    model = auto_class.from_pretrained(str(base), use_safetensors=True, **kwargs)
    rows = len(load_tokenizer(folder))
    if rows > model.get_input_embeddings().weight.shape[0]:  # a named base, without the tokens its chat template added
        model.resize_token_embeddings(rows, mean_resizing=False)  # those rows come from the adapter (trainable tokens)
    model = PeftModel.from_pretrained(model, str(folder), config=config, is_trainable=handoff == "stack")
    if handoff == "stack":
        return head_bias_through_trainable_tokens(model)
    merged = model.merge_and_unload()
    merged.name_or_path = merged.config._name_or_path = (
        ""  # no longer the named base: an adapter kept on it saves it (`_save_base`)
    )
    return merged


def head_bias_through_trainable_tokens(model):
    """TRL's fused LM head (sft, dpo, kto, grpo, rloo) reads `lm_head.weight` and `lm_head.bias`. peft's
    trainable-tokens wrapper serves `weight` (the base rows with the trained ones copied in) but not `bias`: give it the
    wrapped head's, unregistered, so the state dict keeps its keys."""
    from peft.utils.other import TrainableTokensWrapper

    for module in model.modules():
        if isinstance(module, TrainableTokensWrapper) and "bias" not in module.__dict__:
            module.__dict__["bias"] = getattr(module.original_module, "bias", None)
    return model


def save_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    keep_adapter: bool = False,
    state_dict=None,
) -> Path:
    """Save weights (safetensors) and tokenizer (with its chat template); a peft model is merged first unless
    `keep_adapter`. A causal LM's generation config stops at EOS and the template's end of turn (TRL's
    GRPO/RLOO read their stop tokens from it)."""
    from rlhf_pipeline.trainers.models.templates import stop_token_ids

    out_dir.mkdir(parents=True, exist_ok=True)
    # TRL's frozen copy of a stacked adapter: the reference, not the result
    if "ref" in getattr(model, "peft_config", {}):
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
    model.save_pretrained(
        out_dir, safe_serialization=True, **({"state_dict": state_dict} if state_dict is not None else {})
    )
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _save_base(model, out_dir: Path) -> None:
    """Beside a kept adapter, the base it applies to when nothing else names it (a model built in memory, or a stacked
    adapter's base read from an upstream `base/`): later stages load the base from `<model>/base`."""
    import copy

    name = model.peft_config[model.active_adapter].base_model_name_or_path
    if name and Path(name).name != "base":
        return  # a hub id or a model folder of the user's: named in adapter_config.json
    base = copy.deepcopy(model).unload()  # the base weights, adapters taken out
    base.save_pretrained(out_dir / "base", safe_serialization=True)
    for adapter in model.peft_config.values():
        adapter.base_model_name_or_path = None  # found as base/ by `load_adapter_model`, wherever the artifact is


def trainable(model) -> dict:
    """The trained parameters (all of a fully trained model, the adapters under LoRA), contiguous for safetensors."""
    return {name: p.detach().contiguous() for name, p in model.named_parameters() if p.requires_grad}
