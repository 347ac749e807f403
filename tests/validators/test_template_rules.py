"""Rules `chat_template` and `end_of_turn_trained`: conversational data on a tokenizer that cannot train it is
refused in `data`, naming the rule and the fix, before any weights load."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from rlhf_pipeline.trainers.config import ModelConfig
from rlhf_pipeline.trainers.data import DatasetSpec, load_source
from rlhf_pipeline.trainers.models.base_model import load_base_tokenizer
from rlhf_pipeline.validators import DataValidationError, validate_dataset
from tests.foreign_models import gpt2_folder, qwen2_folder
from tests.helpers import write_jsonl

CHAT = [
    {
        "messages": [
            {"role": "user", "content": "Describe the red cat."},
            {"role": "assistant", "content": "The red cat is calm."},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Describe the fox."},
            {"role": "assistant", "content": "Calm."},
        ]
    },
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"gpt2": gpt2_folder(root / "gpt2"), "qwen2": qwen2_folder(root / "qwen2")}


def check(tmp_path, tokenizer, rows=CHAT, kind="sft", **extra):
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    return validate_dataset(
        kind, load_source(DatasetSpec(path=str(path))), source=str(path), tokenizer=tokenizer, max_tokens=256, **extra
    )


def test_conversations_on_a_tokenizer_without_a_template_fail_the_rule_with_the_fix(folders, tmp_path):
    tokenizer = load_base_tokenizer(ModelConfig(name_or_path=str(folders["gpt2"])))
    with pytest.raises(DataValidationError) as failure:
        check(tmp_path, tokenizer, model_name="'gpt2-style'")
    message = str(failure.value)
    assert "rule 'chat_template' failed for 2 of 2 rows" in message and "set model.chat_template=chatml" in message
    # One clear cause, not a tokenizer exception
    assert "fits_max_length" not in message and "Cannot use chat template" not in message
    # Standard (string) rows need no template; with chatml the conversations pass.
    assert check(tmp_path, tokenizer, rows=[{"text": "The red cat is calm."}]).success
    chatml = load_base_tokenizer(ModelConfig(name_or_path=str(folders["gpt2"]), chat_template="chatml"))
    assert check(tmp_path, chatml).success
    assert {
        r.rule for r in check(tmp_path, chatml, kind="prompt", rows=[{"prompt": CHAT[0]["messages"][:1]}]).rules
    } >= {"fits_max_length"}


def test_assistant_only_loss_needs_marks_that_cover_the_end_of_turn(folders, tmp_path):
    qwen = load_base_tokenizer(ModelConfig(name_or_path=str(folders["qwen2"])))
    assert check(tmp_path, qwen).success  # Qwen's own template trains every token: fine without assistant_only_loss
    with pytest.raises(
        DataValidationError,
        match=r"rule 'chat_template'.*assistant_only_loss trains the tokens inside \{% generation %\} marks",
    ):
        check(tmp_path, qwen, assistant_only=True)

    # Marks that leave the end-of-turn token out: the model would never learn to stop.
    leaky = tmp_path / "leaky.jinja"
    leaky.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}{% endgeneration %}"
        "<|im_end|>\n{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
        "<|im_start|>assistant\n{% endif %}"
    )
    leaking = load_base_tokenizer(ModelConfig(name_or_path=str(folders["qwen2"]), chat_template=str(leaky)))
    with pytest.raises(DataValidationError) as failure:
        check(tmp_path, leaking, assistant_only=True)
    assert "rule 'end_of_turn_trained' failed for 2 of 2 rows" in str(failure.value)
    assert "1 of 1 assistant turns are trained without their end-of-turn token '<|im_end|>'" in str(failure.value)
    marked = load_base_tokenizer(ModelConfig(name_or_path=str(folders["qwen2"]), chat_template="chatml"))
    report = check(tmp_path, marked, assistant_only=True)
    assert {"end_of_turn_trained", "fits_max_length"} <= {r.rule for r in report.rules} and report.success
