import json

from rlhf_pipeline.trainers import eval as evaluation
from rlhf_pipeline.trainers import sft
from rlhf_pipeline.trainers.base import load_base_model
from rlhf_pipeline.trainers.common import save_model
from rlhf_pipeline.trainers.eval import generate, reward_scores

from tests.helpers import FAST, SMALL_MODEL, write_data_dir


def test_evaluate_reports_every_model_and_writes_samples(tmp_path):
    data = write_data_dir(tmp_path / "data", rows=40)
    sft.train(sft.SftConfig(max_steps=5, **FAST), SMALL_MODEL, data, tmp_path / "sft", tmp_path / "work")
    base, tokenizer = load_base_model(SMALL_MODEL)
    from transformers import AutoModelForSequenceClassification

    save_model(AutoModelForSequenceClassification.from_pretrained(tmp_path / "sft" / "model", num_labels=1), tokenizer, tmp_path / "rm")
    metrics = evaluation.evaluate(
        evaluation.EvalConfig(max_new_tokens=8, num_samples_logged=5),
        SMALL_MODEL,
        tmp_path / "sft" / "model",
        tmp_path / "sft" / "model",
        tmp_path / "rm",
        data,
        tmp_path / "out",
        "dpo",
    )
    for name in ("base", "sft", "dpo"):
        assert 0.0 <= metrics[f"eval/heldout/{name}_exact_match"] <= 1.0
    # The policy here *is* the SFT model: same greedy answers, same score.
    assert metrics["eval/heldout/sft_exact_match"] == metrics["eval/heldout/dpo_exact_match"]
    assert metrics["eval/heldout/num_prompts"] == 40
    assert "eval/heldout/rm_pairwise_accuracy" in metrics
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and {"prompt", "answer", "sft", "dpo", "dpo_reward"} <= rows[0].keys()


def test_generation_and_scores_handle_conversational_prompts(tmp_path):
    model, tokenizer = load_base_model(SMALL_MODEL)
    prompts = [[{"role": "user", "content": "sort 321 -> "}], "sort 21 -> "]
    outputs = generate(model, tokenizer, prompts, max_new_tokens=3, batch_size=2)
    assert len(outputs) == 2
    from transformers import AutoModelForSequenceClassification

    save_model(model, tokenizer, tmp_path / "m")
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "m", num_labels=1)
    rm.config.pad_token_id = tokenizer.pad_token_id
    batched = reward_scores(rm, tokenizer, prompts, ["123", "12"], batch_size=2)
    single = [reward_scores(rm, tokenizer, [p], [c], batch_size=1)[0] for p, c in zip(prompts, ["123", "12"])]
    # Padding must not change a score: the head reads the last real token.
    assert all(abs(a - b) < 1e-4 for a, b in zip(batched, single))
