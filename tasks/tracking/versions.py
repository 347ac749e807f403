"""Registered model versions, through client.py's MLflow client: a version made from its logged model, its aliases
and tags, and its verified download."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from rlhf_pipeline.tasks.store.secrets import redact_text
from rlhf_pipeline.tasks.tracking.client import DESCRIPTION_LIMIT, VERSIONS_TAG, _download, client, tracking_uri


def register_version(name: str, model_id: str, run_id: str, tags: dict[str, str], description: str = "") -> str:
    """A new version of registered model `name` made from logged model `model_id`, as `mlflow.register_model` makes
    one: source `models:/<model_id>` on a tracking server (its files stay the logged model's artifacts), `model_id`
    set, the logged model's `mlflow.modelVersions` tag naming the version (the tracking server sets it itself; a
    database store does not); `description` is the version page's Description. Returns the version number."""
    from mlflow.exceptions import MlflowException

    mlflow = client()
    try:
        mlflow.create_registered_model(name)
    except MlflowException as exc:
        if "already exists" not in str(exc).lower() and "RESOURCE_ALREADY_EXISTS" not in str(exc):
            raise
    # A database store's registry resolves a `models:/<model_id>` source through a client of MLflow's process-wide
    # tracking URI, not of the store it is called on (MLflow 3.17's SqlAlchemyStore.create_model_version): there the
    # source is the logged model's own artifact location, which is what the tracking server stores for that URI.
    remote = tracking_uri().startswith("http")
    source = f"models:/{model_id}" if remote else mlflow.get_logged_model(model_id).artifact_location
    version = mlflow.create_model_version(
        name,
        source,
        run_id=run_id,
        tags={k: str(v)[:5000] for k, v in tags.items()},
        description=redact_text(description)[:DESCRIPTION_LIMIT] or None,
        model_id=model_id,
    )
    link_version(model_id, name, str(version.version))
    return str(version.version)


def link_version(model_id: str, name: str, version: str) -> None:
    """Version `version` of `name` listed in logged model `model_id`'s `mlflow.modelVersions` tag (once)."""
    mlflow = client()
    listed = json.loads(mlflow.get_logged_model(model_id).tags.get(VERSIONS_TAG) or "[]")
    entry = {"name": name, "version": int(version)}  # as MLflow's tracking server writes it
    if entry not in [{"name": e.get("name"), "version": int(e.get("version", 0))} for e in listed]:
        mlflow.set_logged_model_tags(model_id, {VERSIONS_TAG: json.dumps([*listed, entry])})


def set_version_tags(name: str, version: str, tags: dict[str, str]) -> None:
    mlflow = client()
    for key, value in tags.items():
        mlflow.set_model_version_tag(name, version, key, str(value)[:5000])


def find_version(name: str, tag: str, value: str) -> str | None:
    """The newest version of `name` whose tag `tag` equals `value`."""
    try:
        versions = client().search_model_versions(f"name = '{name}'")
    except Exception:
        return None
    found = [v for v in versions if v.tags.get(tag) == value]
    return str(max(int(v.version) for v in found)) if found else None


def alias_version(name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(client().get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def set_alias(name: str, alias: str, version: str) -> None:
    client().set_registered_model_alias(name, alias, version)


def version_exists(name: str, version: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client().get_model_version(name, version)
    except MlflowException:
        return False
    return True


def version_tags(name: str, version: str) -> dict[str, str]:
    return dict(client().get_model_version(name, version).tags)


FILES_TAG = "rlhf.model_files"
"""A registered version's tag: its model files as {relative path: the first 16 hex digits of their sha256}."""


def download_version(name: str, version: str, dst: Path) -> Path:
    """The files of a registered version, downloaded once to `dst` and checked against the version's file digests
    (`FILES_TAG`) every time they are used: a damaged copy (a truncated download, a file edited or removed) is moved
    aside and fetched again; a version whose stored files are damaged too fails naming the files."""
    import time

    expected = json.loads(version_tags(name, version).get(FILES_TAG) or "{}")
    _download(client().get_model_version_download_uri(name, version), dst)
    if not (damaged := _damaged(dst, expected)):
        return dst
    aside = dst.with_name(f".damaged-{dst.name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.urandom(3).hex()}")
    dst.rename(aside)
    _download(client().get_model_version_download_uri(name, version), dst)
    if still := _damaged(dst, expected):
        raise ValueError(
            f"models:/{name}/{version}: the registered files do not match their digests ({', '.join(still)}): the "
            "version's stored copy is damaged; register the policy again (re-run it with registry.enabled=true)"
        )
    logging.getLogger(__name__).warning(
        f"models:/{name}/{version}: the local copy was damaged ({', '.join(damaged)}), kept in {aside}; fetched again"
    )
    return dst


def files_digests(folder: Path) -> dict[str, str]:
    """{relative path: first 16 hex digits of sha256} of the files under `folder` (`FILES_TAG`)."""
    from rlhf_pipeline.tasks.store.artifacts import sha256_of

    return {p.relative_to(folder).as_posix(): sha256_of(p)[:16] for p in sorted(folder.rglob("*")) if p.is_file()}


def _damaged(folder: Path, expected: dict[str, str]) -> list[str]:
    """The files of `folder` that differ from `expected` (missing, changed, truncated), each with why."""
    if not expected:
        return []  # a version registered before its files were recorded
    found = files_digests(folder)
    return [
        f"{folder / path}: {'missing' if path not in found else 'not the registered bytes'}"
        for path, digest in expected.items()
        if found.get(path) != digest
    ]
