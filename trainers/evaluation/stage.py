"""Held-out evaluation of base, SFT, the policy (and the champion): with reference answers or without.

Greedy decoding on the held-out prompts (`prompts_eval`). What is measured depends
on what the run has, and `planned_metrics` says so before anything trains:
- always: KL(policy || SFT) on policy samples, answer length and its drift from
  SFT, diversity, perplexity on SFT rows, the samples table, and the hacking
  warnings that need no gold metric (length drift, KL);
- a reward model: each model's mean reward, the policy's win rate against SFT and
  the champion with 95% intervals, pairwise accuracy on `preference_eval`;
- a gold metric: exact match against a reference column (`answer_column`, when
  the held-out prompts have it), or a reward function named as `gold_metric`
  (a verifier); then the warning "reward rose while the gold metric fell".
The reward model scores text exactly as TRL's RewardTrainer formats it (prompt +
completion + EOS, or the chat template), so its scores mean what they meant in training.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import Field

from rlhf_pipeline.trainers.config import AttentionField, ModelConfig
from rlhf_pipeline.trainers.evaluation.answers import answering, greedy_answers
from rlhf_pipeline.trainers.evaluation.instructions import InstructionFollowing
from rlhf_pipeline.trainers.models.text import generate, reward_scores
from rlhf_pipeline.trainers.rewards.judges import JudgeConfig
from rlhf_pipeline.trainers.rewards.mix import RewardFunctionSpec, as_completions, gold_scores
from rlhf_pipeline.trainers.runtime.stopping import stoppable

MODELS = ("base", "sft", "policy", "champion")
HELDOUT = "eval/heldout/"


class EvalConfig(AttentionField):
    max_new_tokens: int = Field(64, ge=1, description="Longest generated answer.")
    batch_size: int = Field(64, ge=1, description="Prompts answered at once (the decoding loop's rows).")
    dtype: Literal["float32", "bfloat16", "fast"] | None = Field(
        None,
        description=(
            "Precision every model computes in here (answers, samples, log-probs), the same for all of them; None: as "
            "saved; fast: bfloat16 where the machine multiplies it natively (CUDA, a CPU with AVX512-BF16 or AMX), "
            "else float32. bfloat16 halves the weights read at each generated token: greedy answers came faster on a "
            "CPU with AVX512-BF16 and several times slower on one with AVX2 alone (docs/PERFORMANCE.md), and "
            "differ from float32's in their later tokens."
        ),
    )
    max_prompts: int | None = Field(None, ge=1, description="Evaluate only the first N held-out prompts; None: all.")
    answer_column: str | None = Field(
        "answer",
        description=(
            "Reference column of the held-out prompts: exact match is reported when they have it (most chat data has "
            "none); None: never."
        ),
    )
    gold_metric: RewardFunctionSpec | None = Field(
        None,
        description=(
            "A reward function ('module:function', TRL's signature) used as the gold metric instead of exact match, "
            "e.g. a verifier; reported as `<model>_gold` with intervals."
        ),
    )
    max_length_drift: float = Field(
        0.5, gt=0, description="Warn when the policy's mean answer length moves more than this share from SFT's."
    )
    max_kl: float = Field(
        5.0, gt=0, description="Warn when KL(policy || SFT) on policy samples exceeds this (nats per answer)."
    )
    perplexity_rows: int = Field(200, ge=0, description="SFT rows on which perplexity is measured; 0 to skip.")
    n_bootstrap: int = Field(1000, ge=100, description="Bootstrap resamples of the 95% intervals.")
    seed: int = Field(0, description="Seed of the policy samples (KL, diversity) and of the bootstrap.")
    use_reward_model: bool = Field(
        True, description="Score answers and held-out pairs with the rm stage's model (trains it even for dpo)."
    )
    num_samples_logged: int = Field(50, ge=0, description="Rows of the samples table (prompt, answers, rewards).")
    instruction_following: InstructionFollowing | None = Field(
        None,
        description=(
            "IFEval's strict prompt- and instruction-level accuracy, per constraint family, on the held-out prompts "
            "(rows with instruction_id_list/kwargs) and on IFBench's test prompts; None: not measured."
        ),
    )
    judge: JudgeConfig | None = Field(
        None,
        description=(
            "A pairwise judge (a function 'module:function' or a local causal LM): the policy's win rate against SFT "
            "and the champion, each pair judged in both orders (`judge_win_rate_vs_<rival>`, with position bias); "
            "None: no judge."
        ),
    )

    def code_paths(self) -> list[str]:
        """Import paths whose source keys the eval stage (the gold metric, a function judge)."""
        return [
            *([self.gold_metric.path] if self.gold_metric else []),
            *([self.judge.path] if self.judge and self.judge.is_function else []),
        ]


def planned_metrics(
    cfg: EvalConfig,
    *,
    has_reference: bool,
    reward_model: bool,
    champion: bool = True,
    preference_eval: bool = True,
    ensemble: int = 1,
    sft_trained: bool = True,
    demonstrations: bool = True,
) -> set[str]:
    """The metric names `evaluate` returns for a run with these inputs (`_low`/`_high` bounds included), so a
    gate metric the run cannot produce fails when the parameters are checked, not after the training."""
    names = {
        f"{HELDOUT}{n}"
        for n in (
            "num_prompts",
            "num_left_out",  # rows the policy stage chose its kept probe on (`chosen_on_rows`)
            "kl_to_sft",
            "policy_distinct_2",
            "policy_mean_length",
            "length_drift",
            "hacking_warnings",
        )
    }
    if cfg.perplexity_rows and demonstrations:
        names |= {"eval/sft_split/sft_perplexity", "eval/sft_split/policy_perplexity"}
    # With sft switched off the starting policy is the base model: one row ("sft"), not two identical ones.
    models = [m for m in MODELS if (champion or m != "champion") and (sft_trained or m != "base")]
    rivals = [m for m in ("sft", "champion") if m in models]

    def bounded(name: str) -> set[str]:
        return {f"{HELDOUT}{name}", f"{HELDOUT}{name}_low", f"{HELDOUT}{name}_high"}

    gold = "gold" if cfg.gold_metric is not None else "exact_match" if has_reference and cfg.answer_column else None
    if gold:
        names |= {n for m in models for n in bounded(f"{m}_{gold}")} | bounded(f"{gold}_gain_vs_sft")
        if champion:
            names |= bounded(f"{gold}_gain_vs_champion")
    if reward_model:
        names |= {f"{HELDOUT}{m}_mean_reward" for m in models if m != "base"}
        names |= {n for rival in rivals for n in bounded(f"win_rate_vs_{rival}")}
        if preference_eval:
            names.add(f"{HELDOUT}rm_pairwise_accuracy")
        if ensemble > 1:  # each member's accuracy, and how far the members disagree on each model's answers
            names |= {f"{HELDOUT}{m}_rm_disagreement" for m in models if m != "base"}
            names |= (
                {f"{HELDOUT}rm_member_{i}_pairwise_accuracy" for i in range(ensemble)} if preference_eval else set()
            )
    if cfg.instruction_following is not None:
        from rlhf_pipeline.trainers.evaluation.instructions import planned

        names |= planned(cfg.instruction_following, [m for m in models if m != "base"])
    if cfg.judge is not None:
        for rival in rivals:
            name = f"judge_win_rate_vs_{rival}"
            names |= bounded(name) | {f"{HELDOUT}{name}_position_bias", f"{HELDOUT}{name}_order_disagreement"}
    return names


def _exact(completions: list[str], answers: list[str]) -> list[float]:
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers)]


@stoppable("eval")
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
    sft_trained: bool = True,
) -> dict[str, float]:
    """Compare base, SFT, policy (and the registry's champion) on held-out prompts.

    Writes `summary.json`, `summary.md`, `samples.jsonl` and `plots/*.png` into
    `out_dir`; returns the metrics `planned_metrics` names, with `_low`/`_high`
    95% bootstrap bounds on the gold metric and the win rates.
    """
    from rlhf_pipeline.trainers.attention import check_device
    from rlhf_pipeline.trainers.evaluation.report import EvalResult, write_report
    from rlhf_pipeline.trainers.rewards import metrics as stats

    heldout = _heldout(cfg, data_dir, Path(policy_model), policy_stage)
    boot = {"n_bootstrap": cfg.n_bootstrap, "seed": cfg.seed}
    chosen_on = heldout.chosen_on
    metrics: dict[str, float] = {
        f"{HELDOUT}num_prompts": float(len(heldout.prompts)),
        f"{HELDOUT}num_left_out": float(chosen_on[1] - chosen_on[0]) if chosen_on else 0.0,
    }
    check_device(cfg.attn_implementation, training=False)  # before the first model loads
    loaders, twins = _loaders(cfg, base, sft_model, policy_model, champion_model, sft_trained)
    completions, cut = _answers(cfg, loaders, twins, heldout.prompts)
    gold_name, correct, accuracy = _gold(heldout, completions, boot, metrics)
    if cfg.instruction_following is not None:  # in distribution, then IFEval and IFBench (one model at a time)
        metrics.update(_instruction_following(cfg, heldout, completions, cut, loaders, twins, boot))
    kl, drift = _kl_and_length(cfg, loaders, heldout.prompts, completions, data_dir, metrics)
    rewards, win_rates, measured = _reward_model(
        cfg, reward_model, heldout.prompts, completions, data_dir, boot, policy_stage
    )
    metrics.update(measured)
    judged = _judge(cfg, heldout.prompts, completions, boot, policy_stage, metrics) if cfg.judge is not None else {}
    reward_delta = metrics.get(f"{HELDOUT}policy_mean_reward", 0.0) - metrics.get(f"{HELDOUT}sft_mean_reward", 0.0)
    task_delta = accuracy["policy"].mean - accuracy["sft"].mean if accuracy else None
    warnings = stats.hacking_warnings(
        reward_delta=reward_delta,
        task_delta=task_delta,
        length_drift=drift,
        kl=kl,
        max_length_drift=cfg.max_length_drift,
        max_kl=cfg.max_kl,
        task_name=(gold_name or "").replace("_", " "),
    )
    metrics[f"{HELDOUT}hacking_warnings"] = float(len(warnings))
    result = EvalResult(
        prompts=heldout.prompts,
        answers=heldout.answers,
        completions=completions,
        correct=correct,
        rewards=rewards,
        metrics=metrics,
        warnings=warnings,
        accuracy=accuracy,
        win_rates=win_rates,
        gold_name=gold_name,
        judged=judged,
    )
    write_report(out_dir, cfg.num_samples_logged, result)
    _overoptimisation_plot(Path(policy_model), out_dir, policy_stage)
    return metrics


@dataclass
class Heldout:
    """The held-out prompts eval scores (those the policy's stage did not choose its kept probe on), their reference
    answers and other columns, and the gold metric's function (checked on a sample)."""

    rows: Any
    prompts: list
    answers: list | None
    columns: dict[str, list]
    chosen_on: tuple[int, int] | None
    gold_fn: Callable | None


def _heldout(cfg: EvalConfig, data_dir: Path, policy_model: Path, policy_stage: str) -> Heldout:
    from rlhf_pipeline.trainers.data import load_split

    prompts_ds = load_split(data_dir, "prompts_eval")
    chosen_on = chosen_on_rows(policy_model)
    if chosen_on is not None:  # the rows the policy stage chose its kept probe on: every model is scored on the rest
        prompts_ds = prompts_ds.select([i for i in range(len(prompts_ds)) if not chosen_on[0] <= i < chosen_on[1]])
        if not len(prompts_ds):
            raise ValueError(
                f"the {policy_stage} stage chose the policy it kept (keep_best) on every held-out prompt (rows "
                f"{chosen_on[0]}-{chosen_on[1] - 1} of prompts_eval): none is left to score it on; give prompts_eval "
                "more rows"
            )
    if cfg.max_prompts:
        prompts_ds = prompts_ds.select(range(min(cfg.max_prompts, len(prompts_ds))))
    prompts = prompts_ds["prompt"]
    has_reference = cfg.answer_column is not None and cfg.answer_column in prompts_ds.column_names
    answers = prompts_ds[cfg.answer_column] if has_reference else None
    columns = {name: prompts_ds[name] for name in prompts_ds.column_names if name != "prompt"}
    gold_fn = None
    if cfg.gold_metric is not None:  # imported and tried on a sample before any model loads
        from rlhf_pipeline.trainers.rewards.mix import check_function, load_function

        gold_fn = load_function(cfg.gold_metric)
        sample = slice(0, min(4, len(prompts)))
        check_function(
            cfg.gold_metric,
            gold_fn,
            prompts[sample],
            as_completions(prompts[sample], ["0"] * len(prompts[sample])),
            {k: v[sample] for k, v in columns.items()},
        )
    return Heldout(prompts_ds, prompts, answers, columns, chosen_on, gold_fn)


def _loaders(cfg: EvalConfig, base: ModelConfig, sft_model, policy_model, champion_model, sft_trained: bool):
    """How to load each compared model (in `cfg.dtype`), and the models that are another's folder (`rlhf eval` of the
    start: policy and sft alike), which answer once."""
    import torch

    from rlhf_pipeline.trainers.models.base_model import load_base_model
    from rlhf_pipeline.trainers.models.decode import fast_dtype
    from rlhf_pipeline.trainers.models.load import load_causal_lm

    attention = cfg.attn_implementation

    def cast(load):
        def loaded():
            model, tokenizer = load()
            dtype = fast_dtype(cfg.dtype, str(model.device))
            return (model.to(getattr(torch, dtype)) if dtype else model), tokenizer

        return loaded

    loaders = {
        # else the "sft" row is the base model
        **({"base": cast(lambda: load_base_model(base, attn_implementation=attention))} if sft_trained else {}),
        "sft": cast(lambda: load_causal_lm(sft_model, attn_implementation=attention)),
        "policy": cast(lambda: load_causal_lm(policy_model, attn_implementation=attention)),
    }
    if champion_model is not None:
        loaders["champion"] = cast(lambda: load_causal_lm(champion_model, attn_implementation=attention))
    folders = {"sft": sft_model, "policy": policy_model, "champion": champion_model}
    twins = {
        name: first
        for name in ("policy", "champion")
        for first in ("sft", "policy")
        if first != name
        and folders[name] is not None
        and Path(folders[name]).resolve() == Path(folders[first]).resolve()
    }
    return loaders, twins


def _answers(cfg: EvalConfig, loaders: dict, twins: dict, prompts: list):
    """Each model's greedy answers to the held-out prompts and whether the budget cut them; one model in memory at a
    time."""
    completions: dict[str, list[str]] = {}
    cut: dict[str, list[bool]] = {}
    for name, load in loaders.items():
        if name in twins:
            completions[name], cut[name] = completions[twins[name]], cut[twins[name]]
            continue
        model, tokenizer = load()
        completions[name], cut[name] = greedy_answers(
            model, tokenizer, prompts, cfg.max_new_tokens, cfg.batch_size, **answering(f"held-out, {name}")
        )
        del model
    return completions, cut


def _gold(heldout: Heldout, completions: dict, boot: dict, metrics: dict) -> tuple[str | None, dict, dict]:
    """The gold metric, where there is one: a named function, else exact match against the reference; each model's
    accuracy and the policy's paired gains (intervals on the differences)."""
    from rlhf_pipeline.trainers.rewards import metrics as stats

    gold_name, correct = None, {}
    if heldout.gold_fn is not None:
        gold_name = "gold"
        correct = {
            name: gold_scores(heldout.gold_fn, heldout.prompts, c, heldout.columns) for name, c in completions.items()
        }
    elif heldout.answers is not None:
        gold_name = "exact_match"
        correct = {name: _exact(c, heldout.answers) for name, c in completions.items()}
    accuracy = {name: stats.bootstrap_mean(hits, **boot) for name, hits in correct.items()}
    for name, interval in accuracy.items():
        _put(metrics, f"{HELDOUT}{name}_{gold_name}", interval.mean, interval.low, interval.high)
    for rival in [name for name in ("sft", "champion") if name in correct]:
        gain = stats.bootstrap_mean([p - c for p, c in zip(correct["policy"], correct[rival])], **boot)
        _put(metrics, f"{HELDOUT}{gold_name}_gain_vs_{rival}", gain.mean, gain.low, gain.high)
    return gold_name, correct, accuracy


def _instruction_following(cfg: EvalConfig, heldout: Heldout, completions, cut, loaders, twins, boot) -> dict:
    """The checkers' verdicts in distribution (the held-out rows' own instructions), then on IFEval and IFBench."""
    from rlhf_pipeline.trainers.evaluation import instructions as ifeval_eval

    following, metrics = cfg.instruction_following, {}
    rated = {name: c for name, c in completions.items() if name != "base"}
    if following.heldout:
        missing = [c for c in ifeval_eval.COLUMNS if c not in heldout.rows.column_names]
        if missing:
            raise ValueError(
                f"eval.instruction_following.heldout: the held-out prompts have no {missing} columns to check "
                "the answers by (set heldout=false)"
            )
        metrics.update(ifeval_eval.score(HELDOUT, list(heldout.rows), rated, "ifeval", boot, cut))
    rated_loaders = {name: load for name, load in loaders.items() if name != "base"}
    scored, _ = ifeval_eval.evaluate_benchmarks(following, rated_loaders, cfg.batch_size, boot, twins)
    return metrics | scored


def _kl_and_length(cfg: EvalConfig, loaders, prompts: list, completions: dict, data_dir: Path, metrics: dict):
    """KL(policy || SFT) and diversity, on samples drawn from the policy (the k1 estimate needs them); the answers'
    length and its drift from SFT's; perplexity on SFT rows. Returns (KL, length drift)."""
    import torch

    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.rewards import metrics as stats

    policy, tokenizer = loaders["policy"]()
    reference, _ = loaders["sft"]()
    torch.manual_seed(cfg.seed)
    samples = generate(policy, tokenizer, prompts, cfg.max_new_tokens, cfg.batch_size, sample=True)
    policy_logps = stats.sequence_logprobs(policy, tokenizer, prompts, samples, cfg.batch_size)
    reference_logps = stats.sequence_logprobs(reference, tokenizer, prompts, samples, cfg.batch_size)
    kl = stats.kl_to_reference(policy_logps, reference_logps)
    metrics[f"{HELDOUT}kl_to_sft"] = kl
    metrics[f"{HELDOUT}policy_distinct_2"] = stats.distinct_n(samples, 2)
    metrics[f"{HELDOUT}policy_mean_length"] = stats.mean_length(completions["policy"])
    # SFT answers that are all empty (an untrained model stopping at once) count as one character long.
    drift = (
        stats.length_drift(completions["policy"], completions["sft"])
        if stats.mean_length(completions["sft"])
        else (stats.mean_length(completions["policy"]) or 1.0) - 1
    )
    metrics[f"{HELDOUT}length_drift"] = drift
    if cfg.perplexity_rows and (data_dir / "datasets" / "sft.parquet").is_file():
        rows = load_split(data_dir, "sft")
        rows = rows.select(range(min(cfg.perplexity_rows, len(rows))))
        texts = _sft_texts(rows)
        metrics["eval/sft_split/sft_perplexity"] = stats.perplexity(reference, tokenizer, texts, cfg.batch_size)
        metrics["eval/sft_split/policy_perplexity"] = stats.perplexity(policy, tokenizer, texts, cfg.batch_size)
    return kl, drift


def _reward_model(cfg: EvalConfig, reward_model, prompts: list, completions: dict, data_dir: Path, boot, stage: str):
    """Each model's rewards, the policy's win rates (by the reward model) and the reward model's pairwise accuracy on
    `preference_eval`, and its ensemble members' (their disagreement too). Returns (rewards, win rates, metrics)."""
    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.models.load import load_sequence_classifier, load_tokenizer
    from rlhf_pipeline.trainers.rewards import metrics as stats

    rewards: dict[str, list[float]] = {}
    metrics: dict[str, float] = {}
    win_rates: dict[str, stats.WinRate] = {}
    if reward_model is None:
        return rewards, win_rates, metrics
    rm = load_sequence_classifier(reward_model, attn_implementation=cfg.attn_implementation)
    rm_tokenizer = load_tokenizer(reward_model)
    for name in [n for n in completions if n != "base"]:
        rewards[name] = reward_scores(rm, rm_tokenizer, prompts, completions[name], cfg.batch_size)
        metrics[f"{HELDOUT}{name}_mean_reward"] = sum(rewards[name]) / len(rewards[name])
    for rival in [n for n in ("sft", "champion") if n in rewards]:
        win = stats.win_rate(rewards["policy"], rewards[rival], **boot)
        win_rates[f"{stage} vs {rival}"] = win
        _put(metrics, f"{HELDOUT}win_rate_vs_{rival}", win.rate, win.low, win.high)
    held_pairs = data_dir / "datasets" / "preference_eval.parquet"
    pairs = load_split(data_dir, "preference_eval") if held_pairs.is_file() else None
    if pairs is not None:
        metrics[f"{HELDOUT}rm_pairwise_accuracy"] = _pairwise_accuracy(rm, rm_tokenizer, pairs, cfg.batch_size)
    del rm
    metrics.update(_ensemble_members(cfg, reward_model, prompts, completions, pairs))
    return rewards, win_rates, metrics


def _ensemble_members(cfg: EvalConfig, reward_model: Path, prompts: list, completions: dict, pairs) -> dict:
    """An ensemble's members, one in memory at a time: each one's pairwise accuracy, and their disagreement on each
    model's answers."""
    from rlhf_pipeline.trainers.rewards.ensemble import TextEnsemble, aggregate, member_dirs

    metrics: dict[str, float] = {}
    member_rewards: dict[str, list[list[float]]] = {}
    if len(dirs := member_dirs(reward_model)) <= 1:
        return metrics
    for i, folder in enumerate(dirs):
        member = TextEnsemble([folder], batch_size=cfg.batch_size)
        if pairs is not None:
            metrics[f"{HELDOUT}rm_member_{i}_pairwise_accuracy"] = _pairwise_accuracy(
                member.models[0], member.tokenizer, pairs, cfg.batch_size
            )
        for name in [n for n in completions if n != "base"]:
            member_rewards.setdefault(name, []).append(member.members(prompts, completions[name])[0])
    for name, scores in member_rewards.items():
        spread = aggregate(scores, "mean")[1]
        metrics[f"{HELDOUT}{name}_rm_disagreement"] = sum(spread) / len(spread)
    return metrics


def _judge(cfg: EvalConfig, prompts: list, completions: dict, boot: dict, stage: str, metrics: dict) -> dict:
    """The pairwise judge's win rates of the policy (both orders), after the reward model is gone: an LM judge is one
    more model in memory."""
    from rlhf_pipeline.trainers.rewards.judges import judged_win_rate, load_judge

    judged = {}
    judge = load_judge(cfg.judge, sample=(prompts[:2], completions["policy"][:2], completions["sft"][:2]))
    for rival in [n for n in ("sft", "champion") if n in completions]:
        result = judged_win_rate(judge, prompts, completions["policy"], completions[rival], **boot)
        metrics.update(result.metrics(f"{HELDOUT}judge_win_rate_vs_{rival}"))
        judged[f"{stage} vs {rival}"] = result.win_rate
    return judged


def training_outcome(policy_model: Path) -> dict:
    """The policy stage's `training.json` (which probe it kept, the rows it chose on), {} when it wrote none."""
    import json

    from rlhf_pipeline.trainers.algorithms.loop import OUTCOME

    outcome = policy_model.parent / OUTCOME
    return json.loads(outcome.read_text()) if outcome.is_file() else {}


def chosen_on_rows(policy_model: Path) -> tuple[int, int] | None:
    """The [start, end) rows of `prompts_eval` on which the policy's stage chose the probe it kept (keep_best); None
    when nothing was chosen on held-out rows."""
    rows = training_outcome(policy_model).get("chosen_on_rows")
    return (int(rows[0]), int(rows[1])) if rows else None


def _overoptimisation_plot(policy_model: Path, out_dir: Path, stage: str) -> None:
    """The online stage's held-out probes (its `heldout.jsonl`, beside the policy), on Gao et al.'s axes."""
    import json

    from rlhf_pipeline.trainers.rewards.probes import CURVES

    path = policy_model.parent / CURVES
    if not path.is_file():
        return
    from rlhf_pipeline.trainers.evaluation import plots

    curves = [json.loads(line) for line in path.read_text().splitlines()]
    kept = training_outcome(policy_model).get("kept_step")
    plots.overoptimisation(curves, out_dir / "plots" / "overoptimisation.png", stage, kept)


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
        pair_prompts, chosen, rejected = pairs["prompt"], pairs["chosen"], pairs["rejected"]
    else:  # implicit prompt: the shared leading turns are the prompt, as TRL's extract_prompt splits them
        from trl.data_utils import extract_prompt

        split = [extract_prompt({"chosen": c, "rejected": r}) for c, r in zip(pairs["chosen"], pairs["rejected"])]
        pair_prompts, chosen, rejected = ([row[k] for row in split] for k in ("prompt", "chosen", "rejected"))
    chosen_scores = reward_scores(rm, tokenizer, pair_prompts, chosen, batch_size)
    rejected_scores = reward_scores(rm, tokenizer, pair_prompts, rejected, batch_size)
    return sum(c > r for c, r in zip(chosen_scores, rejected_scores)) / len(chosen_scores)
