import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

from rlhf_pipeline.trainers.algorithms import rm
from rlhf_pipeline.trainers.data import load_split
from rlhf_pipeline.trainers.models.base_model import load_base_model
from rlhf_pipeline.trainers.models.load import save_model
from rlhf_pipeline.trainers.models.text import reward_scores
from tests.helpers import FAST, SMALL_MODEL, trainable, unchanged, write_data_dir


def pairwise_accuracy(model, tokenizer, pairs) -> float:
    chosen, rejected = (
        reward_scores(model, tokenizer, pairs["prompt"], pairs[column], batch_size=64)
        for column in ("chosen", "rejected")
    )
    return sum(c > r for c, r in zip(chosen, rejected)) / len(pairs)


def test_reward_model_learns_to_prefer_chosen(tmp_path):
    data = write_data_dir(tmp_path / "data", rows=128)
    policy, tokenizer = load_base_model(SMALL_MODEL)
    save_model(policy, tokenizer, tmp_path / "sft")
    # The new scalar head is drawn from torch's global RNG: seeded the same way, `untrained` gets the very head
    # rm.train starts from (its first logged rewards match this model's scores).
    torch.manual_seed(1)
    untrained = AutoModelForSequenceClassification.from_pretrained(tmp_path / "sft", num_labels=1)
    untrained.config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(1)
    logged: list[dict] = []
    metrics = rm.train(
        rm.RewardModelConfig(max_steps=30, **{**FAST, "save_steps": 15}),  # checkpoint-15: the weights half-way
        tmp_path / "sft",
        data,
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append(values),
    )
    accuracies = [v["rm/train/accuracy"] for v in logged if "rm/train/accuracy" in v]
    assert len(accuracies) == 30 and sum(accuracies[-5:]) / 5 > sum(accuracies[:5]) / 5
    # The 128 held-out pairs: a random head already ranks some right (the sorted answer often ends on a larger
    # digit than the rejected one), so the trained model is measured against the same model untrained.
    pairs = load_split(data, "preference_eval")
    before = pairwise_accuracy(untrained, tokenizer, pairs)
    assert metrics["rm/eval/accuracy"] > 0.7 and metrics["rm/eval/accuracy"] > before + 0.1, before
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "model")
    assert model.config.num_labels == 1
    assert metrics["rm/eval/accuracy"] == pairwise_accuracy(model, tokenizer, pairs)  # TRL's count and eval's agree
    # Every tensor trained, the head too; each also moved in the second half of training.
    assert unchanged(trainable(untrained), model) == []
    assert unchanged(load_file(tmp_path / "work" / "checkpoint-15" / "model.safetensors"), model) == []
    assert (tmp_path / "out" / "model" / "tokenizer.json").is_file()  # GRPO/RLOO load it from the same folder
