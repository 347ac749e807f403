"""Figures for the evaluation report: reward histograms, win rates, training curves, exact match.

Each function writes one PNG and returns its path. Figures are built with
matplotlib's object API (`Figure`, rendered by Agg) rather than pyplot, so no
global backend is switched and no window or figure registry is involved:
safe in worker threads and on machines without a display.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from rlhf_pipeline.trainers.rewards.metrics import Interval, WinRate

DPI = 120


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _save(fig: Figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path


def reward_distributions(
    rewards: dict[str, list[float]], path: Path, title: str = "Reward-model scores on held-out prompts"
) -> Path:
    """Overlaid histograms on shared bins, each model's mean marked by a dashed line (and in the legend)."""
    import numpy as np

    sizes = {name: len(values) for name, values in rewards.items()}
    if not sizes or 0 in sizes.values():
        raise ValueError(f"reward_distributions needs at least one model and no empty score list, got sizes {sizes}")
    # Shared bins, or two models' bars would have different widths and mislead.
    bins = np.histogram_bin_edges(np.concatenate([np.asarray(v, dtype=float) for v in rewards.values()]), bins=30)
    fig = _figure(7, 4.5)
    ax = fig.add_subplot()
    for i, (name, values) in enumerate(rewards.items()):
        mean = float(np.mean(values))
        ax.hist(values, bins=bins, alpha=0.45, color=f"C{i}", label=f"{name} (mean {mean:.2f}, n={len(values)})")
        ax.axvline(mean, color=f"C{i}", linestyle="--", linewidth=1.5)
    ax.set(title=title, xlabel="reward", ylabel="answers")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def win_rate_bars(win_rates: dict[str, WinRate], path: Path, title: str = "Win rate against the SFT model") -> Path:
    """Horizontal bars with bootstrap intervals; the dashed line at 0.5 is a coin flip."""
    if not win_rates:
        raise ValueError("win_rate_bars needs at least one win rate")
    # Values go in the tick labels: text beside a bar collides with a long one or its interval.
    names = [f"{name}\n{w.rate:.2f} [{w.low:.2f}, {w.high:.2f}], n={w.n}" for name, w in win_rates.items()]
    rates = [w.rate for w in win_rates.values()]
    errors = [[w.rate - w.low for w in win_rates.values()], [w.high - w.rate for w in win_rates.values()]]
    fig = _figure(7, 1.4 + 0.8 * len(names))
    ax = fig.add_subplot()
    ax.barh(names, rates, xerr=errors, color=[f"C{i}" for i in range(len(names))], alpha=0.8, capsize=4)
    ax.axvline(0.5, color="black", linestyle="--", linewidth=1)
    ax.set(title=title, xlabel="win rate (ties count half)", xlim=(0, 1))
    ax.invert_yaxis()  # first entry on top, as in the dict
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def training_curves(histories: dict[str, list[tuple[int, float]]], path: Path, title: str = "Training curves") -> Path:
    """One panel per metric (`sft/train/loss`, `rm/train/accuracy`...), three columns at most."""
    series = {name: sorted(points) for name, points in histories.items() if points}
    if not series:
        raise ValueError(f"training_curves: no points in any of {list(histories)}")
    columns = min(3, len(series))
    rows = math.ceil(len(series) / columns)
    fig = _figure(4.2 * columns, 3.0 * rows + 0.5)
    fig.suptitle(title)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for i, (ax, (name, points)) in enumerate(zip(axes, series.items())):
        steps, values = zip(*points)
        ax.plot(steps, values, color=f"C{i % 10}", marker="." if len(points) < 30 else None)
        ax.set(title=name, xlabel="step")
        ax.grid(alpha=0.3)
    for ax in axes[len(series) :]:
        ax.set_visible(False)
    return _save(fig, path)


def accuracy_bars(values: dict[str, Interval], path: Path, title: str = "Exact match on held-out prompts") -> Path:
    """Vertical bars (e.g. base / sft / policy) with bootstrap intervals and value labels."""
    if not values:
        raise ValueError("accuracy_bars needs at least one interval")
    names = list(values)
    means = [v.mean for v in values.values()]
    errors = [[v.mean - v.low for v in values.values()], [v.high - v.mean for v in values.values()]]
    fig = _figure(1.5 + 1.4 * len(names), 4.5)
    ax = fig.add_subplot()
    ax.bar(names, means, yerr=errors, color=[f"C{i}" for i in range(len(names))], alpha=0.8, capsize=6)
    for x, v in enumerate(values.values()):
        ax.text(x, v.high + 0.02, f"{v.mean:.2f}\nn={v.n}", ha="center", va="bottom")
    top = max(1.0, max(v.high for v in values.values()) + 0.15)  # room for the labels above a bar near 1
    ax.set(title=title, ylabel="exact match", ylim=(0, top))
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def family_bars(shares: dict[str, dict[str, float]], path: Path, title: str) -> Path:
    """Grouped bars: for each constraint family, the share each model follows (`shares[model][family]`)."""
    if not shares:
        raise ValueError("family_bars needs at least one model")
    families = sorted({family for by_family in shares.values() for family in by_family})
    width = 0.8 / len(shares)
    fig = _figure(2.0 + 1.1 * len(families), 4.5)
    ax = fig.add_subplot()
    for i, (model, by_family) in enumerate(shares.items()):
        xs = [j + (i - (len(shares) - 1) / 2) * width for j in range(len(families))]
        ax.bar(xs, [by_family.get(f, 0.0) for f in families], width, label=model, color=f"C{i}", alpha=0.85)
    ax.set_xticks(range(len(families)), families, rotation=20, ha="right")
    ax.set(title=title, ylabel="share of constraints followed (strict)", ylim=(0, 1.05))
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def overoptimisation(curves: list[dict], path: Path, stage: str, kept_step: int | None = None) -> Path:
    """Gao et al. 2022's axes: the held-out proxy reward and the gold metric against sqrt(KL(policy || SFT)), one point
    per probe of the online stage (`heldout.jsonl`), the published probe ringed; the ensemble's disagreement beside
    them."""
    points = sorted((c for c in curves if "sqrt_kl" in c), key=lambda c: c["step"])
    if not points:
        raise ValueError("overoptimisation: no probe with a KL in the curves")
    fig = _figure(7.5, 4.2)
    fig.suptitle(f"{stage}: proxy reward and gold metric against sqrt(KL to SFT), held-out probes (labels: step)")
    ax = fig.subplots()
    x = [c["sqrt_kl"] for c in points]
    handles = []
    if any("proxy_reward" in c for c in points):
        handles += ax.plot(
            x,
            [c.get("proxy_reward", math.nan) for c in points],
            color="C0",
            marker="o",
            lw=0.8,
            label="proxy reward (optimised)",
        )
        if any(c.get("disagreement") for c in points):
            handles += ax.plot(
                x,
                [c.get("disagreement", math.nan) for c in points],
                color="C2",
                marker=".",
                ls="--",
                label="ensemble disagreement (std)",
            )
    ax.set(xlabel="sqrt(KL(policy || SFT)), nats^0.5", ylabel="reward-model score")
    ax.grid(alpha=0.3)
    for c in points:  # the probes' steps: the lines join them in training order, which KL need not follow
        if "proxy_reward" in c:
            ax.annotate(
                str(c["step"]),
                (c["sqrt_kl"], c["proxy_reward"]),
                textcoords="offset points",
                xytext=(3, 4),
                fontsize=7,
                color="C0",
            )
    metric = "gold" if any("gold" in c for c in points) else "exact_match"  # eval's gold metric, else exact match
    if any(metric in c for c in points):
        gold = ax.twinx()
        label = "gold: eval.gold_metric" if metric == "gold" else "gold: exact match"
        handles += gold.plot(x, [c.get(metric, math.nan) for c in points], color="C3", marker="s", lw=0.8, label=label)
        gold.set(ylabel=label.removeprefix("gold: "), **({"ylim": (0, 1)} if metric == "exact_match" else {}))
        for c in points:
            if metric in c:
                gold.annotate(
                    str(c["step"]),
                    (c["sqrt_kl"], c[metric]),
                    textcoords="offset points",
                    xytext=(3, -10),
                    fontsize=7,
                    color="C3",
                )
    for c in points:
        if c["step"] == kept_step:
            handles.append(
                ax.scatter(
                    [c["sqrt_kl"]],
                    [c.get("proxy_reward", 0.0)],
                    s=200,
                    facecolors="none",
                    edgecolors="k",
                    label=f"published (step {kept_step})",
                )
            )
    ax.legend(handles=handles, labels=[h.get_label() for h in handles], loc="lower right", fontsize=8)
    return _save(fig, path)
