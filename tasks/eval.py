"""`eval`: compare the policy with SFT (and the registry's champion) on held-out prompts; publish the report."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from rlhf_pipeline.tasks.gate import RegistryConfig
from rlhf_pipeline.tasks.orchestration.stage_task import device_hold, lock_holder, prefect_log, stage_task
from rlhf_pipeline.tasks.registry import current_champion
from rlhf_pipeline.tasks.stages import BY_NAME
from rlhf_pipeline.tasks.store.artifacts import MANIFEST, ArtifactRef, RunContext, StageOutcome, read_history
from rlhf_pipeline.tasks.store.stage import run_stage
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.tasks.tracking.recorder import MLFLOW
from rlhf_pipeline.trainers.algorithms.sft import SKIPPED
from rlhf_pipeline.trainers.config import ModelConfig
from rlhf_pipeline.trainers.evaluation.stage import EvalConfig
from rlhf_pipeline.trainers.models.checkpoints import keyed_model
from rlhf_pipeline.trainers.runtime.custom import source_digests

REPORT_FILES = ("summary.json", "summary.md", "samples.jsonl", "plots")
# Plotted per stage
CURVES = (
    "/train/loss",
    "/eval/loss",
    "/train/accuracy",
    "/train/reward",
    "/train/kl",
    "/train/rewards_margins",
)


@stage_task("eval")
def evaluate(
    config: EvalConfig,
    model: ModelConfig,
    inputs: dict[str, ArtifactRef | None],
    registry: RegistryConfig,
    ctx: RunContext,
) -> StageOutcome:
    """`inputs`: the `data`, `sft`, `policy` and `rm` (or None) artifacts (and the made `pairs`, shown in the report,
    not keyed), in one mapping as the training stages take
    theirs. A future passed as a parameter of its own while its task runs would make Prefect draw eval inside that
    task's group."""
    data, sft_model, policy, reward_model = inputs["data"], inputs["sft"], inputs["policy"], inputs.get("rm")
    # The champion is an input like any other: a new champion re-keys eval.
    # When the champion *is* this policy (a re-run), there is nothing to compare.
    champion = current_champion(registry)
    if champion is not None and champion.digest == policy.digest:
        champion = None

    def build(out_dir, work_dir, log_metrics):
        from rlhf_pipeline.trainers.algorithms.loop import match_cpu_threads
        from rlhf_pipeline.trainers.evaluation import stage as evaluation

        match_cpu_threads()

        return evaluation.evaluate(
            config,
            model,
            sft_model.path / "model",
            policy.path / "model",
            reward_model.path / "model" if reward_model else None,
            data.path,
            out_dir,
            policy_stage=policy.stage,
            champion_model=champion.path / "model" if champion else None,
            # a run's trained sft has a base model to show; a skipped sft or a model given by path is the start
            sft_trained=(sft_model.path / MANIFEST).is_file()
            and SKIPPED not in sft_model.manifest().get("metrics", {}),
        )

    row = BY_NAME["eval"]
    upstream = {"data": data.select(row.reads), "sft": sft_model, "policy": policy}
    if reward_model:
        upstream["rm"] = reward_model
    if champion:
        upstream["champion"] = champion
    settings = {"eval": config.model_dump(mode="json"), "model": keyed_model(model)}
    fingerprints = source_digests(config.code_paths())  # editing the gold metric or a judge function re-runs eval alone
    outcome = run_stage(
        "eval",
        settings,
        upstream,
        ctx,
        build,
        fingerprints=fingerprints,
        log_files=REPORT_FILES,
        log=prefect_log,
        code=row.code,
        hold=device_hold("eval", row.device, prefect_log, ctx.wait_seconds),
        system_metrics=row.device,
        record=MLFLOW,
        holder=lock_holder(),
    )
    publish_report(outcome.ref, [data, sft_model, reward_model, policy], ctx, pairs=inputs.get("pairs"))
    return outcome


def pairs_section(pairs: ArtifactRef) -> tuple[str, dict[str, float]]:
    """The made pairs as eval shows them: labeller, kept and dropped, and the labeller's agreement with the held-out
    preferences where it was measured."""
    made = json.loads((pairs.path / "pairs.json").read_text())
    m = made["metrics"]
    lines = [
        "\n## Preference pairs made by the `pairs` stage\n",
        f"- labeller: {made['labeller']}; {m['pairs/made']:.0f} pairs from {m['pairs/prompts']:.0f} prompts; trained "
        f"on {m['pairs/train_rows']:.0f} rows",
        "- dropped: "
        + ", ".join(
            f"{v:.0f} {k.removeprefix('pairs/dropped/').replace('_', ' ')}"
            for k, v in m.items()
            if k.startswith("pairs/dropped/")
        ),
    ]
    if "pairs/labeller_agreement" in m:
        lines.append(
            f"- agreement with the held-out preferences: {m['pairs/labeller_agreement']:.3f} "
            f"[{m['pairs/labeller_agreement_low']:.3f}, {m['pairs/labeller_agreement_high']:.3f}] on "
            f"{m['pairs/labeller_agreement_pairs']:.0f} pairs"
        )
    if "pairs/judge/first_position_rate" in m:
        lines.append(
            f"- judge's first-position rate (0.5: no position bias): {m['pairs/judge/first_position_rate']:.3f}"
        )
    shown = {k: v for k, v in m.items() if k.startswith("pairs/")}
    return "\n".join(lines) + "\n", shown


def publish_report(
    report: ArtifactRef, stages: list[ArtifactRef | None], ctx: RunContext, pairs: ArtifactRef | None = None
) -> None:
    """Prefect markdown + table artifacts, and training curves of every stage, for this flow run (with the made
    pairs' summary when the run made them). The summary shows the report's plots and the training curves as images
    (`plots_section`)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    link = tracking.run_link(ctx.parent_run_id)
    summary = (report.path / "summary.md").read_text()
    if pairs is not None and (pairs.path / "pairs.json").is_file():
        section, shown = pairs_section(pairs)
        summary += section
        tracking.log_metrics(ctx.parent_run_id, shown)
    rows = [json.loads(line) for line in (report.path / "samples.jsonl").read_text().splitlines()]
    if rows:
        create_table_artifact(key="rlhf-eval-samples", table=rows, description="Sample answers with their rewards.")
        flat = [{k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()} for row in rows]
        tracking.log_table(ctx.parent_run_id, flat, "eval/samples_table.json")

    # Curves come from the artifacts (`history.jsonl`), not from the runs that produced them: those may
    # live in another tracking store, and an external model (the rlhf-eval flow) has none.
    histories: dict[str, list[tuple[int, float]]] = {}
    for ref in filter(None, stages):
        curves: dict[str, dict[int, float]] = {}
        for step, values in read_history(ref.path):
            for name, value in values.items():
                curves.setdefault(name, {})[step] = value  # a resumed build logs a few steps twice: the last wins
        histories.update({k: sorted(v.items()) for k, v in curves.items() if k.endswith(CURVES) and len(v) > 1})
    with tempfile.TemporaryDirectory() as scratch:
        figures = sorted((report.path / "plots").glob("*.png"))
        if histories:
            curves_root = Path(ctx.artifact_root) / "eval" / ".curves"
            figures.append(curves_figure(histories, [ref for ref in stages if ref], curves_root, Path(scratch)))
            tracking.log_artifacts(ctx.parent_run_id, figures[-1], "plots")
        create_markdown_artifact(
            key="rlhf-eval-summary",
            markdown=f"# rlhf evaluation\n\n{summary}\n{plots_section(figures)}\nMLflow: {link}\n\n"
            f"Artifacts: `{report.uri}`\n",
            description="Held-out evaluation of the policy against SFT (and the champion), with its plots.",
        )
    tracking.log_artifacts(ctx.parent_run_id, report.path / "plots", "plots")


def curves_figure(
    histories: dict[str, list[tuple[int, float]]], stages: list[ArtifactRef], root: Path, scratch: Path
) -> Path:
    """The training curves of `stages` as one figure, drawn once per set of stage artifacts (their keys say which
    curves: a published artifact never changes) and kept in the state folder: a cached re-run, or one that changes
    only eval, reuses it instead of drawing it again (~1 s of matplotlib on 2 cores)."""
    import hashlib
    import os

    from rlhf_pipeline.trainers.evaluation import plots

    name = hashlib.sha256(json.dumps(sorted(f"{ref.stage}/{ref.key}" for ref in stages)).encode()).hexdigest()[:32]
    kept = root / name / "training_curves.png"  # its name is its title, in MLflow and in the Prefect summary
    if kept.is_file():
        return kept
    partial = kept.with_name(f".partial-{os.getpid()}.png")  # a reader never sees half a figure
    try:
        plots.training_curves(histories, partial).rename(kept)
    except OSError:  # a read-only or full state folder: drawn in the scratch folder, and again next time
        partial.unlink(missing_ok=True)
        return plots.training_curves(histories, scratch / "training_curves.png")
    return kept


MAX_IMAGE_BYTES = 256_000
"""A plot larger than this (as PNG) is shown downscaled in the Prefect artifact (the report's own are ~20-40 KB)."""
MAX_SUMMARY_IMAGE_BYTES = 2_000_000
"""The most PNG bytes one summary artifact embeds; plots beyond are named, not shown (they are in MLflow)."""


def plots_section(figures: list[Path]) -> str:
    """The plots as markdown images with `data:` URIs: the Prefect UI's markdown renderer (prefect-design's
    PMarkdownRenderer in Prefect 3.9.1) draws an image token as a plain `<img src>`, unsanitised, and the server sends
    no Content-Security-Policy, so they show with no MLflow server to fetch them from."""
    import base64
    import io

    from matplotlib.image import imread, thumbnail

    lines, spent = ["## Plots\n"], 0
    for figure in figures:
        title = figure.stem.replace("_", " ").capitalize()
        png = figure.read_bytes()
        width = imread(figure).shape[1] if len(png) > MAX_IMAGE_BYTES else 0
        for _ in range(4):  # fewer pixels until it fits: a plot's bytes go about with its pixel count
            if len(png) <= MAX_IMAGE_BYTES:
                break
            scale = min(800 / width, 0.9 * (MAX_IMAGE_BYTES / len(png)) ** 0.5)
            smaller = io.BytesIO()
            thumbnail(io.BytesIO(png), smaller, scale=scale)
            png, width = smaller.getvalue(), int(width * scale)
        if len(png) > MAX_IMAGE_BYTES or spent + len(png) > MAX_SUMMARY_IMAGE_BYTES:
            lines.append(f"- {title}: `plots/{figure.name}` in the MLflow run (too large to embed here)\n")
            continue
        spent += len(png)
        lines.append(f"**{title}**\n\n![{title}](data:image/png;base64,{base64.b64encode(png).decode()})\n")
    return "\n".join(lines) if figures else ""
