import pytest
from rlhf_pipeline.trainers import plots
from rlhf_pipeline.trainers.metrics import bootstrap_mean, win_rate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5_000


def test_reward_distributions(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    rewards = {"sft": rng.normal(0, 1, 300).tolist(), "ppo": rng.normal(1.5, 0.7, 300).tolist()}
    assert_png(plots.reward_distributions(rewards, tmp_path / "figs" / "rewards.png"))
    with pytest.raises(ValueError, match="empty"):
        plots.reward_distributions({"sft": []}, tmp_path / "empty.png")


def test_win_rate_bars(tmp_path):
    rates = {"ppo": win_rate([1, 2, 3, 4, 5, 6], [0, 2, 5, 1, 1, 1]), "dpo": win_rate([1, 1, 0, 0], [0, 1, 1, 0])}
    assert_png(plots.win_rate_bars(rates, tmp_path / "win_rates.png"))


def test_training_curves_wrap_at_three_columns(tmp_path):
    histories = {
        f"{stage}/train/{name}": [(step, 1.0 / (step + 1)) for step in range(0, 50, 5)]
        for stage, name in [("sft", "loss"), ("rm", "loss"), ("rm", "accuracy"), ("ppo", "kl")]
    }
    assert_png(plots.training_curves(histories, tmp_path / "curves.png"))


def test_accuracy_bars(tmp_path):
    values = {"base": bootstrap_mean([0] * 20), "sft": bootstrap_mean([1, 0] * 10), "ppo": bootstrap_mean([1, 1, 0] * 7)}
    assert_png(plots.accuracy_bars(values, tmp_path / "accuracy.png"))
