import json

import pytest

from rlhf_pipeline.trainers import eval as evaluation
from rlhf_pipeline.trainers import sft
from rlhf_pipeline.trainers.base_model import load_base_model
from rlhf_pipeline.trainers.loop import load_split
from rlhf_pipeline.trainers.models import save_model
from rlhf_pipeline.trainers.text import generate, reward_scores
from tests.helpers import FAST, SMALL_MODEL, write_data_dir


def test_evaluate_reports_every_model_and_writes_samples(tmp_path):
    data = write_data_dir(tmp_path / "data", rows=40)
    sft.train(sft.SftConfig(max_steps=5, **FAST), SMALL_MODEL, data, tmp_path / "sft", tmp_path / "work")
    base, tokenizer = load_base_model(SMALL_MODEL)
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "sft" / "model", num_labels=1)
    save_model(rm, tokenizer, tmp_path / "rm")
    metrics = evaluation.evaluate(
        evaluation.EvalConfig(max_new_tokens=8, num_samples_logged=40),  # all 40 prompts in the samples table
        SMALL_MODEL,
        tmp_path / "sft" / "model",
        tmp_path / "sft" / "model",
        tmp_path / "rm",
        data,
        tmp_path / "out",
        "dpo",
    )
    assert metrics["eval/heldout/num_prompts"] == 40
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [row["prompt"] for row in rows] == load_split(data, "prompts_eval")["prompt"]
    assert rows[0].keys() == {"prompt", "answer"} | {
        f"{name}{suffix}" for name in ("base", "sft", "policy") for suffix in ("", "_correct")
    } | {
        "sft_reward",
        "policy_reward",
    }
    # Each exact match is the share of that model's answers in the table that equal the reference (stripped).
    for name in ("base", "sft", "policy"):
        hits = [row[name].strip() == row["answer"] for row in rows]
        assert [row[f"{name}_correct"] for row in rows] == hits, name
        assert metrics[f"eval/heldout/{name}_exact_match"] == sum(hits) / 40, name
    assert metrics["eval/heldout/policy_mean_reward"] == pytest.approx(
        sum(row["policy_reward"] for row in rows) / 40, abs=1e-4
    )
    # The policy here *is* the SFT model: same greedy answers, same scores, every comparison a tie, no drift.
    assert metrics["eval/heldout/sft_exact_match"] == metrics["eval/heldout/policy_exact_match"]
    assert metrics["eval/heldout/sft_mean_reward"] == metrics["eval/heldout/policy_mean_reward"]
    assert [metrics[f"eval/heldout/win_rate_vs_sft{end}"] for end in ("", "_low", "_high")] == [0.5, 0.5, 0.5]
    assert (
        metrics["eval/heldout/kl_to_sft"],
        metrics["eval/heldout/length_drift"],
        metrics["eval/heldout/hacking_warnings"],
    ) == (0.0, 0.0, 0.0)
    # Pairwise accuracy on the 40 held-out pairs, against the same reward model scoring one row at a time (no padding).
    pairs = load_split(data, "preference_eval")
    scores = {
        column: [
            reward_scores(rm, tokenizer, [p], [c], batch_size=1)[0] for p, c in zip(pairs["prompt"], pairs[column])
        ]
        for column in ("chosen", "rejected")
    }
    assert (
        metrics["eval/heldout/rm_pairwise_accuracy"]
        == sum(c > r for c, r in zip(scores["chosen"], scores["rejected"])) / 40
    )


def test_generation_and_scores_handle_conversational_prompts(tmp_path):
    model, tokenizer = load_base_model(SMALL_MODEL)
    prompts = [[{"role": "user", "content": "sort 321 -> "}], "sort 21 -> "]
    outputs = generate(model, tokenizer, prompts, max_new_tokens=3, batch_size=2)
    # Left padding must not change a greedy answer, and a conversation is answered as its rendered chat template.
    assert outputs == [generate(model, tokenizer, [p], max_new_tokens=3, batch_size=1)[0] for p in prompts]
    rendered = tokenizer.apply_chat_template(prompts[0], add_generation_prompt=True, tokenize=False)
    assert generate(model, tokenizer, [rendered], max_new_tokens=3, batch_size=1) == outputs[:1]
    from transformers import AutoModelForSequenceClassification

    save_model(model, tokenizer, tmp_path / "m")
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "m", num_labels=1)
    rm.config.pad_token_id = tokenizer.pad_token_id
    batched = reward_scores(rm, tokenizer, prompts, ["123", "12"], batch_size=2)
    single = [reward_scores(rm, tokenizer, [p], [c], batch_size=1)[0] for p, c in zip(prompts, ["123", "12"])]
    # Padding must not change a score: the head reads the last real token.
    assert all(abs(a - b) < 1e-4 for a, b in zip(batched, single))


def longer_is_better(prompts, completions_a, completions_b) -> list[float]:
    """A deterministic pairwise judge: the longer answer wins, equal lengths tie."""
    return [1.0 if len(a) > len(b) else 0.0 if len(a) < len(b) else 0.5 for a, b in zip(completions_a, completions_b)]


def test_evaluate_without_reference_answers_reports_what_needs_none_and_a_judge(tmp_path):
    data = write_data_dir(tmp_path / "data", rows=30)
    held_out = load_split(data, "prompts_eval").remove_columns(["answer"])  # the chat-data case: no reference
    held_out.to_parquet(str(data / "datasets" / "prompts_eval.parquet"))
    sft.train(sft.SftConfig(max_steps=5, **FAST), SMALL_MODEL, data, tmp_path / "sft", tmp_path / "work")
    sft.train(
        sft.SftConfig(max_steps=1, **FAST), SMALL_MODEL, data, tmp_path / "short", tmp_path / "work2"
    )  # a different "policy"
    cfg = evaluation.EvalConfig(
        max_new_tokens=8, num_samples_logged=30, judge={"path": "tests.trainers.test_eval:longer_is_better"}
    )
    metrics = evaluation.evaluate(
        cfg, SMALL_MODEL, tmp_path / "sft" / "model", tmp_path / "short" / "model", None, data, tmp_path / "out", "dpo"
    )
    assert set(metrics) == evaluation.planned_metrics(cfg, has_reference=False, reward_model=False, champion=False)
    assert not any("exact_match" in name or "reward" in name for name in metrics)
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert rows[0].keys() == {"prompt", "base", "sft", "policy"}
    # The judge's verdict, recomputed from the samples table: longer wins, ties half; both orders agree for this judge.
    wins = [1.0 if len(r["policy"]) > len(r["sft"]) else 0.0 if len(r["policy"]) < len(r["sft"]) else 0.5 for r in rows]
    assert metrics["eval/heldout/judge_win_rate_vs_sft"] == pytest.approx(sum(wins) / len(wins))
    assert metrics["eval/heldout/judge_win_rate_vs_sft_position_bias"] == 0.0
    assert (
        metrics["eval/heldout/judge_win_rate_vs_sft_low"]
        <= metrics["eval/heldout/judge_win_rate_vs_sft"]
        <= metrics["eval/heldout/judge_win_rate_vs_sft_high"]
    )
    assert (tmp_path / "out" / "plots" / "judge_win_rates.png").is_file() and not (
        tmp_path / "out" / "plots" / "exact_match.png"
    ).exists()
