"""`sft.assistant_only_loss` on a template without {% generation %} marks: accepted where TRL 1.16 has a training
version of it (the rule checks the assistant mask that version gives), refused with the file and the rule where it has
none or where the marks cover other turns."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from rlhf_pipeline.trainers.config import ModelConfig
from rlhf_pipeline.trainers.data import DatasetSpec, load_source
from rlhf_pipeline.trainers.models.base_model import load_base_tokenizer
from rlhf_pipeline.trainers.models.templates import assistant_mask, has_generation_marks, training_template
from rlhf_pipeline.validators import DataValidationError, validate_dataset
from rlhf_pipeline.validators.template_rules import PROBE
from tests.foreign_models import qwen2_folder, qwen25_folder, qwen25_template
from tests.helpers import write_jsonl
from tests.validators.test_template_rules import CHAT as RULES_CHAT

CHAT = [  # test_template_rules' rows, the first one turn longer: every end of turn in a conversation is trained
    {
        "messages": [
            *RULES_CHAT[0]["messages"],
            {"role": "user", "content": "And the fox?"},
            {"role": "assistant", "content": "Kind."},
        ]
    },
    *RULES_CHAT[1:],
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2.5": load_base_tokenizer(ModelConfig(name_or_path=str(qwen25_folder(root / "qwen2.5")))),
        "shortened": load_base_tokenizer(ModelConfig(name_or_path=str(qwen2_folder(root / "shortened")))),
        "folder": root / "shortened",
    }


def check(tmp_path, tokenizer, **extra):
    path = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    source = load_source(DatasetSpec(path=str(path)))
    return validate_dataset("sft", source, source=str(path), tokenizer=tokenizer, max_tokens=256, **extra)


def test_qwen25s_template_trains_assistant_turns_only_with_trls_training_version(tokenizers, tmp_path):
    """Qwen2.5-Instruct's template has no marks; TRL swaps in its training version, whose mask covers each reply, its
    `<|im_end|>` and the newline after it, and nothing of the other turns: the template is accepted and every turn's
    end of turn is trained."""
    qwen = tokenizers["qwen2.5"]
    assert qwen.chat_template == qwen25_template() and not has_generation_marks(qwen)
    template = training_template(qwen)
    assert template is not None and "{%- generation %}" in template
    ids, mask = assistant_mask(qwen, PROBE, template)
    trained = qwen.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "\nReply zqb one.<|im_end|>\n\nReply zqd two.<|im_end|>\n"
    assert assistant_mask(qwen, PROBE)[1] == [0] * len(ids)  # its own template marks nothing (as shipped)
    report = check(tmp_path, qwen, assistant_only=True)
    assert report.success and "end_of_turn_trained" in {r.rule for r in report.rules}


def test_a_template_trl_has_no_training_version_of_is_refused_with_the_file_and_rule(tokenizers, tmp_path):
    """The shortened Qwen template is not one TRL knows: refused on the file, by rule, with the fix."""
    with pytest.raises(DataValidationError) as refused:
        check(tmp_path, tokenizers["shortened"], assistant_only=True, model_name="'qwen2-style'")
    message = str(refused.value)
    assert str(tmp_path / "chat.jsonl") in message and "rule 'chat_template' failed for 2 of 2 rows" in message
    assert "the chat template of 'qwen2-style' has none, nor does TRL 1.16 have a training version of it" in message
    assert "set model.chat_template=chatml (marked)" in message
    assert check(tmp_path, tokenizers["shortened"]).success  # without assistant_only_loss every token trains


def test_marks_that_cover_other_turns_are_refused_by_what_they_mask(tokenizers, tmp_path):
    """Marks around every turn's text: the template has marks, but the mask it gives trains the user's words too."""
    everyone = tmp_path / "everyone.jinja"
    everyone.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% generation %}{{ m['content'] }}<|im_end|>"
        "{% endgeneration %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = load_base_tokenizer(ModelConfig(name_or_path=str(tokenizers["folder"]), chat_template=str(everyone)))
    assert has_generation_marks(tokenizer)
    with pytest.raises(DataValidationError) as refused:
        check(tmp_path, tokenizer, assistant_only=True, model_name="'marked'")
    message = str(refused.value)
    assert "rule 'chat_template' failed for 2 of 2 rows" in message
    assert "would train 4 span(s) of a sample conversation" in message and "it trains other turns too" in message
