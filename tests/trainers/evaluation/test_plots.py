import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from rlhf_pipeline.trainers.evaluation import plots
from rlhf_pipeline.trainers.rewards.metrics import bootstrap_mean, win_rate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_png(path, width: float, height: float) -> np.ndarray:
    """The RGB pixels of a PNG that must be `width` x `height` inches at the module's DPI."""
    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = imread(path)[..., :3]
    assert pixels.shape[:2] == (round(height * plots.DPI), round(width * plots.DPI))
    return pixels


def drawn(pixels: np.ndarray, series: int, alpha: float) -> list[bool]:
    """For each colour C0..C<series>, whether over 100 pixels show it (at `alpha` over the white background):
    one colour per series, and one more that no series uses, as a control."""
    colors = [alpha * np.array(to_rgb(f"C{i}")) + 1 - alpha for i in range(series + 1)]
    return [int((np.abs(pixels - color).max(axis=-1) < 3 / 255).sum()) > 100 for color in colors]


def test_reward_distributions(tmp_path):
    rng = np.random.default_rng(0)
    rewards = {"sft": rng.normal(0, 1, 300).tolist(), "ppo": rng.normal(1.5, 0.7, 300).tolist()}
    pixels = read_png(plots.reward_distributions(rewards, tmp_path / "figs" / "rewards.png"), 7, 4.5)
    assert drawn(pixels, 2, alpha=0.45) == [True, True, False]  # one histogram per model
    with pytest.raises(ValueError, match="empty"):
        plots.reward_distributions({"sft": []}, tmp_path / "empty.png")


def test_win_rate_bars(tmp_path):
    rates = {"ppo": win_rate([1, 2, 3, 4, 5, 6], [0, 2, 5, 1, 1, 1]), "dpo": win_rate([1, 1, 0, 0], [0, 1, 1, 0])}
    pixels = read_png(plots.win_rate_bars(rates, tmp_path / "win_rates.png"), 7, 1.4 + 0.8 * 2)  # 0.8 inch per bar
    assert drawn(pixels, 2, alpha=0.8) == [True, True, False]


def test_training_curves_wrap_at_three_columns(tmp_path):
    histories = {
        f"{stage}/train/{name}": [(step, 1.0 / (step + 1)) for step in range(0, 50, 5)]
        for stage, name in [("sft", "loss"), ("rm", "loss"), ("rm", "accuracy"), ("ppo", "kl")]
    }
    # Four panels: three columns of 4.2 inches, two rows of 3 (and the title's half inch).
    pixels = read_png(plots.training_curves(histories, tmp_path / "curves.png"), 3 * 4.2, 2 * 3.0 + 0.5)
    assert drawn(pixels, 4, alpha=1.0) == [True, True, True, True, False]  # one curve per metric
    height, width = pixels.shape[:2]
    assert (pixels[int(height * 0.55) :, int(width * 0.4) :] == 1.0).all()  # the unused 5th and 6th panels stay blank


def test_accuracy_bars(tmp_path):
    values = {
        "base": bootstrap_mean([0] * 20),
        "sft": bootstrap_mean([1, 0] * 10),
        "ppo": bootstrap_mean([1, 1, 0] * 7),
    }
    pixels = read_png(plots.accuracy_bars(values, tmp_path / "accuracy.png"), 1.5 + 1.4 * 3, 4.5)  # 1.4 inches per bar
    assert drawn(pixels, 3, alpha=0.8) == [False, True, True, False]  # base's exact match is 0: a bar of no height


def test_overoptimisation_draws_proxy_gold_and_disagreement_against_sqrt_kl(tmp_path):
    curves = [
        {
            "step": s,
            "kl": kl,
            "sqrt_kl": kl**0.5,
            "proxy_reward": 3 + kl / 2,
            "exact_match": 0.9 - kl / 10,
            "disagreement": 0.2 + kl / 20,
        }
        for s, kl in ((10, 0.5), (20, 1.0), (30, 2.0), (40, 4.0))
    ]
    pixels = read_png(plots.overoptimisation(curves, tmp_path / "oo.png", "ppo", kept_step=20), 7.5, 4.2)
    # proxy (C0), disagreement (C2) and gold (C3) drawn; C1 and C4 are not used.
    shown = drawn(pixels, 4, 1.0)
    assert (shown[0], shown[2], shown[3]) == (True, True, True) and not shown[1] and not shown[4]
    without_gold = [{k: v for k, v in c.items() if k != "exact_match"} for c in curves]
    assert not drawn(read_png(plots.overoptimisation(without_gold, tmp_path / "blind.png", "ppo"), 7.5, 4.2), 4, 1.0)[3]
    with pytest.raises(ValueError, match="no probe with a KL"):
        plots.overoptimisation([{"step": 1}], tmp_path / "none.png", "ppo")
