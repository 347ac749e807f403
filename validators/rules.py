"""The rules per dataset format, and the scalar columns Great Expectations checks them on.

GX measures list columns by their string form, so every rule is reduced here,
in plain Python, to one scalar per row (a count, a bool or a role name) that a
GX expectation can judge. A value of None means "not applicable to this row"
(GX skips nulls): a row whose `chosen` has the wrong type fails
`consistent_types` only, not every rule that would have looked inside it.
Each failing row also gets an English explanation for the report.

validators.screen derives a record batch at a time, keeping the rows Arrow can vouch for out of Python.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from rlhf_pipeline.trainers.models.tiny import ROLES
from rlhf_pipeline.validators.formats import LABEL, DatasetFormat, value_type
from rlhf_pipeline.validators.leakage import normalise
from rlhf_pipeline.validators.report import short_repr

PROMPT_END_ROLES = ("user", "tool")

Row = dict[str, Any]  # the format's columns (an unpaired row's `label` included) -> this row's values
Check = Callable[[DatasetFormat, Row, Row], "tuple[Any, str | None]"]


@dataclass(frozen=True)
class Rule:
    name: str
    description: str
    """The requirement in English; it appears in messages and in the Data Docs."""
    column: str | None
    """The derived column the expectation reads; None for a table-level rule."""
    expect: Literal["at_least_one", "in_set", "at_most"]
    value_set: tuple[Any, ...] = ()
    max_value: int | None = None
    """The limit of an "at_most" rule (a count between 0 and max_value passes)."""


@dataclass
class Derived:
    columns: dict[str, Any] = field(default_factory=dict)
    """Derived column -> one scalar per row (None: not applicable): a list, or a numpy array from Arrow."""
    explanations: dict[str, dict[int, str]] = field(default_factory=dict)
    """Rule -> dataset row -> why that row fails it."""


def rules_for(fmt: DatasetFormat) -> list[Rule]:
    """The rules a dataset of this format must pass, in the order they are reported."""
    columns = ", ".join(fmt.text_columns)
    texts = f"every message content in {columns}" if fmt.conversational else f"every value of {columns}"
    rules = [
        Rule("non_empty_dataset", "the dataset must have at least one row", None, "at_least_one"),
        _in_set("consistent_types", f"every value of {columns} must be {fmt.value_type}", "type_ok", True),
        _at_least_one("text_not_blank", f"{texts} must be a non-empty, non-whitespace string", "shortest_text_length"),
    ]
    return rules + _turn_rules(fmt) + _label_rules(fmt)


def _turn_rules(fmt: DatasetFormat) -> list[Rule]:
    """Conversations: valid roles, text turns, an assistant turn at the end of what trains, a prompt that ends with
    a user (or tool) turn."""
    rules = []
    if fmt.conversational:
        roles = ", ".join(ROLES)
        rules.append(_in_set("valid_roles", f"every message role must be one of {roles}", "roles_valid", True))
        rules.append(
            _in_set(
                "text_turns_only",
                "every turn must be text: no multimodal content parts, and no tool calls unless the chat template "
                "renders them (otherwise a tool-calling turn trains as an empty one)",
                "turns_text_only",
                True,
            )
        )
    trained = " and ".join(_trained_conversations(fmt))
    if trained:
        rules += [
            _at_least_one("has_assistant_turn", f"{trained} must contain an assistant turn", "fewest_assistant_turns"),
            _in_set(
                "ends_with_assistant_turn",
                f"{trained} must end with an assistant turn",
                "last_trained_role",
                "assistant",
            ),
        ]
    if _implicit_pair(fmt):
        rules += [
            _at_least_one(
                "shared_prompt_turns",
                "chosen and rejected must start with the same prompt turns",
                "shared_prompt_turns",
            ),
            _in_set(
                "prompt_ends_with_user_turn",
                "the prompt turns chosen and rejected share must end with a user or tool turn",
                "prompt_last_role",
                *PROMPT_END_ROLES,
            ),
        ]
    elif fmt.conversational and fmt.prompt == "explicit":
        rules.append(
            _in_set(
                "prompt_ends_with_user_turn",
                "a conversational prompt must end with a user or tool turn",
                "prompt_last_role",
                *PROMPT_END_ROLES,
            )
        )
    return rules


def _label_rules(fmt: DatasetFormat) -> list[Rule]:
    """Feedback: boolean labels, both kinds present, none in conflict (unpaired rows); chosen unlike rejected."""
    if fmt.unpaired:
        return [
            _in_set(
                "label_is_boolean",
                "every label must be true or false (a boolean; not 0/1, a string or missing)",
                "label_boolean",
                True,
            ),
            # KTO's loss has a desirable and an undesirable term (Ethayarajh et al. 2024, Eq. 7); with one
            # label only, half of it never trains. Reported on every row, since no row can fix it alone.
            _at_least_one(
                "both_labels_present",
                "the dataset must hold at least one desirable (label true) and one undesirable (label false) row",
                "rows_with_other_label",
            ),
            _in_set(
                "no_conflicting_labels",
                "the same prompt and completion must not be labelled both desirable and undesirable",
                "label_unambiguous",
                True,
            ),
        ]
    if fmt.kind == "preference":
        compared = " in their final turns" if _implicit_pair(fmt) else ""
        return [
            _in_set(
                "chosen_differs_from_rejected", f"chosen must differ from rejected{compared}", "chosen_differs", True
            )
        ]
    return []


def _implicit_pair(fmt: DatasetFormat) -> bool:
    return fmt.kind == "preference" and fmt.conversational and fmt.prompt == "implicit"


def _at_least_one(name: str, description: str, column: str) -> Rule:
    return Rule(name, description, column, "at_least_one")


def _in_set(name: str, description: str, column: str, *allowed: Any) -> Rule:
    return Rule(name, description, column, "in_set", allowed)


def derive(
    fmt: DatasetFormat,
    values: dict[str, list[Any]],
    rules: list[Rule],
    *,
    start: int = 0,
    checks: dict[str, Check] | None = None,
) -> Derived:
    """One scalar per row and rule, plus an explanation for every failing row.

    `values` are rows start, start + 1, ... of the dataset (explanations name those rows). An
    unpaired dataset's label rules look at every row: pass `checks` from `label_checks` when
    `values` is one batch of it.
    """
    derived = Derived()
    row_rules = [rule for rule in rules if rule.column is not None]
    for rule in row_rules:
        derived.columns[rule.column] = []
        derived.explanations[rule.name] = {}
    if not row_rules:
        return derived
    if checks is None:
        checks = {**CHECKS, **label_checks(fmt, [values])} if fmt.unpaired else CHECKS
    num_rows = len(values[fmt.columns[0]])
    for index in range(num_rows):
        row = {column: values[column][index] for column in fmt.columns}
        typed = {c: row[c] for c in fmt.text_columns if value_type(row[c]) == fmt.value_type}
        for rule in row_rules:
            value, why = checks[rule.name](fmt, row, typed)
            derived.columns[rule.column].append(value)
            if why is not None:
                derived.explanations[rule.name][start + index] = why
    return derived


# --- one check per row rule: (fmt, row, typed values) -> (derived value, why it fails or None)


def _check_types(fmt: DatasetFormat, row: Row, typed: Row) -> tuple[Any, str | None]:
    for column in fmt.text_columns:
        value = row[column]
        if column not in typed:
            shown = "" if value is None else f": {short_repr(value)}"
            return False, f"{column} is {value_type(value)}, expected {fmt.value_type}{shown}"
    return True, None


def _check_text(fmt: DatasetFormat, row: Row, typed: Row) -> tuple[Any, str | None]:
    shortest: int | None = None
    for column, value in typed.items():
        if isinstance(value, list) and not value:
            return 0, f"{column} is an empty list of messages"
        for label, text in _texts(column, value):
            length = len(text.strip()) if isinstance(text, str) and normalise(text) else 0  # invisible-only: blank
            if length == 0:
                if not isinstance(text, str):
                    return 0, f"{label} is {value_type(text)}, expected a string"
                shown = "whitespace-only" if not text.strip() else "invisible characters only"
                return 0, f"{label} is empty" if text == "" else f"{label} is {shown}: {short_repr(text)}"
            shortest = length if shortest is None else min(shortest, length)
    return shortest, None


def _check_roles(fmt: DatasetFormat, row: Row, typed: Row) -> tuple[Any, str | None]:
    if not typed:
        return None, None
    for column, turns in typed.items():
        for i, turn in enumerate(turns):
            if turn.get("role") not in ROLES:
                return False, f"{column}[{i}].role is {turn.get('role')!r}, expected one of {', '.join(ROLES)}"
    return True, None


def _check_text_turns(fmt: DatasetFormat, row: Row, typed: Row, tools_rendered: bool = False) -> tuple[Any, str | None]:
    if not typed:
        return None, None
    for column, turns in typed.items():
        for i, turn in enumerate(turns):
            if turn.get("tool_calls") and not tools_rendered:
                return False, (
                    f"{column}[{i}] calls tools ({short_repr(turn['tool_calls'])}), and the chat template renders "
                    "only text: it would train as an empty turn (use a template that renders tool_calls)"
                )
            if isinstance(turn.get("content"), (list, dict)):
                return False, f"{column}[{i}].content is a list of content parts (multimodal), not text"
    return True, None


def _check_has_assistant(fmt: DatasetFormat, row: Row, typed: Row) -> tuple[Any, str | None]:
    fewest, why = None, None
    for column in _trained_conversations(fmt):
        if column not in typed:
            continue
        roles = [turn.get("role") for turn in typed[column]]
        count = roles.count("assistant")
        if count == 0 and why is None:
            why = f"{column} has no assistant turn (roles: {', '.join(map(str, roles)) or 'none'})"
        fewest = count if fewest is None else min(fewest, count)
    return fewest, why


def _check_ends_with_assistant(fmt: DatasetFormat, row: Row, typed: Row) -> tuple[Any, str | None]:
    last_role = None  # stays None when no conversation has an assistant turn (has_assistant_turn says so)
    for column in _trained_conversations(fmt):
        turns = typed.get(column)
        if not turns or not any(turn.get("role") == "assistant" for turn in turns):
            continue
        last = turns[-1]
        if last.get("role") != "assistant":
            why = f"the last turn of {column} has role {last.get('role')!r}: {short_repr(last.get('content'))}"
            return str(last.get("role")), why
        last_role = "assistant"
    return last_role, None


def _check_prompt_end(fmt: DatasetFormat, row: Row, typed: Row) -> tuple[Any, str | None]:
    if fmt.prompt == "explicit":
        if "prompt" not in typed:
            return None, None
        turns, label = typed["prompt"], "prompt"
    else:
        if "chosen" not in typed or "rejected" not in typed:
            return None, None
        shared = _shared_prefix(typed["chosen"], typed["rejected"])
        if shared == 0 or shared == len(typed["chosen"]) == len(typed["rejected"]):
            return None, None  # no shared turns, or identical: other rules report those
        turns, label = typed["chosen"][:shared], f"the shared prompt turns chosen[:{shared}]"
    if not turns:
        return "(no turns)", f"{label} has no turns"
    role = turns[-1].get("role")
    if role in PROMPT_END_ROLES:
        return role, None
    return str(role), f"the last turn of {label} has role {role!r}, expected 'user' or 'tool'"


def _check_shared_prefix(fmt: DatasetFormat, row: Row, typed: Row) -> tuple[Any, str | None]:
    if "chosen" not in typed or "rejected" not in typed:
        return None, None
    chosen, rejected = typed["chosen"], typed["rejected"]
    shared = _shared_prefix(chosen, rejected)
    if shared:
        return shared, None
    return (
        0,
        f"chosen and rejected share no leading turn: chosen starts {_first_turn(chosen)}, rejected starts "
        f"{_first_turn(rejected)}",
    )


def _check_differs(fmt: DatasetFormat, row: Row, typed: Row) -> tuple[Any, str | None]:
    if "chosen" not in typed or "rejected" not in typed:
        return None, None
    chosen, rejected = typed["chosen"], typed["rejected"]
    if not fmt.conversational:
        same, label, shown = chosen == rejected, "chosen == rejected", chosen
    elif fmt.prompt == "implicit":
        if not chosen or not rejected:
            return None, None  # text_not_blank reports empty conversations
        # The shared leading turns are the prompt; the final turns are the answers compared.
        shown = chosen[-1].get("content")
        same, label = shown == rejected[-1].get("content"), "chosen[-1].content == rejected[-1].content"
    else:
        same, label = _turns(chosen) == _turns(rejected), "chosen == rejected"
        shown = chosen[0].get("content") if len(chosen) == 1 else _turns(chosen)
    return (False, f"{label} == {short_repr(shown)}") if same else (True, None)


def _check_label(fmt: DatasetFormat, row: Row, typed: Row) -> tuple[Any, str | None]:
    label = row[LABEL]
    if isinstance(label, bool):
        return True, None
    shown = "" if label is None else f": {short_repr(label)}"
    return False, f"label is {value_type(label)}, expected true or false{shown}"


def label_checks(fmt: DatasetFormat, batches) -> dict[str, Check]:
    """The unpaired rules that look at other rows, from one pass over every row: the label counts and
    the first row of each (prompt, completion, label). `batches`: the dataset's values, batch after
    batch (dicts of column -> list). The first-row index holds one key per distinct row."""
    counts: Counter = Counter()
    first_row: dict[tuple[str, str, bool], int] = {}
    start = 0
    for values in batches:
        labels = values[LABEL]
        counts.update(label for label in labels if isinstance(label, bool))
        for index, label in enumerate(labels):
            prompt, completion = values["prompt"][index], values["completion"][index]
            if isinstance(label, bool) and value_type(prompt) == value_type(completion) == fmt.value_type:
                first_row.setdefault((*_pair_key(prompt, completion), label), start + index)
        start += len(labels)

    def both_labels(fmt: DatasetFormat, row: Row, typed: Row) -> tuple[Any, str | None]:
        label = row[LABEL]
        if not isinstance(label, bool):
            return None, None  # label_is_boolean reports it
        others = counts[not label]
        if others:
            return others, None
        missing = "undesirable" if label else "desirable"
        return (
            0,
            f"all {counts[label]} labels are {label}: no {missing} row (label {not label}) for KTO to contrast this "
            "one with",
        )

    def unambiguous(fmt: DatasetFormat, row: Row, typed: Row) -> tuple[Any, str | None]:
        label = row[LABEL]
        if not isinstance(label, bool) or len(typed) < 2:
            return None, None  # label_is_boolean or consistent_types reports it
        other = first_row.get((*_pair_key(typed["prompt"], typed["completion"]), not label))
        if other is None:
            return True, None
        return (
            False,
            f"row {other} has the same prompt and completion {short_repr(_answer(typed['completion']))} labelled "
            f"{not label}",
        )

    return {"label_is_boolean": _check_label, "both_labels_present": both_labels, "no_conflicting_labels": unambiguous}


CHECKS: dict[str, Check] = {
    "consistent_types": _check_types,
    "text_not_blank": _check_text,
    "valid_roles": _check_roles,
    "text_turns_only": _check_text_turns,
    "has_assistant_turn": _check_has_assistant,
    "ends_with_assistant_turn": _check_ends_with_assistant,
    "prompt_ends_with_user_turn": _check_prompt_end,
    "shared_prompt_turns": _check_shared_prefix,
    "chosen_differs_from_rejected": _check_differs,
}


TOOLS_RENDERED: dict[str, Check] = {
    "text_turns_only": lambda fmt, row, typed: _check_text_turns(fmt, row, typed, tools_rendered=True)
}
"""The checks to use with a chat template that renders `tool_calls` (its tool-calling turns train as rendered)."""


def _trained_conversations(fmt: DatasetFormat) -> tuple[str, ...]:
    """Conversational columns the model is trained to produce: they must hold an assistant answer."""
    if not fmt.conversational:
        return ()
    if fmt.kind == "sft":
        return ("completion",) if fmt.prompt == "explicit" else ("messages",)
    if fmt.unpaired:
        return ("completion",)
    if fmt.kind == "preference":
        return ("chosen", "rejected")
    return ()


def _texts(column: str, value: Any):
    """(label, text) for every text in a field: the string itself or each message's content."""
    if isinstance(value, str):
        yield column, value
        return
    for i, turn in enumerate(value):
        if turn.get("tool_calls") and not turn.get("content"):
            continue  # an assistant turn that only calls tools carries no text
        yield f"{column}[{i}].content", turn.get("content")


def _pair_key(prompt: Any, completion: Any) -> tuple[str, str]:
    """A hashable form of a prompt and completion (strings, or the role and content of each turn)."""
    return repr(prompt if isinstance(prompt, str) else _turns(prompt)), repr(
        completion if isinstance(completion, str) else _turns(completion)
    )


def _answer(completion: Any) -> Any:
    return completion if isinstance(completion, str) else (completion[-1].get("content") if completion else completion)


def _turns(conversation: list[dict]) -> list[tuple[Any, Any]]:
    # Compare role and content only: Arrow fills keys other rows use (tool_calls, ...) with None.
    return [(turn.get("role"), turn.get("content")) for turn in conversation]


def _shared_prefix(chosen: list[dict], rejected: list[dict]) -> int:
    shared = 0
    for a, b in zip(_turns(chosen), _turns(rejected)):
        if a != b:
            break
        shared += 1
    return shared


def _first_turn(conversation: list[dict]) -> str:
    if not conversation:
        return "with no turns"
    first = conversation[0]
    return f"{first.get('role')} {short_repr(first.get('content'), 40)}"
