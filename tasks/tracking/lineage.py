"""What a stage's MLflow run read and made, as MLflow records lineage (docs/ARCHITECTURE.md, "Lineage in MLflow").

    datasets   every dataset the stage read (the data stage: every dataset it checked), an MLflow dataset input with
               its digest and source: the runs table's Datasets column
    models     the upstream stages' logged models, as the run's model inputs
    its model  a stage that publishes `model/` logs it as an MLflow logged model (the Models tab), tagged with its
               artifact digest and the logged models it was trained from, its card as the Description, its final
               metrics linked to it with the datasets it trained on (the page's "Datasets used"); a cached re-run
               links the same one

A registered version is made from the policy's logged model and names its upstream ones in one tag (`LINEAGE_TAG`,
`tasks.registry`), so a machine that shares only the tracking server finds the SFT and reward models through MLflow
(`tasks.tracking.resolve`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf_pipeline.tasks.store.artifacts import ArtifactRef
from rlhf_pipeline.tasks.tracking import client as tracking

LINEAGE_TAG = "rlhf.lineage"
"""A registered version's one tag of what it was built from, JSON: `keys` (stage -> artifact key), `models` (stage ->
logged model id of that stage's model, the policy's and the ones it was built from), `data` (dataset -> fingerprint),
and the flow run and MLflow run that registered it."""
MODEL_TAG, KEY_TAG = "rlhf.model.", "rlhf.key."
"""`rlhf.model.<stage>` / `rlhf.key.<stage>`: the same, one tag a stage, on versions registered before `LINEAGE_TAG`."""
UPSTREAM_TAG = "rlhf.upstream."
"""`rlhf.upstream.<name>` on a logged model: the logged model id of its upstream model `<name>` (sft, rm, ...)."""


CARD = "README.md"
"""The model card every published `model/` folder carries (`tasks.tracking.cards` writes it)."""


def version_lineage(tags: dict[str, str]) -> dict[str, dict[str, str]]:
    """`keys` and `models` (stage -> artifact key / logged model id) of a registered version, from its tags: the
    `LINEAGE_TAG`, else the older one-tag-a-stage form."""
    if tags.get(LINEAGE_TAG):
        try:
            found = json.loads(tags[LINEAGE_TAG])
            parts = {part: found.get(part, {}) for part in ("keys", "models")}
            if not all(isinstance(v, str) for part in parts.values() for v in [*part, *part.values()]):
                raise ValueError("stage names and their keys or models must be strings")
            return {part: dict(value) for part, value in parts.items()}
        except (ValueError, AttributeError, TypeError) as exc:
            raise ValueError(
                f'its {LINEAGE_TAG} tag is not what the registry writes ({{"keys": {{stage: key}}, "models": '
                f"{{stage: model id}}}}): {str(exc)[:200]}; given: {tags[LINEAGE_TAG][:200]!r}"
            ) from None
    return {
        "keys": {tag.removeprefix(KEY_TAG): value for tag, value in tags.items() if tag.startswith(KEY_TAG)},
        "models": {tag.removeprefix(MODEL_TAG): value for tag, value in tags.items() if tag.startswith(MODEL_TAG)},
    }


def card_text(model: Path) -> str:
    """A model folder's card without its YAML header: the Description of its logged model and registered versions."""
    try:
        text = (model / CARD).read_text()
    except OSError:
        return ""
    if text.startswith("---\n") and "\n---\n" in text[4:]:
        text = text[4:].split("\n---\n", 1)[1]
    return text.strip()


def has_model(folder: Path) -> bool:
    return (folder / "model" / "config.json").is_file()


def model_type(folder: Path) -> str:
    """What the folder's architecture is for: a reward model's scalar head, or a causal LM."""
    try:
        architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        architectures = []
    return "reward-model" if any("SequenceClassification" in name for name in architectures) else "causal-lm"


def _rows(path: Path) -> int | None:
    try:
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    except Exception:
        return None


def _dataset(name: str, digest: str, path: Path, context: str, tags: dict[str, str]) -> dict[str, Any]:
    rows = _rows(path) if path.is_file() else None
    return {
        "name": name,
        "digest": digest[:16],
        "source": str(path),
        "context": context,
        "tags": tags,
        "profile": {"num_rows": rows} if rows is not None else None,
    }


def _raw_source(entry: Any) -> str:
    """Where the data stage read a dataset from (its config entry: a path or a hub id)."""
    if isinstance(entry, dict):
        return str(entry.get("path") or entry.get("name") or "")
    return str(entry or "")


def dataset_inputs(
    stage: str, final: Path, manifest: dict, upstream: dict[str, ArtifactRef], config: Any
) -> list[dict[str, Any]]:
    """The datasets a stage's run records as inputs."""
    found = []
    if stage == "data":  # what it checked and froze: the frozen copy, its digest, and where it was read from
        for name, digest in sorted(manifest.get("parts", {}).items()):
            raw = _raw_source(config.get(name)) if isinstance(config, dict) else ""
            tags = {"rlhf.source": raw, "rlhf.fingerprint": manifest.get("fingerprints", {}).get(name, "")}
            found.append(_dataset(name, digest, final / "datasets" / f"{name}.parquet", "validation", tags))
    context = "evaluation" if stage == "eval" else "training"
    for ref in upstream.values():
        if ref.stage == "data":
            for name, digest in sorted(ref.parts.items()):
                found.append(_dataset(name, digest, ref.path / "datasets" / f"{name}.parquet", context, {}))
        elif ref.stage == "pairs" and (ref.path / "datasets" / "preference.parquet").is_file():
            found.append(
                _dataset(
                    "pairs", ref.digest, ref.path / "datasets" / "preference.parquet", context, {"rlhf.made": "true"}
                )
            )
    return found


def upstream_models(upstream: dict[str, ArtifactRef]) -> dict[str, str]:
    """name -> logged model id of every upstream model this tracking store holds."""
    found = {}
    for name, ref in upstream.items():
        if has_model(ref.path) and (model_id := tracking.find_logged_model(ref.digest)):
            found[name] = model_id
    return found


def record(
    run_id: str,
    experiment: str,
    stage: str,
    final: Path,
    upstream: dict[str, ArtifactRef],
    config: Any,
    metrics: dict[str, float],
    step: int,
) -> str | None:
    """The run's dataset and model inputs, and its published model as a logged model (uploaded once per tracking
    store, linked after); returns the logged model's id, or None for a stage without a model."""
    manifest = json.loads((final / "manifest.json").read_text())
    datasets = dataset_inputs(stage, final, manifest, upstream, config)
    tracking.log_datasets(run_id, datasets)
    inputs = upstream_models(upstream)
    tracking.log_model_inputs(run_id, sorted(set(inputs.values())))
    if not has_model(final):
        return None
    model_id, _ = tracking.log_model(
        run_id,
        experiment,
        stage,
        final / "model",
        manifest["digest"],
        config if isinstance(config, dict) else {},
        {
            "rlhf.stage": stage,
            "rlhf.key": manifest["key"],
            **{f"{UPSTREAM_TAG}{name}": model_id for name, model_id in inputs.items()},
        },
        model_type(final / "model"),
        card_text(final / "model"),
    )
    trained_on = [(d["name"], d["digest"]) for d in datasets if d["context"] == "training"]
    tracking.log_model_metrics(run_id, model_id, metrics, step, trained_on)
    return model_id
