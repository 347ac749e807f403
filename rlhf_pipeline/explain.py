"""The run's parameters as a person asks about them: one readable line per mistake (with a "did you mean" for an
unknown key and the way to a TRL argument), the files a run would read looked for before anything starts, and one
field's help, type and default (`rlhf params --explain KEY`)."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from rlhf_pipeline.tasks.store.secrets import redact_text

IN_STEPS = {"num_train_epochs": "max_steps", "epochs": "max_steps", "max_epochs": "max_steps"}
"""TRL's (and other tools') names of a training length the pipeline counts in optimizer steps."""
RENAMED = {"lr": "learning_rate", "batch_size": "per_device_train_batch_size", "seed": "model.seed"}
"""Short names people bring from other tools, and the field that holds the same thing here."""


def blocks(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation holds: itself, the arms of an optional or a union, the items of a list or dict."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in blocks(arg)]


def model_at(model: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    """The block a dotted path leads to (list positions skipped), or None where it leads to no block."""
    for part in path:
        field = model.model_fields.get(part)
        found = blocks(field.annotation) if field else []
        if not found:
            return None
        model = found[0]
    return model


def problems(exc: ValidationError, model: type[BaseModel]) -> list[str]:
    """One line per error of `exc` (a validation of `model`): the dotted key, what is wrong, and what to do."""
    lines = []
    for error in exc.errors(include_url=False):
        path = [str(part) for part in error["loc"] if not isinstance(part, int)]
        key = ".".join(str(part) for part in error["loc"]) or "parameters"
        if error["type"] == "extra_forbidden":
            lines.append(f"{key}: {unknown_key(model, path)}")
            continue
        message = error["msg"].removeprefix("Value error, ")
        shown = "" if error["type"].startswith("value_error") else f" (got {short(error.get('input'))})"
        lines.append(f"{key}: {message[:1].lower()}{message[1:]}{shown}")
    return [redact_text(line) for line in lines]


def unknown_key(model: type[BaseModel], path: list[str]) -> str:
    """Why `path` is no field, and the field or the TRL argument meant."""
    *parents, name = path
    block = model_at(model, parents)
    where = ".".join(parents) or "the parameters"
    if block is None:
        return f"{where} has no fields"
    prefix = f"{'.'.join(parents)}." if parents else ""
    if name in IN_STEPS and IN_STEPS[name] in block.model_fields:
        return (
            f"not a field of {where}: the pipeline counts training in optimizer steps, `{prefix}{IN_STEPS[name]}` "
            f"(TRL's {name} is ignored once max_steps is set)"
        )
    if name in RENAMED and (RENAMED[name] in block.model_fields or "." in RENAMED[name]):
        meant = RENAMED[name] if "." in RENAMED[name] else f"{prefix}{RENAMED[name]}"
        return f"not a field of {where}: the same thing here is `{meant}`"
    trl = getattr(block, "trl_config", "")
    if trl and "trl_overrides" in block.model_fields:
        from rlhf_pipeline.trainers.algorithms.fields import ALIASES, MANAGED_ARGUMENTS, trl_config_fields

        if name in ALIASES:
            return f"not a field of {where}: TRL's {name} is this block's `{prefix}{ALIASES[name]}`"
        if name in MANAGED_ARGUMENTS:
            return f"not a field of {where}: TRL's {name} is set by the pipeline (checkpoints, device, tracking)"
        if name in trl_config_fields(trl):
            return (
                f"not a field of {where}, but an argument of trl.{trl}: give it through the block's trl_overrides, "
                f"--set {prefix}trl_overrides.{name}=VALUE"
            )
    close = difflib.get_close_matches(name, list(block.model_fields), n=1, cutoff=0.7)
    hint = f" (did you mean `{prefix}{close[0]}`?)" if close else ""
    listed = f"`rlhf params --explain {prefix.rstrip('.')}` lists its fields" if parents else "`rlhf params` lists them"
    return f"unknown field of {where}{hint}; {listed}"


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def missing_files(params) -> list[str]:
    """The local datasets the run would read and cannot find (a path that names no file, a pattern that matches none),
    one line each; a hub id is left to the data stage."""
    from rlhf_pipeline.trainers.data import local_files

    found = []
    for name, (_, spec) in params.data.sources().items():
        try:
            local_files(spec)
        except ValueError as exc:
            found.append(f"data.{name}.path: {exc}")
    return found


def explain(key: str, model: type[BaseModel], values: BaseModel) -> str:
    """A field's help: its description, type, default and value in `values` (the resolved parameters); for a block,
    its fields. ValueError names the nearest key for one that does not exist."""
    path = [part for part in key.split(".") if part]
    *parents, name = path or [""]
    block = model_at(model, parents)
    if block is None or name not in block.model_fields:
        if block is None:
            raise ValueError(f"{key}: no such field ({'.'.join(parents)} has no fields)")
        raise ValueError(f"{key}: {unknown_key(model, path)}")
    field = block.model_fields[name]
    value: Any = values
    for part in path:
        value = getattr(value, part, None) if not isinstance(value, dict) else value.get(part)
    lines = [f"{key}: {field.description or '(no description)'}", f"  type:    {type_name(field.annotation)}"]
    default = field.get_default(call_default_factory=True)
    if not isinstance(default, BaseModel):
        lines.append(f"  default: {short(default)}")
        lines.append(f"  value:   {short(value)} (the preset and --set given)")
    inner = blocks(field.annotation)
    if inner:
        lines.append(f"  fields:  {', '.join(inner[0].model_fields)}")
    return "\n".join(redact_text(line) for line in lines)


def type_name(annotation: Any) -> str:
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(repr(arg) for arg in typing.get_args(annotation))
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " | ".join(type_name(arg) for arg in typing.get_args(annotation))
    return str(annotation).replace("typing.", "")
