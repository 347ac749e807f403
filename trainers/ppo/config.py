"""`ppo`'s config: our PPO's fields (`PpoFields`, named as TRL's old PPOConfig's) and the stage's config with the
user's optimizer and callbacks (`PpoConfig`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_pipeline.trainers.config import AttentionField, Customisation, LoraConfig
from rlhf_pipeline.trainers.rewards.mix import RewardsConfig
from rlhf_pipeline.trainers.rewards.probes import ProbeFields


class PpoFields(AttentionField):
    """Field names follow TRL's old PPOConfig, so scripts written for it carry over."""

    learning_rate: float = Field(
        3e-6,
        gt=0,
        description="Peak AdamW learning rate, shared by policy and value model (TRL PPOConfig default 3e-6).",
    )
    lr_scheduler_type: Literal["linear", "constant"] = Field(
        "linear", description="'linear': anneal to 0 over the updates (TRL's default); 'constant'."
    )
    total_episodes: int | None = Field(
        None, ge=1, description="Prompts rolled out in all; None: one pass over the `prompts` split."
    )
    rollout_batch_size: int = Field(
        64,
        ge=1,
        description=(
            "Prompts rolled out per update (one completion each): the whole rollout batch, split into "
            "`num_mini_batches` (TRL's old PPOTrainer called a per-device share of it per_device_train_batch_size)."
        ),
    )
    num_mini_batches: int = Field(
        1, ge=1, description="Optimizer steps per PPO epoch; each takes rollout_batch_size / num_mini_batches rollouts."
    )
    num_ppo_epochs: int = Field(4, ge=1, description="Passes over each rollout batch.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor of GAE.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda: bias (0) vs variance (1) of the advantage estimate.")
    cliprange: float = Field(0.2, gt=0, lt=1, description="Policy ratio clip epsilon (PPO eq. 7).")
    cliprange_value: float = Field(
        0.2, gt=0, description="How far a value prediction may move from its rollout value before the loss is clipped."
    )
    vf_coef: float = Field(0.1, ge=0, description="Weight of the value loss in the summed loss.")
    kl_coef: float = Field(
        0.05,
        ge=0,
        description="Per-token KL penalty to the reference policy (InstructGPT's beta); with target_kl, its start.",
    )
    target_kl: float | None = Field(
        None,
        gt=0,
        description=(
            "Adaptive KL (Ziegler et al. 2019): kl_coef follows the rollouts' KL towards this target (nats per "
            "completion), logged as ppo/train/kl_coef. None: kl_coef stays fixed."
        ),
    )
    kl_horizon: int = Field(
        10000,
        ge=1,
        description=(
            "Adaptive KL's horizon in episodes: kl_coef moves by at most 20% x rollout_batch_size / kl_horizon per "
            "update."
        ),
    )
    whiten_rewards: bool = Field(
        False, description="Rescale the per-token rewards to unit variance before GAE (mean kept)."
    )
    kl_estimator: Literal["k1", "k3"] = Field(
        "k1",
        description=(
            "Per-token KL estimate in the penalty (TRL PPOConfig; Schulman's k-estimators): 'k1' log(p/p_ref), "
            "unbiased; 'k3' (r - 1) - log r with r = p_ref/p, unbiased, never negative, lower variance."
        ),
    )
    missing_eos_penalty: float | None = Field(
        None,
        ge=0,
        description=(
            "Subtracted from the score of a completion that reaches no stop token within response_length (N+ §7). "
            "None: 1.0 (TRL's examples) when the reward model is among the rewards, since it scores a cut-off text as "
            "if finished, else 0 (reward functions judge the text itself); a value given, 0 included, always wins."
        ),
    )
    response_length: int = Field(53, ge=1, description="Most new tokens sampled per completion.")
    stop_token: Literal["eos"] | None = Field(
        None,
        description=(
            "Where a completion ends (TRL PPOConfig; excludes stop_token_id). 'eos': the tokenizer's EOS only. None: "
            "the EOS and the chat template's end of turn (e.g. <|im_end|>), unless stop_token_id is set (TRL's None "
            "stopped nowhere). The response is cut after its first stop token and padded after it."
        ),
    )
    stop_token_id: int | None = Field(
        None, ge=0, description="End completions at this token id only (TRL PPOConfig); excludes stop_token."
    )
    num_sample_generations: int = Field(
        10,
        ge=0,
        description=(
            "Sample tables over the run (TRL PPOConfig), evenly spaced from update 1: prompt, completion and scores "
            "of a few rollouts, appended to samples.jsonl in the stage's artifact. 0: none."
        ),
    )
    temperature: float = Field(
        0.7, gt=0, description="Sampling temperature; log-probabilities are computed at the same temperature."
    )
    rollout_logprobs: bool = Field(
        False,
        description=(
            "Take the rollouts' log-probabilities and entropy from generation's own scores, as TRL's PPOTrainer did, "
            "instead of one more forward pass of the policy over prompt + completion: a rollout spends one forward "
            "pass less. The log-probs then come from cached decoding, so the first mini-batch's ratio moves from "
            "exactly 1 by its rounding (within 1e-3 in float32). Where `generate` samples (a model the decoding loop "
            "does not run), each rank holds its rollouts' scores while it generates: its share of rollout_batch_size "
            "x response_length x vocabulary floats."
        ),
    )
    max_grad_norm: float = Field(
        1.0, gt=0, description="Gradient clipping norm (policy and value parameters together)."
    )
    seed: int = Field(42, description="Seed for prompt order, sampling and mini-batch order.")
    logging_steps: int = Field(10, ge=1, description="Log metrics (averaged over the window) every this many updates.")
    save_steps: int = Field(
        100, ge=1, description="Checkpoint every this many updates; a re-run resumes from the newest."
    )
    optim: str = Field(
        "adamw_torch",
        description=(
            "Optimizer of policy and value model by transformers' name (default adamw_torch, eps 1e-5 as in the N+ "
            "code): adamw_torch_fused, adafactor, sgd, rmsprop, adamw_8bit (bitsandbytes, GPU), ...; "
            "optimizer_factory for anything else."
        ),
    )
    bf16: bool | None = Field(None, description="bfloat16 autocast. None: on when a CUDA device supports it.")
    fp16: bool = Field(
        False, description="float16 autocast with loss scaling (CUDA GPUs without bfloat16); not with bf16."
    )
    tf32: bool | None = Field(
        None, description="TensorFloat-32 matmuls on Ampere and newer GPUs. None: torch's default."
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description=(
            "torch CPU threads while training (restored after); None: torch's default. Small models on a busy CPU run "
            "fastest with 1."
        ),
    )
    save_value_model: bool = Field(
        False, description="Also write the trained value model to `value_model/` beside the policy."
    )
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="LoRA adapters on the policy (peft); the reference is the policy with adapters disabled.",
    )

    def adapters(self) -> LoraConfig:
        return self.lora

    @model_validator(mode="after")
    def _fields_agree(self):
        from rlhf_pipeline.trainers.config import check_optimizer_name, check_precision_fields

        check_precision_fields(self.bf16, self.fp16)
        check_optimizer_name(self.optim, "adamw_torch")
        batch, minis = self.rollout_batch_size, self.num_mini_batches
        if batch % minis:
            raise ValueError(
                f"rollout_batch_size={batch} must be divisible by num_mini_batches={minis} (mini-batches of "
                f"{batch / minis:.2f} rollouts)"
            )
        if self.total_episodes is not None and self.total_episodes < batch:
            raise ValueError(
                f"total_episodes={self.total_episodes} is less than one rollout batch (rollout_batch_size={batch}): "
                "no update would run"
            )
        if self.stop_token is not None and self.stop_token_id is not None:
            raise ValueError(
                f"stop_token={self.stop_token!r} and stop_token_id={self.stop_token_id} exclude each other (as in "
                "TRL): set one"
            )
        return self

    def num_updates(self, num_prompts: int) -> int:
        return (self.total_episodes or num_prompts) // self.rollout_batch_size

    def eos_penalty(self, rewards: RewardsConfig) -> float:
        """`missing_eos_penalty`, or its default for these rewards."""
        if self.missing_eos_penalty is not None:
            return self.missing_eos_penalty
        return 1.0 if rewards.uses_reward_model else 0.0

    def sample_every(self, num_updates: int) -> int | None:
        """Updates between sample tables, as TRL spaced them (None: no tables)."""
        return max(1, num_updates // self.num_sample_generations) if self.num_sample_generations else None


class PpoConfig(Customisation, ProbeFields, PpoFields):
    """Our PPO's fields (`PpoFields`), then the user's own optimizer and callbacks, as in every stage."""

    @model_validator(mode="after")
    def _one_optimizer(self):
        if self.optim != "adamw_torch" and self.optimizer_factory:
            raise ValueError(
                f"optim={self.optim!r} and optimizer_factory={self.optimizer_factory!r} both choose the optimizer: "
                "set one"
            )
        return self
