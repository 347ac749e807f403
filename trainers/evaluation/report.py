"""The eval stage's files: summary (JSON + markdown), a samples table and plots."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class EvalResult:
    """What eval found, as the report shows it: the held-out prompts (and reference answers, None without a reference
    column), each model's answers, their gold scores and reward-model scores, the metrics, the hacking warnings, the
    gold metric's accuracy intervals (empty without one) and the win rates by the reward model and by the judge."""

    prompts: list
    answers: list | None
    completions: dict[str, list[str]]
    correct: dict[str, list[float]]
    rewards: dict[str, list[float]]
    metrics: dict[str, float]
    warnings: list[str]
    accuracy: dict
    win_rates: dict
    gold_name: str | None = "exact_match"
    judged: dict = field(default_factory=dict)


def write_report(out_dir: Path, num_samples: int, result: EvalResult) -> None:
    """`summary.json`, `summary.md`, the first `num_samples` rows of `samples.jsonl`, and `plots/`."""
    from rlhf_pipeline.trainers.evaluation import plots

    prompts, answers, completions, correct, rewards = (
        result.prompts,
        result.answers,
        result.completions,
        result.correct,
        result.rewards,
    )
    metrics, warnings, gold_name = result.metrics, result.warnings, result.gold_name

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(
        json.dumps({"metrics": metrics, "warnings": warnings}, indent=2, sort_keys=True)
    )
    with open(out_dir / "samples.jsonl", "w", encoding="utf-8") as f:
        for i in range(min(num_samples, len(prompts))):
            row: dict[str, Any] = {"prompt": prompts[i]}
            if answers is not None:
                row["answer"] = answers[i]
            for name, outputs in completions.items():
                row[name] = outputs[i]
                if name in correct:
                    row[f"{name}_correct" if gold_name == "exact_match" else f"{name}_{gold_name}"] = correct[name][i]
                if name in rewards:
                    row[f"{name}_reward"] = round(rewards[name][i], 4)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out_dir / "summary.md").write_text(summary_markdown(metrics, warnings))
    figures = out_dir / "plots"
    figures.mkdir(exist_ok=True)
    if result.accuracy:
        title = "Exact match on held-out prompts" if gold_name == "exact_match" else "Gold metric on held-out prompts"
        plots.accuracy_bars(result.accuracy, figures / f"{gold_name}.png", title=title)
    if rewards:
        plots.reward_distributions(rewards, figures / "reward_distributions.png")
    if result.win_rates:
        plots.win_rate_bars(result.win_rates, figures / "win_rates.png", title="Win rate judged by the reward model")
    for prefix, name in (
        ("eval/heldout/", "held-out prompts"),
        ("eval/ifeval/", "IFEval"),
        ("eval/ifbench/", "IFBench"),
    ):
        shares: dict[str, dict[str, float]] = {}
        for metric, value in metrics.items():
            if metric.startswith(f"{prefix}if_family/"):
                model, family = metric.removeprefix(f"{prefix}if_family/").split("/", 1)
                shares.setdefault(model, {})[family] = value
        if shares:
            file = "if_families.png" if prefix == "eval/heldout/" else f"{prefix.split('/')[1]}_families.png"
            plots.family_bars(shares, figures / file, title=f"Constraints followed by family, {name}")
    if result.judged:
        plots.win_rate_bars(
            result.judged, figures / "judge_win_rates.png", title="Win rate by the pairwise judge (both orders)"
        )


def summary_markdown(metrics: dict[str, float], warnings: list[str]) -> str:
    """One row per metric, with its 95% interval where there is one; then each instruction-following benchmark's
    per-instruction-id table, named with what it scored ("IFBench (60 of 300, seed 0)")."""
    from rlhf_pipeline.trainers.evaluation.instructions import BENCHMARKS, HELDOUT, instruction_table

    lines = ["| metric | value | 95% interval |", "|---|---|---|"]
    for name in sorted(metrics):
        if name.endswith(("_low", "_high")) or "/if_instruction/" in name:
            continue
        low, high = metrics.get(f"{name}_low"), metrics.get(f"{name}_high")
        interval = f"[{low:.3f}, {high:.3f}]" if low is not None and high is not None else ""
        lines.append(f"| `{name}` | {metrics[name]:.4f} | {interval} |")
    if warnings:
        lines += ["", "**Warnings**", ""] + [f"- {w}" for w in warnings]
    sections = [(HELDOUT, "Held-out prompts")] + [
        (b.prefix, benchmark_label(metrics, b.prefix)) for b in BENCHMARKS.values()
    ]
    for prefix, title in sections:
        if table := instruction_table(metrics, prefix):
            lines += ["", f"**{title}: each instruction id, share followed (strict)**", "", table.rstrip("\n")]
    return "\n".join(lines) + "\n"


def benchmark_label(metrics: dict[str, float], prefix: str) -> str:
    """A benchmark as its metrics name what was scored: `IFEval (541 of 541)`, `IFBench (60 of 300, seed 0; ...)`."""
    from rlhf_pipeline.trainers.evaluation.instructions import BENCHMARKS, ids_label, sample_label

    earlier = [b.earlier for b in BENCHMARKS.values() if b.earlier is not None]
    benchmark = next(b for b in [*BENCHMARKS.values(), *earlier] if b.prefix == prefix)
    if f"{prefix}num_prompts" not in metrics:
        return benchmark.name
    if benchmark in earlier:  # its rows the current file holds unchanged, from the current file's answers
        return f"{benchmark.name} ({int(metrics[f'{prefix}num_prompts'])} of {benchmark.total})"
    refused = int(metrics[f"{prefix}num_refused"])
    shown, seed = int(metrics[f"{prefix}num_prompts"]), int(metrics[f"{prefix}sample_seed"])
    ids = ids_label(int(metrics[f"{prefix}num_ids"]), int(metrics[f"{prefix}num_ids_total"]))
    return sample_label(benchmark, shown, benchmark.total - refused, refused, seed, ids)
