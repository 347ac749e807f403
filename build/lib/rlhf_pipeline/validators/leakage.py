"""Rule `no_train_eval_leakage`: a prompt held out for evaluation must not appear in the data trained on.

A held-out score on prompts the model trained on measures memory, not
generalisation. A row's prompt is what the user asked: the `prompt` string, or
the first user turn of a conversation (the prompt column, `messages`, or the
turns chosen and rejected share), with whitespace runs collapsed so that
"sort 12 -> " and "sort 12 ->" are one prompt. Standard `text` rows and standard
implicit-prompt pairs carry no separable prompt and are not compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf_pipeline.validators.formats import read_format
from rlhf_pipeline.validators.report import MAX_EXAMPLES, RuleResult, short_repr

if TYPE_CHECKING:
    import datasets

RULE = "no_train_eval_leakage"


@dataclass(frozen=True)
class Split:
    name: str
    """The dataset's role in the pipeline, e.g. "sft" or "prompts_eval"."""
    kind: str
    source: str
    dataset: datasets.Dataset


def check_leakage(held_out: Split, training: list[Split]) -> RuleResult:
    """The held-out rows whose prompt is also a prompt of a training split (first training row quoted)."""
    seen: dict[str, tuple[Split, int]] = {}
    for split in training:
        for row, prompt in enumerate(prompts(split)):
            if prompt is not None:
                seen.setdefault(prompt, (split, row))
    leaked = []
    for row, prompt in enumerate(prompts(held_out)):
        if prompt in seen:
            split, train_row = seen[prompt]
            why = f"{short_repr(prompt)} is also row {train_row} of {split.name} ({split.source})"
            leaked.append({"row": row, "value": why})
    trained = ", ".join(f"{split.name} ({split.source})" for split in training)
    description = f"a prompt held out in {held_out.name} must not appear in the data trained on: {trained}"
    return RuleResult(RULE, description, not leaked, len(leaked), leaked[:MAX_EXAMPLES])


def prompts(split: Split) -> list[str | None]:
    """Each row's prompt, normalised; None where the row has none to compare."""
    fmt, values = read_format(split.kind, split.dataset, split.source)
    if fmt.prompt == "explicit":
        column = values["prompt"]
    elif fmt.conversational:
        column = values["messages"] if fmt.kind == "sft" else values["chosen"]
    else:
        return [None] * split.dataset.num_rows
    return [_normalise(_first_user_text(value)) for value in column]


def _first_user_text(value: Any) -> Any:
    if isinstance(value, list):
        users = (turn.get("content") for turn in value if isinstance(turn, dict) and turn.get("role") == "user")
        return next(users, None)
    return value


def _normalise(text: Any) -> str | None:
    if not isinstance(text, str):
        return None
    return " ".join(text.split()) or None
