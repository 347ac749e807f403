"""Rules `chat_template` and `end_of_turn_trained`: conversational rows need a template that renders them and
trains the model to stop.

A base model such as GPT-2 has no chat template, so a conversational row cannot be
rendered at all (transformers says "Cannot use chat template functions..."); the
fix is `model.chat_template=chatml` (or a Jinja file), which the rule names.
With `sft.assistant_only_loss`, TRL trains only the tokens inside the template's
`{% generation %}` marks: a template without marks cannot train, and one whose
marks leave out the end-of-turn token (ChatML's `<|im_end|>`) trains a model that
never stops. Both are checked on every row before any weights load.
"""

from __future__ import annotations

from typing import Any

from rlhf_pipeline.validators.formats import DatasetFormat
from rlhf_pipeline.validators.report import short_repr
from rlhf_pipeline.validators.rules import Rule

TEMPLATE_RULE = "chat_template"
END_OF_TURN_RULE = "end_of_turn_trained"
FIX = "set model.chat_template=chatml (or a Jinja file: model.chat_template=path/to/template.jinja)"


def template_problem(tokenizer: Any, model_name: str, assistant_only: bool) -> str | None:
    """Why conversational rows cannot be trained with this tokenizer's template, or None."""
    from rlhf_pipeline.trainers.templates import has_generation_marks

    if not getattr(tokenizer, "chat_template", None):
        return f"the tokenizer of {model_name} has no chat template to render conversations with: {FIX}"
    if assistant_only and not has_generation_marks(tokenizer):
        return (
            "sft.assistant_only_loss trains the tokens inside {% generation %} marks, and the chat template of "
            f"{model_name} has none: set model.chat_template=chatml (marked), add the marks to a Jinja file, or set "
            "sft.assistant_only_loss=false"
        )
    return None


def chat_template_rule() -> Rule:
    return Rule(
        TEMPLATE_RULE, "conversational rows need a chat template that can train them", "template_ok", "in_set", (True,)
    )


def template_column(num_rows: int, problem: str, start: int = 0) -> tuple[list[Any], dict[int, str]]:
    """Every row fails the same way: no row can be rendered (the reason is given once, at the dataset's first row).
    Rows start .. start + num_rows - 1 of the dataset; the explanations are keyed by the local row."""
    why = dict.fromkeys(range(num_rows), "the same (see the first row)")
    if start == 0 and num_rows:
        why[0] = problem
    return [False] * num_rows, why


def end_of_turn_rule() -> Rule:
    return Rule(
        END_OF_TURN_RULE,
        "every assistant turn's end-of-turn token must be inside the trained part ({% generation %} marks)",
        "untrained_end_of_turns",
        "at_most",
        max_value=0,
    )


def untrained_end_of_turns(
    fmt: DatasetFormat, values: dict[str, list[Any]], tokenizer: Any
) -> tuple[list[int | None], dict[int, str]]:
    """Per row: assistant turns whose trained span (TRL's assistant mask) does not end with the end-of-turn token."""
    from rlhf_pipeline.trainers.templates import end_of_turn

    eot = end_of_turn(tokenizer)
    eot_id = tokenizer.convert_tokens_to_ids(eot) if eot else tokenizer.eos_token_id
    column = "messages" if "messages" in fmt.columns else fmt.columns[-1]
    counts: list[int | None] = []
    why: dict[int, str] = {}
    for index, turns in enumerate(values[column]):
        if fmt.prompt == "explicit" and "prompt" in values:
            turns = values["prompt"][index] + turns
        if not isinstance(turns, list):
            counts.append(None)
            continue
        try:
            encoded = tokenizer.apply_chat_template(
                turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        except Exception:
            counts.append(None)  # fits_max_length reports a row the template cannot render
            continue
        ids, mask = encoded["input_ids"], encoded["assistant_masks"]
        spans = _spans(mask)
        replies = sum(1 for turn in turns if turn.get("role") == "assistant")
        bad = [span for span in spans if ids[span[1] - 1] != eot_id]
        missing = max(replies - len(spans), 0)
        counts.append(len(bad) + missing)
        if bad or missing:
            shown = tokenizer.convert_ids_to_tokens(ids[bad[0][1] - 1]) if bad else None
            why[index] = (
                f"{len(bad) + missing} of {replies} assistant turns are trained without their end-of-turn token {eot!r}"
                + (f" (the trained part ends with {short_repr(shown, 20)})" if shown else " (the marks cover no token)")
            )
    return counts, why


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, flag in enumerate([*mask, 0]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append((start, i))
            start = None
    return spans
