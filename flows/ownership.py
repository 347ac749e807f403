"""What a run's parameters may name outside the run: clusters, files and code are the worker's operator's to allow.

Whoever can start a flow run (the UI's form, the API, a schedule) chooses its parameters. A parameter that names a
Ray cluster, a file outside the run state or code to run is therefore checked against a list that the worker's
environment holds (`trainers.runtime.trust`), when the parameters are checked and before anything is read or run.
`OWNED` is every such parameter: what it names and which setting decides it. docs/SERVICE.md's table shows it, and
tests/flows/test_ownership.py walks the parameter schema (and TRL's arguments) and fails on an address-like field that
is not here.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from rlhf_pipeline.tasks.config import ENGINE_DIR
from rlhf_pipeline.tasks.tracking.client import always_readable
from rlhf_pipeline.trainers.data import DatasetSpec, check_readable
from rlhf_pipeline.trainers.runtime.trust import (
    IMPORTS_ENV,
    PATHS_ENV,
    RAY_ADDRESSES_ENV,
    REMOTE_CODE_ENV,
    check_path,
    check_ray_address,
    check_remote_code,
)

REFUSED_TRL = frozenset(
    {
        "accelerator_config",
        "chat_template_path",
        "deepspeed",
        "fsdp_config",
        "hub_always_push",
        "hub_model_id",
        "hub_private_repo",
        "hub_revision",
        "hub_strategy",
        "hub_token",
        "log_completions_hub_repo",
        "model_init_kwargs",
        "push_to_hub",
        "resume_from_checkpoint",
        "trust_remote_code",
        "vllm_group_port",
        "vllm_server_base_url",
        "vllm_server_host",
        "vllm_server_port",
    }
)
"""TRL arguments that name a host, a file or code (a hub repository to push to, a vLLM server, a DeepSpeed or FSDP
config file, a checkpoint to resume, model code to trust): a run's `trl_overrides` may not set them."""


def _local(field: str, value: Any) -> None:
    """A value that names a local file or folder (relative to the working directory): it must be one the worker allows.
    Anything else (a hub id, a preset's or engine's name, 'module:function') names no file here."""
    if isinstance(value, str) and value and Path(value).expanduser().exists():
        check_path(Path(value), f"{field}={value!r}", always_readable() + (ENGINE_DIR.resolve(),))


def _data(field: str, value: Any) -> None:
    """A dataset's path: every file it names (a glob, a folder, a bundled file) as the data stage will read it."""
    if isinstance(value, str):
        check_readable(DatasetSpec(path=value), field, always_readable())


def _ray(field: str, value: Any) -> None:
    if value:
        check_ray_address(str(value))


def _kernel(field: str, value: Any) -> None:
    """An attention whose code transformers would fetch from the Hub and run (a Hub kernel, or a FlashAttention
    fallback): its repository must be one the worker allows."""
    from rlhf_pipeline.trainers.attention import hub_kernel

    if isinstance(value, str) and (repo := hub_kernel(value)) is not None:
        check_remote_code(repo, f"{field}={value!r}", "running attention code downloaded from the Hub repository")


def _trl(field: str, value: Any) -> None:
    refused = sorted(set(value or ()) & REFUSED_TRL)
    if refused:
        raise ValueError(
            f"{field} sets {refused}: these name a host, a file or code, which a run may not choose (the worker's "
            "operator does: docs/SERVICE.md, 'Running it as a shared service')"
        )


@dataclass(frozen=True)
class Owned:
    names: str  # what the parameter's value names
    setting: str  # the worker's setting that decides which values a run may give
    check: Callable[[str, Any], None] | None = None  # None: checked where the field is declared


FILES = f"{PATHS_ENV} (unset: the worker's working directory)"
CODE = f"{IMPORTS_ENV} (unset: the pipeline's own modules)"
HUB = "a hub id: the worker's HF_ENDPOINT and HF_TOKEN"

OWNED: dict[str, Owned] = {
    "launch.ray_address": Owned(
        "a Ray cluster: its workers get the run's secrets and send back pickles",
        f"{RAY_ADDRESSES_ENV} (unset: none), or the worker's RAY_ADDRESS",
        _ray,
    ),
    "launch.engine": Owned("an accelerate config file (an engine's name: the pipeline's own)", FILES, _local),
    "preset": Owned("a preset file (a preset's name: the pipeline's configs/)", FILES),  # checked as it is read
    "model.name_or_path": Owned(f"a model folder or GGUF file ({HUB}; a package: the worker's install)", FILES, _local),
    "model.chat_template": Owned("a Jinja file ('chatml': the pipeline's own)", FILES, _local),
    "data.*.path": Owned(f"data files: a file, a glob or a folder ({HUB})", FILES, _data),
    "pairs.people.labels_file": Owned("a labels file", FILES, _local),
    "policy": Owned(
        f"the model `rlhf eval` scores: a folder or GGUF file (a registered version: {HUB})", FILES, _local
    ),
    "sft_model": Owned("the start `rlhf eval` compares with: a folder or GGUF file", FILES, _local),
    "reward_model": Owned("the reward model `rlhf eval` scores with: a folder", FILES, _local),
    "*.judge.path": Owned(f"a judge: code ('module:function'), or an LM's folder ({HUB})", f"{CODE}; {FILES}", _local),
    "*.callbacks.path": Owned("code: a TrainerCallback class", CODE),
    "*.optimizer_factory": Owned("code: an optimizer factory", CODE),
    "*.compute_metrics": Owned("code: a metrics function", CODE),
    "rewards.functions.path": Owned("code: a reward function", CODE),
    "pairs.function": Owned("code: the labeller's reward function", CODE),
    "eval.gold_metric.path": Owned("code: the gold metric", CODE),
    "model.trust_remote_code": Owned("code shipped with a hub model", f"{REMOTE_CODE_ENV} (unset: none)"),
    "*.judge.trust_remote_code": Owned("code shipped with an LM judge", f"{REMOTE_CODE_ENV} (unset: none)"),
    "*.attn_implementation": Owned(
        "code: a Hub kernel 'org/repo' transformers downloads and runs (or the kernels-community build a "
        "flash_attention_* name falls back to without its package)",
        f"{REMOTE_CODE_ENV} (unset: none)",
        _kernel,
    ),
    "*.trl_overrides": Owned(
        "TRL's arguments; those that name a host, a file or code are refused: " + ", ".join(sorted(REFUSED_TRL)),
        "none: the pipeline's",
        _trl,
    ),
}


def leaves(values: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted field, value) of a parameter dump; a list's items share their field's name, a `trl_overrides` dict is
    one value."""
    if isinstance(values, dict) and not prefix.endswith("trl_overrides"):
        for name, value in values.items():
            yield from leaves(value, f"{prefix}.{name}" if prefix else str(name))
    elif isinstance(values, list) and any(isinstance(item, dict) for item in values):
        for item in values:
            yield from leaves(item, prefix)
    else:
        yield prefix, values


def owner(field: str) -> Owned | None:
    """The row of `OWNED` a dotted field falls under."""
    return next((row for pattern, row in OWNED.items() if fnmatch.fnmatchcase(field, pattern)), None)


def check_owned(params: BaseModel) -> None:
    """Refuses, naming the field and the setting, a value the worker's operator has not allowed."""
    for field, value in leaves(params.model_dump(mode="json")):
        row = owner(field)
        if row is not None and row.check is not None and value is not None:
            row.check(field, value)
