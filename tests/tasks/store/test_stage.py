"""The stage contract without Prefect: key, atomic publish, manifest cache, MLflow child runs."""

import json

import pytest
from mlflow.tracking import MlflowClient

from rlhf_pipeline.tasks.store.artifacts import MANIFEST, ArtifactRef, RunContext
from rlhf_pipeline.tasks.store.stage import stage_key
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.trainers.algorithms.dpo import DpoConfig
from tests.helpers import recorded_stage


@pytest.fixture
def ctx(tmp_path):
    experiment = tracking.experiment_id("test-stage")
    parent = tracking.start_run(experiment, "parent", {})
    return RunContext(artifact_root=str(tmp_path / "artifacts"), experiment_id=experiment, parent_run_id=parent)


def writing(calls: list, metrics=None, fail=False):
    def build(out_dir, work_dir, log_metrics):
        calls.append(out_dir)
        (out_dir / "model").mkdir()
        (out_dir / "model" / "weights.bin").write_bytes(b"weights")
        log_metrics({"dpo/train/loss": 0.5}, 1)
        if fail:
            raise OSError("disk vanished mid-write")
        return metrics or {"dpo/train/loss": 0.5}

    return build


def test_key_changes_with_config_upstream_and_data_but_not_with_order():
    up = {"sft": ArtifactRef(stage="sft", key="a", uri="/x"), "data": ArtifactRef(stage="data", key="b", uri="/y")}
    key = stage_key("dpo", DpoConfig(), up, {"p": "1"})
    assert key == stage_key("dpo", DpoConfig(), dict(reversed(list(up.items()))), {"p": "1"})
    assert key != stage_key("dpo", DpoConfig(beta=0.2), up, {"p": "1"})
    assert key != stage_key("dpo", DpoConfig(), {**up, "sft": ArtifactRef(stage="sft", key="c", uri="/x")}, {"p": "1"})
    assert key != stage_key("dpo", DpoConfig(), up, {"p": "2"})
    assert key != stage_key("rm", DpoConfig(), up, {"p": "1"})
    # same upstream key, different bytes (a re-produced, non-deterministic upstream)
    rebuilt = {**up, "sft": ArtifactRef(stage="sft", key="a", uri="/x", digest="other")}
    assert key != stage_key("dpo", DpoConfig(), rebuilt, {"p": "1"})


def test_publish_then_reuse_by_manifest(ctx):
    calls: list = []
    first = recorded_stage("dpo", DpoConfig(), {}, ctx, writing(calls))
    assert not first.cached and len(calls) == 1
    manifest = json.loads((first.ref.path / MANIFEST).read_text())
    assert manifest["key"] == first.ref.key and manifest["config"]["beta"] == 0.1
    assert manifest["versions"]["trl"] and manifest["metrics"]["dpo/train/loss"] == 0.5
    second = recorded_stage("dpo", DpoConfig(), {}, ctx, writing(calls))
    assert second.cached and second.ref == first.ref and len(calls) == 1

    client = MlflowClient()
    runs = client.search_runs([ctx.experiment_id], f"tags.`mlflow.parentRunId` = '{ctx.parent_run_id}'")
    by_cached = {r.data.tags["rlhf.cached"]: r for r in runs}
    assert by_cached["true"].data.tags["rlhf.produced_by"] == by_cached["false"].info.run_id
    assert by_cached["false"].data.params["beta"] == "0.1"
    # per-step value from training (step 1) and the final value, at the last step (not at 0, the start of the curve)
    history = client.get_metric_history(by_cached["false"].info.run_id, "dpo/train/loss")
    assert sorted(m.step for m in history) == [1, 1]


def test_deleted_artifact_runs_again_and_force_ignores_the_cache(ctx):
    calls: list = []
    first = recorded_stage("dpo", DpoConfig(), {}, ctx, writing(calls))
    (first.ref.path / MANIFEST).unlink()  # a directory without a manifest is never "done"
    again = recorded_stage("dpo", DpoConfig(), {}, ctx, writing(calls))
    assert not again.cached and len(calls) == 2 and (again.ref.path / MANIFEST).is_file()
    forced = recorded_stage("dpo", DpoConfig(), {}, ctx.model_copy(update={"force": True}), writing(calls))
    assert not forced.cached and len(calls) == 3


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda path: (path / MANIFEST).write_text('{"stage": "dpo", "ke'), "manifest.json is unreadable"),
        (lambda path: (path / "model" / "weights.bin").write_bytes(b"wei"), "weights.bin has 3 bytes, the manifest"),
        (lambda path: (path / "model" / "weights.bin").write_bytes(b"WEIGHTS"), "weights.bin's bytes differ"),
        (lambda path: (path / "model" / "weights.bin").unlink(), "weights.bin is missing"),
    ],
    ids=["truncated manifest", "truncated weights", "flipped bytes", "missing weights"],
)
def test_a_damaged_artifact_is_moved_aside_and_rebuilt_never_reused(ctx, damage, why):
    calls: list = []
    lines: list[str] = []
    first = recorded_stage("dpo", DpoConfig(), {}, ctx, writing(calls))
    listed = json.loads((first.ref.path / MANIFEST).read_text())["files"]
    assert listed["model/weights.bin"]["size"] == 7 and len(listed["model/weights.bin"]["sha256"]) == 64
    damage(first.ref.path)
    again = recorded_stage("dpo", DpoConfig(), {}, ctx, writing(calls), log=lines.append)
    assert not again.cached and len(calls) == 2, "a damaged artifact was reused"
    assert again.ref.path == first.ref.path and (again.ref.path / "model" / "weights.bin").read_bytes() == b"weights"
    assert any(why in line and "built again" in line for line in lines), lines
    [aside] = first.ref.path.parent.glob(f".damaged-{first.ref.key}-*")  # kept for a look, out of the cache's way
    assert recorded_stage("dpo", DpoConfig(), {}, ctx, writing(calls)).cached  # the rebuilt one is reused


def test_published_bytes_are_synced_before_the_rename_that_publishes_them(ctx, monkeypatch):
    import os

    events: list[tuple[str, str]] = []
    fsync, rename = os.fsync, os.rename
    monkeypatch.setattr(
        os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), fsync(fd))[1]
    )
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(b))), rename(a, b))[1])
    published = recorded_stage("dpo", DpoConfig(), {}, ctx, writing([]))
    renamed = events.index(("rename", str(published.ref.path)))
    synced = {path for kind, path in events[:renamed] if kind == "fsync"}
    assert {name for name in ("weights.bin", MANIFEST) if any(path.endswith(name) for path in synced)} == {
        "weights.bin",
        MANIFEST,
    }
    assert ("fsync", str(published.ref.path.parent)) in events[renamed:]  # the rename itself, durable


def test_a_failing_stage_publishes_nothing_and_marks_its_run_failed(ctx):
    calls: list = []
    with pytest.raises(OSError, match="disk vanished"):
        recorded_stage("dpo", DpoConfig(beta=0.3), {}, ctx, writing(calls, fail=True))
    stage_root = calls[0].parent
    assert [p.name for p in stage_root.iterdir() if p.name not in (".work", ".locks", ".leases")] == []
    failed = MlflowClient().search_runs([ctx.experiment_id], "attributes.status = 'FAILED'")
    assert any("disk vanished" in r.data.tags.get("rlhf.error", "") for r in failed)


def test_two_runs_with_the_same_inputs_at_once_build_once_and_share_the_result(ctx):
    import threading
    import time

    calls: list = []

    def slow(out_dir, work_dir, log_metrics):
        time.sleep(1.0)  # the second run arrives while the first is still building
        return writing(calls)(out_dir, work_dir, log_metrics)

    outcomes: list = []
    runs = [
        threading.Thread(target=lambda: outcomes.append(recorded_stage("dpo", DpoConfig(), {}, ctx, slow)))
        for _ in range(2)
    ]
    for run in runs:
        run.start()
        time.sleep(0.2)
    for run in runs:
        run.join()
    assert len(calls) == 1  # built once
    assert sorted(o.cached for o in outcomes) == [False, True]  # the second reused the first one's result
    assert outcomes[0].ref == outcomes[1].ref
    assert (outcomes[0].ref.path / "model" / "weights.bin").read_bytes() == b"weights"
    stage_root = outcomes[0].ref.path.parent
    assert [p.name for p in stage_root.iterdir() if p.name.startswith(".tmp")] == []


def test_models_with_different_tokenizers_are_refused_at_the_edge_before_the_stage_builds(ctx, tmp_path):
    from rlhf_pipeline.flows.evaluate import EvalParams
    from rlhf_pipeline.trainers.config import ModelConfig
    from rlhf_pipeline.trainers.models.base_model import load_base_model
    from rlhf_pipeline.trainers.models.load import save_model
    from tests.foreign_models import gpt2_folder
    from tests.helpers import SMALL_MODEL

    save_model(*load_base_model(SMALL_MODEL), tmp_path / "sft" / "model")
    save_model(*load_base_model(SMALL_MODEL.model_copy(update={"seed": 1})), tmp_path / "rm" / "model")
    gpt2 = gpt2_folder(tmp_path / "gpt2")
    save_model(*load_base_model(ModelConfig(name_or_path=str(gpt2))), tmp_path / "policy" / "model")
    # A stage that loads its upstream's tokenizer and saves it again keeps the digest (a re-save adds loading options).
    from rlhf_pipeline.trainers.models.load import load_causal_lm, tokenizer_digest

    save_model(*load_causal_lm(tmp_path / "sft" / "model"), tmp_path / "resaved")
    assert tokenizer_digest(tmp_path / "resaved") == tokenizer_digest(tmp_path / "sft" / "model") != ""
    refs = {name: ArtifactRef(stage=name, key=name, uri=str(tmp_path / name)) for name in ("sft", "rm", "policy")}
    calls = []
    # Same tokenizer, other weights: fine.
    recorded_stage("eval", {"a": 1}, {"sft": refs["sft"], "rm": refs["rm"]}, ctx, writing(calls))
    with pytest.raises(ValueError, match=r"eval: its input models do not share a tokenizer.*policy \(.*policy/model\)"):
        recorded_stage("eval", {"a": 2}, refs, ctx, writing(calls))
    assert len(calls) == 1  # refused before building
    # `rlhf eval` with local folders fails in its parameters.
    with pytest.raises(ValueError, match="must share a tokenizer"):
        EvalParams(policy=str(tmp_path / "policy"), sft_model=str(tmp_path / "sft"))


def test_the_manifest_and_the_mlflow_run_record_the_builds_peak_memory_and_wall_time_with_its_child_processes(ctx):
    """A build that holds 200 MiB itself and starts a child process holding 300 MiB: the peak counts both, above the
    process's memory before the build; a build that allocates nothing records about none, beside a child that was there
    before."""
    import subprocess
    import sys
    import time

    def holding(out_dir, work_dir, log_metrics):
        held = bytearray(200 * 2**20)
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.5)",
            ]
        )
        held[::4096] = b"x" * len(held[::4096])  # touched, so resident
        child.wait()
        time.sleep(0.3)
        return {"dpo/train/loss": 0.5}

    def idle(out_dir, work_dir, log_metrics):
        time.sleep(0.5)
        return {"dpo/train/loss": 0.5}

    # A process that was running before the builds (a temporary Prefect server, another test's server) is not theirs.
    holder = (
        "import time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); print(flush=True); time.sleep(60)"
    )
    server = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE)
    try:
        server.stdout.readline()  # it holds its memory now
        busy = recorded_stage("dpo", DpoConfig(), {}, ctx, holding)
        quiet = recorded_stage("dpo", DpoConfig(beta=0.2), {}, ctx, idle)
    finally:
        server.kill()
        server.wait()
    resources = {name: outcome.ref.manifest()["resources"] for name, outcome in (("busy", busy), ("quiet", quiet))}
    grown = resources["busy"]["peak_rss_mb"] - resources["busy"]["rss_before_mb"]
    assert 450 < grown < 700, resources  # 200 + 300 MiB, and the child's interpreter
    assert resources["quiet"]["peak_rss_mb"] - resources["quiet"]["rss_before_mb"] < 50, resources
    assert resources["busy"]["seconds"] >= 1.5 and resources["quiet"]["seconds"] >= 0.5
    metrics = MlflowClient().get_run(busy.mlflow_run_id).data.metrics
    assert (
        metrics["dpo/memory/peak_rss_mb"] == resources["busy"]["peak_rss_mb"]
        and metrics["dpo/time/seconds"] == resources["busy"]["seconds"]
    )


def test_experiments_are_marked_as_model_training_for_the_mlflow_ui():
    mlflow = MlflowClient()
    made = tracking.experiment_id("test-kind-new")
    assert mlflow.get_experiment(made).tags[tracking.KIND_TAG] == "custom_model_development"
    # One made before the tag (or whose kind the UI guessed) is marked; a kind someone chose is left alone.
    old = mlflow.create_experiment("test-kind-old")
    guessed = mlflow.create_experiment("test-kind-guessed", tags={tracking.KIND_TAG: "genai_development_inferred"})
    chosen = mlflow.create_experiment("test-kind-chosen", tags={tracking.KIND_TAG: "genai_development"})
    for name, experiment, kind in (
        ("test-kind-old", old, "custom_model_development"),
        ("test-kind-guessed", guessed, "custom_model_development"),
        ("test-kind-chosen", chosen, "genai_development"),
    ):
        assert tracking.experiment_id(name) == experiment
        assert mlflow.get_experiment(experiment).tags[tracking.KIND_TAG] == kind, name


def test_a_build_runs_with_the_heap_before_it_frozen_and_its_own_cyclic_garbage_is_freed_at_its_end(ctx):
    """The objects alive before a build are out of the collector's full passes while it runs (`gc.freeze`); a model the
    build made and dropped in a reference cycle is freed when it ends, and nothing stays frozen after it."""
    import gc
    import weakref

    seen: dict = {}

    class Model:  # a trainer and its model point at each other, as transformers' do
        pass

    def build(out_dir, work_dir, log_metrics):
        seen["frozen"] = gc.get_freeze_count()
        model, trainer = Model(), Model()
        model.trainer, trainer.model = trainer, model
        seen["model"] = weakref.ref(model)
        (out_dir / "model").mkdir()
        (out_dir / "model" / "weights.bin").write_bytes(b"weights")
        return {"dpo/train/loss": 0.5}

    gc.disable()  # no automatic pass may free the cycle: only the build's own end
    try:
        recorded_stage("dpo", DpoConfig(beta=0.4), {}, ctx, build)
        assert seen["frozen"] > 10_000  # this process's modules, pytest's, MLflow's
        assert seen["model"]() is None
        assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


class Told:
    """A recorder that keeps what the store tells it, and nothing else: the store with no tracking server."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.rows: list = []

    def cached(self, entry, producer, curves, metrics, log):
        self.calls.append(("cached", producer))
        return "reused"

    def started(self, entry, log):
        self.calls.append(("started", entry.key))
        return "built"

    def sink(self, run_id):
        return self.rows.extend

    def watching(self, run_id):
        raise AssertionError("not a device stage")

    def describe(self, entry, folder, metrics):
        (folder / "card.md").write_text(entry.stage)

    def published(self, entry, run_id, queue, finals):
        queue.close(5)
        self.calls.append(("published", f"{finals.metrics['dpo/train/loss']} at step {finals.step}"))

    def failed(self, entry, run_id, exc, queue, folder, log):
        queue.close(5)
        self.calls.append(("failed", type(exc).__name__))


def test_the_store_builds_reuses_and_fails_with_a_recorder_of_its_own_and_imports_neither_mlflow_nor_prefect(tmp_path):
    from rlhf_pipeline.tasks.store.stage import run_stage

    ctx = RunContext(artifact_root=str(tmp_path / "artifacts"), experiment_id="", parent_run_id="")
    told, calls = Told(), []
    built = run_stage("dpo", DpoConfig(), {}, ctx, writing(calls), record=told, holder={"flow_run": "f-1"})
    key = built.ref.key
    assert told.calls == [("started", key), ("published", "0.5 at step 1")]
    assert told.rows and told.rows[0][1:] == ({"dpo/train/loss": 0.5}, 1)  # the curve went to the recorder's sink
    assert (built.ref.path / "card.md").read_text() == "dpo"  # described before the listing: in the manifest's files
    assert "card.md" in json.dumps(built.ref.manifest())
    assert built.mlflow_run_id == "built" and built.ref.manifest()["mlflow_run_id"] == "built"

    again = run_stage("dpo", DpoConfig(), {}, ctx, writing(calls), record=told)
    assert again.cached and again.mlflow_run_id == "reused" and told.calls[-1] == ("cached", "built")
    with pytest.raises(OSError):
        run_stage("dpo", DpoConfig(beta=0.3), {}, ctx, writing(calls, fail=True), record=told)
    assert told.calls[-2:] == [("started", told.calls[-2][1]), ("failed", "OSError")]
    assert len(calls) == 2  # built twice (the reuse built nothing)

    import subprocess
    import sys

    imported = "import sys, rlhf_pipeline.tasks.store.stage; print(sorted({'mlflow', 'prefect'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", imported], capture_output=True, text=True).stdout.strip() == "[]"
