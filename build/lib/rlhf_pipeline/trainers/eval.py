"""Held-out evaluation: exact match of base, SFT and final policy; reward-model accuracy and scores.

Greedy decoding on the held-out prompts (`prompts_eval`, with a reference
`answer` column); the reward model scores text exactly as TRL's RewardTrainer
formats it (prompt + completion + EOS, or the chat template), so its scores
here mean what they meant in training.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from rlhf_pipeline.trainers.common import ModelConfig, StrictModel
from rlhf_pipeline.trainers.text import generate, reward_scores

if TYPE_CHECKING:
    pass


class EvalConfig(StrictModel):
    max_new_tokens: int = Field(64, ge=1, description="Longest generated answer.")
    batch_size: int = Field(64, ge=1, description="Prompts per generation batch.")
    max_prompts: int | None = Field(None, ge=1, description="Evaluate only the first N held-out prompts; None: all.")
    answer_column: str = Field("answer", description="Reference column of the held-out prompts for exact match.")
    max_length_drift: float = Field(0.5, gt=0, description="Warn when the policy's mean answer length moves more than this share from SFT's.")
    max_kl: float = Field(5.0, gt=0, description="Warn when KL(policy || SFT) on policy samples exceeds this (nats per answer).")
    perplexity_rows: int = Field(200, ge=0, description="SFT rows on which perplexity is measured; 0 to skip.")
    n_bootstrap: int = Field(1000, ge=100, description="Bootstrap resamples of the 95% intervals.")
    seed: int = Field(0, description="Seed of the policy samples (KL, diversity) and of the bootstrap.")
    use_reward_model: bool = Field(True, description="Score answers and held-out pairs with the rm stage's model (trains it even for dpo).")
    num_samples_logged: int = Field(50, ge=0, description="Rows of the samples table (prompt, answers, rewards).")


def _exact(completions: list[str], answers: list[str]) -> list[bool]:
    return [c.strip() == str(a).strip() for c, a in zip(completions, answers)]


def evaluate(
    cfg: EvalConfig,
    base: ModelConfig,
    sft_model: Path,
    policy_model: Path,
    reward_model: Path | None,
    data_dir: Path,
    out_dir: Path,
    policy_stage: str = "policy",
    champion_model: Path | None = None,
) -> dict[str, float]:
    """Compare base, SFT, policy (and the registry's champion) on held-out prompts.

    Writes `summary.json`, `summary.md`, `samples.jsonl` and `plots/*.png` into
    `out_dir`; returns `eval/heldout/*` and `eval/sft_split/*` metrics, with
    `_low`/`_high` 95% bootstrap bounds on exact match and win rates.
    """
    import torch
    from transformers import AutoModelForSequenceClassification

    from rlhf_pipeline.trainers import metrics as stats
    from rlhf_pipeline.trainers.base import load_base_model
    from rlhf_pipeline.trainers.common import load_causal_lm, load_split, load_tokenizer

    prompts_ds = load_split(data_dir, "prompts_eval")
    if cfg.max_prompts:
        prompts_ds = prompts_ds.select(range(min(cfg.max_prompts, len(prompts_ds))))
    if cfg.answer_column not in prompts_ds.column_names:
        raise ValueError(f"prompts_eval has no reference column {cfg.answer_column!r} (columns: {prompts_ds.column_names}); set eval.answer_column")
    prompts, answers = prompts_ds["prompt"], prompts_ds[cfg.answer_column]
    boot = {"n_bootstrap": cfg.n_bootstrap, "seed": cfg.seed}
    metrics: dict[str, float] = {"eval/heldout/num_prompts": float(len(prompts))}

    loaders = {"base": lambda: load_base_model(base), "sft": lambda: load_causal_lm(sft_model), "policy": lambda: load_causal_lm(policy_model)}
    if champion_model is not None:
        loaders["champion"] = lambda: load_causal_lm(champion_model)
    completions: dict[str, list[str]] = {}
    for name, load in loaders.items():  # one model in memory at a time
        model, tokenizer = load()
        completions[name] = generate(model, tokenizer, prompts, cfg.max_new_tokens, cfg.batch_size)
        del model
    correct = {name: _exact(c, answers) for name, c in completions.items()}
    accuracy = {name: stats.bootstrap_mean([float(h) for h in hits], **boot) for name, hits in correct.items()}
    for name, interval in accuracy.items():
        _put(metrics, f"eval/heldout/{name}_exact_match", interval.mean, interval.low, interval.high)
    if "champion" in correct:  # paired: the same prompts, so the interval is on the differences
        gain = stats.bootstrap_mean([float(p) - float(c) for p, c in zip(correct["policy"], correct["champion"])], **boot)
        _put(metrics, "eval/heldout/exact_match_gain_vs_champion", gain.mean, gain.low, gain.high)

    # KL(policy || SFT) and diversity, on samples drawn from the policy (the k1 estimate needs them).
    policy, tokenizer = load_causal_lm(policy_model)
    reference, _ = load_causal_lm(sft_model)
    torch.manual_seed(cfg.seed)
    samples = generate(policy, tokenizer, prompts, cfg.max_new_tokens, cfg.batch_size, sample=True)
    policy_logps = stats.sequence_logprobs(policy, tokenizer, prompts, samples, cfg.batch_size)
    reference_logps = stats.sequence_logprobs(reference, tokenizer, prompts, samples, cfg.batch_size)
    kl = stats.kl_to_reference(policy_logps, reference_logps)
    metrics["eval/heldout/kl_to_sft"] = kl
    metrics["eval/heldout/policy_distinct_2"] = stats.distinct_n(samples, 2)
    metrics["eval/heldout/policy_mean_length"] = stats.mean_length(completions["policy"])
    drift = stats.length_drift(completions["policy"], completions["sft"])
    metrics["eval/heldout/length_drift"] = drift
    if cfg.perplexity_rows:
        rows = load_split(data_dir, "sft")
        rows = rows.select(range(min(cfg.perplexity_rows, len(rows))))
        texts = _sft_texts(rows)
        metrics["eval/sft_split/sft_perplexity"] = stats.perplexity(reference, tokenizer, texts, cfg.batch_size)
        metrics["eval/sft_split/policy_perplexity"] = stats.perplexity(policy, tokenizer, texts, cfg.batch_size)
    del policy, reference

    rewards: dict[str, list[float]] = {}
    win_rates: dict[str, stats.WinRate] = {}
    if reward_model is not None:
        rm = AutoModelForSequenceClassification.from_pretrained(str(reward_model), use_safetensors=True)
        rm_tokenizer = load_tokenizer(reward_model)
        for name in [n for n in completions if n != "base"]:
            rewards[name] = reward_scores(rm, rm_tokenizer, prompts, completions[name], cfg.batch_size)
            metrics[f"eval/heldout/{name}_mean_reward"] = sum(rewards[name]) / len(rewards[name])
        for rival in [n for n in ("sft", "champion") if n in rewards]:
            win = stats.win_rate(rewards["policy"], rewards[rival], **boot)
            win_rates[f"{policy_stage} vs {rival}"] = win
            _put(metrics, f"eval/heldout/win_rate_vs_{rival}", win.rate, win.low, win.high)
        if (data_dir / "datasets" / "preference_eval.parquet").is_file():
            metrics["eval/heldout/rm_pairwise_accuracy"] = _pairwise_accuracy(rm, rm_tokenizer, load_split(data_dir, "preference_eval"), cfg.batch_size)

    reward_delta = metrics.get("eval/heldout/policy_mean_reward", 0.0) - metrics.get("eval/heldout/sft_mean_reward", 0.0)
    task_delta = accuracy["policy"].mean - accuracy["sft"].mean
    warnings = stats.hacking_warnings(
        reward_delta=reward_delta, task_delta=task_delta, length_drift=drift, kl=kl,
        max_length_drift=cfg.max_length_drift, max_kl=cfg.max_kl,
    )  # fmt: skip
    metrics["eval/heldout/hacking_warnings"] = float(len(warnings))

    from rlhf_pipeline.trainers.eval_report import write_report

    write_report(out_dir, cfg.num_samples_logged, prompts, answers, completions, correct, rewards, metrics, warnings, accuracy, win_rates)
    return metrics


def _put(metrics: dict[str, float], name: str, value: float, low: float, high: float) -> None:
    metrics[name], metrics[f"{name}_low"], metrics[f"{name}_high"] = value, low, high


def _sft_texts(rows) -> list:
    """SFT rows as perplexity() takes them: (prompt, completion) pairs, or plain text."""
    if "completion" in rows.column_names:
        return list(zip(rows["prompt"], rows["completion"]))
    if "messages" in rows.column_names:  # score the last assistant turn given the rest
        return [(m[:-1], m[-1:]) for m in rows["messages"]]
    return rows["text"]


def _pairwise_accuracy(rm, tokenizer, pairs, batch_size: int) -> float:
    if "prompt" in pairs.column_names:
        pair_prompts = pairs["prompt"]
    else:  # implicit prompt: the whole conversation (or text) is in chosen/rejected
        pair_prompts = [[] if isinstance(c, list) else "" for c in pairs["chosen"]]
    chosen = reward_scores(rm, tokenizer, pair_prompts, pairs["chosen"], batch_size)
    rejected = reward_scores(rm, tokenizer, pair_prompts, pairs["rejected"], batch_size)
    return sum(c > r for c, r in zip(chosen, rejected)) / len(chosen)
