"""Rule `no_train_eval_leakage`: a prompt held out for evaluation must not appear in the data trained on.

A held-out score on prompts the model trained on measures memory, not
generalisation. A row's prompts are what the user asked: the `prompt` string, or
every user turn of a conversation (the prompt column, `messages`, or the turns
chosen and rejected share), compared as a person reads them (`normalise`:
Unicode NFKC, invisible characters removed, case folded, whitespace runs
collapsed), so that "Sort 12 -> ", "sort\u200b 12 ->" and "ｓｏｒｔ １２ ->" are one
prompt. Standard `text` rows and standard
implicit-prompt pairs carry no separable prompt and are not compared.

Rule `no_benchmark_prompt_in_training`: a prompt trained on must not contain a test prompt of a benchmark eval
scores, nor share a run of 13 words with one (`SPAN_WORDS`, the n-gram rule of Tulu 3's and OLMo's
decontamination), compared as words of the normalised text, so that a copy with a sentence added, other punctuation
or other case is still found.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf_pipeline.validators.formats import BATCH_ROWS, detect_format, record_batches
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
    return check_leakages([(held_out, training)])[0]


def check_leakages(checks: list[tuple[Split, list[Split]]], batch_rows: int = BATCH_ROWS) -> list[RuleResult]:
    """check_leakage for each (held-out split, training splits), reading each training split once.

    Only the held-out prompts are kept in memory: a training split is streamed batch by batch,
    noting the first row of each held-out prompt it holds.
    """
    held = [list(_rows_with_prompts(split, batch_rows)) for split, _ in checks]
    wanted = {prompt for rows in held for _, prompt in rows}
    first_rows: dict[int, dict[str, int]] = {}  # id(training split) -> held-out prompt -> its first row there
    for _, training in checks:
        for split in training:
            if id(split) not in first_rows:
                found: dict[str, int] = {}
                for row, prompt in _rows_with_prompts(split, batch_rows, wanted):
                    found.setdefault(prompt, row)
                first_rows[id(split)] = found
    results = []
    for (held_out, training), rows in zip(checks, held):
        leaked: list[dict] = []
        for row, prompt in rows:
            if leaked and leaked[-1]["row"] == row:
                continue  # one example per held-out row: its first leaked turn
            # The first training split (in order) that holds the prompt, at its first row there.
            split = next((split for split in training if prompt in first_rows[id(split)]), None)
            if split is not None:
                why = (
                    f"{short_repr(prompt)} is also row {first_rows[id(split)][prompt]} of {split.name} ({split.source})"
                )
                leaked.append({"row": row, "value": why})
        trained = ", ".join(f"{split.name} ({split.source})" for split in training)
        description = f"a prompt held out in {held_out.name} must not appear in the data trained on: {trained}"
        results.append(RuleResult(RULE, description, not leaked, len(leaked), leaked[:MAX_EXAMPLES]))
    return results


BENCHMARK_RULE = "no_benchmark_prompt_in_training"


def check_benchmark_leakage(training: Split, benchmark: str, source: str, prompts: list[str]) -> RuleResult:
    """The rows of a training split whose prompt (any user turn) shares a run of `SPAN_WORDS` words with one of a
    benchmark's test prompts (`prompts`, in the benchmark file's order), or contains a shorter one whole: a score on a
    prompt trained on measures memory, and a copy with a sentence added, other punctuation or other case is still a
    copy (`words`). Each example names the training row, the span and the benchmark's row."""
    index = span_index(prompts)
    leaked: list[dict] = []
    for row, prompt in _rows_with_prompts(training):
        if leaked and leaked[-1]["row"] == row:
            continue  # one example per row: its first leaked turn
        if (found := shared_span(prompt, index)) is not None:
            span, at = found
            why = f"{short_repr(prompt)} shares {short_repr(span)} with row {at} of {benchmark} ({source})"
            leaked.append({"row": row, "value": why})
    description = (
        f"a prompt trained on must not contain one of {benchmark}'s test prompts, which eval scores, nor share a run "
        f"of {SPAN_WORDS} words with one ({source})"
    )
    return RuleResult(BENCHMARK_RULE, description, not leaked, len(leaked), leaked[:MAX_EXAMPLES])


SPAN_WORDS = 13
"""Words in a row a training prompt may not share with a benchmark prompt (the n-gram rule of Tulu 3's and OLMo's
decontamination); a benchmark prompt shorter than this may not be contained whole."""


def words(text: Any) -> list[str]:
    """`normalise`d text as its words (runs of letters and digits): punctuation and spacing do not hide a span."""
    import re

    normalised = normalise(text)
    return re.findall(r"\w+", normalised) if normalised else []


@dataclass(frozen=True)
class Spans:
    """Every run of `SPAN_WORDS` words of some texts (a shorter text: all of its words), to the first text with it."""

    index: dict[tuple[str, ...], int]
    lengths: tuple[int, ...]
    """The run lengths in `index`, longest first."""


def span_index(texts: list[str], n: int = SPAN_WORDS) -> Spans:
    """The `Spans` of `texts`: each text's runs of `n` words (all of its words when it has fewer)."""
    index: dict[tuple[str, ...], int] = {}
    for row, text in enumerate(texts):
        tokens = words(text)
        for start in range(max(1, len(tokens) - n + 1) if tokens else 0):
            index.setdefault(tuple(tokens[start : start + n]), row)
    return Spans(index, tuple(sorted({len(span) for span in index}, reverse=True)))


def shared_span(text: Any, spans: Spans) -> tuple[str, int] | None:
    """The first run of words `text` shares with one of `spans`' texts, and that text's row; None."""
    tokens = words(text)
    for length in spans.lengths:
        for start in range(len(tokens) - length + 1):
            row = spans.index.get(tuple(tokens[start : start + length]))
            if row is not None:
                return " ".join(tokens[start : start + length]), row
    return None


def _rows_with_prompts(
    split: Split, batch_rows: int = BATCH_ROWS, wanted: set[str] | None = None
) -> Iterator[tuple[int, str]]:
    """(0-based row, normalised prompt) of every row that has one (and, given `wanted`, one of those), in order."""
    import pyarrow as pa
    import pyarrow.compute as pc

    fmt = detect_format(split.kind, split.dataset, split.source, batch_rows)
    if fmt.prompt == "explicit":
        column = "prompt"
    elif fmt.conversational:
        column = "messages" if fmt.kind == "sft" else "chosen"
    else:
        return
    targets = None if wanted is None else pa.array(sorted(wanted), type=pa.string())
    for batch in record_batches(split.dataset, [column], batch_rows):
        texts = batch.table.column(column)
        if targets is None or not pa.types.is_string(texts.type):
            candidates = range(batch.num_rows)
        else:
            # Printable ASCII without a run of spaces: str.split() splits at single spaces alone, so cutting the
            # ends' spaces and lowering the case normalises as `normalise` does (NFKC and casefold leave printable
            # ASCII as ASCII lowering does), and only rows that may hold a wanted prompt come to Python.
            plain = pc.and_(
                pc.and_(pc.string_is_ascii(texts), pc.ascii_is_printable(texts)),
                pc.invert(pc.match_substring(texts, "  ")),
            )
            trimmed = pc.ascii_lower(pc.utf8_trim(texts, " "))
            maybe = pc.or_(pc.invert(pc.fill_null(plain, False)), pc.is_in(trimmed, value_set=targets))
            candidates = pc.indices_nonzero(maybe).to_pylist()
        values = batch.values[column] if targets is None or len(candidates) > batch.num_rows // 10 else None
        for index in candidates:
            value = values[index] if values is not None else texts[index].as_py()
            for text in _user_texts(value):
                prompt = normalise(text)
                if prompt is not None and (wanted is None or prompt in wanted):
                    yield batch.start + index, prompt


def _user_texts(value: Any) -> list[Any]:
    """Every user turn of a conversation (a prompt seen in a later turn was still trained on), or the prompt."""
    if isinstance(value, list):
        return [turn.get("content") for turn in value if isinstance(turn, dict) and turn.get("role") == "user"]
    return [value]


# Zero-width spaces and joiners, word joiner, BOM, soft hyphen, Mongolian vowel separator: invisible, not spaces
INVISIBLE = dict.fromkeys([0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF, 0x00AD, 0x180E])


def normalise(text: Any) -> str | None:
    """The prompt as a person reads it: Unicode NFKC (full-width digits, ligatures), invisible characters removed,
    case folded, whitespace runs collapsed; None when nothing is left."""
    import unicodedata

    if not isinstance(text, str):
        return None
    text = unicodedata.normalize("NFKC", text).translate(INVISIBLE).casefold()
    return " ".join(text.split()) or None
