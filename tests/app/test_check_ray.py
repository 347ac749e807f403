"""`rlhf check` with training stages under `launch.launcher: ray`: the cluster they would use, its nodes, the workers
requested and the memory of each, against a real Ray cluster of two nodes on this host (tests/ray_cluster.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import psutil
import pytest

from rlhf_pipeline.check import LOCAL_CLUSTER, LOCAL_NODE
from rlhf_pipeline.tasks.store.resources import free_port
from tests import ray_cluster
from tests.app.test_check import check, memory, table

pytestmark = pytest.mark.slow  # a Ray cluster of two nodes and a check of the tiny preset per test: ~80 s in all

RAY = ("launch.launcher=ray",)


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster.two_nodes() as env, pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():  # `rlhf check` (this process) joins it as the stage's driver would
            patch.setenv(name, value)
        yield env


def raylets() -> set[int]:
    """The raylet processes (one per Ray node) this test process started, the cluster's included: not those of a
    cluster another test worker runs meanwhile."""
    found = set()
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if process.name() == "raylet":
                found.add(process.pid)
    return found


def test_the_cluster_at_ray_address_is_reported_with_its_two_nodes_and_the_memory_of_each_worker(capsys, cluster):
    import ray

    address = cluster["RAY_ADDRESS"]
    code, out = check(capsys, *RAY, "launch.num_workers=2", "launch.placement_strategy=STRICT_SPREAD", config="tiny")
    assert code == 0, out
    assert f"Ray: sft, rm, dpo run as Ray Train jobs on {address}" in out  # the training stages, not data or eval
    assert f"Ray cluster at {address}: 2 node(s), 2 CPUs, 0 GPUs" in out
    nodes = table(out, "Ray node")
    assert sorted(row["address"] for row in nodes) == [ray_cluster.HEAD, ray_cluster.SECOND]
    assert [(row["CPUs"], row["GPUs"]) for row in nodes] == [("1", "0"), ("1", "0")]
    assert "launch.num_workers=2 x launch.resources_per_worker={CPU: 1}, placement_strategy STRICT_SPREAD" in out
    workers = {row["Ray stage"]: row for row in table(out, "Ray stage")}
    stages = memory(out)
    assert list(workers) == ["sft", "rm", "dpo"]
    for stage, row in workers.items():  # each worker is a DDP rank that holds the whole stage
        assert (row["per worker"], row["workers"]) == (stages[stage]["total"], "2"), stage
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith(f"ready: parameters, tokenizer, 5 datasets, the Ray cluster at {address} and the memory")
    assert not ray.is_initialized()  # the check's connection ended with it


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (
            ("launch.num_workers=3", "launch.placement_strategy=STRICT_SPREAD"),
            "placement_strategy STRICT_SPREAD puts each of 3 workers on a node of its own; it has 2 that can hold one",
        ),
        (
            ("launch.resources_per_worker={GPU: 1}",),
            "launch.num_workers=1 x launch.resources_per_worker={GPU: 1}, and its 2 node(s) hold 0 such worker(s) "
            "(0 GPU in all)",
        ),
    ],
    ids=["strict-spread-over-the-nodes", "gpu-workers-on-a-cpu-cluster"],
)
def test_a_cluster_that_cannot_hold_the_workers_fails_naming_the_reason(capsys, cluster, overrides, reason):
    code, out = check(capsys, *RAY, *overrides, config="tiny")
    assert code == 1, out
    assert f"  cannot hold the workers: {reason}" in out
    verdict = out.strip().splitlines()[-1]
    assert verdict == (
        "not ready: 1 problem the run would fail on: the Ray cluster at "
        f"{cluster['RAY_ADDRESS']} cannot hold the workers: {reason}"
    )


def test_without_an_address_it_describes_this_machine_as_the_local_cluster_and_starts_no_ray(
    capsys, cluster, monkeypatch
):
    import ray
    import torch

    monkeypatch.delenv("RAY_ADDRESS")
    joined, init = [], ray.init
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: joined.append(kwargs) or init(*args, **kwargs))
    before = raylets()
    assert len(before) == 2  # control: the two-node cluster's raylets are found
    code, out = check(capsys, *RAY, "launch.num_workers=2", "launch.placement_strategy=STRICT_SPREAD", config="tiny")
    assert raylets() == before  # no local cluster left running
    assert joined == []  # nor started and stopped: the check joined no cluster at all
    assert f"Ray: sft, rm, dpo run as Ray Train jobs on {LOCAL_CLUSTER}" in out
    assert f"Ray cluster at {LOCAL_NODE}: 1 node(s), {os.cpu_count()} CPUs, {torch.cuda.device_count()} GPUs" in out
    assert [row["address"] for row in table(out, "Ray node")] == ["127.0.0.1"]
    # The machine as one node, in ray.nodes()' shape: trainers.runtime.ray_job.too_small judges it as it judges a
    # cluster.
    assert code == 1
    verdict = out.strip().splitlines()[-1]
    assert verdict.endswith(
        f"the Ray cluster at {LOCAL_NODE} cannot hold the workers: placement_strategy STRICT_SPREAD puts each of 2 "
        "workers on a node of its own; it has 1 that can hold one"
    )


def test_an_address_nothing_answers_at_fails_naming_it(capsys):
    address = f"127.0.0.9:{free_port()}"
    code, out = check(capsys, *RAY, f"launch.ray_address={address}", config="tiny")
    assert code == 1
    assert f"Ray cluster at {address}: cannot be reached: {address} does not answer" in out
    assert out.strip().splitlines()[-1].endswith(f"the Ray cluster at {address} cannot be reached")
    assert table(out, "Ray stage")  # the memory of each worker is still shown


def test_on_a_machine_that_is_no_node_of_the_cluster_a_gcs_address_fails_at_once_saying_why(
    capsys, cluster, monkeypatch
):
    import ray._private.services

    # Ray 2.60 finds a driver's node by the raylets running on its host; the check looks the same way first.
    monkeypatch.setattr(ray._private.services, "find_node_ids", lambda: set())
    code, out = check(capsys, *RAY, config="tiny")
    assert code == 1
    assert f"Ray cluster at {cluster['RAY_ADDRESS']}: cannot be reached: no Ray node runs on this machine" in out
    assert "ray://<head>:10001" in out


def test_a_check_without_ray_stages_does_not_import_ray(cluster):
    probe = (
        "import sys; from rlhf_pipeline.cli import main\n"
        "for launcher in ('inprocess', 'ray'):\n"
        "    code = main(['check', '--set', f'launch.launcher={launcher}'])\n"
        "    print(f'after launcher={launcher}: ray imported', 'ray' in sys.modules, flush=True)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=os.environ, timeout=300)
    said = [line for line in done.stdout.splitlines() if line.startswith("after launcher=")]
    assert said == [
        "after launcher=inprocess: ray imported False",
        "after launcher=ray: ray imported True",  # control: the probe sees the import where the check joins the cluster
    ], done.stdout[-2000:] + done.stderr[-2000:]
