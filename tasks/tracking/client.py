"""The only module that talks to MLflow (versions.py, the registry's side, goes through its `client`).

Runs are addressed by id through `MlflowClient`, never through MLflow's
active-run stack: that stack is per thread, and Prefect runs tasks in worker
threads. One parent run per flow run; one child run per stage.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlhf_pipeline.tasks.store.secrets import URI_CREDENTIALS, mask_uri, redact, redact_text

STATE_ENV = "RLHF_STATE_DIR"
# MLflow prints "View run ... at <tracking URI>" on stdout when a run ends, the URI's password included: never here,
# nor in any process started from here (the variable is inherited).
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
PARAM_VALUE_LIMIT = 6000  # MLflow rejects longer param values
UI_ENV = "RLHF_MLFLOW_UI"


MODEL_LOGGED, MODEL_URI, POLICY_MODEL = "rlhf.model_logged", "rlhf.model_uri", "rlhf.policy_model_id"
"""Parent-run tags: where the policy's weights are (its stage's logged model; or, for a policy with none in this
store, an earlier run's copy, or this run's own under `model/`), and the policy's logged model id."""


def state_dir() -> Path:
    """Run state (MLflow database and artifacts, stage artifacts, checkpoints): `$RLHF_STATE_DIR`, else
    `./state` of the working directory, beside the user, never inside the installed package (a
    wheel's site-packages, or a checkout that several working copies share through one environment)."""
    return Path(os.environ.get(STATE_ENV) or Path.cwd() / "state").resolve()


def always_readable() -> tuple[Path, ...]:
    """What every run may read, whatever folders the worker allows: the run state and the pipeline's own files (bundled
    data, presets; `flows/ownership.py` adds the engine configs)."""
    from rlhf_pipeline.trainers.data import BUNDLED_ROOT

    return state_dir(), BUNDLED_ROOT, *(p.resolve() for p in (BUNDLED_ROOT / "data", BUNDLED_ROOT / "configs"))


def tracking_uri() -> str:
    # The file store refuses writes in MLflow 3.17 (docs/LIBRARY-FACTS.md, MLflow):
    # default to SQLite.
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{state_dir() / 'mlflow.db'}"


def check_reachable(timeout: float = 5.0) -> None:
    """Fail before anything is logged when the tracking server does not answer: no half-logged runs. Credentials go as
    MLflow sends them (the URI's user info, else MLFLOW_TRACKING_USERNAME/PASSWORD, else MLFLOW_TRACKING_TOKEN), never
    in the message."""
    uri = tracking_uri()
    if not uri.startswith("http"):
        return
    import base64
    import urllib.error
    import urllib.request
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(uri)
    plain = parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")).geturl()
    headers = {}
    user = unquote(parts.username or "") or os.environ.get("MLFLOW_TRACKING_USERNAME")
    password = unquote(parts.password or "") if parts.username else os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password or ''}".encode()).decode()
    elif token := os.environ.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = f"Bearer {token}"
    try:
        request = urllib.request.Request(f"{plain.rstrip('/')}/health", headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as response:
            if response.status == 200:
                return
            problem = f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        problem = f"HTTP {exc.code}"
    except OSError as exc:
        problem = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
    raise ConnectionError(
        redact_text(
            f"MLflow tracking server {uri} cannot be reached ({problem}); nothing was logged and no stage ran. "
            "Start it, or point MLFLOW_TRACKING_URI at one (unset: SQLite under the state folder)."
        )
    )


def shown_uri() -> str:
    """The tracking URI as logs, tags, summaries and banners show it: its user info masked."""
    return mask_uri(tracking_uri())


def client():
    from mlflow.tracking import MlflowClient

    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        create_database(uri)
    return MlflowClient(tracking_uri=uri)


@functools.cache
def create_database(uri: str) -> None:
    """Create a SQLite store's tables, one process at a time (a file lock beside the database). MLflow creates them in
    the first process that opens the store; two processes opening a new database at once both run its migrations and
    one fails ('duplicate column name', 'table ... already exists'): a served deployment's runs, their hooks and
    `rlhf eval` may start together. Once per process and URI; a database that has its tables costs a lookup."""
    from filelock import FileLock
    from mlflow.tracking import MlflowClient

    path = Path(uri.removeprefix("sqlite:///"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        mlflow = MlflowClient(tracking_uri=uri)
        mlflow.search_experiments(max_results=1)  # the tracking store's tables
        mlflow.search_registered_models(max_results=1)  # the model registry's


KIND_TAG, TRAINING = "mlflow.experimentKind", "custom_model_development"
"""MLflow 3's experiment kind: the UI opens a model-training experiment on its runs table and curves, not on GenAI
traces."""


def artifacts_root() -> Path:
    """Where a local store's experiments keep their artifacts: what `rlhf up`'s MLflow server serves
    (`--artifacts-destination`)."""
    return state_dir() / "mlartifacts"


def folder_name(name: str) -> str:
    """`name` as one folder name: separators and every other character a path gives meaning to are %-quoted, so no
    experiment name ('../../x', '/abs', '.') reaches outside `mlartifacts/`."""
    from urllib.parse import quote

    folder = quote(name, safe=" -_")
    return folder.replace(".", "%2E") if set(folder) == {"."} else folder


def experiment_id(name: str) -> str:
    """The experiment's id, created if missing, marked as model training (unless someone chose its kind by hand)."""
    mlflow = client()
    found = mlflow.get_experiment_by_name(name)
    if found is not None:
        # Made before the tag, or kind guessed by the UI
        if found.tags.get(KIND_TAG, "_inferred").endswith("_inferred"):
            mlflow.set_experiment_tag(found.experiment_id, KIND_TAG, TRAINING)
        return found.experiment_id
    location = None
    if tracking_uri().startswith("sqlite:"):  # keep artifacts beside the database, not in ./mlruns
        location = (artifacts_root() / folder_name(name)).as_uri()
    return mlflow.create_experiment(name, artifact_location=location, tags={KIND_TAG: TRAINING})


def start_run(experiment: str, run_name: str, tags: dict[str, str], parent_run_id: str | None = None) -> str:
    tags = {**context_tags(), **{key: redact_text(str(value)) for key, value in tags.items()}}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = client().create_run(experiment, run_name=run_name, tags=tags)
    return run.info.run_id


@functools.cache
def context_tags() -> dict[str, str]:
    """MLflow's context tags, as its fluent `start_run` sets them (`mlflow.user`, `mlflow.source.name`/`type`, the
    entry point's git commit), plus the commit of the checkout this package runs from when the entry point (the
    `rlhf` script) lies outside one. Resolved once per process."""
    import subprocess

    from mlflow.tracking.context.registry import resolve_tags

    tags = {key: str(value) for key, value in resolve_tags({}).items()}
    if "mlflow.source.git.commit" not in tags:
        here = Path(__file__).resolve().parent
        try:
            commit = subprocess.run(
                ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
        if len(commit) == 40:
            tags["mlflow.source.git.commit"] = commit
    return tags


SYSTEM_METRICS_SECONDS = 5.0
"""How often the machine's CPU, memory, disk, network (and GPU, with `nvidia-ml-py`) are sampled during a device
stage; MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL overrides it."""


@contextlib.contextmanager
def system_metrics(run_id: str) -> Iterator[None]:
    """MLflow's system metrics (`system/...` curves over time) logged to the run while the block runs. Monitoring
    never fails the stage: MLflow's monitor logs its own problems and stops."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, sampling_interval=SYSTEM_METRICS_SECONDS, tracking_uri=tracking_uri())
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()


def run_exists(run_id: str) -> bool:
    """Whether this tracking store holds the run (a cached artifact's producer may live in another one)."""
    from mlflow.exceptions import MlflowException

    try:
        client().get_run(run_id)
        return True
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise


def end_run(run_id: str, failed: bool = False) -> None:
    client().set_terminated(run_id, status="FAILED" if failed else "FINISHED")


def run_status(run_id: str) -> str:
    return client().get_run(run_id).info.status


def end_stale_runs(experiment: str, key: str) -> list[str]:
    """Mark the RUNNING runs of a stage key KILLED: their process died (the caller holds the key's lock)."""
    mlflow = client()
    stale = mlflow.search_runs([experiment], f"tags.`rlhf.key` = '{key}' and attributes.status = 'RUNNING'")
    for run in stale:
        mlflow.set_tag(run.info.run_id, "rlhf.error", "the process died before the stage finished")
        mlflow.set_terminated(run.info.run_id, status="KILLED")
    return [run.info.run_id for run in stale]


def set_tags(run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag

    client().log_batch(run_id, tags=[RunTag(k, redact_text(str(v))[:5000]) for k, v in tags.items()])


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"sft": {"learning_rate": 3e-3}} -> {"sft.learning_rate": "0.003"}."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            flat[name] = text[:PARAM_VALUE_LIMIT]
    return flat


def log_params(run_id: str, config: dict[str, Any], prefix: str = "") -> None:
    from mlflow.entities import Param

    params = [Param(k, v) for k, v in flatten(redact(config), prefix).items()]
    for start in range(0, len(params), 100):  # MLflow caps a batch at 100 params
        client().log_batch(run_id, params=params[start : start + 100])


def log_metrics(run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client().log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])


def log_metric_rows(run_id: str, rows: list[tuple[int, dict[str, float], int]]) -> None:
    """Rows of (timestamp ms, values, step) in one call, each value at the time it was made
    (`tasks.store.metric_queue`)."""
    from mlflow.entities import Metric

    metrics = [Metric(k, float(v), stamp, step) for stamp, values, step in rows for k, v in values.items()]
    for start in range(0, len(metrics), 1000):  # MLflow caps a batch at 1000 metrics
        client().log_batch(run_id, metrics=metrics[start : start + 1000])


def log_dataset_input(
    run_id: str, name: str, digest: str, source: str, context: str, tags: dict[str, str], profile: dict | None = None
) -> None:
    """A dataset as an input of the run (MLflow's Datasets column): name, digest, where it lies, what it was used for
    (`mlflow.data.context`) and tags such as the labeller."""
    log_datasets(
        run_id,
        [{"name": name, "digest": digest, "source": source, "context": context, "tags": tags, "profile": profile}],
    )


def log_datasets(run_id: str, datasets: list[dict]) -> None:
    """Datasets as inputs of the run, in one call: each a dict of `log_dataset_input`'s arguments."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    inputs = [
        DatasetInput(
            Dataset(
                name=d["name"],
                digest=d["digest"],
                source_type="local",
                source=json.dumps({"uri": d["source"]}),
                profile=json.dumps(d["profile"]) if d.get("profile") else None,
            ),
            tags=[
                InputTag("mlflow.data.context", d["context"]),
                *(InputTag(k, redact_text(str(v))) for k, v in d.get("tags", {}).items()),
            ],
        )
        for d in datasets
    ]
    if inputs:
        client().log_inputs(run_id, datasets=inputs)


# --- logged models (MLflow 3's Models tab) -------------------------------------------------------------------------

MODEL_DIGEST = "rlhf.model_digest"
"""The tag that names a logged model's bytes: the publishing stage's artifact digest (`ArtifactRef.digest`)."""
NOTE_TAG, VERSIONS_TAG = "mlflow.note.content", "mlflow.modelVersions"
"""A logged model's tags that MLflow's UI reads: its Description, and the registered versions made from it (the page
says "Registered" and lists them)."""
DESCRIPTION_LIMIT = 5000
"""Characters of a model card kept as a description (a registry tag keeps 5,000 in our stores)."""


def find_logged_model(digest: str) -> str | None:
    """The id of a finished logged model of these bytes in this tracking store (any experiment), or None."""
    mlflow = client()
    experiments = [e.experiment_id for e in mlflow.search_experiments(max_results=1000)]
    if not digest or not experiments:
        return None
    for start in range(0, len(experiments), 100):
        for model in mlflow.search_logged_models(
            experiments[start : start + 100], filter_string=f"tags.`{MODEL_DIGEST}` = '{digest}'", max_results=50
        ):
            if str(model.status).endswith("READY"):
                return model.model_id
    return None


def log_model(
    run_id: str,
    experiment: str,
    stage: str,
    folder: Path,
    digest: str,
    params: dict[str, Any],
    tags: dict[str, str],
    model_type: str,
    description: str = "",
) -> tuple[str, bool]:
    """The logged model of the published `folder` (a transformers model folder, as `from_pretrained` reads it), made
    the run's output: (model id, whether it was uploaded now). Bytes already logged in this tracking store (a cached
    re-run, the same policy registered again) are linked, not copied. `description` (the model card) is the page's
    Description."""
    from mlflow.entities import LoggedModelOutput

    mlflow = client()
    model_id, uploaded = find_logged_model(digest), False
    if model_id is None:
        flat = flatten(redact(params))
        model = mlflow.create_logged_model(
            experiment,
            name=stage,
            source_run_id=run_id,
            tags={
                MODEL_DIGEST: digest,
                **{k: redact_text(str(v))[:5000] for k, v in tags.items()},
                **({NOTE_TAG: redact_text(description)[:DESCRIPTION_LIMIT]} if description else {}),
            },
            params=dict(list(flat.items())[:500]),
            model_type=model_type,
        )
        try:
            mlflow.log_model_artifacts(model.model_id, str(folder))
        except BaseException:
            mlflow.finalize_logged_model(model.model_id, "FAILED")
            raise
        mlflow.finalize_logged_model(model.model_id, "READY")
        model_id, uploaded = model.model_id, True
    mlflow.log_outputs(run_id, [LoggedModelOutput(model_id, 0)])
    return model_id, uploaded


def log_model_inputs(run_id: str, model_ids: list[str]) -> None:
    """Logged models the run read (its upstream models): MLflow's model-to-model lineage."""
    from mlflow.entities import LoggedModelInput

    if model_ids:
        client().log_inputs(run_id, models=[LoggedModelInput(model_id) for model_id in model_ids])


def log_model_metrics(
    run_id: str, model_id: str, metrics: dict[str, float], step: int = 0, datasets: list[tuple[str, str]] = ()
) -> None:
    """The run's final metrics, linked to its logged model (the model's page lists them), once per dataset of
    `datasets` ((name, digest) of the run's dataset inputs it trained on): MLflow 3's "Datasets used" of a logged
    model are the datasets its metrics name."""
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    named = list(datasets) or [(None, None)]
    # A logged model keeps one value per metric, step, run and millisecond, whatever the dataset: each dataset's
    # rows are a millisecond apart.
    rows = [
        Metric(k, float(v), now + i, step, model_id=model_id, dataset_name=name, dataset_digest=digest)
        for i, (name, digest) in enumerate(named)
        for k, v in metrics.items()
    ]
    for start in range(0, len(rows), 1000):
        client().log_batch(run_id, metrics=rows[start : start + 1000])


def logged_model(model_id: str):
    return client().get_logged_model(model_id)


def download_logged_model(model_id: str, dst: Path) -> Path:
    """The files of a logged model, downloaded once to `dst` (a temporary folder renamed into place)."""
    return _download(client().get_logged_model(model_id).artifact_location, dst)


def _download(location: str, dst: Path) -> Path:
    """The files at artifact `location` (a logged model's or a version's own location, never a `models:/` URI: MLflow
    3.17 resolves those through the process-wide tracking and registry URIs, not the ones it is given, so a run on
    the default store looked them up in a new `mlflow.db` in the working directory), downloaded once to `dst` through
    a temporary folder of this process, renamed into place. A process that loses the race to another keeps theirs."""
    import shutil

    import mlflow

    if (dst / "config.json").is_file():
        return dst
    tmp = dst.with_name(f"{dst.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # not mlflow.set_tracking_uri: that would outlive the call, process-wide
        got = mlflow.artifacts.download_artifacts(artifact_uri=location, dst_path=str(tmp), tracking_uri=tracking_uri())
        Path(got).rename(dst)  # the location's own folder, inside `tmp`
    except OSError:
        if not (dst / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def log_artifacts(run_id: str, local: Path, artifact_path: str | None = None) -> None:
    if local.is_dir():
        client().log_artifacts(run_id, str(local), artifact_path)
    elif local.is_file():
        client().log_artifact(run_id, str(local), artifact_path)


def find_run(experiment: str, tags: dict[str, str]) -> str | None:
    """The newest run of the experiment with all these tag values, or None."""
    query = " and ".join(f"tags.`{name}` = '{value}'" for name, value in tags.items())
    found = client().search_runs([experiment], query, max_results=1, order_by=["attributes.start_time DESC"])
    return found[0].info.run_id if found else None


def has_artifact(run_id: str, path: str) -> bool:
    return any(a.path == path for a in client().list_artifacts(run_id))


def log_table(run_id: str, rows: list[dict], artifact_file: str) -> None:
    """A table MLflow's UI shows as one (Evaluation / Artifacts tab)."""
    import pandas as pd

    client().log_table(run_id, data=pd.DataFrame(rows), artifact_file=artifact_file)


def log_text(run_id: str, text: str, artifact_file: str) -> None:
    client().log_text(run_id, redact_text(text), artifact_file)


def ui_url() -> str | None:
    """The MLflow UI's address: the tracking server itself, or `RLHF_MLFLOW_UI` (set by `rlhf up`) for a local store."""
    uri = tracking_uri()
    if uri.startswith("http"):
        return URI_CREDENTIALS.sub(r"\1", uri).rstrip("/")  # a link without the credentials: the browser asks
    return os.environ.get(UI_ENV, "").rstrip("/") or None


TRAINING_VIEW = "workflowType=machine_learning"
"""MLflow 3.17's UI opens every experiment in its GenAI view unless the page's URL (or the browser's last choice) says
"Model training": the experiment kind tag alone does not switch it. Our links say it."""


def run_url(run_id: str) -> str | None:
    """The run's page in the MLflow UI (its training view), when the UI has an address."""
    ui = ui_url()
    if ui is None:
        return None
    return f"{ui}/#/experiments/{client().get_run(run_id).info.experiment_id}/runs/{run_id}?{TRAINING_VIEW}"


def experiment_url(experiment: str, ui: str | None = None) -> str | None:
    """The experiment's runs table in the MLflow UI (`ui`, default: `ui_url()`), nested stage runs under their
    parent."""
    ui = (ui or ui_url() or "").rstrip("/")
    return f"{ui}/#/experiments/{experiment}/runs?{TRAINING_VIEW}" if ui else None


ARTIFACTS_ROUTE = "/api/2.0/mlflow-artifacts/artifacts/"
"""Where an MLflow server with artifact serving answers for a file under its artifact root, one path per file, so a
page's relative links (a Data Docs page's styles and the pages it links) resolve on the same server."""


def artifact_url(run_id: str, path: str) -> str | None:
    """An http URL of the run's artifact `path` on the MLflow server, or None where none serves it (a local store
    without `rlhf up`: the file:// link is the way). A run whose artifacts the server keeps (`mlflow-artifacts:/...`),
    or, under `rlhf up`, in the state folder it serves, gets a path of `ARTIFACTS_ROUTE`; any other location the
    server's one-file route, which shows the page but not what it links relatively."""
    from urllib.parse import quote, unquote, urlencode, urlsplit

    ui = ui_url()
    if ui is None:
        return None
    location = urlsplit(client().get_run(run_id).info.artifact_uri)
    relative = None
    if location.scheme == "mlflow-artifacts":
        relative = location.path.strip("/")
    elif location.scheme == "file" and not tracking_uri().startswith("http"):
        with contextlib.suppress(ValueError):
            relative = Path(unquote(location.path)).relative_to(artifacts_root()).as_posix()
    if relative is None:
        return f"{ui}/get-artifact?{urlencode({'path': path, 'run_uuid': run_id})}"
    return f"{ui}{ARTIFACTS_ROUTE}{quote(relative)}/{quote(path)}"


def artifact_page(run_id: str, path: str) -> str | None:
    """The MLflow UI's page of the run's artifact `path` (the artifact tab with the file open: an HTML file is shown in
    the page, where the server's own URL of the file makes the browser save it), or None without a UI."""
    from urllib.parse import quote

    ui = ui_url()
    if ui is None:
        return None
    experiment = client().get_run(run_id).info.experiment_id
    return f"{ui.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}/artifactPath/{quote(path)}"


def run_link(run_id: str) -> str:
    """Where a person finds the run: its UI page, else how to open the local UI."""
    uri = shown_uri()
    return run_url(run_id) or f"run {run_id} in {uri} (open with: mlflow ui --backend-store-uri {uri})"


def artifact_uri(run_id: str, path: str) -> str:
    return f"{client().get_run(run_id).info.artifact_uri}/{path}"
