"""People's labels of pairs: the labels file people write, its rules, and the store that keeps labels between pauses.

    {"pair": 0, "label": "A", "hash": "3f2a9c1e0b7d"}      one line per pair; label "A", "B", "tie" or null

`pair` is the pair's number, `hash` its content hash (`trainers.pairs.stage.pair_hash`), both as `to_label.jsonl`
and the flow run's table show them (the hash may be left out; when given it must be that pair's, so a label never
lands on another pair). Every mistake is refused before anything is stored, naming the file, the line and the rule
(`LabelsError`): a pair that is not an integer (of at most 18 digits), or not one of the pairs waiting; a label that
is not one of the four; a hash of another pair; two different labels for one pair; a key given twice on a line; a
line nested deeper than a labels line is; a file over `MAX_BYTES` (read line by line, never whole).

The store (`<artifact_root>/pairs/.labels/<samples key>.json`) keeps each label with its pair's hash; it is replaced
whole, and only with labels that passed these rules.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlhf_pipeline.trainers.pairs.stage import LABELS

MAX_BYTES = 8 << 20  # ~200,000 labels; the to_label.jsonl of 2,000 pairs with 2 KB answers fits too
LABELS_DIR = ".labels"


class LabelsError(ValueError):
    """Labels that break a rule, named with their file and line."""


def labels_store(artifact_root: str | Path, samples_key: str) -> Path:
    """Where people's labels for one set of samples are kept between pauses, suspends and runs."""
    return Path(artifact_root) / "pairs" / LABELS_DIR / f"{samples_key}.json"


def read_labels_file(path: Path, waiting: dict[int, str]) -> dict[int, str | None]:
    """The labels of a file people wrote, for the pairs `waiting` (pair -> hash). Its place is checked here, as it is
    read (hours after the parameters may be, past a pause), against the folders the worker lets runs read."""
    from rlhf_pipeline.tasks.tracking.client import always_readable
    from rlhf_pipeline.trainers.runtime.trust import check_path

    try:
        check_path(path, "labels file", always_readable())
    except ValueError as exc:
        raise LabelsError(str(exc)) from None
    if not path.is_file():
        raise LabelsError(f"labels file {path}: no such file")
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise LabelsError(
            f"labels file {path}: {size / 1e6:.1f} MB, over the {MAX_BYTES >> 20} MiB a labels file may be (one short "
            "line per pair)"
        )
    labels: dict[int, str | None] = {}
    first: dict[int, int] = {}
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"labels file {path} line {number}"
            pair, label = check_line(line, waiting, where)
            if pair in labels and labels[pair] != label:
                raise LabelsError(
                    f"{where}: pair {pair} is labelled {label!r} here and {labels[pair]!r} on line {first[pair]}; "
                    "one label per pair"
                )
            labels[pair], first[pair] = label, first.get(pair, number)
    return labels


MAX_DEPTH = 4
"""Brackets a line may open before its first closes: a labels line is one flat object."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"key {repeated[0]!r} given twice (JSON would keep the last one silently)")
    return dict(pairs)


def _depth(line: str) -> int:
    """How deep the line's brackets go, outside its strings (read before the line is parsed: Python's JSON parser
    recurses once a level and fails, with a traceback, on a few thousand)."""
    deepest = depth = 0
    in_string = escaped = False
    for char in line:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def check_line(line: str, waiting: dict[int, str], where: str) -> tuple[int, str | None]:
    """(pair, label) of one line, or LabelsError naming the rule it breaks: not JSON, nested deeper than a labels line
    is, a key given twice, a pair that is not a short integer, a label or a hash that is not the pair's."""
    if (depth := _depth(line)) > MAX_DEPTH:
        raise LabelsError(f'{where}: nested {depth} deep; each line is one flat object {{"pair": .., "label": ..}}')
    try:
        row = json.loads(line, object_pairs_hook=_unique_keys, parse_int=_pair_number)
    except json.JSONDecodeError as exc:
        raise LabelsError(f"{where}: not JSON ({exc.msg}): {line[:200]!r}") from exc
    except (ValueError, RecursionError) as exc:
        raise LabelsError(f"{where}: {str(exc)[:200]}: {line[:200]!r}") from exc
    if not isinstance(row, dict):
        raise LabelsError(f'{where}: each line is an object {{"pair": <id>, "label": ...}}, got {line[:200]!r}')
    pair, label = row.get("pair"), row.get("label")
    if type(pair) is not int:  # bool is an int to Python, and true would be pair 1
        raise LabelsError(f"{where}: the pair is an integer pair number, got {pair!r}")
    return check_label(pair, label, row.get("hash"), waiting, where), label


MAX_PAIR_DIGITS = 18
"""A pair number has at most this many digits (Python refuses to read one of over 4,300, with a traceback)."""


def _pair_number(text: str) -> int:
    if len(text.lstrip("-")) > MAX_PAIR_DIGITS:
        raise ValueError(f"a number of {len(text)} digits; a pair number has at most {MAX_PAIR_DIGITS}")
    return int(text)


def check_label(pair: int, label: object, given_hash: object, waiting: dict[int, str], where: str) -> int:
    if pair not in waiting:
        shown = f"{min(waiting)}..{max(waiting)}" if waiting else "none"
        raise LabelsError(f"{where}: pair {pair} is not one of the {len(waiting)} pairs waiting for labels ({shown})")
    if label not in (*LABELS, None):
        raise LabelsError(f"{where}: label {label!r} of pair {pair} is not one of {', '.join(LABELS)} or null")
    if given_hash is not None and given_hash != waiting[pair]:
        raise LabelsError(
            f"{where}: hash {given_hash!r} is not pair {pair}'s ({waiting[pair]}): the line was written for another "
            "pair or other samples"
        )
    return pair


def read_store(path: Path, shown: dict[int, str]) -> tuple[dict[int, str | None], bool]:
    """(pair -> label, finished) of the store, for the pairs `shown` (pair -> hash): a label kept for a pair whose
    content is not the one shown now is left out. ({}, False) where there is none yet."""
    if not path.is_file():
        return {}, False
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        entries = stored["labels"].items()
        labels = {}
        for key, entry in entries:
            label, kept_hash = (entry.get("label"), entry.get("hash")) if isinstance(entry, dict) else (entry, None)
            if not key.isdigit() or label not in (*LABELS, None):
                raise ValueError(f"entry {key!r}: {entry!r}")
            if int(key) in shown and kept_hash in (None, shown[int(key)]):
                labels[int(key)] = label
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        raise LabelsError(
            f"labels store {path}: unreadable ({exc}); it was not written by this version: move it aside and label "
            "again, or give the labels as pairs.people.labels_file"
        ) from exc
    return labels, bool(stored.get("finished"))


def write_store(path: Path, labels: dict[int, str | None], finished: bool, shown: dict[int, str]) -> None:
    """The store replaced whole with `labels` (each checked against `shown`, kept with its pair's hash); a crash
    leaves the old one."""
    entries = {}
    for pair, label in sorted(labels.items()):
        check_label(pair, label, None, shown, f"labels for {path}")
        entries[str(pair)] = {"label": label, "hash": shown[pair]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"labels": entries, "finished": finished}) + "\n")
    os.replace(tmp, path)
