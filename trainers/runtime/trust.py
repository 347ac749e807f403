"""What a run may make the worker execute: the operator's settings, not the run's parameters.

A run's parameters come from whoever can start a flow run (the Prefect UI's form, the API, a schedule). Two of them
run code on the worker: import paths (callbacks, optimizer factories, compute_metrics, reward functions, judges,
labellers, gold metrics) and `trust_remote_code` (the model code a hub repository ships). The worker's environment
says which of them a run may pick; anything else is refused when the parameters are checked, before the module is
imported or a file is fetched:

    RLHF_ALLOWED_IMPORTS=my_lab,my_rewards.verifiers,transformers:EarlyStoppingCallback
        module prefixes (`my_lab` allows `my_lab.x:f`), or exact `module:name` paths; `*` allows any import.
        The pipeline's own modules (`rlhf_pipeline...`) are always allowed.
    RLHF_ALLOWED_REMOTE_CODE=my-org/*,other/model
        hub repositories (shell patterns) whose shipped code may run with `trust_remote_code: true`; `*` allows any.
        Unset: none may.

This module has no pydantic models and imports nothing heavy: the config classes call it from their validators.
"""

from __future__ import annotations

import fnmatch
import os

IMPORTS_ENV = "RLHF_ALLOWED_IMPORTS"
REMOTE_CODE_ENV = "RLHF_ALLOWED_REMOTE_CODE"
OWN = "rlhf_pipeline"


def _entries(name: str) -> list[str]:
    return [entry.strip() for entry in os.environ.get(name, "").split(",") if entry.strip()]


def import_allowed(path: str) -> bool:
    """Whether `package.module:name` is on the worker's list (module prefix, exact path, or `*`)."""
    module = path.partition(":")[0]
    for entry in [OWN, *_entries(IMPORTS_ENV)]:
        if entry == "*" or entry == path:
            return True
        if ":" not in entry and (module == entry or module.startswith(entry + ".")):
            return True
    return False


def check_import(path: str, what: str) -> None:
    """Refuses, naming the setting, an import path the worker's operator has not allowed."""
    if not import_allowed(path):
        allowed = ", ".join(_entries(IMPORTS_ENV)) or "nothing besides the pipeline's own modules"
        raise ValueError(
            f"{what} {path!r}: importing {path.partition(':')[0]!r} is not allowed on this worker. Which modules a run "
            f"may import is the worker's setting, not the run's: the operator lists them in {IMPORTS_ENV} (module "
            f"prefixes or module:name, comma-separated; now: {allowed})"
        )


def check_remote_code(repo: str, what: str) -> None:
    """Refuses `trust_remote_code` for a repository the operator has not allowed."""
    if any(entry == "*" or fnmatch.fnmatchcase(repo, entry) for entry in _entries(REMOTE_CODE_ENV)):
        return
    allowed = ", ".join(_entries(REMOTE_CODE_ENV)) or "none"
    raise ValueError(
        f"{what}.trust_remote_code=true for {repo!r}: running code shipped with a model is not allowed on this worker. "
        f"It is the worker's setting, not the run's: the operator lists the repositories in {REMOTE_CODE_ENV} "
        f"(patterns, comma-separated; now: {allowed})"
    )


def allow_imports(*entries: str) -> None:
    """Adds entries to this process's list (and its children's): for a script that is its own operator, such as a
    bench whose callback lives beside it."""
    os.environ[IMPORTS_ENV] = ",".join([*_entries(IMPORTS_ENV), *entries])
