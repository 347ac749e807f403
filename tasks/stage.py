"""The stage contract: content-addressed key, atomic publish, manifest-backed cache, MLflow child run.

    <artifact_root>/<stage>/<key>/manifest.json   written last: its presence means "done"
    <artifact_root>/<stage>/<key>/...             the stage's files (model/, report/, ...)
    <artifact_root>/<stage>/.work/<key>/          checkpoints while training (resume source)

The artifact store, not Prefect's result cache, decides whether a stage runs:
Prefect cannot tell that a cached result points at a deleted directory
(DESIGN.md), so a stage whose manifest is present is reported as a `Cached`
task state and one whose directory was deleted runs again.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from rlhf_pipeline.tasks import tracking
from rlhf_pipeline.tasks.launcher import LaunchConfig
from rlhf_pipeline.tasks.secrets import redact
from rlhf_pipeline.trainers.config import LogMetrics
from rlhf_pipeline.trainers.loop import OUTCOME, PEAK_GPU, last_checkpoint
from rlhf_pipeline.trainers.models import tokenizer_digest

MANIFEST = "manifest.json"
HISTORY = "history.jsonl"
"""Every metric the stage logged while it built, one `{"step", "metrics"}` line per call: the artifact
carries its own curves, so plots and a new tracking store never need the run that produced it."""
PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "great-expectations", "prefect", "mlflow")
PACKAGE = "rlhf_pipeline"


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
    """Per flow run: where artifacts go, which MLflow run is the parent, whether to ignore the cache, how stages are launched."""

    model_config = ConfigDict(frozen=True)
    artifact_root: str
    experiment_id: str
    parent_run_id: str
    force: bool = False
    launch: LaunchConfig = LaunchConfig()


@dataclass(frozen=True)
class StageOutcome:
    ref: ArtifactRef
    cached: bool
    metrics: dict[str, float]
    mlflow_run_id: str = ""


Build = Callable[[Path, Path, LogMetrics], dict[str, float]]
"""build(out_dir, work_dir, log_metrics) -> final metrics; writes the stage's files into out_dir."""


def code_version(trainer: str | None) -> str:
    """sha256 of the source of `trainer` and of every project module it imports, directly or not
    (imports inside functions count; those under `if TYPE_CHECKING:` do not). Derived, never listed
    by hand: editing `trainers/eval.py` re-keys eval alone, the tiny tokenizer re-keys data and sft."""
    digest = hashlib.sha256()
    for name, file in sorted(project_imports(trainer).items()) if trainer else ():
        digest.update(name.encode() + b"\0" + source(file))
    return digest.hexdigest()[:16]


def source(file: Path) -> bytes:
    return file.read_bytes()


def project_imports(module: str) -> dict[str, Path]:
    """`module` and the project modules it imports, transitively: name -> source file."""
    found: dict[str, Path] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            raise ValueError(f"code version: {name!r} is not a project module with Python source")
        found[name] = Path(spec.origin)
        pending += [imported for imported in _imported_modules(found[name], name) if imported not in found]
    return found


def _imported_modules(file: Path, module: str) -> list[str]:
    names: list[str] = []
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    for node in _runtime_nodes(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *([base] if base else [])])
            candidates = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for candidate in candidates:
            if candidate == PACKAGE or candidate.startswith(PACKAGE + "."):
                parts = candidate.split(".")
                # `import a.b.c` imports a and a.b too; `from a.b import name` names a module or an attribute
                names += [".".join(parts[:i]) for i in range(1, len(parts) + 1) if _is_module(".".join(parts[:i]))]
    return names


def _runtime_nodes(tree: ast.AST):
    """Every node, less the bodies of `if TYPE_CHECKING:` (imports for annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def stage_key(stage: str, config: BaseModel | dict, upstream: dict[str, ArtifactRef], fingerprints: dict[str, str], code: str = "") -> str:
    """sha256 of the canonical JSON of everything that determines the stage's output."""
    payload = {
        "stage": stage,
        "config": config.model_dump(mode="json") if isinstance(config, BaseModel) else config,
        # Upstream outputs by content: identical bytes from another config (or a stricter
        # data check) are the same input. A ref without a digest counts by its key.
        "upstream": {name: ref.digest or ref.key for name, ref in sorted(upstream.items())},
        "fingerprints": dict(sorted(fingerprints.items())),
        "code": code,
    }
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def content_digest(directory: Path, only: tuple[str, ...] = ()) -> str:
    """sha256 over every file's relative path and bytes (the manifest excluded), or over the files under `only`."""
    digest = hashlib.sha256()
    roots = [directory / part for part in only] or [directory]
    files = {p for root in roots for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file() and p.name not in (MANIFEST, HISTORY)}
    for file in sorted(files):
        digest.update(file.relative_to(directory).as_posix().encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:32]


def _versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def run_stage(
    stage: str,
    config: BaseModel | dict,
    upstream: dict[str, ArtifactRef],
    ctx: RunContext,
    build: Build,
    fingerprints: dict[str, str] | None = None,
    log_files: tuple[str, ...] = (),
    log: Callable[[str], None] = print,
    digest_of: tuple[str, ...] = (),
    parts: dict[str, str] | None = None,
    trainer: str | None = None,
    device: bool = False,
    extra_tags: dict[str, str] | None = None,
) -> StageOutcome:
    """Publish `<root>/<stage>/<key>/` by running `build`, or reuse it when its manifest exists.

    `log_files` are paths inside the stage directory logged to the stage's MLflow
    run (reports, tables); model weights are logged once, by the pipeline.
    `digest_of` names the paths dependents key on (default: every file), so a
    re-run that changes only a report (timestamps, a new rule) re-trains nothing.
    `parts` names paths whose digests are kept one by one (`ArtifactRef.select`).
    `trainer` is the module whose source (and imports) is the stage's code version;
    `device`: the build holds a device slot; `extra_tags` go on its MLflow run (e.g. `rlhf.round` of a feedback round).
    """
    fingerprints = fingerprints or {}
    check_tokenizers(stage, upstream)
    # Secrets are masked before anything is keyed, logged or written: a rotated token re-trains nothing.
    config_json = redact(config.model_dump(mode="json") if isinstance(config, BaseModel) else config)
    code = code_version(trainer)
    key = stage_key(stage, config_json, upstream, fingerprints, code)
    stage_root = Path(ctx.artifact_root) / stage
    final = stage_root / key
    ref = ArtifactRef(stage=stage, key=key, uri=str(final))
    tags = {"rlhf.stage": stage, "rlhf.key": key, "rlhf.artifact": str(final), **(extra_tags or {})}

    stage_root.mkdir(parents=True, exist_ok=True)
    # One builder per key: a second run with the same inputs waits here, then finds the manifest.
    with _key_lock(stage_root, key, stage, log):
        if (final / MANIFEST).is_file() and not ctx.force:
            manifest = ref.manifest()
            ref = ref.model_copy(update={"digest": manifest["digest"], "parts": manifest.get("parts", {})})
            producer = manifest["mlflow_run_id"]
            # The artifact store and the tracking store are independent: the producing run may live in
            # another MLflow store (MLFLOW_TRACKING_URI changed). Everything logged here comes from the artifact.
            found = tracking.run_exists(producer)
            cached_tags = {"rlhf.cached": "true", "rlhf.produced_by": producer}
            if not found:
                cached_tags["rlhf.produced_by_missing"] = f"run {producer} is not in {tracking.tracking_uri()}"
            run_id = tracking.start_run(ctx.experiment_id, stage, {**tags, **cached_tags}, ctx.parent_run_id)
            tracking.log_params(run_id, config_json)
            curves = read_history(final)
            for step, values in curves:  # the curves, so cached runs line up in MLflow's compare view
                tracking.log_metrics(run_id, values, step)
            tracking.log_metrics(run_id, manifest["metrics"], max((step for step, _ in curves), default=0))
            tracking.end_run(run_id)
            where = f"MLflow run {producer}" if found else f"MLflow run {producer}, not in this tracking store"
            log(f"{stage}: cached ({final}, produced by {where})")
            return StageOutcome(ref, cached=True, metrics=manifest["metrics"], mlflow_run_id=run_id)

        work_dir = stage_root / ".work" / key
        for leftover in stage_root.glob(f".tmp-{key}-*"):  # half-built by a process that died
            shutil.rmtree(leftover, ignore_errors=True)
        # Runs of this key still RUNNING belonged to a process that died (we hold the key's lock).
        for stale in tracking.end_stale_runs(ctx.experiment_id, key):
            log(f"{stage}: marked MLflow run {stale} KILLED (its process died before finishing)")
        resume = last_checkpoint(work_dir)
        if resume:
            tags["rlhf.resumed_from"] = Path(resume).name
            log(f"{stage}: resuming from {resume}")
        run_id = tracking.start_run(ctx.experiment_id, stage, {**tags, "rlhf.cached": "false"}, ctx.parent_run_id)
        tracking.log_params(run_id, config_json)  # the resolved config first, before anything can fail
        log(f"{stage}: MLflow {tracking.run_link(run_id)}")
        tmp = stage_root / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        started = time.time()
        last_step = [0]

        work_dir.mkdir(parents=True, exist_ok=True)
        history = work_dir / HISTORY  # kept beside the checkpoints, so a resumed build keeps its early curve

        def log_metrics(values: dict[str, float], step: int) -> None:
            last_step[0] = max(last_step[0], step)
            with open(history, "a") as f:
                f.write(json.dumps({"step": step, "metrics": values}) + "\n")
            tracking.log_metrics(run_id, values, step)

        children_before = _child_pids()
        from rlhf_pipeline.tasks.orchestration import device_slot  # the Prefect side; imported here, it imports this module

        try:
            with device_slot(stage, log) if device else contextlib.nullcontext(), PeakMemory() as memory:
                metrics = build(tmp, work_dir, log_metrics)
            if history.is_file():
                shutil.copy(history, tmp / HISTORY)
            seconds = time.time() - started
            training = json.loads((tmp / OUTCOME).read_text()) if (tmp / OUTCOME).is_file() else None
            resources = memory.figures(training)
            metrics = {**metrics, f"{stage}/time/seconds": round(seconds, 3), **{f"{stage}/memory/{name}": value for name, value in resources.items()}}
            if training:
                training = {name: value for name, value in training.items() if name != PEAK_GPU}
            if ended := outcome_tags(stage, training, log):
                tracking.set_tags(run_id, ended)
            manifest = {
                "stage": stage,
                "key": key,
                "config": config_json,
                "upstream": {name: {"stage": r.stage, "key": r.key, "digest": r.digest} for name, r in upstream.items()},
                "digest": content_digest(tmp, digest_of),
                "parts": {name: content_digest(tmp, (path,)) for name, path in (parts or {}).items() if (tmp / path).exists()},
                "fingerprints": fingerprints,
                "code_version": code,
                "tokenizer": tokenizer_digest(tmp / "model"),
                "training": training,
                "versions": _versions(),
                "metrics": metrics,
                "mlflow_run_id": run_id,
                "timings": {"started": started, "finished": time.time(), "seconds": seconds},
                "resources": {"seconds": round(seconds, 3), **resources},
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
            for name in (MANIFEST, *log_files):
                _log_file(run_id, tmp, name)
            tracking.log_metrics(run_id, metrics, last_step[0])  # the final values sit at the end of the curves
            _publish(tmp, final)
        except BaseException as exc:
            # A timed-out or failed build leaves no workers behind (data loaders, generation servers).
            for pid in _child_pids() - children_before:
                _kill(pid, log)
            for name in log_files:  # a failed validation still leaves its report in MLflow
                _log_file(run_id, tmp if (tmp / name).exists() else work_dir, name)
            tracking.set_tags(run_id, {"rlhf.error": f"{type(exc).__name__}: {exc}"})
            tracking.end_run(run_id, failed=True)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        tracking.end_run(run_id)
        ref = ref.model_copy(update={"digest": manifest["digest"], "parts": manifest["parts"]})
        shutil.rmtree(work_dir, ignore_errors=True)  # checkpoints are only a resume source
        log(f"{stage}: done in {seconds:.1f}s -> {final}")
        return StageOutcome(ref, cached=False, metrics=metrics, mlflow_run_id=run_id)


def outcome_tags(stage: str, training: dict | None, log: Callable[[str], None]) -> dict[str, str]:
    """MLflow tags (and a log line) for how a training stage ended: stopped early by a callback, the best checkpoint published."""
    tags: dict[str, str] = {}
    if training and training.get("stopped_early"):
        tags["rlhf.stopped_early"] = f"step {training['global_step']} of {training['max_steps']}"
        log(f"{stage}: stopped early by a callback at step {training['global_step']} of {training['max_steps']}; publishing what it has")
    if training and training.get("best_checkpoint"):
        tags["rlhf.best_checkpoint"] = f"{training['best_checkpoint']} ({training['best_metric']:.6g})"
        log(f"{stage}: publishing the best checkpoint, {training['best_checkpoint']} (metric {training['best_metric']:.6g}), not the last")
    return tags


NOT_TOKENIZER_BOUND = ("data", "champion")
"""Upstreams whose models are compared by their text only (the champion may come from another base model)."""


def check_tokenizers(stage: str, upstream: dict[str, ArtifactRef]) -> dict[str, str]:
    """The tokenizer digest of every upstream model; they must be equal: a reward model reads the policy's token
    ids and KL compares two models' log-probabilities of the same ids. Raised before any weights load."""
    digests = {name: tokenizer_digest(ref.path / "model") for name, ref in upstream.items() if name not in NOT_TOKENIZER_BOUND}
    digests = {name: digest for name, digest in digests.items() if digest}
    if len(set(digests.values())) > 1:
        listed = "; ".join(f"{name} ({upstream[name].path / 'model'}): {digest}" for name, digest in digests.items())
        raise ValueError(
            f"{stage}: its input models do not share a tokenizer, so one model's token ids would be read with another's vocabulary "
            f"(tokenizer file digests: {listed}); train them from the same sft model, or pass models built from one base"
        )
    return digests


def read_history(stage_dir: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, metrics) as the stage logged them while it built; [] for an artifact without curves."""
    path = stage_dir / HISTORY
    if not path.is_file():
        return []
    return [(row["step"], row["metrics"]) for row in map(json.loads, path.read_text().splitlines()) if row]


class PeakMemory:
    """The most resident memory the build held: this process and every process under it (a launch's ranks), sampled by a thread
    every `interval` seconds, and this process's own exact peak where Linux keeps it (VmHWM, reset at the start through
    /proc/self/clear_refs); what this process held when the build began; and the most GPU memory torch allocated (in this
    process, or rank 0's from its `training.json`). Sampling more often than every 0.5 s cost measurable CPU (bench.overhead)."""

    def __init__(self, interval: float = 0.5):
        import threading

        self.interval, self.peak, self.before = interval, 0, 0
        self._stop, self._thread = threading.Event(), threading.Thread(target=self._sample, name="rlhf-peak-memory", daemon=True)

    def __enter__(self) -> PeakMemory:
        import psutil

        self._process = psutil.Process()
        self.before = self.peak = self._process.memory_info().rss
        # Processes already running (a temporary Prefect server, a test's servers) are not the build's.
        self._others = {child.pid for child in self._process.children(recursive=True)}
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # resets VmHWM, the process's peak resident set, to what it holds now
            self._hwm = True
        except OSError:
            self._hwm = False
        self._torch = _cuda_torch()
        if self._torch is not None:
            self._torch.cuda.reset_peak_memory_stats()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._measure()
        if self._hwm:
            with open("/proc/self/status") as status:
                kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
            self.peak = max(self.peak, kib * 1024)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._measure()

    def _measure(self) -> None:
        import psutil

        total = 0
        for process in [self._process, *(child for child in self._process.children(recursive=True) if child.pid not in self._others)]:
            with contextlib.suppress(psutil.Error):
                total += process.memory_info().rss
        self.peak = max(self.peak, total)

    def figures(self, training: dict | None) -> dict[str, float]:
        """MiB, for the manifest's `resources` and the `<stage>/memory/*` metrics."""
        mib = 2**20
        figures = {"peak_rss_mb": round(self.peak / mib, 1), "rss_before_mb": round(self.before / mib, 1)}
        gpu = (training or {}).get(PEAK_GPU)
        if gpu is None and self._torch is not None:
            gpu = self._torch.cuda.max_memory_allocated()
        if gpu is not None:
            figures["peak_gpu_mb"] = round(gpu / mib, 1)
        return figures


def _cuda_torch():
    """torch, when a trainer already imported it and a GPU is there (the Prefect side never imports torch itself)."""
    import sys

    torch = sys.modules.get("torch")
    return torch if torch is not None and torch.cuda.is_available() else None


def _child_pids() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def _kill(pid: int, log: Callable[[str], None]) -> None:
    import psutil

    try:
        process = psutil.Process(pid)
        name = process.name()
        process.kill()
        process.wait(10)
        log(f"killed child process {pid} ({name}) left by the failed stage")
    except psutil.Error:
        pass  # already gone


@contextmanager
def _key_lock(stage_root: Path, key: str, stage: str, log: Callable[[str], None]) -> Iterator[None]:
    """An OS file lock per stage key (released by the OS if the holder dies, even by SIGKILL)."""
    from filelock import FileLock, Timeout

    locks = stage_root / ".locks"
    locks.mkdir(exist_ok=True)
    lock = FileLock(locks / f"{key}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"{stage}: another run is building {key}; waiting for it")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _log_file(run_id: str, stage_dir: Path, name: str) -> None:
    """Log `stage_dir/name` (file or folder) at the same relative place in the MLflow run; nothing if the stage wrote none."""
    path = stage_dir / name
    if not path.exists():
        return
    target = name if path.is_dir() else (str(Path(name).parent) if "/" in name else None)
    tracking.log_artifacts(run_id, path, target)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished directory into place; never leave a half-written one at `final`."""
    if final.exists():
        # A forced re-run, or leftovers without a manifest: move the old one aside first.
        trash = final.with_name(f".trash-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
        return
    os.rename(tmp, final)
