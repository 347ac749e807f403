"""Reward-model ensembles (Coste et al. 2023) and their weight average (WARM, Ramé et al. 2024).

An `rm` artifact trained with `ensemble_size` k > 1 holds every member beside the served model:

    rm/<key>/model/              what the stages read as "the reward model": member 0, or the members' weight average
                                 (WARM)
    rm/<key>/members/<i>/model/  member i (seed + i, its own bootstrap resample of the pairs), a whole model folder
    rm/<key>/ensemble.json       {"members": k, "served": "ensemble" | "average"}

With `served: ensemble` the online stages score with every member and aggregate (`rewards.reward_model_aggregate`);
with `served: average` they score with `model/` alone, and the members still give eval its disagreement.
The value model of our PPO starts from `model/` either way.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

ENSEMBLE_FILE = "ensemble.json"
MEMBERS = "members"
Aggregate = Literal["mean", "min", "mean_minus_std"]


def ensemble_info(reward_model: Path) -> dict | None:
    """The artifact's ensemble description, or None for a single reward model (or a hub id)."""
    path = Path(reward_model).parent / ENSEMBLE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def member_dirs(reward_model: Path) -> list[Path]:
    """Every member's folder (a single reward model is its own only member)."""
    info = ensemble_info(reward_model)
    if info is None:
        return [Path(reward_model)]
    members = Path(reward_model).parent / MEMBERS
    return [members / str(i) / "model" for i in range(info["members"])]


def scoring_dirs(reward_model: Path) -> list[Path]:
    """The folders the policy's reward is computed from: every member of a served ensemble, else `model/` alone."""
    info = ensemble_info(reward_model)
    return member_dirs(reward_model) if info is not None and info["served"] == "ensemble" else [Path(reward_model)]


def aggregate(
    member_scores: list[list[float]], how: Aggregate, std_coef: float = 1.0
) -> tuple[list[float], list[float]]:
    """Per row: the members' aggregate score, and their disagreement (population standard deviation; 0 for one member).

    `min` is Coste et al.'s worst-case optimisation (WCO); `mean_minus_std` their uncertainty-weighted one (UWO),
    mean - std_coef * std."""
    rows = list(zip(*member_scores))
    spread = [statistics.pstdev(r) if len(r) > 1 else 0.0 for r in rows]
    if how == "min":
        return [min(r) for r in rows], spread
    means = [statistics.fmean(r) for r in rows]
    if how == "mean_minus_std":
        return [m - std_coef * s for m, s in zip(means, spread)], spread
    return means, spread


def load_members(dirs: list[Path], device: str | torch.device = "cpu") -> list:
    """Each folder's sequence classifier, in eval mode without gradients, its pad id set (it pools at the last real
    token)."""
    from rlhf_pipeline.trainers.models.load import load_sequence_classifier, load_tokenizer

    models = []
    for folder in dirs:
        model = load_sequence_classifier(folder)
        model.to(device).eval().requires_grad_(False)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = load_tokenizer(folder).pad_token_id
        models.append(model)
    return models


def average_weights(dirs: list[Path], out_dir: Path) -> None:
    """WARM: the members' parameters averaged (they share the SFT backbone and the score head's initialisation),
    saved to `out_dir` with member 0's tokenizer and config."""
    import torch

    from rlhf_pipeline.trainers.models.load import load_sequence_classifier, load_tokenizer

    models = [load_sequence_classifier(folder) for folder in dirs]
    average = models[0]
    states = [m.state_dict() for m in models]
    with torch.no_grad():
        for name, tensor in average.state_dict().items():
            if tensor.is_floating_point():
                tensor.copy_(torch.stack([s[name].float() for s in states]).mean(0).to(tensor.dtype))
    average.save_pretrained(out_dir, safe_serialization=True)
    load_tokenizer(dirs[0]).save_pretrained(out_dir)


class TextEnsemble:
    """Members scoring text as TRL's RewardTrainer formats it (text.reward_scores), aggregated: a reward function
    with TRL's signature for GRPO/RLOO (its name, `reward_model`, is the logged reward's), and the held-out probes'."""

    __name__ = "reward_model"

    def __init__(
        self,
        dirs: list[Path],
        how: Aggregate = "mean",
        std_coef: float = 1.0,
        device: str | torch.device = "cpu",
        batch_size: int = 64,
    ):
        from rlhf_pipeline.trainers.models.load import load_tokenizer

        self.models, self.tokenizer = load_members(dirs, device), load_tokenizer(dirs[0])
        self.how, self.std_coef, self.batch_size = how, std_coef, batch_size
        self.last_spread: list[float] = []

    def members(self, prompts: list, completions: list) -> list[list[float]]:
        from rlhf_pipeline.trainers.models.text import reward_scores

        return [reward_scores(m, self.tokenizer, prompts, completions, self.batch_size) for m in self.models]

    def score(self, prompts: list, completions: list) -> tuple[list[float], list[float]]:
        return aggregate(self.members(prompts, completions), self.how, self.std_coef)

    def __call__(self, prompts: list, completions: list, **_columns) -> list[float]:
        scores, self.last_spread = self.score(prompts, completions)
        return scores
