import math
import statistics

import pytest

from rlhf_pipeline.trainers.config import ModelConfig, TinyModelConfig
from rlhf_pipeline.trainers.models.base_model import load_base_model
from rlhf_pipeline.trainers.rewards.metrics import (
    Interval,
    bootstrap_mean,
    bootstrap_runs_difference,
    distinct_n,
    hacking_warnings,
    kl_to_reference,
    length_drift,
    mean_length,
    perplexity,
    sequence_logprobs,
    win_rate,
)

TINY = ModelConfig(
    tiny=TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
)


@pytest.fixture(scope="module")
def tiny():
    return load_base_model(TINY)


# --- win rate and bootstrap --------------------------------------------------------


def test_win_rate_counts_wins_and_half_ties():
    result = win_rate([1, 2, 3, 4], [0, 2, 5, 1])  # wins, tie, loss, win
    assert result.rate == pytest.approx((2 + 0.5) / 4)
    assert (result.n, result.ties) == (4, 1)
    # Resamples of the outcomes (1, .5, 0, 1) have means in steps of 1/8: all wins in (1/2)^4 = 6% of them, so the
    # top 2.5% is 1.0; a mean <= 1/8 in only 2% (0: 0.4%, 1/8: 1.6%), so the bottom 2.5% is the next step, 2/8.
    assert (result.low, result.high) == (0.25, 1.0)


def test_win_rate_interval_separates_a_better_model_and_centres_equal_ones():
    import numpy as np

    rng = np.random.default_rng(1)
    b = rng.normal(size=600)
    better = win_rate(b + 1.0, b + rng.normal(scale=0.5, size=600))
    assert better.low > 0.5
    equal = win_rate(rng.normal(size=600), rng.normal(size=600))
    assert equal.low < 0.5 < equal.high and abs(equal.rate - 0.5) < 0.07


def test_win_rate_rejects_mismatched_or_empty_lists():
    with pytest.raises(ValueError, match="3 and 2"):
        win_rate([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="0 and 0"):
        win_rate([], [])


def test_bootstrap_is_reproducible():
    import numpy as np

    a, b = np.random.default_rng(0).normal(size=(2, 600))
    first = win_rate(a, b, seed=3)
    assert win_rate(a, b, seed=3) == first
    assert win_rate(a, b, seed=4) != first  # same rate, different interval


def test_bootstrap_mean_of_hits():
    interval = bootstrap_mean([1, 0, 1, 1], confidence=0.9)
    assert interval.mean == 0.75 and interval.n == 4
    # Resamples of (1, 0, 1, 1): all hits in (3/4)^4 = 32% of them, so the top 5% is 1.0; a mean of 0 in 0.4%,
    # 1/4 in 4.7%, so the bottom 5% is 1/4 (a close call: seed 0's 1000 resamples put it there).
    assert (interval.low, interval.high) == (0.25, 1.0)
    assert bootstrap_mean([2.0]) == Interval(2.0, 2.0, 2.0, 1)


def test_a_difference_over_runs_carries_the_seed_to_seed_spread():
    """Three seeds of a that scored 0, 1 and 2 on every prompt, against b's 1.2 on every prompt: each prompt's mean
    differs by exactly -0.2, so an interval over the prompts alone is [-0.2, -0.2]; the runs' spread puts 0 inside."""
    a, b = [[0.0] * 50, [1.0] * 50, [2.0] * 50], [[1.2] * 50] * 3
    over_prompts = bootstrap_mean([statistics.fmean(x) - 1.2 for x in zip(*a)])
    assert (over_prompts.low, over_prompts.high) == pytest.approx((-0.2, -0.2))
    interval = bootstrap_runs_difference(a, b)
    assert interval.mean == pytest.approx(-0.2) and interval.n == 50
    assert interval.low < -0.5 and interval.high > 0.5
    # Runs that agree: the items' spread alone, paired, so a constant shift is exact.
    shifted = bootstrap_runs_difference([[x + 1.0 for x in range(50)]] * 2, [list(map(float, range(50)))] * 3)
    assert (shifted.mean, shifted.low, shifted.high) == pytest.approx((1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match=r"same items \(got \(1, 2\) and \(1, 3\)\)"):
        bootstrap_runs_difference([[1.0, 2.0]], [[1.0, 2.0, 3.0]])


# --- texts, KL, drift --------------------------------------------------------------


def test_distinct_n_on_characters_and_on_words():
    assert distinct_n(["123", "123"], 1) == pytest.approx(3 / 6)  # digit strings: characters
    assert distinct_n(["1123"], 2) == pytest.approx(3 / 3)  # 11 12 23
    assert distinct_n(["the cat", "the dog"], 1) == pytest.approx(3 / 4)  # spaces: words
    assert distinct_n(["the cat", "the cat"], 2) == pytest.approx(1 / 2)
    assert distinct_n(["1", ""], 2) == 0.0 and distinct_n([], 1) == 0.0


def test_kl_to_reference_is_the_mean_log_ratio():
    assert kl_to_reference([-1.0, -2.0, -3.0], [-2.0, -2.0, -5.0]) == pytest.approx((1 + 0 + 2) / 3)
    with pytest.raises(ValueError, match="2 and 1"):
        kl_to_reference([-1.0, -2.0], [-1.0])


def test_lengths_and_drift():
    assert mean_length(["ab", "abcd"]) == 3.0
    assert length_drift(["abcdef", "abcdef"], ["ab", "abcd"]) == pytest.approx(1.0)
    assert length_drift(["a"], ["ab"]) == pytest.approx(-0.5)


BOUNDS = dict(max_length_drift=0.3, max_kl=5.0)


def test_hacking_warnings_fire_only_when_they_should():
    assert hacking_warnings(reward_delta=1.0, task_delta=0.1, length_drift=0.1, kl=1.0, **BOUNDS) == []
    # Bounds exclusive
    assert hacking_warnings(reward_delta=-0.5, task_delta=-0.2, length_drift=-0.3, kl=5.0, **BOUNDS) == []
    assert hacking_warnings(reward_delta=1.0, task_delta=None, length_drift=0.0, kl=0.0, **BOUNDS) == []

    (gaming,) = hacking_warnings(reward_delta=1.234, task_delta=-0.31, length_drift=0.0, kl=0.0, **BOUNDS)
    assert "rose by +1.23 while exact match fell by -0.31" in gaming
    (longer,) = hacking_warnings(reward_delta=0.0, task_delta=0.0, length_drift=-0.45, kl=0.0, **BOUNDS)
    assert "-45%" in longer
    (far,) = hacking_warnings(reward_delta=0.0, task_delta=0.0, length_drift=0.0, kl=7.5, **BOUNDS)
    assert "7.5" in far
    assert len(hacking_warnings(reward_delta=1.0, task_delta=-0.1, length_drift=0.9, kl=float("nan"), **BOUNDS)) == 3


# --- scoring under a tiny model ---------------------------------------------------


def test_sequence_logprobs_do_not_depend_on_batching(tiny):
    model, tokenizer = tiny
    prompts = ["sort 3 -> ", "sort 987654321 -> ", "sort 21 -> ", ""]
    completions = ["3", "123456789", "", "12"]
    batched = sequence_logprobs(model, tokenizer, prompts, completions, batch_size=4)
    single = [sequence_logprobs(model, tokenizer, [p], [c], batch_size=1)[0] for p, c in zip(prompts, completions)]
    assert batched == pytest.approx(single, abs=1e-4)
    # Byte-level tokenizer, a random model: each scored token costs about ln 263 = 5.57 nats. Scored: the
    # completion's bytes and EOS (the empty completion still scores its EOS), except after the empty prompt,
    # where the first byte has no context: 1 + 1, 9 + 1, 0 + 1 and 2 + 1 - 1 tokens.
    per_token = -math.log(len(tokenizer))
    assert batched == pytest.approx([2 * per_token, 10 * per_token, per_token, 2 * per_token], rel=0.05)


def test_only_the_positions_that_predict_a_completion_token_reach_the_output_layer(tiny):
    from rlhf_pipeline.trainers.models.text import completion_ids

    model, tokenizer = tiny
    prompts, completions = ["sort 987654321 -> ", "sort 3 -> "], ["123456789", "3"]
    rows = [completion_ids(tokenizer, p, c) for p, c in zip(prompts, completions)]
    width, first = max(len(ids) for ids, _ in rows), min(cut for _, cut in rows) - 1
    seen: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    try:
        scored = sequence_logprobs(model, tokenizer, prompts, completions, batch_size=2)
    finally:
        hook.remove()
    assert seen == [width - first] and first > 0, (seen, width, first)  # not the shorter prompt's positions
    single = [sequence_logprobs(model, tokenizer, [p], [c], batch_size=1)[0] for p, c in zip(prompts, completions)]
    assert scored == pytest.approx(single, abs=1e-4)


def test_conversational_prompts_score_like_their_rendered_text(tiny):
    model, tokenizer = tiny
    chat = [{"role": "user", "content": "sort 21 -> "}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    (from_chat,) = sequence_logprobs(model, tokenizer, [chat], ["12"])
    (from_text,) = sequence_logprobs(model, tokenizer, [rendered], ["12"])
    assert from_chat == pytest.approx(from_text, abs=1e-5)
    assert from_chat == pytest.approx(-3 * math.log(len(tokenizer)), rel=0.05)  # "1", "2", EOS at about ln 263 each


def test_perplexity_of_a_random_model_is_about_the_vocabulary(tiny):
    model, tokenizer = tiny
    texts = ["sort 321 -> 123", "sort 54 -> 45", "hello world"]
    assert perplexity(model, tokenizer, texts, batch_size=2) == pytest.approx(len(tokenizer), rel=0.05)  # 263 tokens
    # Pairs score the completion tokens only: "12" + EOS.
    (logprob,) = sequence_logprobs(model, tokenizer, ["sort 21 -> "], ["12"])
    assert perplexity(model, tokenizer, [("sort 21 -> ", "12")]) == pytest.approx(math.exp(-logprob / 3))
