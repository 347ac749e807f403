"""`ppo`'s models and optimizer: the policy, its frozen reference and the value model, identical on every rank; one
optimizer over both trained models (ours, a named one of transformers', or the user's factory)."""

from __future__ import annotations

import random
from pathlib import Path

from rlhf_pipeline.trainers.ppo.config import PpoConfig
from rlhf_pipeline.trainers.ppo.parallel import Ranks


def load_models(cfg: PpoConfig, sft_model: Path, reward_model: Path | None, tokenizer, device, ranks: Ranks):
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
    # Stacked: the sft adapter trains on; a frozen copy of it is the reference
    if peft_config is None and has_adapter(sft_model):
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


def build_optimizer(
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
