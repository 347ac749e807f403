"""How stages are run and retried: the `launch` and `retry` blocks of a run's parameters, and the names a run gives
MLflow (`check_name`). Config only (fields and their checks), so that every layer of tasks/ can read them; what runs
them is tasks/orchestration (`launcher`, `stage_task`).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Launcher = Literal["inprocess", "accelerate", "ray"]
PLACEMENT = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
ENGINES = ("ddp", "zero2", "zero3", "fsdp2")
ENGINE_DIR = Path(str(resources.files("rlhf_pipeline.deployments") / "accelerate"))


NAME_BYTES = 200
"""The longest experiment or registered model name: each becomes a folder name (%-quoted, with a suffix such as a
version's `v12` or a lock's `.promoting`), and a file system allows 255 bytes."""


def check_name(name: str, what: str) -> str:
    """`name` when MLflow and the state folder can hold it as an experiment's or a registered model's name."""
    from urllib.parse import quote

    if not name.strip():
        raise ValueError(f"{what} is empty")
    if any(char in name for char in "/:"):
        raise ValueError(f"{what}={name!r}: MLflow names may not hold '/' or ':'")
    if len(quote(name, safe=" -_").encode()) > NAME_BYTES:
        raise ValueError(f"{what} is {len(name)} characters: at most {NAME_BYTES} bytes once %-quoted, as folder names")
    return name


class LaunchConfig(BaseModel):
    """How the training stages are run. Not part of any stage's key: the same stage built in one process or eight is the
    same artifact."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    launcher: Literal["auto", "inprocess", "accelerate", "ray"] = Field(
        "auto",
        description=(
            "'auto': accelerate whenever a CUDA GPU is present, else in the flow run's process; or force one. 'ray': a "
            "Ray Train job on the cluster at ray_address / RAY_ADDRESS (else a local one), num_workers workers."
        ),
    )
    stages: dict[str, Launcher] = Field(default_factory=dict, description="Per-stage override, e.g. {ppo: inprocess}.")
    num_processes: int | None = Field(
        None, ge=1, description="Processes per machine under accelerate. None: one per GPU (1 on a CPU)."
    )
    engine: str = Field(
        "ddp",
        description=(
            "accelerate engine: ddp, zero2, zero3 (DeepSpeed ZeRO), fsdp2 (deployments/accelerate/<engine>.yaml), or "
            "the path of an accelerate config file. On a CPU: gloo DDP. One machine; several: launcher ray."
        ),
    )
    num_workers: int = Field(
        1, ge=1, description="Ray Train workers (launcher ray), one torch rank each, across the cluster's nodes."
    )
    resources_per_worker: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1},
        description="What each Ray worker holds, e.g. {CPU: 8, GPU: 1} (a GPU: NCCL; none: gloo).",
    )
    placement_strategy: PLACEMENT = Field(
        "PACK", description="How Ray places the workers: PACK fills a node first, STRICT_SPREAD one worker per node."
    )
    ray_address: str | None = Field(
        None,
        description=(
            "The Ray cluster (ray://host:10001 or host:6379). None: RAY_ADDRESS, else a local cluster started for "
            "the stage (127.0.0.1)."
        ),
    )
    kill_grace_seconds: float = Field(
        15, ge=0, description="After SIGTERM, how long the ranks get to exit before SIGKILL."
    )

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, engine: str) -> str:
        if engine not in ENGINES and not Path(engine).expanduser().is_file():
            raise ValueError(
                f"launch.engine={engine!r} is neither one of {', '.join(ENGINES)} nor an accelerate config file"
            )
        if engine.startswith("zero"):
            import importlib.util

            if importlib.util.find_spec("deepspeed") is None:
                raise ValueError(
                    f"launch.engine={engine!r} runs DeepSpeed ZeRO, which is not installed: pip install "
                    "'rlhf-pipeline[deepspeed]' (CUDA)"
                )
        return engine

    @model_validator(mode="after")
    def _ray_installed(self) -> "LaunchConfig":
        if "ray" in (self.launcher, *self.stages.values()):
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ValueError(
                    "launch.launcher='ray' runs a Ray Train job, and Ray is not installed: pip install "
                    "'rlhf-pipeline[ray]'"
                )
        return self

    def launcher_of(self, stage: str) -> Launcher:
        chosen = self.stages.get(stage, self.launcher)
        if chosen == "auto":
            import torch

            return "accelerate" if torch.cuda.is_available() else "inprocess"
        return chosen


DEFAULT_TIMEOUT = 24 * 3600.0
"""A stage's default time limit: a hung build (a dead NFS mount, a deadlocked collective) ends within a day."""


class RetryConfig(BaseModel):
    """How stages meet failure: transient errors (I/O, network, a lost device) retry with backoff;
    bad config or data (ValueError, TypeError, KeyError, ImportError) fail at once."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    retries: int = Field(
        2, ge=0, le=20, description="Retries of a stage after a transient error; 0 fails at the first."
    )
    delay_seconds: list[float] = Field(
        [10, 60], min_length=1, description="Wait before each retry, in seconds (the last repeats)."
    )
    jitter_factor: float = Field(
        0.2, ge=0, le=1, description="Random extra share of each delay, so retries of parallel runs spread out."
    )
    timeout_seconds: float | None = Field(
        DEFAULT_TIMEOUT,
        gt=0,
        description=(
            "A stage running longer fails (its child processes are killed) and is retried; also the longest wait for "
            "another run's build of the same stage. None: no limit."
        ),
    )

    stall_seconds: float | None = Field(
        600,
        gt=0,
        description=(
            "A stage whose work has not moved (no training step, no batch generated or scored) for this long, or for "
            "10x its longest step so far, fails with every thread's stack in the log, and the retry resumes from its "
            "last checkpoint: a stuck reward function, a dead collective. None: never."
        ),
    )

    def task_options(self) -> dict[str, Any]:
        return {
            "retries": self.retries,
            "retry_delay_seconds": list(self.delay_seconds),
            "retry_jitter_factor": self.jitter_factor or None,
            "timeout_seconds": self.timeout_seconds,
        }
