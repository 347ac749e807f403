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

The run's parameters may also name things outside the run, which the worker's environment decides in the same way
(`flows/ownership.py` lists every such parameter, docs/SERVICE.md shows the list):

    RLHF_ALLOWED_PATHS=/srv/datasets:/srv/models
        folders (separated by ':', as in PATH) whose files a run may read: data files, model folders and GGUF files,
        chat templates, labels files, accelerate configs, presets; `*` allows any. Unset: the worker's working
        directory. The run state folder and the pipeline's own files are always allowed.
    RLHF_ALLOWED_RAY_ADDRESSES=ray://head.lab:10001
        Ray clusters a run may send its stages to with `launch.ray_address` (their workers get the run's secrets and
        send back pickles); `*` allows any. Unset: none; the worker's own RAY_ADDRESS is always allowed.

This module has no pydantic models and imports nothing heavy: the config classes call it from their validators.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

IMPORTS_ENV = "RLHF_ALLOWED_IMPORTS"
REMOTE_CODE_ENV = "RLHF_ALLOWED_REMOTE_CODE"
PATHS_ENV = "RLHF_ALLOWED_PATHS"
RAY_ADDRESSES_ENV = "RLHF_ALLOWED_RAY_ADDRESSES"
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


def check_remote_code(repo: str, what: str, runs: str = "") -> None:
    """Refuses code from a Hub repository the operator has not allowed: `trust_remote_code` (`what` is the block),
    or, given `runs` (what the setting makes run), any other setting (`what` is the whole setting)."""
    if any(entry == "*" or fnmatch.fnmatchcase(repo, entry) for entry in _entries(REMOTE_CODE_ENV)):
        return
    allowed = ", ".join(_entries(REMOTE_CODE_ENV)) or "none"
    said = (
        f"{what}: {runs} {repo!r}"
        if runs
        else f"{what}.trust_remote_code=true for {repo!r}: running code shipped with a model"
    )
    raise ValueError(
        f"{said} is not allowed on this worker. It is the worker's setting, not the run's: the operator lists the "
        f"repositories in {REMOTE_CODE_ENV} (patterns, comma-separated; now: {allowed})"
    )


def allowed_folders(always: tuple[Path, ...] = ()) -> list[Path] | None:
    """The folders whose files a run may read (resolved), `always` among them; None where the operator allows any."""
    entries = [entry.strip() for entry in os.environ.get(PATHS_ENV, "").split(os.pathsep) if entry.strip()]
    if "*" in entries:
        return None
    return [Path(entry).expanduser().resolve() for entry in entries or [os.getcwd()]] + [p.resolve() for p in always]


def check_path(path: Path, what: str, always: tuple[Path, ...] = ()) -> None:
    """Refuses, naming the setting, a file or folder outside the folders the operator lets runs read (`path` resolved:
    a link inside an allowed folder that points outside it is refused)."""
    folders = allowed_folders(always)
    resolved = path.expanduser().resolve()
    if folders is None or any(resolved.is_relative_to(folder) for folder in folders):
        return
    now = os.environ.get(PATHS_ENV, "").strip() or f"unset, so the working directory {os.getcwd()}"
    raise ValueError(
        f"{what}: {resolved} is outside the folders a run may read on this worker. Which files a run may read is the "
        f"worker's setting, not the run's: the operator lists the folders in {PATHS_ENV} (separated by "
        f"{os.pathsep!r}; now: {now})"
    )


def check_ray_address(address: str) -> None:
    """Refuses a Ray cluster the operator has not allowed: its workers would receive the run's secrets."""
    entries = _entries(RAY_ADDRESSES_ENV)
    if address == os.environ.get("RAY_ADDRESS") or "*" in entries or address in entries:
        return
    raise ValueError(
        f"launch.ray_address={address!r}: sending stages to this Ray cluster is not allowed on this worker (its "
        f"workers would receive the run's secrets, and results come back as pickles). Which clusters a run may use "
        f"is the worker's setting, not the run's: the operator lists them in {RAY_ADDRESSES_ENV} (comma-separated; "
        f"now: {', '.join(entries) or 'none'}) or sets RAY_ADDRESS"
    )


def allow_imports(*entries: str) -> None:
    """Adds entries to this process's list (and its children's): for a script that is its own operator, such as a
    bench whose callback lives beside it."""
    os.environ[IMPORTS_ENV] = ",".join([*_entries(IMPORTS_ENV), *entries])
