"""Rewards for online RL (grpo, rloo, ppo): the trained reward model and/or Python functions, weighted.

A reward function follows TRL's GRPO convention, so the same function serves
every algorithm:

    def fn(prompts: list, completions: list, **columns) -> list[float | None]

`completions` are strings (standard prompts) or lists of messages
(conversational prompts); every extra dataset column (e.g. `answer`) arrives as
a keyword argument holding one value per completion.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

from pydantic import Field, field_validator, model_validator

from rlhf_pipeline.trainers.config import Block, StrictModel
from rlhf_pipeline.trainers.runtime.heartbeat import beat

if TYPE_CHECKING:
    import torch

RewardFunction = Callable[..., list]


class RewardFunctionSpec(StrictModel):
    path: str = Field(description="Import path 'package.module:function' of a reward function.")
    weight: float = Field(1.0, description="Weight of this function in the summed reward.")

    @field_validator("path")
    @classmethod
    def _importable(cls, path: str) -> str:
        """Imported and its signature checked with the parameters (it is called on a sample before training, too)."""
        import_function(path)
        return path


class RewardsConfig(Block):
    """Which rewards score the policy's samples, and how they are weighted."""

    reward_model_weight: float = Field(
        1.0, ge=0, description="Weight of the `rm` stage's reward model; 0 leaves it out (and skips training it)."
    )
    functions: list[RewardFunctionSpec] = Field(
        default_factory=list, description="Python reward functions, each with a weight."
    )
    reward_model_aggregate: Literal["mean", "min", "mean_minus_std"] = Field(
        "mean",
        description=(
            "How an ensemble's members (rm.ensemble_size > 1) make one reward: their mean, their minimum (worst case, "
            "Coste et al. 2023), or mean - reward_model_std_coef * std (uncertainty-weighted). One reward model: its "
            "score."
        ),
    )
    reward_model_std_coef: float = Field(
        1.0, ge=0, description="The std's weight in reward_model_aggregate='mean_minus_std'."
    )

    @model_validator(mode="after")
    def _some_reward(self):
        if self.reward_model_weight == 0 and not self.functions:
            raise ValueError(
                "rewards: reward_model_weight is 0 and no reward functions are given; the policy would learn nothing"
            )
        return self

    @property
    def uses_reward_model(self) -> bool:
        return self.reward_model_weight > 0

    def code_paths(self) -> list[str]:
        """Import paths whose source keys the stages these rewards score."""
        return [spec.path for spec in self.functions]


class GoldMetric(Block):
    """The held-out gold metric the online stages' probes score, and `keep_best` chooses by: eval's `gold_metric`
    (a function of prompts, completions and the held-out rows' columns, as eval calls it), else exact match against
    the reference answers. Derived from the `eval` block (`PipelineParams.gold`): it keys the online stages."""

    function: RewardFunctionSpec | None = Field(None, description="eval.gold_metric; None: exact match.")

    def code_paths(self) -> list[str]:
        return [self.function.path] if self.function is not None else []


def gold_scores(fn: RewardFunction, prompts: list, texts: list[str], columns: dict[str, list]) -> list[float]:
    """A gold metric's score of each answer (None counts 0: it did not pass)."""
    scored = fn(prompts=prompts, completions=as_completions(prompts, texts), **columns)
    return [0.0 if s is None else float(s) for s in scored]


def import_function(path: str, what: str = "reward function") -> Callable:
    """The function `package.module:function` names, callable as fn(prompts=, completions=, **columns); fails naming the
    path."""
    from rlhf_pipeline.trainers.runtime.custom import import_callable

    return import_callable(path, what, keywords=("prompts", "completions"), more=True)


def load_function(spec: RewardFunctionSpec) -> RewardFunction:
    fn = import_function(spec.path)
    fn.__name__ = getattr(fn, "__name__", spec.path.partition(":")[2])
    return fn


def as_completions(prompts: list, texts: list[str]) -> list:
    """Completions as TRL hands them to reward functions: a reply message for a conversational prompt, the text
    otherwise."""
    return [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]


def check_function(
    spec: RewardFunctionSpec, fn: RewardFunction, prompts: list, completions: list, columns: dict[str, list]
) -> None:
    """Call `fn` on a sample before any training step; a wrong result fails with its name."""
    try:
        scores = fn(prompts=prompts, completions=completions, **columns)
    except Exception as exc:
        raise ValueError(
            f"reward function {spec.path!r} raised on a sample of {len(prompts)} rows: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(scores, (list, tuple)) or len(scores) != len(completions):
        got = f"{len(scores)} scores" if isinstance(scores, (list, tuple)) else type(scores).__name__
        raise ValueError(
            f"reward function {spec.path!r} returned {got} for {len(completions)} completions; it must return one "
            "float (or None) per completion"
        )
    bad = [s for s in scores if s is not None and not (isinstance(s, (int, float)) and math.isfinite(s))]
    if bad:
        raise ValueError(f"reward function {spec.path!r} returned non-numeric or non-finite scores, e.g. {bad[0]!r}")


def load_functions(
    cfg: RewardsConfig, prompts: list, completions: list, columns: dict[str, list]
) -> list[RewardFunction]:
    """Import and sample-check every reward function of `cfg`."""
    loaded = []
    for spec in cfg.functions:
        fn = load_function(spec)
        check_function(spec, fn, prompts, completions, columns)
        loaded.append(fn)
    return loaded


def trl_reward_funcs(
    cfg: RewardsConfig, reward_model: Path | None, sample: dict[str, list]
) -> tuple[list, list[float]]:
    """`reward_funcs` and `reward_weights` for TRL's GRPOTrainer / RLOOTrainer.

    `sample` is a few dataset rows (column -> values) used to check the functions.
    """
    prompts = sample["prompt"]
    completions = as_completions(prompts, ["0"] * len(prompts))
    columns = {k: v for k, v in sample.items() if k != "prompt"}
    funcs: list[Any] = load_functions(cfg, prompts, completions, columns)
    weights = [spec.weight for spec in cfg.functions]
    if cfg.uses_reward_model:
        if reward_model is None:
            raise ValueError("rewards.reward_model_weight > 0 but no reward model was trained")
        import torch

        from rlhf_pipeline.trainers.models.load import has_adapter, load_sequence_classifier, load_tokenizer
        from rlhf_pipeline.trainers.rewards.ensemble import TextEnsemble, scoring_dirs

        dirs = scoring_dirs(reward_model)
        if len(dirs) > 1:  # an ensemble: one reward function over its members, aggregated
            funcs.append(
                TextEnsemble(
                    dirs,
                    cfg.reward_model_aggregate,
                    cfg.reward_model_std_coef,
                    "cuda" if torch.cuda.is_available() else "cpu",
                )
            )
        # TRL loads a reward model by path only when it is whole: rm's adapter is merged here
        elif has_adapter(reward_model):
            merged = load_sequence_classifier(reward_model)
            merged.config.pad_token_id = load_tokenizer(reward_model).pad_token_id
            funcs.append(merged)
        else:
            funcs.append(str(reward_model))
        weights.append(cfg.reward_model_weight)
    return funcs, weights


def check_shared_tokenizer(policy_model: Path, reward_model: Path) -> None:
    """A reward (or value) model that reads the policy's token ids as they are must turn text into the same ids:
    both folders' tokenizer files must match (a folder without them, e.g. a hub id, is not checked)."""
    from rlhf_pipeline.trainers.models.load import tokenizer_digest

    policy, reward = tokenizer_digest(policy_model), tokenizer_digest(reward_model)
    if policy and reward and policy != reward:
        raise ValueError(
            f"the reward model {reward_model} has another tokenizer (digest {reward}) than the policy {policy_model} "
            f"(digest {policy}); it scores the policy's token ids as they are, so train it from the same SFT model "
            "(or give it the same tokenizer files)"
        )


class RewardScorer:
    """Weighted sum of reward-model score and reward functions, for our own PPO loop.

    The reward model scores token ids (`ids`: prompt + completion, exactly as the policy saw and sampled them),
    so it must share the policy's tokenizer: given `policy_model`, that is checked before any weights load.
    Reward functions get the decoded `completions`.
    """

    def __init__(
        self,
        cfg: RewardsConfig,
        reward_model: Path | None,
        device: str | torch.device = "cpu",
        policy_model: Path | None = None,
    ):
        if policy_model is not None and reward_model is not None:
            check_shared_tokenizer(policy_model, reward_model)
        self.cfg = cfg
        self.functions = [(spec, load_function(spec)) for spec in cfg.functions]
        self.model = None
        if cfg.uses_reward_model:
            if reward_model is None:
                raise ValueError("rewards.reward_model_weight > 0 but no reward model was trained")
            from rlhf_pipeline.trainers.rewards.ensemble import load_members, scoring_dirs

            # Whole models, or rm's adapter (with its score head) merged; every member of a served ensemble.
            self.models = load_members(scoring_dirs(reward_model), device)
            self.model = self.models[0]

    def check(self, prompts: list, completions: list, columns: dict[str, list]) -> None:
        for spec, fn in self.functions:
            check_function(spec, fn, prompts, completions, columns)

    def __call__(
        self,
        prompts: list,
        completions: list,
        columns: dict[str, list],
        ids: list[list[int]] | None = None,
        batch_size: int = 64,
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Total reward per completion, and each component (named `reward_model` or the function's name)."""
        components: dict[str, list[float]] = {}
        total = [0.0] * len(completions)
        if self.model is not None:
            if ids is None or len(ids) != len(completions):
                raise ValueError(
                    f"the reward model scores token ids: pass `ids`, one row per completion ({len(completions)})"
                )
            scores, spread = self.ensemble_scores(ids, batch_size)
            components["reward_model"] = scores
            if len(self.models) > 1:  # logged beside the reward, weighted 0
                components["reward_model_std"] = spread
            total = [t + self.cfg.reward_model_weight * s for t, s in zip(total, scores)]
        for spec, fn in self.functions:
            scores = [0.0 if s is None else float(s) for s in fn(prompts=prompts, completions=completions, **columns)]
            components[fn.__name__] = scores
            total = [t + spec.weight * s for t, s in zip(total, scores)]
        return total, components

    def ensemble_scores(self, ids: list[list[int]], batch_size: int = 64) -> tuple[list[float], list[float]]:
        """The (aggregated) reward-model score of each row of token ids, and the members' disagreement (0 for one
        model)."""
        from rlhf_pipeline.trainers.rewards.ensemble import aggregate

        return aggregate(
            [self.member_scores(m, ids, batch_size) for m in self.models],
            self.cfg.reward_model_aggregate,
            self.cfg.reward_model_std_coef,
        )

    def model_scores(self, ids: list[list[int]], batch_size: int = 64) -> list[float]:
        return self.ensemble_scores(ids, batch_size)[0]

    @staticmethod
    def member_scores(model, ids: list[list[int]], batch_size: int = 64) -> list[float]:
        """One reward model's score of each row of token ids, right-padded as TRL's RewardTrainer pads them."""
        import torch

        from rlhf_pipeline.trainers.models.text import pad

        scores: list[float] = []
        for start in range(0, len(ids), batch_size):
            beat()
            input_ids, attention = pad(ids[start : start + batch_size], model.config.pad_token_id, device=model.device)
            with torch.no_grad():
                scores.extend(model(input_ids=input_ids, attention_mask=attention).logits[:, 0].float().tolist())
        return scores
