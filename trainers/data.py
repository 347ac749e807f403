"""Where datasets come from: local JSONL/JSON/Parquet/CSV files or hub ids, all through `datasets`.

The bundled files and a user's files take the same path: `load_source` reads
them, the `data` stage validates them and writes Parquet copies that later
stages read, so a stage never sees a file that changed under it.
"""

from __future__ import annotations

import hashlib
import math
import re
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from rlhf_pipeline.trainers.config import StageConfig, StrictModel

if TYPE_CHECKING:
    from datasets import Dataset

# The bundled task ships as package data; `data/sort/...` paths that are not in the working
# directory resolve here (the checkout in an editable install, site-packages/rlhf_pipeline in a wheel).
BUNDLED_ROOT = Path(str(resources.files("rlhf_pipeline.data"))).parent
BUNDLED = "data/sort"
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

Kind = Literal["sft", "preference", "prompt"]


class DatasetSpec(StrictModel):
    path: str = Field(
        description=(
            "A local .jsonl/.json/.parquet/.csv file, a glob of them (`prefs/*.jsonl`: new files are picked up), a "
            "folder of files of one of those formats, or a Hugging Face hub dataset id."
        )
    )
    split: str = Field("train", description="Split to read (hub datasets; local files have one split, 'train').")
    name: str | None = Field(None, description="Hub dataset configuration name.")
    revision: str | None = Field(
        None,
        description=(
            "Hub revision (a commit, tag or branch; a branch is resolved to its current commit, so new data re-runs "
            "the stages)."
        ),
    )


def _bundled(name: str) -> DatasetSpec:
    return DatasetSpec(path=f"{BUNDLED}/{name}.jsonl")


class DataConfig(StageConfig):
    """The datasets of one pipeline run. Defaults: the bundled "sort the digits" task."""

    sft: DatasetSpec | None = Field(
        default_factory=lambda: _bundled("sft"),
        description="SFT demonstrations (text, messages, or prompt/completion); None with sft.enabled=false.",
    )
    sft_eval: DatasetSpec | None = Field(
        None, description="Held-out demonstrations sft evaluates on while it trains (sft.eval_strategy); None: none."
    )
    preference: DatasetSpec | None = Field(
        default_factory=lambda: _bundled("preference"),
        description="Preference pairs (prompt?/chosen/rejected) for rm and dpo; None when no stage reads them.",
    )
    preference_eval: DatasetSpec | None = Field(
        default_factory=lambda: _bundled("preference_eval"),
        description="Held-out pairs for reward-model accuracy; None to skip.",
    )
    prompts: DatasetSpec | None = Field(
        default_factory=lambda: _bundled("prompts"),
        description="Prompt-only rows for online RL (reference columns pass through); None when no stage reads them.",
    )
    prompts_eval: DatasetSpec = Field(
        default_factory=lambda: _bundled("prompts_eval"),
        description="Held-out prompts (with `answer` for exact match) for eval.",
    )

    def sources(self) -> dict[str, tuple[Kind, DatasetSpec]]:
        """Dataset name -> (kind, spec), in the order the data stage checks them."""
        named: dict[str, tuple[Kind, DatasetSpec | None]] = {
            "sft": ("sft", self.sft),
            "sft_eval": ("sft", self.sft_eval),
            "preference": ("preference", self.preference),
            "preference_eval": ("preference", self.preference_eval),
            "prompts": ("prompt", self.prompts),
            "prompts_eval": ("prompt", self.prompts_eval),
        }
        return {name: (kind, spec) for name, (kind, spec) in named.items() if spec is not None}


def check_readable(spec: DatasetSpec, field: str, always: tuple[Path, ...]) -> None:
    """Every local file the dataset names that exists (its path, a glob's or a folder's files) against the folders the
    worker lets runs read (`always` besides them): with the parameters, and again as the data stage reads them."""
    from rlhf_pipeline.trainers.runtime.trust import check_path

    try:
        files = local_files(spec) or []
    except ValueError:
        files = []  # the data stage names what is wrong with it
    for file in [Path(spec.path), *files]:
        if file.expanduser().exists():
            check_path(file, f"{field}={spec.path!r}", always)


def local_files(spec: DatasetSpec) -> list[Path] | None:
    """The files a spec names (a path or a glob such as `prefs/2026-*.jsonl`), relative to the
    working directory or else to the project, sorted; None for a hub id."""
    if any(char in spec.path for char in "*?["):
        for base in (Path.cwd(), BUNDLED_ROOT):
            pattern = Path(spec.path).expanduser()
            root, relative = (
                (Path(pattern.anchor), str(pattern.relative_to(pattern.anchor)))
                if pattern.is_absolute()
                else (base, spec.path)
            )
            matched = sorted(path.resolve() for path in root.glob(relative) if path.is_file())
            if matched:
                suffixes = {path.suffix for path in matched}
                if len(suffixes) > 1:
                    raise ValueError(
                        f"{spec.path}: matches files of several types {sorted(suffixes)}; a dataset is one type"
                    )
                return matched
        raise ValueError(f"{spec.path}: the pattern matches no file (looked in {Path.cwd()} and {BUNDLED_ROOT})")
    for candidate in (Path(spec.path).expanduser(), BUNDLED_ROOT / spec.path):
        if candidate.is_file():
            return [candidate.resolve()]
        if candidate.is_dir():
            return folder_files(candidate, spec.path)
    if Path(spec.path).suffix in FILE_BUILDERS:
        raise ValueError(f"{spec.path}: no such file (looked in {Path.cwd()} and {BUNDLED_ROOT})")
    return None


def folder_files(folder: Path, given: str) -> list[Path]:
    """A local folder as a dataset: its data files (top level, hidden files aside), all of one declared format;
    mixed formats, other files and an empty folder are refused by name (a folder is never a hub id)."""
    files = sorted(path.resolve() for path in folder.iterdir() if path.is_file() and not path.name.startswith("."))
    by_type: dict[str, list[str]] = {}
    for path in files:
        by_type.setdefault(path.suffix if path.suffix in FILE_BUILDERS else "other", []).append(path.name)
    if "other" in by_type:
        raise ValueError(
            f"{given}: a dataset folder holds data files only ({', '.join(sorted(FILE_BUILDERS))}); "
            f"{', '.join(by_type['other'][:5])} {'is' if len(by_type['other']) == 1 else 'are'} not one"
        )
    if len(by_type) > 1:
        listed = "; ".join(f"{kind}: {', '.join(names[:3])}" for kind, names in sorted(by_type.items()))
        raise ValueError(f"{given}: a dataset folder holds one format, this one several ({listed})")
    if not files:
        raise ValueError(f"{given}: the folder holds no data file ({', '.join(sorted(FILE_BUILDERS))})")
    return files


def dataset_fingerprint(spec: DatasetSpec) -> str:
    """Content hash of the local files (a new file in a glob changes it, a renamed one does not); for a hub
    dataset its id, config, split and revision, the revision resolved to a commit when the hub answers."""
    paths = local_files(spec)
    if paths is None:
        identity = f"{spec.path}|{spec.name}|{spec.split}|{hub_commit(spec) or spec.revision}"
        return "hub:" + hashlib.sha256(identity.encode()).hexdigest()
    return files_digest(paths)


def files_digest(paths: list[Path]) -> str:
    """sha256 over each file's size and bytes, in order: the fingerprint of local data."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(f"{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()


MIXED_TYPES = re.compile(
    r"Column\((?P<column>[^)]*)\) changed from (?P<was>\w+) to (?P<now>\w+)(?: in row (?P<row>\d+))?"
)


TEXT_COLUMNS = frozenset({"text", "messages", "prompt", "completion", "chosen", "rejected", "label"})
"""Columns the data rules type-check row by row (rule `consistent_types`, naming the rows)."""


def one_type_per_column(copies: list[Path], paths: list[Path], chunk_bytes: int = 32 << 20) -> None:
    """A JSON column of strings and numbers is refused, naming it: `datasets` would fall back to pandas, which turns
    the strings into numbers ("00123" -> 123, "1e3" -> 1000.0), and the meaning of the data is gone. Read by Arrow a
    chunk of lines at a time (memory stays flat at millions of rows), comparing each column's kind across chunks."""
    import io

    import pyarrow as pa
    import pyarrow.json as pj

    def kind(type_: pa.DataType) -> str | None:
        if pa.types.is_null(type_):
            return None  # no value yet: any kind may follow
        if pa.types.is_integer(type_) or pa.types.is_floating(type_):
            return "number"
        return "string" if pa.types.is_string(type_) or pa.types.is_large_string(type_) else str(type_).split("<")[0]

    def refuse(path: Path, column: str, was: str, now: str, row: int | None) -> None:
        if column.lstrip("/").split("/")[0] in TEXT_COLUMNS:
            return  # those: rule consistent_types, with its rows
        where = f" (row {row}, 0-based)" if row is not None else ""
        raise ValueError(
            f"{path}: rule 'one_type_per_column' failed: column {column.lstrip('/')!r} holds {was} and {now} "
            f'values{where}; a column has one type, so quote the numbers that are text (an answer "00123" would '
            "otherwise be read as 123)"
        ) from None

    for copy, path in zip(copies, paths):
        if copy.suffix != ".jsonl" and copy.read_bytes()[:1] == b"[":
            continue  # a JSON document (a list of rows): Arrow reads lines only; `datasets` reads it with json
        kinds: dict[str, tuple[str, int]] = {}  # column -> (its kind, the first row seen with it)
        rows = 0
        with open(copy, "rb") as f:
            while chunk := f.read(chunk_bytes) + f.readline():
                try:
                    table = pj.read_json(io.BytesIO(chunk), read_options=pj.ReadOptions(block_size=2 * chunk_bytes))
                except pa.ArrowInvalid as exc:
                    if found := MIXED_TYPES.search(str(exc)):
                        row = rows + int(found["row"]) if found["row"] else None
                        refuse(path, found["column"], found["was"], found["now"], row)
                    break  # `datasets` reports what Arrow cannot read, with the raw-file rules before it
                except (OSError, pa.ArrowException):
                    break
                for field in table.schema:
                    if (now := kind(field.type)) is None:
                        continue
                    was, _ = kinds.setdefault(field.name, (now, rows))
                    if was != now:
                        refuse(path, field.name, was, now, rows)
                rows += table.num_rows


def text_columns(path: Path):
    """Every column of the CSV's header read as text (`typed_csv` then types each one)."""
    import csv

    import datasets as hf

    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        header = next(csv.reader(f), [])
    return hf.Features({name: hf.Value("string") for name in header}) if header else None


def typed_csv(dataset):
    """A CSV read as text, each column then given the one type every value of it reads back as: integers, floats or
    booleans when every value round-trips exactly, text otherwise ("0119" and "1e3" stay text; pandas' own guess would
    make them 119 and 1000.0). In memory: CSV files are read whole anyway."""
    import datasets as hf
    import pyarrow as pa

    columns = {
        name: pa.array(_typed(dataset[name]) if len(dataset) else [], type=None if len(dataset) else pa.string())
        for name in dataset.column_names
    }
    return hf.Dataset(hf.table.InMemoryTable(pa.table(columns)))


def _typed(values: list[str]) -> list:
    if values and all(value.lower() in ("true", "false") for value in values):
        return [value.lower() == "true" for value in values]
    for convert in (int, float):
        try:
            converted = [convert(value) for value in values]
        except ValueError:
            continue
        if all(_reads_back(value, number) for value, number in zip(values, converted)):
            return converted
    return values


def _reads_back(text: str, number: float) -> bool:
    """Whether the number is written as the text was: no leading zeros, no exponent, nothing dropped."""
    if isinstance(number, int):
        return str(number) == text.strip()
    return repr(number) == text.strip() or (
        not math.isfinite(number) and text.strip().lower() in ("nan", "inf", "-inf", "infinity", "-infinity")
    )


def network_error(exc: BaseException) -> bool:
    """A dropped connection, a timeout or a server error (5xx) on the way to the hub, and not a refusal no retry
    fixes (a missing or gated dataset, refused credentials: `trainers.runtime.failures`)."""
    from rlhf_pipeline.trainers.runtime.failures import causes, permanent_reason

    if permanent_reason(exc) is not None:
        return False
    for cause in causes(exc):
        status = getattr(getattr(cause, "response", None), "status_code", None)
        if isinstance(cause, (ConnectionError, TimeoutError)) or (isinstance(status, int) and status >= 500):
            return True
        if type(cause).__name__ in (
            "ConnectionError",
            "Timeout",
            "ReadTimeout",
            "ConnectTimeout",
            "ChunkedEncodingError",
        ):
            return True  # requests' and httpx's, which are not the builtin ConnectionError
    return False


class DataChanged(RuntimeError):
    """A local file's bytes changed between keying the data stage and reading it: transient (the retry keys the
    new bytes)."""


def hub_commit(spec: DatasetSpec) -> str | None:
    """The commit a hub revision (a branch such as `main`) points at now, so new data re-keys the stages; None
    offline."""
    import os

    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return None
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(spec.path, revision=spec.revision).sha
    except Exception:  # offline, private without a token, or not on the hub: keep the revision as given
        return None


def peek_columns(spec: DatasetSpec, rows: int = 100) -> set[str] | None:
    """The columns of a local dataset, read from its first rows or schema without loading it (the parameters
    decide which eval metrics a run will have); None for a hub dataset or a file that cannot be read this way."""
    import json

    paths = local_files(spec)
    if not paths:
        return None
    path = paths[0]
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return set(pq.read_schema(path).names)
        if path.suffix == ".csv":
            import csv

            with open(path, newline="", encoding="utf-8") as f:
                return set(next(csv.reader(f), []))
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                lines = [line for _, line in zip(range(rows), f) if line.strip()]
            return set().union(*(json.loads(line).keys() for line in lines)) if lines else None
    except (OSError, ValueError, StopIteration, AttributeError):
        return None  # the data stage reports a broken file, with its line
    return None


def load_source(spec: DatasetSpec, fingerprint: str | None = None) -> Dataset:
    """Load a dataset; unreadable files fail with a message that names the file.

    Local files are read from a private copy, with a cache of its own, so the rows are exactly the copied bytes:
    `datasets`' own cache is keyed by path and modification time and would serve an earlier file's rows for a file
    rewritten within the same second. With `fingerprint` (the key's), the copy must have those bytes."""
    import shutil
    import tempfile

    import datasets

    paths = local_files(spec)
    if paths is None:
        try:
            revision = hub_commit(spec) or spec.revision  # the commit the fingerprint saw
            return datasets.load_dataset(spec.path, spec.name, split=spec.split, revision=revision)
        except Exception as exc:
            message = f"{spec.path}: could not be read as a dataset: {type(exc).__name__}: {exc}"
            if network_error(exc):  # the hub or the network failed: a retry may find it back
                raise ConnectionError(message) from exc
            raise ValueError(message) from exc
    builder = FILE_BUILDERS.get(paths[0].suffix)
    if builder is None:
        raise ValueError(f"{spec.path}: unsupported file type {paths[0].suffix!r}; use one of {sorted(FILE_BUILDERS)}")
    with tempfile.TemporaryDirectory(prefix="rlhf-data-") as folder:
        copies = [Path(shutil.copyfile(path, Path(folder) / f"{n}{path.suffix}")) for n, path in enumerate(paths)]
        if fingerprint is not None and (read := files_digest(copies)) != fingerprint:
            raise DataChanged(
                f"{spec.path}: the files changed while the data stage read them (keyed {fingerprint[:19]}, read "
                f"{read[:19]}); the retry keys the new bytes"
            )
        try:
            if builder == "csv":
                return typed_csv(
                    datasets.load_dataset(
                        builder,
                        data_files=[str(copy) for copy in copies],
                        split="train",
                        cache_dir=str(Path(folder) / "cache"),
                        features=text_columns(copies[0]),
                        keep_default_na=False,
                    )
                )
            if builder == "json":
                one_type_per_column(copies, paths)
            # Memory-mapped Arrow files: they stay readable after the folder is removed (the mapping keeps them)
            return datasets.load_dataset(
                builder,
                data_files=[str(copy) for copy in copies],
                split="train",
                cache_dir=str(Path(folder) / "cache"),
            )
        except ValueError as exc:
            if str(exc).startswith(str(spec.path)) or any(str(path) in str(exc) for path in paths):
                raise  # ours, naming the file
            message = f"{type(exc).__name__}: {exc}"
            for copy, path in zip(copies, paths):
                message = message.replace(str(copy), str(path))
            raise ValueError(f"{spec.path}: could not be read as a dataset: {message}") from exc
        except Exception as exc:  # arrow/json parse errors carry no file name, or the copy's
            message = f"{type(exc).__name__}: {exc}"
            for copy, path in zip(copies, paths):
                message = message.replace(str(copy), str(path))
            raise ValueError(f"{spec.path}: could not be read as a dataset: {message}") from exc


def load_split(data_dir: Path, name: str):
    """One dataset written by the `data` stage (`<data artifact>/datasets/<name>.parquet`)."""
    from datasets import Dataset

    return Dataset.from_parquet(str(data_dir / "datasets" / f"{name}.parquet"))
