"""The embedded default model: a byte-level tokenizer and a small Llama, both built locally.

No download is possible on our CI machines, and users dry-run their own data on
this model before renting a GPU, so the tokenizer must take any UTF-8 text: it is
byte-level (every byte is a token, like GPT-2's alphabet with no merges), plus the
special tokens of a small chat template.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from rlhf_pipeline.trainers.config import TinyModelConfig

EOS, PAD = "<|endoftext|>", "<|pad|>"
ROLES = ("system", "user", "assistant", "tool")
"""The roles of a conversation (TRL's conversational formats), each a special token of the tiny template; the data rules
accept these."""

# Assistant turns end with EOS: TRL adds no EOS to conversational rows
# (docs/LIBRARY-FACTS.md, TRL and transformers),
# and generation must stop there. {% generation %} marks the tokens that
# `assistant_only_loss` trains on.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|{{ message['role'] }}|>"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ message['content'] }}" + EOS + "{% endgeneration %}"
    "{%- else -%}"
    "{{ message['content'] }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    specials = [EOS, PAD, "<|end|>", *(f"<|{role}|>" for role in ROLES)]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=specials[2:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )
    return tokenizer


def build_model(config: TinyModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    # Same seed, same base weights: eval rebuilds the untrained base to measure it.
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(llama)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
