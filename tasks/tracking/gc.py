"""`rlhf gc`: remove what no registered version, no live run and none of the last N runs reference.

Kept: the stage artifacts a registered model version names (its `rlhf.lineage` keys) and the run whose copy of
the weights it was registered from; the stage artifacts of the newest N parent runs of every experiment and of every
run still RUNNING, with everything upstream of them (their manifests' `upstream`); whatever a live build holds (its
key's lock) and whatever a live run built or reused (its lease: `tasks/store/leases.py`, checked under the key's lock
as the artifact is removed). Every registered model, version, experiment and run is read, page after page. Removed:
other stage artifacts, working folders (checkpoints) and leftovers (`.tmp-*`, `.trash-*`, `.damaged-*`) of builds
that are not running, and the weights copies (`model/`) of parent runs nothing keeps, when MLflow's artifacts are
local files. `--dry-run` lists them with their sizes and deletes nothing.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from rlhf_pipeline.tasks.store.artifacts import MANIFEST
from rlhf_pipeline.tasks.store.leases import LEASES, live_leases
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.tasks.tracking.client import MODEL_LOGGED, MODEL_URI
from rlhf_pipeline.tasks.tracking.lineage import version_lineage

LINKED_RUN = re.compile(r"/([0-9a-f]{32})/artifacts/model$")


@dataclass(frozen=True)
class Doomed:
    path: Path
    bytes: int
    why: str
    key: str = ""
    """The stage key whose lock guards the path ("" for an MLflow copy)."""
    run_id: str = ""
    """The MLflow run whose weights copy this is ("" for a stage artifact)."""


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


@contextlib.contextmanager
def unheld(stage_root: Path, key: str) -> Iterator[bool]:
    """Holds the key's build lock while the body runs when no build holds it and no live run leases the key; yields
    whether it could (a run leases under the same lock, so none can start using the key while the body runs)."""
    from filelock import FileLock, Timeout

    lock = FileLock(stage_root / ".locks" / f"{key}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        yield False
        return
    try:
        yield not live_leases(stage_root, key)
    finally:
        lock.release()


def every(search, *args, **kwargs) -> Iterator:
    """Every result of an MLflow search, page after page (one page holds 100 registered models, 1,000 runs)."""
    token = None
    while True:
        page = search(*args, **kwargs, page_token=token)
        yield from page
        token = page.token
        if not token:
            return


def kept(keep_runs: int) -> tuple[set[tuple[str, str]], set[str]]:
    """(stage, key) pairs and MLflow run ids that must stay."""
    mlflow = tracking.client()
    keys: set[tuple[str, str]] = set()
    runs: set[str] = set()
    for model in every(mlflow.search_registered_models):
        for version in every(mlflow.search_model_versions, f"name = '{model.name}'"):
            runs.add(version.run_id)
            try:
                keys |= set(version_lineage(version.tags)["keys"].items())
            except ValueError as exc:  # what it keeps is unknown: nothing may be removed
                raise ValueError(
                    f"version {version.version} of registered model {model.name!r}: {exc}. Nothing was removed: fix "
                    f"or delete the tag (MlflowClient().delete_model_version_tag), then run rlhf gc again"
                ) from None
    for experiment in every(mlflow.search_experiments):
        parents = [
            run
            for run in every(mlflow.search_runs, [experiment.experiment_id], order_by=["attributes.start_time DESC"])
            if "mlflow.parentRunId" not in run.data.tags
        ]
        for parent in [*parents[:keep_runs], *(run for run in parents if run.info.status == "RUNNING")]:
            runs.add(parent.info.run_id)
            if linked := LINKED_RUN.search(parent.data.tags.get(MODEL_URI, "")):  # a cached run's weights live there
                runs.add(linked.group(1))
            children = every(
                mlflow.search_runs, [experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
            )
            keys |= {
                (c.data.tags["rlhf.stage"], c.data.tags["rlhf.key"]) for c in children if "rlhf.key" in c.data.tags
            }
    return keys, runs


def with_upstream(keys: set[tuple[str, str]], root: Path) -> set[tuple[str, str]]:
    """`keys` and every artifact their manifests name upstream, transitively."""
    found, todo = set(keys), list(keys)
    while todo:
        stage, key = todo.pop()
        try:
            manifest = json.loads((root / stage / key / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        for ref in manifest.get("upstream", {}).values():
            pair = (ref.get("stage", ""), ref.get("key", ""))
            if pair not in found:
                found.add(pair)
                todo.append(pair)
    return found


def collect(keep_runs: int = 5) -> list[Doomed]:
    """What `rlhf gc` would remove, each with its size and why."""
    root = tracking.state_dir() / "artifacts"
    keys, runs = kept(keep_runs)
    keys = with_upstream(keys, root)
    doomed: list[Doomed] = []
    for stage_root in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        stage = stage_root.name
        for folder in sorted(stage_root.iterdir()):
            # .labels: people's work; .curves: eval's drawn training curves (tasks.eval.curves_figure)
            if folder.name in (".locks", LEASES, ".work", ".labels", ".curves") or not folder.is_dir():
                continue
            if folder.name.startswith((".tmp-", ".trash-", ".damaged-")):
                key = folder.name.split("-")[1]
                doomed.append(Doomed(folder, size_of(folder), "left by a build that died or was rebuilt", key))
            elif (stage, folder.name) not in keys:
                why = f"no registered version, live run or the last {keep_runs} runs use it"
                doomed.append(Doomed(folder, size_of(folder), why, folder.name))
        for work in sorted((stage_root / ".work").iterdir()) if (stage_root / ".work").is_dir() else []:
            doomed.append(Doomed(work, size_of(work), "checkpoints of a build that is not running", work.name))
    doomed = [item for item in doomed if _not_held(item)]
    mlflow = tracking.client()
    for experiment in every(mlflow.search_experiments):
        for run in every(mlflow.search_runs, [experiment.experiment_id]):
            if run.info.run_id in runs or "mlflow.parentRunId" in run.data.tags:
                continue
            uri = urlparse(run.info.artifact_uri)
            copy = Path(unquote(uri.path)) / "model"
            if uri.scheme in ("", "file") and copy.is_dir():
                why = f"the weights copy of run {run.info.run_id}, kept by nothing"
                doomed.append(Doomed(copy, size_of(copy), why, run_id=run.info.run_id))
    return doomed


def _not_held(item: Doomed) -> bool:
    with unheld(item.path.parent if item.path.parent.name != ".work" else item.path.parent.parent, item.key) as free:
        return free


def remove(doomed: list[Doomed]) -> int:
    """Delete them (each artifact under its key's lock, so no build starts on it meanwhile); the bytes freed."""
    freed = 0
    for item in doomed:
        stage_root = item.path.parent.parent if item.path.parent.name == ".work" else item.path.parent
        with unheld(stage_root, item.key) if item.key else contextlib.nullcontext(True) as free:
            if free and item.path.exists():
                if item.run_id:  # no later cached run may link to a copy that is gone
                    tracking.set_tags(item.run_id, {MODEL_LOGGED: "removed by rlhf gc"})
                shutil.rmtree(item.path)
                freed += item.bytes
    return freed
