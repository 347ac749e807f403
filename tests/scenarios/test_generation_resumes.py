"""Generation that a kill interrupts resumes where it stopped: eval's greedy answers and the pairs stage's samples are
kept answer by answer, and a process SIGKILLed mid-way, run again, writes the same bytes as one that was never
stopped (and generates only the answers it had not; the samples with another batch size)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import write_data_dir

pytestmark = pytest.mark.slow  # three driver processes per generator, each loading torch

ROOT = Path(__file__).resolve().parents[2]
DRIVER = """
import json, sys, time
from pathlib import Path
import rlhf_pipeline.trainers.models.text as text

what, model_dir, data_dir, out, counted = sys.argv[1:6]  # and the pairs' batch size

def generated_a_batch(*_):  # a slow device, so that the kill lands mid-way; counts the batches generated
    with open(counted, "a") as f:
        f.write("batch\\n")
    time.sleep(0.4)

if what == "answers":
    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.evaluation.answers import greedy_answers
    from rlhf_pipeline.trainers.models.load import load_causal_lm

    model, tokenizer = load_causal_lm(Path(model_dir))
    prompts = load_split(Path(data_dir), "prompts_eval")["prompt"][:48]
    answers, cut = greedy_answers(model, tokenizer, prompts, 12, 4, progress=generated_a_batch)
    Path(out).write_text(json.dumps([answers, cut]))
else:
    from rlhf_pipeline.trainers.pairs.stage import PairsConfig, sample

    real = text.generate_answers
    def generate_answers(*args, progress=None, **kwargs):
        def told(done, total):
            generated_a_batch()
            progress(done, total)
        return real(*args, progress=told, **kwargs)
    text.generate_answers = generate_answers
    cfg = PairsConfig(samples_per_prompt=3, max_prompts=16, max_new_tokens=6, batch_size=int(sys.argv[6]))
    sample(cfg, Path(model_dir), Path(data_dir), Path(out), work_dir=Path(out).parent / "work")
"""


def drive(
    what: str, model: Path, data: Path, out: Path, cache: Path, counted: Path, batch: int = 4
) -> subprocess.Popen:
    script = out.parent / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "RLHF_MODEL_CACHE": str(cache)}
    args = [sys.executable, str(script), what, str(model), str(data), str(out), str(counted), str(batch)]
    return subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_after(process: subprocess.Popen, kept: Path, lines: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (kept.is_file() and len(kept.read_text().splitlines()) >= lines):
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, f"{kept} had no {lines} lines within {timeout}s"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()


def finish(process: subprocess.Popen) -> None:
    assert process.wait(300) == 0, process.stdout.read()


@pytest.mark.parametrize("what", ["answers", "samples"])
def test_a_generation_killed_mid_way_resumes_and_writes_what_an_unbroken_one_writes(what, tmp_path, untrained_sft):
    data = write_data_dir(tmp_path / "data", rows=64)
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    for side in (unbroken, broken):
        side.mkdir()
    out = {side: side / ("answers.json" if what == "answers" else "out") for side in (unbroken, broken)}
    finish(drive(what, untrained_sft, data, out[unbroken], unbroken / "cache", unbroken / "batches"))

    first = drive(what, untrained_sft, data, out[broken], broken / "cache", broken / "batches")
    kept = (
        next(iter((broken / "cache" / "answers").glob("*.partial.jsonl")), broken / "none")
        if what == "answers"
        else broken / "work" / "samples.partial.jsonl"
    )
    if what == "answers":  # its name is the answers' key: wait for it to appear
        deadline = time.monotonic() + 120
        while not list((broken / "cache" / "answers").glob("*.partial.jsonl")):
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read() if first.poll() else ""
            time.sleep(0.05)
        [kept] = (broken / "cache" / "answers").glob("*.partial.jsonl")
    kill_after(first, kept, lines=12)  # twelve answers kept
    before_kill = len((broken / "batches").read_text().splitlines())
    # the pairs' samples resume with another batch size: each answer's draws are its own
    finish(drive(what, untrained_sft, data, out[broken], broken / "cache", broken / "batches", batch=2))

    total_batches = len((unbroken / "batches").read_text().splitlines())
    generated = len((broken / "batches").read_text().splitlines())
    assert before_kill >= 12 and generated < total_batches + before_kill  # the kept answers were not generated again
    if what == "answers":
        assert json.loads(out[broken].read_text()) == json.loads(out[unbroken].read_text())
        [cached_unbroken] = (unbroken / "cache" / "answers").glob("*[0-9a-f].jsonl")
        [cached_broken] = (broken / "cache" / "answers").glob("*[0-9a-f].jsonl")
        assert cached_broken.read_bytes() == cached_unbroken.read_bytes()
        assert not list((broken / "cache" / "answers").glob("*.partial.jsonl"))
    else:
        assert (out[broken] / "samples.jsonl").read_bytes() == (out[unbroken] / "samples.jsonl").read_bytes()
        assert not (out[broken] / "samples.partial.jsonl").exists()
