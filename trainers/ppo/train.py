"""Proximal policy optimisation for RLHF, written here from the papers (TRL removed its PPOTrainer in 1.13).

One update: sample a batch of completions -> score them -> per-token rewards with a KL penalty
-> GAE -> `num_ppo_epochs` passes of clipped policy and value losses over `num_mini_batches`.
The math is in small pure functions on tensors (losses.py); `train` reads as the algorithm: set up, then per update a
rollout, the optimisation epochs, the logs and checkpoints; then publish. References:
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
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlhf_pipeline.trainers.config import LogMetrics
from rlhf_pipeline.trainers.ppo.config import PpoConfig
from rlhf_pipeline.trainers.ppo.losses import (
    adapted_kl_coef,
    compute_gae,
    explained_variance,
    kl_shaped_rewards,
    masked_mean,
    policy_loss,
    value_loss,
    whiten,
)
from rlhf_pipeline.trainers.ppo.models import build_optimizer, load_models
from rlhf_pipeline.trainers.ppo.parallel import Ranks, cpu_threads, load_checkpoint, save_checkpoint, tf32
from rlhf_pipeline.trainers.ppo.rollout import (
    reference_of,
    response_logprobs,
    response_values,
    sample_completions,
    stop_ids,
)
from rlhf_pipeline.trainers.rewards.mix import GoldMetric, RewardsConfig
from rlhf_pipeline.trainers.runtime.progress import PROGRESS, Progress
from rlhf_pipeline.trainers.runtime.stopping import Terminated, stop_requested

SAMPLE_ROWS = 8
"""Rollouts per sample table (the first of the batch)."""


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
    run = _setup(cfg, rewards, sft_model, reward_model, data_dir, out_dir, work_dir, log_metrics, gold)
    run.hooks("on_train_begin")
    started, first = time.monotonic(), run.state["update"]
    update, terminated = first, False
    with cpu_threads(cfg.num_threads), tf32(cfg.tf32):
        for update in range(run.state["update"] + 1, run.num_updates + 1):
            lr = _scheduled_lr(run, update)
            rows = run.next_rows()[run.ranks.rank :: run.ranks.world]  # this rank's share of the rollout batch
            # 1. Roll out, score, and turn the scores into per-token advantages.
            rollout = _rollout(run, rows)
            # 2. `num_ppo_epochs` passes over shuffled mini-batches (Schulman et al. 2017, Algorithm 1).
            stats = _optimise(run, rollout)
            _end_update(run, update, rollout)
            # 3. Metrics (averaged over the `logging_steps` window), sample tables and checkpoints.
            terminated, stop = _log_and_save(run, update, rollout, stats, lr)
            if stop:
                break
    run.progress.close()
    if terminated:
        run.ranks.close()
        raise Terminated(
            f"ppo: stopped by SIGTERM after update {update}; the next attempt resumes from checkpoint-{update}"
        )
    return _publish(run, update, time.monotonic() - started, update - first)


@dataclass
class PpoRun:
    """Everything one `ppo` stage trains with, set up once (`_setup`) and read by each phase of an update."""

    cfg: PpoConfig
    prompts: list
    columns: dict[str, list]
    prompt_ids: list[list[int]]
    tokenizer: Any
    scorer: Any
    policy: Any
    reference: Any
    value_model: Any
    params: list
    optimizer: Any
    scheduler: Any
    base_lrs: list[float]
    autocast: Callable
    scaler: Any
    state: dict
    keeper: Any
    probe: Any
    hooks: Any
    progress: Progress
    ranks: Ranks
    device: Any
    stops: list[int]
    eos_penalty: float
    sample_every: int | None
    num_updates: int
    local_batch: int
    samples: Path
    work_dir: Path
    out_dir: Path
    log_metrics: LogMetrics | None
    metrics: dict[str, float]
    window: dict[str, list[float]] = field(default_factory=dict)

    def completions(self, texts: list[str], rows: list[int]) -> list:
        """Messages for conversational prompts, as TRL passes them."""
        from rlhf_pipeline.trainers.rewards.mix import as_completions

        return as_completions([self.prompts[i] for i in rows], texts)

    def next_rows(self) -> list[int]:
        """The next batch of a per-epoch shuffle; (data_epoch, data_index) is the iterator's position."""
        import torch

        state, batch_size = self.state, self.cfg.rollout_batch_size
        if state["data_index"] + batch_size > len(self.prompts):
            state["data_epoch"], state["data_index"] = state["data_epoch"] + 1, 0
        generator = torch.Generator().manual_seed(self.cfg.seed + state["data_epoch"])
        order = torch.randperm(len(self.prompts), generator=generator)
        state["data_index"] += batch_size
        return order[state["data_index"] - batch_size : state["data_index"]].tolist()


@dataclass
class Rollout:
    """One update's rollouts, as scored: the sampled completions, their log-probabilities under the policy and the
    reference, the values, the scores and their components, the KL, and the advantages and returns (`_rollout`)."""

    rows: list[int]
    inputs: dict
    mask: Any
    ended: Any
    width: int
    logprobs: Any
    entropy: Any
    values: Any
    responses: list[list[int]]
    scores: Any
    components: dict[str, list[float]]
    kl: Any
    kl_coef: float
    advantages: Any
    returns: Any


def _setup(
    cfg: PpoConfig,
    rewards: RewardsConfig,
    sft_model: Path,
    reward_model: Path | None,
    data_dir: Path,
    out_dir: Path,
    work_dir: Path,
    log_metrics: LogMetrics | None,
    gold: GoldMetric | None,
) -> PpoRun:
    """Config, data and tokenizers checked before any model loads; then models, optimizer, checkpoint, probe, hooks."""
    from rlhf_pipeline.trainers.algorithms.loop import last_checkpoint
    from rlhf_pipeline.trainers.config import device_precision
    from rlhf_pipeline.trainers.models.text import prompt_ids as render_prompt
    from rlhf_pipeline.trainers.rewards.probes import Keeper

    prompts, columns, tokenizer, num_updates = _checked_data(cfg, rewards, sft_model, reward_model, data_dir)
    device, ranks, scorer = _device_and_scorer(cfg, rewards, sft_model, reward_model, prompts, columns)
    bf16 = device_precision(cfg.bf16, cfg.fp16, cfg.tf32)  # a precision the device lacks fails here, naming it
    from rlhf_pipeline.trainers.attention import check_device

    check_device(cfg.attn_implementation)  # and an attention it cannot run
    policy, reference, value_model = load_models(cfg, sft_model, reward_model, tokenizer, device, ranks)
    callbacks = cfg.user_callbacks()
    optimising = _optimising(cfg, policy, value_model, num_updates, device, work_dir, bool(callbacks), bf16)
    params, optimizer, scheduler, args = optimising[:4]
    state = {"update": 0, "data_epoch": 0, "data_index": 0, "metrics": {}, "kl_coef": cfg.kl_coef}
    if checkpoint := last_checkpoint(work_dir):
        state = {"kl_coef": cfg.kl_coef} | load_checkpoint(
            Path(checkpoint), policy, value_model, optimizer, scheduler, ranks.rank
        )
    keeper = Keeper(work_dir, cfg.keep_best, reward_model if rewards.uses_reward_model else None)
    probe = _probe(cfg, rewards, sft_model, reward_model, data_dir, device, ranks, policy, reference, gold)
    if probe is not None:
        keeper.resume(state["update"])
    ranks.barrier()
    samples = _samples_so_far(work_dir, ranks, state["update"])
    progress = Progress("ppo", num_updates, state["update"], main=ranks.main)
    hooks = _hooks(callbacks, args, num_updates, state, policy, tokenizer, optimizer, scheduler, ranks)
    local_batch = cfg.rollout_batch_size // ranks.world  # this rank's rollouts per update
    if ranks.world > 1 and ranks.main:
        PROGRESS.info(
            f"ppo: world size {ranks.world} (data-parallel, {'gloo' if device.type == 'cpu' else 'nccl'}), "
            f"{local_batch} rollouts per rank per update"
        )
    return PpoRun(
        cfg=cfg,
        prompts=prompts,
        columns=columns,
        prompt_ids=[render_prompt(tokenizer, p) for p in prompts],
        tokenizer=tokenizer,
        scorer=scorer,
        policy=policy,
        reference=reference,
        value_model=value_model,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        base_lrs=optimising[4],
        autocast=optimising[5],
        scaler=optimising[6],
        state=state,
        keeper=keeper,
        probe=probe,
        hooks=hooks,
        progress=progress,
        ranks=ranks,
        device=device,
        stops=stop_ids(cfg, tokenizer),
        eos_penalty=cfg.eos_penalty(rewards),
        sample_every=cfg.sample_every(num_updates),
        num_updates=num_updates,
        local_batch=local_batch,
        samples=samples,
        work_dir=work_dir,
        out_dir=out_dir,
        log_metrics=log_metrics,
        metrics=state["metrics"],
    )


def _optimising(cfg: PpoConfig, policy, value_model, num_updates: int, device, work_dir: Path, callbacks: bool, bf16):
    """The trained parameters, the optimizer and its scheduler, the TrainingArguments (None unless something reads
    them), the base learning rates (before a checkpoint overwrites them with scheduled values), the autocast context
    and the gradient scaler (float16 gradients underflow without loss scaling)."""
    import torch

    params = [p for m in (policy, value_model) for p in m.parameters() if p.requires_grad]
    optimizer, scheduler, args = build_optimizer(
        cfg, params, policy, value_model, num_updates, device, work_dir, callbacks
    )
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    dtype = torch.float16 if cfg.fp16 else torch.bfloat16
    autocast = lambda: torch.autocast(device.type, dtype=dtype, enabled=bf16 or cfg.fp16)  # noqa: E731
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.fp16)
    return params, optimizer, scheduler, args, base_lrs, autocast, scaler


def _checked_data(cfg: PpoConfig, rewards: RewardsConfig, sft_model: Path, reward_model: Path | None, data_dir: Path):
    """The prompts and their other columns, the policy's tokenizer and the number of updates, checked."""
    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.models.load import load_tokenizer

    if rewards.uses_reward_model and reward_model is None:
        raise ValueError(f"rewards.reward_model_weight={rewards.reward_model_weight} but no reward model was given")
    dataset = load_split(data_dir, "prompts")
    if "prompt" not in dataset.column_names:
        raise ValueError(f"prompts has no 'prompt' column (columns: {dataset.column_names})")
    if len(dataset) < cfg.rollout_batch_size:
        raise ValueError(f"prompts has {len(dataset)} rows, fewer than rollout_batch_size={cfg.rollout_batch_size}")
    num_updates = cfg.num_updates(len(dataset))
    prompts = list(dataset["prompt"])  # each update indexes rows: a datasets Column reads each from Arrow (~0.2 ms)
    columns = {name: list(dataset[name]) for name in dataset.column_names if name != "prompt"}
    tokenizer = load_tokenizer(sft_model)
    stop_ids(cfg, tokenizer)  # a stop token the tokenizer lacks fails here
    return prompts, columns, tokenizer, num_updates


def _device_and_scorer(cfg: PpoConfig, rewards: RewardsConfig, sft_model, reward_model, prompts: list, columns: dict):
    """This rank's device and the ranks; the reward model's tokenizer is checked, and a broken reward function fails
    with its name, before the policy loads."""
    import torch

    from rlhf_pipeline.trainers.rewards.mix import RewardScorer, as_completions

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ranks = Ranks(cpu=device.type == "cpu")
    if device.type == "cuda":
        device = torch.device("cuda", ranks.local)
        torch.cuda.set_device(device)
    batch_size = cfg.rollout_batch_size
    if batch_size % ranks.world or (batch_size // ranks.world) % cfg.num_mini_batches:
        raise ValueError(
            f"rollout_batch_size={batch_size} must split into {ranks.world} ranks x "
            f"num_mini_batches={cfg.num_mini_batches} equal mini-batches"
        )
    scorer = RewardScorer(rewards, reward_model, device, policy_model=sft_model)
    sample = list(range(min(4, len(prompts))))
    scorer.check(
        [prompts[i] for i in sample],
        as_completions([prompts[i] for i in sample], ["0"] * len(sample)),
        {k: [v[i] for i in sample] for k, v in columns.items()},
    )
    return device, ranks, scorer


def _probe(cfg: PpoConfig, rewards, sft_model, reward_model, data_dir, device, ranks: Ranks, policy, reference, gold):
    """The held-out curves (rank 0 alone: every rank holds the same weights); None without `eval_steps`."""
    from rlhf_pipeline.trainers.rewards.probes import Probe

    if not (cfg.eval_steps and ranks.main):
        return None
    probe = Probe(
        "ppo",
        data_dir,
        sft_model,
        reward_model,
        rewards,
        cfg,
        cfg.response_length,
        device,
        reference=(lambda: reference_of(policy)) if reference is None else None,
        gold=gold,
    )
    if reference is not None:
        probe.reference = reference  # the PPO reference is the SFT model already
    return probe


def _samples_so_far(work_dir: Path, ranks: Ranks, update: int) -> Path:
    """The sample tables, beside the checkpoints so a resumed run keeps those written before it; tables of updates
    after the checkpoint are written again. Half-written checkpoints go."""
    for stale in work_dir.glob(".checkpoint-*.tmp") if work_dir.is_dir() and ranks.main else []:
        shutil.rmtree(stale, ignore_errors=True)
    samples = work_dir / "samples.jsonl"
    if samples.is_file() and ranks.main:
        kept = [line for line in samples.read_text().splitlines() if json.loads(line)["update"] <= update]
        samples.write_text("".join(line + "\n" for line in kept))
    return samples


def _hooks(callbacks, args, num_updates: int, state: dict, policy, tokenizer, optimizer, scheduler, ranks):
    """The user's callbacks, called as the Trainer calls them (steps are updates)."""
    from rlhf_pipeline.trainers.runtime.custom import Hooks

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
    return hooks


def _scheduled_lr(run: PpoRun, update: int) -> float:
    """The learning rate of this update: the scheduler's, else linear to 0 over the updates (or constant)."""
    if run.scheduler is None:
        factor = 1 - (update - 1) / run.num_updates if run.cfg.lr_scheduler_type == "linear" else 1.0
        for group, base in zip(run.optimizer.param_groups, run.base_lrs):
            group["lr"] = base * factor
    return run.optimizer.param_groups[0]["lr"]


def _rollout(run: PpoRun, rows: list[int]) -> Rollout:
    """Sample, score, and turn the scores into per-token advantages (no gradients)."""
    import torch

    cfg, policy, tokenizer, reference = run.cfg, run.policy, run.tokenizer, run.reference
    with torch.no_grad(), run.autocast():
        inputs, mask, ended, logprobs, entropy = sample_completions(
            policy, tokenizer, [run.prompt_ids[i] for i in rows], cfg, run.stops, run.device
        )
        width = mask.shape[1]
        if logprobs is None:  # without `rollout_logprobs`: one more forward pass of the policy
            logprobs, entropy = response_logprobs(policy, inputs, width, cfg.temperature, with_entropy=True)
        with reference_of(policy) if reference is None else contextlib.nullcontext():
            ref_logprobs, _ = response_logprobs(
                policy if reference is None else reference, inputs, width, cfg.temperature
            )
        values = response_values(run.value_model, inputs, width)
        # The reward model reads the ids as sampled, up to and including the stop token (N+ §4): no decode and
        # re-encode, and a cut-off answer gets no EOS. Reward functions read the text, without the stop token.
        lengths = mask.sum(1).long().tolist()
        responses = [ids[:n].tolist() for ids, n in zip(inputs["input_ids"][:, -width:], lengths)]
        texts = [
            tokenizer.decode(ids[: len(ids) - int(end)], skip_special_tokens=True)
            for ids, end in zip(responses, ended.tolist())
        ]
        total, components = run.scorer(
            [run.prompts[i] for i in rows],
            run.completions(texts, rows),
            {k: [v[i] for i in rows] for k, v in run.columns.items()},
            ids=[run.prompt_ids[i] + ids for i, ids in zip(rows, responses)],
        )
        # N+ §7: the EOS trick
        scores = torch.tensor(total, device=run.device, dtype=torch.float) - run.eos_penalty * (~ended).float()
        kl_coef = run.state["kl_coef"]
        token_rewards, kl = kl_shaped_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, cfg.kl_estimator)
        if cfg.whiten_rewards:
            token_rewards = whiten(token_rewards, mask, shift_mean=False)
        advantages, returns = compute_gae(token_rewards, values, mask, cfg.gamma, cfg.lam)
        advantages = whiten(advantages, mask)  # advantage normalisation (N+ §7)
    return Rollout(
        rows,
        inputs,
        mask,
        ended,
        width,
        logprobs,
        entropy,
        values,
        responses,
        scores,
        components,
        kl,
        kl_coef,
        advantages,
        returns,
    )


def _optimise(run: PpoRun, rollout: Rollout) -> dict[str, list[float]]:
    """`num_ppo_epochs` passes of the clipped policy and value losses over shuffled mini-batches; each loss's values."""
    import torch

    cfg, r = run.cfg, rollout
    stats: dict[str, list[float]] = {
        name: [] for name in ("policy_loss", "value_loss", "clipfrac", "approx_kl", "value_clipfrac", "ratio")
    }
    for _ in range(cfg.num_ppo_epochs):
        for idx in torch.randperm(run.local_batch, device=run.device).split(run.local_batch // cfg.num_mini_batches):
            mini = {k: v[idx] for k, v in r.inputs.items()}
            with run.autocast():
                new_logprobs, _ = response_logprobs(run.policy, mini, r.width, cfg.temperature)
                new_values = response_values(run.value_model, mini, r.width)
            pg_loss, clipfrac, approx_kl = policy_loss(
                new_logprobs, r.logprobs[idx], r.advantages[idx], r.mask[idx], cfg.cliprange
            )
            vf_loss, vf_clipfrac = value_loss(
                new_values, r.values[idx], r.returns[idx], r.mask[idx], cfg.cliprange_value
            )
            ratio = masked_mean(torch.exp(new_logprobs.detach() - r.logprobs[idx]), r.mask[idx])
            run.optimizer.zero_grad(set_to_none=True)
            run.scaler.scale(pg_loss + cfg.vf_coef * vf_loss).backward()
            run.ranks.average_gradients(run.params)
            run.scaler.unscale_(run.optimizer)
            torch.nn.utils.clip_grad_norm_(run.params, cfg.max_grad_norm)
            run.scaler.step(run.optimizer)
            run.scaler.update()
            for name, value in zip(stats, (pg_loss, vf_loss, clipfrac, approx_kl, vf_clipfrac, ratio)):
                stats[name].append(value.item())
    return stats


def _end_update(run: PpoRun, update: int, rollout: Rollout) -> None:
    """The scheduler's step, the next update's KL coefficient (from this batch's KL, the same on every rank:
    averaged), and the callbacks' step end."""
    cfg = run.cfg
    if run.scheduler is not None:
        run.scheduler.step()
    if cfg.target_kl is not None:
        mean_kl = run.ranks.mean({"kl": rollout.kl.sum(1).mean().item()})["kl"]
        run.state["kl_coef"] = adapted_kl_coef(
            rollout.kl_coef, mean_kl, cfg.target_kl, cfg.rollout_batch_size, cfg.kl_horizon
        )
    run.hooks.state.global_step = update
    run.hooks("on_step_end")


def _log_and_save(run: PpoRun, update: int, rollout: Rollout, stats: dict, lr: float) -> tuple[bool, bool]:
    """Metrics (averaged over the `logging_steps` window), sample tables, the held-out probe and checkpoints; returns
    (terminated by SIGTERM, training ends)."""
    cfg, r = run.cfg, rollout
    current = {
        "reward": r.scores.mean().item(),
        "kl": r.kl.sum(1).mean().item(),  # KL(policy || reference) per completion, as N+ §7 and TRL report it
        "non_score_reward": (-r.kl_coef * r.kl).sum(1).mean().item(),  # TRL's objective/non_score_reward
        "kl_coef": r.kl_coef,
        "entropy": masked_mean(r.entropy, r.mask).item(),
        "explained_variance": explained_variance(r.values, r.returns, r.mask),
        "response_length": r.mask.sum(1).mean().item(),
        "missing_eos": (~r.ended).float().mean().item(),
        "learning_rate": lr,
        **{name: sum(v) / len(v) for name, v in stats.items()},
        **{_component(name): sum(v) / len(v) for name, v in r.components.items()},
    }
    for name, value in current.items():
        run.window.setdefault(name, []).append(value)
    run.progress.step(update)
    if update % cfg.logging_steps == 0 or update == run.num_updates:
        window = {f"ppo/train/{name}": sum(v) / len(v) for name, v in run.window.items()}
        run.metrics, run.window = run.ranks.mean(window), {}
        if run.ranks.main:
            run.progress.log(update, {k: run.metrics[k] for k in ("ppo/train/reward", "ppo/train/kl")})
            if run.log_metrics is not None:
                run.log_metrics(run.metrics, update)
        run.hooks("on_log", logs={name.removeprefix("ppo/train/"): value for name, value in run.metrics.items()})
    if run.sample_every and (update - 1) % run.sample_every == 0 and run.ranks.main:
        _write_samples(run, update, r)
    if run.probe is not None and (update % cfg.eval_steps == 0 or update == run.num_updates):
        heldout = run.probe(run.policy, seed=cfg.seed)
        run.keeper.record(update, heldout, run.policy)
        shown = {f"ppo/heldout/{k}": heldout[k] for k in ("exact_match", "proxy_reward", "kl") if k in heldout}
        run.progress.log(update, shown)
        if run.log_metrics is not None:
            run.log_metrics({f"ppo/heldout/{name}": value for name, value in heldout.items()}, update)
    terminated = stop_requested()  # SIGTERM: a checkpoint now, then stop (every rank agrees)
    # A callback ended training: publish what we have, as the Trainer does.
    stop = terminated or run.ranks.any(run.hooks.control.should_training_stop)
    if update % cfg.save_steps == 0 or update == run.num_updates or run.hooks.control.should_save or terminated:
        run.state.update(update=update, metrics=run.metrics)
        save_checkpoint(
            run.work_dir, update, run.policy, run.value_model, run.optimizer, run.scheduler, run.state, run.ranks
        )
        run.hooks.control.should_save = False
        run.hooks("on_save")
    return terminated, stop


def _write_samples(run: PpoRun, update: int, rollout: Rollout) -> None:
    """The first `SAMPLE_ROWS` rollouts of this update, appended to the sample tables."""
    table = [
        {
            "update": update,
            "prompt": run.prompts[i],
            "completion": run.tokenizer.decode(rollout.responses[j]),
            "ended": bool(rollout.ended[j]),
            "score": rollout.scores[j].item(),
            **{_component(name): component[j] for name, component in rollout.components.items()},
        }
        for j, i in enumerate(rollout.rows[:SAMPLE_ROWS])
    ]
    run.work_dir.mkdir(parents=True, exist_ok=True)
    with run.samples.open("a") as f:
        f.writelines(json.dumps(row) + "\n" for row in table)


def _publish(run: PpoRun, update: int, seconds: float, updates: int) -> dict[str, float]:
    """The closing summary the Trainer logs too, the end of training, then (rank 0: the weights are the same on every
    rank) the kept or last policy, its outcome, the value model and the sample tables."""
    from rlhf_pipeline.trainers.algorithms.loop import add_outcome, write_outcome
    from rlhf_pipeline.trainers.models.load import save_model

    run.hooks("on_log", logs={"train_runtime": seconds, "train_updates": updates})
    run.hooks("on_train_end")
    metrics, out_dir = run.metrics, run.out_dir
    if run.ranks.main:
        kept = run.keeper.restore(run.policy, update) if run.probe is not None else {}
        if kept:
            kept["chosen_on_rows"] = list(run.probe.rows)
        write_outcome(out_dir, update, run.num_updates)
        if kept:  # which probe's policy is published, and why
            add_outcome(out_dir, kept)
            PROGRESS.info(
                f"ppo: published the policy of update {kept['kept_step']} (held-out proxy reward - disagreement "
                f"{kept['kept_score']:.4f})"
            )
            metrics = metrics | {"ppo/heldout/kept_step": float(kept["kept_step"])}
        run.keeper.publish(out_dir)
        save_model(run.policy, run.tokenizer, out_dir / "model", keep_adapter=run.cfg.lora.keep_adapter)
        if run.cfg.save_value_model:
            save_model(run.value_model, run.tokenizer, out_dir / "value_model")
        if run.samples.is_file():
            shutil.copyfile(run.samples, out_dir / "samples.jsonl")
    run.ranks.close()
    return metrics


def _component(name: str) -> str:
    """A reward component's metric name: `reward_model`, `reward_<function name>`."""
    return f"reward_{name.removeprefix('reward_')}"
