"""Dataset validation for the pipeline: Great Expectations suites per dataset kind.

    report = validate_dataset("preference", dataset, source="data/pref.jsonl", report_dir=out)
    reports = check_files("preference", [Path("data/pref.jsonl")])  # the raw bytes, before parsing

Kinds are "sft", "preference" and "prompt"; each accepts TRL's formats for it
(see validators.formats). Importing this package is cheap: great_expectations,
pandas and datasets are imported only when a dataset is validated. The data stage's build is
`validators.stage` (docs/ARCHITECTURE.md, "Layers").
"""

from rlhf_pipeline.validators.files import check_files
from rlhf_pipeline.validators.formats import DatasetFormat, detect_format
from rlhf_pipeline.validators.report import DataValidationError, RuleResult, ValidationReport
from rlhf_pipeline.validators.validate import validate_dataset

__all__ = [
    "DataValidationError",
    "DatasetFormat",
    "RuleResult",
    "ValidationReport",
    "check_files",
    "detect_format",
    "validate_dataset",
]
