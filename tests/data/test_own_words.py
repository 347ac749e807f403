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
    # the checker library's own wording, which data/instructions.py builds today's bundled prompts with, is IFEval's
    postscript, _ = instructions._constraint("detectable_content:postscript", random.Random(0))
    assert shared_span(f"Describe a quiet library. {postscript}", benchmark_spans) is not None


def test_each_checker_builds_from_its_arguments_and_checks_an_answer():
    """As the reward builds them (`rewards.ifeval.registry`: the NLTK data of a registry package, seeded langdetect)."""
    rng = random.Random(1)
    followed = {
        "punctuation:no_comma": ("No commas here at all.", "Here, a comma."),
        "startend:quotation": ('"All of it quoted."', "Not quoted."),
        "detectable_format:title": ("<<A Note>>\nHello there.", "Hello there."),
        "change_case:english_lowercase": ("all of this is lower case english text.", "Some Capitals Here."),
        "combination:two_responses": ("First answer.\n******\nSecond answer.", "Only one answer."),
    }
    for kind in own_words.TYPES:
        request = rng.choice(REQUESTS)
        _, arguments = own_words.constraint(kind, rng, request)
        checker = registry("ifeval")[kind](kind)
        checker.build_description(**arguments)  # a wrong or missing argument raises here
        kept = {k: v for k, v in (checker.get_instruction_args() or {}).items() if v is not None}
        assert kept == arguments, kind
        assert isinstance(checker.check_following("A short answer. It has two sentences."), bool), kind
        if kind in followed:
            yes, no = followed[kind]
            assert checker.check_following(yes) and not checker.check_following(no), kind
