"""PPO's math (trainers/ppo/losses.py) against values worked by hand."""

import math

import pytest
import torch

from rlhf_pipeline.trainers.ppo import losses as ppo_math


def assert_close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-5, rtol=0)


def test_gae_by_hand():
    # gamma=1, lam=0.95, values V=(.5, .6, .7), reward 1 on the last token, a 4th token is padding:
    #   delta_2 = 1 + 0 - .7 = .3                      A_2 = .3
    #   delta_1 = 0 + .7 - .6 = .1                     A_1 = .1 + .95 * .3    = .385
    #   delta_0 = 0 + .6 - .5 = .1                     A_0 = .1 + .95 * .385  = .46575
    #   returns = A + V = (.96575, .985, 1.0)
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    advantages, returns = ppo_math.compute_gae(rewards, values, mask, gamma=1.0, lam=0.95)
    assert_close(advantages, [[0.46575, 0.385, 0.3, 0.0]])
    assert_close(returns, [[0.96575, 0.985, 1.0, 0.0]])
    # gamma=.5, lam=1, V=0: A_t = sum_l .5^l r_{t+l} = (0 + .5 * 0 + .25 * 1, .5, 1)
    advantages, _ = ppo_math.compute_gae(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.zeros(1, 3), torch.ones(1, 3), gamma=0.5, lam=1.0
    )
    assert_close(advantages, [[0.25, 0.5, 1.0]])


def test_whiten_ignores_padding():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = ppo_math.whiten(x, mask)
    # mean 2, population variance 2/3: (1 - 2) / sqrt(2/3) = -1.2247
    assert_close(out, [[-1.2247449, 0.0, 1.2247449, 0.0]])
    real = out[mask.bool()]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert real.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    # shift_mean=False rescales but keeps the mean (reward whitening)
    assert_close(ppo_math.whiten(x, mask, shift_mean=False), [[0.7752551, 2.0, 3.2247449, 0.0]])


def test_policy_loss_clips_only_beyond_the_range():
    old = torch.zeros(1, 2)
    mask = torch.tensor([[1.0, 0.0]])  # the second token is padding and must not count
    # ratio 1.5, advantage +1, clip .2: max(-1.5, -1.2) = -1.2 -> the clip binds
    loss, clipfrac, approx_kl = ppo_math.policy_loss(
        torch.tensor([[math.log(1.5), 3.0]]), old, torch.tensor([[1.0, 7.0]]), mask, 0.2
    )
    assert loss.item() == pytest.approx(-1.2)
    assert clipfrac.item() == 1.0
    assert approx_kl.item() == pytest.approx(0.5 * math.log(1.5) ** 2)
    # ratio 1.1 is inside [0.8, 1.2]: loss = -1.1, nothing clipped
    loss, clipfrac, _ = ppo_math.policy_loss(
        torch.tensor([[math.log(1.1), 3.0]]), old, torch.tensor([[1.0, 7.0]]), mask, 0.2
    )
    assert loss.item() == pytest.approx(-1.1)
    assert clipfrac.item() == 0.0
    # ratio .5, advantage -1: max(.5, .8) = .8 -> the pessimistic (clipped) term binds
    loss, clipfrac, _ = ppo_math.policy_loss(
        torch.tensor([[math.log(0.5), 0.0]]), old, torch.tensor([[-1.0, 0.0]]), mask, 0.2
    )
    assert loss.item() == pytest.approx(0.8)
    assert clipfrac.item() == 1.0


def test_value_loss_clips_the_step_from_the_old_value():
    old, returns, mask = torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 2.0]]), torch.tensor([[1.0, 1.0]])
    # token 0: V=1.5 -> clipped to 1.2; max((1.5-2)^2, (1.2-2)^2) = max(.25, .64) = .64 (clipped)
    # token 1: V=1.1 (inside the range): (1.1-2)^2 = .81 (not clipped)
    loss, clipfrac = ppo_math.value_loss(torch.tensor([[1.5, 1.1]]), old, returns, mask, 0.2)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81) / 2)
    assert clipfrac.item() == pytest.approx(0.5)


def test_kl_shaped_rewards_put_the_score_on_the_last_real_token():
    scores = torch.tensor([2.0, -1.0])
    logprobs = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the second completion ended (EOS) at token 1
    rewards, kl = ppo_math.kl_shaped_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=0.1)
    # kl = logp - ref on real tokens: (.5, 0, -.5) and (0, 1, padding); reward = -.1 * kl, + score at the last real
    # token
    assert_close(kl, [[0.5, 0.0, -0.5], [0.0, 1.0, 0.0]])
    assert_close(rewards, [[-0.05, 0.0, 0.05 + 2.0], [0.0, -0.1 - 1.0, 0.0]])


def test_k3_kl_by_hand():
    # log r = ref - logp: -.5, 0, .5 and 0, -1 (+ padding). k1 = -log r; k3 = (e^log r - 1) - log r:
    #   e^-.5 - 1 + .5 = .1065307     e^.5 - 1 - .5 = .1487213     e^-1 - 1 + 1 = .3678794
    logprobs = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert_close(ppo_math.kl_per_token(logprobs, ref_logprobs, mask, "k1"), [[0.5, 0.0, -0.5], [0.0, 1.0, 0.0]])
    assert_close(
        ppo_math.kl_per_token(logprobs, ref_logprobs, mask, "k3"), [[0.1065307, 0.0, 0.1487213], [0.0, 0.3678794, 0.0]]
    )
    # The penalty uses the chosen estimate: -.1 * k3 on every real token, the score on the last one.
    rewards, kl = ppo_math.kl_shaped_rewards(
        torch.tensor([2.0, -1.0]), logprobs, ref_logprobs, mask, kl_coef=0.1, kl_estimator="k3"
    )
    assert_close(rewards, [[-0.01065307, 0.0, -0.01487213 + 2.0], [0.0, -0.03678794 - 1.0, 0.0]])


def test_explained_variance_by_hand():
    returns, mask = torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # Var[R] = 2/3; errors R - V = (0, 0, 1): mean 1/3, Var = (1/9 + 1/9 + 4/9) / 3 = 2/9; 1 - (2/9) / (2/3) = 2/3
    assert ppo_math.explained_variance(torch.tensor([[1.0, 2.0, 2.0, -5.0]]), returns, mask) == pytest.approx(2 / 3)
    assert ppo_math.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # The mean predicts nothing
    assert ppo_math.explained_variance(torch.full((1, 4), 2.0), returns, mask) == pytest.approx(0.0)
    assert math.isnan(ppo_math.explained_variance(torch.zeros(1, 4), torch.ones(1, 4), mask))  # constant returns


def test_truncate_at_stop_cuts_after_the_first_stop_token():
    responses = torch.tensor([[5, 7, 3, 9], [5, 5, 5, 5], [3, 7, 3, 9]])
    cut, mask, ended = ppo_math.truncate_at_stop(responses, stop_ids=[3, 7], pad_id=0)
    assert cut.tolist() == [[5, 7, 0, 0], [5, 5, 5, 5], [3, 0, 0, 0]]
    assert mask.int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert ended.tolist() == [True, False, True]


# --- config ----------------------------------------------------------------------------
