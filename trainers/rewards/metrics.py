"""Evaluation statistics: win rates and accuracies with bootstrap intervals, diversity, log-probabilities, KL, drift.

Pure functions over lists of numbers and texts, plus two that score text under a
causal LM (`sequence_logprobs`, `perplexity`). numpy and torch are imported
inside the functions, so importing this module stays cheap for flows.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from rlhf_pipeline.trainers.models.text import completion_ids

if TYPE_CHECKING:
    import numpy as np
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class Interval:
    """A mean with a percentile-bootstrap confidence interval over `n` items."""

    mean: float
    low: float
    high: float
    n: int


@dataclass(frozen=True)
class WinRate:
    """Share of paired items that model a wins (ties count half), with a bootstrap interval."""

    rate: float
    low: float
    high: float
    n: int
    ties: int


# --- bootstrap --------------------------------------------------------------------


def _resampled(count: int, n_bootstrap: int, confidence: float, seed: int) -> tuple[np.ndarray, float]:
    """Percentile bootstrap (Efron & Tibshirani 1993, ch. 13.3): `n_bootstrap` resamples of `count` item indices drawn
    with replacement (all at once: 1000 x 600 indices take a few milliseconds), and the tail share on each side."""
    import numpy as np

    if n_bootstrap < 1 or not 0 < confidence < 1:
        raise ValueError(f"n_bootstrap={n_bootstrap} must be >= 1 and confidence={confidence} in (0, 1)")
    return np.random.default_rng(seed).integers(0, count, size=(n_bootstrap, count)), (1 - confidence) / 2


def _bootstrap_mean(values: np.ndarray, n_bootstrap: int, confidence: float, seed: int) -> Interval:
    import numpy as np

    idx, tail = _resampled(len(values), n_bootstrap, confidence, seed)
    low, high = np.quantile(values[idx].mean(axis=1), [tail, 1 - tail])
    return Interval(float(values.mean()), float(low), float(high), len(values))


def bootstrap_mean(
    values: Sequence[float], *, n_bootstrap: int = 1000, confidence: float = 0.95, seed: int = 0
) -> Interval:
    """Mean of `values` (e.g. 0/1 exact-match hits) with a percentile-bootstrap confidence interval."""
    import numpy as np

    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or len(array) == 0:
        raise ValueError(f"bootstrap_mean needs a non-empty flat list of numbers, got shape {array.shape}")
    return _bootstrap_mean(array, n_bootstrap, confidence, seed)


def bootstrap_runs_difference(
    runs_a: Sequence[Sequence[float]],
    runs_b: Sequence[Sequence[float]],
    *,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Interval:
    """Mean of a's runs less mean of b's, each runs x items (e.g. training seeds x held-out prompts, the same items in
    the same order on both sides), with a two-level percentile bootstrap: each resample draws the items (paired across
    the sides) and, apart, the runs of each side. Runs of one method trained with other seeds differ by more than the
    items explain; an interval over the items alone would call that seed-to-seed spread a difference of methods."""
    import numpy as np

    a, b = np.asarray(runs_a, dtype=np.float64), np.asarray(runs_b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or 0 in a.shape or 0 in b.shape:
        raise ValueError(
            f"bootstrap_runs_difference needs two non-empty runs x items tables over the same items (got {a.shape} "
            f"and {b.shape})"
        )
    items, tail = _resampled(a.shape[1], n_bootstrap, confidence, seed)
    rng = np.random.default_rng(seed + 1)
    runs = [rng.integers(0, len(side), size=(n_bootstrap, len(side))) for side in (a, b)]
    # Each resample: its runs' rows, then its items' columns, averaged.
    means = [
        np.take_along_axis(side[chosen].mean(axis=1), items, axis=1).mean(axis=1) for side, chosen in zip((a, b), runs)
    ]
    low, high = np.quantile(means[0] - means[1], [tail, 1 - tail])
    return Interval(float(a.mean() - b.mean()), float(low), float(high), a.shape[1])


def bootstrap_ratio(
    numerators: Sequence[float],
    denominators: Sequence[float],
    *,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Interval:
    """sum(numerators) / sum(denominators) with a percentile-bootstrap interval that resamples the items (e.g. prompts,
    each with its count of instructions followed and given): a cluster bootstrap, for parts of one item (a prompt's
    instructions) are not independent. The same `seed` draws the same items as `bootstrap_mean` over as many items."""
    import numpy as np

    top, bottom = np.asarray(numerators, dtype=np.float64), np.asarray(denominators, dtype=np.float64)
    if top.shape != bottom.shape or top.ndim != 1 or len(top) == 0 or (bottom <= 0).any():
        raise ValueError(f"bootstrap_ratio needs equally long non-empty lists, denominators > 0 (got {top.shape})")
    idx, tail = _resampled(len(top), n_bootstrap, confidence, seed)
    low, high = np.quantile(top[idx].sum(axis=1) / bottom[idx].sum(axis=1), [tail, 1 - tail])
    return Interval(float(top.sum() / bottom.sum()), float(low), float(high), len(top))


def win_rate(
    scores_a: Sequence[float],
    scores_b: Sequence[float],
    *,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> WinRate:
    """How often a's score beats b's on the same item (ties count half), with a bootstrap interval over items."""
    import numpy as np

    a, b = np.asarray(scores_a, dtype=np.float64), np.asarray(scores_b, dtype=np.float64)
    if len(a) != len(b) or len(a) == 0:
        raise ValueError(f"win_rate needs two equally long, non-empty score lists, got {len(a)} and {len(b)}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("win_rate: scores must be finite (a NaN would silently count as a loss)")
    outcomes = np.where(a > b, 1.0, np.where(a == b, 0.5, 0.0))
    interval = _bootstrap_mean(outcomes, n_bootstrap, confidence, seed)
    return WinRate(interval.mean, interval.low, interval.high, interval.n, int((a == b).sum()))


# --- texts ------------------------------------------------------------------------


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Unique n-grams / all n-grams over `texts` (Li et al. 2016, "distinct-n"); 0.0 when there are none.

    Units: whitespace-separated tokens if any text contains whitespace, characters
    otherwise. Our sort task answers are digit strings with no spaces, where words
    would make every answer a single unigram; one unit for the whole corpus keeps
    the ratio comparable between models. n-grams never cross from one text to the next.
    """
    if n < 1:
        raise ValueError(f"distinct_n: n={n} must be >= 1")
    by_words = any(any(c.isspace() for c in t) for t in texts)
    total, unique = 0, set()
    for text in texts:
        units = text.split() if by_words else list(text)
        grams = [tuple(units[i : i + n]) for i in range(len(units) - n + 1)]
        total += len(grams)
        unique.update(grams)
    return len(unique) / total if total else 0.0


def mean_length(texts: Sequence[str]) -> float:
    """Mean length in characters (not tokens: comparable across tokenizers)."""
    if not texts:
        raise ValueError("mean_length of no texts")
    return sum(map(len, texts)) / len(texts)


def length_drift(policy_texts: Sequence[str], sft_texts: Sequence[str]) -> float:
    """Relative change of the mean answer length, policy / sft - 1 (+0.5: answers grew by half)."""
    sft = mean_length(sft_texts)
    if sft == 0:
        raise ValueError(f"length_drift: the SFT answers are all empty ({len(sft_texts)} texts), no relative change")
    return mean_length(policy_texts) / sft - 1


# --- scoring under a causal LM -----------------------------------------------------


def _score(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list, completions: list, batch_size: int
) -> list[tuple[float, int]]:
    """(sum of completion log-probabilities, number of completion tokens) per row."""
    import torch

    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    rows = [completion_ids(tokenizer, p, c) for p, c in zip(prompts, completions)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # masked out: any id will do
    was_training = model.training
    model.eval()
    # The output layer only where a completion token is predicted (`logits_to_keep`: the last positions): over a
    # prompt's positions it would make [batch, width, vocab] logits that nothing reads.
    keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
    out: list[tuple[float, int]] = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch], device=model.device)
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch], device=model.device)
        # Token t is scored if it is part of the completion; position 0 has no context to predict it from.
        position = torch.arange(width, device=model.device)
        starts = torch.tensor([max(cut, 1) for _, cut in batch], device=model.device)
        scored = (position >= starts[:, None]) & (position < attention.sum(1, keepdim=True))
        first = int(starts.min()) - 1  # the first position whose logits predict a scored token
        with torch.no_grad():
            outputs = model(
                input_ids=input_ids, attention_mask=attention, **({"logits_to_keep": width - first} if keeps else {})
            )
        logits = outputs.logits[:, first - width : -1]  # logits at t predict token t + 1
        mask = scored[:, first + 1 :]
        # Only the completion positions go through float32 log_softmax: [tokens, vocab], not [batch, width, vocab].
        targets = input_ids[:, first + 1 :][mask]
        picked = logits[mask].float().log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        row = torch.arange(len(batch), device=model.device).unsqueeze(1).expand_as(mask)[mask]
        sums = torch.zeros(len(batch), dtype=torch.float64, device=model.device).index_add_(0, row, picked.double())
        out.extend(zip(sums.tolist(), mask.sum(1).tolist()))
    model.train(was_training)
    return out


def sequence_logprobs(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list, completions: list, batch_size: int = 64
) -> list[float]:
    """Sum of log pi(completion token | everything before it) per row, EOS included.

    Prompts are strings (scored as TRL's standard rows: `prompt + completion + eos`)
    or lists of chat messages (scored as TRL's conversational rows: the chat
    template of prompt + assistant reply, minus the template of the prompt with
    the generation prompt). Rows are right-padded and not truncated. With an empty
    string prompt the first completion token has no context and is not scored.
    """
    return [total for total, _ in _score(model, tokenizer, prompts, completions, batch_size)]


def perplexity(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts_or_pairs: list, batch_size: int = 64
) -> float:
    """exp(mean negative log-likelihood per token) over all rows.

    A plain string is scored whole (plus its EOS, as SFT trains on it; its first
    token has no context and is skipped); a (prompt, completion) pair is scored on
    the completion tokens only, like SFT's `completion_only_loss`.
    """
    pairs = [("", row) if isinstance(row, str) else tuple(row) for row in texts_or_pairs]
    scores = _score(model, tokenizer, [p for p, _ in pairs], [c for _, c in pairs], batch_size)
    tokens = sum(n for _, n in scores)
    if tokens == 0:
        raise ValueError(f"perplexity: no tokens to score in {len(pairs)} rows")
    return math.exp(-sum(total for total, _ in scores) / tokens)


def kl_to_reference(policy_logprobs: Sequence[float], reference_logprobs: Sequence[float]) -> float:
    """Mean of log pi(y) - log pi_ref(y): the k1 Monte-Carlo estimate of KL(pi || pi_ref), in nats per sample.

    Unbiased only when the y were sampled from the policy pi itself (Schulman 2020,
    "Approximating KL Divergence"); on greedy answers or dataset rows it is just a
    log-likelihood ratio, and single samples can be negative.
    """
    if len(policy_logprobs) != len(reference_logprobs) or not policy_logprobs:
        raise ValueError(
            f"kl_to_reference needs two equally long, non-empty lists, got {len(policy_logprobs)} and "
            f"{len(reference_logprobs)}"
        )
    return sum(p - r for p, r in zip(policy_logprobs, reference_logprobs)) / len(policy_logprobs)


# --- reward hacking -----------------------------------------------------------------


def hacking_warnings(
    *,
    reward_delta: float,
    task_delta: float | None,
    length_drift: float,
    kl: float,
    max_length_drift: float,
    max_kl: float,
    task_name: str = "exact match",
) -> list[str]:
    """Human-readable signs of reward hacking (Gao et al. 2023, "Scaling Laws for Reward Model Overoptimization").

    `reward_delta` and `task_delta` are policy minus SFT; `task_delta` is None when
    the task has no ground truth. Bounds are exclusive; an empty list means no warning.
    """
    warnings = []
    if task_delta is not None and reward_delta > 0 and task_delta < 0:
        warnings.append(
            f"reward-model score rose by {reward_delta:+.2f} while {task_name} fell by {task_delta:+.2f}: the policy "
            "may be gaming the reward model"
        )
    if abs(length_drift) > max_length_drift:
        warnings.append(
            f"mean answer length changed by {length_drift:+.0%} against the SFT model "
            f"(bound ±{max_length_drift:.0%}): reward models often prefer longer answers"
        )
    if not math.isfinite(kl) or kl > max_kl:
        warnings.append(
            f"KL to the reference model is {kl:.3g} nats per sample (bound {max_kl:.3g}): the policy has drifted far "
            "from it"
        )
    return warnings
