"""What stages hand each other and what a published artifact holds (docs/ARCHITECTURE.md, "Artifacts and the cache
key").

<artifact_root>/<stage>/<key>/manifest.json   written last: its presence means "done"
<artifact_root>/<stage>/<key>/history.jsonl   the curves the stage logged while it built
<artifact_root>/<stage>/<key>/...             the stage's files (model/, report/, ...)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict

from rlhf_pipeline.tasks.config import LaunchConfig
from rlhf_pipeline.trainers.config import LogMetrics

MANIFEST = "manifest.json"


HISTORY = "history.jsonl"
"""Every metric the stage logged while it built, one `{"step", "metrics"}` line per call: the artifact
carries its own curves, so plots and a new tracking store never need the run that produced it."""


class ArtifactRef(BaseModel):
    """What stages hand each other: where a published stage output lives."""

    model_config = ConfigDict(frozen=True)
    stage: str
    key: str
    uri: str
    digest: str = ""
    """sha256 of the published files: a re-produced upstream whose bytes differ re-keys its dependents."""
    parts: dict[str, str] = {}
    """Digest per named part (the data stage: one per dataset), so a dependent can key on the parts it reads."""

    @property
    def path(self) -> Path:
        return Path(self.uri)

    def manifest(self) -> dict[str, Any]:
        return json.loads((self.path / MANIFEST).read_text())

    def select(self, names: tuple[str, ...]) -> ArtifactRef:
        """This artifact as a dependent that reads only `names` sees it: its digest covers those parts alone
        (a new preference file re-keys the stages that read preferences, not sft)."""
        chosen = {name: self.parts[name] for name in names if name in self.parts}
        digest = hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:32]
        return self.model_copy(update={"digest": digest, "parts": chosen})


class RunContext(BaseModel):
    """Per flow run: where artifacts go, which MLflow run is the parent, whether to ignore the cache, how stages are
    launched."""

    model_config = ConfigDict(frozen=True)
    artifact_root: str
    experiment_id: str
    parent_run_id: str
    force: bool = False
    launch: LaunchConfig = LaunchConfig()
    wait_seconds: float | None = None
    """The longest wait for another run's build of the same key, or for a device slot (the run's
    `retry.timeout_seconds`); None: as long as it takes."""
    stall_seconds: float | None = None
    """How long a build may go without progress before it fails as stalled (the run's `retry.stall_seconds`,
    `trainers.runtime.heartbeat`); None: never."""


@dataclass(frozen=True)
class StageOutcome:
    ref: ArtifactRef
    state: Literal["built", "cached", "skipped", "awaiting"]
    """How the stage ended: built now, reused from the cache, switched off (its artifact holds its input unchanged:
    sft's, the base model), or awaiting people's labels (`pairs` with labeller=people: `ref` is the samples artifact,
    `labels_store` where the labels go)."""
    metrics: dict[str, float]
    mlflow_run_id: str = ""
    labels_store: str = ""

    @property
    def cached(self) -> bool:
        return self.state == "cached"


Build = Callable[[Path, Path, LogMetrics], dict[str, float]]
"""build(out_dir, work_dir, log_metrics) -> final metrics; writes the stage's files into out_dir."""


def read_history(stage_dir: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, metrics) as the stage logged them while it built; [] for an artifact without curves."""
    path = stage_dir / HISTORY
    if not path.is_file():
        return []
    return [(row["step"], row["metrics"]) for row in map(json.loads, path.read_text().splitlines()) if row]


def content_digest(directory: Path, only: tuple[str, ...] = ()) -> str:
    """sha256 over every file's relative path and bytes (the manifest excluded), or over the files under `only`."""
    digest = hashlib.sha256()
    roots = [directory / part for part in only] or [directory]
    files = {
        p
        for root in roots
        for p in ([root] if root.is_file() else root.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST, HISTORY)
    }
    for file in sorted(files):
        digest.update(file.relative_to(directory).as_posix().encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:32]


FILES = "files"
"""The manifest's listing of every file it vouches for: `{relative path: {"size": bytes, "sha256": hex}}`."""


def sha256_of(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_listing(directory: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under `directory` but the manifest: what a reuse checks the folder against."""
    return {
        file.relative_to(directory).as_posix(): {"size": file.stat().st_size, "sha256": sha256_of(file)}
        for file in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    }


def damage(directory: Path) -> str | None:
    """Why the published folder cannot be reused, or None: an unreadable manifest, or a listed file missing, of
    another size, or with other bytes. A manifest from before the listing vouches for nothing more than itself."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(manifest, dict) or "digest" not in manifest or "mlflow_run_id" not in manifest:
        return f"{MANIFEST} lacks its digest or run"
    listing = manifest.get(FILES) or {}
    for name, expected in listing.items():
        file = directory / name
        if not file.is_file():
            return f"{name} is missing"
        if (size := file.stat().st_size) != expected["size"]:
            return f"{name} has {size} bytes, the manifest lists {expected['size']}"
    for name, expected in listing.items():  # sizes first: a truncation is found without reading a byte
        if sha256_of(directory / name) != expected["sha256"]:
            return f"{name}'s bytes differ from the manifest's sha256"
    return None
