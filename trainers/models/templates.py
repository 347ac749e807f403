"""Chat templates: giving a base model one (`model.chat_template`), and finding where its turns end.

A base model such as GPT-2 ships without a chat template, and conversational data
cannot be rendered without one. `model.chat_template` names a template (`chatml`)
or a Jinja file; it is set on the tokenizer before any stage uses it, its special
tokens are added (and the model's embeddings resized to match), and it is saved
with every stage's tokenizer, so later stages read it from the upstream folder.

The end-of-turn token is what a template writes after an assistant reply
(ChatML's `<|im_end|>`, the tiny template's EOS): generation stops there as well
as at the tokenizer's EOS, and SFT must train on it or the policy never stops.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# ChatML (OpenAI, Qwen), with {% generation %} marks around each assistant reply and its `<|im_end|>`, so
# TRL's `assistant_only_loss` trains on the end-of-turn token too. The newline between turns is written before
# each `<|im_start|>` rather than after each `<|im_end|>` (the same ids between turns): a conversation then ends
# at `<|im_end|>`, where the reward model reads its score in training and where PPO's rollouts end.
CHATML = (
    "{%- for message in messages %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- ('\\n' if messages else '') + '<|im_start|>assistant\\n' }}{%- endif %}"
)
NAMED = {"chatml": (CHATML, ("<|im_start|>", "<|im_end|>"))}
"""Template name -> (Jinja source, the special tokens it writes)."""

SENTINEL = "\u2063rlhf-sentinel\u2063"


def resolve(template: str) -> tuple[str, tuple[str, ...]]:
    """A template by name (`chatml`) or a Jinja file -> (source, special tokens to add: none for a file)."""
    if template in NAMED:
        return NAMED[template]
    path = Path(template).expanduser()
    if path.suffix in (".jinja", ".j2", ".jinja2") or path.is_file():
        if not path.is_file():
            raise ValueError(f"model.chat_template={template!r}: no such Jinja file")
        return path.read_text(), ()
    raise ValueError(
        f"model.chat_template={template!r}: not a known template ({', '.join(NAMED)}) nor a Jinja file (.jinja)"
    )


def apply(tokenizer: PreTrainedTokenizerBase, template: str | None) -> int:
    """Set `template` on `tokenizer` (None: keep its own); returns how many special tokens were added."""
    if template is None:
        return 0
    from tokenizers import AddedToken

    source, specials = resolve(template)
    missing = [token for token in specials if token not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(
            [AddedToken(token, special=True, normalized=False) for token in missing], special_tokens=True
        )
    tokenizer.chat_template = source
    return len(missing)


def end_of_turn(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The special token the chat template writes right after an assistant reply; None without a template
    (or when the template writes no special token there)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": SENTINEL}], tokenize=False
    )
    if SENTINEL not in rendered:
        return None
    after = rendered.rsplit(SENTINEL, 1)[1]
    specials = sorted(
        {str(t) for t in tokenizer.all_special_tokens} | set(getattr(tokenizer, "added_tokens_encoder", {})),
        key=len,
        reverse=True,
    )
    stripped = after.lstrip()
    for token in specials:
        if token and stripped.startswith(token):
            return token
    return None


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Where generation stops: the tokenizer's EOS and the chat template's end-of-turn token (one list, no repeats)."""
    ids = [tokenizer.eos_token_id]
    eot = end_of_turn(tokenizer)
    if eot is not None:
        ids.append(tokenizer.convert_tokens_to_ids(eot))
    return [i for n, i in enumerate(ids) if i is not None and i not in ids[:n]]


def has_generation_marks(tokenizer: PreTrainedTokenizerBase) -> bool:
    """The template marks assistant replies with {% generation %} (TRL's `assistant_only_loss` needs them)."""
    from trl.chat_template_utils import has_generation_markers

    template = getattr(tokenizer, "chat_template", None)
    return bool(template) and has_generation_markers(template)


def training_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The template TRL 1.16's SFTTrainer renders conversations with under `assistant_only_loss`: None for the
    tokenizer's own when it has {% generation %} marks, else TRL's training version of it (`get_training_chat_template`,
    which knows Qwen2.5/3, Llama 3, Gemma, Phi-3, DeepSeek-V3 and others by their exact text). TRL swaps it in for
    tokenizing only (sft_trainer.py, "swap in a training chat template"), so the saved tokenizer keeps its own.
    Raises ValueError when the template has no marks and TRL has no training version of it."""
    from trl.chat_template_utils import get_training_chat_template

    if has_generation_marks(tokenizer):
        return None
    return get_training_chat_template(tokenizer)


def assistant_mask(
    tokenizer: PreTrainedTokenizerBase, turns: list[dict], template: str | None = None
) -> tuple[list[int], list[int]]:
    """The ids of `turns` and TRL's assistant mask over them (1: trained under `assistant_only_loss`), rendered with
    `template` (None: the tokenizer's own), as TRL's SFT tokenization renders them."""
    encoded = tokenizer.apply_chat_template(
        turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, chat_template=template
    )
    return list(encoded["input_ids"]), list(encoded["assistant_masks"])
