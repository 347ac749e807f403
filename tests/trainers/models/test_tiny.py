from rlhf_pipeline.trainers.config import ModelConfig
from rlhf_pipeline.trainers.models.base_model import load_base_model
from rlhf_pipeline.trainers.models.tiny import EOS, build_tokenizer
from tests.helpers import trainable, unchanged


def test_tokenizer_round_trips_any_utf8_text():
    tokenizer = build_tokenizer()
    for text in [
        "sort 3142 -> 1234",
        "héllo wörld",
        "日本語のテキスト",
        "emoji 🙂👍",
        "tabs\tand\nnewlines",
        "\x00\x7f",
    ]:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text


def test_chat_template_closes_assistant_turns_with_eos_and_marks_them_for_loss():
    tokenizer = build_tokenizer()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.endswith("yo" + EOS)
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    trained = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tokenizer.decode(trained) == "yo" + EOS
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt)  # TRL derives the completion as the part after the prompt


def test_tiny_base_model_is_reproducible_from_its_seed():
    a, _ = load_base_model(ModelConfig(seed=1))
    b, _ = load_base_model(ModelConfig(seed=1))
    c, _ = load_base_model(ModelConfig(seed=2))
    weights = trainable(a)
    assert unchanged(weights, b) == sorted(weights)  # same seed: every tensor identical
    # Another seed redraws every random tensor; RMSNorm weights start at 1 whatever the seed.
    assert unchanged(weights, c) == sorted(name for name in weights if name.endswith("norm.weight"))
    # 263 tokens (256 bytes + 7 specials) x 128 twice (embedding and untied head), 4 blocks of 4 x 128^2
    # (attention) + 3 x 128 x 512 (MLP) + 2 x 128 (norms), and the final norm: 1,117,056.
    assert sum(p.numel() for p in a.parameters()) == 2 * 263 * 128 + 4 * (4 * 128**2 + 3 * 128 * 512 + 2 * 128) + 128
