"""Raw-file checks: what a local file must satisfy before it is parsed as a dataset.

`datasets` reports a stray non-UTF-8 byte, a cut-off JSON line or an empty file
with an error that names neither the file nor the line (a bare
UnicodeDecodeError, Arrow's "JSON parse error ... in row 1", a StopIteration).
These checks read the bytes line by line and name the file, the rule and the
1-based lines, as an editor shows them:

    reports = check_files("sft", [Path("data/sft.jsonl")])  # one report per file
    errors = [DataValidationError(r) for r in reports if not r.success]

Rules: `not_empty_file`, `utf8`, `json_lines` (.jsonl, and .json files that are
not one JSON array), `json_document` (.json arrays) and `row_size` (line-based
files: .jsonl, .json lines, .csv). Parquet is binary and self-checking: only
`not_empty_file`. Nothing here imports more than the standard library (and orjson, prefect's
dependency, when it is there).

A file is read in blocks of whole lines. A line that orjson parses as an object is a valid row for
every rule (orjson accepts a subset of what `json.loads` does: no NaN, no lone surrogates, strict
UTF-8), and a block no longer than MAX_ROW_BYTES per line holds no oversized row; every other line
takes the full per-line checks, whose messages come from `json`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Callable

from rlhf_pipeline.validators.report import MAX_EXAMPLES, RuleResult, ValidationReport, short_repr

MAX_ROW_BYTES = 1 << 20
"""Longest row (one line) accepted, in bytes (rule `row_size`). 1 MiB of text is
~250k BPE tokens (~4 bytes each), far beyond any max_length trained here: such
a row is a broken export (a whole file pasted into one field) that Arrow would
load whole only for the trainer to truncate it."""

BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark opening the file is harmless: `datasets` skips it

NOT_EMPTY = "not_empty_file"
UTF8 = ("utf8", "every line must be valid UTF-8")
JSON_LINES = ("json_lines", "every non-blank line must be one complete JSON object {column: value}")
JSON_DOCUMENT = ("json_document", "a .json file starting with '[' must be one JSON array of row objects")
BLOCK_BYTES = 4 << 20  # lines are read this many bytes at a time (a longer line is read whole)
BLANK = b" \t\n\r\x0b\x0c"  # what bytes.strip() removes: a line of these is blank


def check_files(kind: str, paths: Iterable[Path]) -> list[ValidationReport]:
    """One report per file, in order; every rule runs, so a report lists all of a file's problems."""
    return [check_file(kind, Path(path)) for path in paths]


def check_file(kind: str, path: Path) -> ValidationReport:
    suffix = path.suffix.lower()
    if suffix == ".json" and _first_byte(path) == b"[":
        results, lines = _check_json_document(path)
    elif suffix in (".jsonl", ".json", ".csv"):
        results, lines = _check_lines(path, parse_json=suffix != ".csv", header=suffix == ".csv")
    else:
        empty = path.stat().st_size == 0
        results, lines = [_table_rule((NOT_EMPTY, "a data file must not be empty (0 bytes)"), success=not empty)], 0
    return ValidationReport(str(path), kind, None, lines, results, unit="line")


def _row_size() -> tuple[str, str]:
    # Read at call time, so that a test (or a user) can lower the module constant.
    return "row_size", f"every line (one row) must be at most {MAX_ROW_BYTES:,} bytes"


def _check_lines(path: Path, *, parse_json: bool, header: bool) -> tuple[list[RuleResult], int]:
    failed: dict[str, list[tuple[int, str]]] = {UTF8[0]: [], JSON_LINES[0]: [], "row_size": []}
    fine = _json_block_test() if parse_json else _text_block_test
    number, rows = 0, 0
    for first, lines, last_complete in _line_blocks(path):
        if first == 1 and lines[0].startswith(BOM):
            lines[0] = lines[0][len(BOM) :]
        number = first + len(lines) - 1
        if max(map(len, lines)) <= MAX_ROW_BYTES and fine(lines):
            rows += len(lines)  # the common block: every line a row that passes every rule
            continue
        for number, raw in enumerate(lines, first):
            complete = last_complete or number < first + len(lines) - 1
            rows += _check_line(number, raw, complete, parse_json, failed)
    rows -= 1 if header and rows else 0
    row = "a non-blank line after the header" if header else "a non-blank line"
    results = [_table_rule((NOT_EMPTY, f"a data file must hold at least one row ({row})"), success=rows > 0)]
    results.append(_line_rule(UTF8, failed[UTF8[0]]))
    if parse_json:
        results.append(_line_rule(JSON_LINES, failed[JSON_LINES[0]]))
    results.append(_line_rule(_row_size(), failed["row_size"]))
    return results, number


def _check_line(
    number: int, raw: bytes, complete: bool, parse_json: bool, failed: dict[str, list[tuple[int, str]]]
) -> int:
    """Every rule on one line (without its newline); returns 1 for a row, 0 for a blank line."""
    content = raw.rstrip(b"\r\n")
    if len(content) > MAX_ROW_BYTES:
        failed["row_size"].append((number, f"{len(content):,} bytes, over the {MAX_ROW_BYTES:,}-byte limit"))
    if not content.strip():
        return 0
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as error:
        failed[UTF8[0]].append((number, _not_utf8(content, error.start, error.reason)))
        return 1
    if parse_json:
        why = _not_a_json_object(text, complete=complete)
        if why:
            failed[JSON_LINES[0]].append((number, why))
    return 1


def _line_blocks(path: Path):
    """(number of the first line, the lines without their newline, whether the last one had a newline) per block."""
    first, rest = 1, b""
    with open(path, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            lines = (rest + block).split(b"\n")
            rest = lines.pop()  # the part after the last newline: the start of the next block's first line
            if lines:
                yield first, lines, True
                first += len(lines)
    if rest:
        yield first, [rest], False  # the file ends mid-line


def _json_block_test() -> Callable[[list[bytes]], bool]:
    """A test that passes a block only when every JSON-lines rule accepts each of its lines: one
    complete JSON object per line, valid UTF-8 (a false result only sends the block to the per-line checks)."""
    try:
        from orjson import loads  # ~3x json's speed on short rows; accepts no line json rejects
    except ImportError:

        def loads(raw: bytes):
            return json.loads(raw.decode("utf-8"))

    def fine(lines: list[bytes]) -> bool:
        try:
            return all(type(loads(raw)) is dict for raw in lines)
        except ValueError:  # orjson's JSONDecodeError, json's and UnicodeDecodeError are ValueErrors
            return False

    return fine


def _text_block_test(lines: list[bytes]) -> bool:
    """Every line non-blank valid UTF-8 (CSV rows)."""
    try:
        b"\n".join(lines).decode("utf-8")  # a newline byte never sits inside a UTF-8 character
    except UnicodeDecodeError:
        return False
    return all(raw.strip(BLANK) for raw in lines)


def _check_json_document(path: Path) -> tuple[list[RuleResult], int]:
    data = path.read_bytes().removeprefix(BOM)
    lines = data.count(b"\n") + (not data.endswith(b"\n"))
    utf8: list[tuple[int, str]] = []
    document: list[tuple[int, str]] = []
    rows = 0
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line_start = data.rfind(b"\n", 0, error.start) + 1
        line_end = data.find(b"\n", error.start)
        line = data[line_start : None if line_end < 0 else line_end]
        utf8.append((data.count(b"\n", 0, error.start) + 1, _not_utf8(line, error.start - line_start, error.reason)))
    else:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            document.append((error.lineno, _json_error(error)))
        else:
            if not isinstance(value, list):
                document.append((1, f"a JSON {_json_type(value)}, expected an array of row objects"))
            else:
                rows = len(value)
                bad = next((i for i, row in enumerate(value) if not isinstance(row, dict)), None)
                if bad is not None:
                    element = value[bad]
                    why = f"element {bad} is a JSON {_json_type(element)}, expected an object: {short_repr(element)}"
                    document.append((1, why))
    results = [
        # An unreadable document is reported as such, not as empty as well.
        _table_rule(
            (NOT_EMPTY, "a JSON array must hold at least one row object"), success=rows > 0 or bool(utf8 or document)
        ),
        _line_rule(UTF8, utf8),
        _line_rule(JSON_DOCUMENT, document),
    ]
    return results, lines


def _not_utf8(line: bytes, start: int, reason: str) -> str:
    near = line[max(0, start - 20) : start + 4]
    return f"byte 0x{line[start]:02x} at column {start + 1} is not UTF-8 ({reason}), near {near!r}"


def _not_a_json_object(text: str, *, complete: bool) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        why = _json_error(error)
        # Only the last line can lack its newline: a file cut off mid-write.
        return why + " (the file ends mid-line: truncated?)" if not complete else why
    if isinstance(value, dict):
        return None
    return f"a JSON {_json_type(value)}, expected an object: {short_repr(value)}"


def _json_error(error: json.JSONDecodeError) -> str:
    # json's messages read "Expecting ',' delimiter" or "Unterminated string starting at".
    return f"{error.msg}{'' if error.msg.endswith(' at') else ' at'} column {error.colno}"


def _json_type(value: object) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _first_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4096).removeprefix(BOM).lstrip()[:1]


def _table_rule(rule: tuple[str, str], *, success: bool) -> RuleResult:
    return RuleResult(rule[0], rule[1], success, failed_count=0)


def _line_rule(rule: tuple[str, str], failures: list[tuple[int, str]]) -> RuleResult:
    examples = [{"line": line, "value": why} for line, why in failures[:MAX_EXAMPLES]]
    return RuleResult(rule[0], rule[1], not failures, len(failures), examples)
