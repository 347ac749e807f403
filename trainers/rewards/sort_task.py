"""Reward functions of the bundled "sort the digits" task (TRL's reward-function signature).

rewards.functions: [{path: "rlhf_pipeline.trainers.rewards.sort_task:exact_match", weight: 1.0}]
"""

from __future__ import annotations


def _text(completion) -> str:
    """A completion is a string (standard) or a list of messages (conversational)."""
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return completion


def exact_match(prompts: list, completions: list, answer: list[str], **_) -> list[float]:
    """1.0 when the answer equals the reference `answer` column, else 0.0 (the verifier; as `pairs.function` it makes
    pairs of a right and a wrong answer)."""
    return [float(_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def digits_format(prompts: list, completions: list, answer: list[str], **_) -> list[float]:
    """1.0 when the answer is only digits and as long as the reference: well formed, maybe wrong."""
    out = []
    for completion, reference in zip(completions, answer):
        text = _text(completion).strip()
        out.append(float(text.isdigit() and len(text) == len(str(reference).strip())))
    return out
