"""Where datasets come from: local JSONL/JSON/Parquet/CSV files or hub ids, all through `datasets`.

The bundled files and a user's files take the same path: `load_source` reads
them, the `data` stage validates them and writes Parquet copies that later
stages read, so a stage never sees a file that changed under it.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from rlhf_pipeline.trainers.config import ModelConfig, StrictModel

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
        description="A local .jsonl/.json/.parquet/.csv file, a glob of them (`prefs/*.jsonl`: new files are picked up), or a Hugging Face hub dataset id."
    )
    split: str = Field("train", description="Split to read (hub datasets; local files have one split, 'train').")
    name: str | None = Field(None, description="Hub dataset configuration name.")
    revision: str | None = Field(
        None, description="Hub revision (a commit, tag or branch; a branch is resolved to its current commit, so new data re-runs the stages)."
    )


def _bundled(name: str) -> DatasetSpec:
    return DatasetSpec(path=f"{BUNDLED}/{name}.jsonl")


class DataConfig(StrictModel):
    """The datasets of one pipeline run. Defaults: the bundled "sort the digits" task."""

    sft: DatasetSpec = Field(default_factory=lambda: _bundled("sft"), description="SFT demonstrations (text, messages, or prompt/completion).")
    sft_eval: DatasetSpec | None = Field(None, description="Held-out demonstrations sft evaluates on while it trains (sft.eval_strategy); None: none.")
    preference: DatasetSpec = Field(default_factory=lambda: _bundled("preference"), description="Preference pairs (prompt?/chosen/rejected) for rm and dpo.")
    preference_eval: DatasetSpec | None = Field(
        default_factory=lambda: _bundled("preference_eval"), description="Held-out pairs for reward-model accuracy; None to skip."
    )
    prompts: DatasetSpec = Field(default_factory=lambda: _bundled("prompts"), description="Prompt-only rows for online RL (reference columns pass through).")
    prompts_eval: DatasetSpec = Field(
        default_factory=lambda: _bundled("prompts_eval"), description="Held-out prompts (with `answer` for exact match) for eval."
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


def local_files(spec: DatasetSpec) -> list[Path] | None:
    """The files a spec names (a path or a glob such as `prefs/2026-*.jsonl`), relative to the
    working directory or else to the project, sorted; None for a hub id."""
    if any(char in spec.path for char in "*?["):
        for base in (Path.cwd(), BUNDLED_ROOT):
            pattern = Path(spec.path).expanduser()
            root, relative = (Path(pattern.anchor), str(pattern.relative_to(pattern.anchor))) if pattern.is_absolute() else (base, spec.path)
            matched = sorted(path.resolve() for path in root.glob(relative) if path.is_file())
            if matched:
                suffixes = {path.suffix for path in matched}
                if len(suffixes) > 1:
                    raise ValueError(f"{spec.path}: matches files of several types {sorted(suffixes)}; a dataset is one type")
                return matched
        raise ValueError(f"{spec.path}: the pattern matches no file (looked in {Path.cwd()} and {BUNDLED_ROOT})")
    for candidate in (Path(spec.path).expanduser(), BUNDLED_ROOT / spec.path):
        if candidate.is_file():
            return [candidate.resolve()]
    if Path(spec.path).suffix in FILE_BUILDERS:
        raise ValueError(f"{spec.path}: no such file (looked in {Path.cwd()} and {BUNDLED_ROOT})")
    return None


def fingerprint(spec: DatasetSpec) -> str:
    """Content hash of the local files (a new file in a glob changes it, a renamed one does not); for a hub
    dataset its id, config, split and revision, the revision resolved to a commit when the hub answers."""
    paths = local_files(spec)
    if paths is None:
        identity = f"{spec.path}|{spec.name}|{spec.split}|{hub_commit(spec) or spec.revision}"
        return "hub:" + hashlib.sha256(identity.encode()).hexdigest()
    digest = hashlib.sha256()
    for path in paths:
        digest.update(f"{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()


def hub_commit(spec: DatasetSpec) -> str | None:
    """The commit a hub revision (a branch such as `main`) points at now, so new data re-keys the stages; None offline."""
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


def load_source(spec: DatasetSpec) -> Dataset:
    """Load a dataset; unreadable files fail with a message that names the file."""
    import datasets

    paths = local_files(spec)
    try:
        if paths is None:
            revision = hub_commit(spec) or spec.revision  # the commit the fingerprint saw
            return datasets.load_dataset(spec.path, spec.name, split=spec.split, revision=revision)
        builder = FILE_BUILDERS.get(paths[0].suffix)
        if builder is None:
            raise ValueError(f"{spec.path}: unsupported file type {paths[0].suffix!r}; use one of {sorted(FILE_BUILDERS)}")
        return datasets.load_dataset(builder, data_files=[str(path) for path in paths], split="train")
    except ValueError:
        raise
    except Exception as exc:  # arrow/json parse errors carry no file name
        raise ValueError(f"{spec.path}: could not be read as a dataset: {type(exc).__name__}: {exc}") from exc


# Held-out dataset -> the datasets trained on that must not share a prompt with it.
HELD_OUT = {
    "sft_eval": ("sft",),  # sft's evaluation during training
    "preference_eval": ("preference",),  # reward-model accuracy is measured on it
    # Exact match of the final policy: SFT, DPO and the online trainers all saw their prompts.
    "prompts_eval": ("sft", "preference", "prompts"),
}


def train(
    cfg: DataConfig,
    model: ModelConfig,
    max_tokens: dict[str, int],
    out_dir: Path,
    work_dir: Path,
    log_metrics=None,
    pairs_for: dict[str, tuple[str, ...]] | None = None,
    assistant_only_loss: bool = False,
    required_columns: dict[str, tuple[str, ...]] | None = None,
) -> dict[str, float]:
    """The `data` stage: check every dataset (`check_datasets`), then freeze Parquet copies into
    `out_dir/datasets/<name>.parquet` for later stages. Every broken dataset is reported at once and nothing
    is written to `out_dir`; the reports stay in `work_dir/report` (named in the error)."""
    import shutil

    passed, failures = check_datasets(cfg, model, max_tokens, work_dir / "report", pairs_for, assistant_only_loss, required_columns=required_columns)
    # Report every broken dataset at once, then stop before any training.
    if len(failures) == 1:
        raise failures[0]
    if failures:
        raise ValueError(f"{len(failures)} data checks failed:\n" + "\n".join(map(str, failures)))
    metrics: dict[str, float] = {}
    for name, (split, _) in passed.items():
        split.dataset.to_parquet(str(out_dir / "datasets" / f"{name}.parquet"))
        metrics[f"data/{name}/rows"] = float(len(split.dataset))
    shutil.copytree(work_dir / "report", out_dir / "report")
    return metrics


def check_datasets(
    cfg: DataConfig,
    model: ModelConfig | None,
    max_tokens: dict[str, int],
    report_dir: Path,
    pairs_for: dict[str, tuple[str, ...]] | None = None,
    assistant_only_loss: bool = False,
    tokenizer=None,
    required_columns: dict[str, tuple[str, ...]] | None = None,
) -> tuple[dict[str, tuple], list[ValueError]]:
    """Check every dataset: raw file, Great Expectations rules, chat template and token lengths (counted
    with `model`'s tokenizer, or `tokenizer`), train/eval leakage. Returns the datasets that passed
    (name -> (Split, ValidationReport)) and one error per failure; writes the reports into `report_dir`.

    `max_tokens` maps a dataset name to the most tokens one of its rows may take in the stages that read
    it (rule `fits_max_length`). `pairs_for` names, per dataset, the stages that need preference pairs:
    unpaired rows fail for them. `assistant_only_loss` (sft's): the sft rows' end-of-turn tokens must be
    inside the template's {% generation %} marks. `required_columns` names columns a dataset must have for
    this run (the reference answers a gate on exact match needs, when the parameters could not look: a hub id).
    """
    import json

    from rlhf_pipeline.validators import DataValidationError, check_files, validate_dataset
    from rlhf_pipeline.validators.leakage import Split, check_leakages
    from rlhf_pipeline.validators.validate import REPORT_FILE

    sources = cfg.sources()
    limits = {name: limit for name, limit in max_tokens.items() if name in sources}
    if tokenizer is None and model is not None:
        from rlhf_pipeline.trainers.base import load_base_tokenizer

        tokenizer = load_base_tokenizer(model)
    model_name = repr(model.name_or_path) if model is not None else "the model"
    failures: list[ValueError] = []
    passed: dict[str, tuple] = {}
    for name, (kind, spec) in sources.items():
        # Raw bytes first: `datasets` names neither file nor line for a cut-off
        # JSON line, a non-UTF-8 byte or an empty file.
        files = check_files(kind, local_files(spec) or [])
        if files:
            (report_dir / name).mkdir(parents=True, exist_ok=True)
            text = json.dumps([report.to_dict() for report in files], indent=2, ensure_ascii=False)
            (report_dir / name / "files.json").write_text(text + "\n")
        broken = [report for report in files if not report.success]
        if broken:
            failures += [DataValidationError(report) for report in broken]
            continue
        try:
            dataset = load_source(spec)
            report = validate_dataset(
                kind, dataset, source=spec.path, report_dir=report_dir / name, max_tokens=limits.get(name), tokenizer=tokenizer,
                model_name=model_name, assistant_only=assistant_only_loss and name == "sft",
            )  # fmt: skip
        except ValueError as exc:  # a broken rule, or a file `datasets` cannot read
            failures.append(exc)
            continue
        missing = [column for column in (required_columns or {}).get(name, ()) if column not in dataset.column_names]
        if missing:
            report.rules.append(_required_columns(name, missing, dataset.column_names, len(dataset)))
            report.write_json(report_dir / name / REPORT_FILE)
            failures.append(DataValidationError(report))
            continue
        readers = (pairs_for or {}).get(name, ())
        if readers and report.format is not None and "label" in report.format.columns:
            report.rules.append(_unpaired_for(readers, len(dataset)))
            report.write_json(report_dir / name / REPORT_FILE)
            failures.append(DataValidationError(report))
            continue
        passed[name] = (Split(name, kind, spec.path, dataset), report)

    # A dataset that failed its own rules is already reported. No held-out dataset is trained on, so
    # dropping one that leaks changes no other check: all of them run at once, each training set read once.
    checks = {
        held_out: (passed[held_out][0], [passed[name][0] for name in trained if name in passed])
        for held_out, trained in HELD_OUT.items()
        if held_out in passed and any(name in passed for name in trained)
    }
    for held_out, result in zip(checks, check_leakages(list(checks.values()))):
        report = passed[held_out][1]
        report.rules.append(result)
        report.write_json(report_dir / held_out / REPORT_FILE)
        if not report.success:
            failures.append(DataValidationError(report))
            del passed[held_out]
    return passed, failures


def _required_columns(name: str, missing: list[str], found: list[str], num_rows: int):
    """Rule `required_columns`: the run's gate reads a metric that needs these columns (exact match: the reference answers)."""
    from rlhf_pipeline.validators import RuleResult

    why = f"no column {missing} (columns: {found}); the run's registry gate needs it: set eval.answer_column or registry.gate_metric"
    return RuleResult("required_columns", f"{name} must have the columns {missing} the run's gate metric reads", False, num_rows, [{"row": 0, "value": why}])


def _unpaired_for(readers: tuple[str, ...], num_rows: int):
    """Rule `paired_for_readers`: rm and dpo compare a chosen with a rejected answer; unpaired rows have neither."""
    from rlhf_pipeline.validators import RuleResult

    why = f"an unpaired row (prompt/completion/label), but {', '.join(readers)} of this run need pairs (prompt/chosen/rejected)"
    return RuleResult(
        "paired_for_readers",
        f"rows are preference pairs, as {', '.join(readers)} read them; unpaired feedback trains algorithm=kto (with eval.use_reward_model=false, no rm)",
        False, num_rows, [{"row": row, "value": why} for row in range(min(num_rows, 5))],
    )  # fmt: skip
