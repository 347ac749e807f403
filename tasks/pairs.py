"""`pairs`: the Prefect task that makes preference pairs from prompts (`trainers.pairs.stage`), in two keyed parts.

    <artifact_root>/pairs/<key>/     the samples (keyed on prompts, sampling model, sampling settings), and the
                                     labelled pairs (keyed on the samples, the labeller and people's labels)
    <artifact_root>/pairs/.labels/   people's labels per samples key (`tasks.labels`): never collected by `rlhf gc`

With `labeller: people` and labels still missing, the task publishes the samples and ends `AwaitingLabels`; the flow
then asks people in Prefect (`tasks.people.ask_people`, outside any task: no device slot is held while it waits) and
runs the task again with the labels, which finds the samples cached and publishes the pairs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rlhf_pipeline.tasks.labels import labels_store, read_labels_file, read_store
from rlhf_pipeline.tasks.orchestration.stage_task import device_hold, lock_holder, prefect_log, stage_task
from rlhf_pipeline.tasks.stages import BY_NAME
from rlhf_pipeline.tasks.store.artifacts import ArtifactRef, RunContext, StageOutcome
from rlhf_pipeline.tasks.store.stage import run_stage
from rlhf_pipeline.tasks.tracking.recorder import MLFLOW
from rlhf_pipeline.trainers.pairs.stage import PAIRS, SUMMARY, PairsConfig


@stage_task("pairs")
def make_pairs(
    config: PairsConfig,
    upstream: dict[str, ArtifactRef],
    ctx: RunContext,
    round_: int = 0,
    aggregate: str = "mean",
    earlier: ArtifactRef | None = None,
) -> StageOutcome:
    """Sample the starting policy (`upstream["policy"]` in a feedback round, else `upstream["sft"]`), then label the
    samples; `earlier`: the last round's pairs, kept beside this round's (the reward model's rounds)."""
    from rlhf_pipeline.trainers.pairs import stage as made

    data = upstream["data"]
    start = upstream.get("policy") or upstream["sft"]
    tags = {"rlhf.round": str(round_)} if round_ else {}
    samples = _sampled(config, data, start, ctx, round_, tags)
    fingerprints = _code(config)
    labels: dict[int, str | None] = {}
    if config.labeller == "people":
        labels, awaiting = _people_labels(config, ctx, samples.ref, fingerprints)
        if awaiting:
            return StageOutcome(samples.ref, "awaiting", samples.metrics, labels_store=awaiting)
    # The given pairs when they are trained on too; the held-out ones the labeller's agreement is measured on.
    inputs = {
        "samples": samples.ref,
        "data": data.select((*(("preference",) if config.train_on == "both" else ()), "preference_eval")),
    }
    if config.labeller == "reward_model":
        inputs["rm"] = upstream["rm"]
    if earlier is not None:
        inputs["earlier"] = earlier
    reward_model = upstream["rm"].path / "model" if config.labeller == "reward_model" else None
    labelled = run_stage(
        "pairs",
        {
            "labels": config.labelling(),
            "round": round_,
            **({"aggregate": aggregate} if reward_model is not None else {}),
        },
        inputs,
        ctx,
        lambda out_dir, work_dir, log_metrics: made.label(
            config,
            samples.ref.path,
            data.path,
            out_dir,
            round_,
            reward_model=reward_model,
            labels=labels,
            earlier=earlier.path if earlier is not None else None,
            log_metrics=log_metrics,
            aggregate=aggregate,
            check=preference_rules,
        ),
        fingerprints,
        log_files=(PAIRS, SUMMARY),
        log=prefect_log,
        code=BY_NAME["pairs"].code,
        hold=device_hold("pairs", config.uses_device, prefect_log, ctx.wait_seconds),
        extra_tags={**tags, "rlhf.part": "labels", "rlhf.labeller": config.labeller},
        record=MLFLOW,
        holder=lock_holder(),
    )
    prefect_log(made.summary(labelled.metrics, config.labeller))
    if labelled.mlflow_run_id and not labelled.cached:  # a cached re-run's MLflow run links to its producer's
        log_made_pairs(labelled, config, round_)
    return labelled


def _sampled(config: PairsConfig, data: ArtifactRef, start: ArtifactRef, ctx: RunContext, round_: int, tags: dict):
    """The starting policy's samples of the prompts: keyed on the prompts, the sampling model and the sampling settings
    alone, so another labeller (or people's labels) never samples again."""
    from rlhf_pipeline.trainers.pairs import stage as made

    samples = run_stage(
        "pairs",
        {"samples": config.sampling(), "round": round_},
        {"data": data.select(("prompts",)), "model": start},
        ctx,
        lambda out_dir, work_dir, log_metrics: made.sample(
            config, start.path / "model", data.path, out_dir, round_, log_metrics, work_dir
        ),
        log_files=(made.SAMPLES,),
        log=prefect_log,
        code=BY_NAME["pairs"].code,
        hold=device_hold("pairs", True, prefect_log, ctx.wait_seconds),
        extra_tags={**tags, "rlhf.part": "samples"},
        system_metrics=True,
        record=MLFLOW,
        holder=lock_holder(),
    )
    return samples


def _people_labels(config: PairsConfig, ctx: RunContext, samples: ArtifactRef, fingerprints: dict) -> tuple[dict, str]:
    """People's labels of the pairs shown, from the labels file or the labels store; the labels store still awaited
    ("" once every shown pair is labelled: their digest is keyed, in `fingerprints`)."""
    from rlhf_pipeline.trainers.pairs import stage as made

    shown = made.people_pairs(made.read_samples(samples.path), config.people.max_pairs)
    hashes = {pair["pair"]: pair["hash"] for pair in shown}
    store = labels_store(ctx.artifact_root, samples.key)
    if config.people.labels_file is not None:
        labels, finished = read_labels_file(Path(config.people.labels_file).expanduser(), hashes), True
    else:
        labels, finished = read_store(store, hashes)
    if not finished and any(labels.get(pair["pair"]) is None for pair in shown):
        return labels, str(store)
    canonical = json.dumps({str(k): v for k, v in sorted(labels.items())}, sort_keys=True)
    fingerprints["people_labels"] = hashlib.sha256(canonical.encode()).hexdigest()[:32]
    return labels, ""


def log_made_pairs(labelled: StageOutcome, config: PairsConfig, round_: int) -> None:
    """The made pairs as an MLflow dataset input of the run that labelled them: digest, labeller, counts."""
    from rlhf_pipeline.tasks.tracking import client as tracking

    tracking.log_dataset_input(
        labelled.mlflow_run_id,
        name=f"pairs-{config.labeller}" + (f"-round-{round_}" if round_ else ""),
        digest=labelled.ref.digest[:16],
        source=str(labelled.ref.path / "datasets" / "preference.parquet"),
        context="training",
        tags={"rlhf.labeller": config.labeller, "rlhf.round": str(round_)},
        profile={
            "num_rows": int(labelled.metrics.get("pairs/train_rows", 0)),
            "made": labelled.metrics.get("pairs/made"),
        },
    )


def preference_rules(dataset, source: str) -> None:
    """The data stage's preference rules on the made pairs (DataValidationError naming the rule and rows)."""
    from rlhf_pipeline.validators.validate import validate_dataset

    validate_dataset("preference", dataset, source=source)


def _code(config: PairsConfig) -> dict[str, str]:
    from rlhf_pipeline.trainers.runtime.custom import source_digests

    return source_digests(config.code_paths())
