"""What every TRL stage's training does around `trainer.train()`: its callbacks (metrics, progress, complete-checkpoint
markers, the user's), resuming from the newest complete checkpoint, saving on rank 0, and how training ended
(`training.json`).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from rlhf_pipeline.trainers.algorithms.fields import TrainingConfig
from rlhf_pipeline.trainers.config import Customisation, LogMetrics
from rlhf_pipeline.trainers.models.handoff import unsharded_copy
from rlhf_pipeline.trainers.models.load import save_model
from rlhf_pipeline.trainers.runtime.stopping import TERMINATING, Terminated, checkpoint_callback


def match_cpu_threads() -> int:
    """torch's CPU threads set to the cores this process may use (its affinity: a container's or a launcher's
    share), not the machine's: more threads than cores oversubscribe them, and every thread then waits on the others
    (docs/LIBRARY-FACTS.md, This machine). Returns the count."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if torch.get_num_threads() != cores:
        torch.set_num_threads(cores)
    return cores


COMPLETE = "checkpoint.complete"
"""Written into a checkpoint folder once the trainer has saved all of it (weights, optimizer,
scheduler, RNG, trainer state): a folder without it was being written when the process died."""


def last_checkpoint(work_dir: Path) -> str | None:
    """Newest complete `checkpoint-N` folder, or None; half-written ones (no COMPLETE marker) are never used."""
    if not work_dir.is_dir():
        return None
    done = [p for p in work_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit() and (p / COMPLETE).is_file()]
    return str(max(done, key=lambda p: int(p.name.split("-")[-1]))) if done else None


def metric_name(stage: str, key: str) -> str:
    """TRL's `loss`, `eval_loss`, `rewards/chosen`, `train_runtime` -> `<stage>/<split>/<name>`."""
    if key == "train_loss":  # the end-of-training average; `loss` is the per-step value
        return f"{stage}/train/loss_average"
    split = "train"
    for prefix in ("eval_", "train_"):
        if key.startswith(prefix):
            split, key = prefix[:-1], key[len(prefix) :]
    return f"{stage}/{split}/{re.sub(r'[^A-Za-z0-9_.-]+', '_', key)}"


def stage_callbacks(stage: str, log_metrics: LogMetrics | None, cfg: Customisation | None = None) -> list:
    """The TrainerCallbacks of every TRL stage: metrics and progress, complete-checkpoint markers, then the user's
    (`cfg.callbacks`)."""
    from transformers import TrainerCallback

    class MarkComplete(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            # Called after the trainer wrote the whole checkpoint (and rotated old ones).
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir() and state.is_world_process_zero:
                (folder / COMPLETE).write_text(f"{state.global_step}\n")

    return [
        metrics_callback(stage, log_metrics),
        checkpoint_callback(),  # before MarkComplete: a checkpoint saved on SIGTERM is marked complete as well
        MarkComplete(),
        *(cfg.user_callbacks() if cfg is not None else []),
    ]


def metrics_callback(stage: str, log_metrics: LogMetrics | None):
    """A transformers TrainerCallback that forwards every log line as namespaced metrics and logs progress."""
    from transformers import TrainerCallback

    from rlhf_pipeline.trainers.runtime.progress import PROGRESS, Progress

    class ForwardMetrics(TrainerCallback):
        progress: Progress | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.progress = Progress(stage, state.max_steps, state.global_step, main=state.is_world_process_zero)
            if args.world_size > 1 and state.is_world_process_zero:
                import torch.distributed as dist

                backend = dist.get_backend() if dist.is_initialized() else "?"
                PROGRESS.info(f"{stage}: world size {args.world_size} ({args.parallel_mode.name.lower()}, {backend})")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or not state.is_world_process_zero:
                return
            values = {
                metric_name(stage, k): float(v)
                for k, v in logs.items()
                if isinstance(v, (int, float)) and math.isfinite(v)
            }
            if self.progress is not None and "train_runtime" not in logs:  # not the closing summary
                self.progress.log(state.global_step, values)
            if values and log_metrics is not None:
                log_metrics(values, state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            if self.progress is not None:
                self.progress.step(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            if self.progress is not None:
                self.progress.close()

    return ForwardMetrics()


def fit(trainer, cfg: TrainingConfig, work_dir: Path, out_dir: Path) -> dict:
    """Train a TRL trainer with the user's optimizer if any (`cfg.optimizer_factory`), resuming from the newest complete
    checkpoint, and write how it ended (`training.json`: stopped early by a callback, the best checkpoint loaded)."""
    from rlhf_pipeline.trainers.algorithms.loop import write_outcome
    from rlhf_pipeline.trainers.runtime.custom import install

    install(trainer, cfg)
    trainer.add_callback(counters_callback(trainer))
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)  # its printed log dicts: every value is in `log_metrics` already
    if os.environ.get("TQDM_DISABLE"):  # tqdm's own switch: the progress records are the stage's only display
        trainer.remove_callback(ProgressCallback)
    trainer.train(resume_from_checkpoint=last_checkpoint(work_dir))
    state = trainer.state
    if TERMINATING.is_set():  # stopped by SIGTERM, its checkpoint written: nothing is published
        raise Terminated(
            f"stopped by SIGTERM after step {state.global_step} of {state.max_steps}; the next attempt resumes from "
            f"checkpoint-{state.global_step}"
        )
    best = state.best_model_checkpoint if cfg.keeps_best_checkpoint() else None
    outcome = {"global_step": state.global_step, "max_steps": state.max_steps}
    if is_main_process(trainer):
        outcome = write_outcome(out_dir, state.global_step, state.max_steps, best, state.best_metric)
    return outcome


COUNTERS = "counters.json"
"""Written into every checkpoint: the running totals the trainer keeps outside its saved state (the loss summed over
the steps, the loss of the steps not logged yet, the last logged step, TRL's count of training tokens)."""


def counters_callback(trainer):
    """Keeps a resumed stage's totals whole, so that its artifact is the unbroken one's byte for byte (its card reports
    the average loss and TRL's token count): each checkpoint saves the totals, and a resumed run starts from them, as
    if it had never stopped, instead of counting from the checkpoint."""
    from transformers import TrainerCallback

    class ResumeCounters(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir() and state.is_world_process_zero and hasattr(trainer, "_tr_loss"):
                totals = {
                    "loss": trainer._total_loss_scalar,
                    "pending_loss": trainer._tr_loss.item(),
                    "last_logged": trainer._globalstep_last_logged,
                    "tokens": getattr(trainer, "_total_train_tokens", None),
                }
                (folder / COUNTERS).write_text(json.dumps(totals))

        def on_train_begin(self, args, state, control, **kwargs):
            saved = Path(args.output_dir) / f"checkpoint-{state.global_step}" / COUNTERS
            if state.global_step == 0 or not saved.is_file() or not hasattr(trainer, "_tr_loss"):
                return
            totals = json.loads(saved.read_text())  # resumed from that checkpoint
            trainer._total_loss_scalar = totals["loss"]
            trainer._tr_loss += totals["pending_loss"]
            trainer._globalstep_last_logged = totals["last_logged"]
            trainer._initial_global_step = 0  # the average loss is over every step, as an unbroken run's
            if totals["tokens"] is not None and hasattr(trainer, "_total_train_tokens"):
                trainer._total_train_tokens = totals["tokens"]

    return ResumeCounters()


def is_main_process(trainer) -> bool:
    """Rank 0 under accelerate (the only one that writes the artifact); always true in one process."""
    return trainer.args.process_index == 0


def save_on_main(trainer, tokenizer, out_dir: Path, keep_adapter: bool = False) -> None:
    """Rank 0 saves the model (`save_model`); every rank waits for it, so none exits before the artifact is whole. Under
    DeepSpeed or FSDP the weights are sharded: every rank takes part in gathering the full state dict first (ZeRO-3's
    16-bit gather)."""
    model, state_dict = trainer.model, None
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        state_dict = trainer.accelerator.get_state_dict(
            trainer.deepspeed if trainer.is_deepspeed_enabled else trainer.model_wrapped
        )
        # Merging (or saving the base) needs whole weights
        if hasattr(model, "peft_config") and is_main_process(trainer):
            model, state_dict = unsharded_copy(model, state_dict), None
    if is_main_process(trainer):
        save_model(model, tokenizer, out_dir, keep_adapter=keep_adapter, state_dict=state_dict)
    trainer.accelerator.wait_for_everyone()


def train_and_save(
    stage: str, trainer, tokenizer, cfg: TrainingConfig, work_dir: Path, out_dir: Path, generation_config=None
) -> dict[str, float]:
    """What every TRL stage ends with: train (`fit`), save the model (merged under LoRA unless `keep_adapter`, with
    `generation_config` put back if given) and return the last logged values."""
    fit(trainer, cfg, work_dir, out_dir)
    if generation_config is not None:
        trainer.model.generation_config = generation_config
    save_on_main(trainer, tokenizer, out_dir / "model", keep_adapter=cfg.lora.keep_adapter)
    return final_train_metrics(stage, trainer)


def final_train_metrics(stage: str, trainer) -> dict[str, float]:
    """The last logged training values (loss etc.) from the trainer's history."""
    merged: dict[str, float] = {}
    for entry in trainer.state.log_history:
        for k, v in entry.items():
            if isinstance(v, (int, float)) and k not in ("step", "epoch") and math.isfinite(v):
                merged[metric_name(stage, k)] = float(v)
    return merged


OUTCOME = "training.json"
"""Written beside the model by every training stage: steps trained of the planned, stopped early or not, the checkpoint
published."""


PEAK_GPU = "peak_gpu_bytes"
"""In `training.json` on a GPU: the most memory torch allocated in the writing process (rank 0 under a launch)."""


def write_outcome(
    out_dir: Path,
    global_step: int,
    max_steps: int,
    best_checkpoint: str | None = None,
    best_metric: float | None = None,
) -> dict:
    """`training.json`: how the training ended, for the manifest and the MLflow tags (`tasks.store.stage`)."""
    import torch

    outcome = {"global_step": global_step, "max_steps": max_steps, "stopped_early": global_step < max_steps}
    if best_checkpoint:
        outcome |= {"best_checkpoint": Path(best_checkpoint).name, "best_metric": best_metric}
    if torch.cuda.is_available():
        outcome[PEAK_GPU] = torch.cuda.max_memory_allocated()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / OUTCOME).write_text(json.dumps(outcome, indent=2) + "\n")
    return outcome


def add_outcome(out_dir: Path, values: dict) -> dict:
    """`training.json` with `values` added (e.g. which held-out probe's policy was published)."""
    path = out_dir / OUTCOME
    outcome = (json.loads(path.read_text()) if path.is_file() else {}) | values
    path.write_text(json.dumps(outcome, indent=2) + "\n")
    return outcome
