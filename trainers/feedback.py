"""Iterated feedback (Xiong et al. 2024, online iterative RLHF): after the policy trains, sample it, have the samples
labelled, retrain the reward model on the old pairs and the new ones, train the policy again; `rounds` times.

A round's `rm` stage does the sampling and the labelling: it reads the previous round's policy, draws two completions
for each of `prompts_per_round` training prompts, asks the labeller which is better, and trains on the preference data
plus every pair the rounds so far collected (`feedback_pairs.jsonl` in its artifact, carried to the next round). The
policy's reward stays the reward model alone: the labeller only ever makes pairs.

A labeller has the signature

    def labeller(prompts: list, first: list, second: list, **columns) -> list[float | None]

one value per pair: 1.0 when `first` is the better completion, 0.0 when `second` is, None when it cannot tell (the pair
is dropped). Completions are strings, or message lists for conversational prompts; the prompts' other columns (e.g. a
reference `answer`, which a human rater would know) arrive as keyword arguments, as in TRL's reward functions.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

from pydantic import Field, field_validator, model_validator

from rlhf_pipeline.trainers.config import Block

PAIRS = "feedback_pairs.jsonl"


class FeedbackConfig(Block):
    rounds: int = Field(
        0,
        ge=0,
        le=10,
        description=(
            "Rounds of feedback after the first policy: sample it, label pairs, retrain rm, train the policy again. "
            "0: none."
        ),
    )
    labeller: str | None = Field(
        None,
        description=(
            "'module:function' judging pairs of the policy's samples: fn(prompts, first, second, **columns) -> 1.0 "
            "(first better), 0.0 (second), None (drop). E.g. rlhf_pipeline.trainers.sort_task:reference_labeller (a "
            "rater who knows the answer)."
        ),
    )
    labels_dir: str | None = Field(
        None,
        description=(
            "Instead of a labeller, people: each round writes <labels_dir>/round-<r>/pairs.jsonl (id, prompt, first, "
            'second) and waits for round-<r>/labels.jsonl, one {"id": ..., "label": 1 | 0 | null} per pair (written '
            "whole, e.g. renamed into place)."
        ),
    )
    wait_timeout_s: float = Field(
        86400.0, gt=0, description="How long a round waits for labels.jsonl before the stage fails (labels_dir)."
    )
    prompts_per_round: int = Field(512, ge=1, description="Training prompts sampled (two completions each) per round.")
    max_new_tokens: int = Field(64, ge=1, description="Longest sampled completion.")
    seed: int = Field(0, description="Seed of the prompt choice and the samples (each round draws its own).")
    from_sft: bool = Field(
        False,
        description=(
            "Train each round's policy from the SFT model (its KL reference too) with the round's reward model, "
            "instead of from the last round's policy (then also its reference: drift from SFT adds up over the "
            "rounds)."
        ),
    )

    @field_validator("labeller")
    @classmethod
    def _importable(cls, path: str | None) -> str | None:
        if path is not None:
            from rlhf_pipeline.trainers.rewards import import_function

            import_function(path, "labeller")
        return path

    @model_validator(mode="after")
    def _labeller_given(self):
        if self.labeller is not None and self.labels_dir is not None:
            raise ValueError("feedback.labeller and feedback.labels_dir both label the pairs: set one")
        if self.rounds and self.labeller is None and self.labels_dir is None:
            raise ValueError(
                f"feedback.rounds={self.rounds} needs a labeller ('module:function') or a labels_dir where people "
                "label the policy's samples"
            )
        return self

    def code_paths(self) -> list[str]:
        """The labeller's source keys the rounds' rm stages."""
        return [self.labeller] if self.labeller else []


def collect_pairs(
    cfg: FeedbackConfig, policy_model: Path, data_dir: Path, round_: int, earlier: Path | None, out_dir: Path
) -> list[dict]:
    """This round's labelled pairs from the policy's samples, appended to the earlier rounds' (`earlier`: their file);
    all of them are written to `out_dir/feedback_pairs.jsonl` and returned."""
    import torch

    from rlhf_pipeline.trainers.loop import load_split
    from rlhf_pipeline.trainers.models import load_causal_lm
    from rlhf_pipeline.trainers.rewards import as_completions, import_function
    from rlhf_pipeline.trainers.text import generate

    prompts_ds = load_split(data_dir, "prompts")
    rows = random.Random(cfg.seed * 1000 + round_).sample(
        range(len(prompts_ds)), min(cfg.prompts_per_round, len(prompts_ds))
    )
    chosen_rows = prompts_ds.select(rows)
    prompts = chosen_rows["prompt"]
    columns = {name: chosen_rows[name] for name in chosen_rows.column_names if name != "prompt"}
    policy, tokenizer = load_causal_lm(policy_model)
    torch.manual_seed(cfg.seed * 1000 + round_)
    first, second = (
        generate(policy, tokenizer, prompts, cfg.max_new_tokens, batch_size=128, sample=True) for _ in range(2)
    )
    del policy
    first_c, second_c = as_completions(prompts, first), as_completions(prompts, second)
    if cfg.labels_dir is not None:
        labels = wait_for_labels(
            Path(cfg.labels_dir) / f"round-{round_}", prompts, first_c, second_c, cfg.wait_timeout_s
        )
    else:
        labeller: Callable = import_function(cfg.labeller, "labeller")
        labels = labeller(prompts=prompts, first=first_c, second=second_c, **columns)
    if len(labels) != len(prompts):
        raise ValueError(f"labeller {cfg.labeller!r} returned {len(labels)} labels for {len(prompts)} pairs")
    pairs = (
        [json.loads(line) for line in earlier.read_text().splitlines()]
        if earlier is not None and earlier.is_file()
        else []
    )
    for prompt, a, b, label in zip(prompts, first_c, second_c, labels):
        if label is None or a == b:
            continue
        if not 0.0 <= float(label) <= 1.0:
            raise ValueError(
                f"labeller {cfg.labeller!r} returned {label!r}: labels are 1.0 (first better), 0.0 (second) or None"
            )
        if float(label) == 0.5:
            continue
        better, worse = (a, b) if float(label) > 0.5 else (b, a)
        pairs.append({"prompt": prompt, "chosen": better, "rejected": worse, "round": round_})
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / PAIRS, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(pair, ensure_ascii=False) + "\n" for pair in pairs)
    return pairs


def wait_for_labels(
    folder: Path, prompts: list, first: list, second: list, timeout_s: float, poll_s: float = 5.0
) -> list[float | None]:
    """People's labels: the pairs go to `folder/pairs.jsonl` (ids 0..n-1), and the round waits for
    `folder/labels.jsonl`. A resumed round finds the labels already there. A label file that misses a pair, or holds a
    label that is not 1, 0 or null, fails naming the file and the line."""
    import os
    import time

    from rlhf_pipeline.trainers.progress import PROGRESS

    folder.mkdir(parents=True, exist_ok=True)
    pairs = folder / "pairs.jsonl"
    tmp = folder / ".pairs.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(
            json.dumps({"id": i, "prompt": p, "first": a, "second": b}, ensure_ascii=False) + "\n"
            for i, (p, a, b) in enumerate(zip(prompts, first, second))
        )
    os.replace(tmp, pairs)
    labels_file, started, said = folder / "labels.jsonl", time.monotonic(), 0.0
    while not labels_file.is_file():
        waited = time.monotonic() - started
        if waited > timeout_s:
            raise TimeoutError(
                f"no labels for {pairs} after {waited:.0f}s (feedback.wait_timeout_s={timeout_s}): write {labels_file}"
            )
        if waited >= said:
            PROGRESS.info(f"rm: waiting for the labels of {len(prompts)} pairs ({pairs}) in {labels_file}")
            said = waited + 600
        time.sleep(poll_s)
    labels: dict[int, float | None] = {}
    for number, line in enumerate(labels_file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or "id" not in row or row.get("label") not in (1, 0, 1.0, 0.0, None):
            raise ValueError(
                f'{labels_file} line {number}: each line is {{"id": <pair id>, "label": 1 | 0 | null}}, got '
                f"{line[:200]!r}"
            )
        labels[int(row["id"])] = None if row["label"] is None else float(row["label"])
    missing = [i for i in range(len(prompts)) if i not in labels]
    if missing:
        raise ValueError(
            f"{labels_file} has no label for pairs {missing[:10]}{' ...' if len(missing) > 10 else ''} of {pairs} (a "
            "null label drops a pair)"
        )
    return [labels[i] for i in range(len(prompts))]


def with_pairs(dataset, pairs: list[dict]):
    """The preference dataset with the feedback pairs appended (prompt, chosen, rejected; other columns left out)."""
    from datasets import Dataset, concatenate_datasets

    if not pairs:
        return dataset
    if "prompt" not in dataset.column_names:
        raise ValueError(
            f"feedback pairs have a prompt, and the preference data has none (columns: {dataset.column_names}): give "
            "it a prompt column"
        )
    keep = ["prompt", "chosen", "rejected"]
    base = dataset.select_columns(keep)
    extra = Dataset.from_list([{c: pair[c] for c in keep} for pair in pairs])
    return concatenate_datasets([base, extra.cast(base.features)])
