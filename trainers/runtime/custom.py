"""Your own training code, by import path: importing and checking it, the source digests that key it, and running it.

Every stage block may name code of the user's by `package.module:name`:

    optimizer_factory: my_lab.opt:sgd              fn(model, args) -> (optimizer, scheduler | None)
    callbacks: [{path: my_lab.cb:StopAt, kwargs: {step: 50}}]   transformers TrainerCallback classes
    compute_metrics: my_lab.metrics:accuracy       fn(eval_prediction) -> {name: value}   (sft, rm, dpo)

Each path is checked against the worker's list of importable modules (`trainers.runtime.trust`, RLHF_ALLOWED_IMPORTS),
then imported and its signature checked when the parameters are checked (a misspelt path fails in `rlhf params`, naming
it), and the source of its module is part of the key of the stage that uses it (`source_digests`): editing a callback
re-runs that stage and nothing else. The fields are declared in `trainers.config` (`Customisation`,
`EvalDuringTraining`); this module has no pydantic models.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from rlhf_pipeline.trainers.runtime.trust import check_import


def import_object(path: str, what: str) -> Any:
    """The object `package.module:name` names; a malformed path, a module that does not import or a missing name fails
    naming the path."""
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ValueError(f"{what} {path!r}: expected 'package.module:name'")
    check_import(path, what)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(
            f"{what} {path!r}: module {module_name!r} does not import ({type(exc).__name__}: {exc})"
        ) from exc
    found = module
    for part in name.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise ValueError(f"{what} {path!r}: {module_name} has no {name!r}")
    return found


def import_callable(
    path: str, what: str, positional: int = 0, keywords: tuple[str, ...] = (), more: bool = False
) -> Callable:
    """`import_object`, checked to be callable with `positional` positional arguments and the named `keywords`
    (`more`: and other keyword arguments besides, e.g. the dataset columns a reward function asks for)."""
    fn = import_object(path, what)
    if not callable(fn):
        raise ValueError(f"{what} {path!r}: {type(fn).__name__} is not callable")
    check_signature(fn, path, what, positional, keywords, more)
    return fn


def check_signature(
    fn: Callable, path: str, what: str, positional: int = 0, keywords: tuple[str, ...] = (), more: bool = False
) -> None:
    """Fails, showing `fn`'s signature, when it cannot be called as `fn(*positional, **keywords)`."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: it is called as it is
    try:
        (signature.bind_partial if more else signature.bind)(*range(positional), **dict.fromkeys(keywords))
    except TypeError as exc:
        wanted = ", ".join(
            [*(f"arg{i}" for i in range(positional)), *(f"{k}=..." for k in keywords), *(["..."] if more else [])]
        )
        name = getattr(fn, "__name__", type(fn).__name__)
        raise ValueError(
            f"{what} {path!r} has the signature {name}{signature}, which cannot be called as ({wanted}): {exc}"
        ) from exc


def source_digests(paths: Iterable[str], what: str = "import path") -> dict[str, str]:
    """`{"code:<path>": sha256 of its module's source}` for every path, found without importing the module."""
    found: dict[str, str] = {}
    for path in paths:
        module = path.partition(":")[0]
        check_import(path, what)  # finding a dotted module's spec imports its parent packages
        try:
            origin = getattr(importlib.util.find_spec(module), "origin", None)
        except (ImportError, ValueError) as exc:
            raise ValueError(f"{what} {path!r}: module {module!r} does not import ({exc})") from exc
        if origin is None:
            raise ValueError(f"{what} {path!r}: module {module!r} not found")
        found[f"code:{path}"] = (
            "sha256:" + hashlib.sha256(Path(origin).read_bytes()).hexdigest() if origin.endswith(".py") else origin
        )
    return found


def make_optimizer(path: str, model, args) -> tuple[Any, Any]:
    """Call the factory and check what it returns: an optimizer over the model's trainable parameters, and a scheduler
    or None."""
    import torch

    got = import_callable(path, "optimizer_factory", positional=2)(model, args)
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.optim.Optimizer)):
        raise ValueError(
            f"optimizer_factory {path!r} returned {type(got).__name__}; it must return (torch.optim.Optimizer, "
            "lr_scheduler or None)"
        )
    optimizer, scheduler = got
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if len(missing) == len(trainable):
        raise ValueError(
            f"optimizer_factory {path!r} returned an optimizer that holds none of the model's {len(trainable)} "
            "trainable parameters"
        )
    if scheduler is not None and not hasattr(scheduler, "step"):
        raise ValueError(f"optimizer_factory {path!r} returned a scheduler without step() ({type(scheduler).__name__})")
    return optimizer, scheduler


def install(trainer, cfg) -> None:
    """The factory's optimizer (and scheduler) on a TRL trainer, as its `optimizers=` would: built here, after the
    trainer has wrapped the model (peft adapters, device), so it holds the parameters that actually train; the trainer
    checkpoints and restores its state like its own."""
    if cfg.optimizer_factory:
        trainer.optimizer, trainer.lr_scheduler = make_optimizer(cfg.optimizer_factory, trainer.model, trainer.args)


class Hooks:
    """TrainerCallback hooks for a loop of our own (ppo): the same events, arguments and control as transformers'
    Trainer gives them, so one callback works in every stage. `control.should_training_stop` is the caller's to
    honour."""

    def __init__(self, callbacks: list, args, max_steps: int, global_step: int, **handles):
        self.callbacks, self.args, self.handles = callbacks, args, handles
        # Nothing to call: the loop reads only these (transformers' trainer_callback imports training_args)
        if not callbacks:
            self.state = SimpleNamespace(max_steps=max_steps, global_step=global_step)
            self.control = SimpleNamespace(should_training_stop=False, should_save=False)
            return
        from transformers import TrainerControl, TrainerState

        self.state = TrainerState(
            max_steps=max_steps, global_step=global_step, logging_steps=args.logging_steps, save_steps=args.save_steps
        )
        self.control = TrainerControl()

    def __call__(self, event: str, **kwargs):
        for callback in self.callbacks:
            result = getattr(callback, event)(self.args, self.state, self.control, **self.handles, **kwargs)
            if result is not None:
                self.control = result
        return self.control
