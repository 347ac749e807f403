"""A stage's trainer as a process of its own: the entry point every rank of `accelerate launch` runs.

    accelerate launch ... -m rlhf_pipeline.trainers.runtime.rank <work_dir>/launch.json

`launch.json` (written by `tasks.orchestration.launcher`) names the trainer module and its arguments: configs by class
and JSON, paths as strings. Every rank calls `train(**arguments)`. Rank 0's metrics are printed as `@@rlhf-metrics
{"step", "values"}` lines and its progress records as `@@rlhf-progress {...}` lines for the parent to forward, its final
metrics are written to `<work_dir>/result.json`, and an error that no retry can fix (bad config or data) to
`<work_dir>/launch-error.json`. No Prefect here: trainers never import it.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from rlhf_pipeline.trainers.runtime.failures import PERMANENT
from rlhf_pipeline.trainers.runtime.stopping import checkpoint_on_sigterm, training

METRICS_MARK = "@@rlhf-metrics "
PROGRESS_MARK = "@@rlhf-progress "
RESULT_FILE = "result.json"
ERROR_FILE = "launch-error.json"


SECRETS_ENV = "RLHF_LAUNCH_SECRETS"
"""The arguments whose values `launch.json` holds masked, unmasked, as JSON: in the ranks' environment, never in a
file."""


def write_spec(
    path: Path, trainer: str, arguments: dict[str, Any], mask: Callable[[Any], Any] = lambda value: value
) -> dict[str, Any]:
    """`launch.json`: the trainer module and its arguments (pydantic configs by class and value, paths as text), each
    value through `mask` (the launcher's masks secrets). Returns the arguments `mask` changed, unmasked, for the
    ranks' environment (`SECRETS_ENV`)."""
    from pydantic import BaseModel

    hidden: dict[str, Any] = {}

    def encode(name: str, value: Any) -> Any:
        if isinstance(value, BaseModel):
            cls = type(value)
            dump = value.model_dump(mode="json")
            if (masked := mask(dump)) != dump:
                hidden[name] = dump
            return {"config": f"{cls.__module__}:{cls.__qualname__}", "value": masked}
        if isinstance(value, Path):
            return {"path": str(value)}
        if (masked := mask(value)) != value:
            hidden[name] = value
        return {"value": masked}

    path.write_text(
        json.dumps(
            {"trainer": trainer, "arguments": {name: encode(name, value) for name, value in arguments.items()}},
            indent=2,
        )
    )
    return hidden


def read_spec(path: Path) -> tuple[str, dict[str, Any]]:
    spec = json.loads(path.read_text())
    hidden = json.loads(os.environ.get(SECRETS_ENV) or "{}")

    def decode(name: str, encoded: dict) -> Any:
        if "config" in encoded:
            module, _, cls = encoded["config"].partition(":")
            return getattr(importlib.import_module(module), cls).model_validate(hidden.get(name, encoded["value"]))
        if "path" in encoded:
            return Path(encoded["path"])
        return hidden.get(name, encoded["value"])

    return spec["trainer"], {name: decode(name, value) for name, value in spec["arguments"].items()}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main(argv: list[str]) -> int:
    die_with_parent()
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
    logging.getLogger("rlhf_pipeline").setLevel(logging.INFO)
    _forward_progress()
    spec = Path(argv[0])
    work_dir = spec.parent
    # A stalled launch asks every rank for its threads' stacks (SIGUSR1), which it reads from this file.
    faulthandler.register(signal.SIGUSR1, file=open(work_dir / f"stacks-rank{rank()}.txt", "w"), all_threads=True)

    def log_metrics(values: dict[str, float], step: int) -> None:
        if rank() == 0:
            print(METRICS_MARK + json.dumps({"step": step, "values": values}), flush=True)

    try:
        metrics = run_spec(spec, log_metrics)
    except PERMANENT as exc:
        (work_dir / ERROR_FILE).write_text(json.dumps(permanent_error(exc, rank())))
        raise
    if rank() == 0:
        (work_dir / RESULT_FILE).write_text(json.dumps(metrics))
    return 0


def run_spec(spec: Path, log_metrics: Callable[[dict[str, float], int], None]) -> dict[str, float]:
    """`train(**arguments)` of the trainer `launch.json` names, in this rank; its final metrics."""
    trainer, arguments = read_spec(spec)  # the configs are validated again here, in the rank's environment
    # A SIGTERM (the parent's, or the whole group's) checkpoints and stops the rank, which then ends by it.
    with checkpoint_on_sigterm(), training():
        return importlib.import_module(trainer).train(**arguments, log_metrics=log_metrics)


def permanent_error(exc: BaseException, rank: int | None) -> dict[str, Any]:
    """What `ERROR_FILE` holds for an error no retry can fix: the rank, the error's type (one of `PERMANENT`'s names;
    pydantic's ValidationError is a ValueError) and its message."""
    kind = next(cls.__name__ for cls in PERMANENT if isinstance(exc, cls))
    return {"rank": rank, "type": kind, "message": str(exc)}


class _ProgressLines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        progress = record.__dict__.get("progress")
        if progress is None:  # a plain line ("sft: world size 2 ..."): the parent logs it as it logs every other line
            print(record.getMessage(), flush=True)
            return
        print(PROGRESS_MARK + json.dumps({"message": record.getMessage(), "progress": progress}), flush=True)


def _forward_progress() -> None:
    """The progress records (`trainers.runtime.progress`, rank 0's) as lines the parent turns back into records."""
    from rlhf_pipeline.trainers.runtime.progress import PROGRESS, TICKS

    PROGRESS.propagate = False  # the parent logs the line once, from the record it rebuilds
    for logger in (PROGRESS, TICKS):
        logger.addHandler(_ProgressLines())


def die_with_parent() -> None:
    """This process ends (SIGTERM) when the one that started it dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG): no
    orphans. Called in every rank, and in the launcher before it execs."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except Exception:  # not Linux: the launcher's process group is still killed as a whole
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
