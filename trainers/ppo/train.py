"""Proximal policy optimisation for RLHF, written here from the papers (TRL removed its PPOTrainer in 1.13).

One update: sample a batch of completions -> score them -> per-token rewards with a KL penalty
-> GAE -> `num_ppo_epochs` passes of clipped policy and value losses over `num_mini_batches`.
The math is in small pure functions on tensors; `train` reads top to bottom. References:
PPO: Schulman et al. 2017; GAE: Schulman et al. 2016; InstructGPT: Ouyang et al. 2022;
N+: Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO" (§4 general, §7 PPO details);
k3: Schulman 2020, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html).

Rollouts sample with exactly the stage's settings (temperature only; nothing from the model's
generation_config), stop at the stop tokens (`stop_token`), and the response is cut after the first
stop token and padded after it (N+ §4). The reward model scores the exact ids the policy saw and
sampled (prompt + response up to and including the stop token; a cut-off answer gets no EOS), so
it must share the policy's tokenizer; reward functions get the decoded text.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from rlhf_pipeline.trainers.algorithms.probes import ProbeFields
from rlhf_pipeline.trainers.config import AttentionField, Customisation, LogMetrics, LoraConfig
from rlhf_pipeline.trainers.ppo.losses import (
    adapted_kl_coef,
    compute_gae,
    explained_variance,
    kl_shaped_rewards,
    masked_mean,
    policy_loss,
    truncate_at_stop,
    value_loss,
    whiten,
)
from rlhf_pipeline.trainers.ppo.parallel import Ranks, cpu_threads, load_checkpoint, save_checkpoint, tf32
from rlhf_pipeline.trainers.rewards.mix import GoldMetric, RewardsConfig
from rlhf_pipeline.trainers.runtime.progress import PROGRESS, Progress
from rlhf_pipeline.trainers.runtime.stopping import Terminated, stop_requested

if TYPE_CHECKING:
    import torch


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

    @model_validator(mode="after")
    def _fields_agree(self):
        from rlhf_pipeline.trainers.config import check_optimizer_name, check_precision_fields

        check_precision_fields(self.bf16, self.fp16)
        check_optimizer_name(self.optim, "adamw_torch")
        factory = getattr(self, "optimizer_factory", None)  # PpoConfig's (Customisation)
        if self.optim != "adamw_torch" and factory:
            raise ValueError(
                f"optim={self.optim!r} and optimizer_factory={factory!r} both choose the optimizer: set one"
            )
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


SAMPLE_ROWS = 8
"""Rollouts per sample table (the first of the batch)."""


# --- model plumbing ------------------------------------------------------------------


def stop_ids(cfg: PpoFields, tokenizer) -> list[int]:
    """The ids a completion ends at, per `stop_token` / `stop_token_id`."""
    from rlhf_pipeline.trainers.models.templates import stop_token_ids

    if cfg.stop_token_id is not None:
        if cfg.stop_token_id >= len(tokenizer):
            raise ValueError(
                f"stop_token_id={cfg.stop_token_id} is not a token of the policy's tokenizer ({len(tokenizer)} tokens)"
            )
        return [cfg.stop_token_id]
    if cfg.stop_token == "eos":
        return [tokenizer.eos_token_id]
    return stop_token_ids(tokenizer)


def _sample(
    policy, tokenizer, prompt_ids: list[list[int]], cfg: PpoFields, stops: list[int], device
) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Left-padded prompts (N+ §4) -> inputs for prompt + completion, completion mask, whether each reached a stop
    token. No top-k/top-p/repetition penalty (own_sampling: not even the model's generation_config's), so we sample from
    exactly the distribution whose log-probs we compute (N+ §7)."""
    import torch

    from rlhf_pipeline.trainers.models.text import own_sampling, pad

    queries, query_mask = pad(prompt_ids, tokenizer.pad_token_id, left=True, device=device)
    # peft's generate copies its wrapper's generation_config into the inner model: swap the inner model's, so it is
    # restored.
    with own_sampling(policy.get_base_model() if hasattr(policy, "get_base_model") else policy, tokenizer):
        generated = policy.generate(
            input_ids=queries,
            attention_mask=query_mask,
            do_sample=True,
            temperature=cfg.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=cfg.response_length,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=stops,
        )
    responses, mask, ended = truncate_at_stop(generated[:, queries.shape[1] :], stops, tokenizer.pad_token_id)
    attention_mask = torch.cat([query_mask, mask.long()], 1)
    inputs = {
        "input_ids": torch.cat([queries, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),  # as `generate` numbers left-padded rows
    }
    return inputs, mask.float(), ended


def _response_logprobs(model, inputs: dict, width: int, temperature: float, with_entropy: bool = False):
    """Log-probabilities of the last `width` (completion) tokens, and their entropy; logits are divided by the
    sampling temperature (N+ §7), or the ratios and KL would describe another policy than the one sampled."""
    import torch

    logp_all = torch.log_softmax(model(**inputs, logits_to_keep=width + 1).logits[:, :-1].float() / temperature, dim=-1)
    logprobs = logp_all.gather(-1, inputs["input_ids"][:, -width:, None]).squeeze(-1)
    return logprobs, (-(logp_all.exp() * logp_all).sum(-1) if with_entropy else None)


def _response_values(value_model, inputs: dict, width: int):
    """The reward model's backbone and scalar head on every token (InstructGPT §3.5; N+ §7): the value
    of the state before completion token t is read at the position just before it."""
    hidden = value_model.base_model(**inputs).last_hidden_state
    return value_model.score(hidden[:, -width - 1 : -1]).squeeze(-1).float()


# --- training ------------------------------------------------------------------------


def train(
    cfg: PpoConfig,
    rewards: RewardsConfig,
    sft_model: Path,
    reward_model: Path | None,
    data_dir: Path,
    out_dir: Path,
    work_dir: Path,
    log_metrics: LogMetrics | None = None,
    gold: GoldMetric | None = None,
) -> dict[str, float]:
    """Write the trained policy to `out_dir/model` (merged under LoRA unless keep_adapter) and the sample tables to
    `out_dir/samples.jsonl`; return the last logged metrics.

    Metrics, `ppo/train/<name>`: reward (the score PPO optimises: weighted rewards minus the missing-EOS penalty),
    reward_<component> (each reward's raw mean: `reward_model`, `reward_<function name>`), kl (summed per completion,
    with `kl_estimator`), non_score_reward (the summed KL penalty, -kl_coef * kl), entropy, policy_loss, value_loss,
    clipfrac, approx_kl, ratio (new / old policy over real tokens), value_clipfrac, explained_variance (of the rollout
    values vs the returns), response_length, missing_eos (share that reached no stop token), learning_rate.
    """
    import torch

    from rlhf_pipeline.trainers.algorithms.loop import add_outcome, last_checkpoint, write_outcome
    from rlhf_pipeline.trainers.algorithms.probes import Keeper, Probe
    from rlhf_pipeline.trainers.attention import check_device
    from rlhf_pipeline.trainers.config import device_precision
    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.models.load import load_tokenizer, save_model
    from rlhf_pipeline.trainers.models.text import prompt_ids as render_prompt
    from rlhf_pipeline.trainers.rewards.mix import RewardScorer, as_completions
    from rlhf_pipeline.trainers.runtime.custom import Hooks

    # Fail on the config, the data and the tokenizers before any model is loaded.
    if rewards.uses_reward_model and reward_model is None:
        raise ValueError(f"rewards.reward_model_weight={rewards.reward_model_weight} but no reward model was given")
    dataset = load_split(data_dir, "prompts")
    if "prompt" not in dataset.column_names:
        raise ValueError(f"prompts has no 'prompt' column (columns: {dataset.column_names})")
    batch_size = cfg.rollout_batch_size
    if len(dataset) < batch_size:
        raise ValueError(f"prompts has {len(dataset)} rows, fewer than rollout_batch_size={batch_size}")
    num_updates = cfg.num_updates(len(dataset))
    prompts = dataset["prompt"]
    columns = {name: dataset[name] for name in dataset.column_names if name != "prompt"}
    tokenizer = load_tokenizer(sft_model)
    stops, eos_penalty, sample_every = stop_ids(cfg, tokenizer), cfg.eos_penalty(rewards), cfg.sample_every(num_updates)

    def completions(
        texts: list[str], rows: list[int]
    ) -> list:  # messages for conversational prompts, as TRL passes them
        return as_completions([prompts[i] for i in rows], texts)

    # The reward model's tokenizer is checked, and a broken reward function fails with its name, before the policy
    # loads.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ranks = Ranks(cpu=device.type == "cpu")
    if device.type == "cuda":
        device = torch.device("cuda", ranks.local)
        torch.cuda.set_device(device)
    if batch_size % ranks.world or (batch_size // ranks.world) % cfg.num_mini_batches:
        raise ValueError(
            f"rollout_batch_size={batch_size} must split into {ranks.world} ranks x "
            f"num_mini_batches={cfg.num_mini_batches} equal mini-batches"
        )
    local_batch = batch_size // ranks.world  # this rank's rollouts per update
    bf16 = device_precision(cfg.bf16, cfg.fp16, cfg.tf32)  # a precision the device lacks fails here, naming it
    check_device(cfg.attn_implementation)  # and an attention it cannot run
    scorer = RewardScorer(rewards, reward_model, device, policy_model=sft_model)
    sample = list(range(min(4, len(dataset))))
    scorer.check(
        [prompts[i] for i in sample],
        completions(["0"] * len(sample), sample),
        {k: [v[i] for i in sample] for k, v in columns.items()},
    )

    policy, reference, value_model = _models(cfg, sft_model, reward_model, tokenizer, device, ranks)
    params = [p for m in (policy, value_model) for p in m.parameters() if p.requires_grad]
    callbacks = cfg.user_callbacks()
    optimizer, scheduler, args = _optimizer(
        cfg, params, policy, value_model, num_updates, device, work_dir, bool(callbacks)
    )
    base_lrs = [
        group["lr"] for group in optimizer.param_groups
    ]  # before a checkpoint overwrites them with scheduled values
    dtype = torch.float16 if cfg.fp16 else torch.bfloat16
    autocast = lambda: torch.autocast(device.type, dtype=dtype, enabled=bf16 or cfg.fp16)  # noqa: E731
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.fp16)  # float16 gradients underflow without loss scaling

    state = {"update": 0, "data_epoch": 0, "data_index": 0, "metrics": {}, "kl_coef": cfg.kl_coef}
    if checkpoint := last_checkpoint(work_dir):
        state = {"kl_coef": cfg.kl_coef} | load_checkpoint(
            Path(checkpoint), policy, value_model, optimizer, scheduler, ranks.rank
        )
    keeper = Keeper(work_dir, cfg.keep_best, reward_model if rewards.uses_reward_model else None)
    probe = None
    if cfg.eval_steps and ranks.main:  # the held-out curves (rank 0 alone: every rank holds the same weights)
        probe = Probe(
            "ppo",
            data_dir,
            sft_model,
            reward_model,
            rewards,
            cfg,
            cfg.response_length,
            device,
            reference=(lambda: _reference_of(policy)) if reference is None else None,
            gold=gold,
        )
        if reference is not None:
            probe.reference = reference  # the PPO reference is the SFT model already
        keeper.resume(state["update"])
    ranks.barrier()
    for stale in work_dir.glob(".checkpoint-*.tmp") if work_dir.is_dir() and ranks.main else []:
        shutil.rmtree(stale, ignore_errors=True)
    samples = work_dir / "samples.jsonl"  # beside the checkpoints, so a resumed run keeps the tables written before it
    if samples.is_file() and ranks.main:  # tables of updates after the checkpoint are written again
        kept = [line for line in samples.read_text().splitlines() if json.loads(line)["update"] <= state["update"]]
        samples.write_text("".join(line + "\n" for line in kept))
    prompt_ids = [render_prompt(tokenizer, p) for p in prompts]

    def next_rows() -> list[int]:
        """The next batch of a per-epoch shuffle; (data_epoch, data_index) is the iterator's position."""
        if state["data_index"] + batch_size > len(dataset):
            state["data_epoch"], state["data_index"] = state["data_epoch"] + 1, 0
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(cfg.seed + state["data_epoch"]))
        state["data_index"] += batch_size
        return order[state["data_index"] - batch_size : state["data_index"]].tolist()

    window: dict[str, list[float]] = {}
    metrics: dict[str, float] = state["metrics"]
    progress = Progress("ppo", num_updates, state["update"], main=ranks.main)
    hooks = Hooks(
        callbacks,
        args,
        num_updates,
        state["update"],
        model=policy,
        processing_class=tokenizer,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        train_dataloader=None,
        eval_dataloader=None,
    )
    hooks.state.is_world_process_zero, hooks.state.is_local_process_zero = ranks.main, ranks.local == 0
    if ranks.world > 1 and ranks.main:
        PROGRESS.info(
            f"ppo: world size {ranks.world} (data-parallel, {'gloo' if device.type == 'cpu' else 'nccl'}), "
            f"{local_batch} rollouts per rank per update"
        )
    hooks("on_train_begin")
    started, first = time.monotonic(), state["update"]
    update, terminated = first, False
    with cpu_threads(cfg.num_threads), tf32(cfg.tf32):
        for update in range(state["update"] + 1, num_updates + 1):
            if scheduler is None:
                factor = 1 - (update - 1) / num_updates if cfg.lr_scheduler_type == "linear" else 1.0
                for group, base in zip(optimizer.param_groups, base_lrs):
                    group["lr"] = base * factor
            lr = optimizer.param_groups[0]["lr"]
            rows = next_rows()[ranks.rank :: ranks.world]  # this rank's share of the rollout batch

            # 1. Roll out, score, and turn the scores into per-token advantages.
            with torch.no_grad(), autocast():
                inputs, mask, ended = _sample(policy, tokenizer, [prompt_ids[i] for i in rows], cfg, stops, device)
                width = mask.shape[1]
                logprobs, entropy = _response_logprobs(policy, inputs, width, cfg.temperature, with_entropy=True)
                with _reference_of(policy) if reference is None else contextlib.nullcontext():
                    ref_logprobs, _ = _response_logprobs(
                        policy if reference is None else reference, inputs, width, cfg.temperature
                    )
                values = _response_values(value_model, inputs, width)
                # The reward model reads the ids as sampled, up to and including the stop token (N+ §4): no decode and
                # re-encode, and a cut-off answer gets no EOS. Reward functions read the text, without the stop token.
                lengths = mask.sum(1).long().tolist()
                responses = [ids[:n].tolist() for ids, n in zip(inputs["input_ids"][:, -width:], lengths)]
                texts = [
                    tokenizer.decode(ids[: len(ids) - int(end)], skip_special_tokens=True)
                    for ids, end in zip(responses, ended.tolist())
                ]
                total, components = scorer(
                    [prompts[i] for i in rows],
                    completions(texts, rows),
                    {k: [v[i] for i in rows] for k, v in columns.items()},
                    ids=[prompt_ids[i] + ids for i, ids in zip(rows, responses)],
                )
                scores = (
                    torch.tensor(total, device=device, dtype=torch.float) - eos_penalty * (~ended).float()
                )  # N+ §7: the EOS trick
                kl_coef = state["kl_coef"]
                token_rewards, kl = kl_shaped_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, cfg.kl_estimator)
                if cfg.whiten_rewards:
                    token_rewards = whiten(token_rewards, mask, shift_mean=False)
                advantages, returns = compute_gae(token_rewards, values, mask, cfg.gamma, cfg.lam)
                advantages = whiten(advantages, mask)  # advantage normalisation (N+ §7)

            # 2. `num_ppo_epochs` passes over shuffled mini-batches (Schulman et al. 2017, Algorithm 1).
            stats: dict[str, list[float]] = {
                name: [] for name in ("policy_loss", "value_loss", "clipfrac", "approx_kl", "value_clipfrac", "ratio")
            }
            for _ in range(cfg.num_ppo_epochs):
                for idx in torch.randperm(local_batch, device=device).split(local_batch // cfg.num_mini_batches):
                    mini = {k: v[idx] for k, v in inputs.items()}
                    with autocast():
                        new_logprobs, _ = _response_logprobs(policy, mini, width, cfg.temperature)
                        new_values = _response_values(value_model, mini, width)
                    pg_loss, clipfrac, approx_kl = policy_loss(
                        new_logprobs, logprobs[idx], advantages[idx], mask[idx], cfg.cliprange
                    )
                    vf_loss, vf_clipfrac = value_loss(
                        new_values, values[idx], returns[idx], mask[idx], cfg.cliprange_value
                    )
                    ratio = masked_mean(torch.exp(new_logprobs.detach() - logprobs[idx]), mask[idx])
                    optimizer.zero_grad(set_to_none=True)
                    scaler.scale(pg_loss + cfg.vf_coef * vf_loss).backward()
                    ranks.average_gradients(params)
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                    scaler.step(optimizer)
                    scaler.update()
                    for name, value in zip(stats, (pg_loss, vf_loss, clipfrac, approx_kl, vf_clipfrac, ratio)):
                        stats[name].append(value.item())

            if scheduler is not None:
                scheduler.step()
            if (
                cfg.target_kl is not None
            ):  # the next update's coefficient, from this batch's KL (the same on every rank: averaged)
                mean_kl = ranks.mean({"kl": kl.sum(1).mean().item()})["kl"]
                state["kl_coef"] = adapted_kl_coef(kl_coef, mean_kl, cfg.target_kl, batch_size, cfg.kl_horizon)
            hooks.state.global_step = update
            hooks("on_step_end")

            # 3. Metrics (averaged over the `logging_steps` window), sample tables and checkpoints.
            current = {
                "reward": scores.mean().item(),
                "kl": kl.sum(1).mean().item(),  # KL(policy || reference) per completion, as N+ §7 and TRL report it
                "non_score_reward": (-kl_coef * kl).sum(1).mean().item(),  # TRL's objective/non_score_reward
                "kl_coef": kl_coef,
                "entropy": masked_mean(entropy, mask).item(),
                "explained_variance": explained_variance(values, returns, mask),
                "response_length": mask.sum(1).mean().item(),
                "missing_eos": (~ended).float().mean().item(),
                "learning_rate": lr,
                **{name: sum(v) / len(v) for name, v in stats.items()},
                **{_component(name): sum(v) / len(v) for name, v in components.items()},
            }
            for name, value in current.items():
                window.setdefault(name, []).append(value)
            progress.step(update)
            if update % cfg.logging_steps == 0 or update == num_updates:
                metrics, window = ranks.mean({f"ppo/train/{name}": sum(v) / len(v) for name, v in window.items()}), {}
                if ranks.main:
                    progress.log(update, {k: metrics[k] for k in ("ppo/train/reward", "ppo/train/kl")})
                    if log_metrics is not None:
                        log_metrics(metrics, update)
                hooks("on_log", logs={name.removeprefix("ppo/train/"): value for name, value in metrics.items()})
            if sample_every and (update - 1) % sample_every == 0 and ranks.main:
                table = [
                    {
                        "update": update,
                        "prompt": prompts[i],
                        "completion": tokenizer.decode(responses[j]),
                        "ended": bool(ended[j]),
                        "score": scores[j].item(),
                        **{_component(name): component[j] for name, component in components.items()},
                    }
                    for j, i in enumerate(rows[:SAMPLE_ROWS])
                ]
                work_dir.mkdir(parents=True, exist_ok=True)
                with samples.open("a") as f:
                    f.writelines(json.dumps(row) + "\n" for row in table)
            if probe is not None and (update % cfg.eval_steps == 0 or update == num_updates):
                heldout = probe(policy, seed=cfg.seed)
                keeper.record(update, heldout, policy)
                progress.log(
                    update,
                    {f"ppo/heldout/{k}": heldout[k] for k in ("exact_match", "proxy_reward", "kl") if k in heldout},
                )
                if log_metrics is not None:
                    log_metrics({f"ppo/heldout/{name}": value for name, value in heldout.items()}, update)
            terminated = stop_requested()  # SIGTERM: a checkpoint now, then stop (every rank agrees)
            stop = terminated or ranks.any(
                hooks.control.should_training_stop
            )  # a callback ended training: publish what we have, as the Trainer does
            if update % cfg.save_steps == 0 or update == num_updates or hooks.control.should_save or terminated:
                state.update(update=update, metrics=metrics)
                save_checkpoint(work_dir, update, policy, value_model, optimizer, scheduler, state, ranks)
                hooks.control.should_save = False
                hooks("on_save")
            if stop:
                break

    progress.close()
    if terminated:
        ranks.close()
        raise Terminated(
            f"ppo: stopped by SIGTERM after update {update}; the next attempt resumes from checkpoint-{update}"
        )
    # The closing summary the Trainer logs too, then the end of training.
    hooks("on_log", logs={"train_runtime": time.monotonic() - started, "train_updates": update - first})
    hooks("on_train_end")
    if ranks.main:  # the weights are the same on every rank
        kept = keeper.restore(policy, update) if probe is not None else {}
        if kept:
            kept["chosen_on_rows"] = list(probe.rows)
        write_outcome(out_dir, update, num_updates)
        if kept:  # which probe's policy is published, and why
            add_outcome(out_dir, kept)
            PROGRESS.info(
                f"ppo: published the policy of update {kept['kept_step']} (held-out proxy reward - disagreement "
                f"{kept['kept_score']:.4f})"
            )
            metrics = metrics | {"ppo/heldout/kept_step": float(kept["kept_step"])}
        keeper.publish(out_dir)
        save_model(policy, tokenizer, out_dir / "model", keep_adapter=cfg.lora.keep_adapter)
        if cfg.save_value_model:
            save_model(value_model, tokenizer, out_dir / "value_model")
        if samples.is_file():
            shutil.copyfile(samples, out_dir / "samples.jsonl")
    ranks.close()
    return metrics


def _models(cfg: PpoConfig, sft_model: Path, reward_model: Path | None, tokenizer, device, ranks: Ranks):
    """The policy (from SFT, with LoRA as configured), the frozen reference (None under LoRA: the policy with its
    adapters off, or the frozen copy of a stacked adapter) and the value model, on `device` and identical on every
    rank."""
    import numpy as np
    import torch

    from rlhf_pipeline.trainers.models.handoff import upstream_policy
    from rlhf_pipeline.trainers.models.load import has_adapter, load_causal_lm, load_sequence_classifier

    random.seed(cfg.seed)  # the same on every rank: the value head's fresh init must not differ between ranks
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    # In the dtype its folder was saved in (float32 unless model.dtype says otherwise); an sft adapter merged or stacked
    # (lora.handoff).
    policy, _, peft_config = upstream_policy(sft_model, cfg.lora, attn_implementation=cfg.attn_implementation)
    # under LoRA the reference is the policy with its adapters disabled, or with the frozen copy of a stacked one
    reference = None
    if peft_config is None and has_adapter(
        sft_model
    ):  # stacked: the sft adapter trains on; a frozen copy of it is the reference
        policy.add_adapter("ref", policy.peft_config["default"])
        for name, param in policy.named_parameters():
            if ".default." in name:
                policy.get_parameter(name.replace(".default.", ".ref.")).data.copy_(param.data)
        policy.set_adapter("default")
    elif cfg.lora.enabled:
        import peft

        policy = peft.get_peft_model(policy, peft_config)
    else:
        reference = load_causal_lm(sft_model, cfg.lora.handoff, cfg.attn_implementation)[0].requires_grad_(False)
    # Value model: the reward model, trained on (InstructGPT §3.5, N+ §7); else the SFT model with a fresh scalar
    # head.
    value_model = load_sequence_classifier(reward_model or sft_model, attn_implementation=cfg.attn_implementation)
    value_model.config.pad_token_id = tokenizer.pad_token_id
    # eval(): dropout off (N+ §4), so rollout and update log-probs agree
    for model in (policy, reference, value_model):
        if model is not None:
            model.to(device).eval()
    if ranks.world > 1:  # each rank then samples rollouts of its own; rank 0's weights are every rank's (as DDP starts)
        ranks.broadcast([policy, value_model])
        random.seed(cfg.seed + ranks.rank)
        np.random.seed(cfg.seed + ranks.rank)
        torch.manual_seed(cfg.seed + ranks.rank)
    return policy, reference, value_model


def _optimizer(
    cfg: PpoConfig, params: list, policy, value_model, num_updates: int, device, work_dir: Path, callbacks: bool
):
    """The optimizer of both trained models, its scheduler (None: the loop's linear/constant schedule) and the stage's
    TrainingArguments (None unless something reads them)."""
    import torch

    from rlhf_pipeline.trainers.runtime.custom import make_optimizer

    # The stage's TrainingArguments, as a TRL stage's: what an optimizer_factory, a named optimizer and the callbacks
    # receive (steps are updates). Built only for them: importing transformers' training_args (with peft and accelerate)
    # takes ~2.4 s of a cold start on 2 cores, a launched rank's or a standalone run's, and the default loop needs none
    # of it.
    args = None
    if callbacks or cfg.optimizer_factory or cfg.optim != "adamw_torch":
        from transformers import TrainingArguments

        args = TrainingArguments(
            output_dir=str(work_dir),
            learning_rate=cfg.learning_rate,
            max_steps=num_updates,
            logging_steps=cfg.logging_steps,
            save_steps=cfg.save_steps,
            seed=cfg.seed,
            max_grad_norm=cfg.max_grad_norm,
            lr_scheduler_type=cfg.lr_scheduler_type,
            adam_epsilon=1e-5,
            weight_decay=0.0,
            use_cpu=device.type == "cpu",
            report_to="none",
            optim=cfg.optim,
        )
    scheduler = None  # None: the linear/constant schedule below, over the updates
    if cfg.optimizer_factory:
        # One optimizer for both trained models (as ours); a scheduler it returns is stepped once per update, as TRL's
        # PPOTrainer did.
        optimizer, scheduler = make_optimizer(
            cfg.optimizer_factory, torch.nn.ModuleDict({"policy": policy, "value_model": value_model}), args
        )
    elif cfg.optim != "adamw_torch":
        optimizer = named_optimizer(args, params, policy)
    else:
        # eps 1e-5 as in CleanRL / N+ code; fused: one kernel over all parameters (3x faster steps on CPU than torch's
        # default there)
        fused = device.type in ("cpu", "cuda") and all(
            p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params
        )
        optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, eps=1e-5, weight_decay=0.0, fused=fused or None)
    return optimizer, scheduler, args


def _reference_of(policy):
    """The reference policy, inside the LoRA policy: the frozen 'ref' copy of a stacked adapter, else the adapters
    disabled."""
    from trl.trainer.utils import use_adapter

    return use_adapter(policy, "ref" if "ref" in policy.peft_config else None)


def named_optimizer(args, params: list, policy):
    """The optimizer transformers builds for `args.optim` (its own classes and arguments), over policy and value
    parameters without weight decay (as ours). Optimizers that take over the model (GaLore, LOMO, ...) are the Trainer's
    alone."""
    from transformers import Trainer

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, policy)
    taken = sorted({"params", "model", "optimizer_dict"} & set(kwargs))
    if taken or not isinstance(cls, type):
        raise ValueError(
            f"ppo.optim={args.optim!r} builds its optimizer from the model itself; our ppo takes optimizers over "
            "parameters (use optimizer_factory)"
        )
    return cls([{"params": params, "weight_decay": 0.0}], **kwargs)


def _component(name: str) -> str:
    """A reward component's metric name: `reward_model`, `reward_<function name>`."""
    return f"reward_{name.removeprefix('reward_')}"
