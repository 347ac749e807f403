"""Small builders shared by the tests: a tiny dataset folder as the `data` stage writes it, fast configs."""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_pipeline.flows.params import load_params
from rlhf_pipeline.trainers.data import DataConfig, load_source

CI_PRESET = str(Path(__file__).resolve().parent / "ci.yaml")
"""The tests' preset: the embedded default shrunk to seconds per stage."""
SMALL_MODEL = load_params(CI_PRESET).model
"""The tests' preset's model: a smaller tiny model than the default, so trainer tests take seconds."""
FAST = dict(per_device_train_batch_size=16, max_length=64, logging_steps=1, save_steps=1000, learning_rate=3e-3)
"""Trainer arguments of the unit tests that call a stage's `train` directly: a step on every log, no checkpoints."""


def write_data_dir(root: Path, rows: int = 64) -> Path:
    """`<root>/datasets/<name>.parquet` for every bundled dataset, cut to `rows` rows."""
    (root / "datasets").mkdir(parents=True, exist_ok=True)
    for name, (_, spec) in DataConfig().sources().items():
        dataset = load_source(spec)
        dataset.select(range(min(rows, len(dataset)))).to_parquet(str(root / "datasets" / f"{name}.parquet"))
    return root


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trainable(model) -> dict:
    """A copy of every parameter the optimizer would train (`requires_grad`), by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def unchanged(before: dict, after) -> list[str]:
    """The names in `before` (from `trainable`) whose tensor is bit-identical in `after`, a model or a
    name -> tensor dict (e.g. a safetensors file). Tests assert `== []`, or the exact list of tensors that
    must stay frozen, so one tensor that did not train fails by name; a name missing from `after` is an error."""
    import torch

    if not isinstance(after, dict):
        after = dict(after.named_parameters())
    missing = sorted(before.keys() - after.keys())
    if missing:
        raise KeyError(f"{len(missing)} tensors of `before` are not in `after`: {missing}")
    return sorted(
        name for name, tensor in before.items() if torch.equal(tensor, after[name].detach().to(tensor.device))
    )


def length_reward(prompts, completions, **_) -> list[float]:
    """Varies on an untrained model's samples (unlike exact match), so group advantages are non-zero."""
    return [float(len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]


def brevity(prompts, completions, **_) -> list[float]:
    """A gold metric at odds with `length_reward`: 1 / (1 + characters)."""
    return [1.0 / (1.0 + r) for r in length_reward(prompts, completions)]


FALLING = [0.0, 0.5, 0.9, 0.7, 0.6, 0.4]
"""`falling_gold`'s value at each of its calls in a process: the first is the check before training, then one per
probe; the best is the second probe's."""
_gold_calls = [0]


def falling_gold(prompts, completions, **_) -> list[float]:
    """A gold metric that peaks at the second probe and falls after it, whatever the answers: a held-out metric that
    over-optimisation drives down, without waiting for a tiny model to over-optimise in 8 steps."""
    value = FALLING[min(_gold_calls[0], len(FALLING) - 1)]
    _gold_calls[0] += 1
    return [value] * len(completions)


def stage_context(tmp_path: Path, experiment: str, launch):
    """What the flow hands a stage task (`RunContext`): artifacts under `tmp_path`, a parent MLflow run in
    `experiment`, `launch` as the run's launch block."""
    from rlhf_pipeline.tasks.store.artifacts import RunContext
    from rlhf_pipeline.tasks.tracking import client as tracking

    experiment_id = tracking.experiment_id(experiment)
    parent = tracking.start_run(experiment_id, "parent", {})
    return RunContext(
        artifact_root=str(tmp_path / "artifacts"), experiment_id=experiment_id, parent_run_id=parent, launch=launch
    )


def data_artifact(tmp_path: Path, rows: int = 64):
    """A `data` artifact of `rows` rows of the bundled task, as the data stage hands it on."""
    from rlhf_pipeline.tasks.store.artifacts import ArtifactRef

    return ArtifactRef(stage="data", key="d", uri=str(write_data_dir(tmp_path / "data", rows=rows)))


def recorded_stage(*args, **kwargs):
    """`run_stage` as the tasks call it: recorded in MLflow (`tasks.tracking.recorder.MLFLOW`)."""
    from rlhf_pipeline.tasks.store.stage import run_stage
    from rlhf_pipeline.tasks.tracking.recorder import MLFLOW

    return run_stage(*args, record=MLFLOW, **kwargs)
