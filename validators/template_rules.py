"""Rules `chat_template` and `end_of_turn_trained`: conversational rows need a template that renders them and
trains the model to stop.

A base model such as GPT-2 has no chat template, so a conversational row cannot be
rendered at all (transformers says "Cannot use chat template functions..."); the
fix is `model.chat_template=chatml` (or a Jinja file), which the rule names.
With `sft.assistant_only_loss`, TRL trains only the tokens inside the template's
`{% generation %}` marks; a template without them trains with TRL's own training
version of it where TRL 1.16 has one (`trainers.models.templates.training_template`).
The rule renders a sample conversation with the template TRL will use and checks
the result: the assistant mask covers each assistant turn and nothing of the
others. A template it cannot train, and one whose marks leave out the end-of-turn
token (ChatML's `<|im_end|>`, a model that never stops), are refused on every row
before any weights load.
"""

from __future__ import annotations

from typing import Any

from rlhf_pipeline.validators.formats import DatasetFormat
from rlhf_pipeline.validators.report import short_repr
from rlhf_pipeline.validators.rules import Rule

TEMPLATE_RULE = "chat_template"
END_OF_TURN_RULE = "end_of_turn_trained"
FIX = "set model.chat_template=chatml (or a Jinja file: model.chat_template=path/to/template.jinja)"
MARKS_FIX = (
    "set model.chat_template=chatml (marked), add the marks to a Jinja file, or set sft.assistant_only_loss=false"
)

# A conversation whose every turn says which turn it is: each assistant reply must be inside exactly one trained span
# and no other turn's words inside any. No system turn: some templates (Gemma's) refuse one.
PROBE = [
    {"role": "user", "content": "Question zqa one?"},
    {"role": "assistant", "content": "Reply zqb one."},
    {"role": "user", "content": "Question zqc two?"},
    {"role": "assistant", "content": "Reply zqd two."},
]


def template_problem(tokenizer: Any, model_name: str, assistant_only: bool) -> str | None:
    """Why conversational rows cannot be trained with this tokenizer's template, or None."""
    if not getattr(tokenizer, "chat_template", None):
        return f"the tokenizer of {model_name} has no chat template to render conversations with: {FIX}"
    if assistant_only:
        return assistant_mask_problem(tokenizer, model_name)
    return None


def assistant_mask_problem(tokenizer: Any, model_name: str) -> str | None:
    """Why TRL's assistant mask, computed with the template TRL will train with, does not cover exactly the
    assistant turns of a sample conversation (None: it does)."""
    from rlhf_pipeline.trainers.models.templates import assistant_mask, training_template

    try:
        template = training_template(tokenizer)
    except Exception:  # TRL 1.16: "patching is not supported for this template"
        return (
            "sft.assistant_only_loss trains the tokens inside {% generation %} marks, and the chat template of "
            f"{model_name} has none, nor does TRL 1.16 have a training version of it (it has them for the exact "
            f"templates of Qwen2.5/3, Llama 3, Gemma, Phi-3, DeepSeek-V3 and others): {MARKS_FIX}"
        )
    which = "TRL's training version of the chat template" if template else "the chat template"
    try:
        ids, mask = assistant_mask(tokenizer, PROBE, template)
    except Exception as exc:  # a template that cannot render two plain exchanges
        return f"{which} of {model_name} cannot render a sample conversation: {short_repr(str(exc), 200)}"
    spans = [tokenizer.decode(ids[start:end]) for start, end in _spans(mask)]
    replies = [turn["content"] for turn in PROBE if turn["role"] == "assistant"]
    others = [turn["content"] for turn in PROBE if turn["role"] != "assistant"]
    if not spans:
        return (
            f"sft.assistant_only_loss trains the tokens inside {{% generation %}} marks, and {which} of {model_name} "
            f"marks none of a sample conversation's assistant turns: {MARKS_FIX}"
        )
    covered = len(spans) == len(replies) and all(reply in span for reply, span in zip(replies, spans))
    leaked = [text for text in others if any(text in span for span in spans)]
    if not covered or leaked:
        return (
            f"sft.assistant_only_loss would train {len(spans)} span(s) of a sample conversation with {which} of "
            f"{model_name} ({', '.join(short_repr(span, 60) for span in spans)}), not exactly its {len(replies)} "
            f"assistant turns{' (it trains other turns too)' if leaked else ''}: {MARKS_FIX}"
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
    from rlhf_pipeline.trainers.models.templates import assistant_mask, end_of_turn, training_template

    eot = end_of_turn(tokenizer)
    eot_id = tokenizer.convert_tokens_to_ids(eot) if eot else tokenizer.eos_token_id
    template = training_template(tokenizer)  # the rule `chat_template` passed: TRL's swap, if any, exists
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
            ids, mask = assistant_mask(tokenizer, turns, template)
        except Exception:
            counts.append(None)  # fits_max_length reports a row the template cannot render
            continue
        # A span may end in the newline after the end of turn (TRL's Qwen2.5 training template marks it too): as TRL's
        # `is_chat_template_stop_token_trained`, look at its last token that is not whitespace.
        spans = [_without_trailing_space(tokenizer, ids, span) for span in _spans(mask)]
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


def _without_trailing_space(tokenizer: Any, ids: list[int], span: tuple[int, int]) -> tuple[int, int]:
    start, end = span
    while end - 1 > start and not tokenizer.decode([ids[end - 1]]).strip():
        end -= 1
    return start, end
