"""Iterated feedback (Xiong et al. 2024, online iterative RLHF; iterative DPO): after the policy trains, sample it, have
the samples labelled, train again; `rounds` times.

A round is stages of the flow, each cached and drawn in the graph (`pairs (round r)`, ...):

- `pairs (round r)` samples the last round's policy and labels the samples with the `pairs` block's labeller and
  settings (`trainers.pairs.stage`); with `keep_pairs`, the pairs of every round so far are kept beside this round's;
- an online algorithm (grpo, rloo, ppo against the reward model): `rm (round r)` trains on those pairs (and the given
  ones, with `pairs.train_on: both`), then the policy trains against it;
- an offline algorithm (dpo, kto, orpo): the policy trains on those pairs.

The policy of a round starts from the SFT model (`from_sft`) or from the last round's policy, which is then also its
reference (drift from SFT adds up over the rounds).
"""

from __future__ import annotations

from pydantic import Field

from rlhf_pipeline.trainers.config import Block


class FeedbackConfig(Block):
    rounds: int = Field(
        0,
        ge=0,
        le=10,
        description=(
            "Rounds of feedback after the first policy: sample it, label pairs (the `pairs` block's labeller), train "
            "again (rm then an online policy, or an offline policy on the pairs). 0: none."
        ),
    )
    from_sft: bool = Field(
        False,
        description=(
            "Train each round's policy from the SFT model (its KL reference too) instead of from the last round's "
            "policy (then also its reference: drift from SFT adds up over the rounds)."
        ),
    )
    keep_pairs: bool = Field(
        True, description="Each round trains on the pairs of every round so far; false: on its own round's alone."
    )
