"""What users bring, built at test time (nothing can be downloaded): model folders of other architectures with
tokenizers trained by the `tokenizers` library, and a chat dataset without reference answers.

    gpt2_folder(path)      GPT-2 style: byte-level BPE, EOS only (no pad token), no chat template, float32
    qwen2_folder(path)     Qwen2 style: ChatML template, EOS `<|im_end|>`, pad `<|endoftext|>`, saved in bfloat16,
                           and a generation_config.json with Qwen's sampling defaults (top_k, top_p,
                           repetition_penalty) that our rollouts must not inherit
    qwen25_folder(path)    the same with Qwen2.5-Instruct's exact chat template (tools included, no {% generation %}
                           marks), which TRL 1.16 ships a training version of
    chat_data(folder)      TRL conversational shapes, no `answer` column anywhere: `messages` SFT rows with system
                           turns, implicit-prompt preferences with score columns (UltraFeedback's shape), prompt-only
                           conversational prompts; returns the `--set data.*.path=` overrides
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# Qwen2.5's chat template, shortened to the part without tools (no {% generation %} marks, as shipped).
QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

COLOURS = ["red", "blue", "green", "yellow", "black", "white", "purple", "orange", "grey", "pink", "brown", "gold"]
ANIMALS = ["cat", "dog", "fox", "owl", "bear", "frog", "hare", "wolf", "duck", "seal", "lynx", "mole"]
SYSTEM = "You are a friendly assistant who answers in one short sentence."


def _corpus() -> list[str]:
    words = (
        COLOURS
        + ANIMALS
        + ["Describe", "the", "a", "is", "calm", "and", "kind", "no", "Tell", "me", "about", "friendly", "assistant"]
    )
    rng = random.Random(0)
    return [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)] + [
        SYSTEM,
        "You are a helpful assistant.",
    ]


def train_tokenizer(specials: list[str], vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on the fixture's words (GPT-2's and Qwen2's kind)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(), trainer=trainer)
    return core


def gpt2_folder(path: Path) -> Path:
    """A GPT-2-style causal LM folder: BPE tokenizer with `<|endoftext|>` as BOS/EOS/UNK, no pad token, no chat
    template."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    eos = "<|endoftext|>"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer([eos]), bos_token=eos, eos_token=eos, unk_token=eos, model_max_length=256
    )
    assert tokenizer.pad_token is None and tokenizer.chat_template is None
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=256,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def qwen25_template() -> str:
    """Qwen2.5-Instruct's chat template, character for character: the copy TRL 1.16 recognises it by
    (trl/chat_templates/qwen2_5.jinja)."""
    from trl.chat_template_utils import qwen2_5_chat_template

    return qwen2_5_chat_template


def qwen25_folder(path: Path) -> Path:
    """A Qwen2-style folder with Qwen2.5-Instruct's exact chat template."""
    return qwen2_folder(path, chat_template=qwen25_template())


def qwen2_folder(path: Path, chat_template: str = QWEN_TEMPLATE) -> Path:
    """A Qwen2-style folder as Qwen2.5-Instruct ships: ChatML, EOS `<|im_end|>`, pad `<|endoftext|>`, bf16 weights."""
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(specials),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
        chat_template=chat_template,
        model_max_length=256,
    )
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config = GenerationConfig(
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
        repetition_penalty=1.05,
        eos_token_id=[tokenizer.eos_token_id, end_of_text],
        pad_token_id=end_of_text,
    )
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _turns(prompt: str, system: bool) -> list[dict]:
    return ([{"role": "system", "content": SYSTEM}] if system else []) + [{"role": "user", "content": prompt}]


def chat_data(folder: Path, seed: int = 0) -> list[str]:
    """Conversational datasets without reference answers; returns `--set` overrides pointing the data block at them.

    Train and held-out prompts are disjoint (the data stage's leakage rule): colour/animal pairs are split.
    """
    rng = random.Random(seed)
    pairs = [(c, a) for c in COLOURS for a in ANIMALS]
    rng.shuffle(pairs)
    held_out, train = pairs[:24], pairs[24:]

    def ask(colour: str, animal: str) -> str:
        return f"Describe the {colour} {animal}."

    def good(colour: str, animal: str) -> str:
        return f"The {colour} {animal} is calm and kind."

    rows: dict[str, list[dict]] = {
        "sft": [],
        "preference": [],
        "preference_eval": [],
        "prompts": [],
        "prompts_eval": [],
    }
    for i, (colour, animal) in enumerate(train):
        turns = _turns(ask(colour, animal), system=i % 2 == 0)
        rows["sft"].append(
            {"messages": turns + [{"role": "assistant", "content": good(colour, animal)}], "source": "fixture"}
        )
        rows["preference"].append(
            {
                "chosen": turns + [{"role": "assistant", "content": good(colour, animal)}],
                "rejected": turns + [{"role": "assistant", "content": "no"}],
                "score_chosen": 8.0,
                "score_rejected": 2.0,
            }
        )
        rows["prompts"].append({"prompt": turns})
    for i, (colour, animal) in enumerate(held_out):
        turns = _turns(ask(colour, animal), system=i % 2 == 1)
        if i < 12:
            rows["preference_eval"].append(
                {
                    "chosen": turns + [{"role": "assistant", "content": good(colour, animal)}],
                    "rejected": turns + [{"role": "assistant", "content": "no"}],
                }
            )
        else:
            rows["prompts_eval"].append({"prompt": turns})
    folder.mkdir(parents=True, exist_ok=True)
    overrides = []
    for name, items in rows.items():
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in items))
        overrides.append(f"data.{name}.path={path}")
    return overrides
