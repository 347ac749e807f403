"""tasks/eval.py: the eval summary artifact's plots, embedded as `data:` images of a bounded size (the browser test,
tests/deployments/test_progress.py, sees them drawn in the Prefect UI)."""

from __future__ import annotations

import base64
import io
import re

import numpy as np

from rlhf_pipeline.tasks import eval as summary
from rlhf_pipeline.tasks.eval import MAX_IMAGE_BYTES, plots_section


def png(path, width_in: float, height_in: float, noise: bool = False):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width_in, height_in))
    axes = figure.add_subplot()
    if noise:  # random pixels: a PNG that compresses badly
        axes.imshow(np.random.default_rng(0).random((400, 600)))
    else:
        axes.plot([0, 1, 2], [2, 0, 1])
    figure.savefig(path, dpi=100, format="png")
    return path


def images(markdown: str) -> dict[str, bytes]:
    found = re.findall(r"!\[([^\]]*)\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown)
    return {title: base64.b64decode(data) for title, data in found}


def test_plots_are_embedded_whole_a_large_one_downscaled_and_past_the_budget_named(tmp_path, monkeypatch):
    from matplotlib.image import imread

    small = png(tmp_path / "win_rates.png", 7, 2.2)
    large = png(tmp_path / "reward_distributions.png", 12, 8, noise=True)
    assert small.stat().st_size < MAX_IMAGE_BYTES < large.stat().st_size

    shown = images(plots_section([small, large]))
    assert list(shown) == ["Win rates", "Reward distributions"]
    assert shown["Win rates"] == small.read_bytes()  # small enough: as published
    smaller = shown["Reward distributions"]
    assert len(smaller) <= MAX_IMAGE_BYTES and imread(io.BytesIO(smaller)).shape[1] <= 800 < imread(large).shape[1]

    # Past the budget, the rest are named: three plots of ~25 KB against a budget of two.
    three = [png(tmp_path / f"curve_{i}.png", 7, 2.2) for i in range(3)]
    monkeypatch.setattr(summary, "MAX_SUMMARY_IMAGE_BYTES", sum(p.stat().st_size for p in three[:2]))
    markdown = plots_section(three)
    assert list(images(markdown)) == ["Curve 0", "Curve 1"]
    assert "- Curve 2: `plots/curve_2.png` in the MLflow run (too large to embed here)" in markdown
    assert plots_section([]) == ""
