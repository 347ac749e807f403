"""`pairs`: preference pairs made from prompt-only data, as RLAIF and iterative/online DPO make them.

Two keyed parts, each a published artifact of the `pairs` stage (`tasks.pairs`):

1. **samples** (`sample`): the starting policy (sft's model, or a feedback round's last policy) answers each of the
   `prompts` dataset's prompts `samples_per_prompt` times with the block's sampling settings. Keyed on the prompts, the
   sampling model and the sampling settings alone, so another labeller (or people's labels) never samples again.
2. **labelled pairs** (`label`): a labeller picks, per prompt, the better and the worse answer:
   - `function`: a reward function or verifier by import path (TRL's signature, the prompt's other columns as
     keyword arguments) scores every answer: best vs worst, the margin their difference;
   - `reward_model`: the `rm` stage's reward model (its ensemble, aggregated as `rewards.reward_model_aggregate`);
   - `judge`: a pairwise judge (`eval.judge`'s kinds), every two distinct answers in both orders: the answer with
     the most wins vs the one with the fewest, the position bias reported;
   - `people`: the first two distinct answers of each prompt shown as A and B; labels come from the Prefect form or
     a file (`tasks.people`); people's labels are not part of the key (the labeller is), so they are kept apart
     and digested into the key (`tasks.pairs`).
   Ties (margin 0, or at most `min_margin`) and prompts whose answers are all equal are dropped and counted. The
   pairs pass the data stage's preference rules (the task hands `label` the check) before they are published.

The published pairs are `datasets/preference.parquet` (prompt, chosen, rejected: what dpo, kto, orpo and rm train on,
the given pairs appended with `train_on: both`) and `pairs.jsonl` (each with its margin, labeller and round).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import Field, model_validator

from rlhf_pipeline.trainers.config import LogMetrics, StageConfig, StrictModel
from rlhf_pipeline.trainers.rewards.judges import JudgeConfig
from rlhf_pipeline.trainers.runtime.stopping import stoppable

SAMPLES = "samples.jsonl"
"""The samples artifact: one line per prompt, {"id", "prompt", "completions": [...], **the prompt's other columns}."""
PAIRS = "pairs.jsonl"
"""In the pairs artifact: one line per pair, {"prompt", "chosen", "rejected", "margin", "labeller", "round", ...}."""
SUMMARY = "pairs.json"
LABELS = ("A", "B", "tie")
"""What people answer per pair: A or B is better, or neither (the pair is dropped as a tie)."""

Labeller = Literal["function", "reward_model", "judge", "people"]


class PeopleConfig(StrictModel):
    """People label in Prefect: the flow run suspends (a deployment's run) or pauses with a typed form."""

    max_pairs: int = Field(50, ge=1, le=1000, description="Pairs shown to people (one per prompt, the first prompts).")
    timeout_s: float = Field(
        86400.0,
        gt=0,
        description=(
            "How long the flow run waits for the form; then it fails saying so, the labels given so far are kept, and "
            "a re-run asks for the rest (or reads people.labels_file)."
        ),
    )
    labels_file: str | None = Field(
        None,
        description=(
            'A JSONL file of labels instead of the form: one {"pair": <id>, "label": "A" | "B" | "tie" | null} per '
            "line, for the pairs of the samples artifact's to_label.jsonl (null: unlabelled, dropped)."
        ),
    )


class PairsConfig(StageConfig):
    """Preference pairs from prompts: sample the starting policy, label the samples, train on them."""

    enabled: bool = Field(
        False,
        description=(
            "Make preference pairs from the `prompts` dataset before the stages that read pairs (dpo, kto, orpo, rm) "
            "train; data.preference may then be null."
        ),
    )
    train_on: Literal["made", "both"] = Field(
        "made", description="What the pair-reading stages train on: the made pairs, or the made and the given ones."
    )
    labeller: Labeller = Field(
        "function",
        description=(
            "Who picks the better answer: a reward `function` (or verifier), the `reward_model` (rm trains first, on "
            "the given pairs), a pairwise `judge`, or `people` in the Prefect UI."
        ),
    )
    function: str | None = Field(
        None,
        description=(
            "labeller=function: 'module:function' scoring answers as a TRL reward function does, fn(prompts, "
            "completions, **columns) -> list[float | None], e.g. rlhf_pipeline.trainers.rewards.sort_task:exact_match."
        ),
    )
    judge: JudgeConfig | None = Field(None, description="labeller=judge: a function or LM judge (as eval.judge).")
    people: PeopleConfig = Field(default_factory=PeopleConfig, description="labeller=people: the form and its wait.")
    samples_per_prompt: int = Field(
        4, ge=2, le=64, description="Answers sampled per prompt (people see the first two distinct ones)."
    )
    max_prompts: int | None = Field(
        512, ge=1, description="Prompts sampled (a seeded choice of the prompts dataset); None: all of them."
    )
    max_new_tokens: int = Field(64, ge=1, description="Longest sampled answer.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    batch_size: int = Field(
        64,
        ge=1,
        description="Prompts whose answers decode at once (each of their `samples_per_prompt` answers takes a row); "
        "the answers do not depend on it.",
    )
    min_margin: float = Field(
        0.0, ge=0, description="Pairs whose chosen answer beats the rejected one by no more than this are dropped."
    )
    seed: int = Field(0, description="Seed of the prompt choice and the samples (a feedback round adds its number).")

    @model_validator(mode="after")
    def _labeller_named(self):
        if self.enabled:
            self.check_labeller("pairs.enabled=true")
        if self.function is not None:
            from rlhf_pipeline.trainers.rewards.mix import import_function

            import_function(self.function, "pairs.function")
        return self

    def check_labeller(self, why: str) -> None:
        """The labeller is named in full (`why`: what makes pairs)."""
        if self.labeller == "function" and self.function is None:
            raise ValueError(
                f"{why} makes pairs with pairs.labeller=function, which needs pairs.function: a reward function or "
                "verifier ('module:function')"
            )
        if self.labeller == "judge" and self.judge is None:
            raise ValueError(
                f"{why} makes pairs with pairs.labeller=judge, which needs pairs.judge (a function judge or an LM "
                "judge, as eval.judge)"
            )

    def code_paths(self) -> list[str]:
        if self.labeller == "function" and self.function:
            return [self.function]
        if self.labeller == "judge" and self.judge is not None and self.judge.is_function:
            return [self.judge.path]
        return []

    def sampling(self) -> dict[str, Any]:
        """What the samples are keyed on (besides the prompts and the model)."""
        return self.model_dump(
            mode="json",
            include={"samples_per_prompt", "max_prompts", "max_new_tokens", "temperature", "top_p", "seed"},
        )

    def labelling(self) -> dict[str, Any]:
        """What the pairs are keyed on besides the samples: the labeller and what decides which pairs are kept."""
        fields = {"labeller", "min_margin", "train_on", self.labeller}
        return self.model_dump(mode="json", include=fields & set(type(self).model_fields))

    @property
    def uses_device(self) -> bool:
        """Whether labelling loads a model (the reward model, an LM judge)."""
        return self.labeller == "reward_model" or (
            self.labeller == "judge" and self.judge is not None and not self.judge.is_function
        )


# --- 1. samples ----------------------------------------------------------------------------------------------------


@stoppable("the pairs stage's sampling")
def sample(
    cfg: PairsConfig,
    model_dir: Path,
    data_dir: Path,
    out_dir: Path,
    round_: int = 0,
    log_metrics: LogMetrics | None = None,
    work_dir: Path | None = None,
) -> dict[str, float]:
    """`samples_per_prompt` answers of the model in `model_dir` to each chosen prompt, into `out_dir/samples.jsonl`,
    all in one decoding loop (`batch_size` prompts' answers decoding at once). Each answer is drawn from a generator of
    its own, seeded by the seed, the round, its prompt's row and its place among the prompt's answers, so it is the same
    whatever answers shared its steps; each is kept in `work_dir` as it ends: a run killed here resumes with the
    answers it had not drawn, and writes the same samples as an unbroken one (with any `batch_size`)."""
    import random
    import time

    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.models.load import load_causal_lm
    from rlhf_pipeline.trainers.models.text import generate_answers, keeping, kept_answers
    from rlhf_pipeline.trainers.runtime.progress import Progress

    prompts_ds = load_split(data_dir, "prompts")
    count = len(prompts_ds) if cfg.max_prompts is None else min(cfg.max_prompts, len(prompts_ds))
    rows = sorted(random.Random(cfg.seed * 1000 + round_).sample(range(len(prompts_ds)), count))
    chosen = prompts_ds.select(rows)
    prompts = chosen["prompt"]
    columns = {name: chosen[name] for name in chosen.column_names if name != "prompt"}
    n, started = cfg.samples_per_prompt, time.monotonic()
    flat = [prompt for prompt in prompts for _ in range(n)]  # each prompt's n answers side by side
    seeds = [answer_seed(cfg.seed, round_, row, k) for row in rows for k in range(n)]
    kept = (work_dir or out_dir) / "samples.partial.jsonl"
    before = kept_answers(kept)
    policy, tokenizer = load_causal_lm(model_dir)
    progress = Progress("pairs", total=len(flat))
    with keeping(kept) as keep:

        def told(done: int, total: int) -> None:
            progress.step(done)
            if done == total or done % (10 * n) == 0:
                progress.log(done, {"pairs/samples/answers": float(done)})

        texts, cut = generate_answers(
            policy,
            tokenizer,
            flat,
            cfg.max_new_tokens,
            batch_size=cfg.batch_size * n,
            sample=True,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            progress=told,
            done_before=before,
            on_batch=keep,
            seeds=seeds,
        )
    progress.close()
    del policy
    answers = [texts[i * n : (i + 1) * n] for i in range(len(prompts))]
    write_samples(out_dir, rows, prompts, answers, columns)
    kept.unlink()  # the samples are whole
    distinct = sum(len(set(drawn)) > 1 for drawn in answers)
    metrics = {
        "pairs/samples/prompts": float(len(prompts)),
        "pairs/samples/answers": float(len(flat)),
        "pairs/samples/prompts_with_distinct_answers": float(distinct),
        "pairs/samples/cut_by_budget": float(sum(cut)),
        "pairs/samples/seconds": time.monotonic() - started,
    }
    if log_metrics is not None:
        log_metrics(metrics, 0)
    return metrics


def write_samples(out_dir: Path, rows: list[int], prompts: list, answers: list[list[str]], columns: dict) -> None:
    """The samples file: per chosen prompt its row, the prompt, its answers and the prompt row's other columns."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / SAMPLES, "w", encoding="utf-8") as f:
        for i, (row, prompt, drawn) in enumerate(zip(rows, prompts, answers)):
            other = {name: values[i] for name, values in columns.items()}
            f.write(json.dumps({"id": row, "prompt": prompt, "completions": drawn, **other}, ensure_ascii=False) + "\n")


def answer_seed(seed: int, round_: int, row: int, k: int) -> int:
    """The seed of the `k`-th answer to the prompt at `row` of the prompts split, in round `round_`."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{round_}:{row}:{k}".encode()).digest()[:8], "big")


def read_samples(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / SAMPLES).read_text(encoding="utf-8").splitlines() if line]


def pair_hash(pair: dict) -> str:
    """A shown pair's content hash (its prompt and answers A and B): what binds a label to the pair it was given for."""
    content = json.dumps([pair["prompt"], pair["a"], pair["b"]], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(content.encode()).hexdigest()[:12]


def people_pairs(samples: list[dict], max_pairs: int) -> list[dict]:
    """The pairs people see: per prompt, its first two distinct answers that are not blank (A, B); prompts without two
    are left out; at most `max_pairs`."""
    shown = []
    for row in samples:
        distinct = [answer for answer in dict.fromkeys(row["completions"]) if answer.strip()]
        if len(distinct) >= 2:
            pair = {"pair": len(shown), "id": row["id"], "prompt": row["prompt"], "a": distinct[0], "b": distinct[1]}
            shown.append({**pair, "hash": pair_hash(pair)})
        if len(shown) == max_pairs:
            break
    return shown


# --- 2. labelled pairs ---------------------------------------------------------------------------------------------


def label(
    cfg: PairsConfig,
    samples_dir: Path,
    data_dir: Path,
    out_dir: Path,
    round_: int = 0,
    reward_model: Path | None = None,
    labels: dict[int, str] | None = None,
    earlier: Path | None = None,
    log_metrics: LogMetrics | None = None,
    aggregate: str = "mean",
    check: Callable[[Any, str], None] | None = None,
) -> dict[str, float]:
    """Label the samples in `samples_dir` with the block's labeller (`labels`: people's, pair id -> A/B/tie) and
    publish the pairs into `out_dir`; `earlier`: a previous round's pairs artifact, whose pairs are kept beside these.
    `check(dataset, source)` (the task passes the data stage's preference rules) runs before anything is written."""
    samples = read_samples(samples_dir)
    if cfg.labeller == "people":
        made, counts, extra = _people(people_pairs(samples, cfg.people.max_pairs), labels or {})
    else:
        made, counts, extra = _scored(cfg, samples, reward_model, aggregate)
    for pair in made:
        pair.update(labeller=cfg.labeller, round=round_)
    before = read_pairs(earlier) if earlier is not None else []
    every = before + made
    if not every:
        raise ValueError(
            f"pairs: the labeller ({cfg.labeller}) kept no pair of the {len(samples)} prompts sampled "
            f"({', '.join(f'{v} {k}' for k, v in counts.items())}): nothing to train on (sample more prompts or "
            "answers, or lower pairs.min_margin)"
        )
    extra |= agreement(cfg, data_dir, reward_model, aggregate)
    training = _training_set(cfg, every, data_dir)
    if check is not None:
        check(training, f"pairs made from {samples_dir / SAMPLES}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "datasets").mkdir(exist_ok=True)
    training.to_parquet(str(out_dir / "datasets" / "preference.parquet"))
    with open(out_dir / PAIRS, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(pair, ensure_ascii=False) + "\n" for pair in every)
    margins = [pair["margin"] for pair in made]
    metrics = {
        "pairs/made": float(len(made)),
        "pairs/prompts": float(len(samples)),
        **{f"pairs/dropped/{name}": float(value) for name, value in counts.items()},
        "pairs/margin_mean": float(sum(margins) / len(margins)) if margins else 0.0,
        "pairs/train_rows": float(len(training)),
        **({"pairs/earlier_rounds": float(len(before))} if earlier is not None else {}),
        **extra,
    }
    (out_dir / SUMMARY).write_text(
        json.dumps({"labeller": cfg.labeller, "round": round_, "metrics": metrics}, indent=2) + "\n"
    )
    if log_metrics is not None:
        log_metrics(metrics, 0)
    return metrics


def summary(metrics: dict[str, float], labeller: str) -> str:
    """The line people read about a labelling: pairs kept, dropped and why, rows trained on."""
    dropped = ", ".join(
        f"{value:.0f} {name.removeprefix('pairs/dropped/').replace('_', ' ')}"
        for name, value in metrics.items()
        if name.startswith("pairs/dropped/")
    )
    return (
        f"pairs: {metrics.get('pairs/made', 0):.0f} pairs from {metrics.get('pairs/prompts', 0):.0f} prompts labelled "
        f"by {labeller} (dropped: {dropped}); the pair-reading stages train on {metrics.get('pairs/train_rows', 0):.0f}"
    )


def agreement(cfg: PairsConfig, data_dir: Path, reward_model: Path | None, aggregate: str) -> dict[str, float]:
    """How often the labeller prefers the held-out pairs' chosen answer (`preference_eval`; a tie counts half), with
    its 95% bootstrap interval; {} without held-out pairs, for people, or for a function that needs columns the
    held-out pairs lack (e.g. a verifier's reference answer)."""
    path = data_dir / "datasets" / "preference_eval.parquet"
    if cfg.labeller == "people" or not path.is_file():
        return {}
    from datasets import Dataset

    from rlhf_pipeline.trainers.rewards.metrics import bootstrap_mean

    held = Dataset.from_parquet(str(path))
    if "prompt" not in held.column_names:
        return {}
    prompts, chosen, rejected = held["prompt"], held["chosen"], held["rejected"]
    columns = {k: held[k] for k in held.column_names if k not in ("prompt", "chosen", "rejected")}
    if cfg.labeller == "judge":
        from rlhf_pipeline.trainers.rewards.judges import load_judge

        judge = load_judge(cfg.judge)
        forward, backward = judge(prompts, chosen, rejected), judge(prompts, rejected, chosen)
        agree = [
            1.0 if p > 0.5 else 0.5 if p == 0.5 else 0.0 for p in ((f + 1 - b) / 2 for f, b in zip(forward, backward))
        ]
    else:
        if cfg.labeller == "function":
            from rlhf_pipeline.trainers.rewards.mix import import_function

            fn = import_function(cfg.function, "pairs.function")
            try:
                good = fn(prompts=prompts, completions=chosen, **columns)
                bad = fn(prompts=prompts, completions=rejected, **columns)
            except TypeError:  # it needs a column the held-out pairs do not have
                return {}
        else:
            import torch

            from rlhf_pipeline.trainers.rewards.ensemble import TextEnsemble, scoring_dirs

            device = "cuda" if torch.cuda.is_available() else "cpu"
            scorer = TextEnsemble(scoring_dirs(Path(reward_model)), how=aggregate, device=device)
            good, bad = scorer(prompts, chosen), scorer(prompts, rejected)
        agree = [0.5 if g is None or b is None or g == b else float(g > b) for g, b in zip(good, bad)]
    interval = bootstrap_mean(agree)
    return {
        "pairs/labeller_agreement": interval.mean,
        "pairs/labeller_agreement_low": interval.low,
        "pairs/labeller_agreement_high": interval.high,
        "pairs/labeller_agreement_pairs": float(len(agree)),
    }


def read_pairs(folder: Path) -> list[dict]:
    path = folder / PAIRS
    return (
        [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line] if path.is_file() else []
    )


def _scored(cfg: PairsConfig, samples: list[dict], reward_model: Path | None, aggregate: str):
    """Best vs worst of each prompt's answers, by a score per answer (function, reward model) or by wins in every
    pairing (judge)."""
    counts = {"ties": 0, "all_equal": 0, "unscored": 0}
    extra: dict[str, float] = {}
    if cfg.labeller == "judge":
        wins, extra = _judge_wins(cfg.judge, samples)
    else:
        wins = _scores(cfg, samples, reward_model, aggregate)
    made, blank = [], 0  # a blank answer is never chosen or rejected: the preference rules refuse blank text
    for row, scores in zip(samples, wins):
        answers = row["completions"]
        if len(set(answers)) < 2:
            counts["all_equal"] += 1
            continue
        blank += sum(not a.strip() for a in answers)
        scored = [(s, a) for s, a in zip(scores, answers) if s is not None and math.isfinite(s) and a.strip()]
        if len(scored) < 2:
            counts["unscored"] += 1
            continue
        best = max(scored, key=lambda item: item[0])
        worst = min(scored, key=lambda item: item[0])
        margin = best[0] - worst[0]
        if margin <= cfg.min_margin or best[1] == worst[1]:
            counts["ties"] += 1
            continue
        made.append(
            {
                "prompt": row["prompt"],
                "chosen": _reply(row["prompt"], best[1]),
                "rejected": _reply(row["prompt"], worst[1]),
                "margin": margin,
                "id": row["id"],
            }
        )
    extra["pairs/blank_answers"] = float(blank)
    return made, counts, extra


def _scores(cfg: PairsConfig, samples: list[dict], reward_model: Path | None, aggregate: str) -> list[list]:
    """One score per answer: the reward function's (with the prompt's other columns) or the reward model's."""
    from rlhf_pipeline.trainers.rewards.mix import as_completions

    flat_prompts = [row["prompt"] for row in samples for _ in row["completions"]]
    flat = as_completions(flat_prompts, [a for row in samples for a in row["completions"]])
    if cfg.labeller == "function":
        from rlhf_pipeline.trainers.rewards.mix import import_function

        names = [k for k in samples[0] if k not in ("id", "prompt", "completions")] if samples else []
        columns = {k: [row[k] for row in samples for _ in row["completions"]] for k in names}
        fn = import_function(cfg.function, "pairs.function")
        try:
            got = fn(prompts=flat_prompts, completions=flat, **columns)
        except Exception as exc:
            raise ValueError(
                f"pairs.function {cfg.function!r} raised on the {len(flat)} sampled answers: {type(exc).__name__}: "
                f"{exc} (it is given the prompts dataset's columns {names})"
            ) from exc
        if not isinstance(got, (list, tuple)) or len(got) != len(flat):
            raise ValueError(
                f"pairs.function {cfg.function!r} returned {len(got) if isinstance(got, (list, tuple)) else type(got)} "
                f"scores for {len(flat)} answers: one float (or None) per answer"
            )
        values = [None if s is None else float(s) for s in got]
    else:
        if reward_model is None:
            raise ValueError("pairs.labeller=reward_model: the run has no rm stage to label with")
        import torch

        from rlhf_pipeline.trainers.rewards.ensemble import TextEnsemble, scoring_dirs

        device = "cuda" if torch.cuda.is_available() else "cpu"
        values = TextEnsemble(scoring_dirs(Path(reward_model)), how=aggregate, device=device)(flat_prompts, flat)
    out, at = [], 0
    for row in samples:
        out.append(values[at : at + len(row["completions"])])
        at += len(row["completions"])
    return out


def _judge_wins(judge_cfg: JudgeConfig, samples: list[dict]) -> tuple[list[list[float]], dict[str, float]]:
    """Every two distinct answers of a prompt judged in both orders; an answer's score is its mean probability of
    winning. The judge's position bias: how often it prefers the first answer shown (0.5: none)."""
    from rlhf_pipeline.trainers.rewards.judges import load_judge

    judge = load_judge(judge_cfg)
    index, prompts, a, b = [], [], [], []
    for r, row in enumerate(samples):
        answers = row["completions"]
        for i in range(len(answers)):
            for j in range(i + 1, len(answers)):
                if answers[i] != answers[j]:
                    index.append((r, i, j))
                    prompts.append(row["prompt"])
                    a.append(_reply(row["prompt"], answers[i]))
                    b.append(_reply(row["prompt"], answers[j]))
    forward = judge(prompts, a, b) if prompts else []
    backward = judge(prompts, b, a) if prompts else []
    totals = [[0.0] * len(row["completions"]) for row in samples]
    games = [[0] * len(row["completions"]) for row in samples]
    for (r, i, j), p_ab, p_ba in zip(index, forward, backward):
        p = (p_ab + 1.0 - p_ba) / 2  # i beats j, both orders averaged
        totals[r][i] += p
        totals[r][j] += 1.0 - p
        games[r][i] += 1
        games[r][j] += 1
    scores = [[t / g if g else None for t, g in zip(ts, gs)] for ts, gs in zip(totals, games)]
    first = [*forward, *backward]
    extra = {
        "pairs/judge/first_position_rate": float(sum(first) / len(first)) if first else 0.5,
        "pairs/judge/inconsistent": float(
            sum((p_ab > 0.5) == (p_ba > 0.5) for p_ab, p_ba in zip(forward, backward)) / len(forward)
        )
        if forward
        else 0.0,
    }
    return scores, extra


def _people(shown: list[dict], labels: dict[int, str]):
    """People's labels on the pairs they were shown (`people_pairs`): A or B is chosen (margin 1), a tie or no label
    drops the pair."""
    counts = {"ties": 0, "unlabelled": 0}
    made = []
    for pair in shown:
        given = labels.get(pair["pair"])
        if given is None:
            counts["unlabelled"] += 1
        elif given == "tie":
            counts["ties"] += 1
        else:
            better, worse = (pair["a"], pair["b"]) if given == "A" else (pair["b"], pair["a"])
            made.append(
                {
                    "prompt": pair["prompt"],
                    "chosen": _reply(pair["prompt"], better),
                    "rejected": _reply(pair["prompt"], worse),
                    "margin": 1.0,
                    "id": pair["id"],
                    "pair": pair["pair"],
                }
            )
    return made, counts, {"pairs/people/labelled": float(len(shown) - counts["unlabelled"])}


def _reply(prompt, text: str):
    """An answer as the preference format has it: the text, or an assistant message for a conversational prompt."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


def _training_set(cfg: PairsConfig, pairs: list[dict], data_dir: Path):
    """prompt/chosen/rejected rows: the made pairs, and the given ones after them with train_on=both."""
    from datasets import Dataset, concatenate_datasets

    made = Dataset.from_list([{k: pair[k] for k in ("prompt", "chosen", "rejected")} for pair in pairs])
    given_path = data_dir / "datasets" / "preference.parquet"
    if cfg.train_on != "both":
        return made
    if not given_path.is_file():
        raise ValueError("pairs.train_on=both trains on the given pairs too, and data.preference is null: name it")
    given = Dataset.from_parquet(str(given_path))
    if "prompt" not in given.column_names:
        raise ValueError(
            f"pairs.train_on=both: the given preference data has no prompt column ({given.column_names}); made pairs "
            "have one: give it a prompt column or train on the made pairs alone"
        )
    given = given.select_columns(["prompt", "chosen", "rejected"])
    try:
        return concatenate_datasets([made.cast(given.features), given])
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"pairs.train_on=both: the made pairs ({made.features}) and the given ones ({given.features}) are not the "
            f"same format (conversational vs standard?): {exc}"
        ) from exc
