"""Training code of a user's own, named by import path in the tests (`tests.user_code:<name>`), as a user names
theirs."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from transformers import TrainerCallback


def sgd(model, args):
    """An optimizer_factory: SGD with momentum over the trainable parameters; the stage's own schedule drives it."""
    import torch

    return torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=args.learning_rate, momentum=0.9
    ), None


def sgd_with_step_decay(model, args):
    """An optimizer_factory with its own scheduler: halve the rate every step."""
    import torch

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def frozen_only(model, args):
    """A broken factory: an optimizer over no trainable parameter."""
    import torch

    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate), None


HOOKS = ("on_train_begin", "on_step_end", "on_log", "on_save", "on_train_end")


class CountHooks(TrainerCallback):
    """Counts the hooks it sees and writes them to `out` (JSON) when training ends."""

    def __init__(self, out: str):
        self.out, self.counts = out, dict.fromkeys(HOOKS, 0)

    def on_train_begin(self, args, state, control, **kwargs):
        self.counts["on_train_begin"] += 1

    def on_step_end(self, args, state, control, **kwargs):
        self.counts["on_step_end"] += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.counts["on_log"] += 1

    def on_save(self, args, state, control, **kwargs):
        self.counts["on_save"] += 1

    def on_train_end(self, args, state, control, **kwargs):
        self.counts["on_train_end"] += 1
        Path(self.out).write_text(json.dumps(self.counts))


class StopAtStep(TrainerCallback):
    """Ends training once `step` steps are done (an early-stopping rule)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


class KillAtStep(TrainerCallback):
    """SIGKILLs its own process at `step`: the machine died mid-stage. `rank`: only that rank under accelerate;
    `once`: a marker file, so that the retry of the same config runs through."""

    def __init__(self, step: int, rank: int | None = None, once: str | None = None):
        self.step, self.rank, self.once = step, rank, once

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step < self.step or (self.rank is not None and int(os.environ.get("RANK", "0")) != self.rank):
            return
        if self.once is not None:
            if Path(self.once).exists():
                return
            Path(self.once).write_text(f"{os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGKILL)


def token_accuracy(eval_prediction) -> dict[str, float]:
    """compute_metrics: share of labelled tokens the model predicts greedily."""
    logits, labels = eval_prediction.predictions, eval_prediction.label_ids
    predicted, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    mask = target != -100
    return {"token_accuracy": float((predicted[mask] == target[mask]).mean()) if mask.any() else float("nan")}


class RecordBatches(TrainerCallback):
    """Writes to `out` the shape of every training batch the model was called with, and whether it came with an
    attention mask."""

    def __init__(self, out: str):
        self.out, self.batches = Path(out), []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def record(module, positional, keyword):
            if module.training:
                ids = keyword.get("input_ids")
                self.batches.append({"shape": list(ids.shape), "mask": keyword.get("attention_mask") is not None})

        self.hook = model.register_forward_pre_hook(record, with_kwargs=True)

    def on_train_end(self, args, state, control, **kwargs):
        self.hook.remove()
        self.out.write_text(json.dumps(self.batches))


class RecordCheckpointing(TrainerCallback):
    """Writes to `out` whether the model being trained recomputes its activations (gradient checkpointing), and how
    often each decoder layer's MLP ran its forward in the first step (2 when the backward pass recomputed it)."""

    def __init__(self, out: str):
        self.out, self.calls = Path(out), []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        layers = [layer.mlp for layer in model.model.layers]  # inside the checkpointed call: recomputed too
        self.calls = [0] * len(layers)

        def count(i):
            def hook(module, positional, keyword):
                if module.training:
                    self.calls[i] += 1

            return hook

        self.hooks = [layer.register_forward_pre_hook(count(i), with_kwargs=True) for i, layer in enumerate(layers)]
        self.on = bool(model.is_gradient_checkpointing)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            for hook in self.hooks:
                hook.remove()
            self.out.write_text(json.dumps({"on": self.on, "forwards_per_layer": self.calls}))


class RecordAttention(TrainerCallback):
    """Writes to `out` the attention implementation of the model being trained (its config's) and the one each
    attention layer dispatched on in the first step (transformers' layers look it up in `ALL_ATTENTION_FUNCTIONS`
    on every forward: the lookups are counted by name, the function returned is the library's own)."""

    def __init__(self, out: str):
        self.out, self.dispatched = Path(out), {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.config = model.config._attn_implementation
        self.interface, lookup = ALL_ATTENTION_FUNCTIONS, ALL_ATTENTION_FUNCTIONS.get_interface

        def counted(name, default):
            self.dispatched[name] = self.dispatched.get(name, 0) + 1
            return lookup(name, default)

        self.interface.get_interface = counted  # on this instance only; removed after the first step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            del self.interface.get_interface
            self.out.write_text(json.dumps({"config": self.config, "dispatched": self.dispatched}))


class RecordLabels(TrainerCallback):
    """Writes to `out` the input ids and labels of the first training batch the model was called with (what the loss
    trains: labels other than -100)."""

    def __init__(self, out: str):
        self.out, self.batch = Path(out), None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def record(module, positional, keyword):
            if module.training and self.batch is None:
                self.batch = {"input_ids": keyword["input_ids"].tolist(), "labels": keyword["labels"].tolist()}

        self.hook = model.register_forward_pre_hook(record, with_kwargs=True)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.hook.remove()
            self.out.write_text(json.dumps(self.batch))


class MlflowOutage(TrainerCallback):
    """Stops the tracking server (`tests.mlflow_server`, pid in `pid_file`) once step `stop_at` is done and starts it
    again, on the same store and port, once step `start_at` is: an outage in the middle of training."""

    def __init__(self, stop_at: int, start_at: int, store: str, port: int, pid_file: str):
        self.stop_at, self.start_at, self.store, self.port, self.pid_file = stop_at, start_at, store, port, pid_file

    def on_step_end(self, args, state, control, **kwargs):
        from tests import mlflow_server

        if state.global_step == self.stop_at:
            mlflow_server.stop(Path(self.pid_file))
        elif state.global_step == self.start_at:
            mlflow_server.start(self.store, self.port, Path(self.pid_file))


class TerminateAt(TrainerCallback):
    """Marks the process as terminating (as its SIGTERM handler does) once step `step` is done: a SIGTERM that
    arrives mid-training, without a signal to the test's own process."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        from rlhf_pipeline.trainers.runtime.stopping import TERMINATING

        if state.global_step >= self.step:
            TERMINATING.set()


class GcMidRun(TrainerCallback):
    """`rlhf gc`'s removal of a list made before the run started (`doomed`, set by the test), done as the dpo stage
    begins: after the run reused data, sft and rm, before eval reads them."""

    doomed: list = []

    def on_train_begin(self, args, state, control, **kwargs):
        from rlhf_pipeline.tasks.tracking import gc

        gc.remove(type(self).doomed)


def hang_forever(why: str) -> None:
    """Hangs as a stuck call does: no progress, ever (a loop of short sleeps, so that the thread can be stopped)."""
    import time

    while True:
        time.sleep(0.05)


class HangAtStep(TrainerCallback):
    """Hangs at `step` on `rank` (all ranks when None): a rank that never reaches the next collective, so the others
    wait in it for ever. `once`: a marker file, so that the retry of the same config runs through."""

    def __init__(self, step: int, rank: int | None = None, once: str | None = None):
        self.step, self.rank, self.once = step, rank, once

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step or (self.rank is not None and int(os.environ.get("RANK", "0")) != self.rank):
            return
        if self.once is not None:
            if Path(self.once).exists():
                return
            Path(self.once).write_text(f"{os.getpid()}\n")
        hang_forever("a rank that stopped")


def reward_that_hangs_once(prompts, completions, **kwargs) -> list[float]:
    """A reward function that hangs on the second training batch (8 answers or more) it scores in a process, once per
    `RLHF_TEST_HANG_ONCE` marker file: the stuck verifier a watchdog must catch."""
    if len(completions) >= 8:
        REWARD_CALLS.append(len(completions))
    marker = Path(os.environ["RLHF_TEST_HANG_ONCE"])
    if len(REWARD_CALLS) == 2 and not marker.exists():
        marker.write_text(f"{os.getpid()}\n")
        hang_forever("a stuck reward function")
    return [float(len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]


REWARD_CALLS: list[int] = []


class Notify(TrainerCallback):
    """A callback of the kind that reports to a service, with an API key and an endpoint: both kept out of every
    record (tests/scenarios/test_secrets.py)."""

    def __init__(self, api_key: str, endpoint: str = ""):
        self.api_key, self.endpoint = api_key, endpoint
