"""The wheel: one import package with its presets and bundled task inside, runnable from any folder."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    [built] = out.glob("rlhf_pipeline-*.whl")
    return built


def test_the_wheel_claims_one_import_name_and_ships_presets_and_the_bundled_task(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    info = [n for n in names if ".dist-info/" in n]
    assert {n.split("/")[0] for n in names if n not in info} == {"rlhf_pipeline"}
    assert zipfile.ZipFile(wheel).read(next(n for n in info if n.endswith("top_level.txt"))).decode().split() == [
        "rlhf_pipeline"
    ]
    assert "rlhf_pipeline/configs/tiny.yaml" in names
    bundled = sorted(Path(n).name for n in names if n.startswith("rlhf_pipeline/data/sort/"))
    assert bundled == ["preference.jsonl", "preference_eval.jsonl", "prompts.jsonl", "prompts_eval.jsonl", "sft.jsonl"]
    assert {
        "rlhf_pipeline/deployments/prefect.yaml",
        "rlhf_pipeline/flows/rlhf.py",
        "rlhf_pipeline/tasks/stages.py",
    } <= set(names)
    assert not any(n.startswith(("tests/", "rlhf_pipeline/tests")) for n in names)


@pytest.mark.e2e
def test_the_installed_wheel_runs_the_pipeline_from_an_unrelated_folder(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RLHF_STATE_DIR"}
    env |= {
        "PYTHONPATH": str(site),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import rlhf_pipeline.flows.params as p, rlhf_pipeline.trainers.data as d; print(p.CONFIG_DIR); "
            "print(d.BUNDLED_ROOT)",
        ],
        env=env,
        cwd=elsewhere,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.split() == [str(site / "rlhf_pipeline" / "configs"), str(site / "rlhf_pipeline")]
    preset = tmp_path / "fast.yaml"  # the tests' preset, outside any checkout
    preset.write_text((ROOT / "tests" / "ci.yaml").read_text())
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_pipeline", "run", "--config", str(preset), "--set", "registry.enabled=false"],
        env=env,
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "exact match: policy" in done.stdout  # the closing table's held-out figures
    assert {p.name for p in (elsewhere / "state" / "artifacts").iterdir()} >= {"data", "sft", "rm", "dpo", "eval"}
