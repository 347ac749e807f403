import json

import pytest

from rlhf_pipeline.trainers.algorithms import sft
from rlhf_pipeline.trainers.data import load_split
from rlhf_pipeline.trainers.evaluation import stage as evaluation
from rlhf_pipeline.trainers.models.base_model import load_base_model
from rlhf_pipeline.trainers.models.load import save_model
from rlhf_pipeline.trainers.models.text import generate, reward_scores
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
    # A different "policy"
    sft.train(sft.SftConfig(max_steps=1, **FAST), SMALL_MODEL, data, tmp_path / "short", tmp_path / "work2")
    cfg = evaluation.EvalConfig(
        max_new_tokens=8, num_samples_logged=30, judge={"path": "tests.trainers.evaluation.test_stage:longer_is_better"}
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


def test_length_batches_keep_a_long_prompt_from_padding_short_ones():
    from rlhf_pipeline.trainers.models.text import length_batches

    lengths = [90, 2591, 100, 757, 95, 110, 80]
    batches = length_batches(lengths, batch_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    # the 2,591- and 757-token prompts answer alone; the rest, longest first, three at most to a batch
    assert batches == [[1], [3], [5, 2, 4], [0, 6]]
    for batch in batches:
        assert all(2 * lengths[i] >= lengths[batch[0]] for i in batch)
    # A budget that dwarfs the prompts: one batch rather than a second one of short prompts decoding on their own
    assert length_batches([129, 60, 64, 40], batch_size=64) == [[0], [2, 1, 3]]
    assert length_batches([129, 60, 64, 40], batch_size=64, max_new_tokens=512) == [[0, 2, 1, 3]]
    assert length_batches(lengths, batch_size=7, max_new_tokens=512) == [[1], [3], [5, 2, 4, 0, 6]]


def test_greedy_answers_are_made_once_per_model_prompts_and_budget(tmp_path, monkeypatch):
    from rlhf_pipeline.trainers.evaluation.answers import answers_dir, greedy_answers
    from rlhf_pipeline.trainers.models import text

    monkeypatch.setenv("RLHF_MODEL_CACHE", str(tmp_path / "models"))
    model, tokenizer = load_base_model(SMALL_MODEL)
    prompts = [[{"role": "user", "content": "sort 321 -> "}], [{"role": "user", "content": "sort 4321 -> "}]]
    made, ticks = greedy_answers(model, tokenizer, prompts, 4, 2), []
    assert made == text.generate_answers(model, tokenizer, prompts, 4, 2)
    assert len(list(answers_dir().glob("*.jsonl"))) == 1

    calls = []
    real = text.generate_answers
    monkeypatch.setattr(text, "generate_answers", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert greedy_answers(model, tokenizer, prompts, 4, 2, log=ticks.append) == made
    assert calls == [] and "from the answer cache" in ticks[0]
    # another budget, other prompts or other weights are other answers
    greedy_answers(model, tokenizer, prompts, 3, 2)
    greedy_answers(model, tokenizer, prompts[:1], 4, 2)
    with __import__("torch").no_grad():
        next(model.parameters()).add_(0.01)
    greedy_answers(model, tokenizer, prompts, 4, 2, progress=lambda done, total: ticks.append((done, total)))
    assert len(calls) == 3 and ticks[-1] == (2, 2)
    assert len(list(answers_dir().glob("*.jsonl"))) == 4
    # the same weights saved and loaded again (a GGUF's converted folder, sft's copy of it) are the same model
    save_model(model, tokenizer, tmp_path / "copy")
    from rlhf_pipeline.trainers.models.load import load_causal_lm

    again, again_tokenizer = load_causal_lm(tmp_path / "copy")
    greedy_answers(again, again_tokenizer, prompts, 4, 2)
    assert len(calls) == 3


def test_eval_scores_every_model_on_the_rows_a_kept_probe_was_not_chosen_on(tmp_path):
    import shutil

    from rlhf_pipeline.trainers.rewards.probes import probe_rows

    assert probe_rows(600, 200) == (400, 600) and probe_rows(40, 200) == (20, 40) and probe_rows(1, 8) == (0, 1)
    data = write_data_dir(tmp_path / "data", rows=40)
    sft.train(sft.SftConfig(max_steps=2, **FAST), SMALL_MODEL, data, tmp_path / "sft", tmp_path / "work")
    shutil.copytree(tmp_path / "sft", tmp_path / "policy")
    (tmp_path / "policy" / "training.json").write_text(json.dumps({"kept_step": 4, "chosen_on_rows": [30, 40]}))
    metrics = evaluation.evaluate(
        evaluation.EvalConfig(max_new_tokens=4, use_reward_model=False, num_samples_logged=40),
        SMALL_MODEL,
        tmp_path / "sft" / "model",
        tmp_path / "policy" / "model",
        None,
        data,
        tmp_path / "out",
        "grpo",
    )
    assert metrics["eval/heldout/num_prompts"] == 30 and metrics["eval/heldout/num_left_out"] == 10
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [row["prompt"] for row in rows] == load_split(data, "prompts_eval")["prompt"][:30]
    (tmp_path / "policy" / "training.json").write_text(json.dumps({"kept_step": 4, "chosen_on_rows": [0, 40]}))
    with pytest.raises(ValueError, match="chose the policy it kept .* on every held-out prompt"):
        evaluation.evaluate(
            evaluation.EvalConfig(max_new_tokens=4, use_reward_model=False),
            SMALL_MODEL,
            tmp_path / "sft" / "model",
            tmp_path / "policy" / "model",
            None,
            data,
            tmp_path / "out2",
            "grpo",
        )


def test_eval_answers_in_the_precision_it_is_given_and_keeps_those_answers_apart(tmp_path, monkeypatch):
    import shutil

    import torch

    from rlhf_pipeline.trainers.evaluation.answers import answers_dir

    monkeypatch.setenv("RLHF_MODEL_CACHE", str(tmp_path / "models"))
    data = write_data_dir(tmp_path / "data", rows=12)
    sft.train(sft.SftConfig(max_steps=2, **FAST), SMALL_MODEL, data, tmp_path / "sft", tmp_path / "work")
    shutil.copytree(tmp_path / "sft", tmp_path / "policy")  # the same weights: the policy reads sft's answers
    answered, real = [], evaluation.greedy_answers
    monkeypatch.setattr(
        evaluation,
        "greedy_answers",
        lambda model, *a, **k: answered.append(next(model.parameters()).dtype) or real(model, *a, **k),
    )
    for dtype in (None, "bfloat16"):
        evaluation.evaluate(
            evaluation.EvalConfig(max_new_tokens=4, use_reward_model=False, perplexity_rows=0, dtype=dtype),
            SMALL_MODEL,
            tmp_path / "sft" / "model",
            tmp_path / "policy" / "model",
            None,
            data,
            tmp_path / f"out-{dtype}",
            "grpo",
        )
    assert answered == [torch.float32] * 3 + [torch.bfloat16] * 3  # base, sft, policy
    assert len(list(answers_dir().glob("*.jsonl"))) == 4  # base and sft in each precision


def test_the_answer_cache_key_reads_the_source_of_each_module_that_renders_or_generates(monkeypatch):
    from importlib.util import find_spec
    from pathlib import Path

    from rlhf_pipeline.trainers.evaluation import answers

    model, tokenizer = load_base_model(SMALL_MODEL)
    key = answers.answers_key(model, tokenizer, ["Sort: 3 1 2"], 8, 4)
    assert key == answers.answers_key(model, tokenizer, ["Sort: 3 1 2"], 8, 4)
    read = Path.read_bytes
    for name in answers.CODE:
        edited = Path(find_spec(name).origin)
        monkeypatch.setattr(Path, "read_bytes", lambda self: read(self) + (b"#" if self == edited else b""))
        assert answers.answers_key(model, tokenizer, ["Sort: 3 1 2"], 8, 4) != key, name
    assert {name.rsplit(".", 1)[1] for name in answers.CODE} == {"answers", "text", "templates"}
