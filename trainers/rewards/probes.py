"""Overoptimisation curves of the online stages (Gao et al. 2022) and the policy they keep.

Every `eval_steps` the policy answers a fixed sample of the held-out prompts: the last `eval_prompts` rows of
`prompts_eval` (`probe_rows`). Where the stage keeps the best probe's policy, it chose on those rows, so `training.json`
names them (`chosen_on_rows`) and the eval stage scores every model on the other rows (a model chosen on a test set
looks better on it than it is):
- proxy_reward: the reward the policy optimises (the reward model, or the ensemble's aggregate), on its greedy answers;
- disagreement: the reward-model members' standard deviation on those answers (0 with one reward model);
- gold: eval's `gold_metric` on the greedy answers, where one is set (a verifier: IFEval's checkers), else
- exact_match: against the reference answers, where the prompts have them;
- kl, sqrt_kl: KL(policy || SFT) on policy samples (k1, nats per answer), the x axis of Gao et al.'s curves.
They are logged as `<stage>/heldout/<name>` curves and appended to `heldout.jsonl` (the eval stage plots them). With
`keep_best`, the stage publishes the policy of the probe with the best `score`, and says which: the held-out gold
metric (eval's `gold_metric`, else exact match where the prompts have reference answers: the training reward alone
never chooses), else proxy_reward - disagreement.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from rlhf_pipeline.trainers.config import StageConfig
from rlhf_pipeline.trainers.models.load import trainable

if TYPE_CHECKING:
    from rlhf_pipeline.trainers.rewards.mix import GoldMetric, RewardsConfig

CURVES = "heldout.jsonl"
BEST = "best-policy"


class ProbeFields(StageConfig):
    eval_steps: int | None = Field(
        None,
        ge=1,
        description=(
            "Steps (ppo: updates) between held-out probes: proxy reward, ensemble disagreement, exact match, KL to "
            "SFT, logged as <stage>/heldout/* curves. None: no probes."
        ),
    )
    eval_prompts: int = Field(
        200,
        ge=1,
        description=(
            "Held-out prompts each probe answers: the last of prompts_eval, half of them at most (with keep_best, "
            "eval scores the others)."
        ),
    )
    keep_best: bool | None = Field(
        None,
        description=(
            "With eval_steps: publish the policy of the probe with the best held-out gold metric (eval.gold_metric, "
            "else exact match where the prompts have answers), else the best proxy_reward - disagreement, not the "
            "last one. None: when the probes score a gold metric, or a reward-model ensemble measures the "
            "disagreement (with one reward model and no gold metric the best proxy is the most over-optimised)."
        ),
    )

    @property
    def evaluates(self) -> bool:
        return self.eval_steps is not None

    def held_out(self) -> tuple[str, ...]:
        """The held-out prompts the probes answer: a dataset the stage reads (and keys on) only with eval_steps."""
        return ("prompts_eval",) if self.evaluates else ()


def probe_rows(available: int, wanted: int) -> tuple[int, int]:
    """The [start, end) rows of `prompts_eval` the probes answer: the last `wanted` of them, and never more than half,
    so that eval keeps rows a kept probe was not chosen on."""
    return available - min(wanted, max(available // 2, 1)), available


class Probe:
    """The held-out sample, the reward model(s) and the reference (SFT) model, loaded once; `probe(policy)` measures."""

    def __init__(
        self,
        stage: str,
        data_dir: Path,
        sft_model: Path,
        reward_model: Path | None,
        rewards: RewardsConfig,
        cfg: ProbeFields,
        max_new_tokens: int,
        device,
        reference=None,
        gold: GoldMetric | None = None,
    ):
        from rlhf_pipeline.trainers.data import load_split
        from rlhf_pipeline.trainers.models.load import load_causal_lm, load_tokenizer
        from rlhf_pipeline.trainers.rewards.ensemble import TextEnsemble, member_dirs, scoring_dirs

        rows = load_split(data_dir, "prompts_eval")
        self.rows = probe_rows(len(rows), cfg.eval_prompts)
        rows = rows.select(range(*self.rows))
        self.stage, self.prompts, self.max_new_tokens = stage, rows["prompt"], max_new_tokens
        self.answers = rows["answer"] if "answer" in rows.column_names else None
        self.gold = None
        if gold is not None and gold.function is not None:  # imported and tried on the prompts before training
            from rlhf_pipeline.trainers.rewards.mix import as_completions, check_function, load_function

            self.gold = load_function(gold.function)
            self.columns = {name: rows[name] for name in rows.column_names if name != "prompt"}
            check_function(
                gold.function, self.gold, self.prompts, as_completions(self.prompts, [""] * len(rows)), self.columns
            )
        self.tokenizer = load_tokenizer(sft_model)
        # `reference`: a callable giving a context in which the policy is its own reference (LoRA), else the SFT model
        # is loaded.
        self.reference_context = reference
        self.reference = (
            None if reference is not None else load_causal_lm(sft_model)[0].to(device).eval().requires_grad_(False)
        )
        self.proxy = self.members = None
        if reward_model is not None and rewards.uses_reward_model:
            served, every = scoring_dirs(reward_model), member_dirs(reward_model)
            self.proxy = TextEnsemble(served, rewards.reward_model_aggregate, rewards.reward_model_std_coef, device)
            self.members = self.proxy if served == every else TextEnsemble(every, device=device)

    def __call__(self, policy, seed: int = 0) -> dict[str, float]:
        import contextlib
        import statistics

        import torch

        from rlhf_pipeline.trainers.models.text import generate
        from rlhf_pipeline.trainers.rewards import metrics as stats
        from rlhf_pipeline.trainers.rewards.mix import gold_scores

        was_training = policy.training
        policy.eval()
        with torch.no_grad():
            greedy = generate(policy, self.tokenizer, self.prompts, self.max_new_tokens, batch_size=200)
            state = torch.get_rng_state()
            torch.manual_seed(seed)  # the same draws at every probe; the training's own stream is left as it was
            sampled = generate(policy, self.tokenizer, self.prompts, self.max_new_tokens, batch_size=200, sample=True)
            torch.set_rng_state(state)
            logps = stats.sequence_logprobs(policy, self.tokenizer, self.prompts, sampled, 200)
            with self.reference_context() if self.reference_context else contextlib.nullcontext():
                ref_logps = stats.sequence_logprobs(
                    self.reference or policy, self.tokenizer, self.prompts, sampled, 200
                )
        policy.train(was_training)
        kl = stats.kl_to_reference(logps, ref_logps)
        values = {"kl": kl, "sqrt_kl": max(kl, 0.0) ** 0.5}
        if self.answers is not None:
            values["exact_match"] = statistics.fmean(
                float(c.strip() == str(a).strip()) for c, a in zip(greedy, self.answers)
            )
        if self.proxy is not None:
            proxy, _ = self.proxy.score(self.prompts, greedy)
            _, spread = self.members.score(self.prompts, greedy)
            values |= {"proxy_reward": statistics.fmean(proxy), "disagreement": statistics.fmean(spread)}
            values["score"] = values["proxy_reward"] - values["disagreement"]
        if self.gold is not None:
            values["gold"] = statistics.fmean(gold_scores(self.gold, self.prompts, greedy, self.columns))
        gold = "gold" if "gold" in values else "exact_match" if "exact_match" in values else None
        if gold is not None:  # the gold metric, where there is one, chooses the kept policy
            values["score"] = values[gold]
        return values


class Keeper:
    """The curves file and the best probe's policy weights, in the stage's working folder (so a resumed run keeps
    both)."""

    def __init__(self, work_dir: Path, keep_best: bool | None, reward_model: Path | None = None):
        from rlhf_pipeline.trainers.rewards.ensemble import member_dirs

        # None: on when the probes score a held-out gold metric (decided at the first probe) or the members of an
        # ensemble can disagree; with one reward model and no gold metric the best proxy is the most over-optimised.
        ensemble = reward_model is not None and len(member_dirs(reward_model)) > 1
        self.work_dir, self.keep_best = work_dir, True if keep_best is None and ensemble else keep_best
        self.curves, self.best = work_dir / CURVES, work_dir / BEST

    def resume(self, step: int) -> None:
        """Forget probes after `step` (the checkpoint resumed from): they are measured again."""
        if self.curves.is_file():
            kept = [line for line in self.curves.read_text().splitlines() if json.loads(line)["step"] <= step]
            self.curves.write_text("".join(line + "\n" for line in kept))
        if self.best_step() is not None and self.best_step() > step:
            import shutil

            shutil.rmtree(self.best, ignore_errors=True)

    def best_step(self) -> int | None:
        path = self.best / "best.json"
        return json.loads(path.read_text())["step"] if path.is_file() else None

    def best_score(self) -> float | None:
        path = self.best / "best.json"
        return json.loads(path.read_text())["score"] if path.is_file() else None

    def record(self, step: int, values: dict[str, float], policy) -> None:
        """Append the probe; with keep_best and a better score than the best so far, keep the policy's trained
        weights."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        with self.curves.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self.keep_best is None:
            self.keep_best = "gold" in values or "exact_match" in values
        score, best = values.get("score"), self.best_score()
        if not self.keep_best or score is None or (best is not None and score <= best):
            return
        import shutil

        from safetensors.torch import save_file

        tmp = self.work_dir / f".{BEST}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(trainable(policy), tmp / "policy.safetensors")
        (tmp / "best.json").write_text(json.dumps({"step": step, "score": score}))
        shutil.rmtree(self.best, ignore_errors=True)
        os.replace(tmp, self.best)

    def restore(self, policy, last_step: int) -> dict:
        """Load the best probe's weights into `policy` unless it is the last step's; what was kept, for
        training.json."""
        step = self.best_step()
        if not self.keep_best or step is None:
            return {}
        if step != last_step:
            from safetensors.torch import load_file

            policy.load_state_dict(load_file(self.best / "policy.safetensors"), strict=False)
        return {"kept_step": step, "kept_score": self.best_score()}

    def publish(self, out_dir: Path) -> None:
        if self.curves.is_file():
            import shutil

            out_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.curves, out_dir / CURVES)


def probe_callback(stage: str, cfg: ProbeFields, probe_args: dict, work_dir: Path, log_metrics):
    """GRPO's and RLOO's probes: a TrainerCallback probing every `eval_steps` steps on rank 0, and at the end of
    training putting the best probe's weights back into the model the stage then saves (`kept`: what was kept, for
    training.json)."""
    from transformers import TrainerCallback

    class ProbeCallback(TrainerCallback):
        kept: dict = {}

        def __init__(self):
            self.keeper, self.probe = (
                Keeper(
                    work_dir,
                    cfg.keep_best,
                    probe_args["reward_model"] if probe_args["rewards"].uses_reward_model else None,
                ),
                None,
            )

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if state.is_world_process_zero:
                self.keeper.resume(state.global_step)
                reference = None
                if hasattr(model, "disable_adapter"):  # LoRA: the SFT model is the policy with its adapters off
                    reference = model.disable_adapter
                self.probe = Probe(stage, **probe_args, cfg=cfg, device=model.device, reference=reference)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = state.global_step
            if self.probe is None or not (step % cfg.eval_steps == 0 or step == state.max_steps):
                return
            values = self.probe(model, seed=args.seed)
            self.keeper.record(step, values, model)
            if log_metrics is not None:
                log_metrics({f"{stage}/heldout/{name}": value for name, value in values.items()}, step)

        def on_train_end(self, args, state, control, model=None, **kwargs):
            if self.probe is not None:
                self.kept = self.keeper.restore(model, state.global_step)
                if self.kept:
                    self.kept["chosen_on_rows"] = list(self.probe.rows)

    return ProbeCallback()
