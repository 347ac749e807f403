"""What the Ray job's driver checks before it asks the cluster for workers (trainers/runtime/ray_job.py), on nodes as
`ray.nodes()` gives them: no Ray started."""

from __future__ import annotations

import pytest

from rlhf_pipeline.trainers.runtime.ray_job import too_small


def node(cpus: float, gpus: float = 0, alive: bool = True) -> dict:
    return {"Alive": alive, "Resources": {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}}


def test_workers_fit_by_what_each_node_holds_and_strict_spread_counts_only_nodes_that_hold_one():
    kuberay = [node(0), node(16, 8), node(16, 8)]  # a head with no CPU for workers, two GPU pods
    assert too_small(kuberay, 16, {"CPU": 2, "GPU": 1}, "PACK") is None
    assert too_small(kuberay, 2, {"CPU": 1, "GPU": 1}, "STRICT_SPREAD") is None
    assert too_small(kuberay, 3, {"CPU": 1, "GPU": 1}, "STRICT_SPREAD") == (
        "placement_strategy STRICT_SPREAD puts each of 3 workers on a node of its own; it has 2 that can hold one"
    )
    assert too_small(kuberay, 17, {"CPU": 1, "GPU": 1}, "SPREAD") == (
        "launch.num_workers=17 x launch.resources_per_worker={CPU: 1, GPU: 1}, and its 3 node(s) hold 16 such "
        "worker(s) (32 CPU, 16 GPU in all)"
    )
    assert too_small([*kuberay, node(64, 8, alive=False)], 17, {"GPU": 1}, "PACK") is not None  # a dead node counts not
    assert too_small([node(1)], 2, {"CPU": 0.5}, "PACK") is None  # fractions of a CPU


def test_a_driver_that_a_ray_client_head_refuses_joins_again_and_any_other_refusal_fails_at_once(monkeypatch, capsys):
    import ray

    from rlhf_pipeline.trainers.runtime.ray_job import join

    refusal = ConnectionAbortedError(
        "Initialization failure from server:\nRuntimeError: Starting Ray client server failed. See "
        "ray_client_server_23000.err for detailed logs."
    )
    answers: list[Exception | None] = [refusal, None]
    calls: list[str] = []

    def init(address: str, **_: object) -> None:
        calls.append(address)
        answer = answers.pop(0)
        if answer is not None:
            raise answer

    monkeypatch.setattr(ray, "init", init)
    join("ray://10.0.0.1:10001", "kto", pause=0)
    assert calls == ["ray://10.0.0.1:10001"] * 2
    assert "kto: the Ray cluster at ray://10.0.0.1:10001 refused this driver (RuntimeError: Starting Ray client " in (
        capsys.readouterr().out
    )

    answers[:] = [refusal] * 3
    with pytest.raises(ConnectionAbortedError):  # three refusals: the stage fails, and its task retries
        join("ray://10.0.0.1:10001", "kto", pause=0)
    assert len(calls) == 5
    answers[:] = [refusal]
    with pytest.raises(ConnectionAbortedError):  # a cluster's own address (no Ray Client): no second try
        join("10.0.0.1:6379", "kto", pause=0)
    assert len(calls) == 6
