"""deployments/kubernetes/raycluster.yaml, the KubeRay example shipped with the package: a Ray cluster whose pods run
the project's image on the shared state volume, token-authenticated, with GPU workers for `launch.launcher: ray`."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

from rlhf_pipeline.tasks.tracking.client import STATE_ENV


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load((resources.files("rlhf_pipeline.deployments") / "kubernetes" / "raycluster.yaml").read_text())


def pods(cluster: dict) -> dict[str, dict]:
    """Each group's pod spec: `head` and each worker group by name."""
    spec = cluster["spec"]
    return {
        "head": spec["headGroupSpec"]["template"]["spec"],
        **{group["groupName"]: group["template"]["spec"] for group in spec["workerGroupSpecs"]},
    }


def test_a_kuberay_raycluster_of_a_head_and_gpu_workers(cluster):
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    workers = cluster["spec"]["workerGroupSpecs"]
    assert len(workers) == 1 and workers[0]["replicas"] >= 1
    [container] = workers[0]["template"]["spec"]["containers"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1


def test_every_pod_runs_the_same_image_mounts_state_from_the_same_claim_and_holds_the_same_token(cluster):
    images, claims, secrets = set(), set(), set()
    for group, pod in pods(cluster).items():
        [container] = pod["containers"]
        images.add(container["image"])
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        [state] = [mount for mount in container["volumeMounts"] if mount["mountPath"] == "/state"]
        claims.add(volumes[state["name"]]["persistentVolumeClaim"]["claimName"])
        env = {item["name"]: item for item in container["env"]}
        assert env[STATE_ENV]["value"] == "/state", group
        assert env["RAY_AUTH_MODE"]["value"] == "token", group
        assert set(env["RAY_AUTH_TOKEN"]) == {"name", "valueFrom"}, group  # from a Secret, never inline
        secret = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        secrets.add((secret["name"], secret["key"]))
    assert len(pods(cluster)) == 2
    assert len(images) == 1 and images.pop().startswith("rlhf-pipeline:")  # the image of deployments/Dockerfile
    assert len(claims) == 1 and len(secrets) == 1  # one token: a node with another is refused by the head


def test_the_comments_say_how_a_flow_run_points_at_it(cluster):
    text = (resources.files("rlhf_pipeline.deployments") / "kubernetes" / "raycluster.yaml").read_text()
    head_service = f"{cluster['metadata']['name']}-head-svc"  # KubeRay's name for the head's service
    assert f"RAY_ADDRESS={head_service}:6379" in text and f"RAY_ADDRESS=ray://{head_service}:10001" in text
    assert "launch.launcher=ray" in text
