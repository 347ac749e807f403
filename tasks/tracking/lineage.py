"""What a stage's MLflow run read and made, as MLflow records lineage (docs/ARCHITECTURE.md, "Lineage in MLflow").

    datasets   every dataset the stage read (the data stage: every dataset it checked), an MLflow dataset input with
               its digest and source: the runs table's Datasets column
    models     the upstream stages' logged models, as the run's model inputs
    its model  a stage that publishes `model/` logs it as an MLflow logged model (the Models tab), tagged with its
               artifact digest and the logged models it was trained from; a cached re-run links the same one

A registered version points at the policy's logged model and names its upstream ones (`tasks.registry`), so a machine
that shares only the tracking server finds the SFT and reward models through MLflow (`tasks.tracking.resolve`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf_pipeline.tasks.store.artifacts import ArtifactRef
from rlhf_pipeline.tasks.tracking import client as tracking

MODEL_TAG = "rlhf.model."
"""`rlhf.model.<stage>` on a registered version: the logged model id of that stage's model (the policy's and the
ones it was built from)."""
UPSTREAM_TAG = "rlhf.upstream."
"""`rlhf.upstream.<name>` on a logged model: the logged model id of its upstream model `<name>` (sft, rm, ...)."""


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
    tracking.log_datasets(run_id, dataset_inputs(stage, final, manifest, upstream, config))
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
    )
    tracking.log_model_metrics(run_id, model_id, metrics, step)
    return model_id
