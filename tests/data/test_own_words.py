"""The constraint wordings of the project's own (issue 61, item 1): every IFEval type, several wordings each, none
sharing a 13-word span with a benchmark prompt, each with arguments its checker builds from and checks with."""

from __future__ import annotations

import random

import pytest

from rlhf_pipeline.data import instructions, own_words
from rlhf_pipeline.data.instructions import REQUESTS
from rlhf_pipeline.trainers.evaluation.instructions import BENCHMARKS, benchmark_file
from rlhf_pipeline.trainers.rewards.ifeval import registry
from rlhf_pipeline.validators.leakage import shared_span, span_index


@pytest.fixture(scope="module")
def benchmark_spans():
    prompts = [row["prompt"] for benchmark in BENCHMARKS.values() for row in benchmark_file(benchmark)[1]]
    return span_index(prompts)


def test_every_ifeval_type_is_worded_three_ways_or_more():
    assert set(own_words.TYPES) == set(registry("ifeval"))  # all 25 (issue 61 asks for at least 20)
    for kind in own_words.KINDS.values():
        assert len(set(kind.texts)) >= 3


def test_no_wording_shares_a_thirteen_word_span_with_a_benchmark_prompt(benchmark_spans):
    rng = random.Random(0)
    for kind in own_words.TYPES:
        for _ in range(30):
            request = rng.choice(REQUESTS)
            text, _ = own_words.constraint(kind, rng, request)
            assert "{" not in text and shared_span(f"{request} {text}", benchmark_spans) is None, (kind, text)


def test_the_span_rule_finds_a_benchmark_prompt_contained_or_lightly_reworded(benchmark_spans):
    ifeval = benchmark_file(BENCHMARKS["ifeval"])[1]
    prompt = ifeval[7]["prompt"]
    assert shared_span(f"Please help me. {prompt} Thanks in advance!", benchmark_spans) is not None  # contained
    reworded = prompt.replace(",", " ;").upper() + " One more sentence of my own."  # punctuation and case changed
    assert shared_span(reworded, benchmark_spans) is not None
    assert shared_span("Describe a quiet library. Write without commas.", benchmark_spans) is None
    # the checker library's own wording, which data/instructions.py built the bundled prompts with before, is IFEval's
    checker = registry("ifeval")["detectable_content:postscript"]("detectable_content:postscript")
    postscript = checker.build_description(postscript_marker="P.S.")
    assert shared_span(f"Describe a quiet library. {postscript}", benchmark_spans) is not None


def test_the_bundled_prompts_cover_every_type_and_hold_their_last_wording_out():
    """Every type is trained on and held out; the held-out split (the dev split recipes are chosen on) asks in
    wordings no training prompt uses. (Seeding, staleness and held-out requests: tests/trainers/rewards/test_ifeval.)"""
    import json
    from pathlib import Path

    bundled = Path(instructions.__file__).parent / "ifeval"
    rows = {name: [json.loads(line) for line in (bundled / f"{name}.jsonl").open()] for name in instructions.SIZES}
    for name, split in rows.items():
        assert {kind for row in split for kind in row["instruction_id_list"]} == set(own_words.TYPES), name
    trained = {text.split("{")[0] for kind in own_words.KINDS.values() for text in kind.texts[:-1]}
    held_out = {kind.texts[-1].split("{")[0] for kind in own_words.KINDS.values()}
    assert not trained & held_out
    for row in rows["prompts_eval"]:
        text = row["prompt"][0]["content"]
        assert any(f". {start}" in text for start in held_out), text
        assert not any(f". {start}" in text for start in trained if len(start) > 8), text


def test_every_bundled_row_is_checked_by_the_checkers_it_names():
    """As the reward checks it (`rewards.ifeval.check`): a row whose arguments a checker cannot build from (a language
    its description does not name, say) would stop GRPO at the step that drew it."""
    import json
    from pathlib import Path

    from rlhf_pipeline.trainers.rewards.ifeval import check

    bundled = Path(instructions.__file__).parent / "ifeval"
    for name in instructions.SIZES:
        for line in (bundled / f"{name}.jsonl").open():
            row = json.loads(line)
            check("An answer.", row["instruction_id_list"], row["kwargs"], row["prompt"][0]["content"], "ifeval")
    for code in own_words.LANGUAGES:  # every language a prompt may ask for, whichever rows the seed drew
        registry("ifeval")["language:response_language"]("language:response_language").build_description(language=code)
