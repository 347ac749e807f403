"""Our PPO against TRL 1.12's PPOTrainer (the last TRL that had one), then TRL 1.16's GRPO and RLOO, on the embedded \
default.

    python -m bench.ppo                                # 2560 episodes, 3 repetitions each, interleaved; ~8 minutes on 2
                                                       # idle cores (+ a one-time venv)
    python -m bench.ppo --episodes 5120 --repeats 5 --skip-online   # the tiny preset's full budget
    python -m bench.ppo --venv /elsewhere/trl-1.12     # a venv of one's own (made there if missing)

One SFT model and one reward model (the tiny preset's sft and rm stages, trained once per run) are the starting policy
and the only reward of every run: our PPO (`trainers/ppo/train.py`, the tiny preset's ppo settings with `rewards` = the
reward model alone) twice, as configured by default and with `rollout_logprobs` (the rollouts' log-probs from
generation's scores, as TRL took them), and TRL 1.12's `trl.experimental.ppo.PPOTrainer` with the same hyperparameters,
in a virtualenv of its own (TRL 1.12 with the project's transformers; never in the project's dependencies), each in a
fresh process timed wall to wall (interpreter start to exit: imports, model loading and saving included; its CPU seconds
beside), interleaved, each side first once in three repeats, every process with the same torch threads (`--threads`).
Repeat r runs every side with seed 42 + r. Then GRPO and RLOO (tiny preset, the same reward model) on the same budget of
generated tokens, one run each.

The verdict (exit 1 when it fails) compares the same work: ours with generation's log-probs against TRL's, at >= 1.4x
the episodes/s, and no worse reward gain, i.e. the upper bound of the 95% interval of the held-out score (ours - TRL)
at or above 0; and `rollout_logprobs` leaves the gain unchanged: the interval of (with - without) holds 0. Both
intervals resample the held-out prompts, paired, and each side's seeds: runs of one method with other seeds differ by
more than the prompts explain. The default's speed against TRL's is printed beside.

Every final policy, and the SFT model it started from, is scored afterwards in this process in the same way: completions
sampled as in training (temperature, response_length, stopped at EOS) on the held-out `prompts_eval`, scored by the
reward model; "gain / 1k episodes" is 1000 x (that score - the SFT model's) / episodes. Exact match is greedy, on the
same prompts: the reward model can be gamed on this task (tiny.yaml), so it shows whether the reward was earned.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ROOT / "state" / "bench" / "trl-1.12"
# torch first and alone (the local CPU wheel; an unpinned torch pulls CUDA); then TRL 1.12 with the project's own
# transformers stack (pyproject.toml), which TRL 1.12 accepts (transformers>=4.56.2), so only the trainer differs.
TORCH_PIN = "torch==2.13.0"
TARGET = 1.4
"""Episodes/s of ours over TRL 1.12's, at no worse reward gain: a regression check (issue 45; TRL deleted its
PPOTrainer in 1.13, so 1.12 is a frozen baseline). Exit 1 below it."""
GENERATION = "PPO (ours, gen.)"
"""Ours with `rollout_logprobs`: the rollouts' log-probs from generation's scores, as TRL 1.12 took them (the same work
as TRL's side)."""
SIDES = {"ours": "PPO (ours)", "ours-generation": GENERATION, "trl": "PPO (TRL 1.12)"}
TRL_PINS = (
    "trl==1.12.0",
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "accelerate==1.15.0",
    "datasets==5.2.0",
    "pandas==3.1.1",
    "numpy==2.4.6",
)
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TQDM_DISABLE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
    "TRL_EXPERIMENTAL_SILENCE": "1",
}

OURS = """
import json, sys
from pathlib import Path
from rlhf_pipeline.trainers.rewards.mix import RewardsConfig
stage, spec = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
from rlhf_pipeline.tasks.stages import BY_NAME
module = BY_NAME[stage].code  # the module that builds the stage
module.train(
    cfg=getattr(module, spec["config"])(**spec["cfg"]), rewards=RewardsConfig(**spec["rewards"]), \
sft_model=Path(spec["sft"]),
    reward_model=Path(spec["rm"]), data_dir=Path(spec["data"]), out_dir=Path(spec["out"]), work_dir=Path(spec["work"]),
)
"""

# TRL's own example (examples/scripts/ppo/ppo.py) trimmed to our folders: left-padded prompt ids, a separate reference
# copy, reward and value model both loaded from the reward model's folder.
TRL = """
import json, sys
from pathlib import Path
spec = json.loads(Path(sys.argv[1]).read_text())
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from trl.experimental.ppo import PPOConfig, PPOTrainer
args = PPOConfig(output_dir=spec["work"], **spec["args"])
tokenizer = AutoTokenizer.from_pretrained(spec["sft"], padding_side="left")
policy, reference = (AutoModelForCausalLM.from_pretrained(spec["sft"]) for _ in range(2))
reward_model, value_model = (AutoModelForSequenceClassification.from_pretrained(spec["rm"], num_labels=1) \
for _ in range(2))
rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines()]
prompts = {split: Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows if r["split"] == split]}) \
for split in ("prompts", "prompts_eval")}
trainer = PPOTrainer(
    args=args, processing_class=tokenizer, model=policy, ref_model=reference, reward_model=reward_model, \
value_model=value_model,
    train_dataset=prompts["prompts"], eval_dataset=prompts["prompts_eval"],
)
trainer.train()
trainer.save_model(f"{spec['out']}/model")  # where our stages write theirs
tokenizer.save_pretrained(f"{spec['out']}/model")
"""


def venv_trl_version(venv: Path) -> str | None:
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    found = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('trl'))"], capture_output=True, text=True
    )
    return found.stdout.strip() if found.returncode == 0 else None


def ensure_venv(venv: Path) -> float:
    """TRL 1.12's virtualenv at `venv`, made there (into a sibling, renamed when complete) unless one is; seconds it
    took (0: reused)."""
    version = venv_trl_version(venv)
    if version and version.startswith("1.12."):
        return 0.0
    if venv.exists():
        raise SystemExit(
            f"error: {venv} exists but holds {'trl ' + version if version else 'no usable trl'}, not trl 1.12.*: "
            "remove it or pass --venv"
        )
    started = time.perf_counter()
    partial = venv.with_name(venv.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    pip = [str(partial / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    for step in ([sys.executable, "-m", "venv", str(partial)], [*pip, TORCH_PIN], [*pip, *TRL_PINS]):
        print(f"making {venv}: {' '.join(step[len(pip) :] if step[: len(pip)] == pip else step[1:])}", flush=True)
        done = subprocess.run(step, capture_output=True, text=True, env={**os.environ, "PIP_NO_INPUT": "1"})
        if done.returncode:
            shutil.rmtree(partial, ignore_errors=True)
            raise SystemExit(
                f"error: could not make TRL 1.12's virtualenv at {venv}: `{' '.join(step)}` exited {done.returncode}\n"
                f"{(done.stdout + done.stderr)[-3000:]}\nThe bench needs a package index with these releases: "
                f"{TORCH_PIN} {' '.join(TRL_PINS)}"
            )
    # Moved into place only when complete, so a half-made one is never reused; its scripts' shebangs name the old path.
    partial.rename(venv)
    for script in (venv / "bin").iterdir():
        if script.is_file() and not script.is_symlink():
            try:
                text = script.read_text()
            except UnicodeDecodeError:
                continue
            script.write_text(text.replace(str(partial), str(venv)))
    return time.perf_counter() - started


def venv_pins(venv: Path) -> str:
    names = ["torch", *(pin.split("==")[0] for pin in TRL_PINS)]
    listed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "freeze", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
    ).stdout
    return " ".join(line for line in listed.splitlines() if line.split("==")[0].lower() in names)


def timed(command: list[str], log: Path) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of `command`, a fresh process (its output in `log`); a failure ends the
    bench with the log's tail. CPU seconds hardly move when other work shares the machine; wall seconds do."""
    cpu = lambda: (lambda u: u.ru_utime + u.ru_stime)(resource.getrusage(resource.RUSAGE_CHILDREN))  # noqa: E731
    started, cpu_before = time.perf_counter(), cpu()
    with log.open("w") as out:
        # main() set ENV and the threads
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(
            f"error: `{' '.join(command[:3])} ...` exited {done.returncode}; the end of "
            f"{log}:\n{log.read_text()[-4000:]}"
        )
    return seconds, cpu() - cpu_before


def trl_arguments(ppo, rollout_batch: int) -> dict:
    """TRL 1.12 PPOConfig with our settings. Its per_device_train_batch_size is the micro-batch of one optimizer step
    and also sets the rollout batch (x gradient accumulation x processes): the whole rollout batch with no accumulation
    gives one rollout batch of `rollout_batch` and num_mini_batches optimizer steps per epoch, as ours."""
    same = (
        "learning_rate",
        "lr_scheduler_type",
        "total_episodes",
        "num_mini_batches",
        "num_ppo_epochs",
        "gamma",
        "lam",
        "cliprange",
        "cliprange_value",
        "vf_coef",
        "kl_coef",
        "whiten_rewards",
        "kl_estimator",
        "missing_eos_penalty",
        "response_length",
        "stop_token",
        "temperature",
        "seed",
    )
    return {
        **{name: getattr(ppo, name) for name in same},
        "per_device_train_batch_size": rollout_batch,
        "gradient_accumulation_steps": 1,
        "local_rollout_forward_batch_size": rollout_batch,
        "optim": "adamw_torch",
        "adam_epsilon": 1e-5,
        "weight_decay": 0.0,
        "warmup_steps": 0,  # our AdamW: eps 1e-5, no decay, no warm-up
        "num_sample_generations": 0,
        "save_strategy": "no",
        "report_to": "none",
        "bf16": False,
        "gradient_checkpointing": False,
        "logging_steps": ppo.logging_steps,
    }


DIFFERENCES = [
    "gradient clipping: TRL 1.12's PPOTrainer never clips (max_grad_norm is unused); ours clips, so max_grad_norm=1e9 "
    "here (off)",
    "stop: both end completions at EOS only (stop_token='eos'; ours would also stop at the template's <|end|>, TRL "
    "nowhere)",
    "missing_eos_penalty=1.0 on both (our default with a reward model; TRL's default None)",
    "score position: TRL adds the score one token after the EOS (its 'padding_mask_p1' position, also trained by the "
    "value loss), ours on the EOS (or last token of a cut-off completion)",
    "rollout log-probs: TRL and 'ours, generation log-probs' (rollout_logprobs) take them from generate()'s scores; "
    "'ours' (the default) from one more forward pass; TRL divides logits by temperature + 1e-7",
    "advantage whitening: TRL's unbiased variance, ours the population variance (both over the real tokens)",
    "prompt order: both shuffle each pass over the prompts with the repeat's seed (42 + r), with different generators",
    "sample tables off on both (num_sample_generations=0: TRL's would generate on every held-out prompt 10 times)",
    "KL: the same fixed kl_coef on both (the tiny preset's adaptive target_kl off: TRL 1.12 has none); ours without "
    "its held-out probes (eval_steps)",
    "checkpoints: TRL save_strategy='no'; ours one at the end (save_steps past the run); both then save the final "
    "policy",
    "logging: TRL logs every update, ours every logging_steps=10",
]


def held_out_scores(
    model_dir: Path, sft_model: Path, reward_model: Path, prompts: list, answers: list, ppo, samples: int
) -> tuple[list[float], float, float]:
    """(each prompt's mean reward-model score over `samples` completions sampled as in training, the same draws for
    every policy; missing-EOS share; greedy exact match). Every policy is read with the SFT model's tokenizer, the
    reward model's too: TRL's side saves it with left padding."""
    import torch

    from rlhf_pipeline.trainers.models.load import load_causal_lm, load_tokenizer
    from rlhf_pipeline.trainers.models.text import generate, own_sampling, pad, prompt_ids
    from rlhf_pipeline.trainers.ppo.losses import truncate_at_stop
    from rlhf_pipeline.trainers.rewards.mix import RewardsConfig, RewardScorer
    from rlhf_pipeline.trainers.rewards.sort_task import exact_match

    policy, tokenizer = load_causal_lm(model_dir)[0].eval(), load_tokenizer(sft_model)
    scorer = RewardScorer(RewardsConfig(reward_model_weight=1.0, functions=[]), reward_model, policy_model=sft_model)
    rows = [prompt_ids(tokenizer, p) for p in prompts for _ in range(samples)]
    eos, scores, ended_all = tokenizer.eos_token_id, [], []
    torch.manual_seed(0)  # the same draws for every policy
    with own_sampling(policy, tokenizer), torch.no_grad():
        for start in range(0, len(rows), 300):
            queries, attention = pad(rows[start : start + 300], tokenizer.pad_token_id, left=True)
            generated = policy.generate(
                input_ids=queries,
                attention_mask=attention,
                do_sample=True,
                temperature=ppo.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=ppo.response_length,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=[eos],
            )
            responses, mask, ended = truncate_at_stop(generated[:, queries.shape[1] :], [eos], tokenizer.pad_token_id)
            ids = [
                row + r[:n].tolist() for row, r, n in zip(rows[start : start + 300], responses, mask.sum(1).tolist())
            ]
            scores.extend(scorer.model_scores(ids))
            ended_all.extend(ended.tolist())
    greedy = generate(policy, tokenizer, prompts, max_new_tokens=12, batch_size=200)
    matched = exact_match(prompts, greedy, answer=answers)
    per_prompt = [statistics.fmean(scores[i * samples : (i + 1) * samples]) for i in range(len(prompts))]
    return per_prompt, 1 - statistics.fmean(ended_all), statistics.fmean(matched)


def table(runs: list[dict], start_score: float) -> dict[str, dict[str, float]]:
    """Print one row per method (medians, [min, max] over its runs); return each method's median seconds, episodes/s and
    gain."""
    print(
        f"{'method':16} {'runs':>4}  {'seconds [min, max]':>22}  {'CPU s':>6}  {'episodes/s [min, max]':>23}  "
        f"{'held-out score':>14}  {'gain / 1k episodes [min, max]':>31}  {'missing EOS':>11}  {'exact match':>11}"
    )
    summary = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == method]
        seconds, speed = [r["seconds"] for r in mine], [r["episodes"] / r["seconds"] for r in mine]
        gains = [1000 * (r["score"] - start_score) / r["episodes"] for r in mine]
        cpu = statistics.median(r["cpu"] for r in mine)
        summary[method] = {
            "seconds": statistics.median(seconds),
            "cpu": cpu,
            "speed": statistics.median(speed),
            "gain": statistics.median(gains),
        }
        print(
            f"{method:16} {len(mine):4}  {statistics.median(seconds):7.1f}s [{min(seconds):5.1f}, "
            f"{max(seconds):5.1f}]  {cpu:6.1f}"
            f"  {statistics.median(speed):8.1f} [{min(speed):5.1f}, {max(speed):5.1f}]  "
            f"{statistics.median(r['score'] for r in mine):+14.3f}"
            f"  {statistics.median(gains):+13.3f} [{min(gains):+.3f}, {max(gains):+.3f}]"
            f"  {statistics.median(r['missing_eos'] for r in mine):11.2f}  "
            f"{statistics.median(r['exact_match'] for r in mine):11.3f}"
        )
    return summary


def paired_gain(runs: list[dict], method: str, baseline: str):
    """The held-out score of `method` less `baseline`'s, with a 95% interval that resamples the prompts (paired) and
    each method's runs (seeds)."""
    from rlhf_pipeline.trainers.rewards.metrics import bootstrap_runs_difference

    def scores_of(name: str) -> list[list[float]]:
        return [r["per_prompt"] for r in runs if r["method"] == name]

    return bootstrap_runs_difference(scores_of(method), scores_of(baseline), seed=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--episodes",
        type=int,
        default=2560,
        help=(
            "PPO episodes (prompts rolled out) per run; 0: the tiny preset's (5120). 2560 keeps the bench under 10 "
            "minutes"
        ),
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each PPO, interleaved")
    parser.add_argument("--skip-online", action="store_true", help="leave out GRPO and RLOO")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="TRL 1.12's virtualenv, made here if missing")
    parser.add_argument(
        "--samples", type=int, default=2, help="sampled completions per held-out prompt when scoring a policy"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads of every process, both sides alike (OMP_NUM_THREADS); 1: steadiest on a shared CPU",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="keep models and logs here, and reuse its sft and rm models (default: a temporary folder)",
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    # Before torch loads here
    os.environ.update({**ENV, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)})

    made = ensure_venv(args.venv.resolve())
    print(
        f"TRL 1.12 venv {args.venv}: {f'made in {made:.0f}s' if made else 'reused'}; {venv_pins(args.venv)}", flush=True
    )
    started = time.perf_counter()

    from rlhf_pipeline.flows.params import load_params
    from rlhf_pipeline.trainers.algorithms import rm, sft
    from rlhf_pipeline.trainers.data import load_split
    from rlhf_pipeline.trainers.models.load import load_tokenizer
    from rlhf_pipeline.trainers.models.text import prompt_ids
    from tests.helpers import write_data_dir

    params = load_params("tiny")
    episodes = args.episodes or params.ppo.total_episodes
    ppo = params.ppo.model_copy(
        update={
            "total_episodes": episodes,
            "stop_token": "eos",
            "missing_eos_penalty": 1.0,
            "max_grad_norm": 1e9,
            "num_sample_generations": 0,
            "save_steps": 10**9,
            "target_kl": None,  # the preset's adaptive KL (issue 15) off: TRL 1.12 keeps kl_coef fixed
            "eval_steps": None,  # and its held-out probes: TRL's PPOTrainer has no such curves
            "keep_best": False,
        }
    )
    ppo = type(ppo).model_validate(ppo.model_dump())  # validated as a preset would be: episodes fit the rollout batch
    rewards = {"reward_model_weight": 1.0, "functions": []}
    root = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="bench-ppo-"))
    root.mkdir(parents=True, exist_ok=True)
    data = write_data_dir(root / "data", rows=10**9)

    # The starting policy and the reward, once for every run (in this process: they are not measured); a kept one is
    # reused.
    for stage, arguments in (
        ("sft", {"cfg": params.sft, "model": params.model}),
        ("rm", {"cfg": params.rm, "sft_model": root / "sft" / "model"}),
    ):
        if (root / stage / "model").is_dir():
            print(f"{stage} model: reused from {root / stage}", flush=True)
            continue
        begun = time.perf_counter()
        (sft if stage == "sft" else rm).train(
            **arguments, data_dir=data, out_dir=root / stage, work_dir=root / f"{stage}-work"
        )
        print(f"{stage} model: {time.perf_counter() - begun:.0f}s", flush=True)
    sft_model, reward_model = root / "sft" / "model", root / "rm" / "model"
    tokenizer = load_tokenizer(sft_model)
    held_out = load_split(data, "prompts_eval")
    # Our rendering of the prompts (text.prompt_ids), which TRL's side reads as they are
    prompt_file = root / "prompts.jsonl"
    with prompt_file.open("w") as f:
        for split in ("prompts", "prompts_eval"):
            f.writelines(
                json.dumps({"split": split, "input_ids": prompt_ids(tokenizer, p)}) + "\n"
                for p in load_split(data, split)["prompt"]
            )
    (root / "trl_ppo.py").write_text(TRL)

    def spec_file(name: str, spec: dict) -> Path:
        path = root / name / "spec.json"
        shutil.rmtree(path.parent, ignore_errors=True)
        path.parent.mkdir(parents=True)
        path.write_text(
            json.dumps(
                {
                    **spec,
                    "sft": str(sft_model),
                    "rm": str(reward_model),
                    "out": str(path.parent / "out"),
                    "work": str(path.parent / "work"),
                }
            )
        )
        return path

    runs: list[dict] = []

    def record(method: str, name: str, times: tuple[float, float], episodes: int, repeat: int = 0) -> None:
        seconds, cpu = times
        per_prompt, missing_eos, matched = held_out_scores(
            root / name / "out" / "model",
            sft_model,
            reward_model,
            held_out["prompt"],
            held_out["answer"],
            ppo,
            args.samples,
        )
        runs.append(
            {
                "method": method,
                "repeat": repeat,
                "seconds": seconds,
                "cpu": cpu,
                "episodes": episodes,
                "score": statistics.fmean(per_prompt),
                "per_prompt": per_prompt,
                "missing_eos": missing_eos,
                "exact_match": matched,
            }
        )
        print(
            f"{name:14} {seconds:6.1f}s ({cpu:6.1f} CPU s)  {episodes / seconds:6.1f} episodes/s  held-out score "
            f"{statistics.fmean(per_prompt):+.3f}  exact match {matched:.3f}",
            flush=True,
        )
        if args.keep is None:
            shutil.rmtree(root / name, ignore_errors=True)

    for repeat in range(args.repeats):
        seeded = ppo.model_copy(update={"seed": ppo.seed + repeat})
        sides = list(SIDES)
        for side in sides[repeat % 3 :] + sides[: repeat % 3]:  # interleaved, each side first once in three repeats
            name = f"ppo-{side}-{repeat + 1}"
            if side == "trl":
                spec = spec_file(
                    name, {"args": trl_arguments(seeded, seeded.rollout_batch_size), "prompts": str(prompt_file)}
                )
                times = timed(
                    [str(args.venv / "bin" / "python"), str(root / "trl_ppo.py"), str(spec)],
                    spec.parent.parent / f"{name}.log",
                )
            else:
                mode = seeded.model_copy(update={"rollout_logprobs": side == "ours-generation"})
                spec = spec_file(
                    name,
                    {"config": "PpoConfig", "cfg": mode.model_dump(mode="json"), "rewards": rewards, "data": str(data)},
                )
                times = timed([sys.executable, "-c", OURS, "ppo", str(spec)], spec.parent.parent / f"{name}.log")
            record(SIDES[side], name, times, episodes, repeat)

    tokens = episodes * ppo.response_length
    online_note = ""
    if not args.skip_online:
        for stage in ("grpo", "rloo"):
            cfg = getattr(params, stage)
            # Completions per optimizer step (one process)
            per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
            steps = max(1, round(tokens / (per_step * cfg.max_completion_length)))
            online = cfg.model_copy(update={"max_steps": steps, "save_steps": 10**9})
            spec = spec_file(
                stage,
                {
                    "config": f"{stage.capitalize()}Config",
                    "cfg": online.model_dump(mode="json"),
                    "rewards": rewards,
                    "data": str(data),
                },
            )
            times = timed([sys.executable, "-c", OURS, stage, str(spec)], root / f"{stage}.log")
            record(f"{stage.upper()} (TRL 1.16)", stage, times, steps * per_step)
        online_note = (
            f"; GRPO/RLOO: one run each, {steps} steps x {per_step} completions x {cfg.max_completion_length} tokens "
            f"at most = {steps * per_step * cfg.max_completion_length} tokens, as PPO's {episodes} x "
            f"{ppo.response_length}"
        )

    before = held_out_scores(
        sft_model, sft_model, reward_model, held_out["prompt"], held_out["answer"], ppo, args.samples
    )
    start = statistics.fmean(before[0])
    print(
        f"\nheld-out ({len(held_out)} prompts, {args.samples} samples each at temperature {ppo.temperature}, <= "
        f"{ppo.response_length} tokens), scored by the one reward model: SFT start {start:+.3f} (missing EOS "
        f"{before[1]:.2f}), greedy exact match {before[2]:.3f}"
    )
    print(
        f"PPO: {episodes} episodes, rollout batch {ppo.rollout_batch_size}, {ppo.num_mini_batches} mini-batches, "
        f"{ppo.num_ppo_epochs} epochs, {args.repeats} runs per side, interleaved, {args.threads} torch thread(s) per "
        f"process{online_note}"
    )
    summary = table(runs, start)
    ours, generation, theirs = summary["PPO (ours)"], summary[GENERATION], summary["PPO (TRL 1.12)"]
    ratio = generation["speed"] / theirs["speed"]
    against_trl = paired_gain(runs, GENERATION, "PPO (TRL 1.12)")
    option = paired_gain(runs, GENERATION, "PPO (ours)")
    checks = {
        f"below {TARGET}x": ratio >= TARGET,
        "less gain than TRL's": against_trl.high >= 0,
        "rollout_logprobs changed the gain": option.low <= 0 <= option.high,
    }
    print(
        f"\nspeed(ours, generation log-probs) / speed(TRL 1.12) = {ratio:.2f}x, the same work (median episodes/s); "
        f"the default, one forward pass more: {ours['speed'] / theirs['speed']:.2f}x"
    )
    seconds = {(r["method"], r["repeat"]): r["seconds"] for r in runs}
    print(
        "the same ratios repeat by repeat (its runs adjacent in time; the machine's speed drifts over minutes): "
        + "; ".join(
            f"{seconds['PPO (TRL 1.12)', r] / seconds[GENERATION, r]:.2f}x and "
            f"{seconds['PPO (TRL 1.12)', r] / seconds['PPO (ours)', r]:.2f}x"
            for r in range(args.repeats)
        )
    )
    for label, interval in (("ours, gen. - TRL", against_trl), ("ours, gen. - ours", option)):
        print(
            f"held-out score, {label}: {interval.mean:+.3f} [{interval.low:+.3f}, {interval.high:+.3f}] (95% "
            f"interval resampling {interval.n} prompts, paired, and each side's {args.repeats} seeds)"
        )
    print(
        f"CPU seconds, TRL 1.12 / ours, gen. = {theirs['cpu'] / generation['cpu']:.2f}x (medians; the same ratio less "
        "the load of other work on the machine)"
    )
    failed = [name for name, held in checks.items() if not held]
    verdict = f"does not hold ({', '.join(failed)})" if failed else "holds"
    print(
        f"target >= {TARGET}x at no worse reward gain (upper bound >= 0), and rollout_logprobs's gain unchanged "
        f"(its interval holds 0): {verdict}"
    )
    print("differences between our PPO and TRL's (everything else is the same setting):")
    for line in DIFFERENCES:
        print(f"  - {line}")
    print(f"bench: {time.perf_counter() - started:.0f}s (without the venv)")
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
