"""Held-out evaluation: exact match of base, SFT and final policy; reward-model accuracy and scores.

Greedy decoding on the held-out prompts (`prompts_eval`, with a reference
`answer` column); the reward model scores text exactly as TRL's RewardTrainer
formats it (prompt + completion + EOS, or the chat template), so its scores
here mean what they meant in training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from trainers.common import ModelConfig, StrictModel

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class EvalConfig(StrictModel):
    max_new_tokens: int = Field(64, ge=1, description="Longest generated answer.")
    batch_size: int = Field(64, ge=1, description="Prompts per generation batch.")
    max_prompts: int | None = Field(None, ge=1, description="Evaluate only the first N held-out prompts; None: all.")
    answer_column: str = Field("answer", description="Reference column of the held-out prompts for exact match.")
    use_reward_model: bool = Field(True, description="Score answers and held-out pairs with the rm stage's model (trains it even for dpo).")
    num_samples_logged: int = Field(50, ge=0, description="Rows of the samples table (prompt, answers, rewards).")


def generate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list, max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy completions for standard (str) or conversational (list of messages) prompts."""
    import torch

    tokenizer.padding_side = "left"
    model.eval()
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        ids = [_prompt_ids(tokenizer, p) for p in batch]
        width = max(map(len, ids))
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(x)) + x for x in ids])
        attention = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad():
            generated = model.generate(
                input_ids=input_ids.to(model.device),
                attention_mask=attention.to(model.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        out.extend(tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True))
    return out


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def reward_scores(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list, completions: list, batch_size: int) -> list[float]:
    """Scalar rewards of prompt + completion, formatted as TRL's RewardTrainer formats them."""
    import torch

    texts = []
    for prompt, completion in zip(prompts, completions):
        if isinstance(prompt, list):
            reply = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            texts.append(tokenizer.apply_chat_template(prompt + reply, tokenize=True, return_dict=True)["input_ids"])
        else:
            texts.append(tokenizer(prompt + completion + tokenizer.eos_token)["input_ids"])
    model.eval()
    scores: list[float] = []
    for start in range(0, len(texts), batch_size):
        batch = texts[start : start + batch_size]
        width = max(map(len, batch))
        input_ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in batch])
        attention = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in batch])
        with torch.no_grad():
            logits = model(input_ids=input_ids.to(model.device), attention_mask=attention.to(model.device)).logits
        scores.extend(logits[:, 0].float().tolist())
    return scores


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
) -> dict[str, float]:
    """Write `summary.json` and `samples.jsonl` into `out_dir`; return `eval/heldout/*` metrics."""
    from transformers import AutoModelForSequenceClassification

    from trainers.common import load_base_model, load_causal_lm, load_split, load_tokenizer

    prompts_ds = load_split(data_dir, "prompts_eval")
    if cfg.max_prompts:
        prompts_ds = prompts_ds.select(range(min(cfg.max_prompts, len(prompts_ds))))
    if cfg.answer_column not in prompts_ds.column_names:
        raise ValueError(
            f"prompts_eval has no reference column {cfg.answer_column!r} (columns: {prompts_ds.column_names}); "
            "set eval.answer_column"
        )
    prompts, answers = prompts_ds["prompt"], prompts_ds[cfg.answer_column]

    loaders = {
        "base": lambda: load_base_model(base),
        "sft": lambda: load_causal_lm(sft_model),
        policy_stage: lambda: load_causal_lm(policy_model),
    }
    completions: dict[str, list[str]] = {}
    for name, load in loaders.items():  # one model in memory at a time
        model, tokenizer = load()
        completions[name] = generate(model, tokenizer, prompts, cfg.max_new_tokens, cfg.batch_size)
        del model

    metrics: dict[str, float] = {}
    correct = {name: _exact(c, answers) for name, c in completions.items()}
    for name, hits in correct.items():
        metrics[f"eval/heldout/{name}_exact_match"] = sum(hits) / len(hits)
    metrics["eval/heldout/num_prompts"] = float(len(prompts))

    rewards: dict[str, list[float]] = {}
    if reward_model is not None:
        rm = AutoModelForSequenceClassification.from_pretrained(str(reward_model), use_safetensors=True)
        rm_tokenizer = load_tokenizer(reward_model)
        for name in ("sft", policy_stage):
            rewards[name] = reward_scores(rm, rm_tokenizer, prompts, completions[name], cfg.batch_size)
            metrics[f"eval/heldout/{name}_mean_reward"] = sum(rewards[name]) / len(rewards[name])
        if (data_dir / "datasets" / "preference_eval.parquet").is_file():
            pairs = load_split(data_dir, "preference_eval")
            if "prompt" in pairs.column_names:
                pair_prompts = pairs["prompt"]
            else:  # implicit prompt: the whole conversation (or text) is in chosen/rejected
                pair_prompts = [[] if isinstance(c, list) else "" for c in pairs["chosen"]]
            chosen = reward_scores(rm, rm_tokenizer, pair_prompts, pairs["chosen"], cfg.batch_size)
            rejected = reward_scores(rm, rm_tokenizer, pair_prompts, pairs["rejected"], cfg.batch_size)
            metrics["eval/heldout/rm_pairwise_accuracy"] = sum(c > r for c, r in zip(chosen, rejected)) / len(chosen)

    _write_report(cfg, out_dir, prompts, answers, completions, correct, rewards, metrics)
    return metrics


def _write_report(cfg, out_dir, prompts, answers, completions, correct, rewards, metrics) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    with open(out_dir / "samples.jsonl", "w", encoding="utf-8") as f:
        for i in range(min(cfg.num_samples_logged, len(prompts))):
            row: dict[str, Any] = {"prompt": prompts[i], "answer": answers[i]}
            for name, outputs in completions.items():
                row[name] = outputs[i]
                row[f"{name}_correct"] = correct[name][i]
                if name in rewards:
                    row[f"{name}_reward"] = round(rewards[name][i], 4)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v:.4f} |" for k, v in sorted(metrics.items())]
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n")
