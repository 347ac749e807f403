"""Which of TRL's dataset formats a dataset is in, read from its columns and value types.

TRL's formats (https://huggingface.co/docs/trl/dataset_formats), per kind:
- sft: `text` (language modeling), `messages` (conversational language
  modeling), `prompt` + `completion` (prompt-completion, standard or conversational);
- preference: `prompt` + `chosen` + `rejected` (explicit prompt), `chosen` +
  `rejected` (implicit prompt: a conversational pair repeats the prompt turns),
  `prompt` + `completion` + `label` (unpaired preference, KTO's: one completion
  per row, `label` a boolean, True for desirable);
- prompt: `prompt` (prompt-only, for GRPO, RLOO and PPO).
"Standard" values are strings, "conversational" values are lists of
{"role", "content"} dicts. Other columns are extra and pass through (GRPO hands
them to reward functions).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

from rlhf_pipeline.trainers.data import Kind
from rlhf_pipeline.validators.report import DataValidationError, RuleResult, ValidationReport

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

KINDS: tuple[str, ...] = ("sft", "preference", "prompt")
STRING = "a string"
MESSAGES = "a list of {role, content} messages"
LABEL = "label"
"""The boolean column of unpaired preference rows (True: the completion is desirable)."""
BATCH_ROWS = 200_000
"""Rows the checks hold at once, so memory stays flat in the dataset's size: 200k rows of ~150 bytes
are 30 MB of Arrow, and ~300 MB at worst as Python objects (conversations, ~1.5 kB a row), the form
the per-row checks read. Great Expectations costs ~0.09 s a batch besides ~0.1 s per 100k rows:
a million rows take 1.8 s in batches of 100k, 1.2 s in batches of 250k."""


@dataclass(frozen=True)
class DatasetFormat:
    kind: Kind
    conversational: bool
    """Values are lists of {"role", "content"} messages rather than strings."""
    prompt: Literal["explicit", "implicit", "none"]
    """explicit: a `prompt` column; implicit: the prompt sits inside `text`,
    `messages`, or the shared leading turns of `chosen` and `rejected`."""
    columns: tuple[str, ...]
    """The columns TRL will use; any other column is extra and passes through."""

    @property
    def value_type(self) -> str:
        return MESSAGES if self.conversational else STRING

    @property
    def unpaired(self) -> bool:
        """One completion per row with a boolean `label` (TRL's unpaired preference format, for KTO)."""
        return self.kind == "preference" and LABEL in self.columns

    @cached_property  # read for every row by the per-row checks
    def text_columns(self) -> tuple[str, ...]:
        """The columns holding text (strings or messages): every column but the unpaired `label`."""
        return _text_columns(self.columns)

    def describe(self) -> str:
        style = "conversational" if self.conversational else "standard"
        if self.unpaired:
            return f"{style} unpaired preference ({', '.join(self.columns)})"
        shape = {
            ("sft", "implicit"): "language modeling",
            ("sft", "explicit"): "prompt-completion",
            ("preference", "explicit"): "preference, explicit prompt",
            ("preference", "implicit"): "preference, implicit prompt",
            ("prompt", "explicit"): "prompt-only",
        }.get((self.kind, self.prompt), self.kind)
        return f"{style} {shape} ({', '.join(self.columns)})"


def detect_format(kind: Kind, dataset: datasets.Dataset, source: str, batch_rows: int = BATCH_ROWS) -> DatasetFormat:
    """The TRL format of `dataset`, or DataValidationError (rule `format`) if it has none.

    Reads the dataset batch by batch: Arrow answers for string and message-list columns without
    converting a row to Python; other columns are counted row by row.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown dataset kind {kind!r}; expected one of {', '.join(KINDS)}")
    found = list(dataset.column_names)
    num_rows = len(dataset)

    def fail(problem: str) -> DataValidationError:
        rule = RuleResult("format", problem, success=False, failed_count=0)
        return DataValidationError(ValidationReport(source, kind, None, num_rows, [rule]))

    columns, prompt = _columns_for(kind, found, fail)
    # The unpaired `label` is a boolean: its values are the rules' business (label_is_boolean), not the format's.
    texts = _text_columns(columns)
    if num_rows:
        counts: dict[str, Counter] = {column: Counter() for column in texts}
        for batch in record_batches(dataset, texts, batch_rows):
            for column in texts:
                counts[column].update(_value_types(batch, column))
        conversational = _conversational_from_counts(kind, texts, counts, fail)
    else:  # nothing to look at: fall back on the declared features
        conversational = any(_is_list_feature(dataset.features.get(c)) for c in texts)
    return DatasetFormat(kind, conversational, prompt, columns)


def read_format(kind: Kind, dataset: datasets.Dataset, source: str) -> tuple[DatasetFormat, dict[str, list[Any]]]:
    """detect_format plus the values of the format's columns, every row at once as Python lists
    (the data stage reads `record_batches` instead, so that memory stays flat)."""
    fmt = detect_format(kind, dataset, source)
    # with_format(None): plain Python values whatever format the caller set;
    # slicing (unlike dataset.data) honours select()/shuffle() index mappings.
    return fmt, dataset.with_format(None).select_columns(list(fmt.columns))[:]


@dataclass
class Batch:
    """Consecutive rows of a dataset, as Arrow and (on first use) as the Python values `dataset[:]` gives."""

    start: int
    """The dataset row of the batch's first row: local row i is dataset row start + i."""
    table: pa.Table
    formatter: Any = field(repr=False)
    _values: dict[str, list[Any]] | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        return self.table.num_rows

    @property
    def values(self) -> dict[str, list[Any]]:
        if self._values is None:
            # The formatter behind `dataset[:]` with format None: a value reads the same either way.
            self._values = self.formatter.format_batch(self.table)
        return self._values


def record_batches(
    dataset: datasets.Dataset, columns: tuple[str, ...] | list[str], batch_rows: int = BATCH_ROWS
) -> Iterator[Batch]:
    """`columns` of `dataset`, `batch_rows` rows at a time, in order (select()/shuffle() index mappings honoured).
    An empty dataset gives one empty batch, so that table-level rules still see it. Each batch is a beat of the data
    stage's heartbeat (`trainers.runtime.heartbeat`): its watchdog watches it once it reads rows."""
    from datasets.formatting import get_formatter

    from rlhf_pipeline.trainers.runtime.heartbeat import beat

    selected = dataset.select_columns(list(columns)).with_format("arrow")
    formatter = get_formatter(None, features=selected.features)
    start = 0
    for table in selected.iter(batch_size=batch_rows):
        beat()
        yield Batch(start, table, formatter)
        start += table.num_rows
    if start == 0:
        yield Batch(0, selected[:0], formatter)


def value_type(value: Any) -> str:
    """STRING, MESSAGES, or a short description of what the value is instead."""
    if isinstance(value, str):
        return STRING
    if isinstance(value, list):
        if all(is_message(item) for item in value):
            return MESSAGES  # an empty list counts: the content rules report it
        inner = sorted({type(item).__name__ for item in value})
        return f"a list of {'/'.join(inner)}"
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def is_message(item: Any) -> bool:
    return isinstance(item, dict) and "role" in item and "content" in item


def _columns_for(kind: str, found: list[str], fail) -> tuple[tuple[str, ...], str]:
    has = set(found).__contains__
    listed = f"found columns {found}"
    if kind == "sft":
        # TRL's SFTTrainer order: prompt-completion first, then messages, then text.
        if has("prompt") and has("completion"):
            return ("prompt", "completion"), "explicit"
        if has("messages"):
            return ("messages",), "implicit"
        if has("text"):
            return ("text",), "implicit"
        hint = ""
        if has("chosen") and has("rejected"):
            hint = "; this looks like preference data (kind 'preference')"
        elif has("prompt"):
            hint = "; 'prompt' alone is prompt-only data (kind 'prompt'), SFT also needs 'completion'"
        raise fail(
            f"sft data needs a 'text' column, a 'messages' column, or 'prompt' and 'completion' columns; {listed}{hint}"
        )
    if kind == "preference":
        if has("chosen") and has("rejected"):
            if has("prompt"):
                return ("prompt", "chosen", "rejected"), "explicit"
            return ("chosen", "rejected"), "implicit"
        if has("completion") and has(LABEL):
            if has("prompt"):
                return ("prompt", "completion", LABEL), "explicit"
            # TRL extracts an implicit prompt from chosen/rejected only; an unpaired row must name its prompt.
            raise fail(
                "unpaired preference data (TRL's KTO format) needs 'prompt', 'completion' and 'label' columns; "
                f"{listed}, missing ['prompt']"
            )
        missing = [c for c in ("chosen", "rejected") if not has(c)]
        raise fail(
            "preference data needs 'chosen' and 'rejected' columns (plus an optional 'prompt'), or unpaired "
            f"'prompt', 'completion' and 'label' columns; {listed}, missing {missing}"
        )
    if has("prompt"):
        return ("prompt",), "explicit"
    hint = "; 'messages' is SFT data: rename it to 'prompt' if it holds prompts" if has("messages") else ""
    raise fail(f"prompt data needs a 'prompt' column (a string or a list of messages); {listed}{hint}")


def _text_columns(columns: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(column for column in columns if column != LABEL)


def _value_types(batch: Batch, column: str) -> Counter:
    """value_type of each of the column's values in this batch, counted (in first-seen order where Python counts)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    array = batch.table.column(column)
    arrow_type = array.type
    nulls = array.null_count
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_string_view(arrow_type):
        found = Counter({STRING: len(array) - nulls})  # a non-null value is a str
    elif (
        (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type))
        and _is_message_struct(arrow_type.value_type)
        and pc.list_flatten(array).null_count == 0
    ):
        # Every item a struct with role and content: a dict with both keys
        found = Counter({MESSAGES: len(array) - nulls})
    else:
        return Counter(value_type(value) for value in batch.values[column])
    # A null is None. Arrow cannot say whether it came first; that order only breaks ties between
    # unusable types in an error message, and a column of one Arrow type has one usable type at most.
    found["None"] = nulls
    return +found  # drops zero counts


def _is_message_struct(arrow_type) -> bool:
    import pyarrow as pa

    return (
        pa.types.is_struct(arrow_type)
        and arrow_type.get_field_index("role") >= 0
        and arrow_type.get_field_index("content") >= 0
    )


def _conversational_from_counts(kind, columns, type_counts: dict[str, Counter], fail) -> bool:
    """Each column's type is the type most of its values have; they must all agree."""
    majority: dict[str, str] = {}
    for column in columns:
        counts = type_counts[column]
        usable = {t: n for t, n in counts.items() if t in (STRING, MESSAGES)}
        if not usable:
            seen = ", ".join(f"{t} ({n} rows)" for t, n in counts.most_common(3))
            raise fail(f"column {column!r} holds {seen}; expected {STRING} or {MESSAGES}")
        # Counter keeps first-seen order, so a tie goes to the type of the earlier row.
        majority[column] = max(usable, key=usable.__getitem__)
    if len(set(majority.values())) > 1:
        plural = {STRING: "strings", MESSAGES: "message lists"}
        split = ", ".join(f"{c!r} holds {plural[t]}" for c, t in majority.items())
        raise fail(f"columns disagree: {split}; TRL needs all of {list(columns)} standard or all conversational")
    conversational = majority[columns[0]] == MESSAGES
    if columns == ("messages",) and not conversational:
        raise fail(f"column 'messages' holds strings; expected {MESSAGES} (plain strings go in 'text')")
    if columns == ("text",) and conversational:
        raise fail(f"column 'text' holds message lists; expected {STRING} (conversations go in 'messages')")
    return conversational


def _is_list_feature(feature: Any) -> bool:
    # Avoids importing datasets: List, LargeList and the legacy Sequence all hold lists.
    return isinstance(feature, list) or type(feature).__name__ in ("List", "LargeList", "Sequence")
