import math
import sys

import pytest
import torch
from pydantic import ValidationError

from rlhf_pipeline.trainers.config import ModelConfig, TinyModelConfig
from rlhf_pipeline.trainers.models.base_model import load_base_model
from rlhf_pipeline.trainers.models.load import save_model
from rlhf_pipeline.trainers.rewards.judges import (
    DEFAULT_TEMPLATE,
    JudgeConfig,
    judged_win_rate,
    load_judge,
    render_prompt,
)
from tests.foreign_models import gpt2_folder

SMALL = ModelConfig(
    tiny=TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name an animal."}]


def longer_is_better(prompts, completions_a, completions_b):
    """A consistent judge: the longer answer wins, whatever its position."""
    return [1.0 if len(a) > len(b) else 0.0 if len(a) < len(b) else 0.5 for a, b in zip(completions_a, completions_b)]


def first_is_better(prompts, completions_a, completions_b):
    """The pure position bias: the answer shown first always wins."""
    return [1.0] * len(prompts)


def leaning_judge(prompts, completions_a, completions_b):
    """Prefers the longer answer, but with +0.1 towards the first position: 0.9 when the first is longer, 0.3 when it is
    shorter."""
    return [0.6 + (0.3 if len(a) > len(b) else -0.3) for a, b in zip(completions_a, completions_b)]


def _items(n_long: int, n_short: int, n_same: int = 0):
    """Pairs where a is longer than b n_long times, shorter n_short times, identical n_same times."""
    rows = (
        [("p", "long answer", "short")] * n_long
        + [("p", "x", "longer one")] * n_short
        + [("p", "same", "same")] * n_same
    )
    return [list(column) for column in zip(*rows)]


def test_function_judge_win_rate_has_an_interval_that_narrows_with_more_items():
    judge = load_judge(JudgeConfig(path="tests.trainers.rewards.test_judges:longer_is_better"))
    seen = []
    spy = lambda p, a, b: seen.extend(zip(a, b)) or judge(p, a, b)

    few = judged_win_rate(spy, *_items(7, 3, 2))
    assert few.win_rate.rate == pytest.approx(8 / 12)  # 7 wins, 3 losses, 2 ties at 0.5
    assert few.win_rate.ties == 2 and few.judged == 10 and few.win_rate.n == 12
    assert ("same", "same") not in seen and len(
        seen
    ) == 20  # both orders of the 10 different pairs, never the identical ones
    assert few.position_bias == 0 and few.order_disagreement == 0
    assert few.win_rate.low < few.win_rate.rate < few.win_rate.high

    many = judged_win_rate(judge, *_items(70, 30, 20))
    assert many.win_rate.rate == pytest.approx(few.win_rate.rate)
    assert many.win_rate.low < many.win_rate.rate < many.win_rate.high
    # ~1/sqrt(10) of the width
    assert many.win_rate.high - many.win_rate.low < 0.6 * (few.win_rate.high - few.win_rate.low)
    metrics = many.metrics("eval/heldout/judge_win_rate_vs_sft")
    assert metrics["eval/heldout/judge_win_rate_vs_sft"] == many.win_rate.rate
    assert set(metrics) == {
        "eval/heldout/judge_win_rate_vs_sft" + s for s in ("", "_low", "_high", "_position_bias", "_order_disagreement")
    }


def test_swapping_positions_cancels_a_judge_that_always_picks_the_first():
    prompts, a, b = _items(6, 4)
    assert sum(first_is_better(prompts, a, b)) / len(a) == 1.0  # one order alone: a "wins" everything
    result = judged_win_rate(first_is_better, prompts, a, b)
    assert result.win_rate.rate == 0.5 and result.position_bias == 0.5 and result.order_disagreement == 1.0
    assert judged_win_rate(lambda p, x, y: [0.0] * len(p), prompts, a, b).position_bias == -0.5


def test_a_leaning_judge_against_hand_worked_values():
    # a longer: p(a,b) = 0.9, p(b,a) = 0.3 -> preference (0.9 + 0.7) / 2 = 0.8, bias (0.9 + 0.3) / 2 - 0.5 = 0.1.
    # a shorter: p(a,b) = 0.3, p(b,a) = 0.9 -> preference 0.2, same bias. Both orders agree on every verdict.
    result = judged_win_rate(leaning_judge, *_items(3, 1))
    assert list(result.preferences) == pytest.approx([0.8, 0.8, 0.8, 0.2])
    assert result.win_rate.rate == pytest.approx(0.65) and result.position_bias == pytest.approx(0.1)
    assert result.order_disagreement == 0


@pytest.fixture(scope="module")
def tiny_judge(tmp_path_factory):
    folder = tmp_path_factory.mktemp("judge") / "model"
    model, tokenizer = load_base_model(SMALL)
    save_model(model, tokenizer, folder)
    return folder, model.eval(), tokenizer


def _softmax_ab(model, ids: list[int], a: int, b: int) -> float:
    """P("A") / (P("A") + P("B")) at the next position of one unpadded row."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
    return 1 / (1 + math.exp(logits[b] - logits[a]))


def test_lm_judge_reads_the_verdict_logits_of_a_chat_model(tiny_judge):
    folder, model, tokenizer = tiny_judge
    judge = load_judge(JudgeConfig(path=str(folder), batch_size=2))
    prompts = ["Sort 3 1 2.", CHAT, "Sort the digits 9 8 7 6 5 4 3 2 1, please, in increasing order."]
    a, b = ["1 2 3", "A cat.", "123456789"], ["3 2 1", "A very friendly dog.", "987654321"]

    probabilities = judge(prompts, a, b)
    assert len(probabilities) == 3 and all(0 < p < 1 for p in probabilities)
    assert judge(prompts, a, b) == probabilities
    assert probabilities[1] != pytest.approx(judge(prompts, b, a)[1], abs=1e-6)  # the order reaches the model

    assert render_prompt(CHAT) == "System: Be brief.\n\nUser: Name an animal."
    # Byte-level: "A" is one token after <|assistant|>
    verdict_a, verdict_b = tokenizer.convert_tokens_to_ids(["A", "B"])
    # Item 0 shares a batch with the longer item 1, so it is left-padded; item 1 is the message-list prompt.
    for i, shown in [(0, "Sort 3 1 2."), (1, "System: Be brief.\n\nUser: Name an animal.")]:
        text = DEFAULT_TEMPLATE.format(prompt=shown, a=a[i], b=b[i])
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        assert rendered.startswith("<|user|>") and rendered.endswith("<|assistant|>")
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert probabilities[i] == pytest.approx(_softmax_ab(model, ids, verdict_a, verdict_b), abs=1e-5)

    result = judged_win_rate(judge, prompts, a, b)
    swapped = judge(prompts, b, a)
    assert list(result.preferences) == pytest.approx(
        [(p + 1 - q) / 2 for p, q in zip(probabilities, swapped)], abs=1e-6
    )


def test_lm_judge_scores_the_space_letter_token_where_the_vocabulary_has_one(tmp_path):
    """GPT-2 style: no chat template, no pad token, and " A" / " B" are single tokens, so after the default
    template's trailing space the verdict is " A" read after "...answer:", not "A" read after a lone space."""
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = gpt2_folder(tmp_path / "gpt2")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens([AddedToken(" A", normalized=False), AddedToken(" B", normalized=False)])
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    # Rows unlike each other and the rest, so the verdict depends on the context and on which token is read
    with torch.no_grad():
        torch.manual_seed(0)
        model.get_output_embeddings().weight[-2:] = 0.2 * torch.randn(2, model.config.n_embd)
    save_model(model, tokenizer, folder)
    model.eval()

    judge = load_judge(JudgeConfig(path=str(folder)))
    # Unequal lengths: the second row is left-padded
    prompts, a, b = (
        ["Tell me about the fox.", "Describe a cat"],
        ["the fox is calm and kind", "a cat"],
        ["red", "a dog"],
    )
    probabilities = judge(prompts, a, b)
    space_a, space_b = tokenizer.convert_tokens_to_ids([" A", " B"])
    for i in range(2):
        text = DEFAULT_TEMPLATE.format(prompt=prompts[i], a=a[i], b=b[i])
        assert text.endswith(": ")
        context = tokenizer(text[:-1])["input_ids"]
        assert probabilities[i] == pytest.approx(_softmax_ab(model, context, space_a, space_b), abs=1e-5)
        lone_space = tokenizer(text)["input_ids"]
        assert probabilities[i] != pytest.approx(
            _softmax_ab(model, lone_space, *tokenizer.convert_tokens_to_ids(["A", "B"])), abs=1e-4
        )


def test_templates_and_paths_are_checked_with_the_config():
    with pytest.raises(ValidationError, match=r"lacks \{a\}"):
        JudgeConfig(path="some/judge", template="Prompt {prompt}. Which is better, this or {b}?")
    with pytest.raises(ValidationError, match=r"unknown placeholders \{answer\}"):
        JudgeConfig(path="some/judge", template="{prompt} {a} {b} {answer}")
    with pytest.raises(
        ValidationError, match=r'unknown placeholders \{"verdict"\} \(write literal braces as \{\{ and \}\}\)'
    ):
        JudgeConfig(path="some/judge", template='{prompt} {a} {b} reply as {"verdict": "A"}')
    with pytest.raises(ValidationError, match=r"judge template: Single '}'"):
        JudgeConfig(path="some/judge", template="{prompt} {a} {b} :-}")
    assert "{" in JudgeConfig(path="some/judge", template='{prompt} {a} {b} reply as {{"verdict": "A"}}').template
    with pytest.raises(ValidationError, match=r"'package.module:function'"):
        JudgeConfig(path="my judges:prefer")
    with pytest.raises(ValidationError, match="neither"):
        JudgeConfig(path="not a model")
    with pytest.raises(ValidationError, match="only apply to an LM judge"):
        JudgeConfig(path="tests.trainers.rewards.test_judges:longer_is_better", revision="main")
    assert [name for name, field in JudgeConfig.model_fields.items() if not field.description] == []


def test_broken_function_judges_fail_with_their_path(tmp_path, monkeypatch):
    (tmp_path / "my_judges.py").write_text(
        "def short(prompts, a, b):\n    return [0.5]\n"
        "def percent(prompts, a, b):\n    return [75.0] * len(prompts)\n"
        "def nan(prompts, a, b):\n    return [float('nan')] * len(prompts)\n"
        "def text(prompts, a, b):\n    return 'A'\n"
        "def boom(prompts, a, b):\n    raise KeyError('rubric')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def load(path: str):
        return load_judge(JudgeConfig(path=path))

    with pytest.raises(ValueError, match=r"'no_such_module:judge'.*does not import"):
        load("no_such_module:judge")
    with pytest.raises(ValueError, match=r"'my_judges:missing'.*has no 'missing'"):
        load("my_judges:missing")
    with pytest.raises(ValueError, match=r"'my_judges:short' returned 1 values for 2 pairs"):
        load("my_judges:short")
    with pytest.raises(ValueError, match=r"'my_judges:percent' returned 75.0; .*\[0, 1\]"):
        load("my_judges:percent")
    with pytest.raises(ValueError, match=r"'my_judges:nan' returned nan"):
        load("my_judges:nan")
    with pytest.raises(ValueError, match=r"'my_judges:text' returned str 'A'"):
        load("my_judges:text")
    with pytest.raises(ValueError, match=r"'my_judges:boom' raised.*rubric"):
        load("my_judges:boom")
    with pytest.raises(
        ValueError, match=r"judge '/no/such/judge': cannot load it as a causal LM from a hub id \(no such folder here\)"
    ):
        load("/no/such/judge")
    with pytest.raises(ValueError, match=r"the judge returned 2.0; it must return P\(a is better\) in \[0, 1\]"):
        judged_win_rate(lambda p, a, b: [2.0] * len(p), *_items(1, 1))
    sys.modules.pop("my_judges", None)
