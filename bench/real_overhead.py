"""What the orchestration costs on the real model: `rlhf run --config smollm2` against the same work as plain scripts
(TRL, transformers' `generate`, the checkers), wall to wall, side by side (issue 45).

    python -m bench.real_overhead                 # 2 rounds; about an hour on 2 cores (each side ~15 min a round)
    python -m bench.real_overhead --rounds 3
    python -m bench.real_overhead --rounds 1 --set grpo.max_steps=1 --set grpo.max_completion_length=32 \\
        --set eval.max_prompts=4 --set eval.max_new_tokens=32 --set eval.instruction_following.ifeval_prompts=2 \\
        --set eval.instruction_following.ifbench_prompts=2 --set eval.instruction_following.max_new_tokens=32
                                                  # a smoke run of the mechanics, ~7 minutes

A round of the preset as it stands (README command 3 in docs/PERFORMANCE.md: data ~25 s, 6 GRPO steps ~270 s, eval ~480
s). Each side runs in a fresh process, timed wall to wall (imports, model loading and saving included), interleaved:
pipeline, plain, pipeline, plain, ...; `--set KEY=VALUE` goes to both sides.
- pipeline: `rlhf run --config smollm2` as a user types it, on a fresh state folder each round (one Prefect home for
  all rounds, its database made first): data (checks, Parquet copies) -> sft switched off (the start saved as its
  model) -> grpo -> eval -> registry, with Prefect, MLflow, content-addressed artifacts and hashing.
- plain: one Python process with no Prefect, MLflow, validation or hashing: the preset's data files read into Parquet
  with `datasets`; the GGUF converted by the converter ours uses (`checkpoints.local_folder`); TRL's `GRPOTrainer` with
  the resolved `grpo` settings and the preset's reward (`trainers.rewards.ifeval.constraints_followed`), saving at the
  same steps; then the eval a script would write: the start and the policy loaded in `eval.dtype`, greedy answers by
  `model.generate` (chat template, left-padded, `eval.batch_size` prompts a batch) to the held-out prompts and to the
  same IFEval and IFBench samples (picked by our `stratified_sample`), the gold metric and the checkers called on them
  (strict and loose, as our eval scores them), and the KL to the start on answers sampled from the policy.
The conversion is paid by both sides in every round: each side's `RLHF_MODEL_CACHE` is a fresh folder of its own, which
also keeps ours from reusing the greedy answers it caches there (`trainers.evaluation.answers`) across rounds; each
side's `HF_DATASETS_CACHE` is fresh too. Ours converts inside the data stage's build (its tokenizer counts the rows'
tokens), and the line it logs ("model: converted ... in N s") gives the seconds taken out of data.

The parts: ours from each artifact's manifest (`resources.seconds`), the plain side's from its own clocks (each part
with the imports it needs); "outside" is the wall time left over (ours: start-up, Prefect, MLflow, hashing, the
registry step; plain: start-up, torch and the parameters). Before a verdict the bench checks that both sides did the
same work: the same GRPO steps with the same tokens at each logged step (TRL's `num_tokens`: both sides train on the
same prompts and sample the same completions, seeded alike), the same number of answers per model and prompt set (and
the same answer sets generated: ours counted in its answer cache), the same held-out prompts (those ours shows in its
samples table) and the same instruction ids in each benchmark's sample. The scores of both sides are printed side by
side, and the greedy answers' length in tokens: ours batches prompts by length, the script in their order, and a batch
composed otherwise tips bf16 near-ties, so the answers differ a little and so does the eval's work. Each side's
"other work" is the share of the cores that processes not its own used meanwhile (`/proc/stat`): above `BUSY` the
seconds measure the machine's load as much as either side. Exit 0: pipeline / plain by medians <= TARGET; 1: above
it; 3: no verdict (a run failed, the sides did different work, or the machine was busy).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

from bench.runs import ROOT, clean_env, migrated_prefect_home, printed_artifacts, ratio_of_medians, rlhf_command, timed

if TYPE_CHECKING:
    from rlhf_pipeline.trainers.rewards.ifeval import Benchmark

PRESET = "smollm2"
TARGET = 1.05
"""Pipeline over plain scripts on the real model, by medians of the wall times (issue 45). Exit 1 above it."""
NO_VERDICT = 3
BUSY = 0.10
"""The most of the cores other work may use, by the median over rounds of either side, for the ratio to be a verdict:
under load a side's seconds measure the load, and the two sides have not suffered it alike."""
PARTS = {
    "data": "data",
    "conversion": "conversion (GGUF -> safetensors)",
    "sft": "sft switched off (start saved)",
    "grpo": "grpo build",
    "eval": "eval build",
    "outside": "outside the parts",
}
MODELS = {"start": "sft", "policy": "policy"}
"""The compared models, and the name ours gives each in its metrics (the start is the sft row)."""
REWARD = "rlhf_pipeline.trainers.rewards.ifeval:constraints_followed"
GOLD = "rlhf_pipeline.trainers.rewards.ifeval:all_followed"
CONVERTED = re.compile(r"model: converted \S+ in ([\d.]+) s")
GRPO_FIELDS = (
    *("learning_rate", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "warmup_steps"),
    *("lr_scheduler_type", "lr_scheduler_kwargs", "optim", "weight_decay", "max_grad_norm", "logging_steps"),
    *("save_steps", "seed", "num_generations", "max_completion_length", "temperature", "num_iterations", "epsilon"),
    *("beta", "loss_type", "scale_rewards"),
)
"""The `grpo` fields the plain side passes to TRL's GRPOConfig: bench.real_speed's, with the preset's logging and save
steps (both sides write the same checkpoints)."""


def comparable(params) -> None:
    """Stop unless the parameters ask for the work the plain side does: the preset's reward and gold metric, GRPO from
    the base model, no probes, adapters, reward model or judge."""
    problems = [
        *([f"algorithm={params.algorithm}"] if params.algorithm != "grpo" else []),
        *(["sft.enabled=true"] if params.sft.enabled else []),
        *(["grpo.eval_steps is set"] if params.grpo.eval_steps else []),
        *(["grpo.lora.enabled=true"] if params.grpo.lora.enabled else []),
        *(["a reward model in the rewards"] if params.rewards.uses_reward_model else []),
        *(["eval.use_reward_model=true"] if params.eval.use_reward_model else []),
        *(["eval.judge is set"] if params.eval.judge is not None else []),
    ]
    if [spec.path for spec in params.rewards.functions] != [REWARD]:
        problems.append(f"rewards.functions is not [{REWARD}]")
    if params.eval.gold_metric is None or params.eval.gold_metric.path != GOLD:
        problems.append(f"eval.gold_metric is not {GOLD}")
    if problems:
        raise SystemExit(
            f"bench.real_overhead's plain side does the {PRESET} preset's work, not: {'; '.join(problems)}"
        )


def plain(out: Path, overrides: list[str]) -> None:
    """The child side: the preset's run as plain scripts; writes its parts' seconds, scores and work to
    `out/record.json`."""
    import torch

    from rlhf_pipeline.flows.params import load_params

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    params = load_params(PRESET, overrides)
    comparable(params)
    parts: dict[str, float] = {}
    clock = [time.perf_counter()]

    def finished(part: str) -> None:
        now = time.perf_counter()
        parts[part], clock[0] = now - clock[0], now

    from datasets import load_dataset

    data = out / "data"
    data.mkdir(parents=True)
    for name, (_, spec) in params.data.sources().items():
        load_dataset("json", data_files=spec.path, split="train").to_parquet(str(data / f"{name}.parquet"))
    finished("data")
    from rlhf_pipeline.trainers.models.checkpoints import local_folder

    start = Path(local_folder(params.model.name_or_path, log=lambda line: None))
    finished("conversion")
    steps, tokens = plain_grpo(params, start, data, out)
    finished("grpo")
    scores, work, heldout = plain_eval(params, start, out / "grpo", data)
    finished("eval")
    record = {
        "parts": parts,
        "scores": scores,
        "work": {"grpo_steps": steps, "grpo_tokens": tokens, **work},
        "heldout": heldout,
    }
    (out / "record.json").write_text(json.dumps(record))


def plain_grpo(params, start: Path, data: Path, out: Path) -> tuple[int, list[float]]:
    """TRL's GRPOTrainer with the resolved `grpo` settings (`GRPO_FIELDS`) on the Parquet prompts, from the converted
    start; saves the policy to `out/grpo`. Returns the steps trained and the tokens seen by each logged step."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_pipeline.trainers.rewards.ifeval import constraints_followed

    cfg = params.grpo
    # Our fields carry TRL's names: each resolved value goes to the TRL argument of the same name
    same = {name: getattr(cfg, name) for name in GRPO_FIELDS}
    args = trl.GRPOConfig(
        **same,
        output_dir=str(out / "grpo-work"),
        # Ours keeps the newest two checkpoints as well: both sides write and keep the same ones
        save_total_limit=2,
        report_to="none",
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        reward_weights=[spec.weight for spec in params.rewards.functions],
        **cfg.trl_overrides,
    )
    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32),
        reward_funcs=[constraints_followed],
        args=args,
        train_dataset=Dataset.from_parquet(str(data / "prompts.parquet")),
        processing_class=AutoTokenizer.from_pretrained(start),
    )
    trainer.train()
    trainer.save_model(str(out / "grpo"))
    return trainer.state.global_step, [row["num_tokens"] for row in trainer.state.log_history if "num_tokens" in row]


def eval_sets(params, data: Path) -> dict[str, tuple[list[dict], int, Benchmark]]:
    """Prompt set -> (rows, answer budget, checkers): the first `eval.max_prompts` held-out rows, and each benchmark's
    sample as ours picks it (its rows as messages, with their index among the rows it can check)."""
    from datasets import Dataset

    from rlhf_pipeline.trainers.evaluation.instructions import BENCHMARKS, benchmark_rows, stratified_sample

    cfg, following = params.eval, params.eval.instruction_following
    heldout = list(Dataset.from_parquet(str(data / "prompts_eval.parquet")))[: cfg.max_prompts]
    sets: dict[str, tuple[list[dict], int, Benchmark]] = {"heldout": (heldout, cfg.max_new_tokens, "ifeval")}
    for key, benchmark in BENCHMARKS.items():
        if following is not None and following.prompts(key):
            available, _ = benchmark_rows(benchmark)
            picked = stratified_sample(available, following.prompts(key), following.sample_seed)
            rows = [
                available[i] | {"prompt": [{"role": "user", "content": available[i]["prompt"]}], "index": i}
                for i in picked
            ]
            sets[key] = (rows, following.max_new_tokens, cast("Benchmark", benchmark.checkers))
    return sets


def generated(model, tokenizer, prompts: list, max_new_tokens: int, batch_size: int, **settings):
    """Each batch of `prompts` through the chat template, left-padded, and what `model.generate` made of it: (batch,
    output ids), stopping at the end of turn."""
    import torch

    stops = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
    for first in range(0, len(prompts), batch_size):
        batch = tokenizer.apply_chat_template(
            prompts[first : first + batch_size],
            add_generation_prompt=True,
            padding=True,
            return_tensors="pt",
            return_dict=True,
        )
        with torch.no_grad():
            output = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                eos_token_id=stops,
                pad_token_id=tokenizer.pad_token_id,
                **settings,
            )
        yield batch, output


def greedy(model, tokenizer, prompts: list, max_new_tokens: int, batch_size: int) -> list[str]:
    texts: list[str] = []
    for batch, output in generated(model, tokenizer, prompts, max_new_tokens, batch_size, do_sample=False):
        texts += tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return texts


def sampled_kl(models: dict, tokenizer, prompts: list, cfg) -> float:
    """KL(policy || start), the k1 estimate: the mean over answers sampled from the policy (seeded, temperature 1) of
    log pi(answer) - log pi_start(answer), each answer's tokens up to its first stop token."""
    import torch

    torch.manual_seed(cfg.seed)
    stops = torch.tensor(sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}))
    gaps: list[float] = []
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    for batch, output in generated(
        models["policy"], tokenizer, prompts, cfg.max_new_tokens, cfg.batch_size, **sampling
    ):
        answer = output[:, batch["input_ids"].shape[1] :]
        stopped = torch.isin(answer, stops).long()
        # generate pads a finished answer: its tokens are those up to and including its first stop
        kept = (stopped.cumsum(1) - stopped) == 0
        mask = torch.cat([batch["attention_mask"], kept.long()], 1)
        totals = []
        for name in ("policy", "start"):
            with torch.no_grad():
                logits = models[name](
                    input_ids=output,
                    attention_mask=mask,
                    position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                    logits_to_keep=answer.shape[1] + 1,
                ).logits[:, :-1]
            logps = logits.float().log_softmax(-1).gather(-1, answer.unsqueeze(-1)).squeeze(-1)
            totals.append((logps * kept).sum(1))
        gaps += (totals[0] - totals[1]).tolist()
    return sum(gaps) / len(gaps)


def answer_tokens(tokenizer, texts: list[str]) -> int:
    """The greedy answers' length in tokens, both sides counted alike: each text as the tokenizer encodes it."""
    return sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts)


def followed(rows: list[dict], texts: list[str], checkers: Benchmark) -> dict[str, float]:
    """Prompt- and instruction-level accuracy, strict and loose, by the checkers as our eval calls them."""
    from rlhf_pipeline.trainers.rewards.ifeval import check, text_of

    scores = {}
    for mode in ("strict", "loose"):
        checked = [
            check(
                text, list(row["instruction_id_list"]), row["kwargs"], text_of(row["prompt"]), checkers, mode == "loose"
            )
            for row, text in zip(rows, texts)
        ]
        scores[f"prompt_{mode}"] = sum(c.all for c in checked) / len(checked)
        scores[f"instruction_{mode}"] = sum(sum(c.followed) for c in checked) / sum(len(c.followed) for c in checked)
    return scores


def plain_eval(params, start: Path, policy: Path, data: Path) -> tuple[dict[str, float], dict, list[dict]]:
    """The eval as a script: both models in `eval.dtype`, greedy answers to every prompt set, the gold metric and the
    checkers, the sampled KL. Returns (scores, work, the held-out rows with both models' answers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_pipeline.trainers.rewards.ifeval import all_followed

    cfg, following = params.eval, params.eval.instruction_following
    sets = eval_sets(params, data)
    tokenizer = AutoTokenizer.from_pretrained(start, padding_side="left")
    from rlhf_pipeline.trainers.models.decode import fast_dtype

    dtype = getattr(torch, fast_dtype(cfg.dtype) or "float32")
    models = {
        name: AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        for name, folder in (("start", start), ("policy", policy))
    }
    answers = {
        key: {
            name: greedy(model, tokenizer, [row["prompt"] for row in rows], budget, cfg.batch_size)
            for name, model in models.items()
        }
        for key, (rows, budget, _) in sets.items()
    }
    scores: dict[str, float] = {}
    heldout = sets["heldout"][0]
    for name, texts in answers["heldout"].items():
        gold = all_followed(
            prompts=[row["prompt"] for row in heldout],
            completions=[[{"role": "assistant", "content": text}] for text in texts],
            instruction_id_list=[row["instruction_id_list"] for row in heldout],
            kwargs=[row["kwargs"] for row in heldout],
        )
        scores[f"heldout/gold/{name}"] = sum(gold) / len(gold)
    for key, (rows, _, checkers) in sets.items():
        if key != "heldout" or (following is not None and following.heldout):
            for name, texts in answers[key].items():
                scores |= {f"{key}/{level}/{name}": value for level, value in followed(rows, texts, checkers).items()}
    scores["heldout/kl_to_start"] = sampled_kl(models, tokenizer, [row["prompt"] for row in heldout], cfg)
    work = {
        "answers": {key: {name: len(texts) for name, texts in by_model.items()} for key, by_model in answers.items()},
        "answer_tokens": answer_tokens(
            tokenizer, [text for by_model in answers.values() for texts in by_model.values() for text in texts]
        ),
        "answer_sets": sorted(len(texts) for by_model in answers.values() for texts in by_model.values()),
        "instruction_ids": {
            key: sorted({i for row in rows for i in row["instruction_id_list"]})
            for key, (rows, _, _) in sets.items()
            if key != "heldout"
        },
        "prompt_ids": {key: [row["index"] for row in rows] for key, (rows, _, _) in sets.items() if key != "heldout"},
    }
    shown = [
        {"prompt": row["prompt"], **{name: answers["heldout"][name][i] for name in models}}
        for i, row in enumerate(heldout)
    ]
    return scores, work, shown


def pipeline_round(folder: Path, prefect_home: Path, overrides: list[str], log: Path) -> tuple[dict, list[dict]]:
    """`rlhf run --config smollm2` in `folder`: its wall time, parts, scores and work, and the held-out rows its samples
    table shows."""
    env = clean_env(
        RLHF_STATE_DIR=str(folder / "state"),
        PREFECT_HOME=str(prefect_home),
        RLHF_MODEL_CACHE=str(folder / "pipeline-models"),
        HF_DATASETS_CACHE=str(folder / "pipeline-datasets"),
    )
    wall, printed = timed(rlhf_command(overrides, PRESET), env, log)
    artifacts = printed_artifacts(printed)
    seconds = {
        stage: json.loads((artifacts[stage] / "manifest.json").read_text())["resources"]["seconds"]
        for stage in ("data", "sft", "grpo", "eval")
    }
    conversions = [float(found) for found in CONVERTED.findall(printed)]
    if len(conversions) != 1:
        raise SystemExit(f"the pipeline converted the GGUF {len(conversions)} times, not once; see {log}")
    parts = {**seconds, "data": seconds["data"] - conversions[0], "conversion": conversions[0]}
    parts["outside"] = wall - sum(parts.values())
    metrics = json.loads((artifacts["eval"] / "summary.json").read_text())["metrics"]
    training = json.loads((artifacts["grpo"] / "training.json").read_text())
    history = [json.loads(line)["metrics"] for line in (artifacts["grpo"] / "history.jsonl").read_text().splitlines()]
    answered = sorted(path for path in folder.glob("pipeline-models/answers/*.jsonl") if ".partial" not in path.name)
    from transformers import AutoTokenizer

    (converted,) = folder.glob("pipeline-models/gguf-*/")
    texts = [json.loads(line)["answer"] for path in answered for line in path.read_text().splitlines()]
    sets = {"heldout": "eval/heldout/", **{key: f"eval/{key}/" for key in ("ifeval", "ifbench")}}
    work = {
        "grpo_steps": training["global_step"],
        "grpo_tokens": [row["grpo/train/num_tokens"] for row in history if "grpo/train/num_tokens" in row],
        "answer_tokens": answer_tokens(AutoTokenizer.from_pretrained(converted), texts),
        "answers": {
            key: {
                name: int(metrics[f"{prefix}num_prompts"])
                for name, ours in MODELS.items()
                if any(metric.startswith(f"{prefix}{ours}_") for metric in metrics)
            }
            for key, prefix in sets.items()
            if f"{prefix}num_prompts" in metrics
        },
        "answer_sets": sorted(len(path.read_text().splitlines()) for path in answered),
        "instruction_ids": {
            key: sorted(
                metric.rpartition("/")[2] for metric in metrics if metric.startswith(f"{prefix}if_instruction/sft/")
            )
            for key, prefix in sets.items()
            if key != "heldout" and f"{prefix}num_prompts" in metrics
        },
    }
    scores = {}
    for name, ours in MODELS.items():
        scores[f"heldout/gold/{name}"] = metrics[f"eval/heldout/{ours}_gold"]
        for key, prefix in sets.items():
            for level in ("prompt_strict", "prompt_loose", "instruction_strict", "instruction_loose"):
                if f"{prefix}{ours}_if_{level}" in metrics:
                    scores[f"{key}/{level}/{name}"] = metrics[f"{prefix}{ours}_if_{level}"]
    scores["heldout/kl_to_start"] = metrics["eval/heldout/kl_to_sft"]
    rows = [json.loads(line) for line in (artifacts["eval"] / "samples.jsonl").read_text().splitlines()]
    shown = [{"prompt": row["prompt"], **{name: row[ours] for name, ours in MODELS.items()}} for row in rows]
    return {"wall": wall, "parts": parts, "scores": scores, "work": work}, shown


def plain_round(folder: Path, overrides: list[str], log: Path) -> tuple[dict, list[dict]]:
    """The plain side in a fresh process: its wall time, parts, scores and work, and its held-out rows."""
    env = clean_env(RLHF_MODEL_CACHE=str(folder / "plain-models"), HF_DATASETS_CACHE=str(folder / "plain-datasets"))
    sets = [part for item in overrides for part in ("--set", item)]
    wall, _ = timed([sys.executable, "-m", "bench.real_overhead", "--plain", str(folder / "plain"), *sets], env, log)
    record = json.loads((folder / "plain" / "record.json").read_text())
    parts = record["parts"]
    parts["outside"] = wall - sum(parts.values())
    return {"wall": wall, "parts": parts, "scores": record["scores"], "work": record["work"]}, record["heldout"]


def same_work(pipeline: dict, plain: dict, shown: tuple[list[dict], list[dict]]) -> str:
    """Stop the bench unless both sides of a round did the same work (module docstring); else how many of the held-out
    answers ours shows are the plain side's, word for word."""
    ours, theirs = pipeline["work"], plain["work"]
    problems = [
        f"{what}: pipeline {ours[what]} vs plain {theirs[what]}"
        for what in ("grpo_steps", "grpo_tokens", "answers", "answer_sets", "instruction_ids")
        if ours[what] != theirs[what]
    ]
    rows, plain_rows = shown
    if not rows or [row["prompt"] for row in rows] != [row["prompt"] for row in plain_rows[: len(rows)]]:
        problems.append(
            f"the held-out prompts of the pipeline's samples table ({len(rows)}) are not the plain side's first"
        )
    if problems:
        raise SystemExit("the two sides did not do the same work:\n  " + "\n  ".join(problems))
    equal = {name: sum(row[name] == other[name] for row, other in zip(rows, plain_rows)) for name in MODELS}
    return ", ".join(f"{name} {count} of {len(rows)}" for name, count in equal.items())


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds used since boot by the whole machine (`/proc/stat`: all but idle and I/O wait) and by this process's
    finished children: the difference over a side is the other work that shared the cores with it."""
    ticks = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), children.ru_utime + children.ru_stime


def others_share(before: tuple[float, float], wall: float) -> float:
    """The share of the cores other work used while a side ran (0: none; on a quiet machine a few hundredths)."""
    machine, ours = (now - then for now, then in zip(cpu_seconds(), before))
    return max(machine - ours, 0.0) / (wall * len(os.sched_getaffinity(0)))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(rounds: list[dict], overrides: list[str]) -> float:
    """The per-part table (each round and the median), the scores side by side, and the ratio of medians."""
    count = len(rounds)
    heads = "".join(f"{'r' + str(n + 1):>8}" for n in range(count)) + f"{'median':>9}"
    print(f"\n{PRESET}{' with ' + ' '.join(overrides) if overrides else ''}; {count} round(s), seconds")
    print(f"{'part':34} {'pipeline':^{len(heads)}} | {'plain':^{len(heads)}}")
    print(f"{'':34} {heads} | {heads}")
    for part, label in PARTS.items():
        cells = []
        for side in ("pipeline", "plain"):
            values = [r[side]["parts"].get(part) for r in rounds]
            present = [v for v in values if v is not None]
            cells.append(
                "".join(f"{v:8.1f}" if v is not None else f"{'-':>8}" for v in values)
                + (f"{median(present):9.1f}" if present else f"{'-':>9}")
            )
        print(f"{label:34} {cells[0]} | {cells[1]}")
    tokens = {side: [r[side]["work"]["answer_tokens"] for r in rounds] for side in ("pipeline", "plain")}
    cells = ["".join(f"{v:8d}" for v in tokens[side]) + f"{median(tokens[side]):9.0f}" for side in tokens]
    print(f"{'eval: greedy answers, tokens':34} {cells[0]} | {cells[1]}")
    walls = {side: [r[side]["wall"] for r in rounds] for side in ("pipeline", "plain")}
    cells = ["".join(f"{v:8.1f}" for v in walls[side]) + f"{median(walls[side]):9.1f}" for side in walls]
    print(f"{'wall to wall':34} {cells[0]} | {cells[1]}")
    shares = {side: [r[side]["others"] for r in rounds] for side in ("pipeline", "plain")}
    cells = ["".join(f"{v:8.0%}" for v in shares[side]) + f"{median(shares[side]):9.0%}" for side in shares]
    print(f"{'other work, share of the cores':34} {cells[0]} | {cells[1]}")
    print(f"\n{'scores, pipeline / plain':34} " + "".join(f"{'round ' + str(n + 1):>18}" for n in range(count)))
    for key in rounds[0]["pipeline"]["scores"]:
        pairs = [(r["pipeline"]["scores"][key], r["plain"]["scores"].get(key, float("nan"))) for r in rounds]
        print(f"{key:34} " + "".join(f"{one:9.3f} /{two:7.3f}" for one, two in pairs))
    for n, one in enumerate(rounds):
        print(f"round {n + 1}: held-out answers shown by the pipeline equal to the plain side's: {one['equal']}")
    ratio = ratio_of_medians(walls, TARGET)
    return ratio


def measure(rounds: int, overrides: list[str], root: Path, keep: bool) -> int:
    """Every round, the table and the verdict (0 or 1); `keep`: each round's folder is left in `root`."""
    log = root / "runs.log"
    prefect_home = migrated_prefect_home(root, log)
    results = []
    for n in range(rounds):
        folder = root / f"round-{n + 1}"
        before = cpu_seconds()
        pipeline, shown = pipeline_round(folder, prefect_home, overrides, log)
        pipeline["others"] = others_share(before, pipeline["wall"])
        print(
            f"round {n + 1}: pipeline {pipeline['wall']:.1f}s, others {pipeline['others']:.0%} of the cores", flush=True
        )
        before = cpu_seconds()
        plain_side, plain_shown = plain_round(folder, overrides, log)
        plain_side["others"] = others_share(before, plain_side["wall"])
        print(
            f"round {n + 1}: plain {plain_side['wall']:.1f}s, others {plain_side['others']:.0%} of the cores",
            flush=True,
        )
        equal = same_work(pipeline, plain_side, (shown, plain_shown))
        results.append({"pipeline": pipeline, "plain": plain_side, "equal": equal})
        line = {
            side: {
                "wall": r["wall"],
                "others": r["others"],
                "parts": r["parts"],
                "scores": r["scores"],
                "grpo_steps": r["work"]["grpo_steps"],
                "answers": r["work"]["answers"],
                "answer_tokens": r["work"]["answer_tokens"],
            }
            for side, r in (("pipeline", pipeline), ("plain", plain_side))
        }
        print(json.dumps({"round": n + 1, **line, "prompt_ids": plain_side["work"]["prompt_ids"]}), flush=True)
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
    ratio = report(results, overrides)
    busiest = max(median([one[side]["others"] for one in results]) for side in ("pipeline", "plain"))
    if busiest > BUSY:
        print(f"no verdict: other work used {busiest:.0%} of the cores while a side ran (at most {BUSY:.0%} for one)")
        return NO_VERDICT
    return 0 if ratio <= TARGET else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for both sides (repeatable), e.g. a shorter smoke run",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (runs.log, each round's state)")
    # The child side
    parser.add_argument("--plain", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.plain is not None:
        plain(args.plain, args.overrides)
        return 0
    from rlhf_pipeline.flows.params import load_params

    # Refused here, before any round, rather than in the first plain run
    comparable(load_params(PRESET, args.overrides))
    root = Path(tempfile.mkdtemp(prefix="bench-real-overhead-"))
    try:
        code = measure(args.rounds, args.overrides, root, args.keep)
    except SystemExit as stop:
        if not isinstance(stop.code, str):
            raise
        print(f"{stop.code}\nno verdict; the runs are kept in {root}", file=sys.stderr)
        return NO_VERDICT
    if args.keep:
        print(f"kept: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
