from rlhf_pipeline.trainers import rm
from rlhf_pipeline.trainers.base import load_base_model
from rlhf_pipeline.trainers.common import save_model
from transformers import AutoModelForSequenceClassification

from tests.helpers import FAST, SMALL_MODEL, write_data_dir


def test_reward_model_learns_to_prefer_chosen(tmp_path):
    data = write_data_dir(tmp_path / "data", rows=128)
    policy, tokenizer = load_base_model(SMALL_MODEL)
    save_model(policy, tokenizer, tmp_path / "sft")
    logged: list[dict] = []
    metrics = rm.train(
        rm.RewardConfig(max_steps=30, **FAST),
        tmp_path / "sft",
        data,
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append(values),
    )
    accuracies = [v["rm/train/accuracy"] for v in logged if "rm/train/accuracy" in v]
    assert sum(accuracies[-5:]) / 5 > sum(accuracies[:5]) / 5
    assert 0.0 <= metrics["rm/eval/accuracy"] <= 1.0
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "model")
    assert model.config.num_labels == 1
    assert (tmp_path / "out" / "model" / "tokenizer.json").is_file()  # GRPO/RLOO load it from the same folder
