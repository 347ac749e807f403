"""What GRPO and RLOO share: group sampling settings and the TRL training call.

Both sample `num_generations` completions per prompt, score them with the
rewards of `trainers/rewards/mix.py` and push up the better ones relative to the
group (GRPO: Shao et al. 2024, eq. 3; RLOO: Ahmadian et al. 2024, eq. 5).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from rlhf_pipeline.trainers.algorithms.fields import TrainingConfig
from rlhf_pipeline.trainers.config import LogMetrics
from rlhf_pipeline.trainers.rewards.mix import GoldMetric, RewardsConfig
from rlhf_pipeline.trainers.rewards.probes import ProbeFields


class OnlineConfig(ProbeFields, TrainingConfig):
    learning_rate: float = Field(1e-6, gt=0, description="Peak learning rate (TRL GRPO/RLOO default 1e-6).")
    per_device_train_batch_size: int = Field(8, ge=1, description="Completions (not prompts) per device per step.")
    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (the group).")
    max_completion_length: int = Field(256, ge=1, description="Longest sampled completion, in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts.")
    num_iterations: int = Field(1, ge=1, description="Optimisation passes over each generated batch (mu).")
    epsilon: float = Field(0.2, gt=0, description="Clipping range of the policy ratio.")
    use_vllm: bool = Field(
        False,
        description=(
            "Generate the rollouts with vLLM in the training processes (TRL's colocate mode; CUDA GPU, the [vllm] "
            "extra). Off: transformers' generate."
        ),
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="Share of each GPU's memory vLLM may take (colocate mode)."
    )

    @model_validator(mode="after")
    def _vllm_installed(self):
        if self.use_vllm:
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                raise ValueError(
                    "use_vllm=true needs vLLM, which is not installed: pip install 'rlhf-pipeline[vllm]' (the vLLM "
                    "TRL 1.16 supports) on a CUDA machine"
                )
        return self

    @model_validator(mode="after")
    def _group_fits_the_batch(self):
        generation_batch = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if generation_batch % self.num_generations:
            raise ValueError(
                f"num_generations={self.num_generations} must divide the generation batch "
                f"per_device_train_batch_size * gradient_accumulation_steps = "
                f"{self.per_device_train_batch_size} * {self.gradient_accumulation_steps} = {generation_batch}"
            )
        return self

    def row_token_limit(self) -> int:
        """A prompt must leave room for the completion in max_length."""
        return self.max_length - self.max_completion_length

    def trl_kwargs(self) -> dict[str, Any]:
        """Fields specific to the algorithm (each subclass adds its own)."""
        return {}

    def vllm_kwargs(self) -> dict[str, Any]:
        """TRL's vLLM settings: colocated with training, in the same processes (no separate server to run)."""
        if not self.use_vllm:
            return {"use_vllm": False}
        import torch

        if not torch.cuda.is_available():
            raise ValueError("use_vllm=true: vLLM generates on a CUDA GPU, and this machine trains on cpu")
        return {
            "use_vllm": True,
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": self.vllm_gpu_memory_utilization,
        }


def train(
    stage: str,
    cfg: OnlineConfig,
    rewards: RewardsConfig,
    sft_model: Path,
    reward_model: Path | None,
    data_dir: Path,
    out_dir: Path,
    work_dir: Path,
    log_metrics: LogMetrics | None = None,
    gold: GoldMetric | None = None,
) -> dict[str, float]:
    """Train with TRL's GRPOTrainer (`stage="grpo"`) or RLOOTrainer (`stage="rloo"`) on `prompts`."""
    import trl

    from rlhf_pipeline.trainers.algorithms.loop import add_outcome, stage_callbacks, train_and_save
    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.models.handoff import upstream_policy
    from rlhf_pipeline.trainers.models.text import blank_generation_config
    from rlhf_pipeline.trainers.rewards.mix import trl_reward_funcs

    trainer_cls, config_cls = {"grpo": (trl.GRPOTrainer, trl.GRPOConfig), "rloo": (trl.RLOOTrainer, trl.RLOOConfig)}[
        stage
    ]
    prompts = load_split(data_dir, "prompts")
    # Reward functions are imported and called on a sample before the first step.
    reward_funcs, reward_weights = trl_reward_funcs(rewards, reward_model, prompts[:4])
    # The TRL config first: a combination TRL refuses fails before any weights load.
    args = config_cls(
        **cfg.trl_arguments(work_dir),
        num_generations=cfg.num_generations,
        max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature,
        num_iterations=cfg.num_iterations,
        epsilon=cfg.epsilon,
        reward_weights=reward_weights,
        **cfg.trl_kwargs(),
        **cfg.vllm_kwargs(),
    )
    policy, tokenizer, peft_config = upstream_policy(sft_model, cfg.lora, attn_implementation=cfg.attn_implementation)
    # TRL sets temperature, top_k, top_p and repetition_penalty from the config but leaves the rest (min_p,
    # typical_p, no_repeat_ngram_size...) to the checkpoint's generation_config: rollouts get a blank one,
    # which also names the stop tokens TRL reads (EOS and the template's end of turn); the saved policy keeps its own.
    shipped, policy.generation_config = policy.generation_config, blank_generation_config(policy, tokenizer)
    from transformers import PreTrainedModel

    callbacks = stage_callbacks(stage, log_metrics, cfg)
    probe = None
    if cfg.eval_steps:
        from rlhf_pipeline.trainers.rewards.probes import probe_callback

        probe_args = {
            "data_dir": data_dir,
            "sft_model": sft_model,
            "reward_model": reward_model,
            "rewards": rewards,
            "max_new_tokens": cfg.max_completion_length,
            "gold": gold,
        }
        probe = probe_callback(stage, cfg, probe_args, work_dir, log_metrics)
        callbacks.insert(1, probe)  # after the metrics callback, before the checkpoint marker and the user's
    trainer = decoding(trainer_cls)(
        model=policy,
        reward_funcs=reward_funcs,
        # A reward model passed as a model (rm's adapter, merged) reads the policy's tokenizer, which it shares (checked
        # at the edge).
        reward_processing_classes=[tokenizer if isinstance(f, PreTrainedModel) else None for f in reward_funcs],
        args=args,
        train_dataset=prompts,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
    metrics = train_and_save(stage, trainer, tokenizer, cfg, work_dir, out_dir, generation_config=shipped)
    if probe is not None and probe.probe is not None:
        probe.keeper.publish(out_dir)
        if probe.kept:
            add_outcome(out_dir, probe.kept)
            metrics[f"{stage}/heldout/kept_step"] = float(probe.kept["kept_step"])
    return metrics


def decoding(trainer_cls: type) -> type:
    """`trainer_cls` (TRL's GRPOTrainer or RLOOTrainer) with `Decoding`'s rollouts and time split, named as it."""
    return type(trainer_cls.__name__, (Decoding, trainer_cls), {})


# what Decoding's methods reach through `super()` and `self` is the TRL trainer's it comes before
_Trainer: Any = object


class Decoding(_Trainer):
    """A mixin before TRL's GRPOTrainer or RLOOTrainer (`decoding`): its rollouts drawn by `decode.decode` (continuous
    batching, docs/PERFORMANCE.md) where TRL would call transformers' `generate`: no vLLM, text only, and sampling
    at a temperature with top_p alone (a top_k, min_p or repetition penalty goes to `generate`, which applies them).
    GRPO is handed each token's log-probability as generation drew it, and logs how far the trainer's own lies from
    it (`sampling/sampling_logp_difference/mean` and `/max`, TRL's names for vLLM's); the ratio in the loss is the
    trainer's own either way (TRL's without vLLM). Each optimizer step logs where its time went, in seconds:
    `time/generation`, `time/reward`, `time/forward_backward` (the rest of its micro-batches' training steps) and
    `time/optimizer`."""

    def __init__(self, *args, **kwargs):
        import trl

        self._split = dict.fromkeys(("generation", "reward", "forward_backward"), 0.0)
        self._scored = isinstance(self, trl.GRPOTrainer)
        super().__init__(*args, **kwargs)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *more, **named):
        from rlhf_pipeline.trainers.models.decode import supports

        started = time.perf_counter()
        plain = not (self.top_k or self.min_p or self.repetition_penalty not in (None, 1.0))
        try:
            if self.use_vllm or images or multimodal_fields or not plain or not supports(self.model):
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, *more, **named)
            answers = self._decoded(prompt_ids)
            completions = [answer.tokens for answer in answers]
            return (completions, [answer.logprobs for answer in answers]) if self._scored else completions
        finally:
            self._split["generation"] += time.perf_counter() - started

    # --- where a step's time goes: generation, reward, forward and backward, the optimizer ---------------------

    def _calculate_rewards(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return super()._calculate_rewards(*args, **kwargs)
        finally:
            self._split["reward"] += time.perf_counter() - started

    def training_step(self, *args, **kwargs):
        before = self._split["generation"] + self._split["reward"]
        started = time.perf_counter()
        try:
            return super().training_step(*args, **kwargs)
        finally:
            inside = self._split["generation"] + self._split["reward"] - before
            self._split["forward_backward"] += time.perf_counter() - started - inside

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        stepped = optimizer.step

        def step(*step_args, **step_kwargs):  # one optimizer step: its time and the micro-batches' before it
            started = time.perf_counter()
            try:
                return stepped(*step_args, **step_kwargs)
            finally:
                metrics = self._metrics["train"]
                for part, seconds in self._split.items():
                    metrics[f"time/{part}"].append(seconds)
                    self._split[part] = 0.0
                metrics["time/optimizer"].append(time.perf_counter() - started)

        optimizer.step = step
        return optimizer

    def _decoded(self, prompt_ids: list[list[int]]):
        import torch
        from trl.extras.profiling import profiling_context
        from trl.models.utils import unwrap_model_for_generation

        from rlhf_pipeline.trainers.models.decode import Budget, decode

        budget = Budget(
            self.max_completion_length,
            tuple(self.eos_token_ids),
            sample=True,
            temperature=self.temperature,
            top_p=self.top_p,
            scores=self._scored,
        )
        with (
            profiling_context(self, "decode"),
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            return decode(unwrapped, [list(ids) for ids in prompt_ids], budget, rows=len(prompt_ids))

    def _compute_loss(self, model, inputs):
        self._sampled = (inputs.get("sampling_per_token_logps"), inputs.get("old_per_token_logps"), inputs)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._sampled = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        found = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        sampled = getattr(self, "_sampled", None)
        if sampled is not None and sampled[0] is not None:
            drawn, old, inputs = sampled
            self._sampled = None  # once per batch: the policy's own pass, not the reference's
            trainer = found[0].detach() if old is None else old
            mask = inputs["completion_mask"].bool() & ~drawn.isnan()
            delta = (trainer - drawn).abs()[mask]
            if delta.numel():
                mode = "train" if self.model.training else "eval"
                metrics = self._metrics[mode]
                metrics["sampling/sampling_logp_difference/mean"].append(
                    self.accelerator.gather(delta.mean()).mean().item()
                )
                metrics["sampling/sampling_logp_difference/max"].append(
                    self.accelerator.gather(delta.max()).max().item()
                )
        return found
