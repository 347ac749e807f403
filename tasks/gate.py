"""The `registry` stage's configuration and its promotion gate: pure functions of the eval stage's metrics, so the table
and the parameters import no Prefect or MLflow code (`tasks.registry` registers and moves the aliases).
"""

from __future__ import annotations

import math

from pydantic import Field, field_validator

from rlhf_pipeline.tasks.config import check_name
from rlhf_pipeline.trainers.config import StageConfig
from rlhf_pipeline.trainers.evaluation.stage import HELDOUT

CHAMPION, CANDIDATE = "champion", "candidate"


GATE_ORDER = (
    "eval/heldout/win_rate_vs_champion",
    "eval/heldout/judge_win_rate_vs_champion",
    "eval/heldout/gold_gain_vs_champion",
    "eval/heldout/exact_match_gain_vs_champion",
)
"""The default gate metric: the first of these the run's eval reports (reward model, judge, gold function, reference
answers)."""


class RegistryConfig(StageConfig):
    enabled: bool = Field(True, description="Register the policy and run the promotion gate.")
    model_name: str = Field("rlhf-policy", min_length=1, description="Registered model name in MLflow.")

    @field_validator("model_name")
    @classmethod
    def _holdable_name(cls, name: str) -> str:
        return check_name(name, "registry.model_name")

    gate_metric: str | None = Field(
        None,
        description=(
            "Eval metric the new policy must beat `min_value` on to become champion (its CI bounds are "
            "`<metric>_low`/`_high`). None: the first the run measures of the reward-model win rate against the "
            "champion, the judge's win rate, the gold metric's gain, the exact-match gain (with or without reference "
            "answers, a run has a gate)."
        ),
    )
    min_value: float | None = Field(
        None, description="The gate metric must be at least this. None: 0.5 for a win rate, 0 for a gain."
    )
    margin: float = Field(
        0.02,
        ge=0,
        description=(
            "Non-inferiority margin of the default lower bound: how far below no gain (0, or a win rate of 0.5) the "
            "metric's lower 95% bound may fall, so that a policy as good as the champion can replace it while one "
            "that may be worse by more cannot."
        ),
    )
    min_lower_bound: float | None = Field(
        None,
        description=(
            "The metric's lower 95% bound must be at least this. None: `min_value` less `margin` (0.48 for a win "
            "rate, -0.02 for a gain); -.inf: not checked."
        ),
    )

    beat_start: bool = Field(
        True,
        description=(
            "Promote only a policy that beats its own start (sft) on the held-out gold metric (eval.gold_metric, else "
            "exact match): the paired gain's lower 95% bound above 0, even as the first version. No gold metric: not "
            "checked. The training reward alone never promotes."
        ),
    )
    hacking_gate: bool = Field(
        True,
        description=(
            "Refuse to promote a policy whose held-out reward-model score rose over SFT's while the gold metric "
            "(exact match or eval.gold_metric) fell, or, without one, while the reward-model ensemble's disagreement "
            "rose; or whose reward-model win rate against the champion is above 0.5 while its gold metric is below "
            "the champion's: it games its reward."
        ),
    )
    hacking_tolerance: float = Field(
        0.0,
        ge=0,
        description="How far the gold metric may fall (or the disagreement rise) before the hacking gate refuses.",
    )

    def resolved(self, planned: set[str]) -> RegistryConfig:
        """This gate with its defaults made concrete for a run whose eval reports `planned` metrics."""
        metric = self.gate_metric or next((name for name in GATE_ORDER if name in planned), GATE_ORDER[0])
        even = 0.5 if "win_rate" in metric else 0.0  # no better, no worse
        low = self.min_lower_bound if self.min_lower_bound is not None else even - self.margin
        value = self.min_value if self.min_value is not None else even
        return self.model_copy(update={"gate_metric": metric, "min_value": value, "min_lower_bound": low})


def hacking(cfg: RegistryConfig, metrics: dict[str, float]) -> str | None:
    """Why the policy looks like it games its reward model (with the numbers), or None."""
    if not cfg.hacking_gate:
        return None
    win, gold_gain = metrics.get(f"{HELDOUT}win_rate_vs_champion"), None
    for gold in ("gold", "exact_match"):
        gold_gain = metrics.get(f"{HELDOUT}{gold}_gain_vs_champion")
        if gold_gain is not None:
            break
    if win is not None and gold_gain is not None and win > 0.5 and gold_gain < -cfg.hacking_tolerance:
        return (
            f"reward hacking: the reward model prefers the policy to the champion (win rate {win:.4f}) while "
            f"{gold.replace('_', ' ')} is {gold_gain:+.4f} against the champion's (tolerance {cfg.hacking_tolerance})"
        )
    reward, sft_reward = metrics.get(f"{HELDOUT}policy_mean_reward"), metrics.get(f"{HELDOUT}sft_mean_reward")
    if reward is None or sft_reward is None or reward <= sft_reward:
        return None
    rose = f"the held-out reward-model score rose from {sft_reward:.4f} (sft) to {reward:.4f} (policy)"
    for gold in ("gold", "exact_match"):
        policy, sft = metrics.get(f"{HELDOUT}policy_{gold}"), metrics.get(f"{HELDOUT}sft_{gold}")
        if policy is not None and sft is not None:
            if policy < sft - cfg.hacking_tolerance:
                return (
                    f"reward hacking: {rose} while {gold.replace('_', ' ')} fell from {sft:.4f} to {policy:.4f} "
                    f"(tolerance {cfg.hacking_tolerance})"
                )
            return None
    policy, sft = metrics.get(f"{HELDOUT}policy_rm_disagreement"), metrics.get(f"{HELDOUT}sft_rm_disagreement")
    if policy is not None and sft is not None and policy > sft + cfg.hacking_tolerance:
        return (
            f"reward hacking: {rose} while the reward-model ensemble's disagreement rose from {sft:.4f} to "
            f"{policy:.4f} (no gold metric; tolerance {cfg.hacking_tolerance})"
        )
    return None


START_GAINS = (f"{HELDOUT}gold_gain_vs_sft", f"{HELDOUT}exact_match_gain_vs_sft")
"""The policy's paired gain over its start on the held-out gold metric: the first the run's eval reports."""


def below_start(cfg: RegistryConfig, metrics: dict[str, float]) -> str | None:
    """Why the policy is no champion for not beating its own start on the held-out gold metric (with the numbers), or
    None (it does, `beat_start` is off, or eval measures no gold metric)."""
    name = next((name for name in START_GAINS if name in metrics), None)
    if not cfg.beat_start or name is None:
        return None
    low = metrics.get(f"{name}_low", float("-inf"))
    if low > 0:
        return None
    return (
        f"it does not beat its start on the held-out gold metric: {name}={metrics[name]:+.4f}, lower bound "
        f"{low:+.4f} is not above 0 (registry.beat_start)"
    )


def unmeasured(cfg: RegistryConfig, metrics: dict[str, float]) -> str | None:
    """Why a first version (no champion to beat) stays a candidate when nothing measured it against its start: no gold
    metric and no reference answers (with `beat_start` on; the training reward alone never promotes), or None."""
    if not cfg.beat_start or any(name in metrics for name in START_GAINS):
        return None
    return (
        "no champion yet, and nothing measured this policy against its start: eval has no gold metric "
        "(eval.gold_metric) and its held-out prompts no reference answers, so it stays a candidate "
        "(registry.beat_start=false promotes it)"
    )


def gate(cfg: RegistryConfig, metrics: dict[str, float]) -> tuple[bool, str]:
    """Whether the candidate beats the champion, and why (with the numbers)."""
    cfg = cfg.resolved(set(metrics))
    value = metrics.get(cfg.gate_metric)
    if value is None:
        return False, f"gate metric {cfg.gate_metric!r} missing from eval metrics"
    if value < cfg.min_value:
        return False, f"{cfg.gate_metric}={value:.4f} is below {cfg.min_value:g}"
    reason = f"{cfg.gate_metric}={value:.4f} >= {cfg.min_value:g}"
    if math.isfinite(cfg.min_lower_bound):
        low = metrics.get(f"{cfg.gate_metric}_low")
        if low is None or low < cfg.min_lower_bound:
            return False, f"{cfg.gate_metric} lower bound {low} is below {cfg.min_lower_bound:g} (registry.margin)"
        reason += f", lower bound {low:.4f} >= {cfg.min_lower_bound:g}"
    return True, reason
