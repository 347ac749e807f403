"""`ppo`'s rollouts: the stop tokens, sampling with exactly the stage's settings, and the log-probabilities and values
of the sampled completions (N+: Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO", §4 and §7)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from rlhf_pipeline.trainers.ppo.config import PpoFields
from rlhf_pipeline.trainers.ppo.losses import truncate_at_stop

if TYPE_CHECKING:
    import torch


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


class Sampled(NamedTuple):
    """One batch of rollouts: inputs for prompt + completion, the completion mask, whether each reached a stop token,
    and, with `rollout_logprobs`, the sampled tokens' log-probabilities and the entropy as generation computed them."""

    inputs: dict
    mask: torch.Tensor
    ended: torch.Tensor
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def sample_completions(
    policy, tokenizer, prompt_ids: list[list[int]], cfg: PpoFields, stops: list[int], device
) -> Sampled:
    """Left-padded prompts (N+ §4) -> `Sampled`, drawn by `decode.decode` where it runs the policy, else by
    `generate`. No top-k/top-p/repetition penalty (and with `generate`, not even the model's generation_config's), so
    we sample from exactly the distribution whose log-probs we compute (N+ §7); with `rollout_logprobs` they are read
    from that distribution as generation drew from it (the logits divided by the temperature), as TRL's PPOTrainer
    did."""
    import torch

    from rlhf_pipeline.trainers.models.decode import supports
    from rlhf_pipeline.trainers.models.text import pad

    queries, query_mask = pad(prompt_ids, tokenizer.pad_token_id, left=True, device=device)
    if supports(policy):
        responses, logprobs, entropy = _decoded(policy, prompt_ids, cfg, stops, tokenizer.pad_token_id, device)
    else:
        responses, logprobs, entropy = _generated(policy, tokenizer, queries, query_mask, cfg, stops)
    responses, mask, ended = truncate_at_stop(responses, stops, tokenizer.pad_token_id)
    attention_mask = torch.cat([query_mask, mask.long()], 1)
    inputs = {
        "input_ids": torch.cat([queries, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),  # as `generate` numbers left-padded rows
    }
    return Sampled(inputs, mask.float(), ended, logprobs, entropy)


def _decoded(policy, prompt_ids: list[list[int]], cfg: PpoFields, stops: list[int], pad_id: int, device):
    """The completions by `decode.decode` (continuous batching), right-padded to the longest, with their tokens'
    log-probabilities and entropies under the tempered distribution when `rollout_logprobs` asks."""
    import torch

    from rlhf_pipeline.trainers.models.decode import Budget, decode

    budget = Budget(
        cfg.response_length, tuple(stops), sample=True, temperature=cfg.temperature, scores=cfg.rollout_logprobs
    )
    answers = decode(policy, prompt_ids, budget, rows=len(prompt_ids))
    width = max(len(answer.tokens) for answer in answers)
    responses = torch.full((len(answers), width), pad_id, dtype=torch.long, device=device)
    logprobs, entropy = torch.zeros(responses.shape, device=device), torch.zeros(responses.shape, device=device)
    for row, answer in enumerate(answers):
        responses[row, : len(answer.tokens)] = torch.tensor(answer.tokens, device=device)
        if cfg.rollout_logprobs:
            logprobs[row, : len(answer.tokens)] = torch.tensor(answer.logprobs, device=device)
            entropy[row, : len(answer.tokens)] = torch.tensor(answer.entropy, device=device)
    if not cfg.rollout_logprobs:
        return responses, None, None
    return responses, logprobs, entropy


def _generated(policy, tokenizer, queries, query_mask, cfg: PpoFields, stops: list[int]):
    """The completions by transformers' `generate` (for models `decode` does not run), with the log-probabilities
    and entropies of its scores when `rollout_logprobs` asks, one step at a time so no second copy of the scores is
    held."""
    import torch

    from rlhf_pipeline.trainers.models.text import own_sampling

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
            **({"output_scores": True, "return_dict_in_generate": True} if cfg.rollout_logprobs else {}),
        )
    sequences = generated.sequences if cfg.rollout_logprobs else generated
    responses = sequences[:, queries.shape[1] :]
    if not cfg.rollout_logprobs:
        return responses, None, None
    logprobs, entropy = torch.zeros(responses.shape), torch.zeros(responses.shape)
    for t, scores in enumerate(generated.scores):  # a row's steps after its stop token are masked out
        step = torch.log_softmax(scores.float(), dim=-1)
        logprobs[:, t] = step.gather(-1, responses[:, t, None]).squeeze(-1)
        entropy[:, t] = -(step.exp() * step).sum(-1)
    return responses, logprobs.to(responses.device), entropy.to(responses.device)


def response_logprobs(model, inputs: dict, width: int, temperature: float, with_entropy: bool = False):
    """Log-probabilities of the last `width` (completion) tokens, and their entropy; logits are divided by the
    sampling temperature (N+ §7), or the ratios and KL would describe another policy than the one sampled."""
    import torch

    logp_all = torch.log_softmax(model(**inputs, logits_to_keep=width + 1).logits[:, :-1].float() / temperature, dim=-1)
    logprobs = logp_all.gather(-1, inputs["input_ids"][:, -width:, None]).squeeze(-1)
    return logprobs, (-(logp_all.exp() * logp_all).sum(-1) if with_entropy else None)


def response_values(value_model, inputs: dict, width: int):
    """The reward model's backbone and scalar head on every token (InstructGPT §3.5; N+ §7): the value
    of the state before completion token t is read at the position just before it."""
    hidden = value_model.base_model(**inputs).last_hidden_state
    return value_model.score(hidden[:, -width - 1 : -1]).squeeze(-1).float()


def reference_of(policy):
    """The reference policy, inside the LoRA policy: the frozen 'ref' copy of a stacked adapter, else the adapters
    disabled."""
    from trl.trainer.utils import use_adapter

    return use_adapter(policy, "ref" if "ref" in policy.peft_config else None)
