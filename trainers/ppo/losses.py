"""PPO's math as pure functions on tensors, each beside the equation it implements (docs/ARCHITECTURE.md, "The
trainer contract"; the loop is `trainers.ppo.train`). PPO: Schulman et al. 2017; GAE: Schulman et al. 2016; InstructGPT:
Ouyang et al. 2022; N+: Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO"; k3: Schulman 2020,
"Approximating KL divergence" (http://joschu.net/blog/kl-approx.html). Tested against hand-worked values
(tests/trainers/ppo/test_losses.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Mean 0, (population) std 1 over the real tokens, padding 0; shift_mean=False only rescales (reward whitening, N+
    §7)."""
    import torch

    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask


def kl_per_token(logprobs, ref_logprobs, mask, kl_estimator: str = "k1") -> torch.Tensor:
    """KL(pi_RL || pi_SFT) estimated on each sampled token (Schulman 2020, as TRL's PPOTrainer): with log r = ref_logp -
    logp, k1 = -log r, k3 = (r - 1) - log r. Padding is 0."""
    import torch

    log_r = ref_logprobs - logprobs
    kl = -log_r if kl_estimator == "k1" else torch.expm1(log_r) - log_r
    return kl * mask


def adapted_kl_coef(kl_coef: float, kl: float, target: float, batch_size: int, horizon: int) -> float:
    """Ziegler et al. 2019 (section 2.2): e = clip(KL / target - 1, -0.2, 0.2); beta <- beta * (1 + e * batch_size /
    horizon)."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * batch_size / horizon)


def kl_shaped_rewards(
    scores, logprobs, ref_logprobs, mask, kl_coef: float, kl_estimator: str = "k1"
) -> tuple[torch.Tensor, torch.Tensor]:
    """InstructGPT eq. 2, r(x, y) - beta * log(pi_RL / pi_SFT), spread over tokens as in N+ §7:
    -kl_coef * kl on every real token (the non-score reward), plus the score on the last one (the stop token,
    or the last sampled token of a cut-off completion). Returns (rewards, kl)."""
    import torch

    kl = kl_per_token(logprobs, ref_logprobs, mask, kl_estimator)
    rewards = -kl_coef * kl
    last = (mask.sum(1).long() - 1).clamp(min=0)  # mask is a prefix: the response up to and including the stop token
    rewards[torch.arange(len(scores), device=rewards.device), last] += scores
    return rewards, kl


def explained_variance(values, returns, mask) -> float:
    """1 - Var[R - V] / Var[R] over the real tokens, as CleanRL logs it: 1 when the value predictions match the
    returns, 0 when they do no better than the returns' mean, negative when worse; nan when the returns are constant."""
    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask).item()
    errors = returns - values
    var_errors = masked_mean((errors - masked_mean(errors, mask)) ** 2, mask).item()
    return float("nan") if var_returns == 0 else 1 - var_errors / var_returns


def truncate_at_stop(responses, stop_ids: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """N+ §4: a response ends at its first stop token (kept); everything after it becomes padding.
    Returns (responses, mask of the real tokens, whether each reached a stop token)."""
    import torch

    is_stop = torch.isin(responses, torch.tensor(stop_ids, dtype=responses.dtype, device=responses.device))
    ended = is_stop.any(1)
    first_stop = torch.where(ended, is_stop.int().argmax(1), responses.shape[1])
    mask = torch.arange(responses.shape[1], device=responses.device)[None, :] <= first_stop[:, None]
    return responses.masked_fill(~mask, pad_id), mask, ended


def compute_gae(rewards, values, mask, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE, Schulman et al. 2016 eq. 16: A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t.
    The episode ends at the last real token (V = r = 0 after it). Returns (advantages, returns = A + V)."""
    import torch

    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def policy_loss(
    logprobs, old_logprobs, advantages, mask, cliprange: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Schulman et al. 2017 eq. 7 (negated, mean over real tokens). Returns (loss, clipfrac: share of tokens
    where the clipped term binds, approx_kl: 0.5 E[(log ratio)^2], Schulman's k2 as CleanRL and TRL report it)."""
    import torch

    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    approx_kl = 0.5 * masked_mean(log_ratio**2, mask)
    return loss, clipfrac.detach(), approx_kl.detach()


def value_loss(values, old_values, returns, mask, cliprange_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 max((V - R)^2, (clip(V, V_old +- c) - R)^2), mean over real tokens (N+ §7, as OpenAI's PPO2).
    Returns (loss, clipfrac: share of tokens where the clipped error is the larger)."""
    import torch

    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_error, clipped_error = (values - returns) ** 2, (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped_error, clipped_error), mask)
    return loss, masked_mean((clipped_error > unclipped_error).float(), mask).detach()
