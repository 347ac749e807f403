"""Chat templates, stop tokens and numerics of foreign checkpoints (GPT-2 and Qwen2 style folders built here)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from rlhf_pipeline.trainers.config import ModelConfig
from rlhf_pipeline.trainers.models import templates, text
from rlhf_pipeline.trainers.models.base_model import load_base_model, load_base_tokenizer
from rlhf_pipeline.trainers.models.load import load_causal_lm, save_model
from tests.foreign_models import gpt2_folder, qwen2_folder

TURNS = [{"role": "user", "content": "Describe the red cat."}, {"role": "assistant", "content": "The red cat is calm."}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"gpt2": gpt2_folder(root / "gpt2"), "qwen2": qwen2_folder(root / "qwen2")}


def test_chatml_gives_a_base_model_a_template_its_tokens_and_a_stop_at_the_end_of_turn(folders, tmp_path):
    plain = load_base_tokenizer(ModelConfig(name_or_path=str(folders["gpt2"])))
    assert (
        plain.chat_template is None
        and templates.end_of_turn(plain) is None
        and templates.stop_token_ids(plain) == [plain.eos_token_id]
    )

    model, tokenizer = load_base_model(ModelConfig(name_or_path=str(folders["gpt2"]), chat_template="chatml"))
    assert len(tokenizer) == len(plain) + 2 and model.get_input_embeddings().weight.shape[0] == len(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.tokenize("<|im_end|>") == ["<|im_end|>"]  # one special token, not split into bytes
    assert templates.end_of_turn(tokenizer) == "<|im_end|>"
    assert templates.stop_token_ids(tokenizer) == [tokenizer.eos_token_id, im_end]
    # The end of turn sits inside the {% generation %} marks, so assistant_only_loss trains the model to stop.
    encoded = tokenizer.apply_chat_template(TURNS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    trained = [i for i, m in zip(encoded["input_ids"], encoded["assistant_masks"]) if m]
    assert trained[-1] == im_end and tokenizer.decode(trained[:-1]) == "The red cat is calm."

    # Saved with the tokenizer, and the generation config stops at both.
    save_model(model, tokenizer, tmp_path / "sft")
    reloaded = load_causal_lm(tmp_path / "sft")[1]
    assert reloaded.chat_template == templates.CHATML and templates.stop_token_ids(reloaded) == [
        tokenizer.eos_token_id,
        im_end,
    ]
    assert json.loads((tmp_path / "sft" / "generation_config.json").read_text())["eos_token_id"] == [
        tokenizer.eos_token_id,
        im_end,
    ]


def test_a_jinja_file_is_a_template_and_an_unknown_name_is_refused(folders, tmp_path):
    jinja = tmp_path / "mine.jinja"
    jinja.write_text(
        "{% for m in messages %}[{{ m['role'] }}] "
        "{{ m['content'] }}<|endoftext|>{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    tokenizer = load_base_tokenizer(ModelConfig(name_or_path=str(folders["gpt2"]), chat_template=str(jinja)))
    assert (
        tokenizer.apply_chat_template(TURNS[:1], tokenize=False, add_generation_prompt=True)
        == "[user] Describe the red cat.<|endoftext|>[assistant] "
    )
    assert templates.end_of_turn(tokenizer) == "<|endoftext|>"
    with pytest.raises(
        ValueError, match=r"model.chat_template='chatm': not a known template \(chatml\) nor a Jinja file"
    ):
        load_base_tokenizer(ModelConfig(name_or_path=str(folders["gpt2"]), chat_template="chatm"))
    with pytest.raises(ValueError, match="no such Jinja file"):
        load_base_tokenizer(
            ModelConfig(name_or_path=str(folders["gpt2"]), chat_template=str(tmp_path / "missing.jinja"))
        )


def test_a_bf16_checkpoint_is_trained_and_saved_with_float32_master_weights_unless_the_dtype_says_otherwise(
    folders, tmp_path
):
    with safe_open(folders["qwen2"] / "model.safetensors", "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16
    model, tokenizer = load_base_model(ModelConfig(name_or_path=str(folders["qwen2"])))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    save_model(model, tokenizer, tmp_path / "fp32")
    with safe_open(tmp_path / "fp32" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    explicit, _ = load_base_model(ModelConfig(name_or_path=str(folders["qwen2"]), dtype="bfloat16"))
    assert {p.dtype for p in explicit.parameters()} == {torch.bfloat16}
    # The upcast is exact: float32 holds every bf16 value.
    assert torch.equal(model.get_input_embeddings().weight, explicit.get_input_embeddings().weight.float())


def test_generation_ignores_the_sampling_defaults_a_checkpoint_ships(folders):
    """Qwen's generation_config.json carries top_k=20, top_p=0.8, repetition_penalty=1.05: eval's samples
    must come from the plain temperature-1 distribution whose log-probabilities it scores."""
    model, tokenizer = load_base_model(ModelConfig(name_or_path=str(folders["qwen2"])))
    assert model.generation_config.top_k == 20 and model.generation_config.repetition_penalty == 1.05
    prompts = [TURNS[:1]] * 6
    torch.manual_seed(3)
    ours = text.generate(model, tokenizer, prompts, 10, 6, sample=True)
    assert model.generation_config.top_k == 20  # restored afterwards
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(3)
    blank = text.generate(model, tokenizer, prompts, 10, 6, sample=True)
    assert ours == blank
    inherited = GenerationConfig.from_pretrained(folders["qwen2"])
    model.generation_config = inherited
    torch.manual_seed(3)
    input_ids, mask = text.pad([text.prompt_ids(tokenizer, p) for p in prompts], tokenizer.pad_token_id, left=True)
    leaked = model.generate(
        input_ids=input_ids, attention_mask=mask, max_new_tokens=10, do_sample=True, temperature=1.0
    )
    # What the guard prevents
    assert tokenizer.batch_decode(leaked[:, input_ids.shape[1] :], skip_special_tokens=True) != ours
