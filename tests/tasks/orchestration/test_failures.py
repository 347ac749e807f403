"""Failures told apart: what no retry can fix fails at once with what to do; a network error on the way to the hub
is retried; a wait on another run's build is bounded and names the holder."""

from __future__ import annotations

import errno
import json
import os
import socket
import threading

import pytest

from rlhf_pipeline.tasks.config import DEFAULT_TIMEOUT, RetryConfig
from rlhf_pipeline.tasks.orchestration.stage_task import is_permanent
from rlhf_pipeline.tasks.store.artifacts import RunContext
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.trainers.runtime.failures import permanent_reason
from tests.helpers import recorded_stage


def hub_answer(status: int):
    import httpx

    return httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/org/x"))


def raised_from(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as cause:
            raise outer from cause
    except BaseException as caught:
        return caught


def test_out_of_memory_corrupt_weights_refusals_permission_and_a_full_disk_are_permanent(tmp_path):
    import huggingface_hub.errors as hub
    import torch
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(weights))
    weights.write_bytes(weights.read_bytes()[:100])  # truncated, as a copy that died half-way leaves it
    with pytest.raises(Exception) as truncated:
        load_file(str(weights))

    class Response:
        status_code = 401
        headers: dict = {}

    refused = OSError("401 Client Error")
    refused.response = Response()  # as requests' HTTPError carries it
    permanent = {
        "out of device memory": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        "corrupt or truncated": truncated.value,
        "no such repository": hub.RepositoryNotFoundError(
            "404 Client Error: Repository Not Found", response=hub_answer(404)
        ),
        "gated or private": hub.GatedRepoError("403 Client Error: Cannot access gated repo", response=hub_answer(403)),
        "credentials refused (HTTP 401)": refused,
        "no permission": PermissionError(errno.EACCES, "Permission denied", "/models/x"),
        "the disk is full": OSError(errno.ENOSPC, "No space left on device"),
        "HF_HUB_OFFLINE=1": hub.OfflineModeIsEnabled("Cannot reach the Hub: offline mode is enabled"),
        "switched off here": ConnectionError("Couldn't reach 'org/x' on the Hub (OfflineModeIsEnabled)"),
    }
    for words, exc in permanent.items():
        wrapped = raised_from(RuntimeError("sft failed"), exc)  # found through the chain, as a launcher re-raises
        assert words in (permanent_reason(wrapped) or ""), (words, permanent_reason(wrapped))
        assert is_permanent(wrapped), words
    for transient in (ConnectionError("connection reset"), TimeoutError("read timed out"), OSError(errno.EIO, "I/O")):
        assert permanent_reason(transient) is None and not is_permanent(transient)


def test_a_network_error_loading_a_hub_dataset_is_retried_a_missing_one_is_not(monkeypatch):
    import datasets
    import requests
    from datasets.exceptions import DatasetNotFoundError
    from huggingface_hub.errors import OfflineModeIsEnabled

    from rlhf_pipeline.trainers.data import DatasetSpec, load_source

    def failing(error):
        def load(*args, **kwargs):
            raise error

        return load

    spec = DatasetSpec(path="org/prefs")
    monkeypatch.setattr(datasets, "load_dataset", failing(requests.ConnectionError("Max retries exceeded")))
    with pytest.raises(ConnectionError, match="org/prefs: could not be read") as dropped:
        load_source(spec)
    assert not is_permanent(dropped.value)
    monkeypatch.setattr(datasets, "load_dataset", failing(DatasetNotFoundError("Dataset 'org/prefs' doesn't exist")))
    with pytest.raises(ValueError, match="doesn't exist") as missing:
        load_source(spec)
    assert is_permanent(missing.value)
    offline = OfflineModeIsEnabled("Couldn't reach 'org/prefs' on the Hub (OfflineModeIsEnabled)")
    monkeypatch.setattr(datasets, "load_dataset", failing(offline))  # a ConnectionError, but switched off here
    with pytest.raises(ValueError, match="OfflineModeIsEnabled") as switched_off:
        load_source(spec)
    assert is_permanent(switched_off.value)


def test_a_stage_has_a_time_limit_by_default():
    assert RetryConfig().timeout_seconds == DEFAULT_TIMEOUT == 86400
    assert RetryConfig().task_options()["timeout_seconds"] == 86400


def test_a_wait_on_another_runs_build_is_bounded_and_names_the_holder(tmp_path):
    experiment = tracking.experiment_id("test-failures")
    ctx = RunContext(
        artifact_root=str(tmp_path / "artifacts"),
        experiment_id=experiment,
        parent_run_id=tracking.start_run(experiment, "parent", {}),
        wait_seconds=1,
    )
    building, release = threading.Event(), threading.Event()

    def slow(out_dir, work_dir, log_metrics):
        building.set()
        release.wait(60)
        (out_dir / "done").write_text("yes")
        return {}

    first = threading.Thread(target=recorded_stage, args=("sft", {"a": 1}, {}, ctx, slow))
    first.start()
    try:
        assert building.wait(60)
        with pytest.raises(TimeoutError) as waited:
            recorded_stage("sft", {"a": 1}, {}, ctx, slow)
        message = str(waited.value)
        assert f"held by pid {os.getpid()} on {socket.gethostname()}" in message and "waited 1s" in message
        assert "retry.timeout_seconds" in message and not is_permanent(waited.value)
    finally:
        release.set()
        first.join()
    [holder] = (tmp_path / "artifacts" / "sft" / ".locks").glob("*.holder.json")
    assert json.loads(holder.read_text())["pid"] == os.getpid()
