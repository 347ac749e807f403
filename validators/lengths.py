"""Rule `fits_max_length`: every row, tokenized as its trainer sees it, fits a token limit.

TRL truncates a row over `max_length` without a word: SFT and DPO then train on
a cut-off answer (or on no answer at all when the prompt alone fills the
window). Counting the tokens here turns that into a data error that names the
rows. The count is the tokenizer's own encoding, special tokens included:
strings as `tokenizer(text)`, conversations through the chat template (with the
generation prompt for prompt-only rows, as online trainers render them).
"""

from __future__ import annotations

from typing import Any

from rlhf_pipeline.validators.formats import DatasetFormat, value_type
from rlhf_pipeline.validators.report import short_repr
from rlhf_pipeline.validators.rules import ROLES, Rule

RULE = "fits_max_length"
COLUMN = "token_count"
UNREADABLE = -1  # the count of a row the tokenizer cannot encode: below the expectation's minimum of 0, so it fails


def fits_max_length(fmt: DatasetFormat, limit: int) -> Rule:
    sequences = " and ".join(label for label, _ in _sequences(fmt, {c: "" for c in fmt.text_columns}))
    return Rule(RULE, f"{sequences} must fit in {limit} tokens", COLUMN, "at_most", max_value=limit)


def count_tokens(
    fmt: DatasetFormat, values: dict[str, list[Any]], tokenizer: Any, limit: int
) -> tuple[list[int | None], dict[int, str]]:
    """Longest sequence per row in tokens (None: a row other rules reject), and why rows over `limit` fail."""
    counts: list[int | None] = []
    explanations: dict[int, str] = {}
    for index in range(len(values[fmt.columns[0]])):
        row = {column: values[column][index] for column in fmt.text_columns}
        if not _countable(fmt, row):
            counts.append(None)  # consistent_types or valid_roles reports this row
            continue
        try:
            lengths = [(label, _length(tokenizer, sequence, fmt)) for label, sequence in _sequences(fmt, row)]
        except Exception as error:  # a chat template that raises on this row's turns
            counts.append(UNREADABLE)
            explanations[index] = f"could not be tokenized: {type(error).__name__}: {short_repr(str(error), 120)}"
            continue
        label, longest = max(lengths, key=lambda item: item[1])
        counts.append(longest)
        if longest > limit:
            shown = ", ".join(f"{part} {n} tokens" for part, n in lengths)
            single = f"{label} is {longest} tokens > {limit}"
            explanations[index] = single if len(lengths) == 1 else f"{shown}; limit {limit}"
    return counts, explanations


def _sequences(fmt: DatasetFormat, row: dict[str, Any]) -> list[tuple[str, Any]]:
    """(label, text or turns) of each sequence the trainer builds from the row."""
    if fmt.unpaired:  # KTOTrainer tokenizes prompt + completion, as SFT's prompt-completion rows
        return [("prompt + completion", row["prompt"] + row["completion"])]
    if fmt.kind == "preference":
        if fmt.prompt == "explicit":
            prompt = row["prompt"]
            return [("prompt + chosen", prompt + row["chosen"]), ("prompt + rejected", prompt + row["rejected"])]
        return [("chosen", row["chosen"]), ("rejected", row["rejected"])]
    if fmt.kind == "sft" and fmt.prompt == "explicit":
        return [("prompt + completion", row["prompt"] + row["completion"])]
    (column,) = fmt.columns
    return [(column, row[column])]


def _countable(fmt: DatasetFormat, row: dict[str, Any]) -> bool:
    if any(value_type(value) != fmt.value_type for value in row.values()):
        return False
    if fmt.conversational:
        return all(turn.get("role") in ROLES for turns in row.values() for turn in turns)
    return True


def _length(tokenizer: Any, sequence: str | list[dict], fmt: DatasetFormat) -> int:
    if isinstance(sequence, str):
        return len(tokenizer(sequence)["input_ids"])
    encoded = tokenizer.apply_chat_template(sequence, tokenize=True, add_generation_prompt=fmt.kind == "prompt")
    # transformers 5 returns a BatchEncoding; older versions a plain list of ids.
    return len(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
